"""``aiter.ops.triton.gluon.mla_gluon.mla_gluon`` stand-in (gfx950 small-head decode / MTP)."""

from __future__ import annotations

import torch

from .... import dtypes
from ...._standin import attend, expect, expect_int, get_gfx, ints, is_fp8, record


def mla_gluon(q_nope, q_pe, kv_c, o, page_table, seq_info, sm_scale, k_pe=None,
              kv_pe_offset=512, use_2d_view=True, kv_scale=1.0, min_kv_seq_len=1,
              return_lse=False, has_pe=True, attn_sink=None):
    """3-D ``[B, H, .]`` decode or 4-D ``[B, qlen, H, .]`` MTP; writes ``o``; ``(o, lse)``."""
    record("mla_gluon", q_shape=tuple(q_nope.shape), q_dtype=q_nope.dtype,
           heads=q_nope.shape[-2], o_shape=tuple(o.shape), use_2d_view=use_2d_view,
           kv_pe_offset=kv_pe_offset, kv_scale=kv_scale, min_kv_seq_len=min_kv_seq_len,
           return_lse=return_lse, sm_scale=sm_scale, k_pe_is_none=k_pe is None)
    assert get_gfx() == "gfx950", "mla_gluon is gfx950-only"
    assert q_nope.dim() in (3, 4)
    assert not use_2d_view, "stand-in covers vLLM's flat (use_2d_view=False) form"
    assert k_pe is None and has_pe and attn_sink is None
    assert isinstance(min_kv_seq_len, int)
    dev = q_nope.device
    expect(q_nope, "q_nope", dtypes.bf16)
    expect(q_pe, "q_pe", dtypes.bf16, shape=tuple(q_nope.shape[:-1]) + (64,), device=dev)
    if q_nope.shape[-1] != 512 or kv_pe_offset != 512:
        raise RuntimeError("mla_gluon: L = 512 and R = 64 are fixed")
    expect(kv_c, "kv_c", (dtypes.bf16, dtypes.fp8), shape=(None, 576), device=dev)
    expect(o, "o", dtypes.bf16, shape=tuple(q_nope.shape), device=dev)
    expect(page_table, "page_table", dtypes.i32, ndim=1, device=dev)
    expect(seq_info, "seq_info", dtypes.i32, shape=(q_nope.shape[0] + 1,), device=dev)
    expect_int(min_kv_seq_len, "min_kv_seq_len")
    if not isinstance(sm_scale, float) or not isinstance(kv_scale, float):
        raise RuntimeError("sm_scale and kv_scale are Python floats")
    mtp = q_nope.dim() == 4
    b = q_nope.shape[0]
    qlen = q_nope.shape[1] if mtp else 1
    h = q_nope.shape[-2]
    lr = q_nope.shape[-1]
    if is_fp8(kv_c):
        assert b == 1, "Gluon's fp8 regime (bh16bn128) asserts batch_size == 1"
    qn = q_nope.reshape(b * qlen, h, lr).float()
    qp = q_pe.reshape(b * qlen, h, -1).float()
    q = torch.cat([qn, qp], -1)
    kv = kv_c.float()
    k = torch.cat([kv[:, :lr], kv[:, kv_pe_offset:kv_pe_offset + qp.shape[-1]]], -1)
    indptr, idx = ints(seq_info), page_table.long()
    of = o.view(b * qlen, h, lr)
    lse_out = torch.empty((b, qlen, h), dtype=torch.float32, device=o.device)
    for r in range(b):
        slots = idx[indptr[r]:indptr[r + 1]]
        n = len(slots)
        t = torch.arange(qlen, device=o.device)
        vis = torch.arange(n, device=o.device)[None] <= (n - qlen + t)[:, None]
        out, lse = attend(q[r * qlen:(r + 1) * qlen], k[slots], kv[slots, :lr], vis, sm_scale)
        of[r * qlen:(r + 1) * qlen] = out.to(o.dtype)
        lse_out[r] = lse
    return o, (lse_out if return_lse else None)
