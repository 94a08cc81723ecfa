"""The native launcher: a ``@triton.jit`` (or ``@gluon.jit``) kernel compiled ahead of time for
the plan's target, launched by jax_mla's own typed XLA FFI handlers (``ffi/triton_launch.cc``).

How a kernel becomes a custom call (``docs/launcher.md`` has the whole story):

1. At trace time :func:`compile_kernel` compiles the kernel for the target (``sm_90``-style CUDA
   archs, ``gfx942``/``gfx950``) with Triton's own compiler, from the operands' dtypes and the
   launch's constexprs, the same specialization jax-triton makes (pointers 16-byte aligned). The
   result, a :class:`KernelBinary` (cubin or hsaco, name, threads, shared memory, how many hidden
   parameters Triton appended), is cached in memory and on disk (:func:`cache_dir`, keyed by the
   Triton version, the kernel's source, the specialization and the target).
2. :func:`launch` emits one ``stablehlo.custom_call @jax_mla_triton`` (api_version 4, the typed
   FFI) with the binary and its launch parameters as static attributes.
3. At run time the handler registered for the platform (``CUDA`` or ``ROCM``, see
   :func:`register`) finds the module loaded once per device (when the launch was traced,
   :func:`preload`, else it loads it at the first call) and launches it on XLA's stream with
   ``cuLaunchKernel`` / ``hipModuleLaunchKernel``. The handler is marked command-buffer
   compatible, so XLA may capture it in a CUDA graph. With ``launcher="ffi_record"`` on CUDA
   the call goes to :data:`RECORD_TARGET_NAME`, whose record stage hands XLA the launch itself
   (:func:`register_record_target`).

The kernel's parameters are its operands, then its results, then the hidden ones (null); an
output aliased to an input reuses its buffer and still appears twice (jax-triton's convention,
so the kernels need no change). Only arrays are runtime parameters; every scalar is a constexpr.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import tempfile
import threading

import jax
import numpy as np

from jax_mla import env
from jax_mla.backends.triton import compiler
from jax_mla.problem import Target

log = logging.getLogger(__name__)

TARGET_NAME = "jax_mla_triton"  # the custom call on CUDA and ROCm (registered through jax)
# CUDA: the same handler with XLA's record stage, registered through XLA's FFI API by the
# bootstrap target (:func:`register_record_target`); ``launcher="ffi_record"`` calls it where it
# is registered (opt-in: on an H100 it changed no stream time, ``docs/launcher.md``),
# ``launcher="ffi"`` calls :data:`TARGET_NAME`, whose launch XLA captures.
RECORD_TARGET_NAME = "jax_mla_triton_record"
BOOTSTRAP_TARGET_NAME = "jax_mla_triton_bootstrap"
PACK_TARGET_NAME = "jax_mla_triton_pack"  # the CPU twin that reports the argument packing
# Several kernels launched in order by one custom call (:func:`launch_sequence`), and its CPU twin.
SEQUENCE_TARGET_NAME = "jax_mla_triton_sequence"
PACK_SEQUENCE_TARGET_NAME = "jax_mla_triton_pack_sequence"
LIBRARY_MODULE = "jax_mla._triton_launch"  # the library setup.py builds from ffi/
# Bumped when what is cached changes shape, or the TTGIR rewrite changes.
CACHE_FORMAT = 1

# Triton's pointer types for jax's dtypes.
_POINTER_TYPES = {
    "bool": "*i1", "int8": "*i8", "int16": "*i16", "int32": "*i32", "int64": "*i64",
    "uint8": "*u8", "uint16": "*u16", "uint32": "*u32", "uint64": "*u64",
    "float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "float64": "*fp64",
    "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5", "float8_e4m3fnuz": "*fp8e4b8",
    "float8_e5m2fnuz": "*fp8e5b16",
}
_ALIGN = [["tt.divisibility", 16]]  # XLA's buffers are at least 16-byte aligned
# Most shared memory (LDS) one block may use, by architecture (opt-in maximum on CUDA).
SHARED_LIMITS = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376,
                 "sm_90": 232448, "sm_100": 232448, "sm_103": 232448, "sm_120": 101376,
                 "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840}


# --- the handler library --------------------------------------------------------------------

def library_path() -> str | None:
    """The built handler library: ``JAX_MLA_FFI_LIBRARY`` or the one installed with jax_mla."""
    explicit = env.ffi_library()
    if explicit:
        return explicit
    try:
        spec = importlib.util.find_spec(LIBRARY_MODULE)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


@functools.cache
def _library() -> ctypes.CDLL:
    path = library_path()
    if path is None or not os.path.exists(path):
        raise RuntimeError(
            "jax_mla's FFI launcher library is not built (expected the extension "
            f"{LIBRARY_MODULE}, or a path in JAX_MLA_FFI_LIBRARY): reinstall with "
            "`pip install -e .` (it compiles ffi/triton_launch.cc with the system C++ compiler)")
    return ctypes.CDLL(path)


def _capsule(symbol: str):
    return jax.ffi.pycapsule(getattr(_library(), symbol))


def record_available() -> bool:
    """Whether the built library has the CUDA record stage: it is compiled in where jaxlib's FFI
    headers have XLA's record API (``xla/ffi/api/record_c_api.h``, jaxlib 0.11 and later)."""
    return hasattr(_library(), "JaxMlaTritonRecordCuda")


def command_buffer_traits():
    """The registration traits that let XLA capture our launches in command buffers (CUDA
    graphs). XLA reads a handler's traits from its registration, not from the handler: without
    them it never puts the call in a command buffer, whatever the C++ side declares.
    ``JAX_MLA_FFI_COMMAND_BUFFERS=0`` registers them without (XLA then launches each call on
    its own, between command buffers of the rest: a measurement knob)."""
    try:
        from jaxlib import xla_client
    except ImportError:  # the module jax.ffi itself registers through
        from jax._src.lib import xla_client
    from jax_mla import env

    if not env.read_flag("JAX_MLA_FFI_COMMAND_BUFFERS", True):
        return xla_client.CustomCallTargetTraits.DEFAULT
    return xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE


def handler_stages(capsule) -> dict:
    """The stages a GPU target registers through jax: ``execute`` only, which finds its module
    loaded by :func:`preload` or loads it at the first call (the handlers relax the thread's
    stream-capture mode for that load, so it may happen while XLA records a command buffer).
    XLA calls an initialize stage for every custom call on every execution of the program,
    command buffer or not, which is host time a step's command buffer cannot hide;
    ``JAX_MLA_FFI_INITIALIZE_STAGE=1`` registers it too (a measurement knob, read when the
    targets are first registered). ``capsule(stage)`` gives a stage's handler
    (``"Initialize"`` or ``"Execute"``). The record stage cannot be registered this way
    (:func:`register_record_target`)."""
    from jax_mla import env

    stages = {"execute": capsule("Execute")}
    if env.read_flag("JAX_MLA_FFI_INITIALIZE_STAGE", False):
        stages["initialize"] = capsule("Initialize")
    return stages


_RECORD_LOCK = threading.Lock()
_record_reason: list[str | None] = []  # [] not tried yet, [None] registered, [reason] not


def register_record_target() -> str | None:
    """Register :data:`RECORD_TARGET_NAME` for CUDA, once per process: None when it is (now or
    before), else why not, in words.

    XLA's record stage puts our launch in a command buffer as a kernel node of its own and
    later only updates that node's pointers; without it XLA captures the execute stage's launch
    into a child graph, and captures it again each time a buffer it uses moves, which is every
    execution of a jitted step (``docs/launcher.md``). jax registers GPU targets through the
    PJRT plugin, which passes no record stage, so the library registers this one itself through
    XLA's FFI API (``XLA_FFI_Handler_Register``, bundle {execute, record}, command-buffer
    compatible). That API's table reaches the library only in a handler's call frame: the
    bootstrap target (:data:`BOOTSTRAP_TARGET_NAME`) is run once on the first CUDA device, in a
    thread of its own, since this is called while a step is traced. Not registered: no CUDA
    device, a library built against FFI headers without the record API (jaxlib < 0.11),
    ``JAX_MLA_FFI_COMMAND_BUFFERS=0``, ``JAX_MLA_FFI_INITIALIZE_STAGE=1`` (the record bundle
    has no initialize stage), or XLA refusing it (its message)."""
    with _RECORD_LOCK:
        if not _record_reason:
            _record_reason.append(_register_record_target())
            if _record_reason[0] is not None:
                log.info("jax_mla: launches are captured into command buffers, not recorded: %s",
                         _record_reason[0])
        return _record_reason[0]


def _register_record_target() -> str | None:
    import jax.numpy as jnp

    if not env.read_flag("JAX_MLA_FFI_COMMAND_BUFFERS", True):
        return "JAX_MLA_FFI_COMMAND_BUFFERS=0"
    if env.read_flag("JAX_MLA_FFI_INITIALIZE_STAGE", False):
        return "JAX_MLA_FFI_INITIALIZE_STAGE=1 (the record target has no initialize stage)"
    try:
        if not record_available():
            return ("the FFI library has no record stage (built against jaxlib's FFI headers "
                    "older than 0.11)")
    except (RuntimeError, OSError) as e:
        return str(e)
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        devices = []
    if not devices:
        return "no CUDA device in this process"
    jax.ffi.register_ffi_target(BOOTSTRAP_TARGET_NAME, _capsule("JaxMlaTritonBootstrapCuda"),
                                platform="CUDA")
    errors = []

    def bootstrap():  # a thread of its own: a trace in this one would stage the call instead
        try:
            with jax.default_device(devices[0]):
                call = jax.ffi.ffi_call(BOOTSTRAP_TARGET_NAME, jax.ShapeDtypeStruct((), jnp.int32))
                traits = int(command_buffer_traits())
                jax.block_until_ready(jax.jit(lambda: call(target=RECORD_TARGET_NAME,
                                                           traits=np.int32(traits)))())
        except Exception as e:  # noqa: BLE001 - reported as the reason
            errors.append(e)

    thread = threading.Thread(target=bootstrap, name="jax_mla-record-bootstrap")
    thread.start()
    thread.join()
    buf = ctypes.create_string_buffer(1024)
    state = _library().JaxMlaTritonRecordTargetStatus(buf, len(buf))
    if state == 0:
        return None
    if errors:
        return f"the bootstrap call failed: {errors[0]}"
    return f"XLA refused the target: {buf.value.decode()}" if state > 0 else "not registered"


def launch_mode() -> str:
    """How this process registers and loads the GPU targets, in words (for ``doctor``): the
    stages, whether XLA may put the calls in command buffers, and when kernels load."""
    from jax_mla import env

    stages = ("initialize + execute stages" if env.read_flag("JAX_MLA_FFI_INITIALIZE_STAGE", False)
              else "execute stage only")
    if _record_reason:
        stages += (f", record stage registered on CUDA ({RECORD_TARGET_NAME})"
                   if _record_reason[0] is None else f", no record stage ({_record_reason[0]})")
    else:
        try:
            stages += (", record stage built (used by launcher='ffi_record')"
                       if record_available()
                       else ", no record stage (FFI headers older than jaxlib 0.11)")
        except (RuntimeError, OSError):
            pass
    graphs = ("command-buffer compatible" if env.read_flag("JAX_MLA_FFI_COMMAND_BUFFERS", True)
              else "outside command buffers (JAX_MLA_FFI_COMMAND_BUFFERS=0)")
    loads = ("kernels load when traced" if env.read_flag("JAX_MLA_FFI_PRELOAD", True)
             else "kernels load at their first call (JAX_MLA_FFI_PRELOAD=0)")
    return f"{stages}, {graphs}, {loads}"


_REGISTER_LOCK = threading.Lock()
_registered: set[str] = set()


def register(platforms=("CUDA", "ROCM", "cpu")) -> None:
    """Register the handlers with XLA for ``platforms`` (idempotent; no GPU needed).

    ``CUDA`` and ``ROCM`` get the launcher (:func:`handler_stages`) as :data:`TARGET_NAME`
    and the sequence launcher (execute stage) as :data:`SEQUENCE_TARGET_NAME` (CUDA's record
    target is registered apart: :func:`register_record_target`); ``cpu`` gets the twins
    :data:`PACK_TARGET_NAME` and :data:`PACK_SEQUENCE_TARGET_NAME`, which decode the same
    attributes and report how the parameters were packed, for tests.
    """
    with _REGISTER_LOCK:
        for platform in platforms:
            if platform in _registered:
                continue
            if platform == "cpu":
                jax.ffi.register_ffi_target(PACK_TARGET_NAME, _capsule("JaxMlaTritonPackCpu"),
                                            platform="cpu")
                jax.ffi.register_ffi_target(PACK_SEQUENCE_TARGET_NAME,
                                            _capsule("JaxMlaTritonPackSequenceCpu"),
                                            platform="cpu")
            else:
                suffix = {"CUDA": "Cuda", "ROCM": "Rocm"}[platform]
                jax.ffi.register_ffi_target(
                    TARGET_NAME,
                    handler_stages(
                        lambda stage, suffix=suffix: _capsule(f"JaxMlaTriton{stage}{suffix}")),
                    platform=platform, traits=command_buffer_traits())
                jax.ffi.register_ffi_target(
                    SEQUENCE_TARGET_NAME, {"execute": _capsule(f"JaxMlaTritonSequence{suffix}")},
                    platform=platform, traits=command_buffer_traits())
            _registered.add(platform)


def driver_error(platform: str) -> str | None:
    """Why the handlers cannot reach ``platform``'s driver (``"cuda"`` or ``"rocm"``) in this
    process, as they would report it at their first call; None when they can."""
    buf = ctypes.create_string_buffer(1024)
    n = _library().JaxMlaTritonDriverError(int(platform == "rocm"), buf, len(buf))
    return buf.value.decode() if n else None


def unavailable_reason() -> str | None:
    """Why the native launcher cannot be used in this process (None: it can)."""
    if importlib.util.find_spec("triton") is None:
        return "the native Triton launcher needs triton (pip install 'jax_mla[cuda]')"
    try:
        _library()
    except (RuntimeError, OSError) as e:
        return str(e)
    return None


# --- compiling ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelBinary:
    """One kernel compiled for one target: everything its launch needs besides pointers.

    Attributes:
      name: the kernel's symbol in the binary.
      target: ``"sm_90"``-style or ``"gfx942"``-style architecture it was compiled for.
      binary: the cubin (CUDA) or hsaco (ROCm).
      threads: threads per block (total warps x warp size; a warp-specialized Gluon kernel
        counts all of its warps).
      shared: dynamic shared memory in bytes.
      params: names of the runtime (pointer) parameters, operands then results.
      hidden_params: parameters Triton appended after them (its scratch pointers; null here).
    """

    name: str
    target: str
    binary: bytes
    threads: int
    shared: int
    params: tuple[str, ...]
    hidden_params: int

    @property
    def binary_hash(self) -> int:
        """The module cache key of the handler: 63 bits of the binary's SHA-256."""
        return int.from_bytes(hashlib.sha256(self.binary).digest()[:8], "little") >> 1


def triton_target(target: Target):
    """Triton's ``GPUTarget`` for a jax_mla :class:`Target`."""
    from triton.backends.compiler import GPUTarget

    if target.platform == "cuda":
        arch = (target.arch or "sm_90").removeprefix("sm_").rstrip("a")
        return GPUTarget("cuda", int(arch), 32)
    if target.platform == "rocm":
        if not target.arch:
            raise ValueError(
                "the native Triton launcher compiles for the device's architecture, and this "
                "ROCm target names none: plan with Target('rocm', 'gfx942' or 'gfx950', ...)")
        return GPUTarget("hip", target.arch, 64)
    raise ValueError(f"the native Triton launcher runs on CUDA and ROCm, not {target.platform!r}")


def pointer_type(dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _POINTER_TYPES:
        raise TypeError(f"the native Triton launcher has no pointer type for dtype {name}")
    return _POINTER_TYPES[name]


def specialization(kernel, pointer_dtypes, constexprs: dict) -> tuple[dict, dict, dict, tuple]:
    """``(signature, constexprs, attrs, runtime parameter names)`` for a compile of ``kernel``.

    ``pointer_dtypes``: the dtypes of the runtime parameters in order (operands, then results);
    they fill the kernel's non-constexpr parameters. Every constexpr parameter takes its value
    from ``constexprs`` or its default.
    """
    import inspect

    dtypes = list(pointer_dtypes)
    sig, consts, attrs, names = {}, {}, {}, []
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            if p.name in constexprs:
                consts[p.name] = constexprs[p.name]
            elif p.default is not inspect.Parameter.empty:
                consts[p.name] = p.default
            else:
                raise TypeError(f"{kernel.__name__}: constexpr {p.name} has no value")
            sig[p.name] = "constexpr"
            continue
        if not dtypes:
            raise TypeError(f"{kernel.__name__}: parameter {p.name} has no array (the kernel "
                            f"takes {len(names) + 1} or more, the launch gave {len(names)})")
        sig[p.name] = pointer_type(dtypes.pop(0))
        attrs[(i,)] = _ALIGN
        names.append(p.name)
    if dtypes:
        raise TypeError(f"{kernel.__name__}: {len(names) + len(dtypes)} arrays for "
                        f"{len(names)} runtime parameters")
    unknown = sorted(set(constexprs) - set(consts))
    if unknown:
        raise TypeError(f"{kernel.__name__}: no constexpr parameter named {unknown}")
    return sig, consts, attrs, tuple(names)


def cache_dir() -> str:
    """Where compiled kernels are kept: ``JAX_MLA_CACHE_DIR``, else ``~/.cache/jax_mla``."""
    root = env.cache_dir() or os.path.join(os.path.expanduser("~"), ".cache", "jax_mla")
    return os.path.join(root, "triton")


def _cache_key(kernel, sig, consts, target, num_warps, num_stages, options=None) -> str:
    import triton

    parts = dict(format=CACHE_FORMAT, triton=triton.__version__, kernel=kernel.__name__,
                 source=kernel.cache_key, signature=sig,
                 constexprs={k: repr(v) for k, v in consts.items()},
                 target=[target.backend, str(target.arch), target.warp_size],
                 num_warps=num_warps, num_stages=num_stages,
                 options={k: repr(v) for k, v in (options or {}).items()})
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


_MEMORY: dict[str, KernelBinary] = {}
_COMPILE_LOCK = threading.Lock()


def compile_kernel(kernel, pointer_dtypes, constexprs: dict, target: Target, *, num_warps: int,
                   num_stages: int, options: dict | None = None) -> KernelBinary:
    """``kernel`` compiled for ``target`` (see :func:`specialization`), from the caches when
    there. A constexpr ``WG_SPLIT=True`` on CUDA compiles through the warpgroup column split of
    ``compiler.py``. ``options``: further options of Triton's compile (``compiler.py``)."""
    if env.interpreter_enabled():
        raise RuntimeError("the native Triton launcher compiles kernels: TRITON_INTERPRET must "
                           "be unset before triton is imported")
    tt_target = triton_target(target)
    sig, consts, attrs, names = specialization(kernel, pointer_dtypes, constexprs)
    key = _cache_key(kernel, sig, consts, tt_target, num_warps, num_stages, options)
    with _COMPILE_LOCK:
        if key in _MEMORY:
            return _MEMORY[key]
        kb = _read_cached(key)
        if kb is None:
            kb = _compile(kernel, sig, consts, attrs, names, tt_target, num_warps, num_stages,
                          options)
            _write_cached(key, kb)
        _MEMORY[key] = kb
        return kb


def _compile(kernel, sig, consts, attrs, names, tt_target, num_warps, num_stages,
             options=None) -> KernelBinary:
    with _triton_cache():
        cc, _ = compiler.compile_for_target(kernel, signature=sig, constexprs=consts,
                                            attrs=attrs, target=tt_target,
                                            num_warps=num_warps, num_stages=num_stages,
                                            options=options)
    md = cc.metadata
    scratch = {k: getattr(md, k, 0) or 0 for k in ("global_scratch_size", "profile_scratch_size")}
    if any(scratch.values()):
        raise NotImplementedError(f"{md.name} needs Triton's scratch memory {scratch}, which "
                                  "jax_mla's FFI handler does not allocate")
    cluster = tuple(getattr(md, "cluster_dims", None) or (1, 1, 1))
    if any(c != 1 for c in cluster) or getattr(md, "launch_cooperative_grid", False):
        raise NotImplementedError(f"{md.name}: thread-block clusters and cooperative grids are "
                                  "not launched by jax_mla's FFI handler")
    binary = cc.asm["cubin" if tt_target.backend == "cuda" else "hsaco"]
    total = count_llir_params(cc.asm["llir"], md.name)
    if total < len(names):
        raise RuntimeError(f"{md.name}: its LLVM IR has {total} parameters, fewer than the "
                           f"{len(names)} arrays it takes")
    arch = f"sm_{tt_target.arch}" if tt_target.backend == "cuda" else str(tt_target.arch)
    limit = SHARED_LIMITS.get(arch)
    if limit is not None and md.shared > limit:
        raise ValueError(f"{md.name} compiled for {arch} needs {md.shared} bytes of shared "
                         f"memory, more than the {limit} a block may have there: choose a "
                         "smaller tile or fewer stages (TritonTuning / JAX_MLA_TRITON_*)")
    return KernelBinary(name=md.name, target=arch, binary=bytes(binary),
                        threads=md.num_warps * tt_target.warp_size, shared=int(md.shared),
                        params=names, hidden_params=total - len(names))


def count_llir_params(llir: str, name: str) -> int:
    """How many parameters kernel ``name`` has in its LLVM IR (Triton's hidden ones included)."""
    m = re.search(r"^define\b[^\n]*@" + re.escape(name) + r"\(", llir, re.M)
    if m is None:
        raise RuntimeError(f"kernel {name} is not defined in its LLVM IR")
    depth, i, commas, empty = 1, m.end(), 0, True
    while depth:
        c = llir[i]
        depth += c == "("
        depth -= c == ")"
        commas += c == "," and depth == 1
        empty = empty and (c.isspace() or c == ")")
        i += 1
    return 0 if empty else commas + 1


class _triton_cache:
    """Triton's compile needs a cache directory; jax-triton's import sets ``TRITON_CACHE_DIR=""``
    (no directory), so for the length of a compile an empty one points at ours."""

    def __enter__(self):
        self.saved = os.environ.get("TRITON_CACHE_DIR")
        if self.saved is not None and not self.saved.strip():
            path = os.path.join(cache_dir(), "triton-cache")
            os.makedirs(path, exist_ok=True)
            os.environ["TRITON_CACHE_DIR"] = path

    def __exit__(self, *exc):
        if self.saved is not None:
            os.environ["TRITON_CACHE_DIR"] = self.saved


def _paths(key: str) -> tuple[str, str]:
    base = os.path.join(cache_dir(), key[:2], key)
    return base + ".bin", base + ".json"


def _read_cached(key: str) -> KernelBinary | None:
    bin_path, meta_path = _paths(key)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        with open(bin_path, "rb") as f:
            binary = f.read()
    except (OSError, ValueError):
        return None
    if hashlib.sha256(binary).hexdigest() != meta.get("sha256"):
        return None  # a torn or foreign file: compile again
    return KernelBinary(name=meta["name"], target=meta["target"], binary=binary,
                        threads=meta["threads"], shared=meta["shared"],
                        params=tuple(meta["params"]), hidden_params=meta["hidden_params"])


def _write_cached(key: str, kb: KernelBinary) -> None:
    bin_path, meta_path = _paths(key)
    meta = dict(name=kb.name, target=kb.target, threads=kb.threads, shared=kb.shared,
                params=list(kb.params), hidden_params=kb.hidden_params,
                sha256=hashlib.sha256(kb.binary).hexdigest())
    try:
        os.makedirs(os.path.dirname(bin_path), exist_ok=True)
        for path, data, mode in ((bin_path, kb.binary, "wb"),
                                 (meta_path, json.dumps(meta), "w")):
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
            with os.fdopen(fd, mode) as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    except OSError as e:  # a read-only home: the in-memory cache still holds it
        log.warning("jax_mla: cannot cache a compiled kernel in %s (%s)", cache_dir(), e)


# --- launching ------------------------------------------------------------------------------

_XLA_PLATFORMS = {"cuda": "CUDA", "rocm": "ROCM"}


def check_device(target: Target) -> None:
    """A clear error when this process has a device of ``target``'s platform of another
    architecture (the binary would not load there). Lowering for a platform this process has no
    device of (ahead of time, on a CPU host) is not checked."""
    from jax_mla.problem import detect_target

    here = detect_target(target.platform)
    try:
        present = bool(jax.devices(target.platform))
    except RuntimeError:
        present = False
    if present and here.arch and target.arch and here.arch != target.arch:
        raise ValueError(f"the plan's target is {target.arch} but this process's "
                         f"{target.platform} device is {here.arch}: kernels compiled for one do "
                         "not load on the other; plan for the device the step runs on")


_PRELOAD_LOCK = threading.Lock()
_preloaded: set = set()


def preload(kb: KernelBinary, target: Target) -> None:
    """Load ``kb`` now, while its launch is traced, into every local device of ``target``'s
    platform (each device's primary context, which XLA's streams use), so that the program's
    first execution finds it loaded: XLA may record that execution into a command buffer by
    capturing its stream, where the handler would otherwise load it (with the thread's capture
    mode relaxed, the fallback for an executable that was not traced in this process). A device
    it does not load on is left to the launch's own error; a process with no such device
    (lowering ahead of time on a CPU host) loads nothing. ``JAX_MLA_FFI_PRELOAD=0`` leaves every
    load to the first call (a knob to check that path on a GPU)."""
    hip = int(target.platform == "rocm")

    def load(ordinal):
        fn, err = ctypes.c_void_p(), ctypes.create_string_buffer(512)
        _library().JaxMlaTritonLoadKernel(
            ctypes.c_int(hip), ctypes.c_int(ordinal), ctypes.c_void_p(None), kb.binary,
            ctypes.c_int64(len(kb.binary)), ctypes.c_int64(kb.binary_hash), kb.name.encode(),
            ctypes.c_int(kb.shared), ctypes.byref(fn), err, ctypes.c_int(len(err)))

    preload_on_devices(target.platform, (kb.binary_hash, kb.name), load)


def preload_on_devices(platform: str, key: tuple, load) -> None:
    """``load(ordinal)`` once per ``key`` and local device of ``platform`` (``cuda`` or
    ``rocm``; its hardware ordinal, the one XLA's handlers see), in this process: what
    :func:`preload` and the AITER handlers' ``native.preload`` share. Nothing without such
    devices or with ``JAX_MLA_FFI_PRELOAD=0``; a load's own failure is left to the launch."""
    from jax_mla import env

    if not env.read_flag("JAX_MLA_FFI_PRELOAD", True):
        return
    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError:
        return
    with _PRELOAD_LOCK:
        for d in devices:
            ordinal = getattr(d, "local_hardware_id", None)
            ordinal = d.id if ordinal is None else ordinal
            if (platform, *key, ordinal) in _preloaded:
                continue
            _preloaded.add((platform, *key, ordinal))
            load(ordinal)


def embed_binaries() -> bool:
    """Whether a custom call carries its kernels' binaries (the default: the compiled program
    needs nothing from the process that traced it). ``JAX_MLA_FFI_EMBED_BINARIES=0`` (a
    measurement knob, read at trace time) leaves them out: the call names each kernel by its
    binary hash alone, the handler finds it among those :func:`preload` loaded, and a program
    run where they were not loaded (an executable from a compilation cache) fails at its first
    call saying so. The record target always carries them (XLA loads the cubin itself)."""
    return env.read_flag("JAX_MLA_FFI_EMBED_BINARIES", True)


def _image(kb: KernelBinary, embed: bool) -> bytes:
    return kb.binary if embed else b""


def launch_attributes(kb: KernelBinary, grid, pdl: bool = False, embed: bool = True) -> dict:
    """The custom call's static attributes for launching ``kb`` on ``grid``; ``pdl``: launch it
    with programmatic dependent launch (CUDA: it may start while its predecessor on the stream
    finishes, so the kernel must wait for it, ``griddepcontrol.wait``, before touching memory;
    ROCm ignores it); ``embed``: the binary itself in the attributes, else an empty one
    (:func:`embed_binaries`)."""
    grid = tuple(int(g) for g in grid)
    if not 1 <= len(grid) <= 3 or any(g < 0 or g >= 2**31 for g in grid):
        raise ValueError(f"grid {grid} must be 1 to 3 non-negative 32-bit sizes")
    gx, gy, gz = grid + (1,) * (3 - len(grid))
    i32 = np.int32
    return dict(kernel_name=kb.name, binary=np.frombuffer(_image(kb, embed), np.uint8),
                binary_hash=np.int64(kb.binary_hash), grid_x=i32(gx), grid_y=i32(gy),
                grid_z=i32(gz), block_threads=i32(kb.threads), shared_bytes=i32(kb.shared),
                hidden_params=i32(kb.hidden_params), target=kb.target, pdl=i32(bool(pdl)))


def _require_arrays(owner: str, arrays) -> None:
    """Only arrays are runtime parameters: a ``TypeError`` naming ``owner``'s first other one."""
    for i, a in enumerate(arrays):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"{owner}: argument {i} is {type(a).__name__}; the native launcher "
                            "takes arrays only (pass scalars as constexpr keywords)")


def launch(kernel, arrays, *, grid, out_shapes, target: Target, input_output_aliases=None,
           num_warps=4, num_stages=2, compile_options=None, record: bool = False, **constexprs):
    """``kernel[grid](*arrays, *outs, **constexprs)`` as one FFI custom call; the outputs.
    ``compile_options``: further options of Triton's compile (``compile_kernel``); ``record``:
    on CUDA, the target with XLA's record stage where it can be registered
    (:func:`register_record_target`); false: :data:`TARGET_NAME`, whose launch XLA captures."""
    _require_arrays(getattr(kernel, "__name__", "kernel"), arrays)
    out_shapes = tuple(out_shapes)
    check_device(target)
    register((_XLA_PLATFORMS[target.platform],))
    dtypes = [a.dtype for a in arrays] + [s.dtype for s in out_shapes]
    kb = compile_kernel(kernel, dtypes, constexprs, target, num_warps=num_warps,
                        num_stages=num_stages, options=compile_options)
    preload(kb, target)
    name = TARGET_NAME
    if record and target.platform == "cuda" and register_record_target() is None:
        name = RECORD_TARGET_NAME
    call = jax.ffi.ffi_call(name, out_shapes,
                            input_output_aliases=dict(input_output_aliases or {}))
    # A kernel compiled to wait on its predecessor (the ``PDL`` constexpr of jax_mla's kernels)
    # is the one that may be launched ahead of it.
    outs = call(*arrays, **launch_attributes(kb, grid, pdl=bool(constexprs.get("PDL", False)),
                                             embed=name == RECORD_TARGET_NAME or embed_binaries()))
    return tuple(outs)


@dataclasses.dataclass(frozen=True)
class SequenceStep:
    """One kernel of a launch sequence (:func:`launch_sequence`, ``launch.triton_sequence``):
    ``kernel[grid](*inputs, *outputs, **constexprs)``. ``inputs`` index the sequence's buffers:
    its operands, then its results (``len(arrays) + j`` is result ``j``, written by an earlier
    step); ``outputs`` are the results this step writes (one it also takes as an input is
    rewritten in place)."""

    kernel: object
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    grid: tuple[int, ...]
    num_warps: int = 4
    num_stages: int = 2
    compile_options: dict | None = None
    constexprs: dict = dataclasses.field(default_factory=dict)

    def params(self, n_arrays: int) -> tuple[int, ...]:
        """The kernel's parameters as buffer indices: its inputs, then its outputs."""
        return (*self.inputs, *(n_arrays + j for j in self.outputs))


def check_sequence(steps, n_arrays: int, n_results: int) -> None:
    """Raise ``ValueError`` unless every step reads only operands and results written before
    it, writes only results that exist, and every result is written."""
    written: set[int] = set()
    if not steps:
        raise ValueError("a launch sequence needs at least one kernel")
    for step in steps:
        name = getattr(step.kernel, "__name__", step.kernel)
        bad = [i for i in step.inputs if not 0 <= i < n_arrays + n_results]
        early = [i - n_arrays for i in step.inputs
                 if n_arrays <= i < n_arrays + n_results and i - n_arrays not in written]
        wrong = [j for j in step.outputs if not 0 <= j < n_results]
        if bad or early or wrong or len(set(step.outputs)) != len(step.outputs):
            raise ValueError(
                f"launch sequence step {name}: inputs {list(step.inputs)}, outputs "
                f"{list(step.outputs)} over {n_arrays} operands and {n_results} results"
                + (f"; inputs {bad} are no buffer" if bad else "")
                + (f"; results {early} are read before a step writes them" if early else "")
                + (f"; outputs {wrong} are no result" if wrong else ""))
        written.update(step.outputs)
    if len(written) != n_results:
        raise ValueError(f"launch sequence: results {sorted(set(range(n_results)) - written)} "
                         "are written by no step")


def sequence_attributes(launches, embed: bool = True) -> dict:
    """The sequence call's static attributes for ``launches``, ``(KernelBinary, grid, pdl,
    params)`` each, in order (``ffi/triton_launch.cc``, ``Sequence``): per-kernel arrays, the
    names joined by ``,``, the binaries concatenated with their offsets (``embed=False``: none,
    every offset 0; :func:`embed_binaries`), the parameters' buffer indices concatenated with
    theirs."""
    if not launches:
        raise ValueError("a launch sequence needs at least one kernel")
    singles = [launch_attributes(kb, grid, pdl) for kb, grid, pdl, _ in launches]
    names = [kb.name for kb, *_ in launches]
    if any("," in n or not n for n in names):
        raise ValueError(f"kernel names {names} must be non-empty and free of ','")
    images = [_image(kb, embed) for kb, *_ in launches]
    sizes = [len(image) for image in images]
    counts = [len(params) for *_, params in launches]
    i32 = np.int32
    return dict(
        kernel_names=",".join(names),
        binaries=np.frombuffer(b"".join(images), np.uint8),
        binary_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        binary_hashes=np.array([kb.binary_hash for kb, *_ in launches], np.int64),
        grids=np.array([[a["grid_x"], a["grid_y"], a["grid_z"]] for a in singles], i32).ravel(),
        block_threads=np.array([a["block_threads"] for a in singles], i32),
        shared_bytes=np.array([a["shared_bytes"] for a in singles], i32),
        hidden_params=np.array([a["hidden_params"] for a in singles], i32),
        pdl=np.array([a["pdl"] for a in singles], i32),
        params=np.array([i for *_, params in launches for i in params], i32),
        param_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(i32),
        target=launches[0][0].target)


def launch_sequence(steps, arrays, *, out_shapes, target: Target) -> tuple:
    """Several kernels launched in order on XLA's stream by one FFI custom call
    (:data:`SEQUENCE_TARGET_NAME`); its results (``out_shapes``). Each step is a
    :class:`SequenceStep` whose inputs and outputs name the call's buffers by index, so a later
    kernel may read or rewrite (in place) what an earlier one wrote. XLA then holds one command
    for the steps, not one each: inside a command buffer it updates one when their buffers move,
    and outside one it makes one call. Each kernel is compiled and preloaded as :func:`launch`
    does (its pointer types from the buffers it is given)."""
    arrays = tuple(arrays)
    out_shapes = tuple(out_shapes)
    _require_arrays("launch_sequence", arrays)
    dtypes = [a.dtype for a in arrays] + [s.dtype for s in out_shapes]
    check_device(target)
    register((_XLA_PLATFORMS[target.platform],))
    check_sequence(steps, len(arrays), len(out_shapes))
    launches = []
    for step in steps:
        params = step.params(len(arrays))
        kb = compile_kernel(step.kernel, [dtypes[i] for i in params], step.constexprs,
                            target, num_warps=step.num_warps, num_stages=step.num_stages,
                            options=step.compile_options)
        preload(kb, target)
        launches.append((kb, step.grid, bool(step.constexprs.get("PDL", False)), params))
    call = jax.ffi.ffi_call(SEQUENCE_TARGET_NAME, out_shapes)
    return tuple(call(*arrays, **sequence_attributes(launches, embed=embed_binaries())))
