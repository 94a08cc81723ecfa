"""The benchmark timers really run every call they divide by; the A/B and the grid's rows."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.bench import timing

import oracle
from conftest import make_case


def _compiled(fn, n, *args):
    return timing.chained(fn, n).lower(*args).compile().as_text()


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


def test_donated_chain_writes_its_output_into_the_buffers_passed_in():
    def call(q, c):
        return (q.reshape(-1, 16) @ c.T, q.sum(-1))

    q = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4, 16)), jnp.float32)
    c = jnp.asarray(np.random.default_rng(1).standard_normal((32, 16)), jnp.float32)
    many = timing.chained(call, 3, donated=True)
    sink = jax.jit(call)(q, c)
    text = many.lower(sink, q, c).compile().as_text()
    # Both outputs alias the donated sink (XLA writes them there), and every call is kept.
    assert text.count(" dot(") == 3
    assert "input_output_alias={ {0}: (0, {}" in text and "{1}: (1, {}" in text
    want = timing.chained(call, 3)(q, c)
    got = many(sink, q, c)
    assert sink[0].is_deleted()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    t = timing.device_time(call, q, c, min_ms=0.5, reps=2, donated=True)
    assert 0 < t < 1.0


def test_runs_in_flight_are_one_chain_fed_run_to_run():
    x = jnp.asarray(np.random.default_rng().uniform(1, 2, 64), jnp.float32)
    many = timing.chained(lambda a: a * 1.25, 3, fed=True)
    # The previous run's output is the first call's input: three runs are nine calls.
    out = x
    for _ in range(3):
        out = many(out, x)
    np.testing.assert_allclose(out, np.asarray(x) * 1.25 ** 9, rtol=1e-6)
    # An output unlike the first argument still reaches the next run, as a dependency.
    text = timing.chained(lambda a: a.sum(), 2, fed=True).lower(x.sum(), x).compile().as_text()
    assert text.count("reduce(") >= 2 and "compare(" in text
    with pytest.raises(ValueError, match="exclusive"):
        timing.chained(lambda a: a, 2, donated=True, fed=True)
    with pytest.raises(ValueError, match="exclusive"):
        timing.device_time(lambda a: a, x, donated=True, in_flight=True)
    t = timing.device_time(lambda a: a * 2.0, x, min_ms=0.5, reps=2, in_flight=True)
    assert 0 < t < 1.0


def test_serial_chain_keeps_every_call_with_no_feeding_kernel():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.uniform(1, 2, (8, 128)), jnp.float32)
    y = jnp.asarray(rng.uniform(1, 2, (8, 128)), jnp.float32)

    def call(a, b):
        return jnp.sin(a) * b + 1.0

    n = 4
    firsts = tuple(x + i for i in range(n))
    many = timing.chained(call, n, serial=True)
    outs = many(firsts, y)
    # Every call is its own, on its own first argument, and comes back.
    assert len(outs) == n
    for i, out in enumerate(outs):
        want = np.sin(np.asarray(x, np.float64) + i) * np.asarray(y, np.float64) + 1.0
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    # n calls in the compiled program (XLA merged none), and no dependency between them: no
    # compare, no in-place update of an argument.
    text = many.lower(firsts, y).compile().as_text()
    assert text.count(" sine(") == n, text
    assert "compare(" not in text and "dynamic-update-slice(" not in text
    with pytest.raises(ValueError, match="exclusive"):
        timing.chained(call, 2, fed=True, serial=True)
    with pytest.raises(ValueError, match="exclusive"):
        timing.device_time(call, x, y, donated=True, serial=True)
    t = timing.device_time(call, x, y, min_ms=0.5, reps=2, serial=True)
    assert 0 < t < 1.0


def test_serial_runs_in_flight_are_dispatched_back_to_back_with_one_wait(monkeypatch):
    """``device_time(..., serial=True, in_flight=True)``: runs of the back-to-back program, each
    on the same inputs, issued back to back with one wait at the end (``in_flight_wall``),
    divided by the calls a run."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.uniform(1, 2, (8, 128)), jnp.float32)
    seen = {}

    def fake_wall(step, wait, reps):  # one step and its wait run: seconds a run, said
        step()
        wait()
        seen["reps"] = reps
        return 1.0

    monkeypatch.setattr(timing, "in_flight_wall", fake_wall)
    monkeypatch.setattr(timing, "_wall", lambda f, args: 1e-3)  # the one-call estimate: n = 4
    t = timing.device_time(lambda a: jnp.sin(a), x, min_ms=4.0, reps=3, serial=True,
                           in_flight=True)
    assert seen["reps"] == 3 and t == pytest.approx(1.0 / 4)


def test_in_flight_time_divides_by_every_run_it_waited_for(monkeypatch):
    import time

    runs = []

    def many(prev, *args):  # a run of 3 ms, dispatched synchronously
        runs.append(prev)
        time.sleep(3e-3)
        return prev + 1

    sized = []
    monkeypatch.setattr(timing, "in_flight_runs", lambda run_s: sized.append(run_s) or 10)
    per_run = timing._in_flight(many, 0, (), reps=2)
    # Two untimed runs (compile, then the one that sizes the timing), then 10 runs a rep.
    assert len(sized) == 1 and sized[0] >= 3e-3
    assert len(runs) == 2 + 2 * 10 and runs == list(range(len(runs)))
    assert 3e-3 <= per_run < 12e-3  # loose above: a busy machine oversleeps, not 10x


def test_in_flight_runs_fill_the_timing(monkeypatch):
    monkeypatch.setattr(timing, "IN_FLIGHT_MS", 30.0)
    assert timing.in_flight_runs(3e-3) == 10 and timing.in_flight_runs(4e-3) == 8
    assert timing.in_flight_runs(1.0) == 2 and timing.in_flight_runs(0.0) == 1024


@pytest.mark.parametrize("serial", [False, True])
def test_chain_gaps_reads_the_first_run_and_the_gaps_between_runs(monkeypatch, serial):
    """``profile.chain_gaps`` on a made CUPTI record: three runs of two calls, each call a
    decode and a reduce, the first run with an idle gap between its calls (as a run XLA ran
    one thunk at a time); the first run's span and kernels per call, every run's span, and the
    idle time between runs. The runs themselves really run (on CPU), each fed the last, or
    (``serial``) each call on its own copy of the first argument."""
    from jax_mla.bench import profile

    rng = np.random.default_rng()
    dec, red, idle, slow = rng.uniform(5, 20), rng.uniform(1, 5), rng.uniform(50, 150), \
        rng.uniform(10, 30)
    ev, t = [], 0.0
    for run in range(3):
        for call in range(2):
            t += slow if run == 0 and call == 1 else 0.0
            for name, dur in (("mla_decode_kernel", dec), ("mla_reduce_affine_x", red)):
                ev.append({"name": name, "ts": t, "dur": dur})
                t += dur
        t += idle
    ran = []

    def fake_profile(run, raw=False):
        run()
        ran.append(True)
        return ev

    monkeypatch.setattr(profile, "_profile", fake_profile)
    got = profile.chain_gaps(lambda a: a * 2.0, jnp.ones(8), n=2, runs=3, serial=serial)
    assert ran and got["launches"] == 2
    assert got["span_us"] == pytest.approx(dec + red + slow / 2)
    assert got["kernels_us"] == {"mla_decode": pytest.approx(dec),
                                 "mla_reduce_affine": pytest.approx(red)}
    assert got["gap_before_us"]["mla_decode"] == pytest.approx(slow / 2)
    assert got["run_span_us"] == pytest.approx([dec + red + slow / 2, dec + red, dec + red])
    assert got["between_runs_us"] == pytest.approx(idle)
    ev.append({"name": "stray", "ts": t, "dur": 1.0})  # runs that do not split evenly
    got = profile.chain_gaps(lambda a: a * 2.0, jnp.ones(8), n=2, runs=3, serial=serial)
    assert got["between_runs_us"] is None and got["run_span_us"] is None
    assert got["launches"] == pytest.approx(13 / 6)
    assert got["span_us"] == pytest.approx((t + 1.0) / 6)


def test_decode_rows_carry_both_timers_and_match_xla(monkeypatch):
    import functools

    from jax_mla.bench import decode

    # Short chains and few dispatches: this checks the rows, not speed.
    monkeypatch.setattr(timing, "MIN_MS", 0.2)
    monkeypatch.setattr(timing, "IN_FLIGHT_MS", 0.0)
    monkeypatch.setattr(decode, "dispatch_time", functools.partial(timing.dispatch_time, n=2,
                                                                   reps=1))
    if "triton" not in __import__("jax_mla").available_backends():
        pytest.skip("needs the Triton backend")
    shape = decode.Shape(2, 4, 40, qlen=2, page=8)
    ceil = {"copy_bytes_per_s": 1e12, "bf16_matmul_flops": 1e14}
    rows = decode.run_shape(shape, ["xla", "triton"], ceil, np.random.default_rng(0))
    assert [r["backend"] for r in rows] == ["xla", "triton"]
    for r in rows:
        assert r["us"] > 0 and r["kernel_us"] > 0 and r["metadata_us"] > 0, r
        assert r["in_flight_us"] > 0, r
        assert r["rel_err_vs_xla"] < 1e-2, r


def test_shape_parse_reads_the_gpu_scripts_specs():
    from jax_mla.bench.decode import Shape

    assert Shape.parse("64,16,4096,4") == Shape(64, 16, 4096, qlen=4)
    assert Shape.parse("1,128,1024") == Shape(1, 128, 1024)
    assert Shape.parse("8,16,512,2,1") == Shape(8, 16, 512, qlen=2, page=1)
    assert Shape.parse("8,128,512,1,64,fp8") == Shape(8, 128, 512, kv="fp8")
    assert Shape.parse("8,128,512,1,64,fp8q") == Shape(8, 128, 512, kv="fp8q")
    with pytest.raises(ValueError, match="B,H,S"):
        Shape.parse("64,16")
    with pytest.raises(ValueError, match="KV"):
        Shape.parse("8,128,512,1,64,int4")


def test_attention_call_is_one_layer_on_fresh_inputs():
    from jax_mla.bench.decode import Shape, attention_call

    shape = Shape(2, 4, 40, qlen=2, page=8)
    fn, (q, cache, md) = attention_call(shape, np.random.default_rng(), backend="xla")
    out, lse = jax.jit(fn)(q, cache, md)
    assert out.shape == (4, 4, 512) and lse.shape == (4, 4)
    assert np.all(np.isfinite(np.asarray(out, np.float32))) and np.abs(np.asarray(lse)).max() > 0


def test_ab_times_each_variant_under_its_own_plan(tmp_path, monkeypatch):
    """``python -m jax_mla.bench.ab``: every variant is its own plan (its tuning object), traced
    as such without touching the environment, and compared with the first variant's output."""
    import json
    import os

    from jax_mla.backends.triton import TritonTuning
    from jax_mla.backends.triton import decode as td
    from jax_mla.bench import ab

    if "triton" not in __import__("jax_mla").available_backends():
        pytest.skip("needs the Triton backend")
    assert ab.parse_variant("base") == ("base", TritonTuning())
    assert ab.parse_variant("x:affine_reduce=0,block_n=32,split_plan=line") == (
        "x", TritonTuning(affine_reduce=False, block_n=32, split_plan="line"))
    assert ab.parse_variant("y:launcher=ffi,planner=kernel") == (
        "y", TritonTuning(launcher="ffi", planner="kernel"))
    with pytest.raises(ValueError, match="not a TritonTuning field"):
        ab.parse_variant("x:warps=4")

    seen = []
    real = td.reduce_launch

    def spy(*a, **k):
        seen.append(k["config"].affine)
        return real(*a, **k)

    monkeypatch.setattr(td, "reduce_launch", spy)
    monkeypatch.delenv("JAX_MLA_TRITON_AFFINE_REDUCE", raising=False)
    out = tmp_path / "ab.json"
    ab.main([str(out), "--rounds", "1", "affine", "general:affine_reduce=0", "--", "1,2,200"])
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["affine", "general"]
    assert rows[1]["tuning"]["affine_reduce"] is False
    assert all(len(r["us"]) == 1 and r["best_us"] > 0 for r in rows)
    assert rows[1]["rel_err_vs_first"] < 1e-2  # two reduce kernels, the same merge
    assert True in seen and False in seen  # each variant traced under its own plan
    assert "JAX_MLA_TRITON_AFFINE_REDUCE" not in os.environ


def test_ab_keeps_the_shapes_it_measured_when_a_later_one_fails(tmp_path, monkeypatch):
    """``bench.ab`` writes its file after each shape: a run cut short (a device call's time
    limit, a failing shape) keeps the rows it measured."""
    import json

    from jax_mla.bench import ab

    if "triton" not in __import__("jax_mla").available_backends():
        pytest.skip("needs the Triton backend")
    real = ab.attention_call

    def second_fails(shape, *a, **k):
        if shape.batch == 3:
            raise RuntimeError("the second shape fails")
        return real(shape, *a, **k)

    monkeypatch.setattr(ab, "attention_call", second_fails)
    out = tmp_path / "ab.json"
    with pytest.raises(RuntimeError, match="second shape"):
        ab.main([str(out), "--rounds", "1", "--no-peers", "base", "--", "1,2,200", "3,2,200"])
    rows = json.loads(out.read_text())
    assert [(r["shape"], r["variant"]) for r in rows] == [(rows[0]["shape"], "base")], rows
    assert rows[0]["shape"].startswith("B1 ") and rows[0]["best_us"] > 0, rows


@pytest.mark.parametrize("peer_fails", [False, True])
def test_ab_in_flight_times_every_row_and_flashmla_by_our_clock(tmp_path, monkeypatch,
                                                                 peer_fails):
    """``bench.ab --in-flight --serial``: our rows and FlashMLA's carry the stream time with
    runs in flight, FlashMLA's also its graph timed by our stream timer's wall clock, ours the
    back-to-back chain's. A FlashMLA timing that fails (a graph capture broken, 2026-12-06)
    drops its row, not the run."""
    import json

    from jax_mla.bench import ab

    if "triton" not in __import__("jax_mla").available_backends():
        pytest.skip("needs the Triton backend")
    monkeypatch.setattr(timing, "IN_FLIGHT_MS", 0.0)
    rng = np.random.default_rng()
    said = {k: float(rng.uniform(10, 90)) * 1e-6 for k in ("stream", "wall", "in_flight")}

    class Peer:  # FlashMLA's row: our own outputs, its three timers
        def __init__(self, args):
            self.got = ab._outputs(*ab.attention_call(ab.Shape.parse("1,2,200"),
                                                      np.random.default_rng(0)))

        def outputs(self):
            return self.got

        stream_time = staticmethod(lambda: said["stream"])
        in_flight_time = staticmethod(lambda: said["in_flight"])

        @staticmethod
        def wall_time():
            if peer_fails:
                raise RuntimeError("CUDA error: operation failed during capture")
            return said["wall"]

    monkeypatch.setattr(ab, "_flashmla", lambda shape, args, table, lens: Peer(args))
    out = tmp_path / "ab.json"
    ab.main([str(out), "--rounds", "1", "--in-flight", "--serial", "base", "--", "1,2,200"])
    if peer_fails:
        (ours,) = json.loads(out.read_text())
        assert ours["variant"] == "base" and ours["in_flight_best_us"] > 0
        return
    ours, peer = json.loads(out.read_text())
    assert ours["variant"] == "base" and peer["variant"] == "flashmla"
    assert ours["in_flight_best_us"] > 0 and "wall_best_us" not in ours
    # ``--serial``: our calls back to back, no feeding kernel; FlashMLA's row has no such time.
    assert ours["serial_best_us"] == min(ours["serial_us"]) > 0 and "serial_us" not in peer
    # Both flags: those runs in flight too.
    assert (ours["serial_in_flight_best_us"] == min(ours["serial_in_flight_us"]) > 0
            and "serial_in_flight_us" not in peer)
    assert peer["best_us"] == pytest.approx(said["stream"] * 1e6)
    assert peer["wall_best_us"] == pytest.approx(said["wall"] * 1e6)
    assert peer["in_flight_best_us"] == pytest.approx(said["in_flight"] * 1e6)
    assert peer["rel_err_vs_first"] == 0.0


def _fake_flashmla():
    """FlashMLA's Python API over the float64 oracle, in FlashMLA's layouts: q ``[B, Q, H, D]``,
    cache ``[pages, 64, 1, D]``, out ``[B, Q, H, L]``, lse ``[B, H, Q]``."""
    import types

    import torch

    def get_mla_metadata(*_, **__):
        return types.SimpleNamespace(), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta,
                               num_splits, softmax_scale=None, causal=False):
        b, qlen, h, d = q.shape
        assert k_cache.shape[2] == 1 and num_splits is None and causal == (qlen > 1)
        out, lse = oracle.mla_decode(
            q.reshape(b * qlen, h, d).double().numpy(), k_cache[:, :, 0].double().numpy(),
            block_table.numpy(), cache_seqlens.numpy(), qlen=qlen, page_size=k_cache.shape[1],
            scale=softmax_scale, kv_lora_rank=head_dim_v)
        return (torch.from_numpy(out).reshape(b, qlen, h, head_dim_v),
                torch.from_numpy(lse).reshape(b, qlen, h).transpose(1, 2))

    return types.SimpleNamespace(get_mla_metadata=get_mla_metadata,
                                 flash_mla_with_kvcache=flash_mla_with_kvcache)


def test_ab_times_fp8_queries_multiplied_as_they_are_and_dequantised(tmp_path):
    """The ``ab_fp8q`` stage's A/B on CPU: an ``fp8q`` shape (e4m3 query with its scale, e4m3
    cache) under the default (fp8 products) and ``fp8_qk=0`` (dequantised first), the two
    outputs equal to the bf16 rounding of the dequantised query."""
    import json

    from jax_mla.bench import ab

    if "triton" not in __import__("jax_mla").available_backends():
        pytest.skip("needs the Triton backend")
    out = tmp_path / "ab.json"
    ab.main([str(out), "--rounds", "1", "base", "dq:fp8_qk=0", "--", "2,4,100,1,16,fp8q"])
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["base", "dq"]
    assert rows[1]["tuning"]["fp8_qk"] is False and rows[0]["tuning"]["fp8_qk"] is True
    assert 0 < rows[1]["rel_err_vs_first"] < 1e-2, rows[1]


def test_flashmla_peer_reads_our_buffers_in_its_layout(rng):
    """The FlashMLA row's glue: our q / cache / table / lengths viewed in FlashMLA's layouts,
    its outputs read back in ours (rows ``b * Q + t``; LSE from ``[B, H, Q]``)."""
    import jax_mla
    from jax_mla.bench import peers

    pytest.importorskip("torch")
    c = make_case(rng, seq_lens=[130, 7, 64], qlen=2, num_heads=3, page_size=64)
    q, cache = jnp.asarray(c.q, jnp.float32), jnp.asarray(c.cache, jnp.float32)
    fm = peers.FlashMLA(q, cache, jnp.asarray(c.block_table), jnp.asarray(c.seq_lens), qlen=2,
                        scale=c.scale, module=_fake_flashmla())
    out, lse = fm.outputs()
    md = jax_mla.build_decode_metadata(c.block_table, c.seq_lens, page_size=64, qlen=2)
    want, want_lse = jax_mla.mla_attention(q, cache, md, scale=c.scale, return_lse=True,
                                           backend="xla")
    assert out.shape == (6, 3, 512) and lse.shape == (6, 3)
    assert oracle.rel_err(out, np.asarray(want)) < 1e-5
    np.testing.assert_allclose(lse, np.asarray(want_lse), rtol=1e-5)
    assert peers.flashmla_reason("bf16", 64, 128) is None
    assert "bf16 only" in peers.flashmla_reason("fp8", 64, 16)
    assert "64 tokens" in peers.flashmla_reason("bf16", 1, 16)


def test_flashmla_graph_is_timed_by_our_two_clocks(rng, monkeypatch):
    """``wall_time``: a replay and its wait, wall clock; ``in_flight_time``: replays back to
    back and one wait. Both divide by the graph's calls; a fake graph of 2 ms, 8 calls."""
    import time
    import types

    from jax_mla.bench import peers

    torch = pytest.importorskip("torch")
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: waits.append(len(replays)))
    sized = []
    monkeypatch.setattr(timing, "in_flight_runs", lambda run_s: sized.append(run_s) or 10)
    replays = []
    graph = types.SimpleNamespace(replay=lambda: (replays.append(1), time.sleep(2e-3)))
    fm = peers.FlashMLA.__new__(peers.FlashMLA)
    fm._graphs = {(20.0, 128): (graph, 8)}
    assert 2e-3 / 8 <= fm.wall_time(reps=3) < 8e-3 / 8
    assert len(replays) == 3 and waits == [1, 2, 3]
    replays.clear(), waits.clear()
    assert 2e-3 / 8 <= fm.in_flight_time(reps=2) < 8e-3 / 8
    # One replay sizes the timing (here 10 runs), then each rep waits once.
    assert len(sized) == 1 and sized[0] >= 2e-3
    assert len(replays) == 1 + 2 * 10 and waits == [1, 11, 21]


def test_command_buffers_are_counted_from_the_compiled_hlo(monkeypatch):
    """The compiled program's ``command_buffer`` computations and our custom calls inside: a
    launch sequence counts as ours, another target does not."""
    from jax_mla.bench import profile

    hlo = """HloModule m, is_scheduled=true

%command_buffer (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %a = f32[4]{0} custom-call(%p0), custom_call_target="jax_mla_triton", api_version=4
  ROOT %b = f32[4]{0} custom-call(%a), custom_call_target="jax_mla_triton", api_version=4
}

%command_buffer.2 (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %s = f32[4]{0} custom-call(%p0), custom_call_target="jax_mla_triton_sequence"
}

%command_buffer.1 (p0: f32[4]) -> f32[4] {
  ROOT %p0 = f32[4]{0} parameter(0)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %c = f32[4]{0} call(%x), to_apply=%command_buffer
  %d = f32[4]{0} custom-call(%c), custom_call_target="jax_mla_triton"
  %e = f32[4]{0} call(%d), to_apply=%command_buffer.1
  %f = f32[4]{0} custom-call(%e), custom_call_target="other_target"
  ROOT %g = f32[4]{0} call(%f), to_apply=%command_buffer.2
}
"""

    class Fake:
        def lower(self, *a):
            return self

        def compile(self):
            return self

        def as_text(self):
            return hlo

    monkeypatch.setattr(profile.jax, "jit", lambda fn: Fake())
    assert profile.command_buffers(None) == {"command_buffers": 3, "custom_calls": 4,
                                             "custom_calls_in_command_buffers": 3}


def test_quick_bench_is_a_cpu_smoke_run(tmp_path):
    """``python -m jax_mla.bench --quick`` on a CPU: no ceiling probes (a 1 GiB copy and an
    8192^2 matmul took 9.7 GB), under 2 GB of memory, results under the temp directory and
    nothing where it runs. (It took 33 s on the 2-core dev machine; the timeout only guards
    against a runaway, it is not a speed claim.)"""
    import json
    import os
    import subprocess
    import sys

    run_dir, tmp = tmp_path / "cwd", tmp_path / "tmp"
    run_dir.mkdir()
    tmp.mkdir()
    # A user's shell, not this test process's environment (which earlier tests may have set).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env.update(TMPDIR=str(tmp), PYTHONPATH=root)
    # The peak of this program alone: /proc's VmHWM starts again at exec, while ru_maxrss
    # also counts the pages a forked child shared with this (large) test process.
    script = ("import re, resource, runpy, sys\n"
              "sys.argv = ['jax_mla.bench', '--quick']\n"
              "try:\n    runpy.run_module('jax_mla.bench', run_name='__main__')\n"
              "except SystemExit as e:\n    assert not e.code, e.code\n"
              "try:\n    peak = int(re.search(r'VmHWM:\\s+(\\d+)', "
              "open('/proc/self/status').read()).group(1))\n"
              "except OSError:\n    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "print('peak_kib', peak)\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=run_dir, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no ceiling probes" in res.stdout
    peak_kib = int(res.stdout.split("peak_kib")[-1])
    assert peak_kib < 2 * 1024 * 1024, f"{peak_kib / 1024:.0f} MiB"
    assert not any(run_dir.iterdir())
    rows = json.loads((tmp / "jax_mla_bench" / "decode.json").read_text())["rows"]
    assert {r["backend"] for r in rows} >= {"xla"} and all("error" not in r for r in rows)


def test_cmdbuf_reads_xla_thunk_dump_and_log(tmp_path):
    from jax_mla.bench import cmdbuf

    assert cmdbuf.thunk_summary(str(tmp_path))["thunk_dump"] is None
    (tmp_path / "module_0007.jit_many.thunk_sequence.txt").write_text("kKernel\nkKernel\n")
    (tmp_path / "module_0007.jit_many.thunk_sequence_after_thunk_passes.txt").write_text(
        "000: kCommandBuffer\n  001: kKernel\n  002: kCustomCall\n003: kCustomCall\n")
    got = cmdbuf.thunk_summary(str(tmp_path))
    assert got["thunk_dump"].endswith("after_thunk_passes.txt")
    assert got["command_buffers"] == 1
    assert got["thunk_kinds"] == {"CommandBuffer": 1, "Kernel": 1, "CustomCall": 2}
    log = ("I1205 10:00:00.1 123 command_buffer_conversion_pass.cc:9] Module m "
           "CommandBufferConfig: enabled_commands: [FUSION]\n"
           "I1205 10:00:00.2 123 other.cc:1] unrelated\n"
           "I1205 10:00:00.3 124 command_buffer_conversion_pass.cc:9] Module m "
           "CommandBufferConfig: enabled_commands: [FUSION]\n"
           "I1205 10:00:00.4 124 command_buffer_conversion_pass.cc:7] Thunk kind kCopy is not "
           "lowered to command buffer because command size is less than the min graph size\n")
    assert cmdbuf.keep_log_lines(log) == [
        "Module m CommandBufferConfig: enabled_commands: [FUSION]",
        "Thunk kind kCopy is not lowered to command buffer because command size is less than "
        "the min graph size"]


def test_cmdbuf_finds_thunk_dumps_in_module_folders(tmp_path):
    from jax_mla.bench import cmdbuf

    sub = tmp_path / "module_0009.jit_many"
    sub.mkdir()
    (sub / "module_0009.jit_many.thunk_sequence_after_thunk_passes.txt").write_text(
        "kCommandBuffer\nkCommandBuffer\n")
    (tmp_path / "module_0009.jit_many.sm_9.0_gpu_after_optimizations.txt").write_text("HloModule")
    got = cmdbuf.thunk_summary(str(tmp_path))
    assert got["command_buffers"] == 2
    (sub / "module_0009.jit_many.thunk_sequence_after_thunk_passes.txt").unlink()
    assert cmdbuf.thunk_summary(str(tmp_path))["dump_files"] == [
        "module_0009.jit_many.sm_9.0_gpu_after_optimizations.txt"]


def test_cmdbuf_counts_command_buffer_updates_from_xla_log():
    """XLA's per-execution log (updates before a replay, commands re-recorded and skipped, their
    microseconds) is summed per chain, with unrelated lines ignored."""
    from jax_mla.bench import cmdbuf

    rng = np.random.default_rng()
    allocs = rng.integers(1, 9, size=3)
    us = rng.uniform(100, 2000, size=3)
    done = rng.integers(10, 400, size=3)
    lines = []
    for i in range(3):
        lines += [f"I1205 1 command_buffer_thunk.cc:279] Update command buffer on device #0 after "
                  f"{i} executions since last update; num_commands=400; "
                  f"updated_allocs={allocs[i]}",
                  f"I1205 2 command_executor.cc:690] Updated {done[i]} commands in {us[i]:.3f} "
                  f"μs (skipped {400 - done[i]} command updates)",
                  f"I1205 3 command_buffer_thunk.cc:302] Updated command buffer in {us[i]:.3f} μs",
                  "I1205 4 command_buffer_thunk.cc:346] Execute command buffer on device #0; "
                  f"num_executions={i}", "I1205 5 other.cc:1] Updated nothing"]
    got = cmdbuf.update_summary("\n".join(lines) + "\nExecute command buffer on device #0;")
    assert (got["executions"], got["updates"], got["num_commands"]) == (4, 3, 400), got
    assert got["updated_allocs_mean"] == pytest.approx(allocs.mean())
    assert got["update_us_mean"] == pytest.approx(us.mean(), abs=1e-3)
    assert got["commands_updated_mean"] == pytest.approx(done.mean())
    assert got["commands_skipped_mean"] == pytest.approx(400 - done.mean())
    none = cmdbuf.update_summary("I1205 other.cc:1] nothing")
    assert none["updates"] == 0 and none["update_us_mean"] is None


def test_cmdbuf_reads_the_jax_0_11_forms_of_xla_log():
    """jax 0.11's XLA prefixes the device ordinal and words its lines otherwise (the strings are
    those of the 0.11.2 CUDA plugin): replays and executions between updates, first records
    apart from updates, our calls recorded by stream capture or created by the record stage,
    and a run as plain thunks."""
    from jax_mla.bench import cmdbuf

    rng = np.random.default_rng()
    n_cmd, moved = int(rng.integers(20, 400)), int(rng.integers(1, 9))
    runs = int(rng.integers(3, 9))
    lines = ["I1205 command_buffer_thunk.cc:250] [0] Create/Update command buffer by recoding "
             "command buffer cmd sequence after 0 executions since last update; "
             f"num_commands={n_cmd}; updated_allocs=0; is_first_record=1; needs_update=0"]
    lines += ["I1205 custom_call_thunk.cc:700] FFI handler requested or required fallback to "
              "stream capture."] * 3
    recorded = int(rng.integers(1, 6))
    lines += ["I1205 custom_call_thunk.cc:180] FfiCreateLaunch for kernel: mla_decode_kernel, "
              "use_pdl from ctx: 0, num_dependencies passed: 0, resolved deps size: 1"] * recorded
    for _ in range(runs):
        lines += ["I1205 command_buffer_thunk.cc:250] [0] Create/Update command buffer by "
                  "recoding command buffer cmd sequence after 1 executions since last update; "
                  f"num_commands={n_cmd}; updated_allocs={moved}; is_first_record=0; "
                  "needs_update=1",
                  "I1205 command_buffer_thunk.cc:270] [0] Updated command buffer in 41 μs; "
                  f"num_commands={n_cmd}",
                  "I1205 command_executor.cc:600] Skip updating command 3",
                  "I1205 command_buffer_thunk.cc:300] [0] Execute command buffer; "
                  "num_executions=1"]
    lines.append("I1205 command_buffer_thunk.cc:200] Execute command buffer thunk as a regular "
                 "thunk sequence because we detected active profiling session")
    got = cmdbuf.update_summary("\n".join(lines))
    assert (got["executions"], got["executions_since_update_max"]) == (runs, 1), got
    assert (got["updates"], got["first_records"], got["num_commands"]) == (runs, 1, n_cmd), got
    assert got["updated_allocs_mean"] == moved and got["update_us_mean"] == 41, got
    assert got["stream_captures"] == 3 and got["commands_skipped_logged"] == runs, got
    assert got["ffi_records"] == recorded, got
    assert got["thunk_sequence_because"] == ["we detected active profiling session"], got


def test_cmdbuf_captures_what_native_code_writes_to_stderr(capfd):
    """The capture takes file descriptor 2 itself (XLA's C++ log does not pass through
    ``sys.stderr``) and writes the text back afterwards."""
    from jax_mla.bench import cmdbuf

    token = f"native-{np.random.default_rng().integers(1 << 30)}"
    with cmdbuf.captured_stderr() as got:
        os.write(2, f"{token} Execute command buffer on device #0\n".encode())
    assert token in got[0]
    assert cmdbuf.update_summary(got[0])["executions"] == 1
    assert token in capfd.readouterr().err


def test_the_chain_stage_runs_each_launch_variant_with_xla_logging(monkeypatch, tmp_path):
    """The session's ``cmdbuf_chains`` stage: one process per variant (by stream capture, the
    default; through the record stage; with the initialize stage; outside command buffers),
    each with XLA's command-buffer and record log on and command buffers kept while
    the profiler runs."""
    from jax_mla.bench import cmdbuf, session

    calls = []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/lib/ours.so")
    monkeypatch.setattr(session, "_python",
                        lambda args, timeout, name, **env: calls.append((args, name, env)))
    session.stage_cmdbuf_chains(None)
    assert [name for _, name, _ in calls] == [f"cmdbuf_chains {v}" for v in (
        "on", "record", "init", "off")]
    want = [("1", "0", None), ("1", "0", "ffi_record"), ("1", "1", None), ("0", "0", None)]
    for (args, name, env), (cb, init, launcher) in zip(calls, want):
        assert args[:3] == ["-m", "jax_mla.bench.cmdbuf", "--chains"]
        assert args[3] == str(tmp_path / f"cmdbuf_chains_{name.split()[1]}.json")
        assert (env["JAX_MLA_FFI_COMMAND_BUFFERS"],
                env["JAX_MLA_FFI_INITIALIZE_STAGE"]) == (cb, init)
        assert env.get("JAX_MLA_TRITON_LAUNCHER") == launcher
        assert env["TF_CPP_VMODULE"] == cmdbuf.VMODULE and "custom_call_thunk=3" in env[
            "TF_CPP_VMODULE"] and "record_ffi=3" in env["TF_CPP_VMODULE"]
        assert env["XLA_FLAGS"] == "--xla_enable_command_buffers_during_profiling=true"
        assert env["JAX_MLA_FFI_LIBRARY"] == "/lib/ours.so"


def test_the_record_stage_times_captured_against_recorded_launches(monkeypatch, tmp_path):
    """The session's ``record`` stage: one ``bench.ab`` process, the captured default against
    ``launcher="ffi_record"``, into ``record_ab.json``; shapes after ``--`` replace its own.
    The variants parse to those launchers."""
    from jax_mla.bench import ab, session

    calls = []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/lib/ours.so")
    monkeypatch.setattr(session, "_python",
                        lambda args, timeout, name, **env: calls.append((args, env)))
    session.stage_record([])
    session.stage_record(["2,16,1024"])
    (first, env), (second, _) = calls
    assert first[:3] == ["-m", "jax_mla.bench.ab", str(tmp_path / "record_ab.json")]
    variants = first[3:first.index("--")]
    assert [ab.parse_variant(v)[1].launcher for v in variants] == ["ffi", "ffi_record"]
    assert first[first.index("--") + 1:-1] == list(session.RECORD_AB[2])
    assert first[-1] == "--no-peers" and env["JAX_MLA_FFI_LIBRARY"] == "/lib/ours.so"
    assert second[second.index("--") + 1:] == ["2,16,1024", "--no-peers"]


def test_chain_compiler_options_parse_booleans_integers_and_words(monkeypatch):
    from jax_mla.bench import cmdbuf

    monkeypatch.delenv("JAX_MLA_CHAIN_COMPILER_OPTIONS", raising=False)
    assert cmdbuf.compiler_options() == {}
    monkeypatch.setenv("JAX_MLA_CHAIN_COMPILER_OPTIONS",
                       "xla_gpu_temp_buffer_use_separate_color=true,xla_a=False,xla_n=16,"
                       "xla_mode=SKIP_TEMP")
    assert cmdbuf.compiler_options() == {"xla_gpu_temp_buffer_use_separate_color": True,
                                         "xla_a": False, "xla_n": 16, "xla_mode": "SKIP_TEMP"}


def test_a_runs_anatomy_cuts_its_wall_at_the_gpus_first_and_last_activity():
    """``split_runs``: each dispatch annotation and the wait after it bound one run; the GPU's
    activities inside it cut the run into before / span / after, with the GPU's busy time and
    the host events overlapping each window clipped to it. A run with no GPU activity keeps its
    wall and dispatch only; activities outside every run are not counted."""
    from jax_mla.bench import cmdbuf

    D, W = cmdbuf.DISPATCH_EVENT, cmdbuf.WAIT_EVENT
    us = 1000
    host = [(D, 0, 30 * us), (W, 31 * us, 200 * us), ("Execute", 5 * us, 60 * us),
            ("Sync", 150 * us, 199 * us), ("Inside", 80 * us, 90 * us),
            (D, 300 * us, 310 * us), (W, 311 * us, 320 * us)]
    device = [(50 * us, 100 * us), (105 * us, 140 * us), (250 * us, 260 * us)]
    first, second = cmdbuf.split_runs(host, device)
    assert first["wall_us"] == 200 and first["dispatch_us"] == 30
    assert (first["before_us"], first["span_us"], first["after_us"]) == (50, 90, 60)
    assert first["busy_us"] == 85 and first["gpu_events"] == 2
    assert first["before_events"] == {"Execute": 45.0}  # from its start to the GPU's
    assert first["after_events"] == {"Sync": 49.0}
    assert "Inside" not in first["before_events"] | first["after_events"]
    assert second == {"wall_us": 20.0, "dispatch_us": 10.0, "gpu_events": 0}


def test_anatomies_time_each_chain_then_trace_it(monkeypatch):
    """``cmdbuf --anatomy`` on CPU: a row per shape and chain length, with the unprofiled wall
    and enqueue times a call and the traced runs (no GPU activities here, so walls only)."""
    from jax_mla.bench import cmdbuf, decode

    args = (jnp.ones((1, 2, 576), jnp.bfloat16), jnp.ones(3), jnp.ones(3))
    monkeypatch.setattr(decode, "attention_call",
                        lambda shape, rng: (lambda q, c, m: jnp.sin(q[..., :512]) * 2, args))
    rows = cmdbuf.anatomies(["1,16,64", "xla:1,16,64"], ns=(2, 3), reps=2)
    assert [(r["shape"], r["n"]) for r in rows] == [("1,16,64", 2), ("1,16,64", 3),
                                                    ("xla:1,16,64", 2), ("xla:1,16,64", 3)]
    out = cmdbuf.xla_control(*args)  # the control's output is shaped as the attention's
    assert out.shape == (1, 2, 512) and out.dtype == jnp.bfloat16
    for r in rows:
        assert r["unprofiled_per_call_us"]["wall_us"] > 0
        assert r["unprofiled_per_call_us"]["enqueue_us"] > 0
        assert len(r["runs"]) == 5 and all(run["gpu_events"] == 0 for run in r["runs"])
        assert r["median"]["wall_us"] > 0 and r["clocks"]["device_events"] == 0
        assert not r["tfrt_gpu_client"] and r["embed_binaries"]


def test_cmdbuf_command_lines_take_their_options_anywhere(tmp_path, monkeypatch):
    """``cmdbuf --anatomy`` and ``--chains``: ``--ns`` and ``--reps`` (and ``--no-profile``)
    are taken out wherever they stand, the rest being the output path and the shapes; absent,
    the defaults."""
    from jax_mla.bench import cmdbuf

    seen = []
    monkeypatch.setattr(cmdbuf, "anatomies", lambda specs, ns, reps: seen.append(
        ("anatomy", specs, ns, reps)) or [])
    monkeypatch.setattr(cmdbuf, "chain_lengths", lambda specs, ns, profiled: seen.append(
        ("chains", specs, ns, profiled)) or [])
    out = str(tmp_path / "o.json")
    cmdbuf.main(["--anatomy", out, "1,16,64", "--reps", "21", "--ns", "128", "xla:1,16,64"])
    cmdbuf.main(["--anatomy", out])
    cmdbuf.main(["--chains", out, "--no-profile", "--ns", "16,128", "8,16,4096"])
    assert seen == [("anatomy", ["1,16,64", "xla:1,16,64"], (128,), 21),
                    ("anatomy", ["1,128,1024", "8,16,4096"], (16, 128), 7),
                    ("chains", ["8,16,4096"], (16, 128), False)]
