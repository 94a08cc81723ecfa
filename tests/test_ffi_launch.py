"""The native launcher (``ffi/triton_launch.cc``, ``jax_mla/backends/triton/ffi_launch.py``).

On a CPU host: the handler library builds, loads and registers for CUDA, ROCm and the CPU twin;
the twin decodes the same attributes and reports how the kernel's parameters are packed; kernels
compile ahead of time for ``sm_90`` and ``gfx942`` (in a subprocess: this one runs Triton's
interpreter) and a jitted decode step lowered for ``("cuda",)`` and ``("rocm",)`` holds only
our typed FFI custom calls. Launches themselves need a GPU (``-m gpu``).
"""

import dataclasses
import importlib.util
import os
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.backends.triton import TritonTuning, ffi_launch, launch
from jax_mla.backends.triton.ffi_launch import KernelBinary
from jax_mla.problem import Target

from conftest import has_triton_cuda_backend, run_compiler_script

HAS_LIBRARY = ffi_launch.unavailable_reason() is None
needs_library = pytest.mark.skipif(not HAS_LIBRARY, reason=str(ffi_launch.unavailable_reason()))


def _binary(hidden=2, name="k"):
    return KernelBinary(name=name, target="sm_90", binary=b"\x7fELF" + os.urandom(300),
                        threads=128, shared=2048, params=("a", "b", "c", "o1", "o2"),
                        hidden_params=hidden)


def test_the_package_builds_the_library():
    # `pip install -e .` (README, .ci/run) compiles ffi/ with the system C++ compiler: a CPU CI
    # machine has the library, so a missing one is a failed build, not a skip.
    assert HAS_LIBRARY, ffi_launch.unavailable_reason()
    assert os.path.isfile(ffi_launch.library_path())


# The jaxlibs whose FFI headers have XLA's record API, one of each of its versions: 0.11.2 (the
# GPU machine's, record API 0.1, the kernel given as a cubin) and 0.12.1 (record API 0.5, the
# kernel given as a loaded function).
RECORD_JAXLIBS = ("0.11.2", "0.12.1")


@needs_library
@pytest.mark.parametrize("jaxlib_version", RECORD_JAXLIBS)
def test_the_record_stage_is_built_where_the_headers_have_it(tmp_path, jaxlib_version):
    """The CUDA record stage is compiled in exactly where jaxlib's FFI headers have XLA's record
    API: not against this jaxlib's where they lack it (jax 0.10 on CI), and against the headers
    of each jaxlib in :data:`RECORD_JAXLIBS` (its wheel's, downloaded) the library builds with
    the compiler flags of ``setup.py`` and exports ``JaxMlaTritonRecordCuda`` beside the other
    handlers."""
    import ctypes
    import subprocess
    import sys
    import zipfile

    here = os.path.exists(os.path.join(jax.ffi.include_dir(), "xla/ffi/api/record_c_api.h"))
    assert ffi_launch.record_available() == here
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--platform",
                        "manylinux_2_27_x86_64", "-d", str(tmp_path), f"jaxlib=={jaxlib_version}"],
                       capture_output=True, text=True, timeout=600)
    wheels = list(tmp_path.glob("jaxlib-*.whl"))
    if r.returncode != 0 or not wheels:
        pytest.skip(f"jaxlib {jaxlib_version}'s wheel could not be downloaded: {r.stderr[-500:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(tmp_path, [n for n in z.namelist() if "/include/xla/ffi/" in n])
    include = tmp_path / "jaxlib" / "include"
    assert (include / "xla/ffi/api/record_c_api.h").exists()
    # Each jaxlib takes its own branch of the record stage: 0.12's headers have XLA's shared
    # kernel types (the kernel passed as a function), 0.11's do not (passed as a cubin).
    by_function = tuple(int(p) for p in jaxlib_version.split(".")[:2]) >= (0, 12)
    assert (include / "xla/ffi/api/kernel_c_api.h").exists() == by_function
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lib = tmp_path / "launch.so"
    r = subprocess.run(["c++", "-std=c++17", "-O2", "-g0", "-fvisibility=hidden", "-shared",
                        "-fPIC", f"-I{include}", f"-I{root}/ffi",
                        f"{root}/ffi/triton_launch.cc", "-o", str(lib), "-ldl"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    built = ctypes.CDLL(str(lib))
    for symbol in ("JaxMlaTritonRecordCuda", "JaxMlaTritonExecuteCuda",
                   "JaxMlaTritonExecuteRocm", "JaxMlaTritonPackCpu"):
        assert hasattr(built, symbol), symbol
    assert not hasattr(built, "JaxMlaTritonRecordRocm")


@needs_library
def test_library_registers_for_cuda_rocm_and_the_cpu_twin():
    ffi_launch.register()
    ffi_launch.register()  # idempotent
    assert {"CUDA", "ROCM", "cpu"} <= ffi_launch._registered


@needs_library
def test_gpu_handlers_are_registered_command_buffer_compatible(monkeypatch):
    """XLA reads the traits from the registration: without them it never captures a launch in
    a command buffer (measured on the H200: none formed until they were passed)."""
    seen = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, fn, platform, **kw: seen.append((name, platform, kw)))
    monkeypatch.setattr(ffi_launch, "_registered", set())
    ffi_launch.register()
    gpu = {p: kw for name, p, kw in seen if name == ffi_launch.TARGET_NAME}
    assert set(gpu) == {"CUDA", "ROCM"}
    assert all(kw["traits"] == ffi_launch.command_buffer_traits() for kw in gpu.values())
    assert int(ffi_launch.command_buffer_traits()) == 1  # XLA's COMMAND_BUFFER_COMPATIBLE


@needs_library
@pytest.mark.parametrize("initialize", [False, True])
def test_gpu_targets_register_the_execute_stage_only_unless_asked(monkeypatch, initialize):
    """XLA calls a registered initialize stage for every call on every execution: by default
    our GPU targets (the Triton launcher and the three AITER handlers) register ``execute``
    alone; ``JAX_MLA_FFI_INITIALIZE_STAGE=1`` adds the exported initialize handlers."""
    from jax_mla.backends.aiter import native

    monkeypatch.setenv("JAX_MLA_FFI_INITIALIZE_STAGE", "1" if initialize else "0")
    seen = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, fn, platform, **kw: seen.append((name, platform, fn)))
    monkeypatch.setattr(ffi_launch, "_registered", set())
    monkeypatch.setattr(native, "_registered", set())
    # Symbol names stand in for the handlers: a GPU machine's build of the library has only
    # its own platform's handlers (the CUDA build lacks ``...Rocm``).
    monkeypatch.setattr(ffi_launch, "_capsule", lambda symbol: symbol)
    monkeypatch.setattr(native, "_library", lambda: _SymbolNames())
    monkeypatch.setattr(jax.ffi, "pycapsule", lambda fn: fn)
    ffi_launch.register()
    native.register_handlers(native.TARGET_NAME, native.PACK_TARGET_NAME, "JaxMlaAiterAsm",
                             ("ROCM",))
    gpu = [(name, platform, fn) for name, platform, fn in seen if platform != "cpu"]
    assert {(name, platform) for name, platform, _ in gpu} == {
        (ffi_launch.TARGET_NAME, "CUDA"), (ffi_launch.TARGET_NAME, "ROCM"),
        (ffi_launch.SEQUENCE_TARGET_NAME, "CUDA"), (ffi_launch.SEQUENCE_TARGET_NAME, "ROCM"),
        (native.TARGET_NAME, "ROCM")}
    # The launch sequence registers its execute stage alone, whatever the knob.
    sequences = [(p, fn) for name, p, fn in gpu if name == ffi_launch.SEQUENCE_TARGET_NAME]
    assert all(fn == {"execute": "JaxMlaTritonSequence" + {"CUDA": "Cuda", "ROCM": "Rocm"}[p]}
               for p, fn in sequences), sequences
    gpu = [g for g in gpu if g[0] != ffi_launch.SEQUENCE_TARGET_NAME]
    want = {"execute", "initialize"} if initialize else {"execute"}
    assert all(isinstance(fn, dict) and set(fn) == want for _, _, fn in gpu), gpu
    # Each stage is that platform's exported handler of that stage.
    for _, platform, fn in gpu:
        suffix = {"CUDA": "Cuda", "ROCM": "Rocm"}[platform]
        assert all(sym.endswith(stage.capitalize() + suffix) for stage, sym in fn.items()), fn


@pytest.mark.parametrize("knob,value,words", [
    ("JAX_MLA_FFI_COMMAND_BUFFERS", "0", "JAX_MLA_FFI_COMMAND_BUFFERS=0"),
    ("JAX_MLA_FFI_INITIALIZE_STAGE", "1", "no initialize stage"),
    (None, None, "no CUDA device")])
def test_the_record_target_is_registered_only_where_it_can_be(monkeypatch, knob, value, words):
    """The record target needs command buffers on, no initialize stage, a library with the
    record stage and a CUDA device: otherwise the reason is returned (and kept for the
    process), nothing is run and every launch calls the plain target."""
    if knob:
        monkeypatch.setenv(knob, value)
    else:  # the process has no CUDA device, here or on a GPU machine
        devices = jax.devices

        def no_cuda(backend=None):
            if backend == "cuda":
                raise RuntimeError("Unknown backend cuda")
            return devices(backend)

        monkeypatch.setattr(jax, "devices", no_cuda)
    monkeypatch.setattr(ffi_launch, "_record_reason", [])
    monkeypatch.setattr(ffi_launch, "record_available", lambda: True)
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **k: pytest.fail("registered"))
    reason = ffi_launch.register_record_target()
    assert reason is not None and words in reason, reason
    assert ffi_launch.register_record_target() == reason  # once a process
    monkeypatch.setattr(ffi_launch, "_record_reason", [])
    monkeypatch.setattr(ffi_launch, "record_available", lambda: False)
    monkeypatch.delenv("JAX_MLA_FFI_COMMAND_BUFFERS", raising=False)
    monkeypatch.delenv("JAX_MLA_FFI_INITIALIZE_STAGE", raising=False)
    assert "no record stage" in ffi_launch.register_record_target()


@pytest.mark.parametrize("launcher,registered,name", [
    ("ffi_record", True, "jax_mla_triton_record"), ("ffi_record", False, "jax_mla_triton"),
    ("ffi", True, "jax_mla_triton")])
def test_the_launchers_call_the_record_target_where_it_is_registered(monkeypatch, launcher,
                                                                     registered, name):
    """``launcher="ffi_record"`` on CUDA lowers to the record target where it could be
    registered, else to the plain one; ``ffi`` (the default) always to the plain one, whose
    launch XLA captures. Both carry the same attributes."""
    kb = _binary()
    monkeypatch.setattr(ffi_launch, "compile_kernel", lambda *a, **k: kb)
    monkeypatch.setattr(ffi_launch, "preload", lambda *a, **k: None)
    monkeypatch.setattr(ffi_launch, "check_device", lambda *a, **k: None)
    monkeypatch.setattr(ffi_launch, "register", lambda *a, **k: None)
    monkeypatch.setattr(ffi_launch, "register_record_target",
                        lambda: None if registered else "no CUDA device")
    target = Target("cuda", "sm_90", 132)

    def f(x):
        return launch.triton_call(object(), x, grid=(3,), target=target, launcher=launcher,
                                  out_shapes=[jax.ShapeDtypeStruct((8,), jnp.float32)])[0]

    text = jax.jit(f).trace(jnp.ones(8, jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(\w+)", text)
    assert calls == [name], calls
    assert "kernel_name = \"k\"" in text and "grid_x = 3 : i32" in text, text


class _SymbolNames:
    """A handler library whose every symbol is its own name."""

    def __getattr__(self, name):
        return name


_FAKE_DRIVER = r"""
#include <stdio.h>
#include <string.h>
static char log_[8192];
static int mode_ = 1;  /* a capture in thread-local mode is under way on this thread */
static void add(const char* s) {
  strncat(log_, s, sizeof(log_) - strlen(log_) - 2); strcat(log_, ";"); }
const char* fake_log(void) { return log_; }
void fake_clear(void) { log_[0] = 0; }
int EXCHANGE(int* mode) { int old = mode_; mode_ = *mode; *mode = old;
  char b[32]; snprintf(b, sizeof b, "mode=%d", mode_); add(b); return 0; }
int LOAD(void** m, const void* image) { char b[32]; snprintf(b, sizeof b, "load@%d", mode_); add(b);
  if (mode_ != 2) return 900;  /* the capture refuses it: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
  if (((const unsigned char*)image)[0] != 0x7f) return 200;  /* not an image */
  *m = (void*)0x1000; return 0; }
int GETFN(void** f, void* m, const char* name) {
  char b[64]; snprintf(b, sizeof b, "get:%s", name); add(b);
  *f = (void*)(0x2000 + strlen(name)); return 0; }
int cuFuncLoad(void* f) { add("funcload"); return 0; }
int cuFuncSetAttribute(void* f, int attr, int v) {
  char b[32]; snprintf(b, sizeof b, "smem=%d", v); add(b); return 0; }
int LAUNCH(void* f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
           unsigned s, void* st, void** p, void** x) { return 0; }
int cuStreamGetCtx(void* s, void** c) { *c = (void*)(0x2000 + 0x1000 * (long)s); return 0; }
int cuDeviceGet(int* dev, int ordinal) { *dev = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int dev) { add("retain"); *c = (void*)0x3000; return 0; }
int cuCtxPushCurrent_v2(void* c) { add("push"); return 0; }
int cuCtxPopCurrent_v2(void** c) { add("pop"); return 0; }
int hipGetDevice(int* d) { *d = 1; return 0; }
int hipSetDevice(int d) { char b[32]; snprintf(b, sizeof b, "device=%d", d); add(b); return 0; }
"""


@needs_library
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_a_kernel_loads_once_with_the_capture_mode_relaxed(tmp_path, platform):
    """Against a stand-in driver whose module load fails unless the thread's stream-capture
    mode is relaxed (as under XLA's capture of a command buffer): the load relaxes the mode,
    restores it, loads the function eagerly (CUDA), raises the shared-memory limit past 48 KiB.
    Loaded with no stream (as at trace time) it goes to the device's primary context, where a
    later call on a stream of that context (stream 1 here) finds it without loading again; a
    stream of another context (stream 2) loads its own copy (CUDA)."""
    import shutil
    import subprocess
    import sys

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    assert cc, "no C compiler (the package itself is built with one)"
    names = {"cuda": dict(soname="libcuda.so.1", EXCHANGE="cuThreadExchangeStreamCaptureMode",
                          LOAD="cuModuleLoadData", GETFN="cuModuleGetFunction",
                          LAUNCH="cuLaunchKernel"),
             "rocm": dict(soname="libamdhip64.so", EXCHANGE="hipThreadExchangeStreamCaptureMode",
                          LOAD="hipModuleLoadData", GETFN="hipModuleGetFunction",
                          LAUNCH="hipModuleLaunchKernel")}[platform]
    src = tmp_path / "fake.c"
    src.write_text(_FAKE_DRIVER)
    lib = tmp_path / names["soname"]
    defines = [f"-D{k}={v}" for k, v in names.items() if k != "soname"]
    subprocess.run([cc, "-shared", "-fPIC", *defines, f"-Wl,-soname,{names['soname']}",
                    str(src), "-o", str(lib)], check=True)
    script = f"""
import ctypes, json
fake = ctypes.CDLL({str(lib)!r}, mode=ctypes.RTLD_GLOBAL)  # found by soname at the driver's dlopen
fake.fake_log.restype = ctypes.c_char_p
ours = ctypes.CDLL({ffi_launch.library_path()!r})
def load(name, image, shared, stream=None):
    fn, err = ctypes.c_void_p(), ctypes.create_string_buffer(512)
    rc = ours.JaxMlaTritonLoadKernel({int(platform == "rocm")}, 0, ctypes.c_void_p(stream),
                                     image, len(image),
                                     ctypes.c_int64(hash(image) & 0xFFFF), name.encode(), shared,
                                     ctypes.byref(fn), err, 512)
    out = fake.fake_log().decode()
    fake.fake_clear()
    return dict(rc=rc, fn=fn.value, err=err.value.decode(), log=out)
elf = b"\x7fELF" + bytes(64)
print(json.dumps([load("mla_a", elf, 64 * 1024), load("mla_a", elf, 64 * 1024, stream=1),
                  load("mla_b", elf, 0), load("mla_c", b"text", 0),
                  load("mla_a", elf, 64 * 1024, stream=2)]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    import json

    first, again, other, bad, elsewhere = json.loads(r.stdout.strip().splitlines()[-1])
    assert first["rc"] == 0 and first["fn"] == 0x2000 + len("mla_a"), first
    log = first["log"].rstrip(";").split(";")
    assert "mode=2" in log and log[-1] == "mode=1", log  # relaxed, then restored
    assert "load@2" in log and "get:mla_a" in log, log
    if platform == "cuda":
        assert "funcload" in log and "smem=65536" in log and "push" in log and "pop" in log, log
        assert "retain" in log, log  # no stream: the device's primary context
    else:
        assert "device=0" in log and "device=1" in log, log  # made current, then restored
    assert again == dict(rc=0, fn=first["fn"], err="", log=""), again  # found, not loaded
    assert other["rc"] == 0 and "get:mla_b" in other["log"] and "smem" not in other["log"], other
    assert bad["rc"] != 0 and "cannot load kernel mla_c" in bad["err"], bad
    assert bad["log"].rstrip(";").split(";")[-1] == "mode=1", bad  # restored on failure too
    if platform == "cuda":  # another context loads its own module
        assert elsewhere["rc"] == 0 and "load@2" in elsewhere["log"], elsewhere
        assert "retain" not in elsewhere["log"], elsewhere
    else:  # HIP: one module a device, whatever the stream
        assert elsewhere == dict(rc=0, fn=first["fn"], err="", log=""), elsewhere


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_a_traced_launch_preloads_its_kernel_on_each_local_device(monkeypatch, platform):
    """Tracing a launch loads its kernel into every local device of the target's platform
    (once per kernel and device, no stream: the primary context), so that no load is left for a
    command buffer's capture; a load that fails is left to the launch's own error, and a
    process without such devices loads nothing."""
    calls = []

    class Lib:
        def JaxMlaTritonLoadKernel(self, hip, ordinal, stream, image, size, h, name, shared,
                                   fn, err, err_size):
            calls.append((hip.value, ordinal.value, stream.value, bytes(image), size.value,
                          h.value, name, shared.value))
            return 7 if ordinal.value == 3 else 0  # device 3: the load fails

    kb = _binary()
    devices = [types.SimpleNamespace(id=i + 10, local_hardware_id=hw, platform="gpu")
               for i, hw in enumerate([0, 3, None])]
    monkeypatch.setattr(ffi_launch, "_library", lambda: Lib())
    monkeypatch.setattr(ffi_launch, "_preloaded", set())
    monkeypatch.setattr(jax, "local_devices",
                        lambda backend=None: devices)
    target = Target(platform, "sm_90" if platform == "cuda" else "gfx942", 132)
    ffi_launch.preload(kb, target)
    ffi_launch.preload(kb, target)  # once a kernel and device
    hip = int(platform == "rocm")
    assert calls == [(hip, o, None, kb.binary, len(kb.binary), kb.binary_hash, b"k", kb.shared)
                     for o in (0, 3, 12)], calls  # no hardware id: the device's id
    calls.clear()
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: (_ for _ in ()).throw(
        RuntimeError("Unknown backend")))
    ffi_launch.preload(_binary(name="other"), target)
    assert calls == []  # no device of the platform: nothing loaded (ahead of time on CPU)

    # launch() preloads what it compiled, while it traces
    seen = []
    monkeypatch.setattr(ffi_launch, "compile_kernel", lambda *a, **k: kb)
    monkeypatch.setattr(ffi_launch, "check_device", lambda t: None)
    monkeypatch.setattr(ffi_launch, "register", lambda platforms: None)
    monkeypatch.setattr(ffi_launch, "preload", lambda k, t: seen.append((k, t)))
    out = jax.ShapeDtypeStruct((4,), jnp.float32)
    jax.eval_shape(lambda x: ffi_launch.launch(_reduce_kernel(), [x], grid=(1,),
                                               out_shapes=[out], target=target),
                   jnp.zeros(4, jnp.float32))
    assert seen == [(kb, target)]


@needs_library
@pytest.mark.parametrize("platform,library,advice", [
    ("cuda", "libcuda.so.1", "install the driver"), ("rocm", "libamdhip64.so", "install ROCm")])
def test_a_missing_driver_is_named_with_what_to_install(platform, library, advice):
    """What the handlers say at their first call when the driver library is absent (this CPU
    host has neither). On a GPU host the driver opens and there is nothing to report."""
    import ctypes

    error = ffi_launch.driver_error(platform)
    present = False
    for name in (library, {"cuda": "libcuda.so", "rocm": "libamdhip64.so.6"}[platform]):
        try:  # the names the handlers try, by dlopen's search (not ldconfig's cache)
            ctypes.CDLL(name)
            present = True
        except OSError:
            pass
    if present:
        assert error is None or "lacks" in error, error
    else:
        assert error and library in error and advice in error, error


def test_a_missing_library_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_MLA_FFI_LIBRARY", str(tmp_path / "nowhere.so"))
    ffi_launch._library.cache_clear()
    try:
        reason = ffi_launch.unavailable_reason()
        assert "not built" in reason and "pip install" in reason
        with pytest.raises(RuntimeError, match="JAX_MLA_FFI_LIBRARY"):
            ffi_launch.register(("CUDA",)) if "CUDA" not in ffi_launch._registered else (
                ffi_launch._library())
    finally:
        monkeypatch.delenv("JAX_MLA_FFI_LIBRARY")
        ffi_launch._library.cache_clear()


@needs_library
@pytest.mark.parametrize("hidden", [0, 2, 3])
def test_parameters_are_operands_then_results_then_nulls(rng, hidden):
    """The CPU twin decodes the launch attributes as the GPU handler does and reports, for each
    kernel parameter, the operand (0..) or result (3..) whose buffer it points at (-1: null)."""
    ffi_launch.register(("cpu",))
    kb = _binary(hidden)
    attrs = ffi_launch.launch_attributes(kb, (7, 3))
    with jax.default_device(jax.devices("cpu")[0]):  # the twin is a CPU handler, on GPU hosts too
        _check_packing(rng, hidden, attrs)


def _check_packing(rng, hidden, attrs):
    a = jnp.asarray(rng.standard_normal(5), jnp.float32)
    b = jnp.asarray(rng.integers(0, 9, 4), jnp.int32)
    c = jnp.asarray(rng.standard_normal(6), jnp.float32)
    n = 3 + 2 + hidden
    out_shapes = [jax.ShapeDtypeStruct((2, 2), jnp.bfloat16),
                  jax.ShapeDtypeStruct(c.shape, c.dtype),  # aliases c
                  jax.ShapeDtypeStruct((n,), jnp.int32)]

    @jax.jit
    def pack(a, b, c):
        return jax.ffi.ffi_call(ffi_launch.PACK_TARGET_NAME, out_shapes,
                                input_output_aliases={2: 1})(a, b, c, **attrs)

    _, aliased, where = pack(a, b, c)
    # The aliased result is c's buffer: the kernel sees the same pointer twice (jax-triton's rule).
    assert where.tolist() == [0, 1, 2, 3, 2] + [-1] * hidden
    np.testing.assert_array_equal(np.asarray(aliased), np.asarray(c))


@needs_library
def test_the_twin_rejects_a_wrong_report_buffer():
    ffi_launch.register(("cpu",))
    attrs = ffi_launch.launch_attributes(_binary(2), (1,))
    # One operand and two nulls are three parameters; a report of four entries is refused.
    call = jax.ffi.ffi_call(ffi_launch.PACK_TARGET_NAME, [jax.ShapeDtypeStruct((4,), jnp.int32)])
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(
            Exception, match="int32\\[number of params\\]"):
        jax.block_until_ready(call(jnp.ones(2), **attrs))


@needs_library
@pytest.mark.parametrize("same", [False, True], ids=["distinct", "splat"])
def test_a_sequence_packs_each_kernels_buffers_by_index(rng, same):
    """The sequence's CPU twin decodes the same attributes as the GPU handler (per-kernel arrays,
    names joined by ',', binaries concatenated) and reports, kernel after kernel, the buffer
    (operands 0.., results 3..) each parameter points at, its hidden nulls after it. With
    ``same``, the per-kernel arrays are equal across kernels, which XLA's attributes hold as
    splats: they must still decode to one entry a kernel."""
    ffi_launch.register(("cpu",))
    first = _binary(2, "first")
    second = _binary(2 if same else 1, "second")
    if same:
        second = dataclasses.replace(second, threads=first.threads, shared=first.shared)
    n = 3
    steps = [((4, 1, 1) if same else (7, 3), (0, 1, n + 0, n + 1)),
             ((4, 1, 1), (n + 1, 2, n + 0, n + 0))]  # reads result 1, rewrites result 0
    attrs = ffi_launch.sequence_attributes(
        [(kb, grid, False, params) for kb, (grid, params) in zip((first, second), steps)])
    if same:
        assert len(set(attrs["hidden_params"].tolist())) == 1
    total = 4 + 4 + first.hidden_params + second.hidden_params
    a = jnp.asarray(rng.standard_normal(5), jnp.float32)
    b = jnp.asarray(rng.integers(0, 9, 4), jnp.int32)
    c = jnp.asarray(rng.standard_normal(6), jnp.float32)
    out_shapes = [jax.ShapeDtypeStruct((2, 2), jnp.bfloat16),
                  jax.ShapeDtypeStruct((3,), jnp.float32),
                  jax.ShapeDtypeStruct((total,), jnp.int32)]
    call = jax.ffi.ffi_call(ffi_launch.PACK_SEQUENCE_TARGET_NAME, out_shapes)
    with jax.default_device(jax.devices("cpu")[0]):
        *_, where = jax.jit(lambda a, b, c: call(a, b, c, **attrs))(a, b, c)
    assert where.tolist() == ([0, 1, 3, 4] + [-1] * first.hidden_params
                              + [4, 2, 3, 3] + [-1] * second.hidden_params)


@needs_library
def test_a_call_without_its_binaries_names_its_kernels_by_hash(rng, monkeypatch):
    """``JAX_MLA_FFI_EMBED_BINARIES=0`` (a measurement knob) leaves the binaries out of the
    call's attributes and keeps everything else: the hashes the handler finds the preloaded
    kernels by, offsets that still agree (all 0), and the same parameters for the twin."""
    ffi_launch.register(("cpu",))
    assert ffi_launch.embed_binaries()
    monkeypatch.setenv("JAX_MLA_FFI_EMBED_BINARIES", "0")
    assert not ffi_launch.embed_binaries()
    kb = _binary(2)
    single = ffi_launch.launch_attributes(kb, (7, 3), embed=False)
    full = ffi_launch.launch_attributes(kb, (7, 3))
    assert single["binary"].size == 0 and full["binary"].size == len(kb.binary)
    assert set(single) == set(full)
    assert single["binary_hash"] == full["binary_hash"] == kb.binary_hash
    with jax.default_device(jax.devices("cpu")[0]):
        _check_packing(rng, 2, single)
    first, second = _binary(0, "x"), _binary(1, "y")
    launches = [(first, (1,), False, (0, 2)), (second, (1,), False, (2, 3))]
    seq = ffi_launch.sequence_attributes(launches, embed=False)
    assert seq["binaries"].size == 0 and seq["binary_offsets"].tolist() == [0, 0, 0]
    assert seq["binary_hashes"].tolist() == [first.binary_hash, second.binary_hash]
    assert ffi_launch.sequence_attributes(launches)["binary_offsets"].tolist() == [
        0, len(first.binary), len(first.binary) + len(second.binary)]
    call = jax.ffi.ffi_call(ffi_launch.PACK_SEQUENCE_TARGET_NAME,
                            [jax.ShapeDtypeStruct((2,), jnp.float32),
                             jax.ShapeDtypeStruct((2,), jnp.float32),
                             jax.ShapeDtypeStruct((5,), jnp.int32)])
    with jax.default_device(jax.devices("cpu")[0]):
        *_, where = jax.jit(lambda a, b: call(a, b, **seq))(jnp.ones(2), jnp.ones(2))
    assert where.tolist() == [0, 2, 2, 3, -1]


@pytest.mark.parametrize("embed", ["1", "0"])
def test_launches_carry_their_binaries_unless_the_knob_says_not(monkeypatch, embed):
    """``launch`` and ``launch_sequence`` read ``JAX_MLA_FFI_EMBED_BINARIES`` when traced: the
    binaries in the attributes, or none with ``0``; a launch through the record target carries
    its binary either way (XLA loads the cubin itself)."""
    kb = _binary(0)
    seen = []

    def fake_ffi_call(name, out_shapes, **kw):
        return lambda *arrays, **attrs: seen.append((name, attrs)) or [None] * len(out_shapes)

    monkeypatch.setenv("JAX_MLA_FFI_EMBED_BINARIES", embed)
    monkeypatch.setattr(ffi_launch, "check_device", lambda target: None)
    monkeypatch.setattr(ffi_launch, "register", lambda platforms: None)
    monkeypatch.setattr(ffi_launch, "compile_kernel", lambda *a, **k: kb)
    monkeypatch.setattr(ffi_launch, "preload", lambda kb, target: None)
    monkeypatch.setattr(ffi_launch, "register_record_target", lambda: None)
    monkeypatch.setattr(jax.ffi, "ffi_call", fake_ffi_call)
    target = Target("cuda", "sm_90")
    x = jnp.ones(4)
    shape = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    ffi_launch.launch(types.SimpleNamespace(__name__="k"), (x,), grid=(1,), out_shapes=shape,
                      target=target)
    ffi_launch.launch(types.SimpleNamespace(__name__="k"), (x,), grid=(1,), out_shapes=shape,
                      target=target, record=True)
    step = ffi_launch.SequenceStep(types.SimpleNamespace(__name__="k"), (0,), (0,), (1,))
    ffi_launch.launch_sequence([step], (x,), out_shapes=shape, target=target)
    (single, a), (record, b), (sequence, c) = seen
    assert (single, record, sequence) == (ffi_launch.TARGET_NAME, ffi_launch.RECORD_TARGET_NAME,
                                          ffi_launch.SEQUENCE_TARGET_NAME)
    size = len(kb.binary) if embed == "1" else 0
    assert a["binary"].size == size and c["binaries"].size == size
    assert b["binary"].size == len(kb.binary)
    assert a["binary_hash"] == b["binary_hash"] == c["binary_hashes"][0] == kb.binary_hash


@needs_library
@pytest.mark.parametrize("field, value, words", [
    ("params", np.array([0, 1, 9, 0], np.int32), "parameter index 9 is not one of the call's 4"),
    ("kernel_names", "one", "does not hold 2 names"),
    ("hidden_params", np.array([2], np.int32), "disagree in length"),
    ("binary_offsets", np.array([0, 3, 7], np.int64), "do not end the binaries"),
])
def test_the_sequence_handler_refuses_inconsistent_attributes(field, value, words):
    """Attributes that disagree (a parameter index past the call's buffers, a name missing, an
    array of the wrong length, offsets that do not end the data) are the handler's clear error,
    before any pointer is read."""
    ffi_launch.register(("cpu",))
    attrs = ffi_launch.sequence_attributes(
        [(_binary(0, "x"), (1,), False, (0, 2)), (_binary(0, "y"), (1,), False, (2, 3))])
    attrs[field] = value
    call = jax.ffi.ffi_call(ffi_launch.PACK_SEQUENCE_TARGET_NAME,
                            [jax.ShapeDtypeStruct((2,), jnp.float32),
                             jax.ShapeDtypeStruct((2,), jnp.float32),
                             jax.ShapeDtypeStruct((4,), jnp.int32)])
    with jax.default_device(jax.devices("cpu")[0]), pytest.raises(Exception, match=words):
        jax.block_until_ready(call(jnp.ones(2), jnp.ones(2), **attrs))


def _step(inputs, outputs):
    return ffi_launch.SequenceStep(types.SimpleNamespace(__name__="k"), inputs, outputs, (1,))


@pytest.mark.parametrize("steps, words", [
    ([], "at least one kernel"),
    ([_step((0, 3), (0,))], "results \\[1\\] are read before a step writes them"),
    ([_step((0,), (0, 2))], "outputs \\[2\\] are no result"),
    ([_step((0, 5), (0,))], "inputs \\[5\\] are no buffer"),
    ([_step((0,), (0,))], "results \\[1\\] are written by no step"),
])
def test_a_sequence_that_reads_before_writing_is_refused(steps, words):
    # Two operands, two results: buffer 2 is result 0, buffer 3 result 1.
    with pytest.raises(ValueError, match=words):
        ffi_launch.check_sequence(steps, 2, 2)


def test_a_sequence_outside_the_ffi_launcher_is_its_launches_in_turn(monkeypatch):
    """Where the steps cannot be one custom call (the interpreter, jax-triton, the record
    target), each is a ``triton_call`` with the same parameters: inputs from the operands or
    the results so far, its outputs new, and a result it both reads and writes aliased."""
    calls = []

    def fake_call(kernel, *args, grid, out_shapes, input_output_aliases, **kw):
        calls.append((kernel.__name__, [a.tolist() for a in args], dict(input_output_aliases)))
        outs = []
        for j, s in enumerate(out_shapes):
            src = [k for k, o in input_output_aliases.items() if o == j]
            base = args[src[0]] if src else jnp.zeros(s.shape, s.dtype)
            outs.append(base + len(calls))
        return tuple(outs)

    monkeypatch.setattr(launch, "triton_call", fake_call)
    monkeypatch.setattr(launch, "resolve_launcher", lambda target, choice=None: "interpret")
    a, b = jnp.arange(3.0), jnp.arange(3.0) * 10
    first = ffi_launch.SequenceStep(types.SimpleNamespace(__name__="first"), (0, 1), (0, 1), (1,))
    second = ffi_launch.SequenceStep(types.SimpleNamespace(__name__="second"), (3, 2), (0,), (1,))
    shape = jax.ShapeDtypeStruct((3,), jnp.float32)
    out0, out1 = launch.triton_sequence([first, second], (a, b), out_shapes=[shape, shape],
                                        target="cpu")
    assert [c[0] for c in calls] == ["first", "second"]
    assert calls[0][2] == {} and calls[1][2] == {1: 0}  # result 0 read and rewritten in place
    assert calls[1][1] == [[1.0] * 3, [1.0] * 3]  # results 1 and 0 as the first step left them
    assert out0.tolist() == [3.0] * 3 and out1.tolist() == [1.0] * 3


def test_launch_attributes_are_static_and_typed():
    kb = _binary(2)
    attrs = ffi_launch.launch_attributes(kb, [5])
    assert (attrs["grid_x"], attrs["grid_y"], attrs["grid_z"]) == (5, 1, 1)
    assert all(attrs[k].dtype == np.int32 for k in ("grid_x", "grid_y", "grid_z",
                                                     "block_threads", "shared_bytes",
                                                     "hidden_params"))
    assert attrs["binary"].dtype == np.uint8 and attrs["binary"].tobytes() == kb.binary
    assert attrs["binary_hash"].dtype == np.int64
    assert 0 <= kb.binary_hash < 2**63 and kb.binary_hash == _copy(kb).binary_hash
    assert kb.binary_hash != _binary(2).binary_hash  # another binary, another module
    for bad in [(), (1, 2, 3, 4), (-1,), (2**31,)]:
        with pytest.raises(ValueError, match="grid"):
            ffi_launch.launch_attributes(kb, bad)


def _copy(kb):
    return KernelBinary(**{f: getattr(kb, f) for f in kb.__dataclass_fields__})


def _reduce_kernel():
    """The reduce kernel as Triton's compiler sees it (this process runs the interpreter, whose
    ``@triton.jit`` objects have no parameter list)."""
    from triton.runtime.jit import JITFunction

    from jax_mla.kernels.triton import decode

    return JITFunction(getattr(decode.mla_reduce_affine_kernel, "fn",
                               decode.mla_reduce_affine_kernel))


def test_specialization_follows_the_kernels_parameters():
    k = _reduce_kernel()
    runtime = [p.name for p in k.params if not p.is_constexpr]
    need = {p.name: 2 for p in k.params if p.is_constexpr}
    dtypes = [jnp.float32] * len(runtime)
    sig, values, attrs, names = ffi_launch.specialization(k, dtypes, need)
    assert names == tuple(runtime) and values == need
    assert [sig[n] for n in runtime] == ["*fp32"] * len(runtime)
    assert all(sig[n] == "constexpr" for n in need)
    index = {p.name: i for i, p in enumerate(k.params)}
    assert set(attrs) == {(index[n],) for n in runtime}  # every pointer 16-byte aligned
    with pytest.raises(TypeError, match="has no array"):
        ffi_launch.specialization(k, dtypes[:-1], need)
    with pytest.raises(TypeError, match="runtime parameters"):
        ffi_launch.specialization(k, dtypes + [jnp.int32], need)
    with pytest.raises(TypeError, match="no constexpr parameter named"):
        ffi_launch.specialization(k, dtypes, need | {"NOT_A_PARAM": 1})
    missing = dict(need)
    missing.pop(next(iter(missing)))
    with pytest.raises(TypeError, match="has no value"):
        ffi_launch.specialization(k, dtypes, missing)


@pytest.mark.parametrize("dtype,tt", [
    (jnp.bfloat16, "*bf16"), (jnp.float16, "*fp16"), (jnp.float32, "*fp32"), (jnp.int32, "*i32"),
    (jnp.float8_e4m3fn, "*fp8e4nv"), (jnp.float8_e4m3fnuz, "*fp8e4b8"), (jnp.uint8, "*u8")])
def test_pointer_types(dtype, tt):
    assert ffi_launch.pointer_type(dtype) == tt


def test_unsupported_dtype_and_targets_are_named():
    with pytest.raises(TypeError, match="complex64"):
        ffi_launch.pointer_type(jnp.complex64)
    with pytest.raises(ValueError, match="gfx942"):
        ffi_launch.triton_target(Target("rocm", None, 304))
    with pytest.raises(ValueError, match="CUDA and ROCm"):
        ffi_launch.triton_target(Target("cpu"))
    t = ffi_launch.triton_target(Target("cuda", "sm_90", 132))
    assert (t.backend, t.arch, t.warp_size) == ("cuda", 90, 32)
    t = ffi_launch.triton_target(Target("rocm", "gfx950", 256))
    assert (t.backend, t.arch, t.warp_size) == ("hip", "gfx950", 64)


def test_scalars_are_refused_with_the_rule(monkeypatch):
    with pytest.raises(TypeError, match="constexpr keywords"):
        ffi_launch.launch(_reduce_kernel(), (jnp.ones(2), 3), grid=(1,), out_shapes=[],
                          target=Target("cuda", "sm_90", 132))


def test_compiling_under_the_interpreter_is_a_clear_error():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("this process compiles for real")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ffi_launch.compile_kernel(_reduce_kernel(), [], {}, Target("cuda", "sm_90", 132),
                                  num_warps=4, num_stages=1)


def test_disk_cache_round_trip_and_torn_files(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_MLA_CACHE_DIR", str(tmp_path))
    kb = _binary(2, name="cached")
    key = "ab" + "0" * 62
    assert ffi_launch._read_cached(key) is None
    ffi_launch._write_cached(key, kb)
    assert ffi_launch._read_cached(key) == kb
    bin_path, _ = ffi_launch._paths(key)
    assert bin_path.startswith(str(tmp_path))
    with open(bin_path, "r+b") as f:  # a torn or foreign file is compiled again, never loaded
        f.write(b"junk")
    assert ffi_launch._read_cached(key) is None


def test_cache_key_names_triton_version_target_and_specialization(monkeypatch):
    import triton
    from triton.backends.compiler import GPUTarget

    k = types.SimpleNamespace(__name__="k", cache_key="source-hash")
    sig, consts = {"a": "*fp32"}, {"H": 16}
    key = ffi_launch._cache_key(k, sig, consts, GPUTarget("cuda", 90, 32), 4, 1)
    assert key == ffi_launch._cache_key(k, sig, consts, GPUTarget("cuda", 90, 32), 4, 1)
    others = [ffi_launch._cache_key(k, sig, consts, GPUTarget("hip", "gfx942", 64), 4, 1),
              ffi_launch._cache_key(k, sig, consts, GPUTarget("cuda", 100, 32), 4, 1),
              ffi_launch._cache_key(k, {"a": "*bf16"}, consts, GPUTarget("cuda", 90, 32), 4, 1),
              ffi_launch._cache_key(k, sig, {"H": 32}, GPUTarget("cuda", 90, 32), 4, 1),
              ffi_launch._cache_key(k, sig, consts, GPUTarget("cuda", 90, 32), 8, 1),
              ffi_launch._cache_key(k, sig, consts, GPUTarget("hip", "gfx942", 64), 4, 1,
                                    {"waves_per_eu": 1})]
    k2 = types.SimpleNamespace(__name__="k", cache_key="edited-source-hash")
    others.append(ffi_launch._cache_key(k2, sig, consts, GPUTarget("cuda", 90, 32), 4, 1))
    monkeypatch.setattr(triton, "__version__", "0.0.0-other")
    others.append(ffi_launch._cache_key(k, sig, consts, GPUTarget("cuda", 90, 32), 4, 1))
    assert len({key, *others}) == len(others) + 1


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton.backends.amd") is None,
                    reason="triton without its AMD backend")
def test_compile_options_are_checked_against_the_backend():
    """A compile option reaches Triton only where its backend has it: a HIP hint on CUDA, or a
    misspelt name, is an error naming it (Triton would drop it without a word)."""
    from triton.backends.compiler import GPUTarget

    from jax_mla.backends.triton.compiler import backend_options

    hip = GPUTarget("hip", "gfx942", 64)
    assert backend_options(hip, {"waves_per_eu": 2}) == {"waves_per_eu": 2}
    assert backend_options(GPUTarget("cuda", 90, 32), None) == {}
    with pytest.raises(ValueError, match=r"\['waves_per_eu'\] are not options of Triton's cuda"):
        backend_options(GPUTarget("cuda", 90, 32), {"waves_per_eu": 1})
    with pytest.raises(ValueError, match="waves_per_cu"):
        backend_options(hip, {"waves_per_cu": 1})


def test_llir_parameter_count():
    ir = ('define ptx_kernel void @k(ptr addrspace(1) %0, ptr addrspace(1) %1, '
          'ptr addrspace(1) readnone captures(none) %2, ptr addrspace(1) %3) #0 {\n}\n'
          'define void @none() {\n}\n')
    assert ffi_launch.count_llir_params(ir, "k") == 4
    assert ffi_launch.count_llir_params(ir, "none") == 0
    with pytest.raises(RuntimeError, match="not defined"):
        ffi_launch.count_llir_params(ir, "missing")


def test_launcher_choice(monkeypatch):
    cpu, cuda = Target("cpu"), Target("cuda", "sm_90", 132)
    assert launch.resolve_launcher(cpu, "ffi") == "interpret"
    assert launch.resolve_launcher(cuda, "ffi") == "ffi"
    assert launch.resolve_launcher(cuda, "jax_triton") == "jax_triton"
    # auto: the FFI launcher, whether or not jax-triton is installed ...
    monkeypatch.setattr(ffi_launch, "unavailable_reason", lambda: None)
    for installed in (False, True):
        monkeypatch.setattr(launch, "_jax_triton_installed", lambda installed=installed: installed)
        assert launch.resolve_launcher(cuda) == "ffi"
    # ... jax-triton only without the library, and said once; with neither, ffi (which raises).
    monkeypatch.setattr(ffi_launch, "unavailable_reason", lambda: "no library here")
    with pytest.warns(UserWarning, match="no library here.*jax-triton"):
        assert launch.resolve_launcher(cuda) == "jax_triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.resolve_launcher(cuda) == "jax_triton"  # not said twice
    monkeypatch.setattr(launch, "_jax_triton_installed", lambda: False)
    assert launch.resolve_launcher(cuda) == "ffi"
    monkeypatch.setenv("JAX_MLA_TRITON_LAUNCHER", "ffi")
    assert launch.resolve_launcher(cuda) == "ffi"
    assert TritonTuning.from_env().launcher == "ffi"
    monkeypatch.setenv("JAX_MLA_TRITON_LAUNCHER", "pallas")
    with pytest.raises(ValueError, match="JAX_MLA_TRITON_LAUNCHER"):
        launch.resolve_launcher(cuda)
    with pytest.raises(ValueError, match="launcher"):
        TritonTuning(launcher="pallas")
    monkeypatch.setattr(launch, "_jax_triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="needs jax-triton"):
        launch.triton_call(_reduce_kernel(), jnp.ones(2), grid=(1,), out_shapes=[],
                           target=cuda, launcher="jax_triton")


def test_the_plan_carries_its_launcher(monkeypatch):
    import jax_mla

    md = jax_mla.build_decode_metadata(
        np.zeros((1, 2), np.int32), np.array([5], np.int32), page_size=16, num_heads=16,
        q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, backend="triton", target="cuda",
        tuning=TritonTuning(launcher="ffi", planner="jnp"))  # eager here: no CUDA to plan on
    assert md.plan.launcher == "ffi"
    # The GPU defaults: the FFI launcher (where its library is) and the planning kernel.
    from jax_mla.backends.triton.plan import make_plan
    from jax_mla.problem import DecodeProblem

    problem = DecodeProblem(num_seqs=1, qlen=1, num_heads=16, page_size=16, max_pages=2,
                            kv_lora_rank=512, rope_dim=64, q_dtype="bfloat16",
                            kv_dtype="bfloat16", target=Target("cuda", "sm_90", 132))
    monkeypatch.setattr(ffi_launch, "unavailable_reason", lambda: None)
    plan = make_plan("triton", problem, TritonTuning())
    assert (plan.launcher, plan.planner) == ("ffi", "kernel")
    cpu = make_plan("triton", dataclasses.replace(problem, target=Target("cpu")), TritonTuning())
    assert (cpu.launcher, cpu.planner) == ("interpret", "jnp")
    from jax_mla.backends.triton.launch import triton_importable

    if triton_importable("cpu"):  # not in a GPU process: the interpreter is chosen at import
        md = jax_mla.build_decode_metadata(
            np.zeros((1, 2), np.int32), np.array([5], np.int32), page_size=16, num_heads=16,
            q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, backend="triton", target="cpu")
        assert md.plan.launcher == "interpret"


LOWER = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
import jax_mla
from jax_mla.backends.triton import TritonTuning, ffi_launch
from jax_mla.problem import Target

rng = np.random.default_rng()
B, PS, MP = 3, 64, 4
res = {}


# An attribute of a custom call's line, as a list with one entry a kernel (a launch has one
# kernel, a launch sequence several; a splat array stands for one entry a kernel).
def attr(line, *names):
    kernels = len(re.search(r'kernel_names? = "([\w,]+)"', line).group(1).split(","))
    for name in names:
        m = re.search(name + r' = (dense<\[?([^>\]]*)\]?>|"?([\w-]+)"?)', line)
        if m:
            text = m.group(2) if m.group(2) is not None else m.group(3)
            items = [x.strip() for x in text.split(",")]
            return items * kernels if len(items) == 1 else items
    raise KeyError(names)
for platform, target in (("cuda", Target("cuda", "sm_90", 132)),
                         ("rocm", Target("rocm", "gfx942", 304))):
    for heads in (16, 128):
        bt = jnp.asarray(rng.permutation(B * MP).reshape(B, MP).astype(np.int32))
        lens = jnp.asarray(rng.integers(1, MP * PS, B), jnp.int32)
        q = jnp.ones((B, heads, 576), jnp.bfloat16)
        cache = jnp.ones((B * MP, PS, 576), jnp.bfloat16)

        def step(q, cache, bt, lens):
            md = jax_mla.build_decode_metadata(
                bt, lens, page_size=PS, num_heads=heads, q=q, kv_cache=cache, backend="triton",
                target=target, tuning=TritonTuning(launcher="ffi", planner="kernel",
                                                   one_call=True))
            return jax_mla.mla_attention(q, cache, md, scale=0.1, backend="triton")

        lowered = jax.jit(step).trace(q, cache, bt, lens).lower(lowering_platforms=(platform,))
        text = lowered.as_text()
        hlo = lowered.compiler_ir("hlo").as_hlo_text()
        calls = [l for l in text.splitlines() if "custom_call" in l]
        res[f"{platform}/{heads}"] = dict(
            targets=[l.split("@")[1].split("(")[0] for l in calls],
            kernels=[k for l in calls
                     for k in re.search(r'kernel_names? = "([\w,]+)"', l).group(1).split(",")],
            # Every binary is an ELF image (a sequence's are concatenated at its offsets).
            elf=[bytes.fromhex(re.search(r'binar(?:y|ies) = dense<"0x(\w+)"', l).group(1))[
                     int(o):int(o) + 4] == b"\x7fELF"
                 for l in calls
                 for o in (attr(l, "binary_offsets")[:-1] if "binaries" in l else [0])],
            typed=[l.split("custom_call_target=")[1].split(",")[0] + " " + (
                "typed" if "api_version=API_VERSION_TYPED_FFI" in l else "legacy")
                for l in hlo.splitlines() if "custom-call(" in l],
            hidden=[int(h) for l in calls for h in attr(l, "hidden_params")],
            lowered_target=[re.search(r'target = "(\w+)"', l).group(1) for l in calls])

# The 64-row Triton tile on Hopper with and without the warpgroup split (compiler.py): the
# rewritten TTGIR compiles into another binary.
hashes = []
for split in (True, False):
    tun = TritonTuning(launcher="ffi", planner="jnp", sm90_kernel=False, wg_split=split)
    q128 = jnp.ones((B, 128, 576), jnp.bfloat16)
    md = jax_mla.build_decode_metadata(bt, lens, page_size=PS, num_heads=128, q=q128,
                                       kv_cache=cache, backend="triton",
                                       target=Target("cuda", "sm_90", 132), tuning=tun)
    assert md.plan.kernel.wg_split == split
    text = jax.jit(lambda q, c: jax_mla.mla_attention(q, c, md, scale=0.1)).trace(
        q128, cache).lower(lowering_platforms=("cuda",)).as_text()
    hashes.append([h for l in text.splitlines() if "custom_call" in l
                   for k, h in zip(re.search(r'kernel_names? = "([\w,]+)"', l).group(1).split(","),
                                   attr(l, "binary_hash", "binary_hashes"))
                   if k == "mla_decode_kernel"])
res["wg_split_hashes"] = hashes

# PTX's own parameter count agrees with the one read from the LLVM IR (CUDA).
from jax_mla.kernels.triton import decode
k = decode.mla_reduce_affine_kernel
consts = dict(Q=1, H=16, L=512, BLOCK_H=16, OFF64=False, L2_HINTS=True, BLOCK_S=4, BLOCK_L=128)
dtypes = [jnp.float32, jnp.float32, jnp.int32, jnp.int32, jnp.bfloat16, jnp.float32,
          jnp.bfloat16, jnp.float32]
kb = ffi_launch.compile_kernel(k, dtypes, consts, Target("cuda", "sm_90", 132), num_warps=4,
                               num_stages=1)
ffi_launch._MEMORY.clear()
again = ffi_launch.compile_kernel(k, dtypes, consts, Target("cuda", "sm_90", 132), num_warps=4,
                                  num_stages=1)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sig, c, attrs, names = ffi_launch.specialization(k, dtypes, consts)
cc = triton.compile(ASTSource(fn=k, signature=sig, constexprs=c, attrs=attrs),
                    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
entry = cc.asm["ptx"].split(".entry")[1].split(")")[0]
res["reduce"] = dict(params=len(kb.params), hidden=kb.hidden_params,
                     ptx_params=entry.count(".param"), from_disk=again == kb,
                     threads=kb.threads)

# Programmatic dependent launch: the decode and reduce calls of a Hopper plan carry pdl = 1 (and
# binaries that wait on their predecessor), the planning kernel and every ROCm call pdl = 0.
pdl = {}
for platform, target in (("cuda", Target("cuda", "sm_90", 132)),
                         ("rocm", Target("rocm", "gfx942", 304))):
    for on in (False, True):
        tun = TritonTuning(launcher="ffi", planner="kernel", pdl=on)

        def step(q, cache, bt, lens, tun=tun, target=target):
            md = jax_mla.build_decode_metadata(
                bt, lens, page_size=PS, num_heads=16, q=q, kv_cache=cache, backend="triton",
                target=target, tuning=tun)
            return jax_mla.mla_attention(q, cache, md, scale=0.1, backend="triton")

        text = jax.jit(step).trace(q[:, :16], cache, bt, lens).lower(
            lowering_platforms=(platform,)).as_text()
        calls = [l for l in text.splitlines() if "custom_call" in l]
        pdl[f"{platform}/{on}"] = dict(
            flags=[int(f) for l in calls for f in attr(l, "pdl")],
            hashes=[h for l in calls for h in attr(l, "binary_hash", "binary_hashes")])
res["pdl"] = pdl

# one_call=False: the decode kernel and its reduce as two custom calls; the default: one.
calls = {}
for one in (False, True):
    tun = TritonTuning(launcher="ffi", planner="jnp", one_call=one)
    md = jax_mla.build_decode_metadata(bt, lens, page_size=PS, num_heads=16, q=q[:, :16],
                                       kv_cache=cache, backend="triton",
                                       target=Target("cuda", "sm_90", 132), tuning=tun)
    text = jax.jit(lambda q, c: jax_mla.mla_attention(q, c, md, scale=0.1,
                                                      backend="triton")).trace(
        q[:, :16], cache).lower(lowering_platforms=("cuda",)).as_text()
    calls[one] = [l.split("@")[1].split("(")[0] for l in text.splitlines() if "custom_call" in l]
res["two_calls"], res["one_call"] = calls[False], calls[True]
res["default_one_call"] = TritonTuning().one_call

# Too much shared memory for the target: a clear error at trace time.
try:
    tun = TritonTuning(launcher="ffi", planner="jnp", block_n=64, num_stages=3)
    md = jax_mla.build_decode_metadata(bt, lens, page_size=PS, num_heads=16, q=q[:, :16],
                                       kv_cache=cache, backend="triton",
                                       target=Target("rocm", "gfx942", 304), tuning=tun)
    jax.jit(lambda q, c: jax_mla.mla_attention(q, c, md, scale=0.1, backend="triton")).trace(
        q[:, :16], cache).lower(lowering_platforms=("rocm",))
    res["shared_error"] = None
except ValueError as e:
    res["shared_error"] = str(e)
print(json.dumps(res))
"""


@needs_library
@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
@pytest.mark.skipif(importlib.util.find_spec("triton.backends.amd") is None,
                    reason="triton without its AMD backend")
def test_a_decode_step_lowers_to_our_ffi_calls_only_for_cuda_and_rocm(tmp_path):
    """Planning kernel, then decode kernel (Triton or the Gluon sm_90 one) and reduce as one
    launch sequence (``one_call``, the default): two typed FFI custom calls (api_version 4)
    carrying three ELF binaries, for both GPU platforms, compiled on a host with no GPU; no
    jax-triton call and no Python callback. With ``one_call=False`` the decode kernel and the
    reduce are two calls."""
    # On a CPU jax, as in CI, also on a GPU host: a call's own target is then no device's.
    script = (f"import os; os.environ['JAX_MLA_CACHE_DIR'] = {str(tmp_path)!r}; "
              "os.environ['JAX_PLATFORMS'] = 'cpu'\n" + LOWER)
    r = run_compiler_script(script, timeout=900)
    for key in ("cuda/16", "cuda/128", "rocm/16", "rocm/128"):
        got = r[key]
        assert got["targets"] == ["jax_mla_triton", "jax_mla_triton_sequence"], (key, got)
        assert got["kernels"][0] == "mla_plan_kernel" and got["kernels"][2].startswith(
            "mla_reduce"), (key, got)
        assert got["kernels"][1] == ("mla_decode_sm90_kernel" if key == "cuda/128"
                                     else "mla_decode_kernel"), (key, got)
        assert got["elf"] == [True] * 3, (key, got)
        # (HLO text lists the calls in its own order.)
        assert sorted(got["typed"]) == ['"jax_mla_triton" typed',
                                        '"jax_mla_triton_sequence" typed'], (key, got)
        assert got["hidden"] == [2, 2, 2], (key, got)  # Triton's two scratch pointers
        assert set(got["lowered_target"]) == {"sm_90" if key[0] == "c" else "gfx942"}
    split, plain = r["wg_split_hashes"]
    assert len(split) == len(plain) == 1 and split != plain, r["wg_split_hashes"]
    red = r["reduce"]
    assert red["params"] + red["hidden"] == red["ptx_params"], red
    assert red["from_disk"] and red["threads"] == 128, red
    assert r["shared_error"] and "gfx942" in r["shared_error"] and "65536" in r[
        "shared_error"], r["shared_error"]
    assert any(p.suffix == ".bin" for p in tmp_path.rglob("*")), "nothing cached on disk"
    assert r["two_calls"] == ["jax_mla_triton"] * 2, r["two_calls"]  # decode, reduce
    assert r["one_call"] == ["jax_mla_triton_sequence"] and r["default_one_call"], r
    pdl = r["pdl"]
    assert pdl["cuda/False"]["flags"] == [0, 0, 0] and pdl["rocm/False"]["flags"] == [0, 0, 0]
    assert pdl["rocm/True"] == pdl["rocm/False"], pdl  # no PDL on ROCm: the same binaries
    assert pdl["cuda/True"]["flags"] == [0, 1, 1], pdl  # plan, decode, reduce
    on, off = pdl["cuda/True"]["hashes"], pdl["cuda/False"]["hashes"]
    assert on[0] == off[0] and on[1] != off[1] and on[2] != off[2], pdl


@pytest.mark.gpu
def test_ffi_and_jax_triton_launchers_agree_on_the_gpu(rng):
    """On a GPU: the same decode through both launchers, bit for bit, and close to the oracle."""
    import jax_mla
    from jax_mla.problem import current_platform

    from conftest import make_case
    from oracle import mla_decode, rel_err

    if current_platform() not in ("cuda", "rocm") or not HAS_LIBRARY:
        pytest.skip("needs a GPU and the launcher library")
    c = make_case(rng, seq_lens=[1000, 1, 333, 64], qlen=1, num_heads=16, page_size=64)
    q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
    ref, _ = mla_decode(np.asarray(q, np.float32), np.asarray(cache, np.float32),
                        c.block_table, c.seq_lens, qlen=1, page_size=64, scale=c.scale,
                        kv_lora_rank=c.kv_lora_rank)
    outs = {}
    for launcher in ("ffi", "jax_triton"):
        if launcher == "jax_triton" and importlib.util.find_spec("jax_triton") is None:
            continue
        md = jax_mla.build_decode_metadata(
            c.block_table, c.seq_lens, page_size=64, q=q, kv_cache=cache, backend="triton",
            tuning=TritonTuning(launcher=launcher))
        assert md.plan.launcher == launcher
        outs[launcher] = np.asarray(jax.jit(
            lambda q, k, md: jax_mla.mla_attention(q, k, md, scale=c.scale))(q, cache, md),
            np.float64)
        assert rel_err(outs[launcher], ref) < 1e-2, launcher
    if len(outs) == 2:
        np.testing.assert_array_equal(outs["ffi"], outs["jax_triton"])


def test_one_launch_sequence_and_two_calls_agree_under_the_interpreter(rng):
    """On CPU (Triton's interpreter): ``one_call`` runs the decode kernel and its reduce in turn
    through ``launch.triton_sequence``, with the same outputs and LSE, bit for bit, as two
    calls, at lengths that split (the reduce rewrites out / lse in place), one that is empty
    (out 0, LSE -inf) and close to the oracle."""
    import jax_mla

    from conftest import make_case
    from oracle import mla_decode, rel_err

    if not launch.triton_importable("cpu"):
        pytest.skip("needs Triton's interpreter")
    c = make_case(rng, seq_lens=[700, 0, 1, 90], qlen=1, num_heads=16, page_size=16)
    q, cache = jnp.asarray(c.q, jnp.float32), jnp.asarray(c.cache, jnp.float32)
    ref, _ = mla_decode(np.asarray(q), np.asarray(cache), c.block_table, c.seq_lens, qlen=1,
                        page_size=16, scale=c.scale, kv_lora_rank=c.kv_lora_rank)
    got = {}
    for one in (True, False):
        md = jax_mla.build_decode_metadata(
            c.block_table, c.seq_lens, page_size=16, q=q, kv_cache=cache, backend="triton",
            tuning=TritonTuning(one_call=one))
        assert md.plan.launcher == "interpret" and md.plan.tuning.one_call == one
        assert np.asarray(md.schedule.reduce_tiles)[0] >= 0  # a request was split
        out, lse = jax.jit(lambda q, k, md: jax_mla.mla_attention(
            q, k, md, scale=c.scale, return_lse=True))(q, cache, md)
        got[one] = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        assert rel_err(got[one][0], ref) < 1e-5, one
        assert np.all(got[one][0][1] == 0) and np.all(np.isneginf(got[one][1][1])), one
    np.testing.assert_array_equal(got[True][0], got[False][0])
    np.testing.assert_array_equal(got[True][1], got[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_one_launch_sequence_and_two_calls_agree_on_the_gpu(rng, heads):
    """On a GPU: the decode kernel and its reduce as one launch sequence and as two custom
    calls (the default) give the same outputs and LSE bit for bit, close to the oracle, at lengths
    that split (the reduce rewrites out / lse in place) and one that is empty."""
    import jax_mla
    from jax_mla.problem import current_platform

    from conftest import make_case
    from oracle import mla_decode, rel_err

    if current_platform() not in ("cuda", "rocm") or not HAS_LIBRARY:
        pytest.skip("needs a GPU and the launcher library")
    c = make_case(rng, seq_lens=[5000, 0, 1, 777, 64], qlen=1, num_heads=heads, page_size=64)
    q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
    ref, ref_lse = mla_decode(np.asarray(q, np.float32), np.asarray(cache, np.float32),
                              c.block_table, c.seq_lens, qlen=1, page_size=64, scale=c.scale,
                              kv_lora_rank=c.kv_lora_rank)
    got = {}
    for one in (True, False):
        md = jax_mla.build_decode_metadata(
            c.block_table, c.seq_lens, page_size=64, q=q, kv_cache=cache, backend="triton",
            tuning=TritonTuning(launcher="ffi", one_call=one))
        out, lse = jax.jit(lambda q, k, md: jax_mla.mla_attention(
            q, k, md, scale=c.scale, return_lse=True))(q, cache, md)
        got[one] = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        assert rel_err(got[one][0], ref) < 1e-2, one
        assert np.all(got[one][0][1] == 0) and np.all(np.isneginf(got[one][1][1])), one
    assert np.asarray(md.schedule.reduce_tiles)[0] >= 0  # a request was split
    np.testing.assert_array_equal(got[True][0], got[False][0])
    np.testing.assert_array_equal(got[True][1], got[False][1])


_LAZY_SCRIPT = """
import os, sys
import numpy as np, jax, jax.numpy as jnp
import jax_mla
from jax_mla.backends.triton import ffi_launch
sys.path.insert(0, {tests!r})
from conftest import make_case
c = make_case(np.random.default_rng({seed}), seq_lens=[700, 1, 64, 300], qlen=1,
              num_heads=16, page_size=64)
q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
md = jax_mla.build_decode_metadata(c.block_table, c.seq_lens, page_size=64, q=q, kv_cache=cache,
                                   backend="triton")
def chain(q, k, md):
    outs = []
    for _ in range(4):  # 12 of our calls: XLA records them into one command buffer
        o = jax_mla.mla_attention(q, k, md, scale=c.scale)
        outs.append(o)
        q = q + 0 * o[..., :1].astype(q.dtype)
    return jnp.stack(outs)
out = jax.jit(chain)(q, cache, md)
np.save({path!r}, np.asarray(out, np.float32))
print("preloaded", len(ffi_launch._preloaded))
"""


def _run_script(script: str, rng, path: str, **env):
    """``script`` (formatted with the tests' folder, a fresh seed and ``path``) in a fresh
    Python process with ``env`` added; it must succeed. ``(the process, seed, path)``."""
    import subprocess
    import sys

    seed = int(rng.integers(1 << 30))
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", script.format(tests=tests, seed=seed, path=path)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return r, seed, path


@pytest.mark.gpu
@pytest.mark.parametrize("preload", ["1", "0"])
def test_a_kernel_loaded_inside_a_command_buffer_capture_gives_the_same_answer(tmp_path, rng,
                                                                               preload):
    """On a GPU, in a fresh process: a chain of decode calls in one program (one command
    buffer), its kernels loaded when the launch was traced (the default) or only at the first
    execution, which XLA records by capturing its stream (``JAX_MLA_FFI_PRELOAD=0``): the
    relaxed capture mode must let the load through, and the answer must match this process's,
    bit for bit, and the oracle."""

    from jax_mla.problem import current_platform

    from conftest import make_case
    from oracle import mla_decode, rel_err

    if current_platform() not in ("cuda", "rocm") or not HAS_LIBRARY:
        pytest.skip("needs a GPU and the launcher library")
    r, seed, path = _run_script(_LAZY_SCRIPT, rng, str(tmp_path / "out.npy"),
                                JAX_MLA_FFI_PRELOAD=preload)
    assert ("preloaded 0" in r.stdout) == (preload == "0"), r.stdout
    got = np.load(path)
    c = make_case(np.random.default_rng(seed), seq_lens=[700, 1, 64, 300], qlen=1,
                  num_heads=16, page_size=64)
    q = jnp.asarray(c.q, jnp.bfloat16)
    ref, _ = mla_decode(np.asarray(q, np.float32),
                        np.asarray(jnp.asarray(c.cache, jnp.bfloat16), np.float32),
                        c.block_table, c.seq_lens, qlen=1, page_size=64, scale=c.scale,
                        kv_lora_rank=c.kv_lora_rank)
    for i in range(4):
        assert rel_err(got[i].astype(np.float64), ref) < 1e-2, i
        np.testing.assert_array_equal(got[i], got[0])


def test_preload_knob_leaves_loading_to_the_first_call(monkeypatch):
    """``JAX_MLA_FFI_PRELOAD=0``: nothing is loaded while a launch is traced, by either
    launcher (the device list is not even asked for)."""
    from jax_mla.backends.aiter import native

    monkeypatch.setenv("JAX_MLA_FFI_PRELOAD", "0")
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: pytest.fail("asked"))
    monkeypatch.setattr(ffi_launch, "_library", lambda: pytest.fail("loaded"))
    monkeypatch.setattr(native, "_library", lambda: pytest.fail("loaded"))
    ffi_launch.preload(_binary(), Target("cuda", "sm_90", 132))
    native.preload("/a.co", "k")


def test_programmatic_dependent_launch_follows_the_kernels_pdl_constexpr():
    kb = _binary(0)
    assert ffi_launch.launch_attributes(kb, (1,))["pdl"] == 0
    got = ffi_launch.launch_attributes(kb, (1,), pdl=True)["pdl"]
    assert got.dtype == np.int32 and got == 1


_RECORD_SCRIPT = """
import json, sys
import numpy as np, jax, jax.numpy as jnp
import jax_mla
from jax_mla.backends.triton import TritonTuning
sys.path.insert(0, {tests!r})
from conftest import make_case
c = make_case(np.random.default_rng({seed}), seq_lens=[900, 1, 64, 300], qlen=1,
              num_heads=16, page_size=64)
cache = jnp.asarray(c.cache, jnp.bfloat16)
t, h, d = c.q.shape
rng = np.random.default_rng({seed} + 1)
w = jnp.asarray(rng.standard_normal((h * d, h * d)) / np.sqrt(h * d), jnp.bfloat16)
xs = [jnp.asarray(rng.standard_normal((t, h * d)), jnp.bfloat16) for _ in range(4)]

def make_q(x, w):
    # A slow producer of the query (eight dependent 9216-square matmuls, ~1 ms): a decode
    # launch recorded without its dependency on it would start first and read a stale query.
    for _ in range(8):
        x = jnp.tanh(x @ w)
    return (4.0 * x).reshape(t, h, d)

qs = [np.asarray(jax.jit(make_q)(x, w), np.float32) for x in xs]
out = dict(q=[q.tolist() for q in qs])
for launcher in ("ffi_record", "ffi"):
    md = jax_mla.build_decode_metadata(c.block_table, c.seq_lens, page_size=64, q=xs[0].reshape(
        t, h, d), kv_cache=cache, backend="triton", tuning=TritonTuning(launcher=launcher))
    step = jax.jit(lambda x, w, k, md: jax_mla.mla_attention(make_q(x, w), k, md, scale=c.scale))
    got = []
    for _ in range(3):  # the first execution records the command buffer, later ones update it
        got.append([np.asarray(step(x, w, cache, md), np.float32).tolist() for x in xs])
    out[launcher] = got
    print("done", launcher, file=sys.stderr, flush=True)
from jax_mla.backends.triton import ffi_launch
print("record target:", ffi_launch.register_record_target(), file=sys.stderr, flush=True)
json.dump(out, open({path!r}, "w"))
"""


@pytest.mark.gpu
def test_recorded_launches_wait_for_their_inputs_and_match_captured_ones(tmp_path, rng):
    """On a CUDA GPU, in a fresh process with XLA's command-buffer log on: a decode step whose
    query comes from a slow XLA producer, run in one command buffer through the record stage
    (``launcher="ffi_record"``) and through stream capture (``ffi``), three times over four
    fresh inputs. XLA's log must show our launches recorded by the record stage (its
    ``FfiCreateLaunch`` lines, naming our kernels), every output must match the oracle on the
    query the producer made (a launch that did not wait for the producer reads another
    input's query) and the two launchers must agree bit for bit."""
    import json

    from jax_mla.problem import current_platform

    from conftest import make_case
    from oracle import mla_decode, rel_err

    if current_platform() != "cuda" or not HAS_LIBRARY:
        pytest.skip("needs a CUDA GPU and the launcher library")
    if not ffi_launch.record_available():
        pytest.skip("this jaxlib's FFI headers have no record API (jaxlib 0.11+)")
    r, seed, path = _run_script(_RECORD_SCRIPT, rng, str(tmp_path / "out.json"),
                                TF_CPP_MIN_LOG_LEVEL="0",
                                TF_CPP_VMODULE="custom_call_thunk=3,record_ffi=3",
                                # this process may hold most of the GPU's memory already
                                XLA_PYTHON_CLIENT_PREALLOCATE="false")
    assert "record target: None" in r.stderr, r.stderr[-3000:]
    recorded = set(re.findall(r"FfiCreateLaunch for kernel: (\w+)", r.stderr))
    assert any(k.startswith("mla_decode") for k in recorded), r.stderr[-3000:]
    got = json.load(open(path))
    c = make_case(np.random.default_rng(seed), seq_lens=[900, 1, 64, 300], qlen=1,
                  num_heads=16, page_size=64)
    cache = np.asarray(jnp.asarray(c.cache, jnp.bfloat16), np.float32)
    refs = []
    for q in got["q"]:
        q = np.asarray(jnp.asarray(np.asarray(q, np.float32), jnp.bfloat16), np.float32)
        refs.append(mla_decode(q, cache, c.block_table, c.seq_lens, qlen=1, page_size=64,
                               scale=c.scale, kv_lora_rank=c.kv_lora_rank)[0])
    for launcher in ("ffi_record", "ffi"):
        for run, outs in enumerate(got[launcher]):
            for i, o in enumerate(outs):
                assert rel_err(np.asarray(o, np.float64), refs[i]) < 1e-2, (launcher, run, i)
    np.testing.assert_array_equal(np.asarray(got["ffi_record"]), np.asarray(got["ffi"]))
