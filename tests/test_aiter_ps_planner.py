"""The jnp port of AITER's PS prefill planner (``get_ps_metadata_v1``; ``ps_planner.py``).

Differential: bit-exact, whole buffers included, against a statement-by-statement Python port
of AITER's host planner (tests/aiter_standin/aiter/_ps_metadata_ref.py) on vLLM's test batches
and hypothesis-drawn ones over CU counts 4..304 and 1..128 heads. Properties, from the plan
alone: every query tile's KV units covered exactly once for every head, by CUs of the head's
cluster, within each CU's quota; reduce maps consistent with the works; unused tails as
AITER's buffers hold them. Static shapes: one compile for any lengths, no host traffic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.backends.aiter import ps_planner as pp

from aiter_standin.harness import load_metadata_ref, standin

NAMES = ("work_indptr", "work_info", "reduce_indptr", "reduce_final_map", "reduce_partial_map")


REF = load_metadata_ref("_ps_metadata_ref")


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _ref(qo, kv, heads, max_qlen, num_cu):
    return REF.plan(qo, kv, num_heads_k=heads, max_qlen=max_qlen, cu_num=num_cu)


def _assert_equal(plan, want):
    for name, got in zip(NAMES, plan.arrays()):
        np.testing.assert_array_equal(np.asarray(got), want[name], err_msg=name)
    assert int(plan.num_partial_tiles) == int(want["reduce_indptr"][-1])
    assert int(plan.num_works) == int(want["work_indptr"][-1])


def _check_properties(plan, qo, kv, heads):
    """Coverage, cluster placement, quotas and reduce consistency, from the plan alone."""
    qg, kg = plan.qlen_granularity, plan.kvlen_granularity
    wp = np.asarray(plan.work_indptr)
    wi = np.asarray(plan.work_info)
    ri = np.asarray(plan.reduce_indptr)
    fm = np.asarray(plan.reduce_final_map)
    pm = np.asarray(plan.reduce_partial_map)
    total = int(wp[-1])
    assert wp[0] == 0 and np.all(np.diff(wp) >= 0) and total == int(plan.num_works)
    assert np.all(wi[total:] == 0), "work_info tail: AITER's zero-initialised vector"
    tgs, hpc = plan.tgs_per_cluster, heads // plan.num_clusters
    qlen, ctx = np.diff(qo), np.diff(kv)
    # Which CU runs each work; each head is served by one cluster's CUs.
    cu_of = np.repeat(np.arange(plan.num_cu), np.diff(wp))
    pieces = {}  # (head, qo_start) -> [(kv_start, kv_end, ploc, kv_offset, qo_end, batch)]
    for w in range(total):
        b, ploc, qs, qe, ks, ke, koff, rng = (int(x) for x in wi[w])
        h0, h1 = rng & 0xFFFF, (rng >> 16) & 0xFFFF
        assert h1 == h0 + 1 and 0 <= h0 < heads
        assert cu_of[w] // tgs == h0 // hpc, "a head's works run on its cluster's CUs"
        assert qo[b] <= qs < qe <= qo[b + 1] and kv[b] <= ks < ke <= kv[b + 1]
        pieces.setdefault((h0, qs), []).append((ks, ke, ploc, koff, qe, b))
    split_tiles = {}
    total_units = 0
    for b in range(len(qlen)):
        for lo in range(0, int(qlen[b]), qg):
            hi = min(lo + qg, int(qlen[b]))
            eff = min(int(ctx[b]) - int(qlen[b]) + hi, int(ctx[b]))
            units = -(-eff // kg)
            total_units += units
            per_head = []
            for h in range(heads):
                ps = sorted(pieces.pop((h, int(qo[b]) + lo)))
                assert ps, f"tile {b}:{lo} head {h} has no work"
                assert all(p[4] == qo[b] + hi and p[5] == b for p in ps)
                # Contiguous, disjoint, in whole units from the request's first KV token.
                assert ps[0][0] == kv[b]
                assert all(x[1] == y[0] for x, y in zip(ps, ps[1:]))
                assert all((p[1] - p[0]) % kg == 0 for p in ps[:-1])
                assert ps[-1][1] == min(kv[b] + units * kg, kv[b + 1]) >= kv[b] + eff
                assert ps[-1][3] == 0
                assert all(p[3] == ctx[b] - (p[1] - kv[b]) for p in ps[:-1])  # kv_offset
                plocs = [p[2] for p in ps]
                if len(ps) == 1:
                    assert plocs == [-1]
                else:
                    assert all(x >= 0 and x % qg == 0 for x in plocs)
                    assert plocs == sorted(plocs)
                per_head.append(plocs)
            assert all(x == per_head[0] for x in per_head), "every head splits a tile alike"
            if len(per_head[0]) > 1:
                split_tiles[(int(qo[b]) + lo, int(qo[b]) + hi)] = per_head[0]
    assert not pieces, f"works for tiles that do not exist: {sorted(pieces)[:4]}"
    # Reduce maps: split tiles in query order, their partials ascending, distinct scratch rows.
    n_split = len(split_tiles)
    for i, key in enumerate(sorted(split_tiles)):
        assert tuple(fm[i]) == key
        assert list(pm[ri[i]:ri[i + 1]]) == split_tiles[key]
    n_part = int(ri[n_split])
    assert ri[0] == 0 and np.all(ri[n_split:] == n_part) and n_part == int(plan.num_partial_tiles)
    assert np.all(fm[n_split:] == 0) and np.all(pm[n_part:] == 0)
    used = pm[:n_part]
    assert len(set(used.tolist())) == n_part
    assert np.all(used + qg <= plan.scratch_rows)
    sizes = pp.ps_metadata_sizes(plan.tile_cnt // -(-plan.max_qlen // qg), heads, plan.max_qlen,
                                 num_cu=plan.num_cu)
    assert n_part <= sizes.split_pieces_bound <= sizes.max_partials
    # Quotas: thread group t of a cluster takes exactly avg + (t < rem) units for each head.
    avg, rem = divmod(total_units, tgs)
    load = np.zeros(plan.num_cu, np.int64)
    for w in range(total):
        load[cu_of[w]] += -(-(int(wi[w, 5]) - int(wi[w, 4])) // kg)
    t = np.arange(plan.num_cu) % tgs
    np.testing.assert_array_equal(load, hpc * (avg + (t < rem)))


# vLLM's fp8 prefill tests (batches [8175], [6992, 6896, 2495], [4096] * 4) at the sizes vLLM
# allocates: max_qlen = max_num_batched_tokens 8192, padded heads, gfx950 / gfx942 CU counts.
VLLM_BATCHES = [[8175], [6992, 6896, 2495], [4096] * 4]


@pytest.mark.parametrize("heads,num_cu", [(16, 256), (32, 256), (16, 304), (128, 304)])
@pytest.mark.parametrize("lens", VLLM_BATCHES, ids=lambda x: "x".join(map(str, x)))
def test_vllm_batches_match_aiter(lens, heads, num_cu):
    qo = _indptr(lens)
    want = _ref(qo, None, heads, 8192, num_cu)
    plan = pp.plan_ps_prefill(jnp.asarray(qo), num_heads=heads, max_qlen=8192, num_cu=num_cu)
    _assert_equal(plan, want)
    _check_properties(plan, qo, qo, heads)


def test_vllm_batches_split_and_reduce():
    # [6992, 6896, 2495] at 16 heads / 256 CUs splits tiles: the reduce maps are exercised.
    plan = pp.plan_ps_prefill(jnp.asarray(_indptr([6992, 6896, 2495])), num_heads=16,
                              max_qlen=8192, num_cu=256)
    assert int(plan.num_partial_tiles) > 0
    # [8175] is cut so that zig-zag pairs of tiles (2 + 64, 4 + 62, ... units) fill each
    # cluster's 16 quotas of 66 units exactly: no split at all.
    plan = pp.plan_ps_prefill(jnp.asarray(_indptr([8175])), num_heads=16, max_qlen=8192,
                              num_cu=256)
    assert int(plan.num_partial_tiles) == 0 and int(plan.num_works) == 32 * 16


@pytest.mark.parametrize("heads", [1, 8, 16, 128])
@pytest.mark.parametrize("num_cu", [4, 8, 80, 256, 304])
@pytest.mark.parametrize("batch,max_qlen", [(37, 1), (5, 9000)])
def test_sizes_match_aiter_info(heads, num_cu, batch, max_qlen):
    got = pp.ps_metadata_sizes(batch, heads, max_qlen, num_cu=num_cu).shapes()
    want = REF.get_ps_metadata_info_v1(batch, heads, max_qlen, cu_num=num_cu)
    assert [s for s, _ in got] == [s for s, _ in want]
    with standin(arch="gfx950", cu_num=num_cu) as aiter:
        api = aiter.get_ps_metadata_info_v1(batch_size=batch, num_head_k=heads,
                                            max_qlen=max_qlen, qlen_granularity=256)
    assert [tuple(np.atleast_1d(s)) for s, _ in api] == [s for s, _ in got]


def test_sizes_example():
    s = pp.ps_metadata_sizes(2, 16, 8192, num_cu=256)
    assert (s.num_clusters, s.tgs_per_cluster, s.qo_splits) == (16, 16, 32)
    assert [sh for sh, _ in s.shapes()] == [(2,), (257,), (8704, 8), (65,), (64, 2), (544,)]


# (num_cu, heads, B, max_qlen): one compile per config; hypothesis draws the lengths.
PROP_CONFIGS = [
    (4, 1, 5, 1200), (4, 8, 4, 700), (4, 16, 3, 2000), (8, 16, 5, 1500), (8, 128, 3, 900),
    (80, 8, 4, 3000), (80, 16, 6, 1000), (256, 16, 4, 4000), (256, 128, 3, 2500),
    (304, 16, 4, 3000), (304, 1, 3, 1500), (304, 128, 2, 1100),
]


@pytest.mark.parametrize("cfg", PROP_CONFIGS, ids=lambda c: "cu{}-h{}-b{}-q{}".format(*c))
def test_plan_matches_aiter_hypothesis(cfg):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    num_cu, heads, b, max_qlen = cfg
    f = jax.jit(lambda qo: pp.plan_ps_prefill(qo, num_heads=heads, max_qlen=max_qlen,
                                              num_cu=num_cu))
    seen = {"split": False}

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.one_of(st.just(0), st.integers(1, 300), st.integers(1, max_qlen),
                              st.just(max_qlen)), min_size=b, max_size=b))
    def check(lens):
        qo = _indptr(lens)
        plan = f(jnp.asarray(qo))
        _assert_equal(plan, _ref(qo, None, heads, max_qlen, num_cu))
        _check_properties(plan, qo, qo, heads)
        seen["split"] |= int(plan.num_partial_tiles) > 0

    check()
    assert f._cache_size() == 1, "lengths changed the compiled program"
    if num_cu // np.gcd(heads, num_cu) > 1:
        assert seen["split"], "no draw split a tile: the config misses the reduce maps"


def test_kv_longer_than_query_matches_aiter():
    # The planner takes a separate KV indptr (KV >= query per request, right-aligned causal).
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    f = jax.jit(lambda qo, kv: pp.plan_ps_prefill(qo, kv, num_heads=16, max_qlen=1000,
                                                  num_cu=8))

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 900)), min_size=4,
                    max_size=4))
    def check(pairs):
        qo = _indptr([q for q, _ in pairs])
        kv = _indptr([q + extra for q, extra in pairs])
        plan = f(jnp.asarray(qo), jnp.asarray(kv))
        _assert_equal(plan, _ref(qo, kv, 16, 1000, 8))
        _check_properties(plan, qo, kv, 16)

    check()


def test_padding_requests_and_capacity():
    # Empty trailing requests (a padded batch) add no tiles; a larger capacity only grows
    # the buffers (AITER's plan for max_num_seqs-sized buffers).
    lens = [700, 0, 513, 0, 0]
    qo = _indptr(lens)
    plan = pp.plan_ps_prefill(jnp.asarray(qo), num_heads=16, max_qlen=1024, num_cu=8,
                              capacity_batch=9)
    want = REF.plan(qo, num_heads_k=16, max_qlen=1024, cu_num=8, batch_size=9)
    _assert_equal(plan, want)
    assert plan.tile_cnt == 9 * 4


def test_planner_is_jittable_without_host_sync():
    f = jax.jit(lambda qo: pp.plan_ps_prefill(qo, num_heads=16, max_qlen=2048, num_cu=8))
    jaxpr = str(jax.make_jaxpr(f)(jnp.zeros((4,), jnp.int32)))
    assert "callback" not in jaxpr
    a = jnp.asarray(_indptr([2000, 3, 700]))
    b = jnp.asarray(_indptr([1, 2048, 0]))
    f(a)  # compile
    with jax.transfer_guard("disallow"):  # no host<->device traffic inside the planner
        pa = f(a)
        pb = f(b)
    assert f._cache_size() == 1
    sizes = pp.ps_metadata_sizes(3, 16, 2048, num_cu=8)
    for p in (pa, pb):
        assert [tuple(x.shape) for x in p.arrays()] == [s for s, _ in sizes.shapes()[1:]]
    _assert_equal(pb, _ref(np.asarray(b), None, 16, 2048, 8))


def test_standin_host_planner_agrees():
    # The stand-in's aiter.get_ps_metadata_v1 (vLLM's call, torch buffers from the info sizes)
    # runs the reference port: its buffers equal the jnp plan's.
    import torch

    lens = [300, 5, 40, 1000]
    qo = _indptr(lens)
    # 80 CUs: 16 clusters of 5 thread groups (at 4 or 8 CUs each cluster is one thread group,
    # which never splits a tile).
    with standin(arch="gfx950", cu_num=80) as aiter:
        info = aiter.get_ps_metadata_info_v1(batch_size=4, num_head_k=16, max_qlen=1000)
        bufs = [torch.full(s if isinstance(s, tuple) else (s,), -7, dtype=dt)
                for s, dt in info]
        qo_t = torch.from_numpy(qo)
        aiter.get_ps_metadata_v1(qo_t, qo_t, qo_t[1:] - qo_t[:-1], 1, 16, *bufs,
                                 qhead_granularity=1, qlen_granularity=256,
                                 kvlen_granularity=128, block_size=1, is_causal=True)
    plan = pp.plan_ps_prefill(jnp.asarray(qo), num_heads=16, max_qlen=1000, num_cu=80)
    for name, got, buf in zip(NAMES, plan.arrays(), bufs[1:]):
        np.testing.assert_array_equal(np.asarray(got), buf.numpy(), err_msg=name)
    assert int(plan.num_partial_tiles) > 0


def test_argument_errors_are_clear():
    with pytest.raises(ValueError, match="B \\+ 1"):
        pp.plan_ps_prefill(jnp.zeros((1,), jnp.int32), num_heads=16, max_qlen=8)
    with pytest.raises(ValueError, match="capacity_batch 1"):
        pp.plan_ps_prefill(jnp.zeros((4,), jnp.int32), num_heads=16, max_qlen=8,
                           capacity_batch=1)
    with pytest.raises(ValueError, match="power of 2"):
        pp.plan_ps_prefill(jnp.zeros((4,), jnp.int32), num_heads=16, max_qlen=8,
                           kvlen_granularity=96)


def test_aiter_ps_metadata_runs_aiters_planner():
    # The on-hardware differential check, run here against the stand-in's planner.
    lens = [1000, 0, 300, 17]
    qo = jnp.asarray(_indptr(lens))
    with standin(arch="gfx950", cu_num=80) as aiter:
        got = pp.aiter_ps_metadata(qo, num_heads=16, max_qlen=1000)
        (call,) = aiter.calls("get_ps_metadata_v1")
    assert call["kvlen_granularity"] == 128 and call["block_size"] == 1
    plan = pp.plan_ps_prefill(qo, num_heads=16, max_qlen=1000, num_cu=80)
    for name, a, b in zip(NAMES, got, plan.arrays()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert int(plan.num_partial_tiles) > 0
