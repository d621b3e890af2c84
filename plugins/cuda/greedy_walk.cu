// lilicorr GreedyWalk (Eq. 8) as a CUDA kernel: the C++ counterpart of
// plugins/triton_kernels.py::greedy_walk_kernel, for a C++ TensorRT plugin or a torch extension.
//
//   anchor_scores [N, K], pair_scores [N, S-1, K, K] (T = float / __half / __nv_bfloat16)
//   -> idx [N, S] int64:  c_0 = argmax_k anchor_scores[n, k],
//                         c_{j+1} = argmax_k pair_scores[n, j, c_j, k]
// One warp per row n; lanes stride over k; ties break to the lowest index.
// Compile check: nvcc -arch=sm_90 -c greedy_walk.cu
#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

namespace lilicorr {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Warp-wide argmax of one row of length K; every lane returns the winner.
template <typename T>
__device__ __forceinline__ int warp_argmax(const T* __restrict__ row, int K) {
  const unsigned lane = threadIdx.x & 31u;
  float best = -CUDART_INF_F;
  int best_i = K;  // sentinel larger than any valid index
  for (int k = lane; k < K; k += 32) {
    const float v = to_float(row[k]);
    if (v > best || (v == best && k < best_i)) { best = v; best_i = k; }
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, off);
    const int oi = __shfl_xor_sync(0xffffffffu, best_i, off);
    if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
  }
  return best_i < K ? best_i : 0;  // all -inf / NaN row: index 0
}

template <typename T>
__global__ void greedy_walk_kernel(const T* __restrict__ anchor_scores,
                                   const T* __restrict__ pair_scores, int N, int S, int K,
                                   int64_t* __restrict__ idx) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (n >= N) return;
  const unsigned lane = threadIdx.x & 31u;
  int c = warp_argmax(anchor_scores + n * K, K);
  if (lane == 0) idx[n * S] = c;
  for (int j = 0; j < S - 1; ++j) {
    const T* row = pair_scores + ((n * (S - 1) + j) * K + c) * K;
    c = warp_argmax(row, K);
    if (lane == 0) idx[n * S + j + 1] = c;
  }
}

// Host launcher: 4 warps (rows) per block, on `stream`.
template <typename T>
cudaError_t launch_greedy_walk(const T* anchor_scores, const T* pair_scores, int N, int S, int K,
                               int64_t* idx, cudaStream_t stream) {
  if (N <= 0 || S <= 0) return cudaSuccess;
  constexpr int kRowsPerBlock = 4;
  const dim3 block(32 * kRowsPerBlock);
  const dim3 grid((N + kRowsPerBlock - 1) / kRowsPerBlock);
  greedy_walk_kernel<T><<<grid, block, 0, stream>>>(anchor_scores, pair_scores, N, S, K, idx);
  return cudaGetLastError();
}

template cudaError_t launch_greedy_walk<float>(const float*, const float*, int, int, int, int64_t*, cudaStream_t);
template cudaError_t launch_greedy_walk<__half>(const __half*, const __half*, int, int, int, int64_t*, cudaStream_t);
template cudaError_t launch_greedy_walk<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, int, int, int, int64_t*, cudaStream_t);

}  // namespace lilicorr

extern "C" cudaError_t lilicorr_greedy_walk_f32(const float* anchor_scores, const float* pair_scores,
                                               int N, int S, int K, int64_t* idx,
                                               cudaStream_t stream) {
  return lilicorr::launch_greedy_walk<float>(anchor_scores, pair_scores, N, S, K, idx, stream);
}
