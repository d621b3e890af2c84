#!/usr/bin/env bash
# The packed verify (results/packed_verify_epyc/): what a verify of mixed lengths costs padded against
# packed at 8 and 4 rows (scripts/packed_verify_cost.py), then the main job's benchmark through Triton
# (ar and lilicorr taking turns twice per concurrency, one fresh server per run) on humaneval and on
# general chat prompts at concurrency 1-8, in ROUNDS rounds (default 1).
#   ENGINE (default engines/smollm2-lilicorr-onnxruntime), OUT (default results/packed_verify_epyc)
out=${OUT:-results/packed_verify_epyc}
. "$(dirname "$0")/triton_bench_common.sh"
for rows in 8 4; do
  python scripts/packed_verify_cost.py --target .cache/smollm2-135m-instruct-float32 \
    --out "$out/verify-cost-rows$rows" --rows "$rows" --dtype bf16-gemm
done
runs=()
for ((r = 1; r <= ${ROUNDS:-1}; r++)); do
  bench "humaneval-r$r" humaneval --concurrency 1,2,4,8 --rules ar,lilicorr
  bench "chat-r$r" lilicorr/data/chat_first_turn.jsonl --concurrency 1,2,4,8 --rules ar,lilicorr
  runs+=("$out/humaneval-r$r.json" "$out/chat-r$r.json")
done
python scripts/results_tables.py bench "${runs[@]}"
