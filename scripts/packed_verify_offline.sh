#!/usr/bin/env bash
# Before and after the packed verify, offline (results/packed_verify_epyc/offline/): the engine eval
# (`python -m lilicorr.eval`, ar and lilicorr taking turns, 3 passes) at 4 and 8 concurrent rows on
# humaneval and on general chat prompts, once with the code of commit BEFORE (default e54f5cc, the
# padded verify; run from a git worktree, which python -m imports ahead of the installed package,
# with its own kernel build folder) and once with this checkout, taking turns per cell.
#   BEFORE, OUT (default results/packed_verify_epyc/offline), ROWS (default "4 8")
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-results/packed_verify_epyc/offline}
before=${BEFORE:-e54f5cc}
old=$(mktemp -d)
git worktree add -q --detach "$old" "$before"
trap 'git worktree remove --force "$old"' EXIT
mkdir -p "$out"
run() {  # dir tag suite rows
  local name="$2-$(basename "$3" .jsonl)-b$4-1"
  (cd "$1" && TORCH_EXTENSIONS_DIR="$root/.cache/torch-extensions-$2" OMP_NUM_THREADS=1 \
    "$root/.venv/bin/python" -m lilicorr.eval --target "$root/.cache/smollm2-135m-instruct-float32" \
    --engine "$root/engines/smollm2-lilicorr-onnxruntime" --prompts "$3" --limit 16 --max-tokens 64 \
    --rules ar,lilicorr --batch-size "$4" --threads 1 --draft-length auto --prompt-lookup 3 --dtype auto \
    --profile --repeats 3 --warmup 1 --no-progress --no-plots --json "$root/$out/$name.json" > "$root/$out/$name.log" 2>&1)
  sed -i "s#$root/##g" "$out/$name.json" "$out/$name.log"      # paths relative to the checkout
}
for suite in humaneval "$root/lilicorr/data/chat_first_turn.jsonl"; do
  for rows in ${ROWS:-4 8}; do
    run "$old" old "$suite" "$rows"
    run "$root" new "$suite" "$rows"
  done
done
