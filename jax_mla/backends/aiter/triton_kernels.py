"""AITER's segmented Triton MLA decode kernel, launched by jax_mla itself: no torch per call.

The segmented DCP verify (vLLM's ``mla_decode_fwd(..., skip_reduce=True)`` of
``aiter.ops.triton.attention.mla``) is one Triton kernel on gfx942/gfx950:
``_mla_decode_fwd_kernel`` of ``aiter.ops.triton._triton_kernels.attention.mla``. Rather than
calling AITER's Python wrapper through the bridge (a host callback with torch per call), this
module takes the installed AITER's ``JITFunction``, checks its JIT parameter list against the
one pinned in ``manifest.json`` (:func:`installed_kernel`), computes everything AITER's wrapper
computes on the host -- tile, ``BLOCK_M``/``BLOCK_Q``, head blocks, segment count, grid, warps
and stages (:func:`launch_config`, from the route and the static schedule only) -- and launches
it with :func:`jax_mla.backends.triton.launch.triton_call`: on ROCm compiled ahead of time for
the plan's arch and launched by jax_mla's typed FFI handler (``jax_mla_triton``), on CPU run by
Triton's interpreter inside ``jax.jit``. The three segment partials are merged in jnp
(``segments.merge_mla_segments``).

The kernel is launched through jax_mla's entry kernel (``jax_mla/kernels/triton/aiter_entry.py``),
which calls it with every parameter by name: jax_mla's FFI handler passes arrays only, operands
then results, and AITER's kernel takes its outputs first and its scalars at run time; there they
are compile-time constants. Every size is static (the plan's), nothing is read from a device
array: no host sync.

Importing AITER's kernel module imports ``aiter`` and torch (the module imports torch at its top),
so it is imported when a step is traced, never at ``jax_mla`` import. ``backend.py`` uses this
route by default and falls back to the bridge (``bridge.segmented_dcp_verify``), warned once per
process, when :func:`unavailable_reason` says why it cannot. Nothing here has run on AMD hardware.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math

import jax
import jax.numpy as jnp

from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter import manifest
from jax_mla.backends.aiter.segments import merge_mla_segments
from jax_mla.backends.base import out_dtype
from jax_mla.backends.triton.plan import next_pow2
from jax_mla.cache import is_fp8
from jax_mla.problem import as_target

KERNEL = "aiter.ops.triton._triton_kernels.attention.mla._mla_decode_fwd_kernel"
ARCHS = ("gfx942", "gfx950")  # gfx1250 launches AITER's Gluon kernels instead
FALLBACK_WHAT = "segmented Triton MLA decode"


class KernelUnavailable(RuntimeError):
    """The installed AITER's segmented decode kernel cannot be launched by jax_mla."""


_BRIDGE: list[bool] = []


@contextlib.contextmanager
def use_bridge():
    """Test/bench-only: trace the segmented verify through the Python bridge (no warning)."""
    _BRIDGE.append(True)
    try:
        yield
    finally:
        _BRIDGE.pop()


def bridge_requested() -> bool:
    return bool(_BRIDGE)


# --- finding the kernel -------------------------------------------------------------------------

def installed_kernel():
    """The installed AITER's ``_mla_decode_fwd_kernel`` (a Triton JIT function), checked against
    the pinned JIT parameter list; :class:`KernelUnavailable` saying why not."""
    try:
        from aiter.ops.triton._triton_kernels.attention.mla import (
            _mla_decode_fwd_kernel as kernel,
        )
    except Exception as e:  # noqa: BLE001 - no aiter, or one whose import fails
        raise KernelUnavailable(f"importing {KERNEL} failed: {type(e).__name__}: {e}") from e
    problems = manifest.check_triton_kernel(KERNEL, kernel)
    if problems:
        raise KernelUnavailable(
            f"the installed AITER's segmented decode kernel is not the one jax_mla launches "
            f"(ROCm/aiter {caps.AITER_COMMIT[:8]}): " + "; ".join(problems))
    return kernel


def unavailable_reason(target, arch: str) -> str | None:
    """Why jax_mla cannot launch the segmented kernel for ``target`` (None: it can)."""
    from jax_mla.backends.triton import launch

    target = as_target(target)
    if arch not in ARCHS:
        return f"jax_mla launches AITER's segmented Triton kernel on {ARCHS}, not {arch!r}"
    why = launch.unavailable_reason(target.platform)  # on CPU: chooses the interpreter first
    if why is not None:
        return why
    try:
        installed_kernel()
    except KernelUnavailable as e:
        return str(e)
    return None


def kernel_key(kernel) -> str:
    """A hash of the kernel's source: part of the compile's constexprs, so a changed AITER
    kernel is a new binary (the launch's cache key sees the entry kernel's source only)."""
    key = getattr(kernel, "cache_key", None)
    if isinstance(key, str):
        return key
    return hashlib.sha256(inspect.getsource(kernel.fn).encode()).hexdigest()


# --- AITER's launch parameters, from static sizes ---------------------------------------------

def num_segments(tile_size: int, max_seqlen_kv: int, num_2d_programs: int, num_cu: int) -> int:
    """``select_3d_config``'s segment count on gfx942/gfx950 (always 8 to 128, a power of 2)."""
    max_segments = min(128, math.ceil(max_seqlen_kv / tile_size))
    s = math.ceil(4 * num_cu / num_2d_programs) * 2
    s = next_pow2(min(s, max_segments))
    return max(min(s, 128), 8)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One launch of ``_mla_decode_fwd_kernel`` as AITER's ``mla_decode_fwd`` makes it."""

    tile_size: int
    block_m: int
    block_q: int
    num_head_blocks: int
    num_segments: int
    tokens_per_seq: int
    q_blocks: int
    num_warps: int
    num_stages: int
    waves_per_eu: int

    @property
    def all_decode(self) -> bool:
        return self.tokens_per_seq == 1

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.q_blocks, 1, self.num_segments)  # one KV head


def launch_config(*, rows: int, num_seqs: int, num_heads: int, page_size: int,
                  max_seqlen_kv: int, kv_fp8: bool, arch: str, num_cu: int) -> LaunchConfig:
    """AITER's host computations for ``rows`` query tokens of ``num_seqs`` sequences (uniform),
    ``num_heads`` query heads over one KV head, KV pages of ``page_size`` tokens."""
    if arch not in ARCHS:
        raise KernelUnavailable(f"no segmented Triton launch parameters for {arch!r}")
    tokens = rows // num_seqs
    gqa = num_heads
    block_m = 16 if gqa <= 16 else min(next_pow2(gqa), 128 if kv_fp8 else 64)
    block_q = max(block_m // gqa, 1)
    head_blocks = -(-gqa // block_m)
    q_blocks = num_seqs * head_blocks if tokens == 1 else (
        -(-tokens // block_q) * num_seqs * head_blocks)
    return LaunchConfig(
        tile_size=page_size, block_m=block_m, block_q=block_q, num_head_blocks=head_blocks,
        num_segments=num_segments(page_size, max_seqlen_kv, q_blocks, num_cu),
        tokens_per_seq=tokens, q_blocks=q_blocks, num_warps=2,
        num_stages=2 if arch == "gfx950" else 1, waves_per_eu=1)


# --- the call -----------------------------------------------------------------------------------

def segment_partials(q, kv_cache, view, route, *, scale: float, kv_scale=None, target,
                     kernel=None):
    """``(segm_output [T, n, S, L], segm_max [T, n, S], segm_expsum [T, n, S])`` float32: what
    ``mla_decode_fwd(..., skip_reduce=True)`` returns, from one launch of AITER's kernel.

    ``q [T, n, D]`` 16-bit; ``kv_cache [pages, page_size, D]`` viewed as ``[-1, view.page_size,
    1, D]``; ``view``: the :class:`~.schedule.DcpVerifyView`. Segments past a row's last are not
    written (whatever the buffer held: NaN under ``JAX_MLA_POISON_OUTPUTS`` on CPU).
    """
    from jax_mla.backends.triton.launch import resolve_launcher, triton_call
    from jax_mla.kernels.triton.aiter_entry import mla_aiter_segmented_entry_kernel

    target = as_target(target)
    kernel = installed_kernel() if kernel is None else kernel
    rows, n, d = q.shape
    lr = d - 64
    page = view.page_size
    table = view.block_table.astype(jnp.int32)
    cfg = launch_config(rows=rows, num_seqs=view.row_lens.shape[0], num_heads=n,
                        page_size=page, max_seqlen_kv=view.max_kv_seq_len,
                        kv_fp8=is_fp8(kv_cache.dtype), arch=route.arch,
                        num_cu=route.num_cu or caps.arch_info(route.arch).num_cu)
    kv4 = kv_cache.reshape(-1, page, 1, d)
    q_fp8, kv_fp8 = is_fp8(q.dtype), is_fp8(kv_cache.dtype)
    if resolve_launcher(target) == "interpret":
        # Triton 3.9's interpreter computes a bf16 dot on the values' storage bits (uint16):
        # it gets the same values, exactly, in float32 (jax_mla's own kernels upcast there too).
        # The one difference from a GPU: P is not rounded to bf16 before the P @ V dot.
        q, kv4 = q.astype(jnp.float32), kv4.astype(jnp.float32)
    ks = jnp.asarray(1.0 if kv_scale is None else kv_scale, jnp.float32).reshape(1)
    f32 = jnp.float32
    s = cfg.num_segments
    outs = (jax.ShapeDtypeStruct((rows, n, s, lr), f32), jax.ShapeDtypeStruct((rows, n, s), f32),
            jax.ShapeDtypeStruct((rows, n, s), f32))
    return triton_call(
        mla_aiter_segmented_entry_kernel, q, kv4, table, view.row_lens.astype(jnp.int32),
        view.qo_indptr.astype(jnp.int32), ks, grid=cfg.grid, out_shapes=outs, target=target,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # AITER's launch passes its compiler this HIP occupancy hint too.
        compile_options={"waves_per_eu": cfg.waves_per_eu} if target.platform == "rocm" else None,
        KERNEL=kernel, KERNEL_KEY=kernel_key(kernel), SCALE=float(scale), NUM_QUERY_HEADS=n,
        NUM_KV_HEADS=1, BLOCK_TABLES_STRIDE=table.shape[1], QUERY_STRIDE_0=n * d,
        QUERY_STRIDE_1=d, KV_LORA_RANK=lr, QK_ROPE_HEAD_DIM=d - lr, STRIDE_KV_0=page * d,
        STRIDE_KV_1=d, STRIDE_KV_2=d, STRIDE_KV_3=1, NUM_TOKENS_PER_SEQ=cfg.tokens_per_seq,
        TILE_SIZE=cfg.tile_size, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m,
        NUM_SEGMENTS_PER_SEQ=s, NUM_WARPS=cfg.num_warps, WAVES_PER_EU=cfg.waves_per_eu,
        NUM_STAGES=cfg.num_stages, NUM_HEAD_BLOCKS=cfg.num_head_blocks,
        ALL_DECODE=cfg.all_decode, IS_Q_FP8=q_fp8, IS_KV_FP8=kv_fp8)


def segmented_dcp_verify(q, kv_cache, route, schedule, *, scale: float, target, q_scale=None,
                         kv_scale=None, kernel=None):
    """``bridge.segmented_dcp_verify``'s contract through jax_mla's own launch of AITER's kernel.

    ``q [rows, n, D]`` (fp8 is dequantised to bf16 first, as vLLM and the bridge do); returns
    ``(out [rows, n, L], lse [rows, n])``, natural-log LSE over this rank's KV.
    """
    view = schedule.dcp_verify
    out_dt = out_dtype(q.dtype)
    if is_fp8(kv_cache.dtype) and q.dtype != jnp.bfloat16:
        # q.to(bf16) * q_scale, rounded to bf16 like torch's bf16 * fp32-scalar (the bridge's).
        qs = jnp.asarray(1.0 if q_scale is None else q_scale, jnp.float32).reshape(())
        q = (q.astype(jnp.bfloat16).astype(jnp.float32) * qs).astype(jnp.bfloat16)
    parts = segment_partials(q, kv_cache, view, route, scale=scale, kv_scale=kv_scale,
                             target=target, kernel=kernel)
    return merge_mla_segments(*parts, view.row_lens, view.page_size, out_dtype=out_dt)
