"""The benchmark timer really runs every call it divides by (two bugs seen on the H200)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.bench import timing


def _compiled(fn, n, *args):
    return timing._chained(fn, n).lower(*args).compile().as_text()


def test_chain_keeps_every_call_when_outputs_differ_from_inputs():
    # Output shape != first input: the chain bumps one input element with a data dependency.
    q = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4, 16)), jnp.float32)
    c = jnp.asarray(np.random.default_rng(1).standard_normal((32, 16)), jnp.float32)
    text = _compiled(lambda q, c: q.reshape(-1, 16) @ c.T, 5, q, c)
    assert text.count(" dot(") == 5


def test_chain_does_not_fuse_elementwise_calls_into_one_pass():
    x = jnp.arange(1024, dtype=jnp.bfloat16)
    text = _compiled(lambda a: a * jnp.bfloat16(1.25), 4, x)
    # One multiply per call survives (XLA may not fold the chain into a single pass).
    assert text.count("multiply(") >= 4


def test_the_copy_probe_multiplier_is_not_one_in_bf16():
    # bfloat16(1.0001) == 1.0 made the old copy probe a no-op that XLA deleted.
    assert float(jnp.bfloat16(1.0001)) == 1.0
    assert float(jnp.bfloat16(1.25)) == 1.25


def test_feed_is_zero_for_finite_outputs_and_keeps_pytrees():
    args = (jnp.ones((3, 2)), {"a": jnp.arange(4)})
    out = jnp.full((5,), 7.0)
    fed = timing._feed(args, out)
    assert jax.tree.structure(fed) == jax.tree.structure(args)
    np.testing.assert_array_equal(fed[0], args[0])
    same = timing._feed((jnp.ones(5),), out)  # same shape and dtype: the output is fed through
    np.testing.assert_array_equal(same[0], out)


def test_device_time_runs_on_cpu():
    t = timing.device_time(lambda a: a * 2.0, jnp.ones((256,)), min_ms=0.5, reps=2)
    assert 0 < t < 1.0


def test_decode_tune_checks_every_config_against_xla():
    import numpy as np

    from jax_mla.bench import decode

    shape = decode.Shape(2, 4, 40, qlen=2, page=8)
    plan = [(shape, [(16, 1, 1, 1), (16, 1, 1, 2, 4)])]
    ceil = {"copy_bytes_per_s": 1e12, "bf16_matmul_flops": 1e14}
    rows = decode.tune(plan, ceil, np.random.default_rng(0))
    assert len(rows) == 2
    for r in rows:
        assert "error" not in r, r
        assert r["us"] > 0 and r["rel_err_vs_xla"] < 1e-2, r


def test_shape_parse_reads_the_gpu_scripts_specs():
    from jax_mla.bench.decode import Shape

    assert Shape.parse("64,16,4096,4") == Shape(64, 16, 4096, qlen=4)
    assert Shape.parse("1,128,1024") == Shape(1, 128, 1024)
    assert Shape.parse("8,16,512,2,1") == Shape(8, 16, 512, qlen=2, page=1)
    with pytest.raises(ValueError, match="B,H,S"):
        Shape.parse("64,16")


def test_attention_call_is_one_layer_on_fresh_inputs():
    from jax_mla.bench.decode import Shape, attention_call

    shape = Shape(2, 4, 40, qlen=2, page=8)
    fn, (q, cache, md) = attention_call(shape, np.random.default_rng(), backend="xla")
    out, lse = jax.jit(fn)(q, cache, md)
    assert out.shape == (4, 4, 512) and lse.shape == (4, 4)
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.abs(np.asarray(lse)).max() > 0


def _benchmark_script(name):
    """``benchmarks/{name}.py`` as a module (the GPU scripts are not a package); their CPU tests
    run the Triton backend through the interpreter."""
    import importlib.util
    import pathlib

    if "triton" not in __import__("jax_mla").available_backends():
        pytest.skip("needs the Triton backend")
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_ab_times_each_variant_under_its_own_knobs(tmp_path, monkeypatch):
    """``benchmarks/gpu_ab.py`` traces every variant with its own environment (the knobs are read
    at trace time), compares its output with the first variant's, and restores the environment."""
    import json
    import os

    from jax_mla import config
    from jax_mla.backends import triton as tb

    gpu_ab = _benchmark_script("gpu_ab")
    assert gpu_ab.parse_variant("base") == ("base", {})
    assert gpu_ab.parse_variant("x:A=1,B=") == ("x", {"A": "1", "B": ""})

    seen = []
    real = tb.reduce_partials

    def spy(*a, **k):
        seen.append(config.triton_affine_reduce())
        return real(*a, **k)

    monkeypatch.setattr(tb, "reduce_partials", spy)
    monkeypatch.delenv("JAX_MLA_TRITON_AFFINE_REDUCE", raising=False)
    out = tmp_path / "ab.json"
    gpu_ab.main([str(out), "--rounds", "1", "affine", "general:JAX_MLA_TRITON_AFFINE_REDUCE=0",
                 "--", "1,2,200"])
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["affine", "general"]
    assert rows[1]["env"] == {"JAX_MLA_TRITON_AFFINE_REDUCE": "0"}
    assert all(len(r["us"]) == 1 and r["best_us"] > 0 for r in rows)
    assert rows[1]["rel_err_vs_first"] < 1e-2  # two reduce kernels, the same merge
    assert True in seen and False in seen  # each variant traced under its own knob
    assert "JAX_MLA_TRITON_AFFINE_REDUCE" not in os.environ


def test_gpu_graphs_reports_capture_time_and_error(tmp_path):
    """``benchmarks/gpu_graphs.py`` compiles the bench's chain, counts command buffers in it, and
    checks one Triton call against the XLA backend (out and LSE) in the same process."""
    import json

    gpu_graphs = _benchmark_script("gpu_graphs")
    out = tmp_path / "graphs.json"
    gpu_graphs.main([str(out), "2,2,150", "1,4,40,2,1"])
    rows = json.loads(out.read_text())
    assert [r["shape"] for r in rows] == ["B2 H2 S150 Q1 p64", "B1 H4 S40 Q2 p1"]
    for r in rows:
        assert r["command_buffers"] == 0  # the CPU compiles no CUDA graphs
        assert r["us"] > 0
        assert r["rel_err_vs_xla"] < 1e-2 and r["lse_max_abs_err"] < 1e-2
        assert r["lse_inf_rows_match"]
