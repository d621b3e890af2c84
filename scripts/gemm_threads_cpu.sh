#!/usr/bin/env bash
# The target's multi-token GEMMs on more threads than the rest of it (results/gemm_threads_epyc/ for
# fp16-weights, results/gemm_threads_bf16_gemm_epyc/ for bf16-gemm): `--gemm-threads` splits
# fp16-weights' GEMMs of 2+ tokens across threads (`lilicorr.fp16_linear.PackedFP16`), and bf16-gemm's
# GEMMs and attention of 32+ tokens (`lilicorr.bf16_gemm`), same bits as one thread, while every other
# op keeps torch's one thread.
#  1. The target's forward t(k), k = 1..16 tokens for 1 row, and k = 1..8 for 8 rows, at 1 torch thread
#     with 1 and with 2 GEMM threads side by side (scripts/verify_cost.py), in precision DTYPE.
#  2. Through Triton, the main job's benchmark (ar and lilicorr taking turns twice per concurrency, one
#     fresh server per run) at 1 and at 2 GEMM threads, on humaneval and on general chat prompts, at
#     concurrency 1, 4 and 8, in ROUNDS rounds that alternate which setting runs first.
#   ENGINE (default engines/smollm2-lilicorr-onnxruntime), OUT (default results/gemm_threads_epyc),
#   CONCURRENCY (default 1,4,8), THREADS (the GEMM threads to compare, default "1 2"), ROUNDS (default 2),
#   SKIP_VERIFY_COST=1 (the served runs alone), DTYPE (the target's precision, default fp16-weights)
out=${OUT:-results/gemm_threads_epyc}
. "$(dirname "$0")/triton_bench_common.sh"
target=.cache/smollm2-135m-instruct-float32
threads=(${THREADS:-1 2})
gemm=$(IFS=,; echo "${threads[*]}")
dtype=${DTYPE:-fp16-weights}
note="torch threads 1 for every op; the GEMM threads for $dtype's multi-token GEMMs"
[[ -n ${SKIP_VERIFY_COST:-} ]] || python scripts/verify_cost.py --target "$target" --out "$out/verify-cost-rows1" --rows 1 --threads 1 \
  --gemm-threads "$gemm" --dtypes "$dtype" --rounds 4 --note "$note" > "$out/verify-cost-rows1.log" 2>&1
[[ -n ${SKIP_VERIFY_COST:-} ]] || python scripts/verify_cost.py --target "$target" --out "$out/verify-cost-rows8" --rows 8 --max-k 8 --threads 1 \
  --gemm-threads "$gemm" --dtypes "$dtype" --rounds 3 --note "$note" > "$out/verify-cost-rows8.log" 2>&1
run() {  # name, suite, GEMM threads
  bench "$1" "$2" --concurrency "${CONCURRENCY:-1,4,8}" --rules ar,lilicorr --gemm-threads "$3" --dtype "$dtype"
}
alternating_rounds gemm "${threads[@]}"
