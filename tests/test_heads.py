import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_mla import heads

NON_DIVISOR_HEADS = [3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]
DIVISOR_HEADS = [1, 2, 4, 8]


def _q(rng, n, t=3, d=5):
    return jnp.asarray(rng.standard_normal((t, n, d)), jnp.float32)


def test_is_valid_num_heads_boundaries():
    assert all(heads.is_valid_num_heads(n) for n in range(1, 129))
    assert heads.is_valid_num_heads(144)
    assert not heads.is_valid_num_heads(0)
    assert not heads.is_valid_num_heads(129)
    assert not heads.is_valid_num_heads(-16)
    with pytest.raises(ValueError, match="num_heads=129"):
        heads.check_num_heads(129)


@pytest.mark.parametrize("n", range(1, 129))
def test_padded_counts(n):
    m = heads.padded_num_heads(n)
    assert m % 16 == 0 and m >= n and m - n < 16


def test_native_h24_only_when_declared():
    assert heads.padded_num_heads(24) == 32
    assert heads.padded_num_heads(24, native_h24=True) == 24
    assert heads.padded_num_heads(12, native_h24=True) == 16


def test_h12_query_is_tile_padded_to_h16(rng):
    q = _q(rng, 12)
    p = heads.pad_heads(q, 12)
    assert p.shape == (3, 16, 5)
    np.testing.assert_array_equal(p[:, :12], q)
    np.testing.assert_array_equal(p[:, 12:16], q[:, 0:4])


def test_h6_tp16_query_is_padded_to_h16(rng):
    q = _q(rng, 6)
    p = np.asarray(heads.pad_heads(q, 6))
    for j in range(16):
        np.testing.assert_array_equal(p[:, j], q[:, j % 6])


def test_h24_query_is_tile_padded_to_h32(rng):
    q = _q(rng, 24)
    p = heads.pad_heads(q, 24)
    assert p.shape[1] == 32
    np.testing.assert_array_equal(p[:, 24:], q[:, :8])


def test_native_h24_is_identity(rng):
    q = _q(rng, 24)
    assert heads.pad_heads(q, 24, heads.padded_num_heads(24, native_h24=True)) is q


def test_existing_divisor_head_mapping_is_unchanged(rng):
    q = _q(rng, 8)
    p = heads.pad_heads(q, 8)
    np.testing.assert_array_equal(p, np.repeat(np.asarray(q), 2, axis=1))


@pytest.mark.parametrize("n", [16, 32, 48, 128])
def test_aligned_is_zero_copy(rng, n):
    q = _q(rng, n)
    assert heads.pad_heads(q, n) is q
    assert heads.unpad_heads(q, n, n) is q


@pytest.mark.parametrize("n", range(1, 129))
def test_round_trip_every_count_is_bit_exact(rng, n):
    q = _q(rng, n, t=2, d=3)
    m = heads.padded_num_heads(n)
    p = heads.pad_heads(q, n)
    idx = np.asarray(heads.pad_index(n, m)) if m != n else np.arange(n)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(q)[:, idx])
    if m % n == 0:
        assert np.array_equal(idx, np.arange(m) // (m // n))
    else:
        assert np.array_equal(idx, np.arange(m) % n)
    np.testing.assert_array_equal(heads.unpad_heads(p, n, m), q)
    # LSE-shaped arrays ([T, H]) use the same map.
    lse = q[..., 0]
    np.testing.assert_array_equal(heads.unpad_heads(heads.pad_heads(lse, n), n, m), lse)


@pytest.mark.parametrize("n", NON_DIVISOR_HEADS + DIVISOR_HEADS + [17, 24, 31])
def test_output_discards_padding_heads(rng, n):
    """Unpadding reads only real-head lanes: poison every lane that is not a real head's."""
    m = heads.padded_num_heads(n)
    o = np.full((2, m, 4), np.nan, np.float32)
    real = np.asarray(rng.standard_normal((2, n, 4)), np.float32)
    keep = np.arange(0, m, m // n) if m % n == 0 else np.arange(n)
    o[:, keep] = real
    np.testing.assert_array_equal(heads.unpad_heads(jnp.asarray(o), n, m), real)


@given(n=st.integers(1, 128), extra=st.integers(0, 64), t=st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_targeted_padding_round_trips(n, extra, t):
    m = n + extra
    x = jnp.arange(t * n * 2, dtype=jnp.float32).reshape(t, n, 2)
    p = heads.pad_heads(x, n, m)
    assert p.shape == (t, m, 2)
    np.testing.assert_array_equal(heads.unpad_heads(p, n, m), x)


def test_bad_arguments():
    x = jnp.zeros((1, 4, 2))
    with pytest.raises(ValueError, match="expected n=5"):
        heads.pad_heads(x, 5)
    with pytest.raises(ValueError, match="smaller"):
        heads.pad_heads(x, 4, 2)
    with pytest.raises(ValueError, match="cannot be served"):
        heads.padded_num_heads(130)
