"""AITER's Gluon MLA decode (gfx950), launched by jax_mla itself: no torch, no callback per call.

vLLM's small-head routes on gfx950 (fewer than 16 heads, a bf16 cache; decode and MTP verify)
call ``aiter.ops.triton.gluon.mla_gluon.mla_gluon``, which launches two kernels: ``_mla_gluon``
(a Gluon kernel; each program attends one split of one request's KV for 16 heads and one query
position) and, when a request is cut into several splits, ``_mla_softmax_reducev_kernel`` (a
Triton kernel merging them by their LSE). Rather than calling that wrapper through the bridge (a
host callback with torch per call), this module takes the installed AITER's two kernels, checks
their JIT parameter lists against the ones pinned in ``manifest.json`` (:func:`installed_kernels`),
computes everything the wrapper computes on the host -- regime, head and KV blocks, split count,
grids, warps, strides, the 2 GB addressing switch (:func:`launch_config`, from static shapes
only) -- and launches both through :func:`jax_mla.backends.triton.launch.triton_call`: compiled
ahead of time for gfx950 and launched by jax_mla's typed FFI handler (``jax_mla_triton``), with
jax_mla's entry kernels (``kernels/gluon/aiter_entry.py``, ``kernels/triton/aiter_entry.py``)
binding every parameter by name and every scalar as a constant.

Gluon has no interpreter, so this route exists on ROCm only; elsewhere (CPU tests) the route
stays on the bridge. ``backend.py`` uses it by default on ROCm and falls back to the bridge,
warned once per process, when :func:`unavailable_reason` says why it cannot. Nothing here has
run on AMD hardware: on a CPU host the two kernels compile for gfx950 and the step lowers to two
typed FFI calls (tests/test_aiter_gluon_ffi.py); the reduce's entry runs in Triton's interpreter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter import manifest
from jax_mla.backends.aiter.triton_kernels import KernelUnavailable, kernel_key
from jax_mla.backends.base import out_dtype
from jax_mla.backends.triton.plan import next_pow2
from jax_mla.cache import is_fp8
from jax_mla.problem import as_target

KERNEL = "aiter.ops.triton.gluon.mla_gluon._mla_gluon"
REDUCE_KERNEL = "aiter.ops.triton.gluon.mla_gluon._mla_softmax_reducev_kernel"
ARCHS = ("gfx950",)  # mla_gluon asserts gfx950 (its LDS)
FALLBACK_WHAT = "Gluon MLA decode"
LAUNCH_BUDGET = 256  # mla_gluon's bh16 regimes fill about 256 workgroups (one wave on MI350)
TWO_GB = 0x80000000  # past it AITER's kernel leaves buffer loads for 64-bit addressing


def installed_kernels():
    """``(_mla_gluon, _mla_softmax_reducev_kernel)`` of the installed AITER, each checked against
    its pinned JIT parameter list; :class:`KernelUnavailable` saying why not."""
    try:
        from aiter.ops.triton.gluon.mla_gluon import _mla_gluon, _mla_softmax_reducev_kernel
    except Exception as e:  # noqa: BLE001 - no aiter, an older one, or one whose import fails
        raise KernelUnavailable(f"importing {KERNEL} failed: {type(e).__name__}: {e}") from e
    problems = (manifest.check_triton_kernel(KERNEL, _mla_gluon)
                + manifest.check_triton_kernel(REDUCE_KERNEL, _mla_softmax_reducev_kernel))
    if problems:
        raise KernelUnavailable(
            f"the installed AITER's Gluon MLA kernels are not the ones jax_mla launches "
            f"(ROCm/aiter {caps.AITER_COMMIT[:8]}): " + "; ".join(problems))
    return _mla_gluon, _mla_softmax_reducev_kernel


def unavailable_reason(target, arch: str) -> str | None:
    """Why jax_mla cannot launch the Gluon kernels for ``target`` (None: it can)."""
    from jax_mla.backends.triton import launch

    target = as_target(target)
    if arch not in ARCHS:
        return f"AITER's Gluon MLA kernel runs on {ARCHS}, not {arch!r}"
    if target.platform != "rocm":
        return (f"AITER's Gluon kernel is launched by jax_mla on ROCm only (Gluon has no "
                f"interpreter; platform {target.platform!r})")
    why = launch.unavailable_reason(target.platform)
    if why is not None:
        return why
    try:
        installed_kernels()
    except KernelUnavailable as e:
        return str(e)
    return None


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The two launches of AITER's ``mla_gluon`` for one static problem (bh16 regimes)."""

    regime: str
    block_h: int
    block_n: int
    num_kv_splits: int
    batch: int
    qlen: int
    num_heads: int
    within_2gb: bool

    @property
    def head_blocks(self) -> int:
        return -(-self.num_heads // self.block_h)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.batch, self.num_kv_splits, self.head_blocks * self.qlen)

    @property
    def reduce_grid(self) -> tuple[int, int, int]:
        return (self.batch, self.num_heads, self.qlen)

    @property
    def block_s(self) -> int:
        return min(64, next_pow2(self.num_kv_splits))

    num_warps = 4  # _mla_gluon is launched with the default warps
    reduce_num_warps = 8


def launch_config(*, batch: int, qlen: int, num_heads: int, kv_fp8: bool,
                  kv_bytes: int) -> LaunchConfig:
    """What ``mla_gluon`` computes for ``batch`` requests of ``qlen`` query tokens, ``num_heads``
    heads, over a cache of ``kv_bytes`` bytes (its 64/128-head regime is not one vLLM's routes
    send here, and is refused)."""
    if num_heads in (64, 128) or not 1 <= num_heads <= 96:
        raise KernelUnavailable(f"jax_mla launches mla_gluon's 16-head regimes (1-96 heads, "
                                f"not 64 or 128), not {num_heads} heads")
    regime, block_n = ("bh16bn128", 128) if kv_fp8 else ("bh16bn64", 64)
    head_blocks = -(-num_heads // 16)
    splits = max(1, LAUNCH_BUDGET // (batch * qlen * head_blocks))
    return LaunchConfig(regime=regime, block_h=16, block_n=block_n, num_kv_splits=splits,
                        batch=batch, qlen=qlen, num_heads=num_heads,
                        within_2gb=kv_bytes <= TWO_GB)


def gluon_decode(q, kv_cache, md, route, *, scale: float, target, kernels=None):
    """``bridge.gluon_decode``'s contract through jax_mla's own launches of AITER's kernels.

    ``q [T, n, 576]`` bf16 (``T = B * qlen``), ``kv_cache`` bf16; the metadata's flat per-token
    ``paged_kv_indices`` / ``paged_kv_indptr``. Returns ``(out [T, n, 512], lse [T, n] | None)``,
    natural-log LSE when ``route.return_lse``.
    """
    from jax_mla.backends.triton.launch import triton_call
    from jax_mla.kernels.gluon.aiter_entry import mla_aiter_gluon_entry_kernel

    target = as_target(target)
    kernel, reduce_kernel = installed_kernels() if kernels is None else kernels
    t, n, d = q.shape
    lr = d - 64
    qlen = route.qlen
    if t % qlen:
        raise ValueError(f"verify block {t} rows is not a multiple of qlen {qlen}")
    if is_fp8(kv_cache.dtype) or q.dtype != jnp.bfloat16:
        raise KernelUnavailable("jax_mla's Gluon route takes a bf16 query and cache")
    b = t // qlen
    kv = kv_cache.reshape(-1, d)
    cfg = launch_config(batch=b, qlen=qlen, num_heads=n, kv_fp8=False,
                        kv_bytes=kv.size * kv.dtype.itemsize)
    s = cfg.num_kv_splits
    out_dt = out_dtype(q.dtype)
    f32 = jnp.float32
    ret = bool(route.return_lse)
    dummy = jax.ShapeDtypeStruct((1,), f32)
    lse_shape = jax.ShapeDtypeStruct((t, n), f32) if ret else dummy
    # Strides of AITER's views: q [B, qlen, n, D] (query-position stride 0 for plain decode),
    # the split outputs [B, qlen, n, S, L], their LSE [B, qlen, n, S], the final LSE [B, qlen, n].
    q_s = n * d if qlen > 1 else 0
    o5 = (qlen * n * s * lr, n * s * lr, s * lr, lr)
    ml = (qlen * n * s, n * s, s, 1) if s > 1 else (0, 0, 0, 0)
    fl = (qlen * n, n, 1) if ret else (0, 0, 0)
    first = (jax.ShapeDtypeStruct((t, n, lr) if s == 1 else (b, qlen, n, s, lr), out_dt),
             jax.ShapeDtypeStruct((b, qlen, n, s), f32) if s > 1 else dummy,
             lse_shape if s == 1 else dummy)
    common = dict(target=target, launcher="ffi")
    o, mid, final = triton_call(
        mla_aiter_gluon_entry_kernel, q, kv, md.paged_kv_indices.astype(jnp.int32),
        md.paged_kv_indptr.astype(jnp.int32), grid=cfg.grid, out_shapes=first,
        num_warps=cfg.num_warps, **common,
        KERNEL=kernel, KERNEL_KEY=kernel_key(kernel), SM_SCALE=float(scale), KV_SCALE=1.0,
        STRIDE_Q_B=qlen * n * d, STRIDE_Q_S=q_s, STRIDE_Q_H=d, STRIDE_KV=d,
        STRIDE_O_B=o5[0], STRIDE_O_S=o5[1], STRIDE_O_H=o5[2], STRIDE_O_SPLIT=o5[3],
        STRIDE_ML_B=ml[0], STRIDE_ML_S=ml[1], STRIDE_ML_H=ml[2], STRIDE_ML_SPLIT=ml[3],
        STRIDE_FL_B=fl[0], STRIDE_FL_S=fl[1], STRIDE_FL_H=fl[2], BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n, NUM_KV_SPLITS=s, HEAD_DIM_CKV=lr, HEAD_DIM_KPE=d - lr,
        WITHIN_2GB=cfg.within_2gb, NUM_XCDS=1, NHEAD=n, REGIME=cfg.regime, RETURN_LSE=ret,
        QLEN=qlen)
    if s == 1:  # stage 1 wrote the final output (and LSE)
        return o, (final if ret else None)
    out, lse = reduce_splits(o, mid, md.paged_kv_indptr, cfg, reduce_kernel, out_dt,
                             return_lse=ret, **common)
    return out, (lse if ret else None)


def reduce_splits(logits, mid_lse, kv_indptr, cfg: LaunchConfig, kernel, out_dt, *,
                  return_lse: bool, target, launcher=None):
    """AITER's stage 2 through jax_mla's entry: ``logits [B, qlen, n, S, L]`` and
    ``mid_lse [B, qlen, n, S]`` (natural log) -> ``(out [B * qlen, n, L], lse [B * qlen, n]
    or a one-element placeholder)``."""
    from jax_mla.backends.triton.launch import triton_call
    from jax_mla.kernels.triton.aiter_entry import mla_aiter_gluon_reduce_entry_kernel

    b, qlen, n, s, lr = logits.shape
    f32 = jnp.float32
    o3 = (qlen * n * lr, n * lr, lr) if qlen > 1 else (n * lr, 0, lr)
    fl = (qlen * n, n, 1) if return_lse else (0, 0, 0)
    outs = (jax.ShapeDtypeStruct((b * qlen, n, lr), out_dt),
            jax.ShapeDtypeStruct((b * qlen, n) if return_lse else (1,), f32))
    return triton_call(
        mla_aiter_gluon_reduce_entry_kernel, logits, mid_lse, kv_indptr.astype(jnp.int32),
        grid=cfg.reduce_grid, out_shapes=outs, target=target, launcher=launcher,
        num_warps=cfg.reduce_num_warps, num_stages=2,
        KERNEL=kernel, KERNEL_KEY=kernel_key(kernel), STRIDE_L_B=qlen * n * s * lr,
        STRIDE_L_S=n * s * lr, STRIDE_L_H=s * lr, STRIDE_L_SPLIT=lr,
        STRIDE_ML_B=qlen * n * s, STRIDE_ML_S=n * s, STRIDE_ML_H=s, STRIDE_ML_SPLIT=1,
        STRIDE_O_B=o3[0], STRIDE_O_S=o3[1], STRIDE_O_H=o3[2], STRIDE_FL_B=fl[0],
        STRIDE_FL_S=fl[1], STRIDE_FL_H=fl[2], NUM_KV_SPLITS=s, HEAD_DIM_CKV=lr,
        HAS_FINAL_LSE=return_lse, BLOCK_S=cfg.block_s, BLOCK_N=cfg.block_n)
