#!/usr/bin/env bash
# int8 against float32 drafter weights (convert/build_engine.py --draft-weights) on this CPU: both
# engines from the same checkpoint, `ar` and whole-block `lilicorr` at batch 1, the engines taking
# turns (int8, fp32, int8, fp32), then the table and plot of results/draft_weights_amx.
#   bash scripts/draft_weights_cpu.sh [OUT_DIR]     (default results/draft_weights_amx)
# It also writes tau-suites-<weights>.json (tau over the three suites at 12 rows) and, by
# scripts/verify_after_draft.py, verify_after_draft.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
out=${1:-results/draft_weights_amx}
ckpt=${LILICORR_CKPT:-checkpoints/smollm2-lilicorr}
target=.cache/smollm2-135m-instruct-float32
mkdir -p "$out"
for w in int8 float32; do
  [[ -f engines/draft-weights-$w/manifest.json ]] || \
    python convert/build_engine.py --ckpt "$ckpt" --target "$target" --out "engines/draft-weights-$w" --draft-weights "$w"
done
for pass in 1 2; do
  for w in int8 float32; do
    python -m lilicorr.eval --target "$target" --engine "engines/draft-weights-$w" \
      --prompts humaneval,lilicorr/data/chat_first_turn.jsonl --limit 6 --max-tokens 64 --batch-size 1 \
      --threads 1 --rules ar,lilicorr --profile --json "$out/$w-pass$pass.json" --no-progress --no-plots
  done
done
for w in float32 int8; do
  python -m lilicorr.eval --target "$target" --engine "engines/draft-weights-$w" \
    --prompts humaneval,math500,gsm-symbolic --limit 12 --max-tokens 96 --batch-size 12 --threads 1 \
    --rules ar,argmax,lilicorr --json "$out/tau-suites-$w.json" --no-progress --no-plots
done
python scripts/verify_after_draft.py --out "$out/verify_after_draft.md"
python scripts/draft_weights_table.py "$out"
