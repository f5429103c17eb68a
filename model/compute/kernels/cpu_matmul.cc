// y = x @ w on CPU for few rows (decode), as an XLA FFI custom call dealt to the threads of
// XLA's intra-op pool (model/compute/kernels/cpu_matmul.py builds and registers it; pool.h). No
// dependency beyond g++.
//
//   ringserve_cpu_matmul   x [..., K] f32 | bf16, then G weights w_g [K, N_g] or [N_g, K] f32 |
//                          bf16 | int8, then for int8 weights their G scales f32 [N_g] (column n
//                          is w_g[:, n] * scale_g[n])
//   results                y_g [..., N_g] f32 | bf16 (the caller's choice; bf16 rounded to
//                          nearest even), one per weight
//   attribute transpose_w  the weights are stored [N, K] (a tied embedding as the LM head)
//   stacked weights        w_g [L, K, N] or [L, N, K], scales [L, N], and one more operand last:
//                          the layer l (s32 scalar) whose weights w_g[l] multiply (the layers'
//                          scan passes the whole stack: a slice would copy the layer's weights)
//
// G > 1: the projections that read the same x (q/k/v, gate/up). Each weight is planned as if
// alone (the same items, the same sums: y_g has the bits of a call with w_g only), and the
// items of all G weights are dealt to the pool in one dispatch: fewer, longer calls, which the
// pool's helpers join in time more often than 100-300 us ones.
//
// A step of decode is one row of x against every weight: the time is the time to stream the
// weights from memory once. Items of tens to hundreds of KB of weights are dealt to the pool's
// threads (pool.h); each reads its weights once, in address order where it can:
//   w [K, N], M <= 4   blocks of w's rows (each one contiguous run of memory), 8 rows a pass
//                      (8 sequential streams) into partial sums [M, N] per block; the caller
//                      adds the blocks' sums in block order. The split depends on the shapes
//                      only: the same bits on any number of threads.
//   w [K, N], M > 4    tiles of 64 columns over all of K, 16-column vectors in registers for
//                      4 rows of x at a time, the tile re-read from L2 for each 4 rows (AVX-512);
//                      AVX2: tiles of 16 columns, 6 rows of x at a time, and above 6 rows the
//                      tile first widened into an f32 panel [K, 16] that every block reads in
//                      address order (bf16 and int8 widen once, not once a block; the same sums
//                      in the same order: the same bits as one block)
//   w [N, K], M <= 2   groups of 8 weight rows, each row read start to end (one stream), 4
//                      vectors of K in flight, summed across the vector at the end
//   w [N, K], M > 2    4 weight rows x 4 rows of x in registers, 16 k a step; AVX2 above 6
//                      rows: 16 weight rows at a time transposed (8 x 8 blocks) into an f32
//                      panel [K, 16], then as [K, N] (each result one sum along K in order)
// Weights widen to f32 in registers (bf16: a 16-bit shift; int8: sign extension and a
// convert; the int8 scale multiplies the sum) and every sum accumulates in f32. bf16 x with
// bf16 w goes through vdpbf16ps instead ([N, K] always, [K, N] at M <= 4: exact products of
// pairs along K, f32 sums; inputs below f32's normal range flush to zero). bf16 x with int8 w
// [N, K] up to kQ16Rows rows (K a multiple of 16, AVX-512: 32): x as int16 per row (exact within
// 2^7 of the row's largest), the products summed exactly in int32 by vpmaddwd (AVX-512 VNNI:
// vpdpwssd), groups of 8 weight rows against blocks of 4 rows of x (nk_seq_q16). bf16 x with a
// registered bf16 weight (the executor's: `ringserve_cpu_matmul_register`), either layout, at
// every row count where AVX512-BF16 is: its copy packed in pairs along K (pairs.h), 64-column
// tiles read in address order, 4 rows of x x 4 vectors of vdpbf16ps sums (pair_tile); many rows
// of few tiles are dealt in row groups too. A registered int8 weight times bf16 x of more than
// kS8PairRows rows packs the same way, its integers as bf16 (exact), the scale after the sum.
// The kernels are
// written once over simd.h's vectors: AVX-512 (F, BW, VL; BF16 for the pairs) or AVX2 + FMA
// where the compiler targets it (-march=native; AVX2's tiles are narrower, 16 ymm registers
// against 32 zmm: [K, N] 16 columns, [N, K] 2 weight rows), plain loops elsewhere.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "pairs.h"
#include "pool.h"
#include "simd.h"
#include "xla_call.h"

using ringserve::DataType;

namespace {

using ringserve::bf16_to_f32;
using ringserve::f32_to_bf16;

struct Args {
  const float* x;      // [M, K] f32 (bf16 inputs widened first)
  const uint16_t* xh;  // [M, K] x's bf16 bits, or null (f32 x)
  const void* w;       // [K, N] or [N, K]
  const float* scale;  // [N] (int8 weights) or null
  const int16_t* xq;   // [M, K] x as int16, row m = xq[m] * xs[m] (`quantize_rows`), or null
  const float* xs;     // [M]
  void* y;             // [M, N]
  bool y_bf16;
  int64_t M, K, N;
  const ringserve::pairs::Packed* pk = nullptr;  // w's packed pairs (pairs.h: a registered bf16 [K, N]), or null
  // gated (AMX, model/compute/dots.py GatedMLP): y = silu(x @ w) * (x @ w2), w2's packed pairs and scale
  bool gated = false;
  const ringserve::pairs::Packed* pk2 = nullptr;
  const float* scale2 = nullptr;
  const uint16_t* xp = nullptr;                  // x's bf16 rows for them, xps values apart (K rounded up to even)
  int64_t xps = 0;
};

// bf16 x [M, K] (widened) -> int16 rows for nk_seq_q16: row m is xq[m] * xs[m], where xs[m] is
// the power of two 2^-15 of the one above the row's largest magnitude. Every value within 2^7 of
// that magnitude is exact (bf16 has 8 significant bits: its steps there are multiples of xs[m]),
// smaller ones round by at most xs[m] / 2, 1/128 of the largest value's own bf16 rounding: f32 x
// keeps the f32 path. |xq| <= kQ16Max, so with |w| <= 128 each int32 lane of the kernel sums at
// most K/16 products of 128 * kQ16Max: exact up to K = kQ16MaxK. false (x not used): a row holds
// an infinity or a NaN (the f32 path then gives what IEEE arithmetic gives).
// Measured and not kept (2026-11-29): a second int16 term per row holding the rest at a step
// 2^15 finer (exact down to 2^-22 of the largest value; SmolLM2's hidden states hold outlier
// dimensions, and a value 2^-10 of the largest rounds here by up to 2^-6 of itself). SmolLM2's
// int8 first-token logits (bench.precision, 64 prompts) came 0.227 off HF float32's on average
// instead of 0.238 (HF's own int8: 0.231; XLA's f32 dot: 0.225), but its multiplies made
// bf16 + int8 decode steps ~10% slower at 1-2 rows (1 row: medians 11.6 against 10.4 ms, 6
// alternated runs) and a third and more above (4 rows 18-21 against 13.5-14.5 ms).
#ifdef RINGSERVE_SIMD
constexpr bool kQ16 = true;  // nk_seq_q16 is built (AVX2: vpmaddwd; AVX-512: vpdpwssd where VNNI is)
#else
constexpr bool kQ16 = false;
#endif
// x's int16 rows are read a vector of 16-bit lanes at a time: K a multiple of this
#if RINGSERVE_SIMD == 512
constexpr int64_t kQ16Step = 32;
#else
constexpr int64_t kQ16Step = 16;
#endif
constexpr long kQ16Max = 32767;
constexpr int64_t kQ16MaxK = 8192;
// The most rows of x nk_seq_q16 takes, in blocks of 4 (more: the f32 panels, faster there).
// SmolLM2's bf16 + int8 decode step against the f32 path, in one process, alternated: 4 rows
// 23.18 -> 16.21 ms, 8 rows 49.21 -> 30.41, 16 73.78 -> 53.84, 32 101.35 -> 83.44, 64 180.02 ->
// 179.03 (faster in 5 of 8 pairs), 128 390.15 -> 421.54 (slower). AVX-512 (2 Zen 4 cores, VNNI,
// 256 tokens of context, 10 alternations): 1 row 9.06 -> 6.90 ms, 2 rows 9.40 -> 7.31, 4 rows
// 15.68 -> 10.18.
constexpr int64_t kQ16Rows = 64;
inline bool quantize_rows(const float* x, int64_t M, int64_t K, std::vector<int16_t>& xq, std::vector<float>& xs) {
#if RINGSERVE_SIMD == 256
  xq.resize(size_t(M * K));  // K is a multiple of 16 (the caller's condition)
  xs.resize(size_t(M));
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i lim = _mm256_set1_epi32(int(kQ16Max));
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    __m256 vmax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = _mm256_loadu_ps(r + k);
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, abs_mask));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    const float amax = *std::max_element(lanes, lanes + 8);
    if (_mm256_movemask_ps(nan) || !(amax <= 3.4e38f)) return false;  // a NaN, an infinity
    int e = 0;
    std::frexp(amax, &e);  // amax < 2^e
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? std::ldexp(1.f, 15 - e) : 0.f);
    xs[size_t(m)] = std::ldexp(1.f, e - 15);
    int16_t* q = xq.data() + m * K;
    for (int64_t k = 0; k < K; k += 16) {  // round to nearest even (MXCSR's default), clamp, pack
      __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), inv));
      __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k + 8), inv));
      a = _mm256_max_epi32(_mm256_min_epi32(a, lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
      b = _mm256_max_epi32(_mm256_min_epi32(b, lim), _mm256_sub_epi32(_mm256_setzero_si256(), lim));
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);  // packs works per 128-bit lane
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), p);
    }
  }
  return true;
#elif RINGSERVE_SIMD == 512
  xq.resize(size_t(M * K));  // K is a multiple of 32 (the caller's condition)
  xs.resize(size_t(M));
  const __m512i lim = _mm512_set1_epi32(int(kQ16Max)), neg = _mm512_set1_epi32(-int(kQ16Max));
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_loadu_ps(r + k);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    if (nan || !(amax <= 3.4e38f)) return false;  // a NaN, an infinity
    int e = 0;
    std::frexp(amax, &e);  // amax < 2^e
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? std::ldexp(1.f, 15 - e) : 0.f);
    xs[size_t(m)] = std::ldexp(1.f, e - 15);
    int16_t* q = xq.data() + m * K;
    for (int64_t k = 0; k < K; k += 16) {  // round to nearest even (MXCSR's default), clamp, narrow
      __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k), inv));
      a = _mm512_max_epi32(_mm512_min_epi32(a, lim), neg);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtepi32_epi16(a));
    }
  }
  return true;
#else
  (void)x, (void)M, (void)K, (void)xq, (void)xs;
  return false;
#endif
}

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_f32(v); }
inline float widen(int8_t v) { return float(v); }

inline void store1(const Args& a, int64_t m, int64_t n, float v) {
  if (a.scale) v *= a.scale[n];
  if (a.y_bf16)
    static_cast<uint16_t*>(a.y)[m * a.N + n] = f32_to_bf16(v);
  else
    static_cast<float*>(a.y)[m * a.N + n] = v;
}

#ifdef RINGSERVE_SIMD

namespace simd = ringserve::simd;
constexpr int L = simd::L;
constexpr int kKnVectors = L == 16 ? 4 : 2;  // [K, N] tiles: vectors of columns (MB x this accumulators)
constexpr int kKnRows = L == 16 ? 4 : 6;     // [K, N] tiles: rows of x a block (AVX2: 6 x 2 accumulators of 16)
// Calls of more than one block of rows (kKnRows), either layout: each tile widened (and an
// [N, K] one transposed) into an f32 panel once, then every block reads the panel (AVX2,
// measured there; AVX-512 reads the tile in place)
constexpr bool kPackKn = L == 8;
constexpr int kNkRows = L == 16 ? 4 : 2;     // [N, K] tiles of M > 2: weight rows (MB x this accumulators)

#ifndef RINGSERVE_NK_AHEAD
#define RINGSERVE_NK_AHEAD 1024
#endif
constexpr int kNkAhead = RINGSERVE_NK_AHEAD;  // bytes prefetched ahead along each weight row ([N, K])

using simd::mask_of;

// y[m, n:n+L] (lanes in `msk`) = v, scaled, in y's dtype
inline void store16(const Args& a, int64_t m, int64_t n, simd::V v, simd::Mask msk) {
  if (a.scale) v = simd::mul(v, simd::load(a.scale + n, msk));
  if (a.y_bf16)
    simd::store_bf16(static_cast<uint16_t*>(a.y) + m * a.N + n, v, msk);
  else
    simd::store(static_cast<float*>(a.y) + m * a.N + n, v, msk);
}

// w [K, N] for few rows of x (MB = M <= 4): rows k0..k1-1 of w, one contiguous block, read
// once in order, KG rows at a time (KG sequential streams); the sums over those rows go to
// part [MB, N] (plain stores into a buffer that stays in L1/L2)
template <int MB, int KG, class T>
inline void kn_rows(const Args& a, int64_t k, float* part, bool first) {
  const int64_t N = a.N, K = a.K;
  const T* wr[KG];
  simd::V xb[MB][KG];
  for (int j = 0; j < KG; ++j) {
    wr[j] = static_cast<const T*>(a.w) + (k + j) * N;
    for (int i = 0; i < MB; ++i) xb[i][j] = simd::set1(a.x[i * K + k + j]);
  }
  int64_t n = 0;
  for (; n + L <= N; n += L) {
    simd::V acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = first ? simd::zero() : simd::load(part + i * N + n);
    for (int j = 0; j < KG; ++j) {
      const simd::V wv = simd::load(wr[j] + n);
      for (int i = 0; i < MB; ++i) acc[i] = simd::fma(xb[i][j], wv, acc[i]);
    }
    for (int i = 0; i < MB; ++i) simd::store(part + i * N + n, acc[i]);
  }
  if (n < N) {
    const simd::Mask msk = mask_of(N - n);
    simd::V acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = first ? simd::zero() : simd::load(part + i * N + n, msk);
    for (int j = 0; j < KG; ++j) {
      const simd::V wv = simd::load(wr[j] + n, msk);
      for (int i = 0; i < MB; ++i) acc[i] = simd::fma(xb[i][j], wv, acc[i]);
    }
    for (int i = 0; i < MB; ++i) simd::store(part + i * N + n, acc[i], msk);
  }
}

// y rows 0..MB-1 from the partial sums of `items` row blocks, in block order
inline void kn_reduce(const Args& a, const float* part, int64_t items) {
  const int64_t MN = a.M * a.N;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t n = 0; n < a.N; n += L) {
      const simd::Mask msk = mask_of(a.N - n);
      simd::V s = simd::load(part + m * a.N + n, msk);
      for (int64_t i = 1; i < items; ++i) s = simd::add(s, simd::load(part + i * MN + m * a.N + n, msk));
      store16(a, m, n, s, msk);
    }
}

// w [K, N]: rows m0..m0+MB-1 of y (at most M) x columns n0..n0+L*NV-1 (at most N)
template <int MB, int NV, class T>
void kn_tile(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K, N = a.N;
  const T* w = static_cast<const T*>(a.w) + n0;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.x + std::min(m0 + i, a.M - 1) * K;
  simd::V acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = simd::zero();
  constexpr int kRowBytes = L * NV * int(sizeof(T));
  constexpr int64_t kAhead = std::max(4, 4096 / kRowBytes);  // rows prefetched ahead: ~4 KB in flight
  const size_t stride = size_t(N) * sizeof(T);
  if (n0 + L * NV <= N) {
    const char* pf = reinterpret_cast<const char*>(w) + kAhead * stride;
    const bool odd = (reinterpret_cast<uintptr_t>(pf) | stride) & 63;  // rows straddle one more line
    for (int64_t k = 0; k < K; ++k, pf += stride) {
      if (k + kAhead < K) {
        for (int b = 0; b < kRowBytes; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        if (odd) _mm_prefetch(pf + kRowBytes - 1, _MM_HINT_T0);
      }
      const T* wr = w + k * N;
      simd::V wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = simd::load(wr + L * v);
      for (int i = 0; i < MB; ++i) {
        const simd::V xb = simd::set1(xr[i][k]);
        for (int v = 0; v < NV; ++v) acc[i][v] = simd::fma(xb, wv[v], acc[i][v]);
      }
    }
  } else {  // the last, partial tile
    simd::Mask msk[NV];
    for (int v = 0; v < NV; ++v) msk[v] = mask_of(N - n0 - L * v);
    for (int64_t k = 0; k < K; ++k) {
      const T* wr = w + k * N;
      simd::V wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = simd::load(wr + L * v, msk[v]);
      for (int i = 0; i < MB; ++i) {
        const simd::V xb = simd::set1(xr[i][k]);
        for (int v = 0; v < NV; ++v) acc[i][v] = simd::fma(xb, wv[v], acc[i][v]);
      }
    }
  }
  for (int i = 0; i < MB && m0 + i < a.M; ++i)
    for (int v = 0; v < NV; ++v)
      if (n0 + L * v < N) store16(a, m0 + i, n0 + L * v, acc[i][v], mask_of(N - n0 - L * v));
}

// w [K, N]: the tile of columns n0..n0+C-1 (C = L * kKnVectors; past N: zeros) widened into
// panel [K, C] f32, w read from memory once, row after row, prefetched ahead as in kn_tile
template <class T>
void kn_pack(const Args& a, int64_t n0, float* panel) {
  constexpr int C = L * kKnVectors;
  const int64_t K = a.K, N = a.N;
  const T* w = static_cast<const T*>(a.w) + n0;
  if (n0 + C <= N) {
    constexpr int kRowBytes = C * int(sizeof(T));
    constexpr int64_t kAhead = std::max(4, 4096 / kRowBytes);
    const size_t stride = size_t(N) * sizeof(T);
    const char* pf = reinterpret_cast<const char*>(w) + kAhead * stride;
    const bool odd = (reinterpret_cast<uintptr_t>(pf) | stride) & 63;
    for (int64_t k = 0; k < K; ++k, pf += stride) {
      if (k + kAhead < K) {
        for (int b = 0; b < kRowBytes; b += 64) _mm_prefetch(pf + b, _MM_HINT_T0);
        if (odd) _mm_prefetch(pf + kRowBytes - 1, _MM_HINT_T0);
      }
      for (int v = 0; v < kKnVectors; ++v) simd::store(panel + k * C + L * v, simd::load(w + k * N + L * v));
    }
    return;
  }
  simd::Mask msk[kKnVectors];
  for (int v = 0; v < kKnVectors; ++v) msk[v] = mask_of(N - n0 - L * v);
  for (int64_t k = 0; k < K; ++k)
    for (int v = 0; v < kKnVectors; ++v) simd::store(panel + k * C + L * v, simd::load(w + k * N + L * v, msk[v]));
}

// w [N, K]: weight rows n0..n0+C-1 (past N: zeros) widened and transposed into panel [K, C]
// f32, L x L blocks at a time (AVX2 only: kPackKn), each weight row read once in order
template <class T>
void nk_pack(const Args& a, int64_t n0, float* panel) {
  constexpr int C = L * kKnVectors;
  const int64_t K = a.K, N = a.N;
  for (int j0 = 0; j0 < C; j0 += L) {
    const T* wr[L];
    for (int j = 0; j < L; ++j)
      wr[j] = n0 + j0 + j < N ? static_cast<const T*>(a.w) + (n0 + j0 + j) * K : nullptr;
    int64_t k = 0;
#if RINGSERVE_SIMD == 256
    for (; k + L <= K; k += L) {
      simd::V r[L];
      for (int j = 0; j < L; ++j) r[j] = wr[j] ? simd::load(wr[j] + k) : simd::zero();
      simd::transpose(r);
      for (int t = 0; t < L; ++t) simd::store(panel + (k + t) * C + j0, r[t]);
    }
#endif
    for (; k < K; ++k)
      for (int j = 0; j < L; ++j) panel[k * C + j0 + j] = wr[j] ? widen(wr[j][k]) : 0.f;
  }
}

// kn_tile over a packed panel (kn_pack): rows m0..m0+MB-1 of y x the panel's columns from n0;
// the same sums in the same order, so the same bits
template <int MB>
void kn_panel(const Args& a, const float* panel, int64_t m0, int64_t n0) {
  constexpr int C = L * kKnVectors;
  const int64_t K = a.K, N = a.N;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.x + std::min(m0 + i, a.M - 1) * K;
  simd::V acc[MB][kKnVectors];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < kKnVectors; ++v) acc[i][v] = simd::zero();
  for (int64_t k = 0; k < K; ++k) {
    simd::V wv[kKnVectors];
    for (int v = 0; v < kKnVectors; ++v) wv[v] = simd::load(panel + k * C + L * v);
    for (int i = 0; i < MB; ++i) {
      const simd::V xb = simd::set1(xr[i][k]);
      for (int v = 0; v < kKnVectors; ++v) acc[i][v] = simd::fma(xb, wv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MB && m0 + i < a.M; ++i)
    for (int v = 0; v < kKnVectors; ++v)
      if (n0 + L * v < N) store16(a, m0 + i, n0 + L * v, acc[i][v], mask_of(N - n0 - L * v));
}

// w [N, K] for one or two rows of x: weight rows n0..n0+NB-1 one after the other (the group
// is one contiguous block, read as one sequential stream), 4 vectors of K in flight per row
template <int MB, int NB, class T>
void nk_seq(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.x + std::min(m0 + i, a.M - 1) * K;
  for (int j = 0; j < NB && n0 + j < a.N; ++j) {
    const T* wr = static_cast<const T*>(a.w) + (n0 + j) * K;
    simd::V acc[MB][4];
    for (int i = 0; i < MB; ++i)
      for (int u = 0; u < 4; ++u) acc[i][u] = simd::zero();
    int64_t k = 0;
    for (; k + 4 * L <= K; k += 4 * L)
      for (int u = 0; u < 4; ++u) {
        const simd::V wv = simd::load(wr + k + L * u);
        for (int i = 0; i < MB; ++i) acc[i][u] = simd::fma(simd::load(xr[i] + k + L * u), wv, acc[i][u]);
      }
    for (int u = 0; k < K; k += L, ++u) {
      const simd::Mask msk = mask_of(K - k);
      const simd::V wv = simd::load(wr + k, msk);
      for (int i = 0; i < MB; ++i) acc[i][u] = simd::fma(simd::load(xr[i] + k, msk), wv, acc[i][u]);
    }
    for (int i = 0; i < MB && m0 + i < a.M; ++i) {
      const simd::V s = simd::add(simd::add(acc[i][0], acc[i][1]), simd::add(acc[i][2], acc[i][3]));
      store1(a, m0 + i, n0 + j, simd::reduce(s));
    }
  }
}

// w [N, K]: rows m0..m0+MB-1 of y x columns n0..n0+NB-1 (weight rows; past N: the last one
// again, not stored)
template <int MB, int NB, class T>
void nk_tile(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const T* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = static_cast<const T*>(a.w) + std::min(n0 + j, a.N - 1) * K;
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.x + std::min(m0 + i, a.M - 1) * K;
  simd::V acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = simd::zero();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    simd::V wv[NB];
    if (sizeof(T) * L >= 64 || (k & (64 / sizeof(T) - 1)) == 0)  // a line ahead per row, each new line
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kNkAhead, _MM_HINT_T0);
    for (int j = 0; j < NB; ++j) wv[j] = simd::load(wr[j] + k);
    for (int i = 0; i < MB; ++i) {
      const simd::V xv = simd::load(xr[i] + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = simd::fma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const simd::Mask msk = mask_of(K - k);
    simd::V wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = simd::load(wr[j] + k, msk);
    for (int i = 0; i < MB; ++i) {
      const simd::V xv = simd::load(xr[i] + k, msk);
      for (int j = 0; j < NB; ++j) acc[i][j] = simd::fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB && m0 + i < a.M; ++i)
    for (int j = 0; j < NB && n0 + j < a.N; ++j) store1(a, m0 + i, n0 + j, simd::reduce(acc[i][j]));
}

#ifdef __AVX512BF16__
// bf16 x and bf16 w: vdpbf16ps multiplies pairs of bf16 exactly and adds both products to an
// f32 lane, 32 weights an instruction (the widen-then-FMA path takes 3 for 16); the pair runs
// along K (inputs and results below f32's normal range are flushed to zero).

inline __m512bh bh(__m512i v) { return (__m512bh)v; }

// w [K, N] rows k..k+2*KP-1 in pairs for MB rows of x into part [MB, N] (natural column order:
// a pair of rows is interleaved 16-bit-wise into (w[k, n], w[k+1, n]) lanes)
template <int MB, int KP>
inline void kn_pairs_dp(const Args& a, int64_t k, float* part, bool first) {
  const int64_t N = a.N, K = a.K;
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                          6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);  // fmt: skip
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const uint16_t* r[2 * KP];
  __m512i xp[MB][KP];
  for (int p = 0; p < KP; ++p) {
    r[2 * p] = w + (k + 2 * p) * N;
    r[2 * p + 1] = r[2 * p] + N;
    for (int i = 0; i < MB; ++i)
      xp[i][p] = _mm512_set1_epi32(int32_t(uint32_t(a.xh[i * K + k + 2 * p]) | uint32_t(a.xh[i * K + k + 2 * p + 1]) << 16));
  }
  for (int64_t n = 0; n < N; n += 32) {
    const __mmask32 m32 = N - n >= 32 ? ~__mmask32(0) : __mmask32((1u << (N - n)) - 1);
    const __mmask16 m0 = mask_of(N - n), m1 = mask_of(N - n - 16);
    __m512 lo[MB], hi[MB];
    for (int i = 0; i < MB; ++i) {
      lo[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, part + i * N + n);
      hi[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, part + i * N + n + 16);
    }
    for (int p = 0; p < KP; ++p) {
      const __m512i r0 = _mm512_maskz_loadu_epi16(m32, r[2 * p] + n), r1 = _mm512_maskz_loadu_epi16(m32, r[2 * p + 1] + n);
      const __m512i wl = _mm512_permutex2var_epi16(r0, lo_idx, r1), wh = _mm512_permutex2var_epi16(r0, hi_idx, r1);
      for (int i = 0; i < MB; ++i) {
        lo[i] = _mm512_dpbf16_ps(lo[i], bh(xp[i][p]), bh(wl));
        hi[i] = _mm512_dpbf16_ps(hi[i], bh(xp[i][p]), bh(wh));
      }
    }
    for (int i = 0; i < MB; ++i) {
      _mm512_mask_storeu_ps(part + i * N + n, m0, lo[i]);
      if (m1) _mm512_mask_storeu_ps(part + i * N + n + 16, m1, hi[i]);
    }
  }
}

// nk_seq for bf16 x and w: 32 k an instruction
template <int MB, int NB>
void nk_seq_dp(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const uint16_t* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.xh + std::min(m0 + i, a.M - 1) * K;
  for (int j = 0; j < NB && n0 + j < a.N; ++j) {
    const uint16_t* wr = static_cast<const uint16_t*>(a.w) + (n0 + j) * K;
    __m512 acc[MB][4];
    for (int i = 0; i < MB; ++i)
      for (int u = 0; u < 4; ++u) acc[i][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128)
      for (int u = 0; u < 4; ++u) {
        const __m512i wv = _mm512_loadu_si512(wr + k + 32 * u);
        for (int i = 0; i < MB; ++i) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], bh(_mm512_loadu_si512(xr[i] + k + 32 * u)), bh(wv));
      }
    for (int u = 0; k < K; k += 32, ++u) {
      const __mmask32 m32 = K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
      const __m512i wv = _mm512_maskz_loadu_epi16(m32, wr + k);
      for (int i = 0; i < MB; ++i) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], bh(_mm512_maskz_loadu_epi16(m32, xr[i] + k)), bh(wv));
    }
    for (int i = 0; i < MB && m0 + i < a.M; ++i) {
      const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3]));
      store1(a, m0 + i, n0 + j, _mm512_reduce_add_ps(s));
    }
  }
}

// w [N, K]: rows m0..m0+MB-1 of y x weight rows n0..n0+NB-1 (as nk_tile), 32 k a step
template <int MB, int NB>
void nk_tile_dp(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const uint16_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = static_cast<const uint16_t*>(a.w) + std::min(n0 + j, a.N - 1) * K;
  const uint16_t* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.xh + std::min(m0 + i, a.M - 1) * K;
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m32 = K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kNkAhead, _MM_HINT_T0);
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_epi16(m32, wr[j] + k);
    for (int i = 0; i < MB; ++i) {
      const __m512i xv = _mm512_maskz_loadu_epi16(m32, xr[i] + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], bh(xv), bh(wv[j]));
    }
  }
  for (int i = 0; i < MB && m0 + i < a.M; ++i)
    for (int j = 0; j < NB && n0 + j < a.N; ++j) store1(a, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

// bf16 x against a registered weight's packed pairs (pairs.h; bf16, or int8's integers as bf16,
// scaled in store16): rows m0..m0+MB-1 of y x the
// 64 columns of the tile from column n0, 4 x MB accumulators over the tile's KP pairs of K, the
// tile read once in address order (one vdpbf16ps a row for 32 weights: no interleaving, no
// widening); each sum runs along K in pair order, whatever the other rows
template <int MB>
void pair_tile(const Args& a, int64_t m0, int64_t n0) {
  const int64_t KP = a.pk->KP;
  const uint32_t* w = a.pk->tile(n0 / ringserve::pairs::kCols);
  const uint16_t* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.xp + std::min(m0 + i, a.M - 1) * a.xps;
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t q = 0; q < KP; ++q, w += ringserve::pairs::kCols) {
    __m512i wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(w + 16 * v);
    for (int i = 0; i < MB; ++i) {
      int32_t pair;  // x[2q], x[2q + 1]: the low half first, as in the weight's lanes
      std::memcpy(&pair, xr[i] + 2 * q, 4);
      const __m512bh xb = bh(_mm512_set1_epi32(pair));
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, bh(wv[v]));
    }
  }
  for (int i = 0; i < MB && m0 + i < a.M; ++i)
    for (int v = 0; v < 4; ++v)
      if (n0 + 16 * v < a.N) store16(a, m0 + i, n0 + 16 * v, acc[i][v], mask_of(a.N - n0 - 16 * v));
}
constexpr bool kPairs = true;  // registered bf16 (and int8) weights are read from packed pairs
// int8 weights are read from packed pairs (their values as bf16, scaled after the sum) by calls of
// more rows of x than this; fewer stream the int8 weight itself (nk_seq_q16), half the bytes.
// SmolLM2 int8 decode at 256 tokens of context, alternated in one process (2 Zen cores,
// 2026-12-04), pairs / int16 stream / oneDNN beyond 16 rows: 24 rows 69.6 / 109.3 / 160.1 ms,
// 32 rows 79.9 / 108.4 / 93.2, 64 rows 125.2 / 221.3 / 269.2, 128 rows 254.4 / 586.8 / 527.0;
// prefill of 512 tokens 518 / 1915 / 797; 16 rows 68.4 / 56.3 (the same path both: noise)
constexpr int64_t kS8PairRows = 16;
#else
constexpr bool kPairs = false;
constexpr int64_t kS8PairRows = 0;
#endif

#ifdef RINGSERVE_AMX
// AMX (amx.h): the packed pairs' tiles are AMX's B operand as they are. A packed tile's 16 pairs
// of K x 16 columns are 16 rows of 64 bytes, 256 bytes apart (pairs.h: [KP][64] u32), so a B tile
// loads from the copy in place; 16 rows of x x 32 of K (bf16, 64 bytes) are an A tile, K * 2
// bytes apart. tdpbf16ps adds to each f32 of a 16 x 16 C tile the 32 products of its row of A
// and column of B, pair by pair in K order (bf16 products exact, sums in f32, inputs and
// results below f32's normal range flushed to zero, as vdpbf16ps).
//
//   tiles 0-3   C: rows r..r+15 and r+16..r+31 x columns c..c+15 and c+16..c+31 of y
//   tiles 4-5   A: those rows' 32 values of K at the step
//   tile  6-7   B: the step's 16 pairs of K x those columns
//
// Every row of y is summed the same way whatever the other rows of the call (a row past M is
// zeros, never read back), so a row's bits do not depend on how many rows its call has.
namespace amx {

using ringserve::amx::usable;

// f32 lanes rounded to bf16 (nearest even; a NaN stays a quiet NaN, as store_bf16) and widened back
inline __m512 round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}

// e^x on f32 lanes, x clamped to [-88, 88]: 2^n e^r with r = x - n ln 2 in [-ln2/2, ln2/2] and
// Cephes' degree-6 polynomial for e^r (within 2 ulp of f32)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// The gated MLP's activation as model/compute/dots.py computes it for bf16: g and u rounded to bf16
// (the projections' outputs), silu(g) = g * sigmoid(g) in f32 rounded to bf16, times u in f32
// (the caller rounds the product to bf16). The exp is exp16's, not XLA's: a result may differ
// from XLA's by a bf16 step where the two exps' last f32 bits round apart.
inline __m512 silu_mul(__m512 g, __m512 u) {
  g = round_bf16(g);
  u = round_bf16(u);
  const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(round_bf16(_mm512_mul_ps(g, sig)), u);
}

// y[m, n:n+16] (lanes below N) from stored C rows: the product's (its scale applied), or, gated,
// silu_mul of the gate's and the up projection's (each scaled), rounded to y's dtype
inline void out16(const Args& a, int64_t m, int64_t n, const float* g, const float* u) {
  const simd::Mask msk = mask_of(a.N - n);
  if (!a.gated) return store16(a, m, n, _mm512_load_ps(g), msk);
  __m512 gv = _mm512_load_ps(g), uv = _mm512_load_ps(u);
  if (a.scale) gv = _mm512_mul_ps(gv, _mm512_maskz_loadu_ps(msk, a.scale + n));
  if (a.scale2) uv = _mm512_mul_ps(uv, _mm512_maskz_loadu_ps(msk, a.scale2 + n));
  simd::store_bf16(static_cast<uint16_t*>(a.y) + m * a.N + n, silu_mul(gv, uv), msk);
}

// Up to 16 rows of x (16 rows readable at x) x packed tile t of `pk`, its 64 columns at once:
// C tiles 0-3 the four column blocks, A tile 4, B tiles 5-7 in turn. The tile is read in address
// order, a step's 16 pairs x 64 columns one run of 4 KB (decode's rows: the weights stream)
inline void one_block(const ringserve::pairs::Packed* pk, const uint16_t* x, int64_t stride, int64_t steps,
                      int64_t t, float (*c)[16 * 16]) {
  const uint32_t* b = pk->tile(t);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int64_t row = ringserve::pairs::kCols * 4;
  for (int64_t s = 0; s < steps; ++s, b += 16 * ringserve::pairs::kCols) {
    _tile_loadd(4, x + 32 * s, stride);
    _tile_loadd(5, b, row);
    _tile_loadd(6, b + 16, row);
    _tile_loadd(7, b + 32, row);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 48, row);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}

// A 32 x 32 block of y summed in C tiles 0-3, stored as two [16][32] f32 halves (`c`; gated: the
// gate's, and the up projection's in `u`), written out while the next block's products run
// (`out`): the conversion and the stores are the AVX-512 ports' work, the sums the tiles', so
// the two overlap (SmolLM2's 2048 x 576 x 1536 on one core: 926 GF/s written after its block,
// 1132 meanwhile; 1292 not written at all).
struct Block {
  alignas(64) float c[2][16 * 32];
  alignas(64) float u[2][16 * 32];
  int64_t m = 0, n = 0;  // y's row and column of c[0][0]
  int64_t done = 32;     // rows written (32: none pending)

  static void keep(float (*to)[16 * 32]) { ringserve::amx::store_2x2(to[0], 128); }
  void take(int64_t m_, int64_t n_) { m = m_, n = n_, done = 0; }
  // rows done..r1-1 of the block into y (those below M; columns below N): bf16 without a scale
  // through vcvtne2ps2bf16 (nearest even, as store_bf16: a tile's sums are never below f32's
  // normal range, where the instruction flushes), anything else through out16
  void out(const Args& a, int64_t r1) {
    r1 = std::min<int64_t>(std::min<int64_t>(r1, 32), a.M - m);  // (per_step x steps may pass 32)
    const bool fast = !a.gated && a.y_bf16 && !a.scale && n + 32 <= a.N;
    for (; done < r1; ++done) {
      const float* cr = c[done >> 4] + (done & 15) * 32;
      const float* ur = u[done >> 4] + (done & 15) * 32;
      if (fast) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(cr + 16), _mm512_load_ps(cr));
        _mm512_storeu_si512(static_cast<uint16_t*>(a.y) + (m + done) * a.N + n, (__m512i)v);
      } else {
        for (int h = 0; h < 2; ++h)
          if (n + 16 * h < a.N) out16(a, m + done, n + 16 * h, cr + 16 * h, ur + 16 * h);
      }
    }
    if (done >= a.M - m) done = 32;
  }
};

// Calls of up to this many rows (decode's) run every 16 rows as one_block: each tile is read in
// address order (from memory for the first 16 rows, from L2 after), where the 2 x 2 blocks read
// each 4 KB step of it twice, 128 bytes of every 256, and waited on memory at the B loads (perf:
// 55% of their time). The sums are the same either way (a C element adds the same A row x B
// column products in the same K order). Past 32 rows the 2 x 2 blocks' fewer loads a product
// win where the call is compute-bound: the LM head (49,152 x 576) at 64 rows 3.3 ms against 3.9
// streamed; 30 layers of SmolLM2's gate and down projections at 32 rows 5.8 against 6.7 ms (noisy
// VM: each figure moved 10-30% between runs).
constexpr int64_t kStreamRows = 32;

// Rows m0..m1-1 of y x the packed tiles t0..t1-1 (64 columns each), 32 rows at a time, each
// tile for every 32 rows (the item's tiles stay in L2 while its rows pass). K % 32 == 0. Gated
// (a.pk the gate's pairs, a.pk2 the up projection's): each block summed for both, then y =
// silu_mul of the two.
void rows(const Args& a, int64_t m0, int64_t m1, int64_t t0, int64_t t1) {
  const ringserve::amx::Tiles tiles;
  const int64_t steps = a.pk->KP / 16, stride = a.xps * 2;
  alignas(64) float c[4][16 * 16], cu[4][16 * 16];
  Block blocks[2];  // the one being written out, the one being summed
  int cur = 0;
  const int64_t per_step = (32 + steps - 1) / steps;  // rows written out a step
  thread_local std::vector<uint16_t> pad;  // the last rows, under 32, and zeros after them
  for (int64_t m = m0; m < m1; m += 32) {
    const int64_t live = std::min<int64_t>(32, a.M - m);
    const uint16_t* x = a.xp + m * a.xps;
    if (live % 16) {  // a tile loads 16 rows: those past M read as zeros from a copy, not past x
      pad.assign(size_t((live > 16 ? 32 : 16) * a.xps), 0);
      std::memcpy(pad.data(), x, size_t(live * a.xps) * 2);
      x = pad.data();
    }
    if (live <= 16 || a.M <= kStreamRows) {  // blocks of 16 rows, each tile's four column blocks in one pass
      for (int64_t r = 0; r < live; r += 16)
        for (int64_t t = t0; t < t1; ++t) {
          one_block(a.pk, x + r * a.xps, stride, steps, t, c);
          if (a.gated) one_block(a.pk2, x + r * a.xps, stride, steps, t, cu);
          for (int q = 0; q < 4; ++q) {
            const int64_t n = t * ringserve::pairs::kCols + 16 * q;
            if (n >= a.N) break;
            for (int64_t i = 0; i < 16 && m + r + i < a.M; ++i) out16(a, m + r + i, n, c[q] + 16 * i, cu[q] + 16 * i);
          }
        }
      continue;
    }
    const uint16_t* x1 = x + 16 * a.xps;
    for (int64_t t = t0; t < t1; ++t) {
      for (int h = 0; h < 4; h += 2) {  // the tile's columns 16h..16h+31
        const int64_t n0 = t * ringserve::pairs::kCols + 16 * h;
        if (n0 >= a.N) break;
        Block& last = blocks[cur ^ 1];
        Block& now = blocks[cur];
        for (int w = 0; w < (a.gated ? 2 : 1); ++w) {
          ringserve::amx::zero_2x2();
          const uint32_t* b = (w ? a.pk2 : a.pk)->tile(t) + 16 * h;
          for (int64_t s = 0; s < steps; ++s, b += 16 * ringserve::pairs::kCols) {
            _tile_loadd(4, x + 32 * s, stride);
            _tile_loadd(5, x1 + 32 * s, stride);
            _tile_loadd(6, b, ringserve::pairs::kCols * 4);
            _tile_loadd(7, b + 16, ringserve::pairs::kCols * 4);
            ringserve::amx::dp_2x2();
            if (last.done < 32) last.out(a, last.done + per_step);
          }
          Block::keep(w ? now.u : now.c);
        }
        if (last.done < 32) last.out(a, 32);
        now.take(m, n0);
        cur ^= 1;
      }
    }
  }
  for (Block& b : blocks)
    if (b.done < 32) b.out(a, 32);
}

}  // namespace amx
#endif

#if RINGSERVE_SIMD == 256
// int8 w [N, K] for up to 4 rows of x quantized to int16 (`quantize_rows`; K a multiple of 16,
// at most kQ16MaxK), each weight row read once for them: 16 weights widen to int16 in one
// instruction and vpmaddwd multiplies them by 16 of x's and adds pairs into 8 int32 lanes,
// where widening to f32 took 2 instructions for 8 and an FMA. Each row's int32 sum is exact; y = sum * x's row scale * w's column scale.
// SmolLM2's whole bf16 + int8 decode step (256 tokens of context) on 2 Zen 3 cores, in one
// process, this path switched on and off per 7 steps and alternated 30 times: 1 row 12.86 ->
// 10.68 ms (faster in 27 of 30 pairs), 2 rows 15.30 -> 13.00 (29 of 30); a standalone loop over
// the same weights without the pool: 6.8 -> 6.1 ms on two threads, 11.1 -> 10.0 on one.
// (`quantize_rows` vectorised: with a scalar std::lrint per value it took 9.4 us of a call.)
template <int MB, int NB>
void nk_seq_q16(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const int16_t* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.xq + std::min(m0 + i, a.M - 1) * K;
  for (int j = 0; j < NB && n0 + j < a.N; ++j) {
    const int8_t* wr = static_cast<const int8_t*>(a.w) + (n0 + j) * K;
    __m256i acc[MB][2];
    for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      for (int u = 0; u < 2; ++u) {
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16 * u)));
        for (int i = 0; i < MB; ++i) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i] + k + 16 * u));
          acc[i][u] = _mm256_add_epi32(acc[i][u], _mm256_madd_epi16(wv, xv));
        }
      }
    if (k < K) {  // the last 16
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k)));
      for (int i = 0; i < MB; ++i)
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i] + k))));
    }
    for (int i = 0; i < MB && m0 + i < a.M; ++i) {  // lanes exact in int32, their sum in f32
      const __m256 s = _mm256_add_ps(_mm256_cvtepi32_ps(acc[i][0]), _mm256_cvtepi32_ps(acc[i][1]));
      store1(a, m0 + i, n0 + j, simd::reduce(s) * a.xs[m0 + i]);
    }
  }
}
#elif RINGSERVE_SIMD == 512
// The same on AVX-512 (K a multiple of 32): 32 weights widen to int16 in one instruction and
// vpdpwssd (VNNI; else vpmaddwd and an add) multiplies them by 32 of x's and adds pairs into 16
// int32 lanes, where widening to f32 took 2 instructions for 16 and an FMA.
inline __m512i madd_add(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
template <int MB, int NB>
void nk_seq_q16(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  const int16_t* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = a.xq + std::min(m0 + i, a.M - 1) * K;
  for (int j = 0; j < NB && n0 + j < a.N; ++j) {
    const int8_t* wr = static_cast<const int8_t*>(a.w) + (n0 + j) * K;
    __m512i acc[MB][2];
    for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
      for (int u = 0; u < 2; ++u) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k + 32 * u)));
        for (int i = 0; i < MB; ++i) acc[i][u] = madd_add(acc[i][u], wv, _mm512_loadu_si512(xr[i] + k + 32 * u));
      }
    if (k < K) {  // the last 32
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + k)));
      for (int i = 0; i < MB; ++i) acc[i][0] = madd_add(acc[i][0], wv, _mm512_loadu_si512(xr[i] + k));
    }
    for (int i = 0; i < MB && m0 + i < a.M; ++i) {  // lanes exact in int32, their sum in f32
      const __m512 s = _mm512_add_ps(_mm512_cvtepi32_ps(acc[i][0]), _mm512_cvtepi32_ps(acc[i][1]));
      store1(a, m0 + i, n0 + j, _mm512_reduce_add_ps(s) * a.xs[m0 + i]);
    }
  }
}
#endif

#else  // plain loops (the compiler vectorises what it can)

constexpr bool kPairs = false;
constexpr int64_t kS8PairRows = 0;

constexpr int L = 16, kKnVectors = 4, kNkRows = 4, kKnRows = 4;  // the tiles' widths, as the vectors' above
constexpr bool kPackKn = false;

template <int MB, int KG, class T>
inline void kn_rows(const Args& a, int64_t k, float* part, bool first) {
  const int64_t N = a.N, K = a.K;
  if (first) std::fill(part, part + MB * N, 0.f);
  for (int j = 0; j < KG; ++j) {
    const T* wr = static_cast<const T*>(a.w) + (k + j) * N;
    for (int i = 0; i < MB; ++i) {
      const float xk = a.x[i * K + k + j];
      float* p = part + i * N;
      for (int64_t n = 0; n < N; ++n) p[n] += xk * widen(wr[n]);
    }
  }
}

inline void kn_reduce(const Args& a, const float* part, int64_t items) {
  const int64_t MN = a.M * a.N;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t n = 0; n < a.N; ++n) {
      float s = part[m * a.N + n];
      for (int64_t i = 1; i < items; ++i) s += part[i * MN + m * a.N + n];
      store1(a, m, n, s);
    }
}

template <int MB, int NV, class T>
void kn_tile(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K, N = a.N, n1 = std::min(n0 + L * NV, N);
  const T* w = static_cast<const T*>(a.w);
  for (int i = 0; i < MB && m0 + i < a.M; ++i) {
    const float* xr = a.x + (m0 + i) * K;
    float acc[L * NV] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float xk = xr[k];
      const T* wr = w + k * N;
      for (int64_t n = n0; n < n1; ++n) acc[n - n0] += xk * widen(wr[n]);
    }
    for (int64_t n = n0; n < n1; ++n) store1(a, m0 + i, n, acc[n - n0]);
  }
}

template <int MB, int NB, class T>
void nk_tile(const Args& a, int64_t m0, int64_t n0) {
  const int64_t K = a.K;
  for (int i = 0; i < MB && m0 + i < a.M; ++i) {
    const float* xr = a.x + (m0 + i) * K;
    for (int j = 0; j < NB && n0 + j < a.N; ++j) {
      const T* wr = static_cast<const T*>(a.w) + (n0 + j) * K;
      float acc[16] = {};  // 16 partial sums: vectorises without reassociating
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; ++l) acc[l] += xr[k + l] * widen(wr[k + l]);
      for (; k < K; ++k) acc[k % 16] += xr[k] * widen(wr[k]);
      float s = 0.f;
      for (int l = 0; l < 16; ++l) s += acc[l];
      store1(a, m0 + i, n0 + j, s);
    }
  }
}

template <int MB, int NB, class T>
void nk_seq(const Args& a, int64_t m0, int64_t n0) {
  nk_tile<MB, NB, T>(a, m0, n0);
}

#endif

// part [MB, N] = x[:, k0:k1] @ w[k0:k1, :]: groups of KG rows, then 4, then one by one
template <int MB, class T>
void kn_block(const Args& a, int64_t k0, int64_t k1, float* part) {
  int64_t k = k0;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (a.xh) {  // pairs of rows through vdpbf16ps; an odd last row below
      for (; k + 8 <= k1; k += 8) kn_pairs_dp<MB, 4>(a, k, part, k == k0);
      for (; k + 2 <= k1; k += 2) kn_pairs_dp<MB, 1>(a, k, part, k == k0);
    }
  }
#endif
  // rows a pass: more where a row of weights is little work (the partial sums are loaded and
  // stored once a pass), while MB x KG broadcasts stay in registers
  constexpr int KG = MB == 1 ? 8 : 4;
  for (; k + KG <= k1; k += KG) kn_rows<MB, KG, T>(a, k, part, k == k0);
  for (; k + 4 <= k1; k += 4) kn_rows<MB, 4, T>(a, k, part, k == k0);
  for (; k < k1; ++k) kn_rows<MB, 1, T>(a, k, part, k == k0);
}

using Tile = void (*)(const Args&, int64_t, int64_t);
using PanelTile = void (*)(const Args&, const float*, int64_t, int64_t);
using Pack = void (*)(const Args&, int64_t, float*);

// The kernel for a block of `mb` rows (1..kKnRows for [K, N], 1..4 for [N, K]) with `width`
// (vectors for [K, N], weight rows for [N, K]); the combinations plan() asks for.
template <class T>
Tile kn_kernel(int mb) {
  switch (mb) {
    case 1: return kn_tile<1, kKnVectors, T>;
    case 2: return kn_tile<2, kKnVectors, T>;
    case 3: return kn_tile<3, kKnVectors, T>;
    case 4: return kn_tile<4, kKnVectors, T>;
    case 5: return kn_tile<5, kKnVectors, T>;
    default: return kn_tile<6, kKnVectors, T>;
  }
}

#ifdef RINGSERVE_SIMD
inline PanelTile kn_panel_kernel(int mb) {
  switch (mb) {
    case 1: return kn_panel<1>;
    case 2: return kn_panel<2>;
    case 3: return kn_panel<3>;
    case 4: return kn_panel<4>;
    case 5: return kn_panel<5>;
    default: return kn_panel<6>;
  }
}
template <class T>
Pack packer(bool transpose_w) {
  if constexpr (kPackKn) return transpose_w ? nk_pack<T> : kn_pack<T>;
  return nullptr;
}
#else
inline PanelTile kn_panel_kernel(int) { return nullptr; }
template <class T>
Pack packer(bool) {
  return nullptr;
}
#endif

template <class T>
Tile nk_kernel(int mb, int nb, bool dp, bool q16 = false) {
#ifdef RINGSERVE_SIMD
  if (std::is_same_v<T, int8_t> && q16 && nb == 8) switch (mb) {
      case 1: return nk_seq_q16<1, 8>;
      case 2: return nk_seq_q16<2, 8>;
      case 3: return nk_seq_q16<3, 8>;
      default: return nk_seq_q16<4, 8>;
    }
#endif
#ifdef __AVX512BF16__
  if (std::is_same_v<T, uint16_t> && dp) switch (mb * 100 + nb) {
      case 108: return nk_seq_dp<1, 8>;
      case 208: return nk_seq_dp<2, 8>;
      case 104: return nk_tile_dp<1, 4>;
      case 204: return nk_tile_dp<2, 4>;
      case 304: return nk_tile_dp<3, 4>;
      default: return nk_tile_dp<4, 4>;
    }
#endif
  if (nb == 8) return mb == 1 ? nk_seq<1, 8, T> : nk_seq<2, 8, T>;
  switch (mb) {
    case 1: return nk_tile<1, kNkRows, T>;
    case 2: return nk_tile<2, kNkRows, T>;
    case 3: return nk_tile<3, kNkRows, T>;
    default: return nk_tile<4, kNkRows, T>;
  }
}

// One weight's share of a call: its items, dealt together with the other weights' (one
// dispatch for all the weights that share x), and how to run item i
struct Plan {
  Args a;
  int64_t items = 0;
  // w [K, N], M <= 4: blocks of `rows` rows of w into partial sums, added by finish()
  void (*block)(const Args&, int64_t, int64_t, float*) = nullptr;
  int64_t rows = 0;
  float* sums = nullptr;  // [items, M, N]
  // otherwise: items of `per_item` tiles of `cols` columns, rows of x `mb` at a time (with
  // `row_groups` > 1: each item's tiles for `group_rows` of them, the last group the tail too)
  Tile main = nullptr, tail = nullptr;
  int64_t cols = 0, tiles = 0, per_item = 0, full_rows = 0, row_groups = 1, group_rows = 0;
  int mb = 0;
  bool amx = false;  // packed pairs through AMX (amx::rows), rows in groups of `group_rows`
  // kPackKn and more than one block of rows, either layout: each tile packed, then read by them all
  Pack pack = nullptr;
  PanelTile pmain = nullptr, ptail = nullptr;

  int64_t part_size() const { return block ? items * a.M * a.N : 0; }
  void item(int64_t i) const {
    if (block) return block(a, i * rows, std::min(a.K, (i + 1) * rows), sums + i * a.M * a.N);
    const int64_t t0 = (i / row_groups) * per_item, t1 = std::min(tiles, t0 + per_item);
    if (pack) {
      thread_local std::vector<float> panel;  // [K, cols], reused from call to call
      if (panel.size() < size_t(a.K * cols)) panel.resize(size_t(a.K * cols));
      for (int64_t t = t0; t < t1; ++t) {
        pack(a, t * cols, panel.data());
        for (int64_t m = 0; m < full_rows; m += mb) pmain(a, panel.data(), m, t * cols);
        if (ptail) ptail(a, panel.data(), full_rows, t * cols);
      }
      return;
    }
#ifdef RINGSERVE_AMX
    if (amx) {  // row groups outermost: a thread's next item reads the rows its last one read (in L2)
      const int64_t groups = items / row_groups, u0 = (i % groups) * per_item, r0 = (i / groups) * group_rows;
      return amx::rows(a, r0, std::min(a.M, r0 + group_rows), u0, std::min(tiles, u0 + per_item));
    }
#endif
    const int64_t g = row_groups > 1 ? i % row_groups : 0;
    const int64_t m0 = g * group_rows, m1 = row_groups > 1 ? std::min(full_rows, m0 + group_rows) : full_rows;
    for (int64_t t = t0; t < t1; ++t) {  // each tile once for every row of x (it stays in L2)
      for (int64_t m = m0; m < m1; m += mb) main(a, m, t * cols);
      if (tail && g == row_groups - 1) tail(a, full_rows, t * cols);
    }
  }
  void finish() const {
    if (block) kn_reduce(a, sums, items);
  }
};

#ifdef __AVX512BF16__
inline Tile pair_kernel(int mb) {
  switch (mb) {
    case 1: return pair_tile<1>;
    case 2: return pair_tile<2>;
    case 3: return pair_tile<3>;
    default: return pair_tile<4>;
  }
}
#endif

template <class T>
Plan plan(const Args& a, bool transpose_w, int64_t threads) {
  Plan p;
  p.a = a;
  const int64_t M = a.M, N = a.N, K = a.K;
#ifdef __AVX512BF16__
  if (a.pk) {  // packed pairs: items of whole 64-column tiles, ~1/8 of the weight per thread, every row of x
    p.cols = ringserve::pairs::kCols;
    p.tiles = a.pk->tiles;
    const int64_t tile_bytes = a.pk->KP * p.cols * 4;
#ifdef RINGSERVE_AMX
    if (K % 32 == 0 && amx::usable()) {  // through AMX: items of tiles (within L2) x groups of 32-row blocks
      const int64_t target = std::clamp<int64_t>(p.tiles * tile_bytes / (8 * threads), 32 << 10, 256 << 10);
      p.per_item = std::max<int64_t>(1, target / tile_bytes);
      p.items = (p.tiles + p.per_item - 1) / p.per_item;
      // rows: as many groups as make 8 items a thread, and groups of at most ~512 KB of x (with
      // the item's tiles, within L2; one group for every tile read x from memory once a tile)
      const int64_t blocks = (M + 31) / 32, most = std::max<int64_t>(1, (512 << 10) / (64 * K));
      p.row_groups = std::clamp<int64_t>((8 * threads + p.items - 1) / p.items, 1, blocks);
      p.group_rows = std::min((blocks + p.row_groups - 1) / p.row_groups, most) * 32;
      p.row_groups = (M + p.group_rows - 1) / p.group_rows;
      p.items *= p.row_groups;
      p.full_rows = M;
      p.amx = true;
      return p;
    }
#endif
    const int64_t target = std::clamp<int64_t>(p.tiles * tile_bytes / (8 * threads), 32 << 10, 512 << 10);
    p.per_item = std::max<int64_t>(1, target / tile_bytes);
    p.items = (p.tiles + p.per_item - 1) / p.per_item;
    p.mb = int(std::min<int64_t>(M, 4));
    const int rest = int(M % 4);
    p.full_rows = M > 4 ? M - rest : M;
    // few tiles for many rows (a 576-column weight is 9): the rows in groups too, so that the
    // threads get items enough to end together (each tile then read once a group, from L2/L3)
    const int64_t blocks = (p.full_rows + p.mb - 1) / p.mb;
    p.row_groups = std::clamp<int64_t>((8 * threads + p.items - 1) / p.items, 1, blocks);
    p.group_rows = (blocks + p.row_groups - 1) / p.row_groups * p.mb;
    p.row_groups = (p.full_rows + p.group_rows - 1) / p.group_rows;
    p.items *= p.row_groups;
    p.main = pair_kernel(p.mb);
    p.tail = rest && M > 4 ? pair_kernel(rest) : nullptr;
    return p;
  }
#endif
  if (!transpose_w && M <= 4) {  // blocks of w's rows, each contiguous, summed across blocks at the end
    // ~64 KB and more per block, at most 8 blocks (the partial sums, f32 [M, N] a block, are
    // written, then summed by the caller alone: few, or they cost as much as int8 weights);
    // the split depends on the shapes alone, so the sums do not depend on the thread count
    const int64_t bytes = K * N * int64_t(sizeof(T));
    const int64_t want = std::clamp<int64_t>(bytes / (64 << 10), 1, 8);
    p.rows = std::min(K, ((K + want - 1) / want + 15) / 16 * 16);
    p.items = (K + p.rows - 1) / p.rows;
    p.block = M == 1 ? kn_block<1, T> : M == 2 ? kn_block<2, T> : M == 3 ? kn_block<3, T> : kn_block<4, T>;
    return p;
  }
  // Columns per tile: [K, N] kKnVectors vectors (AVX-512: 64 columns); [N, K] 8 weight rows
  // (M <= 2, or x as int16), else kNkRows; packed (kPackKn, more than one block of rows), either layout: the
  // panel's L * kKnVectors columns. Rows of x: blocks of 4 ([N, K]) or kKnRows ([K, N], panels).
  const bool packed = kPackKn && M > kKnRows && !a.xq;
  const int width = transpose_w ? (M <= 2 || a.xq ? 8 : kNkRows) : kKnVectors;
  p.cols = transpose_w && !packed ? width : L * kKnVectors;
  p.tiles = (N + p.cols - 1) / p.cols;
  // items of whole tiles, ~1/8 of the weight per thread, within 32 KB..512 KB
  const int64_t tile_bytes = std::max<int64_t>(1, p.cols * K * int64_t(sizeof(T)));
  const int64_t target = std::clamp<int64_t>(p.tiles * tile_bytes / (8 * threads), 32 << 10, 512 << 10);
  p.per_item = std::max<int64_t>(1, target / tile_bytes);
  p.items = (p.tiles + p.per_item - 1) / p.per_item;
  const int block = transpose_w && !packed ? 4 : kKnRows;
  p.mb = int(std::min<int64_t>(M, block));
  const int rest = int(M % block);
  p.full_rows = M > block ? M - rest : M;
  if (packed) {
    p.pack = packer<T>(transpose_w);
    p.pmain = kn_panel_kernel(p.mb);
    p.ptail = rest ? kn_panel_kernel(rest) : nullptr;
    return p;
  }
  p.main = transpose_w ? nk_kernel<T>(p.mb, width, a.xh != nullptr, a.xq != nullptr) : kn_kernel<T>(p.mb);
  p.tail = rest && M > block ? (transpose_w ? nk_kernel<T>(rest, width, a.xh != nullptr, a.xq != nullptr) : kn_kernel<T>(rest)) : nullptr;
  return p;
}

// The weight dtypes this build multiplies: -DRINGSERVE_WEIGHTS=1, 2 or 3 compiles the paths of f32,
// bf16 or int8 weights alone (model/compute/kernels/cpu_matmul.py builds one library per dtype, each
// under its own target: a first start builds only its own, SmolLM2 f32 3.0 CPU-s against 5.7
// for all three); unset, all of them (the tests' portable build).
#ifndef RINGSERVE_WEIGHTS
#define RINGSERVE_WEIGHTS 0
#endif
constexpr bool kWeightsF32 = RINGSERVE_WEIGHTS == 0 || RINGSERVE_WEIGHTS == 1;
constexpr bool kWeightsBf16 = RINGSERVE_WEIGHTS == 0 || RINGSERVE_WEIGHTS == 2;
constexpr bool kWeightsS8 = RINGSERVE_WEIGHTS == 0 || RINGSERVE_WEIGHTS == 3;

template <bool Built, class T>
Plan plan_if(const Args& a, bool transpose_w, int64_t threads) {
  if constexpr (Built) return plan<T>(a, transpose_w, threads);
  return Plan{};  // (not reached: the caller refuses a dtype not built)
}

// h = silu(g) * u over n bf16 values (the products' outputs, rounded), as model/compute/dots.py's
// silu_mul computes it: silu in f32 rounded to bf16, the product rounded to bf16
void gated_activation(const uint16_t* g, const uint16_t* u, uint16_t* h, size_t n) {
  size_t i = 0;
#ifdef RINGSERVE_AMX
  for (; i + 16 <= n; i += 16)
    simd::store_bf16(h + i, amx::silu_mul(simd::load(g + i), simd::load(u + i)), mask_of(16));
#endif
  for (; i < n; ++i) {
    const float x = bf16_to_f32(g[i]);
    const float sl = bf16_to_f32(f32_to_bf16(x / (1.f + std::exp(-x))));
    h[i] = f32_to_bf16(sl * bf16_to_f32(u[i]));
  }
}

// Every item of every plan in one deal to the pool; then the block sums, in block order
void run(const ringserve::ThreadPool& pool, int64_t cap, std::vector<Plan>& plans) {
  size_t need = 0;
  for (const Plan& p : plans) need += size_t(p.part_size());
  thread_local std::vector<float> part;  // reused from call to call (grows, never cleared)
  if (part.size() < need) part.resize(need);
  std::vector<int64_t> first(plans.size() + 1, 0);  // plan g's items are first[g]..first[g+1]-1
  float* sums = part.data();                         // the caller's buffer (a helper's `part` is its own)
  for (size_t g = 0; g < plans.size(); ++g) {
    plans[g].sums = sums;
    sums += plans[g].part_size();
    first[g + 1] = first[g] + plans[g].items;
  }
  ringserve::deal(pool, first.back(), cap, [&](int64_t i) {
    const size_t g = std::upper_bound(first.begin() + 1, first.end(), i) - first.begin() - 1;
    plans[g].item(i - first[g]);
  });
  for (const Plan& p : plans) p.finish();
}

// x [..., K] and G weights (then G int8 scales, or none; then the layer, for stacked weights)
// -> G results y_g = x @ w_g
XLA_FFI_Error* matmul(const ringserve::Call& call) {
  using ringserve::Buffer;
  const Buffer x = call.arg(0);
  bool transpose_w = false;
  if (!x.ok() || !call.attr("transpose_w", &transpose_w))
    return call.error("cpu_matmul: x first, and the attribute transpose_w (bool)");
  // gated (optional attribute): two weights (the gate's, the up projection's) and one result,
  // silu(x @ w0) * (x @ w1) as model/compute/dots.py's GatedMLP computes it in bf16 (`silu_mul`)
  bool gated = false;
  if (!call.attr("gated", &gated)) gated = false;
  if (gated && call.rets() != 1) return call.error("cpu_matmul: gated: the gate's and the up projection's weights, one result");
  const size_t G = gated ? 2 : size_t(call.rets());  // the weights
  // Stacked weights ([L, K, N] or [L, N, K], scales [L, N]) end the operands with the layer to
  // read (s32 scalar): the layers' scan hands the kernel the whole stack, never a slice (a
  // slice would be a copy of the layer's weights every step)
  int64_t layer = 0;
  size_t nargs = size_t(call.args() - 1);  // the operands after x
  const Buffer w0 = call.arg(1);
  const bool stacked = G > 0 && w0.ok() && w0.dimensions().size() == 3;
  if (stacked) {
    const Buffer l = call.arg(call.args() - 1);
    if (!l.ok() || l.element_type() != DataType::S32 || l.element_count() != 1)
      return call.error("cpu_matmul: the layer of stacked weights must be an s32 scalar");
    layer = *l.typed_data<const int32_t>();
    --nargs;
  }
  const bool q8 = nargs == 2 * G;
  if (G == 0 || (nargs != G && !q8))
    return call.error("cpu_matmul: x, G weights (and G scales for int8), G results");
  auto xd = x.dimensions();
  const auto xt = x.element_type();
  if (xd.size() < 1) return call.error("cpu_matmul: x [..., K], w rank 2, y [..., N]");
  if (xt != DataType::F32 && xt != DataType::BF16)
    return call.error("cpu_matmul: x and y must be f32 or bf16");
  Args a;
  a.K = xd.back();
  a.M = 1;
  for (size_t d = 0; d + 1 < xd.size(); ++d) a.M *= xd[d];
  // x as f32 and as int16 rows: made on first need, by a weight that is not read from packed
  // pairs (those read x's bf16 bits in place: widening a prefill's x first took longer than
  // AMX's products of it)
  std::vector<float> wide;
  a.xh = xt == DataType::BF16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  a.x = a.xh ? nullptr : static_cast<const float*>(x.untyped_data());
  a.xq = nullptr;
  a.xs = nullptr;
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> xs;
  bool quantize_tried = false;
  auto plain_x = [&] {
    if (!a.x) {
      wide.resize(size_t(a.M * a.K));
      for (size_t e = 0; e < wide.size(); ++e) wide[e] = bf16_to_f32(a.xh[e]);
      a.x = wide.data();
    }
    if (kQ16 && q8 && !quantize_tried) {
      quantize_tried = true;
      if (transpose_w && a.xh && a.M <= kQ16Rows && a.K % kQ16Step == 0 && a.K <= kQ16MaxK && quantize_rows(a.x, a.M, a.K, xq, xs)) {
        a.xq = xq.data();
        a.xs = xs.data();
      }
    }
  };
  static const int64_t cap = ringserve::thread_cap("RINGSERVE_MATMUL_THREADS");
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(call.pool().num_threads(), cap));
  std::vector<Plan> plans;
  std::vector<std::shared_ptr<const ringserve::pairs::Packed>> held;  // the packed pairs this call reads
  thread_local std::vector<uint16_t> xpad;                          // x padded to an even K for them
  for (size_t g = 0; g < G; ++g) {
    const Buffer w = call.arg(1 + int64_t(g)), y = call.ret(gated ? 0 : int64_t(g));
    if (!w.ok() || !y.ok()) return call.error("cpu_matmul: buffers expected");
    auto wd_all = w.dimensions(), yd = y.dimensions();
    const size_t rank = stacked ? 3 : 2;
    if (wd_all.size() != rank || yd.size() != xd.size())
      return call.error(stacked ? "cpu_matmul: x [..., K], stacked w rank 3, y [..., N]"
                                                 : "cpu_matmul: x [..., K], w rank 2, y [..., N]");
    if (stacked && (layer < 0 || layer >= wd_all[0]))
      return call.error("cpu_matmul: layer out of the stack's range");
    const int64_t wd[2] = {wd_all[rank - 2], wd_all[rank - 1]};
    a.N = transpose_w ? wd[0] : wd[1];
    if ((transpose_w ? wd[1] : wd[0]) != a.K || yd.back() != a.N)
      return call.error("cpu_matmul: inner dimensions disagree");
    const auto wt = w.element_type(), yt = y.element_type();
    if (yt != DataType::F32 && yt != DataType::BF16)
      return call.error("cpu_matmul: x and y must be f32 or bf16");
    if (q8 ? wt != DataType::S8 : (wt != DataType::F32 && wt != DataType::BF16))
      return call.error(q8 ? "cpu_matmul_q8: w must be int8" : "cpu_matmul: w must be f32 or bf16");
    a.scale = nullptr;
    if (q8) {
      const Buffer s = call.arg(1 + int64_t(G + g));
      const int64_t layers = stacked ? wd_all[0] : 1;
      if (!s.ok() || s.element_type() != DataType::F32 || int64_t(s.element_count()) != layers * a.N)
        return call.error("cpu_matmul_q8: scale must be f32 [N] ([L, N] stacked)");
      a.scale = s.typed_data<const float>() + layer * a.N;
    }
    const size_t item = wt == DataType::F32 ? 4 : wt == DataType::BF16 ? 2 : 1;
    a.w = static_cast<const char*>(w.untyped_data()) + size_t(layer) * size_t(a.K * a.N) * item;
    a.y = y.untyped_data();
    a.y_bf16 = yt == DataType::BF16;
    if (gated && (xt != DataType::BF16 || yt != DataType::BF16))
      return call.error("cpu_matmul: gated: x and the result must be bf16");
    a.pk = nullptr;
    std::shared_ptr<const ringserve::pairs::Packed> pk;  // bf16 weights: every call; int8: many rows
    if (kPairs && kWeightsBf16 && wt == DataType::BF16 && a.xh && a.M > 0)
      pk = ringserve::pairs::of(static_cast<const uint16_t*>(a.w), a.K, a.N, transpose_w);
    if (kPairs && kWeightsS8 && wt == DataType::S8 && a.xh && a.M > kS8PairRows)
      pk = ringserve::pairs::of(static_cast<const int8_t*>(a.w), a.K, a.N, transpose_w);
    if (pk) {
      a.pk = pk.get();
      held.push_back(std::move(pk));  // a release during this call frees it after
      if (a.K % 2 == 0) {
        a.xp = a.xh, a.xps = a.K;
      } else {  // the last pair's second half: 0 (an odd K's row read past its end)
        xpad.assign(size_t(a.M * (a.K + 1)), 0);
        for (int64_t m = 0; m < a.M; ++m) std::memcpy(xpad.data() + m * (a.K + 1), a.xh + m * a.K, size_t(a.K) * 2);
        a.xp = xpad.data(), a.xps = a.K + 1;
      }
    }
    if (a.M == 0 || a.N == 0) continue;
    if (a.K == 0) {  // an empty sum
      std::memset(a.y, 0, size_t(a.M * a.N) * (a.y_bf16 ? 2 : 4));
      continue;
    }
    if (!a.pk) plain_x();
    if (!(wt == DataType::F32 ? kWeightsF32 : wt == DataType::BF16 ? kWeightsBf16 : kWeightsS8))
      return call.error(wt == DataType::F32    ? "cpu_matmul: this build has no f32 weights (one build per weight dtype)"
                        : wt == DataType::BF16 ? "cpu_matmul: this build has no bf16 weights (one build per weight dtype)"
                                               : "cpu_matmul: this build has no int8 weights (one build per weight dtype)");
    plans.push_back(wt == DataType::F32    ? plan_if<kWeightsF32, float>(a, transpose_w, threads)
                    : wt == DataType::BF16 ? plan_if<kWeightsBf16, uint16_t>(a, transpose_w, threads)
                                           : plan_if<kWeightsS8, int8_t>(a, transpose_w, threads));
  }
  if (gated && plans.size() == 2) {
#ifdef RINGSERVE_AMX
    if (plans[0].amx && plans[1].amx) {  // one plan: each block summed for both weights, then silu_mul
      Plan& p = plans[0];
      p.a.gated = true;
      p.a.pk2 = plans[1].a.pk;
      p.a.scale2 = plans[1].a.scale;
      plans.pop_back();
      run(call.pool(), cap, plans);
      return nullptr;
    }
#endif
    // elsewhere: both products into bf16 buffers of their own (as XLA's would be), then silu_mul
    thread_local std::vector<uint16_t> gu;
    const size_t n = size_t(a.M * a.N);
    gu.resize(2 * n);
    uint16_t* h = static_cast<uint16_t*>(plans[0].a.y);
    plans[0].a.y = gu.data();
    plans[1].a.y = gu.data() + n;
    run(call.pool(), cap, plans);
    gated_activation(gu.data(), gu.data() + n, h, n);
    return nullptr;
  }
  run(call.pool(), cap, plans);
  return nullptr;
}

}  // namespace

// The f32 lanes of the vectors this build computes with: 16 (AVX-512), 8 (AVX2), 1 (plain
// loops); model/compute/dots.py picks how many rows the kernel takes by it.
extern "C" int ringserve_cpu_matmul_lanes() {
#ifdef RINGSERVE_SIMD
  return ringserve::simd::L;
#else
  return 1;
#endif
}

// x, then G weights, then (int8 weights) their G scales; G results
RINGSERVE_FFI_HANDLER(RingserveCpuMatmul, matmul)

// The executor's weights: `n` buffers (address, bytes) that keep their contents until it releases
// `owner` (model/compute/kernels/cpu_matmul.py `register_weights`); a bf16 [K, N] one is read from its
// packed pairs (pairs.h), made on its first call, in the memory the last reserve faulted in if
// one did. An address registered again moves to the new owner and drops what was packed from it.
extern "C" void ringserve_cpu_matmul_register(int64_t owner, const uint64_t* addrs, const uint64_t* bytes, int64_t n) {
  std::lock_guard<std::mutex> lock(ringserve::pairs::mu());
  auto arena = std::exchange(ringserve::pairs::spare(), nullptr);  // the owner's copies, side by side
  if (!arena) arena = std::make_shared<ringserve::pairs::Arena>();
  for (int64_t i = 0; i < n; ++i) ringserve::pairs::registry()[uintptr_t(addrs[i])] = {owner, size_t(bytes[i]), nullptr, arena};
}

// Fault in memory for packed copies of `sizes` bytes each, for the next register to pack into
// (model/compute/kernels/cpu_matmul.py `reserve`): returns at once, the pages come in on a thread of
// their own; chunks still coming when that register takes the arena join it as they are in. A
// reserve that no register takes is freed by the next reserve.
extern "C" void ringserve_cpu_matmul_reserve(const uint64_t* sizes, int64_t n) {
  auto arena = std::make_shared<ringserve::pairs::Arena>();
  {
    std::lock_guard<std::mutex> lock(ringserve::pairs::mu());
    ringserve::pairs::spare() = arena;
  }
  std::thread([arena, s = std::vector<uint64_t>(sizes, sizes + n)] { arena->reserve(s.data(), int64_t(s.size())); }).detach();
}

// Forget every buffer of `owner` and free its packed copies (a call still reading one keeps it
// until it returns).
extern "C" void ringserve_cpu_matmul_release(int64_t owner) {
  std::lock_guard<std::mutex> lock(ringserve::pairs::mu());
  auto& r = ringserve::pairs::registry();
  for (auto it = r.begin(); it != r.end();) it = it->second.owner == owner ? r.erase(it) : std::next(it);
}

// Bytes of packed copies held for `owner` (-1: every owner), for tests and logs.
extern "C" int64_t ringserve_cpu_matmul_packed_bytes(int64_t owner) {
  std::lock_guard<std::mutex> lock(ringserve::pairs::mu());
  int64_t total = 0;
  for (auto& [addr, r] : ringserve::pairs::registry())
    if (r.packed && (owner < 0 || r.owner == owner)) total += int64_t(r.packed->bytes());
  return total;
}

// The bytes `owner`'s arena maps (a negative owner: the reserve no register has taken yet): in
// use, and reserved not yet used
extern "C" void ringserve_cpu_matmul_arena_bytes(int64_t owner, int64_t* in_use, int64_t* reserved) {
  std::shared_ptr<ringserve::pairs::Arena> arena;
  {
    std::lock_guard<std::mutex> lock(ringserve::pairs::mu());
    arena = ringserve::pairs::spare();
    if (owner >= 0) {
      arena = nullptr;
      for (auto& [addr, r] : ringserve::pairs::registry())
        if (r.owner == owner) {
          arena = r.arena;
          break;
        }
    }
  }
  const auto b = arena ? arena->bytes() : std::pair<size_t, size_t>{0, 0};
  *in_use = int64_t(b.first);
  *reserved = int64_t(b.second);
}

// Whether this build reads registered bf16 weights from packed pairs (AVX512-BF16)
extern "C" int ringserve_cpu_matmul_pairs() { return kPairs ? 1 : 0; }

// Whether it multiplies them through AMX's tiles (built for them, and Linux lent them)
extern "C" int ringserve_cpu_matmul_amx() {
#ifdef RINGSERVE_AMX
  return amx::usable() ? 1 : 0;
#else
  return 0;
#endif
}
