"""AITER's Gluon MLA decode (gfx950, fewer than 16 heads) launched by jax_mla itself
(``jax_mla/backends/aiter/gluon_kernels.py``): the installed AITER's ``_mla_gluon`` and its
reduce ``_mla_softmax_reducev_kernel`` (here the stand-in's, kernels with the pinned JIT
signatures and bodies of their own), each checked against ``manifest.json`` and launched through
jax_mla's entry kernels as typed FFI calls. Checked on a CPU host:

- lowered for ``("rocm",)`` (gfx950, compiled ahead of time in a subprocess without the
  interpreter): decode and MTP verify become one or two ``jax_mla_triton`` calls carrying ELF
  code objects, with AITER's grids and warps, and no Python callback;
- the launch parameters, as AITER's wrapper computes them (regime, splits, grids);
- the reduce's entry run by Triton's interpreter against a float64 merge, splits that stage 1
  leaves unwritten (NaN here) never read;
- a kernel of another signature is refused, naming the difference; off ROCm the route stays on
  the bridge (Gluon has no interpreter).

Nothing here has run on AMD hardware, and the stage-1 kernel has run nowhere.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.backends.aiter import gluon_kernels, manifest
from jax_mla.backends.triton import ffi_launch

from aiter_standin.harness import forced_standins
from conftest import run_compiler_script
from lowering import needs_rocm_compile, rocm_script


@pytest.mark.parametrize("batch,qlen,heads,splits,grid", [
    (4, 1, 8, 64, (4, 64, 1)), (2, 2, 8, 64, (2, 64, 2)), (1, 1, 16, 256, (1, 256, 1)),
    (3, 1, 40, 28, (3, 28, 3)), (512, 1, 4, 1, (512, 1, 1)), (128, 4, 1, 1, (128, 1, 4))])
def test_launch_config_is_aiters(batch, qlen, heads, splits, grid):
    # mla_gluon's bh16 regimes: NUM_KV_SPLITS = max(1, 256 // (batch * qlen * cdiv(nhead, 16))).
    cfg = gluon_kernels.launch_config(batch=batch, qlen=qlen, num_heads=heads, kv_fp8=False,
                                      kv_bytes=1 << 30)
    assert (cfg.regime, cfg.block_h, cfg.block_n) == ("bh16bn64", 16, 64)
    assert cfg.num_kv_splits == splits and cfg.grid == grid
    assert cfg.reduce_grid == (batch, heads, qlen) and cfg.within_2gb
    assert cfg.block_s == min(64, 1 << (splits - 1).bit_length())
    fp8 = gluon_kernels.launch_config(batch=batch, qlen=qlen, num_heads=heads, kv_fp8=True,
                                      kv_bytes=(1 << 31) + 1)
    assert (fp8.regime, fp8.block_n, fp8.within_2gb) == ("bh16bn128", 128, False)
    for bad in (64, 128, 97):
        with pytest.raises(gluon_kernels.KernelUnavailable, match="16-head regimes"):
            gluon_kernels.launch_config(batch=1, qlen=1, num_heads=bad, kv_fp8=False,
                                        kv_bytes=1)


def test_the_standin_kernels_and_the_manifest_agree():
    with forced_standins() as enter:
        enter()
        from aiter.ops.triton.gluon.mla_gluon import _mla_gluon, _mla_softmax_reducev_kernel

        assert gluon_kernels.installed_kernels() == (_mla_gluon, _mla_softmax_reducev_kernel)
        # Each kernel against the other's pinned list: the difference is named.
        problems = manifest.check_triton_kernel(gluon_kernels.KERNEL,
                                                _mla_softmax_reducev_kernel)
        assert problems and "parameter names/order differ" in problems[0], problems
        assert "Logits" in problems[0] and "Q_nope" in problems[0]
        # Off ROCm the route is the bridge's, and says why.
        assert "ROCm only" in gluon_kernels.unavailable_reason("cpu", "gfx950")
        assert "gfx942" in gluon_kernels.unavailable_reason("rocm", "gfx942")


def _merge_oracle(logits, mid, lens, cfg):
    """The merge AITER's reduce documents, in float64: splits that hold data (as stage 1 cut
    the request) weighted by ``exp(lse)``."""
    b, qlen, n, s, lr = logits.shape
    out = np.zeros((b, qlen, n, lr))
    lse = np.full((b, qlen, n), -np.inf)
    for i in range(b):
        per = max(cfg.block_n, int(lens[i]) // s)
        active = min(-(-int(lens[i]) // per), s)
        for t in range(qlen):
            for h in range(n):
                ls = mid[i, t, h, :active].astype(np.float64)
                ls = ls[np.isfinite(ls)]
                if not ls.size:
                    continue
                m = ls.max()
                w = np.exp(mid[i, t, h, :active].astype(np.float64) - m)
                w = np.where(np.isfinite(mid[i, t, h, :active]), w, 0.0)
                o = np.where(w[:, None] > 0, logits[i, t, h, :active].astype(np.float64), 0.0)
                out[i, t, h] = (w[:, None] * o).sum(0) / w.sum()
                lse[i, t, h] = m + np.log(w.sum())
    return out.reshape(b * qlen, n, lr), lse.reshape(b * qlen, n)


# A row none of whose splits holds data takes log(0) = -inf in the kernel, as AITER's does; the
# interpreter's NumPy says so.
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.parametrize("qlen", [1, 3])
def test_the_reduce_entry_merges_the_splits_that_hold_data(rng, qlen):
    b, n, lr = 3, 4, 512
    lens = np.array([200, 0, 64], np.int32)  # 4 / no / 1 active splits of 64-token minimum
    cfg = gluon_kernels.launch_config(batch=b, qlen=qlen, num_heads=n, kv_fp8=False, kv_bytes=1)
    s = cfg.num_kv_splits
    assert s >= 4
    logits = rng.standard_normal((b, qlen, n, s, lr)).astype(np.float32)
    mid = (rng.standard_normal((b, qlen, n, s)) * 3).astype(np.float32)
    for i, n_tok in enumerate(lens):  # what stage 1 never writes: NaN
        per = max(cfg.block_n, int(n_tok) // s)
        active = min(-(-int(n_tok) // per), s)
        logits[i, :, :, active:] = np.nan
        mid[i, :, :, active:] = np.nan
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    with forced_standins() as enter:
        enter()
        from aiter.ops.triton.gluon.mla_gluon import _mla_softmax_reducev_kernel

        out, lse = gluon_kernels.reduce_splits(
            jnp.asarray(logits, jnp.bfloat16), jnp.asarray(mid), jnp.asarray(indptr), cfg,
            _mla_softmax_reducev_kernel, jnp.bfloat16, return_lse=True, target="cpu")
    want_o, want_l = _merge_oracle(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32),
                                   mid, lens, cfg)
    out = np.asarray(out, np.float32)
    lse = np.asarray(lse)
    live = lens > 0
    rows = np.repeat(live, qlen)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[rows], want_o[rows], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(lse[rows], want_l[rows], rtol=1e-5, atol=1e-5)
    assert (out[~rows] == 0).all()  # no split holds data: AITER's reduce writes 0


LOWER = r"""
import json, re, sys
sys.path.insert(0, TESTS)
from lowering import lowered_launches
import jax, jax.numpy as jnp
import jax_mla
from jax_mla.backends.aiter import build_aiter_decode_metadata, gluon_kernels
from jax_mla.problem import Target
from aiter_standin.harness import standin

res = {}
with standin(arch="gfx950", cu_num=8):
    for heads, qlen, b in ((8, 1, 4), (8, 2, 2), (4, 1, 512)):
        mp, ps = 4, 16
        bt = jnp.arange(b * mp, dtype=jnp.int32).reshape(b, mp)
        lens = jnp.full((b,), 21, jnp.int32)
        q = jnp.ones((b * qlen, heads, 576), jnp.bfloat16)
        cache = jnp.ones((b * mp, ps, 576), jnp.bfloat16)
        kinds = []

        def step(q, cache, bt, lens):
            md = build_aiter_decode_metadata(
                bt, lens, page_size=ps, num_heads=heads, qlen=qlen, kv_dtype=cache.dtype,
                arch="gfx950", num_cu=8, target=Target("rocm", "gfx950", 8), return_lse=True)
            kinds.append(md.plan.route.kind)
            return jax_mla.mla_attention(q, cache, md, scale=0.1, backend="aiter",
                                         return_lse=True)

        lowered = jax.jit(step).trace(q, cache, bt, lens).lower(lowering_platforms=("rocm",))
        text = lowered.as_text()
        hlo = lowered.compiler_ir("hlo").as_hlo_text()
        cfg = gluon_kernels.launch_config(batch=b, qlen=qlen, num_heads=heads, kv_fp8=False,
                                          kv_bytes=cache.size * 2)
        res[f"{heads},{qlen},{b}"] = dict(
            kinds=kinds, **lowered_launches(text, hlo),
            want=[list(cfg.grid)] + ([list(cfg.reduce_grid)] if cfg.num_kv_splits > 1 else []))
print(json.dumps(res))
"""


@needs_rocm_compile()
def test_the_route_lowers_for_rocm_to_our_typed_ffi_calls_only(tmp_path):
    r = run_compiler_script(rocm_script(tmp_path, LOWER), timeout=900)
    entry, reduce_ = "mla_aiter_gluon_entry_kernel", "mla_aiter_gluon_reduce_entry_kernel"
    for key, kind, kernels in (("8,1,4", "gluon_decode", [entry, reduce_]),
                               ("8,2,2", "gluon_verify", [entry, reduce_]),
                               ("4,1,512", "gluon_decode", [entry])):  # one split: no reduce
        got = r[key]
        assert set(got["kinds"]) == {kind}, got
        assert got["kernels"] == kernels, (key, got)
        assert got["targets"] == [ffi_launch.TARGET_NAME] * len(kernels), (key, got)
        assert got["typed"] == [f'"{ffi_launch.TARGET_NAME}" typed'] * len(kernels), (key, got)
        assert all(got["elf"]), (key, got)
        assert got["lowered_target"] == ["gfx950"] * len(kernels), (key, got)
        assert got["grid"] == got["want"], (key, got)
        assert got["threads"] == [256, 512][:len(kernels)], (key, got)  # 4 / 8 wave64 warps
        assert got["callbacks"] == 0, (key, got)
