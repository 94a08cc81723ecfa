// XLA FFI handlers that launch AITER's hand-written assembly MLA decode kernels (stage 1 of
// `mla_decode_fwd`, persistent and split-KV), its fp8 persistent-scheduling prefill kernel
// (`mla_prefill_ps_asm_fwd`) and its FlashAttention v3 forward (`fmha_v3_varlen_fwd`, the
// kernel `flash_attn_varlen_func` runs for MLA's qk 192 / v 128 prefill; both at the end of this
// file) from the `.co` code objects of an installed AITER, with jax_mla's own copy of the kernels' argument blocks. No torch, no AITER
// C++, no Python per call.
//
// The argument block (`MlaAsmKernelArgs`) was read from ROCm/aiter at commit
//   e4048607a535ace3a2b51ded31b1c8c2d45c0879 (2026-08-22), csrc/py_itfs_cu/asm_mla.cu,
//   `struct __attribute__((packed)) KernelArgs` (the gfx942/gfx950 layout; p2/p3 from
//   csrc/include/aiter_hip_common.h),
// and is written here from that description: every field sits in its own 16-byte slot (a
// pointer + 2 x u32 padding, or a 32-bit scalar + 3 x u32 padding), 368 bytes in all. The
// static_asserts below pin sizeof and every offset; jax_mla/backends/aiter/native.py carries the
// same table (and checks it against JaxMlaAiterAsmLayout) and refuses an AITER install whose
// kernel table does not look like the one at that commit.
//
// Stages. execute (the only one registered by default): load the `.co` named by the `co_path`
// attribute with hipModuleLoad and look up `kernel_name` with hipModuleGetFunction, once per
// (device ordinal, path, kernel), with the thread's stream-capture mode relaxed
// (hipThreadExchangeStreamCaptureMode: the first execution of a command buffer records the
// launch by capturing XLA's stream, and a capture otherwise refuses a module load); later
// executions find it without allocating. XLA would call an initialize stage for every call on
// every execution of the program, so it is exported (same load) but registered only for the
// A/B knob JAX_MLA_FFI_INITIALIZE_STAGE=1. Then execute validates the buffers
// (shapes and dtypes only: nothing is read from the device), fill the argument block, in
// persistent mode write the two work-metadata pointers into the `work_meta` result with four
// hipMemsetD32Async on XLA's stream (the kernel reads work_indptr / work_info through them; the
// addresses are the operands' own, so a copied plan never leaves stale pointers), then one
// hipModuleLaunchKernel with HIP_LAUNCH_PARAM_BUFFER_POINTER/SIZE. No allocation, no blocking
// call, no host sync: command-buffer compatible.
//
// libamdhip64 is opened with dlopen at first use, so this file builds with a plain C++ compiler
// and no ROCm headers. `jax_mla_aiter_asm_pack` (CPU) is a twin that decodes the same operands
// and attributes and writes the argument block it would launch with (and the grid) into an extra
// result, for tests on hosts without an AMD GPU.

#include <dlfcn.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "relaxed_capture.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mla {
namespace aiter_asm {
namespace {

// ---- the argument block (ROCm/aiter e4048607, csrc/py_itfs_cu/asm_mla.cu, KernelArgs) --------

struct Pad2 {  // AITER's p2: pads a pointer to 16 bytes
  uint32_t pad0, pad1;
};
struct Pad3 {  // AITER's p3: pads a 32-bit scalar to 16 bytes
  uint32_t pad0, pad1, pad2;
};

struct __attribute__((packed)) MlaAsmKernelArgs {
  void* ptr_R;               // split output (fp32; bf16 when out_16_nosplit, split-KV mode)
  Pad2 pad_r;
  void* ptr_LSE;             // split LSE, fp32
  Pad2 pad_lse;
  void* ptr_Q;               // q [tokens, heads, 576]
  Pad2 pad_q;
  void* ptr_KV;              // kv [pages, page_size, 1, 576]
  Pad2 pad_kv;
  void* ptr_LTP;             // kv_indptr int32 [batch + 1]
  Pad2 pad_ltp;
  void* ptr_LTD;             // kv_page_indices int32
  Pad2 pad_ltd;
  void* ptr_LTL;             // kv_last_page_lens int32 [batch]
  Pad2 pad_ltl;
  float scalar;              // softmax scale
  Pad3 pad_scalar;
  uint32_t s_MQA;            // query rows per request and kv head (gqa * qlen, or gqa)
  Pad3 pad_mqa;
  uint32_t s_kv_split;       // split_o.shape[1]
  Pad3 pad_kv_split;
  uint32_t s_Q_Bs;           // bytes between requests in q: q.stride(0) * elem * qlen
  Pad3 pad_q_bs;
  uint32_t s_Bs;             // bytes per KV page: kv.stride(0) * elem
  Pad3 pad_bs;
  uint32_t s_log2_plen;      // log2(page_size)
  Pad3 pad_log2_plen;
  void* ptr_QTP;             // qo_indptr int32 [batch + 1]
  Pad2 pad_qtp;
  void* ptr_STP;             // split-KV: num_kv_splits_indptr; persistent: work metadata (2 x u64)
  Pad2 pad_stp;
  void* ptr_RP;              // persistent: the final output; split-KV: null
  Pad2 pad_rp;
  void* ptr_QSCALE;          // fp8 q: q_scale float32 [1]
  Pad2 pad_qscale;
  void* ptr_KVSCALE;         // fp8 q or kv: kv_scale float32 [1]
  Pad2 pad_kvscale;
  uint32_t out_16_nosplit;   // persistent: s_kv_split; split-KV: s_kv_split == 1
  Pad3 pad_out16;
  void* ptr_LSEP;            // final LSE float32 [tokens, heads] or null
  Pad2 pad_lsep;
  void* ptr_GKVTP;           // global kv_indptr (round-robin context parallel) or null
  Pad2 pad_gkvtp;
  uint32_t s_cp_world_size;  // >= 1
  Pad3 pad_cp_world_size;
  uint32_t s_cp_rank;
  Pad3 pad_cp_rank;
};

// The layout at ROCm/aiter e4048607 (and the `.args` offsets in its gfx950 code objects).
static_assert(sizeof(void*) == 8, "AITER's kernel arguments are laid out for 64-bit pointers");
static_assert(sizeof(Pad2) == 8 && sizeof(Pad3) == 12, "padding slots");
static_assert(sizeof(MlaAsmKernelArgs) == 0x170, "AITER e4048607 KernelArgs is 368 bytes");
#define JAX_MLA_AITER_FIELDS(X)                                                          \
  X(ptr_R, 0x00) X(ptr_LSE, 0x10) X(ptr_Q, 0x20) X(ptr_KV, 0x30) X(ptr_LTP, 0x40)        \
  X(ptr_LTD, 0x50) X(ptr_LTL, 0x60) X(scalar, 0x70) X(s_MQA, 0x80) X(s_kv_split, 0x90)   \
  X(s_Q_Bs, 0xA0) X(s_Bs, 0xB0) X(s_log2_plen, 0xC0) X(ptr_QTP, 0xD0) X(ptr_STP, 0xE0)   \
  X(ptr_RP, 0xF0) X(ptr_QSCALE, 0x100) X(ptr_KVSCALE, 0x110) X(out_16_nosplit, 0x120)    \
  X(ptr_LSEP, 0x130) X(ptr_GKVTP, 0x140) X(s_cp_world_size, 0x150) X(s_cp_rank, 0x160)
#define JAX_MLA_AITER_ASSERT_OFFSET(field, offset)                             \
  static_assert(offsetof(MlaAsmKernelArgs, field) == (offset),                 \
                "MlaAsmKernelArgs::" #field " is not where AITER e4048607 has it");
JAX_MLA_AITER_FIELDS(JAX_MLA_AITER_ASSERT_OFFSET)
#undef JAX_MLA_AITER_ASSERT_OFFSET

constexpr int kBlockThreads = 256;  // 4 wave64, as AITER launches every MLA decode kernel

// ---- the HIP runtime, opened at run time ----------------------------------------------------

using HipResult = int;  // hipError_t; 0 is hipSuccess

struct Hip {
  HipResult (*module_load)(void** module, const char* path) = nullptr;
  HipResult (*module_get_function)(void** function, void* module, const char* name) = nullptr;
  HipResult (*launch_kernel)(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                             unsigned by, unsigned bz, unsigned shared, void* stream,
                             void** params, void** extra) = nullptr;
  HipResult (*memset_d32_async)(void* dst, int value, size_t count, void* stream) = nullptr;
  HipResult (*get_device)(int* ordinal) = nullptr;
  HipResult (*set_device)(int ordinal) = nullptr;
  const char* (*error_string)(HipResult) = nullptr;  // optional
  HipResult (*exchange_capture_mode)(int* mode) = nullptr;  // optional
  std::string error;  // why the runtime cannot be used ("" when it can)

  std::string Describe(HipResult r) const {
    std::string s = "HIP error " + std::to_string(r);
    if (error_string != nullptr) {
      if (const char* text = error_string(r)) s += " " + std::string(text);
    }
    return s;
  }
};

template <typename T>
void Load(void* lib, const char* name, T* fn, std::string* missing) {
  *fn = reinterpret_cast<T>(dlsym(lib, name));
  if (*fn == nullptr && missing != nullptr) *missing += std::string(" ") + name;
}

const Hip& GetHip() {
  static Hip hip;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = nullptr;
    for (const char* name : {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"}) {
      if ((lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) break;
    }
    if (lib == nullptr) {
      hip.error = "jax_mla could not open the ROCm runtime (libamdhip64.so) to launch AITER's "
                  "asm MLA decode: install ROCm, or put its lib directory on LD_LIBRARY_PATH";
      return;
    }
    std::string missing;
    Load(lib, "hipModuleLoad", &hip.module_load, &missing);
    Load(lib, "hipModuleGetFunction", &hip.module_get_function, &missing);
    Load(lib, "hipModuleLaunchKernel", &hip.launch_kernel, &missing);
    Load(lib, "hipMemsetD32Async", &hip.memset_d32_async, &missing);
    Load(lib, "hipGetDevice", &hip.get_device, &missing);
    Load(lib, "hipSetDevice", &hip.set_device, &missing);
    Load(lib, "hipGetErrorString", &hip.error_string, nullptr);
    Load(lib, "hipThreadExchangeStreamCaptureMode", &hip.exchange_capture_mode, nullptr);
    if (!missing.empty()) hip.error = "jax_mla: the ROCm runtime (libamdhip64.so) lacks" + missing;
  });
  return hip;
}

// The device `ordinal` current for the life of the object (the initialize stage may run on a
// thread where another device is current).
class ScopedDevice {
 public:
  ScopedDevice(const Hip& hip, int32_t ordinal) : hip_(hip) {
    if (hip.get_device(&saved_) == 0 && saved_ != ordinal) {
      restore_ = hip.set_device(ordinal) == 0;
    }
  }
  ~ScopedDevice() {
    if (restore_) hip_.set_device(saved_);
  }

 private:
  const Hip& hip_;
  int saved_ = 0;
  bool restore_ = false;
};

// Functions by (device ordinal, code object path, kernel name); a hit allocates nothing (the
// map's comparator takes the views).
using FunctionKey = std::tuple<int32_t, std::string, std::string>;
using FunctionView = std::tuple<int32_t, std::string_view, std::string_view>;
std::mutex cache_mutex;
std::map<FunctionKey, void*, std::less<>> function_cache;

ffi::ErrorOr<void*> GetFunction(int32_t device, std::string_view co_path,
                                std::string_view kernel_name) {
  const Hip& hip = GetHip();
  if (!hip.error.empty()) return ffi::Unexpected(ffi::Error::Internal(hip.error));
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (auto it = function_cache.find(FunctionView{device, co_path, kernel_name});
      it != function_cache.end()) {
    return it->second;
  }
  std::string path(co_path), name(kernel_name);
  FunctionKey key{device, path, name};
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    std::fclose(f);
  } else {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_mla: AITER's asm MLA kernel file " + path + " (for " + name + ") cannot be read: "
        "the AITER install is incomplete or AITER_ASM_DIR points elsewhere"));
  }
  RelaxedCapture relaxed(hip.exchange_capture_mode);
  ScopedDevice scoped(hip, device);
  void* module = nullptr;
  if (HipResult r = hip.module_load(&module, path.c_str()); r != 0) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_mla: hipModuleLoad(" + path + ") failed on device " + std::to_string(device) +
        " (" + hip.Describe(r) + "): the code object must be for this device's architecture"));
  }
  void* function = nullptr;
  if (HipResult r = hip.module_get_function(&function, module, name.c_str()); r != 0) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_mla: kernel " + name + " is not in " + path + " (" + hip.Describe(r) +
        "): the AITER install's mla_asm.csv and its .co files disagree"));
  }
  function_cache.emplace(std::move(key), function);
  return function;
}

// ---- operands -> argument block ---------------------------------------------------------------

struct Attrs {
  std::string_view co_path;
  std::string_view kernel_name;
  float softmax_scale;
  int32_t max_seqlen_q;
  int32_t page_size;
  int32_t s_mqa;
  int32_t sub_q;
  int32_t persistent;
  int32_t cp_world_size;
  int32_t cp_rank;
};

struct Packed {
  MlaAsmKernelArgs args;
  uint32_t grid[3];
  void* work_meta;                 // persistent: where the two pointers go
  uint64_t work_meta_values[2];    // ... and what they are
};

bool IsFp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E4M3FNUZ;
}

void* Ptr(const ffi::AnyBuffer& b) {
  return b.element_count() == 0 ? nullptr : b.untyped_data();
}

std::string Dims(const ffi::AnyBuffer& b) {
  std::string s = "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_mla_aiter_asm_mla: " + what);
}

ffi::ErrorOr<Packed> Pack(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer qo_indptr,
                          ffi::AnyBuffer kv_indptr, ffi::AnyBuffer kv_page_indices,
                          ffi::AnyBuffer kv_last_page_lens, ffi::AnyBuffer split_indptr,
                          ffi::AnyBuffer work_indptr, ffi::AnyBuffer work_info,
                          ffi::AnyBuffer q_scale, ffi::AnyBuffer kv_scale,
                          ffi::AnyBuffer g_kv_indptr, ffi::AnyBuffer split_o,
                          ffi::AnyBuffer split_lse, ffi::AnyBuffer out, ffi::AnyBuffer final_lse,
                          ffi::AnyBuffer work_meta, const Attrs& a) {
  auto fail = [](const std::string& what) { return ffi::Unexpected(Invalid(what)); };
  if (q.dimensions().size() != 3) return fail("q must be [tokens, heads, head_dim], got " + Dims(q));
  if (q.element_type() != ffi::DataType::BF16 && !IsFp8(q.element_type())) {
    return fail("q must be bfloat16 or float8_e4m3 (fn/fnuz)");
  }
  if (kv.dimensions().size() < 2) return fail("kv must be [pages, ..., head_dim], got " + Dims(kv));
  if (kv.element_type() != ffi::DataType::BF16 && !IsFp8(kv.element_type())) {
    return fail("kv must be bfloat16 or float8_e4m3 (fn/fnuz)");
  }
  const int64_t head_dim = q.dimensions()[2];
  if (kv.dimensions().back() != head_dim) {
    return fail("q " + Dims(q) + " and kv " + Dims(kv) + " differ in head_dim");
  }
  for (auto [buf, name] : {std::pair{&qo_indptr, "qo_indptr"}, {&kv_indptr, "kv_indptr"},
                           {&kv_page_indices, "kv_page_indices"},
                           {&kv_last_page_lens, "kv_last_page_lens"},
                           {&split_indptr, "split_indptr"}, {&work_indptr, "work_indptr"},
                           {&work_info, "work_info"}, {&g_kv_indptr, "g_kv_indptr"}}) {
    if (buf->element_count() != 0 && buf->element_type() != ffi::DataType::S32) {
      return fail(std::string(name) + " must be int32");
    }
  }
  if (qo_indptr.element_count() < 1) return fail("qo_indptr must have batch + 1 entries");
  if (split_o.dimensions().size() != 4) {
    return fail("split_o must be [rows, kv_splits, heads, v_head_dim], got " + Dims(split_o));
  }
  if (split_lse.element_type() != ffi::DataType::F32 || split_lse.element_count() == 0) {
    return fail("split_lse must be a non-empty float32 array");
  }
  if (a.max_seqlen_q < 1 || a.sub_q < 1 || a.s_mqa < 1) {
    return fail("max_seqlen_q, sub_q and s_mqa must be >= 1");
  }
  if (a.page_size < 1 || (a.page_size & (a.page_size - 1)) != 0) {
    return fail("page_size " + std::to_string(a.page_size) + " is not a power of two");
  }
  const bool q8 = IsFp8(q.element_type()), kv8 = IsFp8(kv.element_type());
  for (auto [buf, name] : {std::pair{&q_scale, "q_scale"}, {&kv_scale, "kv_scale"}}) {
    if (buf->element_count() != 0 && buf->element_type() != ffi::DataType::F32) {
      return fail(std::string(name) + " must be float32[1]");
    }
  }
  if (q8 && (q_scale.element_count() == 0 || kv_scale.element_count() == 0)) {
    return fail("an fp8 q needs q_scale and kv_scale");
  }
  if (final_lse.element_count() != 0 && final_lse.element_type() != ffi::DataType::F32) {
    return fail("final_lse must be float32");
  }

  const int64_t batch = static_cast<int64_t>(qo_indptr.element_count()) - 1;
  const int64_t heads = q.dimensions()[1];
  const int64_t kv_split = split_o.dimensions()[1];
  const size_t q_elem = ffi::ByteWidth(q.element_type());
  const size_t kv_elem = ffi::ByteWidth(kv.element_type());
  int64_t page_elems = 1;
  for (size_t i = 1; i < kv.dimensions().size(); ++i) page_elems *= kv.dimensions()[i];
  const int64_t q_bs = heads * head_dim * static_cast<int64_t>(q_elem) * a.max_seqlen_q;
  const int64_t page_bytes = page_elems * static_cast<int64_t>(kv_elem);
  if (q_bs > INT32_MAX || page_bytes > INT32_MAX) {
    return fail("a request's q rows or a KV page exceed the kernels' 32-bit byte strides");
  }
  if (kv_split < 1) return fail("split_o must have at least one KV split");

  Packed p{};
  MlaAsmKernelArgs& args = p.args;
  args.ptr_R = Ptr(split_o);
  args.ptr_LSE = Ptr(split_lse);
  args.ptr_Q = Ptr(q);
  args.ptr_KV = Ptr(kv);
  args.ptr_LTP = Ptr(kv_indptr);
  args.ptr_LTD = Ptr(kv_page_indices);
  args.ptr_LTL = Ptr(kv_last_page_lens);
  args.ptr_QTP = Ptr(qo_indptr);
  args.scalar = a.softmax_scale;
  args.s_MQA = static_cast<uint32_t>(a.s_mqa);
  args.s_kv_split = static_cast<uint32_t>(kv_split);
  args.s_Q_Bs = static_cast<uint32_t>(q_bs);
  args.s_Bs = static_cast<uint32_t>(page_bytes);
  args.s_log2_plen = static_cast<uint32_t>(std::log2(static_cast<double>(a.page_size)) + 0.5);
  args.ptr_LSEP = Ptr(final_lse);
  args.ptr_GKVTP = Ptr(g_kv_indptr);
  if (args.ptr_GKVTP != nullptr &&
      (a.cp_world_size < 1 || a.cp_rank < 0 || a.cp_rank >= a.cp_world_size)) {
    return fail("with g_kv_indptr, cp_rank must be in [0, cp_world_size)");
  }
  args.s_cp_world_size = a.cp_world_size > 0 ? static_cast<uint32_t>(a.cp_world_size) : 1u;
  args.s_cp_rank = a.cp_rank >= 0 ? static_cast<uint32_t>(a.cp_rank) : 0u;
  if (q8) {
    args.ptr_QSCALE = Ptr(q_scale);
    args.ptr_KVSCALE = Ptr(kv_scale);
  } else if (kv8) {
    args.ptr_KVSCALE = Ptr(kv_scale);
  }
  if (a.persistent) {
    if (work_indptr.element_count() < 1 || work_info.element_count() == 0) {
      return fail("persistent mode needs work_indptr and work_info");
    }
    if (work_meta.size_bytes() < 2 * sizeof(uint64_t)) {
      return fail("persistent mode needs a 16-byte work_meta result (2 x uint64 pointers)");
    }
    if (out.element_count() == 0) return fail("persistent mode needs the output buffer");
    args.out_16_nosplit = static_cast<uint32_t>(kv_split);
    args.ptr_RP = Ptr(out);
    args.ptr_STP = work_meta.untyped_data();
    p.work_meta = work_meta.untyped_data();
    p.work_meta_values[0] = reinterpret_cast<uint64_t>(work_indptr.untyped_data());
    p.work_meta_values[1] = reinterpret_cast<uint64_t>(work_info.untyped_data());
    p.grid[0] = static_cast<uint32_t>(work_indptr.element_count() - 1);
    p.grid[1] = p.grid[2] = 1;
  } else {
    if (split_indptr.element_count() != static_cast<size_t>(batch + 1)) {
      return fail("split-KV mode needs split_indptr with batch + 1 entries");
    }
    // With one split AITER sets out_16_nosplit and most kernels then write R as 16-bit final
    // rows (the caller sizes split_o in bfloat16); with more, R is float32.
    const bool one_split = kv_split == 1;
    const ffi::DataType r_type = split_o.element_type();
    if (r_type != ffi::DataType::F32 && !(one_split && r_type == ffi::DataType::BF16)) {
      return fail(one_split ? "split_o must be float32 or bfloat16" : "split_o must be float32");
    }
    args.out_16_nosplit = one_split ? 1u : 0u;
    args.ptr_RP = nullptr;
    args.ptr_STP = Ptr(split_indptr);
    p.grid[0] = static_cast<uint32_t>((a.max_seqlen_q * heads + a.sub_q - 1) / a.sub_q);
    p.grid[1] = static_cast<uint32_t>(batch);
    p.grid[2] = static_cast<uint32_t>(kv_split);
  }
  if (a.persistent && split_o.element_type() != ffi::DataType::F32) {
    return fail("split_o must be float32");
  }
  return p;
}

// ---- handlers -------------------------------------------------------------------------------

#define JAX_MLA_AITER_BUFFER_PARAMS                                                            \
  ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer qo_indptr, ffi::AnyBuffer kv_indptr,    \
      ffi::AnyBuffer kv_page_indices, ffi::AnyBuffer kv_last_page_lens,                        \
      ffi::AnyBuffer split_indptr, ffi::AnyBuffer work_indptr, ffi::AnyBuffer work_info,       \
      ffi::AnyBuffer q_scale, ffi::AnyBuffer kv_scale, ffi::AnyBuffer g_kv_indptr,             \
      ffi::Result<ffi::AnyBuffer> split_o, ffi::Result<ffi::AnyBuffer> split_lse,              \
      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> final_lse,                  \
      ffi::Result<ffi::AnyBuffer> work_meta
#define JAX_MLA_AITER_BUFFER_ARGS                                                             \
  q, kv, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens, split_indptr, work_indptr, \
      work_info, q_scale, kv_scale, g_kv_indptr, *split_o, *split_lse, *out, *final_lse,      \
      *work_meta
#define JAX_MLA_AITER_ATTR_PARAMS                                                        \
  std::string_view co_path, std::string_view kernel_name, float softmax_scale,           \
      int32_t max_seqlen_q, int32_t page_size, int32_t s_mqa, int32_t sub_q,             \
      int32_t persistent, int32_t cp_world_size, int32_t cp_rank
#define JAX_MLA_AITER_ATTRS                                                                  \
  Attrs {                                                                                    \
    co_path, kernel_name, softmax_scale, max_seqlen_q, page_size, s_mqa, sub_q, persistent, \
        cp_world_size, cp_rank                                                               \
  }

template <typename Binding>
auto BindBuffers(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // kv
      .template Arg<ffi::AnyBuffer>()  // qo_indptr
      .template Arg<ffi::AnyBuffer>()  // kv_indptr
      .template Arg<ffi::AnyBuffer>()  // kv_page_indices
      .template Arg<ffi::AnyBuffer>()  // kv_last_page_lens
      .template Arg<ffi::AnyBuffer>()  // split_indptr (split-KV) or empty
      .template Arg<ffi::AnyBuffer>()  // work_indptr (persistent) or empty
      .template Arg<ffi::AnyBuffer>()  // work_info (persistent) or empty
      .template Arg<ffi::AnyBuffer>()  // q_scale or empty
      .template Arg<ffi::AnyBuffer>()  // kv_scale or empty
      .template Arg<ffi::AnyBuffer>()  // g_kv_indptr or empty
      .template Ret<ffi::AnyBuffer>()  // split_o
      .template Ret<ffi::AnyBuffer>()  // split_lse
      .template Ret<ffi::AnyBuffer>()  // out (persistent) or empty
      .template Ret<ffi::AnyBuffer>()  // final_lse or empty
      .template Ret<ffi::AnyBuffer>();  // work_meta (persistent: 16 bytes) or empty
}

template <typename Binding>
auto BindKernelAttrs(Binding&& binding) {  // every handler's first three attributes
  return std::forward<Binding>(binding)
      .template Attr<std::string_view>("co_path")
      .template Attr<std::string_view>("kernel_name")
      .template Attr<float>("softmax_scale");
}

template <typename Binding>
auto BindAttrs(Binding binding) {
  return BindKernelAttrs(std::move(binding))
      .template Attr<int32_t>("max_seqlen_q")
      .template Attr<int32_t>("page_size")
      .template Attr<int32_t>("s_mqa")
      .template Attr<int32_t>("sub_q")
      .template Attr<int32_t>("persistent")
      .template Attr<int32_t>("cp_world_size")
      .template Attr<int32_t>("cp_rank");
}

// Initialize stage of every handler (registered only for the A/B knob): the code object loaded
// (and cached) for this device.
ffi::Error LoadOnce(int32_t device, std::string_view co_path, std::string_view kernel_name) {
  auto function = GetFunction(device, co_path, kernel_name);
  return function.has_error() ? function.error() : ffi::Error::Success();
}

// Execute stage of every handler, after packing: one launch of `kernel_name` (loaded at the
// first call) on XLA's stream with its argument block passed whole
// (HIP_LAUNCH_PARAM_BUFFER_POINTER, HIP_LAUNCH_PARAM_BUFFER_SIZE, HIP_LAUNCH_PARAM_END);
// nothing for an empty grid.
ffi::Error LaunchBlock(int32_t device, void* stream, std::string_view co_path,
                       std::string_view kernel_name, void* args, size_t arg_size,
                       const uint32_t (&grid)[3], uint32_t block_threads) {
  auto function = GetFunction(device, co_path, kernel_name);  // loaded at the first call
  if (function.has_error()) return function.error();
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return ffi::Error::Success();
  const Hip& hip = GetHip();
  void* config[] = {reinterpret_cast<void*>(0x01), args, reinterpret_cast<void*>(0x02),
                    &arg_size, reinterpret_cast<void*>(0x03)};
  if (HipResult r = hip.launch_kernel(*function, grid[0], grid[1], grid[2], block_threads, 1, 1,
                                      0, stream, nullptr, config);
      r != 0) {
    return ffi::Error::Internal("jax_mla: launching AITER's " + std::string(kernel_name) +
                                " from " + std::string(co_path) + " failed (" +
                                hip.Describe(r) + ")");
  }
  return ffi::Error::Success();
}

// The CPU twins' result: the argument block's bytes, then grid xyz and block xyz (uint32).
ffi::Error WritePacked(ffi::AnyBuffer& out, std::string_view handler, const void* args,
                       size_t arg_size, const uint32_t (&grid)[3], uint32_t block_threads) {
  const size_t bytes = arg_size + 6 * sizeof(uint32_t);
  if (out.size_bytes() != bytes) {
    return ffi::Error::InvalidArgument(std::string(handler) +
                                       ": the packing result must be uint8[" +
                                       std::to_string(bytes) + "]");
  }
  auto* dst = static_cast<uint8_t*>(out.untyped_data());
  std::memcpy(dst, args, arg_size);
  const uint32_t launch[6] = {grid[0], grid[1], grid[2], block_threads, 1, 1};
  std::memcpy(dst + arg_size, launch, sizeof(launch));
  return ffi::Error::Success();
}

// The execution context every ROCm handler binds first: XLA's stream and the device ordinal.
// By reference: an empty ffi::Binding cannot be moved into a parameter (private constructor).
template <typename Binding>
auto BindStreamAndDevice(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Ctx<ffi::PlatformStream<void*>>()
      .template Ctx<ffi::DeviceOrdinal>();
}

template <typename Binding>
auto BindGpu(Binding binding) {
  return BindAttrs(BindBuffers(BindStreamAndDevice(std::move(binding))));
}

ffi::Error InitializeStage(void*, int32_t device, JAX_MLA_AITER_BUFFER_PARAMS,
                           JAX_MLA_AITER_ATTR_PARAMS) {
  return LoadOnce(device, co_path, kernel_name);
}

ffi::Error ExecuteStage(void* stream, int32_t device, JAX_MLA_AITER_BUFFER_PARAMS,
                        JAX_MLA_AITER_ATTR_PARAMS) {
  auto packed = Pack(JAX_MLA_AITER_BUFFER_ARGS, JAX_MLA_AITER_ATTRS);
  if (packed.has_error()) return packed.error();
  const Hip& hip = GetHip();
  Packed& p = *packed;
  if (p.work_meta != nullptr) {
    // Two uint64 pointers as four 32-bit words, stream-ordered (capturable, no host sync).
    for (int i = 0; i < 4; ++i) {
      uint32_t word = static_cast<uint32_t>(p.work_meta_values[i / 2] >> (32 * (i % 2)));
      int value;
      std::memcpy(&value, &word, sizeof(value));
      if (HipResult r = hip.memset_d32_async(static_cast<uint32_t*>(p.work_meta) + i, value, 1,
                                             stream);
          r != 0) {
        return ffi::Error::Internal("jax_mla: writing the work metadata for " +
                                    std::string(kernel_name) + " failed (" + hip.Describe(r) +
                                    ")");
      }
    }
  }
  return LaunchBlock(device, stream, co_path, kernel_name, &p.args, sizeof(p.args), p.grid,
                     kBlockThreads);
}

// The CPU twin: the same decoding and packing, then the argument block's bytes followed by
// the grid and block (six uint32) into the last result (uint8[kPackBytes]); in persistent mode
// the two work-metadata pointers are written into `work_meta` directly (host memory here).
constexpr size_t kPackBytes = sizeof(MlaAsmKernelArgs) + 6 * sizeof(uint32_t);

ffi::Error PackStage(JAX_MLA_AITER_BUFFER_PARAMS, ffi::Result<ffi::AnyBuffer> packed_bytes,
                     JAX_MLA_AITER_ATTR_PARAMS) {
  auto packed = Pack(JAX_MLA_AITER_BUFFER_ARGS, JAX_MLA_AITER_ATTRS);
  if (packed.has_error()) return packed.error();
  const Packed& p = *packed;
  if (packed_bytes->size_bytes() == kPackBytes && p.work_meta != nullptr) {
    std::memcpy(p.work_meta, p.work_meta_values, 16);
  }
  return WritePacked(*packed_bytes, "jax_mla_aiter_asm_mla", &p.args, sizeof(p.args), p.grid,
                     kBlockThreads);
}

// ---- the fp8 PS prefill: `mla_prefill_ps_asm_fwd` ---------------------------------------------
//
// Read from the same commit and file: `struct __attribute__((packed)) PsKernelArgs` and
// `mla_prefill_ps_asm_fwd`. Fourteen pointers and five 32-bit scalars, each in its own 16-byte
// slot (304 bytes); one workgroup of 8 wave64 per entry of work_indptr less one (the CUs the
// PS plan was made for). AITER passes the query indptr as both qo_indptr and kv_indptr (the
// new tokens attend to themselves); here they are separate operands. Whole-tile works write
// `out`; split tiles write float32 partials and their LSE, which the caller merges (AITER's
// `mla_reduce_v1`; jnp in jax_mla).

struct __attribute__((packed)) MlaPsPrefillKernelArgs {
  void* ptr_Q;               // q [tokens, heads, 192] fp8
  Pad2 pad_q;
  void* ptr_K;               // k [kv tokens, kv heads, 192] fp8
  Pad2 pad_k;
  void* ptr_V;               // v [kv tokens, kv heads, 128] fp8
  Pad2 pad_v;
  void* ptr_O;               // out [tokens, heads, 128] bf16
  Pad2 pad_o;
  void* ptr_PartialO;        // partials [rows, heads, 128] f32
  Pad2 pad_partial_o;
  void* ptr_PartialLSE;      // their LSE [rows, heads] f32 (natural log)
  Pad2 pad_partial_lse;
  void* ptr_WorkIndptr;      // int32 [CUs + 1]
  Pad2 pad_work_indptr;
  void* ptr_WorkInfo;        // int32 [works, 8]
  Pad2 pad_work_info;
  void* ptr_QOIndptr;        // int32 [batch + 1]
  Pad2 pad_qo_indptr;
  void* ptr_KVIndptr;        // int32 [batch + 1]
  Pad2 pad_kv_indptr;
  void* ptr_KVPageIndices;   // int32 [kv tokens used]
  Pad2 pad_kv_page_indices;
  void* ptr_QScale;          // float32 [1] or null
  Pad2 pad_q_scale;
  void* ptr_KScale;          // float32 [1] or null
  Pad2 pad_k_scale;
  void* ptr_VScale;          // float32 [1] or null
  Pad2 pad_v_scale;
  float scalar;              // softmax scale
  Pad3 pad_scalar;
  uint32_t num_q_tokens;     // q.shape[0]
  Pad3 pad_num_q_tokens;
  uint32_t num_head_q;       // q.shape[1]
  Pad3 pad_num_head_q;
  uint32_t num_page;         // k.shape[0]
  Pad3 pad_num_page;
  uint32_t num_used_page;    // kv_page_indices.shape[0]
  Pad3 pad_num_used_page;
};

static_assert(sizeof(MlaPsPrefillKernelArgs) == 0x130, "AITER e4048607 PsKernelArgs is 304 bytes");
#define JAX_MLA_AITER_PS_FIELDS(X)                                                          \
  X(ptr_Q, 0x00) X(ptr_K, 0x10) X(ptr_V, 0x20) X(ptr_O, 0x30) X(ptr_PartialO, 0x40)          \
  X(ptr_PartialLSE, 0x50) X(ptr_WorkIndptr, 0x60) X(ptr_WorkInfo, 0x70)                       \
  X(ptr_QOIndptr, 0x80) X(ptr_KVIndptr, 0x90) X(ptr_KVPageIndices, 0xA0) X(ptr_QScale, 0xB0) \
  X(ptr_KScale, 0xC0) X(ptr_VScale, 0xD0) X(scalar, 0xE0) X(num_q_tokens, 0xF0)              \
  X(num_head_q, 0x100) X(num_page, 0x110) X(num_used_page, 0x120)
#define JAX_MLA_AITER_PS_ASSERT_OFFSET(field, offset)                          \
  static_assert(offsetof(MlaPsPrefillKernelArgs, field) == (offset),           \
                "MlaPsPrefillKernelArgs::" #field " is not where AITER e4048607 has it");
JAX_MLA_AITER_PS_FIELDS(JAX_MLA_AITER_PS_ASSERT_OFFSET)
#undef JAX_MLA_AITER_PS_ASSERT_OFFSET

constexpr int kPsBlockThreads = 512;  // 8 wave64 (mla_prefill_ps_asm_fwd's wave_per_tg)

struct PsPacked {
  MlaPsPrefillKernelArgs args;
  uint32_t grid;
};

ffi::Error InvalidPs(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_mla_aiter_asm_prefill_ps: " + what);
}

ffi::ErrorOr<PsPacked> PackPs(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer qo_indptr, ffi::AnyBuffer kv_indptr,
                              ffi::AnyBuffer kv_page_indices, ffi::AnyBuffer work_indptr,
                              ffi::AnyBuffer work_info, ffi::AnyBuffer q_scale,
                              ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::AnyBuffer out,
                              ffi::AnyBuffer partial_o, ffi::AnyBuffer partial_lse,
                              float softmax_scale) {
  auto fail = [](const std::string& what) { return ffi::Unexpected(InvalidPs(what)); };
  for (auto [buf, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    if (buf->dimensions().size() != 3) {
      return fail(std::string(name) + " must be [tokens, heads, head_dim], got " + Dims(*buf));
    }
    if (!IsFp8(buf->element_type())) return fail(std::string(name) + " must be float8_e4m3");
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd[2] != kd[2]) return fail("q " + Dims(q) + " and k " + Dims(k) + " differ in head_dim");
  if (vd[0] != kd[0] || vd[1] != kd[1]) {
    return fail("v " + Dims(v) + " must have k's tokens and heads " + Dims(k));
  }
  if (kd[1] < 1 || qd[1] % kd[1] != 0) {
    return fail("q's heads must be a multiple of k's: q " + Dims(q) + ", k " + Dims(k));
  }
  if (out.element_type() != ffi::DataType::BF16 || out.dimensions().size() != 3 ||
      out.dimensions()[0] != qd[0] || out.dimensions()[1] != qd[1] ||
      out.dimensions()[2] != vd[2]) {
    return fail("out must be bfloat16 [q tokens, q heads, v head_dim], got " + Dims(out));
  }
  if (partial_o.element_type() != ffi::DataType::F32 || partial_o.dimensions().size() != 3 ||
      partial_o.dimensions()[1] != qd[1] || partial_o.dimensions()[2] != vd[2]) {
    return fail("partial_o must be float32 [rows, q heads, v head_dim], got " + Dims(partial_o));
  }
  if (partial_lse.element_type() != ffi::DataType::F32 ||
      partial_lse.dimensions().size() != 2 ||
      partial_lse.dimensions()[0] != partial_o.dimensions()[0] ||
      partial_lse.dimensions()[1] != qd[1]) {
    return fail("partial_lse must be float32 [rows, q heads], got " + Dims(partial_lse));
  }
  for (auto [buf, name] : {std::pair{&qo_indptr, "qo_indptr"}, {&kv_indptr, "kv_indptr"},
                           {&kv_page_indices, "kv_page_indices"},
                           {&work_indptr, "work_indptr"}, {&work_info, "work_info"}}) {
    if (buf->element_type() != ffi::DataType::S32) return fail(std::string(name) + " must be int32");
  }
  if (qo_indptr.element_count() < 1 || kv_indptr.element_count() != qo_indptr.element_count()) {
    return fail("qo_indptr and kv_indptr must both have batch + 1 entries");
  }
  if (work_indptr.element_count() < 1 || work_info.element_count() == 0 ||
      work_info.element_count() % 8 != 0) {
    return fail("the PS plan needs work_indptr [CUs + 1] and work_info [works, 8]");
  }
  for (auto [buf, name] : {std::pair{&q_scale, "q_scale"}, {&k_scale, "k_scale"},
                           {&v_scale, "v_scale"}}) {
    if (buf->element_count() != 0 &&
        (buf->element_type() != ffi::DataType::F32 || buf->element_count() != 1)) {
      return fail(std::string(name) + " must be float32[1] or absent");
    }
  }
  for (int64_t n : {qd[0], qd[1], kd[0], static_cast<int64_t>(kv_page_indices.element_count())}) {
    if (n > UINT32_MAX) return fail("a size exceeds the kernel's 32-bit arguments");
  }
  PsPacked p{};
  MlaPsPrefillKernelArgs& a = p.args;
  a.ptr_Q = Ptr(q);
  a.ptr_K = Ptr(k);
  a.ptr_V = Ptr(v);
  a.ptr_O = Ptr(out);
  a.ptr_PartialO = Ptr(partial_o);
  a.ptr_PartialLSE = Ptr(partial_lse);
  a.ptr_WorkIndptr = Ptr(work_indptr);
  a.ptr_WorkInfo = Ptr(work_info);
  a.ptr_QOIndptr = Ptr(qo_indptr);
  a.ptr_KVIndptr = Ptr(kv_indptr);
  a.ptr_KVPageIndices = Ptr(kv_page_indices);
  a.ptr_QScale = Ptr(q_scale);
  a.ptr_KScale = Ptr(k_scale);
  a.ptr_VScale = Ptr(v_scale);
  a.scalar = softmax_scale;
  a.num_q_tokens = static_cast<uint32_t>(qd[0]);
  a.num_head_q = static_cast<uint32_t>(qd[1]);
  a.num_page = static_cast<uint32_t>(kd[0]);
  a.num_used_page = static_cast<uint32_t>(kv_page_indices.element_count());
  p.grid = static_cast<uint32_t>(work_indptr.element_count() - 1);
  return p;
}

#define JAX_MLA_AITER_PS_BUFFER_PARAMS                                                        \
  ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer qo_indptr,            \
      ffi::AnyBuffer kv_indptr, ffi::AnyBuffer kv_page_indices, ffi::AnyBuffer work_indptr,  \
      ffi::AnyBuffer work_info, ffi::AnyBuffer q_scale, ffi::AnyBuffer k_scale,              \
      ffi::AnyBuffer v_scale, ffi::Result<ffi::AnyBuffer> out,                               \
      ffi::Result<ffi::AnyBuffer> partial_o, ffi::Result<ffi::AnyBuffer> partial_lse
#define JAX_MLA_AITER_PS_BUFFER_ARGS                                                          \
  q, k, v, qo_indptr, kv_indptr, kv_page_indices, work_indptr, work_info, q_scale, k_scale,  \
      v_scale, *out, *partial_o, *partial_lse
#define JAX_MLA_AITER_PS_ATTR_PARAMS \
  std::string_view co_path, std::string_view kernel_name, float softmax_scale

template <typename Binding>
auto BindPs(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .template Arg<ffi::AnyBuffer>()  // qo_indptr
      .template Arg<ffi::AnyBuffer>()  // kv_indptr
      .template Arg<ffi::AnyBuffer>()  // kv_page_indices
      .template Arg<ffi::AnyBuffer>()  // work_indptr
      .template Arg<ffi::AnyBuffer>()  // work_info
      .template Arg<ffi::AnyBuffer>()  // q_scale or empty
      .template Arg<ffi::AnyBuffer>()  // k_scale or empty
      .template Arg<ffi::AnyBuffer>()  // v_scale or empty
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // partial_o
      .template Ret<ffi::AnyBuffer>();  // partial_lse
}

template <typename Binding>
auto BindPsAttrs(Binding binding) {
  return BindKernelAttrs(std::move(binding));
}

template <typename Binding>
auto BindPsGpu(Binding binding) {
  return BindPsAttrs(BindPs(BindStreamAndDevice(std::move(binding))));
}

ffi::Error InitializePs(void*, int32_t device, JAX_MLA_AITER_PS_BUFFER_PARAMS,
                        JAX_MLA_AITER_PS_ATTR_PARAMS) {
  return LoadOnce(device, co_path, kernel_name);
}

ffi::Error ExecutePs(void* stream, int32_t device, JAX_MLA_AITER_PS_BUFFER_PARAMS,
                     JAX_MLA_AITER_PS_ATTR_PARAMS) {
  auto packed = PackPs(JAX_MLA_AITER_PS_BUFFER_ARGS, softmax_scale);
  if (packed.has_error()) return packed.error();
  const uint32_t grid[3] = {packed->grid, 1, 1};
  return LaunchBlock(device, stream, co_path, kernel_name, &packed->args, sizeof(packed->args),
                     grid, kPsBlockThreads);
}

// The CPU twin: the argument block's bytes, then the grid and block (six uint32).
ffi::Error PackPsStage(JAX_MLA_AITER_PS_BUFFER_PARAMS, ffi::Result<ffi::AnyBuffer> packed_bytes,
                       JAX_MLA_AITER_PS_ATTR_PARAMS) {
  auto packed = PackPs(JAX_MLA_AITER_PS_BUFFER_ARGS, softmax_scale);
  if (packed.has_error()) return packed.error();
  const uint32_t grid[3] = {packed->grid, 1, 1};
  return WritePacked(*packed_bytes, "jax_mla_aiter_asm_prefill_ps", &packed->args,
                     sizeof(packed->args), grid, kPsBlockThreads);
}


// ---- the FlashAttention v3 forward: `fmha_v3_varlen_fwd` (group mode) ------------------------
//
// Read from the same commit: `struct __attribute__((packed)) fmha_fwd_v3_args` in
// csrc/include/mha_fwd.h, filled by `init_fmha_fwd_v3_args` and launched by `fmha_fwd_v3` in
// csrc/cpp_itfs/mha_fwd.cu, from the operands `get_asm_mha_varlen_fwd_args`
// (csrc/py_itfs_cu/asm_mha_varlen_fwd.cu) derives for packed varlen q, k, v. Five pointers,
// twenty-two 32-bit scalars, the sequence-start pointers and the fp8 descale fields, each in its
// own 16-byte slot (656 bytes; the bf16 code objects declare the first 512). Group mode: the
// batch strides are 0, `s_seq_len` and `s_kv_seq_len` are the packed token counts, and the
// sequence starts go both as the sequence and the padding pointers (no padded layout). Strides
// are in bytes. The launch rule values (query tile, tile merge, tuning option, threads) come
// as attributes from native_fmha.py, which ports AITER's rules for them.

struct __attribute__((packed)) MlaFmhaFwdKernelArgs {
  void* ptr_o;                  // out [q tokens, q heads, v head_dim] bf16
  Pad2 pad_o;
  void* ptr_q;                  // q [q tokens, q heads, qk head_dim] bf16
  Pad2 pad_q;
  void* ptr_k;                  // k [kv tokens, kv heads, qk head_dim] bf16
  Pad2 pad_k;
  void* ptr_v;                  // v [kv tokens, kv heads, v head_dim] bf16
  Pad2 pad_v;
  void* ptr_lse;                // lse [q heads, q tokens] f32 (natural log) or null
  Pad2 pad_lse;
  float scalar;                 // softmax scale
  Pad3 pad_scalar;
  uint32_t s_seq_len;           // q tokens (group mode: all sequences)
  Pad3 pad_seq_len;
  uint32_t s_Seqs;              // q token stride, bytes
  Pad3 pad_seqs;
  uint32_t s_Ts;                // one query tile of tokens, bytes
  Pad3 pad_ts;
  uint32_t s_Hs;                // q head stride, bytes
  Pad3 pad_hs;
  uint32_t s_Bs;                // q batch stride: 0 in group mode
  Pad3 pad_bs;
  uint32_t s_gqa;               // q heads per kv head
  Pad3 pad_gqa;
  uint32_t s_k_Seqs;
  Pad3 pad_k_seqs;
  uint32_t s_k_Hs;
  Pad3 pad_k_hs;
  uint32_t s_k_Bs;
  Pad3 pad_k_bs;
  uint32_t s_opt;               // AITER's tuning option
  Pad3 pad_opt;
  uint32_t s_lse;               // 1: write lse
  Pad3 pad_s_lse;
  uint32_t s_kv_seq_len;        // kv tokens (group mode: all sequences)
  Pad3 pad_kv_seq_len;
  uint32_t s_qk_head_dim;
  Pad3 pad_qk_head_dim;
  uint32_t s_v_head_dim;
  Pad3 pad_v_head_dim;
  uint32_t s_q_head_num;
  Pad3 pad_q_head_num;
  uint32_t s_v_Seqs;
  Pad3 pad_v_seqs;
  uint32_t s_v_Hs;
  Pad3 pad_v_hs;
  uint32_t s_v_Bs;
  Pad3 pad_v_bs;
  uint32_t s_o_Seqs;
  Pad3 pad_o_seqs;
  uint32_t s_o_Hs;
  Pad3 pad_o_hs;
  uint32_t s_o_Bs;
  Pad3 pad_o_bs;
  const void* ptr_qseq;         // int32 [batch + 1] query sequence starts
  Pad2 pad_qseq;
  const void* ptr_kseq;         // int32 [batch + 1] key sequence starts
  Pad2 pad_kseq;
  uint32_t s_lse_Hs;            // lse head stride, bytes
  Pad3 pad_lse_hs;
  const void* ptr_qseq_padding;  // the physical starts: the same array here
  Pad2 pad_qseq_padding;
  const void* ptr_kseq_padding;
  Pad2 pad_kseq_padding;
  const void* ptr_q_descale;    // fp8 kernels only: null
  Pad2 pad_q_descale;
  const void* ptr_k_descale;
  Pad2 pad_k_descale;
  const void* ptr_v_descale;
  Pad2 pad_v_descale;
  uint32_t s_descale_q_Bs;
  Pad3 pad_descale_q_bs;
  uint32_t s_descale_q_Hs;
  Pad3 pad_descale_q_hs;
  uint32_t s_descale_k_Bs;
  Pad3 pad_descale_k_bs;
  uint32_t s_descale_k_Hs;
  Pad3 pad_descale_k_hs;
  uint32_t s_descale_v_Bs;
  Pad3 pad_descale_v_bs;
  uint32_t s_descale_v_Hs;
  Pad3 pad_descale_v_hs;
};

static_assert(sizeof(MlaFmhaFwdKernelArgs) == 0x290,
              "AITER e4048607 fmha_fwd_v3_args is 656 bytes");
#define JAX_MLA_AITER_FMHA_FIELDS(X)                                                          \
  X(ptr_o, 0x00) X(ptr_q, 0x10) X(ptr_k, 0x20) X(ptr_v, 0x30) X(ptr_lse, 0x40)               \
  X(scalar, 0x50) X(s_seq_len, 0x60) X(s_Seqs, 0x70) X(s_Ts, 0x80) X(s_Hs, 0x90)             \
  X(s_Bs, 0xA0) X(s_gqa, 0xB0) X(s_k_Seqs, 0xC0) X(s_k_Hs, 0xD0) X(s_k_Bs, 0xE0)             \
  X(s_opt, 0xF0) X(s_lse, 0x100) X(s_kv_seq_len, 0x110) X(s_qk_head_dim, 0x120)              \
  X(s_v_head_dim, 0x130) X(s_q_head_num, 0x140) X(s_v_Seqs, 0x150) X(s_v_Hs, 0x160)          \
  X(s_v_Bs, 0x170) X(s_o_Seqs, 0x180) X(s_o_Hs, 0x190) X(s_o_Bs, 0x1A0) X(ptr_qseq, 0x1B0)   \
  X(ptr_kseq, 0x1C0) X(s_lse_Hs, 0x1D0) X(ptr_qseq_padding, 0x1E0)                           \
  X(ptr_kseq_padding, 0x1F0) X(ptr_q_descale, 0x200) X(ptr_k_descale, 0x210)                 \
  X(ptr_v_descale, 0x220) X(s_descale_q_Bs, 0x230) X(s_descale_q_Hs, 0x240)                  \
  X(s_descale_k_Bs, 0x250) X(s_descale_k_Hs, 0x260) X(s_descale_v_Bs, 0x270)                 \
  X(s_descale_v_Hs, 0x280)
#define JAX_MLA_AITER_FMHA_ASSERT_OFFSET(field, offset)                        \
  static_assert(offsetof(MlaFmhaFwdKernelArgs, field) == (offset),             \
                "MlaFmhaFwdKernelArgs::" #field " is not where AITER e4048607 has it");
JAX_MLA_AITER_FMHA_FIELDS(JAX_MLA_AITER_FMHA_ASSERT_OFFSET)
#undef JAX_MLA_AITER_FMHA_ASSERT_OFFSET

struct FmhaAttrs {
  std::string_view co_path;
  std::string_view kernel_name;
  float softmax_scale;
  int32_t ts_qo;          // query rows a workgroup takes (the kernel table's ts_qo)
  int32_t tg_div;         // query tiles a workgroup takes (2: a head and a tail tile, causal)
  int32_t opt;            // AITER's tuning option (s_opt)
  int32_t block_threads;  // 256 for qk 192 / v 128, else 512
};

struct FmhaPacked {
  MlaFmhaFwdKernelArgs args;
  uint32_t grid[3];
};

ffi::Error InvalidFmha(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_mla_aiter_asm_fmha_fwd: " + what);
}

ffi::ErrorOr<FmhaPacked> PackFmha(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::AnyBuffer cu_seqlens_q, ffi::AnyBuffer cu_seqlens_k,
                                  ffi::AnyBuffer out, ffi::AnyBuffer lse, const FmhaAttrs& a) {
  auto fail = [](const std::string& what) { return ffi::Unexpected(InvalidFmha(what)); };
  for (auto [buf, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    if (buf->dimensions().size() != 3) {
      return fail(std::string(name) + " must be [tokens, heads, head_dim], got " + Dims(*buf));
    }
    if (buf->element_type() != ffi::DataType::BF16) {
      return fail(std::string(name) + " must be bfloat16 (the v3 kernels' 16-bit type)");
    }
  }
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd[2] != kd[2]) return fail("q " + Dims(q) + " and k " + Dims(k) + " differ in head_dim");
  if (vd[0] != kd[0] || vd[1] != kd[1]) {
    return fail("v " + Dims(v) + " must have k's tokens and heads " + Dims(k));
  }
  if (kd[1] < 1 || qd[1] % kd[1] != 0) {
    return fail("q's heads must be a multiple of k's: q " + Dims(q) + ", k " + Dims(k));
  }
  if (out.element_type() != ffi::DataType::BF16 || out.dimensions().size() != 3 ||
      out.dimensions()[0] != qd[0] || out.dimensions()[1] != qd[1] ||
      out.dimensions()[2] != vd[2]) {
    return fail("out must be bfloat16 [q tokens, q heads, v head_dim], got " + Dims(out));
  }
  const bool has_lse = lse.element_count() != 0;
  if (lse.element_type() != ffi::DataType::F32 ||
      (has_lse && (lse.dimensions().size() != 2 || lse.dimensions()[0] != qd[1] ||
                   lse.dimensions()[1] != qd[0]))) {
    return fail("lse must be float32 [q heads, q tokens] or empty, got " + Dims(lse));
  }
  for (auto [buf, name] : {std::pair{&cu_seqlens_q, "cu_seqlens_q"},
                           {&cu_seqlens_k, "cu_seqlens_k"}}) {
    if (buf->element_type() != ffi::DataType::S32 || buf->dimensions().size() != 1 ||
        buf->element_count() < 1) {
      return fail(std::string(name) + " must be int32 [batch + 1], got " + Dims(*buf));
    }
  }
  if (cu_seqlens_k.element_count() != cu_seqlens_q.element_count()) {
    return fail("cu_seqlens_q " + Dims(cu_seqlens_q) + " and cu_seqlens_k " +
                Dims(cu_seqlens_k) + " must both have batch + 1 entries");
  }
  if (a.ts_qo < 1 || a.tg_div < 1 || a.opt < 0 || a.block_threads < 1) {
    return fail("ts_qo, tg_div and block_threads must be positive and opt non-negative");
  }
  constexpr int64_t bpe = 2;  // bf16 in and out
  const int64_t q_seqs = qd[1] * qd[2] * bpe, k_seqs = kd[1] * kd[2] * bpe;
  const int64_t v_seqs = vd[1] * vd[2] * bpe, o_seqs = qd[1] * vd[2] * bpe;
  const int64_t batch = cu_seqlens_q.element_count() - 1;
  for (int64_t n : {qd[0], kd[0], qd[1], batch, q_seqs * a.ts_qo, k_seqs, v_seqs, o_seqs,
                    qd[0] * 4}) {
    if (n > UINT32_MAX) return fail("a size or byte stride exceeds the kernel's 32-bit arguments");
  }
  FmhaPacked p{};
  MlaFmhaFwdKernelArgs& g = p.args;
  g.ptr_o = Ptr(out);
  g.ptr_q = Ptr(q);
  g.ptr_k = Ptr(k);
  g.ptr_v = Ptr(v);
  g.ptr_lse = has_lse ? lse.untyped_data() : nullptr;
  g.scalar = a.softmax_scale;
  g.s_seq_len = static_cast<uint32_t>(qd[0]);
  g.s_Seqs = static_cast<uint32_t>(q_seqs);
  g.s_Ts = static_cast<uint32_t>(q_seqs * a.ts_qo);
  g.s_Hs = static_cast<uint32_t>(qd[2] * bpe);
  g.s_gqa = static_cast<uint32_t>(qd[1] / kd[1]);
  g.s_k_Seqs = static_cast<uint32_t>(k_seqs);
  g.s_k_Hs = static_cast<uint32_t>(kd[2] * bpe);
  g.s_opt = static_cast<uint32_t>(a.opt);
  g.s_lse = has_lse ? 1 : 0;
  g.s_kv_seq_len = static_cast<uint32_t>(kd[0]);
  g.s_qk_head_dim = static_cast<uint32_t>(qd[2]);
  g.s_v_head_dim = static_cast<uint32_t>(vd[2]);
  g.s_q_head_num = static_cast<uint32_t>(qd[1]);
  g.s_v_Seqs = static_cast<uint32_t>(v_seqs);
  g.s_v_Hs = static_cast<uint32_t>(vd[2] * bpe);
  g.s_o_Seqs = static_cast<uint32_t>(o_seqs);
  g.s_o_Hs = static_cast<uint32_t>(vd[2] * bpe);
  g.ptr_qseq = g.ptr_qseq_padding = Ptr(cu_seqlens_q);
  g.ptr_kseq = g.ptr_kseq_padding = Ptr(cu_seqlens_k);
  g.s_lse_Hs = has_lse ? static_cast<uint32_t>(qd[0] * 4) : 0;
  // Group mode: heads, sequences, then query tiles of all q tokens (AITER sizes z by the
  // packed count; a workgroup past its sequence's end returns).
  const int64_t tiles = (qd[0] + a.ts_qo - 1) / a.ts_qo;
  p.grid[0] = static_cast<uint32_t>(qd[1]);
  p.grid[1] = static_cast<uint32_t>(batch);
  p.grid[2] = static_cast<uint32_t>((tiles + a.tg_div - 1) / a.tg_div);
  return p;
}

#define JAX_MLA_AITER_FMHA_BUFFER_PARAMS                                                   \
  ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer cu_seqlens_q,      \
      ffi::AnyBuffer cu_seqlens_k, ffi::Result<ffi::AnyBuffer> out,                       \
      ffi::Result<ffi::AnyBuffer> lse
#define JAX_MLA_AITER_FMHA_BUFFER_ARGS q, k, v, cu_seqlens_q, cu_seqlens_k, *out, *lse
#define JAX_MLA_AITER_FMHA_ATTR_PARAMS                                                     \
  std::string_view co_path, std::string_view kernel_name, float softmax_scale,            \
      int32_t ts_qo, int32_t tg_div, int32_t opt, int32_t block_threads
#define JAX_MLA_AITER_FMHA_ATTRS \
  FmhaAttrs { co_path, kernel_name, softmax_scale, ts_qo, tg_div, opt, block_threads }

template <typename Binding>
auto BindFmha(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .template Arg<ffi::AnyBuffer>()  // cu_seqlens_q
      .template Arg<ffi::AnyBuffer>()  // cu_seqlens_k
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>();  // lse or empty
}

template <typename Binding>
auto BindFmhaAttrs(Binding binding) {
  return BindKernelAttrs(std::move(binding))
      .template Attr<int32_t>("ts_qo")
      .template Attr<int32_t>("tg_div")
      .template Attr<int32_t>("opt")
      .template Attr<int32_t>("block_threads");
}

template <typename Binding>
auto BindFmhaGpu(Binding binding) {
  return BindFmhaAttrs(BindFmha(BindStreamAndDevice(std::move(binding))));
}

ffi::Error InitializeFmha(void*, int32_t device, JAX_MLA_AITER_FMHA_BUFFER_PARAMS,
                          JAX_MLA_AITER_FMHA_ATTR_PARAMS) {
  return LoadOnce(device, co_path, kernel_name);
}

ffi::Error ExecuteFmha(void* stream, int32_t device, JAX_MLA_AITER_FMHA_BUFFER_PARAMS,
                       JAX_MLA_AITER_FMHA_ATTR_PARAMS) {
  auto packed = PackFmha(JAX_MLA_AITER_FMHA_BUFFER_ARGS, JAX_MLA_AITER_FMHA_ATTRS);
  if (packed.has_error()) return packed.error();
  return LaunchBlock(device, stream, co_path, kernel_name, &packed->args, sizeof(packed->args),
                     packed->grid, static_cast<uint32_t>(block_threads));
}

// The CPU twin: the argument block's bytes, then the grid and block (six uint32).
ffi::Error PackFmhaStage(JAX_MLA_AITER_FMHA_BUFFER_PARAMS,
                         ffi::Result<ffi::AnyBuffer> packed_bytes,
                         JAX_MLA_AITER_FMHA_ATTR_PARAMS) {
  auto packed = PackFmha(JAX_MLA_AITER_FMHA_BUFFER_ARGS, JAX_MLA_AITER_FMHA_ATTRS);
  if (packed.has_error()) return packed.error();
  return WritePacked(*packed_bytes, "jax_mla_aiter_asm_fmha_fwd", &packed->args,
                     sizeof(packed->args), packed->grid, static_cast<uint32_t>(block_threads));
}

}  // namespace
}  // namespace aiter_asm
}  // namespace jax_mla

#define JAX_MLA_EXPORT_HANDLER(name) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*);
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterAsmInitializeRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterAsmExecuteRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterAsmPackCpu)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterPsPrefillInitializeRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterPsPrefillExecuteRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterPsPrefillPackCpu)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterFmhaFwdInitializeRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterFmhaFwdExecuteRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaAiterFmhaFwdPackCpu)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaAiterAsmInitializeRocm, jax_mla::aiter_asm::InitializeStage,
                              jax_mla::aiter_asm::BindGpu(ffi::Ffi::BindInitialize()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaAiterAsmExecuteRocm, jax_mla::aiter_asm::ExecuteStage,
                              jax_mla::aiter_asm::BindGpu(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMlaAiterAsmPackCpu, jax_mla::aiter_asm::PackStage,
    jax_mla::aiter_asm::BindAttrs(
        jax_mla::aiter_asm::BindBuffers(ffi::Ffi::Bind()).Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaAiterPsPrefillInitializeRocm, jax_mla::aiter_asm::InitializePs,
                              jax_mla::aiter_asm::BindPsGpu(ffi::Ffi::BindInitialize()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaAiterPsPrefillExecuteRocm, jax_mla::aiter_asm::ExecutePs,
                              jax_mla::aiter_asm::BindPsGpu(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMlaAiterPsPrefillPackCpu, jax_mla::aiter_asm::PackPsStage,
    jax_mla::aiter_asm::BindPsAttrs(
        jax_mla::aiter_asm::BindPs(ffi::Ffi::Bind()).Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaAiterFmhaFwdInitializeRocm,
                              jax_mla::aiter_asm::InitializeFmha,
                              jax_mla::aiter_asm::BindFmhaGpu(ffi::Ffi::BindInitialize()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaAiterFmhaFwdExecuteRocm, jax_mla::aiter_asm::ExecuteFmha,
                              jax_mla::aiter_asm::BindFmhaGpu(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMlaAiterFmhaFwdPackCpu, jax_mla::aiter_asm::PackFmhaStage,
    jax_mla::aiter_asm::BindFmhaAttrs(
        jax_mla::aiter_asm::BindFmha(ffi::Ffi::Bind()).Ret<ffi::AnyBuffer>()));

// The argument block's layout as "name:offset;..." (offsets in bytes) plus "size:N", copied
// into `buffer`; returns the full length. native.py checks its own table against this.
extern "C" __attribute__((visibility("default"))) int JaxMlaAiterAsmLayout(char* buffer,
                                                                           int size) {
  std::string s;
#define JAX_MLA_AITER_DESCRIBE(field, offset) \
  s += #field ":" + std::to_string(offsetof(jax_mla::aiter_asm::MlaAsmKernelArgs, field)) + ";";
  JAX_MLA_AITER_FIELDS(JAX_MLA_AITER_DESCRIBE)
#undef JAX_MLA_AITER_DESCRIBE
  s += "size:" + std::to_string(sizeof(jax_mla::aiter_asm::MlaAsmKernelArgs));
  if (size > 0) std::snprintf(buffer, static_cast<size_t>(size), "%s", s.c_str());
  return static_cast<int>(s.size());
}

// The PS prefill's argument block, in the same form.
extern "C" __attribute__((visibility("default"))) int JaxMlaAiterPsPrefillLayout(char* buffer,
                                                                                 int size) {
  std::string s;
#define JAX_MLA_AITER_DESCRIBE(field, offset)                                                  \
  s += #field ":" +                                                                            \
       std::to_string(offsetof(jax_mla::aiter_asm::MlaPsPrefillKernelArgs, field)) + ";";
  JAX_MLA_AITER_PS_FIELDS(JAX_MLA_AITER_DESCRIBE)
#undef JAX_MLA_AITER_DESCRIBE
  s += "size:" + std::to_string(sizeof(jax_mla::aiter_asm::MlaPsPrefillKernelArgs));
  if (size > 0) std::snprintf(buffer, static_cast<size_t>(size), "%s", s.c_str());
  return static_cast<int>(s.size());
}

// The FlashAttention v3 forward's argument block, in the same form.
extern "C" __attribute__((visibility("default"))) int JaxMlaAiterFmhaFwdLayout(char* buffer,
                                                                               int size) {
  std::string s;
#define JAX_MLA_AITER_DESCRIBE(field, offset)                                                \
  s += #field ":" +                                                                          \
       std::to_string(offsetof(jax_mla::aiter_asm::MlaFmhaFwdKernelArgs, field)) + ";";
  JAX_MLA_AITER_FMHA_FIELDS(JAX_MLA_AITER_DESCRIBE)
#undef JAX_MLA_AITER_DESCRIBE
  s += "size:" + std::to_string(sizeof(jax_mla::aiter_asm::MlaFmhaFwdKernelArgs));
  if (size > 0) std::snprintf(buffer, static_cast<size_t>(size), "%s", s.c_str());
  return static_cast<int>(s.size());
}

// Why the ROCm runtime cannot be used for AITER's asm kernels ("" when it can).
extern "C" __attribute__((visibility("default"))) int JaxMlaAiterAsmDriverError(char* buffer,
                                                                                int size) {
  const std::string& error = jax_mla::aiter_asm::GetHip().error;
  if (size > 0) std::snprintf(buffer, static_cast<size_t>(size), "%s", error.c_str());
  return static_cast<int>(error.size());
}

// Loads (or finds) `kernel_name` from the code object `co_path` on `device` as every handler's
// execute stage does before its launch: jax_mla calls it when it traces a launch
// (native.preload), so that the first execution, which XLA may record into a command buffer by
// stream capture, finds it loaded. 0 on success, else the error's length + 1 with its text
// copied into `error`.
extern "C" __attribute__((visibility("default"))) int JaxMlaAiterLoadKernel(
    int device, const char* co_path, const char* kernel_name, char* error, int error_size) {
  auto function = jax_mla::aiter_asm::GetFunction(device, co_path, kernel_name);
  if (function.has_value()) return 0;
  std::string message = function.error().message();
  if (error_size > 0) std::snprintf(error, static_cast<size_t>(error_size), "%s", message.c_str());
  return static_cast<int>(message.size()) + 1;
}
