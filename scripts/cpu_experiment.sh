#!/usr/bin/env bash
# Issue 8: the paper's headline comparison at CPU scale on SmolLM2-135M-Instruct.
# Every phase is resumable: rerun the script (or a phase) after an interruption.
#   bash scripts/cpu_experiment.sh [regen|train|eval|all]
# Sizes are set by the environment (defaults: what results/cpu_smollm2 reports).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1     # one thread per process: 2 shared cores
W=${WORK:-work/cpu_smollm2}
T=.cache/smollm2-135m-instruct-float32
PROMPTS=${PROMPTS:-800}; MAX_NEW=${MAX_NEW:-160}
STEPS=${STEPS:-210}; ANCHORS=${ANCHORS:-24}; BATCH=${BATCH:-8}
EVAL_LIMIT=${EVAL_LIMIT:-12}; EVAL_TOKENS=${EVAL_TOKENS:-64}
phase=${1:-all}
mkdir -p "$W"

if [[ $phase == regen || $phase == all ]]; then
  python train/prepare_target.py --out "$T"
  python train/regen.py --target "$T" --out "$W/regen.jsonl" --num-prompts "$PROMPTS" \
    --max-new-tokens "$MAX_NEW" --batch-size 48 --seed 0 --allow-mismatch
fi

train() {  # name, extra flags
  python train/train.py --preset cpu --target "$T" --data "$W/regen.jsonl" --features "$W/features" \
    --steps "$STEPS" --num-anchors "$ANCHORS" --global-batch "$BATCH" --save-every 25 \
    --save-dtype bfloat16 --out "$W/ckpt-$1" "${@:2}" > "$W/train-$1.log" 2>&1
}
if [[ $phase == train || $phase == all ]]; then
  python - "$T" "$W" <<'PY'
import sys
from pathlib import Path
from lilicorr.config import preset
from lilicorr.features import build_feature_store
from lilicorr.target import load_target
from lilicorr.training import load_sequences
target_dir, work = sys.argv[1], Path(sys.argv[2])
if not (work / "features" / "meta.json").exists():
    t = load_target(target_dir)
    cfg = preset("cpu"); cfg.drafter = cfg.drafter.for_target(t.config)
    seqs = load_sequences(work / "regen.jsonl", cfg.train.seq_len)
    build_feature_store(t, seqs, cfg.drafter.target_layer_ids, work / "features")
PY
  train vanilla --vanilla & train lilicorr & train nodist --no-distractor &
  wait
fi

if [[ $phase == eval || $phase == all ]]; then
  suites=humaneval,math500,gsm-symbolic
  common=(--target "$T" --prompts "$suites" --limit "$EVAL_LIMIT" --max-tokens "$EVAL_TOKENS" --threads 1)
  python -m lilicorr.eval "${common[@]}" --ckpt "$W/ckpt-vanilla" --rules ar,argmax --json "$W/eval-vanilla.json" &
  python -m lilicorr.eval "${common[@]}" --ckpt "$W/ckpt-lilicorr" --rules ar,argmax,lilicorr,viterbi --json "$W/eval-lilicorr.json" &
  wait
  python -m lilicorr.eval "${common[@]}" --ckpt "$W/ckpt-nodist" --rules ar,lilicorr --json "$W/eval-nodist.json"
fi
