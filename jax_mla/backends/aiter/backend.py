"""``backend="aiter"``: AITER's MLA kernels on AMD Instinct GPUs, routed as vLLM does.

The route (asm decode persistent or not, Gluon decode/verify, segmented DCP verify) is the
plan's (:class:`~.plan.AiterPlan`), decided when the metadata is built; ``decode`` only reads it
and calls the matching bridge (``bridge.py``; it and ``triton_kernels.py`` import ``aiter``). On
ROCm the asm route runs AITER's ``.co`` kernels through jax_mla's own FFI launcher (``native.py``)
when the library and the installed AITER's kernels are there, and falls back to the bridge
(warned once) when not. The segmented DCP verify launches the installed AITER's Triton kernel
through jax_mla's own Triton launcher (``triton_kernels.py``: the FFI launcher on ROCm, the
interpreter on CPU) when it matches the pinned JIT signature, with the same bridge fallback;
so do the Gluon decode/verify on ROCm (``gluon_kernels.py``), the fp8 PS prefill
(``native_prefill.py``: its ``.co`` through jax_mla's handler) and ``flash_attn_varlen_func``'s
bf16 prefill (``native_fmha.py``: AITER's FlashAttention v3 ``.co`` through jax_mla's handler).
Nothing here imports ``aiter``: the backend is available only on ROCm with ``aiter``
importable.

Head padding is route-dependent (asm pads to the kernel's head count, Gluon and segmented do
not), so plans keep the real count and the bridge pads and unpads around each kernel call with
the exact maps of ``jax_mla.heads``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp

from jax_mla import heads as _heads
from jax_mla.backends.aiter import (
    bridge,
    gluon_kernels,
    native,
    native_fmha,
    native_prefill,
    triton_kernels,
)
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter.plan import AiterPlan, make_plan
from jax_mla.backends.aiter.schedule import VIEWS, build_schedule
from jax_mla.backends.base import Backend, dequantize_qkv
from jax_mla.cache import is_fp8
from jax_mla.problem import Target

# Platforms on which the bridge is forced on, for CPU CI and the NVIDIA stand-in check only.
_FORCED: set[str] = set()


@contextlib.contextmanager
def force_bridge(platforms=("cpu", "cuda")):
    """Test/bench-only: make ``backend="aiter"`` usable on ``platforms`` (``auto`` never picks it
    there). With the stand-in package on ``sys.path`` this runs the real bridge code."""
    added = set(platforms) - _FORCED
    _FORCED.update(added)
    try:
        yield
    finally:
        _FORCED.difference_update(added)


@dataclasses.dataclass(frozen=True)
class AiterPrefillConfig:
    """The AITER prefill's options: ``kv_cache_fp8`` (the model's cache is fp8, which enables
    the fp8 PS asm prefill where the arch and build have it), ``has_context`` (chunked context
    follows: its merge needs the LSE, so no PS path), ``arch`` and ``build`` (default:
    detected)."""

    kv_cache_fp8: bool = False
    has_context: bool = False
    arch: str | None = None
    build: caps.AiterBuild | None = None


class AiterBackend(Backend):
    """AITER MLA decode, and the AITER prefill paths (FlashAttention varlen, fp8 PS asm)."""

    name = "aiter"
    platforms = ("rocm",)
    views = VIEWS

    def unavailable_reason(self, target: Target) -> str | None:
        if not bridge.aiter_importable():
            return ("backend='aiter' needs the ROCm/aiter package (pip install aiter on a ROCm "
                    "host), and it is not importable here")
        if target.platform in _FORCED or target.platform == "rocm":
            return None
        return f"backend='aiter' runs on ROCm (AMD Instinct gfx942/gfx950), not {target.platform!r}"

    def check(self, problem) -> None:
        _heads.check_num_heads(problem.num_heads, "num_heads (q.shape[1])")
        if problem.kv_lora_rank != 512 or problem.rope_dim != 64:
            raise NotImplementedError(
                f"AITER's MLA kernels are built for kv_lora_rank 512 and rope 64 (D = 576); got "
                f"L={problem.kv_lora_rank}, R={problem.rope_dim}"
            )
        q, kv = caps.dtype_name(problem.q_dtype), caps.dtype_name(problem.kv_dtype)
        if q not in ("bf16", "fp8") or kv not in ("bf16", "fp8"):
            raise NotImplementedError(
                f"AITER MLA decode takes bf16 or fp8 q and KV, got q {q} / kv {kv}"
            )

    def plan(self, problem, *, tuning=None, **options) -> AiterPlan:
        """The route for ``problem``; ``options`` as ``build_aiter_decode_metadata``'s (arch,
        num_cu, mtp_decode_qlen, dcp_world_size, cp_interleave, return_lse, small_head_mode,
        build, capacity_batch, check_kernels, allow_known_bad)."""
        if tuning is not None:
            raise TypeError("backend='aiter' takes no tuning object; pass AITER's options")
        return make_plan(self.name, problem, **options)

    def schedule(self, plan: AiterPlan, metadata, *, seq_lens=None, **arrays):
        """The route's arrays; ``arrays``: ``dcp_rank``, ``cp_interleave``,
        ``dcp_tot_seq_lens``, ``live`` (see ``schedule.build_schedule``). ``seq_lens`` (the
        lengths before the metadata's clamp) is not used: AITER's planners read the metadata."""
        return build_schedule(plan, metadata, **arrays)

    def decode(self, q, kv_cache, metadata, *, plan: AiterPlan, scale, q_scale, kv_scale,
               return_lse):
        """``q [T, H, 576]`` -> ``(out [T, H, 512], lse [T, H] float32)`` via the bridge.

        ``lse`` is the kernel's when the route asks for it (``route.return_lse``), otherwise NaN
        and unused (the entry refuses ``return_lse=True`` against such a plan).
        """
        route, sched = plan.route, metadata.schedule
        if is_fp8(kv_cache.dtype) and jnp.dtype(kv_cache.dtype) != caps.fp8_dtype(route.arch):
            raise TypeError(
                f"{route.arch} stores fp8 as {caps.fp8_dtype(route.arch)}, the cache is "
                f"{jnp.dtype(kv_cache.dtype)}"
            )
        if route.kind == "asm":
            out, lse = self._asm_decode(q, kv_cache, metadata, plan, sched, scale=scale,
                                        q_scale=q_scale, kv_scale=kv_scale)
        elif route.kind in ("gluon_decode", "gluon_verify"):
            out, lse = self._gluon_decode(q, kv_cache, metadata, plan, sched, scale=scale,
                                          kv_scale=kv_scale)
        else:
            out, lse = self._segmented_verify(q, kv_cache, plan, sched, scale=scale,
                                              q_scale=q_scale, kv_scale=kv_scale)
        # jax_mla's contract: a row that sees no KV gives out 0 and lse -inf (AITER's reducer
        # reports +inf for such rows and kernels may leave garbage there).
        seen = self._rows_seeing_kv(metadata, route, sched)
        out = jnp.where(seen[:, None, None], out, jnp.zeros((), out.dtype))
        if lse is None:
            lse = jnp.full(out.shape[:2], jnp.nan, jnp.float32)
        else:
            lse = jnp.where(seen[:, None], lse.astype(jnp.float32), -jnp.inf)
        return out, lse

    @staticmethod
    def _asm_decode(q, kv_cache, md, plan, sched, **kw):
        """The asm route: AITER's ``.co`` through jax_mla's FFI launcher (``native.py``) on ROCm
        when it can serve the arch, else the Python bridge (warned once per process)."""
        route = plan.route
        if plan.problem.target.platform == "rocm":
            reason = native.unavailable_reason(route.arch)
            if reason is None:
                try:
                    return native.asm_decode(q, kv_cache, md, route, sched, **kw)
                except native.AiterInstallError as e:  # this kernel's .co is not ours to launch
                    reason = str(e)
            native.warn_fallback(reason)
        return bridge.asm_decode(q, kv_cache, md, route, sched, **kw)

    @staticmethod
    def _fp8_prefill(q, k, v, cu_q, *, rocm: bool, **kw):
        """The fp8 PS prefill: on ROCm AITER's asm kernel launched by jax_mla
        (``native_prefill.py``) when the install has it and it matches, else the Python bridge
        (warned once per process); elsewhere (CPU tests) the bridge."""
        if rocm:
            reason = native_prefill.unavailable_reason(kw["arch"])
            if reason is None:
                try:
                    return native_prefill.fp8_prefill(q, k, v, cu_q, **kw)
                except (native.AiterInstallError, NotImplementedError) as e:
                    reason = str(e)
            native.warn_fallback(reason, native_prefill.FALLBACK_WHAT)
        return bridge.fp8_prefill(q, k, v, cu_q, **kw)

    @staticmethod
    def _flash_attn_varlen(q, k, v, cu_q, cu_k, *, target, arch, **kw):
        """FlashAttention varlen: on ROCm AITER's v3 asm kernel launched by jax_mla
        (``native_fmha.py``) when AITER would run it for these operands and the install has it,
        else the Python bridge (warned once per process); elsewhere (CPU tests) the bridge."""
        if target.platform == "rocm":
            routing = native_fmha.routing_reason(arch, q, k, v, max_seqlen_k=kw["max_seqlen_k"])
            if routing is None:
                reason = native_fmha.unavailable_reason(arch, causal=kw["causal"],
                                                        num_cu=target.num_cores)
                if reason is None:
                    try:
                        return native_fmha.flash_attn_varlen(q, k, v, cu_q, cu_k, arch=arch,
                                                             num_cu=target.num_cores, **kw)
                    except (native.AiterInstallError, NotImplementedError) as e:
                        reason = str(e)
                native.warn_fallback(reason, native_fmha.FALLBACK_WHAT)
            else:  # AITER's CK kernel: compiled into its extension, no code object to launch
                native.warn_fallback(f"{routing}; AITER runs its CK kernel there, which only the "
                                     "bridge reaches", native_fmha.FALLBACK_WHAT + " (CK)")
        return bridge.flash_attn_varlen(q, k, v, cu_q, cu_k, **kw)

    @staticmethod
    def _gluon_decode(q, kv_cache, md, plan, sched, *, scale, kv_scale):
        """The small-head Gluon routes: on ROCm the installed AITER's two kernels launched by
        jax_mla (``gluon_kernels.py``: the FFI launcher) when they are there and match the
        pinned JIT signatures, else the Python bridge (warned once per process); elsewhere
        (CPU: Gluon has no interpreter) the bridge."""
        route, target = plan.route, plan.problem.target
        if target.platform == "rocm":
            reason = gluon_kernels.unavailable_reason(target, route.arch)
            if reason is None:
                try:
                    return gluon_kernels.gluon_decode(q, kv_cache, md, route, scale=scale,
                                                      target=target)
                except gluon_kernels.KernelUnavailable as e:
                    reason = str(e)
            native.warn_fallback(reason, gluon_kernels.FALLBACK_WHAT)
        return bridge.gluon_decode(q, kv_cache, md, route, sched, scale=scale,
                                   kv_scale=kv_scale)

    @staticmethod
    def _segmented_verify(q, kv_cache, plan, sched, **kw):
        """The segmented DCP verify: the installed AITER's Triton kernel launched by jax_mla
        (``triton_kernels.py``: the FFI launcher on ROCm, the interpreter on CPU) when it is
        there and matches the pinned JIT signature, else the Python bridge (warned once per
        process)."""
        route, target = plan.route, plan.problem.target
        if not triton_kernels.bridge_requested():
            reason = triton_kernels.unavailable_reason(target, route.arch)
            if reason is None:
                try:
                    return triton_kernels.segmented_dcp_verify(q, kv_cache, route, sched,
                                                               target=target, **kw)
                except triton_kernels.KernelUnavailable as e:
                    reason = str(e)
            native.warn_fallback(reason, triton_kernels.FALLBACK_WHAT)
        return bridge.segmented_dcp_verify(q, kv_cache, route, sched, **kw)

    @staticmethod
    def _rows_seeing_kv(md, route, sched):
        if route.kind == "dcp_verify":
            return sched.dcp_verify.row_lens > 0
        t = jnp.arange(md.qlen, dtype=jnp.int32)
        return (md.seq_lens[:, None] - md.qlen + t[None, :] + 1 > 0).reshape(-1)

    # -- prefill ---------------------------------------------------------------------------

    def check_prefill(self, q, k, v, *, config) -> None:
        if config is not None and not isinstance(config, AiterPrefillConfig):
            raise TypeError(f"config must be an AiterPrefillConfig for backend='aiter', got "
                            f"{type(config).__name__}")

    def prefill(self, q, k, v, cu_q, cu_k, *, scale, causal, target, max_seqlen, max_seqlen_k,
                config=None, return_lse=True, q_scale=None, k_scale=None, v_scale=None):
        """The fp8 PS asm prefill when enabled, else FlashAttention varlen (vLLM's order).

        Same contract as :meth:`Backend.prefill`; ``lse`` is None when the fp8 PS path ran (it
        exposes none). That path is taken only on an arch and build that have it, with an fp8
        KV cache (``config.kv_cache_fp8``) or fp8 q, k, v in the arch's fp8 dtype (their scales
        go to the kernel), a valid head count, no chunked context, equal query and key packing,
        causal attention and no LSE asked for. FlashAttention takes 16-bit inputs: fp8 ones
        reach it dequantised to bf16.
        """
        config = config or AiterPrefillConfig()
        arch = config.arch or (target.arch if target.platform == "rocm" else None) \
            or caps.detect_arch()
        build = config.build or (bridge.installed_build() if bridge.aiter_importable()
                                 else caps.DEFAULT_BUILD)
        max_seqlen = q.shape[0] if max_seqlen is None else max_seqlen
        max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
        same_kv = cu_k is None
        cu_k = cu_q if cu_k is None else cu_k
        fp8_in = is_fp8(q.dtype)
        use_ps = (arch is not None and caps.fp8_prefill_supported(arch, build)
                  and (config.kv_cache_fp8 or fp8_in) and _heads.is_valid_num_heads(q.shape[1])
                  and not config.has_context and same_kv and causal and not return_lse
                  and (not fp8_in or jnp.dtype(q.dtype) == caps.fp8_dtype(arch)))
        live = jnp.arange(q.shape[0], dtype=jnp.int32) < cu_q[-1]  # rows past cu_q[-1]: padding
        if use_ps:
            # AITER plans for the device's CUs; off ROCm, for the arch's flagship part.
            out = self._fp8_prefill(q, k, v, cu_q, max_query_len=max_seqlen, scale=scale,
                                    arch=arch, q_scale=q_scale, k_scale=k_scale,
                                    v_scale=v_scale, rocm=target.platform == "rocm",
                                    num_cu=target.num_cores if target.platform == "rocm"
                                    else None)
            return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype)), None
        q, k, v = dequantize_qkv(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                 dtype=jnp.bfloat16)
        out, lse = self._flash_attn_varlen(q, k, v, cu_q, cu_k, target=target, arch=arch,
                                           max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen_k,
                                           scale=scale, causal=causal, return_lse=return_lse)
        out = jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
        if lse is not None:
            lse = jnp.where(live[:, None], lse.T, -jnp.inf)  # FA's [H, T] -> jax_mla's [T, H]
        return out, lse
