"""``python -m jax_mla.bench serve``: the JSON a served run writes, and the peer's timeline."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jax_mla.bench import serve
from jax_mla.serving.engine import Request


def test_serve_writes_the_metrics(tmp_path, monkeypatch, capsys):
    small = dataclasses.replace(serve.PRESETS["tiny"], layers=1, hidden=64, heads=4,
                                kv_lora_rank=32, q_lora_rank=32, rope_dim=8, nope_dim=16,
                                v_dim=16, mlp_hidden=64, vocab=64, max_decode=2,
                                prefill_tokens=16, workspace_tokens=32, requests=5, prompt=10,
                                new_tokens=4, page_size=8, num_pages=32)
    monkeypatch.setitem(serve.PRESETS, "small", small)
    out = tmp_path / "serve.json"
    from jax_mla.bench.__main__ import main

    assert main(["serve", "--preset", "small", "--out", str(out), "--backend", "xla",
                 "--peer", "off"]) == 0
    run = json.loads(out.read_text())["small"]
    ours = run["ours"]
    assert run["steady_compiles"] == 0 and run["compile_s"] > 0
    assert run["buckets"] == [[1, 0], [2, 0], [0, 16], [2, 16]]
    assert ours["output_tokens"] == sum(r.max_new_tokens for r in serve.trace(small))
    for key in ("ttft_ms", "itl_ms"):
        assert {"p50", "p90", "p99"} <= set(ours[key]) and ours[key]["p50"] > 0
    assert ours["tokens_per_s"] > 0 and ours["total_tokens_per_s"] > ours["tokens_per_s"]
    assert ours["steps"] and all("roofline_fraction" in r for r in ours["steps"])
    assert {r["kind"] for r in ours["steps"]} >= {"decode", "prefill"}
    assert "TTFT ms p50/p90/p99" in capsys.readouterr().out
    # A second preset run adds its entry beside the first.
    assert main(["serve", "--preset", "small", "--tag=-again", "--out", str(out),
                 "--backend", "xla", "--peer", "off", "--requests", "2"]) == 0
    assert set(json.loads(out.read_text())) == {"small", "small-again"}


def test_the_trace_is_fixed():
    a, b = serve.trace(serve.PRESETS["tiny"]), serve.trace(serve.PRESETS["tiny"])
    assert [(r.prompt, r.max_new_tokens) for r in a] == [(r.prompt, r.max_new_tokens) for r in b]


def test_peer_timeline():
    """Arrival at the start of the step after submission, tokens at the end of their step."""
    r0 = Request(0, [1, 2], 2, output=[3, 4], arrival_step=1, token_steps=[1, 3])
    r1 = Request(1, [1], 1, output=[5], arrival_step=2, token_steps=[3])
    m = serve.timeline_metrics([r0, r1], [0.010, 0.020, 0.030])
    assert m["wall_s"] == pytest.approx(0.060)
    assert m["ttft_ms"]["n"] == 2
    np.testing.assert_allclose(sorted([m["ttft_ms"]["p50"]]), [(10 + 50) / 2])
    assert m["itl_ms"]["p50"] == pytest.approx(50.0)
    assert m["tokens_per_s"] == pytest.approx(3 / 0.060)


def test_kernel_groups():
    assert serve.kernel_group("mla_decode_sm90_bf16") == "attention"
    assert serve.kernel_group("nvjet_tst_128x64_64x4_1x2_h_bz_coopB_NTN") == "matmul"
    assert serve.kernel_group("loop_scatter_fusion") == "cache write"
    assert serve.kernel_group("input_reduce_fusion_3") == "norms/rope"
    assert serve.kernel_group("loop_add_fusion") == "other"
