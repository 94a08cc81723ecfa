"""Varlen flash-attention forward for MLA prefill (MHA form), in pure Triton (no jax imports).

Packed layout, contiguous: ``q [Tq, H, DQK]``, ``k [Tk, H, DQK]``, ``v [Tk, H, DV]``,
``out [Tq, H, DV]``, ``lse [Tq, H]`` float32 natural log. Sequence ``s`` owns query rows
``cu_q[s] .. cu_q[s+1]`` and key rows ``cu_k[s] .. cu_k[s+1]``. Causal masking is bottom-right
aligned (FlashAttention >= 2.1): local query row ``i`` sees local keys ``j <= i + (sk - sq)``, so
queries that are the tail of a longer key sequence see the whole prefix.

Grid ``(NUM_BLOCKS, H)``. Program ``pid`` serves query block ``blk_m0[pid]`` (a local row offset)
of sequence ``blk_seq[pid]``; ``-1`` marks a spare program that exits at once. The table is built
by the caller, so one static grid serves every length mix.

Written the way Triton's fused-attention tutorial is for Hopper: BLOCK_M x BLOCK_N tiles, fp32
accumulators, ``exp2`` with ``log2(e)`` folded into the scale, and each query block's keys split
into a stage every row sees in full (no masks at all: the hot loop) and a stage with masks (the
causal diagonal and the ragged end of the keys). A head dim that is not a power of two
(DeepSeek's 192 = 128 nope + 64 rope) is split into two dots, ``D1`` (a power of two) plus ``D2``
(the rest, padded to a power of two by masked loads), as MLA kernels do.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load(ptrs, row_ok, col_ok, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
    # Masks only where a tile can leave the data; `other=0` so padding never feeds NaN to a dot.
    if ROW_MASK:
        if COL_MASK:
            x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok, other=0.0)
    elif COL_MASK:
        x = tl.load(ptrs, mask=col_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # fp32 inputs ask for true fp32 products; 16-bit inputs take the tensor-core default.
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dot0(a, b, IEEE: tl.constexpr):
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _attn_inner(acc, l_i, m_i, q1, q2, k_ptrs1, k_ptrs2, v_ptrs, lo, hi, rows, cols, seqlen_k,
                causal_off, d2_ok, dv_ok,
                QK_SCALE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_D2: tl.constexpr, PAD_D2: tl.constexpr,
                PAD_DV: tl.constexpr, STRIDE_K: tl.constexpr, STRIDE_V: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over key rows ``lo .. hi`` (local); pointers already sit at ``lo``."""
    for start_n in range(lo, hi, BLOCK_N):
        kv_ok = (start_n + cols) < seqlen_k
        k1 = _load(k_ptrs1, kv_ok[None, :], True, MASKED, False)
        if UPCAST:
            k1 = k1.to(tl.float32)
        qk = _dot0(q1, k1, IEEE)
        if HAS_D2:
            k2 = _load(k_ptrs2, kv_ok[None, :], d2_ok[:, None], MASKED, PAD_D2)
            if UPCAST:
                k2 = k2.to(tl.float32)
            qk = _dot(q2, k2, qk, IEEE)
        if MASKED:
            see = kv_ok[None, :]
            if CAUSAL:
                see = see & ((start_n + cols)[None, :] <= (rows + causal_off)[:, None])
            qk = tl.where(see, qk * QK_SCALE, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            # Every row sees every key here, so the running max is finite after this block.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * QK_SCALE)
            p = tl.math.exp2(qk * QK_SCALE - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load(v_ptrs, kv_ok[:, None], dv_ok[None, :], MASKED, PAD_DV)
        if UPCAST:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        acc = _dot(p, v, acc, IEEE)
        m_i = m_ij
        k_ptrs1 += BLOCK_N * STRIDE_K
        v_ptrs += BLOCK_N * STRIDE_V
        if HAS_D2:
            k_ptrs2 += BLOCK_N * STRIDE_K
    return acc, l_i, m_i


@triton.jit
def prefill_fwd_kernel(
    Q, K, V, CU_Q, CU_K, BLK_SEQ, BLK_M0,  # inputs
    Out, Lse,  # outputs
    QK_SCALE: tl.constexpr,  # softmax scale * log2(e)
    H: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(BLK_SEQ + pid)
    if seq < 0:
        return
    m0 = tl.load(BLK_M0 + pid)
    q_start = tl.load(CU_Q + seq)
    seqlen_q = tl.load(CU_Q + seq + 1) - q_start
    k_start = tl.load(CU_K + seq)
    seqlen_k = tl.load(CU_K + seq + 1) - k_start

    HAS_D2: tl.constexpr = DQK > D1
    PAD_D2: tl.constexpr = D1 + D2 > DQK
    PAD_DV: tl.constexpr = BLOCK_DV > DV
    STRIDE_Q: tl.constexpr = H * DQK
    STRIDE_V: tl.constexpr = H * DV

    rows = m0 + tl.arange(0, BLOCK_M)  # local query rows
    cols = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1)
    offs_d2 = D1 + tl.arange(0, D2)
    offs_v = tl.arange(0, BLOCK_DV)
    q_ok = rows < seqlen_q
    d2_ok = offs_d2 < DQK
    dv_ok = offs_v < DV

    # 64-bit base pointers; in-tile offsets stay small, so 32-bit math never overflows.
    q_base = Q + (q_start + m0).to(tl.int64) * STRIDE_Q + h * DQK
    tile_m = tl.arange(0, BLOCK_M)
    q1 = tl.load(q_base + tile_m[:, None] * STRIDE_Q + offs_d1[None, :], mask=q_ok[:, None],
                 other=0.0)
    if UPCAST:
        q1 = q1.to(tl.float32)
    q2 = q1  # placeholder when there is no second part; never read then
    if HAS_D2:
        q2 = tl.load(q_base + tile_m[:, None] * STRIDE_Q + offs_d2[None, :],
                     mask=q_ok[:, None] & d2_ok[None, :], other=0.0)
        if UPCAST:
            q2 = q2.to(tl.float32)

    # Key ranges. Row i sees keys j <= i + off (causal) or j < sk. Keys below n_full are seen by
    # every row of the block; n_full .. hi need masks; keys at or past hi are never seen.
    causal_off = seqlen_k - seqlen_q
    if CAUSAL:
        n_full = tl.minimum(tl.maximum(m0 + causal_off + 1, 0), seqlen_k)
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + causal_off, 0), seqlen_k)
    else:
        n_full = seqlen_k
        hi = seqlen_k
    n_full = (n_full // BLOCK_N) * BLOCK_N

    k_base = K + k_start.to(tl.int64) * STRIDE_Q + h * DQK
    v_base = V + k_start.to(tl.int64) * STRIDE_V + h * DV
    k_ptrs1 = k_base + cols[None, :] * STRIDE_Q + offs_d1[:, None]  # [D1, BLOCK_N] (K^T)
    k_ptrs2 = k_base + cols[None, :] * STRIDE_Q + offs_d2[:, None]
    v_ptrs = v_base + cols[:, None] * STRIDE_V + offs_v[None, :]  # [BLOCK_N, BLOCK_DV]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q1, q2, k_ptrs1, k_ptrs2, v_ptrs, 0, n_full, rows, cols, seqlen_k,
        causal_off, d2_ok, dv_ok, QK_SCALE, False, CAUSAL, BLOCK_N, HAS_D2, PAD_D2, PAD_DV,
        STRIDE_Q, STRIDE_V, UPCAST, IEEE)
    step_k = n_full.to(tl.int64) * STRIDE_Q
    step_v = n_full.to(tl.int64) * STRIDE_V
    acc, l_i, m_i = _attn_inner(
        acc, l_i, m_i, q1, q2, k_ptrs1 + step_k, k_ptrs2 + step_k, v_ptrs + step_v, n_full, hi,
        rows, cols, seqlen_k, causal_off, d2_ok, dv_ok, QK_SCALE, True, CAUSAL, BLOCK_N, HAS_D2,
        PAD_D2, PAD_DV, STRIDE_Q, STRIDE_V, UPCAST, IEEE)

    # A row that saw no key (empty sequence, or causal with fewer keys than queries): 0, -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # base 2 -> natural log
    lse = tl.where(empty, float("-inf"), lse)

    o_base = Out + (q_start + m0).to(tl.int64) * STRIDE_V + h * DV
    o_ptrs = o_base + tile_m[:, None] * STRIDE_V + offs_v[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_ok[:, None] & dv_ok[None, :])
    lse_ptrs = Lse + (q_start + m0).to(tl.int64) * H + h + tile_m * H
    tl.store(lse_ptrs, lse, mask=q_ok)
