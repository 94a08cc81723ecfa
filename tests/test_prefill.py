"""Conformance suite of ``mla_prefill``: every backend against the float64 oracle.

The Triton backend runs through the interpreter on CPU (tiny shapes, small tiles so that every
stage of the kernel is exercised: several query blocks, unmasked and masked key blocks).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_prefill_oracle import varlen_attention

from jax_mla import PrefillTritonConfig, mla_prefill
from jax_mla.backends import resolve_backend
from jax_mla.backends.triton.launch import triton_importable
from jax_mla.backends.triton.prefill import (
    head_dim_split,
    num_query_blocks,
    pick_config,
    query_block_table,
)
from jax_mla.reference import prefill_reference

from oracle import rel_err

HAS_TRITON = triton_importable("cpu")
SMALL = PrefillTritonConfig(block_m=16, block_n=16)
BACKENDS = [
    pytest.param(("xla", None), id="xla"),
    pytest.param(("triton", SMALL), id="triton-16x16",
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton interpreter missing")),
    pytest.param(("triton", PrefillTritonConfig(32, 16)), id="triton-32x16",
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton interpreter missing")),
]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    # Interpreted kernels start from NaN outputs: an unwritten lane fails the comparison.
    monkeypatch.setenv("JAX_MLA_POISON_OUTPUTS", "1")


def packed(rng, lens, num_rows, h, d):
    """``[num_rows, h, d]`` normal values for the packed rows, NaN in the padding rows."""
    x = np.full((num_rows, h, d), np.nan, np.float32)
    n = int(np.sum(lens))
    x[:n] = rng.standard_normal((n, h, d))
    return x


def cu_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def check(got, want, dtype):
    out, lse = got
    want_o, want_l = want
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    assert lse.dtype == np.float32
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_l))
    assert np.all(out[np.isneginf(want_l)] == 0)
    assert rel_err(out, want_o) < TOL[dtype]
    fin = np.isfinite(want_l)
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(lse[fin], want_l[fin], atol=atol, rtol=atol)


def run(backend, q, k, v, cu, dtype, **kw):
    name, cfg = backend
    cast = lambda x: jnp.asarray(x, dtype)
    return mla_prefill(cast(q), cast(k), cast(v), jnp.asarray(cu), return_lse=True, backend=name,
                       config=cfg, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_oracle(rng, backend, dtype, causal):
    # Lengths around the tile sizes, an empty sequence, and NaN padding rows past cu[-1].
    lens = np.array([rng.integers(17, 40), 0, rng.integers(1, 6), 33])
    t = int(lens.sum()) + 3
    h, dqk, dv = 2, 48, 24  # 48 = 32 + 16 (two dots, like 128 + 64); 24 pads to 32
    q, k = packed(rng, lens, t, h, dqk), packed(rng, lens, t, h, dqk)
    v = packed(rng, lens, t, h, dv)
    cu = cu_of(lens)
    # The oracle sees the values the kernel sees (rounded to the input dtype).
    r = lambda x: np.asarray(jnp.asarray(x, dtype), np.float64)
    want = varlen_attention(r(q), r(k), r(v), cu, cu, scale=0.3, causal=causal)
    got = run(backend, q, k, v, cu, dtype, scale=0.3, causal=causal, max_seqlen=40)
    assert got[0].shape == (t, h, dv) and got[0].dtype == dtype
    check(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS[:2])
@pytest.mark.parametrize("causal", [True, False])
def test_separate_key_packing(rng, backend, causal):
    """``cu_seqlens_k``: queries are the last tokens of longer (or shorter, or empty) key
    sequences; causal is bottom-right aligned, so rows with no visible key give 0, -inf."""
    lens_q = np.array([5, 20, 7, 3, 4])
    lens_k = np.array([30, 20, 2, 0, 4])
    h, dqk, dv = 2, 40, 16  # 40 = 32 + 8 (second dot padded to 16 by masks)
    q = packed(rng, lens_q, int(lens_q.sum()) + 2, h, dqk)
    k = packed(rng, lens_k, int(lens_k.sum()) + 5, h, dqk)
    v = packed(rng, lens_k, int(lens_k.sum()) + 5, h, dv)
    cu_q, cu_k = cu_of(lens_q), cu_of(lens_k)
    want = varlen_attention(q, k, v, cu_q, cu_k, scale=0.25, causal=causal)
    got = run(backend, q, k, v, cu_q, jnp.float32, scale=0.25, causal=causal,
              cu_seqlens_k=jnp.asarray(cu_k))
    check(got, want, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS[:2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_deepseek_head_dims(rng, backend, dtype):
    """qk 192 (128 nope + 64 rope), v 128, DeepSeek's softmax scale."""
    lens = np.array([45, 19]) if backend[0] == "triton" else np.array([150, 37, 64])
    h = 2 if backend[0] == "triton" else 4
    t = int(lens.sum())
    q, k = packed(rng, lens, t, h, 192), packed(rng, lens, t, h, 192)
    v = packed(rng, lens, t, h, 128)
    cu = cu_of(lens)
    r = lambda x: np.asarray(jnp.asarray(x, dtype), np.float64)
    want = varlen_attention(r(q), r(k), r(v), cu, cu, scale=192 ** -0.5, causal=True)
    check(run(backend, q, k, v, cu, dtype, scale=192 ** -0.5), want, dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="triton interpreter missing")
@pytest.mark.parametrize("dqk,dv,cfg", [(32, 16, (16, 32)), (24, 40, (32, 32)), (64, 64, (64, 16))])
def test_triton_head_dims_and_tiles(rng, dqk, dv, cfg):
    """No second dot (32), a padded second dot (24 = 16 + 8), padded v (40 -> 64), BM < BN."""
    lens = np.array([int(rng.integers(20, 50)), int(rng.integers(1, 20))])
    t = int(lens.sum()) + 1
    q, k = packed(rng, lens, t, 2, dqk), packed(rng, lens, t, 2, dqk)
    v = packed(rng, lens, t, 2, dv)
    cu = cu_of(lens)
    want = varlen_attention(q, k, v, cu, cu, scale=0.4, causal=True)
    check(run(("triton", PrefillTritonConfig(*cfg)), q, k, v, cu, jnp.float32, scale=0.4),
          want, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_all_sequences_empty(rng, backend):
    q = jnp.asarray(rng.standard_normal((4, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 2, 16)), jnp.float32)
    out, lse = mla_prefill(q, q, v, jnp.zeros(3, jnp.int32), scale=1.0, return_lse=True,
                           backend=backend[0], config=backend[1])
    np.testing.assert_array_equal(np.asarray(out), 0)
    assert np.all(np.isneginf(np.asarray(lse)))


def test_under_jit_lengths_are_data(rng):
    """One compiled step serves different length mixes (cu_seqlens is traced)."""
    h, d, t = 2, 16, 24
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32) for _ in range(3))
    step = jax.jit(lambda q, k, v, cu: mla_prefill(q, k, v, cu, scale=0.5, max_seqlen=t,
                                                  return_lse=True))
    for lens in ([10, 14], [1, 20], [0, 24]):
        cu = cu_of(lens)
        want = varlen_attention(q, k, v, cu, cu, scale=0.5, causal=True)
        check(step(q, k, v, jnp.asarray(cu)), want, jnp.float32)
    assert step._cache_size() == 1


@pytest.mark.parametrize("q_chunk,k_chunk", [(16, 8), (16, 5), (32, 64)])
def test_reference_chunk_sizes(rng, q_chunk, k_chunk):
    """Key chunks that straddle sequences and the end of k (the clamped slice) count once."""
    lens = np.array([13, 1, 22])
    h, d, t = 2, 8, 36
    q, k, v = (packed(rng, lens, t, h, d) for _ in range(3))
    cu = cu_of(lens)
    for causal in (True, False):
        want = varlen_attention(q, k, v, cu, cu, scale=0.5, causal=causal)
        got = prefill_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu),
                                jnp.asarray(cu), scale=0.5, causal=causal, q_chunk=q_chunk,
                                k_chunk=k_chunk)
        check(got, want, jnp.float32)


_MAX_SEQS, _MAX_LEN, _MAX_PAD = 6, 70, 20
# One static shape per (block_m, causal), so the examples do not recompile.
_table = jax.jit(query_block_table, static_argnums=(1, 2, 3))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(lens=st.lists(st.integers(0, _MAX_LEN), min_size=1, max_size=_MAX_SEQS),
                  pad=st.integers(0, _MAX_PAD), bm=st.sampled_from([16, 32, 128]),
                  causal=st.booleans())
def test_query_block_table_covers_every_block_once(lens, pad, bm, causal):
    seqs = lens + [pad]  # the trailing padding sequence, as the backend adds it
    need = sum(-(-n // bm) for n in seqs)
    assert need <= num_query_blocks(sum(seqs), len(seqs), bm)  # the static bound holds
    # Fixed shapes: zero-length sequences up to _MAX_SEQS, grid bound of the largest total.
    cu = cu_of(seqs + [0] * (_MAX_SEQS - len(lens)))
    nb = num_query_blocks(_MAX_SEQS * _MAX_LEN + _MAX_PAD, _MAX_SEQS + 1, bm)
    seq, m0 = (np.asarray(a) for a in _table(jnp.asarray(cu), nb, bm, causal))
    got = sorted((int(s), int(m)) for s, m in zip(seq, m0) if s >= 0)
    want = sorted((s, m) for s, n in enumerate(seqs) for m in range(0, n, bm))
    assert got == want  # every block exactly once
    assert np.all(m0[seq < 0] == 0)
    if causal:  # within a sequence the last block (most keys) comes first
        for s in set(seq[seq >= 0].tolist()):
            assert list(m0[seq == s]) == sorted(m0[seq == s], reverse=True)


def test_config_picker_and_head_split():
    assert head_dim_split(192, 128) == (128, 64, 128)
    assert head_dim_split(128, 128) == (128, 0, 128)
    assert head_dim_split(576, 512) == (512, 64, 512)
    assert head_dim_split(24, 8) == (16, 16, 16)
    cfg = pick_config(192, 128, jnp.bfloat16)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 64, 8, 3)
    # Shared memory on Hopper: resident Q tile plus K and V tiles per stage, <= 227 KiB.
    for dqk, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
        for dtype in (jnp.bfloat16, jnp.float32):
            c = pick_config(dqk, dv, dtype)
            d1, d2, bdv = head_dim_split(dqk, dv)
            size = jnp.dtype(dtype).itemsize
            smem = (c.block_m * (d1 + d2) + c.num_stages * c.block_n * (d1 + d2 + bdv)) * size
            assert smem <= 227 * 1024, (dqk, dv, dtype, c)
    with pytest.raises(ValueError, match="block_m"):
        PrefillTritonConfig(block_m=48)


def test_backend_resolution():
    assert resolve_backend("auto", "cpu").name == "xla"  # CPU never picks the interpreter
    assert resolve_backend("xla", "cuda").name == "xla"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("flash", "cpu")


def test_errors(rng):
    x = jnp.zeros((6, 2, 16), jnp.float32)
    cu = jnp.asarray([0, 2, 6], jnp.int32)
    kw = dict(scale=1.0)
    with pytest.raises(ValueError, match="q must be rank 3"):
        mla_prefill(x[0], x, x, cu, **kw)
    with pytest.raises(TypeError, match="dtypes differ"):
        mla_prefill(x, x.astype(jnp.bfloat16), x, cu, **kw)
    with pytest.raises(TypeError, match="v dtype"):
        mla_prefill(x, x, x.astype(jnp.int32), cu, **kw)
    with pytest.raises(ValueError, match="heads"):
        mla_prefill(x, x[:, :1], x[:, :1], cu, **kw)
    with pytest.raises(ValueError, match="head dims differ"):
        mla_prefill(x, x[..., :8], x, cu, **kw)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        mla_prefill(x, x, x, jnp.asarray([0, 4, 2]), **kw)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        mla_prefill(x, x, x, jnp.asarray([0, 4, 9]), **kw)
    with pytest.raises(TypeError, match="cu_seqlens must be an integer"):
        mla_prefill(x, x, x, cu.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        mla_prefill(x, x, x, jnp.asarray([0]), **kw)
    with pytest.raises(ValueError, match="max_seqlen"):
        mla_prefill(x, x, x, cu, max_seqlen=3, **kw)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        mla_prefill(x, x[:4], x[:4], cu, **kw)
    with pytest.raises(ValueError, match="cu_seqlens_k shape"):
        mla_prefill(x, x, x, cu, cu_seqlens_k=cu[:2], **kw)
    with pytest.raises(ValueError, match="backend"):
        mla_prefill(x, x, x, cu, backend="cudnn", **kw)
    with pytest.raises(TypeError, match="config"):
        mla_prefill(x, x, x, cu, config=(128, 64), **kw)
