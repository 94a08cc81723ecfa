"""Chunked-context prefill and the mixed decode + prefill step against the float64 oracle.

The oracle is one-shot MHA attention over each request's whole sequence (cached context + new
tokens); the implementation gathers the context from a paged cache whose unused slots are NaN, in
workspace-bounded chunks of every size from one page to the whole context, and merges by LSE.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_prefill_oracle import mla_prefill_over_context

from jax_mla import (
    PrefillTritonConfig,
    build_decode_metadata,
    mla_mixed_step,
    mla_prefill,
    mla_prefill_with_context,
)
from jax_mla.backends.triton.launch import triton_importable

from oracle import logical_kv, rel_err

HAS_TRITON = triton_importable("cpu")
BACKENDS = [
    pytest.param(("xla", None), id="xla"),
    pytest.param(("triton", PrefillTritonConfig(16, 16)), id="triton",
                 marks=pytest.mark.skipif(not HAS_TRITON, reason="triton interpreter missing")),
]
PAGE = 4


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("JAX_MLA_POISON_OUTPUTS", "1")


def page_in(rng, seqs, page_size, extra_pages=2):
    """A paged cache holding ``seqs[b] [n_b, D]`` through a permuted block table.

    Every slot no request uses is NaN; table entries past a request's pages are -1 or point at
    NaN pages (nothing may read them). Returns ``(cache [P, page, D] float32, table [B, M])``.
    """
    d = seqs[0].shape[1]
    need = [-(-len(s) // page_size) for s in seqs]
    max_pages = max(need + [1]) + extra_pages
    num_phys = sum(need) + extra_pages + 1
    cache = np.full((num_phys, page_size, d), np.nan, np.float32)
    perm = rng.permutation(num_phys)
    spare = perm[sum(need):]
    table = np.full((len(seqs), max_pages), -1, np.int32)
    k = 0
    for b, s in enumerate(seqs):
        pages = perm[k:k + need[b]]
        k += need[b]
        table[b, :need[b]] = pages
        table[b, need[b]:] = np.where(rng.random(max_pages - need[b]) < 0.5, -1,
                                      rng.choice(spare, max_pages - need[b]))
        for i, page in enumerate(pages):
            rows = s[i * page_size:(i + 1) * page_size]
            cache[page, :len(rows)] = rows
    return cache, table


@pytest.fixture
def problem(rng):
    """Four prefill requests, three with context (one longer than the others), tiny MLA dims."""
    return make_problem(rng, ctx=[9, 0, 17, 4], new=[3, 5, 2, 1], h=2, lrank=16, rope=8, nope=16,
                        dv=16)


def make_problem(rng, *, ctx, new, h, lrank, rope, nope, dv):
    ctx, new = np.asarray(ctx), np.asarray(new)
    d = lrank + rope
    latents = [rng.standard_normal((c, d)).astype(np.float32) for c in ctx]
    cache, table = page_in(rng, latents, PAGE)
    t = int(new.sum())
    return dict(
        q=rng.standard_normal((t, h, nope + rope)).astype(np.float32),
        kv_c=rng.standard_normal((t, lrank)).astype(np.float32),
        k_pe=rng.standard_normal((t, rope)).astype(np.float32),
        cache=cache, table=table, ctx=ctx.astype(np.int32),
        cu=np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
        w=(rng.standard_normal((lrank, h, nope + dv)) / np.sqrt(lrank)).astype(np.float32),
        scale=float((nope + rope) ** -0.5),
    )


def oracle_of(p, k_scale=1.0, cache=None):
    return mla_prefill_over_context(p["q"], p["kv_c"], p["k_pe"],
                                    p["cache"] if cache is None else cache, p["table"], p["ctx"],
                                    p["cu"], p["w"], page_size=PAGE, scale=p["scale"],
                                    k_scale=k_scale)


def run(p, backend, workspace_tokens, dtype=jnp.float32, cache=None, k_scale=None):
    c = lambda x: jnp.asarray(x, dtype)
    return mla_prefill_with_context(
        c(p["q"]), c(p["kv_c"]), c(p["k_pe"]), jnp.asarray(p["cache"] if cache is None else cache),
        jnp.asarray(p["table"]), jnp.asarray(p["ctx"]), jnp.asarray(p["cu"]), c(p["w"]),
        scale=p["scale"], workspace_tokens=workspace_tokens, k_scale=k_scale, return_lse=True,
        backend=backend[0], config=backend[1])


def check(got, want, tol=1e-5, lse_tol=1e-5):
    out, lse = (np.asarray(x, np.float64) for x in got)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_err(out, want[0]) < tol
    np.testing.assert_allclose(lse, want[1], rtol=lse_tol, atol=lse_tol)


# Per-request chunk budget C = W // 3 (three requests have context): one page (4), a budget that
# is not a page multiple (5), two and three pages, and the longest context at once (17).
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [PAGE, 5, 2 * PAGE, 3 * PAGE, 17])
def test_every_chunk_size_matches_one_shot_attention(problem, backend, budget):
    want = oracle_of(problem)
    check(run(problem, backend, workspace_tokens=3 * budget + budget % 2), want)


def test_one_token_chunks_and_one_shot_prefill_agree(problem):
    """The smallest budget (C = 1 token) and the implementation's own one-shot varlen attention over
    context + new tokens (bottom-right causal ``mla_prefill`` with ``cu_seqlens_k``)."""
    p = problem
    want = oracle_of(p)
    got = run(p, ("xla", None), workspace_tokens=4)  # C = 4 // 3 = 1
    check(got, want)
    # One-shot with mla_prefill: build each request's full K/V from the oracle's latents.
    nope = p["q"].shape[2] - p["k_pe"].shape[1]
    lrank = p["kv_c"].shape[1]
    ks, vs, cu_k = [], [], [0]
    new = np.concatenate([p["kv_c"], p["k_pe"]], axis=1)
    for b in range(4):
        lat = np.concatenate([logical_kv(p["cache"], p["table"][b], p["ctx"][b], PAGE),
                              new[p["cu"][b]:p["cu"][b + 1]]])
        kv = np.einsum("nl,lhd->nhd", lat[:, :lrank], p["w"])
        pe = np.broadcast_to(lat[:, None, lrank:], (len(lat), 2, lat.shape[1] - lrank))
        ks.append(np.concatenate([kv[..., :nope], pe], -1))
        vs.append(kv[..., nope:])
        cu_k.append(cu_k[-1] + len(lat))
    one = mla_prefill(jnp.asarray(p["q"]), jnp.asarray(np.concatenate(ks), jnp.float32),
                      jnp.asarray(np.concatenate(vs), jnp.float32), jnp.asarray(p["cu"]),
                      cu_seqlens_k=jnp.asarray(cu_k, jnp.int32), scale=p["scale"],
                      return_lse=True)
    check(one, want)
    check(got, [np.asarray(x, np.float64) for x in one])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_cache_dequantised_with_k_scale(problem, backend):
    p = problem
    k_scale = 0.37
    fp8 = jnp.asarray(p["cache"] / k_scale, jnp.float8_e4m3fn)
    # The oracle reads exactly the stored values, dequantised (unused slots stay NaN).
    stored = np.asarray(fp8.astype(jnp.float32), np.float64)
    want = oracle_of(p, k_scale=k_scale, cache=stored)
    check(run(p, backend, workspace_tokens=24, cache=fp8, k_scale=jnp.float32(k_scale)), want)


def test_deepseek_dims_bf16(rng):
    """qk 192 = 128 + 64, v 128, a 64-wide latent (DeepSeek's is 512), bf16 everywhere."""
    p = make_problem(rng, ctx=[33, 70], new=[20, 9], h=2, lrank=64, rope=64, nope=128, dv=128)
    rnd = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    for key in ("q", "kv_c", "k_pe", "w", "cache"):
        p[key] = rnd(p[key])
    bf_cache = jnp.asarray(p["cache"], jnp.bfloat16)
    check(run(p, ("xla", None), workspace_tokens=64, dtype=jnp.bfloat16, cache=bf_cache),
          oracle_of(p), tol=2e-2, lse_tol=2e-2)


def test_under_jit_context_lengths_are_data(problem):
    p = problem
    step = jax.jit(lambda ctx: mla_prefill_with_context(
        jnp.asarray(p["q"]), jnp.asarray(p["kv_c"]), jnp.asarray(p["k_pe"]),
        jnp.asarray(p["cache"]), jnp.asarray(p["table"]), ctx, jnp.asarray(p["cu"]),
        jnp.asarray(p["w"]), scale=p["scale"], workspace_tokens=12, return_lse=True))
    for ctx in ([9, 0, 17, 4], [0, 0, 0, 0], [1, 0, 3, 0]):
        p2 = dict(p, ctx=np.asarray(ctx, np.int32))
        check(step(jnp.asarray(ctx, jnp.int32)), oracle_of(p2))
    assert step._cache_size() == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qlen", [1, 2])
def test_mixed_step_decode_rows_first(rng, backend, qlen):
    """Decode requests (absorbed path over the latent cache) then prefill requests (MHA path
    with chunked context), one call, against MHA attention over every row's whole prefix."""
    h, lrank, rope, nope, dv = 2, 16, 8, 16, 16
    d = lrank + rope
    dec_lens = np.array([7, 12])  # include each decode request's qlen new tokens
    pre_ctx, pre_new = np.array([5, 0, 11]), np.array([4, 3, 2])
    pre_lat = [rng.standard_normal((c + n, d)).astype(np.float32)
               for c, n in zip(pre_ctx, pre_new)]
    dec_lat = [rng.standard_normal((n, d)).astype(np.float32) for n in dec_lens]
    # One cache, already holding this step's tokens (written before attention, as in vLLM).
    cache, table = page_in(rng, dec_lat + pre_lat, PAGE)
    t_d = 2 * qlen
    new_rows = np.concatenate([s[-qlen:] for s in dec_lat] + [s[c:] for s, c in
                                                             zip(pre_lat, pre_ctx)])
    t = len(new_rows)
    q = rng.standard_normal((t, h, nope + rope)).astype(np.float32)
    w = (rng.standard_normal((lrank, h, nope + dv)) / np.sqrt(lrank)).astype(np.float32)
    scale = (nope + rope) ** -0.5
    md = build_decode_metadata(jnp.asarray(table[:2]), jnp.asarray(dec_lens), page_size=PAGE,
                               qlen=qlen)
    cu_p = np.concatenate([[0], np.cumsum(pre_new)]).astype(np.int32)
    out = mla_mixed_step(
        jnp.asarray(q), jnp.asarray(new_rows[:, :lrank]), jnp.asarray(new_rows[:, lrank:]),
        jnp.asarray(cache), jnp.asarray(w), md, jnp.asarray(table[2:]), jnp.asarray(pre_ctx),
        jnp.asarray(cu_p), scale=scale, workspace_tokens=8, prefill_backend=backend[0],
        config=backend[1])
    # Oracle: every row is a "new token" of its request over the request's earlier tokens.
    ctx_all = np.concatenate([dec_lens - qlen, pre_ctx]).astype(np.int32)
    cu_all = np.concatenate([[0], np.cumsum([qlen, qlen, *pre_new])]).astype(np.int32)
    want, _ = mla_prefill_over_context(q, new_rows[:, :lrank], new_rows[:, lrank:], cache, table,
                                       ctx_all, cu_all, w, page_size=PAGE, scale=scale)
    assert out.shape == (t, h, dv)
    assert rel_err(out[:t_d], want[:t_d]) < 1e-5
    assert rel_err(out[t_d:], want[t_d:]) < 1e-5

    # Decode only, and prefill only, through the same entry.
    only_d = mla_mixed_step(jnp.asarray(q[:t_d]), jnp.asarray(new_rows[:t_d, :lrank]),
                            jnp.asarray(new_rows[:t_d, lrank:]), jnp.asarray(cache),
                            jnp.asarray(w), md, scale=scale)
    np.testing.assert_allclose(only_d, out[:t_d], rtol=1e-6, atol=1e-6)
    only_p = mla_mixed_step(jnp.asarray(q[t_d:]), jnp.asarray(new_rows[t_d:, :lrank]),
                            jnp.asarray(new_rows[t_d:, lrank:]), jnp.asarray(cache),
                            jnp.asarray(w), None, jnp.asarray(table[2:]), jnp.asarray(pre_ctx),
                            jnp.asarray(cu_p), scale=scale, workspace_tokens=8)
    assert rel_err(only_p, want[t_d:]) < 1e-5


def test_errors(problem):
    p = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in problem.items()}
    args = lambda **o: [o.get(k, p[k]) for k in ("q", "kv_c", "k_pe", "cache", "table", "ctx",
                                                  "cu", "w")]
    kw = dict(scale=1.0, workspace_tokens=16)
    with pytest.raises(ValueError, match="workspace_tokens"):
        mla_prefill_with_context(*args(), scale=1.0, workspace_tokens=3)
    with pytest.raises(ValueError, match="kv_b_proj"):
        mla_prefill_with_context(*args(w=p["w"][:, :1]), **kw)
    with pytest.raises(ValueError, match="kv_cache width"):
        mla_prefill_with_context(*args(cache=p["cache"][..., :-1]), **kw)
    with pytest.raises(ValueError, match="kv_c_normed"):
        mla_prefill_with_context(*args(kv_c=p["kv_c"][:-1]), **kw)
    with pytest.raises(ValueError, match="k_pe"):
        mla_prefill_with_context(*args(k_pe=p["k_pe"][:, :0]), **kw)
    with pytest.raises(ValueError, match="context_lens"):
        mla_prefill_with_context(*args(ctx=p["ctx"][:2]), **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mla_prefill_with_context(*args(cu=p["cu"][:3]), **kw)
    with pytest.raises(TypeError, match="q dtype"):
        mla_prefill_with_context(*args(q=p["q"].astype(jnp.int32)), **kw)
    with pytest.raises(ValueError, match="workspace_tokens is required"):
        mla_mixed_step(p["q"], p["kv_c"], p["k_pe"], p["cache"], p["w"], None, p["table"],
                       p["ctx"], p["cu"], scale=1.0)
