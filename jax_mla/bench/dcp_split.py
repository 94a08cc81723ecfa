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

Run: ``python -m jax_mla.bench.dcp_split --out DIR`` (the grid of :func:`target_shapes`:
B 32/128, H 16 per device, S 32k/128k, N 2/4/8; about a minute on one H200) or ``--quick``
(tiny shapes, seconds on a CPU). Writes ``DIR/dcp_split.json`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
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


def target_shapes(quick: bool = False) -> list[SplitShape]:
    """The DCP grid (B 32-128, H 16, total context 32k-128k, decode) or a CPU smoke grid."""
    if quick:
        return [SplitShape(batch=2, heads=2, seq=200, page=16, dtype="float32", kv_lora_rank=64,
                           rope_dim=16),
                SplitShape(batch=2, heads=2, seq=64, qlen=2, page=16, interleave=2,
                           dtype="float32", kv_lora_rank=64, rope_dim=16)]
    return [SplitShape(batch=b, heads=16, seq=s) for b in (32, 128) for s in (32768, 131072)]


def _timer(fn, *args, min_ms: float, max_n: int, reps: int) -> float:
    """``device_time``, except that a call already longer than ``min_ms`` is timed as is.

    Dispatch overhead (tens of microseconds) is noise next to such a call, and skipping the
    chained program saves one compile per shape (most of this bench's wall time).
    """
    import statistics
    import time

    from jax_mla.bench.timing import device_time

    f = jax.jit(fn)
    jax.block_until_ready(f(*args))

    def wall():
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        return time.perf_counter() - t0

    if min(wall() for _ in range(2)) * 1e3 < min_ms:
        return device_time(fn, *args, min_ms=min_ms, reps=reps, max_n=max_n)
    return statistics.median(wall() for _ in range(reps))


COLUMNS = ["shape", "world_size", "local_seq_len", "gathered_heads", "local_attn_s",
           "merge_ag_rs_s", "merge_a2a_s", "merge_share_ag_rs", "merge_share_a2a", "ag_rs_bytes",
           "a2a_bytes"]


def main(argv=None) -> int:
    from jax_mla.bench.__main__ import DEFAULT_OUT, environment, print_table, write

    p = argparse.ArgumentParser(prog="python -m jax_mla.bench.dcp_split",
                                description="One DCP rank's compute on one device (simulated "
                                            "split): local attention at S/N plus the merge.")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--backend", default="auto", help="the local kernel (default: auto)")
    p.add_argument("--world-sizes", default="2,4,8", help="DCP sizes N (comma list)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    env = environment()
    print(json.dumps(env))
    # Merges take microseconds: cap the chained repeats so compile time stays small.
    timer = functools.partial(_timer, min_ms=0.5 if args.quick else 2.0,
                              max_n=4 if args.quick else 32, reps=3 if args.quick else 5)
    rows = bench_dcp_split(timer, backend=args.backend, shapes=target_shapes(args.quick),
                           world_sizes=tuple(int(n) for n in args.world_sizes.split(",")),
                           seed=args.seed)
    print_table(rows, COLUMNS)
    env["note"] = ("simulated DCP on one device: rank 0's local attention and merge arithmetic; "
                   "no collective was run or timed (multi-GPU runs: not made)")
    write(rows, env, args.out, "dcp_split")
    print(f"wrote {args.out}/dcp_split.json and .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
