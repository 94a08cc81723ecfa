"""Device-side timing of jitted functions, and the machine's ceilings measured in the same run.

A call is timed as one jitted program that runs it ``n`` times back to back, each call chained to
the previous one's output through ``lax.optimization_barrier`` (no data moves, but XLA can neither
merge the calls nor reorder them). Wall time / ``n`` is then the GPU time of one call with the
single dispatch amortised; ``n`` grows until the program runs for about ``min_ms``. The median of
``reps`` runs is reported.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp


def _chained(fn, n):
    def many(*args):
        out = fn(*args)
        for _ in range(n - 1):
            args, _ = jax.lax.optimization_barrier((args, out))
            out = fn(*args)
        return out

    return jax.jit(many)


def _wall(f, args):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def device_time(fn, *args, min_ms: float = 3.0, reps: int = 5, max_n: int = 256) -> float:
    """Median seconds per call of ``fn(*args)`` (see the module docstring)."""
    one = jax.jit(fn)
    jax.block_until_ready(one(*args))
    est = min(_wall(one, args) for _ in range(3))
    n = int(max(2, min(max_n, (min_ms * 1e-3) // max(est, 1e-6))))
    many = _chained(fn, n)
    jax.block_until_ready(many(*args))
    return statistics.median(_wall(many, args) for _ in range(reps)) / n


def host_time(fn, *args, reps: int = 50) -> float:
    """Median wall seconds of one jitted call, dispatch included (latency as a caller sees it)."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    return statistics.median(_wall(f, args) for _ in range(reps))


@functools.cache
def ceilings() -> dict:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate measured here, now."""
    n = 1 << 29  # 1 GiB of bf16
    x = jnp.ones((n,), jnp.bfloat16) * 1.5
    t = device_time(lambda a: a * jnp.bfloat16(1.0001), x)
    copy = 2 * n * 2 / t
    m = 8192
    key = jax.random.key(0)
    a = jax.random.normal(key, (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    t = device_time(lambda p, q: p @ q, a, b)
    return {"copy_bytes_per_s": copy, "bf16_matmul_flops": 2 * m**3 / t}
