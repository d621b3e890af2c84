#!/usr/bin/env bash
# Grows the training data with prompts in the forms users send (results/cpu_smollm2_v10 found the
# evaluation prompts' forms, not memorisation, cost most of the drafter's held-out tau), resumably:
#   forms  PROMPTS code_complete + math_reason prompts (lilicorr.data.prompt_sources) answered by the
#          target in 2 processes (regen-forms-0/1.jsonl)
#   chat   CHAT_PROMPTS Magpie user turns started with an opening phrase (train/magpie.py --openers
#          builtin, seed 1: ids apart from the committed seed-0 prompts), answered in 2 processes
#          (regen-chat-openers-0/1.jsonl)
#   WORK=work/r27 PROMPTS=4200 CHAT_PROMPTS=2400 bash scripts/grow_data_forms.sh [forms|chat|all|keep]
# PROMPTS and CHAT_PROMPTS are totals: what DONE (default data/smollm2; empty: nothing) already holds
# (regen-forms, magpie-openers, regen-chat-openers .jsonl.gz) is not made again, and the two processes
# split only the new prompts. Rerun the same command after an interruption. `keep` then appends
# WORK's new lines to DONE's files (each written whole, then moved into place).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
W=${WORK:-work/forms}; T=.cache/smollm2-135m-instruct-float32; DTYPE=${DTYPE:-bfloat16}
PROMPTS=${PROMPTS:-2100}; CHAT_PROMPTS=${CHAT_PROMPTS:-1200}; MAX_NEW=${MAX_NEW:-192}
phase=${1:-all}; DONE=${DONE-data/smollm2}
mkdir -p "$W"
done_flags() {  # file name in DONE: --exclude it where it exists
  [[ -n $DONE && -f $DONE/$1 ]] && echo --exclude "$DONE/$1" || true
}
python train/prepare_target.py --out "$T" > /dev/null
regen2() {  # name, regen flags...: two processes, one shard each
  local name=$1 pids=() i rc=0
  for i in 0 1; do
    python train/regen.py --target "$T" --out "$W/$name-$i.jsonl" "${@:2}" --max-new-tokens "$MAX_NEW" \
      --batch-size 32 --seed 0 --shard "$i/2" --dtype "$DTYPE" --no-progress >> "$W/$name-$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=$?; done
  return $rc
}
if [[ $phase == forms || $phase == all ]]; then
  regen2 regen-forms --num-prompts "$PROMPTS" --mix code_complete=0.43,math_reason=0.57 \
    $(done_flags regen-forms.jsonl.gz)
fi
if [[ $phase == chat || $phase == all ]]; then
  if [[ -n $DONE && -f $DONE/magpie-openers.jsonl.gz && ! -s $W/magpie-openers.jsonl ]]; then
    zcat "$DONE/magpie-openers.jsonl.gz" > "$W/magpie-openers.jsonl"   # Magpie resumes: only the new turns
  fi
  python train/magpie.py --target "$T" --out "$W/magpie-openers.jsonl" --num "$CHAT_PROMPTS" --seed 1 \
    --openers builtin --dtype "$DTYPE" >> "$W/magpie-openers.log" 2>&1
  regen2 regen-chat-openers --prompts "$W/magpie-openers.jsonl" --num-prompts "$CHAT_PROMPTS" \
    $(done_flags regen-chat-openers.jsonl.gz)
fi
if [[ $phase == keep ]]; then
  : "${DONE:?keep needs DONE, the folder to append to}"
  python scripts/append_jsonl_gz.py "$DONE/regen-forms.jsonl.gz" "$W"/regen-forms-{0,1}.jsonl
  python scripts/append_jsonl_gz.py "$DONE/magpie-openers.jsonl.gz" "$W/magpie-openers.jsonl"
  python scripts/append_jsonl_gz.py "$DONE/regen-chat-openers.jsonl.gz" "$W"/regen-chat-openers-{0,1}.jsonl
fi
