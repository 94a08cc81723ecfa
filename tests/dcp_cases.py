"""Shared pieces of the DCP tests: device checks, sharded cases, an opaque callback backend."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla.backends import Backend, DecodePlan, register_backend, unregister_backend

from oracle import mla_decode

NEED_DEVICES = 8
needs_8_devices = pytest.mark.skipif(
    len(jax.devices()) < NEED_DEVICES,
    reason=(
        f"DCP mesh tests need {NEED_DEVICES} devices, found {len(jax.devices())}: export "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={NEED_DEVICES} before jax starts "
        f"(.ci/run does)"
    ),
)


def permute_rank_pages(kv, tables, rng):
    """Shuffle every rank's physical pages (and its block table to match): tables are not arange.

    ``kv [N * P_local, ps, D]``, ``tables [N, B, max_pages_local]`` (numpy or jax, unsharded).
    """
    kv = np.array(kv)
    tables = np.array(tables)
    n = tables.shape[0]
    p_local = kv.shape[0] // n
    for r in range(n):
        perm = rng.permutation(p_local)
        shard = kv[r * p_local:(r + 1) * p_local].copy()
        kv[r * p_local + perm] = shard
        tables[r] = perm[tables[r]]
    return kv, tables


def shard_case(case, mesh, *, interleave, head_axis=None, rng=None, dtype=jnp.float32):
    """Device-placed ``(q, kv_cache, block_tables, seq_lens)`` of a ``make_case`` case."""
    n = mesh.shape["dcp"]
    kv, tables = jax_mla.dcp_shard_cache(
        jnp.asarray(case.cache, dtype), case.block_table, case.seq_lens, world_size=n,
        interleave=interleave, fill_value=np.nan)
    if rng is not None:
        kv, tables = permute_rank_pages(kv, tables, rng)
    assert np.isnan(np.asarray(kv, np.float32)).any(), "unused cache slots must be NaN-poisoned"
    sh = jax_mla.dcp_shardings(mesh, head_axis=head_axis)
    return (jax.device_put(jnp.asarray(case.q, dtype), sh.q),
            jax.device_put(jnp.asarray(kv, dtype), sh.kv_cache),
            jax.device_put(jnp.asarray(tables), sh.block_tables),
            jax.device_put(jnp.asarray(case.seq_lens), sh.seq_lens))


def assert_covers_the_edge_cases(case, n, interleave):
    """The case has an empty shard, and (verify) a block whose rows straddle a shard boundary.

    Guards the test data itself: a later edit of the lengths must not quietly drop either.
    """
    rows = np.asarray(jax_mla.dcp_verify_row_lens(case.seq_lens, case.qlen, n, None,
                                                  interleave)).reshape(len(case.seq_lens),
                                                                       case.qlen, n)
    if n > 1:
        full = rows[:, -1]  # [B, N] each request's local lengths
        assert (full == 0).any(), "no request leaves a rank empty"
    if n > 1 and case.qlen > 1:
        # Rows of one block gain their newest token on different ranks.
        grows_on = (np.diff(rows, axis=1) > 0).any(axis=1)  # [B, N]
        assert (grows_on.sum(-1) > 1).any(), "no verify block straddles a shard boundary"


def oracle(case):
    return mla_decode(case.q, case.cache, case.block_table, case.seq_lens, qlen=case.qlen,
                      page_size=case.page_size, scale=case.scale, kv_lora_rank=case.kv_lora_rank)


def lse_rel_err(got, want):
    """Relative error over finite rows; the ``-inf`` (empty) pattern must match exactly."""
    got = np.asarray(got, np.float64)
    fin = np.isfinite(want)
    assert np.array_equal(np.isneginf(got), ~fin), "empty-row (-inf) pattern differs"
    if not fin.any():
        return 0.0
    return float(np.linalg.norm(got[fin] - want[fin]) / np.linalg.norm(want[fin]))


# ------------------------------------------------------------------------------------------------
# Compiled-HLO inspection
# ------------------------------------------------------------------------------------------------

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\(?[^=]*?\)?)\s+(?P<op>all-gather|all-to-all|reduce-scatter|all-reduce|"
    r"collective-permute|collective-broadcast)(?:-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


def collectives(hlo_text):
    """``[(op, dtype, element_count)]`` for every collective's result array in compiled HLO."""
    found = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        for dt, dims in _ARRAY.findall(m.group("shape")):
            size = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
            found.append((m.group("op"), dt, size))
    return found


# ------------------------------------------------------------------------------------------------
# An opaque local kernel: a host callback (stands in for a custom call, e.g. AITER through FFI)
# ------------------------------------------------------------------------------------------------


class CallbackBackend(Backend):
    """Decodes on the host with the float64 oracle through ``jax.pure_callback``.

    Opaque to XLA like a real custom call, pads heads to 16 like AITER, and writes garbage
    (NaN out, ``+inf`` lse) into rows that see nothing, as some kernels do. A whole backend in
    a few lines: the contract's defaults cover the rest.
    """

    name = "dcp_test_callback"

    def plan(self, problem, *, tuning=None, **options):
        return DecodePlan(self.name, problem, -(-problem.num_heads // 16) * 16)

    def decode(self, q, kv_cache, metadata, *, plan, scale, q_scale, kv_scale, return_lse):
        t, h, _ = q.shape
        md = metadata
        lr = plan.problem.kv_lora_rank

        def host(q, kv, table, lens):
            out, lse = mla_decode(q, kv, table, lens, qlen=md.qlen, page_size=md.page_size,
                                  scale=scale, kv_lora_rank=lr)
            empty = np.isneginf(lse)
            out[empty] = np.nan
            lse[empty] = np.inf
            return out.astype(np.float32), lse.astype(np.float32)

        shapes = (jax.ShapeDtypeStruct((t, h, lr), jnp.float32),
                  jax.ShapeDtypeStruct((t, h), jnp.float32))
        return jax.pure_callback(host, shapes, q.astype(jnp.float32),
                                 kv_cache.astype(jnp.float32), md.block_table, md.seq_lens)


@pytest.fixture
def callback_backend():
    """Register :class:`CallbackBackend` for one test, then remove it again."""
    b = CallbackBackend()
    register_backend(b)
    try:
        yield b.name
    finally:
        unregister_backend(b.name)
