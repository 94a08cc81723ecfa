"""AITER's fp8 persistent-scheduling prefill through jax_mla's own launcher: no torch, no callback.

vLLM's fp8 prefill on gfx950 (``_mla_fp8_prefill_attn``) calls ``mla_prefill_ps_asm_fwd`` and
then ``mla_reduce_v1``. The first is an assembly kernel (``mla_pfl_qh192_vh128_m32x8_n128x1_
causal{0,1}`` in AITER's ``hsa/gfx950/mla/``) that walks a persistent plan: each workgroup runs
its CU's works, a work being one head and one piece of one 256-row query tile. A work that
covers its whole tile writes the final bf16 rows; the pieces of a split tile write float32
partials and their LSE, which the reduce merges.

Here the kernel is launched by jax_mla's typed FFI handler ``jax_mla_aiter_asm_prefill_ps``
(``ffi/aiter_asm.cc``, the same library and module cache as the asm decode), with jax_mla's own
copy of its argument block (:data:`KERNEL_ARGS_LAYOUT`, read from ROCm/aiter at
``capabilities.AITER_COMMIT``: ``PsKernelArgs`` in ``csrc/py_itfs_cu/asm_mla.cu``). The plan is
AITER's ``get_ps_metadata_v1`` computed on the device in jnp (``ps_planner.plan_ps_prefill``,
bit-exact with AITER's host planner); the merge is jnp (:func:`merge_partials`, the semantics of
``mla_reduce_v1``). The kernel is chosen from the installed kernel table by AITER's own lookup
(:func:`select_kernel`) and its ``.co`` is checked against the argument block, once, at trace
time. Nothing runs per call in Python and nothing is read back: no host sync.

``backend.py`` uses this route on ROCm when :func:`unavailable_reason` is None and falls back to
the Python bridge (``bridge.fp8_prefill``) otherwise, said once per process. Nothing here has run
on AMD hardware: on a CPU host the argument block is packed by the handler's CPU twin and
compared with a NumPy model, the step lowers for ``("rocm",)`` to the typed call, and the merge
runs on partials written by the stand-in kernel (tests/test_aiter_native_prefill.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import heads as _heads
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter import native
from jax_mla.backends.aiter.native import AiterInstallError, KernelChoice
from jax_mla.backends.base import out_dtype

TARGET_NAME = "jax_mla_aiter_asm_prefill_ps"  # ROCm: execute (load the .co once, launch)
PACK_TARGET_NAME = "jax_mla_aiter_asm_prefill_ps_pack"  # CPU twin: the packed argument block
FALLBACK_WHAT = "fp8 PS prefill"
ARCHS = ("gfx950",)  # AITER refuses gfx942; vLLM gates the route on gfx950

# ``MlaPsPrefillKernelArgs`` (ffi/aiter_asm.cc): (field, byte offset, kind), 16-byte slots.
KERNEL_ARGS_LAYOUT = (
    ("ptr_Q", 0x00, "ptr"), ("ptr_K", 0x10, "ptr"), ("ptr_V", 0x20, "ptr"),
    ("ptr_O", 0x30, "ptr"), ("ptr_PartialO", 0x40, "ptr"), ("ptr_PartialLSE", 0x50, "ptr"),
    ("ptr_WorkIndptr", 0x60, "ptr"), ("ptr_WorkInfo", 0x70, "ptr"),
    ("ptr_QOIndptr", 0x80, "ptr"), ("ptr_KVIndptr", 0x90, "ptr"),
    ("ptr_KVPageIndices", 0xA0, "ptr"), ("ptr_QScale", 0xB0, "ptr"),
    ("ptr_KScale", 0xC0, "ptr"), ("ptr_VScale", 0xD0, "ptr"), ("scalar", 0xE0, "f32"),
    ("num_q_tokens", 0xF0, "u32"), ("num_head_q", 0x100, "u32"), ("num_page", 0x110, "u32"),
    ("num_used_page", 0x120, "u32"),
)
KERNEL_ARGS_SIZE = 0x130  # 304 bytes
PACK_BYTES = KERNEL_ARGS_SIZE + 6 * 4  # the twin appends grid xyz and block xyz (uint32)
_SYMBOLS = ("JaxMlaAiterPsPrefillInitializeRocm", "JaxMlaAiterPsPrefillExecuteRocm",
            "JaxMlaAiterPsPrefillPackCpu", "JaxMlaAiterPsPrefillLayout")


def library_error() -> str | None:
    """Why the handler library cannot launch the PS prefill (None: it can)."""
    return native.library_error() or native.library_error(_SYMBOLS)


def library_layout() -> dict[str, int]:
    """The argument block as the compiled library lays it out: ``{field: offset, "size"}``."""
    return native.library_layout("JaxMlaAiterPsPrefillLayout")


def check_library_layout() -> None:
    """Raise if the library's argument block differs from :data:`KERNEL_ARGS_LAYOUT`."""
    native.check_library_layout("JaxMlaAiterPsPrefillLayout", KERNEL_ARGS_LAYOUT,
                                KERNEL_ARGS_SIZE, "native_prefill.py")


def register(platforms=("ROCM", "cpu")) -> None:
    """Register the handlers with XLA (idempotent; no GPU needed)."""
    native.register_handlers(TARGET_NAME, PACK_TARGET_NAME, "JaxMlaAiterPsPrefill", platforms)


def select_kernel(table: native.KernelTable, *, causal: bool, gqa: int = 1) -> KernelChoice:
    """``mla_prefill_ps_asm_fwd``'s lookup: fp8 q and k, ``gqa`` query heads per KV head,
    persistent, ``qSeqLen`` 0, prefill, ``causal``; no LSE, no ``cprr``."""
    key = dict(qType="fp8", kvType="fp8", Gqa=int(gqa), ps=1, qSeqLen=0, prefill=1,
               causal=int(bool(causal)), lse=0, cprr=0)
    return native.find_kernel(table, key, layout=KERNEL_ARGS_LAYOUT, size=KERNEL_ARGS_SIZE,
                              what="fp8 PS prefill")


def unavailable_reason(arch: str, *, causal: bool = True) -> str | None:
    """Why the native PS prefill cannot serve ``arch`` in this process (None: it can)."""
    if arch not in ARCHS:
        return f"AITER's fp8 PS prefill kernel runs on {ARCHS}, not {arch!r}"
    err = library_error()
    if err is not None:
        return err
    try:
        check_library_layout()
        select_kernel(native.kernel_table(arch), causal=causal)
    except (AiterInstallError, NotImplementedError) as e:
        return str(e)
    return None


def stage1(q, k, v, qo_indptr, kv_indptr, kv_indices, work_indptr, work_info, *,
           choice: KernelChoice, scale: float, rows: int, q_scale=None, k_scale=None,
           v_scale=None, pack: bool = False):
    """One ``jax_mla_aiter_asm_prefill_ps`` custom call (``pack``: its CPU twin).

    ``q [T, Hq, 192]``, ``k [Tk, Hk, 192]``, ``v [Tk, Hk, 128]`` fp8; ``rows``: partial scratch
    rows. Returns ``(out [T, Hq, 128] bf16, partial_o [rows, Hq, 128] f32, partial_lse
    [rows, Hq] f32)`` and, with ``pack``, the packed argument block (``uint8[PACK_BYTES]``).
    Rows of ``out`` that no whole-tile work writes, and unused partial rows, hold whatever the
    buffers held.
    """
    register(("cpu",) if pack else ("ROCM",))
    t, hq, _ = q.shape
    dv = v.shape[-1]
    shapes = [jax.ShapeDtypeStruct((t, hq, dv), jnp.bfloat16),
              jax.ShapeDtypeStruct((rows, hq, dv), jnp.float32),
              jax.ShapeDtypeStruct((rows, hq), jnp.float32)]
    if pack:
        shapes.append(jax.ShapeDtypeStruct((PACK_BYTES,), jnp.uint8))
    i32 = jnp.int32
    scales = [native._empty(jnp.float32) if s is None else native._scalar(s)
              for s in (q_scale, k_scale, v_scale)]
    if not pack:
        native.preload(choice.co_path, choice.kernel_name)
    call = jax.ffi.ffi_call(PACK_TARGET_NAME if pack else TARGET_NAME, tuple(shapes))
    return tuple(call(q, k, v, qo_indptr.astype(i32), kv_indptr.astype(i32),
                      kv_indices.astype(i32), work_indptr.astype(i32), work_info.astype(i32),
                      *scales, co_path=choice.co_path, kernel_name=choice.kernel_name,
                      softmax_scale=np.float32(scale)))


def merge_partials(out, partial_o, partial_lse, plan):
    """``mla_reduce_v1`` for a PS prefill plan, in jnp: every split tile ``i`` (with at least two
    partials) gets rows ``reduce_final_map[i][0] + r`` < ``reduce_final_map[i][1]`` of ``out``
    from the LSE-weighted sum of partial rows ``reduce_partial_map[j] + r``; other rows keep
    what the kernel wrote. Returns ``out`` as float32 ``[T, Hq, Dv]``."""
    t, hq, dv = out.shape
    ts = plan.qlen_granularity
    if plan.reduce_partial_map.shape[0] == 0 or partial_o.shape[0] == 0:
        return out.astype(jnp.float32)  # plans of these sizes never split a tile
    parts = max(partial_o.shape[0] // ts, 1)  # static bound on partials
    ri, fm, pm = plan.reduce_indptr, plan.reduce_final_map, plan.reduce_partial_map
    k = jnp.arange(parts, dtype=jnp.int32)
    tile = jnp.clip(jnp.searchsorted(ri, k, side="right").astype(jnp.int32) - 1, 0,
                    max(fm.shape[0] - 1, 0))
    split = (ri[tile + 1] - ri[tile]) >= 2
    live = (k < ri[-1]) & split
    start = pm[jnp.clip(k, 0, pm.shape[0] - 1)]
    r = jnp.arange(ts, dtype=jnp.int32)
    dst = fm[tile, 0][:, None] + r[None, :]  # [parts, ts]
    src = start[:, None] + r[None, :]
    ok = live[:, None] & (dst < fm[tile, 1][:, None]) & (src < partial_o.shape[0])
    dst = jnp.where(ok, dst, t).reshape(-1)  # row t: a dump row
    src = jnp.clip(src, 0, partial_o.shape[0] - 1).reshape(-1)
    lse = jnp.where(ok.reshape(-1)[:, None], partial_lse[src], -jnp.inf)  # [n, Hq]
    m = jax.ops.segment_max(lse, dst, num_segments=t + 1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m[dst])  # 0 for rows and partials that take no part
    z = jax.ops.segment_sum(w, dst, num_segments=t + 1)
    acc = jax.ops.segment_sum(w[..., None] * partial_o[src], dst, num_segments=t + 1)
    merged = acc[:t] / jnp.where(z[:t] > 0, z[:t], 1.0)[..., None]
    touched = jax.ops.segment_sum(ok.reshape(-1).astype(jnp.int32), dst, num_segments=t + 1)
    return jnp.where((touched[:t] > 0)[:, None, None], merged, out.astype(jnp.float32))


def fp8_prefill(q, k, v, query_start_loc, *, max_query_len: int, scale: float, arch: str,
                q_scale=None, k_scale=None, v_scale=None, num_cu: int | None = None,
                base: str | None = None):
    """``bridge.fp8_prefill``'s contract through the native launcher (causal, gqa 1).

    ``q``, ``k``: ``[T, H, 192]``; ``v``: ``[T, H, 128]``, new tokens only; 16-bit (cast to the
    arch's fp8 with unit scales, as vLLM does) or already fp8 with per-tensor scales. Returns
    ``out [T, H, 128]`` in q's dtype (bf16 for fp8 q).
    """
    from jax_mla.backends.aiter import ps_planner

    t, h, _ = q.shape
    hp = caps.fp8_prefill_num_heads(h)
    f8 = caps.fp8_dtype(arch)
    qp, kp, vp = (_heads.pad_heads(x, h, hp).astype(f8) for x in (q, k, v))
    qsl = query_start_loc.astype(jnp.int32)
    plan = ps_planner.plan_ps_prefill(qsl, num_heads=hp, max_qlen=max_query_len,
                                      num_cu=num_cu, arch=arch)
    choice = select_kernel(native.kernel_table(arch, base), causal=True)
    out, partial_o, partial_lse = stage1(
        qp, kp, vp, qsl, qsl, jnp.arange(t, dtype=jnp.int32), plan.work_indptr, plan.work_info,
        choice=choice, scale=scale, rows=plan.scratch_rows,
        q_scale=1.0 if q_scale is None else q_scale, k_scale=1.0 if k_scale is None else k_scale,
        v_scale=1.0 if v_scale is None else v_scale)
    out = merge_partials(out, partial_o, partial_lse, plan).astype(out_dtype(q.dtype))
    return _heads.unpad_heads(out, h, hp)
