"""The Triton backend's decode call: the split kernel, then the reduce, as the plan says.

Nothing here decides anything: the tile, the kernel (Triton or the Gluon sm_90 one), the split
schedule and the reduce come from the :class:`~jax_mla.backends.triton.plan.TritonPlan` and the
schedule arrays carried in the metadata.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_mla.backends.triton.ffi_launch import SequenceStep
from jax_mla.backends.triton.launch import triton_call, triton_sequence
from jax_mla.backends.triton.plan import (
    LOG2E,
    KernelConfig,
    ReduceConfig,
    TritonPlan,
    next_pow2,
)
from jax_mla.backends.triton.schedule import SplitSchedule
from jax_mla.cache import is_fp8


def _kernels():
    # Kernel sources import triton: loaded when a call is traced, never at jax_mla's import.
    from jax_mla.kernels.triton import decode

    return decode


def _sm90_kernel(fp8: bool):
    if fp8:
        from jax_mla.kernels.gluon import decode_sm90_fp8

        return decode_sm90_fp8.mla_decode_sm90_fp8_kernel
    from jax_mla.kernels.gluon import decode_sm90

    return decode_sm90.mla_decode_sm90_kernel


def fp8_f16_mma(plan: TritonPlan, q_dtype, kv_dtype) -> bool:
    """Whether the Triton kernel runs an fp8 cache's products in float16 (``F16_MMA``): a bf16
    query (an fp8 one is dequantised to bf16 first) against an fp8 cache, on CUDA and in the
    interpreter, where ``TritonTuning.fp8_f16`` asks for it. Not on ROCm (unmeasured there)."""
    q_bf16 = is_fp8(q_dtype) or jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16)
    return (bool(plan.tuning is not None and plan.tuning.fp8_f16) and is_fp8(kv_dtype) and q_bf16
            and (plan.interpret or plan.problem.target.platform == "cuda"))


def fp8_scores(plan: TritonPlan, q_dtype, kv_dtype) -> bool:
    """Whether an fp8 query meets an fp8 cache in fp8 products (``FP8_QK``): on CUDA and in the
    interpreter, unless ``TritonTuning.fp8_qk`` is off. Otherwise the query is dequantised to
    bf16 first. Not on ROCm (unmeasured there)."""
    return (bool(plan.tuning is not None and plan.tuning.fp8_qk) and is_fp8(q_dtype)
            and is_fp8(kv_dtype) and (plan.interpret or plan.problem.target.platform == "cuda"))


def fp8_convert_once(plan: TritonPlan, kv_dtype) -> bool:
    """Whether the Triton kernel converts an fp8 cache's tile once, where it was loaded
    (``CVT_ONCE``): on CUDA (inline PTX; not the interpreter, not ROCm), unless
    ``TritonTuning.fp8_convert_once`` is off."""
    return (bool(plan.tuning is None or plan.tuning.fp8_convert_once) and is_fp8(kv_dtype)
            and not plan.interpret and plan.problem.target.platform == "cuda")


def split_query_e4m3(q):
    """A 16-bit query ``[T, H, D]`` as two e4m3 parts and a power-of-two scale a row, for the
    Gluon fp8 kernel's ``SPLIT_Q``: ``q = s * (hi + lo)``, ``s`` putting the row's largest
    magnitude in ``[64, 128)``. ``hi`` is a value rounded to 4 significant bits (values under
    e4m3's normal range, ``2^-6``, go whole to ``lo``), ``lo`` the rest rounded to e4m3. A bf16
    row comes back exact wherever ``|q| >= 2^-8 max |q|``; smaller elements are off by at most
    ``2^-16 max |q|``. A float16 value keeps its top 8 significant bits (off by at most
    ``2^-8 max |q|``, bf16's precision). A row holding an infinity or a NaN gets the scale NaN
    (its scores go NaN, as the products would).

    ``hi`` comes from ``lax.reduce_precision``, not from a round trip through float8: XLA's GPU
    pipeline may fold ``convert(convert(y, f8), f32)`` back to ``y`` (excess precision
    allowed), which would leave ``lo`` all zeros.

    Returns ``(parts [T, H, 2 D] float8_e4m3fn, hi then lo, scales [T * H] float32)``;
    jittable."""
    x = q.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    # The biased exponent e of the row's max: s = 2^(e - 133), 1 / s = 2^(133 - e), both normal
    # for e >= 8 (smaller rows, zero ones included, take e = 8).
    e = jnp.maximum((jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF, 8)
    inv = jax.lax.bitcast_convert_type((260 - e) << 23, jnp.float32)
    bad = ~jnp.all(jnp.isfinite(x), axis=-1)  # (a max over a NaN need not be NaN)
    s = jnp.where(bad, jnp.nan, jax.lax.bitcast_convert_type((e - 6) << 23, jnp.float32))
    y = (x * inv[..., None])[..., None, :]  # [T, H, 1, D]
    # e4m3's normal numbers (4 exponent bits, 3 mantissa bits; |y| < 128, so nothing reaches
    # the format's top, where an IEEE-style 4-bit exponent would overflow); subnormals flush.
    hi = jax.lax.reduce_precision(y, exponent_bits=4, mantissa_bits=3)
    # Both parts from one elementwise pass over [T, H, 2, D] (hi, then lo), a free reshape to
    # [T, H, 2 D]: no concatenation (on an H100 XLA's concatenation of the two parts wrote
    # 18.9 MB at about 1.3 TB/s, 28.9 µs at B128 H128).
    which = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 2, 1), 2)
    parts = jnp.where(which == 0, hi, y - hi).astype(jnp.float8_e4m3fn)
    t, h, d = q.shape
    return parts.reshape(t, h, 2 * d), s.reshape(-1)


def split_query_kernel(q, lead, *, target, launcher):
    """:func:`split_query_e4m3` in one Triton kernel (``kernels/triton/split_query.py``), the
    same parts bit for bit wherever a row is finite, with the rows' scales written after
    ``lead`` (the kernel's leading scales, ``[kv_scale]``): ``(parts [T, H, 2 D] float8_e4m3fn,
    scales [len(lead) + T * H] float32)``."""
    from jax_mla.kernels.triton import split_query

    t, h, d = q.shape
    rows, n_lead = t * h, lead.shape[0]
    if n_lead not in (1, 2):
        raise ValueError(f"split_query_kernel: {n_lead} leading scales (1 or 2)")
    grid, cfg = split_query.launch_config(rows, d)
    parts, scales = triton_call(
        split_query.mla_split_query_e4m3_kernel, q.reshape(rows, d),
        lead.astype(jnp.float32), grid=grid,
        out_shapes=[jax.ShapeDtypeStruct((rows, 2 * d), jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((n_lead + rows,), jnp.float32)],
        target=target, launcher=launcher, num_warps=4, num_stages=1, N_LEAD=n_lead, **cfg)
    return parts.reshape(t, h, 2 * d), scales


def decode(q, kv_cache, md, *, plan: TritonPlan, scale: float, q_scale, kv_scale):
    """``q [T, H, D]`` -> ``(out [T, H, L] in q's dtype (bf16 for fp8 q), lse [T, H] float32)``."""
    cfg = plan.kernel
    p = plan.problem
    t_rows, h, d = q.shape
    lr, rd = p.kv_lora_rank, p.rope_dim
    target, launcher = p.target, plan.launcher
    fp8_qk = fp8_scores(plan, q.dtype, kv_cache.dtype)
    out_dt = jnp.bfloat16 if is_fp8(q.dtype) else q.dtype
    if is_fp8(q.dtype) and not fp8_qk:  # dequantise once here; the kernel multiplies in bf16
        q = (q.astype(jnp.float32) * jnp.asarray(q_scale, jnp.float32)).astype(jnp.bfloat16)
    sched: SplitSchedule = md.schedule
    kv = kv_cache.reshape(-1, d)
    has_scale = kv_scale is not None
    # [kv_scale] (a view, no kernel); [kv_scale, q_scale] for an fp8 query multiplied as is (one
    # tiny XLA kernel where a scale is traced, in place of the query's dequantisation).
    scales = jnp.asarray(1.0 if kv_scale is None else kv_scale, jnp.float32).reshape(1)
    if fp8_qk and q_scale is not None:
        scales = jnp.concatenate([scales, jnp.asarray(q_scale, jnp.float32).reshape(1)])
    f16_mma = fp8_f16_mma(plan, q.dtype, kv_cache.dtype) and not fp8_qk
    # The interpreter's 16-bit dots: float16 and fp8 are exact there, bf16 is not (upcast to
    # float32).
    upcast = plan.interpret and not (f16_mma or fp8_qk)
    prow = sched.max_works * md.qlen
    shape = dict(num_heads=h, qlen=md.qlen, page_size=md.page_size, max_pages=md.max_pages,
                 kv_lora_rank=lr, rope_dim=rd, scale=scale, num_pages=kv_cache.shape[0])
    if cfg.sm90:
        # The plan takes the Gluon kernel for an fp8 query only with fp8 scores (``sm90_fp8``),
        # and for a 16-bit query against an fp8 cache only split in two e4m3 parts here
        # (``sm90_split_q``, :func:`split_query_e4m3`).
        fp8_cache = is_fp8(kv_cache.dtype)
        kernel = _sm90_kernel(fp8_cache)
        consts = sm90_constexprs(cfg, **shape)
        if fp8_cache:
            split = not is_fp8(q.dtype)
            if split:  # the parts in place of the query, the rows' scales after kv_scale
                if plan.tuning is not None and plan.tuning.split_q_kernel:
                    q, scales = split_query_kernel(q, scales, target=target, launcher=launcher)
                else:
                    q, row_scales = split_query_e4m3(q)
                    scales = jnp.concatenate([scales, row_scales])
            consts |= dict(HAS_KV_SCALE=has_scale, HAS_Q_SCALE=fp8_qk and q_scale is not None,
                           SPLIT_Q=split, SPLIT_ACC=split and plan.tuning is not None
                           and plan.tuning.split_acc)
    else:
        kernel = _kernels().mla_decode_kernel
        consts = decode_constexprs(cfg, **shape, has_kv_scale=has_scale, upcast=upcast,
                                   ieee=(not upcast) and jnp.dtype(q.dtype) == jnp.float32,
                                   f16_mma=f16_mma, fp8_qk=fp8_qk,
                                   has_q_scale=fp8_qk and q_scale is not None,
                                   cvt_once=fp8_convert_once(plan, kv_cache.dtype))
    f32 = jnp.float32
    arrays = (q, kv, md.block_table, md.paged_kv_indptr, sched.work_indptr, sched.work_info_set,
              scales)
    out_shapes = [jax.ShapeDtypeStruct((t_rows, h, lr), out_dt),
                  jax.ShapeDtypeStruct((t_rows, h), f32),
                  jax.ShapeDtypeStruct((prow, h, lr), f32),
                  jax.ShapeDtypeStruct((prow, h), f32)]
    grid = (sched.num_programs * cfg.num_head_blocks,)
    if plan.tuning is None or plan.tuning.one_call:
        # The decode kernel and its reduce, one custom call: the reduce reads the partials
        # (results 2, 3) and rewrites out / lse (results 0, 1) in place.
        r_kernel, r_arrays, r_grid, r_consts = reduce_launch(sched, out_shapes[0],
                                                             out_shapes[2], config=plan.reduce)
        n = len(arrays) + len(r_arrays)
        steps = [SequenceStep(kernel, tuple(range(len(arrays))), (0, 1, 2, 3), grid,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              constexprs=consts),
                 SequenceStep(r_kernel, (n + 2, n + 3, *range(len(arrays), n), n, n + 1),
                              (0, 1), r_grid, num_warps=4, num_stages=1, constexprs=r_consts)]
        out, lse, _, _ = triton_sequence(steps, arrays + r_arrays, out_shapes=out_shapes,
                                         target=target, launcher=launcher)
        return out, lse
    out, lse, part_out, part_lse = triton_call(
        kernel, *arrays, grid=grid, out_shapes=out_shapes, target=target, launcher=launcher,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts)
    return reduce_partials(part_out, part_lse, sched, out, lse, config=plan.reduce,
                           target=target, launcher=launcher)


UNKNOWN_PAGES = 2**31 - 1  # NUM_PAGES when the cache is not known (compile reports)


def _problem_constexprs(cfg: KernelConfig, *, num_heads, qlen, page_size, max_pages,
                        kv_lora_rank, rope_dim, scale, num_pages=None) -> dict:
    """The compile-time arguments both decode kernels take (the same launch contract).
    ``num_pages``: the cache's pages, into which the kernels clamp every page index (None:
    :data:`UNKNOWN_PAGES`, which only clamps negative ones)."""
    return dict(
        QK_SCALE=float(scale * LOG2E), H=num_heads, MAX_PAGES=max_pages, Q=qlen,
        HB=cfg.heads_per_block, NUM_HB=cfg.num_head_blocks, L=kv_lora_rank, R=rope_dim,
        PAGE_SIZE=page_size, L2_HINTS=cfg.l2_hints,
        NUM_PAGES=UNKNOWN_PAGES if num_pages is None else int(num_pages))


def decode_constexprs(cfg: KernelConfig, *, num_heads, qlen, page_size, max_pages, kv_lora_rank,
                      rope_dim, scale, has_kv_scale=False, upcast=False, ieee=False,
                      num_pages=None, f16_mma=False, fp8_qk=False, has_q_scale=False,
                      cvt_once=False) -> dict:
    """The Triton decode kernel's compile-time arguments for tile ``cfg`` and one problem."""
    return _problem_constexprs(
        cfg, num_heads=num_heads, qlen=qlen, page_size=page_size, max_pages=max_pages,
        kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, scale=scale, num_pages=num_pages) | dict(
        BLOCK_M=cfg.block_m, BLOCK_L=next_pow2(kv_lora_rank), BLOCK_R=next_pow2(rope_dim),
        BLOCK_N=cfg.block_n, TILE_IN_PAGE=page_size % cfg.block_n == 0,
        HAS_KV_SCALE=has_kv_scale, UPCAST=upcast, IEEE=ieee, WG_SPLIT=cfg.wg_split,
        PDL=cfg.pdl, F16_MMA=f16_mma, FP8_QK=fp8_qk, HAS_Q_SCALE=has_q_scale,
        CVT_ONCE=cvt_once)


def sm90_constexprs(cfg: KernelConfig, *, num_heads, qlen, page_size, max_pages, kv_lora_rank,
                    rope_dim, scale, num_pages=None) -> dict:
    """The Gluon sm_90 kernel's compile-time arguments (its tiles are 64 tokens)."""
    return _problem_constexprs(
        cfg, num_heads=num_heads, qlen=qlen, page_size=page_size, max_pages=max_pages,
        kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, scale=scale, num_pages=num_pages) | dict(
        TILE_IN_PAGE=page_size % 64 == 0)


def reduce_launch(sched, out, part_out, *, config: ReduceConfig):
    """``(kernel, arrays, grid, constexprs)`` of the reduce that merges split partials (shaped
    like ``part_out``) into ``out`` (a shape or an array): its parameters are ``part_out,
    part_lse, *arrays, out, lse`` and then ``out, lse`` again as its outputs (rewritten in
    place). ``sched`` as in :func:`reduce_partials`."""
    t_rows, h, lr = out.shape
    block_h = min(16, next_pow2(h))
    h_blocks = math.ceil(h / block_h)
    consts = dict(H=h, L=lr, BLOCK_H=block_h, OFF64=math.prod(part_out.shape) >= 2**31,
                  L2_HINTS=config.l2_hints, BLOCK_S=config.block_s, BLOCK_L=config.block_l,
                  PDL=config.pdl)
    grid_l = math.ceil(lr / config.block_l)
    if isinstance(sched, SplitSchedule) and config.affine:
        # One program per split request (a program with nothing to merge still costs a launch),
        # each finding its consecutive partials with one load.
        tiles = sched.reduce_tiles
        return (_kernels().mla_reduce_affine_kernel, (tiles, sched.reduce_tile_ptr),
                (tiles.shape[0], h_blocks, grid_l), dict(Q=sched.qlen, **consts))
    # Any partial map: a program for every listed tile (every request when none are listed).
    tiles = getattr(sched, "reduce_tiles", None)
    if tiles is None:
        tiles = jnp.arange(sched.reduce_final_map.shape[0], dtype=jnp.int32)
    return (_kernels().mla_reduce_kernel,
            (sched.reduce_indptr, sched.reduce_final_map, sched.reduce_partial_map, tiles),
            (tiles.shape[0], h_blocks, grid_l), dict(MAX_ROWS=sched.qlen, **consts))


def reduce_partials(part_out, part_lse, sched, out, lse, *, config: ReduceConfig, target,
                    launcher=None):
    """Merge split partials into ``out``/``lse`` in place (requests with < 2 partials untouched).

    ``sched``: this package's :class:`SplitSchedule` (with ``config.affine``, the two-load
    kernel over each split request's consecutive partials), or any plan in AITER's layout
    (``reduce_indptr``, ``reduce_final_map``, ``reduce_partial_map``; the general kernel).
    """
    kernel, arrays, grid, consts = reduce_launch(sched, out, part_out, config=config)
    k = 2 + len(arrays)
    return triton_call(
        kernel, part_out, part_lse, *arrays, out, lse, grid=grid,
        out_shapes=[jax.ShapeDtypeStruct(out.shape, out.dtype),
                    jax.ShapeDtypeStruct(lse.shape, lse.dtype)],
        input_output_aliases={k: 0, k + 1: 1}, target=target, launcher=launcher, num_warps=4,
        num_stages=1, **consts)
