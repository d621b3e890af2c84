#!/usr/bin/env bash
# The drafter's ONNX Runtime thread pool against the target's verify, at batch 1 and 1 torch thread:
# ONNX Runtime's defaults (a pool thread per core that spin-waits after each run) against the engine's
# default (torch's thread count, no spinning), per target precision. Writes OUT.md (stage tables).
#   bash scripts/ort_threads_cpu.sh   (TARGET, ENGINE, DTYPES, LIMIT, OUT from the environment)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
T=${TARGET:-.cache/smollm2-135m-instruct-float32}
E=${ENGINE:-engines/smollm2-lilicorr-onnxruntime}
OUT=${OUT:-results/ort_threads_cpu}
DTYPES=${DTYPES:-bfloat16 fp16-weights}
LIMIT=${LIMIT:-4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
{
  echo "# The drafter's ONNX Runtime threads and the target's verify"
  echo
  echo "Made by \`bash scripts/ort_threads_cpu.sh\` ($(nproc) cores, torch $(python -c 'import torch; print(torch.__version__)'))."
  echo "Each table: \`python -m lilicorr.eval --engine $E --prompts humaneval --limit $LIMIT --max-tokens 64"
  echo "--batch-size 1 --threads 1 --rules ar,lilicorr --profile\`; the two settings run one after the other."
  for dt in $DTYPES; do
    for setting in spin quiet; do
      if [[ $setting == spin ]]; then
        env=(LILICORR_ORT_THREADS="$(nproc)" LILICORR_ORT_SPIN=1)
        title="ONNX Runtime's defaults: $(nproc) intra-op threads, spinning"
      else
        env=()
        title="the engine's default: torch's thread count (1), no spinning"
      fi
      env "${env[@]}" OMP_NUM_THREADS=1 python -m lilicorr.eval --target "$T" --engine "$E" --prompts humaneval \
        --limit "$LIMIT" --max-tokens 64 --batch-size 1 --threads 1 --dtype "$dt" --rules ar,lilicorr --profile \
        --json "$tmp/$dt-$setting.json" --no-progress --no-plots > "$tmp/$dt-$setting.log" 2>&1
      echo
      echo "## $dt target; drafter sessions: $title"
      echo
      sed -n '/^| suite/,/^$/p' "$tmp/$dt-$setting.log"
      sed -n '/^| Stage/,/^| tokens/p' "$tmp/$dt-$setting.log"
    done
  done
} > "$OUT.md.tmp"
mv "$OUT.md.tmp" "$OUT.md"
echo "wrote $OUT.md"
