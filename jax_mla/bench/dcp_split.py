"""DCP on one device, simulated: the local attention at ``S / N`` plus the merge, and its share.

What one DCP rank computes in a step, timed on a single GPU with no collectives:

- local attention: :func:`jax_mla.mla_attention` over the busiest rank's shard (rank 0, which
  holds ``dcp_local_seq_lens(S, N, 0, I)`` tokens), for ``T = B * Q`` rows and the ``H * N``
  heads of the DCP group, with the per-row metadata the DCP entry builds
  (:func:`jax_mla.dcp_local_metadata`);
- merge, both combines: ``"ag_rs"`` = weights from the gathered LSEs ``[N, T, H*N]``, scaling
  this rank's partial to float32, and the additions the reduce-scatter performs (``N`` slices of
  ``[T, H, L]``); ``"a2a"`` = the local exact merge of the ``N`` received partials ``[N, T, H,
  L]``. Same functions the DCP entry runs (``jax_mla.dcp.scale_own_partial`` /
  ``merge_partials``).

Communication is not timed (it needs several GPUs); each row reports the bytes a device would
send per step in each combine instead, so the step time on a real mesh is this compute plus the
collectives at the fabric's bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla
from jax_mla.dcp import merge_partials, scale_own_partial


@dataclasses.dataclass(frozen=True)
class SplitShape:
    """One step: ``batch`` requests of global length ``seq``, ``heads`` query heads per device."""

    batch: int
    heads: int
    seq: int
    qlen: int = 1
    page: int = 64
    interleave: int = 1
    dtype: str = "bfloat16"
    kv_lora_rank: int = 512
    rope_dim: int = 64

    @property
    def name(self) -> str:
        return (f"B{self.batch} H{self.heads} S{self.seq} Q{self.qlen} p{self.page} "
                f"I{self.interleave}")


def _as_shape(s) -> SplitShape:
    """A :class:`SplitShape`, a dict of its fields, or any object with ``batch/heads/seq``."""
    if isinstance(s, SplitShape):
        return s
    if isinstance(s, dict):
        return SplitShape(**s)
    fields = {f.name for f in dataclasses.fields(SplitShape)}
    return SplitShape(**{k: getattr(s, k) for k in fields if hasattr(s, k)})


def _local_problem(shape: SplitShape, n: int, key):
    """Rank 0's inputs: ``q [T, H*N, D]``, its cache shard, its per-row metadata."""
    b, q_len, ps = shape.batch, shape.qlen, shape.page
    d = shape.kv_lora_rank + shape.rope_dim
    dt = jnp.dtype(shape.dtype)
    local = int(jax_mla.dcp_local_seq_lens(shape.seq, n, 0, shape.interleave))
    pages = max(1, math.ceil(local / ps))
    kq, kk = jax.random.split(key)
    q = jax.random.normal(kq, (b * q_len, shape.heads * n, d), jnp.float32).astype(dt)
    kv = jax.random.normal(kk, (b * pages, ps, d), jnp.float32).astype(dt)
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    md, _ = jax_mla.dcp_local_metadata(table, jnp.full((b,), shape.seq, jnp.int32), qlen=q_len,
                                       page_size=ps, world_size=n, rank=0,
                                       interleave=shape.interleave)
    return q, kv, md, local


def _partials(shape: SplitShape, n: int, out_dtype, key):
    """Random stand-ins for the merge inputs, ``-inf`` in a few rows (empty shards)."""
    t, h, lr = shape.batch * shape.qlen, shape.heads, shape.kv_lora_rank
    k1, k2 = jax.random.split(key)
    lses = jax.random.normal(k1, (n, t, h * n), jnp.float32) * 4.0
    lses = lses.at[1:, 0].set(-jnp.inf)
    own = jax.random.normal(k2, (t, h * n, lr), jnp.float32).astype(out_dtype)
    # What a rank holds after the all-to-all: N partials of its own H heads.
    recv = jnp.broadcast_to(own[None, :, :h], (n, t, h, lr))
    return own, lses, recv, lses[:, :, :h]


def _merge_ag_rs(n, h):
    def f(own, lses):
        part, lse = scale_own_partial(own, lses, 0)
        t, _, lr = part.shape
        # The reduce-scatter's additions: N slices of [T, H, L] summed (here, all local).
        return part.reshape(t, n, h, lr).sum(axis=1), lse[:, :h]

    return f


def _bytes_sent(shape: SplitShape, n: int, out_itemsize: int) -> dict:
    """Per device, per step, ring/pairwise: what each combine (and the q gather) sends."""
    t, h, lr = shape.batch * shape.qlen, shape.heads, shape.kv_lora_rank
    d = lr + shape.rope_dim
    q_item = jnp.dtype(shape.dtype).itemsize
    return {
        "q_gather_bytes": (n - 1) * t * h * d * q_item,
        "ag_rs_bytes": (n - 1) * t * h * n * 4 + (n - 1) * t * h * lr * 4,
        "a2a_bytes": (n - 1) * t * h * (lr * out_itemsize + 4),
    }


def bench_dcp_split(timer: Callable[..., float], *, backend: str = "auto",
                    shapes: Iterable, world_sizes=(2, 4, 8), scale: float = 192 ** -0.5,
                    seed: int = 0) -> list[dict]:
    """Time one DCP rank's compute on this device for every shape and world size.

    Args:
      timer: ``timer(fn, *args) -> float`` median seconds of one call of ``fn(*args)`` (e.g.
        ``jax_mla.bench.timing.device_time``); ``fn`` is a plain function of arrays/pytrees.
      backend: the local kernel (any :func:`jax_mla.mla_attention` backend).
      shapes: :class:`SplitShape` (or dicts of its fields, or objects with ``batch``, ``heads``,
        ``seq`` and optionally ``qlen``, ``page``): ``heads`` are per device, ``seq`` global.
      world_sizes: DCP sizes ``N`` to simulate.
    Returns:
      One dict per (shape, N): ``local_attn_s`` (rank 0's attention over its ``S / N`` shard,
      ``H * N`` heads), ``merge_ag_rs_s`` / ``merge_a2a_s`` (the merge arithmetic of each
      combine), ``merge_share_ag_rs`` / ``merge_share_a2a`` (merge / (attention + merge)), the
      bytes each combine would send, and ``simulated=True`` (no communication measured).
    """
    rows = []
    key = jax.random.key(seed)
    for raw in shapes:
        shape = _as_shape(raw)
        for n in world_sizes:
            if shape.page % shape.interleave:
                raise ValueError(f"{shape.name}: page={shape.page} must be a multiple of "
                                 f"interleave={shape.interleave}")
            key, k1, k2 = jax.random.split(key, 3)
            q, kv, md, local = _local_problem(shape, n, k1)

            def attn(q, kv, md, lr=shape.kv_lora_rank):
                return jax_mla.mla_attention(q, kv, md, scale=scale, backend=backend,
                                             return_lse=True, kv_lora_rank=lr)

            out_dtype = jax.eval_shape(attn, q, kv, md)[0].dtype
            own, lses, recv, recv_lses = _partials(shape, n, out_dtype, k2)
            t_attn = timer(attn, q, kv, md)
            t_rs = timer(_merge_ag_rs(n, shape.heads), own, lses)
            t_a2a = timer(merge_partials, recv, recv_lses)
            rows.append({
                "shape": shape.name, "backend": backend, "world_size": n,
                "batch": shape.batch, "seq_len": shape.seq, "local_seq_len": local,
                "qlen": shape.qlen, "heads_per_device": shape.heads,
                "gathered_heads": shape.heads * n, "dtype": shape.dtype,
                "local_attn_s": t_attn, "merge_ag_rs_s": t_rs, "merge_a2a_s": t_a2a,
                "merge_share_ag_rs": t_rs / (t_attn + t_rs),
                "merge_share_a2a": t_a2a / (t_attn + t_a2a),
                **_bytes_sent(shape, n, np.dtype(out_dtype).itemsize),
                "simulated": True,
                "note": "one device: rank 0's compute only; collectives not timed",
            })
    return rows
