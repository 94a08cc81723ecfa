"""AITER's asm MLA decode through jax_mla's own FFI launcher (``ffi/aiter_asm.cc``,
``jax_mla/backends/aiter/native.py``), on a CPU host.

Checked here: the library carries and registers the handlers; the argument block's layout in the
compiled library equals native.py's table (and AITER's at the pinned commit); the CPU twin packs
exactly what a NumPy model of the struct predicts from the operands (pointers opaque: nonzero,
distinct, or null where AITER passes null); AITER's kernel-selection rules; the code-object
check (synthetic ``.co`` files carrying only an AMDGPU metadata note); a fake AITER tree (a
kernel table and such ``.co`` files) routes a jitted decode lowered for ``("rocm",)`` to the
``jax_mla_aiter_asm_mla`` typed FFI call with no Python callback; a kernel table of another form
is refused with a message naming it; without the library the bridge is used, warned once; the
route's jnp around the kernel (folding, split merges, padding) against the oracle with the
kernel emulated in jnp; the FFI sources compiled as HIP (``ffi/hip_check.sh``).
Nothing here launches a kernel: that needs an AMD GPU.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from test_aiter_kernel_set import PINNED_CSV

import jax_mla
from jax_mla.backends.aiter import build_aiter_decode_metadata, native, native_fmha, native_prefill
from jax_mla.backends.triton import ffi_launch
from jax_mla.problem import Target

from aiter_standin.harness import forced_standins
from lowering import custom_call_targets, one_typed_call

pytestmark = pytest.mark.skipif(native.library_error() is not None,
                                reason=f"FFI library unavailable: {native.library_error()}")

# Rows of hsa/gfx950/mla/mla_asm.csv at ROCm/aiter e4048607 (the table-form checks edit these;
# the fake install below holds every row of both tables, PINNED_CSV, since routing reads them).
CSV_950 = """qType,kvType,Gqa,ps,qSeqLen,prefill,causal,lse,cprr,knl_name,co_name
bf16,bf16,16,0,1,0,1,0,0,_ZN5aiter39mla_dec_stage1_bf16_a16w16_subQ16_mqa16E,mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co
bf16,bf16,16,0,4,0,1,0,0,_ZN5aiter39mla_a16w16_qh16_m16x4_n16x1_coex0_mask1E,mla_a16w16_qh16_m16x4_n16x1_coex0_mask1.co
bf16,bf16,32,1,4,0,1,0,0,_ZN5aiter38mla_a16w16_qh32_qseqlen4_gqaratio32_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_ps.co
bf16,bf16,32,1,4,0,1,1,0,_ZN5aiter42mla_a16w16_qh32_qseqlen4_gqaratio32_lse_psE,mla_a16w16_qh32_qseqlen4_gqaratio32_lse_ps.co
bf16,bf16,64,1,1,0,1,0,0,_ZN5aiter41mla_a16w16_qh64_qseqlen1_gqaratio64_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_v3_ps.co
bf16,bf16,64,1,1,0,1,1,0,_ZN5aiter45mla_a16w16_qh64_qseqlen1_gqaratio64_lse_v3_psE,mla_a16w16_qh64_qseqlen1_gqaratio64_lse_v3_ps.co
"""


def _aiter_args(extra=(), layout=native.KERNEL_ARGS_LAYOUT):
    """The ``.args`` AITER's kernels declare: one per field of ``layout``, then ``pad``s."""
    args = []
    for name, off, kind in layout:
        size = 8 if kind == "ptr" else 4
        args.append((name, off, size))
        args += [("pad", o, 4) for o in range(off + size, off + 16, 4)]
    return args + list(extra)


def code_object(kernels: dict) -> bytes:
    """A 64-bit ELF whose only section is an ``NT_AMDGPU_METADATA`` note declaring
    ``kernels`` (``{name: [(arg, offset, size), ...]}``); no code."""
    meta = {"amdhsa.kernels": [
        {".name": k, ".symbol": k + ".kd", ".kernarg_segment_size": 384,
         ".args": [{".name": n, ".offset": o, ".size": z} for n, o, z in args]}
        for k, args in kernels.items()], "amdhsa.version": [1, 2]}
    desc = msgpack.packb(meta)
    name = b"AMDGPU\0"
    note = struct.pack("<III", len(name), len(desc), 32) + name + b"\0" + desc
    note += b"\0" * (-len(note) % 8)
    shoff = 64 + len(note)
    ident = b"\x7fELF" + bytes([2, 1, 1, 64, 2]) + b"\0" * 7
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 0xE0, 1, 0, 0, shoff, 0, 64, 0, 0, 64,
                                 2, 0)
    null = b"\0" * 64
    sect = struct.pack("<IIQQQQIIQQ", 0, 7, 0, 0, 64, len(note), 0, 0, 4, 0)
    return header + note + null + sect


def _fake_aiter(root, arch="gfx950", text=CSV_950, with_co=True):
    d = root / arch / "mla"
    d.mkdir(parents=True, exist_ok=True)
    (d / "mla_asm.csv").write_text(text)
    if with_co:
        for line in text.strip().splitlines()[1:]:
            kernel, co = line.split(",")[-2:]
            (d / co).write_bytes(code_object({kernel: _aiter_args()}))
    return root


@pytest.fixture
def fake_aiter(tmp_path, monkeypatch):
    root = _fake_aiter(tmp_path / "hsa", "gfx950", PINNED_CSV["gfx950"])
    _fake_aiter(root, "gfx942", PINNED_CSV["gfx942"])
    monkeypatch.setenv("AITER_ASM_DIR", str(root))
    return root


# --- the library ------------------------------------------------------------------------------

def test_library_registers_the_targets():
    native.register()
    native.register()  # idempotent
    assert {(native.TARGET_NAME, "ROCM"), (native.TARGET_NAME, "cpu")} <= native._registered


def test_rocm_handler_is_registered_command_buffer_compatible(monkeypatch):
    seen = {}
    monkeypatch.setattr(
        jax.ffi, "register_ffi_target",
        lambda name, fn, platform, **kw: seen.setdefault((name, platform), (fn, kw)))
    monkeypatch.setattr(native, "_registered", set())
    monkeypatch.delenv("JAX_MLA_FFI_INITIALIZE_STAGE", raising=False)
    native.register()
    native_prefill.register()
    native_fmha.register()
    for mod in (native, native_prefill, native_fmha):
        fn, kw = seen[(mod.TARGET_NAME, "ROCM")]
        assert set(fn) == {"execute"}  # loads at the first call (see ffi_launch.handler_stages)
        assert kw["traits"] == ffi_launch.command_buffer_traits()
        assert (mod.PACK_TARGET_NAME, "cpu") in seen


def test_a_traced_launch_preloads_the_code_object_on_each_rocm_device(monkeypatch):
    """Tracing an AITER launch loads its ``.co`` on every local ROCm device, once a kernel and
    device, so that no load is left for a command buffer's capture; the real library's loader
    reports a missing runtime as an error code, never a crash."""
    import types

    calls = []

    class Lib:
        def JaxMlaAiterLoadKernel(self, ordinal, co_path, name, err, size):
            calls.append((ordinal.value, co_path, name))
            return 9

    devices = [types.SimpleNamespace(id=5, local_hardware_id=1),
               types.SimpleNamespace(id=6, local_hardware_id=None)]
    monkeypatch.setattr(native, "_library", lambda: Lib())
    monkeypatch.setattr(ffi_launch, "_preloaded", set())
    monkeypatch.setattr(jax, "local_devices", lambda backend=None: devices)
    native.preload("/aiter/hsa/gfx942/mla/a.co", "mla_a")
    native.preload("/aiter/hsa/gfx942/mla/a.co", "mla_a")
    native.preload("/aiter/hsa/gfx942/mla/b.co", "mla_b")
    assert calls == [(1, b"/aiter/hsa/gfx942/mla/a.co", b"mla_a"),
                     (6, b"/aiter/hsa/gfx942/mla/a.co", b"mla_a"),
                     (1, b"/aiter/hsa/gfx942/mla/b.co", b"mla_b"),
                     (6, b"/aiter/hsa/gfx942/mla/b.co", b"mla_b")]
    # This host has no ROCm runtime: the library's own loader says so in its error text.
    import ctypes

    err = ctypes.create_string_buffer(512)
    rc = ffi_launch._library().JaxMlaAiterLoadKernel(0, b"/nowhere.co", b"k", err, 512)
    assert rc == len(err.value) + 1 and (b"ROCm runtime" in err.value  # no runtime here
                                         or b"cannot be read" in err.value), err.value


def test_library_layout_is_aiters_at_the_pinned_commit():
    native.check_library_layout()
    got = native.library_layout()
    assert got["size"] == native.KERNEL_ARGS_SIZE == 368
    # every field in its own 16-byte slot, in AITER's order
    offs = [off for _, off, _ in native.KERNEL_ARGS_LAYOUT]
    assert offs == list(range(0, 368, 16))
    assert native.AITER_COMMIT.startswith("e4048607")


# --- the CPU twin's packing -------------------------------------------------------------------

def _unpack(b: np.ndarray, layout=native.KERNEL_ARGS_LAYOUT, size=native.KERNEL_ARGS_SIZE):
    """A CPU twin's bytes: ``({field: value}, (grid xyz, block xyz))``; padding checked zero."""
    fields = {}
    for name, off, kind in layout:
        width = 8 if kind == "ptr" else 4
        dt = {"ptr": "<u8", "f32": "<f4", "u32": "<u4"}[kind]
        fields[name] = b[off:off + width].view(dt)[0]
        assert not b[off + width:off + 16].any(), f"padding after {name} is not zero"
    launch = b[size:].view("<u4")
    return fields, tuple(int(x) for x in launch)


CHOICE = native.KernelChoice("_ZN5aiter3fooE", "/nonexistent/foo.co", 128, 16, ())


def _operands(t=6, h=16, d=576, pages=40, batch=3, q_dt=jnp.bfloat16, kv_dt=jnp.bfloat16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32).astype(q_dt)
    kv = jnp.asarray(rng.standard_normal((pages, 1, 1, d)), jnp.float32).astype(kv_dt)
    qo = jnp.arange(batch + 1, dtype=jnp.int32) * (t // batch)
    kvp = jnp.asarray([0, 7, 20, 33], jnp.int32)[:batch + 1]
    kvi = jnp.arange(pages, dtype=jnp.int32)
    last = jnp.ones((batch,), jnp.int32)
    return q, kv, qo, kvp, kvi, last


@pytest.mark.parametrize("q_dt,kv_dt", [(jnp.bfloat16, jnp.bfloat16),
                                        (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
                                        (jnp.bfloat16, jnp.float8_e4m3fnuz)])
def test_split_kv_packing_matches_a_numpy_model(q_dt, kv_dt):
    t, h, qlen, nsplit = 6, 16, 2, 3
    ops = _operands(t=t, h=h, q_dt=q_dt, kv_dt=kv_dt)
    split_indptr = jnp.arange(0, 4 * nsplit, nsplit, dtype=jnp.int32)

    @jax.jit
    def run(*ops):
        return native.stage1(
            *ops, choice=CHOICE, scale=0.0625, max_seqlen_q=qlen, page_size=1,
            persistent=False, split_o=jax.ShapeDtypeStruct((t, nsplit, h, 512), jnp.float32),
            split_lse=jax.ShapeDtypeStruct((t, nsplit, h, 1), jnp.float32),
            split_indptr=split_indptr, q_scale=0.5, kv_scale=2.0, pack=True)

    f, launch = _unpack(np.asarray(run(*ops)[-1]))
    q8 = jnp.dtype(q_dt).itemsize == 1
    kv8 = jnp.dtype(kv_dt).itemsize == 1
    assert f["scalar"] == np.float32(0.0625)
    assert f["s_MQA"] == CHOICE.s_mqa
    assert f["s_kv_split"] == nsplit
    assert f["s_Q_Bs"] == h * 576 * jnp.dtype(q_dt).itemsize * qlen
    assert f["s_Bs"] == 576 * jnp.dtype(kv_dt).itemsize
    assert f["s_log2_plen"] == 0
    assert f["out_16_nosplit"] == 0
    assert (f["s_cp_world_size"], f["s_cp_rank"]) == (1, 0)
    ptrs = ["ptr_R", "ptr_LSE", "ptr_Q", "ptr_KV", "ptr_LTP", "ptr_LTD", "ptr_LTL", "ptr_QTP",
            "ptr_STP"] + (["ptr_QSCALE"] if q8 else []) + (["ptr_KVSCALE"] if q8 or kv8 else [])
    vals = [int(f[p]) for p in ptrs]
    assert all(vals) and len(set(vals)) == len(vals), dict(zip(ptrs, vals))
    nulls = ["ptr_RP", "ptr_LSEP", "ptr_GKVTP"] + ([] if q8 else ["ptr_QSCALE"]) + (
        [] if q8 or kv8 else ["ptr_KVSCALE"])
    assert all(int(f[p]) == 0 for p in nulls), {p: f[p] for p in nulls}
    # AITER's split-KV grid: ceil(qlen * gqa / sub_q) x batch x splits, 256 threads
    assert launch == (-(-qlen * h // CHOICE.sub_q), 3, nsplit, 256, 1, 1)


def test_persistent_packing_points_at_the_work_metadata():
    t, h = 6, 16
    ops = _operands(t=t, h=h)
    work_indptr = jnp.asarray([0, 2, 3, 5, 5], jnp.int32)
    work_info = jnp.zeros((8, 8), jnp.int32)

    @jax.jit
    def run(*ops):
        return native.stage1(
            *ops, choice=CHOICE, scale=0.1, max_seqlen_q=1, page_size=1, persistent=True,
            split_o=jax.ShapeDtypeStruct((10, 1, h, 512), jnp.float32),
            split_lse=jax.ShapeDtypeStruct((10, 1, h, 1), jnp.float32),
            out=jax.ShapeDtypeStruct((t, h, 512), jnp.bfloat16),
            final_lse=jax.ShapeDtypeStruct((t, h), jnp.float32),
            work_indptr=work_indptr, work_info=work_info, pack=True)

    res = run(*ops)
    f, launch = _unpack(np.asarray(res[-1]))
    assert f["out_16_nosplit"] == 1 and f["s_kv_split"] == 1
    assert launch == (4, 1, 1, 256, 1, 1)  # one workgroup per CU slot: len(work_indptr) - 1
    for p in ("ptr_RP", "ptr_LSEP", "ptr_STP"):
        assert int(f[p]) != 0
    assert int(f["ptr_QSCALE"]) == int(f["ptr_KVSCALE"]) == 0
    meta = np.asarray(res[4])
    assert meta.dtype == np.uint32 and meta.shape == (4,)
    meta = meta.view("<u8")
    assert meta[0] and meta[1] and meta[0] != meta[1]


def test_packing_refuses_bad_operands():
    ops = _operands()
    with pytest.raises(Exception, match="fp8 q needs q_scale"):
        q8 = ops[0].astype(jnp.float8_e4m3fn)
        jax.jit(lambda *o: native.stage1(
            *o, choice=CHOICE, scale=0.1, max_seqlen_q=1, page_size=1, persistent=False,
            split_o=jax.ShapeDtypeStruct((6, 2, 16, 512), jnp.float32),
            split_lse=jax.ShapeDtypeStruct((6, 2, 16, 1), jnp.float32),
            split_indptr=jnp.arange(0, 8, 2, dtype=jnp.int32), pack=True))(q8, *ops[1:])


# --- kernel tables and selection --------------------------------------------------------------

def test_kernel_selection_follows_aiters_rules(fake_aiter):
    t950 = native.kernel_table("gfx950")
    # gfx950 bf16 persistent 16 heads qlen 1 -> the generic qh64 kernel with s_MQA = 16
    c = native.select_kernel(t950, arch="gfx950", q_type="bf16", kv_type="bf16", gqa=16, qlen=1,
                             persistent=True, lse=False)
    assert c.kernel_name == "_ZN5aiter41mla_a16w16_qh64_qseqlen1_gqaratio64_v3_psE"
    assert c.s_mqa == 16 and c.co_path.endswith("gfx950/mla/mla_a16w16_qh64_qseqlen1_"
                                                "gqaratio64_v3_ps.co")
    # 128 heads persistent -> qh32 qseqlen4, s_MQA 128; with LSE the lse variant
    c = native.select_kernel(t950, arch="gfx950", q_type="bf16", kv_type="bf16", gqa=128, qlen=1,
                             persistent=True, lse=True)
    assert c.kernel_name.endswith("gqaratio32_lse_psE") and c.s_mqa == 128
    # split-KV bf16 16 heads: qlen 1 -> subQ16 kernel, qlen 2 -> padded to the qseqlen-4 kernel
    c = native.select_kernel(t950, arch="gfx950", q_type="bf16", kv_type="bf16", gqa=16, qlen=1,
                             persistent=False, lse=False)
    assert "subQ16_mqa16" in c.kernel_name and c.sub_q == 16
    c = native.select_kernel(t950, arch="gfx950", q_type="bf16", kv_type="bf16", gqa=16, qlen=2,
                             persistent=False, lse=False)
    assert c.kernel_name.endswith("mask1E") and c.sub_q == 128 and c.s_mqa == 32
    t942 = native.kernel_table("gfx942")
    c = native.select_kernel(t942, arch="gfx942", q_type="bf16", kv_type="bf16", gqa=16, qlen=3,
                             persistent=True, lse=False)
    assert c.kernel_name.endswith("mask1_psE")
    c = native.select_kernel(t942, arch="gfx942", q_type="fp8", kv_type="fp8", gqa=16, qlen=2,
                             persistent=True, lse=False)
    assert c.kernel_name == "_ZN5aiter36mla_a8w8_qh16_qseqlen2_gqaratio16_psE"
    with pytest.raises(NotImplementedError, match="no asm MLA decode kernel"):
        native.select_kernel(t942, arch="gfx942", q_type="bf16", kv_type="bf16", gqa=16, qlen=8,
                             persistent=True, lse=False)
    with pytest.raises(NotImplementedError, match="fp8 gqa 64 runs persistent only"):
        native.kernel_key(arch="gfx942", q_type="fp8", kv_type="fp8", gqa=64, qlen=1,
                          persistent=False, lse=False)


def test_a_table_of_another_form_is_refused(tmp_path):
    bad = CSV_950.replace("qSeqLen", "qlen")
    root = _fake_aiter(tmp_path / "hsa", text=bad)
    with pytest.raises(native.AiterInstallError) as e:
        native.kernel_table("gfx950", str(root))
    msg = str(e.value)
    assert str(root / "gfx950" / "mla" / "mla_asm.csv") in msg
    assert "missing ['qSeqLen']" in msg and "unknown ['qlen']" in msg and "e4048607" in msg
    bad_name = CSV_950.replace("_ZN5aiter39mla_dec", "aiter_mla_dec")
    root2 = _fake_aiter(tmp_path / "hsa2", text=bad_name)
    with pytest.raises(native.AiterInstallError, match="line 2"):
        native.kernel_table("gfx950", str(root2))
    with pytest.raises(native.AiterInstallError, match="does not exist"):
        native.kernel_table("gfx942", str(root))


def test_a_missing_code_object_is_refused(tmp_path):
    root = _fake_aiter(tmp_path / "hsa", with_co=False)
    table = native.kernel_table("gfx950", str(root))
    with pytest.raises(native.AiterInstallError, match="the AITER install is incomplete"):
        native.select_kernel(table, arch="gfx950", q_type="bf16", kv_type="bf16", gqa=16,
                             qlen=1, persistent=True, lse=False)


def test_code_objects_are_checked_against_the_argument_block(tmp_path):
    good = tmp_path / "good.co"
    good.write_bytes(code_object({"_ZN5aiter1kE": _aiter_args(), "other": []}))
    assert set(native.code_object_kernels(str(good))) == {"_ZN5aiter1kE", "other"}
    native.check_code_object(str(good), "_ZN5aiter1kE")
    raw = tmp_path / "raw.co"  # one raw view of the block's head (AITER's gfx942 a8w8 qh64)
    raw.write_bytes(code_object({"k": [("_kernarg_raw", 0, 320)]}))
    native.check_code_object(str(raw), "k")
    with pytest.raises(native.AiterInstallError, match="does not define _ZN5aiter2kkE"):
        native.check_code_object(str(good), "_ZN5aiter2kkE")
    grown = tmp_path / "grown.co"  # a later AITER with one more field
    grown.write_bytes(code_object({"k": _aiter_args([("new_field", 0x170, 8)])}))
    with pytest.raises(native.AiterInstallError, match=r"outside the argument block.*new_field"):
        native.check_code_object(str(grown), "k")
    moved = tmp_path / "moved.co"
    moved.write_bytes(code_object({"k": [("Q", 0x18, 8)]}))
    with pytest.raises(native.AiterInstallError, match="outside the argument block"):
        native.check_code_object(str(moved), "k")
    junk = tmp_path / "junk.co"
    junk.write_bytes(b"\x7fELF not really")
    with pytest.raises(native.AiterInstallError, match="cannot be read as an AMDGPU code"):
        native.check_code_object(str(junk), "k")


def test_split_counts_follow_aiters_get_meta_param():
    # bf16: occupancy x HBM term over 1..16 splits
    assert native.num_kv_splits(1, 4096, 16, 1, "bf16", 256) == 16
    assert native.num_kv_splits(256, 256 * 4096, 16, 1, "bf16", 256) == 1
    # fp8 caps the count by the kv length in min-block units
    assert native.num_kv_splits(1, 200, 16, 1, "fp8", 256) == 2


# --- the decode route -------------------------------------------------------------------------

PS = 8
TARGET = Target("rocm", "gfx950", 256)


def _lower_decode(heads=16, qlen=1, mtp=None, return_lse=False):
    b = 3
    rng = np.random.default_rng(1)
    bt = jnp.asarray(rng.permutation(b * 4).reshape(b, 4).astype(np.int32))
    lens = jnp.asarray([9, 20, 31], jnp.int32)
    q = jnp.ones((b * qlen, heads, 576), jnp.bfloat16)
    cache = jnp.ones((b * 4, PS, 576), jnp.bfloat16)

    def step(q, cache, bt, lens):
        md = build_aiter_decode_metadata(bt, lens, page_size=PS, num_heads=heads, qlen=qlen,
                                         arch="gfx950", num_cu=8, mtp_decode_qlen=mtp,
                                         return_lse=return_lse, target=TARGET)
        return jax_mla.mla_attention(q, cache, md, scale=0.1, backend="aiter",
                                     return_lse=return_lse)

    lowered = jax.jit(step).trace(q, cache, bt, lens).lower(lowering_platforms=("rocm",))
    return lowered.as_text(), lowered.compiler_ir("hlo").as_hlo_text()


@pytest.mark.parametrize("heads,qlen,mtp,lse", [(16, 1, None, False), (128, 1, None, True),
                                                (16, 2, 1, False)])
def test_decode_lowers_to_the_native_call_with_no_python_callback(aiter_on_rocm, fake_aiter,
                                                                  heads, qlen, mtp, lse):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        text, hlo = _lower_decode(heads, qlen, mtp, lse)
    line = one_typed_call(text, hlo, native.TARGET_NAME)
    assert str(fake_aiter) in line and 'kernel_name = "_ZN5aiter' in line


def test_without_the_library_the_bridge_is_used_and_warned_once(aiter_on_rocm, fake_aiter,
                                                                monkeypatch):
    monkeypatch.setattr(native, "library_error", lambda: "jax_mla's FFI library is not built")
    with pytest.warns(RuntimeWarning, match="Python bridge.*not built") as rec:
        text, _ = _lower_decode()
        text2, _ = _lower_decode(heads=128)
    assert sum("Python bridge" in str(w.message) for w in rec) == 1
    for t in (text, text2):
        calls = custom_call_targets(t)
        assert native.TARGET_NAME not in calls and any("callback" in c for c in calls), calls


def test_a_code_object_of_another_layout_falls_back_with_the_reason(aiter_on_rocm, fake_aiter):
    co = fake_aiter / "gfx950" / "mla" / "mla_a16w16_qh64_qseqlen1_gqaratio64_v3_ps.co"
    co.write_bytes(code_object({"_ZN5aiter41mla_a16w16_qh64_qseqlen1_gqaratio64_v3_psE":
                                _aiter_args([("new_field", 0x170, 8)])}))
    with pytest.warns(RuntimeWarning, match="outside the argument block"):
        text, _ = _lower_decode()
    assert native.TARGET_NAME not in custom_call_targets(text)


def test_a_mismatching_install_falls_back_with_the_reason(aiter_on_rocm, tmp_path, monkeypatch):
    root = _fake_aiter(tmp_path / "hsa", text=CSV_950.replace("knl_name", "kernel"))
    monkeypatch.setenv("AITER_ASM_DIR", str(root))
    with pytest.warns(RuntimeWarning, match="is not the one jax_mla reads") as rec:
        text, _ = _lower_decode()
    assert native.TARGET_NAME not in custom_call_targets(text)
    said = [str(w.message) for w in rec]
    assert any("Python bridge" in m and "is not the one jax_mla reads" in m for m in said), said
    # routing says it used the static table, not the unreadable installed one
    assert any("by the static table" in m for m in said), said


# --- the route's jnp around the kernel, with the kernel emulated ------------------------------

def _emulated_stage1(md, route):
    """A jnp stand-in for the asm kernel with the handler's operands and results: persistent
    works via the planner's exact consumer, split-KV splits over contiguous KV chunks (splits
    AITER's merge never reads are NaN)."""
    from jax_mla.backends.aiter.planner import execute_plan_works, unfold_rows

    def stage1(q, kv4, qo, kvp, kvi, last, *, choice, scale, max_seqlen_q, persistent,
               split_o, split_lse, out=None, final_lse=None, split_indptr=None,
               work_indptr=None, work_info=None, q_scale=None, kv_scale=None, **kw):
        d = q.shape[-1]
        empty = jnp.zeros((0,), jnp.float32)
        if persistent:
            plan = md.schedule.plan
            qu = unfold_rows(q, plan.qlen, plan.fold_ratio)
            fin, flse, part, plse = execute_plan_works(
                qu, kv4.reshape(-1, 1, d), md, plan, scale=scale, q_scale=q_scale,
                kv_scale=kv_scale)
            return (part[:, None], plse[:, None, :, None], fin.astype(out.dtype),
                    flse if final_lse is not None else empty, jnp.zeros((4,), jnp.uint32))
        t, h, _ = q.shape
        nsplit, qlen = split_o.shape[1], max_seqlen_q
        mgc = native._merge_granularity(h, qlen, route.q_dtype, route.kv_dtype)
        qf = q.astype(jnp.float32) * q_scale
        kvf = kv4.reshape(-1, d).astype(jnp.float32) * kv_scale
        rows = jnp.arange(t)
        b, tq = rows // qlen, rows % qlen
        n = kvp[b + 1] - kvp[b]
        nvalid = jnp.maximum(jnp.minimum(nsplit, (n + mgc - 1) // mgc), 1)
        chunk = (n + nvalid - 1) // nvalid
        pos = jnp.arange(int(md.paged_kv_indices.shape[0]))
        tok = kvi[jnp.clip(kvp[b][:, None] + pos, 0, kvi.shape[0] - 1)]
        kvr = jnp.where((pos[None, :] < n[:, None])[..., None], kvf[tok], 0.0)
        s = jnp.einsum("thd,tkd->thk", qf, kvr) * scale
        see = pos[None, :] < (n - qlen + tq + 1)[:, None]
        outs, lses = [], []
        for j in range(nsplit):
            m_ = see & (pos[None, :] >= j * chunk[:, None]) & (pos[None, :] < (j + 1) *
                                                                chunk[:, None])
            sj = jnp.where(m_[:, None, :], s, -jnp.inf)
            mx = jnp.max(sj, -1, keepdims=True)
            p = jnp.exp(sj - mx)
            z = p.sum(-1)
            o = jnp.einsum("thk,tkl->thl", p, kvr[..., :512]) / z[..., None]
            lse = mx[..., 0] + jnp.log(z)
            unused = (j >= nvalid)[:, None]
            outs.append(jnp.where(unused[..., None], jnp.nan, o))
            lses.append(jnp.where(unused, jnp.nan, lse))
        so = jnp.stack(outs, 1).astype(split_o.dtype)
        sl = jnp.stack(lses, 1)[..., None]
        fl = sl[:, 0, :, 0] if final_lse is not None else empty
        return so, sl, jnp.zeros((0,), jnp.bfloat16), fl, jnp.zeros((0,), jnp.uint32)

    return stage1


EMULATED = [  # arch, dtype, heads, qlen, K, num_cu, persistent, fold
    ("gfx950", "bf16", 16, 1, None, 8, True, 1),
    ("gfx942", "bf16", 32, 1, None, 8, True, 2),
    ("gfx942", "bf16", 64, 2, None, 8, True, 4),
    ("gfx950", "bf16", 16, 2, 1, 8, False, 1),
    ("gfx950", "bf16", 128, 3, 1, 8, False, 1),
    ("gfx950", "bf16", 32, 2, 1, 1, False, 1),  # one split: the kernel's 16-bit rows are out
    ("gfx942", "fp8", 16, 1, None, 8, True, 1),
    ("gfx942", "fp8", 32, 2, None, 8, True, 2),
    ("gfx950", "fp8", 128, 1, None, 8, True, 1),
    ("gfx942", "fp8", 16, 2, 1, 8, False, 1),
]


@pytest.mark.parametrize("case", EMULATED,
                         ids=lambda c: f"{c[0]}-{c[1]}-h{c[2]}-q{c[3]}-cu{c[5]}")
def test_native_decode_around_an_emulated_kernel_matches_the_oracle(rng, monkeypatch,
                                                                    fake_aiter, case):
    from jax_mla.backends.aiter import capabilities as caps

    import oracle
    from conftest import make_case

    arch, dt, heads, qlen, k, cu, persistent, fold = case
    # gfx942's persistent bf16/fp8-16 kernels return no LSE
    lse_wanted = arch == "gfx950" or not persistent
    with forced_standins() as enter:
        enter(arch=arch, cu_num=cu)
        c = make_case(rng, seq_lens=[9, 70, 33], qlen=qlen, num_heads=heads, page_size=PS)
        wdt = caps.fp8_dtype(arch) if dt == "fp8" else jnp.bfloat16
        q, cache = jnp.asarray(c.q, wdt), jnp.asarray(c.cache, wdt)
        md = build_aiter_decode_metadata(c.block_table, c.seq_lens, page_size=PS,
                                         num_heads=heads, qlen=qlen, kv_dtype=cache.dtype,
                                         arch=arch, num_cu=cu, mtp_decode_qlen=k,
                                         return_lse=lse_wanted)
    qs, ks = (0.5, 1.5) if dt == "fp8" else (1.0, 1.0)
    route = md.plan.route
    assert route.persistent is persistent
    if persistent:
        assert md.schedule.plan.fold_ratio == fold
    monkeypatch.setattr(native, "stage1", _emulated_stage1(md, route))
    monkeypatch.setattr(native, "select_kernel", lambda table, **kw: CHOICE)
    out, lse = jax.jit(lambda q, cache, md: native.asm_decode(
        q, cache, md, route, md.schedule, scale=c.scale, q_scale=jnp.float32(qs),
        kv_scale=jnp.float32(ks)))(q, cache, md)
    want, want_lse = oracle.mla_decode(np.asarray(q, np.float32), np.asarray(cache, np.float32),
                                       c.block_table, c.seq_lens, qlen=qlen, page_size=PS,
                                       scale=c.scale, kv_lora_rank=512, q_scale=qs,
                                       kv_scale=ks)
    assert out.shape == (3 * qlen, heads, 512) and out.dtype == jnp.bfloat16
    assert oracle.rel_err(np.asarray(out, np.float32), want) < 1e-2
    if lse_wanted:
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-2, rtol=1e-2)
    else:
        assert lse is None


# --- the FFI sources under a HIP toolchain ----------------------------------------------------

@pytest.mark.skipif(shutil.which("apt-get") is None and not os.environ.get("CLANGXX"),
                    reason="ffi/hip_check.sh fetches Debian's clang-19 with apt-get")
def test_ffi_sources_compile_as_hip():
    root = pathlib.Path(__file__).resolve().parent.parent
    r = subprocess.run(["bash", str(root / "ffi" / "hip_check.sh")], capture_output=True,
                       text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable})
    if r.returncode == 3:
        pytest.skip(f"no HIP toolchain: {r.stderr.strip()}")
    assert r.returncode == 0, r.stdout + r.stderr
    for src in sorted(p.name for p in (root / "ffi").glob("*.cc")):
        assert re.search(rf"ok   gfx9\w+ {re.escape(src)}", r.stdout), r.stdout
