#!/usr/bin/env bash
# A narrower LiLiCorr head on the committed drafter (results/narrow_head_epyc/): the head of
# checkpoints/smollm2-lilicorr as of BASE_COMMIT (default c1bb932) is width 256 (FFN 512); this
# trains a fresh head of width HEAD_WIDTH (default 128, FFN twice that, d_e and K as before) on that
# drafter, frozen, then measures it against the width-256 head. DISTILL=1 also distils the new head
# from the width-256 head (train.py --distill-head, weight DISTILL_WEIGHT, default 1): its name and
# files then end in "kd" (w128kd).
#   bash scripts/narrow_head_cpu.sh [data|features|train|reference|eval|curve|build|cost|triton|all]
# Every phase is resumable (rerun it after an interruption; a phase whose output exists is skipped).
#   data      the conversations the committed drafter never trained on: data/smollm2's sixth round
#             (regen-forms lines 2101-4200, regen-chat-openers lines 1201-2400; data/smollm2/README.md)
#   features  the target's features over them (scripts/cpu_experiment.sh's phase, SHARDS workers)
#   train     STEPS head steps (batch 8, 32 anchors per sequence, peak learning rate LR_HEAD), the
#             drafter frozen (train/train.py --init --freeze-drafter --head-width ...); the run's
#             meta.json (its per-step history) is kept in OUT/train-NAME/ (NAME: w128, w128kd)
#   reference the width-256 head scored on the first 100 of the same training batches, unchanged
#             (learning rate 1e-12); the batch order depends on the seed, not on the number of steps
#   eval      engine greedy tau of both heads, the settings of results/cpu_smollm2_v12/ (16 rows,
#             fp16-weights target, prompt lookup off): the suites and general chat
#   curve     held-out tau against steps: the new head's snapshots beside the committed head
#             (scripts/tau_vs_steps.py, teacher-forced)
#   build     the ONNX Runtime engines of both heads (convert/build_engine.py)
#   cost      the drafter's sessions of both engines side by side (scripts/draft_parts_cost.py)
#   triton    the main job's benchmark through Triton on both engines, alternating (ROUNDS rounds)
# WORK (default work/narrow_head), OUT (default results/narrow_head_epyc), STEPS (default 3000),
# LR_HEAD (default 1e-3), THREADS (default 2), SHARDS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
W=${WORK:-work/narrow_head}; out=${OUT:-results/narrow_head_epyc}
T=.cache/smollm2-135m-instruct-float32
# the width-256 head: checkpoints/smollm2-lilicorr as of BASE_COMMIT, taken from git into WORK
BASE_COMMIT=${BASE_COMMIT:-c1bb932}
BASE=$W/base-$BASE_COMMIT/checkpoints/smollm2-lilicorr
BASE_ENGINE=$W/engine-w256
WIDTH=${HEAD_WIDTH:-128}
KEY=$WIDTH${DISTILL:+kd}; NAME=w$KEY          # the new head's label: w128, or w128kd when distilled
CKPT=$W/ckpt-$NAME; NEW_ENGINE=$W/engine-$NAME
DISTILL_FLAGS=()
[[ -n ${DISTILL:-} ]] && DISTILL_FLAGS=(--distill-head "$BASE" --distill-weight "${DISTILL_WEIGHT:-1}")
phase=${1:-all}
want() { [[ $phase == "$1" || $phase == all ]]; }
mkdir -p "$W" "$out"
[[ -f $BASE/model.safetensors ]] || { mkdir -p "$W/base-$BASE_COMMIT" \
  && git archive "$BASE_COMMIT" checkpoints/smollm2-lilicorr | tar -x -C "$W/base-$BASE_COMMIT"; }

if want data; then
  [[ -f $W/regen-forms-r6.jsonl ]] || zcat data/smollm2/regen-forms.jsonl.gz | sed -n 2101,4200p > "$W/regen-forms-r6.jsonl"
  [[ -f $W/regen-openers-r6.jsonl ]] || zcat data/smollm2/regen-chat-openers.jsonl.gz | sed -n 1201,2400p > "$W/regen-openers-r6.jsonl"
  wc -l "$W"/regen-*.jsonl
fi
if want features; then
  WORK=$W SEED_DATA= SHARDS=${SHARDS:-2} DTYPE=bfloat16 bash scripts/cpu_experiment.sh features
fi
if want train; then
  OMP_NUM_THREADS=${THREADS:-2} python train/train.py --preset cpu --target "$T" --data "$W"/regen-*.jsonl \
    --features "$W/features" --init "$BASE" --freeze-drafter --head-width "$WIDTH" --head-ffn $((2 * WIDTH)) \
    --steps "${STEPS:-3000}" --num-anchors 32 --global-batch 8 --lr-head "${LR_HEAD:-1e-3}" \
    --save-every 50 --snapshot-every 250 --save-dtype bfloat16 "${DISTILL_FLAGS[@]}" --out "$CKPT" 2>&1 \
    | tee -a "$W/train-$NAME.log"
  mkdir -p "$out/train-$NAME" && cp "$CKPT/meta.json" "$out/train-$NAME/meta.json"   # the run's history
fi
if want reference; then   # the width-256 head on the first 100 of the same batches, its weights kept (lr ~ 0)
  OMP_NUM_THREADS=${THREADS:-2} python train/train.py --preset cpu --target "$T" --data "$W"/regen-*.jsonl \
    --features "$W/features" --init "$BASE" --freeze-drafter --steps 100 --num-anchors 32 --global-batch 8 \
    --lr-head 1e-12 --save-dtype bfloat16 --out "$W/reference-w256" 2>&1 | tee -a "$W/reference.log"
  mkdir -p "$out/reference-w256" && cp "$W/reference-w256/meta.json" "$out/reference-w256/meta.json"
fi
if want eval; then   # both heads, one process each (1 thread)
  evaluate() {  # label, checkpoint
    local common=(--target "$T" --limit 40 --max-tokens 128 --batch-size 16 --threads 1 --no-progress --no-plots
                  --dtype fp16-weights --ckpt "$2")
    [[ -f $out/eval-suites-$1.json ]] || python -m lilicorr.eval "${common[@]}" --prompts humaneval,math500,gsm-symbolic \
      --rules argmax,lilicorr --json "$out/eval-suites-$1.json" > "$W/eval-suites-$1.log" 2>&1
    [[ -f $out/eval-chat-$1.json ]] || python -m lilicorr.eval "${common[@]}" --prompts lilicorr/data/chat_first_turn.jsonl \
      --rules ar,argmax,lilicorr --json "$out/eval-chat-$1.json" > "$W/eval-chat-$1.log" 2>&1
  }
  evaluate "$NAME" "$CKPT" & a=$!
  evaluate w256 "$BASE" & b=$!
  wait $a && wait $b
fi
if want curve; then
  steps=$(python -c "import json, sys; m = json.load(open(sys.argv[1])); print(m['step'] + m.get('init_step', 0))" \
    "$BASE/meta.json")                                    # the committed head, at its total steps
  # the held-out greedy text of results/cpu_smollm2_v3/ (regenerated in WORK if stale)
  [[ -f $W/heldout.jsonl ]] || cp results/cpu_smollm2_v3/tau_vs_steps.heldout.jsonl "$W/heldout.jsonl"
  mkdir -p "$W/committed-head" && ln -sfn "$PWD/$BASE" "$W/committed-head/step-$(printf %05d "$steps")"
  python scripts/tau_vs_steps.py --target "$T" --arm "$NAME=$CKPT.snapshots" --arm "w256=$W/committed-head" \
    --threads 1 --heldout "$W/heldout.jsonl" --out "$out/tau-vs-steps"
fi
if want build; then
  [[ -f $NEW_ENGINE/manifest.json ]] || python convert/build_engine.py --ckpt "$CKPT" --target "$T" --out "$NEW_ENGINE" \
    --backend onnxruntime
  [[ -f $BASE_ENGINE/manifest.json ]] || python convert/build_engine.py --ckpt "$BASE" --target "$T" \
    --out "$BASE_ENGINE" --backend onnxruntime
fi
if want cost; then
  for rows in 1 8; do
    python scripts/ort_op_profile.py --engine "w256=$BASE_ENGINE" --engine "$NAME=$NEW_ENGINE" --graph draft_head \
      --rows "$rows" --out "$out/head-profile-rows$rows"
  done
  python scripts/draft_parts_cost.py --engine "w256=$BASE_ENGINE" --engine "$NAME=$NEW_ENGINE" --rows 1,4,8 \
    --out "$out/draft-parts-cost"
fi
if want triton; then
  declare -A engines=([256]="$BASE_ENGINE" [$KEY]="$NEW_ENGINE")
  run() { engine=${engines[$3]} bench "$1" "$2" --concurrency 1,4 --rules ar,lilicorr; }
  . scripts/triton_bench_common.sh
  alternating_rounds head-w 256 "$KEY"
fi
