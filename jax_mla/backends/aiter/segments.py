"""Merging AITER's segmented-decode partials (base-2 statistics) into ``out`` and a natural LSE.

AITER's segmented Triton decode (``aiter.ops.triton.attention.mla.mla_decode_fwd`` with
``skip_reduce=True``) splits each row's KV into ``S`` segments of whole tiles and returns, per
segment, the *unnormalised* accumulator ``acc_s = sum 2^(x - m_s) v``, the running maximum
``m_s`` in the log2 domain and ``e_s = sum 2^(x - m_s)``. Segments past the last one a row needs
are never written (garbage, possibly NaN), so the merge masks by the active count -- the same
partition AITER uses: ``tiles_per_segment = max(1, ceil(len / (S * tile)))``,
``active = ceil(len / (tiles_per_segment * tile))`` (0 for an empty row). docs/design.md §4.6.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LN2 = math.log(2.0)


def active_segments(seq_lens: jax.Array, num_segments: int, tile_size: int) -> jax.Array:
    """``[T]`` int32: how many leading segments AITER wrote for each row."""
    n = seq_lens.astype(jnp.int32)
    span = num_segments * tile_size
    tps = jnp.maximum(1, (n + span - 1) // span)
    per = tps * tile_size
    return jnp.where(n > 0, (n + per - 1) // per, 0)


def merge_mla_segments(segm_output, segm_max, segm_expsum, seq_lens, tile_size: int,
                       out_dtype=jnp.float32):
    """vLLM's ``merge_mla_segments_triton`` math in jnp.

    Args:
      segm_output: ``[T, H, S, L]`` float32 unnormalised segment accumulators.
      segm_max: ``[T, H, S]`` float32 running max, log2 domain.
      segm_expsum: ``[T, H, S]`` float32 sums of ``2^(x - max)``.
      seq_lens: ``[T]`` int32 KV length of each row (the segmented call's ``seqused_k``).
      tile_size: the kernel's TILE_SIZE (the verify subpage size). Static.
    Returns:
      ``out [T, H, L]`` in ``out_dtype`` and ``lse [T, H]`` float32, natural log:
      ``M = max_s m_s``, ``w_s = 2^(m_s - M)``, ``Z = sum e_s w_s``, ``out = sum acc_s w_s / Z``
      (0 when ``Z == 0``), ``lse = (M + log2 Z) ln 2`` (``-inf`` when ``Z == 0``).
    """
    s = segm_max.shape[-1]
    act = active_segments(seq_lens, s, tile_size)
    on = jnp.arange(s, dtype=jnp.int32)[None, None, :] < act[:, None, None]  # [T, 1, S]
    m = jnp.where(on, segm_max.astype(jnp.float32), -jnp.inf)
    big_m = jnp.max(m, axis=-1, keepdims=True)
    big_m = jnp.where(jnp.isneginf(big_m), 0.0, big_m)
    w = jnp.where(on, jnp.exp2(m - big_m), 0.0)
    z = jnp.sum(jnp.where(on, segm_expsum, 0.0) * w, axis=-1)
    acc = jnp.sum(jnp.where(on[..., None], segm_output * w[..., None], 0.0), axis=-2)
    empty = z == 0
    safe_z = jnp.where(empty, 1.0, z)
    out = jnp.where(empty[..., None], 0.0, acc / safe_z[..., None])
    lse = jnp.where(empty, -jnp.inf, (big_m[..., 0] + jnp.log2(safe_z)) * LN2)
    return out.astype(out_dtype), lse
