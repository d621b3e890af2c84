#!/usr/bin/env bash
# A prefill on more threads than the rest of the served engine (results/prefill_threads_epyc/):
# `--prefill-threads N` gives the target's GEMMs N threads while the engine prefills new requests
# (`lilicorr.fp16_linear.set_prefill_threads`; bf16-gemm splits calls of 32+ tokens, same bits), while
# verifies and every other op keep torch's one thread. Through Triton, the main job's benchmark (ar and
# lilicorr taking turns twice per concurrency, one fresh server per run) with the engine's defaults at
# each prefill thread count, on humaneval and on general chat prompts, in ROUNDS rounds that alternate
# which setting runs first.
#   ENGINE (default engines/smollm2-lilicorr-onnxruntime), OUT (default results/prefill_threads_epyc),
#   CONCURRENCY (default 1,2,4,8), THREADS (the prefill threads to compare, default "1 2"), ROUNDS (default 2)
out=${OUT:-results/prefill_threads_epyc}
. "$(dirname "$0")/triton_bench_common.sh"
threads=(${THREADS:-1 2})
run() {  # name, suite, prefill threads
  bench "$1" "$2" --concurrency "${CONCURRENCY:-1,2,4,8}" --rules ar,lilicorr --prefill-threads "$3"
}
alternating_rounds prefill "${threads[@]}"
