"""``aiter.mla.mla_decode_fwd`` stand-in: AITER's head folding, persistent/non-persistent split,
and the work list executed with exact math (so a plan that misses or double-counts KV shows)."""

from __future__ import annotations

import math
import os

import torch

from . import dtypes
from ._standin import (
    attend,
    dequant,
    expect,
    expect_int,
    expect_scale,
    fill_unwritten,
    get_gfx,
    ints,
    is_fp8,
    record,
    scalar,
)
from .ops.attention import get_mla_decode_fwd_max_splits, mla_reduce_v1

_PERSISTENT_MAX_BATCH_DEFAULT = 32


def _use_persistent_mla_decode(bs, nhead, max_seqlen_q, q_dtype, kv_dtype):
    """AITER silently drops the plan for gfx950 bf16 16-head qlen-1 decode at batch >= 32."""
    profile = (get_gfx() == "gfx950" and q_dtype == dtypes.bf16 and kv_dtype == dtypes.bf16
               and nhead == 16 and max_seqlen_q == 1)
    if not profile:
        return True
    max_batch = int(os.getenv("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH",
                              _PERSISTENT_MAX_BATCH_DEFAULT))
    return max_batch <= 0 or bs < max_batch


def _natively_supported(nhead, max_seqlen_q, q_dtype, kv_dtype):
    gfx, q8, kv8 = get_gfx(), q_dtype == dtypes.fp8, kv_dtype == dtypes.fp8
    bf = q_dtype == dtypes.bf16 and kv_dtype == dtypes.bf16
    return (nhead == 16 or (gfx == "gfx942" and nhead == 128 and q8 and kv8)
            or (gfx == "gfx950" and q8 and kv8 and nhead in (32, 64, 128))
            or (gfx == "gfx950" and nhead == 8 and q8 and kv8 and max_seqlen_q == 4)
            or (gfx == "gfx942" and nhead == 8 and bf and max_seqlen_q == 2)
            or (gfx == "gfx942" and nhead == 64 and q8 and kv8 and max_seqlen_q == 1)
            or (gfx == "gfx950" and bf))


def _visible(rows_local, qlen, kv_pos, kv_len, causal):
    """Right-aligned causal: row t of a qlen block over kv_len tokens sees [0, kv_len-qlen+t]."""
    if not causal:
        return torch.ones(len(rows_local), len(kv_pos), dtype=torch.bool,
                          device=kv_pos.device)
    return kv_pos[None, :] <= (kv_len - qlen + rows_local)[:, None]


def _check_decode_args(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                       max_seqlen_q, q_scale, kv_scale, work_meta_data, work_indptr,
                       work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map,
                       return_lse):
    """What AITER's host code checks (asm_mla.cu / aiter/mla.py), as RuntimeErrors."""
    dev = q.device
    qkv_dtypes = (dtypes.bf16, dtypes.fp8)  # the asm kernels: bf16 or the arch's fp8
    expect(q, "q", qkv_dtypes, ndim=3, contiguous=True)
    total_q, hq, d = q.shape
    expect(kv_buffer, "kv_buffer", qkv_dtypes, shape=(None, 1, 1, d), device=dev)
    expect(o, "o", dtypes.bf16, shape=(total_q, hq, 512), contiguous=True, device=dev)
    if d != 576:
        raise RuntimeError(f"MLA asm decode needs a 576-wide q/kv, got {d}")
    if hq % 8:
        raise RuntimeError(f"num_heads {hq} is not a multiple of 8")
    expect(qo_indptr, "qo_indptr", dtypes.i32, ndim=1, device=dev)
    b = qo_indptr.shape[0] - 1
    expect(kv_indptr, "kv_indptr", dtypes.i32, shape=(b + 1,), device=dev)
    expect(kv_indices, "kv_indices", dtypes.i32, ndim=1, device=dev)
    expect(kv_last_page_lens, "kv_last_page_lens", dtypes.i32, shape=(b,), device=dev)
    expect_int(max_seqlen_q, "max_seqlen_q")
    if is_fp8(q) and q_scale is None:
        raise RuntimeError("fp8 q needs q_scale")
    expect_scale(q_scale, "q_scale", dev)
    expect_scale(kv_scale, "kv_scale", dev)
    if work_meta_data is not None:
        expect(work_meta_data, "work_meta_data", dtypes.u64, shape=(2,), device=dev)
        expect(work_indptr, "work_indptr", dtypes.i32, ndim=1, device=dev)
        expect(work_info_set, "work_info_set", dtypes.i32, shape=(None, 8), device=dev)
        expect(reduce_indptr, "reduce_indptr", dtypes.i32, ndim=1, device=dev)
        expect(reduce_final_map, "reduce_final_map", dtypes.i32, shape=(None, 2), device=dev)
        expect(reduce_partial_map, "reduce_partial_map", dtypes.i32, ndim=1, device=dev)
        # Kernel availability the host dispatch would not find (docs/design.md §7.8, gfx942).
        if get_gfx() == "gfx942" and not is_fp8(q):
            if max_seqlen_q > 4:
                raise RuntimeError("cannot get heuristic kernel: gfx942 bf16 persistent qlen > 4")
            if return_lse:
                raise RuntimeError("cannot get heuristic kernel: gfx942 bf16 persistent lse")


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                   max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                   num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                   work_indptr=None, work_info_set=None, reduce_indptr=None,
                   reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                   intra_batch_mode=False, return_logits=False, return_lse=False,
                   g_kv_indptr=None, cp_world_size=1, cp_rank=0, causal=True):
    """Returns ``(logits, final_lse)``; ``final_lse [total_q, Hq]`` is allocated here."""
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    assert page_size == 1 and nhead_kv == 1 and cp_world_size == 1, "stand-in: vLLM's use only"
    _check_decode_args(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                       max_seqlen_q, q_scale, kv_scale, work_meta_data, work_indptr,
                       work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map,
                       return_lse)
    total_kv_d = kv_buffer.shape[-1]
    if sm_scale is None:
        sm_scale = 1.0 / total_kv_d ** 0.5
    ori_total_s, ori_nhead, v_dim = o.shape
    total_s, nhead = ori_total_s, ori_nhead
    bs = qo_indptr.shape[0] - 1
    requested = work_meta_data is not None
    persistent = requested
    if persistent and num_kv_splits is None:
        persistent = _use_persistent_mla_decode(bs, nhead, max_seqlen_q, q.dtype, kv_buffer.dtype)
    record("mla_decode_fwd", q_shape=tuple(q.shape), q_dtype=q.dtype, heads=ori_nhead,
           o_shape=tuple(o.shape), kv_buffer_shape=tuple(kv_buffer.shape),
           max_seqlen_q=max_seqlen_q, sm_scale=sm_scale, return_lse=return_lse,
           plan_passed=requested, persistent=persistent, q_scale=scalar(q_scale),
           kv_scale=scalar(kv_scale), o_zero_at_entry=bool((o == 0).all()),
           meta_ptrs_ok=(requested and ints(work_meta_data.view(torch.int64)) ==
                         [work_indptr.data_ptr(), work_info_set.data_ptr()]))
    if is_fp8(q):
        assert q_scale is not None, "fp8 q needs q_scale"
    qf = dequant(q, q_scale)
    kvf = dequant(kv_buffer.reshape(-1, total_kv_d), kv_scale)
    qo, kvp, kvi = ints(qo_indptr), ints(kv_indptr), ints(kv_indices)
    dev = q.device

    if not persistent:
        # Split-KV stage 1 + Triton stage 2, collapsed: exact attention per request. Rows that
        # see nothing are left unwritten (their lanes are what vLLM's zero-fill guards).
        final_lse = torch.empty((total_s, nhead), dtype=torch.float32, device=dev) \
            if return_lse else None
        if final_lse is not None:
            fill_unwritten(final_lse)
        for b in range(bs):
            r0, r1 = qo[b], qo[b + 1]
            slots = torch.tensor(kvi[kvp[b]:kvp[b + 1]], device=dev, dtype=torch.long)
            n = kvp[b + 1] - kvp[b]
            t = torch.arange(r1 - r0, device=dev)
            vis = _visible(t, r1 - r0, torch.arange(n, device=dev), n, causal)
            out, lse = attend(qf[r0:r1], kvf[slots], kvf[slots, :v_dim], vis, sm_scale)
            live = vis.any(1)
            o[r0:r1][live] = out[live].to(o.dtype)
            if final_lse is not None:
                final_lse[r0:r1] = lse
        return o.view(total_s, 1, nhead, v_dim), final_lse

    if num_kv_splits is None:
        num_kv_splits = get_mla_decode_fwd_max_splits(ori_nhead, max_seqlen_q, q.dtype,
                                                      kv_buffer.dtype)
    io_transformed = False
    fold = 1
    if _natively_supported(nhead, max_seqlen_q, q.dtype, kv_buffer.dtype):
        pass
    elif nhead in range(32, 128 + 1, 16):
        fold = ori_nhead // 16
        nhead = 16
        total_s = ori_total_s * fold
        if max_seqlen_q == 1:
            q = q.view(total_s, nhead, -1)
        else:
            q = (q.reshape(ori_total_s // max_seqlen_q, max_seqlen_q, fold, nhead, -1)
                 .permute(0, 2, 1, 3, 4).reshape(total_s, nhead, -1))
            o_orig = o
        o = o.view(total_s, nhead, -1)
        io_transformed = True
        qf = dequant(q, q_scale)
    else:
        raise AssertionError(f"{nhead=} and {max_seqlen_q=} not supported")

    p_rows = reduce_partial_map.size(0) * max_seqlen_q
    logits = fill_unwritten(torch.empty((p_rows, 1, nhead, v_dim), dtype=torch.float32,
                                        device=dev))
    attn_lse = fill_unwritten(torch.empty((p_rows, 1, nhead, 1), dtype=torch.float32,
                                          device=dev))
    final_lse = fill_unwritten(torch.empty((total_s, nhead), dtype=torch.float32, device=dev)) \
        if return_lse else None

    # Stage 1: each CU slot runs its works. Causality comes from kv_offset (the KV end of the
    # request is kv_end + kv_offset), the way the kernel places its right-aligned mask.
    wp, wi = ints(work_indptr), ints(work_info_set)
    for c in range(len(wp) - 1):
        for w in range(wp[c], wp[c + 1]):
            pb, ploc, qs, qe, ks, ke, koff = wi[8 * w: 8 * w + 7]
            if fold > 1:
                req_q0, qlen_b = max_seqlen_q * pb, max_seqlen_q
            else:
                req_q0, qlen_b = qo[pb], qo[pb + 1] - qo[pb]
            kv_end = ke + koff
            req = pb // fold
            kv_len = kv_end - kvp[req]
            idx = torch.arange(ks, max(ke, ks), device=dev)
            slots = torch.tensor(kvi[ks:max(ke, ks)], device=dev, dtype=torch.long)
            t = torch.arange(qs, qe, device=dev) - req_q0
            vis = _visible(t, qlen_b, idx - kvp[req], kv_len, causal)
            out, lse = attend(qf[qs:qe], kvf[slots], kvf[slots, :v_dim], vis, sm_scale)
            if ploc < 0:
                o[qs:qe] = out.to(o.dtype)
                if final_lse is not None:
                    final_lse[qs:qe] = lse
            else:
                logits[ploc:ploc + (qe - qs), 0] = out
                attn_lse[ploc:ploc + (qe - qs), 0, :, 0] = lse
    mla_reduce_v1(logits, attn_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                  max_seqlen_q, num_kv_splits, o, final_lse)

    if io_transformed:
        if max_seqlen_q == 1:
            o = o.view(ori_total_s, ori_nhead, -1)
            if final_lse is not None:
                final_lse = final_lse.view(ori_total_s, ori_nhead)
        else:
            new_o = (o.reshape(ori_total_s // max_seqlen_q, ori_nhead // nhead, max_seqlen_q,
                               nhead, -1).permute(0, 2, 1, 3, 4)
                     .reshape(ori_total_s, ori_nhead, -1).contiguous())
            # AITER rebinds the caller's tensor to new storage: the buffer it was handed keeps
            # the folded layout. A bridge that wraps XLA's buffer must copy this back.
            o_orig.set_(new_o)
            if final_lse is not None:
                final_lse = (final_lse.reshape(ori_total_s // max_seqlen_q, ori_nhead // nhead,
                                               max_seqlen_q, nhead)
                             .permute(0, 2, 1, 3).reshape(ori_total_s, ori_nhead).contiguous())
    return logits, final_lse


__all__ = ["mla_decode_fwd", "math"]
