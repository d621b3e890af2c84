#!/usr/bin/env bash
# Prompt lookup through Triton, on and off side by side (results/prompt_lookup_cpu/): the main job's
# benchmark (deploy/bench.py: ar, argmax and lilicorr taking turns twice per concurrency, greedy,
# stage profile) once per setting and suite, one fresh server each, on the engine that
# scripts/demo.sh builds. Humaneval at concurrency 1 and 4 (the main job), general chat at 1.
#   ENGINE (default engines/smollm2-lilicorr-onnxruntime), OUT (default results/prompt_lookup_cpu)
out=${OUT:-results/prompt_lookup_cpu}
. "$(dirname "$0")/triton_bench_common.sh"
run() {  # name, suite, concurrency, prompt lookup
  bench "$1" "$2" --concurrency "$3" --rules ar,argmax,lilicorr --prompt-lookup "$4"
}
run humaneval-lookup humaneval 1,4 3
run humaneval-no-lookup humaneval 1,4 off
run chat-lookup lilicorr/data/chat_first_turn.jsonl 1 3
run chat-no-lookup lilicorr/data/chat_first_turn.jsonl 1 off
python scripts/results_tables.py bench "$out"/{humaneval-lookup,humaneval-no-lookup,chat-lookup,chat-no-lookup}.json
