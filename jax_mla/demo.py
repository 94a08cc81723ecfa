"""``python -m jax_mla demo``: decode and verify steps on a DeepSeek-shaped paged cache.

Each step is one jitted function, as a model would run it: write the new tokens' latents into the
cache (donated, in place), build the step's metadata and plan once (``build_decode_metadata``
with the query and cache as examples), run ``mla_attention``. The error against a float64 NumPy
oracle and the time per step are printed.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla
from jax_mla.testing import numpy_mla_decode, rel_err


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16, help="query heads per rank (TP8: 16)")
    p.add_argument("--context", type=int, default=2048, help="mean prompt length")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--verify-steps", type=int, default=2)
    p.add_argument("--verify-qlen", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=None)


@functools.partial(jax.jit, static_argnames=("page_size", "qlen", "backend", "scale"),
                   donate_argnums=0)
def step(cache, kv_c, k_pe, slots, q, block_table, seq_lens, *, page_size, qlen, backend, scale):
    """One model step: write new tokens, build metadata, attend. Returns ``(cache, out, lse)``."""
    cache = jax_mla.write_kv_cache(cache, kv_c, k_pe, slots)
    md = jax_mla.build_decode_metadata(block_table, seq_lens, page_size=page_size, qlen=qlen,
                                       q=q, kv_cache=cache, return_lse=True, backend=backend)
    out, lse = jax_mla.mla_attention(q, cache, md, scale=scale, backend=backend, return_lse=True)
    return cache, out, lse


def run(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    lr, rd, ps, b, h = 512, 64, args.page_size, args.batch, args.heads
    dtype = jnp.dtype(args.dtype)
    steps = [1] * args.decode_steps + [args.verify_qlen] * args.verify_steps
    lens = np.maximum(1, rng.normal(args.context, args.context / 4, b)).astype(np.int32)
    cap_tokens = int(lens.max()) + sum(steps)
    max_pages = -(-cap_tokens // ps)
    num_pages = b * max_pages + 1
    # Permuted pages; every slot starts as NaN so a stray read would show.
    block_table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    cache = jnp.full((num_pages, ps, lr + rd), jnp.nan, dtype)
    scale = float(1.0 / np.sqrt(192.0))

    def slots_for(starts, n):
        pos = starts[:, None] + np.arange(n)[None]
        return (block_table[np.arange(b)[:, None], pos // ps] * ps + pos % ps).reshape(-1)

    write = jax.jit(jax_mla.write_kv_cache, donate_argnums=0)
    prompt_slots = np.concatenate([block_table[i, np.arange(n) // ps] * ps + np.arange(n) % ps
                                   for i, n in enumerate(lens)])
    tot = int(lens.sum())
    cache = write(cache, jnp.asarray(rng.standard_normal((tot, lr)), dtype),
                  jnp.asarray(rng.standard_normal((tot, rd)), dtype),
                  jnp.asarray(prompt_slots, jnp.int32))
    rows = []
    seq = lens.copy()
    for i, qlen in enumerate(steps):
        kv_c = jnp.asarray(rng.standard_normal((b * qlen, lr)), dtype)
        k_pe = jnp.asarray(rng.standard_normal((b * qlen, rd)), dtype)
        slots = jnp.asarray(slots_for(seq, qlen), jnp.int32)
        seq = seq + qlen
        q = jnp.asarray(rng.standard_normal((b * qlen, h, lr + rd)), dtype)
        args_ = (kv_c, k_pe, slots, q, jnp.asarray(block_table), jnp.asarray(seq))
        kw = dict(page_size=ps, qlen=qlen, backend=args.backend, scale=scale)
        t0 = time.perf_counter()
        cache, out, lse = step(cache, *args_, **kw)
        out.block_until_ready()
        first = time.perf_counter() - t0
        # Time a second run of the same step shape on a copy (the first includes compilation).
        t0 = time.perf_counter()
        c2, out2, _ = step(cache.copy(), *args_, **kw)
        out2.block_until_ready()
        warm = time.perf_counter() - t0
        del c2
        want_o, want_l = numpy_mla_decode(
            np.asarray(q.astype(jnp.float32)), np.asarray(cache.astype(jnp.float32)),
            block_table, seq, qlen=qlen, scale=scale, kv_lora_rank=lr)
        rows.append(dict(step=i, kind="decode" if qlen == 1 else f"verify q={qlen}",
                         rel_err_out=rel_err(out.astype(jnp.float32), want_o),
                         max_err_lse=float(np.max(np.abs(np.asarray(lse) - want_l))),
                         first_ms=first * 1e3, step_ms=warm * 1e3))
    return rows


def main(args) -> int:
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; backends available: "
          f"{jax_mla.available_backends()}; using backend={args.backend!r}")
    print(f"DeepSeek geometry L=512 R=64, B={args.batch}, H={args.heads}, page {args.page_size}, "
          f"{args.dtype}, mean context {args.context}")
    rows = run(args)
    print(f"{'step':>4}  {'kind':<11} {'rel err out':>12} {'max |dlse|':>11} {'1st ms':>9} "
          f"{'step ms':>9}")
    for r in rows:
        print(f"{r['step']:>4}  {r['kind']:<11} {r['rel_err_out']:12.2e} {r['max_err_lse']:11.2e} "
              f"{r['first_ms']:9.1f} {r['step_ms']:9.2f}")
    tol = 1e-5 if args.dtype == "float32" else 1e-2
    worst = max(r["rel_err_out"] for r in rows)
    ok = worst < tol
    print(f"worst relative error {worst:.2e} ({'OK' if ok else 'FAIL'}: tolerance {tol:g})")
    return 0 if ok else 1
