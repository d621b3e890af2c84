#!/usr/bin/env bash
# LiLiCorr vs vanilla DFlash on SmolLM2-135M-Instruct at CPU scale (results/cpu_smollm2).
#   bash scripts/cpu_experiment.sh [magpie|regen|features|train|eval|eval-chat|eval-t1|all]
# Every phase is resumable: rerun the script (or a phase) after an interruption. Sizes come from
# the environment; the defaults are what results/cpu_smollm2 reports.
#   magpie    CHAT_PROMPTS general-chat user turns sampled from the target itself (Magpie).
#   regen     the target's answers: PROMPTS code/math/docstring prompts in SHARDS processes (one
#             per core, regen-<i>.jsonl) and the Magpie prompts (regen-chat.jsonl); REGEN_MINUTES
#             caps the phase (0: no cap), a capped run resumes where it stopped.
#   features  the target's features (5 captured layers) over all regen-*.jsonl, SHARDS workers;
#             rebuilt when the data changed.
#   train     ARMS (of vanilla, lilicorr, nodist, margin, distill: self-logit distillation with
#             share DISTILL, wd: drafter weight decay WD) side by side at the same budget: STEPS steps of BATCH sequences, ANCHORS
#             anchors per sequence, a DRAFT_VOCAB draft vocabulary, a checkpoint every SAVE_EVERY, and a
#             weights-only snapshot every SNAPSHOT_EVERY (ckpt-<arm>.snapshots/, for tau vs steps).
#             INIT=DIR starts every arm from DIR/smollm2-<arm> (e.g. INIT=checkpoints: the committed
#             drafters trained on with a fresh schedule, `train.py --init`), a joint arm with no
#             checkpoint of its own (distill, wd, ...) from DIR/smollm2-lilicorr; LR_DRAFTER / LR_HEAD set
#             the peak learning rates (default: the preset's); SEED sets the data order and anchor
#             draws (`train.py --seed`, default the preset's).
#   eval      greedy, EVAL_LIMIT prompts x EVAL_TOKENS tokens per suite, EVAL_BATCH concurrent rows;
#             GREEDY_RULES for the joint arm (default ar,argmax,lilicorr,viterbi).
#   eval-chat greedy on the general-chat suite (prompts in no training file).
#   eval-t1   temperature 1 over SEEDS: argmax on the vanilla drafter, lilicorr on the joint one.
# THREADS (default 1): torch threads per process; features and regen start one process per core.
# SEED_DATA (default data/smollm2, committed): gzipped magpie prompts and regen files copied into an
# empty WORK first, so regen resumes after them instead of starting over (SEED_DATA= to start empty).
# DTYPE (float32 | bfloat16) is the target's dtype in regen, features and eval; the default is the
# serving default's arithmetic (bfloat16 on AMX CPUs, float32 on other CPUs; DTYPE=bfloat16 is faster
# wherever bf16 is native; runs meant to compare with earlier evals pin the same DTYPE).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-1}  # one thread per process: 2 shared cores
                                                         # (THREADS=2 for a single training arm)
W=${WORK:-work/cpu_smollm2}
T=.cache/smollm2-135m-instruct-float32
DTYPE=${DTYPE:-$(python -c "from lilicorr.target import resolve_dtype; print(str(resolve_dtype('auto')).removeprefix('torch.'))")}
PROMPTS=${PROMPTS:-1200}; MAX_NEW=${MAX_NEW:-192}; SHARDS=${SHARDS:-1}; REGEN_MINUTES=${REGEN_MINUTES:-0}
CHAT_PROMPTS=${CHAT_PROMPTS:-500}
STEPS=${STEPS:-600}; ANCHORS=${ANCHORS:-64}; BATCH=${BATCH:-8}; DRAFT_VOCAB=${DRAFT_VOCAB:-16384}
SAVE_EVERY=${SAVE_EVERY:-50}; SNAPSHOT_EVERY=${SNAPSHOT_EVERY:-100}
ARMS=${ARMS:-vanilla lilicorr}
EVAL_LIMIT=${EVAL_LIMIT:-40}; EVAL_TOKENS=${EVAL_TOKENS:-128}; EVAL_BATCH=${EVAL_BATCH:-16}
SEEDS=${SEEDS:-0,1,2}
phase=${1:-all}
mkdir -p "$W"
want() { [[ $phase == "$1" || $phase == all ]]; }
seed_data() {  # unpack SEED_DATA/*.jsonl.gz into WORK where WORK has no such file yet
  local src=${SEED_DATA-data/smollm2} f name
  [[ -n $src && -d $src ]] || return 0
  for f in "$src"/*.jsonl.gz; do
    [[ -e $f ]] || continue
    name=$(basename "$f" .gz)
    [[ -e $W/$name ]] || { gzip -dc "$f" > "$W/$name.tmp" && mv "$W/$name.tmp" "$W/$name"; }
  done
}
seed_data
timed() {  # name, command...: run it and append "name<TAB>seconds<TAB>date" to phase-times.tsv
  local t0=$SECONDS; "${@:2}"; printf '%s\t%s\t%s\n' "$1" $((SECONDS - t0)) "$(date -u +%FT%TZ)" >> "$W/phase-times.tsv"
}
data() { ls "$W"/regen-*.jsonl; }
wait_all() {  # pids: wait for every one; fail with the last failure (a bare `wait` would hide it)
  local rc=0 p
  for p in "$@"; do wait "$p" || rc=$?; done
  return $rc
}

magpie() {
  python train/prepare_target.py --out "$T"
  python train/magpie.py --target "$T" --out "$W/magpie-prompts.jsonl" --num "$CHAT_PROMPTS" \
    --dtype "$DTYPE" >> "$W/magpie.log" 2>&1
}

regen() {
  python train/prepare_target.py --out "$T"
  local cap=() pids=()
  [[ $REGEN_MINUTES != 0 ]] && cap=(timeout -s TERM "${REGEN_MINUTES}m")
  for ((i = 0; i < SHARDS; i++)); do
    "${cap[@]}" python train/regen.py --target "$T" --out "$W/regen-$i.jsonl" --num-prompts "$PROMPTS" \
      --max-new-tokens "$MAX_NEW" --batch-size 32 --seed 0 --shard "$i/$SHARDS" --dtype "$DTYPE" \
      --allow-mismatch --no-progress >> "$W/regen-$i.log" 2>&1 &
    pids+=($!)
  done
  if [[ -f $W/magpie-prompts.jsonl ]]; then
    "${cap[@]}" python train/regen.py --target "$T" --out "$W/regen-chat.jsonl" --prompts "$W/magpie-prompts.jsonl" \
      --num-prompts "$(wc -l < "$W/magpie-prompts.jsonl")" --max-new-tokens "$MAX_NEW" --batch-size 32 --seed 0 --dtype "$DTYPE" --allow-mismatch --no-progress \
      >> "$W/regen-chat.log" 2>&1 &
    pids+=($!)
  fi
  local p rc
  for p in "${pids[@]}"; do     # 124/130: stopped at the time cap, resumable
    wait "$p" || { rc=$?; [[ $rc == 130 || $rc == 124 ]] || exit $rc; echo "regen stopped at the time cap (resumable)"; }
  done
}

features() {
  DTYPE=$DTYPE python - "$T" "$W" "$SHARDS" $(data) <<'PY'
import os
import sys
from pathlib import Path
from tqdm import tqdm
from lilicorr.config import preset
from lilicorr.features import FeatureStore, build_feature_store
from lilicorr.target import load_target
from lilicorr.training import load_sequences
target_dir, work, workers, files = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
t = load_target(target_dir, dtype=os.environ["DTYPE"], batch_invariant=False)   # features only
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
  declare -A flags=([vanilla]=--vanilla [lilicorr]= [nodist]=--no-distractor [margin]=--margin
                    [distill]="--self-distill ${DISTILL:-0.5}" [wd]="--weight-decay-drafter ${WD:-0.1}")
  local pids=() init=() opts=()
  [[ -n ${LR_DRAFTER:-} ]] && opts+=(--lr-drafter "$LR_DRAFTER")
  [[ -n ${LR_HEAD:-} ]] && opts+=(--lr-head "$LR_HEAD")
  [[ -n ${SEED:-} ]] && opts+=(--seed "$SEED")
  for arm in $ARMS; do
    if [[ -n ${INIT:-} ]]; then   # an arm with no checkpoint of its own starts from the joint one
      init=(--init "$INIT/smollm2-$arm")
      [[ $arm != vanilla && ! -d $INIT/smollm2-$arm ]] && init=(--init "$INIT/smollm2-lilicorr")
    fi
    python train/train.py --preset cpu --target "$T" --data $(data) --features "$W/features" \
      --steps "$STEPS" --num-anchors "$ANCHORS" --global-batch "$BATCH" --draft-vocab "$DRAFT_VOCAB" \
      --save-every "$SAVE_EVERY" --snapshot-every "$SNAPSHOT_EVERY" --save-dtype bfloat16 --out "$W/ckpt-$arm" ${flags[$arm]} "${init[@]}" "${opts[@]}" \
      >> "$W/train-$arm.log" 2>&1 &
    pids+=($!)
  done
  wait_all "${pids[@]}" || { echo "a training arm failed: see $W/train-*.log"; exit 1; }
}

common=(--target "$T" --limit "$EVAL_LIMIT" --max-tokens "$EVAL_TOKENS" --batch-size "$EVAL_BATCH"
        --threads 1 --dtype "$DTYPE")
suites=(--prompts humaneval,math500,gsm-symbolic)
evaluate() {  # model, rules, extra flags; skipped when its JSON exists (delete it to rerun)
  local out="$W/eval-$1${4:-}.json"
  [[ -f $out ]] && { echo "have $out"; return; }
  [[ -d $W/ckpt-$1 ]] || { echo "no $W/ckpt-$1: train that arm first"; return; }
  python -m lilicorr.eval "${common[@]}" "${suites[@]}" --ckpt "$W/ckpt-$1" --rules "$2" ${3:-} --json "$out" \
    > "$W/eval-$1${4:-}.log" 2>&1
}
eval_greedy() {
  evaluate lilicorr "${GREEDY_RULES:-ar,argmax,lilicorr,viterbi}" & local a=$!
  { evaluate vanilla ar,argmax && evaluate nodist ar,lilicorr && evaluate margin ar,lilicorr \
    && evaluate distill ar,lilicorr; } & local b=$!
  wait_all $a $b || { echo "an eval run failed: see $W/eval-*.log"; exit 1; }
}
eval_chat() {   # general chat: one run per arm
  local suites=(--prompts lilicorr/data/chat_first_turn.jsonl)
  evaluate lilicorr ar,argmax,lilicorr "" -chat & local a=$!
  evaluate vanilla ar,argmax "" -chat & local b=$!
  wait_all $a $b || { echo "an eval run failed: see $W/eval-*-chat.log"; exit 1; }
}
eval_t1() {
  evaluate vanilla argmax "--temperature 1 --seed $SEEDS" -t1 & local a=$!   # ar's rate: the greedy runs
  evaluate lilicorr lilicorr "--temperature 1 --seed $SEEDS" -t1 & local b=$!
  wait_all $a $b || { echo "an eval run failed: see $W/eval-*-t1.log"; exit 1; }
}

if want magpie; then timed magpie magpie; fi
if want regen; then timed regen regen; fi
if want features || want train; then timed features features; fi
if want train; then timed train train; fi
if want eval; then timed eval eval_greedy; fi
if want eval-chat; then timed eval-chat eval_chat; fi
if want eval-t1; then timed eval-t1 eval_t1; fi
