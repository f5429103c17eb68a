// y = x @ w on CPU through oneDNN's matmul, as an XLA FFI custom call (model/compute/kernels/onednn.py
// builds, loads and registers it; the model calls it through model/compute/dots.py `matmul`).
//
//   ringserve_onednn_matmul     x [M, K] (f32 | bf16 | f16), w [K, N] or [N, K] (same dtype)
//   ringserve_onednn_matmul_q8  x [M, K] (bf16 | f32), w int8 [K, N] or [N, K], scale f32 [N]:
//                               weight-only int8, dequantized inside the kernel (w * scale[n])
//   result                      y [M, N] (f32 | bf16 | f16, the caller's choice)
//   attribute transpose_w       the weight is stored [N, K] (a tied embedding as the LM head)
//
// A oneDNN primitive is made once per (shapes, dtypes, layout) and kept: every compiled program
// has static shapes, so a server makes a few dozen and reuses them for every step. Memory
// objects wrap XLA's buffers (no copies). Errors come back to XLA as FFI errors, never aborts.
//
// Packed weights. A plain [K, N] weight is copied into the blocked layout oneDNN's kernels read
// (pairs of K interleaved for the bf16 dot instructions) inside every call; a weight the
// executor has registered as one of its parameters (`ringserve_onednn_register`: its buffers'
// addresses, which XLA passes as they are) is copied into that layout once, on its first call
// of MIN_PACKED_ROWS rows or more, and every later call reads the copy (SmolLM2's projections,
// bf16, 64 rows: 1.2-1.6x faster; 2048 rows: 1.04-1.2x). int8 weights are packed as int8
// (copied as bf16 they measured no faster, at twice the memory). Only registered buffers are
// packed: any other operand (a temporary of the program) may hold new values at the same
// address on the next call. The executor releases its registration before it frees or
// replaces its weights, so no address is ever packed from stale contents; a release while a
// step still reads a packed copy frees it when that step is done (shared ownership).

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla_call.h"

using ringserve::Buffer;
using ringserve::DataType;

namespace {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

bool to_dnnl(DataType t, dt* out) {
  switch (t) {
    case DataType::F32: *out = dt::f32; return true;
    case DataType::BF16: *out = dt::bf16; return true;
    case DataType::F16: *out = dt::f16; return true;
    case DataType::S8: *out = dt::s8; return true;
    default: return false;
  }
}

dnnl::engine& cpu_engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream s(cpu_engine());
  return s;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int, int, int, bool, bool, bool>;

constexpr int64_t MIN_PACKED_ROWS = 8;  // fewer rows: the plain weight is as fast (1 row: faster)

struct Cached {
  bool ok = false;  // false: oneDNN has no kernel for this combination on this CPU (kept, not retried)
  dnnl::matmul prim;
  dnnl::memory::desc x, w, y, scale;
};

std::mutex cache_mu;
std::map<Key, Cached>& cache() {
  static std::map<Key, Cached> c;
  return c;
}

// The primitive for these shapes and types (`ok` false where this CPU's oneDNN has none: a bf16
// source needs AVX512-BF16, AMX or AVX2-VNNI-2, and int8 weights with a floating source the
// same; a blocked weight layout may be missing where the plain one exists)
const Cached& primitive(int64_t m, int64_t k, int64_t n, dt xt, dt wt, dt yt, bool transpose_w, bool quant,
                        bool packed) {
  Key key{m, k, n, int(xt), int(wt), int(yt), transpose_w, quant, packed};
  std::lock_guard<std::mutex> lock(cache_mu);
  auto it = cache().find(key);
  if (it != cache().end()) return it->second;
  dnnl::memory::desc x({m, k}, xt, tag::ab);
  dnnl::memory::desc w({k, n}, wt, packed ? tag::any : transpose_w ? tag::ba : tag::ab);
  dnnl::memory::desc y({m, n}, yt, tag::ab);
  dnnl::memory::desc scale;
  dnnl::primitive_attr attr;
  if (quant) {  // int8 weights, one f32 scale per output column, computed in the source's dtype
    attr.set_fpmath_mode(xt == dt::bf16 ? dnnl::fpmath_mode::bf16 : dnnl::fpmath_mode::strict, true);
    attr.set_scales(DNNL_ARG_WEIGHTS, 1 << 1, {}, dt::f32);
    scale = dnnl::memory::desc({n}, dt::f32, tag::a);
  }
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(cpu_engine(), x, w, y, attr);
  } catch (const dnnl::error& e) {
    if (e.status != dnnl_unimplemented) throw;
    return cache().emplace(key, Cached{}).first->second;
  }
  return cache().emplace(key, Cached{true, dnnl::matmul(pd), x, pd.weights_desc(), y, scale}).first->second;
}

const char* name(dt t) {
  switch (t) {
    case dt::f32: return "f32";
    case dt::bf16: return "bf16";
    case dt::f16: return "f16";
    case dt::s8: return "int8";
    default: return "?";
  }
}

// ---- packed weights ---------------------------------------------------------------------------
struct Registered {
  int64_t owner;
  size_t bytes;
  std::vector<std::pair<dnnl::memory::desc, std::shared_ptr<dnnl::memory>>> packed;  // one per layout
};

std::mutex packed_mu;
std::unordered_map<uintptr_t, Registered>& registered() {
  static std::unordered_map<uintptr_t, Registered> r;
  return r;
}

// The packed copy of the registered weight at `data` (plain layout `plain`) in layout `want`,
// made on first use; null when `data` is not a registered weight.
std::shared_ptr<dnnl::memory> packed_weight(const void* data, const dnnl::memory::desc& plain,
                                            const dnnl::memory::desc& want) {
  std::lock_guard<std::mutex> lock(packed_mu);
  auto it = registered().find(reinterpret_cast<uintptr_t>(data));
  if (it == registered().end() || it->second.bytes != plain.get_size()) return nullptr;
  for (auto& [desc, mem] : it->second.packed)
    if (desc == want) return mem;
  auto& eng = cpu_engine();
  auto mem = std::make_shared<dnnl::memory>(want, eng);
  dnnl::memory src(plain, eng, const_cast<void*>(data));
  auto& s = thread_stream();
  dnnl::reorder(src, *mem).execute(s, src, *mem);
  s.wait();
  it->second.packed.emplace_back(want, mem);
  return mem;
}

// `layer` (an s32 scalar, or null): w is stacked over the layers ([L, K, N] or [L, N, K], scale
// [L, N]) and layer `layer`'s multiply, read in place (the layers' scan; each layer's slice of a
// registered stack is registered on its own, so it has its packed copy)
XLA_FFI_Error* run(const ringserve::Call& call, Buffer x, Buffer w, const Buffer* scale, const Buffer* layer, Buffer y,
                   bool transpose_w) {
  auto xd = x.dimensions(), wd_all = w.dimensions(), yd = y.dimensions();
  const size_t rank = layer ? 3 : 2;
  if (wd_all.size() != rank || xd.size() < 1 || yd.size() != xd.size())
    return call.error(layer ? "onednn_matmul: x [..., K], stacked w rank 3, y [..., N]"
                                             : "onednn_matmul: x [..., K], w rank 2, y [..., N]");
  int64_t l = 0;
  if (layer) {
    if (layer->element_type() != DataType::S32 || layer->element_count() != 1)
      return call.error("onednn_matmul: the layer of stacked weights must be an s32 scalar");
    l = *static_cast<const int32_t*>(layer->untyped_data());
    if (l < 0 || l >= wd_all[0]) return call.error("onednn_matmul: layer out of the stack's range");
  }
  const int64_t wd[2] = {wd_all[rank - 2], wd_all[rank - 1]};
  int64_t k = xd.back();
  int64_t m = k == 0 ? 0 : int64_t(x.element_count()) / k;
  int64_t n = transpose_w ? wd[0] : wd[1];
  if ((transpose_w ? wd[1] : wd[0]) != k || yd.back() != n)
    return call.error("onednn_matmul: inner dimensions disagree");
  dt xt, wt, yt;
  if (!to_dnnl(x.element_type(), &xt) || !to_dnnl(w.element_type(), &wt) || !to_dnnl(y.element_type(), &yt))
    return call.error("onednn_matmul: dtypes must be f32, bf16, f16 (w: or s8)");
  if (m == 0 || n == 0) return nullptr;
  const void* wdata = static_cast<const char*>(w.untyped_data()) + size_t(l) * size_t(k * n) * dnnl::memory::data_type_size(wt);
  const void* sdata = scale ? static_cast<const float*>(scale->untyped_data()) + l * n : nullptr;
  try {
    const bool quant = scale != nullptr;
    auto& eng = cpu_engine();
    std::shared_ptr<dnnl::memory> packed;
    const Cached* cp = nullptr;
    if (m >= MIN_PACKED_ROWS) {
      const Cached& c = primitive(m, k, n, xt, wt, yt, transpose_w, quant, true);
      dnnl::memory::desc plain({k, n}, wt, transpose_w ? tag::ba : tag::ab);
      if (c.ok && (packed = packed_weight(wdata, plain, c.w))) cp = &c;
    }
    const Cached& c = cp ? *cp : primitive(m, k, n, xt, wt, yt, transpose_w, quant, false);
    if (!c.ok)  // the executor asks `ringserve_onednn_supports` first; a direct caller may not
      return call.error((std::string("onednn_matmul: oneDNN has no ") + name(xt) + " x " + name(wt) +
                         " matmul on this CPU").c_str());
    dnnl::memory xm(c.x, eng, x.untyped_data()), ym(c.y, eng, y.untyped_data());
    dnnl::memory wm = packed ? *packed : dnnl::memory(c.w, eng, const_cast<void*>(wdata));
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}};
    if (scale != nullptr) args.emplace(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, dnnl::memory(c.scale, eng, const_cast<void*>(sdata)));
    auto& s = thread_stream();
    c.prim.execute(s, args);
    s.wait();
  } catch (const dnnl::error& e) {
    return call.error((std::string("onednn_matmul: ") + e.what()).c_str(), XLA_FFI_Error_Code_INTERNAL);
  }
  return nullptr;
}

// x, w (then scale f32 for int8 w), then at most the layer of stacked weights (`run`)
XLA_FFI_Error* call_with(const ringserve::Call& call, bool q8) {
  const char* what = q8 ? "onednn_matmul_q8: x, w, scale, then at most the layer; one result"
                        : "onednn_matmul: x, w, then at most the layer; one result";
  const int64_t fixed = q8 ? 3 : 2;
  bool transpose_w = false;
  if (call.args() < fixed || call.args() > fixed + 1 || call.rets() != 1) return call.error(what);
  if (!call.attr("transpose_w", &transpose_w)) return call.error("onednn_matmul: the attribute transpose_w (bool)");
  const Buffer x = call.arg(0), w = call.arg(1), y = call.ret(0), scale = call.arg(2), layer = call.arg(fixed);
  if (!x.ok() || !w.ok() || !y.ok() || (q8 && !scale.ok()) || (call.args() > fixed && !layer.ok()))
    return call.error(what);
  if (q8 && (w.element_type() != DataType::S8 || scale.element_type() != DataType::F32))
    return call.error("onednn_matmul_q8: w must be int8 and scale f32");
  return run(call, x, w, q8 ? &scale : nullptr, layer.ok() ? &layer : nullptr, y, transpose_w);
}

XLA_FFI_Error* matmul(const ringserve::Call& call) { return call_with(call, false); }
XLA_FFI_Error* matmul_q8(const ringserve::Call& call) { return call_with(call, true); }

}  // namespace

RINGSERVE_FFI_HANDLER(RingserveOnednnMatmul, matmul)
RINGSERVE_FFI_HANDLER(RingserveOnednnMatmulQ8, matmul_q8)

// The executor's weights: `n` buffers (address, bytes) that stay unchanged until it releases
// `owner` (model/compute/kernels/onednn.py `register_weights`). An address registered again moves to
// the new owner and drops what was packed from it.
extern "C" void ringserve_onednn_register(int64_t owner, const uint64_t* addrs, const uint64_t* bytes, int64_t n) {
  std::lock_guard<std::mutex> lock(packed_mu);
  for (int64_t i = 0; i < n; ++i) registered()[uintptr_t(addrs[i])] = Registered{owner, size_t(bytes[i]), {}};
}

// Forget every buffer of `owner` and free its packed copies (a step still reading one keeps it
// until it is done).
extern "C" void ringserve_onednn_release(int64_t owner) {
  std::lock_guard<std::mutex> lock(packed_mu);
  for (auto it = registered().begin(); it != registered().end();)
    it = it->second.owner == owner ? registered().erase(it) : std::next(it);
}

// Bytes of packed copies held for `owner` (-1: every owner), for tests and logs.
extern "C" int64_t ringserve_onednn_packed_bytes(int64_t owner) {
  std::lock_guard<std::mutex> lock(packed_mu);
  int64_t total = 0;
  for (auto& [addr, r] : registered())
    if (owner < 0 || r.owner == owner)
      for (auto& [desc, mem] : r.packed) total += int64_t(desc.get_size());
  return total;
}

// Whether oneDNN makes the matmuls a model of source dtype `x` and weight dtype `w` asks for on
// this CPU (codes: 0 f32, 1 bf16, 2 f16, 3 int8; an int8 weight is weight-only quantized):
// bit 0, from the plain weight (every step), with results in the source's dtype and in f32 (the
// LM head's logits); bit 1, from a packed copy as well (calls of MIN_PACKED_ROWS rows or more).
extern "C" int ringserve_onednn_supports(int x, int w) {
  static const dt codes[] = {dt::f32, dt::bf16, dt::f16, dt::s8};
  if (x < 0 || x > 2 || w < 0 || w > 3) return 0;
  const dt xt = codes[x], wt = codes[w];
  const bool quant = wt == dt::s8;
  try {
    int plain = 1, packed = 2;
    for (dt yt : {xt, dt::f32})
      for (bool transpose_w : {false, true}) {
        plain &= int(primitive(1, 64, 64, xt, wt, yt, transpose_w, quant, false).ok);
        plain &= int(primitive(MIN_PACKED_ROWS, 64, 64, xt, wt, yt, transpose_w, quant, false).ok);
        packed &= int(primitive(MIN_PACKED_ROWS, 64, 64, xt, wt, yt, transpose_w, quant, true).ok) << 1;
      }
    return plain ? plain | packed : 0;
  } catch (...) {
    return 0;
  }
}

extern "C" int ringserve_onednn_ready() {  // 1 if a CPU engine can be made (the runtime is there)
  try {
    cpu_engine();
    return 1;
  } catch (...) {
    return 0;
  }
}
