#!/usr/bin/env bash
# LiLiCorr against vanilla DFlash at the same budget, over seeds (results/vanilla_gain_seeds/): the
# two arms' equal-budget weights (5,760 steps each, committed in START_REV, results/cpu_smollm2_v7/)
# each train STEPS more steps with its own loss (joint for `lilicorr`, L_DFlash alone for `vanilla`)
# on the same conversations, which neither has seen (the sixth round of data/smollm2, prepared by
# scripts/self_distill_ablation.sh), with the same data order, anchor draws and learning rates for
# each seed in SEEDS. Then the engine's greedy tau of every run on the suites and on general chat:
# the walk and argmax on the joint drafter, argmax on the vanilla one (scripts/engine_eval.sh).
#   bash scripts/vanilla_gain_seeds.sh [data|runs|start|table|all]
#   data   the sixth-round conversations and their bf16 feature store (shared with the self-distill
#          ablation), and the start weights from git
#   runs   seed after seed: both arms' training side by side, then both arms' evaluation
#   start  the same evaluation of the start weights
#   table  scripts/ablation_table.py over the seeds: every arm against vanilla (OUT), the walk against
#          argmax on the joint drafter (OUT-walk)
# Resumable: training resumes (scripts/cpu_experiment.sh), an eval JSON that exists is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
W=${WORK:-work/vanilla_gain}
DATA=${DATA_WORK:-work/self_distill}     # the self-distill ablation's data and features
START_REV=${START_REV:-247d6b0}           # the commit holding both arms' 5,760-step weights
export STEPS=${STEPS:-300}
SEEDS=${SEEDS:-42 7 1}
phase=${1:-all}
want() { [[ $phase == "$1" || $phase == all ]]; }
wait_all() { local p; for p in "$@"; do wait "$p" || { echo "a run failed: see $W/*/*.log"; exit 1; }; done; }
mkdir -p "$W"

if want data; then
  WORK=$DATA bash scripts/self_distill_ablation.sh data
  WORK=$DATA bash scripts/self_distill_ablation.sh features
  if [[ ! -d $W/init/smollm2-vanilla ]]; then
    rm -rf "$W/init.tmp" && mkdir -p "$W/init.tmp"
    git archive "$START_REV" checkpoints/smollm2-lilicorr checkpoints/smollm2-vanilla \
      | tar -x -C "$W/init.tmp" --strip-components=1
    mv "$W/init.tmp" "$W/init"
  fi
fi
if want runs; then
  for seed in $SEEDS; do
    d=$W/seed-$seed
    mkdir -p "$d"
    for f in "$DATA"/regen-*.jsonl "$DATA/features"; do ln -sfn "$PWD/$f" "$d/$(basename "$f")"; done
    WORK=$d SEED=$seed SEED_DATA= INIT="$W/init" ANCHORS=32 DTYPE=bfloat16 ARMS="lilicorr vanilla" \
      LR_DRAFTER=3e-4 LR_HEAD=1.5e-4 SNAPSHOT_EVERY=1000 THREADS=1 bash scripts/cpu_experiment.sh train
    bash scripts/engine_eval.sh "$d/ckpt-lilicorr" "$d/eval-lilicorr" argmax,lilicorr & a=$!
    bash scripts/engine_eval.sh "$d/ckpt-vanilla" "$d/eval-vanilla" argmax & b=$!
    wait_all "$a" "$b"
  done
fi
if want start; then
  mkdir -p "$W/start"
  bash scripts/engine_eval.sh "$W/init/smollm2-lilicorr" "$W/start/eval-lilicorr" argmax,lilicorr & a=$!
  bash scripts/engine_eval.sh "$W/init/smollm2-vanilla" "$W/start/eval-vanilla" argmax & b=$!
  wait_all "$a" "$b"
fi
if want table; then
  base=()
  [[ -f $W/start/eval-lilicorr-chat.json ]] && base+=(--base-eval lilicorr="$W/start/eval-lilicorr.json" \
    lilicorr="$W/start/eval-lilicorr-chat.json" vanilla="$W/start/eval-vanilla.json" \
    vanilla="$W/start/eval-vanilla-chat.json")
  runs=$(for s in $SEEDS; do echo "$W/seed-$s"; done)
  out=${OUT:-results/vanilla_gain_seeds/table}
  python scripts/ablation_table.py --runs $runs --arms vanilla:argmax lilicorr lilicorr:argmax "${base[@]}" --out "$out"
  # the walk against argmax on the same joint drafter, seed by seed
  python scripts/ablation_table.py --runs $runs --arms lilicorr:argmax lilicorr "${base[@]}" --out "$out-walk"
fi
