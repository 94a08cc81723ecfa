"""The prefill bench and GPU check run end to end on CPU at tiny shapes (plumbing, FLOP counts)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_prefill_oracle import varlen_attention

from jax_mla.backends.triton.launch import triton_importable
from jax_mla.bench.prefill import (
    PrefillShape,
    _context_case,
    attention_flops,
    bench_prefill,
    dense_reference,
    target_shapes,
    tune_prefill,
)


def test_flop_counts_are_exact():
    # Causal, queries = keys: s (s + 1) / 2 pairs per sequence.
    assert attention_flops([3, 5], [3, 5], 2, 192, 128, True) == 2 * 2 * 320 * (6 + 15)
    assert attention_flops([3], [3], 1, 8, 8, False) == 2 * 16 * 9
    # Bottom-right: 2 queries at the end of 4 keys see 3 and 4 keys; 3 queries over 1 key: 0,0,1.
    assert attention_flops([2, 3], [4, 1], 1, 1, 1, True) == 2 * 2 * (7 + 1)


def test_target_grid_covers_the_issue():
    shapes = target_shapes()
    for h in (16, 128):
        assert any(s.heads == h and max(s.seq_lens) >= 8192 and s.causal for s in shapes)
        assert any(s.heads == h and max(s.seq_lens) == 128 and len(s.seq_lens) >= 64
                   for s in shapes)
    assert all((s.dqk, s.dv) == (192, 128) for s in shapes)


def test_bench_rows(rng):
    calls = []

    def timer(fn, *args):
        jax.block_until_ready(jax.jit(fn)(*args))
        calls.append(fn)
        return 1e-3

    backends = ("xla", "triton") if triton_importable("cpu") else ("xla",)
    shapes = [PrefillShape((20, 5), 2, dqk=48, dv=16), PrefillShape((9,), 2, dqk=48, dv=16,
                                                                    causal=False)]
    rows = bench_prefill(timer, shapes=shapes, backends=backends, dtype=jnp.float32)
    assert len(rows) == len(shapes) * len(backends) == len(calls)
    for r in rows:
        flops = attention_flops(*([[20, 5]] * 2 if r["batch"] == 2 else [[9]] * 2), 2, 48, 16,
                                r["causal"])
        assert r["us"] == pytest.approx(1000.0)
        assert r["TFLOPs"] == pytest.approx(flops / 1e-3 / 1e12)
        assert r["speedup_vs_xla"] == pytest.approx(1.0)
        assert r["rel_err_vs_xla"] < 1e-5


def test_dense_reference_matches_oracle(rng):
    lens_q, lens_k = [5, 0, 7], [9, 3, 7]
    q = rng.standard_normal((12, 2, 8)).astype(np.float32)
    k = rng.standard_normal((19, 2, 8)).astype(np.float32)
    v = rng.standard_normal((19, 2, 4)).astype(np.float32)
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    for causal in (True, False):
        out, lse = dense_reference(q, k, v, cu_q, cu_k, scale=0.5, causal=causal)
        w_out, w_lse = varlen_attention(q, k, v, cu_q, cu_k, scale=0.5, causal=causal)
        np.testing.assert_allclose(out, w_out, rtol=1e-5, atol=1e-6)
        # An LSE can sit near 0, where a relative bound alone is float32 noise (1.2e-5 seen).
        np.testing.assert_allclose(lse, w_lse, rtol=1e-5, atol=1e-6)


def test_context_check_case_runs_small():
    backends = ["xla", "triton"] if triton_importable("cpu") else ["xla"]
    errs = _context_case(jax.random.key(0), backends, heads=2, lrank=16, rope=8, nope=16, dv=16,
                         page=8, ctx=(40, 0, 17), new=(9, 4, 1), workspace_tokens=24)
    for e in errs.values():
        assert e["out_rel_err"] < 2e-2 and e["lse_max_abs_err"] < 5e-2 and not e["has_nan"]


@pytest.mark.skipif(not triton_importable("cpu"), reason="triton interpreter missing")
def test_tune_rows_carry_the_config():
    from jax_mla import PrefillTritonConfig

    cfgs = (PrefillTritonConfig(16, 16), PrefillTritonConfig(32, 16, 4, 2))
    rows = tune_prefill(lambda fn, *a: 1e-3, shapes=[PrefillShape((20,), 2, dqk=32, dv=16)],
                        configs=cfgs, dtype=jnp.float32)
    assert [(r["block_m"], r["num_stages"]) for r in rows] == [(16, 3), (32, 2)]
