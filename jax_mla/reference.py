"""The exact XLA references: paged MLA decode/verify and varlen MHA-form prefill.

Every backend's default (``jax_mla.backends.Backend``) and the XLA backend itself. Both work on
every platform in float32 with an online softmax over chunks, so memory is linear in the chunk,
not in the context: 32k-128k contexts run on a CPU.

Decode: only pages the block table names are gathered, and only positions below each row's
causal bound enter the sums; other rows of a gathered page are zeroed before any product, so NaN
in unused slots cannot leak (0 * NaN would). Prefill: each query chunk walks only the keys its
rows can see. Formulas and masks: docs/design.md §1 and §9.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla.cache import dequantize

_HI = jax.lax.Precision.HIGHEST
# Bytes of float32 KV gathered per chunk across the batch; bounds the working set.
_CHUNK_BYTES = 64 << 20


def default_chunk_tokens(num_seqs: int, page_size: int, width: int, max_seq_len: int) -> int:
    """Largest power-of-two token chunk (whole pages) whose float32 gather fits the budget."""
    tokens = max(1, _CHUNK_BYTES // (4 * width * max(1, num_seqs)))
    tokens = 1 << (tokens.bit_length() - 1)
    tokens = min(tokens, 4096, max(page_size, max_seq_len))
    return max(page_size, (tokens // page_size) * page_size)


def row_bounds(seq_lens: jax.Array, qlen: int) -> jax.Array:
    """``[B, Q]`` int32: row ``t`` of request ``b`` sees positions ``< seq_lens[b] - Q + t + 1``."""
    t = jnp.arange(qlen, dtype=jnp.int32)
    return jnp.maximum(seq_lens[:, None] - qlen + t[None, :] + 1, 0)


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "chunk_tokens"))
def paged_mla_reference(q, kv_cache, metadata, *, scale, kv_lora_rank, q_scale=None,
                        kv_scale=None, chunk_tokens=None):
    """MLA decode/verify, exact in float32.

    Args:
      q: ``[T, H, D]`` absorbed queries (``q_nope`` then ``q_pe``), ``T = B * Q``.
      kv_cache: ``[num_pages, page_size, D]``.
      metadata: :class:`jax_mla.DecodeMetadata`.
    Returns:
      ``out [T, H, L] float32`` and ``lse [T, H] float32`` (natural log; empty rows: 0, -inf).
    """
    md = metadata
    b, qlen, ps = md.num_seqs, md.qlen, md.page_size
    t_rows, h, d = q.shape
    lr = kv_lora_rank
    num_phys = kv_cache.shape[0]
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(b, ps, d, md.max_seq_len)
    ppc = max(1, chunk_tokens // ps)  # pages per chunk
    c = ppc * ps
    n_static = -(-md.max_pages // ppc)

    qf = dequantize(q, q_scale).reshape(b, qlen, h, d)
    bounds = row_bounds(md.seq_lens, qlen)  # [B, Q]
    num_pages = -(-md.seq_lens // ps)
    table = jnp.pad(md.block_table, ((0, 0), (0, n_static * ppc - md.max_pages)))

    def body(j, carry):
        m, z, acc = carry
        pidx = j * ppc + jnp.arange(ppc, dtype=jnp.int32)
        pages = jax.lax.dynamic_slice_in_dim(table, j * ppc, ppc, axis=1)
        pages = jnp.where(pidx[None] < num_pages[:, None], pages, 0)
        pages = jnp.clip(pages, 0, num_phys - 1)
        kv = dequantize(kv_cache[pages], kv_scale).reshape(b, c, d)
        pos = j * c + jnp.arange(c, dtype=jnp.int32)
        kv = jnp.where((pos[None, :] < md.seq_lens[:, None])[..., None], kv, 0.0)
        s = jnp.einsum("bqhd,bcd->bqhc", qf, kv, precision=_HI) * scale
        see = pos[None, None, :] < bounds[:, :, None]  # [B, Q, C]
        s = jnp.where(see[:, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        z = z * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bqhc,bcl->bqhl", p, kv[..., :lr], precision=_HI)
        return m_new, z, acc

    init = (
        jnp.full((b, qlen, h), -jnp.inf, jnp.float32),
        jnp.zeros((b, qlen, h), jnp.float32),
        jnp.zeros((b, qlen, h, lr), jnp.float32),
    )
    n_chunks = (jnp.max(md.seq_lens, initial=0) + c - 1) // c
    m, z, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    empty = z == 0
    out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, z)[..., None])
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, z)))
    return out.reshape(t_rows, h, lr), lse.reshape(t_rows, h)


# --------------------------------------------------------------------------------------------
# Prefill (MHA form)

# float32 score elements per (query chunk x heads x key chunk) tile of the prefill reference.
_TILE_ELEMS = 1 << 24
_MAX_K_CHUNK = 512
_MAX_Q_CHUNK = 512


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def reference_chunks(num_heads: int, tk: int, max_seqlen: int | None,
                     max_seqlen_k: int | None) -> tuple[int, int]:
    """``(q_chunk, k_chunk)`` of the XLA reference: no larger than the sequences need (rows of
    other sequences in a tile are wasted work), and one score tile of at most ``_TILE_ELEMS``."""
    ck = min(_MAX_K_CHUNK, _pow2_ceil(max_seqlen_k or tk), tk)
    cq = max(16, min(_MAX_Q_CHUNK, _TILE_ELEMS // (num_heads * ck)))
    cq = 1 << (cq.bit_length() - 1)
    if max_seqlen is not None:
        cq = max(16, min(cq, _pow2_ceil(max_seqlen)))
    return cq, max(1, ck)


def visible_key_ranges(cu_q, cu_k, num_rows: int, causal: bool):
    """``(lo, hi)`` int32 ``[num_rows]``: packed row ``r`` sees packed keys ``lo[r] .. hi[r]``.

    Both are non-decreasing in ``r`` (sequences are packed in order and the causal bound grows
    along a sequence); padding rows get the empty range ``cu_k[-1] .. cu_k[-1]``.
    """
    b = cu_q.shape[0] - 1
    r = jnp.arange(num_rows, dtype=jnp.int32)
    seg = jnp.searchsorted(cu_q[1:], r, side="right").astype(jnp.int32)
    real = seg < b
    s = jnp.minimum(seg, b - 1)
    sq = cu_q[s + 1] - cu_q[s]
    sk = cu_k[s + 1] - cu_k[s]
    n_vis = jnp.clip(r - cu_q[s] + sk - sq + 1, 0, sk) if causal else sk
    lo = jnp.where(real, cu_k[s], cu_k[-1])
    hi = jnp.where(real, cu_k[s] + n_vis, cu_k[-1])
    return lo, hi


@functools.partial(jax.jit, static_argnames=("scale", "causal", "max_seqlen", "max_seqlen_k",
                                             "q_chunk", "k_chunk"))
def prefill_reference(q, k, v, cu_q, cu_k, *, scale, causal, max_seqlen=None, max_seqlen_k=None,
                      q_chunk=None, k_chunk=None):
    """The XLA reference: chunked online softmax, float32 statistics and accumulators.

    Args:
      q: ``[T, H, Dqk]``; k: ``[Tk, H, Dqk]``; v: ``[Tk, H, Dv]``; cu_q, cu_k: ``[B + 1]`` int32
        in canonical form (see :func:`canonical_cu`); ``Tk >= 1``.
    Returns:
      ``out [T, H, Dv] float32``, ``lse [T, H] float32`` (natural log; empty rows 0, ``-inf``).

    Query chunks of ``q_chunk`` rows run one after another; each walks only the keys its rows
    can see (contiguous, see :func:`visible_key_ranges`) in chunks of ``k_chunk``, so work
    skips other sequences and the causal upper triangle, and memory is one
    ``[q_chunk, H, k_chunk]`` tile. 16-bit inputs feed the matmuls directly with float32
    accumulation, as the tensor cores do; float32 inputs use full precision.
    """
    t, h, dqk = q.shape
    tk, _, dv = v.shape
    cq, ck = reference_chunks(h, tk, max_seqlen, max_seqlen_k)
    cq, ck = q_chunk or cq, min(k_chunk or ck, tk)
    prec = _HI if jnp.dtype(q.dtype) == jnp.float32 else None
    lo, hi = visible_key_ranges(cu_q, cu_k, t, causal)
    nq = -(-t // cq)
    pad = nq * cq - t
    qs = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(nq, cq, h, dqk)
    los = jnp.pad(lo, (0, pad), constant_values=cu_k[-1]).reshape(nq, cq)
    his = jnp.pad(hi, (0, pad), constant_values=cu_k[-1]).reshape(nq, cq)
    k_end = cu_k[-1]

    def q_block(args):
        qc, lo_c, hi_c = args
        first, last = lo_c[0], jnp.max(hi_c)

        def body(j, carry):
            m, den, acc = carry
            start = first + j * ck
            # dynamic_slice clamps the start into range; keys below `start` then belong to
            # the previous chunk and are masked out so none is counted twice.
            s0 = jnp.clip(start, 0, tk - ck)
            kc = jax.lax.dynamic_slice_in_dim(k, s0, ck, axis=0)
            vc = jax.lax.dynamic_slice_in_dim(v, s0, ck, axis=0)
            kidx = s0 + jnp.arange(ck, dtype=jnp.int32)
            # Rows past the last key are padding that may hold garbage: zero them, since
            # 0 * NaN would leak into the sums.
            vc = jnp.where((kidx < k_end)[:, None, None], vc, 0)
            see = (kidx[None, :] >= jnp.maximum(lo_c, start)[:, None]) & (
                kidx[None, :] < hi_c[:, None])
            s = jnp.einsum("qhd,khd->qhk", qc, kc, precision=prec,
                           preferred_element_type=jnp.float32) * scale
            s = jnp.where(see[:, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            den = den * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum("qhk,khv->qhv", p.astype(v.dtype), vc, precision=prec,
                            preferred_element_type=jnp.float32)
            return m_new, den, acc * alpha[..., None] + pv

        init = (jnp.full((cq, h), -jnp.inf, jnp.float32), jnp.zeros((cq, h), jnp.float32),
                jnp.zeros((cq, h, dv), jnp.float32))
        m, den, acc = jax.lax.fori_loop(0, (last - first + ck - 1) // ck, body, init)
        empty = den == 0
        den = jnp.where(empty, 1.0, den)
        out = jnp.where(empty[..., None], 0.0, acc / den[..., None])
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(den))
        return out, lse

    out, lse = jax.lax.map(q_block, (qs, los, his))
    return out.reshape(nq * cq, h, dv)[:t], lse.reshape(nq * cq, h)[:t]
