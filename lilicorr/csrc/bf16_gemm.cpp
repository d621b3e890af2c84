// bf16 GEMM for small M on CPUs with AVX512-BF16: y[M, N] = bf16(x)[M, K] @ W[N, K]^T (+ bias), fp32
// accumulation (VDPBF16PS). Built on first use by lilicorr/bf16_gemm.py.
//
// Why: a speculative verify multiplies 2-16 tokens by every weight matrix. fbgemm's fp16-weight
// GEMM converts each fp16 weight to fp32 and runs fp32 FMAs, so past a few tokens it is bound by
// FMA throughput: an 8-token SmolLM2 forward costs ~1.8 plain steps on an AVX512-BF16 EPYC. One
// VDPBF16PS does twice the multiply-adds of an fp32 FMA, and the register tile below reads each
// weight once per call from memory (and once more per further 8 rows, from cache), so 8 tokens cost
// little more than the one memory pass a 1-token step needs.
//
// Batch invariance: every output element is the sum over k-pairs in ascending order, one VDPBF16PS
// per pair, into an accumulator that starts at 0 (bias added last). No code path changes that order
// with M, the row tile, the column tile or the thread count, so a row's output has the same bits
// whatever else is in the call: a k-token verify decides exactly as k one-token steps.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;           // output columns per 512-bit accumulator
constexpr int kGroup = 3;                // column blocks per packed group (48 columns)
constexpr int64_t kGroupCols = kBlock * kGroup;
constexpr int kRows = 8;                 // rows per register tile: 8 x 3 = 24 accumulators
constexpr int64_t kParallelRows = 32;    // rows (GEMM) or queries (attention) from which a call splits
constexpr int64_t kPrefetch = 16;        // k-pairs ahead a tile prefetches its weights (0: none)

// Packed weight: [groups][KP][kGroup][16][2] bf16 (KP = K/2 rounded up), as int16 (bf16 bits).
// A group is one contiguous stream of KP x 192 bytes, read front to back by every tile of it.

// Rows [0, MR) of x (bf16 pairs, KP per row) times `ng` consecutive groups starting at wg, into
// columns col0.. of y. NG groups at once give a 1- or 2-row call enough independent accumulators.
template <int MR, int NG>
inline void tile(const uint32_t* xp, int64_t KP, const __m512bh* wg, float* y, int64_t ldy, int64_t col0,
                 int64_t n_valid, const float* bias) {
  constexpr int NR = kGroup * NG;
  const int64_t gstride = KP * kGroup;                       // vectors per group
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    __m512bh wv[NR];
    if (kPrefetch > 0 && kp + kPrefetch < KP)                  // the group's stream, kPrefetch pairs ahead
      for (int g = 0; g < NG; ++g)
        for (int j = 0; j < kGroup; ++j)
          _mm_prefetch((const char*)(wg + g * gstride + (kp + kPrefetch) * kGroup + j), _MM_HINT_T0);
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < kGroup; ++j)
        wv[g * kGroup + j] = (__m512bh)_mm512_loadu_si512((const void*)(wg + g * gstride + kp * kGroup + j));
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[m * KP + kp]);
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t c = col0 + j * kBlock;                       // first output column of this block
    const int64_t left = n_valid - c;
    if (left <= 0) break;
    const __mmask16 mask = left >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + c, mask, _mm512_add_ps(acc[m][j], b));
  }
}

// Every row of x times groups [g0, g1).
void run_groups(const uint32_t* xp, int64_t M, int64_t KP, const __m512bh* w, float* y, int64_t N, int64_t g0,
            int64_t g1, const float* bias) {
  const int64_t gstride = KP * kGroup;
  int64_t g = g0;
  // few rows: several groups per tile, so enough accumulators are in flight (a tile's accumulators
  // and weight vectors must fit the 32 registers, or they spill: 2 rows x 4 groups ran at half the
  // speed of 3 rows x 1 group)
  if (M == 1) {
    for (; g + 4 <= g1; g += 4) tile<1, 4>(xp, KP, w + g * gstride, y, N, g * kGroupCols, N, bias);
  } else if (M == 2) {
    for (; g + 2 <= g1; g += 2) tile<2, 2>(xp, KP, w + g * gstride, y, N, g * kGroupCols, N, bias);
  } else if (M == 3 || M == 4) {
    // two groups per tile: two weight streams in flight (with one, a 3-token forward cost 1.45 plain
    // steps on an AMX Xeon, 1.12 with two: results/verify_cost_bf16_gemm_amx/); 5-8 rows keep one
    // group, as two would spill registers
    for (; g + 2 <= g1; g += 2) {
      if (M == 3) tile<3, 2>(xp, KP, w + g * gstride, y, N, g * kGroupCols, N, bias);
      else tile<4, 2>(xp, KP, w + g * gstride, y, N, g * kGroupCols, N, bias);
    }
  } else if (M == 9) {   // one pass over the weights: 27 accumulators, 3 weight vectors and 1 broadcast
    for (; g < g1; ++g) tile<9, 1>(xp, KP, w + g * gstride, y, N, g * kGroupCols, N, bias);
  }
  for (; g < g1; ++g) {
    const __m512bh* wg = w + g * gstride;
    const int64_t col0 = g * kGroupCols;
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) tile<kRows, 1>(xp + m * KP, KP, wg, y + m * N, N, col0, N, bias);
    const uint32_t* xr = xp + m * KP;
    float* yr = y + m * N;
    switch (M - m) {
      case 7: tile<7, 1>(xr, KP, wg, yr, N, col0, N, bias); break;
      case 6: tile<6, 1>(xr, KP, wg, yr, N, col0, N, bias); break;
      case 5: tile<5, 1>(xr, KP, wg, yr, N, col0, N, bias); break;
      case 4: tile<4, 1>(xr, KP, wg, yr, N, col0, N, bias); break;
      case 3: tile<3, 1>(xr, KP, wg, yr, N, col0, N, bias); break;
      case 2: tile<2, 1>(xr, KP, wg, yr, N, col0, N, bias); break;
      case 1: tile<1, 1>(xr, KP, wg, yr, N, col0, N, bias); break;
      default: break;
    }
  }
}

// x [M, K] float32 -> [M, 2 * KP] bf16 bits, round to nearest even, zero in the padding column.
void round_rows(const float* x, int64_t M, int64_t K, int64_t KP, uint16_t* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    uint16_t* dst = out + m * 2 * KP;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256((__m256i*)(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
    if (k < K) {
      const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k));
      _mm256_mask_storeu_epi16(dst + k, mask, v);
    }
    for (int64_t p = K; p < 2 * KP; ++p) dst[p] = 0;
  }
}

}  // namespace

// w [N, K] (any float dtype; its values are rounded to bf16) -> packed [groups, KP, kGroup * 16 * 2]
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "bf16 GEMM: the weight must be 2-D [out, in], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t groups = (N + kGroupCols - 1) / kGroupCols, KP = (K + 1) / 2;
  auto padded = torch::zeros({groups * kGroupCols, 2 * KP}, torch::kBFloat16);
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w.detach().to(torch::kCPU));
  // [G*192, 2KP] -> [G, 192, KP, 2] -> [G, KP, 192, 2]
  auto packed = padded.view({groups, kGroupCols, KP, 2}).permute({0, 2, 1, 3}).contiguous();
  return packed.view({groups, KP, kGroupCols * 2}).view(torch::kInt16);
}

// x [..., K] float32, packed from pack(), N = out features, bias [N] float32 or None -> float32 [..., N]
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "bf16 GEMM runs on CPU tensors");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGroupCols * 2, "bf16 GEMM: not a packed weight");
  const int64_t KP = packed.size(1), groups = packed.size(0);
  const int64_t K = x.size(-1);
  TORCH_CHECK((K + 1) / 2 == KP, "bf16 GEMM: input has ", K, " features, the weight was packed for ", 2 * KP);
  TORCH_CHECK(N > 0 && N <= groups * kGroupCols, "bf16 GEMM: ", N, " outputs for a weight packed with ",
              groups * kGroupCols, " columns");
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto x2 = x.reshape({-1, K}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return y.view(out_shape);
  const float* b = nullptr;
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "bf16 GEMM: bias has ", bias_f.numel(), " values for ", N, " outputs");
    b = bias_f.data_ptr<float>();
  }
  auto xb = torch::empty({M, 2 * KP}, torch::kInt16);
  round_rows(x2.data_ptr<float>(), M, K, KP, (uint16_t*)xb.data_ptr());
  const uint32_t* xp = (const uint32_t*)xb.data_ptr();
  const __m512bh* w = (const __m512bh*)packed.data_ptr();
  float* yp = y.data_ptr<float>();
  const int64_t used = (N + kGroupCols - 1) / kGroupCols;
  // column groups split over torch's threads only for a call of kParallelRows rows or more: below
  // that, a fork and join per GEMM cost more than the split saves. Each output element is computed
  // the same way on any thread.
  const int64_t grain = M >= kParallelRows ? 4 : used;
  at::parallel_for(0, used, grain, [&](int64_t g0, int64_t g1) { run_groups(xp, M, KP, w, yp, N, g0, g1, b); });
  return y.view(out_shape);
}

// exp(x) for 16 lanes (Cephes' expf polynomial after x = n ln2 + r, scaled by 2^n with VSCALEFPS):
// a lane's result depends on that lane alone. Relative error about 2e-7; x below -87 gives ~0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// queries per group for a head of 16 * ch floats: their accumulators (QB x CH vectors) fit in registers
constexpr int group_queries(int64_t ch) { return ch <= 4 ? 4 : (ch <= 8 ? 2 : 1); }
constexpr int kMaxGroup = 4;

template <int CH, int QB>
void attend_group(const float* const* qrow, const float* const* mrow, int64_t ms3, int nq, const float* krow,
                  int64_t ks2, const float* vrow, int64_t vs2, int64_t S, float sc, float* score,
                  float* const* orow, __mmask16 tail) {
  auto lanes = [tail](int c) { return c == CH - 1 ? tail : (__mmask16)0xFFFF; };
  __m512 qv[QB][CH];
  float best[QB];
  for (int j = 0; j < QB; ++j) {
    best[j] = -INFINITY;
    for (int c = 0; c < CH; ++c)
      qv[j][c] = j < nq ? _mm512_maskz_loadu_ps(lanes(c), qrow[j] + c * 16) : _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < S; ++s) {                           // scores, -inf where masked
    const float* kr = krow + s * ks2;
    __m512 kv[CH];
    for (int c = 0; c < CH; ++c) kv[c] = _mm512_maskz_loadu_ps(lanes(c), kr + c * 16);
    for (int j = 0; j < QB; ++j) {
      if (j >= nq) break;
      const float m = mrow[j][s * ms3];
      if (m == -INFINITY) {
        score[j * S + s] = -INFINITY;
        continue;
      }
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < CH; ++c) acc = _mm512_fmadd_ps(qv[j][c], kv[c], acc);
      const float x = _mm512_reduce_add_ps(acc) * sc + m;
      score[j * S + s] = x;
      if (x > best[j]) best[j] = x;
    }
  }
  for (int j = 0; j < nq; ++j) {                              // exp(score - best), lane by lane
    if (best[j] == -INFINITY) continue;
    const __m512 bv = _mm512_set1_ps(best[j]);
    float* row = score + j * S;
    for (int64_t s = 0; s < S; s += 16) {
      const int64_t left = S - s;
      const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      _mm512_mask_storeu_ps(row + s, mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, row + s), bv)));
    }
  }
  __m512 o[QB][CH];
  float denom[QB];
  for (int j = 0; j < QB; ++j) {
    denom[j] = 0.f;
    for (int c = 0; c < CH; ++c) o[j][c] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < S; ++s) {                           // in key order, the keys each mask leaves
    const float* vr = vrow + s * vs2;
    __m512 vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = _mm512_maskz_loadu_ps(lanes(c), vr + c * 16);
    for (int j = 0; j < QB; ++j) {
      if (j >= nq) break;
      if (best[j] == -INFINITY || mrow[j][s * ms3] == -INFINITY) continue;
      const float p = score[j * S + s];
      denom[j] += p;
      const __m512 pv = _mm512_set1_ps(p);
      for (int c = 0; c < CH; ++c) o[j][c] = _mm512_fmadd_ps(pv, vv[c], o[j][c]);
    }
  }
  for (int j = 0; j < nq; ++j) {
    const __m512 inv = _mm512_set1_ps(denom[j] > 0.f ? 1.f / denom[j] : 0.f);
    for (int c = 0; c < CH; ++c) _mm512_mask_storeu_ps(orow[j] + c * 16, lanes(c), _mm512_mul_ps(o[j][c], inv));
  }
}

// Attention whose every query is computed on its own, in one fixed order: softmax(q k^T * scale + mask) v
// in float32 for q [N, HQ, T, D], k and v [N, HKV, S, D] (the target's cache views: any strides with
// a unit last one), an additive mask [N or 1, 1, T, S] (float32), head size D up to 256. Keys
// a query's mask sets to -inf are skipped, so neither the other queries of the call nor how many keys
// the call reads past a query's own change its bits: a k-token verify's attention equals k one-token
// steps'. Scores are 16-lane dot products reduced in a fixed tree, the sums run in key order, and the
// output is divided by the softmax denominator once, at the end. The query heads that share a
// key/value head are taken together, so each key and value is read once per group of queries.
//
// `live` [N] (optional, int64): row n's queries t >= live[n] are padding (a packed verify whose rows
// verify different numbers of tokens): they are not computed and their outputs are zeros. The other
// queries are grouped among themselves, each computed exactly as without padding.
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scale,
                        c10::optional<torch::Tensor> live) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "attention: 4-D q, k, v, mask");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32 && mask.scalar_type() == torch::kFloat32,
              "attention: float32 q, k, v and mask");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: k and v need a unit last stride");
  q = q.contiguous();
  const int64_t N = q.size(0), HQ = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == N && v.size(0) == N && k.size(3) == D && v.size(3) == D && v.size(2) == S &&
              v.size(1) == HKV && HQ % HKV == 0, "attention: q, k, v shapes do not fit");
  TORCH_CHECK((mask.size(0) == N || mask.size(0) == 1) && mask.size(2) == T && mask.size(3) == S,
              "attention: mask must be [N or 1, 1, T, S]");
  TORCH_CHECK(D >= 1 && D <= 256, "attention: head size must be 1..256, got ", D);
  const int64_t chunks = (D + 15) / 16;
  const __mmask16 tail = (__mmask16)((1u << (D - 16 * (chunks - 1))) - 1);
  const int64_t rep = HQ / HKV;
  const int64_t QB = group_queries(chunks);                   // queries per group
  std::vector<int64_t> rows_t(N, T);                          // queries computed per row (per head)
  if (live.has_value() && live->defined()) {
    auto lv = live->to(torch::kCPU, torch::kLong).contiguous();
    TORCH_CHECK(lv.dim() == 1 && lv.size(0) == N, "attention: live must be [N]");
    for (int64_t n = 0; n < N; ++n) rows_t[n] = std::max<int64_t>(0, std::min<int64_t>(T, lv.data_ptr<int64_t>()[n]));
  }
  const bool padded = std::any_of(rows_t.begin(), rows_t.end(), [T](int64_t x) { return x < T; });
  const int64_t groups = (rep * T + QB - 1) / QB;             // at most, per key/value head
  auto out = padded ? torch::zeros({N, HQ, T, D}, torch::kFloat32) : torch::empty({N, HQ, T, D}, torch::kFloat32);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = mask.size(0) == 1 ? 0 : mask.stride(0), ms2 = mask.stride(2), ms3 = mask.stride(3);
  const float sc = (float)scale;
  const int64_t items = N * HKV * groups;                   // split over threads from kParallelRows queries
  at::parallel_for(0, items, N * T >= kParallelRows ? 1 : items, [&](int64_t i0, int64_t i1) {
    std::vector<float> score((size_t)(QB * S));
    const float* qrow[kMaxGroup];
    const float* mrow[kMaxGroup];
    float* orow[kMaxGroup];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / (HKV * groups), g = (i / groups) % HKV, first = (i % groups) * QB;
      const int64_t tn = rows_t[n], per_head = rep * tn;      // this row's queries per key/value head
      if (first >= per_head) continue;
      const int nq = (int)std::min<int64_t>(QB, per_head - first);
      for (int j = 0; j < nq; ++j) {
        const int64_t h = g * rep + (first + j) / tn, t = (first + j) % tn;
        const int64_t at = ((n * HQ + h) * T + t) * D;
        qrow[j] = qp + at;
        orow[j] = op + at;
        mrow[j] = mp + n * ms0 + t * ms2;
      }
      const float* krow = kp + n * ks0 + g * ks1;
      const float* vrow = vp + n * vs0 + g * vs1;
      switch (chunks) {
#define LILICORR_ATTEND(CH) case CH: attend_group<CH, group_queries(CH)>(                                  \
          qrow, mrow, ms3, nq, krow, ks2, vrow, vs2, S, sc, score.data(), orow, tail); break;
        LILICORR_ATTEND(1) LILICORR_ATTEND(2) LILICORR_ATTEND(3) LILICORR_ATTEND(4) LILICORR_ATTEND(5)
        LILICORR_ATTEND(6) LILICORR_ATTEND(7) LILICORR_ATTEND(8) LILICORR_ATTEND(9) LILICORR_ATTEND(10)
        LILICORR_ATTEND(11) LILICORR_ATTEND(12) LILICORR_ATTEND(13) LILICORR_ATTEND(14) LILICORR_ATTEND(15)
        LILICORR_ATTEND(16)
#undef LILICORR_ATTEND
        default: break;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "round a [N, K] weight to bf16 and pack it for linear()");
  m.def("linear", &linear, "float32 x [..., K] @ packed bf16 weight -> float32 [..., N]");
  m.def("attention", &attention, "float32 attention, every query on its own in a fixed order",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"), py::arg("live") = py::none());
}
