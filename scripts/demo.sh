#!/usr/bin/env bash
# The README's main job on the CPU default: prepare the SmolLM2 target, build the engine from the
# committed LiLiCorr checkpoint (ONNX Runtime backend with the LatticeMatch / GreedyWalk nodes),
# start a real Triton server on free loopback ports, send gRPC requests for the `ar`, `argmax` and
# `lilicorr` rules side by side, and print tau, throughput and the Table 3 stage decomposition.
#
# The rules take turns twice per concurrency (A B C, then C B A), so that a shared machine's slow and
# fast minutes fall on all of them.
# Environment overrides: LILICORR_CKPT, LILICORR_SUITE, LILICORR_LIMIT, LILICORR_MAX_TOKENS,
# LILICORR_CONCURRENCY, LILICORR_REPEATS.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export PYTHONUNBUFFERED=1

target=.cache/smollm2-135m-instruct-float32
ckpt=${LILICORR_CKPT:-checkpoints/smollm2-lilicorr}
engine=engines/$(basename "$ckpt")-onnxruntime
out=out/demo

python train/prepare_target.py --out "$target"
python convert/build_engine.py --ckpt "$ckpt" --target "$target" --out "$engine" --backend onnxruntime
mkdir -p "$out"
python deploy/bench.py --engine "$engine" \
  --prompts "${LILICORR_SUITE:-humaneval}" --limit "${LILICORR_LIMIT:-8}" \
  --concurrency "${LILICORR_CONCURRENCY:-1,4}" --rules ar,argmax,lilicorr \
  --max-tokens "${LILICORR_MAX_TOKENS:-64}" --repeats "${LILICORR_REPEATS:-2}" --profile --json "$out/bench.json"
echo "results: $out/bench.json (table, plot: $out/bench.png)"
