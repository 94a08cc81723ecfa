"""Token sampling on the device: greedy, temperature, top-k and top-p, one setting per row.

``sample(logits, key, params)`` turns ``logits [S, V]`` into ids ``[S]`` inside the jitted
step, so only the ids cross to the host. Each row has its own temperature, top-k and top-p
(arrays, so changing them never recompiles); a row with ``temperature == 0`` is greedy.

Top-k and top-p act on the ``cap`` largest logits of each row (``lax.top_k``, static ``cap``):
exact when ``top_k <= cap`` and the top-p nucleus fits in ``cap`` tokens, as it does for any
``cap`` when ``top_p`` is small. ``cap = V`` makes top-p exact for every row, at the cost of a
full sort.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row settings, ``[S]`` arrays.

    temperature: float32; ``0`` is greedy (argmax), else logits are divided by it.
    top_k: int32; keep the ``k`` largest logits (``0``: no limit beyond the cap).
    top_p: float32 in ``(0, 1]``; keep the smallest set of tokens whose probability reaches it.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def greedy(cls, rows: int) -> SamplingParams:
        return cls(jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.int32),
                   jnp.ones((rows,), jnp.float32))


def sample(logits, key, params: SamplingParams | None, *, cap: int = 256):
    """``logits [S, V]`` float -> ids ``[S]`` int32.

    ``params`` None: greedy for every row (an argmax; no random numbers drawn). ``cap``: static
    number of candidates top-k / top-p choose among (clipped to ``V``).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if params is None:
        return greedy
    s, v = logits.shape
    cap = min(int(cap), v)
    vals, idx = jax.lax.top_k(logits.astype(jnp.float32), cap)  # [S, cap], descending
    temp = jnp.maximum(params.temperature, 1e-6)[:, None]
    vals = vals / temp
    rank = jnp.arange(cap, dtype=jnp.int32)[None]
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, cap), cap)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
    # Top-p: a candidate stays while the mass before it is below top_p (the first always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep &= before < params.top_p[:, None]
    choice = jax.random.categorical(key, jnp.where(keep, vals, -jnp.inf), axis=-1)
    drawn = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)
