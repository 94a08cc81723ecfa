"""The exact XLA reference for MLA decode and verify over a paged latent cache.

Works on every platform. The KV is processed in chunks of whole pages with an online softmax in
float32, so memory is linear in the chunk, not in the context: it serves 32k-128k contexts on a CPU.
Only pages the block table names are gathered, and only positions below each row's causal bound
enter the sums; other rows of a gathered page are zeroed before any product, so NaN in unused
slots cannot leak (0 * NaN would).
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


class XlaBackend:
    """Plain XLA: the exact reference, every platform, every head count, no padding."""

    name = "xla"

    def is_available(self, platform: str) -> bool:
        return True

    def check(self, problem) -> None:
        return None

    def padded_heads(self, problem) -> int:
        return problem.num_heads

    def decode(self, q, kv_cache, metadata, *, scale, kv_lora_rank, q_scale, kv_scale):
        return paged_mla_reference(q, kv_cache, metadata, scale=scale, kv_lora_rank=kv_lora_rank,
                                   q_scale=q_scale, kv_scale=kv_scale)
