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
