"""Chunked-context prefill and the mixed decode + prefill step (docs/design.md §9.4, §9.5).

A prefill request may already have ``context_lens[b]`` tokens in the paged latent cache (an
earlier chunk of a long prompt, or a prefix-cache hit). Its new tokens attend that context (all
of it) and each other (causally). vLLM's flow, reproduced here with static shapes:

1. new tokens: up-project ``kv_c`` with ``kv_b_proj`` into per-head ``k_nope``/``v``, append
   ``k_pe`` to every head, run causal varlen attention with LSE;
2. context, in chunks bounded by a workspace of ``W`` tokens: each request with context gets a
   per-chunk budget ``C = W // num_prefills_with_context``; chunk ``i`` gathers positions
   ``i*C .. min((i+1)*C, ctx)`` of every request from the cache (dequantising fp8), up-projects
   them, and runs non-causal attention of all new queries against them with LSE; chunks fold
   into a running result with :func:`jax_mla.merge_attn_states`;
3. the context result (prefix) merges with the new-token result (suffix).

Merging by LSE is exact, so the result equals one-shot attention over context + new tokens.

fp8 (docs/design.md §2.3): an fp8 cache is dequantised with ``k_scale`` wherever it is read.
``prefill_fp8`` also quantises each prefill attention's q, k, v to the cache's fp8 format, one
dynamic per-tensor scale each (vLLM's fp8 prefill); ``q_fp8`` quantises the absorbed decode
query where the decode route takes an fp8 one (vLLM's ``_mla_q_dtype``), as its plan says.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import checks
from jax_mla.attention import mla_attention
from jax_mla.cache import FLOAT_DTYPES, check_cache, dequantize, is_fp8, quantize_per_tensor
from jax_mla.merge import merge_attn_states
from jax_mla.paged import DecodeMetadata, expand_indptr, flat_slot_ids
from jax_mla.prefill import check_cu_seqlens, prefill_attention, resolve_prefill

_HI = jax.lax.Precision.HIGHEST


def _mm_precision(dtype):
    return _HI if jnp.dtype(dtype) == jnp.float32 else None


def up_project(kv_c, k_pe, kv_b_proj, nope_dim: int, dtype):
    """``kv_c [N, L]``, ``k_pe [N, R]``, ``kv_b_proj [L, H, P + V]`` -> ``k [N, H, P + R]``,
    ``v [N, H, V]`` in ``dtype`` (vLLM: ``kv_b_proj(kv_c).view(N, H, P + V)``; ``k_pe`` is
    shared by all heads)."""
    kv = jnp.einsum("nl,lhd->nhd", kv_c.astype(dtype), kv_b_proj.astype(dtype),
                    precision=_mm_precision(dtype), preferred_element_type=jnp.float32)
    kv = kv.astype(dtype)
    n, h = kv.shape[:2]
    pe = jnp.broadcast_to(k_pe.astype(dtype)[:, None, :], (n, h, k_pe.shape[-1]))
    return jnp.concatenate([kv[..., :nope_dim], pe], axis=-1), kv[..., nope_dim:]


def gather_context_chunk(kv_cache, block_table, context_lens, chunk, budget, workspace_tokens,
                         k_scale=None):
    """Chunk ``chunk`` of every request's cached context, packed into a fixed workspace.

    Args:
      kv_cache: ``[num_pages, page_size, D]``; block_table: ``[B, max_pages]`` int32;
      context_lens: ``[B]`` int32; chunk: int32 scalar; budget: int32 scalar ``C``.
    Returns:
      ``rows [W, D]`` float32 (dequantised; unused rows 0) and ``cu_k [B + 1]`` int32: request
      ``b``'s positions ``chunk*C .. min((chunk+1)*C, context_lens[b])`` sit at rows
      ``cu_k[b] .. cu_k[b+1]``.
    """
    num_pages, page_size, d = kv_cache.shape
    start = chunk * budget
    lens = jnp.clip(context_lens - start, 0, budget).astype(jnp.int32)
    cu_k = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens, dtype=jnp.int32)])
    req, off, valid = expand_indptr(cu_k, workspace_tokens)
    slots = flat_slot_ids(block_table, start + off, page_size, rows=req)
    slots = jnp.where(valid, jnp.clip(slots, 0, num_pages * page_size - 1), 0)
    rows = dequantize(kv_cache.reshape(num_pages * page_size, d)[slots], k_scale)
    # Unused workspace rows may have read NaN (poisoned or stale slots): select, never multiply.
    return jnp.where(valid[:, None], rows, 0.0), cu_k


def check_prefill_shapes(q, kv_c, k_pe, kv_cache, kv_b_proj, cu_seqlens, num_requests: int,
                         workspace_tokens):
    """Static checks shared by the one-device and DCP prefill over cached context.

    Returns ``(k_pe [T, R], nope)``; raises naming the argument. ``num_requests`` is ``B``.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, P + R], got shape {tuple(q.shape)}")
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"q dtype {q.dtype} is not one of bf16, fp16, fp32")
    t, h, dqk = q.shape
    if k_pe.ndim == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    if kv_c.ndim != 2 or kv_c.shape[0] != t:
        raise ValueError(f"kv_c_normed must be [T={t}, L], got shape {tuple(kv_c.shape)}")
    if k_pe.ndim != 2 or k_pe.shape[0] != t:
        raise ValueError(f"k_pe must be [T={t}, R] (or [T, 1, R]), got shape {tuple(k_pe.shape)}")
    lrank, rope = kv_c.shape[1], k_pe.shape[1]
    if not 0 < rope < dqk:
        raise ValueError(f"k_pe width R={rope} must lie in (0, q head dim {dqk})")
    nope = dqk - rope
    check_cache(kv_cache)
    if kv_cache.shape[2] != lrank + rope:
        raise ValueError(
            f"kv_cache width {kv_cache.shape[2]} must equal L + R = {lrank} + {rope}"
        )
    if kv_b_proj.ndim != 3 or kv_b_proj.shape[:2] != (lrank, h) or kv_b_proj.shape[2] <= nope:
        raise ValueError(
            f"kv_b_proj must be [L={lrank}, H={h}, P + V] with P={nope} and V >= 1, got shape "
            f"{tuple(kv_b_proj.shape)}"
        )
    b = num_requests
    if cu_seqlens.shape != (b + 1,):
        raise ValueError(
            f"cu_seqlens must be [B + 1 = {b + 1}], got shape {tuple(cu_seqlens.shape)}")
    check_cu_seqlens(cu_seqlens, t, "cu_seqlens")
    if not isinstance(workspace_tokens, int) or workspace_tokens < b:
        raise ValueError(
            f"workspace_tokens must be an int >= B={b} (each request with context needs a chunk "
            f"budget of at least one token), got {workspace_tokens!r}"
        )
    return k_pe, nope


def check_context_lens(context_lens, b: int):
    """``context_lens`` must be an int ``[B]``."""
    if context_lens.shape != (b,):
        raise ValueError(f"context_lens must be [B={b}], got shape {tuple(context_lens.shape)}")
    if not jnp.issubdtype(context_lens.dtype, jnp.integer):
        raise TypeError(f"context_lens must be an integer array (int32), got {context_lens.dtype}")


def _check_prefill_inputs(q, kv_c, k_pe, kv_cache, block_table, context_lens, cu_seqlens,
                          kv_b_proj, workspace_tokens):
    if block_table.ndim != 2:
        raise ValueError(
            f"block_table must be [B, max_pages], got shape {tuple(block_table.shape)}")
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise TypeError(f"block_table must be an integer array (int32), got {block_table.dtype}")
    b = block_table.shape[0]
    check_context_lens(context_lens, b)
    k_pe, nope = check_prefill_shapes(q, kv_c, k_pe, kv_cache, kv_b_proj, cu_seqlens, b,
                                      workspace_tokens)
    checks.seq_lens_in_capacity(context_lens, block_table.shape[1] * kv_cache.shape[1],
                                name="context_lens")
    checks.pages_in_cache(block_table, context_lens, kv_cache.shape[1], kv_cache.shape[0])
    return k_pe, nope


def mla_prefill_with_context(
    q,
    kv_c_normed,
    k_pe,
    kv_cache,
    block_table,
    context_lens,
    cu_seqlens,
    kv_b_proj,
    *,
    scale: float,
    workspace_tokens: int,
    k_scale=None,
    return_lse: bool = False,
    max_seqlen: int | None = None,
    backend: str = "auto",
    config=None,
    prefill_fp8: bool = False,
):
    """MLA prefill of new tokens over their cached context plus themselves (vLLM ``forward_mha``).

    Args:
      q: ``[T, H, P + R]`` queries of the new tokens, packed per request (``q_nope | q_pe``).
      kv_c_normed: ``[T, L]`` the new tokens' latents (after the KV norm).
      k_pe: ``[T, R]`` (or ``[T, 1, R]``) the new tokens' rotary keys.
      kv_cache: ``[num_pages, page_size, L + R]`` paged latent cache holding each request's
        context; bf16, fp16, fp32 or fp8 (dequantised with ``k_scale``).
      block_table: ``[B, max_pages]`` int32 pages of each prefill request.
      context_lens: ``[B]`` int32 tokens already cached before the new ones (0 = none).
      cu_seqlens: ``[B + 1]`` int32 offsets of each request's new tokens in ``q``.
      kv_b_proj: ``[L, H, P + V]`` the up-projection weight (``W_UK | W_UV``), as in the spec.
      scale: softmax scale. Static.
      workspace_tokens: ``W``, static: the most context rows gathered and up-projected at once
        (across requests). Each chunk costs a ``[W, H, P + R]`` and ``[W, H, V]`` workspace.
      k_scale: per-tensor float32 dequantisation multiplier of an fp8 cache.
      return_lse: also return the LSE. Static.
      max_seqlen: static bound on new tokens per request (sizes the XLA chunks).
      backend, config: as in :func:`jax_mla.mla_prefill`.
      prefill_fp8: quantise the q, k, v of every attention call (the new tokens', each context
        chunk's) to the fp8 cache's format, each with a per-tensor scale from its own amax,
        and attend them through :func:`jax_mla.mla_prefill`'s fp8 path. Needs an fp8 cache.
        The context merge needs every call's LSE, which AITER's fp8 PS prefill does not make:
        there the calls run FlashAttention on the dequantised values. Static.

    Returns:
      ``out [T, H, V]`` in q's dtype, and with ``return_lse`` also ``lse [T, H]`` float32
      (natural log), equal to attention of each new token over its request's context and the
      new tokens up to itself.

    The chunk loop runs ``ceil(max(context_lens) / C)`` times at run time (a while loop), so a
    jitted step neither recompiles as context lengths change nor runs empty chunks.
    """
    q, kv_c_normed, k_pe, block_table, context_lens, cu_seqlens = (
        jnp.asarray(a) for a in (q, kv_c_normed, k_pe, block_table, context_lens, cu_seqlens))
    k_pe, nope = _check_prefill_inputs(q, kv_c_normed, k_pe, kv_cache, block_table, context_lens,
                                       cu_seqlens, kv_b_proj, workspace_tokens)
    checks.cache_scale(k_scale, kv_cache.dtype, is_fp8(kv_cache.dtype), "k_scale")
    if not isinstance(prefill_fp8, bool):
        raise TypeError(f"prefill_fp8 must be a bool, got {prefill_fp8!r}")
    if prefill_fp8 and not is_fp8(kv_cache.dtype):
        raise ValueError(f"prefill_fp8=True quantises the prefill q, k, v to the fp8 cache's "
                         f"format; this cache is {jnp.dtype(kv_cache.dtype).name}")
    impl, target = resolve_prefill(backend, q, q, q, config)
    out, lse = _prefill_with_context(
        q, kv_c_normed, k_pe, kv_cache, block_table, context_lens, cu_seqlens, kv_b_proj,
        k_scale, scale=checks.static_scale(scale), workspace_tokens=workspace_tokens, nope=nope,
        backend=impl.name, target=target, max_seqlen=max_seqlen, config=config,
        fp8=jnp.dtype(kv_cache.dtype).name if prefill_fp8 else None)
    return (out, lse) if return_lse else out


def prefill_attend(q, cu_seqlens, *, scale, backend, target, max_seqlen, config, fp8):
    """``attend(k, v, cu_k, causal) -> (out [T, H, V], lse [T, H] float32)`` of the queries
    ``q [T, H, P + R]`` (packed by ``cu_seqlens``) against keys packed by ``cu_k`` (None: like
    the queries). ``fp8``: the fp8 dtype name q, k, v are quantised to per call, or None."""
    q_in = q if fp8 is None else quantize_per_tensor(q, fp8)

    def attend(k, v, cu_k, causal):
        if fp8 is None:
            qkv, scales = (q, k, v), None
        else:
            # One scale per tensor per call: each call's (out, lse) is exact for its own
            # inputs, so the LSE merge needs no common scale across calls.
            (k, ks), (v, vs) = quantize_per_tensor(k, fp8), quantize_per_tensor(v, fp8)
            qkv, scales = (q_in[0], k, v), (q_in[1], ks, vs)
        return prefill_attention(*qkv, cu_seqlens, cu_k, scale=scale, causal=causal,
                                 backend=backend, target=target, max_seqlen=max_seqlen,
                                 config=config, scales=scales)

    return attend


def context_attention(attend, kv_cache, block_table, context_lens, kv_b_proj, k_scale, *,
                      num_rows: int, workspace_tokens: int, nope: int, dtype):
    """The new tokens' attention over their cached context alone (§9.4 step 2), chunk by chunk.

    Args:
      attend: :func:`prefill_attend` of the new tokens' queries (``num_rows`` rows, ``H``
        heads).
      kv_cache: ``[num_pages, page_size, L + R]``; block_table ``[B, max_pages]``;
        context_lens ``[B]`` int32 (0: none); kv_b_proj ``[L, H, P + V]``.
      dtype: the up-projected keys' and values' dtype (the queries').
    Returns:
      ``(out [T, H, V] float32, lse [T, H] float32)``; rows of requests without context: out 0,
      lse ``-inf``. The loop runs ``ceil(max(context_lens) / C)`` times at run time, ``C =
      workspace_tokens // (requests with context)``.
    """
    lrank, h, pv = kv_b_proj.shape
    context_lens = jnp.maximum(context_lens.astype(jnp.int32), 0)
    with_context = jnp.sum(context_lens > 0, dtype=jnp.int32)
    budget = workspace_tokens // jnp.maximum(with_context, 1)
    num_chunks = (jnp.max(context_lens) + budget - 1) // budget

    def chunk(i, carry):
        rows, cu_k = gather_context_chunk(kv_cache, block_table, context_lens, i, budget,
                                          workspace_tokens, k_scale)
        kc, vc = up_project(rows[:, :lrank], rows[:, lrank:], kv_b_proj, nope, dtype)
        o, lse = attend(kc, vc, cu_k, causal=False)
        return merge_attn_states(carry[0], carry[1], o.astype(jnp.float32), lse)

    init = (jnp.zeros((num_rows, h, pv - nope), jnp.float32),
            jnp.full((num_rows, h), -jnp.inf, jnp.float32))
    return jax.lax.fori_loop(0, num_chunks, chunk, init)


@functools.partial(jax.jit, static_argnames=("scale", "workspace_tokens", "nope", "backend",
                                             "target", "max_seqlen", "config", "fp8"))
def _prefill_with_context(q, kv_c, k_pe, kv_cache, block_table, context_lens, cu_seqlens,
                          kv_b_proj, k_scale, *, scale, workspace_tokens, nope, backend,
                          target, max_seqlen, config, fp8):
    attend = prefill_attend(q, cu_seqlens, scale=scale, backend=backend, target=target,
                            max_seqlen=max_seqlen, config=config, fp8=fp8)
    k, v = up_project(kv_c, k_pe, kv_b_proj, nope, q.dtype)
    out_new, lse_new = attend(k, v, None, causal=True)
    out_ctx, lse_ctx = context_attention(attend, kv_cache, block_table, context_lens, kv_b_proj,
                                         k_scale, num_rows=q.shape[0],
                                         workspace_tokens=workspace_tokens, nope=nope,
                                         dtype=q.dtype)
    out, lse = merge_attn_states(out_ctx, lse_ctx, out_new.astype(jnp.float32), lse_new)
    return out.astype(q.dtype), lse


def mla_mixed_step(
    q,
    kv_c_normed,
    k_pe,
    kv_cache,
    kv_b_proj,
    decode_metadata: DecodeMetadata | None,
    prefill_block_table=None,
    prefill_context_lens=None,
    prefill_cu_seqlens=None,
    *,
    scale: float,
    workspace_tokens: int | None = None,
    k_scale=None,
    decode_backend: str = "auto",
    prefill_backend: str = "auto",
    max_seqlen: int | None = None,
    config=None,
    q_fp8: bool | str = "auto",
    q_scale=None,
    prefill_fp8: bool = False,
):
    """One MLA attention step over a batch ordered as vLLM orders it: decode requests first.

    The first ``T_d = decode_metadata.num_rows`` rows (``B_d`` requests x ``qlen``) take the
    absorbed MQA path (``q_nope @ W_UK`` -> :func:`jax_mla.mla_attention` over the latent cache
    -> ``@ W_UV``); the remaining ``T - T_d`` rows are prefill tokens and take the MHA path
    (:func:`mla_prefill_with_context`). ``T_d`` comes from the metadata's static shape, so one
    jitted step serves every decode/prefill mix of the same sizes.

    Args:
      q: ``[T, H, P + R]`` queries (decode rows, then prefill rows).
      kv_c_normed: ``[T, L]``; k_pe: ``[T, R]``: the step's new latents. They must already be
        written into ``kv_cache`` (:func:`jax_mla.write_kv_cache`, as vLLM does before
        attention): decode rows read their own token from the cache.
      kv_cache: ``[num_pages, page_size, L + R]``.
      kv_b_proj: ``[L, H, P + V]``.
      decode_metadata: :class:`jax_mla.DecodeMetadata` of the decode requests, or None (no
        decode rows).
      prefill_block_table: ``[B_p, max_pages]``; prefill_context_lens: ``[B_p]`` (cached tokens
        before this step's); prefill_cu_seqlens: ``[B_p + 1]`` offsets of the prefill tokens,
        rebased to 0 at row ``T_d``. All None when there are no prefill rows.
      scale: softmax scale of both paths (``1/sqrt(P + R)``, times mscale^2). Static.
      workspace_tokens: chunked-context workspace (required with prefill rows). Static.
      k_scale: fp8 cache dequantisation multiplier (both paths).
      decode_backend: backend of :func:`jax_mla.mla_attention`; prefill_backend, max_seqlen,
        config: as in :func:`mla_prefill_with_context`.
      q_fp8: quantise the absorbed decode query ``[ql_nope | q_pe]`` to fp8 with one per-tensor
        scale before :func:`jax_mla.mla_attention`: ``"auto"`` where the decode metadata's plan
        takes an fp8 query (its ``problem.q_dtype``; AITER plans one with an fp8 cache, as
        vLLM does), ``True`` with any fp8 cache (in the plan's fp8 dtype, else the cache's; a
        plan for a 16-bit query is then an error), ``False`` never. Static.
      q_scale: that query's float32 dequantisation multiplier (a static calibration); None:
        from the query's own amax each step (:func:`jax_mla.cache.calibrate_fp8_scale`).
      prefill_fp8: as in :func:`mla_prefill_with_context`. Static.

    Returns:
      ``out [T, H, V]`` in q's dtype.
    """
    if not (isinstance(q_fp8, bool) or q_fp8 == "auto"):
        raise ValueError(f"q_fp8 must be True, False or 'auto', got {q_fp8!r}")
    q = jnp.asarray(q)
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, P + R], got shape {tuple(q.shape)}")
    if kv_b_proj.ndim != 3:
        raise ValueError(f"kv_b_proj must be [L, H, P + V], got shape {tuple(kv_b_proj.shape)}")
    t = q.shape[0]
    if k_pe.ndim == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    t_d = 0 if decode_metadata is None else decode_metadata.num_rows
    has_prefill = prefill_cu_seqlens is not None
    if t_d > t or (not has_prefill and t_d != t):
        raise ValueError(
            f"q has T={t} rows but the decode metadata covers {t_d}: without prefill inputs T "
            "must equal the decode rows, and never be smaller"
        )
    parts = []
    if t_d:
        parts.append(_decode_rows(q[:t_d], kv_cache, kv_b_proj, decode_metadata, k_pe.shape[-1],
                                  scale=scale, backend=decode_backend, k_scale=k_scale,
                                  q_fp8=q_fp8, q_scale=q_scale))
    if has_prefill:
        if workspace_tokens is None:
            raise ValueError("workspace_tokens is required when there are prefill rows")
        parts.append(mla_prefill_with_context(
            q[t_d:], kv_c_normed[t_d:], k_pe[t_d:], kv_cache, prefill_block_table,
            prefill_context_lens, prefill_cu_seqlens, kv_b_proj, scale=scale,
            workspace_tokens=workspace_tokens, k_scale=k_scale, max_seqlen=max_seqlen,
            backend=prefill_backend, config=config, prefill_fp8=prefill_fp8))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _decode_q_dtype(md: DecodeMetadata, kv_dtype, q_fp8, q_scale):
    """The fp8 dtype the absorbed decode query is quantised to, or None (``q_fp8`` as in
    :func:`mla_mixed_step`). The plan decides (``"auto"``); nothing is re-planned here."""
    planned = md.plan.problem.q_dtype if md.plan is not None else None
    plan_fp8 = planned is not None and is_fp8(planned)
    if q_fp8 == "auto":
        fp8 = jnp.dtype(planned) if plan_fp8 else None
    elif q_fp8:
        if not is_fp8(kv_dtype):
            raise ValueError(f"q_fp8=True quantises the decode query for an fp8 cache; this "
                             f"cache is {jnp.dtype(kv_dtype).name}")
        if planned is not None and not plan_fp8:
            raise ValueError(f"q_fp8=True but the decode metadata was planned for a {planned} "
                             f"query: build it with q_dtype={jnp.dtype(kv_dtype).name}")
        fp8 = jnp.dtype(planned) if plan_fp8 else jnp.dtype(kv_dtype)
    else:
        fp8 = None
    if fp8 is None and q_scale is not None:
        raise ValueError(f"q_scale is the fp8 decode query's scale, but the query is not "
                         f"quantised (q_fp8={q_fp8!r}, planned q dtype: {planned})")
    return fp8


def absorb_query(q, kv_b_proj, nope: int):
    """``q_nope @ W_UK``: ``q [T, H, P + R]``, ``kv_b_proj [L, H, P + V]`` -> ``[T, H, L]`` in
    q's dtype (docs/design.md §1.2)."""
    w_uk = kv_b_proj[..., :nope].astype(q.dtype)  # [L, H, P]
    return jnp.einsum("thp,lhp->thl", q[..., :nope], w_uk, precision=_mm_precision(q.dtype),
                      preferred_element_type=jnp.float32).astype(q.dtype)


def unabsorb_output(latent, kv_b_proj, nope: int, dtype):
    """``latent @ W_UV``: ``[T, H, L]`` -> ``[T, H, V]`` in ``dtype``."""
    w_uv = kv_b_proj[..., nope:].astype(dtype)  # [L, H, V]
    out = jnp.einsum("thl,lhv->thv", latent.astype(dtype), w_uv, precision=_mm_precision(dtype),
                     preferred_element_type=jnp.float32)
    return out.astype(dtype)


def _decode_rows(q, kv_cache, kv_b_proj, md, rope, *, scale, backend, k_scale, q_fp8, q_scale):
    """Absorbed decode: ``[T_d, H, P + R]`` -> ``[T_d, H, V]`` (docs/design.md §1.2)."""
    lrank = kv_b_proj.shape[0]
    nope = q.shape[2] - rope
    ql_nope = absorb_query(q, kv_b_proj, nope)
    fp8 = _decode_q_dtype(md, kv_cache.dtype, q_fp8, q_scale)
    if fp8 is None:
        q_abs, q_scale = (ql_nope, q[..., nope:]), None
    else:  # one tensor, one scale over both parts (vLLM concatenates, then quantises)
        q_abs, q_scale = quantize_per_tensor(jnp.concatenate([ql_nope, q[..., nope:]], axis=-1),
                                             fp8, q_scale)
    latent = mla_attention(q_abs, kv_cache, md, scale=scale, backend=backend, q_scale=q_scale,
                           kv_scale=k_scale, kv_lora_rank=lrank)
    return unabsorb_output(latent, kv_b_proj, nope, q.dtype)
