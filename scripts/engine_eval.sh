#!/usr/bin/env bash
# The engine's greedy evaluation of one checkpoint, as the drafter results measure it: 40 prompts x
# 128 tokens of humaneval, math500 and gsm-symbolic, then the 12 general-chat prompts that appear in
# no training file; 16 concurrent rows, 1 thread, target fp16-weights, prompt lookup off.
#   bash scripts/engine_eval.sh CKPT OUT RULES     # writes OUT.json (suites) and OUT-chat.json
# An eval JSON that exists is kept (eval.py writes each atomically): rerunning resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
ckpt=$1 out=$2 rules=$3
T=.cache/smollm2-135m-instruct-float32
run() {  # prompts, suffix
  [[ -f $out$2.json ]] || python -m lilicorr.eval --target "$T" --limit 40 --max-tokens 128 --batch-size 16 \
    --threads 1 --no-progress --no-plots --ckpt "$ckpt" --dtype fp16-weights --prompts "$1" --rules "$rules" \
    --json "$out$2.json" > "$out$2.log" 2>&1
}
run humaneval,math500,gsm-symbolic ""
run lilicorr/data/chat_first_turn.jsonl -chat
