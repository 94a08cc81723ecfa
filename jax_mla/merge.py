"""Exact merging of partial attention results through their log-sum-exp (natural log).

A partial result over a KV subset is ``(out, lse)`` with ``out`` normalised over the subset and
``lse = log(sum(exp(scores)))``. Two disjoint subsets merge exactly:
``lse = log(e^la + e^lb)``, ``out = e^(la - lse) * oa + e^(lb - lse) * ob``.
An empty subset has ``lse = -inf`` and weight 0. ``+inf`` and NaN LSEs are read as ``-inf``: that
is FlashAttention's (and AITER's reducer's) empty-row convention, never a real value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sanitize_lse(lse: jax.Array) -> jax.Array:
    """float32 LSE with ``+inf`` and NaN (empty-row markers) turned into ``-inf``."""
    lse = lse.astype(jnp.float32)
    return jnp.where(jnp.isnan(lse) | (lse == jnp.inf), -jnp.inf, lse)


def merge_lse_weights(lses: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Weights and merged LSE for partials stacked on ``axis``.

    Returns ``(w, lse)``: ``w = exp(lse_i - lse)`` with ``sum_i w_i = 1`` (all 0 when every
    partial is empty) and ``lse`` the merged natural-log LSE (``-inf`` when all are empty).
    """
    lses = sanitize_lse(lses)
    m = jnp.max(lses, axis=axis, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.exp(lses - m)
    z = jnp.sum(e, axis=axis, keepdims=True)
    safe_z = jnp.where(z == 0, 1.0, z)
    w = e / safe_z
    lse = jnp.where(z == 0, -jnp.inf, m + jnp.log(safe_z))
    return w, jnp.squeeze(lse, axis)


def merge_attn_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Merge two partial attention results over disjoint KV sets.

    Args:
      out_a, out_b: ``[..., Dv]`` partial outputs, each normalised over its own KV set.
      lse_a, lse_b: ``[...]`` their log-sum-exp of scores, natural log (``-inf`` = empty).
    Returns:
      ``(out [..., Dv] in out_a's dtype, lse [...] float32)``. Both empty: out 0, lse ``-inf``.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"merge_attn_states: shapes differ: out {out_a.shape} vs {out_b.shape}, "
            f"lse {lse_a.shape} vs {lse_b.shape}"
        )
    if out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attn_states: lse shape {lse_a.shape} must equal out shape without its last "
            f"axis {out_a.shape[:-1]}"
        )
    w, lse = merge_lse_weights(jnp.stack([lse_a, lse_b]), axis=0)
    out = weighted_sum(w, jnp.stack([out_a, out_b]), axis=0)
    return out.astype(out_a.dtype), lse


def weighted_sum(w: jax.Array, outs: jax.Array, axis: int = 0) -> jax.Array:
    """``sum_i w_i * out_i`` in float32 over ``axis``; a zero weight contributes exactly 0.

    ``outs`` has one more trailing axis (``Dv``) than ``w``. An empty partial's output may be
    garbage (even NaN) in some kernels, so it is masked out, not multiplied by 0.
    """
    w = w[..., None]
    terms = jnp.where(w > 0, w * outs.astype(jnp.float32), 0.0)
    return jnp.sum(terms, axis=axis)
