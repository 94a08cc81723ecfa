"""The paged latent KV cache: layout, writes, fp8 storage.

Layout ``kv_cache [num_pages, page_size, D]`` with ``D = L + R``; each row is ``[kv_c (L) | k_pe
(R)]`` for one token (DeepSeek: L=512, R=64, so D=576). Token ``slot`` lives at page
``slot // page_size``, row ``slot % page_size``. One latent KV head is shared by all query heads.

fp8 caches (``float8_e4m3fn``, ``float8_e4m3fnuz``, ``float8_e5m2``) store ``x / k_scale`` with one
per-tensor float32 scale, saturated to the format's largest finite value (as vLLM and AITER
quantise: a value past the range is stored as that maximum, not as NaN); readers dequantise with
``x = fp8 * k_scale``. :func:`calibrate_fp8_scale` picks that scale from sample activations.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import checks

FP8_DTYPES = tuple(
    jnp.dtype(d) for d in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
)
FLOAT_DTYPES = tuple(jnp.dtype(d) for d in ("bfloat16", "float16", "float32"))


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def check_cache(kv_cache, what: str = "kv_cache") -> None:
    """Raise a clear error unless ``kv_cache`` is ``[num_pages, page_size, D]`` float or fp8."""
    if kv_cache.ndim != 3:
        raise ValueError(
            f"{what} must be [num_pages, page_size, D], got shape {tuple(kv_cache.shape)}"
        )
    dt = jnp.dtype(kv_cache.dtype)
    if dt not in FLOAT_DTYPES + FP8_DTYPES:
        raise TypeError(f"{what} dtype {dt} is not one of bf16, fp16, fp32 or fp8")


def write_kv_cache(kv_cache, kv_c, k_pe, slot_mapping, *, k_scale=None):
    """Write new tokens' latents into the paged cache; returns the updated cache.

    Args:
      kv_cache: ``[num_pages, page_size, L + R]``.
      kv_c: ``[N, L]`` compressed latents (after the KV norm).
      k_pe: ``[N, R]`` (or ``[N, 1, R]``) rotary key part.
      slot_mapping: ``[N]`` int32 flat slots ``page * page_size + row``; ``-1`` (any negative or
        out-of-range slot) is skipped, as vLLM does for padding tokens and for tokens another DCP
        rank owns. Values that do not fit int32 are an error (they would wrap onto another
        slot); an int64 array under ``jax_enable_x64`` is compared before any cast.
      k_scale: per-tensor float32 scale for fp8 caches (default 1.0), finite and > 0; ignored
        for other caches.

    Jittable. To update in place, donate the cache:
    ``step = jax.jit(write_kv_cache, donate_argnums=0)``.
    """
    check_cache(kv_cache)
    kv_c, k_pe = jnp.asarray(kv_c), jnp.asarray(k_pe)
    if not isinstance(slot_mapping, jax.Array):  # lists too; NumPy keeps int64 for the check
        slot_mapping = np.asarray(slot_mapping)
    if k_pe.ndim == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    if kv_c.ndim != 2 or k_pe.ndim != 2:
        raise ValueError(
            f"kv_c must be [N, L] and k_pe [N, R]; got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}"
        )
    n, lrank = kv_c.shape
    if k_pe.shape[0] != n or slot_mapping.shape != (n,):
        raise ValueError(
            f"kv_c [N={n}, L], k_pe {tuple(k_pe.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must agree on N"
        )
    if lrank + k_pe.shape[1] != kv_cache.shape[2]:
        raise ValueError(
            f"kv_c width L={lrank} plus k_pe width R={k_pe.shape[1]} must equal the cache width "
            f"D={kv_cache.shape[2]}"
        )
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise TypeError(f"slot_mapping must be an integer array, got {slot_mapping.dtype}")
    if checks.is_concrete(slot_mapping) and slot_mapping.size:
        s = np.asarray(slot_mapping)
        wide = (s < np.iinfo(np.int32).min) | (s > np.iinfo(np.int32).max)
        if wide.any():
            i = int(np.argmax(wide))
            raise ValueError(
                f"slot_mapping[{i}] = {int(s[i])} does not fit int32: slots are page * page_size "
                f"+ row < {kv_cache.shape[0] * kv_cache.shape[1]} (negative: skipped)")
    if k_scale is not None and is_fp8(kv_cache.dtype):
        checks.scale_values(k_scale, "k_scale")
    return _write(kv_cache, kv_c, k_pe, slot_mapping, k_scale)


@jax.jit
def _write(kv_cache, kv_c, k_pe, slot_mapping, k_scale):
    num_pages, page_size, d = kv_cache.shape
    rows = jnp.concatenate([kv_c, k_pe], axis=-1)
    rows = quantize(rows, kv_cache.dtype, k_scale)
    cap = num_pages * page_size
    # Skipped slots are pointed past the end and dropped by the scatter (compared in the slots'
    # own width, then cast: nothing wraps onto a real slot).
    skip = (slot_mapping < 0) | (slot_mapping >= cap)
    slots = jnp.where(skip, cap, slot_mapping).astype(jnp.int32)
    flat = kv_cache.reshape(cap, d).at[slots].set(rows, mode="drop")
    return flat.reshape(num_pages, page_size, d)


def quantize(x, dtype, scale=None):
    """Cast ``x`` to the cache dtype; fp8 stores ``x / scale`` (scale defaults to 1.0),
    saturated to the format's finite range (NaN stays NaN)."""
    dtype = jnp.dtype(dtype)
    if is_fp8(dtype):
        s = jnp.float32(1.0) if scale is None else jnp.asarray(scale, jnp.float32)
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(dtype)
    return x.astype(dtype)


def dequantize(x, scale=None):
    """float32 view of cache rows: ``fp8 * scale`` for fp8, a plain cast otherwise."""
    y = x.astype(jnp.float32)
    if is_fp8(x.dtype) and scale is not None:
        y = y * jnp.asarray(scale, jnp.float32)
    return y


def calibrate_fp8_scale(samples, dtype=jnp.float8_e4m3fn, *, margin: float = 1.0):
    """The per-tensor float32 scale that maps the samples' largest magnitude onto ``dtype``'s.

    ``scale = amax(|samples|) * margin / finfo(dtype).max``, so that ``quantize(x, dtype,
    scale)`` stores the sampled ``amax`` as the format's largest finite value (``margin > 1``
    leaves headroom for later activations, which past it saturate).

    Args:
      samples: an array, or a list/tuple of arrays of any shapes (e.g. ``kv_c [N, L]`` and
        ``k_pe [N, R]`` of several batches): one scale covers them all.
      dtype: the fp8 format (``float8_e4m3fn``, ``float8_e4m3fnuz``, ``float8_e5m2``). Static.
      margin: a finite Python float > 0. Static.

    Returns:
      a float32 scalar, finite and > 0 (what ``write_kv_cache``'s ``k_scale`` and the
      ``q_scale``/``kv_scale`` arguments accept). Non-finite samples (NaN, inf) are ignored:
      they cannot be stored in range whatever the scale. With no finite non-zero sample (all
      zeros, empty) it is 1.0, the caches' default scale; a scale that would underflow to 0
      or overflow float32 is 1.0 too.

    Jittable (the arrays may be traced).
    """
    dtype = jnp.dtype(dtype)
    if not is_fp8(dtype):
        raise TypeError(f"dtype {dtype} is not an fp8 format ({', '.join(map(str, FP8_DTYPES))})")
    if isinstance(margin, jax.core.Tracer) or not isinstance(margin, (int, float, np.floating)):
        raise TypeError(f"margin must be a Python float, got {margin!r}")
    if not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"margin must be finite and > 0, got {margin}")
    parts = samples if isinstance(samples, (list, tuple)) else [samples]
    amax = jnp.float32(0.0)
    for x in parts:
        a = jnp.abs(jnp.asarray(x).astype(jnp.float32)).reshape(-1)
        # Selected, not multiplied: a NaN or inf sample must not reach the max.
        amax = jnp.maximum(amax, jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), initial=0.0))
    scale = amax / float(jnp.finfo(dtype).max) * jnp.float32(margin)
    return jnp.where(jnp.isfinite(scale) & (scale > 0), scale, 1.0).astype(jnp.float32)


def quantize_per_tensor(x, dtype, scale=None):
    """``(quantize(x, dtype, scale), scale)`` with one float32 scale for the whole of ``x``;
    ``scale`` None: :func:`calibrate_fp8_scale` of ``x`` itself (a dynamic per-tensor scale, as
    vLLM quantises activations)."""
    scale = calibrate_fp8_scale(x, dtype) if scale is None else (
        jnp.asarray(scale, jnp.float32).reshape(()))
    return quantize(x, dtype, scale), scale
