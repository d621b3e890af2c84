#!/usr/bin/env bash
# The drafter's sessions before and after the tree part and the fused RMSNorms
# (results/draft_parts_epyc/): what each session of the two engines costs (scripts/draft_parts_cost.py),
# then the main job's benchmark through Triton (ar and lilicorr taking turns twice per
# concurrency, one fresh server per run) on each engine, on humaneval and on general chat
# prompts, the engines alternating over ROUNDS rounds (default 2).
#   BEFORE: an engine directory built before the change (three draft parts, RMSNorm chains unfused)
#   AFTER (default engines/smollm2-lilicorr-onnxruntime), OUT (default results/draft_parts_epyc)
out=${OUT:-results/draft_parts_epyc}
. "$(dirname "$0")/triton_bench_common.sh"
: "${BEFORE:?set BEFORE to an engine directory built before the tree part (e.g. by git checkout 5561d9a)}"
declare -A engines=([before]="$BEFORE" [after]="${AFTER:-engines/smollm2-lilicorr-onnxruntime}")
python scripts/draft_parts_cost.py --engine "before=${engines[before]}" --engine "after=${engines[after]}" \
  --rows 1,4,8 --out "$out/draft-parts-cost"
run() { engine=${engines[$3]} bench "$1" "$2" --concurrency 1,4 --rules ar,lilicorr; }
alternating_rounds engine- before after
