"""Merging the DCP ranks' partial attention results exactly, by their LSEs (docs/design.md §8.9).

Each rank attends over its shard of the context for the ``H * N`` query heads of its DCP group.
The ``N`` partials of a head merge with natural-log LSE weights, and each rank keeps its own
``H`` heads, by one of two collective patterns (:data:`COMBINES`, same result):

- ``"ag_rs"``: all-gather the (small) LSEs, weight the own partial, reduce-scatter the sum;
- ``"a2a"``: all-to-all the partials so each rank holds the ``N`` partials of its heads, merge
  locally.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mla.merge import merge_lse_weights, weighted_sum

COMBINES = ("ag_rs", "a2a")


def scale_own_partial(out, lses, rank):
    """AG+RS's local step: this rank's partial weighted for the exact merge, float32.

    Args:
      out: ``[T, H*N, L]`` this rank's partial output (any float dtype).
      lses: ``[N, T, H*N]`` float32 every rank's natural-log LSE (``-inf`` = empty).
      rank: this rank (int or traced scalar).
    Returns:
      ``(part [T, H*N, L] float32, lse [T, H*N] float32)``: summing ``part`` over ranks gives the
      merged output; ``lse`` is the merged LSE. float32 because the sum happens inside the
      reduce-scatter, where bf16 would round at every hop.
    """
    w, lse = merge_lse_weights(lses, axis=0)
    own_w = jax.lax.dynamic_index_in_dim(w, rank, 0, keepdims=True)
    return weighted_sum(own_w, out[None], axis=0), lse


def merge_partials(outs, lses):
    """A2A's local step: the exact merge of ``N`` partials of the same heads.

    ``outs [N, T, H, L]`` (any float dtype), ``lses [N, T, H]`` natural log -> ``(out [T, H, L]
    float32, lse [T, H] float32)``; all-empty rows give 0 and ``-inf``.
    """
    w, lse = merge_lse_weights(lses, axis=0)
    return weighted_sum(w, outs, axis=0), lse


def combine_ag_rs(out, lse, axis, rank, h):
    """LSE all-gather, local scaling, reduce-scatter (sum) of heads: ``[T, H*N] -> [T, H]``."""
    lses = jax.lax.all_gather(lse, axis)  # [N, T, H*N]: small
    part, lse_all = scale_own_partial(out, lses, rank)
    merged = jax.lax.psum_scatter(part, axis, scatter_dimension=1, tiled=True)
    return merged, jax.lax.dynamic_slice_in_dim(lse_all, rank * h, h, axis=1)


def to_head_owner_major(x, n):
    """``[T, N*H, ...] -> [N, T, H, ...]``: axis 0 = the rank that owns those heads."""
    t, hn = x.shape[:2]
    return jnp.moveaxis(x.reshape(t, n, hn // n, *x.shape[2:]), 1, 0)


def combine_a2a(out, lse, axis, n):
    """All-to-all the partials so each rank holds the ``N`` partials of its heads; merge locally."""
    # Before the exchange axis 0 is the heads' owner; after it, the partial's source rank.
    outs = jax.lax.all_to_all(to_head_owner_major(out, n), axis, 0, 0, tiled=True)
    lses = jax.lax.all_to_all(to_head_owner_major(lse, n), axis, 0, 0, tiled=True)
    return merge_partials(outs, lses)

