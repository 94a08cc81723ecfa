// XLA FFI handlers that launch kernels compiled ahead of time by Triton (a cubin on CUDA, an
// hsaco on ROCm) on XLA's stream.
//
// A launch is described entirely by the custom call's attributes: the kernel's name, its binary
// (and a hash of it, the module cache key), the grid, the threads per block, the dynamic shared
// memory, and how many hidden pointer parameters Triton appended to the kernel (its global and
// profile scratch; jax_mla's kernels need neither, so they are passed as null). The kernel's
// parameters are the device pointers of every operand, then of every result, in order (an
// aliased result is passed twice, once as each), then the hidden ones.
//
// The driver (libcuda / libamdhip64) is opened with dlopen on first use, so this library builds
// with a plain C++ compiler and no CUDA or ROCm toolkit. A module is loaded once per context
// (CUDA: the stream's; HIP: the device's) and binary, and cached for the life of the process:
// when jax_mla traces the launch (`JaxMlaTritonLoadKernel` into each local device's primary
// context, the one XLA's streams use: ffi_launch.preload), else at the first execution. After
// that execution only looks the function up (no allocation) and launches (nothing for an empty
// grid), so the handlers are command-buffer (CUDA graph) compatible.
//
// Only the execute stage is registered by default. XLA calls a registered initialize stage for
// every custom call on every execution of the program, command buffer or not (a call frame, an
// execution-scoped state and the attribute decoding each time): host work per call that a
// command buffer cannot hide, since XLA launches the graph only after every thunk is
// initialized. The first execution of a command buffer records our launch by capturing XLA's
// stream, so the module load may then happen inside a stream capture: it runs with the
// thread's capture mode relaxed (cuThreadExchangeStreamCaptureMode), which lets the thread make
// the calls a capture otherwise refuses, and the function is loaded eagerly (cuFuncLoad, where
// the driver has it) so that no lazy load is left for the captured launch. The initialize
// stage stays exported (``JaxMlaTritonInitialize*``) for the A/B knob
// JAX_MLA_FFI_INITIALIZE_STAGE=1. Where jaxlib's headers have XLA's record API (0.11+), a record
// stage for CUDA is built too, with the bootstrap that registers it (see Record and
// JaxMlaTritonBootstrapCuda below; launcher="ffi_record").

#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "relaxed_capture.h"
#include "xla/ffi/api/ffi.h"

// XLA's record stage (jaxlib 0.11 and later): the handler gives XLA its launch to put in the
// command buffer as a kernel node, instead of XLA capturing the execute stage's launch.
#if __has_include("xla/ffi/api/record_c_api.h")
#include "xla/ffi/api/record_c_api.h"
#define JAX_MLA_HAS_RECORD 1
// The record API's version 0.5 (jaxlib 0.12) names the kernel by a loaded function handle and
// its launch by XLA's shared kernel types (kernel_c_api.h); version 0.1 (jaxlib 0.11) took the
// cubin and the launch dimensions as arguments of its own.
#if __has_include("xla/ffi/api/kernel_c_api.h")
#define JAX_MLA_RECORD_BY_FUNCTION 1
#else
#define JAX_MLA_RECORD_BY_FUNCTION 0
#endif
#else
#define JAX_MLA_HAS_RECORD 0
#endif

namespace ffi = xla::ffi;

namespace jax_mla {
namespace {

using Result = int;  // CUresult / hipError_t: 0 is success.

// The few driver entry points a launch needs; CUDA's and HIP's have the same shapes.
struct Driver {
  const char* vendor = nullptr;  // "CUDA" or "HIP"
  Result (*module_load_data)(void** module, const void* image) = nullptr;
  Result (*module_get_function)(void** function, void* module, const char* name) = nullptr;
  Result (*launch_kernel)(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned shared, void* stream,
                          void** params, void** extra) = nullptr;
  Result (*func_set_attribute)(void* function, int attribute, int value) = nullptr;
  // CUDA 12+: a launch with attributes, for programmatic dependent launch (optional).
  Result (*launch_kernel_ex)(const void* config, void* function, void** params,
                             void** extra) = nullptr;
  // Making the device's context current for a module load (CUDA: the stream's context, or the
  // device's primary context when there is no stream; HIP: the device ordinal), whatever
  // thread it runs on.
  Result (*stream_get_ctx)(void* stream, void** ctx) = nullptr;
  Result (*primary_ctx_retain)(void** ctx, int device) = nullptr;  // optional
  Result (*ctx_push)(void* ctx) = nullptr;
  Result (*ctx_pop)(void** ctx) = nullptr;
  Result (*get_device)(int* ordinal) = nullptr;
  Result (*set_device)(int ordinal) = nullptr;
  // Swapping the thread's stream-capture mode (CUDA 10.1+, ROCm 5+), so that a module load may
  // run while XLA captures its stream; and loading a function now rather than at its first
  // launch (CUDA 12.4+). Both optional.
  Result (*exchange_capture_mode)(int* mode) = nullptr;
  Result (*func_load)(void* function) = nullptr;
  // For error messages: what device an ordinal is (optional entry points).
  Result (*device_get)(int* device, int ordinal) = nullptr;
  Result (*device_get_attribute)(int* value, int attribute, int device) = nullptr;
  Result (*device_get_name)(char* name, int len, int device) = nullptr;
  std::string error;  // why the driver could not be opened ("" when it was)

  std::string Describe(Result r) const {
    return std::string(vendor) + " error " + std::to_string(r);
  }
};

template <typename T>
bool Load(void* lib, const char* name, T* fn, std::string* missing) {
  *fn = reinterpret_cast<T>(dlsym(lib, name));
  if (*fn == nullptr) *missing += std::string(" ") + name;
  return *fn != nullptr;
}

const Driver& GetDriver(bool hip) {
  static Driver cuda, rocm;
  static std::once_flag cuda_once, rocm_once;
  Driver& d = hip ? rocm : cuda;
  std::call_once(hip ? rocm_once : cuda_once, [&] {
    d.vendor = hip ? "HIP" : "CUDA";
    const char* names[] = {hip ? "libamdhip64.so" : "libcuda.so.1",
                           hip ? "libamdhip64.so.6" : "libcuda.so"};
    void* lib = nullptr;
    for (const char* name : names) {
      if ((lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) break;
    }
    if (lib == nullptr) {
      d.error = hip ? "jax_mla could not open the ROCm runtime (libamdhip64.so): install "
                      "ROCm, or put its lib directory on LD_LIBRARY_PATH"
                    : "jax_mla could not open the NVIDIA driver (libcuda.so.1): install the "
                      "driver, or put its lib directory on LD_LIBRARY_PATH";
      return;
    }
    std::string missing;
    if (hip) {
      Load(lib, "hipModuleLoadData", &d.module_load_data, &missing);
      Load(lib, "hipModuleGetFunction", &d.module_get_function, &missing);
      Load(lib, "hipModuleLaunchKernel", &d.launch_kernel, &missing);
      Load(lib, "hipGetDevice", &d.get_device, &missing);
      Load(lib, "hipSetDevice", &d.set_device, &missing);
      std::string optional;
      Load(lib, "hipDeviceGetName", &d.device_get_name, &optional);
      Load(lib, "hipThreadExchangeStreamCaptureMode", &d.exchange_capture_mode, &optional);
    } else {
      Load(lib, "cuModuleLoadData", &d.module_load_data, &missing);
      Load(lib, "cuModuleGetFunction", &d.module_get_function, &missing);
      Load(lib, "cuLaunchKernel", &d.launch_kernel, &missing);
      Load(lib, "cuFuncSetAttribute", &d.func_set_attribute, &missing);
      Load(lib, "cuStreamGetCtx", &d.stream_get_ctx, &missing);
      Load(lib, "cuCtxPushCurrent_v2", &d.ctx_push, &missing);
      Load(lib, "cuCtxPopCurrent_v2", &d.ctx_pop, &missing);
      std::string optional;
      Load(lib, "cuLaunchKernelEx", &d.launch_kernel_ex, &optional);
      Load(lib, "cuDeviceGet", &d.device_get, &optional);
      Load(lib, "cuDeviceGetAttribute", &d.device_get_attribute, &optional);
      Load(lib, "cuThreadExchangeStreamCaptureMode", &d.exchange_capture_mode, &optional);
      Load(lib, "cuFuncLoad", &d.func_load, &optional);
      Load(lib, "cuDevicePrimaryCtxRetain", &d.primary_ctx_retain, &optional);
    }
    if (!missing.empty()) d.error = "jax_mla: the " + std::string(d.vendor) +
                                    " driver lacks" + missing;
  });
  return d;
}

// "device 0 (sm_90)" on CUDA, "device 0 (AMD Instinct MI300X)" on ROCm, as far as known.
std::string DescribeDevice(const Driver& d, int32_t ordinal) {
  std::string out = "device " + std::to_string(ordinal);
  if (d.device_get != nullptr && d.device_get_attribute != nullptr) {
    int dev = 0, major = 0, minor = 0;
    // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
    if (d.device_get(&dev, ordinal) == 0 && d.device_get_attribute(&major, 75, dev) == 0 &&
        d.device_get_attribute(&minor, 76, dev) == 0) {
      out += " (sm_" + std::to_string(major) + std::to_string(minor) + ")";
    }
  } else if (d.device_get_name != nullptr) {
    char name[256] = {0};
    if (d.device_get_name(name, sizeof(name) - 1, ordinal) == 0) out += " (" + std::string(name) + ")";
  }
  return out;
}

// What a launch needs besides its pointers.
struct Launch {
  std::string_view name;
  ffi::Span<const uint8_t> binary;
  int64_t binary_hash;
  int32_t grid[3];
  int32_t block_threads;
  int32_t shared_bytes;
  int32_t hidden_params;
  std::string_view target;
  int32_t pdl;  // 1: programmatic dependent launch (the kernel waits on its predecessor itself)
};

// cuLaunchKernelEx's configuration, as cuda.h lays it out (CUDA 12.0+): one launch attribute,
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, whose value union is 64 bytes.
struct CuLaunchAttribute {
  int32_t id;
  char pad[8 - sizeof(int32_t)];
  union {
    char bytes[64];
    int32_t programmatic_stream_serialization_allowed;
  } value;
};
struct CuLaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  void* stream;
  CuLaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(CuLaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes in cuda.h");
static_assert(offsetof(CuLaunchConfig, stream) == 32 && offsetof(CuLaunchConfig, attrs) == 40 &&
                  sizeof(CuLaunchConfig) == 56,
              "CUlaunchConfig's layout in cuda.h");
constexpr int32_t kProgrammaticStreamSerialization = 6;

// Functions by (context, binary hash), then kernel name. The context is CUDA's (a module
// belongs to one) or, on HIP, the device ordinal. A hit allocates nothing (the name is compared
// as a view).
struct FunctionKey {
  const void* context;
  int64_t binary_hash;
  bool operator==(const FunctionKey& o) const {
    return context == o.context && binary_hash == o.binary_hash;
  }
};
struct FunctionKeyHash {
  size_t operator()(const FunctionKey& k) const {
    return std::hash<int64_t>()(k.binary_hash) ^ std::hash<const void*>()(k.context);
  }
};
std::mutex cache_mutex;
std::unordered_map<FunctionKey, std::vector<std::pair<std::string, void*>>, FunctionKeyHash>
    function_cache;

// CUDA's attribute for more than 48 KiB of dynamic shared memory.
constexpr int kMaxDynamicSharedBytes = 8;

// Where a function is loaded and looked up: on CUDA the context of XLA's `stream`, or with no
// stream the device's primary context (the one XLA's streams use; retained, never released, so
// it outlives the module); on HIP the device ordinal. Null when CUDA gives no context.
const void* LoadScope(const Driver& d, void* stream, int32_t device) {
  if (d.ctx_push == nullptr) {  // HIP
    return reinterpret_cast<const void*>(static_cast<intptr_t>(device) + 1);
  }
  void* ctx = nullptr;
  if (stream != nullptr) return d.stream_get_ctx(stream, &ctx) == 0 ? ctx : nullptr;
  int dev = 0;
  if (d.device_get != nullptr && d.primary_ctx_retain != nullptr &&
      d.device_get(&dev, device) == 0 && d.primary_ctx_retain(&ctx, dev) == 0) {
    return ctx;
  }
  return nullptr;
}

// The scope's context (CUDA) or device (HIP) made current for the life of the object
// (restored after).
class ScopedDevice {
 public:
  ScopedDevice(const Driver& d, const void* scope, int32_t device) : d_(d) {
    if (d.ctx_push != nullptr) {  // CUDA
      pushed_ = d.ctx_push(const_cast<void*>(scope)) == 0;
    } else if (d.get_device != nullptr && d.get_device(&saved_) == 0 && saved_ != device) {
      restore_ = d.set_device(device) == 0;  // HIP
    }
  }
  ~ScopedDevice() {
    void* ignored = nullptr;
    if (pushed_) d_.ctx_pop(&ignored);
    if (restore_) d_.set_device(saved_);
  }

 private:
  const Driver& d_;
  bool pushed_ = false, restore_ = false;
  int saved_ = 0;
};

ffi::ErrorOr<void*> GetFunction(const Driver& d, void* stream, int32_t device, const Launch& l) {
  if (!d.error.empty()) return ffi::Unexpected(ffi::Error::Internal(d.error));
  const void* scope = LoadScope(d, stream, device);
  if (scope == nullptr) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_mla: no CUDA context for " + DescribeDevice(d, device) + " to load kernel " +
        std::string(l.name) + " into"));
  }
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto& loaded = function_cache[FunctionKey{scope, l.binary_hash}];
  for (const auto& [name, function] : loaded) {
    if (name == l.name) return function;
  }
  if (l.binary.size() == 0) {  // the call names the kernel by hash alone
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_mla: kernel " + std::string(l.name) + " (binary hash " +
        std::to_string(l.binary_hash) + ") is not loaded on " + DescribeDevice(d, device) +
        " and its call carries no binary (traced with JAX_MLA_FFI_EMBED_BINARIES=0): run the "
        "program in the process that traced it, or trace it with the binaries embedded"));
  }
  RelaxedCapture relaxed(d.exchange_capture_mode);
  ScopedDevice scoped(d, scope, device);
  // The image must outlive the module load only; copy it (attribute storage is not ours).
  std::vector<uint8_t> image(l.binary.begin(), l.binary.end());
  image.push_back(0);  // harmless for ELF images, required for text ones
  void* module = nullptr;
  if (Result r = d.module_load_data(&module, image.data()); r != 0) {
    return ffi::Unexpected(ffi::Error::Internal(
        "jax_mla: cannot load kernel " + std::string(l.name) + " compiled for " +
        std::string(l.target) + " on " + DescribeDevice(d, device) + " (" + d.Describe(r) +
        "): the plan's target must be the architecture of the device the step runs on"));
  }
  void* function = nullptr;
  std::string name(l.name);
  if (Result r = d.module_get_function(&function, module, name.c_str()); r != 0) {
    return ffi::Unexpected(ffi::Error::Internal("jax_mla: kernel " + name + " is not in its module (" +
                                d.Describe(r) + ")"));
  }
  if (d.func_load != nullptr) {
    if (Result r = d.func_load(function); r != 0) {
      return ffi::Unexpected(ffi::Error::Internal("jax_mla: kernel " + name +
                                                  " cannot be loaded (" + d.Describe(r) + ")"));
    }
  }
  if (d.func_set_attribute != nullptr && l.shared_bytes > 48 * 1024) {
    if (Result r = d.func_set_attribute(function, kMaxDynamicSharedBytes, l.shared_bytes);
        r != 0) {
      return ffi::Unexpected(ffi::Error::Internal("jax_mla: kernel " + name + " cannot have " +
                                  std::to_string(l.shared_bytes) + " bytes of shared memory (" +
                                  d.Describe(r) + ")"));
    }
  }
  loaded.emplace_back(std::move(name), function);
  return function;
}

// The kernel's parameters: every operand's pointer, then every result's (the first `n_rets`),
// then `hidden` null pointers.
ffi::ErrorOr<std::vector<void*>> KernelPointers(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                               size_t n_rets, int32_t hidden) {
  std::vector<void*> ptrs;
  ptrs.reserve(args.size() + n_rets + hidden);
  for (size_t i = 0; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return ffi::Unexpected(buf.error());
    ptrs.push_back(buf->untyped_data());
  }
  for (size_t i = 0; i < n_rets; ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return ffi::Unexpected(buf.error());
    ptrs.push_back((*buf)->untyped_data());
  }
  for (int32_t i = 0; i < hidden; ++i) ptrs.push_back(nullptr);
  return ptrs;
}

// Launches `function` (looked up for `l`) on `stream` with `params` (pointers to its
// parameters), with programmatic dependent launch where `l` asks for it and the driver has it.
ffi::Error LaunchFunction(const Driver& d, void* function, void* stream, const Launch& l,
                          void** params) {
  Result r = 0;
  if (l.pdl != 0 && d.launch_kernel_ex != nullptr) {
    // The kernel may start before its predecessor on the stream ends: it waits for it
    // (griddepcontrol.wait) before touching memory, so only the launch latency overlaps.
    CuLaunchAttribute attr{};
    attr.id = kProgrammaticStreamSerialization;
    attr.value.programmatic_stream_serialization_allowed = 1;
    CuLaunchConfig config{static_cast<unsigned>(l.grid[0]), static_cast<unsigned>(l.grid[1]),
                          static_cast<unsigned>(l.grid[2]), static_cast<unsigned>(l.block_threads),
                          1, 1, static_cast<unsigned>(l.shared_bytes), stream, &attr, 1};
    r = d.launch_kernel_ex(&config, function, params, nullptr);
  } else {
    // ROCm, or a driver without cuLaunchKernelEx: an ordinary launch (the kernel's wait is
    // then a no-op).
    r = d.launch_kernel(function, l.grid[0], l.grid[1], l.grid[2], l.block_threads, 1, 1,
                        l.shared_bytes, stream, params, nullptr);
  }
  if (r != 0) {
    return ffi::Error::Internal("jax_mla: launching " + std::string(l.name) + " failed (" +
                                d.Describe(r) + ")");
  }
  return ffi::Error::Success();
}

ffi::Error Execute(bool hip, void* stream, int32_t device, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, const Launch& l) {
  const Driver& d = GetDriver(hip);
  auto function = GetFunction(d, stream, device, l);
  if (function.has_error()) return function.error();
  if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) return ffi::Error::Success();
  auto ptrs = KernelPointers(args, rets, rets.size(), l.hidden_params);
  if (ptrs.has_error()) return ptrs.error();
  std::vector<void*> params(ptrs->size());
  for (size_t i = 0; i < ptrs->size(); ++i) params[i] = &(*ptrs)[i];
  return LaunchFunction(d, *function, stream, l, params.data());
}

// A sequence of launches in one custom call: N kernels, launched in order on XLA's stream, whose
// parameters are chosen among the call's buffers by index (operands 0.., then results
// n_args..), each followed by its hidden (null) parameters. A step that writes a result and a
// later step that reads it (a decode kernel's partials and the reduce that merges them) then
// cost XLA one command, not two. Per-kernel attributes are arrays of N (the grids 3N); the
// names are joined by ','; the binaries are concatenated, kernel k's bytes at
// [binary_offsets[k], binary_offsets[k + 1]); kernel k's parameters are
// params[param_offsets[k]:param_offsets[k + 1]].
struct Sequence {
  std::string_view names;
  ffi::Span<const uint8_t> binaries;
  ffi::Span<const int64_t> binary_offsets, binary_hashes;
  ffi::Span<const int32_t> grids, threads, shared, hidden, pdl, params, param_offsets;
  std::string_view target;

  size_t size() const { return binary_hashes.size(); }

  // Whether the arrays agree with each other and with `n_buffers`; the error names the rule.
  ffi::Error Check(size_t n_buffers) const {
    const size_t n = size();
    auto bad = [](const std::string& what) {
      return ffi::Error::InvalidArgument("jax_mla: launch sequence: " + what);
    };
    if (n == 0) return bad("no kernel");
    if (binary_offsets.size() != n + 1 || param_offsets.size() != n + 1 || grids.size() != 3 * n ||
        threads.size() != n || shared.size() != n || hidden.size() != n || pdl.size() != n) {
      return bad("per-kernel attributes of " + std::to_string(n) + " kernels disagree in length");
    }
    size_t commas = 0;
    for (char c : names) commas += c == ',';
    if (commas + 1 != n) return bad("kernel_names does not hold " + std::to_string(n) + " names");
    for (size_t k = 0; k < n; ++k) {
      if (binary_offsets[k] < 0 || binary_offsets[k] > binary_offsets[k + 1] ||
          param_offsets[k] < 0 || param_offsets[k] > param_offsets[k + 1] || hidden[k] < 0) {
        return bad("offsets of kernel " + std::to_string(k) + " out of order");
      }
    }
    if (static_cast<size_t>(binary_offsets[n]) != binaries.size() ||
        static_cast<size_t>(param_offsets[n]) != params.size()) {
      return bad("the last offsets do not end the binaries and the parameters");
    }
    for (int32_t i : params) {
      if (i < 0 || static_cast<size_t>(i) >= n_buffers) {
        return bad("parameter index " + std::to_string(i) + " is not one of the call's " +
                   std::to_string(n_buffers) + " buffers");
      }
    }
    return ffi::Error::Success();
  }

  // Kernel k's launch (its name a view into `names`).
  Launch At(size_t k) const {
    size_t start = 0;
    for (size_t i = 0; i < k; ++i) start = names.find(',', start) + 1;
    size_t end = names.find(',', start);
    std::string_view name = names.substr(start, end == std::string_view::npos ? end : end - start);
    const uint8_t* bytes = binaries.begin() + binary_offsets[k];
    return Launch{name,
                  ffi::Span<const uint8_t>(bytes, static_cast<size_t>(binary_offsets[k + 1] -
                                                                      binary_offsets[k])),
                  binary_hashes[k],
                  {grids[3 * k], grids[3 * k + 1], grids[3 * k + 2]},
                  threads[k],
                  shared[k],
                  hidden[k],
                  target,
                  pdl[k]};
  }

  // Kernel k's parameters: the chosen buffers' addresses, then its hidden nulls.
  std::vector<void*> Pointers(size_t k, const std::vector<void*>& buffers) const {
    std::vector<void*> out;
    out.reserve(static_cast<size_t>(param_offsets[k + 1] - param_offsets[k] + hidden[k]));
    for (int32_t i = param_offsets[k]; i < param_offsets[k + 1]; ++i) {
      out.push_back(buffers[static_cast<size_t>(params[i])]);
    }
    for (int32_t i = 0; i < hidden[k]; ++i) out.push_back(nullptr);
    return out;
  }
};

ffi::Error ExecuteSequence(bool hip, void* stream, int32_t device, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, const Sequence& seq) {
  if (ffi::Error e = seq.Check(args.size() + rets.size()); e.failure()) return e;
  const Driver& d = GetDriver(hip);
  auto buffers = KernelPointers(args, rets, rets.size(), 0);  // every buffer's address
  if (buffers.has_error()) return buffers.error();
  for (size_t k = 0; k < seq.size(); ++k) {
    Launch l = seq.At(k);
    auto function = GetFunction(d, stream, device, l);
    if (function.has_error()) return function.error();
    if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) continue;
    std::vector<void*> ptrs = seq.Pointers(k, *buffers);
    std::vector<void*> params(ptrs.size());
    for (size_t i = 0; i < ptrs.size(); ++i) params[i] = &ptrs[i];
    if (ffi::Error e = LaunchFunction(d, *function, stream, l, params.data()); e.failure()) {
      return e;
    }
  }
  return ffi::Error::Success();
}

#if JAX_MLA_HAS_RECORD
// The record stage (CUDA). XLA calls it, instead of capturing the execute stage, when it builds
// a command buffer that holds the call (action Create) and again whenever a buffer the call
// reads or writes has moved since (action Update). On Create the handler hands XLA the kernel
// (name and cubin), the grid, block, shared memory and the pointers, and XLA adds one kernel
// node to its graph, after the commands XLA says it depends on (no dependencies of our own are
// passed, so XLA's are used); on Update it passes only the new pointers, which XLA applies to
// that node in place. Capturing the execute stage instead makes XLA re-capture the launch into
// a child graph on every update. XLA loads the cubin into its own module (cached by the name
// and the image's address, so both are interned here for the life of the process); the
// handler first loads it its own way, which gives the clear error for a binary built for
// another device (GetFunction). An empty grid, which launches nothing, asks XLA to capture the
// execute stage (an empty capture) rather than record a launch of zero blocks.
struct RecordFrameExtension {
  struct Type {
    const XLA_FFI_Api* api;
    XLA_FFI_RecordFrame* frame;
  };
  using CExtension = XLA_FFI_Record_Extension;
  static constexpr auto kName = "RecordExtension";
  static constexpr int64_t kExtensionType = XLA_FFI_Extension_Record;
  static constexpr int32_t kMajorVersion = XLA_FFI_Extension_Record_MajorVersion;
  static constexpr int32_t kMinorVersion = XLA_FFI_Extension_Record_MinorVersion;
  // The API is marked as still changing, and its major version 0 changes the layout of its
  // structs between minor versions (0.1 to 0.5, jaxlib 0.11 to 0.12): under major 0 only the
  // version the library was built against is taken; from 1 on, a later minor (additions) too.
  static bool Support(int32_t major, int32_t minor) {
    if (major != kMajorVersion) return false;
    return major == 0 ? minor == kMinorVersion : minor >= kMinorVersion;
  }
  static Type Create(const XLA_FFI_Api* api, const CExtension* ext) {
    return Type{api, ext->record_frame};
  }
};

// XLA's error, as ours (its message kept, the error freed).
ffi::Error FromXla(const XLA_FFI_Api* api, XLA_FFI_Error* error, std::string_view what) {
  std::string message = ffi::internal::GetErrorMessage(api, error);
  ffi::internal::DestroyError(api, error);
  return ffi::Error::Internal("jax_mla: XLA could not " + std::string(what) + ": " + message);
}

// A kernel's name (NUL-terminated) and cubin at addresses that stay put, by binary hash and name.
struct InternedKernel {
  std::string name;
  std::string image;
};
std::mutex intern_mutex;
std::unordered_map<int64_t, std::vector<InternedKernel*>> interned_kernels;

const InternedKernel& Intern(const Launch& l) {
  std::lock_guard<std::mutex> lock(intern_mutex);
  auto& same_hash = interned_kernels[l.binary_hash];
  for (const InternedKernel* k : same_hash) {
    if (k->name == l.name) return *k;
  }
  same_hash.push_back(new InternedKernel{
      std::string(l.name),
      std::string(reinterpret_cast<const char*>(l.binary.begin()), l.binary.size())});
  return *same_hash.back();
}

ffi::Error Record(void* stream, int32_t device, RecordFrameExtension::Type record,
                  ffi::RemainingArgs args, ffi::RemainingRets rets, const Launch& l) {
  const XLA_FFI_RecordApi* api = record.frame->api;
  XLA_FFI_RecordContext* ctx = record.frame->record_ctx;
  if (l.grid[0] == 0 || l.grid[1] == 0 || l.grid[2] == 0) {
    XLA_FFI_Error* e = api->request_stream_capture(ctx);
    return e == nullptr ? ffi::Error::Success() : FromXla(record.api, e, "capture an empty launch");
  }
  auto ptrs = KernelPointers(args, rets, rets.size(), l.hidden_params);
  if (ptrs.has_error()) return ptrs.error();
  std::vector<XLA_FFI_KernelArg> kernel_args;
  kernel_args.reserve(ptrs->size());
  for (void* p : *ptrs) kernel_args.push_back({p, 0, XLA_FFI_KernelArgType_DevicePtr});
  XLA_FFI_KernelArgs packed{kernel_args.data(), static_cast<int64_t>(kernel_args.size())};
  XLA_FFI_RecordFrame& frame = *record.frame;
  if (frame.action == XLA_FFI_RecordAction_Update) {
    if (frame.commands == nullptr || frame.num_commands == nullptr || *frame.num_commands != 1) {
      return ffi::Error::Internal("jax_mla: XLA asked to update " + std::string(l.name) +
                                  " without the one launch recorded for it");
    }
    XLA_FFI_Error* e = api->update_launch(ctx, frame.commands[0], &packed);
    return e == nullptr ? ffi::Error::Success()
                        : FromXla(record.api, e, "update the launch of " + std::string(l.name));
  }
  if (frame.commands == nullptr || frame.num_commands == nullptr ||
      *frame.num_commands >= frame.max_commands) {
    return ffi::Error::Internal("jax_mla: XLA gave no room to record " + std::string(l.name));
  }
  auto function = GetFunction(GetDriver(false), stream, device, l);
  if (function.has_error()) return function.error();
  const InternedKernel& k = Intern(l);
  XLA_FFI_LaunchDims dims{{l.grid[0], l.grid[1], l.grid[2]}, {l.block_threads, 1, 1}, {0, 0, 0}};
  const XLA_FFI_Command* command = nullptr;
#if JAX_MLA_RECORD_BY_FUNCTION
  // XLA launches the function this library loaded (its module cache keeps it for the life of
  // the process); the name is for XLA's log.
  XLA_FFI_RecordKernel kernel{XLA_FFI_RecordKernel_STRUCT_SIZE, nullptr, nullptr, *function,
                              XLA_FFI_ByteSpan{k.name.data(), k.name.size()}};
  XLA_FFI_KernelLaunchParams params{XLA_FFI_KernelLaunchParams_STRUCT_SIZE, nullptr, dims,
                                    static_cast<uint32_t>(l.shared_bytes), l.pdl != 0 ? 1 : 0,
                                    &packed};
  XLA_FFI_Error* e = api->create_launch(ctx, &kernel, &params, /*dependencies=*/nullptr,
                                        /*num_dependencies=*/0, &command);
#else
  XLA_FFI_Error* e = api->create_launch(
      ctx, k.name.c_str(), k.image.data(), static_cast<int64_t>(k.image.size()),
      XLA_FFI_SourceFormat_CUBIN, dims, static_cast<uint32_t>(l.shared_bytes), l.pdl != 0 ? 1 : 0,
      &packed, /*dependencies=*/nullptr, /*num_dependencies=*/0, &command);
#endif
  if (e != nullptr) return FromXla(record.api, e, "record the launch of " + std::string(l.name));
  if (command == nullptr) {
    return ffi::Error::Internal("jax_mla: XLA recorded no command for " + std::string(l.name));
  }
  frame.commands[(*frame.num_commands)++] = command;
  return ffi::Error::Success();
}
#endif  // JAX_MLA_HAS_RECORD

ffi::Error Initialize(bool hip, void* stream, int32_t device, const Launch& l) {
  auto function = GetFunction(GetDriver(hip), stream, device, l);
  return function.has_error() ? function.error() : ffi::Error::Success();
}

// The parameters and bindings every launch handler shares: XLA's stream and device ordinal,
// the buffers, then the launch attributes.
#define JAX_MLA_LAUNCH_ATTR_PARAMS                                                      \
  std::string_view name, ffi::Span<const uint8_t> binary, int64_t hash, int32_t gx,      \
      int32_t gy, int32_t gz, int32_t threads, int32_t shared, int32_t hidden,           \
      std::string_view target, int32_t pdl
#define JAX_MLA_LAUNCH_ATTR_ARGS \
  name, binary, hash, gx, gy, gz, threads, shared, hidden, target, pdl

template <typename Binding>
auto BindLaunchAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<std::string_view>("kernel_name")
      .template Attr<ffi::Span<const uint8_t>>("binary")
      .template Attr<int64_t>("binary_hash")
      .template Attr<int32_t>("grid_x")
      .template Attr<int32_t>("grid_y")
      .template Attr<int32_t>("grid_z")
      .template Attr<int32_t>("block_threads")
      .template Attr<int32_t>("shared_bytes")
      .template Attr<int32_t>("hidden_params")
      .template Attr<std::string_view>("target")
      .template Attr<int32_t>("pdl");
}

template <typename Binding>
auto BindLaunch(Binding binding) {
  return BindLaunchAttrs(std::move(binding)
                             .template Ctx<ffi::PlatformStream<void*>>()
                             .template Ctx<ffi::DeviceOrdinal>()
                             .RemainingArgs()
                             .RemainingRets());
}

// The sequence's attributes (Sequence above).
#define JAX_MLA_SEQUENCE_ATTR_PARAMS                                                          \
  std::string_view names, ffi::Span<const uint8_t> binaries,                                  \
      ffi::Span<const int64_t> binary_offsets, ffi::Span<const int64_t> binary_hashes,         \
      ffi::Span<const int32_t> grids, ffi::Span<const int32_t> threads,                        \
      ffi::Span<const int32_t> shared, ffi::Span<const int32_t> hidden,                        \
      ffi::Span<const int32_t> pdl, ffi::Span<const int32_t> params,                           \
      ffi::Span<const int32_t> param_offsets, std::string_view target
#define JAX_MLA_SEQUENCE_ATTR_ARGS                                                           \
  Sequence {                                                                                 \
    names, binaries, binary_offsets, binary_hashes, grids, threads, shared, hidden, pdl,     \
        params, param_offsets, target                                                        \
  }

template <typename Binding>
auto BindSequenceAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<std::string_view>("kernel_names")
      .template Attr<ffi::Span<const uint8_t>>("binaries")
      .template Attr<ffi::Span<const int64_t>>("binary_offsets")
      .template Attr<ffi::Span<const int64_t>>("binary_hashes")
      .template Attr<ffi::Span<const int32_t>>("grids")
      .template Attr<ffi::Span<const int32_t>>("block_threads")
      .template Attr<ffi::Span<const int32_t>>("shared_bytes")
      .template Attr<ffi::Span<const int32_t>>("hidden_params")
      .template Attr<ffi::Span<const int32_t>>("pdl")
      .template Attr<ffi::Span<const int32_t>>("params")
      .template Attr<ffi::Span<const int32_t>>("param_offsets")
      .template Attr<std::string_view>("target");
}

template <typename Binding>
auto BindSequence(Binding binding) {
  return BindSequenceAttrs(std::move(binding)
                               .template Ctx<ffi::PlatformStream<void*>>()
                               .template Ctx<ffi::DeviceOrdinal>()
                               .RemainingArgs()
                               .RemainingRets());
}

template <bool kHip>
ffi::Error ExecuteSequenceStage(void* stream, int32_t device, ffi::RemainingArgs args,
                                ffi::RemainingRets rets, JAX_MLA_SEQUENCE_ATTR_PARAMS) {
  return ExecuteSequence(kHip, stream, device, args, rets, JAX_MLA_SEQUENCE_ATTR_ARGS);
}

Launch MakeLaunch(JAX_MLA_LAUNCH_ATTR_PARAMS) {
  return Launch{name, binary, hash, {gx, gy, gz}, threads, shared, hidden, target, pdl};
}

// The two stages, for CUDA (kHip false) and ROCm (kHip true). Only execute is registered by
// default (see the top of this file); initialize loads the module a step ahead, for the A/B.
template <bool kHip>
ffi::Error InitializeStage(void* stream, int32_t device, ffi::RemainingArgs, ffi::RemainingRets,
                           JAX_MLA_LAUNCH_ATTR_PARAMS) {
  return Initialize(kHip, stream, device, MakeLaunch(JAX_MLA_LAUNCH_ATTR_ARGS));
}

template <bool kHip>
ffi::Error ExecuteStage(void* stream, int32_t device, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, JAX_MLA_LAUNCH_ATTR_PARAMS) {
  return Execute(kHip, stream, device, args, rets, MakeLaunch(JAX_MLA_LAUNCH_ATTR_ARGS));
}

#if JAX_MLA_HAS_RECORD
ffi::Error RecordStage(void* stream, int32_t device, RecordFrameExtension::Type record,
                       ffi::RemainingArgs args, ffi::RemainingRets rets,
                       JAX_MLA_LAUNCH_ATTR_PARAMS) {
  return Record(stream, device, record, args, rets, MakeLaunch(JAX_MLA_LAUNCH_ATTR_ARGS));
}
#endif

}  // namespace
}  // namespace jax_mla

// The handlers are the library's only exported symbols (it is built with -fvisibility=hidden).
#define JAX_MLA_EXPORT_HANDLER(name) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*);
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonInitializeCuda)
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonExecuteCuda)
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonInitializeRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonExecuteRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonPackCpu)
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonSequenceCuda)
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonSequenceRocm)
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonPackSequenceCpu)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTritonInitializeCuda, jax_mla::InitializeStage<false>,
                              jax_mla::BindLaunch(ffi::Ffi::BindInitialize()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTritonExecuteCuda, jax_mla::ExecuteStage<false>,
                              jax_mla::BindLaunch(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTritonInitializeRocm, jax_mla::InitializeStage<true>,
                              jax_mla::BindLaunch(ffi::Ffi::BindInitialize()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTritonExecuteRocm, jax_mla::ExecuteStage<true>,
                              jax_mla::BindLaunch(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});

// Launch sequences: execute stage only, command-buffer compatible like the single launch.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTritonSequenceCuda, jax_mla::ExecuteSequenceStage<false>,
                              jax_mla::BindSequence(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTritonSequenceRocm, jax_mla::ExecuteSequenceStage<true>,
                              jax_mla::BindSequence(ffi::Ffi::Bind()),
                              {ffi::Traits::kCmdBufferCompatible});

#if JAX_MLA_HAS_RECORD
// The record stage, where the FFI headers have it (jaxlib 0.11+).
JAX_MLA_EXPORT_HANDLER(JaxMlaTritonRecordCuda)
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMlaTritonRecordCuda, jax_mla::RecordStage,
    jax_mla::BindLaunchAttrs(ffi::Ffi::BindRecord()
                                 .Ctx<ffi::PlatformStream<void*>>()
                                 .Ctx<ffi::DeviceOrdinal>()
                                 .Ctx<ffi::Extension<jax_mla::RecordFrameExtension>>()
                                 .RemainingArgs()
                                 .RemainingRets()),
    {ffi::Traits::kCmdBufferCompatible});

// Registering the record stage. jax registers a GPU target through the PJRT plugin's
// custom-call extension, which carries the instantiate, prepare, initialize and execute stages
// but no record stage (jaxlib 0.11.2), so a record bundle cannot be registered from Python.
// XLA's own FFI API can: XLA_FFI_Handler_Register takes the whole bundle. Its table is what
// XLA hands every handler it calls (XLA_FFI_CallFrame::api), and the plugin exports nothing
// else, so jax_mla runs this tiny target once (ffi_launch.register_record_target), which takes
// the table from its call frame and registers `target` for CUDA with {execute, record} and
// `traits`. The outcome, for JaxMlaTritonRecordTargetStatus: -1 not tried, 0 registered, else
// XLA's error.
namespace jax_mla {
namespace {
std::atomic<const XLA_FFI_Api*> bootstrap_api{nullptr};
std::mutex record_target_mutex;
int record_target_state = -1;
std::string record_target_error;

ffi::Error RegisterRecordTarget(std::string_view target, int32_t traits) {
  std::lock_guard<std::mutex> lock(record_target_mutex);
  if (record_target_state == 0) return ffi::Error::Success();
  const XLA_FFI_Api* api = bootstrap_api.load();
  if (api == nullptr) return ffi::Error::Internal("jax_mla: XLA's FFI API was not seen");
  static std::string name;  // XLA may keep the view
  static const char kPlatform[] = "CUDA";
  name = std::string(target);
  XLA_FFI_Handler_Register_Args args{};
  args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.name = XLA_FFI_ByteSpan{name.data(), name.size()};
  args.platform = XLA_FFI_ByteSpan{kPlatform, sizeof(kPlatform) - 1};
  args.bundle = XLA_FFI_Handler_Bundle{nullptr, nullptr, nullptr, JaxMlaTritonExecuteCuda,
                                       JaxMlaTritonRecordCuda};
  args.traits = static_cast<XLA_FFI_Handler_Traits>(traits);
  if (XLA_FFI_Error* e = api->XLA_FFI_Handler_Register(&args); e != nullptr) {
    record_target_error = ffi::internal::GetErrorMessage(api, e);
    ffi::internal::DestroyError(api, e);
    record_target_state = 1;
    return ffi::Error::Internal("jax_mla: XLA refused the record target " + name + ": " +
                                record_target_error);
  }
  record_target_state = 0;
  return ffi::Error::Success();
}
}  // namespace
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER(kJaxMlaTritonBootstrap, jax_mla::RegisterRecordTarget,
                       ffi::Ffi::Bind().Attr<std::string_view>("target").Attr<int32_t>("traits"));

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* JaxMlaTritonBootstrapCuda(
    XLA_FFI_CallFrame* frame) {
  if (frame != nullptr && frame->api != nullptr) jax_mla::bootstrap_api.store(frame->api);
  return kJaxMlaTritonBootstrap(frame);
}

extern "C" __attribute__((visibility("default"))) int JaxMlaTritonRecordTargetStatus(char* buffer,
                                                                                     int size) {
  std::lock_guard<std::mutex> lock(jax_mla::record_target_mutex);
  if (size > 0) std::snprintf(buffer, static_cast<size_t>(size), "%s",
                              jax_mla::record_target_error.c_str());
  return jax_mla::record_target_state;
}
#endif

// Why the CUDA (hip == 0) or ROCm (hip != 0) driver cannot be used, copied into `buffer`
// ("" when it can): what the handlers return at their first call. For tests and diagnostics.
extern "C" __attribute__((visibility("default"))) int JaxMlaTritonDriverError(int hip,
                                                                              char* buffer,
                                                                              int size) {
  const std::string& error = jax_mla::GetDriver(hip != 0).error;
  if (size > 0) {
    std::snprintf(buffer, static_cast<size_t>(size), "%s", error.c_str());
  }
  return static_cast<int>(error.size());
}

// Loads (or finds) `name` from `image` on `device` as the execute stage does before its launch,
// into the context of `stream` (a CUstream / hipStream_t), or with a null stream into the
// device's primary context, which XLA's streams use: jax_mla calls it when it traces a launch
// (ffi_launch.preload), so that the first execution, which may be recorded into a command
// buffer by stream capture, finds the function loaded. Writes the function into `*function`;
// returns 0, else the error's length + 1 with its text copied into `error`.
extern "C" __attribute__((visibility("default"))) int JaxMlaTritonLoadKernel(
    int hip, int device, void* stream, const uint8_t* image, int64_t size, int64_t binary_hash,
    const char* name, int shared_bytes, void** function, char* error, int error_size) {
  jax_mla::Launch l{};
  l.name = name;
  l.binary = ffi::Span<const uint8_t>(image, static_cast<size_t>(size));
  l.binary_hash = binary_hash;
  l.shared_bytes = shared_bytes;
  l.target = "the caller's";
  auto f = jax_mla::GetFunction(jax_mla::GetDriver(hip != 0), stream, device, l);
  if (f.has_value()) {
    *function = *f;
    return 0;
  }
  std::string message = f.error().message();
  if (error_size > 0) std::snprintf(error, static_cast<size_t>(error_size), "%s", message.c_str());
  return static_cast<int>(message.size()) + 1;
}

// CPU twin for tests: decodes the same attributes and packs the same parameters, then writes,
// into its last result (int32, one entry per parameter), which operand (0..) or result
// (n_args..) each parameter points at, -1 for a null one; the other results are left as they
// are. Nothing is launched.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMlaTritonPackCpu,
    [](ffi::RemainingArgs args, ffi::RemainingRets rets, JAX_MLA_LAUNCH_ATTR_PARAMS) {
      jax_mla::Launch l = jax_mla::MakeLaunch(JAX_MLA_LAUNCH_ATTR_ARGS);
      if (rets.size() == 0) return ffi::Error::InvalidArgument("no result to write into");
      auto ptrs = jax_mla::KernelPointers(args, rets, rets.size() - 1, l.hidden_params);
      if (ptrs.has_error()) return ptrs.error();
      auto out = rets.get<ffi::AnyBuffer>(rets.size() - 1);
      if (out.has_error()) return out.error();
      if ((*out)->element_count() != ptrs->size() ||
          (*out)->element_type() != ffi::DataType::S32) {
        return ffi::Error::InvalidArgument("the last result must be int32[number of params]");
      }
      int32_t* dst = static_cast<int32_t*>((*out)->untyped_data());
      for (size_t k = 0; k < ptrs->size(); ++k) {
        dst[k] = -1;
        for (size_t i = 0; i < args.size() && dst[k] < 0; ++i) {
          if (args.get<ffi::AnyBuffer>(i)->untyped_data() == (*ptrs)[k]) dst[k] = i;
        }
        for (size_t i = 0; i + 1 < rets.size() && dst[k] < 0; ++i) {
          if ((*rets.get<ffi::AnyBuffer>(i))->untyped_data() == (*ptrs)[k]) {
            dst[k] = args.size() + i;
          }
        }
      }
      return ffi::Error::Success();
    },
    jax_mla::BindLaunchAttrs(ffi::Ffi::Bind().RemainingArgs().RemainingRets()));

// CPU twin of a launch sequence: checks and decodes the same attributes, then writes, into its
// last result (int32, one entry per parameter of every kernel in order, hidden ones included),
// which operand (0..) or result (n_args..) each parameter points at, -1 for a null one. The
// other results are left as they are; nothing is launched.
namespace jax_mla {
namespace {
ffi::Error PackSequence(ffi::RemainingArgs args, ffi::RemainingRets rets,
                        JAX_MLA_SEQUENCE_ATTR_PARAMS) {
  Sequence seq = JAX_MLA_SEQUENCE_ATTR_ARGS;
  if (rets.size() == 0) return ffi::Error::InvalidArgument("no result to write into");
  if (ffi::Error e = seq.Check(args.size() + rets.size() - 1); e.failure()) return e;
  auto buffers = KernelPointers(args, rets, rets.size() - 1, 0);
  if (buffers.has_error()) return buffers.error();
  auto out = rets.get<ffi::AnyBuffer>(rets.size() - 1);
  if (out.has_error()) return out.error();
  std::vector<int32_t> report;
  for (size_t k = 0; k < seq.size(); ++k) {
    Launch l = seq.At(k);
    if (l.name.empty()) return ffi::Error::InvalidArgument("an empty kernel name");
    for (void* p : seq.Pointers(k, *buffers)) {
      int32_t at = -1;
      for (size_t i = 0; i < buffers->size() && at < 0 && p != nullptr; ++i) {
        if ((*buffers)[i] == p) at = static_cast<int32_t>(i);
      }
      report.push_back(at);
    }
  }
  if ((*out)->element_count() != report.size() ||
      (*out)->element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument("the last result must be int32[number of params]");
  }
  std::memcpy((*out)->untyped_data(), report.data(), report.size() * sizeof(int32_t));
  return ffi::Error::Success();
}
}  // namespace
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxMlaTritonPackSequenceCpu, jax_mla::PackSequence,
    jax_mla::BindSequenceAttrs(ffi::Ffi::Bind().RemainingArgs().RemainingRets()));
