#!/usr/bin/env bash
# Issue 8: the paper's headline comparison at CPU scale on SmolLM2-135M-Instruct.
#   bash scripts/cpu_experiment.sh [regen|features|train|eval|eval-t1|all]
# Every phase is resumable: rerun the script (or a phase) after an interruption. Sizes come from
# the environment; the defaults are what results/cpu_smollm2 reports.
#   regen     SHARDS processes (one per core) each regenerate a contiguous block of the PROMPTS
#             training prompts into regen-<i>.jsonl; REGEN_MINUTES caps the phase (0: no cap),
#             a capped run resumes where it stopped.
#   features  the target's features over all regen-*.jsonl, SHARDS worker processes; rebuilt
#             when the data changed.
#   train     ARMS side by side, equal data, steps, batch and anchors.
#   eval      greedy, EVAL_LIMIT prompts x EVAL_TOKENS tokens per suite, EVAL_BATCH concurrent rows.
#   eval-t1   temperature 1 over SEEDS: argmax on the vanilla drafter, lilicorr on the joint one.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1     # one thread per process: 2 shared cores
W=${WORK:-work/cpu_smollm2}
T=.cache/smollm2-135m-instruct-float32
PROMPTS=${PROMPTS:-1200}; MAX_NEW=${MAX_NEW:-160}; SHARDS=${SHARDS:-2}; REGEN_MINUTES=${REGEN_MINUTES:-0}
STEPS=${STEPS:-210}; ANCHORS=${ANCHORS:-24}; BATCH=${BATCH:-8}
ARMS=${ARMS:-vanilla lilicorr nodist margin}
EVAL_LIMIT=${EVAL_LIMIT:-40}; EVAL_TOKENS=${EVAL_TOKENS:-128}; EVAL_BATCH=${EVAL_BATCH:-16}
SEEDS=${SEEDS:-0,1,2}
phase=${1:-all}
mkdir -p "$W"
want() { [[ $phase == "$1" || $phase == all ]]; }
timed() {  # name, command...: run it and append "name<TAB>seconds<TAB>date" to phase-times.tsv
  local t0=$SECONDS; "${@:2}"; printf '%s\t%s\t%s\n' "$1" $((SECONDS - t0)) "$(date -u +%FT%TZ)" >> "$W/phase-times.tsv"
}
data() { ls "$W"/regen-*.jsonl; }
wait_all() {  # pids: wait for every one; fail with the last failure (a bare `wait` would hide it)
  local rc=0 p
  for p in "$@"; do wait "$p" || rc=$?; done
  return $rc
}

regen() {
  python train/prepare_target.py --out "$T"
  local cap=() pids=()
  [[ $REGEN_MINUTES != 0 ]] && cap=(timeout -s TERM "${REGEN_MINUTES}m")
  for ((i = 0; i < SHARDS; i++)); do
    "${cap[@]}" python train/regen.py --target "$T" --out "$W/regen-$i.jsonl" --num-prompts "$PROMPTS" \
      --max-new-tokens "$MAX_NEW" --batch-size 48 --seed 0 --shard "$i/$SHARDS" --allow-mismatch \
      >> "$W/regen-$i.log" 2>&1 &
    pids+=($!)
  done
  local p rc
  for p in "${pids[@]}"; do     # 124/130: stopped at the time cap, resumable
    wait "$p" || { rc=$?; [[ $rc == 130 || $rc == 124 ]] || exit $rc; echo "regen stopped at the time cap (resumable)"; }
  done
}

features() {
  python - "$T" "$W" "$SHARDS" $(data) <<'PY'
import sys
from pathlib import Path
from tqdm import tqdm
from lilicorr.config import preset
from lilicorr.features import FeatureStore, build_feature_store
from lilicorr.target import load_target
from lilicorr.training import load_sequences
target_dir, work, workers, files = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
t = load_target(target_dir)
cfg = preset("cpu"); cfg.drafter = cfg.drafter.for_target(t.config)
seqs = load_sequences(files, cfg.train.seq_len)
try:
    FeatureStore(work / "features", t.config, cfg.drafter.target_layer_ids, seqs)
    print(f"features up to date ({len(seqs)} sequences)")
except (FileNotFoundError, ValueError) as e:
    print(f"building features for {len(seqs)} sequences ({e})")
    with tqdm(total=len(seqs), desc="target features", unit="seq", mininterval=30) as bar:
        build_feature_store(t, seqs, cfg.drafter.target_layer_ids, work / "features", workers=workers,
                            progress=bar.update)
PY
}

train() {
  declare -A flags=([vanilla]=--vanilla [lilicorr]= [nodist]=--no-distractor [margin]=--margin)
  local pids=()
  for arm in $ARMS; do
    python train/train.py --preset cpu --target "$T" --data $(data) --features "$W/features" \
      --steps "$STEPS" --num-anchors "$ANCHORS" --global-batch "$BATCH" --save-every 25 \
      --save-dtype bfloat16 --out "$W/ckpt-$arm" ${flags[$arm]} > "$W/train-$arm.log" 2>&1 &
    pids+=($!)
  done
  wait_all "${pids[@]}" || { echo "a training arm failed: see $W/train-*.log"; exit 1; }
}

common=(--target "$T" --prompts humaneval,math500,gsm-symbolic --limit "$EVAL_LIMIT"
        --max-tokens "$EVAL_TOKENS" --batch-size "$EVAL_BATCH" --threads 1)
evaluate() {  # model, rules, extra flags; skipped when its JSON exists (delete it to rerun)
  local out="$W/eval-$1${4:-}.json"
  [[ -f $out ]] && { echo "have $out"; return; }
  [[ -d $W/ckpt-$1 ]] || { echo "no $W/ckpt-$1: train that arm first"; return; }
  python -m lilicorr.eval "${common[@]}" --ckpt "$W/ckpt-$1" --rules "$2" ${3:-} --json "$out" \
    > "$W/eval-$1${4:-}.log" 2>&1
}
eval_greedy() {
  evaluate lilicorr ar,argmax,lilicorr,viterbi & local a=$!
  { evaluate vanilla ar,argmax && evaluate nodist ar,lilicorr && evaluate margin ar,lilicorr; } & local b=$!
  wait_all $a $b || { echo "an eval run failed: see $W/eval-*.log"; exit 1; }
}
eval_t1() {
  evaluate vanilla argmax "--temperature 1 --seed $SEEDS" -t1 & local a=$!   # ar's rate: the greedy runs
  evaluate lilicorr lilicorr "--temperature 1 --seed $SEEDS" -t1 & local b=$!
  wait_all $a $b || { echo "an eval run failed: see $W/eval-*-t1.log"; exit 1; }
}

if want regen; then timed regen regen; fi
if want features || want train; then timed features features; fi
if want train; then timed train train; fi
if want eval; then timed eval eval_greedy; fi
if want eval-t1; then timed eval-t1 eval_t1; fi
