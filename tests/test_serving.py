"""The serving loop: continuous batching of a small MLA model through the paged cache manager.

Every served request's tokens must be what the same model gives when it recomputes the whole
history from scratch (greedy), whatever the batching did: chunked prefill, mixed steps, verify
with drafts, preemption and page reuse. The per-step check inside the engine must also be able to
fail.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.model import MLAConfig, YarnScaling
from jax_mla.model.transformer import ModelConfig, init_model
from jax_mla.serving import CacheFull
from jax_mla.serving import demo as serving_demo
from jax_mla.serving.engine import Engine, EngineConfig, Request, _draft, reference_logits

MLA = MLAConfig(hidden_size=64, num_heads=4, kv_lora_rank=32, q_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                rope_scaling=YarnScaling(factor=2.0, original_max_position_embeddings=32,
                                         mscale=1.0, mscale_all_dim=1.0))
CFG = ModelConfig(vocab_size=64, num_layers=2, mla=MLA, mlp_hidden=96)


@pytest.fixture(scope="module")
def params():
    return init_model(CFG, jax.random.key(7), jnp.float32)


def _requests(rng, n, *, vocab=CFG.vocab_size, prompt=(1, 40), new=(1, 12)):
    return [Request(rid=i, prompt=rng.integers(0, vocab, int(rng.integers(*prompt))).tolist(),
                    max_new_tokens=int(rng.integers(*new))) for i in range(n)]


def _serve(engine, reqs, arrivals=2):
    return engine.serve(reqs, arrivals, max_calls=400)[0]


def _greedy_from_scratch(params, req):
    """The request's continuation recomputed token by token with no cache reuse."""
    toks = list(req.prompt)
    for _ in range(len(req.output)):
        logits = reference_logits(params, CFG, np.asarray(toks, np.int32), jnp.float32, 8)
        toks.append(int(logits[-1].argmax()))
    return toks[len(req.prompt):]


@pytest.mark.parametrize("spec,num_pages", [(0, 64), (2, 64), (3, 9)])
def test_served_tokens_equal_recompute(params, rng, spec, num_pages):
    ecfg = EngineConfig(num_pages=num_pages, page_size=8, max_seq_len=64, max_decode=4,
                        max_prefill_seqs=2, prefill_tokens=16, spec_tokens=spec,
                        workspace_tokens=32, check_every=3, backend="xla")
    engine = Engine(params, CFG, ecfg, dtype=jnp.float32)
    if num_pages < 10:  # long requests: two of them outgrow the 9 pages, so one is evicted
        reqs = _requests(rng, 10, prompt=(30, 40), new=(10, 12))
    else:
        reqs = _requests(rng, 10)
    reports = _serve(engine, reqs)
    assert sorted(r.rid for r in engine.finished) == list(range(10))
    assert all(len(r.output) == r.max_new_tokens for r in engine.finished)
    kinds = {r.kind for r in reports}
    assert {"prefill", "mixed"} <= kinds and ("verify" if spec else "decode") in kinds
    checks = [r.check_err for r in reports if r.check_err is not None]
    assert checks and max(checks) < 1e-4, checks
    for req in engine.finished[:4]:
        assert req.output == _greedy_from_scratch(params, req), req.rid
    assert engine.pages.num_used_pages == 0  # every page came back
    if num_pages < 10:  # a small pool: requests were evicted and recomputed
        assert sum(r.preemptions for r in engine.finished) > 0


def test_verify_accepts_matching_drafts(params, rng, monkeypatch):
    """Drafts equal to the model's own greedy tokens are all accepted (4 tokens per step)."""
    import jax_mla.serving.engine as eng

    req = _requests(rng, 1)[0]
    req.max_new_tokens = 9
    want = _greedy_from_scratch(params, Request(0, req.prompt, 9, output=[0] * 9))

    def perfect(tokens, k):  # the next k greedy tokens after the current last one
        n = len(tokens) - len(req.prompt)
        return (want[n:n + k] + [0] * k)[:k]

    monkeypatch.setattr(eng, "_draft", perfect)
    ecfg = EngineConfig(num_pages=32, page_size=8, max_seq_len=64, max_decode=1,
                        max_prefill_seqs=1, prefill_tokens=64, spec_tokens=3,
                        workspace_tokens=64, backend="xla")
    engine = Engine(params, CFG, ecfg, dtype=jnp.float32)
    engine.submit(req)
    steps = 0
    while not engine.idle:
        engine.step()
        steps += 1
    assert req.output == want
    # 1 prefill step, then 2 verify steps of 4 tokens (3 accepted drafts + the model's own).
    assert steps == 3 and req.accepted_drafts == 6


def test_prompt_lookup_drafts():
    assert _draft([1, 2, 3, 1], 2) == [2, 3]
    assert _draft([5, 6, 7], 3) == [7, 7, 7]
    assert _draft([4, 9, 4], 3) == [9, 4, 4]


def test_engine_errors(params):
    ecfg = EngineConfig(num_pages=2, page_size=4, max_seq_len=16, max_decode=2,
                        max_prefill_seqs=1, prefill_tokens=8, workspace_tokens=8, backend="xla")
    engine = Engine(params, CFG, ecfg, dtype=jnp.float32)
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
        engine.submit(Request(0, [1] * 10, 7))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit(Request(1, [], 3))
    # A request that needs more pages than the whole pool holds never fits.
    engine.submit(Request(2, [1] * 8, 6))
    with pytest.raises(CacheFull, match="raise num_pages"):
        for _ in range(10):
            engine.step()


def test_check_detects_a_wrong_step(params, rng):
    """The per-step check recomputes independently: a corrupted cache makes it fail."""
    ecfg = EngineConfig(num_pages=32, page_size=8, max_seq_len=64, max_decode=2,
                        max_prefill_seqs=1, prefill_tokens=16, workspace_tokens=32,
                        check_every=1, backend="xla")
    engine = Engine(params, CFG, ecfg, dtype=jnp.float32)
    req = _requests(rng, 1)[0]
    req.prompt, req.max_new_tokens = req.prompt[:10] + [1], 4
    engine.submit(req)
    assert engine.step().check_err < 1e-4  # the prefill, honest
    engine.caches = engine.caches + 0.5  # every cached latent shifted
    rep = engine.step()
    assert rep.kind == "decode" and rep.check_err > 1e-2, rep


def test_demo_cli(capsys):
    p = argparse.ArgumentParser()
    serving_demo.add_args(p)
    args = p.parse_args(["--requests", "4", "--arrivals", "2", "--prompt", "12",
                         "--new-tokens", "4", "--layers", "1", "--hidden", "64", "--heads", "4",
                         "--kv-lora-rank", "32", "--rope-dim", "8", "--vocab", "64",
                         "--page-size", "8", "--num-pages", "32", "--max-decode", "4",
                         "--prefill-tokens", "16", "--spec", "1", "--check-every", "2",
                         "--seed", "3", "--no-progress"])
    assert serving_demo.main(args) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "OK" in out and "4 requests" in out


def test_python_m_jax_mla_entry_points(capsys):
    """``python -m jax_mla demo`` (the serving loop) and ``kernels`` (the kernel check)."""
    from jax_mla.__main__ import main

    assert main(["demo", "--requests", "2", "--prompt", "6", "--new-tokens", "3", "--layers",
                 "1", "--hidden", "32", "--heads", "2", "--kv-lora-rank", "16", "--rope-dim",
                 "4", "--vocab", "32", "--page-size", "4", "--num-pages", "16",
                 "--prefill-tokens", "8", "--check-every", "1", "--no-progress"]) == 0
    assert main(["kernels", "--batch", "2", "--heads", "4", "--context", "40", "--page-size",
                 "16", "--decode-steps", "1", "--verify-steps", "1", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "worst relative error" in out


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_cache_end_to_end(params, rng, fp8):
    """An fp8 cache with calibrated per-layer scales: every step's logits within the stated
    tolerance of the same model with an unquantised cache."""
    from jax_mla.model.transformer import calibrate_kv_scales

    sample = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 24)), jnp.int32)
    scales = calibrate_kv_scales(params, CFG, sample, fp8_dtype=jnp.dtype(fp8), margin=1.25)
    assert scales.shape == (CFG.num_layers,) and bool(jnp.all(scales > 0))
    ecfg = EngineConfig(num_pages=64, page_size=8, max_seq_len=64, max_decode=4,
                        max_prefill_seqs=2, prefill_tokens=16, workspace_tokens=32,
                        check_every=1, backend="xla", cache_dtype=fp8)
    engine = Engine(params, CFG, ecfg, dtype=jnp.float32, k_scales=scales)
    assert engine.caches[0].dtype == jnp.dtype(fp8)
    reports = _serve(engine, _requests(rng, 6))
    checks = [r.check_err for r in reports if r.check_err is not None]
    assert len(engine.finished) == 6
    assert 1e-4 < max(checks) < serving_demo.FP8_CHECK_TOL, checks  # quantised, but close
    with pytest.raises(ValueError, match="needs k_scales"):
        Engine(params, CFG, ecfg, dtype=jnp.float32)
