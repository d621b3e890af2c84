#!/usr/bin/env bash
# Two drafter checkpoints through Triton, side by side (results/serving_checkpoints_cpu/): the main
# job's benchmark (deploy/bench.py: ar and lilicorr taking turns twice per concurrency, greedy, 8
# prompts x 64 tokens, stage profile, one fresh server per run) with the serving defaults (bf16
# target on AMX, int8 drafter, auto draft length, prompt lookup 3), on humaneval and on general chat
# prompts at concurrency 1, 2, 4 and 8, once per engine; the runs alternate engines.
#   BEFORE, AFTER: engine directories (python convert/build_engine.py --ckpt ... --backend onnxruntime)
#   OUT (default results/serving_checkpoints_cpu), CONCURRENCY (default 1,2,4,8)
: "${BEFORE:?set BEFORE to the earlier checkpoint's engine}" "${AFTER:?set AFTER to the later checkpoint's engine}"
out=${OUT:-results/serving_checkpoints_cpu}
. "$(dirname "$0")/triton_bench_common.sh"
run() {  # name, suite, engine directory
  engine=$3 bench "$1" "$2" --concurrency "${CONCURRENCY:-1,2,4,8}" --rules ar,lilicorr
}
chat=lilicorr/data/chat_first_turn.jsonl
run humaneval-before humaneval "$BEFORE"
run humaneval-after humaneval "$AFTER"
run chat-after "$chat" "$AFTER"          # the other order on chat: neither engine always runs first
run chat-before "$chat" "$BEFORE"
python scripts/results_tables.py bench "$out"/{humaneval-before,humaneval-after,chat-before,chat-after}.json
