"""``python -m jax_mla.bench serve --preset NAME --out FILE.json``: a served model, measured.

The serving engine (:mod:`jax_mla.serving.engine`) serves a fixed-seed request trace after
compiling every step bucket ahead; the JSON and the console table give what serving benchmarks
report -- output and total tokens/s, time to first token and inter-token latency (p50/p90/p99),
step time per kind and bucket -- and, per bucket, its fraction of the step's roofline:

- decode / verify buckets: the bytes the step must read (every layer's weights, the LM head,
  the KV the decode rows attend, the cache rows written) over the device's copy bandwidth
  measured in the same run (``timing.ceilings``), divided by the step's time;
- prefill / mixed buckets: the step's matmul FLOPs (``2 x`` weights per token, attention's
  ``QK^T`` and ``PV`` over context and causal part) over the measured bf16 matmul rate.

``steady_compiles`` counts XLA compilations of the process while serving (0 is the contract).
With ``--peer`` (default where it can run: torch with CUDA), the same model (same weights,
shared by DLPack), the same steps (the engine's recorded trace: same requests, same scheduler
decisions, same tokens) run in PyTorch with FlashMLA's decode where it is built, SDPA prefill
and cuBLAS matmuls, each decode bucket a CUDA graph (``serve_peer.py``); its tokens/s, TTFT,
ITL and step times sit beside ours, from the same timeline (a request arrives when the step
after its submission starts; a token is out when its step ends).

``--profile``: one decode bucket's kernels under CUPTI, grouped (matmuls, attention, norms and
rope, cache write, other), with the top kernels by time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.model import MLAConfig, YarnScaling
from jax_mla.model.transformer import ModelConfig, calibrate_kv_scales, init_model
from jax_mla.serving.engine import Engine, EngineConfig, Request
from jax_mla.serving.metrics import format_summary, percentiles, summarize


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model, an engine and a request trace."""

    layers: int = 2
    hidden: int = 256
    heads: int = 8
    kv_lora_rank: int = 128
    q_lora_rank: int | None = 128
    rope_dim: int = 32
    nope_dim: int = 64
    v_dim: int = 64
    mlp_hidden: int = 512
    vocab: int = 512
    dtype: str = "float32"
    cache_dtype: str | None = None
    page_size: int = 16
    num_pages: int = 256
    max_decode: int = 8
    max_prefill_seqs: int = 2
    prefill_tokens: int = 64
    workspace_tokens: int = 256
    requests: int = 16
    arrivals: int = 2
    prompt: int = 48
    new_tokens: int = 16
    seed: int = 0


def _deepseek(heads, cache_dtype=None):
    # DeepSeek-V3's layer geometry (hidden 7168, q LoRA 1536, L 512, R 64, P 128, V 128, its
    # dense MLP of 18432, vocab 129280), 4 layers; 16 heads is one TP8 rank's share of 128.
    return Preset(layers=4, hidden=7168, heads=heads, kv_lora_rank=512, q_lora_rank=1536,
                  rope_dim=64, nope_dim=128, v_dim=128, mlp_hidden=18432, vocab=129280,
                  dtype="bfloat16", cache_dtype=cache_dtype, page_size=64, num_pages=2048,
                  max_decode=64, max_prefill_seqs=4, prefill_tokens=4096,
                  workspace_tokens=8192, requests=64, arrivals=16, prompt=1024, new_tokens=64)


PRESETS = {
    "tiny": Preset(),
    "deepseek-h16": _deepseek(16),
    "deepseek-h128": _deepseek(128),
    "deepseek-h16-fp8": _deepseek(16, "float8_e4m3fn"),
    "deepseek-h128-fp8": _deepseek(128, "float8_e4m3fn"),
}


def build(p: Preset, *, backend="auto", overlap=True, layer_loop="scan", compiler_options=()):
    mla = MLAConfig(
        hidden_size=p.hidden, num_heads=p.heads, kv_lora_rank=p.kv_lora_rank,
        q_lora_rank=p.q_lora_rank, qk_nope_head_dim=p.nope_dim, qk_rope_head_dim=p.rope_dim,
        v_head_dim=p.v_dim,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=4096,
                                 mscale=1.0, mscale_all_dim=1.0))
    cfg = ModelConfig(vocab_size=p.vocab, num_layers=p.layers, mla=mla, mlp_hidden=p.mlp_hidden)
    dtype = jnp.dtype(p.dtype)
    params = init_model(cfg, jax.random.key(p.seed), dtype)
    k_scales = None
    if p.cache_dtype:
        rng = np.random.default_rng([p.seed, 1])
        sample = jnp.asarray(rng.integers(0, p.vocab, (2, min(p.prompt, 512))), jnp.int32)
        k_scales = calibrate_kv_scales(params, cfg, sample, fp8_dtype=jnp.dtype(p.cache_dtype),
                                       margin=1.25)
    ecfg = EngineConfig(
        num_pages=p.num_pages, page_size=p.page_size,
        max_seq_len=3 * p.prompt + 3 * p.new_tokens, max_decode=p.max_decode,
        max_prefill_seqs=p.max_prefill_seqs, prefill_tokens=p.prefill_tokens,
        workspace_tokens=p.workspace_tokens, backend=backend, cache_dtype=p.cache_dtype,
        overlap=overlap, record=True, layer_loop=layer_loop, seed=p.seed,
        compiler_options=tuple(compiler_options))
    return Engine(params, cfg, ecfg, dtype=dtype, k_scales=k_scales)


def trace(p: Preset) -> list[Request]:
    """The fixed-seed requests: prompt and output lengths normal around the preset's means."""
    rng = np.random.default_rng([p.seed, 7])
    reqs = []
    for i in range(p.requests):
        n = int(np.clip(rng.normal(p.prompt, p.prompt / 4), 1, 3 * p.prompt))
        m = int(np.clip(rng.normal(p.new_tokens, p.new_tokens / 4), 1, 3 * p.new_tokens))
        reqs.append(Request(rid=i, prompt=rng.integers(0, p.vocab, n).tolist(), max_new_tokens=m))
    return reqs


# --- rooflines -----------------------------------------------------------------------------


def model_bytes(engine: Engine) -> dict:
    layers = sum(a.nbytes for a in jax.tree.leaves(engine.params["layers"]))
    head = engine.params["lm_head"].nbytes + engine.params["norm"].nbytes
    return dict(layer_weights=layers, lm_head=head)


def step_bytes(engine: Engine, rep) -> float:
    """Bytes a step must move at least: weights (once), the KV the decode rows read, the cache
    rows written (every layer)."""
    wb = model_bytes(engine)
    width = engine.cfg.cache_width * engine.cache_dtype.itemsize * engine.cfg.num_layers
    return (wb["layer_weights"] + wb["lm_head"] + rep.kv_tokens * width
            + (rep.decode_rows + rep.prefill_tokens) * width)


def step_flops(engine: Engine, rep, context: float = 0.0) -> float:
    """Matmul FLOPs of a step: ``2 x`` layer weights per row (the up-projection of prefill
    rows included), the attention of prefill rows over themselves (causal) and context, and
    the absorbed decode rows' attention over the latent cache."""
    m = engine.cfg.mla
    layer_params = sum(a.size for a in jax.tree.leaves(engine.params["layers"]))
    rows = rep.decode_rows + rep.prefill_tokens
    f = 2.0 * layer_params * rows
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    f += engine.cfg.num_layers * 2.0 * m.num_heads * (qk + v) * (
        rep.prefill_tokens ** 2 / 2 + rep.prefill_tokens * context)
    f += engine.cfg.num_layers * 2.0 * m.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) \
        * rep.kv_tokens
    return f


def with_rooflines(engine, reports, summary, ceil) -> None:
    bw, peak = ceil.get("copy_bytes_per_s"), ceil.get("bf16_matmul_flops")
    for row in summary["steps"]:
        reps = [r for r in reports if r.kind == row["kind"] and list(r.bucket) == row["bucket"]]
        row["roofline_fraction"] = None  # without the device's ceilings (a CPU run)
        if row["kind"] in ("decode", "verify"):
            b = np.array([step_bytes(engine, r) for r in reps])
            row["bytes"] = float(b.mean())
            if bw and np.isfinite(bw):
                t = b / bw
                row["roofline_ms"] = float(t.mean() * 1e3)
                row["roofline_fraction"] = float(np.median(t / [r.seconds for r in reps]))
                row["x_roofline"] = float(np.median(np.array([r.seconds for r in reps]) / t))
        else:
            fl = np.array([step_flops(engine, r) for r in reps])
            row["flops"] = float(fl.mean())
            if peak and np.isfinite(peak):
                row["roofline_fraction"] = float(np.median(fl / peak / [r.seconds for r in reps]))


# --- the peer's timeline ---------------------------------------------------------------------


def timeline_metrics(requests, step_seconds: list[float]) -> dict:
    """TTFT / ITL / tokens/s of a replay whose step ``k`` (1-based) took ``step_seconds[k-1]``:
    a request arrives when the step after its submission starts, a token is out when the step
    that made it ends."""
    ends = np.cumsum([0.0] + list(step_seconds))  # ends[k]: end of step k; ends[0] = start
    ttft, itl = [], []
    for r in requests:
        if not r.token_steps:
            continue
        t = ends[np.asarray(r.token_steps)]
        ttft.append(t[0] - ends[r.arrival_step - 1])
        itl += list(np.diff(t))
    wall = float(ends[-1])
    out = sum(len(r.output) for r in requests)
    prompt = sum(len(r.prompt) for r in requests)
    return dict(wall_s=wall, tokens_per_s=out / wall, total_tokens_per_s=(out + prompt) / wall,
                ttft_ms=percentiles(ttft, scale=1e3), itl_ms=percentiles(itl, scale=1e3))


def run_peer(engine: Engine, requests) -> dict:
    from jax_mla.bench import serve_peer

    reason = serve_peer.peer_available()
    if reason is not None:
        return {"skipped": reason}
    e = engine.ecfg
    peer = serve_peer.TorchPeer(engine.params, engine.cfg, num_pages=e.num_pages,
                                page_size=e.page_size,
                                max_seq_len=engine.pages.max_pages_per_seq * e.page_size,
                                dtype=str(engine.dtype))
    steps = [(r["inputs"], r["qlen"]) for r in engine.records]
    got = peer.replay(steps)
    seconds = got["seconds"]
    out = timeline_metrics(requests, seconds)
    agree = [float(np.mean(a[: len(b)] == b)) for a, b in
             ((np.asarray(pi), _sampled(rec, engine)) for pi, rec in zip(got["ids"],
                                                                        engine.records))]
    out["greedy_agreement"] = float(np.mean(agree))
    out["backend"] = got.get("backend")
    groups: dict = {}
    for rec, s in zip(engine.records, seconds):
        groups.setdefault((rec["kind"], tuple(rec["bucket"])), []).append(s * 1e3)
    out["steps"] = [dict(kind=k, bucket=list(b), steps=len(v), ms_p50=float(np.median(v)),
                         ms_p90=float(np.percentile(v, 90)))
                    for (k, b), v in sorted(groups.items())]
    ours = [r["seconds"] for r in engine.records]
    out["ours_same_timeline"] = timeline_metrics(requests, ours)
    return out


def _sampled(rec, engine) -> np.ndarray:
    """Our ids in the peer's order: decode rows, then one per prefill request."""
    ids, (b_d, t_p) = rec["ids"], rec["bucket"]
    b_p = engine.ecfg.max_prefill_seqs if t_p else 0
    return np.concatenate([ids[: b_d * rec["qlen"]], ids[engine.num_samples - b_p:]])


# --- the decode step's profile ---------------------------------------------------------------

_GROUPS = (
    ("attention", r"mla_|prefill_fwd|split_q|sm90|flash|reduce_affine|plan_|schedule"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|matmul|dot|triton_"),
    ("cache write", r"scatter|dynamic_update|dynamic-update"),
    ("norms/rope", r"reduce|rsqrt|norm|sin|cos|rope"),
    ("copies", r"copy|memcpy|memset|transpose|dynamic_slice|dynamic-slice|slice"),
)


def kernel_group(name: str) -> str:
    for group, pat in _GROUPS:
        if re.search(pat, name, re.IGNORECASE):
            return group
    return "other"


def profile_bucket(engine: Engine, bucket, calls: int = 10) -> dict:
    """CUPTI kernel times of ``calls`` runs of one recorded step of ``bucket``, grouped."""
    from jax_mla.bench import profile

    rec = next(r for r in reversed(engine.records) if tuple(r["bucket"]) == tuple(bucket))
    fn = engine._compiled[tuple(bucket)]
    inputs = rec["inputs"]
    feed = np.full(inputs.tokens.shape, -1, np.int32)
    rows = bucket[0] * engine.qlen + (engine.ecfg.max_prefill_seqs if bucket[1] else 0)
    sampling = engine._sampling_inputs(rows)

    def once():
        ids, _, engine.caches = fn(*engine._args(inputs, feed, sampling, 0))
        return ids

    once().block_until_ready()

    def run():
        for _ in range(calls):
            once().block_until_ready()

    events = profile._profile(run)
    per, groups = {}, {}
    for ev in events:
        name = ev["name"]
        dur = float(ev.get("dur", 0.0)) / calls
        per[name] = per.get(name, 0.0) + dur
        g = kernel_group(name)
        groups[g] = groups.get(g, 0.0) + dur
    total = sum(per.values())
    top = sorted(per.items(), key=lambda kv: -kv[1])[:15]
    return dict(bucket=list(bucket), kv_tokens=int(inputs.decode_seq_lens.sum()),
                gpu_us=total, launches=len(events) / calls,
                groups_us={k: round(v, 2) for k, v in sorted(groups.items(),
                                                             key=lambda kv: -kv[1])},
                top_kernels_us=[(n[:90], round(v, 2), kernel_group(n)) for n, v in top])


def _option(text: str):
    name, _, value = text.partition("=")
    low = value.lower()
    if low in ("true", "false"):
        return name, low == "true"
    try:
        return name, int(value)
    except ValueError:
        return name, value


# --- main ------------------------------------------------------------------------------------


def run(name: str, p: Preset, args) -> dict:
    from jax_mla.bench.timing import ceilings, environment

    env = environment()
    if env["platform"] == "cpu":
        ceil = {"copy_bytes_per_s": float("nan"), "bf16_matmul_flops": float("nan"),
                "skipped": "no ceiling probes on a CPU"}
    else:
        ceil = ceilings()
    t0 = time.perf_counter()
    options = [_option(o) for o in args.xla_option]
    engine = build(p, backend=args.backend, overlap=not args.no_overlap,
                   layer_loop=args.layer_loop, compiler_options=options)
    build_s = time.perf_counter() - t0
    compile_s = engine.compile(progress=not args.no_progress)
    requests = trace(p)
    reports, wall = engine.serve(requests, p.arrivals)
    steady = engine.compiles_since_warmup
    summary = summarize(engine.finished, reports, wall)
    with_rooflines(engine, reports, summary, ceil)
    out = dict(preset=name, config=dataclasses.asdict(p), environment=env, ceilings=ceil,
               backend=args.backend, overlap=not args.no_overlap, layer_loop=args.layer_loop,
               compiler_options=dict(options),
               build_s=build_s, compile_s=compile_s, buckets=[list(b) for b in
                                                              engine.bucket_list],
               steady_compiles=steady, model_bytes=model_bytes(engine), ours=summary)
    print(f"[{name}] compiled {len(engine.bucket_list)} buckets in {compile_s:.1f} s; "
          f"{steady} compilations while serving")
    print(format_summary(summary))
    if args.profile and env["platform"] != "cpu":
        decode = [b for b in engine.bucket_list if b[1] == 0 and any(
            tuple(r["bucket"]) == b for r in engine.records)]
        if decode:
            try:
                out["profile"] = profile_bucket(engine, max(decode))
                print("profile", json.dumps(out["profile"]))
            except Exception as e:  # noqa: BLE001 - the rest of the run stands without it
                out["profile"] = {"error": repr(e)[:300]}
    if args.peer != "off":
        try:
            out["peer"] = run_peer(engine, engine.finished)
        except Exception as e:  # noqa: BLE001 - ours stands without the peer
            if args.peer == "on":
                raise
            out["peer"] = {"error": repr(e)[:500]}
        print("peer", json.dumps({k: v for k, v in out["peer"].items() if k != "steps"},
                                 default=str))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_mla.bench serve")
    ap.add_argument("--preset", default="tiny", help=f"comma list of {sorted(PRESETS)}")
    ap.add_argument("--out", default=None, help="JSON file (presets already in it are kept)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--peer", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--profile", action="store_true", help="CUPTI profile of a decode bucket")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--layer-loop", default="scan", choices=["scan", "python"])
    ap.add_argument("--xla-option", action="append", default=[],
                    help="NAME=VALUE, an XLA option of the steps' compilation (repeatable)")
    ap.add_argument("--requests", type=int, default=None, help="override the preset's count")
    ap.add_argument("--tag", default="", help="suffix of the preset's key in the JSON")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    results = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    for name in args.preset.split(","):
        if name not in PRESETS:
            ap.error(f"unknown preset {name!r}: one of {sorted(PRESETS)}")
        p = PRESETS[name]
        if args.requests:
            p = dataclasses.replace(p, requests=args.requests)
        results[name + args.tag] = run(name, p, args)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
