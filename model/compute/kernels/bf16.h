// bf16 <-> f32 for the kernels' scalar paths (cpu_attention.cc, cpu_matmul.cc).

#pragma once

#include <cstdint>
#include <cstring>

namespace ringserve {

inline float bf16_to_f32(uint16_t b) {  // exact: bf16 is f32's upper half
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace ringserve
