"""The one-device DCP split bench runs, reports every field, and times what DCP runs."""

import json

import jax
import numpy as np
import pytest

from jax_mla.bench import dcp_split
from jax_mla.bench.dcp_split import SplitShape, bench_dcp_split

_TIMED = []


def _timer(fn, *args):
    """Traces ``fn`` (shape errors surface) without compiling it; a fixed, distinct time."""
    jax.eval_shape(fn, *args)
    _TIMED.append(fn)
    return 1e-3 * len(_TIMED)


def test_bench_dcp_split_rows():
    shapes = [SplitShape(batch=2, heads=2, seq=100, qlen=2, page=16, dtype="float32",
                         kv_lora_rank=32, rope_dim=16),
              dict(batch=1, heads=4, seq=33, page=8, interleave=2, kv_lora_rank=32, rope_dim=16)]
    rows = bench_dcp_split(_timer, backend="xla", shapes=shapes[:1], world_sizes=(2, 4))
    rows += bench_dcp_split(_timer, backend="xla", shapes=shapes[1:], world_sizes=(4,))
    assert len(rows) == 3
    for r in rows:
        assert r["simulated"] and r["gathered_heads"] == r["heads_per_device"] * r["world_size"]
        for k in ("local_attn_s", "merge_ag_rs_s", "merge_a2a_s"):
            assert r[k] > 0
        for k in ("merge_share_ag_rs", "merge_share_a2a"):
            assert 0 < r[k] < 1
        assert r["merge_share_ag_rs"] == pytest.approx(
            r["merge_ag_rs_s"] / (r["local_attn_s"] + r["merge_ag_rs_s"]))
        # A2A never sends more than AG+RS (fewer LSE bytes; half the out bytes in bf16).
        assert r["a2a_bytes"] <= r["ag_rs_bytes"]
    assert rows[0]["local_seq_len"] == 50 and rows[1]["local_seq_len"] == 25
    # 33 tokens over 4 ranks, 2 at a time: rank 0 holds 8 + 1.
    assert rows[2]["dtype"] == "bfloat16" and rows[2]["local_seq_len"] == 9


def test_bench_rejects_bad_interleave():
    with pytest.raises(ValueError, match="multiple of interleave"):
        bench_dcp_split(_timer, backend="xla", world_sizes=(2,),
                        shapes=[SplitShape(batch=1, heads=1, seq=8, page=6, interleave=4,
                                           kv_lora_rank=8, rope_dim=8)])


def test_merge_functions_match_each_other():
    """The two local steps the bench times give the same merged result."""
    from jax_mla.dcp import merge_partials, scale_own_partial, to_head_owner_major

    rng = np.random.default_rng(0)
    n, t, h, lr = 4, 3, 2, 8
    outs = rng.standard_normal((n, t, h * n, lr)).astype(np.float32)
    lses = (rng.standard_normal((n, t, h * n)) * 3).astype(np.float32)
    lses[1:, 0] = -np.inf
    rs = sum(np.asarray(scale_own_partial(outs[r], lses, r)[0]) for r in range(n))
    for owner in range(n):
        recv = np.stack([np.asarray(to_head_owner_major(outs[r], n))[owner] for r in range(n)])
        recv_l = np.stack([np.asarray(to_head_owner_major(lses[r], n))[owner] for r in range(n)])
        out, _ = merge_partials(recv, recv_l)
        np.testing.assert_allclose(out, rs[:, owner * h:(owner + 1) * h], rtol=1e-5, atol=1e-6)


def test_cli_quick_runs_and_writes_results(tmp_path, capsys):
    """``python -m jax_mla.bench.dcp_split --quick --out DIR`` with the real device timer."""
    assert dcp_split.main(["--quick", "--out", str(tmp_path), "--world-sizes", "2,8"]) == 0
    data = json.loads((tmp_path / "dcp_split.json").read_text())
    rows = data["rows"]
    assert "no collective was run" in data["environment"]["note"]
    assert len(rows) == 2 * len(dcp_split.target_shapes(quick=True))
    for r in rows:
        assert r["simulated"] and r["local_attn_s"] > 0 and 0 < r["merge_share_a2a"] < 1
        assert r["local_seq_len"] == -(-r["seq_len"] // r["world_size"]) or r["qlen"] > 1
    assert (tmp_path / "dcp_split.csv").read_text().count("\n") == len(rows) + 1
    assert "merge_share_ag_rs" in capsys.readouterr().out


def test_full_grid_is_the_issues_grid():
    shapes = dcp_split.target_shapes()
    assert {s.batch for s in shapes} == {32, 128} and {s.heads for s in shapes} == {16}
    assert {s.seq for s in shapes} == {32768, 131072} and {s.qlen for s in shapes} == {1}
