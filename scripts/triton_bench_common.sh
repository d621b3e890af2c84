# Sourced by the scripts that benchmark the served engine through Triton side by side
# (scripts/serving_dtype_cpu.sh, scripts/prompt_lookup_cpu.sh, scripts/gemm_threads_cpu.sh,
# scripts/prefill_threads_cpu.sh): the shared set-up, and
#   bench NAME SUITE [deploy/bench.py flags...]
# one run of the main job's benchmark (deploy/bench.py: the rules taking turns twice per
# concurrency, greedy, 8 prompts x 64 tokens, stage profile, one fresh server) on $engine, writing
# $out/NAME.json and $out/NAME.log. Set `out` (the results folder) before sourcing; ENGINE picks the
# engine (default: the one scripts/demo.sh builds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. .venv/bin/activate
export PYTHONUNBUFFERED=1
engine=${ENGINE:-engines/smollm2-lilicorr-onnxruntime}
mkdir -p "$out"
bench() {
  python deploy/bench.py --engine "$engine" --prompts "$2" --limit 8 --max-tokens 64 --repeats 2 --profile \
    "${@:3}" --json "$out/$1.json" > "$out/$1.log" 2>&1
}
# alternating_rounds TAG VALUE...: in each of ROUNDS rounds (default 2), `run NAME SUITE VALUE` (the
# caller's function) for every VALUE on humaneval, then on general chat prompts, NAME being
# SUITE-TAGVALUE-rROUND; odd rounds take the values in the order given, even rounds reversed, so
# neither setting always runs first. Then prints the side-by-side table of every run.
alternating_rounds() {
  local tag=$1 r v order runs=() chat=lilicorr/data/chat_first_turn.jsonl
  shift
  for ((r = 1; r <= ${ROUNDS:-2}; r++)); do
    order=("$@")
    ((r % 2 == 0)) && order=($(printf '%s\n' "$@" | tac))
    for v in "${order[@]}"; do run "humaneval-$tag$v-r$r" humaneval "$v"; runs+=("$out/humaneval-$tag$v-r$r.json"); done
    for v in "${order[@]}"; do run "chat-$tag$v-r$r" "$chat" "$v"; runs+=("$out/chat-$tag$v-r$r.json"); done
  done
  python scripts/results_tables.py bench "${runs[@]}"
}
