"""AITER's fp8 PS prefill through jax_mla's own FFI launcher (``native_prefill.py``,
``ffi/aiter_asm.cc``), on a CPU host.

Checked here: the library's argument block equals the module's table (AITER's ``PsKernelArgs`` at
the pinned commit); the CPU twin packs what a NumPy model of the struct predicts from the
operands (pointers opaque: nonzero and distinct, null where a scale is absent) with AITER's
grid and 512 threads, and refuses bad operands by name; AITER's kernel lookup in a fake
install's table; a ``.co`` of another argument layout refused; the route's jnp around the kernel
(head padding, the device-side plan, the partial merge) against the float64 oracle with the
kernel emulated by the stand-in's torch ``mla_prefill_ps_asm_fwd`` on NaN-poisoned buffers, with
tiles that split; a jitted fp8 prefill lowered for ``("rocm",)`` to the typed call with no
Python callback; the bridge used, and said once, without the handlers. Nothing here launches the
kernel: that needs a gfx950.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_aiter_kernel_set import PINNED_CSV
from test_aiter_native import _aiter_args, _fake_aiter, code_object
from test_aiter_native import _unpack as _unpack_block

from jax_mla.backends import aiter as aiter_backend
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter import native, native_prefill, ps_planner
from jax_mla.problem import Target

import oracle
from aiter_standin.harness import forced_standins
from lowering import custom_call_targets, one_typed_call

pytestmark = pytest.mark.skipif(native_prefill.library_error() is not None,
                                reason=f"FFI library: {native_prefill.library_error()}")

PS_KERNELS = {True: "_ZN5aiter40mla_pfl_qh192_vh128_m32x8_n128x1_causal1E",
              False: "_ZN5aiter40mla_pfl_qh192_vh128_m32x8_n128x1_causal0E"}


def _ps_args(extra=()):
    """The ``.args`` a PS prefill code object declares: one per field, then ``pad``s."""
    return _aiter_args(extra, native_prefill.KERNEL_ARGS_LAYOUT)


@pytest.fixture
def fake_aiter(tmp_path, monkeypatch):
    """Both pinned kernel tables; the PS prefill ``.co`` files declare the PS argument block."""
    root = _fake_aiter(tmp_path / "hsa", "gfx950", PINNED_CSV["gfx950"])
    _fake_aiter(root, "gfx942", PINNED_CSV["gfx942"])
    for name in PS_KERNELS.values():
        co = name[len("_ZN5aiter40"):-1] + ".co"
        (root / "gfx950" / "mla" / co).write_bytes(code_object({name: _ps_args()}))
    monkeypatch.setenv("AITER_ASM_DIR", str(root))
    return root


# --- the library and the argument block -------------------------------------------------------

def test_library_layout_is_aiters_ps_kernel_args():
    want = {n: o for n, o, _ in native_prefill.KERNEL_ARGS_LAYOUT}
    assert native_prefill.library_layout() == want | {"size": 304}
    native_prefill.check_library_layout()
    native_prefill.register()
    native_prefill.register()  # idempotent
    assert {(native_prefill.TARGET_NAME, "ROCM"),
            (native_prefill.TARGET_NAME, "cpu")} <= native._registered


def _unpack(b: np.ndarray):
    return _unpack_block(b, native_prefill.KERNEL_ARGS_LAYOUT, native_prefill.KERNEL_ARGS_SIZE)


CHOICE = native.KernelChoice("_ZN5aiter3fooE", "/nonexistent/foo.co", 0, 0, ())
F8 = jnp.float8_e4m3fn


def _ps_operands(rng, t=40, h=16, tk=40, cus=6, works=9):
    q = jnp.asarray(rng.standard_normal((t, h, 192)), jnp.float32).astype(F8)
    k = jnp.asarray(rng.standard_normal((tk, h, 192)), jnp.float32).astype(F8)
    v = jnp.asarray(rng.standard_normal((tk, h, 128)), jnp.float32).astype(F8)
    qo = jnp.asarray([0, 25, t], jnp.int32)
    kvi = jnp.arange(tk - 3, dtype=jnp.int32)
    wp = jnp.asarray(np.linspace(0, works, cus + 1).astype(np.int32))
    wi = jnp.zeros((works, 8), jnp.int32)
    return q, k, v, qo, qo, kvi, wp, wi


@pytest.mark.parametrize("scales", [True, False])
def test_packing_matches_a_numpy_model(rng, scales):
    ops = _ps_operands(rng)
    sc = dict(q_scale=0.5, k_scale=2.0, v_scale=0.25) if scales else {}

    @jax.jit
    def run(*ops):
        return native_prefill.stage1(*ops, choice=CHOICE, scale=0.072, rows=512, pack=True,
                                     **sc)

    res = run(*ops)
    assert [r.shape for r in res[:3]] == [(40, 16, 128), (512, 16, 128), (512, 16)]
    f, launch = _unpack(np.asarray(res[-1]))
    assert f["scalar"] == np.float32(0.072)
    assert (f["num_q_tokens"], f["num_head_q"], f["num_page"], f["num_used_page"]) == (
        40, 16, 40, 37)
    ptrs = ["ptr_Q", "ptr_K", "ptr_V", "ptr_O", "ptr_PartialO", "ptr_PartialLSE",
            "ptr_WorkIndptr", "ptr_WorkInfo", "ptr_KVPageIndices", "ptr_QOIndptr",
            "ptr_KVIndptr"]
    scale_ptrs = ["ptr_QScale", "ptr_KScale", "ptr_VScale"]
    vals = [int(f[p]) for p in ptrs + (scale_ptrs if scales else [])]
    assert all(vals), dict(zip(ptrs, vals))
    # qo and kv indptr are the same array here: XLA may hand both operands one buffer
    assert len(set(vals)) >= len(vals) - 1
    if not scales:
        assert all(int(f[p]) == 0 for p in scale_ptrs)
    assert launch == (6, 1, 1, 512, 1, 1)  # one workgroup of 8 wave64 per CU of the plan


@pytest.mark.parametrize("what,change,match", [
    ("q", lambda o: (o[0].astype(jnp.bfloat16),) + o[1:], "q must be float8_e4m3"),
    ("v", lambda o: o[:2] + (o[2][:, :8],) + o[3:], r"v .* must have k's tokens and heads"),
    ("work_info", lambda o: o[:7] + (o[7][:, :7],), r"work_info \[works, 8\]"),
    ("kv_indptr", lambda o: o[:4] + (o[4][:2],) + o[5:], "qo_indptr and kv_indptr"),
])
def test_packing_refuses_bad_operands(rng, what, change, match):
    ops = change(_ps_operands(rng))
    with pytest.raises(Exception, match=match):
        jax.jit(lambda *o: native_prefill.stage1(*o, choice=CHOICE, scale=0.1, rows=256,
                                                 pack=True))(*ops)


# --- kernel lookup ----------------------------------------------------------------------------

def test_kernel_selection_follows_aiters_lookup(fake_aiter):
    table = native.kernel_table("gfx950")
    for causal, name in PS_KERNELS.items():
        c = native_prefill.select_kernel(table, causal=causal)
        assert c.kernel_name == name and c.co_path.endswith(name[len("_ZN5aiter40"):-1] + ".co")
    with pytest.raises(NotImplementedError, match="no fp8 PS prefill kernel"):
        native_prefill.select_kernel(table, causal=True, gqa=16)
    assert native_prefill.unavailable_reason("gfx950") is None
    assert "gfx950" in native_prefill.unavailable_reason("gfx942")


def test_a_code_object_of_another_layout_is_refused(fake_aiter):
    name = PS_KERNELS[True]
    co = fake_aiter / "gfx950" / "mla" / (name[len("_ZN5aiter40"):-1] + ".co")
    co.write_bytes(code_object({name: _ps_args([("new_field", 0x130, 4)])}))
    reason = native_prefill.unavailable_reason("gfx950")
    assert reason is not None and "outside the argument block" in reason and "304 bytes" in reason


# --- the route around the kernel, with the kernel emulated ------------------------------------

def _emulated_stage1(q, k, v, qo, kvp, kvi, wp, wi, *, choice, scale, rows, q_scale, k_scale,
                     v_scale, pack=False):
    """The stand-in's torch kernel on NaN-poisoned buffers (eager: concrete arrays)."""
    import torch

    from aiter_standin.aiter.ops.attention import mla_prefill_ps_asm_fwd

    def t(x):
        x = np.asarray(x)
        if x.dtype == jnp.float8_e4m3fn:
            return torch.from_numpy(x.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(x.copy())

    out = torch.full((q.shape[0], q.shape[1], 128), float("nan"), dtype=torch.bfloat16)
    po = torch.full((rows, q.shape[1], 128), float("nan"))
    pl = torch.full((rows, q.shape[1]), float("nan"))
    s = [torch.tensor([float(x)]) for x in (q_scale, k_scale, v_scale)]
    mla_prefill_ps_asm_fwd(t(q), t(k), t(v), t(qo), t(kvp), t(kvi), t(wp), t(wi), 256, scale,
                           True, po, pl, out, *s)
    return (jnp.asarray(out.float().numpy()).astype(jnp.bfloat16), jnp.asarray(po.numpy()),
            jnp.asarray(pl.numpy()))


@pytest.mark.parametrize("heads,lens", [(16, [300, 5, 40]), (12, [600, 70])])
def test_native_prefill_around_an_emulated_kernel_matches_the_oracle(rng, fake_aiter,
                                                                     monkeypatch, heads, lens):
    from test_prefill_oracle import varlen_attention

    with forced_standins() as enter:
        enter(arch="gfx950", cu_num=4)
        monkeypatch.setattr(native_prefill, "stage1", _emulated_stage1)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t = int(cu[-1])
        q, k = (jnp.asarray(rng.standard_normal((t, heads, 192)), jnp.bfloat16)
                for _ in range(2))
        v = jnp.asarray(rng.standard_normal((t, heads, 128)), jnp.bfloat16)
        scale = 192 ** -0.5
        out = native_prefill.fp8_prefill(q, k, v, jnp.asarray(cu), max_query_len=max(lens),
                                         scale=scale, arch="gfx950")
    hp = caps.fp8_prefill_num_heads(heads)
    plan = ps_planner.plan_ps_prefill(jnp.asarray(cu), num_heads=hp, max_qlen=max(lens),
                                      arch="gfx950")  # gfx950's 256 CUs: tiles split
    assert int(plan.reduce_indptr[-1]) >= 2, "no tile split: the merge is not exercised"
    f8 = caps.fp8_dtype("gfx950")
    q8, k8, v8 = (np.asarray(jnp.asarray(x).astype(f8).astype(jnp.float32)) for x in (q, k, v))
    want, _ = varlen_attention(q8, k8, v8, cu, cu, scale=scale, causal=True)
    got = np.asarray(out.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16 and out.shape == (t, heads, 128)
    assert np.isfinite(got).all()
    assert oracle.rel_err(got, want) < 1e-2


# --- lowering for ROCm --------------------------------------------------------------------------

def _lower_prefill(heads=16):
    t = 40
    q = jnp.ones((t, heads, 192), jnp.bfloat16)
    v = jnp.ones((t, heads, 128), jnp.bfloat16)
    cu = jnp.asarray([0, 30, 38], jnp.int32)
    be = aiter_backend.AiterBackend()
    cfg = aiter_backend.AiterPrefillConfig(kv_cache_fp8=True, arch="gfx950")

    def step(q, k, v, cu):
        return be.prefill(q, k, v, cu, None, scale=0.07, causal=True,
                          target=Target("rocm", "gfx950", 256), max_seqlen=30, max_seqlen_k=30,
                          config=cfg, return_lse=False)[0]

    lowered = jax.jit(step).trace(q, q, v, cu).lower(lowering_platforms=("rocm",))
    return lowered.as_text(), lowered.compiler_ir("hlo").as_hlo_text()


@pytest.mark.parametrize("heads", [16, 12])
def test_fp8_prefill_lowers_to_the_native_call_with_no_python_callback(aiter_on_rocm, fake_aiter,
                                                                        heads):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        text, hlo = _lower_prefill(heads)
    line = one_typed_call(text, hlo, native_prefill.TARGET_NAME)
    assert str(fake_aiter) in line and PS_KERNELS[True] in line


def test_without_the_handlers_the_bridge_is_used_and_said_once(aiter_on_rocm, fake_aiter,
                                                               monkeypatch):
    monkeypatch.setattr(native_prefill, "library_error",
                        lambda: "jax_mla's FFI library lacks JaxMlaAiterPsPrefillExecuteRocm")
    with pytest.warns(RuntimeWarning, match="Python bridge.*lacks JaxMlaAiterPsPrefill") as rec:
        texts = [_lower_prefill(16)[0], _lower_prefill(12)[0]]
    assert sum("Python bridge" in str(w.message) for w in rec) == 1
    for text in texts:
        calls = custom_call_targets(text)
        assert native_prefill.TARGET_NAME not in calls and any("callback" in c for c in calls)


def test_doctor_says_how_the_fp8_prefill_runs_on_rocm(fake_aiter):
    from jax_mla import doctor

    rows = {r["check"]: r for r in doctor._launcher_checks(Target("rocm", "gfx950", 256))}
    assert rows["AITER fp8 PS prefill via FFI"]["status"] == doctor.OK
    assert "jax_mla_aiter_asm_prefill_ps" in rows["AITER fp8 PS prefill via FFI"]["detail"]
    assert "AITER Gluon decode via FFI" in rows
    (fake_aiter / "gfx950" / "mla" / "mla_pfl_qh192_vh128_m32x8_n128x1_causal1.co").unlink()
    rows = {r["check"]: r for r in doctor._launcher_checks(Target("rocm", "gfx950", 256))}
    row = rows["AITER fp8 PS prefill via FFI"]
    assert row["status"] == doctor.WARN and "does not exist" in row["detail"]
