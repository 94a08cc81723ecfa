import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla import merge_attn_states

from oracle import rel_err, softmax_union


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_matches_softmax_over_the_union(rng, dtype):
    t, h, na, nb, dv = 5, 3, 7, 4, 16
    sa = rng.standard_normal((t, h, na)) * 3
    sb = rng.standard_normal((t, h, nb)) * 3 + 2
    va = rng.standard_normal((t, h, na, dv))
    vb = rng.standard_normal((t, h, nb, dv))
    oa, la = softmax_union(sa[..., :1], va[..., :1, :], sa[..., 1:], va[..., 1:, :])
    ob, lb = softmax_union(sb[..., :1], vb[..., :1, :], sb[..., 1:], vb[..., 1:, :])
    want_o, want_l = softmax_union(sa, va, sb, vb)
    out, lse = jax.jit(merge_attn_states)(jnp.asarray(oa, dtype), jnp.asarray(la, jnp.float32),
                                          jnp.asarray(ob, dtype), jnp.asarray(lb, jnp.float32))
    assert out.dtype == dtype and lse.dtype == jnp.float32
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel_err(out, want_o) < tol
    np.testing.assert_allclose(lse, want_l, rtol=1e-6, atol=1e-6)  # an LSE can sit near 0


def test_empty_sides(rng):
    o = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    ninf = jnp.full((2,), -jnp.inf)
    lse = jnp.asarray(rng.standard_normal(2), jnp.float32)
    garbage = jnp.full((2, 4), jnp.nan)
    # One side empty (with garbage output, as some kernels leave): the other passes through.
    out, l2 = merge_attn_states(o, lse, garbage, ninf)
    np.testing.assert_allclose(out, o, rtol=1e-6)
    np.testing.assert_allclose(l2, lse, rtol=1e-6)
    # +inf and NaN are empty-row markers, never real values.
    out, l2 = merge_attn_states(garbage, jnp.full((2,), jnp.inf), o, lse)
    np.testing.assert_allclose(out, o, rtol=1e-6)
    out, l2 = merge_attn_states(garbage, jnp.full((2,), jnp.nan), o, lse)
    np.testing.assert_allclose(out, o, rtol=1e-6)
    # Both empty: out 0, lse -inf.
    out, l2 = merge_attn_states(garbage, ninf, garbage, jnp.full((2,), jnp.inf))
    np.testing.assert_array_equal(out, np.zeros((2, 4)))
    assert np.all(np.isneginf(l2))


def test_shape_errors():
    with pytest.raises(ValueError, match="shapes differ"):
        merge_attn_states(jnp.zeros((2, 4)), jnp.zeros(2), jnp.zeros((3, 4)), jnp.zeros(3))
    with pytest.raises(ValueError, match="lse shape"):
        merge_attn_states(jnp.zeros((2, 4)), jnp.zeros(4), jnp.zeros((2, 4)), jnp.zeros(4))
