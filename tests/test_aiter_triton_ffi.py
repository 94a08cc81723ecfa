"""AITER's segmented Triton decode kernel launched by jax_mla itself (``triton_kernels.py``).

The segmented DCP-verify route takes the installed AITER's ``_mla_decode_fwd_kernel``
(``aiter.ops.triton._triton_kernels.attention.mla``; here the stand-in's, a kernel with the
pinned JIT signature and its own body), checks its JIT parameter list against
``manifest.json``, and launches it through ``jax_mla.backends.triton.launch.triton_call``.
Checked on a CPU host:

- lowered for ``("rocm",)`` (gfx950, compiled ahead of time in a subprocess without the
  interpreter): one typed ``jax_mla_triton`` FFI call carrying an ELF, with AITER's grid and
  warps, and no Python callback of any kind (so no host round trip, no host sync);
- run by Triton's interpreter inside ``jax.jit``: bf16 and fp8 caches with NaN in every slot no
  row may read and NaN-poisoned kernel outputs (unwritten segments), against the float64
  oracle and against the Python bridge path (the stand-in's torch ``mla_decode_fwd``);
- a kernel whose JIT signature differs is refused by the manifest check, naming the
  difference, and the route falls back to the bridge, said once per process;
- AITER's launch parameters (tile, BLOCK_M, head blocks, segment count) as its wrapper
  computes them.

Nothing here has run on AMD hardware.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla.backends.aiter import build_aiter_decode_metadata, manifest, native, triton_kernels
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.triton import ffi_launch

import oracle
from aiter_standin.harness import STANDIN_DIR, forced_standins
from conftest import make_case, run_compiler_script
from lowering import needs_rocm_compile, rocm_script

PS = 16  # page size (the segmented tile); AITER's dots need tiles of 16 or more on a GPU
KERNEL = triton_kernels.KERNEL


@pytest.fixture
def aiter_on(monkeypatch):
    """The stand-in as ``aiter``, the backend forced on for this platform, warn-once reset."""
    monkeypatch.setattr(native, "_warned", set())
    jax.clear_caches()  # the route is chosen at trace time
    with forced_standins() as enter:
        yield enter
    jax.clear_caches()


def finite_tails(rng, c, scale=30.0):
    """``c`` with the unused tail of each request's last page holding large finite garbage
    instead of NaN; every other unused slot (whole pages no row reaches, ``-1`` table entries)
    stays NaN.

    AITER's kernel reads whole tiles: positions past a row's length in its last tile are masked
    out of the softmax (probability 0) but still enter ``P @ V``, so a NaN there poisons the row
    (``0 * NaN``), as :func:`test_nan_in_a_read_tile_reaches_the_output_as_in_aiters_kernel`
    pins. Finite garbage there must not matter.
    """
    for i, n in enumerate(c.seq_lens):
        used = -(-int(n) // c.page_size)
        if used and n % c.page_size:
            page = c.block_table[i, used - 1]
            tail = c.cache[page, int(n) % c.page_size:]
            c.cache[page, int(n) % c.page_size:] = scale * rng.standard_normal(tail.shape)
    return c


def _case(rng, dt, *, heads=32, qlen=3, n=2, rank=1, tot=(41, 3, 18), nan_tails=False):
    from jax_mla.dcp import dcp_local_seq_lens

    tot = np.asarray(tot, np.int32)
    local = np.asarray(dcp_local_seq_lens(jnp.asarray(tot), n, rank)).astype(np.int32)
    c = make_case(rng, seq_lens=local, qlen=qlen, num_heads=heads, page_size=PS)
    if not nan_tails:
        c = finite_tails(rng, c)
    if dt == "fp8":
        f8 = caps.fp8_dtype("gfx950")
        q, cache = jnp.asarray(c.q, f8), jnp.asarray(c.cache, f8)
        scales = dict(q_scale=jnp.float32(0.5), kv_scale=jnp.float32(1.5))
    else:
        q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
        scales = dict(q_scale=None, kv_scale=None)
    md = build_aiter_decode_metadata(c.block_table, local, page_size=PS, num_heads=heads,
                                     qlen=qlen, kv_dtype=cache.dtype, arch="gfx950", num_cu=8,
                                     dcp_world_size=n, dcp_rank=rank,
                                     dcp_tot_seq_lens=jnp.asarray(tot))
    assert md.plan.route.kind == "dcp_verify"
    return c, q, cache, md, scales


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _run(q, cache, md, c, scales):
    jax.clear_caches()
    step = jax.jit(lambda q, cache, md: jax_mla.mla_attention(
        q, cache, md, scale=c.scale, backend="aiter", return_lse=True, **scales))
    return step(q, cache, md)


# --- (b) the interpreter against the oracle and the bridge -------------------------------------

@pytest.mark.parametrize("dt", ["bf16", "fp8"])
def test_route_runs_aiters_kernel_and_matches_oracle_and_bridge(rng, aiter_on, monkeypatch, dt):
    aiter = aiter_on("gfx950", cu_num=8)
    monkeypatch.setenv("JAX_MLA_POISON_OUTPUTS", "1")  # unwritten segments read as NaN
    c, q, cache, md, scales = _case(rng, dt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        out, lse = _run(q, cache, md, c, scales)
    assert not aiter.calls("segmented_mla_decode_fwd"), "the bridge ran"
    with triton_kernels.use_bridge():
        b_out, b_lse = _run(q, cache, md, c, scales)
    assert len(aiter.calls("segmented_mla_decode_fwd")) == 1

    view = md.schedule.dcp_verify
    row_lens = np.asarray(view.row_lens)
    assert (row_lens == 0).any() and (row_lens > PS).any()  # empty rows, 2-tile rows
    qs = 0.5 if dt == "fp8" else 1.0
    ks = 1.5 if dt == "fp8" else 1.0
    q_in = _f32(q) * qs
    if dt == "fp8":  # vLLM dequantises q to bf16 before the segmented kernel
        q_in = _f32(jnp.asarray(q_in, jnp.bfloat16))
    want, want_lse = oracle.mla_decode(q_in, _f32(cache), np.repeat(c.block_table, 3, axis=0),
                                       row_lens, qlen=1, page_size=PS, scale=c.scale,
                                       kv_lora_rank=512, kv_scale=ks)
    for o, ls in ((out, lse), (b_out, b_lse)):
        assert np.isfinite(_f32(o)).all()
        assert oracle.rel_err(_f32(o), want) < 1e-2
        np.testing.assert_array_equal(np.isneginf(ls), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(np.asarray(ls)[fin], want_lse[fin], atol=2e-3, rtol=1e-3)
    # The two paths: the same partials math, one in Triton (float32 in the interpreter), one in
    # torch; bf16 outputs within a rounding step.
    assert oracle.rel_err(_f32(out), _f32(b_out)) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(b_lse), atol=1e-4, rtol=1e-5)


def test_partials_leave_segments_past_a_row_unwritten(rng, aiter_on, monkeypatch):
    # What the merge relies on: active segments written, later ones never touched (NaN here).
    aiter_on("gfx950", cu_num=8)
    monkeypatch.setenv("JAX_MLA_POISON_OUTPUTS", "1")
    c, q, cache, md, _ = _case(rng, "bf16", heads=16)
    view = md.schedule.dcp_verify
    parts = jax.jit(lambda q, cache, view: triton_kernels.segment_partials(
        q, cache, view, md.plan.route, scale=c.scale, target="cpu"))(q, cache, view)
    so, sm, se = (np.asarray(p) for p in parts)
    from jax_mla.backends.aiter.segments import active_segments

    act = np.asarray(active_segments(view.row_lens, sm.shape[-1], view.page_size))
    for r, a in enumerate(act):
        assert np.isfinite(sm[r, :, :a]).all() and np.isfinite(so[r, :, :a]).all(), r
        assert np.isnan(sm[r, :, a:]).all() and np.isnan(se[r, :, a:]).all(), r
    assert (act == 0).any() and (act > 1).any(), act


def test_nan_in_a_read_tile_reaches_the_output_as_in_aiters_kernel(rng, aiter_on):
    # AITER's _mla_decode_fwd_kernel (e4048607, run through this route in Triton's interpreter
    # while this was written) loads whole TILE_SIZE tiles and multiplies masked probabilities
    # (0) by their V rows: a NaN in the unused tail of a row's last page makes that row NaN.
    # The stand-in kernel does the same; the torch bridge stand-in never reads those slots.
    aiter_on("gfx950", cu_num=8)
    c, q, cache, md, scales = _case(rng, "bf16", nan_tails=True)
    out, _ = _run(q, cache, md, c, scales)
    with triton_kernels.use_bridge():
        b_out, _ = _run(q, cache, md, c, scales)
    assert np.isfinite(_f32(b_out)).all()
    bad = ~np.isfinite(_f32(out)).all(axis=(1, 2))
    view = md.schedule.dcp_verify
    lens = np.repeat(c.seq_lens, 3)
    # a row reads a NaN tail when its last tile is its request's last, partly used, page
    row_lens = np.asarray(view.row_lens)
    reads_tail = (row_lens > 0) & (lens % PS != 0) & (
        -(-row_lens // PS) == -(-lens // PS))
    np.testing.assert_array_equal(bad, reads_tail)
    assert reads_tail.any()


# --- (c) a kernel of another signature is refused; the bridge runs, said once -----------------

class _Altered:
    """A Triton JIT function (``.fn``, launchable by ``[grid]``) whose parameter list differs
    from the pinned one, as a newer AITER's might."""

    def __init__(self, kernel, change):
        def fn(*args, **kwargs):
            raise AssertionError("a refused kernel was called")

        sig = inspect.signature(kernel.fn)
        fn.__signature__ = sig.replace(parameters=change(list(sig.parameters.values())))
        self.fn = fn

    def __getitem__(self, grid):
        raise AssertionError("a refused kernel was launched")


def _rename(old, new):
    return lambda ps: [p.replace(name=new) if p.name == old else p for p in ps]


def _retype(name, annotation):
    return lambda ps: [p.replace(annotation=annotation) if p.name == name else p for p in ps]


ALTERED = [
    ("renamed", _rename("scale", "sm_scale"),
     r"parameter names/order differ \(missing scale; unexpected sm_scale\)"),
    ("dropped", lambda ps: [p for p in ps if p.name != "waves_per_eu"],
     r"parameter names/order differ \(missing waves_per_eu\)"),
    ("no-longer-constexpr", _retype("TILE_SIZE", inspect.Parameter.empty),
     r"parameter 'TILE_SIZE' annotation differs: pinned constexpr, found none"),
]


@pytest.mark.parametrize("name,change,match", ALTERED, ids=[a[0] for a in ALTERED])
def test_a_kernel_of_another_signature_falls_back_to_the_bridge_once(
        rng, aiter_on, monkeypatch, caplog, name, change, match):
    aiter = aiter_on("gfx950", cu_num=8)
    import aiter.ops.triton._triton_kernels.attention.mla as kmod

    altered = _Altered(kmod._mla_decode_fwd_kernel, change)
    problems = manifest.check_triton_kernel(KERNEL, altered)
    assert problems and re.search(match, "; ".join(problems)), problems
    monkeypatch.setattr(kmod, "_mla_decode_fwd_kernel", altered)
    reason = triton_kernels.unavailable_reason("cpu", "gfx950")
    assert reason and "not the one jax_mla launches" in reason and re.search(match, reason)

    c, q, cache, md, scales = _case(rng, "bf16")
    with caplog.at_level(logging.WARNING, logger=native.log.name), pytest.warns(
            RuntimeWarning, match="segmented Triton MLA decode runs through the Python bridge"):
        out, lse = _run(q, cache, md, c, scales)
        out2, _ = _run(q, cache, md, c, scales)  # traced again: not said again
    lines = [r.getMessage() for r in caplog.records if "Python bridge" in r.getMessage()]
    assert len(lines) == 1 and re.search(match, lines[0]), lines
    assert len(aiter.calls("segmented_mla_decode_fwd")) == 2  # both traces ran the bridge
    np.testing.assert_array_equal(_f32(out), _f32(out2))


def test_the_standin_kernel_and_the_manifest_agree():
    with forced_standins() as enter:
        enter()
        from aiter.ops.triton._triton_kernels.attention.mla import _mla_decode_fwd_kernel

        assert manifest.check_triton_kernel(KERNEL, _mla_decode_fwd_kernel) == []
        entry = manifest.load_manifest()["triton_kernels"][KERNEL]
        path = os.path.join(STANDIN_DIR, entry["file"])
        assert os.path.samefile(inspect.getsourcefile(_mla_decode_fwd_kernel.fn), path)
        assert triton_kernels.unavailable_reason("cpu", "gfx950") is None
        assert "gfx1250" in triton_kernels.unavailable_reason("cpu", "gfx1250")


# --- AITER's launch parameters ------------------------------------------------------------------

@pytest.mark.parametrize("heads,fp8,block_m,head_blocks", [
    (8, False, 16, 1), (16, False, 16, 1), (32, False, 32, 1), (128, False, 64, 2),
    (128, True, 128, 1), (48, True, 64, 1)])
def test_launch_config_is_aiters(heads, fp8, block_m, head_blocks):
    cfg = triton_kernels.launch_config(rows=12, num_seqs=12, num_heads=heads, page_size=64,
                                       max_seqlen_kv=4096, kv_fp8=fp8, arch="gfx942",
                                       num_cu=304)
    assert (cfg.block_m, cfg.num_head_blocks) == (block_m, head_blocks)
    assert cfg.block_q == max(block_m // heads, 1) and cfg.all_decode
    assert cfg.grid == (12 * head_blocks, 1, cfg.num_segments)
    assert (cfg.num_warps, cfg.num_stages, cfg.waves_per_eu) == (2, 1, 1)
    assert triton_kernels.launch_config(rows=4, num_seqs=4, num_heads=16, page_size=16,
                                        max_seqlen_kv=64, kv_fp8=False, arch="gfx950",
                                        num_cu=256).num_stages == 2


@pytest.mark.parametrize("tile,max_kv,progs,cu", [
    (16, 4096, 12, 304), (16, 4096, 1000, 304), (64, 64, 3, 8), (1, 0, 5, 256),
    (128, 1 << 20, 1, 256), (16, 300, 40, 80)])
def test_num_segments_matches_the_standin_port(tile, max_kv, progs, cu):
    with forced_standins() as enter:
        enter()
        from aiter.ops.triton.attention.mla import num_segments

        want = num_segments(tile, max_kv, progs, 4 * cu)
    got = triton_kernels.num_segments(tile, max_kv, progs, cu)
    assert got == want and 8 <= got <= 128 and got & (got - 1) == 0


# --- (a) lowered for ROCm: our typed FFI call only ------------------------------------------------

LOWER = r"""
import json, re, sys
sys.path.insert(0, TESTS)
from lowering import lowered_launches
import jax, jax.numpy as jnp, numpy as np
import jax_mla
from jax_mla.backends.aiter import build_aiter_decode_metadata, triton_kernels
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.problem import Target
from aiter_standin.harness import standin
from jax_mla.backends.triton import compiler as tc

# What AITER's launch hands its compiler reaches ours: the HIP occupancy hint, as the LLVM
# function attribute Triton's AMD backend makes of it.
waves = []
compile_for_target = tc.compile_for_target


def recording(*args, **kwargs):
    cc, n = compile_for_target(*args, **kwargs)
    waves.append(re.findall(r'"amdgpu-waves-per-eu"="([\d,]+)"', cc.asm["llir"]))
    return cc, n


tc.compile_for_target = recording
res = {}
with standin(arch="gfx950", cu_num=8):
    for dt, heads in (("bf16", 32), ("fp8", 16)):
        waves.clear()
        kv_dt = jnp.bfloat16 if dt == "bf16" else caps.fp8_dtype("gfx950")
        b, qlen, mp, ps = 3, 3, 4, 16
        bt = jnp.arange(b * mp, dtype=jnp.int32).reshape(b, mp)
        tot = jnp.asarray([41, 3, 18], jnp.int32)
        lens = jnp.asarray([21, 2, 9], jnp.int32)
        q = jnp.ones((b * qlen, heads, 576), kv_dt)
        cache = jnp.ones((b * mp, ps, 576), kv_dt)

        def step(q, cache, bt, lens, tot):
            md = build_aiter_decode_metadata(
                bt, lens, page_size=ps, num_heads=heads, qlen=qlen, kv_dtype=cache.dtype,
                arch="gfx950", num_cu=8, dcp_world_size=2, dcp_rank=1, dcp_tot_seq_lens=tot,
                target=Target("rocm", "gfx950", 8))
            assert md.plan.route.kind == "dcp_verify"
            scales = {} if dt == "bf16" else dict(q_scale=jnp.float32(0.5),
                                                  kv_scale=jnp.float32(1.5))
            return jax_mla.mla_attention(q, cache, md, scale=0.1, backend="aiter",
                                         return_lse=True, **scales)

        lowered = jax.jit(step).trace(q, cache, bt, lens, tot).lower(
            lowering_platforms=("rocm",))
        text = lowered.as_text()
        hlo = lowered.compiler_ir("hlo").as_hlo_text()
        cfg = triton_kernels.launch_config(rows=b * qlen, num_seqs=b * qlen, num_heads=heads,
                                           page_size=ps, max_seqlen_kv=mp * ps,
                                           kv_fp8=dt == "fp8", arch="gfx950", num_cu=8)
        res[dt] = dict(**lowered_launches(text, hlo), want_grid=list(cfg.grid),
                       want_threads=cfg.num_warps * 64, waves=waves[:],
                       want_waves=cfg.waves_per_eu)
print(json.dumps(res))
"""


@needs_rocm_compile()
def test_the_route_lowers_for_rocm_to_our_typed_ffi_call_only(tmp_path):
    r = run_compiler_script(rocm_script(tmp_path, LOWER), timeout=900)
    for dt in ("bf16", "fp8"):
        got = r[dt]
        assert got["targets"] == [ffi_launch.TARGET_NAME], (dt, got)
        assert got["kernels"] == ["mla_aiter_segmented_entry_kernel"], (dt, got)
        assert got["elf"] == [True] and got["lowered_target"] == ["gfx950"], (dt, got)
        assert got["typed"] == [f'"{ffi_launch.TARGET_NAME}" typed'], (dt, got)
        assert got["grid"] == [got["want_grid"]] and got["threads"] == [got["want_threads"]]
        assert got["callbacks"] == 0, (dt, got)
        (attr,), = got["waves"]  # one compile, one kernel attribute ("1,1": min and max)
        assert {int(x) for x in attr.split(",")} == {got["want_waves"]}, (dt, got)
