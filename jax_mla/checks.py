"""Checks of the *values* inside arrays: page indices, lengths, slots, scales.

Every rule is checked on every path, in one of three modes:

- **eager** (the arrays are concrete: a call outside ``jax.jit``): a ``ValueError`` naming the
  argument, the rule and the first offending value, before any kernel runs;
- **checked** (inside :func:`checked`, under ``jax.jit`` too): the same rule as a
  ``jax.experimental.checkify`` check; the caller gets an error value and throws it;
- **unchecked** (traced, outside :func:`checked`): nothing is checked and the result is the one
  ``docs/design.md`` (*Bad values*) defines, the same on every backend: page indices are clamped
  into the cache, lengths into the block table's capacity, slots outside the cache are skipped,
  fp8 writes saturate. No kernel ever reads or writes out of bounds.

Static arguments (shapes, dtypes, ``scale``) are checked at trace time in every mode.
"""

from __future__ import annotations

import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

_CHECKED = contextvars.ContextVar("jax_mla_checked", default=False)


def checked(fn):
    """``fn`` with jax_mla's value checks compiled in: returns ``(error, out)``.

    ``fn`` may call any jax_mla function, and be jitted whole: ``err, out =
    jax.jit(jax_mla.checked(step))(...)``, then ``err.throw()`` raises the first failed check
    (a ``jax.experimental.checkify.JaxRuntimeError`` naming the argument, the rule and the
    value), or does nothing. Checks are extra device work: use it to validate a serving loop's
    inputs, not on every step.
    """
    from jax.experimental import checkify

    if hasattr(fn, "lower") and hasattr(fn, "__wrapped__"):
        # A jax.jit-wrapped function: its cached trace may predate the checks; trace the
        # function itself (jit the result instead).
        fn = fn.__wrapped__

    @functools.wraps(fn)
    def with_checks(*args, **kwargs):
        token = _CHECKED.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _CHECKED.reset(token)

    return checkify.checkify(with_checks, errors=checkify.user_checks)


def checking() -> bool:
    """Whether traced values are being checked (inside :func:`checked`)."""
    return _CHECKED.get()


def is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def expect(ok, message: str, **values) -> None:
    """Require ``ok`` (a boolean scalar, concrete or traced); ``message`` is formatted with
    ``values`` (scalars, concrete or traced) in both modes."""
    if is_concrete(ok, *values.values()):
        if not bool(np.asarray(ok)):
            raise ValueError(message.format(**{k: _py(v) for k, v in values.items()}))
    elif checking():
        from jax.experimental import checkify

        checkify.check(jnp.asarray(ok), message,
                       **{k: jnp.asarray(v) for k, v in values.items()})


def _skip(*xs) -> bool:
    """Traced and unchecked: nothing to do (no op is even traced)."""
    return not is_concrete(*xs) and not checking()


def _host(*xs):
    """Concrete arrays through one host copy, unsharded (whatever their sharding); traced ones
    as they are."""
    return tuple(jnp.asarray(_on_this_host(x)) if is_concrete(x) else x for x in xs)


def _on_this_host(x) -> np.ndarray:
    """The whole of ``x`` as a NumPy array, also when other processes hold parts of it.

    A multi-process array (DCP across hosts: rank-local block tables and lengths sharded over
    the processes' devices) cannot be read where it is not held; every process gathers it
    instead. The checked arrays are metadata (kilobytes), never a KV cache, and every process
    runs the same checks in the same order, so the gathers pair up.
    """
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _py(v):
    a = np.asarray(v)
    return a.item() if a.ndim == 0 else a


# --- the rules ---------------------------------------------------------------------------------

def static_scale(scale, name: str = "scale") -> float:
    """A softmax scale: a Python (or NumPy) real, finite and positive. It is a compile-time
    constant, so a traced value cannot serve, and a NaN would recompile on every call."""
    if isinstance(scale, jax.core.Tracer):
        raise TypeError(f"{name} must be a Python float (it is static, part of the compiled "
                        f"program), got a traced value: pass float(...) of a concrete number")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


def scale_values(value, name: str) -> None:
    """A dequantisation / quantisation scale array: every entry finite and > 0."""
    if _skip(value):
        return
    (value,) = _host(value)
    v = jnp.asarray(value, jnp.float32).reshape(-1)
    if v.size == 0:
        raise ValueError(f"{name} is empty: pass one float32 scale")
    bad = ~(jnp.isfinite(v) & (v > 0))
    expect(~jnp.any(bad), f"{name} must be finite and > 0, got {{value}}",
           value=v[jnp.argmax(bad)])


def cache_scale(scale, cache_dtype, fp8: bool, name: str) -> None:
    """The dequantisation multiplier of a cache (``kv_scale``, ``k_scale``): only with an fp8
    cache (``fp8``; every backend would otherwise have to guess whether to apply it), finite
    and > 0."""
    if scale is None:
        return
    if not fp8:
        raise ValueError(f"{name} is the dequantisation multiplier of an fp8 cache; this cache "
                         f"is {jnp.dtype(cache_dtype).name}: pass {name}=None")
    scale_values(scale, name)


def seq_lens_in_capacity(seq_lens, capacity: int, name: str = "seq_lens",
                         capacity_is: str = "max_pages * page_size of the block table") -> None:
    """Lengths in ``[0, capacity]`` (by default ``max_pages * page_size`` of the block table)."""
    if seq_lens.size == 0 or _skip(seq_lens):
        return
    (seq_lens,) = _host(seq_lens)
    bad = (seq_lens < 0) | (seq_lens > capacity)
    i = jnp.argmax(bad)
    value = jnp.sum(jnp.where(jnp.arange(seq_lens.shape[0]) == i, seq_lens, 0))  # no gather
    expect(~jnp.any(bad), f"{name}[{{i}}] = {{value}} must lie in [0, {capacity}] "
           f"({capacity_is})", i=i, value=value)


def pages_in_cache(block_table, seq_lens, page_size: int, num_pages: int,
                   name: str = "block_table", ranks: int = 1) -> None:
    """Every page a request reads (the first ``ceil(seq_lens[b] / page_size)`` entries of its
    row) lies in ``[0, num_pages)``; unused entries may hold anything. ``ranks > 1``: the rows
    are ``ranks`` DCP ranks' local tables, rank-major, each against its own local cache."""
    if block_table.size == 0 or _skip(block_table, seq_lens):
        return
    block_table, seq_lens = _host(block_table, seq_lens)
    rows, width = block_table.shape
    used = -(-jnp.clip(seq_lens, 0, width * page_size) // page_size)
    cols = jnp.arange(width)
    bad = (cols[None, :] < used[:, None]) & ((block_table < 0) | (block_table >= num_pages))
    # The first bad entry by reductions only (no gather): sharded tables (DCP) stay sharded.
    row_ids = jnp.arange(rows)
    b = jnp.argmax(jnp.any(bad, axis=1))
    at_b = row_ids[:, None] == b
    j = jnp.argmax(jnp.any(bad & at_b, axis=0))
    value = jnp.sum(jnp.where(at_b & (cols[None, :] == j), block_table, 0))
    where, values = f"{name}[{{b}}, {{j}}] = {{value}}: row {{b}}", {}
    b_show = b
    if ranks > 1:
        per_rank = rows // ranks
        where = f"{name}[{{rank}}][{{b}}, {{j}}] = {{value}}: row {{b}} of rank {{rank}}"
        values = {"rank": b // per_rank}
        b_show = b % per_rank
    cache = "its rank's local cache" if ranks > 1 else "the cache"
    expect(~jnp.any(bad), f"{where} reads that page, and every page a request reads must lie "
           f"in [0, num_pages={num_pages}) of {cache}", b=b_show, j=j, value=value, **values)
