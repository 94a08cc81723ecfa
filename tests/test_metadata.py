import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_mla


def test_decode_expands_kernel_block_page_indices():
    """docs/design.md §3.4: block 2, table [[10,11,99],[20,21,22]], lens [3,5]."""
    md = jax_mla.build_decode_metadata(
        jnp.array([[10, 11, 99], [20, 21, 22]], jnp.int32), jnp.array([3, 5], jnp.int32),
        page_size=2)
    np.testing.assert_array_equal(md.paged_kv_indices[:8], [20, 21, 22, 40, 41, 42, 43, 44])
    assert np.all(np.asarray(md.paged_kv_indices[8:]) == -1)
    np.testing.assert_array_equal(md.paged_kv_indptr, [0, 3, 8])
    np.testing.assert_array_equal(md.paged_kv_last_page_len, [1, 1])
    np.testing.assert_array_equal(md.page_indptr, [0, 2, 5])
    np.testing.assert_array_equal(md.page_indices[:5], [10, 11, 20, 21, 22])
    np.testing.assert_array_equal(md.last_page_len, [1, 1])


@pytest.mark.parametrize("qlen", [1, 2, 4])
def test_uniform_qo_indptr(qlen):
    md = jax_mla.build_decode_metadata(jnp.zeros((3, 2), jnp.int32), jnp.array([1, 2, 3]),
                                       page_size=4, qlen=qlen)
    np.testing.assert_array_equal(md.qo_indptr, np.arange(4) * qlen)
    assert md.num_rows == 3 * qlen and md.qlen == qlen


@st.composite
def tables(draw):
    b = draw(st.integers(1, 6))
    page_size = draw(st.sampled_from([1, 2, 3, 16, 64]))
    max_pages = draw(st.integers(1, 5))
    lens = draw(st.lists(st.integers(0, max_pages * page_size), min_size=b, max_size=b))
    table = draw(st.lists(st.lists(st.integers(0, 1000), min_size=max_pages, max_size=max_pages),
                          min_size=b, max_size=b))
    return np.array(table, np.int32), np.array(lens, np.int32), page_size


@given(tables())
@settings(max_examples=40, deadline=None)
def test_both_views_agree_with_a_direct_expansion(args):
    table, lens, ps = args
    md = jax_mla.build_decode_metadata(table, lens, page_size=ps)
    flat, pages, last = [], [], []
    for b, n in enumerate(lens):
        flat += [table[b, t // ps] * ps + t % ps for t in range(n)]
        npg = -(-n // ps)
        pages += list(table[b, :npg])
        last.append(n - (npg - 1) * ps if n else 0)
    cap = table.shape[0] * table.shape[1] * ps
    np.testing.assert_array_equal(md.paged_kv_indices, flat + [-1] * (cap - len(flat)))
    np.testing.assert_array_equal(md.paged_kv_indptr, np.concatenate([[0], np.cumsum(lens)]))
    np.testing.assert_array_equal(md.page_indices, pages + [-1] * (table.size - len(pages)))
    np.testing.assert_array_equal(md.last_page_len, last)
    np.testing.assert_array_equal(md.seq_lens, lens)


def test_jitted_step_does_not_recompile_as_lengths_change():
    traces = []

    @jax.jit
    def step(table, lens):
        traces.append(1)
        return jax_mla.build_decode_metadata(table, lens, page_size=16, qlen=2)

    table = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    for lens in ([5, 17, 64], [1, 2, 3], [0, 64, 33]):
        md = step(table, jnp.array(lens, jnp.int32))
        np.testing.assert_array_equal(md.seq_lens, lens)
    assert len(traces) == 1
    leaves = jax.tree_util.tree_leaves(md)
    assert all(isinstance(x, jax.Array) for x in leaves)


def test_flat_capacity_and_errors():
    table = jnp.zeros((2, 3), jnp.int32)
    md = jax_mla.build_decode_metadata(table, jnp.array([2, 3]), page_size=2, flat_capacity=5)
    assert md.flat_capacity == 5
    with pytest.raises(ValueError, match="flat_capacity"):
        jax_mla.build_decode_metadata(table, jnp.array([2, 4]), page_size=2, flat_capacity=5)
    with pytest.raises(ValueError,
                       match=r"seq_lens\[1\] = 7 must lie in \[0, 6\] \(max_pages \* page_size"):
        jax_mla.build_decode_metadata(table, jnp.array([2, 7]), page_size=2)
    with pytest.raises(TypeError, match="block_table must be an integer"):
        jax_mla.build_decode_metadata(table.astype(jnp.float32), jnp.array([1, 1]), page_size=2)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        jax_mla.build_decode_metadata(table, jnp.array([1, 1]), page_size=0)
    with pytest.raises(ValueError, match=r"seq_lens must be \[B=2\]"):
        jax_mla.build_decode_metadata(table, jnp.array([1, 1, 1]), page_size=2)
    with pytest.raises(ValueError, match="qlen"):
        jax_mla.build_decode_metadata(table, jnp.array([1, 1]), page_size=2, qlen=0)


def test_planned_metadata_builds_only_the_views_its_backend_reads():
    table, lens = jnp.arange(12, dtype=jnp.int32).reshape(3, 4), jnp.array([5, 17, 0])
    full = jax_mla.build_decode_metadata(table, lens, page_size=8)
    assert full.plan is None and full.paged_kv_indices is not None
    assert full.page_indices is not None and full.flat_capacity == 3 * 4 * 8
    xla = jax_mla.build_decode_metadata(table, lens, page_size=8, num_heads=4, backend="xla")
    for name in ("page_indptr", "page_indices", "last_page_len", "paged_kv_indices",
                 "paged_kv_last_page_len"):
        assert getattr(xla, name) is None, name
    for name in ("block_table", "seq_lens", "qo_indptr", "paged_kv_indptr"):
        np.testing.assert_array_equal(getattr(xla, name), getattr(full, name))
    with pytest.raises(ValueError, match="no flat per-token view"):
        _ = xla.flat_capacity
