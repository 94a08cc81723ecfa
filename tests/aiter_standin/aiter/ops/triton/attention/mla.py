"""``aiter.ops.triton.attention.mla.mla_decode_fwd`` stand-in: the segmented Triton decode."""

from __future__ import annotations

import math

import torch

from .... import dtypes
from ...._standin import (
    expect,
    expect_int,
    expect_scale,
    fill_unwritten,
    get_cu_num,
    ints,
    record,
    scalar,
)

LOG2E = 1.4426950408889634


def _next_pow2(x):
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def num_segments(block_size, max_seqlen_k, num_2d_prgms, target_num_prgms):
    """``select_3d_config`` (non-gfx12 branch)."""
    max_seg = min(128, math.ceil(max_seqlen_k / block_size))
    s = math.ceil(target_num_prgms / num_2d_prgms) * 2
    s = _next_pow2(min(s, max_seg))
    s = min(s, 128)
    return max(s, max(8, s))


def mla_decode_fwd(q, kv_buffer, out, cu_seqlens_q, seqused_k, max_seqlen_kv, block_tables,
                   softmax_scale, kv_lora_rank, qk_rope_head_dim, causal, q_descale, kv_descale,
                   q_scales=None, out_scale=None, shuffled_kv_cache=False, skip_reduce=False):
    """Returns ``(segm_output, segm_max, segm_expsum)`` with ``skip_reduce`` (base-2 stats)."""
    assert causal, "Only causal attention is supported"
    assert not shuffled_kv_cache and q_scales is None
    dev = q.device
    expect(q, "q", (dtypes.bf16, dtypes.fp16), ndim=3)  # vLLM dequantises an fp8 q first
    total, hq, d = q.shape
    expect(kv_buffer, "kv_buffer", (dtypes.bf16, dtypes.fp8), shape=(None, None, 1, d),
           device=dev)
    if out is not None:
        expect(out, "out", q.dtype, shape=(total, hq, kv_lora_rank), device=dev)
    expect(cu_seqlens_q, "cu_seqlens_q", dtypes.i32, ndim=1, device=dev)
    expect(seqused_k, "seqused_k", dtypes.i32, shape=(cu_seqlens_q.shape[0] - 1,), device=dev)
    expect(block_tables, "block_tables", dtypes.i32, shape=(seqused_k.shape[0], None),
           device=dev)
    expect_int(max_seqlen_kv, "max_seqlen_kv")
    expect_scale(kv_descale, "kv_descale", dev)
    if not isinstance(softmax_scale, float):
        raise RuntimeError("softmax_scale is a Python float")
    num_blocks, block_size, hk, _ = kv_buffer.shape
    num_seqs = len(seqused_k)
    tps = total // num_seqs
    gqa = hq // hk
    block_m = 16 if gqa <= 16 else min(_next_pow2(gqa), 128 if kv_buffer.dtype != torch.bfloat16
                                       else 64)
    head_blocks = (gqa + block_m - 1) // block_m
    num_2d = num_seqs * head_blocks * hk if tps == 1 else (
        ((tps + max(block_m // gqa, 1) - 1) // max(block_m // gqa, 1)) * num_seqs * head_blocks
        * hk)
    s_seg = num_segments(block_size, max_seqlen_kv, num_2d, get_cu_num() * 4)
    record("segmented_mla_decode_fwd", q_shape=tuple(q.shape), q_dtype=q.dtype,
           kv_buffer_shape=tuple(kv_buffer.shape), max_seqlen_kv=max_seqlen_kv,
           softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank,
           qk_rope_head_dim=qk_rope_head_dim, q_descale=scalar(q_descale),
           kv_descale=scalar(kv_descale), skip_reduce=skip_reduce, out_is_none=out is None,
           num_segments=s_seg)
    assert kv_lora_rank + qk_rope_head_dim == d
    kv = kv_buffer.float()  # fp8 raw values: kv_descale is folded into scores and output
    kvd = scalar(kv_descale) if kv_descale is not None else 1.0
    qd = scalar(q_descale) if q_descale is not None else 1.0
    lr = kv_lora_rank
    dev = q.device
    seg_out = fill_unwritten(torch.empty((total, hq, s_seg, _next_pow2(lr)), dtype=torch.float32,
                                         device=dev))
    seg_max = fill_unwritten(torch.empty((total, hq, s_seg), dtype=torch.float32, device=dev))
    seg_sum = fill_unwritten(torch.empty((total, hq, s_seg), dtype=torch.float32, device=dev))
    lens, cu, table = ints(seqused_k), ints(cu_seqlens_q), block_tables.long()
    qf = q.float()
    for s in range(num_seqs):
        n = lens[s]
        ctx = n - tps
        tiles_total = -(-n // block_size)
        per = max(1, -(-n // (s_seg * block_size)))
        for pos in range(tps):
            row = cu[s] + pos
            bound = min(n, ctx + pos + 1)
            for g in range(s_seg):
                t0, t1 = g * per, min((g + 1) * per, tiles_total)
                if t0 >= t1:
                    continue  # empty segment: exits early, never written
                p = torch.arange(t0 * block_size, min(t1 * block_size, n), device=dev)
                rows = kv[table[s, p // block_size], p % block_size, 0]  # [P, D]
                x = (qf[row] @ rows.T) * softmax_scale * LOG2E * qd * kvd  # [Hq, P]
                x = torch.where((p < bound)[None], x, torch.full_like(x, -math.inf))
                m = x.amax(-1)
                m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
                w = torch.exp2(x - m_safe[:, None])
                seg_out[row, :, g, :lr] = (w @ rows[:, :lr]) * kvd
                seg_max[row, :, g] = m
                seg_sum[row, :, g] = w.sum(-1)
    if skip_reduce:
        return seg_out, seg_max, seg_sum
    raise NotImplementedError("stand-in: vLLM always passes skip_reduce=True")
