#!/usr/bin/env bash
# The served engine through Triton at every load, side by side with plain decoding
# (results/serving_plain_steps_cpu/): the main job's benchmark (deploy/bench.py: ar and lilicorr
# taking turns twice per concurrency, greedy, 8 prompts x 64 tokens, stage profile, one fresh
# server per run) with the engine's serving defaults (auto target precision, int8 drafter, auto
# draft length, prompt lookup 3) on humaneval and on general chat prompts at concurrency 1, 2, 4
# and 8; then chat at concurrency 8 under sustained load (24 requests over the 12 chat prompts, so
# rows finish and join while others run) without the stage profile.
#   ENGINE (default engines/smollm2-lilicorr-onnxruntime), OUT (default results/serving_plain_steps_cpu),
#   CONCURRENCY (default 1,2,4,8)
out=${OUT:-results/serving_plain_steps_cpu}
. "$(dirname "$0")/triton_bench_common.sh"
chat=lilicorr/data/chat_first_turn.jsonl
bench humaneval humaneval --concurrency "${CONCURRENCY:-1,2,4,8}" --rules ar,lilicorr
bench chat "$chat" --concurrency "${CONCURRENCY:-1,2,4,8}" --rules ar,lilicorr
python deploy/bench.py --engine "$engine" --prompts "$chat" --limit 12 --requests 24 --max-tokens 64 --repeats 2 \
  --concurrency 8 --rules ar,lilicorr --json "$out/chat-c8-sustained.json" > "$out/chat-c8-sustained.log" 2>&1
python scripts/results_tables.py bench "$out"/{humaneval,chat,chat-c8-sustained}.json
