"""The jnp port of AITER's persistent decode planner (docs/design.md §7.9).

Differential: bit-exact against a statement-by-statement Python port of AITER's two planner
kernels (tests/aiter_standin/aiter/_metadata_ref.py). Properties: every KV block of every query
tile covered exactly once, reduce maps consistent with the works, per-CU load within the
payload bound, head folding for 32..128 heads. Consumer: ``execute_plan_reference`` against the
float64 oracle on NaN-poisoned caches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import build_decode_metadata
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter import planner as pl

import oracle
from aiter_standin.harness import load_metadata_ref
from conftest import make_case

REF = load_metadata_ref()


def _lens(rng, b, hi=700, p_zero=0.15):
    lens = rng.integers(0, hi, b)
    lens[rng.random(b) < p_zero] = 0
    return lens.astype(np.int32)


def _indptr(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _ref(lens, qlen, heads, dt, arch, num_cu, sizes, parallel_env=True):
    b = len(lens)
    bufs = (np.full((sizes.max_work, 8), -1, np.int32), np.full(sizes.max_splits + 1, -1, np.int32),
            np.full(sizes.tile_cnt + 1, -1, np.int32), np.full((sizes.tile_cnt, 2), -1, np.int32),
            np.full(sizes.partial_capacity, -1, np.int32))
    facts = REF.get_mla_metadata_v1_2(
        (np.arange(b + 1) * qlen).astype(np.int32), _indptr(lens), np.ones(b, np.int32), heads, 1,
        True, *bufs, max_seqlen_qo=qlen, uni_seqlen_qo=qlen, arch=arch, cu_count=num_cu,
        lds_bytes=caps.arch_info(arch).lds_bytes, q_fp8=dt == "fp8", kv_fp8=dt == "fp8",
        use_parallel_env=parallel_env)
    wi, wp, ri, fm, pm = bufs
    return facts, dict(work_indptr=wp, work_info_set=wi, reduce_indptr=ri, reduce_final_map=fm,
                       reduce_partial_map=pm)


def _plan(lens, qlen, heads, dt, arch, num_cu, variant="auto"):
    st = pl._static_config(len(lens), qlen, heads, dt, dt, arch, num_cu, -1, len(lens), qlen,
                           variant, True, 16)
    plan, aux = pl._plan(jnp.asarray(_indptr(lens)), st)
    return plan, {k: int(v) for k, v in aux.items()}


# (arch, dtype, qlen, heads, B, num_cu): parallel/sequential kernels, folds, q tiles, tails.
CONFIGS = [
    ("gfx950", "bf16", 1, 16, 8, 8),
    ("gfx950", "bf16", 1, 16, 5, 13),
    ("gfx942", "bf16", 1, 32, 4, 8),
    ("gfx942", "bf16", 1, 128, 3, 16),
    ("gfx942", "bf16", 4, 48, 3, 8),
    ("gfx942", "fp8", 2, 64, 4, 8),
    ("gfx942", "fp8", 1, 64, 4, 8),
    ("gfx942", "fp8", 3, 128, 3, 8),
    ("gfx950", "bf16", 4, 64, 3, 8),
    ("gfx950", "bf16", 3, 48, 3, 8),
    ("gfx950", "bf16", 16, 16, 2, 8),
    ("gfx950", "fp8", 8, 16, 3, 8),
    ("gfx950", "bf16", 1, 24, 4, 8),
    ("gfx950", "fp8", 1, 128, 2, 256),
    ("gfx942", "bf16", 1, 16, 64, 304),
]


def test_sizes_match_the_spec_example():
    s = pl.mla_metadata_sizes(256, 1, 16, "bf16", "bf16", arch="gfx950")
    shapes = dict(zip(["meta", "work_indptr", "work_info", "reduce_indptr", "final_map",
                       "partial_map"], [sh for sh, _ in s.shapes()]))
    assert shapes == {"meta": (2,), "work_indptr": (257,), "work_info": (511, 8),
                      "reduce_indptr": (257,), "final_map": (256, 2), "partial_map": (510,)}
    # Decode scratch: 510 * 1 * 16 * 512 * 4 bytes of partial logits (about 16.7 MB).
    assert s.partial_capacity * 1 * 16 * 512 * 4 == 16_711_680


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("qlen", [1, 2, 4])
@pytest.mark.parametrize("dt", ["bf16", "fp8"])
def test_sizes_match_aiter_arithmetic(arch, dt, qlen, heads):
    import sys

    from aiter_standin.harness import standin

    with standin(arch=arch, cu_num=None) as aiter:
        d = aiter.dtypes.fp8 if dt == "fp8" else aiter.dtypes.bf16
        want = aiter.get_mla_metadata_info_v1(37, qlen, heads, d, d, False, fast_mode=True)
    got = pl.mla_metadata_sizes(37, qlen, heads, dt, dt, arch=arch).shapes()
    assert [tuple(np.atleast_1d(s)) for s, _ in want] == [s for s, _ in got]
    assert "aiter" not in sys.modules


def _check_properties(plan, aux, lens, qlen, heads, num_cu):
    """Coverage, reduce consistency and load bound, checked from the plan alone."""
    wp = np.asarray(plan.work_indptr)
    wi = np.asarray(plan.work_info_set)
    ri = np.asarray(plan.reduce_indptr)
    fm = np.asarray(plan.reduce_final_map)
    pm = np.asarray(plan.reduce_partial_map)
    total = int(wp[-1])
    assert wp[0] == 0 and np.all(np.diff(wp) >= 0)
    assert np.all(wi[total:] == -1)
    kvp = _indptr(lens)
    ratio, tiles, ts = plan.fold_ratio, plan.tiles_per_batch, plan.tile_size
    assert plan.kernel_heads * ratio == heads
    gran, o = plan.kv_granularity, plan.overhead
    items = {}
    for w in range(total):
        items.setdefault((int(wi[w, 0]), int(wi[w, 2])), []).append(w)
    # Every (pseudo-batch, q-tile): works cover its KV contiguously, disjointly, exactly once.
    used_ploc = []
    tile = 0
    for pb in range(len(lens) * ratio):
        req = pb // ratio
        kb, ke = kvp[req], kvp[req + 1]
        for k in range(tiles):
            qs = qlen * pb + k * ts
            qe = min(qs + ts, qlen * (pb + 1))
            ws = items.pop((pb, qs), [])
            if not ws:
                # Only AITER's prefix-scan planner drops a batch, and only an empty one.
                assert plan.variant == "parallel" and ke == kb
                assert ri[tile + 1] == ri[tile]
                tile += 1
                continue
            rows = wi[ws]
            assert np.all(rows[:, 3] == qe)
            if ke == kb:
                # AITER's quirk, kept: an empty request's q tile gets kv_end = kv_start - tail,
                # an inverted (empty) range.
                assert len(ws) == 1 and rows[0, 4] == kb and rows[0, 5] <= kb
                assert rows[0, 1] == -1 and ri[tile + 1] == ri[tile]
                tile += 1
                continue
            starts, ends = rows[:, 4], rows[:, 5]
            assert starts[0] == kb and np.all(starts[1:] == ends[:-1])  # contiguous, disjoint
            bt = kb + (ke - kb) - ends[-1]
            assert 0 <= bt < qlen and (tiles > 1 or bt == 0)
            # The trimmed tail holds no token any row of the tile can see.
            t_last = qe - 1 - qlen * pb
            assert ends[-1] - kb >= (ke - kb) - qlen + t_last + 1 or ke == kb
            assert np.all(rows[:, 6] == ke - ends)  # kv_offset
            n = len(ws)
            lo, hi = ri[tile], ri[tile + 1]
            if n > 1:
                assert hi - lo == n
                assert tuple(fm[tile]) == (qs, qe)
                assert list(pm[lo:hi]) == list(rows[:, 1])
                assert np.all(rows[:, 1] >= 0)
                used_ploc += list(rows[:, 1])
            else:
                assert hi == lo and rows[0, 1] == -1 and tuple(fm[tile]) == (-1, -1)
            tile += 1
    assert not items, f"works for tiles that do not exist: {items}"
    assert np.all(ri[tile:] == ri[tile])
    # Partial scratch rows [ploc, ploc + ts) are distinct and inside AITER's scratch.
    assert len(set(used_ploc)) == len(used_ploc)
    assert all(0 <= p and p + ts <= plan.scratch_rows for p in used_ploc)
    assert np.all(pm[ri[tile]:] == -1)
    # Load: every CU stays within the payload (a swallowed tail adds < threshold tokens).
    nblk = -(-(np.repeat(np.diff(kvp), ratio)) // gran)
    payload = -(-int(np.sum((nblk + o) * tiles)) // num_cu) + o
    assert aux["payload"] == payload
    slack = 0 if qlen == 1 else -(-qlen // gran)
    for c in range(num_cu):
        load = sum(-(-(wi[w, 5] - wi[w, 4]) // gran) + o for w in range(wp[c], wp[c + 1]))
        assert load <= payload + slack, (c, load, payload)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_plan_matches_aiter_and_has_its_properties(rng, cfg):
    arch, dt, qlen, heads, b, num_cu = cfg
    sizes = pl.mla_metadata_sizes(b, qlen, heads, dt, dt, arch=arch, num_cu=num_cu)
    split_seen = False
    for _ in range(6):
        lens = _lens(rng, b)
        plan, aux = _plan(lens, qlen, heads, dt, arch, num_cu)
        facts, want = _ref(lens, qlen, heads, dt, arch, num_cu, sizes)
        assert facts["variant"] == plan.variant and facts["unassigned"] == 0
        for name, arr in want.items():
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), arr, err_msg=name)
        _check_properties(plan, aux, lens, qlen, heads, num_cu)
        split_seen |= aux["num_reduce"] > 0
    if num_cu < 32:
        assert split_seen, "no draw split a tile: the config does not exercise the reduce maps"


@pytest.mark.parametrize("heads", [32, 48, 80, 128])
def test_head_folding_32_to_128(rng, heads):
    # gfx942 bf16 has no native kernel above 16 heads: every count folds to 16-head pseudo-rows.
    lens = _lens(rng, 3, hi=400)
    plan, aux = _plan(lens, 2, heads, "bf16", "gfx942", 8)
    assert plan.fold_ratio == heads // 16 and plan.kernel_heads == 16
    sizes = pl.mla_metadata_sizes(3, 2, heads, "bf16", "bf16", arch="gfx942", num_cu=8)
    _, want = _ref(lens, 2, heads, "bf16", "gfx942", 8, sizes)
    np.testing.assert_array_equal(np.asarray(plan.work_info_set), want["work_info_set"])
    _check_properties(plan, aux, lens, 2, heads, 8)
    # Pseudo-batch b' reads request b' // ratio's KV.
    wi = np.asarray(plan.work_info_set)[: aux["num_works"]]
    kvp = _indptr(lens)
    for row in wi:
        req = row[0] // plan.fold_ratio
        assert kvp[req] <= row[4] <= row[5] <= kvp[req + 1]


def test_sequential_variant_matches_aiter_sequential_kernel(rng):
    # Forcing AITER's sequential planner (AITER_MLA_META_USE_PARALLEL=0) on a qlen-1 batch.
    sizes = pl.mla_metadata_sizes(6, 1, 16, "bf16", "bf16", arch="gfx950", num_cu=8)
    for _ in range(5):
        lens = _lens(rng, 6, p_zero=0.4)
        plan, aux = _plan(lens, 1, 16, "bf16", "gfx950", 8, variant="sequential")
        facts, want = _ref(lens, 1, 16, "bf16", "gfx950", 8, sizes, parallel_env=False)
        assert facts["variant"] == "sequential" == plan.variant
        for name, arr in want.items():
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), arr, err_msg=name)
        _check_properties(plan, aux, lens, 1, 16, 8)


def test_parallel_variant_drops_an_empty_batch_at_a_full_cu():
    # The one place AITER's two planners differ: an empty batch meeting a CU with <= 16 blocks
    # of payload left gets no work from the prefix-scan kernel (its rows are never written;
    # jax_mla masks rows that see no KV anyway).
    lens = np.array([0, 0, 274, 88, 143], np.int32)
    par, _ = _plan(lens, 1, 64, "bf16", "gfx950", 8, variant="parallel")
    seq, _ = _plan(lens, 1, 64, "bf16", "gfx950", 8, variant="sequential")
    batches_par = set(np.asarray(par.work_info_set)[:, 0].tolist())
    batches_seq = set(np.asarray(seq.work_info_set)[:, 0].tolist())
    assert 1 not in batches_par and 1 in batches_seq


def test_planner_is_jittable_without_host_sync():
    f = jax.jit(lambda kvp: pl.plan_mla_decode(kvp, qlen=2, num_heads=32, q_dtype="bf16",
                                               kv_dtype="bf16", arch="gfx942", num_cu=8))
    jaxpr = str(jax.make_jaxpr(f)(jnp.zeros((5,), jnp.int32)))
    assert "callback" not in jaxpr
    kvp = jnp.asarray(_indptr(np.array([5, 0, 40, 17], np.int32)))
    f(kvp)  # compile
    with jax.transfer_guard("disallow"):  # no host<->device traffic inside the planner
        plan = f(kvp)
    assert plan.work_info_set.shape == (pl.mla_metadata_sizes(
        4, 2, 32, "bf16", "bf16", arch="gfx942", num_cu=8).max_work, 8)


def test_capacity_errors_are_clear():
    with pytest.raises(ValueError, match="sized for batch 2"):
        pl.plan_mla_decode(jnp.zeros((5,), jnp.int32), qlen=1, num_heads=16, q_dtype="bf16",
                           kv_dtype="bf16", arch="gfx950", num_cu=8, capacity_batch=2)
    with pytest.raises(ValueError, match="no kernel for 144 heads"):
        pl.plan_mla_decode(jnp.zeros((5,), jnp.int32), qlen=1, num_heads=144, q_dtype="bf16",
                           kv_dtype="bf16", arch="gfx942")


# (arch, dtype, qlen, heads, seq_lens, num_cu): unsplit, split, folded, q-tiled + tails.
EXEC_CASES = [
    ("gfx950", "bf16", 1, 16, [600, 0, 20, 5], 4),
    ("gfx942", "bf16", 2, 32, [300, 40, 3], 4),
    ("gfx942", "fp8", 3, 128, [200, 2, 45], 6),
    ("gfx950", "bf16", 16, 16, [300, 40], 8),
]


def _planned_case(rng, case):
    """A NaN-poisoned case, its metadata, and AITER's plan for it (which must split a tile)."""
    arch, dt, qlen, heads, lens, num_cu = case
    c = make_case(rng, seq_lens=lens, qlen=qlen, num_heads=heads, page_size=8)
    md = build_decode_metadata(c.block_table, c.seq_lens, page_size=8, qlen=qlen)
    plan = pl.plan_mla_decode(md.paged_kv_indptr, qlen=qlen, num_heads=heads, q_dtype=dt,
                              kv_dtype=dt, arch=arch, num_cu=num_cu)
    assert int(plan.reduce_indptr[-1]) > 0, "the case must split at least one tile"
    return c, md, plan, qlen


def _check_against_oracle(c, qlen, out, lse):
    want, want_lse = oracle.mla_decode(c.q, c.cache, c.block_table, c.seq_lens, qlen=qlen,
                                       page_size=8, scale=c.scale, kv_lora_rank=512)
    assert oracle.rel_err(out, want) < 1e-5
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=1e-4)


@pytest.mark.parametrize("case", EXEC_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_execute_plan_reference_matches_float64_oracle(rng, case):
    c, md, plan, qlen = _planned_case(rng, case)
    out, lse = pl.execute_plan_reference(jnp.asarray(c.q), jnp.asarray(c.cache), md, plan,
                                         scale=c.scale)
    _check_against_oracle(c, qlen, out, lse)


def test_fold_rows_round_trip_and_aiter_order(rng):
    x = jnp.asarray(rng.standard_normal((6, 48, 3)), jnp.float32)  # B=3, qlen=2, F=3
    f = pl.fold_rows(x, 2, 3)
    # Pseudo-row (b*F + f)*qlen + t holds heads f*16 .. f*16+15 of row b*qlen + t.
    np.testing.assert_array_equal(f[(1 * 3 + 2) * 2 + 1], x[1 * 2 + 1, 32:48])
    np.testing.assert_array_equal(pl.unfold_rows(f, 2, 3), x)
    np.testing.assert_array_equal(pl.unfold_rows(pl.fold_rows(x, 1, 3), 1, 3), x)


# --- Property tests (hypothesis) over random lengths ---------------------------------------------
# Static configs are fixed per draw family (one compile each); hypothesis draws the lengths.

PROP_CONFIGS = [
    # (arch, dtype, qlen, heads, B, num_cu)
    ("gfx950", "bf16", 1, 16, 6, 8),  # parallel (prefix-scan) planner
    ("gfx942", "bf16", 1, 64, 4, 8),  # fold 4, sequential
    ("gfx942", "bf16", 2, 128, 3, 8),  # fold 8, qlen 2
    ("gfx950", "bf16", 4, 48, 3, 8),  # q tiles (packed 192 > 64 per wg)
    ("gfx942", "fp8", 4, 32, 4, 5),  # fp8 fold 2
]


@pytest.mark.parametrize("cfg", PROP_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_plan_properties_hypothesis(cfg):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    arch, dt, qlen, heads, b, num_cu = cfg

    @settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.one_of(st.just(0), st.integers(1, 20), st.integers(1, 900)),
                    min_size=b, max_size=b))
    def check(lens):
        lens = np.asarray(lens, np.int32)
        plan, aux = _plan(lens, qlen, heads, dt, arch, num_cu)
        _check_properties(plan, aux, lens, qlen, heads, num_cu)

    check()


# --- The plan drives jax_mla's own Triton reduce kernel (a second, independent consumer) ------

TRITON_CASES = [
    ("gfx950", "bf16", 1, 16, [600, 0, 20, 5], 4),
    ("gfx942", "bf16", 2, 32, [150, 40, 3], 4),  # fold 2, qlen 2
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_plan_drives_the_triton_reduce_kernel(rng, case):
    import types

    from jax_mla.backends.triton.decode import reduce_partials
    from jax_mla.backends.triton.launch import triton_importable
    from jax_mla.backends.triton.plan import general_reduce_config
    from jax_mla.problem import current_platform, detect_target

    platform = current_platform()
    if not triton_importable(platform):  # on CPU this selects Triton's interpreter
        pytest.skip(f"triton cannot run on {platform} here")
    c, md, plan, qlen = _planned_case(rng, case)
    final, final_lse, part, part_lse = pl.execute_plan_works(
        jnp.asarray(c.q), jnp.asarray(c.cache), md, plan, scale=c.scale)
    # The Triton reduce reads the plan's reduce maps as they are; rows per tile = tile_size.
    sched = types.SimpleNamespace(reduce_indptr=plan.reduce_indptr,
                                  reduce_final_map=plan.reduce_final_map,
                                  reduce_partial_map=plan.reduce_partial_map,
                                  qlen=plan.tile_size)
    config = general_reduce_config(512, detect_target(platform))
    out_t, lse_t = jax.jit(lambda p, p_lse, f, f_lse: reduce_partials(
        p, p_lse, sched, f, f_lse, config=config, target=platform))(part, part_lse, final,
                                                                      final_lse)
    out_t = pl.unfold_rows(out_t, qlen, plan.fold_ratio)
    lse_t = pl.unfold_rows(lse_t, qlen, plan.fold_ratio)
    _check_against_oracle(c, qlen, out_t, lse_t)
    # And it agrees with the jnp reducer on the same partials.
    out_r, _ = pl.execute_plan_reference(jnp.asarray(c.q), jnp.asarray(c.cache), md, plan,
                                         scale=c.scale)
    np.testing.assert_allclose(np.asarray(out_t), np.asarray(out_r), atol=1e-5)
