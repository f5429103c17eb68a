// Paged attention on CPU as an XLA FFI custom call, on every core of XLA's own thread pool
// (model/compute/kernels/cpu_attention.py builds and registers it; model/compute/attention/cpu_kernel.py calls it).
//
//   q        [T, H, D] f32|bf16       the step's packed query tokens (RoPE applied); bf16 q with a
//                                     bf16 cache: prefill's items through vdpbf16ps where the CPU
//                                     has it (AVX512-BF16)
//   k_cache  [Hkv, L*P, D, S] f32|u16 keys, key-major within a page (the native backend's layout;
//                                     u16: bf16 bits)
//   v_cache  [Hkv, L*P, S, D] f32|u16 values
//   pages    [R, MP] i32              each row's page table in the layer's page space
//   row_start[R + 1] i32              row r owns tokens row_start[r]:row_start[r+1]
//   kv_len   [R] i32                  keys valid after this step's writes (0: a padding row)
//   positions[T] i32                  each token's position: it sees keys 0..position
//   base     [] i32                   the layer's page 0 on the caches' page axis: page id + base
//                                     (attention/base.py's AttnGeometry.layer_base)
//   window   [] i32                   the layer's sliding window: a query sees keys > position - window
//                                     (0 = none; an operand, as the scanned loop's layer is traced)
//   out      [T, H, D] f32|bf16       (tokens of padding rows: zeros; bf16: rounded to nearest even)
//   attributes: scale, softcap (scores -> softcap * tanh(scores / softcap)
//               after scaling, Gemma 2's; 0 = none)
//
// Work items are (row, KV head, block of up to 8 query tokens); each walks its row's pages in
// order with an online softmax, so a query's sums are the same whatever else is in the batch.
// Items are dealt to the calling thread and to helpers on XLA's intra-op pool (pool.h).
//
// The pair layouts (bf16 caches where the CPU has AVX512-BF16: model/compute/attention/cpu_kernel.py
// picks them, pages of 16 keys, head dims of 32s): each page holds the two values vdpbf16ps and
// AMX multiply together side by side, so a page is read as the instructions' operand as it is
//
//   k_cache  [Hkv, L*P, D/2, 16, 2] u16   row p of a page: (k[2p][s], k[2p+1][s]) for its 16 keys
//   v_cache  [Hkv, L*P, 8, D, 2] u16      row j of a page: (v[2j][d], v[2j+1][d]) for every dim
//
// and an item (up to 16 queries: a row's tokens x the KV head's G query heads) runs in two
// passes over its row's keys (`pairs_item`): every score (q.k, exact bf16 products summed in
// f32, then scaled), the softmax over all of a query's visible keys at once, its probabilities
// rounded to bf16 (as HF's bf16 attention rounds softmax's output), then their sums with the
// values. With AMX the products run in its tiles (a page's 32 dims of K are a B tile as they
// lie; two pages of V copied side by side are four); elsewhere through vdpbf16ps. A query's
// sums do not depend on the other queries of its item, nor on how its row was cut into steps.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16.h"
#include "pool.h"
#include "simd.h"
#include "xla_call.h"

using ringserve::DataType;

namespace {

using ringserve::bf16_to_f32;

constexpr int kBlock = 8;          // query tokens per work item
constexpr int kPagesAhead = 2;     // a row's pages are prefetched this far ahead of the one read
constexpr int kDpQueries = 8;      // the fewest queries of an item that go through vdpbf16ps
constexpr float kNegInf = -1e30f;  // finite: a fully masked query gives zeros, not NaN

struct Args {
  const void* q;
  bool q_bf16;  // q holds bf16 bits (else f32)
  const void* k;
  const void* v;
  bool bits;  // caches hold bf16 bits
  const int32_t *pages, *row_start, *kv_len, *positions;
  void* out;     // [T, H, D] f32, or bf16 (`out_bf16`: a bf16 model's, rounded to nearest even)
  bool out_bf16;
  int64_t T, H, D, Hkv, S, MP, R;
  int64_t layer_offset;  // the layer's base page
  int64_t pages_per_head;  // L * P: the caches' second axis
  int64_t window;
  float scale;
  float softcap;  // 0: none
  bool pairs = false;  // the pair layouts (bf16 bits; pages of 16, D a multiple of 32)
};

struct Item {
  int32_t row, head, t0, t1;
};

#ifdef RINGSERVE_SIMD
namespace simd = ringserve::simd;
constexpr int L = simd::L;
constexpr int kPageVectors = 16 / L;  // vectors of one key row's 16 scores (a page's keys)

// L cache values at p + i as f32: f32 caches loaded, bf16 ones (BITS) widened in the register
// (exact: bf16 is f32's upper half), so a page is never copied out to be widened first.
template <bool BITS>
inline simd::V load_page(const void* p, int64_t i) {
  if constexpr (BITS)
    return simd::load(static_cast<const uint16_t*>(p) + i);
  else
    return simd::load(static_cast<const float*>(p) + i);
}

// NB queries' scores against one page of 16 keys (k: [D, 16]) into s [NB, 16]: NB accumulators
// (of kPageVectors vectors), one per query, each an independent FMA chain over the head dim.
template <int NB, int DC, bool BITS>
inline void scores16(const float* q, const void* k, float* s) {
  simd::V r[NB][kPageVectors];
  for (int b = 0; b < NB; ++b)
    for (int h = 0; h < kPageVectors; ++h) r[b][h] = simd::zero();
  for (int64_t d = 0; d < DC; ++d) {
    simd::V kr[kPageVectors];
    for (int h = 0; h < kPageVectors; ++h) kr[h] = load_page<BITS>(k, d * 16 + h * L);
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < kPageVectors; ++h) r[b][h] = simd::fma(simd::set1(q[b * DC + d]), kr[h], r[b][h]);
  }
  for (int b = 0; b < NB; ++b)
    for (int h = 0; h < kPageVectors; ++h) simd::store(s + b * 16 + h * L, r[b][h]);
}
// queries scored together: 8 accumulators hide the FMA latency; AVX2 holds 4 (2 vectors each)
constexpr int kScoreBlock = L == 16 ? 8 : 4;

// nqp queries' scores (nqp <= kScoreBlock exactly, a decode token's G heads with no padding
// query; more: a multiple of kScoreBlock)
template <int DC, bool BITS>
inline void scores_all(const float* qs, const void* k, float* s, int64_t nqp) {
  switch (nqp) {
    case 1: return scores16<1, DC, BITS>(qs, k, s);
    case 2: return scores16<2, DC, BITS>(qs, k, s);
    case 3: return scores16<3, DC, BITS>(qs, k, s);
    case 4: return scores16<4, DC, BITS>(qs, k, s);
    default: break;
  }
  if constexpr (kScoreBlock == 8) switch (nqp) {
      case 5: return scores16<5, DC, BITS>(qs, k, s);
      case 6: return scores16<6, DC, BITS>(qs, k, s);
      case 7: return scores16<7, DC, BITS>(qs, k, s);
      default: break;
    }
  for (int64_t q0 = 0; q0 < nqp; q0 += kScoreBlock) scores16<kScoreBlock, DC, BITS>(qs + q0 * DC, k, s + q0 * 16);
}

#ifdef __AVX512BF16__
// bf16 queries (bits qh [NB, DC], unscaled) against a bf16 page of 16 keys (k: [DC, 16] bits)
// into s [NB, 16] = scale * q.k: vdpbf16ps multiplies a pair of dims exactly and adds both
// products to the key's f32 lane, so a page takes DC/2 instructions a query where widening
// then FMAs took DC (rows d and d+1 of the page are one 64-byte load, interleaved by one
// vpermw into (k[d][j], k[d+1][j]) pairs; bf16 values below f32's normal range flush to zero)
template <int NB, int DC>
inline void scores16_dp(const uint16_t* qh, const uint16_t* k, float* s, float scale) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // fmt: skip
  __m512 r[NB];
  for (int b = 0; b < NB; ++b) r[b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < DC; d += 2) {
    const __m512bh kk = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(k + d * 16));
    for (int b = 0; b < NB; ++b) {
      int32_t qq;
      std::memcpy(&qq, qh + b * DC + d, 4);
      r[b] = _mm512_dpbf16_ps(r[b], (__m512bh)_mm512_set1_epi32(qq), kk);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + b * 16, _mm512_mul_ps(r[b], sc));
}

// nqp (a multiple of 8) queries' scores, 8 at a time
template <int DC>
inline void scores_all_dp(const uint16_t* qh, const uint16_t* k, float* s, int64_t nqp, float scale) {
  for (int64_t q0 = 0; q0 < nqp; q0 += 8) scores16_dp<8, DC>(qh + q0 * DC, k, s + q0 * 16, scale);
}
constexpr bool kScoreDp = true;  // bf16 q against bf16 pages through vdpbf16ps

// acc rows q0..q0+QB-1 += their probabilities, rounded to bf16 (ph [nqp, 16] bits), x the bf16
// page's values (v: [16, DC] bits), through vdpbf16ps along the keys: rows 2i and 2i+1 of the
// page interleaved 16-bit-wise (vpermt2w) into (v[2i][c], v[2i+1][c]) pairs, 8 instructions a
// query for every 16 columns where widening then FMAs took 16 (HF's bf16 attention multiplies
// bf16 probabilities too)
template <int QB, int DC>
inline void values_rows_dp(const uint16_t* ph, const uint16_t* v, float* acc, int64_t q0) {
  constexpr int W = DC / 32;  // 32 bf16 a zmm: vectors of one value row
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);  // fmt: skip
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  __m512 o[QB][2 * W];
  for (int b = 0; b < QB; ++b)
    for (int c = 0; c < 2 * W; ++c) o[b][c] = _mm512_loadu_ps(acc + (q0 + b) * DC + c * 16);
  for (int j = 0; j < 16; j += 2) {
    __m512bh vp[2 * W];
    for (int w = 0; w < W; ++w) {
      const __m512i r0 = _mm512_loadu_si512(v + j * DC + w * 32), r1 = _mm512_loadu_si512(v + (j + 1) * DC + w * 32);
      vp[2 * w] = (__m512bh)_mm512_permutex2var_epi16(r0, lo, r1);
      vp[2 * w + 1] = (__m512bh)_mm512_permutex2var_epi16(r0, hi, r1);
    }
    for (int b = 0; b < QB; ++b) {
      int32_t pp;
      std::memcpy(&pp, ph + (q0 + b) * 16 + j, 4);
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp);
      for (int c = 0; c < 2 * W; ++c) o[b][c] = _mm512_dpbf16_ps(o[b][c], pb, vp[c]);
    }
  }
  for (int b = 0; b < QB; ++b)
    for (int c = 0; c < 2 * W; ++c) _mm512_storeu_ps(acc + (q0 + b) * DC + c * 16, o[b][c]);
}

// nqp (a multiple of 4) queries' outputs, 4 at a time
template <int DC>
inline void values16_dp(const float* s, uint16_t* ph, const uint16_t* v, float* acc, int64_t nqp) {
  for (int64_t q = 0; q < nqp; ++q)  // the probabilities to bf16, nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + q * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + q * 16)));
  for (int64_t q0 = 0; q0 < nqp; q0 += 4) values_rows_dp<4, DC>(ph, v, acc, q0);
}
#else
constexpr bool kScoreDp = false;
#endif

// The queries' outputs (acc [nqp, DC]) += their probabilities (s [nqp, 16]) x the page's values
// (v: [16, DC]), QB queries' CW vectors of columns held in registers over the page's keys.
template <int DC>
constexpr int kValueCols = L == 16 ? DC / L : (DC / L) % 4 == 0 ? 4 : (DC / L) % 2 == 0 ? 2 : 1;  // AVX2: 16 registers
template <int DC>
constexpr int kValueRows = L == 16 ? (DC / L <= 4 ? 4 : 2) : 2;  // query rows a block

// rows q0..q0+QB-1 of acc += their probabilities x the page's values, CW vectors of columns a pass
template <int QB, int DC, bool BITS>
inline void values_rows(const float* s, const void* v, float* acc, int64_t q0) {
  constexpr int V = DC / L, CW = kValueCols<DC>;
  for (int c0 = 0; c0 < V; c0 += CW) {
    simd::V o[QB][CW];
    for (int b = 0; b < QB; ++b)
      for (int c = 0; c < CW; ++c) o[b][c] = simd::load(acc + (q0 + b) * DC + (c0 + c) * L);
    for (int j = 0; j < 16; ++j) {
      simd::V vv[CW];
      for (int c = 0; c < CW; ++c) vv[c] = load_page<BITS>(v, j * DC + (c0 + c) * L);
      for (int b = 0; b < QB; ++b) {
        const simd::V p = simd::set1(s[(q0 + b) * 16 + j]);
        for (int c = 0; c < CW; ++c) o[b][c] = simd::fma(p, vv[c], o[b][c]);
      }
    }
    for (int b = 0; b < QB; ++b)
      for (int c = 0; c < CW; ++c) simd::store(acc + (q0 + b) * DC + (c0 + c) * L, o[b][c]);
  }
}

template <int DC, bool BITS>
inline void values16(const float* s, const void* v, float* acc, int64_t nqp) {
  constexpr int QB = kValueRows<DC>;
  int64_t q0 = 0;
  for (; q0 + QB <= nqp; q0 += QB) values_rows<QB, DC, BITS>(s, v, acc, q0);
  switch (nqp - q0) {  // the last rows (a decode token's G heads need not fill a block)
    case 1: return values_rows<1, DC, BITS>(s, v, acc, q0);
    case 2: if constexpr (QB > 2) return values_rows<2, DC, BITS>(s, v, acc, q0); break;
    case 3: if constexpr (QB > 3) return values_rows<3, DC, BITS>(s, v, acc, q0); break;
    default: break;
  }
}
constexpr bool kRegisterPages = true;  // 16-key pages of a head dim of 16s read straight from the cache
#else
constexpr bool kRegisterPages = false;
constexpr bool kScoreDp = false;
#endif

// One work item: queries t0..t1-1 of row `row`, the G query heads of KV head `head`. SC, DC:
// the page size and head dim when known at compile time (the common 16 x 64 and 16 x 128),
// else 0 (read from `a`): fixed trip counts let the compiler keep a page's 16 scores in one
// vector and unroll the head dim.
template <int SC, int DC>
void run_item(const Args& a, const Item& it, std::vector<float>& scratch) {
  const int64_t G = a.H / a.Hkv;
  const int64_t D = DC ? DC : a.D, S = SC ? SC : a.S;
  const int64_t nq = int64_t(it.t1 - it.t0) * G;
  // 16-key pages of a head dim of 16s are read straight from the cache: no f32 page buffers
  constexpr bool in_registers = kRegisterPages && SC == 16 && DC > 0 && DC % 16 == 0;
  // rows padded (zeros) for the register blocks: none up to 8 queries (a decode token's G
  // heads) in registers, else to 8 (the generic paths: blocks of 4 and 2)
  const int64_t nqp = in_registers && nq <= 8 ? nq : nq <= 4 ? 4 : (nq + 7) / 8 * 8;
  // bf16 q and bf16 pages, 8 queries or more (prefill): scores and values through vdpbf16ps
  // (qh: q's bits; ph: a page's probabilities rounded to bf16). SmolLM2's attention, one
  // process, alternated (bench.cpu_attention, bf16): a 512-token prefill 80.0 -> 56.0 ms a step
  // (30 layers); but a decode token's 3 heads 22.8 -> 24.6 ms (64 rows x 256 keys): the pairs'
  // interleaving serves too few queries there, so fewer keep the f32 FMAs
  const bool dp = kScoreDp && in_registers && a.q_bf16 && a.bits && nqp >= kDpQueries;
  thread_local std::vector<uint16_t> qh, ph;  // q's bits [nqp, D]; a page's probabilities as bf16 [nqp, 16]
  if (dp) {
    qh.assign(size_t(nqp * D), 0);
    ph.assign(size_t(nqp * 16), 0);
  }
  scratch.assign(size_t(nqp * (2 * D + 2 + S) + (in_registers ? 0 : 2 * S * D)), 0.f);
  float* acc = scratch.data();        // [nqp, D]
  float* qs = acc + nqp * D;          // [nqp, D] the queries, scaled
  float* m = qs + nqp * D;            // [nqp] running max
  float* l = m + nqp;                 // [nqp] running denominator
  float* s = l + nqp;                 // [nqp, S] this page's scores, then probabilities
  float* kbuf = in_registers ? nullptr : s + nqp * S;  // [D, S] the page's keys as f32
  float* vbuf = in_registers ? nullptr : kbuf + D * S;  // [S, D] the page's values as f32
  int32_t max_pos = 0, min_pos = INT32_MAX;
  for (int32_t t = it.t0; t < it.t1; ++t) {
    max_pos = std::max(max_pos, a.positions[t]);
    min_pos = std::min(min_pos, a.positions[t]);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = int64_t(t - it.t0) * G + g;
      const int64_t at = (int64_t(t) * a.H + int64_t(it.head) * G + g) * D;
      if (a.q_bf16) {
        const uint16_t* qv = static_cast<const uint16_t*>(a.q) + at;
        if (dp)
          std::memcpy(qh.data() + qi * D, qv, size_t(D) * 2);
        else
          for (int64_t d = 0; d < D; ++d) qs[qi * D + d] = bf16_to_f32(qv[d]) * a.scale;
      } else {
        const float* qv = static_cast<const float*>(a.q) + at;
        for (int64_t d = 0; d < D; ++d) qs[qi * D + d] = qv[d] * a.scale;
      }
      m[qi] = kNegInf;
    }
  }
  const int32_t kv_len = a.kv_len[it.row];
  max_pos = std::min<int32_t>(max_pos, kv_len - 1);
  const int64_t first_key = a.window > 0 ? std::max<int64_t>(0, int64_t(min_pos) - a.window + 1) : 0;
  const int32_t* table = a.pages + int64_t(it.row) * a.MP;
  const size_t page_elems = size_t(D * S);
  const size_t page_bytes = page_elems * (a.bits ? 2 : 4);
  // k_cache [Hkv, L*P, D, S] and v_cache [Hkv, L*P, S, D]: page pg of the row, KV head `head`,
  // in the cache's own dtype
  auto page_at = [&](const void* cache, int64_t pg) {
    const size_t page = size_t(it.head) * size_t(a.pages_per_head) + size_t(int64_t(table[pg]) + a.layer_offset);
    return static_cast<const char*>(cache) + page * page_bytes;
  };
  for (int64_t pg = first_key / S; pg * S <= max_pos; ++pg) {
    // the page after next is elsewhere in memory: ask for it now, into L2. SmolLM2's decode
    // attention (64 rows x 256 keys, bf16 pages scattered over 30 layers' pool, bench.cpu_attention,
    // one process, alternated): 30.7 -> 25.1 ms a step against the next page into L1
    if ((pg + kPagesAhead) * S <= max_pos) {
      const char *nk = page_at(a.k, pg + kPagesAhead), *nv = page_at(a.v, pg + kPagesAhead);
      for (size_t b = 0; b < page_bytes; b += 64) {
        __builtin_prefetch(nk + b, 0, 2);
        __builtin_prefetch(nv + b, 0, 2);
      }
    }
    const char *kraw = page_at(a.k, pg), *vraw = page_at(a.v, pg);  // the register paths read these
    const float *kpage = kbuf, *vpage = vbuf;  // what the generic paths read: f32 pages
    if (!a.bits) {  // f32 caches are read in place
      kpage = reinterpret_cast<const float*>(kraw);
      vpage = reinterpret_cast<const float*>(vraw);
    } else if (!in_registers) {  // bf16 ones widened here
      const uint16_t* kp = reinterpret_cast<const uint16_t*>(kraw);
      const uint16_t* vp = reinterpret_cast<const uint16_t*>(vraw);
      for (size_t e = 0; e < page_elems; ++e) kbuf[e] = bf16_to_f32(kp[e]);
      for (size_t e = 0; e < page_elems; ++e) vbuf[e] = bf16_to_f32(vp[e]);
    }
    // scores of every query at once: each key row kpage[d] is read once for all of them
#ifdef RINGSERVE_SIMD
    if constexpr (in_registers) {  // 8 (or 4) queries' 16 scores in registers over the head dim
#ifdef __AVX512BF16__
      if (dp)
        scores_all_dp<DC>(qh.data(), reinterpret_cast<const uint16_t*>(kraw), s, nqp, a.scale);
      else
#endif
      if (a.bits) scores_all<DC, true>(qs, kraw, s, nqp); else scores_all<DC, false>(qs, kraw, s, nqp);
    } else
#endif
    if constexpr (SC > 0 && DC > 0) {  // 4 queries' 16 scores held in registers over the head dim
      for (int64_t q0 = 0; q0 < nqp; q0 += 4) {
        float r[4][SC] = {};
        const float* qb = qs + q0 * DC;
        for (int64_t d = 0; d < DC; ++d) {
          const float* kr = kpage + d * SC;
          for (int b = 0; b < 4; ++b) {
            const float qd = qb[b * DC + d];
            for (int j = 0; j < SC; ++j) r[b][j] += qd * kr[j];
          }
        }
        for (int b = 0; b < 4; ++b)
          for (int j = 0; j < SC; ++j) s[(q0 + b) * SC + j] = r[b][j];
      }
    } else {
      for (int64_t e = 0; e < nq * S; ++e) s[e] = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float* kr = kpage + d * S;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float qd = qs[qi * D + d];
          float* sc = s + qi * S;
          for (int64_t j = 0; j < S; ++j) sc[j] += qd * kr[j];
        }
      }
    }
    const int64_t key0 = pg * S;
    for (int32_t t = it.t0; t < it.t1; ++t) {
      const int32_t pos = a.positions[t];
      const int64_t lo = a.window > 0 ? int64_t(pos) - a.window + 1 : 0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qi = int64_t(t - it.t0) * G + g;
        float* sc = s + qi * S;
        if (a.softcap > 0.f)
          for (int64_t j = 0; j < S; ++j) sc[j] = a.softcap * std::tanh(sc[j] / a.softcap);
        float pmax = kNegInf;
        if (key0 + S - 1 <= pos && key0 >= lo && key0 + S <= kv_len) {  // the whole page is visible
#pragma omp simd reduction(max : pmax)
          for (int64_t j = 0; j < S; ++j) pmax = std::max(pmax, sc[j]);
        } else {
          for (int64_t j = 0; j < S; ++j) {
            const int64_t key = key0 + j;
            const bool ok = key <= pos && key >= lo && key < kv_len;
            sc[j] = ok ? sc[j] : kNegInf;
            pmax = std::max(pmax, sc[j]);
          }
        }
        const float m_new = std::max(m[qi], pmax);
        float sum = 0.f;
        // exp of every score, then the masked ones zeroed: a loop without a branch around the
        // exp is vectorised (libmvec's 16-wide expf under -ffast-math; a scalar expf per score
        // was most of an extend step's attention)
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < S; ++j) {
          const float e = std::exp(sc[j] - m_new);
          const float p = sc[j] <= kNegInf ? 0.f : e;
          sc[j] = p;
          sum += p;
        }
        if (m_new > m[qi]) {  // a new running max rescales what is summed so far
          const float corr = std::exp(m[qi] - m_new);
          l[qi] = l[qi] * corr + sum;
          float* ac = acc + qi * D;
          for (int64_t d = 0; d < D; ++d) ac[d] *= corr;
        } else {
          l[qi] += sum;
        }
        m[qi] = m_new;
      }
    }
    // values: each value row vpage[j] is read once for every query
#ifdef RINGSERVE_SIMD
    if constexpr (in_registers) {  // QB queries' outputs in registers over the keys
#ifdef __AVX512BF16__
      if (dp)
        values16_dp<DC>(s, ph.data(), reinterpret_cast<const uint16_t*>(vraw), acc, nqp);
      else
#endif
      if (a.bits) values16<DC, true>(s, vraw, acc, nqp); else values16<DC, false>(s, vraw, acc, nqp);
    } else
#endif
    if constexpr (SC > 0 && DC > 0) {  // 2 queries' outputs held in registers over the page's keys
      for (int64_t q0 = 0; q0 < nqp; q0 += 2) {  // padded rows have p = 0 (their scores stay 0s)
        float o[2][DC];
        for (int b = 0; b < 2; ++b)
          for (int d = 0; d < DC; ++d) o[b][d] = acc[(q0 + b) * DC + d];
        for (int j = 0; j < SC; ++j) {
          const float* vr = vpage + j * DC;
          const float p0 = s[q0 * SC + j], p1 = s[(q0 + 1) * SC + j];
          for (int d = 0; d < DC; ++d) {
            o[0][d] += p0 * vr[d];
            o[1][d] += p1 * vr[d];
          }
        }
        for (int b = 0; b < 2; ++b)
          for (int d = 0; d < DC; ++d) acc[(q0 + b) * DC + d] = o[b][d];
      }
    } else {
      for (int64_t j = 0; j < S; ++j) {
        const float* vr = vpage + j * D;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float p = s[qi * S + j];
          float* ac = acc + qi * D;
          for (int64_t d = 0; d < D; ++d) ac[d] += p * vr[d];
        }
      }
    }
  }
  for (int32_t t = it.t0; t < it.t1; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = int64_t(t - it.t0) * G + g;
      const int64_t at = (int64_t(t) * a.H + int64_t(it.head) * G + g) * D;
      const float inv = l[qi] > 0.f ? 1.f / l[qi] : 0.f;
      if (a.out_bf16)
        for (int64_t d = 0; d < D; ++d) static_cast<uint16_t*>(a.out)[at + d] = ringserve::f32_to_bf16(acc[qi * D + d] * inv);
      else
        for (int64_t d = 0; d < D; ++d) static_cast<float*>(a.out)[at + d] = acc[qi * D + d] * inv;
    }
  }
}

#ifdef __AVX512BF16__
// ---- the pair layouts -----------------------------------------------------------------------

constexpr int64_t kPairQueries = 32;  // the most queries of an item (two AMX tiles of rows)

inline void prefetch_page(const void* p, size_t bytes) {
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}

// The item's scores [16, ld] f32 (rows past its queries: zeros' products; unscaled) for pages
// p0..p0+np-1 of its row: qh [16, DC] bf16 queries; kpage(i): page p0+i's keys in the pair layout;
// ahead(i) as page i's keys are read (prefetches)
template <int DC, class KPage, class Ahead>
void pair_scores(const uint16_t* qh, int64_t nq, KPage kpage, Ahead ahead, int64_t np, float* sc, int64_t ld) {
#ifdef RINGSERVE_AMX
  if (ringserve::amx::usable() && nq > 16) {
    // 32 queries: C tiles 0-1 rows 0-15 x two pages' keys, 2-3 rows 16-31; A 4-5: their 32 dims
    // of q at a step; B 6-7: the two pages' (a page past the last: zeros)
    alignas(64) static const uint16_t zeros[16 * 32] = {};
    for (int64_t c = 0; c < np; c += 2) {
      ahead(c);
      if (c + 1 < np) ahead(c + 1);
      ringserve::amx::zero_2x2();
      for (int64_t dc = 0; dc < DC / 32; ++dc) {
        const int64_t rows = dc * 16 * 32;  // the pages' pair rows 16 dc.. (32 u16 each)
        _tile_loadd(4, qh + dc * 32, DC * 2);
        _tile_loadd(5, qh + 16 * DC + dc * 32, DC * 2);
        _tile_loadd(6, kpage(c) + rows, 64);
        _tile_loadd(7, c + 1 < np ? kpage(c + 1) + rows : zeros, 64);
        ringserve::amx::dp_2x2();
      }
      ringserve::amx::store_2x2(sc + c * 16, ld * 4);
    }
    return;
  }
  if (ringserve::amx::usable()) {  // C tiles 0-3: 4 pages' 16 keys; A 4: 32 dims of q; B 5-7: those of a page
    for (int64_t c = 0; c < np; c += 4) {
      const int64_t cnt = std::min<int64_t>(4, np - c);
      for (int64_t i = c; i < std::min(np, c + 4); ++i) ahead(i);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t dc = 0; dc < DC / 32; ++dc) {
        _tile_loadd(4, qh + dc * 32, DC * 2);
        const int64_t rows = dc * 16 * 32;  // the page's pair rows 16 dc.. (32 u16 each)
        _tile_loadd(5, kpage(c) + rows, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (cnt > 1) {
          _tile_loadd(6, kpage(c + 1) + rows, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (cnt > 2) {
          _tile_loadd(7, kpage(c + 2) + rows, 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (cnt > 3) {
          _tile_loadd(5, kpage(c + 3) + rows, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, sc + c * 16, ld * 4);
      _tile_stored(1, sc + c * 16 + 16, ld * 4);
      _tile_stored(2, sc + c * 16 + 32, ld * 4);
      _tile_stored(3, sc + c * 16 + 48, ld * 4);
    }
    return;
  }
#endif
  // vdpbf16ps: a page's pair row p is 16 keys' dims 2p, 2p+1; 4 queries' 16 scores in registers
  for (int64_t q0 = 0; q0 < nq; q0 += 4) {
    const int64_t nb = std::min<int64_t>(4, nq - q0);
    for (int64_t i = 0; i < np; ++i) {
      if (q0 == 0) ahead(i);
      const uint16_t* k = kpage(i);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t p = 0; p < DC / 2; ++p) {
        const __m512bh kr = (__m512bh)_mm512_loadu_si512(k + p * 32);
        for (int b = 0; b < 4; ++b) {
          if (b >= nb) break;
          int32_t qq;
          std::memcpy(&qq, qh + (q0 + b) * DC + 2 * p, 4);
          acc[b] = _mm512_dpbf16_ps(acc[b], (__m512bh)_mm512_set1_epi32(qq), kr);
        }
      }
      for (int b = 0; b < nb; ++b) _mm512_storeu_ps(sc + (q0 + b) * ld + i * 16, acc[b]);
    }
  }
}

// The item's outputs [16, DC] f32 = its probabilities (ph [16, ldp] bf16, normalised; zeros past
// its keys and queries) x the values of pages p0..p0+np-1 (vpage(i): the pair layout)
template <int DC, class VPage>
void pair_values(const uint16_t* ph, int64_t ldp, int64_t nq, VPage vpage, int64_t np, float* o) {
#ifdef RINGSERVE_AMX
  if (ringserve::amx::usable() && nq > 16) {
    // 32 queries, 32 dims a pass: C tiles 0-1 rows 0-15 x 16 dims each, 2-3 rows 16-31; A 4-5:
    // those rows' probabilities of 32 keys; B 6-7: two pages' values of the pass's dims, copied
    // side by side (16 key pairs, 128 bytes a row; zeros past the last page)
    thread_local std::vector<uint16_t> vb;
    vb.resize(16 * 32 * 2);
    for (int64_t dh = 0; dh < DC / 32; ++dh) {
      ringserve::amx::zero_2x2();
      for (int64_t i = 0; i < np; i += 2) {
        for (int64_t h = 0; h < 2; ++h) {
          uint16_t* dst = vb.data() + h * 8 * 64;
          if (i + h < np) {
            const uint16_t* src = vpage(i + h) + dh * 64;
            for (int64_t j = 0; j < 8; ++j) std::memcpy(dst + j * 64, src + j * DC * 2, 128);
          } else {
            std::memset(dst, 0, 8 * 128);
          }
        }
        _tile_loadd(4, ph + i * 16, ldp * 2);
        _tile_loadd(5, ph + 16 * ldp + i * 16, ldp * 2);
        _tile_loadd(6, vb.data(), 128);
        _tile_loadd(7, vb.data() + 32, 128);
        ringserve::amx::dp_2x2();
      }
      ringserve::amx::store_2x2(o + dh * 32, DC * 4);
    }
    return;
  }
  if (ringserve::amx::usable()) {
    // two pages' values side by side: B tiles of 16 key pairs x 16 dims, a row of PASS dims
    // (PASS * 4 bytes) a pair (64 dims a pass: C tiles 0-3 hold 16 queries x 64 dims, or 0-1
    // for 32; A 4: 32 keys' probabilities)
    constexpr int64_t PASS = DC < 64 ? DC : 64, NB = PASS / 16;
    thread_local std::vector<uint16_t> vb;
    vb.resize(16 * PASS * 2);
    for (int64_t dh = 0; dh < DC / PASS; ++dh) {
      _tile_zero(0);
      _tile_zero(1);
      if constexpr (NB == 4) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t i = 0; i < np; i += 2) {
        for (int64_t h = 0; h < 2; ++h) {  // page i + h's 8 key pairs, dims PASS dh.. (zeros past the last page)
          uint16_t* dst = vb.data() + h * 8 * PASS * 2;
          if (i + h < np) {
            const uint16_t* src = vpage(i + h) + dh * PASS * 2;
            for (int64_t j = 0; j < 8; ++j) std::memcpy(dst + j * PASS * 2, src + j * DC * 2, PASS * 4);
          } else {
            std::memset(dst, 0, 8 * PASS * 4);
          }
        }
        _tile_loadd(4, ph + i * 16, ldp * 2);
        _tile_loadd(5, vb.data(), PASS * 4);
        _tile_loadd(6, vb.data() + 32, PASS * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        if constexpr (NB == 4) {
          _tile_loadd(7, vb.data() + 64, PASS * 4);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, vb.data() + 96, PASS * 4);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, o + dh * PASS, DC * 4);
      _tile_stored(1, o + dh * PASS + 16, DC * 4);
      if constexpr (NB == 4) {
        _tile_stored(2, o + dh * PASS + 32, DC * 4);
        _tile_stored(3, o + dh * PASS + 48, DC * 4);
      }
    }
    return;
  }
#endif
  // vdpbf16ps: a page's pair row j is keys 2j, 2j+1 for every dim; 2 queries x DC/16 vectors
  constexpr int V = DC / 16;
  for (int64_t q0 = 0; q0 < nq; q0 += 2) {
    const int64_t nb = std::min<int64_t>(2, nq - q0);
    __m512 acc[2][V];
    for (int b = 0; b < 2; ++b)
      for (int c = 0; c < V; ++c) acc[b][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < np; ++i) {
      const uint16_t* v = vpage(i);
      for (int64_t j = 0; j < 8; ++j) {
        __m512bh vr[V];
        for (int c = 0; c < V; ++c) vr[c] = (__m512bh)_mm512_loadu_si512(v + j * DC * 2 + c * 32);
        for (int b = 0; b < 2; ++b) {
          if (b >= nb) break;
          int32_t pp;
          std::memcpy(&pp, ph + (q0 + b) * ldp + i * 16 + 2 * j, 4);
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(pp);
          for (int c = 0; c < V; ++c) acc[b][c] = _mm512_dpbf16_ps(acc[b][c], pb, vr[c]);
        }
      }
    }
    for (int b = 0; b < nb; ++b)
      for (int c = 0; c < V; ++c) _mm512_storeu_ps(o + (q0 + b) * DC + c * 16, acc[b][c]);
  }
}

// One item in the pair layouts: queries t0..t1-1 of row `row` x the G query heads of KV head
// `head` (at most kPairQueries), in two passes over the row's pages (the header's account)
template <int DC>
void pairs_item(const Args& a, const Item& it) {
  constexpr int64_t S = 16;
  const int64_t G = a.H / a.Hkv;
  const int64_t nq = int64_t(it.t1 - it.t0) * G;
  thread_local std::vector<uint16_t> qh, ph;
  thread_local std::vector<float> sc, o;
  // rows past the item's queries hold whatever they held: a tile row's products and sums reach
  // only that row of the result, which is never read (no zeroing a decode item's 13 of 16 rows)
  qh.resize(size_t(kPairQueries * DC));
  int32_t max_pos = 0, min_pos = INT32_MAX;
  for (int32_t t = it.t0; t < it.t1; ++t) {
    max_pos = std::max(max_pos, a.positions[t]);
    min_pos = std::min(min_pos, a.positions[t]);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = int64_t(t - it.t0) * G + g, at = (int64_t(t) * a.H + int64_t(it.head) * G + g) * DC;
      if (a.q_bf16)
        std::memcpy(qh.data() + qi * DC, static_cast<const uint16_t*>(a.q) + at, DC * 2);
      else
        for (int64_t d = 0; d < DC; ++d) qh[size_t(qi * DC + d)] = ringserve::f32_to_bf16(static_cast<const float*>(a.q)[at + d]);
    }
  }
  const int32_t kv_len = a.kv_len[it.row];
  max_pos = std::min<int32_t>(max_pos, kv_len - 1);
  if (max_pos < 0) return;  // (outputs stay zeros)
  const int64_t first_key = a.window > 0 ? std::max<int64_t>(0, int64_t(min_pos) - a.window + 1) : 0;
  const int64_t p0 = first_key / S, np = max_pos / S - p0 + 1, nk = np * S;
  const int64_t ld = (nk + 63) / 64 * 64, ldp = (nk + 31) / 32 * 32;
  const int32_t* table = a.pages + int64_t(it.row) * a.MP;
  const size_t page_elems = size_t(DC * S);
  auto page_of = [&](const void* cache, int64_t i) {
    const size_t page = size_t(it.head) * size_t(a.pages_per_head) + size_t(int64_t(table[p0 + i]) + a.layer_offset);
    return static_cast<const uint16_t*>(cache) + page * page_elems;
  };
#ifdef RINGSERVE_AMX
  std::optional<ringserve::amx::Tiles> tiles;  // both passes' tiles, configured once an item
  if (ringserve::amx::usable()) tiles.emplace();
#endif
  sc.resize(size_t(kPairQueries * ld));
  // pages ahead of the one scored are elsewhere in memory: asked for into L2, the values' too
  // (the second pass reads them)
  for (int64_t i = 0; i < std::min<int64_t>(np, 4); ++i) prefetch_page(page_of(a.k, i), page_elems * 2);
  auto ahead = [&](int64_t i) {  // page i's keys are being scored: ask for those 4 pages on, and its values
    if (i + 4 < np) prefetch_page(page_of(a.k, i + 4), page_elems * 2);
    prefetch_page(page_of(a.v, i), page_elems * 2);
  };
  pair_scores<DC>(qh.data(), nq, [&](int64_t i) { return page_of(a.k, i); }, ahead, np, sc.data(), ld);
  // the softmax of each query over its visible keys, normalised, rounded to bf16 (nearest even)
  ph.resize(size_t(kPairQueries * ldp));
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int32_t pos = a.positions[it.t0 + qi / G];
    const int64_t lo = a.window > 0 ? int64_t(pos) - a.window + 1 : 0;
    const int64_t k0 = std::max<int64_t>(lo, p0 * S) - p0 * S;  // the visible keys: k0..k1-1 of the item's
    const int64_t k1 = std::min<int64_t>(int64_t(pos) + 1, kv_len) - p0 * S;
    uint16_t* p = ph.data() + qi * ldp;  // zeros but for the visible keys' probabilities
    std::memset(p, 0, size_t(std::max<int64_t>(k0, 0)) * 2);
    std::memset(p + std::max(k0, k1), 0, size_t(ldp - std::max(k0, k1)) * 2);
    if (k1 <= k0) continue;  // none: zeros
    float* s = sc.data() + qi * ld;
    if (a.softcap > 0.f)
      for (int64_t j = k0; j < k1; ++j) s[j] = a.softcap * std::tanh(s[j] * a.scale / a.softcap);
    else
      for (int64_t j = k0; j < k1; ++j) s[j] *= a.scale;
    float m = kNegInf;
    for (int64_t j = k0; j < k1; ++j) m = std::max(m, s[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = k0; j < k1; ++j) {
      const float e = std::exp(s[j] - m);
      s[j] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    int64_t j = k0;
    for (; j + 16 <= k1; j += 16) simd::store_bf16(p + j, simd::mul(simd::load(s + j), simd::set1(inv)), simd::mask_of(16));
    if (j < k1) simd::store_bf16(p + j, simd::mul(simd::load(s + j, simd::mask_of(k1 - j)), simd::set1(inv)), simd::mask_of(k1 - j));
  }
  o.resize(size_t(kPairQueries * DC));
  pair_values<DC>(ph.data(), ldp, nq, [&](int64_t i) { return page_of(a.v, i); }, np, o.data());
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t t = it.t0 + qi / G, g = qi % G;
    const int64_t at = (t * a.H + int64_t(it.head) * G + g) * DC;
    if (a.out_bf16)
      for (int64_t d = 0; d < DC; d += 16)
        simd::store_bf16(static_cast<uint16_t*>(a.out) + at + d, simd::load(o.data() + qi * DC + d), simd::mask_of(16));
    else
      std::memcpy(static_cast<float*>(a.out) + at, o.data() + qi * DC, DC * 4);
  }
}
constexpr bool kPairLayouts = true;
#else
constexpr bool kPairLayouts = false;
constexpr int64_t kPairQueries = 32;
#endif

void run_any(const Args& a, const Item& it, std::vector<float>& scratch) {
#ifdef __AVX512BF16__
  if (a.pairs) return a.D == 32 ? pairs_item<32>(a, it) : a.D == 64 ? pairs_item<64>(a, it) : pairs_item<128>(a, it);
#endif
  if (a.S == 16 && a.D == 64) return run_item<16, 64>(a, it, scratch);
  if (a.S == 16 && a.D == 128) return run_item<16, 128>(a, it, scratch);
  run_item<0, 0>(a, it, scratch);
}

XLA_FFI_Error* attend(const ringserve::Call& call) {
  using ringserve::Buffer;
  if (call.args() != 9 || call.rets() != 1)
    return call.error("cpu_attention: q, k_cache, v_cache, pages, row_start, kv_len, positions, base, window -> out");
  const Buffer q = call.arg(0), k = call.arg(1), v = call.arg(2), pages = call.arg(3), row_start = call.arg(4),
               kv_len = call.arg(5), positions = call.arg(6), base = call.arg(7), win = call.arg(8), out = call.ret(0);
  for (const Buffer& b : {q, k, v, pages, row_start, kv_len, positions, base, win, out})
    if (!b.ok()) return call.error("cpu_attention: buffers expected");
  if ((q.element_type() != DataType::F32 && q.element_type() != DataType::BF16) ||
      (out.element_type() != DataType::F32 && out.element_type() != DataType::BF16))
    return call.error("cpu_attention: q must be f32 or bf16, out f32 or bf16");
  for (const Buffer& b : {pages, row_start, kv_len, positions, base, win})
    if (b.element_type() != DataType::S32)
      return call.error("cpu_attention: pages, row_start, kv_len, positions, base and window must be s32");
  float scale = 0.f, softcap = 0.f;
  if (!call.attr("scale", &scale) || !call.attr("softcap", &softcap))
    return call.error("cpu_attention: attributes scale (f32), softcap (f32)");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = pages.dimensions();
  const bool pairs = kd.size() == 5;  // the pair layouts: k [Hkv, L*P, D/2, 16, 2], v [Hkv, L*P, 8, D, 2]
  if (qd.size() != 3 || (kd.size() != 4 && !pairs) || vd.size() != kd.size() || pd.size() != 2)
    return call.error("cpu_attention: q [T, H, D], k [Hkv, L*P, D, S] (pairs: [Hkv, L*P, D/2, 16, 2]), pages [R, MP]");
  const bool bits = k.element_type() == DataType::U16;
  if (pairs) {
    if (!kPairLayouts) return call.error("cpu_attention: this build reads no pair layout (AVX512-BF16)");
    if (!bits || kd[3] != 16 || kd[4] != 2 || vd[2] != 8 || vd[4] != 2 || vd[3] != 2 * kd[2] || vd[0] != kd[0] ||
        vd[1] != kd[1] || (qd[2] != 32 && qd[2] != 64 && qd[2] != 128))
      return call.error("cpu_attention: pair layouts are bf16 bits, pages of 16, k [Hkv, L*P, D/2, 16, 2], v [Hkv, L*P, 8, D, 2], D 32, 64 or 128");
  }
  if (!bits && k.element_type() != DataType::F32)
    return call.error("cpu_attention: the cache must be f32 or bf16 bits (u16)");
  if (v.element_type() != k.element_type()) return call.error("cpu_attention: k_cache and v_cache types differ");
  Args a;
  std::vector<Item> items;
  a.q = q.untyped_data();
  a.q_bf16 = q.element_type() == DataType::BF16;
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.bits = bits;
  a.pages = pages.typed_data<const int32_t>();
  a.row_start = row_start.typed_data<const int32_t>();
  a.kv_len = kv_len.typed_data<const int32_t>();
  a.positions = positions.typed_data<const int32_t>();
  a.out = out.untyped_data();
  a.out_bf16 = out.element_type() == DataType::BF16;
  a.T = qd[0], a.H = qd[1], a.D = qd[2];
  a.Hkv = kd[0], a.S = pairs ? 16 : kd[3];
  a.pairs = pairs;
  a.MP = pd[1], a.R = pd[0];
  a.layer_offset = int64_t(base.typed_data<const int32_t>()[0]);
  a.window = std::max<int64_t>(0, win.typed_data<const int32_t>()[0]);
  a.scale = scale;
  a.softcap = softcap;
  if ((pairs ? 2 * kd[2] : kd[2]) != a.D || a.H % a.Hkv != 0)
    return call.error("cpu_attention: head_dim or head counts disagree");
  const int64_t block = pairs ? kPairQueries / (a.H / a.Hkv) : kBlock;  // query tokens an item
  if (block < 1) return call.error("cpu_attention: pair layouts take at most 16 query heads a KV head");
  a.pages_per_head = kd[1];
  std::memset(a.out, 0, size_t(a.T * a.H * a.D) * (a.out_bf16 ? 2 : 4));
  for (int32_t r = 0; r < a.R; ++r) {
    if (a.kv_len[r] <= 0) continue;
    const int32_t t0 = a.row_start[r], t1 = std::min<int64_t>(a.row_start[r + 1], a.T);
    for (int32_t b = t0; b < t1; b += int32_t(block))
      for (int32_t h = 0; h < a.Hkv; ++h) items.push_back({r, h, b, std::min(b + int32_t(block), t1)});
  }
  // longest first: items of long rows start early, the short ones fill the gaps
  if (items.empty()) return nullptr;
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    return a.kv_len[x.row] > a.kv_len[y.row];
  });
  static const int64_t cap = ringserve::thread_cap("RINGSERVE_ATTN_THREADS");
  ringserve::deal(call.pool(), int64_t(items.size()), cap, [&](int64_t i) {
    thread_local std::vector<float> scratch;
    run_any(a, items[size_t(i)], scratch);
  });
  return nullptr;
}

}  // namespace

RINGSERVE_FFI_HANDLER(RingserveCpuAttention, attend)

// Whether this build reads bf16 caches in the pair layouts (AVX512-BF16; with AMX where Linux lends it)
extern "C" int ringserve_cpu_attention_pairs() { return kPairLayouts ? 1 : 0; }
extern "C" int ringserve_cpu_attention_amx() {
#ifdef RINGSERVE_AMX
  return ringserve::amx::usable() ? 1 : 0;
#else
  return 0;
#endif
}
