// AMX (Sapphire Rapids and later), shared by cpu_matmul.cc and cpu_attention.cc: whether the
// process may use the tiles, and the one tile configuration both kernels use.
//
// Linux lends a process AMX's tile registers only when it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM, Linux 5.16+); before, the first tile instruction faults (SIGILL): that is
// why AMX "faulted" in this VM for programs that never asked. A thread loads the configuration
// before its first tile instruction and releases the tiles after its last (TILERELEASE: no 8 KB
// of tile data to save at every switch of a thread that holds none).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RINGSERVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace ringserve::amx {

struct Config {  // LDTILECFG's 64 bytes: palette 1, tiles 0-7 each 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
static_assert(sizeof(Config) == 64);

// Whether the tiles may be used: this process asked Linux for them and got them (asked once per
// library; RINGSERVE_AMX=0 keeps the AVX-512 paths, for tests and benchmarks).
inline bool usable() {
  static const bool ok = [] {
    const char* e = std::getenv("RINGSERVE_AMX");
    if (e && std::string_view(e) == "0") return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The tiles configured (every tile 16 x 64 bytes) for this thread until the scope ends, then released
struct Tiles {
  Tiles() {
    static const Config config;
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// The 2 x 2 blocks both kernels sum: C tiles 0-3 zeroed; then += A tiles 4-5 x B tiles 6-7
// (0 = 4 x 6, 1 = 4 x 7, 2 = 5 x 6, 3 = 5 x 7); then stored as f32 rows `stride` bytes apart from
// c: tiles 0 and 1 side by side in rows 0-15, 2 and 3 in rows 16-31
inline void zero_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
inline void dp_2x2() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}
inline void store_2x2(float* c, int64_t stride) {
  float* low = c + 16 * stride / int64_t(sizeof(float));
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, low, stride);
  _tile_stored(3, low + 16, stride);
}

}  // namespace ringserve::amx

#endif
