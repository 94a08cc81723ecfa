"""The Gluon sm_90 decode kernel (kernels/gluon/decode_sm90.py) without a GPU.

Its numerics are checked on the H200 by the conformance suite (``test_triton_64_row_tiles_*``);
here: it compiles for sm_90 to the shape of the design, and jax-triton's compile is bridged to it.
"""

import sys
import types

import numpy as np
import pytest

from conftest import has_triton_cuda_backend, run_compiler_script

SCRIPT = r"""
import json
import os
import re
from jax_mla.backends.triton.aot import sm90_compile_report
from jax_mla.backends.triton.launch import ptxas_spills
out = {}
for name, h, q, page, hints in [("h128", 128, 1, 64, "1"), ("q4_page1", 16, 4, 1, "1"),
                                ("q2_page16", 16, 2, 16, "1"),
                                ("h128_no_l2_hints", 128, 1, 64, "0")]:
    os.environ["JAX_MLA_TRITON_L2_HINTS"] = hints
    r = sm90_compile_report(h, q, page)
    out[name] = dict(shared=r["shared"], num_warps=r["num_warps"], wgmma=r["wgmma"],
                     spills=ptxas_spills(r["ptx"]), setmaxnreg=r["ptx"].count("setmaxnreg"),
                     block_n=r["config"].block_n,
                     evict_last_stores=len(re.findall(r"st\.global[^;]*evict_last", r["ptx"])),
                     stores=len(re.findall(r"st\.global", r["ptx"])))
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_sm90_kernel_compiles_to_its_design():
    from jax_mla.backends.triton.plan import gluon_available as _gluon_available

    if not _gluon_available():
        pytest.skip("this triton's Gluon lacks the sm_90 kernel's API")
    r = run_compiler_script(SCRIPT, timeout=600)
    for name, k in r.items():
        # Two warpgroups: 4 compiled warps plus a 4-warp worker partition, registers rebalanced.
        assert k["num_warps"] == 8 and k["setmaxnreg"] > 0, (name, k)
        # Q (72 KB) and two 64-token KV tiles (72 KB each) and the exchange buffers fit.
        assert 216 * 1024 < k["shared"] <= 227 * 1024, (name, k)
        # Each warpgroup: Q @ K^T of its own tile, n = 64 (576 / 16 = 36 k-steps), and P @ V for
        # both tiles of a pair on its 256 columns (64 / 16 = 4 k-steps each).
        assert k["wgmma"] == {"m64n64k16": 2 * 36, "m64n256k16": 2 * 2 * 4}, (name, k)
        assert k["block_n"] == 128  # the schedule hands out pairs of tiles
        if k["spills"] is not None:
            assert k["spills"] == 0, (name, k)
    # Split partials are stored evict_last (kept in L2 for the reduce), the final output is not;
    # JAX_MLA_TRITON_L2_HINTS=0 drops the hint.
    for name in ("h128", "q4_page1", "q2_page16"):
        assert 0 < r[name]["evict_last_stores"] < r[name]["stores"], (name, r[name])
    assert r["h128_no_l2_hints"]["evict_last_stores"] == 0 < r["h128_no_l2_hints"]["stores"]


FP8_SCRIPT = r"""
import json
from jax_mla.backends.triton.aot import sm90_compile_report
from jax_mla.backends.triton.compiler import ptxas_stats
from triton.backends.compiler import GPUTarget
out = {}
for name, h, q, page, kv in [("h128", 128, 1, 64, "fp8e4nv"), ("q5_page16", 16, 5, 16, "fp8e4nv"),
                             ("h32_q2_page1_e5m2", 32, 2, 1, "fp8e5")]:
    r = sm90_compile_report(h, q, page, fp8=kv)
    out[name] = dict(shared=r["shared"], num_warps=r["num_warps"], wgmma=r["wgmma"],
                     setmaxnreg=r["ptx"].count("setmaxnreg"), block_n=r["config"].block_n,
                     f16_cvt=r["ptx"].count("cvt.rn.f16x2.e"),
                     **ptxas_stats(r["ptx"], GPUTarget("cuda", 90, 32)))
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_sm90_fp8_kernel_compiles_to_its_design():
    """The fp8 kernel (``decode_sm90_fp8.py``): fp8 wgmma scores (k = 32), float16 ``P @ V``
    from the converted halves of ``V``, in about 189 KiB, with no spills under this triton's
    ptxas (the Triton 64-row fp8 tile spills under triton 3.9's)."""
    from jax_mla.backends.triton.plan import gluon_available as _gluon_available

    if not _gluon_available():
        pytest.skip("this triton's Gluon lacks the sm_90 kernel's API")
    r = run_compiler_script(FP8_SCRIPT, timeout=600)
    for name, k in r.items():
        assert k["num_warps"] == 8 and k["setmaxnreg"] > 0, (name, k)
        # fp8 Q (36 KiB), two fp8 KV tiles (72), two float16 V halves (64), two float16 P
        # buffers (16) and the exchange vectors.
        assert 188 * 1024 < k["shared"] <= 192 * 1024, (name, k)
        # Each warpgroup: Q @ K^T of its own tile in fp8 (576 / 32 = 18 k-steps), and P @ V
        # for both tiles on its 256 columns in float16 (64 / 16 = 4 k-steps each).
        assert k["wgmma"] == {"m64n64k32": 2 * 18, "m64n256k16": 2 * 2 * 4}, (name, k)
        assert k["f16_cvt"] > 0, (name, k)  # the cache's V halves, in one instruction a pair
        assert k["block_n"] == 128
        assert k["spills"] == 0 and k["registers"] <= 255, (name, k)


SPLIT_SCRIPT = r"""
import json
from jax_mla.backends.triton.aot import sm90_compile_report
from jax_mla.backends.triton.compiler import ptxas_stats
from triton.backends.compiler import GPUTarget
out = {}
for name, h, q, page, kv, query in [("h128", 128, 1, 64, "fp8e4nv", "bf16"),
                                    ("h16_q4_page16_f16", 16, 4, 16, "fp8e4nv", "fp16"),
                                    ("h32_q2_page1_e5m2", 32, 2, 1, "fp8e5", "bf16")]:
    r = sm90_compile_report(h, q, page, fp8=kv, query=query)
    ptx = r["ptx"]
    out[name] = dict(shared=r["shared"], num_warps=r["num_warps"], wgmma=r["wgmma"],
                     e4m3_from_f32=ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                     mixed=ptx.count(".e4m3.e5m2"),
                     **ptxas_stats(ptx, GPUTarget("cuda", 90, 32)))
print(json.dumps(out))
"""


def test_split_query_e4m3_is_exact_to_its_bound(rng):
    """``split_query_e4m3`` (XLA, before the split-query kernel): ``s * (hi + lo)`` gives each
    bf16 row back within ``2^-16`` of its largest magnitude (exactly where an element is at
    least ``2^-8`` of it) and each float16 row (11 significant bits, of which the parts hold 8)
    within ``2^-8``, for rows of very different sizes; ``s`` is a power of two; the low part is
    not all zeros; a zero row gives zeros, a row holding an infinity or a NaN the scale NaN."""
    import re

    import jax
    import jax.numpy as jnp

    from jax_mla.backends.triton.decode import split_query_e4m3

    for dtype, bound in ((jnp.bfloat16, 2.0 ** -16), (jnp.float16, 2.0 ** -8)):
        x = rng.standard_normal((4, 6, 576)).astype(np.float32) * 3.0
        x[0, 1] *= 2.0 ** -12
        x[1, 2] *= 2.0 ** 9
        x[2, 3] = 0.0
        x[3, 4, 5] = np.inf
        x[3, 5, 7] = np.nan
        q = jnp.asarray(x, dtype)
        parts, scales = jax.jit(split_query_e4m3)(q)
        assert parts.dtype == jnp.float8_e4m3fn and parts.shape == (4, 6, 2 * 576)
        assert scales.dtype == jnp.float32 and scales.shape == (24,)
        p = np.asarray(parts).astype(np.float32)
        s = np.asarray(scales).reshape(4, 6)
        qf = np.asarray(q, np.float32)
        bad = ~np.isfinite(qf).all(-1)
        assert np.isnan(s[bad]).all() and np.isfinite(s[~bad]).all()
        assert np.all(np.frexp(s[~bad])[0] == 0.5), s  # powers of two
        back = s[..., None] * (p[..., :576] + p[..., 576:])
        amax = np.abs(qf).max(-1)
        err = np.abs(back - qf).max(-1)
        assert np.all(err[~bad] <= bound * amax[~bad]), (dtype, err, amax)
        assert np.mean(p[..., 576:] != 0) > 0.5  # the low part carries the rest
        if dtype == jnp.bfloat16:
            big = np.abs(qf) >= 2.0 ** -8 * amax[..., None]
            assert np.all((back == qf)[big & ~bad[..., None]])
        assert np.all(back[2, 3] == 0.0)
    # No float8 value is converted back inside the split: XLA's GPU pipeline folds a
    # f32 -> f8 -> f32 chain to the identity (excess precision allowed), which zeroed the low
    # part on an H100; this CPU run would not show it.
    text = jax.jit(split_query_e4m3).lower(q).as_text()
    assert not re.search(r"convert .*f8E4M3FN>\) -> tensor<[^>]*xf32>", text), text


def _split_rows(rng, dtype, t=5, h=7, d=576):
    """Query rows for the split: normal rows of very different sizes, a zero row, a row of tiny
    values (under e4m3's normal range once scaled), values at rounding ties and at the flush
    boundary (both signs), and a row holding an infinity and one holding a NaN."""
    import jax.numpy as jnp

    x = rng.standard_normal((t, h, d)).astype(np.float32) * 3.0
    x[0, 1] *= 2.0 ** -12
    x[1, 2] *= 2.0 ** 9
    x[2, 3] = 0.0
    x[2, 4] = rng.standard_normal(d) * 2.0 ** -20
    x[2, 4, 0] = 1.0
    # Scaled by 2^6 (the row's max is 1.0 -> 64): 1.0625 * 2^-6 / 64 sits on a tie of e4m3's
    # mantissa, 0.99 * 2^-6 / 64 rounds up to its smallest normal, 0.9 * 2^-6 / 64 is flushed
    # (its sign kept), 1.0 * 2^-6 / 64 is that normal.
    x[2, 5, :] = rng.standard_normal(d) * 2.0 ** -8
    x[2, 5, 0] = 1.0
    x[2, 5, 1:9] = np.array([1.0625, -1.0625, 0.99, -0.99, 0.9, -0.9, 1.0, 1.1875]) * 2.0 ** -12
    x[3, 4, 5] = np.inf
    x[3, 5, 7] = np.nan
    x[4, 6] = -np.abs(x[4, 6])
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("lead", [1, 2])
def test_the_split_kernel_gives_the_xla_split_bit_for_bit(rng, dtype, lead):
    """``decode.split_query_kernel`` (one Triton kernel, run here by the interpreter): the parts
    of every finite row equal ``split_query_e4m3``'s bit for bit (signed zeros included), the
    scales follow the leading ones unchanged, and a row holding an infinity or a NaN gets the
    scale NaN. 35 rows: the last program holds three rows and one masked one."""
    import jax
    import jax.numpy as jnp

    from jax_mla.backends.triton.decode import split_query_e4m3, split_query_kernel

    q = _split_rows(rng, getattr(jnp, dtype))
    first = jnp.asarray(rng.uniform(0.5, 2.0, lead), jnp.float32)
    parts, scales = jax.jit(lambda q, f: split_query_kernel(q, f, target="cpu",
                                                            launcher=None))(q, first)
    want_parts, want_s = jax.jit(split_query_e4m3)(q)
    assert parts.dtype == jnp.float8_e4m3fn and parts.shape == want_parts.shape
    assert scales.shape == (lead + 35,) and scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(scales[:lead]), np.asarray(first))
    got_s, want_s = np.asarray(scales[lead:]), np.asarray(want_s)
    bad = ~np.isfinite(np.asarray(q, np.float32)).all(-1).reshape(-1)
    assert bad.sum() == 2 and np.isnan(got_s[bad]).all()
    np.testing.assert_array_equal(got_s[~bad], want_s[~bad])
    bits = np.asarray(parts).view(np.uint8).reshape(35, -1)
    want_bits = np.asarray(want_parts).view(np.uint8).reshape(35, -1)
    np.testing.assert_array_equal(bits[~bad], want_bits[~bad])
    # The edge row's low parts are not all zeros, and its flushed values kept their sign.
    row = 2 * 7 + 5
    assert (bits[row, 576:] != 0).mean() > 0.3
    assert list(bits[row, 1:9]) == [0x08, 0x88, 0x08, 0x88, 0x00, 0x80, 0x08, 0x0A], bits[row]


def test_the_split_kernel_is_chosen_by_its_knob(monkeypatch):
    """``TritonTuning.split_q_kernel`` (``JAX_MLA_TRITON_SPLIT_Q_KERNEL``) is on by default and
    read from the environment."""
    from jax_mla.backends.triton.plan import TritonTuning

    monkeypatch.delenv("JAX_MLA_TRITON_SPLIT_Q_KERNEL", raising=False)
    assert TritonTuning().split_q_kernel and TritonTuning.from_env().split_q_kernel
    monkeypatch.setenv("JAX_MLA_TRITON_SPLIT_Q_KERNEL", "0")
    assert not TritonTuning.from_env().split_q_kernel


def test_the_split_accumulator_is_chosen_by_its_knob(monkeypatch):
    """``TritonTuning.split_acc`` (``JAX_MLA_TRITON_SPLIT_ACC``) is off by default and read
    from the environment (its answer is checked on Hopper in ``test_conformance.py``)."""
    from jax_mla.backends.triton.plan import TritonTuning

    monkeypatch.delenv("JAX_MLA_TRITON_SPLIT_ACC", raising=False)
    assert not TritonTuning().split_acc and not TritonTuning.from_env().split_acc
    monkeypatch.setenv("JAX_MLA_TRITON_SPLIT_ACC", "1")
    assert TritonTuning.from_env().split_acc


SPLIT_KERNEL_SCRIPT = r"""
import json
import jax.numpy as jnp
from jax_mla.backends.triton import compiler, ffi_launch
from jax_mla.kernels.triton import split_query
from jax_mla.problem import Target
out = {}
for rows in (16 * 4, 128 * 128):
    _, cfg = split_query.launch_config(rows, 576)
    for dtype in ("bfloat16", "float16"):
        kb = ffi_launch.compile_kernel(split_query.mla_split_query_e4m3_kernel,
                                       [jnp.dtype(dtype), jnp.float32, jnp.float8_e4m3fn,
                                        jnp.float32], dict(cfg, N_LEAD=1),
                                       Target("cuda", "sm_90", 132), num_warps=4, num_stages=1)
        out[f"{rows}/{dtype}"] = dict(shared=kb.shared, threads=kb.threads, cubin=len(kb.binary))
from triton.compiler.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import triton
src = ASTSource(split_query.mla_split_query_e4m3_kernel,
                {"q_ptr": "*bf16", "lead_ptr": "*fp32", "parts_ptr": "*fp8e4nv",
                 "scales_ptr": "*fp32", "ROWS": "constexpr", "D": "constexpr",
                 "BLOCK_D": "constexpr", "ROWS_PER_PROGRAM": "constexpr", "N_LEAD": "constexpr"},
                constexprs={"ROWS": 16384, "D": 576, "BLOCK_D": 1024, "ROWS_PER_PROGRAM": 4,
                            "N_LEAD": 1})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4,
                                                                         num_stages=1))
stats = compiler.ptxas_stats(k.asm["ptx"], GPUTarget("cuda", 90, 32))
ptx = k.asm["ptx"]
out["ptxas"] = stats
out["cvt_e4m3"] = ptx.count("e4m3x2")
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_the_split_kernel_compiles_for_sm90_without_spills():
    """The split kernel compiles for sm_90 through the FFI launcher's compile (both query
    dtypes, a small and a large row count), with no shared memory to speak of, no spills
    under this Triton's ptxas, and hardware fp8 conversions."""
    r = run_compiler_script(SPLIT_KERNEL_SCRIPT, timeout=600)
    for key in ("64/bfloat16", "64/float16", "16384/bfloat16", "16384/float16"):
        assert r[key]["threads"] == 128 and r[key]["cubin"] > 0, r
    stats = r["ptxas"]
    assert stats["spills"] == 0 and stats["scratch"] == 0 and stats["registers"] <= 128, stats
    assert r["cvt_e4m3"] > 0, r


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_sm90_split_query_kernel_compiles_to_its_design():
    """The fp8 kernel with a 16-bit query (``SPLIT_Q``): the query's two e4m3 parts doubled in
    shared memory (72 KiB, about 225.3 KiB in all, under sm_90's 227 KiB a block), twice the
    fp8 score products (hi and lo parts against the same tile), e4m3 x e5m2 products for an
    e5m2 cache, and nothing converted to e4m3 in the kernel (XLA splits the query:
    ``split_query_e4m3``). It spills under this Triton exactly where the table of the plan's
    default says so (``plan.SPLIT_Q_TRITON``: a Triton that stops spilling it belongs in the
    table, one that starts must leave it), and never inside its KV loops (under triton 3.9 the
    plan takes it in place of the Triton 64-row tile, which spills there)."""
    from jax_mla.backends.triton.plan import SPLIT_Q_TRITON, triton_release
    from jax_mla.backends.triton.plan import gluon_available as _gluon_available

    if not _gluon_available():
        pytest.skip("this triton's Gluon lacks the sm_90 kernel's API")
    r = run_compiler_script(SPLIT_SCRIPT, timeout=600)
    for name, k in r.items():
        assert k["num_warps"] == 8, (name, k)
        assert 224 * 1024 < k["shared"] <= 227 * 1024, (name, k)
        assert k["wgmma"] == {"m64n64k32": 2 * 2 * 18, "m64n256k16": 2 * 2 * 4}, (name, k)
        assert k["e4m3_from_f32"] == 0, (name, k)
        assert (k["mixed"] > 0) == name.endswith("e5m2"), (name, k)
        assert k["registers"] <= 255, (name, k)
    spill_free = all(k["spills"] == 0 for k in r.values())
    assert spill_free == (triton_release() in SPLIT_Q_TRITON), (triton_release(), r)
    assert all(k.get("loop_spills", 0) == 0 for k in r.values()), r


def test_jax_triton_bridge_compiles_gluon_kernels_and_restores(monkeypatch):
    """``_compile_gluon`` on a stand-in of jax-triton's ``triton_lib`` (jax-triton cannot be
    imported without a GPU jaxlib): the Gluon source class, the Gluon IR entry, the stage swap
    and the launch's total warps are what reach the compile, and the module is restored."""
    from jax_mla.backends.triton import compiler as triton_ttgir

    calls = {}

    class Backend:
        target = "sm90-target"

        def make_ttir(self, mod, md, opt, cap):
            raise AssertionError("TTIR passes must be skipped for Gluon")

        def make_ttgir(self, mod, md, opt, cap):
            raise AssertionError("make_ttgir must be replaced by gluon_to_ttgir")

        def gluon_to_ttgir(self, mod, md, opt, cap):
            calls["gluon_to_ttgir"] = mod
            return mod + ":ttgir"

        def make_llir(self, mod, md, opt, cap):
            md["num_warps"] = 8  # what triton writes for a warp-specialized kernel
            return mod + ":llir"

    class Src:
        def __init__(self, fn, constexprs=None, signature=None, attrs=None):
            self.fn = fn

        def make_ir(self, target, options, codegen_fns, module_map, context):
            calls["make_ir"] = target
            return "ir"

    tc = types.SimpleNamespace(ASTSource="triton-ASTSource")
    code_gen = types.SimpleNamespace(ast_to_ttir=None)
    kcl = types.SimpleNamespace(TritonKernel=lambda *a: ("kernel",) + a)

    def get_or_create(backend_init_func, platform, fn, *, num_warps, metaparams):
        be = backend_init_func(0, 90)
        src = lib.tc.ASTSource(fn, constexprs={}, signature={}, attrs={})
        mod = lib.code_gen.ast_to_ttir(fn, src, options=None, codegen_fns=None, context=None,
                                       module_map=None)
        md = {}
        mod = be.make_ttgir(be.make_ttir(mod, md, None, 90), md, None, 90)
        be.make_llir(mod, md, None, 90)
        return lib.triton_kernel_call_lib.TritonKernel("k", num_warps, 0), "attrs"

    lib = types.SimpleNamespace(tc=tc, code_gen=code_gen, triton_kernel_call_lib=kcl)
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_lib=lib))
    gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
    monkeypatch.setattr(gluon_runtime, "GluonASTSource", Src)
    kernel, attrs = triton_ttgir._compile_gluon(get_or_create, lambda d, c: Backend(), "cuda",
                                                "fn", num_warps=4, metaparams={})
    assert kernel == ("kernel", "k", 8, 0) and attrs == "attrs"
    assert calls == {"make_ir": "sm90-target", "gluon_to_ttgir": "ir"}
    assert (lib.tc, lib.code_gen, lib.triton_kernel_call_lib) == (tc, code_gen, kcl)
    with pytest.raises(RuntimeError):
        triton_ttgir._compile_gluon(lambda *a, **k: (_ for _ in ()).throw(RuntimeError()),
                                    None, "cuda", "fn", metaparams={})
    assert (lib.tc, lib.code_gen, lib.triton_kernel_call_lib) == (tc, code_gen, kcl)


def test_split_probe_variants_have_the_answers_they_claim(rng):
    """``bench.split_probe``'s made parts: each variant's ``s' (a + b)`` is the high part's
    product (``hi_*``, ``zero_hi``), up to the sixteenths' rounding for ``hi_hi16``, or the low
    part's (``lo_zero``, ``zero_lo``), in the buffer order the variant names."""
    import jax.numpy as jnp

    from jax_mla.backends.triton.decode import split_query_e4m3
    from jax_mla.bench.split_probe import _variants

    q = jnp.asarray(rng.standard_normal((3, 4, 576)), jnp.bfloat16)
    parts, s = split_query_e4m3(q)
    p = np.asarray(parts).astype(np.float32)
    s = np.asarray(s).reshape(3, 4, 1)
    hi, lo = s * p[..., :576], s * p[..., 576:]
    want = {"real": hi + lo, "hi_zero": hi, "zero_hi": hi, "hi_hi_half": hi, "hi_hi16": hi,
            "lo_zero": lo, "zero_lo": lo, "real_acc2": hi + lo}
    variants = _variants(split_query_e4m3)
    assert set(variants) == set(want)
    for name, fn in variants.items():
        vp, vs = fn(q)
        vp = np.asarray(vp).astype(np.float32)
        got = np.asarray(vs).reshape(3, 4, 1) * (vp[..., :576] + vp[..., 576:])
        tol = 2.0 ** -4 * np.abs(hi).max() if name == "hi_hi16" else 0.0
        assert np.max(np.abs(got - want[name])) <= tol, name
        first_zero = not np.any(vp[..., :576])
        assert first_zero == name.startswith("zero_"), name


def test_split_probe_refuses_a_plan_without_the_gluon_kernel(rng):
    """``bench.split_probe`` plans its step for the Gluon fp8 kernel with the split forced and
    stops, saying so, where the plan takes another kernel (here, off Hopper): its first run had
    planned without the dtypes, and nothing it swapped in reached the kernel."""
    import dataclasses

    import jax.numpy as jnp

    from jax_mla.bench.decode import Shape, make_inputs
    from jax_mla.bench.split_probe import CASES, split_metadata

    shape = dataclasses.replace(Shape.parse(CASES[0]), varlen=True)
    qb, kv, table, lens, _ = make_inputs(shape, rng)
    assert kv.dtype == jnp.float8_e4m3fn and qb.dtype == jnp.bfloat16
    with pytest.raises(SystemExit, match="not the Gluon fp8 kernel"):
        split_metadata(table, lens, shape, qb.dtype, kv.dtype)
