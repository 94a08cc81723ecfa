"""The MLA layer in a jitted model with its cache sharded along pages over a mesh axis (DCP),
heads optionally split over a second axis: equal to the single-device layer over the same tokens,
chosen from the cache's own sharding when the cache carries one, and the compiled step moves no
KV-sized array between devices."""

from __future__ import annotations

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


@functools.partial(jax.jit, static_argnames=("parallel",), donate_argnums=3)
def _layer(params, x, positions, cache, batch, *, parallel):
    return mla_layer(params, CFG, x, positions, cache, batch, parallel=parallel,
                     workspace_tokens=32, decode_backend="xla", prefill_backend="xla")


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
