"""Rotary embedding of MLA's rope part, with DeepSeek's YaRN scaling.

Only ``qk_rope_head_dim`` of each query head and the one shared ``k_pe`` are rotated. DeepSeek's
checkpoints lay the rotary dimensions out in interleaved pairs ``(x0, x1), (x2, x3), ...``
(``rope_interleave=True``); the rotation returns them de-interleaved, ``[x_even' | x_odd']``,
as transformers and vLLM do, so queries and cached keys agree. With ``rope_interleave=False`` the
pairs are ``(x_i, x_{i + R/2})`` (the ``rotate_half`` form).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jax_mla.model.config import MLAConfig, yarn_mscale


def inv_freq(cfg: MLAConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq [R/2] float32, attention_factor)``: the rotary frequencies and the factor
    the cos/sin tables are multiplied by (1 without YaRN)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrap = (1.0 / pos_freqs).astype(np.float32)
    y = cfg.rope_scaling
    if y is None:
        return extrap, 1.0
    interp = (1.0 / (y.factor * pos_freqs)).astype(np.float32)

    def correction_dim(rotations):
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (high frequencies), 0: interpolate
    freqs = (interp * (1 - keep) + extrap * keep).astype(np.float32)
    if y.attention_factor is not None:
        factor = float(y.attention_factor)
    else:
        factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    return freqs, factor


def rope_cos_sin(cfg: MLAConfig, positions, dtype):
    """``cos, sin [T, R/2]`` in ``dtype`` for int ``positions [T]`` (computed in float32)."""
    freqs, factor = inv_freq(cfg)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]
    return ((jnp.cos(angles) * factor).astype(dtype), (jnp.sin(angles) * factor).astype(dtype))


def apply_rope(x, cos, sin, *, interleave: bool):
    """Rotate ``x [T, ..., R]`` by ``cos, sin [T, R/2]`` (broadcast over the middle axes).

    Returns ``[x1 cos - x2 sin | x2 cos + x1 sin]`` with ``(x1, x2)`` the even/odd dimensions
    (``interleave``) or the two halves.
    """
    r = x.shape[-1]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : r // 2], x[..., r // 2:]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (r // 2,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
