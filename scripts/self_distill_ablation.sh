#!/usr/bin/env bash
# Self-logit distillation against hard labels at the same budget, over seeds
# (results/self_distill_ablation/): the committed LiLiCorr drafter trained STEPS more steps on
# conversations it never saw (the sixth round of data/smollm2: regen-forms lines 2101-4200,
# regen-chat-openers lines 1201-2400), once with the joint loss alone (arm `lilicorr`) and once with
# a DISTILL share of each slot's CE on the target's own distribution (arm `distill`,
# `train.py --self-distill`); same data, schedule and learning rates, for each seed in SEEDS (data
# order and anchor draws). Then the engine's greedy tau of every run on the suites and on general
# chat (RULES, default the lilicorr walk alone; scripts/engine_eval.sh), as results/cpu_smollm2_v13/
# measured its drafter, and the table:
#   bash scripts/self_distill_ablation.sh [data|features|train|eval|table|all]
# Resumable: the feature store and training resume (scripts/cpu_experiment.sh), an eval JSON that
# exists is kept. Two processes run at a time per phase, one per core (2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
W=${WORK:-work/self_distill}
export STEPS=${STEPS:-300} DISTILL=${DISTILL:-0.5}
SEEDS=${SEEDS:-42 7 1}
RULES=${RULES:-lilicorr}   # the engine rules evaluated (the table reads lilicorr)
T=.cache/smollm2-135m-instruct-float32
phase=${1:-all}
want() { [[ $phase == "$1" || $phase == all ]]; }
wait_all() { local p; for p in "$@"; do wait "$p" || { echo "a run failed: see $W/*/*.log"; exit 1; }; done; }
mkdir -p "$W/init"

if want data; then
  [[ -f $W/regen-forms-r6.jsonl ]] || { gzip -dc data/smollm2/regen-forms.jsonl.gz \
    | sed -n 2101,4200p > "$W/tmp" && mv "$W/tmp" "$W/regen-forms-r6.jsonl"; }
  [[ -f $W/regen-chat-openers-r6.jsonl ]] || { gzip -dc data/smollm2/regen-chat-openers.jsonl.gz \
    | sed -n 1201,2400p > "$W/tmp" && mv "$W/tmp" "$W/regen-chat-openers-r6.jsonl"; }
  ln -sfn "$PWD/checkpoints/smollm2-lilicorr" "$W/init/smollm2-lilicorr"
fi
if want features; then   # the bf16 target's features, both cores
  python train/prepare_target.py --out "$T"
  WORK=$W SEED_DATA= SHARDS=2 DTYPE=bfloat16 bash scripts/cpu_experiment.sh features
fi
if want train; then      # per seed a folder sharing the data and features; seed after seed, both
  for seed in $SEEDS; do # arms side by side (each training process holds about 6 GB)
    d=$W/seed-$seed
    mkdir -p "$d"
    for f in "$W"/regen-*.jsonl "$W/features"; do ln -sfn "$PWD/$f" "$d/$(basename "$f")"; done
    WORK=$d SEED=$seed SEED_DATA= INIT="$W/init" ANCHORS=32 DTYPE=bfloat16 ARMS="lilicorr distill" \
      LR_DRAFTER=3e-4 LR_HEAD=1.5e-4 SNAPSHOT_EVERY=1000 THREADS=1 bash scripts/cpu_experiment.sh train
  done
fi
if want eval; then       # the arms of one seed side by side, seed after seed
  for seed in $SEEDS; do
    pids=()
    for arm in lilicorr distill; do
      bash scripts/engine_eval.sh "$W/seed-$seed/ckpt-$arm" "$W/seed-$seed/eval-$arm" "$RULES" & pids+=($!)
    done
    wait_all "${pids[@]}"
  done
fi
if want table; then
  python scripts/ablation_table.py --runs $(for s in $SEEDS; do echo "$W/seed-$s"; done) \
    --arms lilicorr distill --base-eval results/cpu_smollm2_v12/eval-lilicorr.json \
    results/cpu_smollm2_v12/eval-lilicorr-chat.json --out "${OUT:-results/self_distill_ablation/table}"
fi
