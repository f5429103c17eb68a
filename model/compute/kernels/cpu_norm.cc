// RMSNorm, and the residual add before it, for bf16 on CPU as an XLA FFI custom call on the
// threads of XLA's intra-op pool (model/compute/kernels/cpu_norm.py builds and registers it;
// model/compute/dots.py RMSNorm calls it).
//
//   x [T, H] bf16, w [H] bf16            -> y [T, H] bf16
//   x [T, H] bf16, a [T, H] bf16, w [H]  -> s [T, H] bf16 = x + a, y = norm(s)
//   attribute eps (f32)
//
//   y = w * bf16(s * 1 / sqrt(mean(s^2) + eps)), s's squares summed in f32, each product rounded
//   to bf16 (nearest even; a NaN stays a NaN): what model/compute/dots.py's rms_norm computes in XLA,
//   and the sum s = bf16(x + a) as XLA adds two bf16 arrays. The sum of squares runs in 16 (or 8)
//   lanes then across them, XLA's in an order of its own: a result may be one bf16 step from
//   XLA's where the two means round apart.
//
// XLA:CPU made each of these three to four passes over [T, H] (a convert, the reduction, the
// scale; the add's convert): a 2048-token SmolLM2 bf16 prefill step spent ~40 ms of ~415 in them.
// Here a row is read once for its squares and once for its outputs, and rows are dealt to the
// pool in runs.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "pool.h"
#include "simd.h"
#include "xla_call.h"

using ringserve::bf16_to_f32;
using ringserve::DataType;
using ringserve::f32_to_bf16;

namespace {

constexpr int64_t kRows = 32;  // rows an item

// rows r0..r1-1 of the norm of s (s = x, or written from x + a first)
void norm_rows(const uint16_t* x, const uint16_t* a, uint16_t* s, const uint16_t* w, uint16_t* y, int64_t H,
               float eps, int64_t r0, int64_t r1) {
#ifdef RINGSERVE_SIMD
  namespace simd = ringserve::simd;
  constexpr int64_t L = simd::L;
  thread_local std::vector<uint16_t> t;  // a row's s * scale, rounded
  t.resize(size_t(H));
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* sr = x + r * H;
    if (a) {  // s = x + a, rounded, written out (exactly what its squares read back)
      const uint16_t *xr = x + r * H, *ar = a + r * H;
      uint16_t* out = s + r * H;
      for (int64_t j = 0; j < H; j += L) {
        const simd::Mask m = simd::mask_of(H - j);
        simd::store_bf16(out + j, simd::add(simd::load(xr + j, m), simd::load(ar + j, m)), m);
      }
      sr = out;
    }
    simd::V acc = simd::zero();
    for (int64_t j = 0; j < H; j += L) {
      const simd::V v = simd::load(sr + j, simd::mask_of(H - j));
      acc = simd::fma(v, v, acc);
    }
    const simd::V scale = simd::set1(1.f / std::sqrt(simd::reduce(acc) / float(H) + eps));
    uint16_t* yr = y + r * H;
    for (int64_t j = 0; j < H; j += L) {
      const simd::Mask m = simd::mask_of(H - j);
      simd::store_bf16(t.data() + j, simd::mul(simd::load(sr + j, m), scale), m);
      simd::store_bf16(yr + j, simd::mul(simd::load(w + j, m), simd::load(t.data() + j, m)), m);
    }
  }
#else
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* sr = x + r * H;
    if (a) {
      const uint16_t *xr = x + r * H, *ar = a + r * H;
      uint16_t* out = s + r * H;
      for (int64_t j = 0; j < H; ++j) out[j] = f32_to_bf16(bf16_to_f32(xr[j]) + bf16_to_f32(ar[j]));
      sr = out;
    }
    float ss = 0.f;
    for (int64_t j = 0; j < H; ++j) ss += bf16_to_f32(sr[j]) * bf16_to_f32(sr[j]);
    const float scale = 1.f / std::sqrt(ss / float(H) + eps);
    uint16_t* yr = y + r * H;
    for (int64_t j = 0; j < H; ++j)
      yr[j] = f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(sr[j]) * scale)));
  }
#endif
}

XLA_FFI_Error* rms_norm(const ringserve::Call& call) {
  using ringserve::Buffer;
  const bool add = call.args() == 3;
  if ((call.args() != 2 && !add) || call.rets() != (add ? 2 : 1))
    return call.error("cpu_rms_norm: x, w -> y, or x, a, w -> x + a, y");
  float eps = 0.f;
  if (!call.attr("eps", &eps)) return call.error("cpu_rms_norm: the attribute eps (f32)");
  const Buffer x = call.arg(0), w = call.arg(add ? 2 : 1), a = add ? call.arg(1) : Buffer{};
  const Buffer s = add ? call.ret(0) : Buffer{}, y = call.ret(add ? 1 : 0);
  if (!x.ok() || !w.ok() || !y.ok() || (add && (!a.ok() || !s.ok()))) return call.error("cpu_rms_norm: buffers expected");
  for (const Buffer* b : {&x, &w, &y, &a, &s})
    if (b->ok() && b->element_type() != DataType::BF16) return call.error("cpu_rms_norm: operands and results must be bf16");
  auto xd = x.dimensions();
  if (xd.size() < 1) return call.error("cpu_rms_norm: x [..., H]");
  const int64_t H = xd.back(), n = int64_t(x.element_count());
  if (int64_t(w.element_count()) != H || int64_t(y.element_count()) != n || (add && (int64_t(a.element_count()) != n ||
                                                                                       int64_t(s.element_count()) != n)))
    return call.error("cpu_rms_norm: x, a, the results [..., H] and w [H]");
  if (n == 0 || H == 0) return nullptr;
  const int64_t T = n / H;
  const auto* xp = x.typed_data<const uint16_t>();
  const auto* ap = add ? a.typed_data<const uint16_t>() : nullptr;
  auto* sp = add ? s.typed_data<uint16_t>() : nullptr;
  const auto* wp = w.typed_data<const uint16_t>();
  auto* yp = y.typed_data<uint16_t>();
  static const int64_t cap = ringserve::thread_cap("RINGSERVE_NORM_THREADS");
  ringserve::deal(call.pool(), (T + kRows - 1) / kRows, cap, [&](int64_t i) {
    norm_rows(xp, ap, sp, wp, yp, H, eps, i * kRows, std::min(T, (i + 1) * kRows));
  });
  return nullptr;
}

}  // namespace

RINGSERVE_FFI_HANDLER(RingserveCpuRmsNorm, rms_norm)
