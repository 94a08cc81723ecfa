"""``aiter.flash_attn_varlen_func`` stand-in (causal mask aligned bottom-right, as AITER's)."""

from __future__ import annotations

import math

import torch

from .. import dtypes
from .._standin import attend, expect, expect_int, ints, record


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           min_seqlen_q=0, dropout_p=0.0, softmax_scale=None,
                           logits_soft_cap=0.0, causal=False, window_size=(-1, -1, 0),
                           bias=None, alibi_slopes=None, deterministic=False, return_lse=False,
                           return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None,
                           out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None,
                           sink_ptr=None):
    """Returns ``out [Tq, H, Dv]`` (a fresh tensor), or ``(out, lse [H, Tq])`` with return_lse.

    An empty row (nothing visible) gets out 0 and lse ``+inf`` (FlashAttention's convention).
    """
    record("flash_attn_varlen_func", q_shape=tuple(q.shape), k_shape=tuple(k.shape),
           v_shape=tuple(v.shape), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
           softmax_scale=softmax_scale, causal=causal, return_lse=return_lse)
    assert dropout_p == 0.0 and bias is None and alibi_slopes is None and block_table is None
    dev = q.device
    expect(q, "q", (dtypes.bf16, dtypes.fp16), ndim=3)
    expect(k, "k", q.dtype, shape=(None, None, q.shape[-1]), device=dev)
    expect(v, "v", q.dtype, shape=(k.shape[0], k.shape[1], None), device=dev)
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    expect(cu_seqlens_q, "cu_seqlens_q", dtypes.i32, ndim=1, device=dev)
    expect(cu_seqlens_k, "cu_seqlens_k", dtypes.i32, shape=tuple(cu_seqlens_q.shape), device=dev)
    expect_int(max_seqlen_q, "max_seqlen_q")
    expect_int(max_seqlen_k, "max_seqlen_k")
    tq, h, dqk = q.shape
    hk = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else dqk ** -0.5
    cq, ck = ints(cu_seqlens_q), ints(cu_seqlens_k)
    res = torch.zeros((tq, h, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse_all = torch.full((h, tq), math.inf, dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        i = torch.arange(q1 - q0, device=q.device)
        j = torch.arange(k1 - k0, device=q.device)
        vis = (j[None] <= i[:, None] + (k1 - k0) - (q1 - q0)) if causal else torch.ones(
            len(i), len(j), dtype=torch.bool, device=q.device)
        for g in range(hk):
            hs = slice(g * (h // hk), (g + 1) * (h // hk))
            o, lse = attend(q[q0:q1, hs].float(), k[k0:k1, g].float(), v[k0:k1, g].float(),
                            vis, scale)
            res[q0:q1, hs] = o.to(q.dtype)
            lse_all[hs, q0:q1] = torch.where(torch.isneginf(lse), math.inf, lse).T
    return (res, lse_all) if return_lse else res
