"""Prefill benchmark and GPU correctness check (MHA form, qk 192 / v 128; docs/design.md §10).

``bench_prefill(timer, shapes=...)`` times every backend on the same inputs in one run and
reports microseconds and TFLOP/s with FlashAttention's FLOP count, using exact causal pair counts
per sequence. ``gpu_check_prefill()`` measures max errors of every backend against a float32
dense reference at a few realistic shapes, chunked context included. ``python -m
jax_mla.bench.prefill`` runs both and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.backends.triton.launch import triton_importable
from jax_mla.backends.triton.prefill import TUNING_CONFIGS, PrefillTritonConfig
from jax_mla.context import mla_prefill_with_context
from jax_mla.prefill import mla_prefill
from jax_mla.problem import current_platform

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    """One benchmark point: packed sequences of ``seq_lens`` tokens each (queries = keys)."""

    seq_lens: tuple[int, ...]
    heads: int
    dqk: int = 192
    dv: int = 128
    causal: bool = True
    tag: str = ""

    @property
    def name(self) -> str:
        lens = self.seq_lens
        mean = int(np.mean(lens))
        s = f"B{len(lens)} S{lens[0]}" if len(set(lens)) == 1 else f"B{len(lens)} varlen~{mean}"
        return f"{s} H{self.heads} {self.dqk}/{self.dv}{'' if self.causal else ' noncausal'}"


def uniform(batch: int, seq: int, heads: int, **kw) -> PrefillShape:
    return PrefillShape((seq,) * batch, heads, **kw)


def target_shapes(quick: bool = False) -> list[PrefillShape]:
    """The prefill grid: 16 and 128 heads, 192/128, causal; long sequences at 16k tokens per call
    (tritonbench's B*S = 16k), short ones (128..1k) with many requests, a varlen mix, and one
    non-causal point for the non-causal FA aim."""
    if quick:
        return [uniform(2, 1024, 16, tag="quick"), uniform(16, 128, 16, tag="quick")]
    s = [uniform(max(1, 16384 // n), n, h, tag="long") for h in (16, 128)
         for n in (2048, 4096, 8192, 16384, 32768)]
    s += [uniform(16384 // n, n, h, tag="short") for h in (16, 128) for n in (128, 256, 512, 1024)]
    rng = np.random.default_rng(0)
    mix = tuple(int(x) for x in np.clip(rng.normal(2048, 1024, 8), 64, 8192))
    s += [PrefillShape(mix, h, tag="varlen") for h in (16, 128)]
    s += [uniform(2, 8192, 16, causal=False, tag="noncausal")]
    return s


def attention_flops(lens_q, lens_k, heads: int, dqk: int, dv: int, causal: bool) -> float:
    """``2 * H * (Dqk + Dv) * visible (query, key) pairs``; causal pairs counted exactly per
    sequence with the bottom-right mask (``s (s + 1) / 2`` when ``sq == sk == s``)."""
    pairs = 0
    for sq, sk in zip(lens_q, lens_k):
        sq, sk = int(sq), int(sk)
        if not causal:
            pairs += sq * sk
            continue
        i = np.arange(sq, dtype=np.int64)
        pairs += int(np.clip(i + sk - sq + 1, 0, sk).sum())
    return 2.0 * heads * (dqk + dv) * pairs


def _cu(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def _inputs(shape: PrefillShape, dtype, key):
    t = int(sum(shape.seq_lens))
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (t, shape.heads, shape.dqk), dtype)
    k = jax.random.normal(kk, (t, shape.heads, shape.dqk), dtype)
    v = jax.random.normal(kv, (t, shape.heads, shape.dv), dtype)
    return q, k, v, _cu(shape.seq_lens)


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def bench_prefill(timer, *, shapes=None, backends=("xla", "triton"), dtype=jnp.bfloat16,
                  config: PrefillTritonConfig | None = None, seed: int = 0) -> list[dict]:
    """Time :func:`jax_mla.mla_prefill` on every shape and backend, same inputs for all.

    Args:
      timer: ``timer(fn, *args) -> median seconds`` of one call (e.g.
        ``jax_mla.bench.timing.device_time``); ``fn`` is jittable.
      shapes: :class:`PrefillShape` list (default :func:`target_shapes`).
      backends: prefill backends; ones that cannot run here are skipped.
      dtype: input dtype (bf16 for the targets).
      config: Triton tile config (default: picked by head dims), for tuning.
    Returns:
      One dict per (shape, backend): ``shape``, ``tag``, ``backend``, ``batch``, ``heads``,
      ``tokens``, ``max_seqlen``, ``dqk``, ``dv``, ``causal``, ``us``, ``TFLOPs``, and when the
      XLA backend ran too, ``speedup_vs_xla`` and ``rel_err_vs_xla`` (of the output).
    """
    platform = current_platform()
    shapes = target_shapes() if shapes is None else shapes
    runnable = [b for b in backends if b == "xla" or triton_importable(platform)]
    rows = []
    for i, shape in enumerate(shapes):
        q, k, v, cu = _inputs(shape, dtype, jax.random.key(seed + i))
        smax = max(shape.seq_lens)
        flops = attention_flops(shape.seq_lens, shape.seq_lens, shape.heads, shape.dqk, shape.dv,
                                shape.causal)
        outs = {}
        for backend in runnable:
            fn = functools.partial(mla_prefill, scale=shape.dqk ** -0.5, causal=shape.causal,
                                   max_seqlen=smax, backend=backend,
                                   config=config if backend == "triton" else None)
            sec = timer(fn, q, k, v, cu)
            outs[backend] = jax.jit(fn)(q, k, v, cu)
            rows.append(dict(shape=shape.name, tag=shape.tag, backend=backend,
                             batch=len(shape.seq_lens), heads=shape.heads,
                             tokens=int(sum(shape.seq_lens)), max_seqlen=smax, dqk=shape.dqk,
                             dv=shape.dv, causal=shape.causal, us=sec * 1e6,
                             TFLOPs=flops / sec / 1e12))
        base = next((r for r in rows if r["shape"] == shape.name and r["backend"] == "xla"), None)
        for r in rows:
            if r["shape"] == shape.name and base is not None:
                r["speedup_vs_xla"] = base["us"] / r["us"]
                r["rel_err_vs_xla"] = _rel(outs[r["backend"]], outs["xla"])
        del outs
    return rows


def tune_prefill(timer, *, shapes=None, configs=TUNING_CONFIGS, dtype=jnp.bfloat16,
                 seed: int = 0) -> list[dict]:
    """:func:`bench_prefill` of the Triton backend once per tile config (for tuning on the GPU).

    Returns the rows of every run with ``block_m``, ``block_n``, ``num_warps``, ``num_stages``
    added; the best config per shape is the row with the largest ``TFLOPs``.
    """
    rows = []
    for cfg in configs:
        for r in bench_prefill(timer, shapes=shapes, backends=("triton",), dtype=dtype,
                               config=cfg, seed=seed):
            rows.append(dict(r, **dataclasses.asdict(cfg)))
    return rows


def dense_reference(q, k, v, cu_q, cu_k, *, scale, causal):
    """float32 dense attention per sequence (bottom-right causal), on the device: ``out``,
    ``lse`` as numpy float32. For checks at realistic sizes, where float64 on the host is slow."""
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    lse = np.full(q.shape[:2], -np.inf, np.float32)
    for b in range(len(cu_q) - 1):
        sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if sq == 0 or sk == 0:
            continue
        s = jnp.einsum("ihd,jhd->hij", q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]],
                       precision=_HI) * scale
        if causal:
            see = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
            s = jnp.where(see[None], s, -jnp.inf)
        l_b = jax.nn.logsumexp(s, axis=-1)  # [H, sq]
        ok = jnp.isfinite(l_b)
        p = jnp.where(ok[..., None], jnp.exp(s - jnp.where(ok, l_b, 0)[..., None]), 0)
        o = jnp.einsum("hij,jhv->ihv", p, v[cu_k[b]:cu_k[b + 1]], precision=_HI)
        out[cu_q[b]:cu_q[b + 1]] = np.asarray(o)
        lse[cu_q[b]:cu_q[b + 1]] = np.asarray(l_b.T)
    return out, lse


def _errors(got, want) -> dict:
    out, lse = (np.asarray(x, np.float32) for x in got)
    w_out, w_lse = want
    fin = np.isfinite(w_lse)
    return dict(
        out_rel_err=_rel(out, w_out),
        out_max_abs_err=float(np.max(np.abs(out - w_out), initial=0.0)),
        lse_max_abs_err=float(np.max(np.abs(lse[fin] - w_lse[fin]), initial=0.0)),
        empty_rows_ok=bool(np.all(np.isneginf(lse[~fin])) and np.all(out[~fin] == 0)),
        has_nan=bool(np.isnan(out).any() or np.isnan(lse).any()),
    )


def gpu_check_prefill(backends=("xla", "triton"), seed: int = 0) -> dict:
    """Max errors of every backend against :func:`dense_reference` at realistic shapes.

    Returns ``{case: {backend: {out_rel_err, out_max_abs_err, lse_max_abs_err,
    empty_rows_ok, has_nan}}}``. Inputs are rounded to the case dtype before the reference sees
    them, so the errors are the kernels' own. Cases: DeepSeek 192/128 bf16 varlen (with an empty
    sequence) at 16 and 128 heads, fp16, fp32 with separate key packing (causal and not, rows
    that see nothing), and the chunked-context path (paged bf16 cache, page 64, a 2048-token
    workspace) against one-shot attention over context + new tokens.
    """
    platform = current_platform()
    runnable = [b for b in backends if b == "xla" or triton_importable(platform)]
    key = iter(jax.random.split(jax.random.key(seed), 64))
    report = {}

    def varlen_case(name, lens_q, heads, dtype, *, lens_k=None, causal=True, dqk=192, dv=128):
        lens_k = lens_q if lens_k is None else lens_k
        tq, tk = int(sum(lens_q)), int(sum(lens_k))
        q = jax.random.normal(next(key), (tq, heads, dqk), dtype)
        k = jax.random.normal(next(key), (tk, heads, dqk), dtype)
        v = jax.random.normal(next(key), (tk, heads, dv), dtype)
        cu_q, cu_k = _cu(lens_q), _cu(lens_k)
        scale = dqk ** -0.5
        want = dense_reference(q, k, v, cu_q, cu_k, scale=scale, causal=causal)
        report[name] = {
            b: _errors(mla_prefill(q, k, v, cu_q, cu_seqlens_k=cu_k, scale=scale, causal=causal,
                                   return_lse=True, backend=b), want)
            for b in runnable}

    varlen_case("h16_bf16_varlen", [1000, 3000, 17, 0, 511], 16, jnp.bfloat16)
    varlen_case("h128_bf16", [2048, 1024], 128, jnp.bfloat16)
    varlen_case("h16_fp16", [777, 4096], 16, jnp.float16)
    for causal in (True, False):
        varlen_case(f"h8_fp32_cu_k_{'causal' if causal else 'noncausal'}", [300, 64, 129], 8,
                    jnp.float32, lens_k=[1000, 0, 100], causal=causal)
    report["h16_bf16_chunked_context"] = _context_case(next(key), runnable)
    return report


def _context_case(key, backends, *, heads=16, lrank=512, rope=64, nope=128, dv=128, page=64,
                  ctx=(3000, 1000, 0, 129), new=(512, 100, 64, 1), workspace_tokens=2048):
    ctx, new = np.asarray(ctx), np.asarray(new)
    dtype = jnp.bfloat16
    ks = iter(jax.random.split(key, 8))
    b, d = len(ctx), lrank + rope
    pages = [-(-int(c) // page) for c in ctx]
    num_pages = sum(pages) + 1
    perm = np.asarray(jax.random.permutation(next(ks), num_pages))
    table = np.zeros((b, max(pages) + 1), np.int32)
    off = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[off:off + n]
        off += n
    cache = jax.random.normal(next(ks), (num_pages, page, d), dtype)
    t = int(new.sum())
    q = jax.random.normal(next(ks), (t, heads, nope + rope), dtype)
    kv_c = jax.random.normal(next(ks), (t, lrank), dtype)
    k_pe = jax.random.normal(next(ks), (t, rope), dtype)
    w = (jax.random.normal(next(ks), (lrank, heads, nope + dv), jnp.float32)
         / np.sqrt(lrank)).astype(dtype)
    cu = _cu(new)
    scale = (nope + rope) ** -0.5
    # One-shot reference: each request's latents (context from the cache, then new tokens).
    flat = np.asarray(cache, np.float32).reshape(-1, d)
    new_lat = np.concatenate([np.asarray(kv_c, np.float32), np.asarray(k_pe, np.float32)], 1)
    lats, cu_k = [], [0]
    for i in range(b):
        pos = np.arange(ctx[i])
        rows = flat[table[i][pos // page] * page + pos % page]
        lats.append(np.concatenate([rows, new_lat[int(cu[i]):int(cu[i + 1])]]))
        cu_k.append(cu_k[-1] + len(lats[-1]))
    lat = jnp.asarray(np.concatenate(lats))
    kv = jnp.einsum("nl,lhd->nhd", lat[:, :lrank], jnp.asarray(w, jnp.float32), precision=_HI)
    k_full = jnp.concatenate(
        [kv[..., :nope], jnp.broadcast_to(lat[:, None, lrank:], (lat.shape[0], heads, rope))], -1)
    want = dense_reference(q, k_full, kv[..., nope:], cu, np.asarray(cu_k), scale=scale,
                           causal=True)
    return {
        be: _errors(mla_prefill_with_context(
            q, kv_c, k_pe, cache, jnp.asarray(table), jnp.asarray(ctx, jnp.int32), cu, w,
            scale=scale, workspace_tokens=workspace_tokens, return_lse=True, backend=be), want)
        for be in backends}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_mla.bench.prefill")
    p.add_argument("--quick", action="store_true", help="two small shapes (smoke test)")
    p.add_argument("--backends", default="xla,triton")
    p.add_argument("--no-check", action="store_true", help="skip gpu_check_prefill")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "jax_mla_bench",
                                                 "prefill.json"))
    args = p.parse_args(argv)
    from jax_mla.bench.timing import device_time

    backends = tuple(args.backends.split(","))
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    if not args.no_check:
        result["check"] = gpu_check_prefill(backends)
        print(json.dumps(result["check"], indent=1))
    result["rows"] = bench_prefill(device_time, shapes=target_shapes(args.quick),
                                   backends=backends)
    for r in result["rows"]:
        print(f"{r['shape']:>32} {r['backend']:>7} {r['us']:10.1f} us {r['TFLOPs']:7.1f} TFLOP/s"
              f"  x{r.get('speedup_vs_xla', float('nan')):.2f} vs xla")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
