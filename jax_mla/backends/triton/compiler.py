"""Hooks in jax-triton's kernel compile: a TTGIR rewrite for the Triton 64-row decode tile on
Hopper (score tiles split across warpgroups), and the route by which ``@gluon.jit`` kernels
(``kernels/gluon/``) compile at all (:func:`_compile_gluon`).

The problem. A 64-row decode program has 8 warps (two warpgroups) so that its ``[64, 512]``
float32 accumulator takes 128 registers a thread, not 256: the ``P @ V`` product gets the layout
``warpsPerCTA = [4, 2]`` (each warpgroup owns 256 of the 512 columns). But Triton gives any dot
whose result feeds another dot (attention's ``Q @ K^T`` -> softmax -> ``P @ V``) the layout
``[num_warps, 1]``, so that a row's softmax stays inside one warp. With 64 rows and 8 warps that
layout *broadcasts*: both warpgroups compute the same whole ``[64, block_n]`` score tile. That is
576 / 1088 = 53 % of the kernel's MMA work done twice, twice the shared-memory reads of ``Q`` and
``K``, and twice the score registers (the tile sat at 255 registers and spilled).

The rewrite. After Triton's TTGIR passes, every 3.0 ``nvidia_mma`` layout of an 8-warp kernel
that broadcasts over warpgroups (all its tensors have 64 rows) is given ``warpsPerCTA = [4, 2]``
and an instruction width that divides its half of the columns. Each warpgroup then computes half
of the score columns; the row max and row sum become cross-warpgroup reductions, and ``P`` and the
rescale factor reach the ``P @ V`` layout through shared memory (Triton already converted them
there). Every op of TTGIR is lowered for any distributed layout, so the module stays valid; the
rewritten text is parsed back and compiled as usual.

It is applied only to kernels launched with the constexpr ``WG_SPLIT=True`` (the decode kernel at
64 rows and 8 warps on Hopper; see ``plan.py``), through a wrapper around jax-triton's kernel
compile (``install``), or by the ahead-of-time compile of the FFI launcher and the compile
reports (:func:`compile_for_target`). If the rewrite finds nothing to do, or the result does not
parse, the kernel is compiled unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import subprocess
import tempfile
import threading

log = logging.getLogger(__name__)

_MMA_V3 = re.compile(
    r"^(#mma\d*) = #ttg\.nvidia_mma<\{versionMajor = 3, versionMinor = 0, "
    r"warpsPerCTA = \[(\d+), 1\], instrShape = \[16, (\d+), (\d+)\]\}>$", re.M)
_WARPGROUP_ROWS = 64  # one warpgroup's wgmma covers 64 rows (4 warps x 16)


def _tensor_shapes(text: str, alias: str) -> list[tuple[int, ...]]:
    pat = re.compile(r"tensor<((?:\d+x)+)[a-z]\w*, " + re.escape(alias) + r">")
    return [tuple(int(d) for d in m.group(1).rstrip("x").split("x")) for m in pat.finditer(text)]


def split_broadcast_wgmma(text: str) -> tuple[str, int]:
    """``text`` with every warpgroup-broadcast wgmma layout split by columns; and how many.

    A layout qualifies when it is a 3.0 ``nvidia_mma`` with ``warpsPerCTA = [W, 1]``, ``W`` a
    multiple of 4 above 4, every 2-D tensor of that layout has 64 rows, and it is not
    the parent of a register operand (``dot_op``) whose layout would change with it (tensors of
    one row, broadcast along the rows, are allowed). It becomes
    ``[4, W / 4]`` with the widest instruction ``n`` (a multiple of 8, at most the old one) that
    divides every tensor's share of columns.
    """
    count = 0
    for m in list(_MMA_V3.finditer(text)):
        alias, warps, n, k = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if warps <= 4 or warps % 4:
            continue
        shapes = [s for s in _tensor_shapes(text, alias) if len(s) == 2]
        # Rows: one warpgroup's 64, or 1 (a broadcast row such as the key positions of a mask).
        if not shapes or any(s[0] not in (1, _WARPGROUP_ROWS) for s in shapes) or all(
                s[0] == 1 for s in shapes):
            continue  # more rows than one warpgroup: the layout does not broadcast
        if re.search(r"dot_op<\{opIdx = \d, parent = " + re.escape(alias) + r"\b", text):
            continue
        wn = warps // 4
        cols = [s[1] // wn for s in shapes if s[1] > 1]
        if any(s[1] > 1 and s[1] % wn for s in shapes) or any(c < 8 for c in cols):
            continue
        new_n = next((c for c in range(min(n, *cols) if cols else n, 7, -1)
                      if c % 8 == 0 and all(x % c == 0 for x in cols)), None)
        if new_n is None:
            continue
        new = (f"{alias} = #ttg.nvidia_mma<{{versionMajor = 3, versionMinor = 0, "
               f"warpsPerCTA = [4, {wn}], instrShape = [16, {new_n}, {k}]}}>")
        text = text.replace(m.group(0), new, 1)
        count += 1
    return text, count


def rewrite_module(mod):
    """The TTGIR module ``mod`` after :func:`split_broadcast_wgmma` (``mod`` itself if no-op)."""
    text, count = split_broadcast_wgmma(str(mod))
    if not count:
        return mod
    from triton._C.libtriton import ir

    fd, path = tempfile.mkstemp(suffix=".ttgir")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        new = ir.parse_mlir_module(path, mod.context)
        new.context = mod.context
        return new
    except Exception as e:  # noqa: BLE001 - a rewrite that does not parse is skipped, not fatal
        log.warning("jax_mla: TTGIR warpgroup split skipped (%s)", e)
        return mod
    finally:
        os.unlink(path)


def _with_rewrite(backend):
    make_ttgir = backend.make_ttgir

    def make_ttgir_split(mod, metadata, options, capability):
        return rewrite_module(make_ttgir(mod, metadata, options, capability))

    backend.make_ttgir = make_ttgir_split  # this backend object only (one per compile)
    return backend


class _Proxy:
    """A module seen through a few replaced attributes."""

    def __init__(self, module, **overrides):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._module, name)


def is_gluon(fn) -> bool:
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return False
    return isinstance(fn, GluonJITFunction)


_GLUON_LOCK = threading.Lock()


def _compile_gluon(compile_kernel, backend_init_func, platform, fn, *args, **kwargs):
    """jax-triton's compile for a ``@gluon.jit`` kernel (jax-triton 0.3 knows only ``@triton.jit``).

    The same specialization, cache and launch object; three steps differ. The source is a
    ``GluonASTSource`` (its IR is already TTGIR-level), the TTIR passes are skipped and
    ``gluon_to_ttgir`` replaces ``make_ttgir``, and the launch gets the kernel's *total* warps
    (a warp-specialized kernel has more than the ``num_warps`` it was compiled with).
    """
    from jax_triton import triton_lib
    from triton.experimental.gluon._runtime import GluonASTSource

    seen = {}

    def init(device, compute_capability):
        backend = backend_init_func(device, compute_capability)
        make_llir = backend.make_llir

        def llir(mod, metadata, options, capability):
            out = make_llir(mod, metadata, options, capability)
            seen["num_warps"] = metadata.get("num_warps")
            return out

        backend.make_ttir = lambda mod, metadata, options, capability: mod
        backend.make_ttgir = backend.gluon_to_ttgir
        backend.make_llir = llir
        seen["target"] = backend.target
        return backend

    def ast_to_ttir(fn, src, options, codegen_fns, context, module_map):
        return src.make_ir(seen["target"], options, codegen_fns, module_map, context)

    saved = (triton_lib.tc, triton_lib.code_gen, triton_lib.triton_kernel_call_lib)

    def kernel(name, num_warps, *rest):
        return saved[2].TritonKernel(name, seen.get("num_warps") or num_warps, *rest)

    with _GLUON_LOCK:
        triton_lib.tc = _Proxy(saved[0], ASTSource=GluonASTSource)
        triton_lib.code_gen = _Proxy(saved[1], ast_to_ttir=ast_to_ttir)
        triton_lib.triton_kernel_call_lib = _Proxy(saved[2], TritonKernel=kernel)
        try:
            return compile_kernel(init, platform, fn, *args, **kwargs)
        finally:
            triton_lib.tc, triton_lib.code_gen, triton_lib.triton_kernel_call_lib = saved


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _amd_knobs(target, constexprs: dict):
    """gfx942, float32 (``IEEE``) kernels: Triton's in-thread transpose pass off. With it the
    float32 decode tile spills 2-8 VGPRs at 512; without it takes 444-452 and spills none
    (``python -m jax_mla.aot``, triton 3.9; docs/aot.md). Set through the environment, which
    Triton's compile cache key includes, so the two binaries never share a cache entry."""
    if not (target.backend == "hip" and target.arch == "gfx942" and constexprs.get("IEEE")):
        yield
        return
    name = "TRITON_HIP_USE_IN_THREAD_TRANSPOSE"
    with _ENV_LOCK:
        saved = os.environ.get(name)
        os.environ[name] = "0"
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = saved


def backend_options(target, options: dict | None) -> dict:
    """``options`` checked against the compile options of ``target``'s Triton backend (a
    ``GPUTarget``): Triton drops a name its backend does not have without a word, so a
    ``waves_per_eu`` meant for HIP would vanish on CUDA, or a misspelt one anywhere."""
    if not options:
        return {}
    from triton.compiler.compiler import make_backend

    fields = getattr(make_backend(target).parse_options({}), "__dataclass_fields__", {})
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"compile options {unknown} are not options of Triton's "
                         f"{target.backend} backend (it has: {', '.join(sorted(fields))})")
    return dict(options)


def compile_for_target(kernel, *, signature: dict, constexprs: dict, attrs: dict, target,
                       num_warps: int, num_stages: int | None = None,
                       options: dict | None = None):
    """``(compiled, rewrites)``: Triton's ahead-of-time compile of ``kernel`` for ``target`` (a
    ``GPUTarget``), as the FFI launcher and the compile reports make it.

    A ``@gluon.jit`` kernel compiles from its Gluon source (warps only; it has no stages). On
    CUDA a kernel with the constexpr ``WG_SPLIT=True`` is compiled again from its TTGIR after
    :func:`split_broadcast_wgmma`; ``rewrites`` counts the layouts split (0 when nothing was to
    split, or the rewritten text did not compile and the kernel was kept unchanged).
    ``options``: further options of the target backend's compile (``waves_per_eu`` on HIP, ...);
    one the backend does not have is a ``ValueError`` (Triton would drop it silently).
    """
    import triton

    if is_gluon(kernel):
        from triton.experimental.gluon._runtime import GluonASTSource as Source
        opts = dict(num_warps=num_warps)
    else:
        from triton.compiler import ASTSource as Source
        opts = dict(num_warps=num_warps, num_stages=num_stages)
    opts.update(backend_options(target, options))
    src = Source(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    with _amd_knobs(target, constexprs):
        cc = triton.compile(src, target=target, options=opts)
    if target.backend != "cuda" or not constexprs.get("WG_SPLIT"):
        return cc, 0
    text, rewrites = split_broadcast_wgmma(cc.asm["ttgir"])
    if not rewrites:
        return cc, 0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{cc.metadata.name}.ttgir")
        with open(path, "w") as f:
            f.write(text)
        try:
            return triton.compile(path, target=target, options=opts), rewrites
        except Exception as e:  # noqa: BLE001 - as rewrite_module: the split is skipped
            log.warning("jax_mla: TTGIR warpgroup split skipped (%s)", e)
            return cc, 0


_PTXAS_LOCK = threading.Lock()


def ptxas_stats(ptx: str, target, options: dict | None = None) -> dict:
    """Registers a thread, bytes of spill stores plus loads, and stack frame bytes of ``ptx``,
    as the installed Triton's own cubin step builds it for ``target`` (a CUDA ``GPUTarget``):
    its ptxas, with the flags that version passes (triton 3.9: the CUDA 13 ``ptxas-blackwell``
    with ``--regAllocOptLevel=2``; triton 3.6: the plain CUDA 12.9 ``ptxas``, without it), read
    from the ``-v`` log Triton prints when ``dump_ptxas_log`` is on. ``options``: Triton
    compile options (``enable_fp_fusion``, ``ptx_options``, ...). No GPU needed."""
    import contextlib
    import io

    from triton import knobs
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    opt = backend.parse_options(dict(options or {}))
    log_out = io.StringIO()
    with _PTXAS_LOCK, knobs.nvidia.scope(), contextlib.redirect_stdout(log_out):
        knobs.nvidia.dump_ptxas_log = True
        cubin = backend.make_cubin(ptx, {}, opt, target.arch)
    log_text = log_out.getvalue()

    def total(pattern):
        return sum(int(m) for m in re.findall(pattern, log_text))

    if "Used" not in log_text:
        raise RuntimeError(f"no ptxas -v report in Triton's cubin step: {log_text[-500:]!r}")
    stats = dict(registers=total(r"Used (\d+) registers"),
                 spills=total(r"(\d+) bytes spill stores") + total(r"(\d+) bytes spill loads"),
                 scratch=total(r"(\d+) bytes stack frame"))
    if stats["spills"]:
        with contextlib.suppress(OSError, subprocess.SubprocessError, RuntimeError):
            stats["loop_spills"] = sass_loop_spills(cubin)
    return stats


# Backward branches over at most this many instructions are spin loops (barrier waits), not
# loops of the kernel's own.
_SPIN_LOOP = 8


def sass_loop_spills(cubin: bytes) -> int:
    """Spill instructions (``STL``/``LDL``) inside the innermost loops of a cubin's SASS (read
    with the ``cuobjdump`` Triton ships): a loop is a backward branch's range, innermost where it
    holds no other loop (spin loops of a few instructions, barrier waits, do not count, nor do
    branches from the out-of-line code after the last ``EXIT`` back into the body). Spills
    outside them run once a work, not once a KV tile."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                              check=True, timeout=120).stdout
    return loop_spills_of_sass(sass)


def loop_spills_of_sass(sass: str) -> int:
    """:func:`sass_loop_spills` on ``cuobjdump -sass`` text."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    if not ins:
        raise RuntimeError("no SASS in cuobjdump's output")
    step = ins[1][0] - ins[0][0] if len(ins) > 1 else 16
    # Code after the last EXIT is out of line (a barrier's retry loop placed after the body,
    # whose branch back into the body would read as a loop around most of the kernel).
    exits = [a for a, t in ins if re.search(r"\bEXIT\b", t)]
    body_end = exits[-1] if exits else ins[-1][0]
    loops = [(int(m.group(1), 16), a) for a, t in ins
             for m in [re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", t)]
             if m and a <= body_end and int(m.group(1), 16) < a
             and (a - int(m.group(1), 16)) // step > _SPIN_LOOP]
    inner = [(lo, hi) for lo, hi in loops
             if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops)]
    return sum(1 for a, t in ins if re.search(r"\b(STL|LDL)\b", t)
               and any(lo <= a <= hi for lo, hi in inner))


@functools.cache
def install() -> None:
    """Wrap jax-triton's kernel compile: ``WG_SPLIT=True`` kernels get the rewrite, and
    ``@gluon.jit`` kernels (``kernels/gluon/``) compile through :func:`_compile_gluon`.

    ``WG_SPLIT`` is a constexpr of the kernel, so it is part of jax-triton's compile cache key:
    the same kernel with and without the rewrite are two cached binaries.
    """
    from jax_triton import triton_lib

    compile_kernel = triton_lib.get_or_create_triton_kernel

    def get_or_create(backend_init_func, platform, fn, *args, metaparams, **kwargs):
        if is_gluon(fn):
            return _compile_gluon(compile_kernel, backend_init_func, platform, fn, *args,
                                  metaparams=metaparams, **kwargs)
        if platform == "cuda" and metaparams.get("WG_SPLIT"):
            init = backend_init_func

            def backend_init_func(device, compute_capability):
                return _with_rewrite(init(device, compute_capability))

        return compile_kernel(backend_init_func, platform, fn, *args, metaparams=metaparams,
                              **kwargs)

    triton_lib.get_or_create_triton_kernel = get_or_create
