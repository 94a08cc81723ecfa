"""The persistent split plan (``jax_mla/schedule.py``): coverage, balance and the reduce maps."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_mla.schedule import OVERHEAD_BLOCKS, plan_splits


def _plan(lens, *, qlen=1, block_n=16, programs=8):
    lens = np.asarray(lens, np.int32)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    sched = plan_splits(lens, indptr, qlen=qlen, block_n=block_n, num_programs=programs)
    return lens, indptr, {k: np.asarray(getattr(sched, k)) for k in (
        "work_indptr", "work_info_set", "num_works", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map")}, sched


def _check(lens, qlen, block_n, programs):
    lens, indptr, p, sched = _plan(lens, qlen=qlen, block_n=block_n, programs=programs)
    b = len(lens)
    n_works = int(p["num_works"][0])
    wp = p["work_indptr"]
    assert sched.max_works == programs + b and sched.num_programs == programs
    assert wp[0] == 0 and wp[-1] == n_works and np.all(np.diff(wp) >= 0)
    info = p["work_info_set"][:n_works]
    # Every request is covered exactly once, in order, by tiles that start on block_n.
    for r in range(b):
        mine = info[info[:, 0] == r]
        assert len(mine) >= 1, f"request {r} has no work (its rows would never be written)"
        lo = mine[:, 4] - indptr[r]
        hi = mine[:, 5] - indptr[r]
        assert lo[0] == 0 and hi[-1] == lens[r]
        np.testing.assert_array_equal(lo[1:], hi[:-1])
        assert np.all(lo % block_n == 0) and np.all(hi >= lo)
        np.testing.assert_array_equal(mine[:, 6], lens[r] - hi)  # kv_offset
        np.testing.assert_array_equal(mine[:, 2], r * qlen)
        np.testing.assert_array_equal(mine[:, 3], r * qlen + qlen)
        split = len(mine) > 1
        assert np.all((mine[:, 1] >= 0) == split)
        got = p["reduce_indptr"][r + 1] - p["reduce_indptr"][r]
        assert got == (len(mine) if split else 0)
        if split:  # partial rows are this request's slots, in work order
            slots = p["reduce_partial_map"][p["reduce_indptr"][r]:p["reduce_indptr"][r + 1]]
            np.testing.assert_array_equal(mine[:, 1], slots)
    # Balance: every program's cost (blocks + the overhead unit of each request it starts) is at
    # most the equal share plus one unit.
    cost = (-(-lens // block_n)) + OVERHEAD_BLOCKS
    chunk = max(1, -(-int(cost.sum()) // programs))
    for q in range(programs):
        w = info[wp[q]:wp[q + 1]]
        units = ((w[:, 5] - w[:, 4]) + block_n - 1) // block_n
        starts = (w[:, 4] == indptr[w[:, 0]]).sum()  # works that hold their request's overhead
        assert units.sum() + starts * OVERHEAD_BLOCKS <= chunk + OVERHEAD_BLOCKS
    # No piece holds only an overhead unit of a request that has KV (an empty extra partial).
    for r in np.flatnonzero(lens > 0):
        mine = info[info[:, 0] == r]
        assert np.all(mine[:, 5] > mine[:, 4]), (r, mine)
    # Partial slots are distinct and dense.
    ploc = info[info[:, 1] >= 0, 1]
    assert len(set(ploc.tolist())) == len(ploc)
    np.testing.assert_array_equal(np.sort(ploc), np.arange(len(ploc)) * qlen)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.sampled_from([1, 2, 4]),
       st.sampled_from([16, 32]), st.integers(1, 24))
def test_plan_covers_balances_and_maps(lens, qlen, block_n, programs):
    lens = [max(x, 0) for x in lens]
    _check(lens, qlen, block_n, programs)


def test_plan_splits_long_request_across_programs():
    lens, indptr, p, _ = _plan([16 * 40, 16, 0, 16 * 3], programs=8)
    info = p["work_info_set"][: int(p["num_works"][0])]
    assert (info[:, 0] == 0).sum() >= 5  # 41 of 48 units: spread over most programs
    assert np.all(info[info[:, 0] == 2, 4:6] == indptr[2])  # the empty request: one empty work


@pytest.mark.parametrize("programs", [1, 3, 264])
def test_plan_extremes(programs):
    _check([1, 2048, 33, 0, 4096], 1, 32, programs)


@pytest.mark.parametrize("heads,qlen,want", [
    (16, 1, (16, 1, 16, 32, 4, 2)),    # one 16-row mma.sync block, 2 programs / SM
    (16, 2, (8, 2, 16, 32, 4, 2)),     # 32 rows: two 16-row blocks sharing the KV through L2
    (32, 1, (16, 2, 16, 32, 4, 2)),
    (16, 4, (16, 1, 64, 64, 8, 1)),    # 64 rows: one wgmma block, 1 program / SM
    (128, 1, (64, 2, 64, 64, 8, 1)),
    (16, 3, (16, 1, 64, 64, 8, 1)),
    (1, 1, (1, 1, 16, 32, 4, 2)),
])
def test_gpu_kernel_config(heads, qlen, want):
    from jax_mla.backends.triton import kernel_config

    c = kernel_config(heads, qlen, 64, "cuda")
    got = (c.heads_per_block, c.num_head_blocks, c.block_m, c.block_n, c.num_warps,
           c.ctas_per_sm)
    assert got == want


def test_gpu_kernel_config_env_overrides(monkeypatch):
    from jax_mla.backends.triton import kernel_config

    monkeypatch.setenv("JAX_MLA_TRITON_BLOCK_N", "16")
    monkeypatch.setenv("JAX_MLA_TRITON_CTAS_PER_SM", "3")
    monkeypatch.setenv("JAX_MLA_TRITON_MAX_ROWS", "32")
    c = kernel_config(16, 2, 64, "cuda")
    assert (c.heads_per_block, c.block_m, c.block_n, c.ctas_per_sm) == (16, 32, 16, 3)
