"""DCP attention on an 8-device CPU mesh vs single-device attention over the whole context.

Needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax starts (``.ci/run``
exports it); skipped with that reason otherwise.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_mla

from conftest import make_case
from dcp_cases import (
    assert_covers_the_edge_cases,
    callback_backend,  # noqa: F401  (a fixture, used by name)
    collectives,
    lse_rel_err,
    needs_8_devices,
    oracle,
    shard_case,
)
from oracle import logical_kv, rel_err

pytestmark = needs_8_devices

L, R = 32, 16  # small latent / rope widths (any L + R works with kv_lora_rank given)
H_TOTAL = 16  # divisible by every DCP x TP layout used here
TOL = 1e-5


def _mesh(n, tp=None, *, explicit=True):
    if tp is None:
        return jax.make_mesh((n,), ("dcp",)) if explicit else Mesh(
            np.array(jax.devices()[:n]), ("dcp",))
    if explicit:
        return jax.make_mesh((n, tp), ("dcp", "tp"))
    return Mesh(np.array(jax.devices()[:n * tp]).reshape(n, tp), ("dcp", "tp"))


def _lens(n, i, qlen):
    """Shorter than N (empty shards), shorter than Q (empty rows), verify blocks straddling the
    rank-0 -> rank-1 and rank-(N-1) -> rank-0 boundaries, and a long-ish request."""
    return [1, 2, max(qlen - 1, 0), i + 1, i * n + 1, 2 * i * n - 1, 70]


def _run(case, mesh, *, interleave, combine, head_axis=None, backend="auto", rng=None, **kw):
    args = shard_case(case, mesh, interleave=interleave, head_axis=head_axis, rng=rng)
    return jax_mla.dcp_mla_attention(
        *args, mesh=mesh, scale=case.scale, qlen=case.qlen, interleave=interleave,
        head_axis=head_axis, combine=combine, backend=backend, return_lse=True,
        kv_lora_rank=case.kv_lora_rank, **kw)


def _single_device(case, dtype=jnp.float32, **kw):
    md = jax_mla.build_decode_metadata(case.block_table, case.seq_lens, page_size=case.page_size,
                                       qlen=case.qlen)
    return jax_mla.mla_attention(jnp.asarray(case.q, dtype), jnp.asarray(case.cache, dtype), md,
                                 scale=case.scale, return_lse=True,
                                 kv_lora_rank=case.kv_lora_rank, **kw)


def _check(case, out, lse, what, tol=TOL):
    want_o, want_l = oracle(case)
    eo, el = rel_err(out, want_o), lse_rel_err(lse, want_l)
    print(f"{what}: rel err out {eo:.2e} lse {el:.2e}")
    assert eo < tol and el < tol, (what, eo, el)
    return eo, el


@pytest.mark.parametrize("interleave", [1, 2, 16])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_dcp_matches_single_device(rng, n, interleave):
    """Decode (Q=1) and verify (Q=3), both combines: four calls compiled as one program (XLA's
    CPU compile time, not the run, is what this suite spends)."""
    lens = _lens(n, interleave, 3)
    cases = {q: make_case(rng, seq_lens=lens, qlen=q, num_heads=H_TOTAL, page_size=16,
                          kv_lora_rank=L, rope_dim=R) for q in (1, 3)}
    for c in cases.values():
        assert_covers_the_edge_cases(c, n, interleave)
    mesh = _mesh(n)
    args = {q: shard_case(c, mesh, interleave=interleave, rng=rng) for q, c in cases.items()}

    @jax.jit
    def all_variants(args):
        return {(q, comb): jax_mla.dcp_mla_attention(
            *args[q], mesh=mesh, scale=cases[q].scale, qlen=q, interleave=interleave,
            combine=comb, return_lse=True, kv_lora_rank=L)
            for q in cases for comb in jax_mla.dcp.COMBINES}

    for (q, comb), (out, lse) in all_variants(args).items():
        assert out.shape == (len(lens) * q, H_TOTAL, L) and lse.shape == out.shape[:2]
        _check(cases[q], out, lse, f"N={n} I={interleave} Q={q} {comb}")
    # Same answer as the library's own single-device path (not only the float64 oracle).
    ref_o, ref_l = _single_device(cases[3])
    out, lse = all_variants(args)[3, "ag_rs"]
    assert rel_err(out, ref_o) < TOL and lse_rel_err(lse, np.asarray(ref_l)) < TOL


@pytest.mark.parametrize("combine", jax_mla.dcp.COMBINES)
@pytest.mark.parametrize("n,tp,explicit", [(2, 4, True), (4, 2, False), (8, 1, True)])
def test_dcp_with_head_parallelism_on_a_2d_mesh(rng, n, tp, explicit, combine):
    case = make_case(rng, seq_lens=_lens(n, 2, 2), qlen=2, num_heads=H_TOTAL, page_size=4,
                     kv_lora_rank=L, rope_dim=R)
    mesh = _mesh(n, tp, explicit=explicit)
    out, lse = _run(case, mesh, interleave=2, combine=combine, head_axis="tp", rng=rng)
    assert out.sharding.spec[:2] == jax_mla.dcp_shardings(mesh, head_axis="tp").out.spec[:2]
    _check(case, out, lse, f"2-D mesh dcp={n} tp={tp} {combine}")


def test_dcp_inside_a_user_jit_with_split_q(rng):
    n = 4
    case = make_case(rng, seq_lens=[3, 50, 17], qlen=2, num_heads=H_TOTAL, page_size=8,
                     kv_lora_rank=L, rope_dim=R)
    mesh = _mesh(n, 2)
    q, kv, tables, lens = shard_case(case, mesh, interleave=1, head_axis="tp")

    @jax.jit
    def step(q, kv, tables, lens):
        q = q * 2.0  # some upstream op; the scale below undoes it
        out, lse = jax_mla.dcp_mla_attention((q[..., :L], q[..., L:]), kv, tables, lens,
                                             mesh=mesh, scale=case.scale / 2.0, qlen=2,
                                             head_axis="tp", combine="a2a", return_lse=True)
        return out + 0.0, lse

    _check(case, *step(q, kv, tables, lens), "inside a user jit, (q_nope, q_pe)")


@pytest.mark.parametrize("qlen,combine", [(1, "a2a"), (2, "ag_rs")])
def test_deepseek_widths(rng, qlen, combine):
    case = make_case(rng, seq_lens=[1, 100, 300], qlen=qlen, num_heads=H_TOTAL, page_size=64)
    out, lse = _run(case, _mesh(4), interleave=1, combine=combine, rng=rng)
    _check(case, out, lse, f"DeepSeek 512/64 N=4 Q={qlen} {combine}")


def test_bf16(rng):
    case = make_case(rng, seq_lens=[5, 77, 130], qlen=1, num_heads=H_TOTAL, page_size=16,
                     kv_lora_rank=L, rope_dim=R)
    mesh = _mesh(4)
    args = shard_case(case, mesh, interleave=2, dtype=jnp.bfloat16)
    for combine in jax_mla.dcp.COMBINES:
        out, lse = jax_mla.dcp_mla_attention(*args, mesh=mesh, scale=case.scale, interleave=2,
                                             combine=combine, return_lse=True, kv_lora_rank=L)
        assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
        ref_o, ref_l = _single_device(case, jnp.bfloat16)
        # Against single-device bf16: only the partials' bf16 rounding differs.
        assert rel_err(out, ref_o) < 1e-2 and lse_rel_err(lse, np.asarray(ref_l)) < 1e-3


def test_fp8_query_is_what_gets_all_gathered(rng):
    """docs/design.md §8.7: fp8 q is gathered as fp8; fp8 cache with a kv_scale; as one device."""
    n, f8 = 4, jnp.float8_e4m3fn
    case = make_case(rng, seq_lens=[4, 45, 90], qlen=1, num_heads=H_TOTAL, page_size=16,
                     kv_lora_rank=L, rope_dim=R)
    qs, ks = jnp.float32(0.25), jnp.float32(0.5)
    q8 = (jnp.asarray(case.q) / qs).astype(f8)
    kv8 = (jnp.asarray(case.cache) / ks).astype(f8)
    mesh = _mesh(n)
    sh = jax_mla.dcp_shardings(mesh)
    kv, tables = jax_mla.dcp_shard_cache(kv8, case.block_table, case.seq_lens, world_size=n,
                                         mesh=mesh)
    f = functools.partial(jax_mla.dcp_mla_attention, mesh=mesh, scale=case.scale,
                          return_lse=True, kv_lora_rank=L)
    q = jax.device_put(q8, sh.q)
    out, lse = f(q, kv, tables, jnp.asarray(case.seq_lens), kv_scale=ks, q_scale=qs)
    md = jax_mla.build_decode_metadata(case.block_table, case.seq_lens, page_size=16)
    ref_o, ref_l = jax_mla.mla_attention(q8, kv8, md, scale=case.scale, return_lse=True,
                                         kv_lora_rank=L, kv_scale=ks, q_scale=qs)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, ref_o) < 1e-2 and lse_rel_err(lse, np.asarray(ref_l)) < TOL
    lowered = jax.jit(lambda *a: f(*a, kv_scale=ks, q_scale=qs)).lower(
        q, kv, tables, jnp.asarray(case.seq_lens))
    # The program gathers fp8 (what jax emits). XLA:CPU has no fp8 collectives and widens the
    # gather to f16 when it compiles; on GPU it stays fp8. Check both stages.
    t_rows = case.q.shape[0]
    gathers = re.findall(r"all_gather.*-> tensor<([0-9x]+)x(\w+)>", lowered.as_text())
    assert (f"{t_rows}x{H_TOTAL}x{L + R}", "f8E4M3FN") in gathers, gathers
    compiled = collectives(lowered.compile().as_text())
    q_gathers = [dt for op, dt, size in compiled
                 if op == "all-gather" and size == t_rows * H_TOTAL * (L + R)]
    assert q_gathers and q_gathers[0] in ("f8e4m3fn", "f16"), compiled


def _hlo_collectives(case, mesh, backend, combine):
    args = shard_case(case, mesh, interleave=1, head_axis="tp")
    f = functools.partial(jax_mla.dcp_mla_attention, mesh=mesh, scale=case.scale, qlen=case.qlen,
                          head_axis="tp", combine=combine, backend=backend, return_lse=True,
                          kv_lora_rank=L)
    hlo = jax.jit(f).lower(*args).compile().as_text()
    return collectives(hlo), args[1]


@pytest.mark.parametrize("combine", jax_mla.dcp.COMBINES)
@pytest.mark.parametrize("backend", ["dcp_test_callback", *jax_mla.available_backends("cpu")])
def test_compiled_program_never_gathers_the_kv_cache(rng, callback_backend, backend,  # noqa: F811
                                                     combine):
    n, tp = 4, 2
    # Many spare pages: the cache dwarfs every legitimate collective operand.
    case = make_case(rng, seq_lens=[9, 33, 5], qlen=2, num_heads=H_TOTAL, page_size=8,
                     kv_lora_rank=L, rope_dim=R, extra_pages=100)
    mesh = _mesh(n, tp)
    found, kv = _hlo_collectives(case, mesh, backend, combine)
    local_cache = kv.size // n
    t, h_dev = case.q.shape[0], H_TOTAL // (n * tp)
    assert max(size for _, _, size in found) < local_cache // 4, (found, local_cache)
    assert {op for op, _, _ in found} <= {"all-gather", "reduce-scatter", "all-to-all"}, found
    # The query gather is there ([T, H*N, D]): the parse above is really seeing collectives.
    assert ("all-gather", "f32", t * h_dev * n * (L + R)) in found, found
    want_comm = "reduce-scatter" if combine == "ag_rs" else "all-to-all"
    assert any(op == want_comm for op, _, _ in found), found


@pytest.mark.parametrize("backend", ["dcp_test_callback", *jax_mla.available_backends("cpu")])
def test_every_backend_as_the_local_kernel(rng, callback_backend, backend):  # noqa: F811
    """The callback backend also pads heads and leaves NaN / +inf in empty rows. ``triton`` runs
    the real kernel source under Triton's interpreter, one device thread at a time."""
    case = make_case(rng, seq_lens=[1, 2, 21, 40], qlen=2, num_heads=H_TOTAL, page_size=4,
                     kv_lora_rank=L, rope_dim=R)
    for combine in jax_mla.dcp.COMBINES:
        out, lse = _run(case, _mesh(4, 2), interleave=2, combine=combine, head_axis="tp",
                        backend=backend, rng=rng)
        _check(case, out, lse, f"backend {backend} {combine}")


@pytest.mark.parametrize("explicit", [True, False])
def test_unplaced_inputs_are_placed_without_gathering(rng, explicit):
    """Plain single-device arrays in, on Explicit (make_mesh) and Auto (Mesh) axes alike."""
    n = 4
    case = make_case(rng, seq_lens=[3, 30, 61], qlen=2, num_heads=H_TOTAL, page_size=4,
                     kv_lora_rank=L, rope_dim=R, extra_pages=60)
    kv, tables = jax_mla.dcp_shard_cache(jnp.asarray(case.cache), case.block_table,
                                         case.seq_lens, world_size=n, fill_value=np.nan)
    mesh = _mesh(n, 2, explicit=explicit)
    f = jax.jit(functools.partial(jax_mla.dcp_mla_attention, mesh=mesh, scale=case.scale,
                                  qlen=2, head_axis="tp", return_lse=True, kv_lora_rank=L))
    args = (jnp.asarray(case.q), kv, tables, jnp.asarray(case.seq_lens))
    _check(case, *f(*args), f"unplaced inputs, explicit={explicit}")
    found = collectives(f.lower(*args).compile().as_text())
    assert max(size for _, _, size in found) < kv.size // n // 4, found


def test_mesh_errors(rng):
    mesh = _mesh(4, 2)
    case = make_case(rng, seq_lens=[5, 9], qlen=1, num_heads=H_TOTAL, page_size=4,
                     kv_lora_rank=L, rope_dim=R)
    # Host copies: slicing an Explicit-sharded array would itself be a sharding question.
    q, kv, tables, lens = (np.asarray(a) for a in shard_case(case, mesh, interleave=1,
                                                             head_axis="tp"))
    f = functools.partial(jax_mla.dcp_mla_attention, mesh=mesh, scale=1.0, kv_lora_rank=L,
                          head_axis="tp")
    with pytest.raises(ValueError, match="H_total=12 heads, not divisible by the DCP world size 4 "
                                         "times the head-parallel size 2"):
        f(jnp.zeros((2, 12, L + R)), kv, tables, lens)
    with pytest.raises(ValueError, match="page_size=4 must be a multiple of interleave=8"):
        f(q, kv, tables, lens, interleave=8)
    with pytest.raises(ValueError, match="not divisible by the DCP world size 4"):
        f(q, kv[:-1], tables, lens)
    with pytest.raises(ValueError, match=r"block_tables must be \[N=4, B, max_pages_local\]"):
        f(q, kv, tables[:2], lens)
    with pytest.raises(ValueError, match="T must equal B \\* Q"):
        f(q, kv, tables, lens, qlen=2)
    with pytest.raises(ValueError, match="seq_lens must be"):
        f(q, kv, tables, lens[:1])
    with pytest.raises(ValueError, match="combine='ring' must be one of"):
        f(q, kv, tables, lens, combine="ring")
    with pytest.raises(ValueError, match="head_axis='model' is not an axis of the mesh"):
        f(q, kv, tables, lens, head_axis="model")
    with pytest.raises(ValueError, match="q width D=40 must equal the kv_cache width 48"):
        f(q[..., :40], kv, tables, lens)


@pytest.mark.parametrize("n,interleave", [(4, 2), (8, 1)])
def test_a_step_writes_new_tokens_on_their_owners_then_attends(rng, n, interleave):
    """Shard the context, write the Q new tokens with the slot mapping (traced rank), attend."""
    qlen, ps = 2, 4
    lens = np.array([1, 5, 9, 2 * n * interleave + 1, 33], np.int32)  # global, incl. new tokens
    case = make_case(rng, seq_lens=lens, qlen=qlen, num_heads=H_TOTAL, page_size=ps,
                     kv_lora_rank=L, rope_dim=R)
    mesh = _mesh(n, 8 // n)
    before = np.maximum(lens - qlen, 0)  # the cache as the previous step left it
    kv, tables = jax_mla.dcp_shard_cache(jnp.asarray(case.cache), case.block_table, before,
                                         world_size=n, interleave=interleave, fill_value=np.nan,
                                         mesh=mesh)
    pos = (lens[:, None] - qlen + np.arange(qlen)).reshape(-1)  # negative: padding row
    req = np.repeat(np.arange(len(lens)), qlen)
    new = np.stack([logical_kv(case.cache, case.block_table[b], lens[b], ps)[p] if p >= 0
                    else np.full(L + R, np.nan) for b, p in zip(req, pos)]).astype(np.float32)
    sh = jax_mla.dcp_shardings(mesh, head_axis="tp")

    @jax.jit
    def step(q, kv, kv_c, k_pe, pos, req):
        kv = jax_mla.dcp.dcp_write_kv_cache(kv, kv_c, k_pe, pos, req, tables, mesh=mesh,
                                            interleave=interleave)
        return kv, jax_mla.dcp_mla_attention(q, kv, tables, jnp.asarray(lens), mesh=mesh,
                                             scale=case.scale, qlen=qlen, interleave=interleave,
                                             head_axis="tp", return_lse=True, kv_lora_rank=L)

    kv2, (out, lse) = step(jax.device_put(jnp.asarray(case.q), sh.q), kv, new[:, :L], new[:, L:],
                           jnp.asarray(pos), jnp.asarray(req))
    _check(case, out, lse, f"write + attend N={n} I={interleave}")
    # Same cache as sharding the whole context at once (NaN-poisoned unused slots included).
    want, _ = jax_mla.dcp_shard_cache(jnp.asarray(case.cache), case.block_table, lens,
                                      world_size=n, interleave=interleave, fill_value=np.nan)
    np.testing.assert_array_equal(np.asarray(kv2), np.asarray(want))
    assert kv2.sharding.spec[:1] == sh.kv_cache.spec[:1]
