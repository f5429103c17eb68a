// bf16 weights [K, N] packed in pairs along K for vdpbf16ps (AVX512-BF16), kept for the weights
// the executor registers (cpu_matmul.cc reads them; model/compute/kernels/cpu_matmul.py
// `register_weights`). int8 weights pack the same way, as their integer values in bf16 (exact),
// for the calls of many rows, where the arithmetic is the time; their scales multiply the sums.
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

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace ringserve::pairs {

constexpr int64_t kCols = 64;  // columns of a packed tile: four 16-lane vectors

// The copies' memory: one arena per registrant, in chunks of anonymous memory aligned to 2 MiB
// and asked for transparent huge pages before they are written (the tiles are streamed every
// step, as the weights are, which model/weights/state.py `huge_pages` keeps on huge pages: a TLB miss
// every 4 KiB otherwise; most single copies are smaller than a huge page, so they share chunks).
// A copy holds its arena: released chunks are unmapped once no call reads from them.
//
// `reserve` faults chunks in ahead of the copies (the executor's weights, while its programs
// load): the first write of a page is a fault, and on a VM whose host backs guest memory on
// first use, SmolLM2 bf16's 270 MB of pairs faulted inside the first step took it from ~20 ms to
// 0.4-0.9 s (perf: 92% of it clear_page under pack). `take` then uses the reserved chunk that
// fits best before it maps a new one.
class Arena {
 public:
  static constexpr size_t kHuge = size_t(2) << 20, kChunk = size_t(32) << 20;
  ~Arena() {
    for (auto& [p, n] : chunks_) munmap(p, n);
    for (auto& [p, n] : free_) munmap(p, n);
  }
  // `words` zeroed u32, 64-byte aligned: a copy under kChunk from the chunk being filled, a
  // larger one in a chunk of its own; a chunk from the reserved ones that fits best if one does
  uint32_t* take(size_t words) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t want = (words * 4 + 63) / 64 * 64;
    if (want >= kChunk) return static_cast<uint32_t*>(chunk(round(want)));
    if (!fill_ || used_ + want > kChunk) {
      fill_ = static_cast<char*>(chunk(kChunk));
      used_ = 0;
    }
    uint32_t* p = reinterpret_cast<uint32_t*>(fill_ + used_);
    used_ += want;
    return p;
  }
  // Fault in chunks for copies of `sizes` bytes each, laid out as `take` will (blocks; the
  // chunks join the arena one by one as they are in).
  void reserve(const uint64_t* sizes, int64_t n) {
    std::vector<size_t> chunks;
    size_t shared = 0;
    for (int64_t i = 0; i < n; ++i) {
      const size_t want = (size_t(sizes[i]) + 63) / 64 * 64;
      if (want >= kChunk) {
        chunks.push_back(round(want));
      } else if (shared + want > kChunk) {
        chunks.push_back(kChunk);
        shared = want;
      } else {
        shared += want;
      }
    }
    if (shared) chunks.push_back(kChunk);
    for (size_t bytes : chunks) {
      void* p = map(bytes);
      fault_in(p, bytes);
      std::lock_guard<std::mutex> lock(mu_);
      free_.emplace_back(p, bytes);
    }
  }

 // bytes mapped: in use (chunks copies were taken from) and reserved (not yet taken)
  std::pair<size_t, size_t> bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    std::pair<size_t, size_t> b{0, 0};
    for (auto& c : chunks_) b.first += c.second;
    for (auto& c : free_) b.second += c.second;
    return b;
  }

 private:
  static size_t round(size_t bytes) { return (bytes + kHuge - 1) / kHuge * kHuge; }
  // a chunk of at least `n` bytes, in use from now: the smallest reserved one that holds them,
  // else a new one of `n` (under mu_)
  void* chunk(size_t n) {
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->second >= n && (best == free_.end() || it->second < best->second)) best = it;
    if (best != free_.end()) {
      chunks_.push_back(*best);
      free_.erase(best);
    } else {
      chunks_.emplace_back(map(n), n);
    }
    return chunks_.back().first;
  }
  // `n` bytes (a multiple of 2 MiB) of zeroed anonymous memory from a 2 MiB boundary
  static void* map(size_t n) {
    void* raw = mmap(nullptr, n + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
    if (base > raw) munmap(raw, size_t(base - static_cast<char*>(raw)));  // the chunk from a 2 MiB boundary
    const size_t tail = size_t(static_cast<char*>(raw) + n + kHuge - (base + n));
    if (tail) munmap(base + n, tail);
#ifdef MADV_HUGEPAGE
    madvise(base, n, MADV_HUGEPAGE);  // advice: refused or absent, 4 KiB pages serve as well
#endif
    return base;
  }
  // every page of [p, p + n) in, its zeros kept (MADV_POPULATE_WRITE, Linux 5.14+; else a write
  // of zero to each page)
  static void fault_in(void* p, size_t n) {
#ifdef MADV_POPULATE_WRITE
    if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return;
#endif
    volatile char* c = static_cast<volatile char*>(p);
    for (size_t at = 0; at < n; at += 4096) c[at] = 0;
  }

  std::mutex mu_;
  std::vector<std::pair<void*, size_t>> chunks_;  // in use
  std::vector<std::pair<void*, size_t>> free_;    // reserved, not yet used
  char* fill_ = nullptr;                          // the chunk the copies under kChunk fill
  size_t used_ = 0;                               // bytes of it taken
};

struct Packed {
  int64_t K = 0, N = 0, KP = 0, tiles = 0;
  bool transposed = false;       // packed from w [N, K]
  bool int8 = false;             // from int8 weights: their integer values (the caller scales)
  std::shared_ptr<Arena> arena;  // where `data` lives
  uint32_t* data = nullptr;      // [tiles][KP][kCols] u32
  const uint32_t* tile(int64_t t) const { return data + t * KP * kCols; }
  size_t bytes() const { return size_t(tiles * KP * kCols) * 4; }
};

// a weight's value as bf16 bits: bf16 as it is; int8 exactly (8 significant bits at most)
inline uint16_t bits(uint16_t v) { return v; }
inline uint16_t bits(int8_t v) {
  const float f = float(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

// w [K, N] (or [N, K], `transposed`) bf16 bits or int8 -> its packed pairs, in `arena`
template <class T>
std::shared_ptr<const Packed> pack(const T* w, int64_t K, int64_t N, bool transposed, std::shared_ptr<Arena> arena) {
  auto p = std::make_shared<Packed>();
  p->K = K, p->N = N, p->KP = (K + 1) / 2, p->tiles = (N + kCols - 1) / kCols, p->transposed = transposed;
  p->int8 = std::is_same_v<T, int8_t>;
  p->data = arena->take(size_t(p->tiles * p->KP * kCols));  // zeros past K and N
  p->arena = std::move(arena);
  uint32_t* data = p->data;
  if (transposed) {  // row n's pairs, written 64 rows apart within its tile
    for (int64_t n = 0; n < N; ++n) {
      uint32_t* out = data + (n / kCols) * p->KP * kCols + n % kCols;
      const T* row = w + n * K;
      for (int64_t q = 0; q < p->KP; ++q)
        out[q * kCols] = uint32_t(bits(row[2 * q])) | (2 * q + 1 < K ? uint32_t(bits(row[2 * q + 1])) << 16 : 0u);
    }
    return p;
  }
  for (int64_t t = 0; t < p->tiles; ++t) {
    const int64_t n0 = t * kCols, cols = std::min<int64_t>(kCols, N - n0);
    for (int64_t q = 0; q < p->KP; ++q) {
      uint32_t* out = data + (t * p->KP + q) * kCols;
      const T* lo = w + (2 * q) * N + n0;
      const T* hi = 2 * q + 1 < K ? lo + N : nullptr;
      int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<T, uint16_t>)
        for (; c + 16 <= cols; c += 16) {
          const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + c)));
          const __m512i b = hi ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + c)))
                               : _mm512_setzero_si512();
          _mm512_storeu_si512(out + c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
#endif
      for (; c < cols; ++c) out[c] = uint32_t(bits(lo[c])) | (hi ? uint32_t(bits(hi[c])) << 16 : 0u);
    }
  }
  return p;
}

struct Registered {
  int64_t owner;
  size_t bytes;
  std::shared_ptr<const Packed> packed;
  std::shared_ptr<Arena> arena;  // the owner's
};

namespace {  // each library its own registry (the f32, bf16 and int8 builds are loaded side by side)
inline std::mutex& mu() {
  static std::mutex m;
  return m;
}
inline std::unordered_map<uintptr_t, Registered>& registry() {
  static std::unordered_map<uintptr_t, Registered> r;
  return r;
}
// the arena `ringserve_cpu_matmul_reserve` fills for the next registrant (null: none)
inline std::shared_ptr<Arena>& spare() {
  static std::shared_ptr<Arena> a;
  return a;
}

// The packed copy of the registered weight w [K, N] (or [N, K], `transposed`; bf16 or int8; made
// on first use), or null when w is not a registered buffer of K * N such values
template <class T>
std::shared_ptr<const Packed> of(const T* w, int64_t K, int64_t N, bool transposed) {
  std::lock_guard<std::mutex> lock(mu());
  auto it = registry().find(reinterpret_cast<uintptr_t>(w));
  if (it == registry().end() || it->second.bytes != size_t(K * N) * sizeof(T)) return nullptr;
  auto& p = it->second.packed;
  if (!p || p->K != K || p->N != N || p->transposed != transposed || p->int8 != std::is_same_v<T, int8_t>)
    p = pack(w, K, N, transposed, it->second.arena);
  return p;
}
}  // namespace

}  // namespace ringserve::pairs
