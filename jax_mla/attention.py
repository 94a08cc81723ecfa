"""The jitted MLA decode/verify entry point: validate -> check the plan -> pad -> decode -> unpad.

The entry names no backend: the metadata's plan does (``build_decode_metadata``), or, for
metadata built without one, the plan made here from the call's arrays (once per trace).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import checks
from jax_mla import heads as _heads
from jax_mla.backends import get_backend
from jax_mla.backends.base import out_dtype
from jax_mla.cache import FLOAT_DTYPES, check_cache, is_fp8
from jax_mla.metadata import plan_decode, with_schedule
from jax_mla.paged import DecodeMetadata
from jax_mla.problem import DecodeProblem, Target, current_platform, detect_target, dtype_name

DEFAULT_KV_LORA_RANK = 512  # DeepSeek-V2/V3/R1, Kimi K2


def split_q(q, kv_lora_rank):
    """Canonicalise ``q`` to one ``[T, H, D]`` array and its latent width ``L``."""
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            raise ValueError("q as a tuple must be (q_nope [T, H, L], q_pe [T, H, R])")
        q_nope, q_pe = q
        if q_nope.ndim != 3 or q_pe.ndim != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
            raise ValueError(
                f"q_nope [T, H, L] and q_pe [T, H, R] must be rank 3 with the same T, H; got "
                f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
            )
        if q_nope.dtype != q_pe.dtype:
            raise TypeError(f"q_nope ({q_nope.dtype}) and q_pe ({q_pe.dtype}) dtypes differ")
        lr = q_nope.shape[-1]
        if kv_lora_rank is not None and kv_lora_rank != lr:
            raise ValueError(f"kv_lora_rank={kv_lora_rank} but q_nope has width {lr}")
        return jnp.concatenate([q_nope, q_pe], axis=-1), lr
    if q.ndim != 3:
        raise ValueError(
            f"q must be [T, H, D] (or a (q_nope, q_pe) tuple), got shape {tuple(q.shape)}"
        )
    if kv_lora_rank is None:
        if q.shape[-1] <= DEFAULT_KV_LORA_RANK:
            raise ValueError(
                f"q width {q.shape[-1]} is not DeepSeek's 512 + R: pass kv_lora_rank=L explicitly"
            )
        kv_lora_rank = DEFAULT_KV_LORA_RANK
    return q, int(kv_lora_rank)


def _check_unsupported(alibi_slopes, sliding_window, logits_soft_cap):
    for name, val, none_like in (
        ("alibi_slopes", alibi_slopes, (None,)),
        ("sliding_window", sliding_window, (None, -1, (-1, -1))),
        ("logits_soft_cap", logits_soft_cap, (None, 0, 0.0)),
    ):
        if not any(val is v or (not hasattr(val, "shape") and val == v) for v in none_like):
            raise NotImplementedError(
                f"{name} is not supported by MLA decode (as in vLLM's AITER MLA backend); "
                f"got {name}={val!r}"
            )


def _call_target(q, planned: Target | None) -> Target:
    """Where this call runs: the platform of a concrete ``q``, else jax's default one. A plan
    for a GPU traced on a CPU host is trusted (lowering ahead of time for that GPU)."""
    try:
        platform = next(iter(q.devices())).platform
        platform = current_platform() if platform == "gpu" else platform
    except (AttributeError, TypeError, StopIteration, jax.errors.ConcretizationTypeError):
        platform = current_platform()
        if planned is not None and planned.gpu and platform == "cpu":
            return planned
    return detect_target(platform)


def _problem(q, kv_cache, md, lr, q_scale, kv_scale, return_lse):
    t, h, d = q.shape
    if not isinstance(md, DecodeMetadata):
        raise TypeError(f"metadata must be a jax_mla.DecodeMetadata, got {type(md).__name__}")
    check_cache(kv_cache)
    if d != kv_cache.shape[2]:
        raise ValueError(f"q width D={d} must equal the kv_cache width {kv_cache.shape[2]}")
    if not 0 < lr < d:
        raise ValueError(f"kv_lora_rank={lr} must lie in (0, D={d})")
    if t != md.num_rows:
        raise ValueError(
            f"q has T={t} rows but metadata describes B={md.num_seqs} requests x qlen={md.qlen} "
            f"= {md.num_rows}: T must equal B * Q"
        )
    if kv_cache.shape[1] != md.page_size:
        raise ValueError(
            f"kv_cache page size {kv_cache.shape[1]} does not match metadata.page_size="
            f"{md.page_size}: build the metadata with the cache's page size"
        )
    if h < 1:
        raise ValueError("q must have at least one head")
    qdt = jnp.dtype(q.dtype)
    if qdt not in FLOAT_DTYPES and not is_fp8(qdt):
        raise TypeError(f"q dtype {qdt} is not one of bf16, fp16, fp32 or fp8")
    if is_fp8(qdt) and q_scale is None:
        raise ValueError("q is fp8: pass q_scale (the per-tensor dequantisation multiplier)")
    planned = md.plan.problem.target if md.plan is not None else None
    return DecodeProblem(
        num_seqs=md.num_seqs, qlen=md.qlen, num_heads=h, page_size=md.page_size,
        max_pages=md.max_pages, kv_lora_rank=lr, rope_dim=d - lr, q_dtype=dtype_name(qdt),
        kv_dtype=dtype_name(kv_cache.dtype), target=_call_target(q, planned),
        has_kv_scale=kv_scale is not None, return_lse=bool(return_lse),
    )


def _check_values(kv_cache, md, q_scale, kv_scale) -> None:
    """The values of the call's arrays (``jax_mla.checks``: eagerly, or under ``checked``)."""
    checks.cache_scale(kv_scale, kv_cache.dtype, is_fp8(kv_cache.dtype), "kv_scale")
    if q_scale is not None:
        checks.scale_values(q_scale, "q_scale")
    checks.pages_in_cache(md.block_table, md.seq_lens, md.page_size, kv_cache.shape[0])


def _check_plan(plan, problem: DecodeProblem, backend: str) -> None:
    if backend not in ("auto", plan.backend):
        raise ValueError(
            f"the metadata was planned for backend={plan.backend!r} but mla_attention was called "
            f"with backend={backend!r}: build the metadata for {backend!r} or pass 'auto'"
        )
    bad = plan.mismatches(problem)
    if bad:
        raise ValueError(
            f"the metadata's plan (backend={plan.backend!r}) does not match this call: "
            f"{'; '.join(bad)}. Build the metadata for the call (build_decode_metadata(..., "
            "num_heads=, q_dtype=, kv_dtype=) or q=/kv_cache= examples)"
        )


def mla_attention(
    q,
    kv_cache,
    metadata: DecodeMetadata,
    *,
    scale: float,
    backend: str = "auto",
    return_lse: bool = False,
    kv_scale=None,
    q_scale=None,
    kv_lora_rank: int | None = None,
    alibi_slopes=None,
    sliding_window=None,
    logits_soft_cap=None,
):
    """MLA decode (``Q = 1``) or multi-token verify (``Q > 1``) over a paged latent KV cache.

    Args:
      q: ``[T, H, L + R]`` absorbed queries (``q_nope @ W_UK`` then ``q_pe``), or the tuple
        ``(q_nope [T, H, L], q_pe [T, H, R])``. Rows are ordered ``b * Q + t``.
      kv_cache: ``[num_pages, page_size, L + R]``; rows ``[kv_c | k_pe]``; bf16, fp16, fp32 or fp8.
      metadata: from :func:`jax_mla.build_decode_metadata` for this step.
      scale: softmax scale, the caller's (DeepSeek: pre-absorption ``1/sqrt(192)`` times the YaRN
        mscale^2; never an implicit ``1/sqrt(D)``). Static.
      backend: ``"auto"`` (the metadata's plan, or the best available here), ``"xla"``,
        ``"triton"``, ``"aiter"``; with a planned metadata it must be ``"auto"`` or the plan's.
        Static.
      return_lse: also return the natural-log LSE (needed to merge partials, e.g. DCP). Static.
      kv_scale: per-tensor float32 dequantisation multiplier of an fp8 cache.
      q_scale: per-tensor float32 dequantisation multiplier of an fp8 ``q`` (required then).
      kv_lora_rank: ``L``; inferred from a tuple ``q``, else 512 (DeepSeek). Static.
      alibi_slopes, sliding_window, logits_soft_cap: not supported; raise ``NotImplementedError``.

    Returns:
      ``out [T, H, L]`` in q's dtype (bf16 when q is fp8), and with ``return_lse`` also
      ``lse [T, H] float32``. Row ``t`` of request ``b`` attends cache positions
      ``0 .. seq_lens[b] - Q + t``; a row that sees nothing gives out 0 and lse ``-inf``.
    """
    _check_unsupported(alibi_slopes, sliding_window, logits_soft_cap)
    scale = checks.static_scale(scale)
    q, lr = split_q(q, kv_lora_rank)
    problem = _problem(q, kv_cache, metadata, lr, q_scale, kv_scale, return_lse)
    _check_values(kv_cache, metadata, q_scale, kv_scale)
    plan = metadata.plan
    if plan is None:
        _, plan = plan_decode(problem, backend)
    else:
        _check_plan(plan, problem, backend)
    return _mla_attention(q, kv_cache, metadata, q_scale, kv_scale, scale=float(scale),
                          return_lse=bool(return_lse), plan=plan)


def degenerate(md) -> bool:
    """No request, or no page to read (every length is then 0): every row sees nothing."""
    return md.num_seqs == 0 or md.max_pages == 0


@functools.partial(jax.jit, static_argnames=("scale", "return_lse", "plan"))
def _mla_attention(q, kv_cache, md, q_scale, kv_scale, *, scale, return_lse, plan):
    if degenerate(md):  # the documented empty result, on every backend, without a kernel
        t, h = q.shape[:2]
        out = jnp.zeros((t, h, plan.problem.kv_lora_rank), out_dtype(q.dtype))
        return (out, jnp.full((t, h), -jnp.inf, jnp.float32)) if return_lse else out
    impl = get_backend(plan.backend)
    if md.plan is None:  # planned for this call: the plan's arrays are built here, once a trace
        md = with_schedule(md, impl, plan)
    h, hp = plan.problem.num_heads, plan.padded_heads
    qp = _heads.pad_heads(q, h, hp)
    out, lse = impl.decode(qp, kv_cache, md, plan=plan, scale=scale, q_scale=q_scale,
                           kv_scale=kv_scale, return_lse=return_lse)
    out = _heads.unpad_heads(out, h, hp).astype(out_dtype(q.dtype))
    if not return_lse:
        return out
    return out, _heads.unpad_heads(lse, h, hp).astype(jnp.float32)
