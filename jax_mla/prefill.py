"""MLA prefill in the decompressed (MHA) form: varlen flash attention with LSE.

New prompt tokens attend each other causally with full per-head keys and values (DeepSeek: qk
head dim 192 = 128 nope + 64 rope, v head dim 128), packed as varlen sequences described by
``cu_seqlens`` (vLLM's ``query_start_loc``); docs/design.md §9. Every backend serves it through
one contract (``Backend.prefill``; the default is the XLA reference of ``jax_mla.reference``).
The chunked-context and mixed-batch helpers live in :mod:`jax_mla.context`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import checks
from jax_mla.backends import get_backend, require_available, resolve_backend
from jax_mla.backends.base import out_dtype
from jax_mla.cache import FLOAT_DTYPES, is_fp8
from jax_mla.problem import Target, detect_target


def resolve_prefill(backend: str, q, k, v, config=None):
    """``(backend object, target)`` for a prefill on this process's device, checked.

    ``"auto"`` is the platform's best available backend (on a CPU, the XLA reference: the
    interpreter is for tests).
    """
    target = detect_target()
    impl = resolve_backend("auto", target) if backend == "auto" else get_backend(backend)
    impl.check_prefill(q, k, v, config=config)
    return require_available(impl, target), target


def _concrete(x) -> np.ndarray | None:
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def check_cu_seqlens(cu, num_rows: int, name: str, max_seqlen: int | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``cu`` is an int ``[B + 1]`` offset array.

    Values are checked when concrete (``cu[0] == 0``, non-decreasing, ``cu[-1] <= num_rows``,
    lengths ``<= max_seqlen``); under tracing they are clamped into that form instead.
    """
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be [B + 1] with B >= 1, got shape {tuple(cu.shape)}")
    if not jnp.issubdtype(cu.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got {cu.dtype}")
    c = _concrete(cu)
    if c is None:
        if checks.checking():  # under jax_mla.checked: the same rules, checked on the device
            d = jnp.diff(cu)
            checks.expect((cu[0] == 0) & jnp.all(d >= 0) & (cu[-1] <= num_rows),
                          f"{name} must start at 0, be non-decreasing and end at most at "
                          f"{num_rows} (the number of packed rows); got first {{first}}, last "
                          f"{{last}}, smallest step {{step}}", first=cu[0], last=cu[-1],
                          step=jnp.min(d))
            if max_seqlen is not None:
                checks.expect(jnp.max(d) <= max_seqlen, f"{name} has a sequence of length "
                              f"{{n}} > max_seqlen={max_seqlen}", n=jnp.max(d))
        return
    lens = np.diff(c)
    if c[0] != 0 or (lens < 0).any() or c[-1] > num_rows:
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at most at {num_rows} (the "
            f"number of packed rows); got {c.tolist()}"
        )
    if max_seqlen is not None and lens.size and lens.max() > max_seqlen:
        raise ValueError(f"{name} has a sequence of length {lens.max()} > max_seqlen={max_seqlen}")


def canonical_cu(cu, num_rows: int):
    """int32 offsets forced into the valid form (start 0, non-decreasing, <= ``num_rows``)."""
    cu = jnp.clip(cu.astype(jnp.int32), 0, num_rows)
    return jax.lax.cummax(cu.at[0].set(0))


def _check_qkv(q, k, v):
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 3:
            raise ValueError(f"{name} must be rank 3 [T, H, D], got shape {tuple(a.shape)}")
        if jnp.dtype(a.dtype) not in FLOAT_DTYPES and not is_fp8(a.dtype):
            raise TypeError(f"{name} dtype {a.dtype} is not one of bf16, fp16, fp32 or fp8")
    if not q.dtype == k.dtype == v.dtype:
        fp8 = [n for n, a in (("q", q), ("k", k), ("v", v)) if is_fp8(a.dtype)]
        hint = (f" ({', '.join(fp8)} fp8: an fp8 prefill takes q, k and v in one fp8 dtype, "
                "each with its scale)" if fp8 else "")
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}{hint}")
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1] or q.shape[1] < 1:
        raise ValueError(
            f"q, k, v must have the same number (>= 1) of heads H: {q.shape[1]}, {k.shape[1]}, "
            f"{v.shape[1]}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same rows Tk: {k.shape[0]} vs {v.shape[0]}")


def _check_scales(dtype, scales: dict) -> tuple | None:
    """``(q_scale, k_scale, v_scale)`` as float32 scalars for fp8 inputs, None otherwise; each
    fp8 input needs its per-tensor dequantisation multiplier, finite and > 0."""
    if not is_fp8(dtype):
        given = [n for n, s in scales.items() if s is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given for {jnp.dtype(dtype).name} q, k, v: "
                             "the scales dequantise fp8 inputs only (pass None)")
        return None
    missing = [n for n, s in scales.items() if s is None]
    if missing:
        raise ValueError(f"q, k, v are {jnp.dtype(dtype).name}: pass {', '.join(missing)} (the "
                         "per-tensor float32 dequantisation multipliers, x = fp8 * scale)")
    out = []
    for name, s in scales.items():
        s = jnp.asarray(s, jnp.float32)
        if s.size != 1:
            raise ValueError(f"{name} must be one per-tensor scale, got shape {tuple(s.shape)}")
        checks.scale_values(s, name)
        out.append(s.reshape(()))
    return tuple(out)


def _check_static_len(name, value):
    if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def mla_prefill(
    q,
    k,
    v,
    cu_seqlens,
    *,
    scale: float,
    causal: bool = True,
    return_lse: bool = False,
    max_seqlen: int | None = None,
    cu_seqlens_k=None,
    max_seqlen_k: int | None = None,
    backend: str = "auto",
    config=None,
    q_scale=None,
    k_scale=None,
    v_scale=None,
):
    """Varlen (causal) attention over packed sequences, MHA form, with optional LSE.

    Args:
      q: ``[T, H, Dqk]`` queries of every sequence, packed (DeepSeek: ``Dqk = P + R = 192``).
      k: ``[Tk, H, Dqk]`` keys (``[k_nope | k_pe]`` after the ``kv_b_proj`` up-projection).
      v: ``[Tk, H, Dv]`` values (DeepSeek: ``Dv = 128``). q, k, v share one dtype: bf16, fp16,
        fp32, or fp8 with ``q_scale``, ``k_scale``, ``v_scale``.
      cu_seqlens: ``[B + 1]`` int32 query offsets: sequence ``b`` owns rows
        ``cu_seqlens[b] .. cu_seqlens[b+1]``; ``cu_seqlens[0] == 0``. Rows at or past
        ``cu_seqlens[-1]`` are padding (out 0, lse ``-inf``).
      scale: softmax scale (DeepSeek: ``1/sqrt(192)`` times the YaRN mscale^2). Static.
      causal: mask keys after the query. With ``cu_seqlens_k`` giving longer key sequences the
        mask is bottom-right aligned: local row ``i`` of a sequence with ``sq`` queries and ``sk``
        keys sees local keys ``j <= i + sk - sq`` (queries are the sequence's last tokens). Static.
      return_lse: also return the LSE. Static.
      max_seqlen: static bound on query lengths (default ``T``); sizes the XLA chunks, never
        changes results. Checked when ``cu_seqlens`` is concrete.
      cu_seqlens_k: ``[B + 1]`` key offsets into ``k``/``v`` (default ``cu_seqlens``, then
        ``Tk`` must equal ``T``).
      max_seqlen_k: like ``max_seqlen`` for keys (default ``max_seqlen`` or ``Tk``).
      backend: ``"auto"`` (AITER on ROCm when importable, else Triton on GPU when available,
        else XLA), ``"xla"``, ``"triton"``, ``"aiter"``.
      config: the backend's prefill configuration (``PrefillTritonConfig`` for ``"triton"``,
        ``AiterPrefillConfig`` for ``"aiter"``; default: the backend's own choice). Static.
      q_scale, k_scale, v_scale: per-tensor float32 dequantisation multipliers of fp8 q, k, v
        (``x = fp8 * scale``; required then, None otherwise). A route with an fp8 kernel takes
        them as they are (AITER's fp8 PS prefill); the others attend the dequantised values
        (XLA and Triton in float32: exact, and slower than their bf16 path; AITER's
        FlashAttention in bf16).

    Returns:
      ``out [T, H, Dv]`` in q's dtype (bf16 when q is fp8), and with ``return_lse`` also ``lse
      [T, H]`` float32, natural log. A row that sees no key (empty sequence, padding row)
      gives out 0, lse ``-inf``.
    """
    _check_qkv(q, k, v)
    scales = _check_scales(q.dtype, {"q_scale": q_scale, "k_scale": k_scale,
                                     "v_scale": v_scale})
    t, tk = q.shape[0], k.shape[0]
    for name, val in (("max_seqlen", max_seqlen), ("max_seqlen_k", max_seqlen_k)):
        _check_static_len(name, val)
    cu_q = jnp.asarray(cu_seqlens)
    check_cu_seqlens(cu_q, t, "cu_seqlens", max_seqlen)
    if cu_seqlens_k is None:
        if tk != t:
            raise ValueError(
                f"k has Tk={tk} rows but q has T={t}: pass cu_seqlens_k when keys are packed "
                "differently from queries"
            )
        cu_k = cu_q
        if max_seqlen_k is None:
            max_seqlen_k = max_seqlen
    else:
        cu_k = jnp.asarray(cu_seqlens_k)
        if cu_k.shape != cu_q.shape:
            raise ValueError(
                f"cu_seqlens_k shape {tuple(cu_k.shape)} must equal cu_seqlens shape "
                f"{tuple(cu_q.shape)} (one key sequence per query sequence)"
            )
        check_cu_seqlens(cu_k, tk, "cu_seqlens_k", max_seqlen_k)
    impl, target = resolve_prefill(backend, q, k, v, config)
    out, lse = _mla_prefill(
        q, k, v, cu_q, None if cu_seqlens_k is None else cu_k, scales,
        scale=checks.static_scale(scale), causal=bool(causal), backend=impl.name, target=target,
        max_seqlen=int(max_seqlen or t), max_seqlen_k=int(max_seqlen_k or tk), config=config,
        return_lse=bool(return_lse))
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("scale", "causal", "backend", "target",
                                             "max_seqlen", "max_seqlen_k", "config",
                                             "return_lse"))
def _mla_prefill(q, k, v, cu_q, cu_k, scales, *, scale, causal, backend, target, max_seqlen,
                 max_seqlen_k, config, return_lse):
    return prefill_attention(q, k, v, cu_q, cu_k, scale=scale, causal=causal, backend=backend,
                             target=target, max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k,
                             config=config, return_lse=return_lse, scales=scales)


def prefill_attention(q, k, v, cu_q, cu_k, *, scale, causal, backend: str, target: Target,
                      max_seqlen=None, max_seqlen_k=None, config=None, return_lse=True,
                      scales=None):
    """Unchecked, traceable core of :func:`mla_prefill` for callers that validated already.

    ``backend`` is a registered name; ``cu_k`` None means keys packed like the queries;
    ``scales`` is ``(q_scale, k_scale, v_scale)`` float32 scalars when q, k, v are fp8. Returns
    ``(out [T, H, Dv] in q's dtype (bf16 for fp8), lse [T, H] float32)`` (``lse`` may be None
    when ``return_lse`` is False).
    """
    t, h, _ = q.shape
    tk, _, dv = v.shape
    if t == 0 or tk == 0:
        return (jnp.zeros((t, h, dv), out_dtype(q.dtype)),
                jnp.full((t, h), -jnp.inf, jnp.float32))
    cu_q = canonical_cu(cu_q, t)
    cu_k = None if cu_k is None else canonical_cu(cu_k, tk)
    # Scales travel only with fp8 inputs: a backend written before fp8 prefill still serves
    # every float dtype.
    fp8 = {} if scales is None else dict(zip(("q_scale", "k_scale", "v_scale"), scales))
    return get_backend(backend).prefill(q, k, v, cu_q, cu_k, scale=scale, causal=causal,
                                        target=target, max_seqlen=max_seqlen,
                                        max_seqlen_k=max_seqlen_k, config=config,
                                        return_lse=return_lse, **fp8)
