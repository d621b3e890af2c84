#!/usr/bin/env bash
# Grows the regenerated training data (data/smollm2) in one background process at a time, resumably:
# more Magpie chat prompts, the target's answers to them, then more code/math/docstring prompts.
#   WORK=work/r18 CHAT_PROMPTS=5000 PROMPTS=3600 bash scripts/grow_data.sh
# Starts from the committed files (SEED_DATA), so a rerun or a new WORK goes on from where they stop;
# copy WORK's magpie-prompts.jsonl and regen-*.jsonl back into data/smollm2 (gzipped) to keep them.
set -euo pipefail
cd "$(dirname "$0")/.."
export WORK=${WORK:-work/grow} DTYPE=${DTYPE:-bfloat16}
CHAT_PROMPTS=${CHAT_PROMPTS:-5000} bash scripts/cpu_experiment.sh magpie
SHARDS=0 bash scripts/cpu_experiment.sh regen                       # chat answers only
SHARDS=1 PROMPTS=${PROMPTS:-3600} bash scripts/cpu_experiment.sh regen   # code/math (chat is done)
