#!/usr/bin/env bash
# The drafter's sessions before and after the tree part and the fused RMSNorms
# (results/draft_parts_epyc/): the head's op profile and what each session of the two engines costs
# (scripts/ort_op_profile.py, scripts/draft_parts_cost.py), then the main job's benchmark through
# Triton (ar and lilicorr taking turns twice per concurrency, one fresh server per run) on each
# engine, on humaneval and on general chat prompts, the engines alternating over ROUNDS rounds
# (default 2).
#   BEFORE (default 5561d9a): the commit whose convert/build_engine.py builds the "before" engine
#   from the same checkpoint (three draft parts, RMSNorm chains unfused), run from a git worktree
#   AFTER (default engines/smollm2-lilicorr-onnxruntime, as scripts/demo.sh builds it)
#   OUT (default results/draft_parts_epyc)
out=${OUT:-results/draft_parts_epyc}
. "$(dirname "$0")/triton_bench_common.sh"
root=$PWD
before_commit=${BEFORE:-5561d9a}
before_engine=engines/smollm2-lilicorr-onnxruntime-$before_commit
if [ ! -f "$before_engine/manifest.json" ]; then
  old=$(mktemp -d)
  git worktree add -q --detach "$old" "$before_commit"
  trap 'git worktree remove --force "$old"' EXIT
  (cd "$old" && PYTHONPATH="$old" python convert/build_engine.py --ckpt "$root/checkpoints/smollm2-lilicorr" \
    --target "$root/.cache/smollm2-135m-instruct-float32" --out "$root/$before_engine" --backend onnxruntime)
fi
declare -A engines=([before]="$before_engine" [after]="${AFTER:-engines/smollm2-lilicorr-onnxruntime}")
for rows in 1 8; do
  python scripts/ort_op_profile.py --engine "before=${engines[before]}" --engine "after=${engines[after]}" \
    --graph draft_head --rows "$rows" --out "$out/head-profile-rows$rows"
done
python scripts/draft_parts_cost.py --engine "before=${engines[before]}" --engine "after=${engines[after]}" \
  --rows 1,4,8 --out "$out/draft-parts-cost"
[ -n "${SKIP_TRITON:-}" ] && exit 0
run() { engine=${engines[$3]} bench "$1" "$2" --concurrency 1,4 --rules ar,lilicorr; }
alternating_rounds engine- before after
