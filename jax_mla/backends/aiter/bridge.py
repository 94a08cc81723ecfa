"""XLA custom calls into AITER's Python API (``triton_kernels.py`` launches AITER's segmented
Triton kernel without it; this module is that route's fallback).

Each kernel family is a ``jax.experimental.buffer_callback`` (custom call
``xla_buffer_python_gpu_callback`` on ROCm/CUDA, its CPU twin on CPU) whose Python body wraps
XLA's buffers with ``torch.from_dlpack`` and calls AITER exactly as vLLM's ROCm AITER MLA
backend does. The traps of ``buffer_callback`` with torch, and how they are handled:

- **Stream.** ``Buffer.__dlpack__`` ignores its ``stream`` argument, so the torch work runs under
  ``torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream))``: AITER launches on XLA's stream.
  On CPU ``ctx.stream`` raises and no stream context is used (CPU CI runs this same code).
- **Inputs are read-only.** Input buffers are only read (views, never ``copy_``/``zero_`` into
  them); outputs are XLA's buffers, written in place.
- **AITER's own allocations** (the returned LSE, flash-attention's output, segment partials,
  and the storage AITER swaps into ``o`` with ``set_`` when it folds a multi-token block) are
  copied into XLA's output buffers before the callback returns.
- **Memory.** torch allocates beside XLA's preallocated pool: set
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (e.g. 0.5) or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.
- Not command-buffer compatible: AITER allocates per call (the PS prefill's plan no longer
  comes from AITER's host planner: it is computed on the device, ``ps_planner``). Each call
  costs a Python round trip on the host (``python -m jax_mla.bench.aiter`` measures it with the
  stand-in on a CUDA GPU).

Head padding and unpadding happen in jnp around each call with vLLM's maps
(``jax_mla.heads``); the callbacks see exactly the tensors vLLM hands AITER.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import os

import jax
import jax.numpy as jnp
from jax.experimental import buffer_callback

from jax_mla import heads as _heads
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter.planner import fold_rows, unfold_rows
from jax_mla.backends.base import out_dtype
from jax_mla.cache import is_fp8
from jax_mla.merge import sanitize_lse

FP8_PREFILL_TILE_Q = caps.FP8_PREFILL_TILE_Q
AITER_DISTRIBUTION = "amd-aiter"  # the name AITER's setup.py installs it under


def aiter_importable() -> bool:
    """Whether ``import aiter`` would find a package (nothing is imported)."""
    try:
        return importlib.util.find_spec("aiter") is not None
    except (ImportError, ValueError):
        return False


def _aiter():
    # Imported at trace/run time, never at jax_mla import: the package must load without aiter.
    return importlib.import_module("aiter")


def _torch():
    import torch

    return torch


def _stream_ctx(ctx, like):
    """Make torch launch on XLA's stream; no-op on CPU (where ``ctx.stream`` raises)."""
    try:
        stream = ctx.stream
    except Exception:  # CPU: "XLA FFI GPU context is not available"
        return contextlib.nullcontext()
    torch = _torch()
    if not stream or like.device.type != "cuda":
        return contextlib.nullcontext()
    # ROCm builds of torch expose HIP through the torch.cuda namespace.
    return torch.cuda.stream(torch.cuda.ExternalStream(int(stream), device=like.device))


def _t(buf):
    return _torch().from_dlpack(buf)


def _scalar(x, default=1.0):
    """A float32 scalar array (vLLM passes layer scales as 0-d tensors, default 1.0)."""
    return jnp.asarray(default if x is None else x, jnp.float32).reshape(())


def _call(callback, out_shapes, *args):
    outs = buffer_callback.buffer_callback(callback, tuple(out_shapes))(*args)
    return tuple(outs)


def installed_version() -> str | None:
    """The installed AITER's version (its ``amd-aiter`` distribution's metadata, e.g.
    ``0.1.21.post1``; nothing imported), or None where there is none (no AITER, or a source
    tree on ``sys.path``, such as the test stand-in)."""
    try:
        return importlib.metadata.version(AITER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_build() -> caps.AiterBuild:
    """What the installed AITER provides (vLLM's probes; imports aiter) and its version."""
    aiter = _aiter()

    def importable(mod, *names):
        try:
            m = importlib.import_module(mod)
            return all(hasattr(m, n) for n in names)
        except Exception:
            return False

    def source_has(rel, needle):
        # vLLM reads AITER's JIT sources, whitespace-stripped.
        root = os.path.dirname(os.path.abspath(aiter.__file__))
        for base in (os.path.join(root, ".."), os.path.join(root, "aiter_meta")):
            path = os.path.join(base, rel)
            if os.path.exists(path):
                with open(path) as f:
                    return needle in "".join(f.read().split())
        return False

    return caps.AiterBuild(
        native_h24_reducer=source_has("csrc/kernels/mla/reduce.cu",
                                      "MLA_REDUCE_CASE_EF(NUM_HEAD,24,HEAD_DIM,512,"),
        native_h24_metadata=source_has("csrc/kernels/mla/metadata/v1_2_device.cuh",
                                       "num_heads==24"),
        gluon_kernel=importable("aiter.ops.triton.gluon.mla_gluon", "mla_gluon")
        or importable("aiter.ops.triton.gluon.mla_decode_gluon", "mla_decode_gluon"),
        segmented_kernel=importable("aiter.ops.triton.attention.mla", "mla_decode_fwd"),
        fp8_prefill_kernels=importable("aiter", "mla_prefill_ps_asm_fwd", "mla_reduce_v1"),
        version=installed_version(),
    )


def installed_build() -> caps.AiterBuild:
    """:func:`probe_build` of the ``aiter`` importable now, probed once per installation."""
    return _probe_cached(importlib.util.find_spec("aiter").origin)


@functools.cache
def _probe_cached(origin: str) -> caps.AiterBuild:
    return probe_build()


def _get_mla_gluon():
    try:
        from aiter.ops.triton.gluon.mla_gluon import mla_gluon
    except ImportError:
        try:
            from aiter.ops.triton.gluon.mla_decode_gluon import mla_decode_gluon as mla_gluon
        except ImportError as e:
            raise RuntimeError(
                "ROCM_AITER_MLA small-head decode requires an AITER build with the small-head "
                "Gluon MLA kernel"
            ) from e
    return mla_gluon


# ---------------------------------------------------------------------------------------------
# asm decode: aiter.mla.mla_decode_fwd (persistent and not, with LSE for DCP)


def asm_decode(q, kv_cache, md, route, schedule, *, scale: float, q_scale=None,
               kv_scale=None):
    """vLLM's ``forward_mqa`` asm path.

    Args:
      q: ``[T, n_dec, D]`` bf16 or fp8 query (unpadded; padded here with vLLM's maps).
      kv_cache: ``[num_pages, page_size, D]`` (viewed as ``[-1, 1, 1, D]``: page size 1).
      md: :class:`jax_mla.DecodeMetadata`; route: its plan's route; schedule: its arrays.
    Returns:
      ``(out [T, n_dec, L], lse [T, n_dec] float32 | None)``; out in the attention dtype.
    """
    n, hp, qlen = route.num_heads, route.kernel_heads, route.qlen
    lr = q.shape[-1] - 64
    qp = _heads.pad_heads(q, n, hp)
    plan = schedule.plan if route.persistent else None
    idx = (md.qo_indptr, md.paged_kv_indptr, md.paged_kv_indices, md.paged_kv_last_page_len)
    ratio = 1
    if plan is not None and route.force_fold:
        # A fold AITER would not make itself (its native kernel for this count is known bad,
        # known_bad.py): hand it the 16-head pseudo-batches, which it serves natively.
        ratio = plan.fold_ratio
        qp = fold_rows(qp, qlen, ratio)
        idx = _fold_indptrs(md, ratio)
    rows, heads = qp.shape[:2]
    out_dt = out_dtype(q.dtype)
    shapes = [jax.ShapeDtypeStruct((rows, heads, lr), out_dt)]
    if route.return_lse:
        shapes.append(jax.ShapeDtypeStruct((rows, heads), jnp.float32))
    args = [qp, kv_cache, *idx, _scalar(q_scale), _scalar(kv_scale)]
    if plan is not None:
        args += [plan.work_indptr, plan.work_info_set, plan.reduce_indptr,
                 plan.reduce_final_map, plan.reduce_partial_map]

    def callback(ctx, outs, qb, kvb, qo, kvp, kvi, last, qs, ks, *planb):
        torch = _torch()
        o_x = _t(outs[0])
        with _stream_ctx(ctx, o_x):
            qt, kv = _t(qb), _t(kvb)
            kwargs = dict(q_scale=_t(qs), kv_scale=_t(ks))
            if planb:
                wi, wis, ri, rf, rp = (_t(b) for b in planb)
                # The asm kernel reads work_indptr/work_info_set through this 2-pointer table;
                # without it AITER's host code would hipMalloc one per call.
                meta = torch.tensor([wi.data_ptr(), wis.data_ptr()], dtype=torch.uint64,
                                    device=wi.device)
                kwargs.update(work_meta_data=meta, work_indptr=wi, work_info_set=wis,
                              reduce_indptr=ri, reduce_final_map=rf, reduce_partial_map=rp)
            if route.zero_fill:
                # MTP verify without a persistent plan: unwritten lanes must not leak.
                o_x.zero_()
            # A separate tensor object: AITER may `set_` new storage into the one it is given.
            o_arg = o_x.view(o_x.shape)
            _, lse = _aiter().mla.mla_decode_fwd(
                qt, kv.view(-1, 1, 1, kv.shape[-1]), o_arg, _t(qo), _t(kvp), _t(kvi), _t(last),
                qlen, sm_scale=scale, return_lse=route.return_lse, **kwargs)
            if o_arg.data_ptr() != o_x.data_ptr():
                o_x.copy_(o_arg.reshape(o_x.shape))
            if route.return_lse:
                if lse is None:
                    raise RuntimeError(
                        "aiter mla_decode_fwd(return_lse=True) returned no LSE; upgrade aiter "
                        "to a build with decode LSE support."
                    )
                _t(outs[1]).copy_(lse.reshape(rows, heads))

    res = _call(callback, shapes, *args)
    out = _heads.unpad_heads(unfold_rows(res[0], qlen, ratio), n, hp)
    lse = (_heads.unpad_heads(unfold_rows(res[1], qlen, ratio), n, hp) if route.return_lse
           else None)
    return out, lse


def _fold_indptrs(md, ratio: int):
    """``(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)`` over the
    ``B * ratio`` pseudo-batches of a fold, as AITER's own fold states them: each request's
    query rows once per pseudo-batch, and each pseudo-batch's KV starting where its request's
    does (the plan's works carry the KV ranges)."""
    i32 = jnp.int32
    qo = jnp.concatenate([jnp.zeros((1,), i32),
                          jnp.cumsum(jnp.repeat(jnp.diff(md.qo_indptr), ratio)).astype(i32)])
    kvp = jnp.concatenate([jnp.repeat(md.paged_kv_indptr[:-1], ratio), md.paged_kv_indptr[-1:]])
    last = jnp.repeat(md.paged_kv_last_page_len, ratio)
    return qo, kvp.astype(i32), md.paged_kv_indices, last


# ---------------------------------------------------------------------------------------------
# Gluon small-head decode (3-D) and verify (4-D MTP entry)


def _gluon_min_kv(num_heads: int, minkv) -> int:
    """``mla_gluon``'s ``min_kv_seq_len``: AITER reads it only in its 64/128-head regime (an
    assert on the shortest request), so the other head counts pass its default, 1, and the call
    never waits for the device. The 64/128-head case reads it from the device (a host sync);
    the routes never send those head counts to Gluon."""
    if num_heads in (64, 128):
        return int(_t(minkv).item())
    return 1


def gluon_decode(q, kv_cache, md, route, schedule, *, scale: float, kv_scale=None):
    """vLLM's Gluon routes: ``n_dec < 16``, bf16 KV, no head padding.

    ``q [T, n, D]`` bf16; verify (``qlen > 1``) hands Gluon 4-D views ``[B, qlen, n, .]``.
    Returns ``(out [T, n, L], lse [T, n] | None)``.
    """
    n, qlen = route.num_heads, route.qlen
    t, _, d = q.shape
    lr = d - 64
    out_dt = out_dtype(q.dtype)
    shapes = [jax.ShapeDtypeStruct((t, n, lr), out_dt)]
    if route.return_lse:
        shapes.append(jax.ShapeDtypeStruct((t, n), jnp.float32))
    verify = route.kind == "gluon_verify"
    if verify and t % qlen:
        raise ValueError(f"verify block {t} rows is not a multiple of qlen {qlen}")

    def callback(ctx, outs, qb, kvb, kvi, kvp, minkv):
        o_x = _t(outs[0])
        with _stream_ctx(ctx, o_x):
            qt, kv = _t(qb), _t(kvb)
            q_nope, q_pe = qt.split([lr, d - lr], dim=-1)
            o_arg = o_x
            if verify:
                reqs = t // qlen
                q_nope, q_pe = q_nope.unflatten(0, (reqs, qlen)), q_pe.unflatten(0, (reqs, qlen))
                o_arg = o_x.unflatten(0, (reqs, qlen))
            extra = {"return_lse": True} if route.return_lse else {}
            res = _get_mla_gluon()(
                q_nope=q_nope, q_pe=q_pe, kv_c=kv.reshape(-1, d), o=o_arg, page_table=_t(kvi),
                seq_info=_t(kvp), sm_scale=scale, k_pe=None, kv_pe_offset=lr, use_2d_view=False,
                kv_scale=1.0, min_kv_seq_len=_gluon_min_kv(n, minkv), **extra)
            o_ret, lse = res if isinstance(res, tuple) else (res, None)
            if o_ret is not None and o_ret.data_ptr() != o_x.data_ptr():
                o_x.copy_(o_ret.reshape(o_x.shape))
            if route.return_lse:
                if lse is None:
                    raise RuntimeError("mla_gluon(return_lse=True) returned no LSE")
                _t(outs[1]).copy_(lse.reshape(t, n))

    res = _call(callback, shapes, q, kv_cache, md.paged_kv_indices, md.paged_kv_indptr,
                schedule.min_kv_seq_len)
    return res[0], (res[1] if route.return_lse else None)


# ---------------------------------------------------------------------------------------------
# Segmented DCP verify + the base-2 segment merge


def _merge_segments_torch(segm_output, segm_max, segm_expsum, seq_lens, tile_size):
    """``merge_mla_segments`` (``segments.py``) in torch, inside the callback."""
    torch = _torch()
    s = segm_max.shape[-1]
    n = seq_lens.to(torch.int64)
    span = s * tile_size
    tps = torch.clamp((n + span - 1) // span, min=1)
    per = tps * tile_size
    act = torch.where(n > 0, (n + per - 1) // per, torch.zeros_like(n))
    on = torch.arange(s, device=n.device)[None, None, :] < act[:, None, None]
    m = torch.where(on, segm_max.float(), torch.full_like(segm_max, -float("inf")))
    big_m = m.amax(dim=-1, keepdim=True)
    big_m = torch.where(torch.isneginf(big_m), torch.zeros_like(big_m), big_m)
    w = torch.where(on, torch.exp2(m - big_m), torch.zeros_like(m))
    z = (torch.where(on, segm_expsum, torch.zeros_like(segm_expsum)) * w).sum(-1)
    acc = torch.where(on[..., None], segm_output * w[..., None],
                      torch.zeros((), device=n.device)).sum(-2)
    empty = z == 0
    safe = torch.where(empty, torch.ones_like(z), z)
    out = torch.where(empty[..., None], torch.zeros_like(acc), acc / safe[..., None])
    lse = torch.where(empty, torch.full_like(z, -float("inf")),
                      (big_m[..., 0] + torch.log2(safe)) * 0.6931471805599453)
    return out, lse


def segmented_dcp_verify(q, kv_cache, route, schedule, *, scale: float, q_scale=None,
                         kv_scale=None):
    """vLLM's segmented DCP verify: this rank's shard of every verify row, natural-log LSE.

    ``q [rows, n, D]`` (fp8 is dequantised to bf16 first, as vLLM); returns
    ``(out [rows, n, L], lse [rows, n])`` -- partial over this rank's KV, merged across ranks
    by the DCP combine.
    """
    view = schedule.dcp_verify
    n = route.num_heads
    rows, _, d = q.shape
    lr = d - 64
    out_dt = out_dtype(q.dtype)
    if is_fp8(kv_cache.dtype) and q.dtype != jnp.bfloat16:
        # q.to(bf16) * q_scale, rounded to bf16 like torch's bf16 * fp32-scalar.
        q = (q.astype(jnp.bfloat16).astype(jnp.float32) * _scalar(q_scale)).astype(jnp.bfloat16)
    shapes = [jax.ShapeDtypeStruct((rows, n, lr), out_dt),
              jax.ShapeDtypeStruct((rows, n), jnp.float32)]

    def callback(ctx, outs, qb, kvb, qo, row_lens, table, ks):
        o_x = _t(outs[0])
        with _stream_ctx(ctx, o_x):
            from aiter.ops.triton.attention.mla import mla_decode_fwd as segmented

            kv, lens = _t(kvb), _t(row_lens)
            parts = segmented(
                _t(qb), kv.view(-1, view.page_size, 1, kv.shape[-1]), None, _t(qo), lens,
                view.max_kv_seq_len, _t(table), scale, lr, d - lr, causal=True, q_descale=None,
                kv_descale=_t(ks), skip_reduce=True)
            if not (isinstance(parts, tuple) and len(parts) == 3):
                raise RuntimeError(
                    "AITER segmented MLA verify must return segment partials when "
                    "skip_reduce=True."
                )
            out, lse = _merge_segments_torch(*parts, lens, view.page_size)
            o_x.copy_(out)
            _t(outs[1]).copy_(lse)

    res = _call(callback, shapes, q, kv_cache, view.qo_indptr, view.row_lens, view.block_table,
                _scalar(kv_scale))
    return res[0], res[1]


# ---------------------------------------------------------------------------------------------
# The persistent plan from AITER itself (on-hardware differential check of our jnp planner)


def aiter_mla_metadata(md):
    """Run AITER's ``get_mla_metadata_info_v1`` + ``get_mla_metadata_v1`` for ``md``'s plan.

    Returns ``(work_indptr, work_info_set, reduce_indptr, reduce_final_map,
    reduce_partial_map)`` shaped like ``md.schedule.plan``'s arrays (AITER's unwritten entries
    are whatever its freshly allocated buffers held). vLLM's exact call; for checking
    :func:`jax_mla.backends.aiter.planner.plan_mla_decode` against the real planner.
    """
    route, plan = md.plan.route, md.schedule.plan
    if plan is None:
        raise ValueError("the schedule has no persistent plan to compare with")
    if route.force_fold:
        raise ValueError("the plan folds a head count AITER serves natively (a known-bad kernel "
                         "routed around): AITER's planner has no such mode to compare with")
    arrays = (plan.work_indptr, plan.work_info_set, plan.reduce_indptr, plan.reduce_final_map,
              plan.reduce_partial_map)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    dt = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}

    def callback(ctx, outs, qo, kvp, last):
        wi_x = _t(outs[0])
        with _stream_ctx(ctx, wi_x):
            torch = _torch()
            aiter = _aiter()
            qd = getattr(aiter.dtypes, dt[route.q_dtype])
            kd = getattr(aiter.dtypes, dt[route.kv_dtype])
            info = aiter.get_mla_metadata_info_v1(plan.num_batches, route.mtp_decode_qlen,
                                                  route.kernel_heads, qd, kd, is_sparse=False,
                                                  fast_mode=True)
            bufs = [torch.empty(s, dtype=d, device=wi_x.device) for s, d in info]
            outs_t = [_t(o) for o in outs]
            for b, o in zip(bufs[1:], outs_t):
                if tuple(b.shape) != tuple(o.shape):
                    raise RuntimeError(
                        f"AITER sizes a plan buffer {tuple(b.shape)}, jax_mla {tuple(o.shape)}")
                b.copy_(torch.full_like(o, -1))
            meta, w_indptr, w_info, r_indptr, r_final, r_partial = bufs
            aiter.get_mla_metadata_v1(
                _t(qo), _t(kvp), _t(last), route.kernel_heads, 1, True, meta, w_info, w_indptr,
                r_indptr, r_final, r_partial, page_size=1, kv_granularity=16,
                max_seqlen_qo=route.qlen, uni_seqlen_qo=route.qlen, fast_mode=True,
                dtype_q=qd, dtype_kv=kd)
            for o, b in zip(outs_t, (w_indptr, w_info, r_indptr, r_final, r_partial)):
                o.copy_(b)

    return _call(callback, shapes, md.qo_indptr, md.paged_kv_indptr, md.paged_kv_last_page_len)


# ---------------------------------------------------------------------------------------------
# Prefill: fp8 PS asm prefill + reduce, and flash_attn_varlen_func


def fp8_prefill(q, k, v, query_start_loc, *, max_query_len: int, scale: float, arch: str,
                q_scale=None, k_scale=None, v_scale=None, num_cu: int | None = None):
    """vLLM's ``_mla_fp8_prefill_attn``: fp8 PS asm prefill + ``mla_reduce_v1`` (gfx950).

    Args:
      q, k: ``[T, H, P + R]``; v: ``[T, H, V]`` -- new tokens only (no chunked context), after
        ``kv_b_proj`` (gqa 1); 16-bit, or already the arch's fp8.
      query_start_loc: ``[B + 1]`` int32 (KV indptr = query indptr: KV length == query length).
      max_query_len: static bound on a request's query length.
      q_scale, k_scale, v_scale: per-tensor float32 dequantisation multipliers of fp8 inputs
        (default 1.0).
      num_cu: CU count the PS plan is made for (AITER's host planner uses the device's; the
        kernel's grid is the plan's). Default: ``arch``'s flagship part.
    Returns ``out [T, H, V]`` in q's dtype (bf16 for fp8 q).

    Heads pad to ``ceil(H/16)*16`` with vLLM's maps (exact: padded head j duplicates a real
    one in q, k and v alike); 16-bit q, k, v are cast to the arch's fp8 with unit scales, as
    vLLM does. The PS plan is AITER's ``get_ps_metadata_v1`` computed on the device in jnp
    (``ps_planner.plan_ps_prefill``, bit-exact with AITER's host planner) and handed to the
    callback with ``kv_indices`` and the partial/LSE scratch as XLA buffers: no host sync and
    no allocation in the callback.
    """
    from jax_mla.backends.aiter import ps_planner

    t, h, dqk = q.shape
    dv = v.shape[-1]
    hp = caps.fp8_prefill_num_heads(h)
    f8 = caps.fp8_dtype(arch)
    qp, kp, vp = (_heads.pad_heads(x, h, hp).astype(f8) for x in (q, k, v))
    out_dt = out_dtype(q.dtype)
    tile = FP8_PREFILL_TILE_Q
    qsl = query_start_loc.astype(jnp.int32)
    plan = ps_planner.plan_ps_prefill(qsl, num_heads=hp, max_qlen=max_query_len,
                                      num_cu=num_cu, arch=arch, qlen_granularity=tile)
    rows = plan.scratch_rows  # static: enough for any plan of these sizes
    shapes = [jax.ShapeDtypeStruct((t, hp, dv), out_dt),
              jax.ShapeDtypeStruct((rows, hp, dv), jnp.float32),  # logits (partials)
              jax.ShapeDtypeStruct((rows, hp), jnp.float32),  # attn_lse (partials)
              jax.ShapeDtypeStruct((t, hp), jnp.float32)]  # final_lse (unused)

    def callback(ctx, outs, qb, kb, vb, qo, kvi, wp, wi, ri, rf, rp, qs, ks, vs):
        o_x = _t(outs[0])
        with _stream_ctx(ctx, o_x):
            aiter = _aiter()
            logits, attn_lse, final_lse = (_t(o) for o in outs[1:])
            qo_t = _t(qo)
            aiter.mla_prefill_ps_asm_fwd(_t(qb), _t(kb), _t(vb), qo_t, qo_t, _t(kvi), _t(wp),
                                         _t(wi), max_query_len, scale, True, logits, attn_lse,
                                         o_x, _t(qs), _t(ks), _t(vs))
            # num_kv_splits=0: "auto" (the CU count), as vLLM passes after ROCm/aiter#3391.
            aiter.mla_reduce_v1(logits, attn_lse, _t(ri), _t(rf), _t(rp), tile, 0, o_x,
                                final_lse)

    out = _call(callback, shapes, qp, kp, vp, qsl, jnp.arange(t, dtype=jnp.int32),
                *plan.arrays(), _scalar(q_scale), _scalar(k_scale), _scalar(v_scale))[0]
    return _heads.unpad_heads(out, h, hp)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
                      max_seqlen_k: int, scale: float, causal: bool = True,
                      return_lse: bool = False):
    """``aiter.flash_attn_varlen_func`` (the common MLA prefill; qk 192 and v 128 differ).

    Args:
      q: ``[Tq, H, Dqk]``; k: ``[Tk, Hk, Dqk]``; v: ``[Tk, Hk, Dv]``; cu_seqlens: ``[B + 1]``.
    Returns ``(out [Tq, H, Dv] in q's dtype, lse)``: with ``return_lse`` ``lse [H, Tq]``
    float32, natural log, FlashAttention's layout (an empty row's ``+inf`` returned as
    ``-inf``), else None.
    """
    tq, h, _ = q.shape
    dv = v.shape[-1]
    shapes = [jax.ShapeDtypeStruct((tq, h, dv), q.dtype)]
    if return_lse:
        shapes.append(jax.ShapeDtypeStruct((h, tq), jnp.float32))

    def callback(ctx, outs, qb, kb, vb, cq, ck):
        o_x = _t(outs[0])
        with _stream_ctx(ctx, o_x):
            res = _aiter().flash_attn_varlen_func(
                q=_t(qb), k=_t(kb), v=_t(vb), softmax_scale=scale, return_lse=return_lse,
                cu_seqlens_q=_t(cq), cu_seqlens_k=_t(ck), max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, causal=causal)
            out, lse = (res[0], res[1]) if return_lse else (res, None)
            o_x.copy_(out)
            if return_lse:
                _t(outs[1]).copy_(lse)

    res = _call(callback, shapes, q, k, v, cu_seqlens_q.astype(jnp.int32),
                cu_seqlens_k.astype(jnp.int32))
    return res[0], (sanitize_lse(res[1]) if return_lse else None)


def noop_call(x):
    """A bridge round trip that does nothing but wrap the buffers (host-overhead measurement)."""

    def callback(ctx, outs, xb):
        o = _t(outs[0])
        with _stream_ctx(ctx, o):
            o.copy_(_t(xb))

    return _call(callback, [jax.ShapeDtypeStruct(x.shape, x.dtype)], x)[0]
