"""DCP sharding rule, slot mapping and layout helper (single device; docs/design.md §8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_mla

from conftest import make_case
from oracle import logical_kv


def _owner(p, n, i):
    return (p // i) % n


def _local_pos(p, n, i):
    return (p // (i * n)) * i + p % i


# ------------------------------------------------------------------------------------------------
# Worked examples from the spec
# ------------------------------------------------------------------------------------------------


def test_chunked_context_example_65_and_96():
    """docs/design.md §8.3: N 4, I 1: context 65 -> [17, 16, 16, 16], 96 -> [24] * 4."""
    got = jax_mla.dcp_local_seq_lens(jnp.array([65, 96]), 4, None, 1)
    np.testing.assert_array_equal(got, [[17, 16, 16, 16], [24, 24, 24, 24]])
    for r, want in enumerate([17, 16, 16, 16]):
        assert int(jax_mla.dcp_local_seq_lens(65, 4, r, 1)) == want


def test_verify_row_view_is_causal_per_row():
    """docs/design.md §8.4 and §7.11: qlen 4, N 2 rank 0, I 1, block 2, global lens [10, 12]."""
    lens = jnp.array([10, 12], jnp.int32)
    rows = jax_mla.dcp_verify_row_lens(lens, 4, 2, 0, 1)
    np.testing.assert_array_equal(rows, [4, 4, 5, 5, 5, 5, 6, 6])
    table = jnp.array([[7, 8, 9], [10, 11, 12]], jnp.int32)
    md, row_lens = jax_mla.dcp_local_metadata(table, lens, qlen=4, page_size=2, world_size=2,
                                              rank=0)
    np.testing.assert_array_equal(row_lens, [4, 4, 5, 5, 5, 5, 6, 6])
    np.testing.assert_array_equal(md.seq_lens, row_lens)
    np.testing.assert_array_equal(md.qo_indptr, np.arange(9))  # one query per row
    np.testing.assert_array_equal(md.block_table, np.repeat(np.asarray(table), 4, axis=0))
    assert md.qlen == 1 and int(row_lens.max()) == 6  # max_kv_seq_len 6


def test_verify_row_view_static_bound_example():
    """docs/design.md §8.4: N 8, qlen 3, global len 1000 -> rank 0 row lens [125] * 3."""
    np.testing.assert_array_equal(jax_mla.dcp_verify_row_lens(jnp.array([1000]), 3, 8, 0),
                                  [125, 125, 125])


def test_verify_rows_sum_to_the_global_window_across_ranks():
    lens = jnp.array([10, 12, 2, 0], jnp.int32)
    q = 4
    rows = jax_mla.dcp_verify_row_lens(lens, q, 2, None, 1)  # [B*Q, N]
    want = np.maximum(np.asarray(lens)[:, None] - q + np.arange(1, q + 1), 0).reshape(-1)
    np.testing.assert_array_equal(np.asarray(rows).sum(-1), want)
    for r in range(2):
        np.testing.assert_array_equal(rows[:, r], jax_mla.dcp_verify_row_lens(lens, q, 2, r, 1))


def test_verify_bound_is_global_not_local():
    """The causal bound is taken before the shard mapping (it is not local_len(S) - Q + t)."""
    s, q, n = 9, 3, 4
    rows = np.asarray(jax_mla.dcp_verify_row_lens(jnp.array([s]), q, n, None, 1))
    per_req = np.asarray(jax_mla.dcp_local_seq_lens(s, n, None, 1))
    naive = np.maximum(per_req[None, :] - q + np.arange(1, q + 1)[:, None], 0)
    assert not np.array_equal(rows, naive)
    for t in range(q):
        vis = s - q + t + 1
        np.testing.assert_array_equal(rows[t], [sum(_owner(p, n, 1) == r for p in range(vis))
                                                for r in range(n)])


def test_local_lens_accept_a_traced_rank():
    f = jax.jit(lambda s, r: jax_mla.dcp_local_seq_lens(s, 4, r, 2))
    s = jnp.array([0, 1, 7, 65, 100])
    for r in range(4):
        np.testing.assert_array_equal(f(s, jnp.int32(r)), jax_mla.dcp_local_seq_lens(s, 4, r, 2))


# ------------------------------------------------------------------------------------------------
# Properties
# ------------------------------------------------------------------------------------------------


@given(n=st.integers(1, 16), i=st.integers(1, 40),
       lens=st.lists(st.integers(0, 3000), min_size=8, max_size=8))
@settings(max_examples=100, deadline=None)
def test_local_lengths_sum_to_the_global_length_and_count_owned_tokens(n, i, lens):
    lens = np.array(lens, np.int32)
    local = np.asarray(jax_mla.dcp_local_seq_lens(jnp.asarray(lens), n, None, i))
    assert local.shape == (len(lens), n)
    np.testing.assert_array_equal(local.sum(-1), lens)
    for b, s in enumerate(lens):
        owners = _owner(np.arange(s), n, i)
        np.testing.assert_array_equal(local[b], np.bincount(owners, minlength=n))
    # The spec's max_seq_len bound: no rank holds more than ceil(len / (N*I)) * I tokens.
    assert np.all(local <= (-(-lens // (n * i)) * i)[:, None])


@given(n=st.integers(1, 8), i=st.integers(1, 8), q=st.integers(1, 6),
       lens=st.lists(st.integers(0, 300), min_size=4, max_size=4))
@settings(max_examples=60, deadline=None)
def test_verify_row_lens_are_local_prefixes_of_the_global_window(n, i, q, lens):
    lens = np.array(lens, np.int32)
    rows = np.asarray(jax_mla.dcp_verify_row_lens(jnp.asarray(lens), q, n, None, i))
    for b, s in enumerate(lens):
        for t in range(q):
            vis = max(int(s) - q + t + 1, 0)
            p = np.arange(vis)
            for r in range(n):
                mine = _local_pos(p[_owner(p, n, i) == r], n, i)
                # Locally stored part of the causal prefix is exactly local positions 0..len-1.
                np.testing.assert_array_equal(mine, np.arange(rows[b * q + t, r]))


# ------------------------------------------------------------------------------------------------
# Slot mapping and the layout helper
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,i,ps", [(1, 1, 4), (2, 1, 4), (4, 2, 4), (3, 4, 8), (8, 16, 16)])
def test_slot_mapping_writes_reproduce_the_sharded_layout(rng, n, i, ps):
    lens = [1, 2, 5, 3 * ps * n + 3, i * n + 1]
    case = make_case(rng, seq_lens=lens, qlen=1, num_heads=1, page_size=ps, kv_lora_rank=8,
                     rope_dim=4)
    kv, tables = jax_mla.dcp_shard_cache(jnp.asarray(case.cache), case.block_table,
                                         case.seq_lens, world_size=n, interleave=i,
                                         fill_value=np.nan)
    p_local = kv.shape[0] // n
    # All tokens of all requests, in one write per rank; padding rows (position -1) included.
    req = np.concatenate([np.full(s, b) for b, s in enumerate(lens)] + [[0, 1]])
    pos = np.concatenate([np.arange(s) for s in lens] + [[-1, -1]])
    rows = np.stack([logical_kv(case.cache, case.block_table[b], s, ps)[p] if p >= 0
                     else np.zeros(case.cache.shape[-1]) for b, p, s in
                     zip(req, pos, [lens[b] for b in req])]).astype(np.float32)
    owned = np.zeros(len(pos), int)
    for r in range(n):
        slots = jax_mla.dcp_slot_mapping(pos, req, tables[r], page_size=ps, world_size=n,
                                         rank=r, interleave=i)
        slots = np.asarray(slots)
        owned += slots >= 0
        np.testing.assert_array_equal(slots >= 0, (_owner(pos, n, i) == r) & (pos >= 0))
        local = jnp.full((p_local, ps, case.cache.shape[-1]), jnp.nan, jnp.float32)
        local = jax_mla.write_kv_cache(local, jnp.asarray(rows[:, :8]), jnp.asarray(rows[:, 8:]),
                                       jnp.asarray(slots))
        np.testing.assert_array_equal(local, kv[r * p_local:(r + 1) * p_local])
    np.testing.assert_array_equal(owned, pos >= 0)  # each real token lives on exactly one rank


def test_shard_cache_round_trips(rng):
    n, i, ps = 4, 2, 4
    lens = [0, 1, 9, 37]
    case = make_case(rng, seq_lens=lens, qlen=1, num_heads=1, page_size=ps, kv_lora_rank=8,
                     rope_dim=4)
    kv, tables = jax_mla.dcp_shard_cache(jnp.asarray(case.cache), case.block_table,
                                         case.seq_lens, world_size=n, interleave=i)
    kv, tables = np.asarray(kv), np.asarray(tables)
    mpl = jax_mla.dcp_max_local_pages(case.block_table.shape[1], ps, n, i)
    p_local = kv.shape[0] // n
    assert tables.shape == (n, len(lens), mpl) and p_local == len(lens) * mpl
    for b, s in enumerate(lens):
        want = logical_kv(case.cache, case.block_table[b], s, ps)
        got = np.zeros_like(want)
        for p in range(s):
            r, lp = _owner(p, n, i), _local_pos(p, n, i)
            got[p] = kv[r * p_local + tables[r, b, lp // ps], lp % ps]
        np.testing.assert_array_equal(got, want)


def test_max_local_pages_holds_the_busiest_rank():
    for n, i, ps, mp in [(4, 1, 16, 5), (8, 16, 16, 3), (2, 2, 4, 7), (3, 1, 1, 10)]:
        cap = mp * ps
        need = int(np.max(jax_mla.dcp_local_seq_lens(cap, n, None, i)))
        assert jax_mla.dcp_max_local_pages(mp, ps, n, i) == max(1, -(-need // ps))


# ------------------------------------------------------------------------------------------------
# Clear errors
# ------------------------------------------------------------------------------------------------


def test_rule_errors():
    with pytest.raises(ValueError, match="page_size=6 must be a multiple of interleave=4"):
        jax_mla.dcp_slot_mapping(jnp.arange(3), jnp.zeros(3, jnp.int32),
                                 jnp.zeros((1, 2), jnp.int32), page_size=6, world_size=2,
                                 rank=0, interleave=4)
    with pytest.raises(ValueError, match="page_size=16 must be a multiple of interleave=3"):
        jax_mla.dcp_shard_cache(jnp.zeros((2, 16, 8)), jnp.zeros((1, 2), jnp.int32),
                                jnp.array([3]), world_size=2, interleave=3)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        jax_mla.dcp_local_seq_lens(jnp.array([3]), 0)
    with pytest.raises(ValueError, match="interleave must be a positive int"):
        jax_mla.dcp_local_seq_lens(jnp.array([3]), 2, 0, 0)
    with pytest.raises(ValueError, match=r"rank=4 must lie in \[0, world_size=4\)"):
        jax_mla.dcp_local_seq_lens(jnp.array([3]), 4, 4)
    with pytest.raises(ValueError, match="qlen must be a positive int"):
        jax_mla.dcp_verify_row_lens(jnp.array([3]), 0, 2, 0)
    with pytest.raises(ValueError, match="total_seq_lens must be"):
        jax_mla.dcp_verify_row_lens(jnp.zeros((2, 2), jnp.int32), 2, 2, 0)
    with pytest.raises(ValueError, match="rank must be given"):
        jax_mla.dcp_slot_mapping(jnp.arange(3), jnp.zeros(3, jnp.int32),
                                 jnp.zeros((1, 2), jnp.int32), page_size=4, world_size=2,
                                 rank=None)
    with pytest.raises(ValueError, match="positions and request_ids must both be"):
        jax_mla.dcp_slot_mapping(jnp.arange(3), jnp.zeros(2, jnp.int32),
                                 jnp.zeros((1, 2), jnp.int32), page_size=4, world_size=2, rank=0)
    with pytest.raises(ValueError, match="seq_lens"):
        jax_mla.dcp_shard_cache(jnp.zeros((2, 4, 8)), jnp.zeros((2, 2), jnp.int32),
                                jnp.array([3]), world_size=2)
