"""``backend="aiter"``: AITER's MLA kernels on AMD Instinct GPUs, routed as vLLM's seed does.

The route (asm decode persistent or not, Gluon decode/verify, segmented DCP verify) is decided
when the metadata is built (:func:`jax_mla.rocm.build_aiter_decode_metadata`) and carried in
``DecodeMetadata.schedule``; ``decode`` only reads it and calls the matching bridge
(``jax_mla.rocm.bridge``, the only module that imports ``aiter``). Nothing here imports ``aiter``:
the backend is registered on every platform and is *available* only on ROCm with ``aiter``
importable.

Head padding is route-dependent (asm pads to the kernel's head count, Gluon and segmented do
not), so :meth:`AiterBackend.padded_heads` returns the real count and the bridge pads and unpads
around each kernel call with the seed's maps.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp

from jax_mla.cache import is_fp8
from jax_mla.rocm import capabilities as caps

# Platforms on which the bridge is forced on, for CPU CI and the NVIDIA stand-in check only.
_FORCED: set[str] = set()


@contextlib.contextmanager
def force_bridge(platforms=("cpu", "cuda", "gpu")):
    """Test/bench-only: make ``backend="aiter"`` usable on ``platforms`` (``auto`` never picks it
    there). With the stand-in package on ``sys.path`` this runs the real bridge code."""
    added = set(platforms) - _FORCED
    _FORCED.update(added)
    try:
        yield
    finally:
        _FORCED.difference_update(added)


def _is_rocm(platform: str) -> bool:
    if platform == "rocm":
        return True
    if platform != "gpu":
        return False
    # jax reports "gpu" for both vendors; the device's compute capability says which.
    return caps.detect_arch() is not None


class AiterBackend:
    """AITER MLA decode (and, through ``prefill``, the AITER prefill paths)."""

    name = "aiter"
    # mla_attention passes return_lse: AITER's kernels only produce an LSE when asked.
    decode_takes_return_lse = True

    def is_available(self, platform: str) -> bool:
        from jax_mla.rocm.bridge import aiter_importable

        if platform in _FORCED:
            return aiter_importable()
        return _is_rocm(platform) and aiter_importable()

    def unavailable_reason(self, platform: str) -> str | None:
        """Why ``is_available(platform)`` is False (None when it is available)."""
        from jax_mla.rocm.bridge import aiter_importable

        if self.is_available(platform):
            return None
        if not aiter_importable():
            return ("backend='aiter' needs the ROCm/aiter package (pip install aiter on a ROCm "
                    "host), and it is not importable here")
        return f"backend='aiter' runs on ROCm (AMD Instinct gfx942/gfx950), not {platform!r}"

    def check(self, problem) -> None:
        from jax_mla import heads as _heads

        _heads.check_num_heads(problem.num_heads, "num_heads (q.shape[1])")
        if problem.kv_lora_rank != 512 or problem.rope_dim != 64:
            raise NotImplementedError(
                f"AITER's MLA kernels are built for kv_lora_rank 512 and rope 64 (D = 576); got "
                f"L={problem.kv_lora_rank}, R={problem.rope_dim}"
            )
        q = caps.dtype_name(problem.q_dtype)
        kv = caps.dtype_name(problem.kv_dtype)
        if q not in ("bf16", "fp8") or kv not in ("bf16", "fp8"):
            raise NotImplementedError(
                f"AITER MLA decode takes bf16 or fp8 q and KV, got q {q} / kv {kv}"
            )

    def padded_heads(self, problem) -> int:
        return problem.num_heads

    def plan(self, md, num_heads: int, platform: str, **kw):
        """The schedule for ``md`` (``build_decode_metadata(num_heads=..., backend="aiter")``).

        Without dtype arguments this plans for a bf16 query and cache; for fp8 use
        :func:`jax_mla.rocm.build_aiter_decode_metadata` (the call checks the match).
        """
        from jax_mla.rocm.metadata import plan_schedule

        return plan_schedule(md, num_heads=num_heads, **kw)

    def decode(self, q, kv_cache, metadata, *, scale, kv_lora_rank, q_scale, kv_scale,
               return_lse=None):
        """``q [T, H, 576]`` -> ``(out [T, H, 512], lse [T, H] float32)`` via the bridge.

        ``lse`` is the kernel's when the schedule asked for it (``route.return_lse``: DCP, or
        ``build_aiter_decode_metadata(..., return_lse=True)``), otherwise NaN and unused
        (``mla_attention`` passes ``return_lse``; asking for an LSE the metadata was not built
        for raises).
        """
        from jax_mla.rocm import bridge
        from jax_mla.rocm.metadata import AiterDecodeSchedule, plan_schedule

        sched = metadata.schedule
        if sched is None:
            # Not planned at build time: decide here from the actual dtypes (once per trace).
            sched = plan_schedule(metadata, num_heads=q.shape[1], q_dtype=q.dtype,
                                  kv_dtype=kv_cache.dtype,
                                  return_lse=bool(return_lse) if return_lse is not None else None)
        if not isinstance(sched, AiterDecodeSchedule):
            raise TypeError(
                f"metadata.schedule is a {type(sched).__name__}, not an AITER schedule: build "
                "the metadata with jax_mla.rocm.build_aiter_decode_metadata"
            )
        route = sched.route
        self._check_schedule(route, q, kv_cache, kv_lora_rank, return_lse)
        if route.kind == "asm":
            out, lse = bridge.asm_decode(q, kv_cache, metadata, sched, scale=scale,
                                         q_scale=q_scale, kv_scale=kv_scale)
        elif route.kind in ("gluon_decode", "gluon_verify"):
            out, lse = bridge.gluon_decode(q, kv_cache, metadata, sched, scale=scale,
                                           kv_scale=kv_scale)
        else:
            out, lse = bridge.segmented_dcp_verify(q, kv_cache, sched, scale=scale,
                                                   q_scale=q_scale, kv_scale=kv_scale)
        # jax_mla's contract: a row that sees no KV gives out 0 and lse -inf (AITER's reducer
        # reports +inf for such rows and kernels may leave garbage there).
        seen = self._rows_seeing_kv(metadata, sched)
        out = jnp.where(seen[:, None, None], out, jnp.zeros((), out.dtype))
        if lse is None:
            lse = jnp.full(out.shape[:2], jnp.nan, jnp.float32)
        else:
            lse = jnp.where(seen[:, None], lse.astype(jnp.float32), -jnp.inf)
        return out, lse

    @staticmethod
    def _rows_seeing_kv(md, sched):
        if sched.route.kind == "dcp_verify":
            return sched.dcp_verify.row_lens > 0
        t = jnp.arange(md.qlen, dtype=jnp.int32)
        return (md.seq_lens[:, None] - md.qlen + t[None, :] + 1 > 0).reshape(-1)

    @staticmethod
    def _check_schedule(route, q, kv_cache, kv_lora_rank, return_lse):
        if q.shape[1] != route.num_heads:
            raise ValueError(
                f"ROCM_AITER_MLA decode expected the DCP-gathered query head count "
                f"{route.num_heads} the metadata was built for, got {q.shape[1]}"
            )
        if kv_lora_rank != 512:
            raise NotImplementedError(f"AITER needs kv_lora_rank 512, got {kv_lora_rank}")
        for what, got, want in (("q", q.dtype, route.q_dtype),
                                ("kv_cache", kv_cache.dtype, route.kv_dtype)):
            if caps.dtype_name(got) != want:
                raise TypeError(
                    f"the AITER metadata was planned for {what} {want} but {what} is "
                    f"{jnp.dtype(got)}: pass q_dtype/kv_dtype to build_aiter_decode_metadata"
                )
        if is_fp8(kv_cache.dtype) and jnp.dtype(kv_cache.dtype) != caps.fp8_dtype(route.arch):
            raise TypeError(
                f"{route.arch} stores fp8 as {caps.fp8_dtype(route.arch)}, the cache is "
                f"{jnp.dtype(kv_cache.dtype)}"
            )
        if return_lse and not route.return_lse:
            raise ValueError(
                "return_lse=True but the AITER metadata was built without it: pass "
                "return_lse=True to build_aiter_decode_metadata"
            )

    # -- prefill ---------------------------------------------------------------------------

    def prefill(self, q, k, v, cu_q, cu_k=None, *, scale: float, max_seqlen: int,
                max_seqlen_k: int | None = None, causal: bool = True, return_lse: bool = True,
                kv_cache_fp8: bool = False, has_context: bool = False, arch: str | None = None,
                build: caps.AiterBuild | None = None):
        """Seed ``forward_mha`` for new tokens: fp8 PS asm prefill when enabled, else FA varlen.

        Same contract as :func:`jax_mla.prefill.prefill_attention`: ``q, k [T, H, P + R]``,
        ``v [T, H, V]``, ``cu_q``/``cu_k`` ``[B + 1]`` int32; returns ``out [T, H, V]`` in q's
        dtype and ``lse [T, H]`` float32 natural (``None`` when ``return_lse`` is False or the
        fp8 PS path ran: it exposes no LSE). The PS path is taken, as in the seed, only on
        gfx950 with the kernels, an fp8 KV cache (``kv_cache_fp8``), a valid head count, no
        chunked context (``has_context``: the caller needs the LSE to merge chunks), equal
        query/key packing and causal attention.
        """
        from jax_mla import heads as _heads
        from jax_mla.rocm import bridge

        arch = arch or caps.detect_arch()
        build = caps.DEFAULT_BUILD if build is None else build
        same_kv = cu_k is None
        cu_k = cu_q if cu_k is None else cu_k
        max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
        use_ps = (arch is not None and caps.fp8_prefill_supported(arch, build) and kv_cache_fp8
                  and _heads.is_valid_num_heads(q.shape[1]) and not has_context and same_kv
                  and causal and not return_lse)
        t = q.shape[0]
        live = jnp.arange(t, dtype=jnp.int32) < cu_q[-1]  # rows past cu_q[-1] are padding
        if use_ps:
            out = bridge.fp8_prefill(q, k, v, cu_q, max_query_len=max_seqlen, scale=scale,
                                     arch=arch)
            return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype)), None
        res = bridge.flash_attn_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen,
                                       max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                                       return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        out = jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
        if lse is not None:
            lse = jnp.where(live[:, None], lse.T, -jnp.inf)  # FA's [H, T] -> jax_mla's [T, H]
        return out, lse
