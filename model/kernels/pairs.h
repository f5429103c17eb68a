// bf16 weights [K, N] packed in pairs along K for vdpbf16ps (AVX512-BF16), kept for the weights
// the executor registers (cpu_matmul.cc reads them; model/kernels/cpu_matmul.py
// `register_weights`).
//
//   packed   [tiles][KP][64] u32, KP = ceil(K / 2), tiles = ceil(N / 64): element (t, p, c) holds
//            w[2p, 64t + c] in its low 16 bits and w[2p + 1, 64t + c] in its high ones (0 past K
//            and past N). A tile is one contiguous run of memory (KP x 256 bytes): read once, in
//            address order, for every row of x. A weight stored [N, K] (a tied embedding as the
//            LM head) packs to the same layout: its pair (w[n, 2p], w[n, 2p + 1]) is already
//            one u32, gathered from 64 rows
//
// vdpbf16ps multiplies a lane's two bf16 pairs exactly and adds both to an f32 lane, so each
// instruction does 32 of a tile's weights for one row of x; in the plain layout two weight rows
// must first be interleaved (two vpermt2w a pair of rows, cpu_matmul.cc kn_pairs_dp).
//
// Only registered buffers are packed: any other operand (a temporary of the program) may hold
// new values at the same address on the next call. The registrant promises a registered
// buffer keeps its contents until it releases it (`ringserve_cpu_matmul_release`), as for
// oneDNN's packed copies (onednn_matmul.cc); a call still reading a released copy holds it
// (shared ownership) until it returns.

#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace ringserve::pairs {

constexpr int64_t kCols = 64;  // columns of a packed tile: four 16-lane vectors

struct Packed {
  int64_t K = 0, N = 0, KP = 0, tiles = 0;
  bool transposed = false;  // packed from w [N, K]
  std::vector<uint32_t> data;  // [tiles][KP][kCols]
  const uint32_t* tile(int64_t t) const { return data.data() + t * KP * kCols; }
};

// w [K, N] (or [N, K], `transposed`) bf16 bits -> its packed pairs
inline std::shared_ptr<const Packed> pack(const uint16_t* w, int64_t K, int64_t N, bool transposed) {
  auto p = std::make_shared<Packed>();
  p->K = K, p->N = N, p->KP = (K + 1) / 2, p->tiles = (N + kCols - 1) / kCols, p->transposed = transposed;
  p->data.assign(size_t(p->tiles * p->KP * kCols), 0u);
  if (transposed) {  // row n's pairs, written 64 rows apart within its tile
    for (int64_t n = 0; n < N; ++n) {
      uint32_t* out = p->data.data() + (n / kCols) * p->KP * kCols + n % kCols;
      const uint16_t* row = w + n * K;
      for (int64_t q = 0; q < p->KP; ++q)
        out[q * kCols] = uint32_t(row[2 * q]) | (2 * q + 1 < K ? uint32_t(row[2 * q + 1]) << 16 : 0u);
    }
    return p;
  }
  for (int64_t t = 0; t < p->tiles; ++t) {
    const int64_t n0 = t * kCols, cols = std::min<int64_t>(kCols, N - n0);
    for (int64_t q = 0; q < p->KP; ++q) {
      uint32_t* out = p->data.data() + (t * p->KP + q) * kCols;
      const uint16_t* lo = w + (2 * q) * N + n0;
      const uint16_t* hi = 2 * q + 1 < K ? lo + N : nullptr;
      int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      for (; c + 16 <= cols; c += 16) {
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + c)));
        const __m512i b = hi ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + c)))
                             : _mm512_setzero_si512();
        _mm512_storeu_si512(out + c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
      }
#endif
      for (; c < cols; ++c) out[c] = uint32_t(lo[c]) | (hi ? uint32_t(hi[c]) << 16 : 0u);
    }
  }
  return p;
}

struct Registered {
  int64_t owner;
  size_t bytes;
  std::shared_ptr<const Packed> packed;
};

inline std::mutex& mu() {
  static std::mutex m;
  return m;
}
inline std::unordered_map<uintptr_t, Registered>& registry() {
  static std::unordered_map<uintptr_t, Registered> r;
  return r;
}

// The packed copy of the registered bf16 weight w [K, N] (or [N, K], `transposed`; made on first
// use), or null when w is not a registered buffer of K * N bf16 values
inline std::shared_ptr<const Packed> of(const uint16_t* w, int64_t K, int64_t N, bool transposed) {
  std::lock_guard<std::mutex> lock(mu());
  auto it = registry().find(reinterpret_cast<uintptr_t>(w));
  if (it == registry().end() || it->second.bytes != size_t(K * N) * 2) return nullptr;
  auto& p = it->second.packed;
  if (!p || p->K != K || p->N != N || p->transposed != transposed) p = pack(w, K, N, transposed);
  return p;
}

}  // namespace ringserve::pairs
