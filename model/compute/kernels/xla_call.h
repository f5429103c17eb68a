// XLA's FFI for ringserve's CPU custom calls, over the C API alone (xla/ffi/api/c_api.h: plain
// structs, 800 lines of C), shared by cpu_matmul.cc, cpu_attention.cc, cpu_memory.cc and
// onednn_matmul.cc.
//
// jax also ships a C++ layer (xla/ffi/api/ffi.h) that binds a handler's parameters with
// templates. Parsing it took 1.5 s of every kernel's build on 2 Zen 3 cores, its bindings more
// (cpu_memory, 77 lines: 2.3 s with it, 0.4 s here), and a first start builds every kernel
// before its first step can be compiled. A handler here reads its own call frame instead:
//
//   XLA_FFI_Error* my_call(const ringserve::Call& call) {
//     ringserve::Buffer x = call.arg(0);         // .ok() false: no such argument
//     bool t = false;
//     if (!x.ok() || !call.attr("transpose_w", &t)) return call.error("my_call: ...");
//     ... call.pool() ...                        // XLA's intra-op threads (pool.h deals to them)
//     return nullptr;                            // success
//   }
//   RINGSERVE_FFI_HANDLER(MySymbol, my_call)     // the exported symbol jax registers
//
// The handshake around it is what ffi.h's handler does: the call frame's size must be this
// header's (an older or newer jaxlib says so instead of misreading it), a metadata query is
// answered with this header's API version, and only the execute stage runs the handler.

#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/c_api.h"

namespace ringserve {

// The element types the kernels read (XLA's primitive type numbers).
enum class DataType : int {
  PRED = XLA_FFI_DataType_PRED,
  S8 = XLA_FFI_DataType_S8,
  S32 = XLA_FFI_DataType_S32,
  U16 = XLA_FFI_DataType_U16,
  F16 = XLA_FFI_DataType_F16,
  F32 = XLA_FFI_DataType_F32,
  BF16 = XLA_FFI_DataType_BF16,
};

// Bytes per element; 0 for a type packed below a byte or unknown here.
inline size_t byte_width(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8:
    case XLA_FFI_DataType_F8E5M2: case XLA_FFI_DataType_F8E3M4: case XLA_FFI_DataType_F8E4M3:
    case XLA_FFI_DataType_F8E4M3FN: case XLA_FFI_DataType_F8E4M3B11FNUZ: case XLA_FFI_DataType_F8E5M2FNUZ:
    case XLA_FFI_DataType_F8E4M3FNUZ: case XLA_FFI_DataType_F8E8M0FNU:
      return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16: case XLA_FFI_DataType_BF16:
      return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32:
      return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64: case XLA_FFI_DataType_C64:
      return 8;
    case XLA_FFI_DataType_C128:
      return 16;
    default:
      return 0;
  }
}

// A buffer's dimensions (a view of the call frame's).
struct Dims {
  const int64_t* p = nullptr;
  size_t n = 0;
  size_t size() const { return n; }
  int64_t operator[](size_t i) const { return p[i]; }
  int64_t back() const { return p[n - 1]; }
};

// One argument or result buffer; ok() false when the call has no such buffer.
struct Buffer {
  XLA_FFI_Buffer* b = nullptr;
  bool ok() const { return b != nullptr; }
  DataType element_type() const { return static_cast<DataType>(b->dtype); }
  void* untyped_data() const { return b->data; }
  template <typename T>
  T* typed_data() const { return static_cast<T*>(b->data); }
  Dims dimensions() const { return {b->dims, size_t(b->rank)}; }
  size_t element_count() const {
    size_t n = 1;
    for (int64_t d = 0; d < b->rank; ++d) n *= size_t(b->dims[d]);
    return n;
  }
  size_t size_bytes() const { return byte_width(b->dtype) * element_count(); }  // 0: a sub-byte type
};

// XLA's intra-op thread pool (on CPU the pool every step's compute runs on).
class ThreadPool {
 public:
  ThreadPool(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx) : api_(api), ctx_(ctx) {}

  int64_t num_threads() const {
    int64_t n = 0;
    XLA_FFI_ThreadPool_NumThreads_Args a{XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE, nullptr, ctx_, &n};
    if (XLA_FFI_Error* e = api_->XLA_FFI_ThreadPool_NumThreads(&a)) destroy(e);  // no pool: 0
    return n;
  }

  // f() on one of the pool's threads, some time later; on the caller's, now, when there is no pool.
  template <typename F>
  void Schedule(F&& f) const {
    using Task = std::decay_t<F>;
    XLA_FFI_Task* task = +[](void* data) {
      Task* t = static_cast<Task*>(data);
      (*t)();
      delete t;
    };
    Task* data = new Task(std::forward<F>(f));
    XLA_FFI_ThreadPool_Schedule_Args a{XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE, nullptr, ctx_, task, data};
    if (XLA_FFI_Error* e = api_->XLA_FFI_ThreadPool_Schedule(&a)) {
      destroy(e);
      task(data);
    }
  }

 private:
  void destroy(XLA_FFI_Error* e) const {
    XLA_FFI_Error_Destroy_Args a{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, e};
    api_->XLA_FFI_Error_Destroy(&a);
  }

  const XLA_FFI_Api* api_;
  XLA_FFI_ExecutionContext* ctx_;
};

// One call of a custom call: its operands, results and attributes, as XLA passed them.
class Call {
 public:
  explicit Call(XLA_FFI_CallFrame* f) : f_(f) {}

  int64_t args() const { return f_->args.size; }
  int64_t rets() const { return f_->rets.size; }

  Buffer arg(int64_t i) const {
    if (i < 0 || i >= f_->args.size || f_->args.types[i] != XLA_FFI_ArgType_BUFFER) return {};
    return {static_cast<XLA_FFI_Buffer*>(f_->args.args[i])};
  }
  Buffer ret(int64_t i) const {
    if (i < 0 || i >= f_->rets.size || f_->rets.types[i] != XLA_FFI_RetType_BUFFER) return {};
    return {static_cast<XLA_FFI_Buffer*>(f_->rets.rets[i])};
  }

  // The scalar attribute `name` into *out; false when the call has none of that name and type.
  bool attr(const char* name, bool* out) const { return scalar(name, XLA_FFI_DataType_PRED, out, sizeof *out); }
  bool attr(const char* name, int64_t* out) const { return scalar(name, XLA_FFI_DataType_S64, out, sizeof *out); }
  bool attr(const char* name, float* out) const { return scalar(name, XLA_FFI_DataType_F32, out, sizeof *out); }

  ThreadPool pool() const { return ThreadPool(f_->api, f_->ctx); }

  // An error for XLA to raise (it owns it); `message` is copied.
  XLA_FFI_Error* error(const char* message, XLA_FFI_Error_Code code = XLA_FFI_Error_Code_INVALID_ARGUMENT) const {
    XLA_FFI_Error_Create_Args a{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr, message, code};
    return f_->api->XLA_FFI_Error_Create(&a);
  }

 private:
  bool scalar(const char* name, XLA_FFI_DataType dtype, void* out, size_t bytes) const {
    const size_t len = std::strlen(name);
    for (int64_t i = 0; i < f_->attrs.size; ++i) {
      const XLA_FFI_ByteSpan* n = f_->attrs.names[i];
      if (n->len != len || std::memcmp(n->ptr, name, len) != 0) continue;
      if (f_->attrs.types[i] != XLA_FFI_AttrType_SCALAR) return false;
      const auto* s = static_cast<const XLA_FFI_Scalar*>(f_->attrs.attrs[i]);
      if (s->dtype != dtype) return false;
      std::memcpy(out, s->value, bytes);
      return true;
    }
    return false;
  }

  XLA_FFI_CallFrame* f_;
};

// What every handler does around its own work: ffi.h's handshake (above).
inline XLA_FFI_Error* handle(XLA_FFI_CallFrame* frame, XLA_FFI_Error* (*fn)(const Call&)) {
  const Call call(frame);
  if (frame->struct_size != XLA_FFI_CallFrame_STRUCT_SIZE)
    return call.error("ringserve kernel: unexpected XLA_FFI_CallFrame size; rebuild it against this jaxlib");
  XLA_FFI_Extension_Base* ext = frame->extension_start;
  if (ext != nullptr && ext->type == XLA_FFI_Extension_Metadata) {
    auto* meta = reinterpret_cast<XLA_FFI_Metadata_Extension*>(ext);
    if (meta->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
        meta->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE)
      return call.error("ringserve kernel: unexpected XLA_FFI_Metadata size; rebuild it against this jaxlib");
    meta->metadata->api_version = XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR,
                                                      XLA_FFI_API_MINOR};
    meta->metadata->traits = 0;
    meta->metadata->state_type_id = XLA_FFI_TypeId{0};  // stateless
    return nullptr;
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
    return call.error("ringserve kernel: called outside the execute stage");
  return fn(call);
}

}  // namespace ringserve

// The exported handler `symbol` (what build.py registers with jax) around `fn(const Call&)`.
#define RINGSERVE_FFI_HANDLER(symbol, fn) \
  extern "C" XLA_FFI_Error* symbol(XLA_FFI_CallFrame* frame) { return ringserve::handle(frame, fn); }
