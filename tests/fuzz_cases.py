"""Property-based fuzz cases (hypothesis), run by ``test_fuzz.py`` in a subprocess so that a
crash (a segfault in a kernel, say) fails the test instead of ending the test run.

``python fuzz_cases.py valid|invalid BACKEND EXAMPLES``: random valid problems must match the
float64 oracle; random invalid ones must raise the documented ``ValueError`` eagerly and, under
``jax_mla.checked``, the same error from ``err.throw()``; either way, unchecked under jit, the
call must return finite rows for every request it did not corrupt. Prints ``ok N`` on success.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import jax_mla

import oracle

L, R = 64, 32


@st.composite
def problems(draw):
    page = draw(st.sampled_from([1, 4, 16]))
    qlen = draw(st.sampled_from([1, 2]))
    heads = draw(st.sampled_from([1, 3, 8]))
    lens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=4))
    max_pages = max(1, max(-(-n // page) for n in lens)) + draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(page=page, qlen=qlen, heads=heads, lens=np.asarray(lens, np.int32),
                max_pages=max_pages, seed=seed)


def build(p):
    rng = np.random.default_rng(p["seed"])
    b, page, mp = len(p["lens"]), p["page"], p["max_pages"]
    num_pages = b * mp + 1
    table = rng.permutation(num_pages)[:b * mp].reshape(b, mp).astype(np.int32)
    cache = rng.standard_normal((num_pages, page, L + R)).astype(np.float32)
    used = np.zeros(num_pages, bool)
    for i, n in enumerate(p["lens"]):
        used[table[i, :-(-n // page)]] = True
    cache[~used] = np.nan  # pages no request reads are poisoned
    q = rng.standard_normal((b * p["qlen"], p["heads"], L + R)).astype(np.float32)
    return q, cache, table, rng


def attend(q, cache, md, **kw):
    return jax_mla.mla_attention(q, cache, md, scale=0.125, kv_lora_rank=L, return_lse=True,
                                 **kw)


def run_valid(backend, examples):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(problems())
    def case(p):
        q, cache, table, _ = build(p)
        md = jax_mla.build_decode_metadata(table, p["lens"], page_size=p["page"],
                                           qlen=p["qlen"], q=jnp.asarray(q),
                                           kv_cache=jnp.asarray(cache), kv_lora_rank=L,
                                           backend=backend)
        out, lse = attend(jnp.asarray(q), jnp.asarray(cache), md)
        want, want_lse = oracle.mla_decode(q, cache, table, p["lens"], qlen=p["qlen"],
                                           page_size=p["page"], scale=0.125, kv_lora_rank=L)
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
        assert oracle.rel_err(out, want) < 1e-5, p
        fin = np.isfinite(want_lse)
        assert np.array_equal(fin, np.isfinite(lse)) and np.all(out[~fin] == 0), p
        np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5)

    case()


def run_invalid(backend, examples):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(problems().filter(lambda p: p["lens"].max() > 0),
           st.sampled_from(["page_high", "page_negative", "page_huge", "length", "kv_scale"]))
    def case(p, fault):
        q, cache, table, rng = build(p)
        table0, lens = table.copy(), p["lens"].copy()
        b = int(rng.choice(np.flatnonzero(lens > 0)))
        j = int(rng.integers(0, -(-lens[b] // p["page"])))
        kw, pattern = {}, None
        if fault.startswith("page"):
            table[b, j] = {"page_high": cache.shape[0], "page_negative": -1,
                           "page_huge": 2**30}[fault]
            pattern = rf"block_table\[{b}, {j}\] = {table[b, j]}: row {b} reads that page"
        elif fault == "length":
            lens[b] = -1 - int(rng.integers(0, 5))
            pattern = rf"seq_lens\[{b}\] = {lens[b]} must lie in"
        else:
            kw = dict(kv_scale=float(rng.choice([0.0, -1.0, np.nan])))
            pattern = None  # kv_scale on an fp32 cache: refused whatever its value
        qj, cj = jnp.asarray(q), jnp.asarray(cache)

        def step(table, lens):
            md = jax_mla.build_decode_metadata(table, lens, page_size=p["page"],
                                               qlen=p["qlen"], q=qj, kv_cache=cj,
                                               kv_lora_rank=L, backend=backend)
            return attend(qj, cj, md, **kw)

        try:
            step(jnp.asarray(table), jnp.asarray(lens))
        except ValueError as e:
            msg = str(e)
        else:
            raise AssertionError(f"no error for {fault}: {p}")
        if pattern is None:
            assert "kv_scale is the dequantisation multiplier of an fp8 cache" in msg, msg
            return
        import re

        assert re.search(pattern, msg), (pattern, msg)
        err, _ = jax.jit(jax_mla.checked(step))(jnp.asarray(table), jnp.asarray(lens))
        try:
            err.throw()
        except checkify.JaxRuntimeError as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"checked missed {fault}: {p}")
        # Unchecked under jit: no crash, no read out of bounds; requests other than b exact.
        out, _ = jax.jit(step)(jnp.asarray(table), jnp.asarray(lens))
        good = np.ones(len(lens), bool)
        good[b] = False
        rows = np.repeat(good, p["qlen"])
        want, _ = oracle.mla_decode(q, cache, table0, np.clip(lens, 0, None), qlen=p["qlen"],
                                    page_size=p["page"], scale=0.125, kv_lora_rank=L)
        if rows.any():
            assert oracle.rel_err(np.asarray(out, np.float64)[rows], want[rows]) < 1e-5, p

    case()


def main(argv):
    kind, backend, examples = argv[0], argv[1], int(argv[2])
    {"valid": run_valid, "invalid": run_invalid}[kind](backend, examples)
    print("ok", examples)


if __name__ == "__main__":
    main(sys.argv[1:])
