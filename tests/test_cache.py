import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla


def test_write_places_rows_and_skips_padding(rng):
    p, ps, lr, r = 4, 3, 8, 4
    cache = jnp.full((p, ps, lr + r), jnp.nan, jnp.float32)
    n = 5
    kv_c = jnp.asarray(rng.standard_normal((n, lr)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((n, 1, r)), jnp.float32)  # vLLM's [N, 1, R] form
    slots = jnp.array([7, -1, 0, 11, 12], jnp.int32)  # -1 and 12 (past the end) are skipped
    out = jax.jit(jax_mla.write_kv_cache, donate_argnums=0)(cache, kv_c, k_pe, slots)
    flat = np.asarray(out).reshape(p * ps, lr + r)
    for i, s in enumerate([7, None, 0, 11, None]):
        if s is not None:
            np.testing.assert_array_equal(flat[s], np.concatenate([kv_c[i], k_pe[i, 0]]))
    written = {0, 7, 11}
    for s in range(p * ps):
        if s not in written:
            assert np.all(np.isnan(flat[s]))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_fp8_write_stores_x_over_scale(rng, dtype):
    cache = jnp.zeros((2, 2, 12), dtype)
    kv_c = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
    k_pe = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    k_scale = 0.05
    out = jax_mla.write_kv_cache(cache, kv_c, k_pe, jnp.array([3, 0, 2]), k_scale=k_scale)
    assert out.dtype == jnp.dtype(dtype)
    stored = np.asarray(out.astype(jnp.float32)).reshape(4, 12)[[3, 0, 2]]
    want = np.concatenate([kv_c, k_pe], axis=1)
    # Exactly ml_dtypes' round-to-nearest of the float32 quotient x / k_scale ...
    quotient = want.astype(np.float32) / np.float32(k_scale)
    np.testing.assert_array_equal(stored, quotient.astype(jnp.dtype(dtype)).astype(np.float32))
    # ... so each value is within half an ulp of x / k_scale (normal range: relative 2^-(m+1)).
    finfo = jnp.finfo(dtype)
    normal = np.abs(quotient) >= float(finfo.smallest_normal)
    half_ulp = 2.0 ** -(finfo.nmant + 1)
    err = np.abs(stored.astype(np.float64) - quotient) / np.abs(quotient)
    assert normal.any() and np.all(err[normal] <= half_ulp), (err.max(), half_ulp)


def test_write_errors():
    cache = jnp.zeros((2, 2, 12))
    with pytest.raises(ValueError, match="must equal the cache width"):
        jax_mla.write_kv_cache(cache, jnp.zeros((1, 8)), jnp.zeros((1, 3)), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="must agree on N"):
        jax_mla.write_kv_cache(cache, jnp.zeros((2, 8)), jnp.zeros((2, 4)), jnp.zeros(1, jnp.int32))
    with pytest.raises(TypeError, match="slot_mapping must be an integer"):
        jax_mla.write_kv_cache(cache, jnp.zeros((1, 8)), jnp.zeros((1, 4)), jnp.zeros(1))
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_pages, page_size, D\]"):
        jax_mla.write_kv_cache(jnp.zeros((2, 12)), jnp.zeros((1, 8)), jnp.zeros((1, 4)),
                               jnp.zeros(1, jnp.int32))
