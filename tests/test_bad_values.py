"""Bad *values* inside arrays (issue 22): an error naming the argument, the rule and the value,
eagerly and under ``jax_mla.checked``; unchecked under jit, one defined result on every backend
and never an out-of-bounds read (docs/design.md, *Bad values*)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_mla

import oracle
from conftest import make_case
from dcp_cases import needs_8_devices

BACKENDS = [b for b in jax_mla.available_backends() if b != "aiter"]
PS = 16


def _case(rng, heads=4):
    c = make_case(rng, seq_lens=[40, 0, 17], qlen=1, num_heads=heads, page_size=PS,
                  kv_lora_rank=64, rope_dim=32)
    return c, jnp.asarray(c.q), jnp.asarray(c.cache)


def _md(c, backend, table=None, q=None, cache=None):
    return jax_mla.build_decode_metadata(
        c.block_table if table is None else table, c.seq_lens, page_size=PS, q=q, kv_cache=cache,
        kv_lora_rank=64, backend=backend)


def _attend(q, cache, md, scale, **kw):
    return jax_mla.mla_attention(q, cache, md, scale=scale, kv_lora_rank=64, return_lse=True,
                                 **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["num_pages", "huge", "negative"])
def test_a_page_outside_the_cache_is_named_eagerly(rng, backend, bad):
    c, q, cache = _case(rng)
    num_pages = cache.shape[0]
    table = np.array(c.block_table)
    value = {"num_pages": num_pages, "huge": 2**30, "negative": -1}[bad]
    table[2, 1] = value  # request 2 (17 tokens at page 16) reads pages 0 and 1
    md = _md(c, backend, table, q, cache)
    with pytest.raises(ValueError, match=rf"block_table\[2, 1\] = {value}: row 2 reads that "
                       rf"page.*\[0, num_pages={num_pages}\)"):
        _attend(q, cache, md, c.scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entries_no_request_reads_may_hold_anything(rng, backend):
    c, q, cache = _case(rng)
    table = np.array(c.block_table)
    table[1, :] = -7  # request 1 is empty
    table[2, 2:] = 2**30  # request 2 reads two pages
    out, lse = _attend(q, cache, _md(c, backend, table, q, cache), c.scale)
    want, want_lse = oracle.mla_decode(c.q, c.cache, c.block_table, c.seq_lens, qlen=1,
                                       page_size=PS, scale=c.scale, kv_lora_rank=64)
    assert oracle.rel_err(np.asarray(out), want) < 1e-5
    assert np.all(np.asarray(out)[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))


def test_unchecked_under_jit_every_backend_clamps_pages_into_the_cache(rng):
    """The unchecked result: a page index outside ``[0, num_pages)`` reads the nearest page, on
    every backend, and nothing reads out of bounds (the Triton kernels clamp as they load)."""
    c, q, cache = _case(rng)
    num_pages = cache.shape[0]
    table = np.array(c.block_table)
    table[0, 0], table[0, 2], table[2, 1] = 2**30, -5, num_pages
    clamped = np.clip(table, 0, num_pages - 1)
    cache_np = np.array(c.cache)
    cache_np[np.isnan(cache_np)] = 0.5  # the clamped reads land on pages no request owned
    cache = jnp.asarray(cache_np)
    want, _ = oracle.mla_decode(c.q, cache_np, clamped, c.seq_lens, qlen=1, page_size=PS,
                                scale=c.scale, kv_lora_rank=64)
    outs = {}
    for backend in BACKENDS:
        md = _md(c, backend, jnp.asarray(table), q, cache)
        step = jax.jit(lambda q, k, m: _attend(q, k, m, c.scale))
        outs[backend] = np.asarray(step(q, cache, md)[0])
        assert np.all(np.isfinite(outs[backend])), backend
        assert oracle.rel_err(outs[backend], want) < 1e-5, backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_checked_reports_bad_pages_and_lengths_under_jit(rng, backend):
    c, q, cache = _case(rng)
    table = np.array(c.block_table)
    table[0, 2] = cache.shape[0] + 3

    def step(q, cache, table, lens):
        md = jax_mla.build_decode_metadata(table, lens, page_size=PS, q=q, kv_cache=cache,
                                           kv_lora_rank=64, backend=backend)
        return _attend(q, cache, md, c.scale)

    run = jax.jit(jax_mla.checked(step))
    err, _ = run(q, cache, jnp.asarray(table), jnp.asarray(c.seq_lens))
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_table\[0, 2\] = "
                       rf"{cache.shape[0] + 3}: row 0 reads that page"):
        err.throw()
    err, _ = run(q, cache, jnp.asarray(c.block_table), jnp.asarray([40, -1, 17], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=r"seq_lens\[1\] = -1 must lie in"):
        err.throw()
    err, out = run(q, cache, jnp.asarray(c.block_table), jnp.asarray(c.seq_lens))
    err.throw()  # a valid step passes
    want, _ = oracle.mla_decode(c.q, c.cache, c.block_table, c.seq_lens, qlen=1, page_size=PS,
                                scale=c.scale, kv_lora_rank=64)
    assert oracle.rel_err(np.asarray(out[0]), want) < 1e-5
    # A step already jitted and traced unchecked is checked all the same.
    jitted = jax.jit(step)
    jitted(q, cache, jnp.asarray(table), jnp.asarray(c.seq_lens))
    err, _ = jax.jit(jax_mla.checked(jitted))(q, cache, jnp.asarray(table),
                                             jnp.asarray(c.seq_lens))
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_table\[0, 2\]"):
        err.throw()
    # Unchecked, the same jitted step raises nothing and reads nothing out of bounds: request 0
    # reads the last page (its clamped index; NaN-poisoned here), the others are exact.
    out, _ = jax.jit(step)(q, cache, jnp.asarray(table), jnp.asarray(c.seq_lens))
    assert oracle.rel_err(np.asarray(out)[1:], want[1:]) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_scale_belongs_to_fp8_caches_on_every_backend(rng, backend):
    c, q, cache = _case(rng)
    md = _md(c, backend, q=q, cache=cache)
    with pytest.raises(ValueError, match="kv_scale is the dequantisation multiplier of an fp8 "
                       "cache; this cache is float32"):
        _attend(q, cache, md, c.scale, kv_scale=2.0)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_scales_must_be_finite_and_positive(rng, value):
    c, q, cache = _case(rng)
    f8 = jnp.float8_e4m3fn
    cache8 = (cache / 0.5).astype(f8)
    md = jax_mla.build_decode_metadata(c.block_table, c.seq_lens, page_size=PS, q=q,
                                       kv_cache=cache8, kv_lora_rank=64, backend="xla")
    with pytest.raises(ValueError, match=r"kv_scale must be finite and > 0, got"):
        _attend(q, cache8, md, c.scale, kv_scale=jnp.float32(value))
    with pytest.raises(ValueError, match=r"scale must be finite and > 0"):
        _attend(q, cache8, md, value, kv_scale=0.5)
    err, _ = jax.jit(jax_mla.checked(lambda s: _attend(q, cache8, md, c.scale, kv_scale=s)))(
        jnp.float32(value))
    with pytest.raises(checkify.JaxRuntimeError, match="kv_scale must be finite and > 0"):
        err.throw()


def test_a_traced_scale_says_it_must_be_a_python_float(rng):
    c, q, cache = _case(rng)
    md = _md(c, "xla", q=q, cache=cache)
    with pytest.raises(TypeError, match="scale must be a Python float.*traced"):
        jax.jit(lambda s: _attend(q, cache, md, s))(0.1)


@pytest.mark.parametrize("dtype,top", [(jnp.float8_e4m3fn, 448.0), (jnp.float8_e4m3fnuz, 240.0)])
def test_fp8_writes_saturate_and_k_scale_must_be_positive(dtype, top):
    cache = jnp.zeros((2, 4, 8), dtype)
    kv_c, k_pe = jnp.full((2, 6), 500.0), jnp.full((2, 2), -1e9)
    out = jax_mla.write_kv_cache(cache, kv_c, k_pe, jnp.array([1, 6]))
    rows = np.asarray(out.astype(jnp.float32)).reshape(8, 8)[[1, 6]]
    np.testing.assert_array_equal(rows, [[top] * 6 + [-top] * 2] * 2)  # not NaN
    half = jax_mla.write_kv_cache(cache, kv_c, k_pe, jnp.array([1, 6]), k_scale=4.0)
    assert np.asarray(half.astype(jnp.float32)).reshape(8, 8)[1, 0] == 128.0  # 500 / 4 -> 128
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
            jax_mla.write_kv_cache(cache, kv_c, k_pe, jnp.array([1, 6]), k_scale=bad)


def test_a_slot_wider_than_int32_is_an_error_not_a_wrap():
    cache = jnp.zeros((2, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 4294967299 does not fit int32"):
        jax_mla.write_kv_cache(cache, jnp.ones((2, 6)), jnp.ones((2, 2)),
                               np.array([0, 2**32 + 3], np.int64))
    out = jax_mla.write_kv_cache(cache, jnp.ones((2, 6)), jnp.ones((2, 2)),
                                 np.array([-1, 8], np.int64))  # negative / past the end: skipped
    assert not np.asarray(out).any()
    out = jax_mla.write_kv_cache(cache, [[1.0] * 6], [[2.0] * 2], [5])  # lists are arrays too
    np.testing.assert_array_equal(np.asarray(out).reshape(8, 8)[5], [1.0] * 6 + [2.0] * 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["no requests", "no pages", "all empty"])
@pytest.mark.parametrize("planned", [True, False])
def test_degenerate_shapes_give_the_empty_result(backend, shape, planned):
    b, pages = {"no requests": (0, 2), "no pages": (2, 0), "all empty": (2, 2)}[shape]
    table, lens = np.zeros((b, pages), np.int32), np.zeros((b,), np.int32)
    q, cache = jnp.ones((2 * b, 4, 96)), jnp.ones((3, PS, 96))
    md = jax_mla.build_decode_metadata(table, lens, page_size=PS, qlen=2, backend=backend,
                                       **(dict(q=q, kv_cache=cache, kv_lora_rank=64)
                                          if planned else {}))
    out, lse = jax.jit(lambda q, c, m: jax_mla.mla_attention(
        q, c, m, scale=0.1, kv_lora_rank=64, return_lse=True, backend=backend))(q, cache, md)
    assert out.shape == (2 * b, 4, 64) and lse.shape == (2 * b, 4)
    assert not np.asarray(out).any() and np.all(np.isneginf(np.asarray(lse)))


@needs_8_devices
def test_dcp_lengths_beyond_the_sharded_capacity_are_named():
    mesh = jax.make_mesh((2,), ("dcp",), devices=jax.devices()[:2])
    tables = jnp.zeros((2, 3, 2), jnp.int32)  # 2 ranks x 2 local pages x page 16: 64 tokens
    kw = dict(mesh=mesh, page_size=PS, num_heads=4, kv_lora_rank=64, rope_dim=32,
              backend="xla")
    jax_mla.build_dcp_metadata(tables, jnp.array([64, 0, 1]), **kw)
    for lens, i, v in (([65, 0, 1], 0, 65), ([3, -2, 1], 1, -2)):
        with pytest.raises(ValueError, match=rf"seq_lens\[{i}\] = {v} must lie in \[0, 64\] "
                           r"\(the world size 2 x max_pages_local 2 x page_size 16"):
            jax_mla.build_dcp_metadata(tables, jnp.array(lens), **kw)


@needs_8_devices
def test_dcp_pages_outside_a_ranks_cache_are_named(rng):
    n = 2
    mesh = jax.make_mesh((n,), ("dcp",), devices=jax.devices()[:n])
    c = make_case(rng, seq_lens=[40, 17], qlen=1, num_heads=4, page_size=PS, kv_lora_rank=64,
                  rope_dim=32)
    kv, tables = jax_mla.dcp_shard_cache(jnp.asarray(c.cache), c.block_table, c.seq_lens,
                                         world_size=n, mesh=mesh)
    q = jnp.asarray(c.q)
    call = lambda t: jax_mla.dcp_mla_attention(q, kv, t, mesh=mesh, seq_lens=c.seq_lens,
                                               scale=c.scale, kv_lora_rank=64, backend="xla")
    want, _ = oracle.mla_decode(c.q, c.cache, c.block_table, c.seq_lens, qlen=1, page_size=PS,
                                scale=c.scale, kv_lora_rank=64)
    assert oracle.rel_err(np.asarray(call(tables)), want) < 1e-5
    local_pages = kv.shape[0] // n
    bad = np.array(tables)
    bad[1, 0, 0] = local_pages  # rank 1's first page of request 0, one past its local cache
    with pytest.raises(ValueError, match=rf"block_tables\[1\]\[0, 0\] = {local_pages}: row 0 of "
                       rf"rank 1 reads that page.*num_pages={local_pages}\) of its rank's"):
        call(jnp.asarray(bad))


def test_prefill_context_lengths_and_pages_are_checked(rng):
    from jax_mla import mla_prefill_with_context

    t, h, lrank, rope, nope, dv = 4, 2, 16, 8, 8, 8
    cache = jnp.asarray(rng.standard_normal((4, PS, lrank + rope)), jnp.float32)
    args = lambda table, ctx: (
        jnp.ones((t, h, nope + rope)), jnp.ones((t, lrank)), jnp.ones((t, rope)), cache,
        jnp.asarray(table, jnp.int32), jnp.asarray(ctx, jnp.int32), jnp.array([0, 2, 4]),
        jnp.ones((lrank, h, nope + dv)) * 0.1)
    ok = mla_prefill_with_context(*args([[0, 1], [2, 3]], [20, 0]), scale=0.3,
                                  workspace_tokens=16)
    assert np.all(np.isfinite(np.asarray(ok)))
    with pytest.raises(ValueError, match=r"context_lens\[0\] = 33 must lie in \[0, 32\]"):
        mla_prefill_with_context(*args([[0, 1], [2, 3]], [33, 0]), scale=0.3,
                                 workspace_tokens=16)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = -1 must lie"):
        mla_prefill_with_context(*args([[0, 1], [2, 3]], [3, -1]), scale=0.3,
                                 workspace_tokens=16)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9: row 0 reads that page"):
        mla_prefill_with_context(*args([[0, 9], [2, 3]], [20, 0]), scale=0.3,
                                 workspace_tokens=16)


def test_checked_cu_seqlens_under_jit():
    q = jnp.ones((6, 2, 16))

    def f(cu):
        return jax_mla.mla_prefill(q, q, q, cu, scale=0.3, causal=True)

    run = jax.jit(jax_mla.checked(f))
    run(jnp.array([0, 2, 6]))[0].throw()
    for cu in ([1, 2, 6], [0, 4, 2], [0, 2, 7]):
        with pytest.raises(checkify.JaxRuntimeError, match="cu_seqlens must start at 0, be "
                           "non-decreasing and end at most at 6"):
            run(jnp.array(cu))[0].throw()


def test_prefill_scales_are_checked_like_decode(rng):
    from jax_mla import mla_prefill_with_context

    q = jnp.ones((6, 2, 16))
    for bad in (float("nan"), 0.0, -1.0):
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            jax_mla.mla_prefill(q, q, q, jnp.array([0, 2, 6]), scale=bad)
    cache = jnp.ones((4, PS, 24))
    args = (jnp.ones((4, 2, 16)), jnp.ones((4, 16)), jnp.ones((4, 8)), cache,
            jnp.zeros((2, 2), jnp.int32), jnp.array([3, 0]), jnp.array([0, 2, 4]),
            jnp.ones((16, 2, 16)))
    with pytest.raises(ValueError, match="k_scale is the dequantisation multiplier of an fp8 "
                       "cache; this cache is float32"):
        mla_prefill_with_context(*args, scale=0.3, workspace_tokens=8, k_scale=2.0)
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        mla_prefill_with_context(*args[:3], cache.astype(jnp.float8_e4m3fn), *args[4:],
                                 scale=0.3, workspace_tokens=8, k_scale=0.0)
