"""``aiter.ops.attention`` stand-ins: the decode planner, the reducer, the PS prefill."""

from __future__ import annotations

import math

import torch

from .. import _metadata_ref, _ps_metadata_ref, dtypes
from .._standin import (
    attend,
    dequant,
    expect,
    expect_int,
    expect_scale,
    get_cu_num,
    get_gfx,
    ints,
    is_fp8,
    record,
    scalar,
)


def get_mla_decode_fwd_max_splits(num_head_qo, max_seqlen_qo, q_dtype, kv_dtype):
    return get_cu_num()  # occupancy 1: the experimental HK m16x4 kernel is off


def get_mla_metadata_info_v1(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype,
                             is_sparse, fast_mode=True, num_kv_splits=32,
                             intra_batch_mode=False, max_split_per_batch=-1):
    """Same arithmetic as AITER's (aiter/ops/attention.py), non-experimental."""
    record("get_mla_metadata_info_v1", batch_size=batch_size, max_seqlen_qo=max_seqlen_qo,
           num_head_qo=num_head_qo, q_dtype=q_dtype, kv_dtype=kv_dtype, is_sparse=is_sparse,
           fast_mode=fast_mode)
    assert num_head_qo % 8 == 0
    gfx = get_gfx()
    max_splits = get_mla_decode_fwd_max_splits(num_head_qo, max_seqlen_qo, q_dtype, kv_dtype)
    eff = 1 if is_sparse else max_seqlen_qo
    packed = eff * num_head_qo
    tiles = math.ceil(packed / 16)
    q8, kv8 = q_dtype == dtypes.fp8, kv_dtype == dtypes.fp8
    bf = q_dtype == dtypes.bf16 and kv_dtype == dtypes.bf16
    if (gfx == "gfx950" and bf and packed >= 64 and num_head_qo <= 64
            and (packed < 128 or num_head_qo == 48)) or (
            gfx == "gfx950" and q8 and kv8 and num_head_qo == 32 and eff == 3):
        tiles = eff if num_head_qo * 2 > 64 else math.ceil(packed / 64)
    elif (num_head_qo == 16 or (gfx == "gfx942" and num_head_qo == 128 and q8 and kv8)
          or (gfx == "gfx950" and q8 and kv8 and ((num_head_qo == 32 and eff == 4)
                                                   or num_head_qo in (64, 128)))
          or (num_head_qo == 64 and q8 and kv8 and eff == 1)):
        tiles = math.ceil(packed / 128)
    elif gfx == "gfx950" and (packed >= 128 or num_head_qo > 64) and bf and num_head_qo != 48:
        tiles = eff if num_head_qo * 2 > 128 else math.ceil(packed / 128)
    b = batch_size * max_seqlen_qo if is_sparse else batch_size
    tile_cnt = b * tiles
    if fast_mode:
        max_work = (b + max_splits - 1) * tiles
        max_split_tiles = min(b + max_splits - 1, (max_splits - 1) * 2) * tiles
    else:
        max_work = max_split_tiles = tile_cnt * max_splits
    if max_split_per_batch > 0:
        max_split_tiles = max(max_split_tiles,
                              tile_cnt + min(max_splits, max_split_per_batch * b))
    return (((2), torch.uint64), ((max_splits + 1), torch.int32), ((max_work, 8), torch.int32),
            ((tile_cnt + 1), torch.int32), ((tile_cnt, 2), torch.int32),
            (max_split_tiles, torch.int32))


def get_mla_metadata_v1(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens,
                        num_heads_per_head_k, num_heads_k, is_causal, work_metadata_ptrs,
                        work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                        reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1,
                        uni_seqlen_qo=-1, fast_mode=True, topk=-1, max_split_per_batch=-1,
                        intra_batch_mode=False, is_cp_round_robin=False, mla_version=0,
                        dtype_q_nope=None, dtype_q_rope=None, dtype_kv_nope=None,
                        dtype_kv_rope=None, dtype_q=None, dtype_kv=None):
    """Runs the statement-by-statement port of AITER's v1_2 planner (``_metadata_ref``)."""
    record("get_mla_metadata_v1", num_heads_per_head_k=num_heads_per_head_k,
           num_heads_k=num_heads_k, is_causal=is_causal, page_size=page_size,
           kv_granularity=kv_granularity, max_seqlen_qo=max_seqlen_qo,
           uni_seqlen_qo=uni_seqlen_qo, fast_mode=fast_mode, dtype_q=dtype_q, dtype_kv=dtype_kv)
    assert fast_mode and topk < 0 and not intra_batch_mode and not is_cp_round_robin
    qd = dtype_q_nope if dtype_q_nope is not None else dtype_q
    kd = dtype_kv_nope if dtype_kv_nope is not None else dtype_kv
    bufs = [t.cpu().numpy().copy() for t in (work_info_set, work_indptr, reduce_indptr,
                                              reduce_final_map, reduce_partial_map)]
    lds = 160 * 1024 if get_gfx() == "gfx950" else 64 * 1024
    _metadata_ref.get_mla_metadata_v1_2(
        seqlens_qo_indptr.cpu().numpy(), seqlens_kv_indptr.cpu().numpy(),
        kv_last_page_lens.cpu().numpy(), num_heads_per_head_k, num_heads_k, is_causal, *bufs,
        page_size=page_size, kv_granularity=kv_granularity, max_seqlen_qo=max_seqlen_qo,
        uni_seqlen_qo=uni_seqlen_qo, max_split_per_batch=max_split_per_batch, arch=get_gfx(),
        cu_count=get_cu_num(), lds_bytes=lds, q_fp8=qd == dtypes.fp8, kv_fp8=kd == dtypes.fp8)
    for t, b in zip((work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                     reduce_partial_map), bufs):
        t.copy_(torch.from_numpy(b))
    work_metadata_ptrs.copy_(torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()],
                                          dtype=torch.uint64))


def mla_reduce_v1(partial_output, partial_lse, reduce_indptr, reduce_final_map,
                  reduce_partial_map, max_seqlen_q, num_kv_splits, final_output,
                  final_lse=None):
    """Merge every tile with >= 2 partials (natural log); ``+inf`` LSE for an all-empty row."""
    record("mla_reduce_v1", max_seqlen_q=max_seqlen_q, num_kv_splits=num_kv_splits,
           partial_rows=partial_output.shape[0], final_shape=tuple(final_output.shape),
           has_final_lse=final_lse is not None)
    dev = final_output.device
    expect(partial_output, "partial_output", dtypes.fp32, device=dev)
    expect(partial_lse, "partial_lse", dtypes.fp32, device=dev)
    for name, t in (("reduce_indptr", reduce_indptr), ("reduce_partial_map", reduce_partial_map)):
        expect(t, name, dtypes.i32, ndim=1, device=dev)
    if reduce_final_map is not None:
        expect(reduce_final_map, "reduce_final_map", dtypes.i32, shape=(None, 2), device=dev)
    expect(final_output, "final_output", (dtypes.bf16, dtypes.fp16), ndim=3)
    if final_lse is not None:
        expect(final_lse, "final_lse", dtypes.fp32, shape=tuple(final_output.shape[:2]),
               device=dev)
    expect_int(max_seqlen_q, "max_seqlen_q")
    expect_int(num_kv_splits, "num_kv_splits")
    rows = partial_output.shape[0]
    dv = final_output.shape[-1]
    heads = final_output.shape[-2]
    po = partial_output.reshape(rows, heads, dv)
    pl = partial_lse.reshape(rows, heads)
    ri = ints(reduce_indptr)
    fm = ints(reduce_final_map) if reduce_final_map is not None else None
    pm = ints(reduce_partial_map)
    for i in range(len(ri) - 1):
        lo, hi = ri[i], ri[i + 1]
        if hi - lo < 2:
            continue  # unsplit tiles were written by their single work
        qs, qe = (fm[2 * i], fm[2 * i + 1]) if fm is not None else (
            i * max_seqlen_q, (i + 1) * max_seqlen_q)
        n = qe - qs
        idx = torch.tensor([[pm[k] + r for r in range(n)] for k in range(lo, hi)],
                           device=po.device)  # [P, n]
        lse = pl[idx]  # [P, n, H]
        m = lse.amax(0)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        z = torch.exp(lse - m_safe).sum(0)
        merged = torch.log(z) + m_safe
        bad = (z == 0) | torch.isnan(z)
        merged = torch.where(bad, torch.full_like(merged, math.inf), merged)
        w = torch.exp(lse - merged)  # [P, n, H]
        out = (w[..., None] * po[idx]).sum(0)
        final_output[qs:qe] = out.to(final_output.dtype).reshape(final_output[qs:qe].shape)
        if final_lse is not None:
            final_lse[qs:qe] = merged.reshape(final_lse[qs:qe].shape)


# --- fp8 PS prefill ---------------------------------------------------------------------------


def get_ps_metadata_info_v1(batch_size, num_head_k, max_qlen, qlen_granularity=256):
    cu_num = get_cu_num()
    clusters = math.gcd(num_head_k, cu_num)
    per = cu_num // clusters
    qsplit = math.ceil(max_qlen / qlen_granularity)
    tiles = batch_size * qsplit
    max_works = (batch_size + per - 1) * qsplit * num_head_k
    max_partials = min(batch_size + per - 1, (per - 1) * 2) * qsplit
    return ((2, torch.uint64), (cu_num + 1, torch.int32), ((max_works, 8), torch.int32),
            (tiles + 1, torch.int32), ((tiles, 2), torch.int32), (max_partials, torch.int32))


def get_ps_metadata_v1(seqlens_qo_indptr, pages_kv_indptr, context_lens, gqa_ratio,
                       num_heads_k, work_metadata_ptrs, work_indptr, work_info,
                       reduce_indptr, reduce_final_map, reduce_partial_map,
                       qhead_granularity=1, qlen_granularity=256, kvlen_granularity=16,
                       block_size=16, is_causal=True):
    """AITER's *host* PS planner: the statement-by-statement port in ``_ps_metadata_ref``."""
    record("get_ps_metadata_v1", gqa_ratio=gqa_ratio, num_heads_k=num_heads_k,
           qhead_granularity=qhead_granularity, qlen_granularity=qlen_granularity,
           kvlen_granularity=kvlen_granularity, block_size=block_size, is_causal=is_causal)
    for name, t in (("seqlens_qo_indptr", seqlens_qo_indptr), ("pages_kv_indptr", pages_kv_indptr),
                    ("context_lens", context_lens)):
        # A host algorithm: vLLM hands it CPU copies (qsl_cpu).
        expect(t, name, dtypes.i32, ndim=1, device=torch.device("cpu"))
    for name, t in (("work_indptr", work_indptr), ("reduce_indptr", reduce_indptr),
                    ("reduce_partial_map", reduce_partial_map)):
        expect(t, name, dtypes.i32, ndim=1)
    expect(work_info, "work_info", dtypes.i32, shape=(None, 8))
    expect(reduce_final_map, "reduce_final_map", dtypes.i32, shape=(None, 2))
    out = _ps_metadata_ref.get_ps_metadata_v1_2_host(
        ints(seqlens_qo_indptr), ints(pages_kv_indptr), ints(context_lens), gqa_ratio,
        num_heads_k, work_indptr.numel(), work_info.shape[0], reduce_indptr.numel(),
        reduce_final_map.shape[0], reduce_partial_map.numel(), qhead_granularity,
        qlen_granularity, kvlen_granularity, block_size, is_causal,
        available_tgs=get_cu_num())
    # AITER copies its whole zero-initialised host vectors back (tails included).
    for t, name in ((work_indptr, "work_indptr"), (work_info, "work_info"),
                    (reduce_indptr, "reduce_indptr"), (reduce_final_map, "reduce_final_map"),
                    (reduce_partial_map, "reduce_partial_map")):
        t.copy_(torch.from_numpy(out[name]).reshape(t.shape))


def mla_prefill_ps_asm_fwd(Q, K, V, qo_indptr, kv_indptr, kv_page_indices, work_indptr,
                           work_info_set, max_seqlen_q, softmax_scale, is_causal, splitData,
                           splitLse, output, q_scale=None, k_scale=None, v_scale=None):
    """Every work: its head range, query rows and KV chunk; partial or final rows."""
    record("mla_prefill_ps_asm_fwd", q_shape=tuple(Q.shape), q_dtype=Q.dtype,
           k_dtype=K.dtype, v_dtype=V.dtype, max_seqlen_q=max_seqlen_q,
           softmax_scale=softmax_scale, is_causal=is_causal,
           scales=(scalar(q_scale), scalar(k_scale), scalar(v_scale)),
           split_rows=splitData.shape[0])
    assert is_fp8(Q) and is_fp8(K) and is_fp8(V), "the PS asm prefill takes fp8 q, k, v"
    dev = Q.device
    expect(Q, "Q", dtypes.fp8, shape=(None, None, 192))  # the arch's fp8 (fnuz on gfx942)
    expect(K, "K", dtypes.fp8, shape=(None, None, 192), device=dev)
    expect(V, "V", dtypes.fp8, shape=(K.shape[0], K.shape[1], 128), device=dev)
    expect(output, "output", (dtypes.bf16, dtypes.fp16), shape=(Q.shape[0], Q.shape[1], 128),
           device=dev)
    expect(splitData, "splitData", dtypes.fp32, shape=(None, Q.shape[1], 128), device=dev)
    expect(splitLse, "splitLse", dtypes.fp32, shape=(splitData.shape[0], Q.shape[1]),
           device=dev)
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_page_indices", kv_page_indices), ("work_indptr", work_indptr)):
        expect(t, name, dtypes.i32, ndim=1, device=dev)
    expect(work_info_set, "work_info_set", dtypes.i32, shape=(None, 8), device=dev)
    expect_int(max_seqlen_q, "max_seqlen_q")
    for name, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        expect_scale(x, name, dev)
    if Q.shape[1] % 16:
        raise RuntimeError(f"PS prefill needs 16-aligned heads, got {Q.shape[1]}")
    qf, kf, vf = dequant(Q, q_scale), dequant(K, k_scale), dequant(V, v_scale)
    qo, kvp, kvi = ints(qo_indptr), ints(kv_indptr), ints(kv_page_indices)
    wp, wi = ints(work_indptr), ints(work_info_set)
    for w in range(wp[-1]):
        b, ploc, qs, qe, ks, ke, _, rng = wi[8 * w: 8 * w + 8]
        h0, h1 = rng & 0xFFFF, (rng >> 16) & 0xFFFF
        rows = torch.arange(qs, qe, device=Q.device)
        idx = torch.tensor(kvi[ks:ke], device=Q.device, dtype=torch.long)
        i = rows - qo[b]
        j = torch.arange(ks, ke, device=Q.device) - kvp[b]
        shift = (kvp[b + 1] - kvp[b]) - (qo[b + 1] - qo[b])
        vis = j[None, :] <= i[:, None] + shift if is_causal else torch.ones(
            len(rows), len(j), dtype=torch.bool, device=Q.device)
        outs, lses = [], []
        for h in range(h0, h1):  # one KV head per query head (gqa 1)
            o, lse = attend(qf[qs:qe, h:h + 1], kf[idx, h], vf[idx, h], vis, softmax_scale)
            outs.append(o[:, 0])
            lses.append(lse[:, 0])
        o = torch.stack(outs, 1)
        lse = torch.stack(lses, 1)
        if ploc < 0:
            output[qs:qe, h0:h1] = o.to(output.dtype)
        else:
            splitData[ploc:ploc + (qe - qs), h0:h1] = o
            splitLse[ploc:ploc + (qe - qs), h0:h1] = lse
