"""AITER's FlashAttention v3 forward through jax_mla's own launcher: no torch, no callback.

MLA's prefill in the MHA form (qk head_dim 192, v head_dim 128, packed varlen sequences) is
``aiter.flash_attn_varlen_func``. For bf16 inputs on gfx942 and gfx950 AITER runs it as
``fmha_v3_varlen_fwd``: one assembly kernel in group mode (``hsa/<arch>/fmha_v3_fwd/*.co``,
chosen from the kernel table ``fmha_fwd.csv`` beside them), which reads the query and key
sequence starts itself. One workgroup takes one head of one sequence and one query tile (or, on
gfx950 with a causal mask, a head tile and a tail tile), over the whole packed query length.

Here that kernel is launched by jax_mla's typed FFI handler ``jax_mla_aiter_asm_fmha_fwd``
(``ffi/aiter_asm.cc``, the same library and module cache as the asm decode), with jax_mla's own
copy of its argument block (:data:`KERNEL_ARGS_LAYOUT`, read from ROCm/aiter at
``capabilities.AITER_COMMIT``: ``fmha_fwd_v3_args`` in ``csrc/include/mha_fwd.h``, filled as
``init_fmha_fwd_v3_args`` in ``csrc/cpp_itfs/mha_fwd.cu`` fills it for the operands
``csrc/py_itfs_cu/asm_mha_varlen_fwd.cu`` derives). The kernel is chosen by AITER's own lookup
(:func:`select_kernel`), its ``.co`` checked against the argument block once at trace time, and
the launch values follow AITER's rules (:func:`launch_params`). Rows that see no key (and
padding rows past the last sequence) are set here to out 0 and LSE -inf, whatever the kernel
leaves in them. Nothing runs per call in Python and nothing is read back.

Where AITER itself would take another kernel: on gfx950 without an LSE it prefers its OPUS
kernel, which is compiled into its C++ extension and has no code object to load; here the v3
kernel serves those calls too (AITER's choice on gfx950 whenever the LSE is asked for).

``backend.py`` uses this route on ROCm when :func:`unavailable_reason` is None and falls back to
the Python bridge (``bridge.flash_attn_varlen``) otherwise, said once per process. Nothing here
has run on AMD hardware: on a CPU host the argument block is packed by the handler's CPU twin
and compared with a NumPy model, the kernel lookup runs on a fake install whose code objects
declare the arguments AITER's own ``.co`` files declare at the pinned commit, the route's jnp
runs around the stand-in's kernel against the float64 oracle, and a jitted prefill lowers for
``("rocm",)`` to the typed call (tests/test_aiter_native_fmha.py).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.backends.aiter import native
from jax_mla.backends.aiter.native import AiterInstallError

TARGET_NAME = "jax_mla_aiter_asm_fmha_fwd"  # ROCm: execute (load the .co once, launch)
PACK_TARGET_NAME = "jax_mla_aiter_asm_fmha_fwd_pack"  # CPU twin: the packed argument block
FALLBACK_WHAT = "FlashAttention varlen prefill"
ARCHS = ("gfx942", "gfx950")  # the archs with fmha_v3_fwd kernels

# ``MlaFmhaFwdKernelArgs`` (ffi/aiter_asm.cc): (field, byte offset, kind), 16-byte slots.
KERNEL_ARGS_LAYOUT = (
    ("ptr_o", 0x00, "ptr"), ("ptr_q", 0x10, "ptr"), ("ptr_k", 0x20, "ptr"),
    ("ptr_v", 0x30, "ptr"), ("ptr_lse", 0x40, "ptr"), ("scalar", 0x50, "f32"),
    ("s_seq_len", 0x60, "u32"), ("s_Seqs", 0x70, "u32"), ("s_Ts", 0x80, "u32"),
    ("s_Hs", 0x90, "u32"), ("s_Bs", 0xA0, "u32"), ("s_gqa", 0xB0, "u32"),
    ("s_k_Seqs", 0xC0, "u32"), ("s_k_Hs", 0xD0, "u32"), ("s_k_Bs", 0xE0, "u32"),
    ("s_opt", 0xF0, "u32"), ("s_lse", 0x100, "u32"), ("s_kv_seq_len", 0x110, "u32"),
    ("s_qk_head_dim", 0x120, "u32"), ("s_v_head_dim", 0x130, "u32"),
    ("s_q_head_num", 0x140, "u32"), ("s_v_Seqs", 0x150, "u32"), ("s_v_Hs", 0x160, "u32"),
    ("s_v_Bs", 0x170, "u32"), ("s_o_Seqs", 0x180, "u32"), ("s_o_Hs", 0x190, "u32"),
    ("s_o_Bs", 0x1A0, "u32"), ("ptr_qseq", 0x1B0, "ptr"), ("ptr_kseq", 0x1C0, "ptr"),
    ("s_lse_Hs", 0x1D0, "u32"), ("ptr_qseq_padding", 0x1E0, "ptr"),
    ("ptr_kseq_padding", 0x1F0, "ptr"), ("ptr_q_descale", 0x200, "ptr"),
    ("ptr_k_descale", 0x210, "ptr"), ("ptr_v_descale", 0x220, "ptr"),
    ("s_descale_q_Bs", 0x230, "u32"), ("s_descale_q_Hs", 0x240, "u32"),
    ("s_descale_k_Bs", 0x250, "u32"), ("s_descale_k_Hs", 0x260, "u32"),
    ("s_descale_v_Bs", 0x270, "u32"), ("s_descale_v_Hs", 0x280, "u32"),
)
KERNEL_ARGS_SIZE = 0x290  # 656 bytes; AITER's bf16 code objects declare the first 512
PACK_BYTES = KERNEL_ARGS_SIZE + 6 * 4  # the twin appends grid xyz and block xyz (uint32)
_SYMBOLS = ("JaxMlaAiterFmhaFwdInitializeRocm", "JaxMlaAiterFmhaFwdExecuteRocm",
            "JaxMlaAiterFmhaFwdPackCpu", "JaxMlaAiterFmhaFwdLayout")

# ``hsa/<arch>/fmha_v3_fwd/fmha_fwd.csv`` at the pinned commit.
CSV_COLUMNS = ("dtype", "hdim_q", "hdim_v", "mask", "mode", "bf16_cvt", "ts_qo", "ts_kv",
               "knl_name", "co_name")
_CSV_INTS = ("hdim_q", "hdim_v", "mask", "mode", "bf16_cvt", "ts_qo", "ts_kv")
MASK_NONE, MASK_BOTTOM_RIGHT = 0, 2  # the table's mask column (CK's mask_enum)
GROUP_MODE = 1  # the table's mode column: packed varlen sequences
DEFAULT_BF16_CVT = 1  # flash_attn_varlen_func's how_v3_bf16_cvt (gfx942: round to nearest, away)
MI308_NUM_CU = 80  # gfx942 parts whose kernels live under MI308/ (AITER asks the PCI chip id)


def library_error() -> str | None:
    """Why the handler library cannot launch the v3 forward (None: it can)."""
    return native.library_error() or native.library_error(_SYMBOLS)


def library_layout() -> dict[str, int]:
    """The argument block as the compiled library lays it out: ``{field: offset, "size"}``."""
    return native.library_layout("JaxMlaAiterFmhaFwdLayout")


def check_library_layout() -> None:
    """Raise if the library's argument block differs from :data:`KERNEL_ARGS_LAYOUT`."""
    native.check_library_layout("JaxMlaAiterFmhaFwdLayout", KERNEL_ARGS_LAYOUT,
                                KERNEL_ARGS_SIZE, "native_fmha.py")


def register(platforms=("ROCM", "cpu")) -> None:
    """Register the handlers with XLA (idempotent; no GPU needed)."""
    native.register_handlers(TARGET_NAME, PACK_TARGET_NAME, "JaxMlaAiterFmhaFwd", platforms)


# --- the kernel table and AITER's lookup -------------------------------------------------------

def kernel_table(arch: str, base: str | None = None) -> native.KernelTable:
    """The checked ``fmha_fwd.csv`` of ``arch`` under ``base`` (default ``native.asm_dir()``)."""
    return native._read_table(os.path.join(native.hsa_base(base), arch, "fmha_v3_fwd",
                                           "fmha_fwd.csv"),
                              CSV_COLUMNS, (), _CSV_INTS, "FlashAttention v3 kernel table")


def gfx942_variant(num_cu: int | None) -> str:
    """The gfx942 kernel directory: ``"MI308"`` for an 80-CU part, else ``"MI300"``. AITER
    decides by the PCI chip id (``is_mi308_device``), which jax does not expose; every MI308X
    has 80 CUs and no MI300-family part with MI300's kernels has."""
    return "MI308" if num_cu == MI308_NUM_CU else "MI300"


@dataclasses.dataclass(frozen=True)
class FmhaChoice:
    """The v3 kernel for one call: its symbol, its ``.co``, its query tile and the key."""

    kernel_name: str
    co_path: str
    ts_qo: int
    key: tuple


def select_kernel(table: native.KernelTable, *, arch: str, causal: bool, hdim_q: int = 192,
                  hdim_v: int = 128, bf16_cvt: int = DEFAULT_BF16_CVT,
                  num_cu: int | None = None) -> FmhaChoice:
    """``fmha_fwd_v3``'s lookup (``get_kernel_name_key``, ``get_kernel_co_name``): the bf16
    group-mode row of ``hdim_q``/``hdim_v`` and mask (bottom-right causal or none); on gfx942
    also of ``bf16_cvt``, its code object under ``MI300/`` or ``MI308/``
    (:func:`gfx942_variant`). The ``.co`` must exist and fit the argument block."""
    key = dict(dtype="bf16", hdim_q=int(hdim_q), hdim_v=int(hdim_v),
               mask=MASK_BOTTOM_RIGHT if causal else MASK_NONE, mode=GROUP_MODE)
    if arch == "gfx942":
        key["bf16_cvt"] = int(bf16_cvt)
    for r in table.rows:
        if all(str(r.get(k) or 0) == str(v) for k, v in key.items()):
            sub = gfx942_variant(num_cu) if arch == "gfx942" else ""
            co = os.path.join(table.directory, sub, r["co_name"])
            if not os.path.isfile(co):
                raise AiterInstallError(
                    f"AITER's kernel table {table.path} names {r['co_name']} for {key}, but "
                    f"{co} does not exist: the AITER install is incomplete")
            native.check_code_object(co, r["knl_name"], KERNEL_ARGS_LAYOUT, KERNEL_ARGS_SIZE)
            return FmhaChoice(r["knl_name"], co, int(r["ts_qo"]), tuple(sorted(key.items())))
    raise NotImplementedError(
        f"AITER's kernel table {table.path} has no FlashAttention v3 group-mode kernel for "
        f"{key} (AITER falls back to its CK kernel there)")


def launch_params(arch: str, *, heads: int, total_q: int, causal: bool, ts_qo: int,
                  hdim_q: int = 192, hdim_v: int = 128) -> dict[str, int]:
    """AITER's launch values for a group-mode call (``init_fmha_fwd_v3_args``,
    ``get_grid_dim``, ``fmha_fwd_v3``): ``ts_qo``; ``tg_div``, query tiles a workgroup takes
    (2 with a mask, except gfx942's 192/128 kernels); ``opt``, the tuning option (5; 3 with a
    mask where the heads are not a multiple of 8 or the packed query is over 16384 tokens; 0 for
    gfx942's 192/128 kernels); ``block_threads`` (256 for 192/128, else 512)."""
    mla = (hdim_q, hdim_v) == (192, 128)
    tg_div = 1 if (not causal or (arch == "gfx942" and mla)) else 2
    opt = 5
    if causal and (heads % 8 != 0 or total_q > 16384):
        opt -= 2
    if mla and arch == "gfx942":
        opt = 0
    return dict(ts_qo=int(ts_qo), tg_div=tg_div, opt=opt, block_threads=256 if mla else 512)


def routing_reason(arch: str | None, q, k, v, *, max_seqlen_k: int) -> str | None:
    """Why AITER would not run these operands on its v3 kernel (``can_impl_fmha_v3_fwd`` for
    jax_mla's calls: no dropout, bias, ALiBi, window or soft-cap ever reach it); None: it
    would."""
    if arch not in ARCHS:
        return f"AITER's FlashAttention v3 kernels run on {ARCHS}, not {arch!r}"
    dq, dv = q.shape[-1], v.shape[-1]
    if (dq, dv) not in ((192, 128), (128, 128)):
        return f"AITER's v3 forward takes qk/v head_dim 192/128 or 128/128, not {dq}/{dv}"
    if jnp.dtype(q.dtype) != jnp.bfloat16:
        return f"AITER's v3 forward takes bfloat16 q, k, v, not {jnp.dtype(q.dtype).name}"
    if q.shape[1] % k.shape[1]:
        return f"q's {q.shape[1]} heads are not a multiple of k's {k.shape[1]}"
    if (dq, dv) == (192, 128):
        # _fmha_kv_byte_extent_ge_u32: a key or value row's byte extent must fit 32 bits
        row = max(k.shape[1] * dq, v.shape[1] * dv) * 2
        if int(max_seqlen_k) * row >= 1 << 32:
            return (f"max_seqlen_k {max_seqlen_k} x {row} bytes a token reaches the v3 kernel's "
                    "32-bit offsets (AITER uses its CK kernel)")
    return None


def unavailable_reason(arch: str | None, *, causal: bool = True, num_cu: int | None = None,
                       base: str | None = None) -> str | None:
    """Why the native v3 forward cannot serve ``arch`` in this process (None: it can)."""
    if arch not in ARCHS:
        return f"AITER's FlashAttention v3 kernels run on {ARCHS}, not {arch!r}"
    err = library_error()
    if err is not None:
        return err
    try:
        check_library_layout()
        select_kernel(kernel_table(arch, base), arch=arch, causal=causal, num_cu=num_cu)
    except (AiterInstallError, NotImplementedError) as e:
        return str(e)
    return None


# --- the call ----------------------------------------------------------------------------------

def stage(q, k, v, cu_seqlens_q, cu_seqlens_k, *, choice: FmhaChoice, scale: float,
          params: dict, return_lse: bool, pack: bool = False):
    """One ``jax_mla_aiter_asm_fmha_fwd`` custom call (``pack``: its CPU twin).

    ``q [Tq, H, Dqk]``, ``k [Tk, Hk, Dqk]``, ``v [Tk, Hk, Dv]`` bf16; ``cu_seqlens_*`` int32
    ``[B + 1]``; ``params``: :func:`launch_params`. Returns ``(out [Tq, H, Dv] bf16, lse)``,
    ``lse [H, Tq]`` float32 with ``return_lse`` else an empty array, and with ``pack`` the
    packed argument block (``uint8[PACK_BYTES]``). Rows the kernel does not write (padding
    past the last sequence) hold whatever the buffers held.
    """
    register(("cpu",) if pack else ("ROCM",))
    tq, h, _ = q.shape
    shapes = [jax.ShapeDtypeStruct((tq, h, v.shape[-1]), jnp.bfloat16),
              jax.ShapeDtypeStruct((h, tq) if return_lse else (0,), jnp.float32)]
    if pack:
        shapes.append(jax.ShapeDtypeStruct((PACK_BYTES,), jnp.uint8))
    if not pack:
        native.preload(choice.co_path, choice.kernel_name)
    call = jax.ffi.ffi_call(PACK_TARGET_NAME if pack else TARGET_NAME, tuple(shapes))
    return tuple(call(q, k, v, cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32),
                      co_path=choice.co_path, kernel_name=choice.kernel_name,
                      softmax_scale=np.float32(scale),
                      **{n: np.int32(x) for n, x in params.items()}))


def _visible_rows(cu_q, cu_k, tq: int, causal: bool):
    """``[Tq]`` bool: rows of a sequence that see at least one key (bottom-right causal: row
    ``i`` of a query of ``sq`` tokens against ``sk`` keys sees ``i + sk - sq + 1`` of them)."""
    t = jnp.arange(tq, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q, t, side="right").astype(jnp.int32) - 1, 0,
                   cu_q.shape[0] - 2)
    sq = cu_q[seq + 1] - cu_q[seq]
    sk = cu_k[seq + 1] - cu_k[seq]
    row = t - cu_q[seq]
    seen = (row + sk - sq + 1) if causal else sk
    return (t < cu_q[-1]) & (seen > 0)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
                      max_seqlen_k: int, scale: float, causal: bool = True,
                      return_lse: bool = False, arch: str, num_cu: int | None = None,
                      base: str | None = None):
    """``bridge.flash_attn_varlen``'s contract through the native launcher.

    ``q [Tq, H, 192]``, ``k [Tk, Hk, 192]``, ``v [Tk, Hk, 128]`` bf16; ``cu_seqlens`` ``[B + 1]``.
    Returns ``(out [Tq, H, 128] bf16, lse [H, Tq] float32 or None)``; a row that sees no key,
    or lies past the last sequence, gets out 0 and LSE -inf. Raises
    :class:`~jax_mla.backends.aiter.native.AiterInstallError` or ``NotImplementedError`` where
    the install cannot serve the call (the backend then uses the bridge).
    """
    tq, h, _ = q.shape
    dv = v.shape[-1]
    cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
    causal = bool(causal) and int(max_seqlen_q) > 1  # a one-token query sees every key
    if int(max_seqlen_k) == 0 or tq == 0 or cu_q.shape[0] < 2:
        out = jnp.zeros((tq, h, dv), jnp.bfloat16)
        return out, (jnp.full((h, tq), -jnp.inf, jnp.float32) if return_lse else None)
    choice = select_kernel(kernel_table(arch, base), arch=arch, causal=causal,
                           hdim_q=q.shape[-1], hdim_v=dv, num_cu=num_cu)
    params = launch_params(arch, heads=h, total_q=tq, causal=causal, ts_qo=choice.ts_qo,
                           hdim_q=q.shape[-1], hdim_v=dv)
    out, lse = stage(q, k, v, cu_q, cu_k, choice=choice, scale=scale, params=params,
                     return_lse=return_lse)
    live = _visible_rows(cu_q, cu_k, tq, causal)
    out = jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
    if not return_lse:
        return out, None
    return out, jnp.where(live[None, :], lse, -jnp.inf)
