"""The persistent split plan (``jax_mla/backends/triton/schedule.py``): coverage, balance and the
reduce maps; the Triton backend's tile and reduce rules (``plan.py``)."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jax_mla.backends.triton.schedule import (
    EVEN_SLACK_BLOCKS,
    NO_SPLIT_SLACK,
    OVERHEAD_BLOCKS,
    PLAN_MODES,
    SplitSchedule,
    plan_splits,
)

from conftest import has_triton_cuda_backend, run_compiler_script


def _plan(lens, *, qlen=1, block_n=16, programs=8, mode="auto"):
    lens = np.asarray(lens, np.int32)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    sched = plan_splits(lens, indptr, qlen=qlen, block_n=block_n, num_programs=programs,
                        mode=mode)
    return lens, indptr, {k: np.asarray(getattr(sched, k)) for k in (
        "work_indptr", "work_info_set", "num_works", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "reduce_tiles", "reduce_tile_ptr")}, sched


def _program_costs(p, block_n, programs):
    """Each program's KV blocks plus one overhead unit per work (what a work really costs)."""
    info, wp = p["work_info_set"], p["work_indptr"]
    return np.array([int(((info[wp[q]:wp[q + 1], 5] - info[wp[q]:wp[q + 1], 4] + block_n - 1)
                          // block_n).sum()) + int(wp[q + 1] - wp[q]) * OVERHEAD_BLOCKS
                     for q in range(programs)])


def _check(lens, qlen, block_n, programs, mode="line"):
    lens, indptr, p, sched = _plan(lens, qlen=qlen, block_n=block_n, programs=programs,
                                   mode=mode)
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
    # Balance. The line plan: every program's cost (blocks + the overhead unit of each request it
    # starts) is at most the equal share plus one unit; a plan that splits nothing may take
    # NO_SPLIT_SLACK more. Any other plan: with every work's overhead counted, its longest program
    # is at most EVEN_SLACK_BLOCKS over the line plan's, or it is a plan that splits nothing.
    cost = (-(-lens // block_n)) + OVERHEAD_BLOCKS
    chunk = max(1, -(-int(cost.sum()) // programs))
    num, den = NO_SPLIT_SLACK
    no_split = p["reduce_indptr"][-1] == 0
    bound = chunk * (den + num) / den if no_split else chunk + OVERHEAD_BLOCKS
    line_balanced = True
    for q in range(programs):
        w = info[wp[q]:wp[q + 1]]
        units = ((w[:, 5] - w[:, 4]) + block_n - 1) // block_n
        starts = (w[:, 4] == indptr[w[:, 0]]).sum()  # works holding their request's overhead
        line_balanced &= bool(units.sum() + starts * OVERHEAD_BLOCKS
                              <= max(bound, chunk + OVERHEAD_BLOCKS))
    if mode == "line":
        assert line_balanced
    elif mode == "auto":  # the line or whole plan, or even pieces (which may split nothing)
        _, _, line, _ = _plan(lens, qlen=qlen, block_n=block_n, programs=programs, mode="line")
        assert line_balanced or (_program_costs(p, block_n, programs).max()
                                 <= _program_costs(line, block_n, programs).max()
                                 + EVEN_SLACK_BLOCKS)
    if mode == "even" and not no_split and b <= programs:
        # The even-pieces plan (it fits whenever there are no more requests than programs): one
        # work a program, the pieces of a request within a block of each other.
        assert np.all(np.diff(wp) <= 1)
        for r in range(b):
            mine = info[info[:, 0] == r]
            n_blk = (mine[:, 5] - mine[:, 4] + block_n - 1) // block_n
            assert n_blk.max() - n_blk.min() <= 1, (r, n_blk)
    # No piece holds only an overhead unit of a request that has KV (an empty extra partial).
    for r in np.flatnonzero(lens > 0):
        mine = info[info[:, 0] == r]
        assert np.all(mine[:, 5] > mine[:, 4]), (r, mine)
    # The reduce's tiles: exactly the split requests, ascending, in a list of static length.
    split_reqs = np.flatnonzero(np.diff(p["reduce_indptr"]) > 0)
    tiles = p["reduce_tiles"]
    assert len(tiles) == max(1, min(b, programs - 1)) and len(split_reqs) <= len(tiles)
    np.testing.assert_array_equal(tiles[:len(split_reqs)], split_reqs)
    assert np.all(tiles[len(split_reqs):] == -1)
    # Each listed request's partials, in one row: (reduce_indptr[t], reduce_indptr[t + 1]).
    tp = p["reduce_tile_ptr"]
    ri = p["reduce_indptr"]
    assert tp.shape == (len(tiles), 2)
    np.testing.assert_array_equal(tp[:len(split_reqs), 0], ri[split_reqs])
    np.testing.assert_array_equal(tp[:len(split_reqs), 1], ri[split_reqs + 1])
    assert np.all(tp[len(split_reqs):] == 0)
    # Partial slots are distinct and dense.
    ploc = info[info[:, 1] >= 0, 1]
    assert len(set(ploc.tolist())) == len(ploc)
    np.testing.assert_array_equal(np.sort(ploc), np.arange(len(ploc)) * qlen)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=12), st.sampled_from([1, 2, 4]),
       st.sampled_from([16, 32]), st.integers(1, 24))
@example([0, 0, 33], 1, 16, 3)  # even pieces that split nothing: one request a program
def test_plan_covers_balances_and_maps(lens, qlen, block_n, programs):
    lens = [max(x, 0) for x in lens]
    for mode in ("line", "auto", "even"):
        _check(lens, qlen, block_n, programs, mode)


def test_plan_splits_long_request_across_programs():
    lens, indptr, p, _ = _plan([16 * 40, 16, 0, 16 * 3], programs=8)
    info = p["work_info_set"][: int(p["num_works"][0])]
    assert (info[:, 0] == 0).sum() >= 5  # 41 of 48 units: spread over most programs
    assert np.all(info[info[:, 0] == 2, 4:6] == indptr[2])  # the empty request: one empty work


@pytest.mark.parametrize("batch,programs,whole", [
    (128, 66, True),    # 128 heads, B=128: 2 requests a program at most, 3 % over the share
    (128, 132, True),   # 64 heads: a request a program at most
    (128, 264, False),  # 16 heads: half the programs would idle, so requests are split
    (8, 66, False),
])
def test_plan_splits_nothing_when_whole_requests_balance(batch, programs, whole):
    lens = [4096] * batch
    _check(lens, 1, 64, programs)
    _, _, p, _ = _plan(lens, block_n=64, programs=programs)
    assert (p["reduce_indptr"][-1] == 0) == whole
    if whole:
        per_prog = np.diff(p["work_indptr"])
        assert per_prog.max() == -(-batch // programs) and per_prog.sum() == batch


@pytest.mark.parametrize("programs", [1, 3, 264])
def test_plan_extremes(programs):
    _check([1, 2048, 33, 0, 4096], 1, 32, programs)


@pytest.mark.parametrize("heads,qlen,want", [
    (16, 1, (16, 1, 16, 32, 4, 2)),    # one 16-row mma.sync block, 2 programs / SM
    (16, 2, (16, 1, 64, 128, 4, 1)),   # 32 rows: one 64-row tile (Gluon kernel), half padding
    (32, 1, (32, 1, 64, 128, 4, 1)),
    (16, 4, (16, 1, 64, 128, 4, 1)),   # 64 rows: the Gluon kernel, pairs of 64-token tiles
    (128, 1, (64, 2, 64, 128, 4, 1)),
    (16, 3, (16, 1, 64, 128, 4, 1)),
    (1, 1, (1, 1, 16, 32, 4, 2)),
])
def test_gpu_kernel_config(heads, qlen, want):
    """Hopper defaults: 64-row tiles go to the Gluon two-warpgroup kernel (4 warps compiled, a
    4-warp worker partition added), scheduled in 128-token pairs; or, where the Gluon kernel
    cannot serve the call, to the Triton 64-row tile with its score columns split."""
    from jax_mla.backends.triton.plan import gluon_available as _gluon_available
    from jax_mla.backends.triton.plan import kernel_config

    if not _gluon_available():
        pytest.skip("this triton has no Gluon with the sm_90 kernel's API")
    c = kernel_config(heads, qlen, 64, "cuda")
    got = (c.heads_per_block, c.num_head_blocks, c.block_m, c.block_n, c.num_warps,
           c.ctas_per_sm)
    assert got == want
    assert c.sm90 == (c.block_m == 64) and not c.wg_split
    t = kernel_config(heads, qlen, 64, "cuda", sm90=False)
    assert (t.block_m, t.sm90, t.wg_split) == (c.block_m, False, c.block_m == 64)
    if t.block_m == 64:
        assert (t.block_n, t.num_warps, t.num_stages) == (64, 8, 2)


def test_sm90_kernel_knob_and_rules(monkeypatch):
    import jax.numpy as jnp

    from jax_mla.backends.triton.plan import kernel_config, sm90_supported

    monkeypatch.setenv("JAX_MLA_TRITON_SM90_KERNEL", "0")
    assert not kernel_config(128, 1, 64, "cuda").sm90
    monkeypatch.delenv("JAX_MLA_TRITON_SM90_KERNEL")
    assert not kernel_config(128, 1, 64, "rocm").sm90
    bf, f16 = jnp.bfloat16, jnp.float16
    assert sm90_supported(bf, bf, 512, 64, False) and sm90_supported(f16, f16, 512, 64, False)
    assert not sm90_supported(jnp.float32, jnp.float32, 512, 64, False)  # exact fp32 path
    assert not sm90_supported(bf, jnp.float8_e4m3fn, 512, 64, True)  # fp8 cache, kv scale
    assert not sm90_supported(bf, bf, 256, 64, False)  # not DeepSeek geometry
    assert not sm90_supported(bf, bf, 512, 64, True)
    # The fp8 kernel: an fp8 query against an fp8 cache, scales allowed, where asked for.
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    assert sm90_supported(e4, e4, 512, 64, True, fp8=True)
    assert sm90_supported(e4, e5, 512, 64, False, fp8=True)
    assert not sm90_supported(e4, e4, 512, 64, True)  # not asked for
    assert not sm90_supported(e4, e4, 256, 64, True, fp8=True)
    assert not sm90_supported(bf, e4, 512, 64, True, fp8=True)  # a bf16 query: the Triton tile
    # ... unless split in two e4m3 parts in the Gluon fp8 kernel (``sm90_split_q``)
    assert sm90_supported(bf, e4, 512, 64, True, split_q=True)
    assert sm90_supported(f16, e5, 512, 64, False, split_q=True)
    assert not sm90_supported(jnp.float32, e4, 512, 64, True, split_q=True)
    assert not sm90_supported(bf, bf, 512, 64, True, split_q=True)


@pytest.mark.parametrize("knob, page_size, want", [
    ("1", 64, True), ("1", 16, True), ("1", 1, True), ("1", 128, True),
    ("1", 8, False), ("1", 32, False), ("0", 64, False), (None, 64, True)])
def test_sm90_fp8_kernel_plan(monkeypatch, knob, page_size, want):
    """The Gluon fp8 kernel (``JAX_MLA_TRITON_SM90_FP8``, on by default) is planned for an fp8
    query and cache on Hopper at 64-row tiles and the page sizes it compiles cleanly for; its
    plan takes the cache scale (the bf16 Gluon kernel's does not); off, or at other page
    sizes: the Triton 64-row tile. Not with fp8 scores off. At 16 rows or fewer, its 64-row
    programs where it serves, the Triton 16-row tile where it does not."""
    from jax_mla.backends.triton.plan import make_plan
    from jax_mla.problem import DecodeProblem, Target

    if knob is None:
        monkeypatch.delenv("JAX_MLA_TRITON_SM90_FP8", raising=False)
    else:
        monkeypatch.setenv("JAX_MLA_TRITON_SM90_FP8", knob)
    def plan(heads, qlen, **kw):
        problem = DecodeProblem(num_seqs=4, qlen=qlen, num_heads=heads, page_size=page_size,
                                max_pages=8, kv_lora_rank=512, rope_dim=64,
                                q_dtype="float8_e4m3fn", kv_dtype="float8_e4m3fn",
                                target=Target("cuda", "sm_90", 132), has_kv_scale=True, **kw)
        return make_plan("triton", problem), problem

    p, problem = plan(128, 1)
    assert p.kernel.sm90 is want and p.kernel.block_m == 64
    assert p.mismatches(problem) == []
    # 16 rows or fewer: the Gluon kernel's 64-row programs where it serves (faster than the
    # Triton 16-row tile on an H100), else the 16-row tile.
    for heads in (16, 1):
        small = plan(heads, 1)[0].kernel
        assert small.sm90 is want and small.block_m == (64 if want else 16), small
    monkeypatch.setenv("JAX_MLA_TRITON_FP8_QK", "0")
    assert not plan(128, 1)[0].kernel.sm90


@pytest.mark.parametrize("knob, release, page_size, want128, want16", [
    (None, (3, 6), 64, True, True), (None, (3, 6), 16, True, True), (None, (3, 6), 1, True, True),
    (None, (3, 6), 32, False, False), (None, (3, 9), 64, True, True),
    (None, (3, 8), 64, True, False), (None, None, 64, True, False), ("1", (3, 8), 64, True, True),
    ("0", (3, 6), 64, False, False)])
def test_sm90_split_query_plan(monkeypatch, knob, release, page_size, want128, want16):
    """A 16-bit query against an fp8 cache on Hopper (``JAX_MLA_TRITON_SM90_SPLIT_Q``): unset,
    the Gluon fp8 kernel with the query split in two e4m3 parts at the page sizes that kernel
    takes, with the cache scale: at every row count where the installed Triton compiles it
    without spills (``plan.SPLIT_Q_TRITON``), elsewhere only in place of the Triton 64-row tile
    (128 heads), not of the 16-row one (16 heads). ``1`` / ``0`` force it either way. ROCm
    never takes it."""
    from jax_mla.backends.triton import plan as plan_mod
    from jax_mla.problem import DecodeProblem, Target

    if knob is None:
        monkeypatch.delenv("JAX_MLA_TRITON_SM90_SPLIT_Q", raising=False)
    else:
        monkeypatch.setenv("JAX_MLA_TRITON_SM90_SPLIT_Q", knob)
    monkeypatch.setattr(plan_mod, "triton_release", lambda: release)

    def plan(heads, qlen, platform="cuda", arch="sm_90"):
        problem = DecodeProblem(num_seqs=4, qlen=qlen, num_heads=heads, page_size=page_size,
                                max_pages=8, kv_lora_rank=512, rope_dim=64,
                                q_dtype="bfloat16", kv_dtype="float8_e4m3fn",
                                target=Target(platform, arch, 132), has_kv_scale=True)
        return plan_mod.make_plan("triton", problem), problem

    p, problem = plan(128, 1)
    assert p.kernel.sm90 is want128 and p.kernel.block_m == 64, p.kernel
    assert p.mismatches(problem) == []
    small = plan(16, 1)[0].kernel
    assert small.sm90 is want16 and small.block_m == (64 if want16 else 16), small
    assert not plan(128, 1, "rocm", "gfx942")[0].kernel.sm90


def test_rocm_splits_32_rows_into_two_16_row_blocks():
    from jax_mla.backends.triton.plan import kernel_config

    c = kernel_config(16, 2, 64, "rocm")  # no wgmma: two 16-row blocks sharing the KV via L2
    assert (c.heads_per_block, c.num_head_blocks, c.block_m, c.wg_split) == (8, 2, 16, False)


def test_gpu_kernel_config_env_overrides(monkeypatch):
    from jax_mla.backends.triton.plan import kernel_config

    monkeypatch.setenv("JAX_MLA_TRITON_BLOCK_N", "16")
    monkeypatch.setenv("JAX_MLA_TRITON_CTAS_PER_SM", "3")
    monkeypatch.setenv("JAX_MLA_TRITON_MAX_ROWS", "32")
    c = kernel_config(16, 2, 64, "cuda")
    assert (c.heads_per_block, c.block_m, c.block_n, c.ctas_per_sm) == (16, 32, 16, 3)
    # Tile overrides are for the Triton kernel: with them the Gluon kernel stands aside.
    monkeypatch.delenv("JAX_MLA_TRITON_MAX_ROWS")
    c = kernel_config(128, 1, 64, "cuda")
    assert (c.block_m, c.block_n, c.sm90) == (64, 16, False)


@pytest.mark.parametrize("layout,chunk", [("maps", None), ("affine", None), ("affine", (2, 16)),
                                          ("affine", (2, 64)), ("affine", (4, 32))])
@pytest.mark.parametrize("qlen", [1, 3])
def test_triton_reduce_merges_many_partials_exactly(qlen, layout, chunk, monkeypatch):
    """Requests split 13 / 1 / 6 / 9 ways (partials empty, -inf or +inf-poisoned among them).

    ``maps``: a plan in AITER's layout, partial rows in any order (the general reduce kernel).
    ``affine``: this package's plan, each request's partials consecutive and only the split
    requests listed, with an unused tail entry (``mla_reduce_affine_kernel``); ``chunk``: its
    (partials, latent columns) per program forced: with (2, 16) requests take up to 7 rounds
    and the 40 columns three blocks, the last one partial; (2, 64) and (4, 32) are the GPU's
    tiles for chunks of 2 and 4."""
    import types

    import jax
    import jax.numpy as jnp

    from jax_mla.backends.triton.decode import reduce_partials
    from jax_mla.backends.triton.launch import triton_importable
    from jax_mla.backends.triton.plan import (
        TritonTuning,
        general_reduce_config,
        reduce_config,
    )
    from jax_mla.problem import current_platform, detect_target

    platform = current_platform()
    if not triton_importable(platform):
        pytest.skip(f"triton cannot run on {platform} here")
    if chunk:
        monkeypatch.setenv("JAX_MLA_TRITON_REDUCE_BLOCK_S", str(chunk[0]))
        monkeypatch.setenv("JAX_MLA_TRITON_REDUCE_BLOCK_L", str(chunk[1]))
    rng = np.random.default_rng()
    h, lr = 3, 40
    counts = np.array([13, 1, 6, 9])
    b = len(counts)
    split = np.where(counts > 1, counts, 0)
    indptr = np.concatenate([[0], np.cumsum(split)]).astype(np.int32)
    n_part = int(indptr[-1])
    # In AITER's layout partial rows need not be in request order; in ours they are.
    order = rng.permutation(n_part) if layout == "maps" else np.arange(n_part)
    pmap = np.full(n_part + 3, -1, np.int32)
    pmap[:n_part] = order * qlen
    part = rng.standard_normal((n_part * qlen, h, lr)).astype(np.float32)
    plse = (3 * rng.standard_normal((n_part * qlen, h))).astype(np.float32)
    r2 = indptr[2]  # request 2: every partial empty -> out 0, lse -inf
    plse[(order[r2:r2 + 6, None] * qlen + np.arange(qlen)).ravel()] = -np.inf
    plse[order[indptr[3]] * qlen] = np.inf  # +inf counts as empty (AITER's convention)
    final = rng.standard_normal((b * qlen, h, lr)).astype(np.float32)
    final_lse = rng.standard_normal((b * qlen, h)).astype(np.float32)
    fmap = np.stack([np.arange(b) * qlen, np.arange(b) * qlen + qlen], 1).astype(np.int32)
    programs = 8
    if layout == "maps":
        sched = types.SimpleNamespace(reduce_indptr=jnp.asarray(indptr),
                                      reduce_final_map=jnp.asarray(fmap),
                                      reduce_partial_map=jnp.asarray(pmap), qlen=qlen)
    else:
        tiles = np.array([0, 2, 3, -1], np.int32)
        tile_ptr = np.array([[indptr[t], indptr[t + 1]] if t >= 0 else [0, 0] for t in tiles])
        sched = SplitSchedule(
            work_indptr=jnp.zeros(programs + 1, jnp.int32),
            work_info_set=jnp.zeros((programs + b, 8), jnp.int32),
            num_works=jnp.zeros(1, jnp.int32), reduce_indptr=jnp.asarray(indptr),
            reduce_final_map=jnp.asarray(fmap), reduce_partial_map=jnp.asarray(pmap),
            reduce_tiles=jnp.asarray(tiles), reduce_tile_ptr=jnp.asarray(tile_ptr, jnp.int32),
            qlen=qlen)
    target = detect_target()
    config = (general_reduce_config(lr, target) if layout == "maps" else
              reduce_config(programs, b, lr, target, TritonTuning.from_env()))
    out, lse = jax.jit(lambda p, pl_, f, fl: reduce_partials(p, pl_, sched, f, fl, config=config,
                                                             target=platform))(
        jnp.asarray(part), jnp.asarray(plse), jnp.asarray(final), jnp.asarray(final_lse))
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    for i in range(b):
        rows = slice(i * qlen, i * qlen + qlen)
        if counts[i] < 2:  # written whole by the split kernel: left alone
            np.testing.assert_array_equal(out[rows], final[rows])
            np.testing.assert_array_equal(lse[rows], final_lse[rows])
            continue
        prow = order[indptr[i]:indptr[i + 1]][:, None] * qlen + np.arange(qlen)  # [S, Q]
        lj = plse[prow].astype(np.float64)  # [S, Q, H]
        lj[np.isposinf(lj)] = -np.inf
        m = lj.max(0)
        if np.all(np.isneginf(m)):
            np.testing.assert_array_equal(out[rows], 0.0)
            assert np.all(np.isneginf(lse[rows]))
            continue
        w = np.exp(lj - m)
        want = (w[..., None] * part[prow]).sum(0) / w.sum(0)[..., None]
        np.testing.assert_allclose(out[rows], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[rows], m + np.log(w.sum(0)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("batch,seq,block_n,programs,pieces", [
    (64, 4096, 128, 132, 2),   # verify at 16 heads (Gluon tile): halves, not thirds with a sliver
    (32, 4096, 32, 264, 8),    # 16 heads, Q=1
    (128, 4096, 32, 264, 2),
    (8, 32768, 128, 66, 8),    # 128 heads: two head blocks of 66 programs
])
def test_even_pieces_plan_splits_fixed_lengths_evenly(batch, seq, block_n, programs, pieces):
    """Fixed lengths: each request in the same number of equal pieces, one a program, so fewer
    partials than the line plan writes (whose cuts fall anywhere in a request)."""
    lens = [seq] * batch
    _check(lens, 1, block_n, programs, "auto")
    _, _, p, _ = _plan(lens, block_n=block_n, programs=programs)
    _, _, line, _ = _plan(lens, block_n=block_n, programs=programs, mode="line")
    info = p["work_info_set"][: int(p["num_works"][0])]
    np.testing.assert_array_equal(np.bincount(info[:, 0], minlength=batch), pieces)
    np.testing.assert_array_equal(info[:, 5] - info[:, 4], seq // pieces)
    assert np.all(np.diff(p["work_indptr"]) <= 1)
    assert p["reduce_indptr"][-1] == batch * pieces < line["reduce_indptr"][-1]


def test_even_pieces_plan_is_left_when_it_would_lengthen_the_longest_program():
    """B=128, S=32k over 264 programs: halves would cost 513 blocks a program against the line
    plan's 498 (with every work's overhead), so the line plan stays."""
    lens = [32768] * 128
    _, _, p, _ = _plan(lens, block_n=32, programs=264)
    _, _, line, _ = _plan(lens, block_n=32, programs=264, mode="line")
    np.testing.assert_array_equal(p["work_info_set"], line["work_info_set"])
    assert _program_costs(line, 32, 264).max() == 498


def test_split_plan_mode_knob(monkeypatch):
    from jax_mla.backends.triton.plan import split_plan_mode

    assert split_plan_mode() == "auto"
    monkeypatch.setenv("JAX_MLA_SPLIT_PLAN", "Line")
    assert split_plan_mode() == "line"
    monkeypatch.setenv("JAX_MLA_SPLIT_PLAN", "halves")
    with pytest.raises(ValueError, match="JAX_MLA_SPLIT_PLAN='halves' must be one of"):
        split_plan_mode()
    with pytest.raises(ValueError, match="mode must be one of"):
        _plan([64, 64], mode="halves")


@pytest.mark.parametrize("programs,batch,want", [
    (132, 64, 2),    # verify at 16 heads: halves
    (264, 128, 2),
    (264, 64, 4),
    (264, 32, 8),
    (264, 1, 8),     # capped
    (66, 128, 2),    # more requests than programs: at least 2
])
def test_reduce_chunk_is_the_even_plans_pieces(programs, batch, want):
    """The affine reduce reads a request's pieces in one round trip where the even-pieces plan
    cut a fixed-length batch (chunks one size up were 2-5 % slower a call on the H200)."""
    from jax_mla.backends.triton.plan import reduce_block_s

    assert reduce_block_s(programs, batch, gpu=True) == want
    lens = [4096] * batch
    if programs >= batch:  # the plan cuts each request into exactly that many pieces or fewer
        _, _, p, _ = _plan(lens, block_n=32, programs=programs)
        pieces = np.bincount(p["work_info_set"][: int(p["num_works"][0]), 0], minlength=batch)
        assert pieces.max() <= max(want, 1) or want == 8


@pytest.mark.parametrize("block_s,want", [(2, 64), (4, 32), (8, 16)])
def test_reduce_column_block_keeps_the_tile_size(block_s, want, monkeypatch):
    """Fewer partials a chunk, wider latent blocks: the [S, 16, L] tile stays 8 x 16 x 16 floats
    (on the H200 the reduce took 4.3 instead of 6.4 us at B128 H16 S4k, chunks of 2)."""
    from jax_mla.backends.triton.plan import reduce_block_l

    assert reduce_block_l(block_s, 512, gpu=True) == want
    assert reduce_block_l(block_s, 40, gpu=True) == min(want, 64)  # never wider than L
    assert reduce_block_l(block_s, 512, gpu=False) == 128
    monkeypatch.setenv("JAX_MLA_TRITON_REDUCE_BLOCK_L", "16")
    assert reduce_block_l(block_s, 512, gpu=True) == 16


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-50, 450), min_size=1, max_size=20), st.sampled_from([1, 2, 3]),
       st.sampled_from([16, 32, 128]), st.integers(1, 40), st.sampled_from(PLAN_MODES),
       st.tuples(*[st.sampled_from([2, 4, 16])] * 3))
@example([0, 0, 33], 1, 16, 3, "auto", (2, 2, 2))
@example([4096] * 17, 1, 32, 16, "auto", (4, 4, 4))  # even pieces over more requests
@example([-7, 401, 5], 1, 16, 4, "line", (2, 2, 2))  # clamped at both ends
def test_the_planning_kernel_is_the_jnp_plan_bit_for_bit(lens, qlen, block_n, programs, mode,
                                                        chunks):
    """``plan_splits_kernel`` (one Triton program, run here by the interpreter) returns exactly
    :func:`plan_splits`'s arrays, whatever the chunking of requests, programs and works; from
    the lengths as given it also makes the metadata's clamped lengths and their offsets
    (``paged.py``'s ``_build``: ``clip(seq_lens, 0, max_len)`` and its cumulative sum)."""
    from jax_mla.backends.triton.launch import triton_importable
    from jax_mla.backends.triton.schedule import plan_splits_kernel
    from jax_mla.problem import current_platform

    if not triton_importable(current_platform()):
        pytest.skip("triton cannot run here")
    max_len = 400 if max(lens) <= 450 else None
    raw = np.asarray(lens, np.int32)
    lens = np.clip(raw, 0, max_len if max_len is not None else np.iinfo(np.int32).max)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kw = dict(qlen=qlen, block_n=block_n, num_programs=programs, mode=mode)
    want = plan_splits(lens, indptr, **kw)
    got = plan_splits_kernel(raw, max_len=max_len, target=current_platform(), chunks=chunks,
                             **kw)
    for name in ("work_indptr", "work_info_set", "num_works", "reduce_indptr",
                 "reduce_final_map", "reduce_partial_map", "reduce_tiles", "reduce_tile_ptr",
                 "seq_lens", "kv_indptr"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)
    assert (got.block_n, got.qlen, got.num_programs) == (want.block_n, want.qlen,
                                                        want.num_programs)


PLAN_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jax_mla.kernels.triton import plan as pk
names = ["seq_lens_ptr", "work_indptr_ptr", "work_info_ptr", "num_works_ptr",
         "reduce_indptr_ptr", "final_map_ptr", "partial_map_ptr", "tiles_ptr", "tile_ptr_ptr",
         "lens_ptr", "kv_indptr_ptr", "scratch_ptr"]
consts = dict(B=128, P=264, NT=128, QLEN=1, BLOCK_N=32, MODE=0, OVERHEAD=1, SLACK_NUM=1,
              SLACK_DEN=16, EVEN_SLACK=1, GRID=128, CB=128, CP=128, CW=128, MAX_LEN=4096)
sig = dict.fromkeys(names, "*i32") | dict.fromkeys(consts, "constexpr")
src = ASTSource(fn=pk.mla_plan_kernel, signature=sig, constexprs=consts,
                attrs={(i,): [["tt.divisibility", 16]] for i in range(len(names))})
cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8,
                                                                         num_stages=1))
print(json.dumps(dict(shared=cc.metadata.shared, n_ptx=len(cc.asm["ptx"]))))
"""


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_the_planning_kernel_compiles_for_sm90():
    r = run_compiler_script(PLAN_COMPILE, timeout=600)
    assert r["n_ptx"] > 0 and r["shared"] <= 227 * 1024, r


def test_a_planned_triton_step_runs_its_three_kernels_and_nothing_else(rng):
    """With the planning kernel, the step's lengths go to it as given: it clamps them and makes
    their offsets, so the metadata's own clamp and cumulative sum are dead code XLA drops
    (on a GPU: two kernel launches fewer a step). The compiled program holds the three
    kernels' calls and no computation of XLA's; its output is the jnp planner's, bit for bit,
    lengths out of range under jit included (clamped alike). The metadata carries the kernel's
    lengths and offsets (``metadata.with_schedule``), so a metadata build jitted alone is the
    planning kernel too."""
    import re

    import jax
    import jax.numpy as jnp

    import jax_mla
    from jax_mla.backends.triton import TritonTuning
    from jax_mla.backends.triton.launch import triton_importable
    from jax_mla.problem import current_platform

    if not triton_importable(current_platform()):
        pytest.skip("triton cannot run here")
    b, mp, ps, h = 3, 4, 16, 16
    table = jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, h, 576)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((b * mp, ps, 576)), jnp.float32)

    def step(planner):
        def f(q, cache, table, lens):
            md = jax_mla.build_decode_metadata(
                table, lens, page_size=ps, num_heads=h, q=q, kv_cache=cache, backend="triton",
                tuning=TritonTuning(planner=planner))
            return jax_mla.mla_attention(q, cache, md, scale=0.1, backend="triton")
        return jax.jit(f)

    lens = jnp.asarray([5, 999, -3], jnp.int32)  # past the capacity (64), and negative
    hlo = step("kernel").lower(q, cache, table, lens).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    ops = set(re.findall(r"^\s*(?:ROOT\s+)?%\S+ = (?:\([^)]*\)|\S+) ([\w-]+)\(", entry, re.M))
    assert ops <= {"parameter", "constant", "bitcast", "custom-call", "get-tuple-element",
                   "tuple"}, ops
    assert entry.count("custom-call(") == 3, entry
    # The metadata jitted alone: the planning kernel makes its lengths and offsets too (no
    # clamp, no cumulative sum anywhere in the program).
    build = jax.jit(lambda table, lens: jax_mla.build_decode_metadata(
        table, lens, page_size=ps, num_heads=h, q=q, kv_cache=cache, backend="triton",
        tuning=TritonTuning(planner="kernel")))
    alone = build.lower(table, lens).compile().as_text()
    assert alone.count("custom-call(") == 1, alone
    for op in ("reduce-window(", "minimum(", "maximum(", "clamp(", "concatenate("):
        assert op not in alone, (op, alone)
    md = build(table, lens)
    np.testing.assert_array_equal(np.asarray(md.seq_lens), [5, 64, 0])
    np.testing.assert_array_equal(np.asarray(md.paged_kv_indptr), [0, 5, 69, 69])
    assert md.schedule.seq_lens is None and md.schedule.kv_indptr is None
    got = step("kernel")(q, cache, table, lens)
    want = step("jnp")(q, cache, table, lens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.isfinite(np.asarray(got)).all()


def test_head_blocks_are_a_power_of_two_where_that_keeps_their_number():
    """Split heads take the largest power of two a block that needs no more blocks (rows pack
    ``t * HB + h``: shifts, not divisions, in the kernel); the block count, the rows' cap and
    the heads' coverage never change."""
    from jax_mla.backends.triton.plan import kernel_config, pow2_heads_per_block

    for max_rows in (16, 32, 64):
        for heads in range(1, 129):
            for qlen in range(1, 9):
                hb0 = heads if qlen * heads <= max_rows else max(1, max_rows // qlen)
                nhb = -(-heads // hb0)
                hb = pow2_heads_per_block(heads, hb0, nhb)
                assert -(-heads // hb) == nhb and hb <= hb0, (max_rows, heads, qlen, hb)
                pow2s = [1 << i for i in range(8) if (1 << i) <= hb0
                         and -(-heads // (1 << i)) == nhb]
                assert hb == (max(pow2s) if pow2s and nhb > 1 else hb0), (heads, qlen, hb)
    got = {(h, q): kernel_config(h, q, 64, "cuda", sm90=False) for h, q in
           ((16, 5), (16, 6), (16, 7), (32, 3), (128, 3), (128, 1))}
    assert {k: (c.heads_per_block, c.num_head_blocks) for k, c in got.items()} == {
        (16, 5): (8, 2), (16, 6): (8, 2), (16, 7): (8, 2), (32, 3): (16, 2), (128, 3): (21, 7),
        (128, 1): (64, 2)}
    r = kernel_config(16, 3, 64, "rocm")  # at most 32 rows there: 10 heads a block before
    assert (r.heads_per_block, r.num_head_blocks, r.block_m) == (8, 2, 32), r
