"""MLA prefill in the decompressed (MHA) form: varlen flash attention with LSE.

New prompt tokens attend each other causally with full per-head keys and values (DeepSeek: qk
head dim 192 = 128 nope + 64 rope, v head dim 128), packed as varlen sequences described by
``cu_seqlens`` (vLLM's ``query_start_loc``). Two backends share one contract: the XLA reference
below (every platform, chunked online softmax, memory linear in the chunk) and a Triton
flash-attention kernel (``backends/triton_prefill.py``). The chunked-context and mixed-batch
helpers live in :mod:`jax_mla.context`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.backends import current_platform
from jax_mla.backends.triton_launch import GPU_PLATFORMS, triton_importable
from jax_mla.backends.triton_prefill import PrefillTritonConfig, prefill_triton
from jax_mla.cache import FLOAT_DTYPES

PREFILL_BACKENDS = ("auto", "xla", "triton", "aiter")
_HI = jax.lax.Precision.HIGHEST
# float32 score elements per (query chunk x heads x key chunk) tile of the XLA reference.
_TILE_ELEMS = 1 << 24
_MAX_K_CHUNK = 512
_MAX_Q_CHUNK = 512


def resolve_prefill_backend(backend: str, platform: str) -> str:
    """``"xla"`` or ``"triton"`` for ``backend`` on ``platform``, or a clear error.

    ``"auto"`` is Triton on GPU platforms when it can run there, else XLA; CPU never picks the
    interpreter on its own (it is for tests).
    """
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {PREFILL_BACKENDS}")
    if backend == "aiter" or (backend == "auto" and platform == "rocm"):
        from jax_mla.backends import resolve_backend

        if backend == "aiter":
            resolve_backend("aiter", platform)  # raises the clear "not available" error
            return "aiter"
        if resolve_backend("auto", platform).name == "aiter":
            return "aiter"
    if backend == "auto":
        return "triton" if platform in GPU_PLATFORMS and triton_importable(platform) else "xla"
    if backend == "triton" and not triton_importable(platform):
        raise RuntimeError(
            f"backend='triton' is not available on platform {platform!r} (needs triton, plus "
            "jax-triton on GPU or TRITON_INTERPRET=1 with torch on CPU)"
        )
    return backend


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
        if jnp.dtype(a.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{name} dtype {a.dtype} is not one of bf16, fp16, fp32")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1] or q.shape[1] < 1:
        raise ValueError(
            f"q, k, v must have the same number (>= 1) of heads H: {q.shape[1]}, {k.shape[1]}, "
            f"{v.shape[1]}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} vs {k.shape[2]}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same rows Tk: {k.shape[0]} vs {v.shape[0]}")


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
    triton_config: PrefillTritonConfig | None = None,
):
    """Varlen (causal) attention over packed sequences, MHA form, with optional LSE.

    Args:
      q: ``[T, H, Dqk]`` queries of every sequence, packed (DeepSeek: ``Dqk = P + R = 192``).
      k: ``[Tk, H, Dqk]`` keys (``[k_nope | k_pe]`` after the ``kv_b_proj`` up-projection).
      v: ``[Tk, H, Dv]`` values (DeepSeek: ``Dv = 128``). q, k, v share one float dtype.
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
      triton_config: tile config of the Triton kernel (default by head dims and dtype). Static.

    Returns:
      ``out [T, H, Dv]`` in q's dtype, and with ``return_lse`` also ``lse [T, H]`` float32,
      natural log. A row that sees no key (empty sequence, padding row) gives out 0, lse
      ``-inf``.
    """
    _check_qkv(q, k, v)
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
    if triton_config is not None and not isinstance(triton_config, PrefillTritonConfig):
        raise TypeError(f"triton_config must be a PrefillTritonConfig, got {type(triton_config)}")
    platform = current_platform()
    impl = resolve_prefill_backend(backend, platform)
    out, lse = _mla_prefill(
        q, k, v, cu_q, cu_k, scale=float(scale), causal=bool(causal), backend=impl,
        platform=platform, max_seqlen=int(max_seqlen or t), max_seqlen_k=int(max_seqlen_k or tk),
        triton_config=triton_config,
    )
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("scale", "causal", "backend", "platform",
                                             "max_seqlen", "max_seqlen_k", "triton_config"))
def _mla_prefill(q, k, v, cu_q, cu_k, *, scale, causal, backend, platform, max_seqlen,
                 max_seqlen_k, triton_config):
    return prefill_attention(q, k, v, cu_q, cu_k, scale=scale, causal=causal, backend=backend,
                             platform=platform, max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k,
                             triton_config=triton_config)


def prefill_attention(q, k, v, cu_q, cu_k, *, scale, causal, backend, platform,
                      max_seqlen=None, max_seqlen_k=None, triton_config=None):
    """Unchecked, traceable core of :func:`mla_prefill` for callers that validated already.

    ``backend`` is a resolved name (``"xla"`` or ``"triton"``). Returns ``(out [T, H, Dv] in q's
    dtype, lse [T, H] float32)``.
    """
    t, h, _ = q.shape
    tk, _, dv = v.shape
    if t == 0 or tk == 0:
        return (jnp.zeros((t, h, dv), q.dtype), jnp.full((t, h), -jnp.inf, jnp.float32))
    cu_q = canonical_cu(cu_q, t)
    cu_k = canonical_cu(cu_k, tk)
    if backend == "aiter":
        from jax_mla.backends.aiter import AiterBackend

        # FlashAttention varlen with LSE (the seed's common prefill; the fp8 PS path needs the
        # KV-cache dtype and no LSE: AiterBackend.prefill(..., kv_cache_fp8=True)).
        return AiterBackend().prefill(q, k, v, cu_q, cu_k, scale=scale, max_seqlen=max_seqlen,
                                      max_seqlen_k=max_seqlen_k, causal=causal,
                                      return_lse=True)
    if backend == "triton":
        # A trailing key-less sequence covers padding rows, so the kernel writes every row.
        cu_q = jnp.concatenate([cu_q, jnp.full((1,), t, jnp.int32)])
        cu_k = jnp.concatenate([cu_k, cu_k[-1:]])
        return prefill_triton(q, k, v, cu_q, cu_k, scale=scale, causal=causal, platform=platform,
                              config=triton_config)
    out, lse = prefill_reference(q, k, v, cu_q, cu_k, scale=scale, causal=causal,
                                 max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k)
    return out.astype(q.dtype), lse


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def reference_chunks(num_heads: int, tk: int, max_seqlen: int | None,
                     max_seqlen_k: int | None) -> tuple[int, int]:
    """``(q_chunk, k_chunk)`` of the XLA reference: no larger than the sequences need (rows of
    other sequences in a tile are wasted work), and one score tile of at most ``_TILE_ELEMS``."""
    ck = min(_MAX_K_CHUNK, _pow2_ceil(max_seqlen_k or tk), tk)
    cq = max(16, min(_MAX_Q_CHUNK, _TILE_ELEMS // (num_heads * ck)))
    cq = 1 << (cq.bit_length() - 1)
    if max_seqlen is not None:
        cq = max(16, min(cq, _pow2_ceil(max_seqlen)))
    return cq, max(1, ck)


def visible_key_ranges(cu_q, cu_k, num_rows: int, causal: bool):
    """``(lo, hi)`` int32 ``[num_rows]``: packed row ``r`` sees packed keys ``lo[r] .. hi[r]``.

    Both are non-decreasing in ``r`` (sequences are packed in order and the causal bound grows
    along a sequence); padding rows get the empty range ``cu_k[-1] .. cu_k[-1]``.
    """
    b = cu_q.shape[0] - 1
    r = jnp.arange(num_rows, dtype=jnp.int32)
    seg = jnp.searchsorted(cu_q[1:], r, side="right").astype(jnp.int32)
    real = seg < b
    s = jnp.minimum(seg, b - 1)
    sq = cu_q[s + 1] - cu_q[s]
    sk = cu_k[s + 1] - cu_k[s]
    n_vis = jnp.clip(r - cu_q[s] + sk - sq + 1, 0, sk) if causal else sk
    lo = jnp.where(real, cu_k[s], cu_k[-1])
    hi = jnp.where(real, cu_k[s] + n_vis, cu_k[-1])
    return lo, hi


@functools.partial(jax.jit, static_argnames=("scale", "causal", "max_seqlen", "max_seqlen_k",
                                             "q_chunk", "k_chunk"))
def prefill_reference(q, k, v, cu_q, cu_k, *, scale, causal, max_seqlen=None, max_seqlen_k=None,
                      q_chunk=None, k_chunk=None):
    """The XLA reference: chunked online softmax, float32 statistics and accumulators.

    Args:
      q: ``[T, H, Dqk]``; k: ``[Tk, H, Dqk]``; v: ``[Tk, H, Dv]``; cu_q, cu_k: ``[B + 1]`` int32
        in canonical form (see :func:`canonical_cu`); ``Tk >= 1``.
    Returns:
      ``out [T, H, Dv] float32``, ``lse [T, H] float32`` (natural log; empty rows 0, ``-inf``).

    Query chunks of ``q_chunk`` rows run one after another; each walks only the keys its rows
    can see (contiguous, see :func:`visible_key_ranges`) in chunks of ``k_chunk``, so work
    skips other sequences and the causal upper triangle, and memory is one
    ``[q_chunk, H, k_chunk]`` tile. 16-bit inputs feed the matmuls directly with float32
    accumulation, as the tensor cores do; float32 inputs use full precision.
    """
    t, h, dqk = q.shape
    tk, _, dv = v.shape
    cq, ck = reference_chunks(h, tk, max_seqlen, max_seqlen_k)
    cq, ck = q_chunk or cq, min(k_chunk or ck, tk)
    prec = _HI if jnp.dtype(q.dtype) == jnp.float32 else None
    lo, hi = visible_key_ranges(cu_q, cu_k, t, causal)
    nq = -(-t // cq)
    pad = nq * cq - t
    qs = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(nq, cq, h, dqk)
    los = jnp.pad(lo, (0, pad), constant_values=cu_k[-1]).reshape(nq, cq)
    his = jnp.pad(hi, (0, pad), constant_values=cu_k[-1]).reshape(nq, cq)
    k_end = cu_k[-1]

    def q_block(args):
        qc, lo_c, hi_c = args
        first, last = lo_c[0], jnp.max(hi_c)

        def body(j, carry):
            m, den, acc = carry
            start = first + j * ck
            # dynamic_slice clamps the start into range; keys below `start` then belong to
            # the previous chunk and are masked out so none is counted twice.
            s0 = jnp.clip(start, 0, tk - ck)
            kc = jax.lax.dynamic_slice_in_dim(k, s0, ck, axis=0)
            vc = jax.lax.dynamic_slice_in_dim(v, s0, ck, axis=0)
            kidx = s0 + jnp.arange(ck, dtype=jnp.int32)
            # Rows past the last key are padding that may hold garbage: zero them, since
            # 0 * NaN would leak into the sums.
            vc = jnp.where((kidx < k_end)[:, None, None], vc, 0)
            see = (kidx[None, :] >= jnp.maximum(lo_c, start)[:, None]) & (
                kidx[None, :] < hi_c[:, None])
            s = jnp.einsum("qhd,khd->qhk", qc, kc, precision=prec,
                           preferred_element_type=jnp.float32) * scale
            s = jnp.where(see[:, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            den = den * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum("qhk,khv->qhv", p.astype(v.dtype), vc, precision=prec,
                            preferred_element_type=jnp.float32)
            return m_new, den, acc * alpha[..., None] + pv

        init = (jnp.full((cq, h), -jnp.inf, jnp.float32), jnp.zeros((cq, h), jnp.float32),
                jnp.zeros((cq, h, dv), jnp.float32))
        m, den, acc = jax.lax.fori_loop(0, (last - first + ck - 1) // ck, body, init)
        empty = den == 0
        den = jnp.where(empty, 1.0, den)
        out = jnp.where(empty[..., None], 0.0, acc / den[..., None])
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(den))
        return out, lse

    out, lse = jax.lax.map(q_block, (qs, los, his))
    return out.reshape(nq * cq, h, dv)[:t], lse.reshape(nq * cq, h)[:t]
