// A zeroed buffer on CPU whose pages come when first written, as an XLA FFI custom call
// (model/compute/kernels/cpu_memory.py builds, registers and calls it; the executor makes the KV pool
// with it).
//
//   out  any shape and dtype   all zeros
//
// XLA's own zeros (a broadcast) write every byte, so every page of a 2 GiB KV pool is faulted
// in before the server is ready: on a VM whose host backs guest memory lazily that was 6.7 s
// of a 13 s start (SmolLM2 f32, 2 cores). Here the buffer's whole pages are handed back to
// the kernel instead (madvise MADV_DONTNEED: a private anonymous mapping then reads zeros,
// page by page, when next touched) and only the partial pages at its two ends are written.
// That holds only for private anonymous memory, which is what XLA's CPU allocator (malloc)
// gives; the mappings under the buffer are read from /proc/self/maps first, and anything
// else (a shared or file-backed mapping, no /proc, madvise refused) is zeroed with memset.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "xla_call.h"

namespace {

// Whether every byte of [lo, hi) lies in private anonymous mappings ("p" and inode 0).
bool private_anonymous(uintptr_t lo, uintptr_t hi) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  char line[512];
  uintptr_t covered = lo;  // [lo, covered) is known good; mappings come in address order
  bool ok = true;
  while (ok && covered < hi && std::fgets(line, sizeof line, maps) != nullptr) {
    if (std::strchr(line, '\n') == nullptr) {  // a long path: the rest of its line is not a mapping
      int c;
      while ((c = std::fgetc(maps)) != EOF && c != '\n') {
      }
    }
    unsigned long start = 0, end = 0, offset = 0, inode = 0;
    char perms[5] = {0};
    unsigned dev_major = 0, dev_minor = 0;
    if (std::sscanf(line, "%lx-%lx %4s %lx %x:%x %lu", &start, &end, perms, &offset, &dev_major, &dev_minor,
                    &inode) != 7) {
      ok = false;
      break;
    }
    if (end <= covered) continue;
    if (start > covered) break;  // a hole: not mapped at all
    ok = perms[3] == 'p' && inode == 0;
    covered = end;
  }
  std::fclose(maps);
  return ok && covered >= hi;
}

XLA_FFI_Error* lazy_zeros(const ringserve::Call& call) {
  const ringserve::Buffer out = call.ret(0);
  if (call.args() != 0 || call.rets() != 1 || !out.ok()) return call.error("lazy_zeros: no operands, one result");
  char* p = static_cast<char*>(out.untyped_data());
  const size_t n = out.size_bytes();
  if (n == 0 && out.element_count() != 0) return call.error("lazy_zeros: a type packed below a byte");
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p), end = begin + n;
  const uintptr_t lo = (begin + page - 1) / page * page, hi = end / page * page;
  if (hi > lo && private_anonymous(lo, hi) &&
      madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) == 0) {
    std::memset(p, 0, lo - begin);
    std::memset(reinterpret_cast<void*>(hi), 0, end - hi);
  } else {
    std::memset(p, 0, n);
  }
  return nullptr;
}

}  // namespace

RINGSERVE_FFI_HANDLER(RingserveLazyZeros, lazy_zeros)
