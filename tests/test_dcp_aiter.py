"""DCP with ``backend="aiter"`` as the local kernel, on an 8-device CPU mesh, against the stand-in.

Each rank's local call runs every query row as its own ``qlen = 1`` request over its shard of
the cache and must return an LSE, so the AITER route there is vLLM's DCP decode: the asm
``mla_decode_fwd`` with ``return_lse=True`` (persistent plan), for the ``H * N`` gathered heads.
The schedule is planned inside the attention call, for the arch ``detect_arch`` reports; off
ROCm that is None, so these tests make it report the stand-in's arch. Nothing here has run on
AMD hardware: this checks the DCP plumbing around the bridge, not AITER.

Needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax starts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla.backends.aiter import build_aiter_decode_metadata
from jax_mla.backends.aiter import capabilities as caps

from aiter_standin.harness import forced_standins
from conftest import make_case
from dcp_cases import (
    assert_covers_the_edge_cases,
    collectives,
    lse_rel_err,
    needs_8_devices,
    oracle,
    shard_case,
)
from oracle import rel_err

pytestmark = needs_8_devices

H = 16  # query heads per device: AITER's head rules apply to the gathered H * N (32, 64)
PS = 16  # page size (a multiple of every interleave used)
OUT_TOL = 5e-3  # bf16 output, partials and result rounded to bf16 (measured ~1.5e-3)
LSE_TOL = 1e-5  # the LSE is float32 end to end


@pytest.fixture
def aiter_dcp(monkeypatch):
    """The stand-in as ``aiter``, the bridge forced on, and ``detect_arch`` reporting its arch.

    ``dcp_mla_attention`` builds plain metadata on each rank, so ``AiterBackend.decode`` plans
    the schedule in the call for ``detect_arch()``: None off ROCm.
    """

    def report_arch(mod):
        monkeypatch.setattr(caps, "detect_arch", lambda device=None: mod.get_gfx())

    with forced_standins(on_enter=report_arch) as enter:
        yield enter


def _bf16_case(rng, *, lens, qlen, heads):
    """A DeepSeek-width case whose values are exactly bf16, so the float64 oracle is exact."""
    c = make_case(rng, seq_lens=lens, qlen=qlen, num_heads=heads, page_size=PS)
    c.q = np.asarray(jnp.asarray(c.q, jnp.bfloat16), np.float32)
    c.cache = np.asarray(jnp.asarray(c.cache, jnp.bfloat16), np.float32)  # NaN stays NaN
    return c


def _lens(n, i, qlen):
    """As test_dcp_mesh: empty shards, rows that see nothing, straddling verify blocks."""
    return [1, 2, max(qlen - 1, 0), i + 1, i * n + 1, 2 * i * n - 1, 70]


def _single_device_aiter(case):
    """Single-device ``backend="aiter"`` over the whole context (the non-DCP route), one jit
    (the planner op by op would dispatch hundreds of small programs)."""

    @jax.jit
    def run(q, cache, table, lens):
        md = build_aiter_decode_metadata(table, lens, page_size=PS, num_heads=q.shape[1],
                                         qlen=case.qlen, arch="gfx950", num_cu=8,
                                         mtp_decode_qlen=case.qlen, return_lse=True)
        return jax_mla.mla_attention(q, cache, md, scale=case.scale, backend="aiter",
                                     return_lse=True)

    return run(jnp.asarray(case.q, jnp.bfloat16), jnp.asarray(case.cache, jnp.bfloat16),
               jnp.asarray(case.block_table), jnp.asarray(case.seq_lens))


@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("n", [2, 4])
def test_dcp_aiter_matches_single_device(rng, aiter_dcp, n, interleave):
    """Decode (Q=1) and verify (Q=2), both combines, compiled as one program (XLA's compile,
    not the run, is what this costs on CPU)."""
    aiter = aiter_dcp("gfx950")
    mesh = jax.make_mesh((n,), ("dcp",))
    lens = _lens(n, interleave, 2)
    cases = {q: _bf16_case(rng, lens=lens, qlen=q, heads=H * n) for q in (1, 2)}
    assert_covers_the_edge_cases(cases[1], n, interleave)  # empty shards
    # A Q=2 block straddles a shard boundary: its two new tokens live on different ranks.
    # (The shared guard's row-growth test needs Q >= 3 to see this.)
    owner = lambda p: (p // interleave) % n  # noqa: E731
    assert any(owner(s - 2) != owner(s - 1) for s in lens if s >= 2)
    args = {q: shard_case(c, mesh, interleave=interleave, rng=rng, dtype=jnp.bfloat16)
            for q, c in cases.items()}

    @jax.jit
    def all_variants(args):
        return {(q, comb): jax_mla.dcp_mla_attention(
            *args[q], mesh=mesh, scale=cases[q].scale, qlen=q, interleave=interleave,
            combine=comb, backend="aiter", return_lse=True)
            for q in cases for comb in jax_mla.dcp.COMBINES}

    aiter.reset_calls()
    res = jax.block_until_ready(all_variants(args))
    for (q, comb), (out, lse) in res.items():
        c = cases[q]
        assert out.shape == (len(c.seq_lens) * q, H * n, 512) and out.dtype == jnp.bfloat16
        assert lse.shape == out.shape[:2] and lse.dtype == jnp.float32
        want_o, want_l = oracle(c)
        eo = rel_err(np.asarray(out, np.float32), want_o)
        el = lse_rel_err(lse, want_l)
        print(f"aiter N={n} I={interleave} Q={q} {comb}: rel err out {eo:.2e} lse {el:.2e}")
        assert eo < OUT_TOL and el < LSE_TOL, (q, comb, eo, el)

    # Every local call was vLLM's DCP decode: asm, persistent plan, LSE, one query per row,
    # for the gathered heads; one call per rank per Q (XLA shares the local call of the two
    # combines: same inputs, same pure custom call).
    calls = aiter.calls("mla_decode_fwd")
    assert n * len(cases) <= len(calls) <= n * len(res) and len(calls) % n == 0, len(calls)
    for call in calls:
        assert call["heads"] == H * n and call["return_lse"] and call["plan_passed"]
        assert call["max_seqlen_q"] == 1
    assert not aiter.calls("mla_gluon") and not aiter.calls("segmented_mla_decode_fwd")

    # Same answer as the library's single-device AITER path over the whole context (not only
    # the float64 oracle); verify, the harder case.
    ref_o, ref_l = _single_device_aiter(cases[2])
    for comb in jax_mla.dcp.COMBINES:
        out, lse = res[2, comb]
        assert rel_err(np.asarray(out, np.float32), np.asarray(ref_o, np.float32)) < OUT_TOL
        assert lse_rel_err(lse, np.asarray(ref_l)) < LSE_TOL


@pytest.mark.parametrize("combine", jax_mla.dcp.COMBINES)
def test_dcp_aiter_compiled_program_never_gathers_the_kv_cache(rng, aiter_dcp, combine):
    aiter_dcp("gfx950")
    n, tp = 2, 2
    case = make_case(rng, seq_lens=[9, 33, 5], qlen=2, num_heads=H * n * tp, page_size=PS,
                     extra_pages=40)
    mesh = jax.make_mesh((n, tp), ("dcp", "tp"))
    args = shard_case(case, mesh, interleave=1, head_axis="tp", dtype=jnp.bfloat16)
    f = functools.partial(jax_mla.dcp_mla_attention, mesh=mesh, scale=case.scale, qlen=2,
                          head_axis="tp", combine=combine, backend="aiter", return_lse=True)
    hlo = jax.jit(f).lower(*args).compile().as_text()
    assert "buffer_python_cpu_callback" in hlo or "xla_buffer_python" in hlo, \
        "the AITER bridge's custom call is not in the program"
    found = collectives(hlo)
    local_cache = args[1].size // n
    t = case.q.shape[0]
    assert max(size for _, _, size in found) < local_cache // 4, (found, local_cache)
    assert {op for op, _, _ in found} <= {"all-gather", "reduce-scatter", "all-to-all"}, found
    # The query gather is there ([T, H*N, D]): the parse above is really seeing collectives.
    # XLA:CPU widens bf16 collectives to f32 when it compiles.
    q_gathers = [dt for op, dt, size in found if op == "all-gather" and size == t * H * n * 576]
    assert q_gathers and q_gathers[0] in ("bf16", "f32"), found
    want_comm = "reduce-scatter" if combine == "ag_rs" else "all-to-all"
    assert any(op == want_comm for op, _, _ in found), found


def test_dcp_aiter_bf16_on_gfx942_is_refused_clearly(rng, aiter_dcp):
    # gfx942 has no bf16 persistent asm decode that returns an LSE (docs/design.md §7.8): the
    # DCP local call refuses at trace time rather than failing inside AITER.
    aiter_dcp("gfx942")
    n = 2
    case = make_case(rng, seq_lens=[5, 20], qlen=1, num_heads=H * n, page_size=PS)
    mesh = jax.make_mesh((n,), ("dcp",))
    args = shard_case(case, mesh, interleave=1, dtype=jnp.bfloat16)
    with pytest.raises(Exception, match="gfx942 has no persistent asm MLA decode kernel"):
        jax_mla.dcp_mla_attention(*args, mesh=mesh, scale=case.scale, backend="aiter",
                                  return_lse=True)
