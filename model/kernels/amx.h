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

}  // namespace ringserve::amx

#endif
