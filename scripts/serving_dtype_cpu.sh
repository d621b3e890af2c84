#!/usr/bin/env bash
# The served target's precision through Triton, side by side (results/serving_dtype_cpu/): the main
# job's benchmark (deploy/bench.py: the rules taking turns twice per concurrency, greedy, stage
# profile) on the engine that scripts/demo.sh builds, with its serving defaults (auto draft length,
# prompt lookup 3), once with the target in bfloat16 (batch-invariant kernels) and once in
# fp16-weights, on humaneval and on general chat prompts, at concurrency 1, 2, 4 and 8. One fresh
# server per run; the runs alternate precisions.
#   ENGINE (default engines/smollm2-lilicorr-onnxruntime), OUT (default results/serving_dtype_cpu),
#   RULES (default ar,lilicorr), CONCURRENCY (default 1,2,4,8), DTYPES (default "bfloat16 fp16-weights":
#   DTYPES=bfloat16 runs the serving default on an AMX CPU alone)
out=${OUT:-results/serving_dtype_cpu}
. "$(dirname "$0")/triton_bench_common.sh"
run() {  # name, suite, dtype
  bench "$1" "$2" --concurrency "${CONCURRENCY:-1,2,4,8}" --rules "${RULES:-ar,lilicorr}" --dtype "$3"
}
chat=lilicorr/data/chat_first_turn.jsonl
dtypes=(${DTYPES:-bfloat16 fp16-weights})
runs=()
for d in "${dtypes[@]}"; do run "humaneval-$d" humaneval "$d"; runs+=("$out/humaneval-$d.json"); done
for ((i = ${#dtypes[@]} - 1; i >= 0; i--)); do    # the other order on chat: neither dtype always runs first
  d=${dtypes[i]}; run "chat-$d" "$chat" "$d"; runs+=("$out/chat-$d.json")
done
python scripts/results_tables.py bench "${runs[@]}"
