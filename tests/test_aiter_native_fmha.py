"""AITER's FlashAttention v3 forward through jax_mla's own FFI launcher (``native_fmha.py``,
``ffi/aiter_asm.cc``), on a CPU host.

Checked here: the library's argument block equals the module's table (AITER's
``fmha_fwd_v3_args`` at the pinned commit) and holds, at the same offsets and widths, every
argument AITER's own 192/128 code objects declare (:data:`PINNED_CO_ARGS`, read from the pinned
commit's ``.co`` files); the CPU twin packs what a NumPy model predicts from the operands with
AITER's grid and threads, and refuses bad operands by name; AITER's launch rules and kernel
lookup (gfx942's MI300/MI308 directories, its rounding variants, gfx950's one kernel a mask) in
a fake install whose code objects declare those arguments; a ``.co`` of another layout refused;
AITER's routing conditions; the route's jnp around the kernel (empty rows, padding rows, GQA,
the LSE) against the float64 oracle with the kernel emulated on NaN-poisoned buffers, alone and
through the backend; a jitted bf16 prefill lowered for ``("rocm",)`` to the typed call with no
Python callback; the bridge used, and said once, without the handlers. Nothing here launches the
kernel: that needs a gfx942 or gfx950.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_aiter_native import _unpack as _unpack_block
from test_aiter_native import code_object
from test_prefill_oracle import varlen_attention

from jax_mla.backends import aiter as aiter_backend
from jax_mla.backends.aiter import native, native_fmha
from jax_mla.problem import Target

import oracle
from aiter_standin.harness import forced_standins
from lowering import custom_call_targets, one_typed_call

pytestmark = pytest.mark.skipif(native_fmha.library_error() is not None,
                                reason=f"FFI library: {native_fmha.library_error()}")

# The arguments every 192/128 code object of hsa/gfx942/fmha_v3_fwd (MI300 and MI308) and
# hsa/gfx950/fmha_v3_fwd declares at ROCm/aiter e4048607 (28 files, one signature: a
# 512-byte kernarg segment, 256 threads a workgroup), read from their AMDGPU metadata notes:
# (name, offset, size), AITER's ``pad`` entries left out.
PINNED_CO_ARGS = (
    ("R", 0x0, 8), ("Q", 0x10, 8), ("K", 0x20, 8), ("V", 0x30, 8), ("LSE", 0x40, 8),
    ("scalar", 0x50, 4), ("seq_len", 0x60, 4), ("Seqs", 0x70, 4), ("Ts", 0x80, 4),
    ("Hs", 0x90, 4), ("Bs", 0xA0, 4), ("gqa", 0xB0, 4), ("k_Seqs", 0xC0, 4), ("k_Hs", 0xD0, 4),
    ("k_Bs", 0xE0, 4), ("msk_opt", 0xF0, 4), ("lse", 0x100, 4), ("kv_seq_len", 0x110, 4),
    ("qk_head_dim", 0x120, 4), ("v_head_dim", 0x130, 4), ("q_head_num", 0x140, 4),
    ("v_Seqs", 0x150, 4), ("v_Hs", 0x160, 4), ("v_Bs", 0x170, 4), ("r_Seqs", 0x180, 4),
    ("r_Hs", 0x190, 4), ("r_Bs", 0x1A0, 4), ("ptr_qseq", 0x1B0, 8), ("ptr_kseq", 0x1C0, 8),
    ("lse_Hs", 0x1D0, 4), ("ptr_qseq_padding", 0x1E0, 8), ("ptr_kseq_padding", 0x1F0, 8),
)
PINNED_KERNARG_BYTES = 512

# The 192/128 rows of hsa/<arch>/fmha_v3_fwd/fmha_fwd.csv at the pinned commit (gfx942's
# batch-mode rows and the other head sizes left out).
PINNED_FMHA_CSV = {
    "gfx942": """\
dtype,hdim_q,hdim_v,mask,mode,bf16_cvt,ts_qo,ts_kv,knl_name,co_name
bf16,192,128,2,0,1,128,32,_ZN5aiter35fmha_fwd_hd192x128_bf16_causal_rtnaE,fwd_hd192x128_bf16_causal_rtna.co
bf16,192,128,0,1,0,128,32,_ZN5aiter34fmha_fwd_hd192x128_bf16_rtne_groupE,fwd_hd192x128_bf16_rtne_group.co
bf16,192,128,0,1,1,128,32,_ZN5aiter34fmha_fwd_hd192x128_bf16_rtna_groupE,fwd_hd192x128_bf16_rtna_group.co
bf16,192,128,0,1,2,128,32,_ZN5aiter33fmha_fwd_hd192x128_bf16_rtz_groupE,fwd_hd192x128_bf16_rtz_group.co
bf16,192,128,2,1,0,128,32,_ZN5aiter41fmha_fwd_hd192x128_bf16_causal_rtne_groupE,fwd_hd192x128_bf16_causal_rtne_group.co
bf16,192,128,2,1,1,128,32,_ZN5aiter41fmha_fwd_hd192x128_bf16_causal_rtna_groupE,fwd_hd192x128_bf16_causal_rtna_group.co
bf16,192,128,2,1,2,128,32,_ZN5aiter40fmha_fwd_hd192x128_bf16_causal_rtz_groupE,fwd_hd192x128_bf16_causal_rtz_group.co
""",
    "gfx950": """\
dtype,hdim_q,hdim_v,mask,mode,bf16_cvt,ts_qo,ts_kv,knl_name,co_name
bf16,192,128,0,0,0,128,128,_ZN5aiter25fmha_fwd_hd192_hd128_bf16E,fwd_hd192_hd128_bf16.co
bf16,192,128,2,0,0,128,128,_ZN5aiter32fmha_fwd_hd192_hd128_bf16_causalE,fwd_hd192_hd128_bf16_causal.co
bf16,192,128,0,1,0,128,128,_ZN5aiter31fmha_fwd_hd192_hd128_bf16_groupE,fwd_hd192_hd128_bf16_group.co
bf16,192,128,2,1,0,128,128,_ZN5aiter38fmha_fwd_hd192_hd128_bf16_causal_groupE,fwd_hd192_hd128_bf16_causal_group.co
""",
}

# AITER's argument names (the .co's) -> jax_mla's field names (AITER's fmha_fwd_v3_args).
_CO_TO_FIELD = {"R": "ptr_o", "Q": "ptr_q", "K": "ptr_k", "V": "ptr_v", "LSE": "ptr_lse",
                "msk_opt": "s_opt", "lse": "s_lse", "r_Seqs": "s_o_Seqs", "r_Hs": "s_o_Hs",
                "r_Bs": "s_o_Bs", "lse_Hs": "s_lse_Hs"}


def _co_args(args=PINNED_CO_ARGS):
    """The ``.args`` a v3 code object declares: the pinned arguments, each padded to 16 bytes
    with AITER's ``pad`` entries."""
    out = []
    for name, off, size in args:
        out.append((name, off, size))
        out += [("pad", o, 4) for o in range(off + size, off + 16, 4)]
    return out


def _write_install(root, arch, text, variants=("MI300", "MI308")):
    d = root / arch / "fmha_v3_fwd"
    d.mkdir(parents=True, exist_ok=True)
    (d / "fmha_fwd.csv").write_text(text)
    for line in text.strip().splitlines()[1:]:
        kernel, co = line.split(",")[-2:]
        for sub in (variants if arch == "gfx942" else ("",)):
            (d / sub).mkdir(exist_ok=True)
            (d / sub / co).write_bytes(code_object({kernel: _co_args()}))
    return root


@pytest.fixture
def fake_aiter(tmp_path, monkeypatch):
    """Both archs' pinned 192/128 v3 tables, with code objects declaring AITER's arguments."""
    root = tmp_path / "hsa"
    for arch, text in PINNED_FMHA_CSV.items():
        _write_install(root, arch, text)
    monkeypatch.setenv("AITER_ASM_DIR", str(root))
    return root


# --- the library and the argument block -------------------------------------------------------

def test_library_layout_is_aiters_fmha_fwd_v3_args():
    want = {n: o for n, o, _ in native_fmha.KERNEL_ARGS_LAYOUT}
    assert native_fmha.library_layout() == want | {"size": 656}
    native_fmha.check_library_layout()
    native_fmha.register()
    native_fmha.register()  # idempotent
    assert {(native_fmha.TARGET_NAME, "ROCM"), (native_fmha.TARGET_NAME, "cpu")} <= \
        native._registered


def test_every_argument_aiters_code_objects_declare_is_a_field_at_its_offset():
    fields = {name: (off, kind) for name, off, kind in native_fmha.KERNEL_ARGS_LAYOUT}
    for name, off, size in PINNED_CO_ARGS:
        field = _CO_TO_FIELD.get(name, name if name.startswith("ptr_") else "s_" + name)
        if name == "scalar":
            field = "scalar"
        assert field in fields, (name, field)
        assert fields[field][0] == off, (name, field, hex(off), hex(fields[field][0]))
        assert size == (8 if fields[field][1] == "ptr" else 4), (name, size)
    # the block AITER passes is longer than the bf16 kernels read: the fp8 descale fields
    tail = [n for n, off, _ in native_fmha.KERNEL_ARGS_LAYOUT if off >= PINNED_KERNARG_BYTES]
    assert tail == ["ptr_q_descale", "ptr_k_descale", "ptr_v_descale", "s_descale_q_Bs",
                    "s_descale_q_Hs", "s_descale_k_Bs", "s_descale_k_Hs", "s_descale_v_Bs",
                    "s_descale_v_Hs"]


def _unpack(b: np.ndarray):
    return _unpack_block(b, native_fmha.KERNEL_ARGS_LAYOUT, native_fmha.KERNEL_ARGS_SIZE)


CHOICE = native_fmha.FmhaChoice("_ZN5aiter3fooE", "/nonexistent/foo.co", 128, ())


def _operands(rng, lens_q=(37, 5, 60), lens_k=(37, 9, 60), h=16, hk=16):
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk = int(cq[-1]) + 6, int(ck[-1])  # six padding rows past the last sequence
    q = jnp.asarray(rng.standard_normal((tq, h, 192)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((tk, hk, 192)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((tk, hk, 128)), jnp.bfloat16)
    return q, k, v, jnp.asarray(cq), jnp.asarray(ck)


@pytest.mark.parametrize("arch,causal,lse,hk", [
    ("gfx950", True, True, 16), ("gfx950", False, False, 4), ("gfx942", True, False, 2),
    ("gfx942", False, True, 16)])
def test_packing_matches_a_numpy_model(rng, arch, causal, lse, hk):
    q, k, v, cq, ck = _operands(rng, hk=hk)
    tq, h, tk = q.shape[0], q.shape[1], k.shape[0]
    params = native_fmha.launch_params(arch, heads=h, total_q=tq, causal=causal, ts_qo=128)

    @jax.jit
    def run(*ops):
        return native_fmha.stage(*ops, choice=CHOICE, scale=0.0721, params=params,
                                 return_lse=lse, pack=True)

    out, lse_out, packed = run(q, k, v, cq, ck)
    assert out.shape == (tq, h, 128) and out.dtype == jnp.bfloat16
    assert lse_out.shape == ((h, tq) if lse else (0,))
    f, launch = _unpack(np.asarray(packed))
    assert f["scalar"] == np.float32(0.0721)
    want = dict(s_seq_len=tq, s_Seqs=h * 192 * 2, s_Ts=128 * h * 192 * 2, s_Hs=192 * 2, s_Bs=0,
                s_gqa=h // hk, s_k_Seqs=hk * 192 * 2, s_k_Hs=192 * 2, s_k_Bs=0,
                s_opt=params["opt"], s_lse=int(lse), s_kv_seq_len=tk, s_qk_head_dim=192,
                s_v_head_dim=128, s_q_head_num=h, s_v_Seqs=hk * 128 * 2, s_v_Hs=128 * 2,
                s_v_Bs=0, s_o_Seqs=h * 128 * 2, s_o_Hs=128 * 2, s_o_Bs=0,
                s_lse_Hs=tq * 4 if lse else 0, s_descale_q_Bs=0, s_descale_q_Hs=0,
                s_descale_k_Bs=0, s_descale_k_Hs=0, s_descale_v_Bs=0, s_descale_v_Hs=0)
    assert {n: int(f[n]) for n in want} == want
    ptrs = ["ptr_o", "ptr_q", "ptr_k", "ptr_v", "ptr_qseq", "ptr_kseq"] + (["ptr_lse"] if lse
                                                                             else [])
    vals = [int(f[p]) for p in ptrs]
    assert all(vals) and len(set(vals)) == len(vals), dict(zip(ptrs, vals))
    assert int(f["ptr_qseq_padding"]) == int(f["ptr_qseq"])
    assert int(f["ptr_kseq_padding"]) == int(f["ptr_kseq"])
    assert all(int(f[p]) == 0 for p in ("ptr_q_descale", "ptr_k_descale", "ptr_v_descale")
               + (() if lse else ("ptr_lse",)))
    tiles = -(-tq // 128)
    assert launch == (h, 3, -(-tiles // params["tg_div"]), 256, 1, 1)


@pytest.mark.parametrize("what,change,match", [
    ("q", lambda o: (o[0].astype(jnp.float16),) + o[1:], "q must be bfloat16"),
    ("v", lambda o: o[:2] + (o[2][:, :8],) + o[3:], r"v .* must have k's tokens and heads"),
    ("k heads", lambda o: (o[0], o[1][:, :3], o[2][:, :3]) + o[3:],
     "q's heads must be a multiple of k's"),
    ("cu_seqlens_k", lambda o: o[:4] + (o[4][:2],), "must both have batch \\+ 1 entries"),
    ("cu_seqlens_q", lambda o: o[:3] + (o[3].astype(jnp.float32),) + o[4:],
     "cu_seqlens_q must be int32"),
])
def test_packing_refuses_bad_operands(rng, what, change, match):
    q, k, v, cq, ck = change(_operands(rng))
    params = native_fmha.launch_params("gfx950", heads=16, total_q=q.shape[0], causal=True,
                                       ts_qo=128)

    def run(q, k, v, cq, ck):  # the twin called directly: stage() would shape out from q
        native_fmha.register(("cpu",))
        call = jax.ffi.ffi_call(native_fmha.PACK_TARGET_NAME, (
            jax.ShapeDtypeStruct((q.shape[0], q.shape[1], 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((0,), jnp.float32),
            jax.ShapeDtypeStruct((native_fmha.PACK_BYTES,), jnp.uint8)))
        return call(q, k, v, cq, ck, co_path="x.co", kernel_name="k",
                    softmax_scale=np.float32(0.1), **{n: np.int32(x) for n, x in params.items()})

    with pytest.raises(Exception, match=match):
        jax.jit(run)(q, k, v, cq, ck)


# --- AITER's rules ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,heads,total_q,causal,want", [
    # gfx950 192/128: a causal workgroup takes a head and a tail tile; opt 5, or 3 where the
    # heads are not a multiple of 8 or the packed query is over 16384 tokens (causal only)
    ("gfx950", 16, 4096, True, dict(tg_div=2, opt=5)),
    ("gfx950", 12, 4096, True, dict(tg_div=2, opt=3)),
    ("gfx950", 16, 16385, True, dict(tg_div=2, opt=3)),
    ("gfx950", 12, 16385, False, dict(tg_div=1, opt=5)),
    # gfx942 192/128: one tile a workgroup, opt 0
    ("gfx942", 16, 4096, True, dict(tg_div=1, opt=0)),
    ("gfx942", 12, 20000, False, dict(tg_div=1, opt=0)),
])
def test_launch_params_follow_aiters_rules(arch, heads, total_q, causal, want):
    got = native_fmha.launch_params(arch, heads=heads, total_q=total_q, causal=causal, ts_qo=128)
    assert got == dict(ts_qo=128, block_threads=256, **want)
    assert native_fmha.launch_params(arch, heads=heads, total_q=total_q, causal=causal,
                                     ts_qo=256, hdim_q=128, hdim_v=128)["block_threads"] == 512


def test_kernel_selection_follows_aiters_lookup(fake_aiter):
    t950 = native_fmha.kernel_table("gfx950")
    for causal, name in ((True, "fwd_hd192_hd128_bf16_causal_group"),
                         (False, "fwd_hd192_hd128_bf16_group")):
        c = native_fmha.select_kernel(t950, arch="gfx950", causal=causal, bf16_cvt=2)
        assert c.co_path == str(fake_aiter / "gfx950" / "fmha_v3_fwd" / (name + ".co"))
        assert c.kernel_name == f"_ZN5aiter{len('fmha_' + name)}fmha_{name}E" and c.ts_qo == 128
    t942 = native_fmha.kernel_table("gfx942")
    c = native_fmha.select_kernel(t942, arch="gfx942", causal=True, num_cu=304)
    assert c.co_path.endswith("gfx942/fmha_v3_fwd/MI300/fwd_hd192x128_bf16_causal_rtna_group.co")
    c = native_fmha.select_kernel(t942, arch="gfx942", causal=False, bf16_cvt=0, num_cu=80)
    assert c.co_path.endswith("gfx942/fmha_v3_fwd/MI308/fwd_hd192x128_bf16_rtne_group.co")
    assert c.kernel_name == "_ZN5aiter34fmha_fwd_hd192x128_bf16_rtne_groupE"
    with pytest.raises(NotImplementedError, match="no FlashAttention v3 group-mode kernel"):
        native_fmha.select_kernel(t942, arch="gfx942", causal=True, hdim_q=256, hdim_v=256)
    assert native_fmha.unavailable_reason("gfx950") is None
    assert native_fmha.unavailable_reason("gfx942", num_cu=80) is None
    assert "('gfx942', 'gfx950'), not 'gfx90a'" in native_fmha.unavailable_reason("gfx90a")


def test_an_incomplete_or_foreign_install_is_refused(fake_aiter):
    (fake_aiter / "gfx942" / "fmha_v3_fwd" / "MI308" /
     "fwd_hd192x128_bf16_causal_rtna_group.co").unlink()
    reason = native_fmha.unavailable_reason("gfx942", num_cu=80)
    assert reason is not None and "does not exist" in reason and "MI308" in reason
    assert native_fmha.unavailable_reason("gfx942", num_cu=304) is None
    table = fake_aiter / "gfx950" / "fmha_v3_fwd" / "fmha_fwd.csv"
    table.write_text(PINNED_FMHA_CSV["gfx950"].replace("ts_kv", "ts_kv,tile"))
    native._read_table.cache_clear()
    reason = native_fmha.unavailable_reason("gfx950")
    assert reason is not None and "unknown ['tile']" in reason and "fmha_fwd.csv" in reason


def test_a_code_object_of_another_layout_is_refused(fake_aiter):
    name = "_ZN5aiter38fmha_fwd_hd192_hd128_bf16_causal_groupE"
    co = fake_aiter / "gfx950" / "fmha_v3_fwd" / "fwd_hd192_hd128_bf16_causal_group.co"
    moved = tuple((n, o + 8 if n == "lse_Hs" else o, z) for n, o, z in PINNED_CO_ARGS)
    co.write_bytes(code_object({name: _co_args(moved)}))
    native.check_code_object.cache_clear()
    reason = native_fmha.unavailable_reason("gfx950")
    assert reason is not None and "outside the argument block" in reason and "656 bytes" in reason
    assert "lse_Hs" in reason


def test_routing_follows_aiters_conditions(rng):
    q, k, v, *_ = _operands(rng, hk=4)
    assert native_fmha.routing_reason("gfx950", q, k, v, max_seqlen_k=60) is None
    assert "not 'gfx90a'" in native_fmha.routing_reason("gfx90a", q, k, v, max_seqlen_k=60)
    assert "not float16" in native_fmha.routing_reason(
        "gfx942", q.astype(jnp.float16), k, v, max_seqlen_k=60)
    assert "not 576/512" in native_fmha.routing_reason(
        "gfx942", jnp.zeros((4, 16, 576), jnp.bfloat16), jnp.zeros((4, 1, 576), jnp.bfloat16),
        jnp.zeros((4, 1, 512), jnp.bfloat16), max_seqlen_k=4)
    assert "not a multiple" in native_fmha.routing_reason("gfx942", q[:, :6], k[:, :4],
                                                          v[:, :4], max_seqlen_k=60)
    # 4 kv heads x 192 x 2 bytes = 1536 bytes a token: 2**32 / 1536 tokens reach 32 bits
    limit = (1 << 32) // (4 * 192 * 2)
    assert native_fmha.routing_reason("gfx942", q, k, v, max_seqlen_k=limit - 1) is None
    assert "32-bit offsets" in native_fmha.routing_reason("gfx942", q, k, v,
                                                          max_seqlen_k=limit + 1)


# --- the route around the kernel, with the kernel emulated ------------------------------------

def _oracle(q, k, v, cq, ck, *, scale, causal):
    """The float64 oracle with grouped kv heads: query head ``i`` reads kv head
    ``i // (H / Hk)``."""
    g = q.shape[1] // k.shape[1]
    k, v = (np.repeat(np.asarray(x, np.float64), g, axis=1) for x in (k, v))
    return varlen_attention(np.asarray(q, np.float64), k, v, np.asarray(cq), np.asarray(ck),
                            scale=scale, causal=causal)


def _emulated_stage(seen):
    """A stand-in for the custom call: the float64 oracle's rows written into NaN-poisoned
    buffers, except rows that see no key and rows past the last sequence (left NaN, as a
    kernel may leave them). ``seen`` collects each call's launch values."""
    def stage(q, k, v, cq, ck, *, choice, scale, params, return_lse, pack=False):
        seen.append(dict(params, kernel=choice.kernel_name, return_lse=return_lse))
        out, lse = _oracle(q, k, v, cq, ck, scale=scale, causal=dict(choice.key)["mask"] == 2)
        written = np.isfinite(lse)  # [T, H]: rows inside a sequence that see a key
        o = np.where(written[..., None], out, np.nan)
        lse_t = np.where(written, lse, np.nan).T
        return (jnp.asarray(o, jnp.bfloat16),
                jnp.asarray(lse_t, jnp.float32) if return_lse else jnp.zeros((0,), jnp.float32))
    return stage


@pytest.mark.parametrize("arch,causal,hk", [("gfx950", True, 16), ("gfx942", True, 4),
                                            ("gfx950", False, 2)])
def test_native_fmha_around_an_emulated_kernel_matches_the_oracle(rng, fake_aiter, monkeypatch,
                                                                   arch, causal, hk):
    seen = []
    monkeypatch.setattr(native_fmha, "stage", _emulated_stage(seen))
    # sequence 1 has fewer keys than queries: bottom-right causal leaves its first rows empty
    q, k, v, cq, ck = _operands(rng, lens_q=(37, 9, 60), lens_k=(37, 5, 70), hk=hk)
    scale = 192 ** -0.5
    out, lse = native_fmha.flash_attn_varlen(q, k, v, cq, ck, max_seqlen_q=60, max_seqlen_k=70,
                                             scale=scale, causal=causal, return_lse=True,
                                             arch=arch, num_cu=304)
    want, want_lse = _oracle(q, k, v, cq, ck, scale=scale, causal=causal)
    got, got_lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert out.dtype == jnp.bfloat16 and lse.shape == (16, q.shape[0])
    assert np.isfinite(got).all()
    assert oracle.rel_err(got, want) < 1e-2
    empty = ~np.isfinite(want_lse)
    assert empty[-6:].all() and (empty.any(axis=1).sum() > 6) == causal  # padding; empty rows
    assert (got[empty] == 0).all() and np.isneginf(got_lse.T[empty]).all()
    np.testing.assert_allclose(got_lse.T[~empty], want_lse[~empty], rtol=1e-5, atol=1e-5)
    [call] = seen
    assert call["return_lse"] and call["ts_qo"] == 128 and call["block_threads"] == 256
    assert call["tg_div"] == (2 if causal and arch == "gfx950" else 1)
    assert ("causal" in call["kernel"]) == causal


def test_one_token_queries_and_no_keys(rng, fake_aiter, monkeypatch):
    seen = []
    monkeypatch.setattr(native_fmha, "stage", _emulated_stage(seen))
    q, k, v, cq, ck = _operands(rng, lens_q=(1, 1, 1), lens_k=(4, 9, 3))
    out, lse = native_fmha.flash_attn_varlen(q, k, v, cq, ck, max_seqlen_q=1, max_seqlen_k=9,
                                             scale=0.1, causal=True, return_lse=False,
                                             arch="gfx950")
    assert lse is None and "causal" not in seen[0]["kernel"]  # AITER: causal = non-causal here
    want, _ = _oracle(q, k, v, cq, ck, scale=0.1, causal=True)
    assert oracle.rel_err(np.asarray(out.astype(jnp.float32)), want) < 1e-2
    out, lse = native_fmha.flash_attn_varlen(q, k[:0], v[:0], cq, cq * 0, max_seqlen_q=1,
                                             max_seqlen_k=0, scale=0.1, causal=True,
                                             return_lse=True, arch="gfx950")
    assert len(seen) == 1  # nothing launched without keys
    assert (np.asarray(out.astype(jnp.float32)) == 0).all() and np.isneginf(lse).all()


def test_backend_prefill_takes_the_native_route_on_rocm(rng, fake_aiter, monkeypatch):
    seen = []
    monkeypatch.setattr(native_fmha, "stage", _emulated_stage(seen))
    monkeypatch.setattr(native, "_warned", set())
    q, k, v, cq, _ = _operands(rng, lens_q=(30, 50, 8), lens_k=(30, 50, 8))
    scale = 0.08
    with forced_standins() as enter, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        enter(arch="gfx942", cu_num=304)
        out, lse = aiter_backend.AiterBackend().prefill(
            q, k, v, cq, None, scale=scale, causal=True, target=Target("rocm", "gfx942", 304),
            max_seqlen=50, max_seqlen_k=50, config=aiter_backend.AiterPrefillConfig(),
            return_lse=True)
    assert seen and seen[0]["kernel"] == "_ZN5aiter41fmha_fwd_hd192x128_bf16_causal_rtna_groupE"
    want, want_lse = _oracle(q, k, v, cq, cq, scale=scale, causal=True)
    assert oracle.rel_err(np.asarray(out.astype(jnp.float32)), want) < 1e-2
    assert lse.shape == want_lse.shape  # jax_mla's [T, H]
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(lse)[~fin]).all()


# --- lowering for ROCm --------------------------------------------------------------------------

def _lower_prefill(arch="gfx950", return_lse=True, heads=16):
    t = 40
    q = jnp.ones((t, heads, 192), jnp.bfloat16)
    v = jnp.ones((t, heads, 128), jnp.bfloat16)
    cu = jnp.asarray([0, 30, 38], jnp.int32)
    be = aiter_backend.AiterBackend()
    cfg = aiter_backend.AiterPrefillConfig(arch=arch)
    cus = {"gfx950": 256, "gfx942": 304}[arch]

    def step(q, k, v, cu):
        return be.prefill(q, k, v, cu, None, scale=0.07, causal=True,
                          target=Target("rocm", arch, cus), max_seqlen=30, max_seqlen_k=30,
                          config=cfg, return_lse=return_lse)

    lowered = jax.jit(step).trace(q, q, v, cu).lower(lowering_platforms=("rocm",))
    return lowered.as_text(), lowered.compiler_ir("hlo").as_hlo_text()


@pytest.mark.parametrize("arch,return_lse,kernel", [
    ("gfx950", True, "_ZN5aiter38fmha_fwd_hd192_hd128_bf16_causal_groupE"),
    ("gfx950", False, "_ZN5aiter38fmha_fwd_hd192_hd128_bf16_causal_groupE"),
    ("gfx942", True, "_ZN5aiter41fmha_fwd_hd192x128_bf16_causal_rtna_groupE")])
def test_bf16_prefill_lowers_to_the_native_call_with_no_python_callback(
        aiter_on_rocm, fake_aiter, arch, return_lse, kernel):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning
        text, hlo = _lower_prefill(arch, return_lse)
    line = one_typed_call(text, hlo, native_fmha.TARGET_NAME)
    assert str(fake_aiter) in line and kernel in line
    assert ("MI300" in line) == (arch == "gfx942")
    assert re.search(r"tg_div = 2 : i32", line) if arch == "gfx950" else \
        re.search(r"opt = 0 : i32", line), line


def test_without_the_handlers_the_bridge_is_used_and_said_once(aiter_on_rocm, fake_aiter,
                                                               monkeypatch):
    monkeypatch.setattr(native_fmha, "library_error",
                        lambda: "jax_mla's FFI library lacks JaxMlaAiterFmhaFwdExecuteRocm")
    with pytest.warns(RuntimeWarning, match="Python bridge.*lacks JaxMlaAiterFmhaFwd") as rec:
        texts = [_lower_prefill("gfx950")[0], _lower_prefill("gfx942", False)[0]]
    assert sum("Python bridge" in str(w.message) for w in rec) == 1
    for text in texts:
        calls = custom_call_targets(text)
        assert native_fmha.TARGET_NAME not in calls and any("callback" in c for c in calls)


def test_doctor_says_how_the_bf16_prefill_runs_on_rocm(fake_aiter):
    from jax_mla import doctor

    check = "AITER FlashAttention prefill via FFI"
    rows = {r["check"]: r for r in doctor._launcher_checks(Target("rocm", "gfx942", 80))}
    assert rows[check]["status"] == doctor.OK
    assert "jax_mla_aiter_asm_fmha_fwd" in rows[check]["detail"]
    (fake_aiter / "gfx942" / "fmha_v3_fwd" / "MI308" /
     "fwd_hd192x128_bf16_causal_rtna_group.co").unlink()
    rows = {r["check"]: r for r in doctor._launcher_checks(Target("rocm", "gfx942", 80))}
    assert rows[check]["status"] == doctor.WARN and "does not exist" in rows[check]["detail"]
