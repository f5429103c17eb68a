// f32 vectors at the widest width the compiler targets (-march=native), for kernels written once
// over them (cpu_matmul.cc): AVX-512 (F, BW, VL: 16 lanes) or AVX2 with FMA (8 lanes, as Zen 2
// and 3 and Intel's client cores before Ice Lake have); neither: RINGSERVE_SIMD is undefined and
// the kernels keep their plain loops.
//
//   V, L          the vector type and its lanes
//   Mask          lanes 0..n-1 of a vector (`mask_of(left)`: all where left >= L, none where <= 0)
//   load(p)       L values at p as f32: f32 loaded, bf16 bits widened (exact), int8 converted
//   load(p, m)    the same for the lanes of m, zeros elsewhere; nothing outside them is read
//   store(p, v [, m]), store_bf16(p, v, m)   f32 / bf16 (nearest even; NaN stays a quiet NaN,
//                 as bf16.h's f32_to_bf16) into the lanes of m
//   zero, set1, add, mul, fma(a, b, c) = a * b + c, reduce(v): the lanes' sum
//
// The AVX-512 functions are the intrinsics the kernels called before this header existed, one
// for one, so the kernels' AVX-512 code (and its bits) is what it was.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define RINGSERVE_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RINGSERVE_SIMD 256
#endif

#ifdef RINGSERVE_SIMD
namespace ringserve::simd {

#if RINGSERVE_SIMD == 512

constexpr int L = 16;
using V = __m512;
using Mask = __mmask16;

inline Mask mask_of(int64_t left) { return left >= 16 ? Mask(0xffff) : left <= 0 ? Mask(0) : Mask((1u << left) - 1); }
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce(V v) { return _mm512_reduce_add_ps(v); }

inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline V load(const uint16_t* p, Mask m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline V load(const int8_t* p, Mask m) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p))); }

inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, V v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_bf16(uint16_t* p, V v, Mask m) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

#else  // AVX2 + FMA

constexpr int L = 8;
using V = __m256;
struct Mask {
  int n;  // lanes 0..n-1
  explicit operator bool() const { return n > 0; }
};

inline Mask mask_of(int64_t left) { return Mask{left >= 8 ? 8 : left <= 0 ? 0 : int(left)}; }
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce(V v) {  // ((0+4) + (2+6)) + ((1+5) + (3+7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V load(const int8_t* p) {
  int64_t b;
  std::memcpy(&b, p, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(b)));
}
inline __m256i lanes(Mask m) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(m.n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline V load(const float* p, Mask m) { return _mm256_maskload_ps(p, lanes(m)); }
template <class T>
inline V load(const T* p, Mask m) {  // no masked load below 32 bits: the lanes copied out first
  T tmp[8] = {};
  std::memcpy(tmp, p, size_t(m.n) * sizeof(T));
  return load(static_cast<const T*>(tmp));
}

inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline void store(float* p, V v, Mask m) { _mm256_maskstore_ps(p, lanes(m), v); }
// r[i] lane j <-> r[j] lane i (AVX2 only: the packed panels of cpu_matmul.cc)
inline void transpose(V (&r)[8]) {
  V t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      u[i + h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + h + 2] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // u[order[q]]: column q of rows 0-3 in its low half, column q + 4 in its high half; u[order[q] + 4]: rows 4-7
  const int order[4] = {0, 2, 1, 3};
  for (int q = 0; q < 4; ++q) {
    r[q] = _mm256_permute2f128_ps(u[order[q]], u[order[q] + 4], 0x20);
    r[q + 4] = _mm256_permute2f128_ps(u[order[q]], u[order[q] + 4], 0x31);
  }
}
inline void store_bf16(uint16_t* p, V v, Mask m) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // each < 2^16
  if (m.n == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  } else {
    uint16_t tmp[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), h);
    std::memcpy(p, tmp, size_t(m.n) * 2);
  }
}

#endif

}  // namespace ringserve::simd
#endif
