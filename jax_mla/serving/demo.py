"""``python -m jax_mla demo``: a small random-weight MLA model serving a stream of requests.

Continuous batching through the paged cache manager (prefill chunks, decode, optional speculative
verify), tokens/s, and a check of sampled steps against the same tokens recomputed from scratch
(``jax_mla.serving.engine``). CPU by default; ``--backend triton`` on a GPU.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.backends import available_backends
from jax_mla.model import MLAConfig, YarnScaling
from jax_mla.model.transformer import ModelConfig, calibrate_kv_scales, init_model
from jax_mla.serving.engine import Engine, EngineConfig, Request, check_tolerance
from jax_mla.serving.metrics import format_summary, summarize

# An fp8 cache against the same model with an unquantised cache: logits rel err on the demo's
# model, measured 1.7e-2 (e4m3fn) and 3.4e-2 (e5m2) (docs/model.md).
FP8_CHECK_TOL = check_tolerance(jnp.float32, cache_dtype=jnp.float8_e4m3fn)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="decode backend (auto, xla, triton, aiter)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--arrivals", type=int, default=2, help="new requests per step (a stream)")
    p.add_argument("--prompt", type=int, default=48, help="mean prompt length")
    p.add_argument("--new-tokens", type=int, default=24, help="mean tokens to generate")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--rope-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=160)
    p.add_argument("--max-decode", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=64)
    p.add_argument("--spec", type=int, default=0, help="draft tokens per verify step (0: decode)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cache-dtype", default=None,
                   choices=["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"],
                   help="an fp8 cache, per-layer scales calibrated on sample prompts")
    p.add_argument("--check-every", type=int, default=4, help="check every n-th step (0: never)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")


def build(args, rng=None):
    mla = MLAConfig(
        hidden_size=args.hidden, num_heads=args.heads, kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.hidden // 2, qk_nope_head_dim=args.rope_dim * 2,
        qk_rope_head_dim=args.rope_dim, v_head_dim=args.rope_dim * 2,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128,
                                 mscale=1.0, mscale_all_dim=1.0))
    cfg = ModelConfig(vocab_size=args.vocab, num_layers=args.layers, mla=mla,
                      mlp_hidden=2 * args.hidden)
    dtype = jnp.dtype(args.dtype)
    params = init_model(cfg, jax.random.key(args.seed or 0), dtype)
    k_scales = None
    if args.cache_dtype:
        # Calibrate on prompts like the served ones (the served requests are not seen).
        rng = rng or np.random.default_rng(args.seed)
        sample = rng.integers(0, args.vocab, (4, args.prompt)).astype(np.int32)
        k_scales = calibrate_kv_scales(params, cfg, jnp.asarray(sample),
                                       fp8_dtype=jnp.dtype(args.cache_dtype), margin=1.25)
    ecfg = EngineConfig(
        num_pages=args.num_pages, page_size=args.page_size,
        max_seq_len=4 * (args.prompt + args.new_tokens) + args.spec, max_decode=args.max_decode,
        max_prefill_seqs=2, prefill_tokens=args.prefill_tokens, spec_tokens=args.spec,
        workspace_tokens=4 * args.prefill_tokens, backend=args.backend,
        check_every=args.check_every, cache_dtype=args.cache_dtype)
    return Engine(params, cfg, ecfg, dtype=dtype, k_scales=k_scales)


def make_requests(args, rng) -> list[Request]:
    reqs = []
    for i in range(args.requests):
        n = int(np.clip(rng.normal(args.prompt, args.prompt / 3), 1, 3 * args.prompt))
        m = int(np.clip(rng.normal(args.new_tokens, args.new_tokens / 3), 1, 3 * args.new_tokens))
        reqs.append(Request(rid=i, prompt=rng.integers(0, args.vocab, n).tolist(),
                            max_new_tokens=m))
    return reqs


def serve(engine: Engine, requests: list[Request], arrivals: int, progress: bool = True):
    """Run until every request finishes; returns ``(reports, wall seconds)``
    (:meth:`Engine.serve`)."""
    return engine.serve(requests, arrivals, progress=progress)


def main(args) -> int:
    rng = np.random.default_rng(args.seed)
    engine = build(args, rng)
    m = engine.cfg.mla
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; backends available: "
          f"{available_backends()}; decode backend {args.backend!r}")
    print(f"model: {args.layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, "
          f"L={m.kv_lora_rank} R={m.qk_rope_head_dim}, vocab {args.vocab}, {args.dtype}; cache "
          f"{args.cache_dtype or args.dtype} "
          f"{args.num_pages} pages x {args.page_size}; {args.requests} requests, {args.arrivals} "
          f"arriving per step" + (f"; speculative verify with {args.spec} drafts" if args.spec
                                  else ""))
    if engine.k_scales is not None:
        print("fp8 cache scales per layer (calibrated): "
              + ", ".join(f"{float(s):.3g}" for s in engine.k_scales))
    requests = make_requests(args, rng)
    engine.compile(progress=not args.no_progress)
    reports, wall = serve(engine, requests, args.arrivals, progress=not args.no_progress)
    toks = sum(r.new_tokens for r in reports)
    kinds = {k: sum(r.kind == k for r in reports) for k in ("prefill", "mixed", "decode",
                                                          "verify")}
    print(f"{len(engine.finished)} requests, {toks} tokens in {len(reports)} steps "
          f"({', '.join(f'{v} {k}' for k, v in kinds.items() if v)}); {wall:.2f} s wall, "
          f"{engine.compiles_since_warmup} compilations while serving")
    if engine.check_seconds:
        print(f"the checks' recomputes took {engine.check_seconds:.2f} s of it: "
              f"{toks / max(wall - engine.check_seconds, 1e-9):.1f} tokens/s without them")
    print(format_summary(summarize(engine.finished, reports, wall)))
    if args.spec:
        acc = sum(r.accepted_drafts for r in engine.finished)
        prop = sum(r.proposed_drafts for r in engine.finished)
        print(f"speculative: {acc}/{prop} drafts accepted ({acc / max(prop, 1):.0%})")
    pre = sum(r.preemptions for r in engine.finished)
    if pre:
        print(f"preemptions: {pre} (recomputed by prefill)")
    checks = [r.check_err for r in reports if r.check_err is not None]
    if not checks:
        print("no step was checked")
        return 0 if len(engine.finished) == args.requests else 1
    worst = max(checks)
    ok = worst < engine.ecfg.check_tol and len(engine.finished) == args.requests
    print(f"checked {len(checks)} steps against a from-scratch recompute: worst logits rel err "
          f"{worst:.2e} ({'OK' if ok else 'FAIL'}: tolerance {engine.ecfg.check_tol:g})")
    return 0 if ok else 1
