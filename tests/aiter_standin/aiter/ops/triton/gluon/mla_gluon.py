"""``aiter.ops.triton.gluon.mla_gluon.mla_gluon`` stand-in (gfx950 small-head decode / MTP)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

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


# --- The kernels ``mla_gluon`` launches (jax_mla launches them itself:
# backends/aiter/gluon_kernels.py)
#
# Both have the JIT parameter lists of ROCm/aiter e4048607's kernels of those names (names,
# order, which are constexpr; pinned in jax_mla/backends/aiter/manifest.json), so jax_mla's
# launcher binds and compiles them exactly as it would AITER's. The bodies are this stand-in's
# own, written from the documented semantics:
#
# - ``_mla_gluon`` (stage 1, the bh16 regimes; ``@gluon.jit``): program (batch, split,
#   head block x query position); a request's KV is cut into splits of
#   ``max(BLOCK_N, seq_len // NUM_KV_SPLITS)`` tokens (the last split to the end); an empty split
#   writes nothing; query position ``t`` sees positions ``< seq_len - QLEN + t + 1``; each split
#   stores its normalised output (times ``kv_scale``) in ``O``'s dtype and, with several splits,
#   its natural-log LSE in ``Mid_lse``; with one split and ``RETURN_LSE`` the LSE goes to
#   ``Final_lse``. Written token by token (no MFMA): it is compiled for gfx950 by the ROCm
#   lowering test and never run -- Gluon has no interpreter and this host no AMD GPU.
# - ``_mla_softmax_reducev_kernel`` (stage 2; ``@triton.jit``): program (batch, head, query
#   position) merges the splits that hold data (re-derived from the lengths as stage 1 cut
#   them) by their LSE into ``O`` and, with ``HAS_FINAL_LSE``, the merged LSE. Run by Triton's
#   interpreter in the CPU tests.


@gluon.jit
def _mla_gluon(
    Q_nope,
    Q_pe,
    Kv_c_cache,
    K_pe_cache,
    Req_to_tokens,
    B_seq_len,
    O,  # noqa: E741 - AITER's name
    Attn_sink,
    sm_scale,
    kv_scale,
    stride_q_nope_bs,
    stride_q_nope_s,
    stride_q_nope_h,
    stride_q_pe_bs,
    stride_q_pe_s,
    stride_q_pe_h,
    stride_kv_c_bs,
    stride_k_pe_bs,
    stride_req_to_tokens_bs,
    stride_o_b,
    stride_o_s,
    stride_o_h,
    stride_o_split,
    Mid_lse,
    stride_mid_lse_b,
    stride_mid_lse_s,
    stride_mid_lse_h,
    stride_mid_lse_split,
    Final_lse,
    stride_final_lse_b,
    stride_final_lse_s,
    stride_final_lse_h,
    BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_KV_SPLITS: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    HEAD_DIM_CKV: gl.constexpr,
    HEAD_DIM_KPE: gl.constexpr,
    KV_PE_OFFSET: gl.constexpr,
    USE_2D_VIEW: gl.constexpr,
    WITHIN_2GB: gl.constexpr,
    NUM_XCDS: gl.constexpr,
    NHEAD: gl.constexpr,
    REGIME: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    QLEN: gl.constexpr,
    HAS_PE: gl.constexpr,
    HAS_ATTN_SINK: gl.constexpr,
):
    NUM_M_BLOCKS: gl.constexpr = (NHEAD + BLOCK_H - 1) // BLOCK_H
    LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 64], [4, 1], [1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, LAYOUT)
    COLS: gl.constexpr = gl.SliceLayout(0, LAYOUT)
    cur_batch = gl.program_id(0)
    split_kv_id = gl.program_id(1)
    cur_head_id = gl.program_id(2) % NUM_M_BLOCKS
    q_pos = gl.program_id(2) // NUM_M_BLOCKS
    if USE_2D_VIEW:
        batch_page_start = stride_req_to_tokens_bs * cur_batch
        seq_len = gl.load(B_seq_len + cur_batch)
    else:
        batch_page_start = gl.load(B_seq_len + cur_batch)
        seq_len = gl.load(B_seq_len + cur_batch + 1) - batch_page_start
    kv_len_per_split = gl.maximum(BLOCK_N, seq_len // NUM_KV_SPLITS)
    split_start = kv_len_per_split * split_kv_id
    split_end = gl.minimum(split_start + kv_len_per_split, seq_len)
    if split_kv_id == NUM_KV_SPLITS - 1:
        split_end = seq_len
    if split_start >= split_end:
        return
    score_end = gl.minimum(split_end, seq_len - QLEN + q_pos + 1)
    heads = cur_head_id * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS)
    h_ok = heads < NHEAD
    offs_c = gl.arange(0, HEAD_DIM_CKV, layout=COLS)
    offs_p = gl.arange(0, HEAD_DIM_KPE, layout=COLS)
    q_c = gl.load(Q_nope + cur_batch * stride_q_nope_bs + q_pos * stride_q_nope_s
                  + heads[:, None] * stride_q_nope_h + offs_c[None, :],
                  mask=h_ok[:, None], other=0.0).to(gl.float32)
    q_p = gl.load(Q_pe + cur_batch * stride_q_pe_bs + q_pos * stride_q_pe_s
                  + heads[:, None] * stride_q_pe_h + offs_p[None, :],
                  mask=h_ok[:, None], other=0.0).to(gl.float32)
    qk_scale = sm_scale * kv_scale
    m = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
    s_sum = gl.zeros([BLOCK_H], gl.float32, ROWS)
    acc = gl.zeros([BLOCK_H, HEAD_DIM_CKV], gl.float32, LAYOUT)
    for n in range(split_start, score_end):
        tok = gl.load(Req_to_tokens + batch_page_start + n // PAGE_SIZE).to(gl.int64) * PAGE_SIZE \
            + n % PAGE_SIZE
        k_c = gl.load(Kv_c_cache + tok * stride_kv_c_bs + offs_c).to(gl.float32)
        k_p = gl.load(K_pe_cache + tok * stride_k_pe_bs + KV_PE_OFFSET + offs_p).to(gl.float32)
        s = (gl.sum(q_c * k_c[None, :], axis=1) + gl.sum(q_p * k_p[None, :], axis=1)) * qk_scale
        m_new = gl.maximum(m, s)
        alpha = gl.exp2((m - m_new) * 1.4426950408889634)
        p = gl.exp2((s - m_new) * 1.4426950408889634)
        s_sum = s_sum * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * k_c[None, :]
        m = m_new
    empty = s_sum == 0.0
    out = acc * kv_scale / gl.where(empty, 1.0, s_sum)[:, None]
    o_ptrs = (O + cur_batch * stride_o_b + q_pos * stride_o_s + heads[:, None] * stride_o_h
              + split_kv_id * stride_o_split + offs_c[None, :])
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=h_ok[:, None])
    lse = m + gl.log(s_sum)
    if RETURN_LSE and NUM_KV_SPLITS == 1:
        gl.store(Final_lse + cur_batch * stride_final_lse_b + q_pos * stride_final_lse_s
                 + heads * stride_final_lse_h, lse, mask=h_ok)
    elif NUM_KV_SPLITS > 1:
        gl.store(Mid_lse + cur_batch * stride_mid_lse_b + q_pos * stride_mid_lse_s
                 + heads * stride_mid_lse_h + split_kv_id * stride_mid_lse_split, lse, mask=h_ok)


@triton.jit
def _mla_softmax_reducev_kernel(
    Logits,
    Mid_lse,
    O,  # noqa: E741 - AITER's name
    Final_lse,
    B_seq_len,
    stride_l_b,
    stride_l_qs,
    stride_l_h,
    stride_l_s,
    stride_ml_b,
    stride_ml_qs,
    stride_ml_h,
    stride_ml_s,
    stride_o_b,
    stride_o_qs,
    stride_o_h,
    stride_fl_b,
    stride_fl_qs,
    stride_fl_h,
    NUM_KV_SPLITS: tl.constexpr,
    HEAD_DIM_CKV: tl.constexpr,
    HAS_FINAL_LSE: tl.constexpr,
    USE_2D_VIEW: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    q_pos = tl.program_id(2)
    if USE_2D_VIEW:
        seq_len = tl.load(B_seq_len + cur_batch)
    else:
        seq_len = tl.load(B_seq_len + cur_batch + 1) - tl.load(B_seq_len + cur_batch)
    per = tl.maximum(BLOCK_N, seq_len // NUM_KV_SPLITS)
    active = tl.minimum(tl.cdiv(seq_len, per), NUM_KV_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_CKV)
    base_l = cur_batch * stride_l_b + q_pos * stride_l_qs + cur_head * stride_l_h
    base_ml = cur_batch * stride_ml_b + q_pos * stride_ml_qs + cur_head * stride_ml_h
    m = -float("inf")
    z = 0.0
    acc = tl.zeros([HEAD_DIM_CKV], dtype=tl.float32)
    for s in range(0, active):
        lse = tl.load(Mid_lse + base_ml + s * stride_ml_s)
        if lse > -float("inf"):
            o = tl.load(Logits + base_l + s * stride_l_s + offs_d).to(tl.float32)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * o
            z = z * alpha + w
            m = m_new
    out = acc / tl.where(z > 0.0, z, 1.0)
    tl.store(O + cur_batch * stride_o_b + q_pos * stride_o_qs + cur_head * stride_o_h + offs_d,
             out.to(O.dtype.element_ty))
    if HAS_FINAL_LSE:
        tl.store(Final_lse + cur_batch * stride_fl_b + q_pos * stride_fl_qs
                 + cur_head * stride_fl_h, m + tl.log(z))
