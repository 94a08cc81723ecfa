"""AITER's query-head rules for MLA decode, as pure functions.

AITER's MLA decode kernels serve head counts that are multiples of 16 (natively, or by folding
32..128 into 16-head pseudo-rows). Other counts are padded. Padding is exact, not approximate:
MLA decode is independent per query head over one shared latent KV head, so a padded head that
duplicates a real head computes exactly that head's output, and unpadding picks the real ones.

Two maps, both bit-exact on the round trip:
- divisor counts (``padded % n == 0``, e.g. 1, 2, 4, 8 -> 16): padded head ``j`` is real head
  ``j // (padded // n)`` (``repeat``); unpad takes every ``padded // n``-th head.
- other counts (3, 5, ..., 24 -> 32): padded head ``j`` is real head ``j % n`` (tile, then slice);
  unpad takes the first ``n`` heads.
Aligned counts pass through untouched (the same array object, no copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_HEADS = 16  # AITER's smallest decode head group (_AITER_MIN_MLA_HEADS)
MAX_PADDED_HEADS = 128  # largest count AITER pads to (_AITER_MAX_PADDED_MLA_HEADS)


def is_valid_num_heads(n: int) -> bool:
    """True iff AITER can serve ``n`` query heads: ``0 < n <= 128`` or ``n % 16 == 0``."""
    n = int(n)
    return n > 0 and (n <= MAX_PADDED_HEADS or n % MIN_HEADS == 0)


def check_num_heads(n: int, what: str = "num_heads") -> None:
    """Raise ``ValueError`` naming ``what`` when AITER cannot serve ``n`` heads."""
    if not is_valid_num_heads(n):
        raise ValueError(
            f"{what}={n} cannot be served by AITER's MLA kernels: a head count must be in "
            f"1..{MAX_PADDED_HEADS} or a multiple of {MIN_HEADS}"
        )


def padded_num_heads(n: int, *, native_h24: bool = False) -> int:
    """Head count AITER's decode kernel sees for ``n`` real heads.

    ``ceil(n / 16) * 16``, except 24 stays 24 when the AITER build declares native 24-head support
    (both its reducer and its metadata planner; not the case at AITER HEAD, so 24 -> 32).
    """
    check_num_heads(n)
    n = int(n)
    if n == 24 and native_h24:
        return 24
    return -(-n // MIN_HEADS) * MIN_HEADS


def _resolve(n: int, x_heads: int, target: int | None) -> int:
    if x_heads != n:
        raise ValueError(f"x has {x_heads} heads on axis 1, expected n={n}")
    m = padded_num_heads(n) if target is None else int(target)
    if m < n:
        raise ValueError(f"target={m} is smaller than the real head count n={n}")
    return m


def pad_index(n: int, padded: int) -> jax.Array:
    """Real head each padded head copies: ``[padded]`` int32 (see the module docstring)."""
    j = jnp.arange(padded, dtype=jnp.int32)
    if padded % n == 0:
        return j // (padded // n)
    return j % n


def pad_heads(x: jax.Array, n: int, target: int | None = None) -> jax.Array:
    """Pad heads on axis 1 of ``x [T, n, ...]`` to ``target`` (default ``padded_num_heads(n)``).

    Returns ``x`` itself when no padding is needed; otherwise ``[T, target, ...]`` where padded
    head ``j`` equals real head ``j // (target // n)`` (divisor case) or ``j % n`` (tile case).
    """
    m = _resolve(n, x.shape[1], target)
    if m == n:
        return x
    if m % n == 0:
        return jnp.repeat(x, m // n, axis=1)
    reps = -(-m // n)
    return jnp.tile(x, (1, reps) + (1,) * (x.ndim - 2))[:, :m]


def unpad_heads(x: jax.Array, n: int, padded: int) -> jax.Array:
    """Inverse of :func:`pad_heads` on axis 1: ``[T, padded, ...] -> [T, n, ...]``.

    Divisor case: strided slice ``x[:, ::padded // n]``; tile case: prefix ``x[:, :n]``;
    ``padded == n``: ``x`` itself.
    """
    if x.shape[1] != padded:
        raise ValueError(f"x has {x.shape[1]} heads on axis 1, expected padded={padded}")
    if padded == n:
        return x
    if padded % n == 0:
        return x[:, :: padded // n]
    return x[:, :n]
