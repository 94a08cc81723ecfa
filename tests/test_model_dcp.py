"""The MLA layer in a jitted model with its cache sharded along pages over a mesh axis (DCP),
heads optionally split over a second axis: equal to the single-device layer over the same tokens,
chosen from the cache's own sharding when the cache carries one, and the compiled step moves no
KV-sized array between devices."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla.model import AttentionBatch, MLAConfig, Parallel, init_params, mla_layer
from jax_mla.model.layer import parallel_from_cache
from jax_mla.serving import PagedCacheManager

from dcp_cases import collectives, needs_8_devices

pytestmark = needs_8_devices

CFG = MLAConfig(hidden_size=48, num_heads=8, kv_lora_rank=32, q_lora_rank=16,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
PAGE, POOL, MAX_PAGES = 4, 24, 8
TOL = 1e-5


def _mesh(n, tp):
    return jax.make_mesh((n, tp), ("dcp", "tp")) if tp > 1 else jax.make_mesh((n,), ("dcp",))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Side:
    """One cache (single device or DCP) with its manager, stepping the same requests."""

    def __init__(self, par: Parallel | None, interleave=1, pool=POOL):
        n = 1 if par is None else par.mesh.shape[par.dcp_axis]
        self.par, self.n = par, n
        self.mgr = PagedCacheManager(num_pages=pool, page_size=PAGE, max_seqs=4,
                                     max_pages_per_seq=MAX_PAGES, world_size=n,
                                     interleave=interleave)
        cache = jnp.full((n * pool, PAGE, CFG.kv_lora_rank + CFG.qk_rope_head_dim), jnp.nan,
                         jnp.float32)
        self.cache = cache if par is None else jax.device_put(cache, par.shardings.kv_cache)

    def batch(self, ids, counts, *, decode_qlen):
        cap = sum(counts)
        if self.par is None:
            md = None
            if decode_qlen:
                md = jax_mla.build_decode_metadata(
                    self.mgr.block_tables(ids, rows=len(ids)),
                    self.mgr.seq_lens(ids, rows=len(ids)), page_size=PAGE, qlen=decode_qlen)
            slots = self.mgr.slot_mapping(ids, None, counts, capacity=cap)
            pre = {} if decode_qlen else dict(
                prefill_block_table=self.mgr.block_tables(ids, rows=len(ids)),
                prefill_context_lens=np.zeros(len(ids), np.int32),
                prefill_cu_seqlens=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
            return AttentionBatch(slot_mapping=slots, decode=md, **pre)
        p = self.par
        tables = self.mgr.block_tables(ids, rows=len(ids))
        tables = tables[None] if tables.ndim == 2 else tables  # a DCP axis of size 1
        pos, req = self.mgr.token_positions(ids, None, counts, capacity=cap)
        md = None
        if decode_qlen:
            md = jax_mla.build_dcp_metadata(
                tables, self.mgr.seq_lens(ids, rows=len(ids)), mesh=p.mesh, page_size=PAGE,
                num_heads=CFG.num_heads, qlen=decode_qlen, interleave=p.interleave,
                head_axis=p.head_axis, q_dtype=jnp.float32, kv_lora_rank=CFG.kv_lora_rank,
                rope_dim=CFG.qk_rope_head_dim, backend="xla")
        pre = {} if decode_qlen else dict(
            prefill_cu_seqlens=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        return AttentionBatch(slot_mapping=None, decode=md, positions=pos, request_ids=req,
                              block_tables=tables, **pre)


    def mixed_batch(self, dec_ids, qlen, pre_ids, pre_counts, pre_ctx, *, pad_rows=0):
        """A step of decode/verify rows (``qlen`` each) of ``dec_ids``, then prefill chunks
        ``pre_counts`` of ``pre_ids`` over ``pre_ctx`` cached tokens, then a padding prefill
        request (no tokens, a context that must be ignored) and ``pad_rows`` padding rows.
        Returns ``(batch, positions)``."""
        ids = dec_ids + pre_ids
        counts = [qlen] * len(dec_ids) + list(pre_counts)
        cap = sum(counts) + pad_rows
        cu = np.concatenate([[0], np.cumsum(pre_counts), [sum(pre_counts)]]).astype(np.int32)
        ctx = np.array(list(pre_ctx) + [3], np.int32)
        pos, req = self.mgr.token_positions(ids, None, counts, capacity=cap)
        pre = dict(prefill_context_lens=ctx, prefill_cu_seqlens=cu)
        bd, rows = len(dec_ids), len(pre_ids) + 1
        if self.par is None:
            md = jax_mla.build_decode_metadata(
                self.mgr.block_tables(dec_ids, rows=bd), self.mgr.seq_lens(dec_ids, rows=bd),
                page_size=PAGE, qlen=qlen) if bd else None
            return AttentionBatch(
                slot_mapping=self.mgr.slot_mapping(ids, None, counts, capacity=cap), decode=md,
                prefill_block_table=self.mgr.block_tables(pre_ids, rows=rows), **pre), pos
        p = self.par
        md = jax_mla.build_dcp_metadata(
            self.mgr.block_tables(dec_ids, rows=bd), self.mgr.seq_lens(dec_ids, rows=bd),
            mesh=p.mesh, page_size=PAGE, num_heads=CFG.num_heads, qlen=qlen,
            interleave=p.interleave, head_axis=p.head_axis, q_dtype=jnp.float32,
            kv_lora_rank=CFG.kv_lora_rank, rope_dim=CFG.qk_rope_head_dim,
            backend="xla") if bd else None
        return AttentionBatch(slot_mapping=None, decode=md, positions=pos, request_ids=req,
                              block_tables=self.mgr.block_tables(ids, rows=len(ids)),
                              **pre), pos


@functools.partial(jax.jit, static_argnames=("parallel", "workspace"), donate_argnums=3)
def _layer(params, x, positions, cache, batch, *, parallel, workspace=32):
    return mla_layer(params, CFG, x, positions, cache, batch, parallel=parallel,
                     workspace_tokens=workspace, decode_backend="xla", prefill_backend="xla")


def _run_both(rng, par, *, steps=(("prefill", 1), ("decode", 1), ("decode", 1), ("verify", 2))):
    params = init_params(CFG, jax.random.key(int(rng.integers(1 << 30))), jnp.float32, std=0.2)
    one, dcp = Side(None), Side(par, par.interleave)
    prompts = [5, 11, 2]
    ids = [0, 1, 2]
    errs = []
    for kind, q in steps:
        counts = prompts if kind == "prefill" else [q] * len(ids)
        for side in (one, dcp):
            for i, c in zip(ids, counts):
                (side.mgr.add if kind == "prefill" else side.mgr.append)(i, c)
        pos = np.concatenate([one.mgr.seq_len(i) - c + np.arange(c) for i, c in
                              zip(ids, counts)]).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((sum(counts), CFG.hidden_size)), jnp.float32)
        qlen = 0 if kind == "prefill" else q
        b1 = one.batch(ids, counts, decode_qlen=qlen)
        b2 = dcp.batch(ids, counts, decode_qlen=qlen)
        y1, one.cache = _layer(params, x, pos, one.cache, b1, parallel=None)
        y2, dcp.cache = _layer(params, x, pos, dcp.cache, b2, parallel=par)
        assert dcp.cache.sharding.is_equivalent_to(par.shardings.kv_cache, 3)
        errs.append(_rel(y2, y1))
    return errs, params, dcp


@pytest.mark.parametrize("n,tp,interleave", [(4, 1, 1), (2, 2, 2), (4, 2, 1), (1, 4, 1)])
def test_dcp_layer_equals_single_device(rng, n, tp, interleave):
    """DCP, DCP x head parallel, and head parallel alone (a DCP axis of size 1: the cache
    replicated, each device its heads)."""
    mesh = _mesh(n, tp)
    par = Parallel(mesh=mesh, head_axis="tp" if tp > 1 else None, interleave=interleave)
    errs, _, _ = _run_both(rng, par)
    assert max(errs) < TOL, errs


def test_parallel_chosen_from_the_cache_sharding(rng):
    mesh = _mesh(4, 1)
    par = Parallel(mesh=mesh)
    cache = jax.device_put(jnp.zeros((4 * POOL, PAGE, 40), jnp.float32), par.shardings.kv_cache)
    assert parallel_from_cache(cache) == par
    assert parallel_from_cache(jnp.zeros((POOL, PAGE, 40))) is None
    # An eager layer call on a sharded cache runs DCP without being told.
    errs, params, dcp = _run_both(rng, par, steps=(("prefill", 1),))
    ids, counts = [0, 1, 2], [1, 1, 1]
    for i in ids:
        dcp.mgr.append(i, 1)
    pos = np.array([dcp.mgr.seq_len(i) - 1 for i in ids], np.int32)
    x = jnp.asarray(rng.standard_normal((3, CFG.hidden_size)), jnp.float32)
    batch = dcp.batch(ids, counts, decode_qlen=1)
    y_auto, _ = mla_layer(params, CFG, x, pos, dcp.cache.copy(), batch, decode_backend="xla")
    y_par, _ = mla_layer(params, CFG, x, pos, dcp.cache.copy(), batch, decode_backend="xla",
                         parallel=par)
    np.testing.assert_array_equal(np.asarray(y_auto), np.asarray(y_par))
    # Under jax.jit too: a traced cache on an explicit-axes mesh carries its sharding.
    step = jax.jit(lambda p, x, pos, c, b: mla_layer(p, CFG, x, pos, c, b, decode_backend="xla"))
    y_jit, c_jit = step(params, x, pos, dcp.cache.copy(), batch)
    assert _rel(y_jit, y_par) < TOL  # one jitted program fuses differently from eager calls
    assert c_jit.sharding.is_equivalent_to(par.shardings.kv_cache, 3)
    hlo = step.lower(params, x, pos, dcp.cache, batch).compile().as_text()
    assert max(size for _, _, size in collectives(hlo)) < dcp.cache.size // 4  # < one shard
    with pytest.raises(ValueError, match="AttentionBatch.positions"):
        mla_layer(params, CFG, x, pos, dcp.cache, AttentionBatch(slot_mapping=None),
                  parallel=par)
    with pytest.raises(ValueError, match="AttentionBatch.slot_mapping is required"):
        mla_layer(params, CFG, x, pos, jnp.zeros((POOL, PAGE, 40)), batch, parallel=None)


def test_dcp_layer_moves_no_kv_sized_array(rng):
    """Compiled decode step: every collective is far smaller than one device's cache shard."""
    n, tp = 4, 2
    mesh = _mesh(n, tp)
    par = Parallel(mesh=mesh, head_axis="tp")
    params = init_params(CFG, jax.random.key(0), jnp.float32)
    side = Side(par, pool=256)  # a cache that dwarfs every legitimate collective operand
    ids = [0, 1, 2]
    for i, c in zip(ids, [13, 30, 7]):
        side.mgr.add(i, c)
    for i in ids:
        side.mgr.append(i, 1)
    batch = side.batch(ids, [1, 1, 1], decode_qlen=1)
    x = jnp.zeros((3, CFG.hidden_size), jnp.float32)
    pos = np.zeros(3, np.int32)
    hlo = _layer.lower(params, x, pos, side.cache, batch, parallel=par).compile().as_text()
    found = collectives(hlo)
    assert found, "the DCP step has collectives (the query gather, the LSE merge)"
    shard = 256 * PAGE * (CFG.kv_lora_rank + CFG.qk_rope_head_dim)
    assert max(size for _, _, size in found) * 8 < shard, (found, shard)


# A chunked prefill over cached context next to decode/verify rows: (decode ids, qlen), then
# (prefill ids, new tokens, cached context). Request 3 arrives in step 1 with no context; step 2
# runs a workspace small enough that every rank folds its context in several chunks.
CHUNKED_STEPS = (
    (([], 0), ([0, 1, 2], [5, 11, 2], [0, 0, 0])),
    (([0], 1), ([1, 2, 3], [7, 9, 6], [11, 2, 0])),
    (([0, 3], 2), ([1, 2], [5, 3], [18, 11])),
)


def _run_chunked(rng, par, *, workspace=(32, 32, 5)):
    params = init_params(CFG, jax.random.key(int(rng.integers(1 << 30))), jnp.float32, std=0.2)
    one, dcp = Side(None), Side(par, par.interleave)
    errs = []
    for ((dec, qlen), (pre, counts, ctx)), ws in zip(CHUNKED_STEPS, workspace):
        for side in (one, dcp):
            for i in dec:
                side.mgr.append(i, qlen)
            for i, c, k in zip(pre, counts, ctx):
                (side.mgr.append if k else side.mgr.add)(i, c)
                assert side.mgr.seq_len(i) == k + c
        b1, pos = one.mixed_batch(dec, qlen, pre, counts, ctx, pad_rows=2)
        b2, _ = dcp.mixed_batch(dec, qlen, pre, counts, ctx, pad_rows=2)
        x = jnp.asarray(rng.standard_normal((pos.shape[0], CFG.hidden_size)), jnp.float32)
        y1, one.cache = _layer(params, x, pos, one.cache, b1, parallel=None, workspace=ws)
        y2, dcp.cache = _layer(params, x, pos, dcp.cache, b2, parallel=par, workspace=ws)
        errs.append(_rel(y2, y1))
    return errs, params, dcp


@pytest.mark.parametrize("n,tp,interleave,combine", [
    (2, 1, 1, "ag_rs"), (4, 1, 2, "a2a"), (4, 2, 2, "ag_rs"), (2, 4, 1, "a2a")])
def test_chunked_prefill_over_sharded_context_equals_single_device(rng, n, tp, interleave,
                                                                   combine):
    """Prompt chunks over cached context (ragged, some 0, one request's context folded in
    several workspace chunks per rank) mixed with decode and verify rows, on a NaN-poisoned
    cache: each rank attends its own shard of the context, the partials merge by LSE."""
    mesh = _mesh(n, tp)
    par = Parallel(mesh=mesh, head_axis="tp" if tp > 1 else None, interleave=interleave,
                   combine=combine)
    errs, _, dcp = _run_chunked(rng, par)
    assert max(errs) < TOL, errs
    assert dcp.cache.sharding.is_equivalent_to(par.shardings.kv_cache, 3)


def test_chunked_prefill_moves_no_kv_sized_array(rng):
    """The compiled mixed step (decode rows + prefill chunks over cached context): only the
    query gather of the decode rows and the LSE combines of both travel; every collective is
    far below one device's cache shard, and the prefill combine is the [T_p, H*N, V] partials."""
    n, tp = 4, 2
    par = Parallel(mesh=_mesh(n, tp), head_axis="tp", interleave=2)
    params = init_params(CFG, jax.random.key(0), jnp.float32)
    side = Side(par, par.interleave, pool=256)  # a cache that dwarfs every legitimate operand
    for i, c in zip([0, 1, 2], [13, 30, 7]):
        side.mgr.add(i, c)
    side.mgr.append(0, 1)
    for i, c in zip([1, 2], [8, 5]):
        side.mgr.append(i, c)
    batch, pos = side.mixed_batch([0], 1, [1, 2], [8, 5], [30, 7])
    x = jnp.zeros((pos.shape[0], CFG.hidden_size), jnp.float32)
    hlo = _layer.lower(params, x, pos, side.cache, batch, parallel=par).compile().as_text()
    found = collectives(hlo)
    shard = 256 * PAGE * (CFG.kv_lora_rank + CFG.qk_rope_head_dim)
    assert max(size for _, _, size in found) * 8 < shard, (found, shard)
    # The prefill combine is there: the LSEs [N, T_p, H*N] gathered, the [T_p, H*N, V] partials
    # reduce-scattered to [T_p, H, V] (the parse really sees the collectives).
    t_p, h_group = 13, CFG.num_heads // tp
    assert ("all-gather", "f32", n * t_p * h_group) in found, found
    assert ("reduce-scatter", "f32", t_p * (h_group // n) * CFG.v_head_dim) in found, found
    # Besides: the queries' gathers, and head parallel's o_proj sum [T, hidden].
    for op, _, size in found:
        assert op in ("all-gather", "reduce-scatter") or (
            op == "all-reduce" and size == pos.shape[0] * CFG.hidden_size), found


def test_chunked_prefill_errors_stay_clear(rng):
    par = Parallel(mesh=_mesh(2, 1))
    params = init_params(CFG, jax.random.key(0), jnp.float32)
    side = Side(par)
    side.mgr.add(0, 5)
    side.mgr.append(0, 3)
    batch, pos = side.mixed_batch([], 0, [0], [3], [5])
    x = jnp.zeros((pos.shape[0], CFG.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="workspace_tokens is required"):
        mla_layer(params, CFG, x, pos, side.cache, batch, parallel=par, prefill_backend="xla")
    with pytest.raises(ValueError, match="leave AttentionBatch.prefill_block_table None"):
        mla_layer(params, CFG, x, pos, side.cache,
                  dataclasses.replace(batch, prefill_block_table=batch.block_tables[0]),
                  parallel=par, workspace_tokens=8)
    with pytest.raises(NotImplementedError, match="prefill_fp8"):
        mla_layer(params, CFG, x, pos, side.cache, batch, parallel=par, workspace_tokens=8,
                  prefill_fp8=True)
    with pytest.raises(ValueError, match=r"context_lens\[0\] = 99 must lie in \[0, 64\]"):
        jax_mla.dcp_prefill_with_context(
            jnp.zeros((3, 8, 24)), jnp.zeros((3, 32)), jnp.zeros((3, 8)), side.cache,
            batch.block_tables[:, :1], np.array([99], np.int32), np.array([0, 3], np.int32),
            params["kv_b_proj"]["w"], mesh=par.mesh, scale=0.1, workspace_tokens=8)


@pytest.mark.parametrize("combine,dtype", [("ag_rs", "float32"), ("a2a", "float8_e4m3fn")])
def test_dcp_prefill_with_context_entry(rng, combine, dtype):
    """The entry alone: out and LSE equal ``mla_prefill_with_context`` on one device, with
    ragged contexts (one empty, one shorter than a rank turn), a request with no new tokens,
    block-table rows picked by ``rows=``, NaN in every unused slot, and an fp8 cache
    dequantised with its scale."""
    n, i, ps, h, lr, r, p_dim, v_dim = 4, 2, 4, 8, 32, 8, 16, 16
    ctx = np.array([0, 13, 3, 30], np.int32)
    new = np.array([3, 4, 0, 6])
    pages = -(-ctx // ps)
    cache = jnp.asarray(rng.standard_normal((int(pages.sum()) + 1, ps, lr + r)), dtype)
    k_scale = None if dtype == "float32" else jnp.float32(0.5)
    table = np.zeros((4, pages.max()), np.int32)
    for b, start in enumerate(np.cumsum(pages) - pages):
        table[b, :pages[b]] = start + np.arange(pages[b])
    mesh = _mesh(n, 1)
    kv, tables = jax_mla.dcp_shard_cache(cache, table, ctx, world_size=n, interleave=i,
                                         fill_value=np.nan, mesh=mesh)
    t = int(new.sum())
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((t, h, p_dim + r)).astype(np.float32)
    kv_c = rng.standard_normal((t, lr)).astype(np.float32)
    k_pe = rng.standard_normal((t, r)).astype(np.float32)
    w = (0.3 * rng.standard_normal((lr, h, p_dim + v_dim))).astype(np.float32)
    want, want_lse = jax_mla.mla_prefill_with_context(
        q, kv_c, k_pe, cache, table, ctx, cu, w, scale=0.2, workspace_tokens=8,
        k_scale=k_scale, return_lse=True, backend="xla")
    order = np.array([2, 0, 3, 1])  # the tables' rows shuffled, found again through rows=
    got, lse = jax_mla.dcp_prefill_with_context(
        q, kv_c, k_pe, kv, tables[:, order], ctx, cu, w, mesh=mesh, scale=0.2,
        workspace_tokens=8, rows=np.argsort(order).astype(np.int32), interleave=i,
        combine=combine, k_scale=k_scale, return_lse=True, backend="xla")
    assert got.sharding.is_equivalent_to(jax_mla.dcp_shardings(mesh).out, 3)
    assert _rel(got, want) < TOL and _rel(lse, want_lse) < TOL
