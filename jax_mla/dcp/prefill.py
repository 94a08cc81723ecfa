"""Prefill over cached context with the cache sharded along the sequence (DCP; docs/dcp.md).

A chunk of new prompt tokens attends its request's cached context, all of it, and itself,
causally (docs/design.md §9.4). Under DCP the context is spread over the ``N`` ranks of the DCP
axis, and the cached tokens all precede the new ones, so the context needs no mask: it is ``N``
disjoint key sets whose partial results merge exactly by LSE (§4). Inside one ``shard_map``, the
device at (dcp ``i``, tp ``j``):

1. attends the new tokens' queries for the ``H * N`` heads of its head-parallel group against
   its own shard of every request's context, in the MHA form: the context latents it holds
   (a local prefix of length ``dcp_local_seq_lens(context_lens)``) are gathered and
   up-projected with ``kv_b_proj`` in chunks of ``workspace_tokens`` rows, with LSE
   (:func:`jax_mla.context.context_attention`, the one-device loop over a local table);
2. merges the ``N`` context partials by LSE across the DCP axis with the decode combines
   (``ag_rs`` / ``a2a``, :mod:`jax_mla.dcp.combine`), keeping its own ``H`` heads;
3. attends the new tokens against themselves, causally, for those ``H`` heads only, and merges
   that in. Every head's causal part runs once, on the rank that owns the head: the ``N``
   ranks of a group split it by heads instead of repeating it.

Only the partials and LSEs of the new tokens travel (``[T, H * N, V]`` float32 per device); the
queries are replicated over the DCP axis like the step's other new-token inputs, and the cache
never moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_mla import checks
from jax_mla.cache import is_fp8
from jax_mla.context import (
    check_context_lens,
    check_prefill_shapes,
    context_attention,
    prefill_attend,
    up_project,
)
from jax_mla.dcp.attention import _check_mesh, _head_spec, _shard_map, place_on_mesh
from jax_mla.dcp.combine import COMBINES, combine_a2a, combine_ag_rs
from jax_mla.dcp.layout import check_layout, dcp_local_seq_lens
from jax_mla.merge import merge_attn_states
from jax_mla.prefill import resolve_prefill


def dcp_prefill_with_context(
    q,
    kv_c_normed,
    k_pe,
    kv_cache,
    block_tables,
    context_lens,
    cu_seqlens,
    kv_b_proj,
    *,
    mesh: Mesh,
    scale: float,
    workspace_tokens: int,
    rows=None,
    interleave: int = 1,
    dcp_axis: str = "dcp",
    head_axis: str | None = None,
    combine: str = "ag_rs",
    k_scale=None,
    return_lse: bool = False,
    max_seqlen: int | None = None,
    backend: str = "auto",
    config=None,
):
    """:func:`jax_mla.mla_prefill_with_context` with the cache sharded over ``dcp_axis``.

    Shapes (``N`` = size of ``dcp_axis``, ``TP`` = size of ``head_axis`` or 1, ``T`` new
    tokens of ``B`` requests, ``H_total`` heads, ``H = H_total / (TP * N)`` per device):

    Args:
      q: ``[T, H_total, P + R]`` the new tokens' queries, packed per request; replicated over
        ``dcp_axis`` (heads may be split over ``head_axis``): placed so if not.
      kv_c_normed: ``[T, L]``, k_pe: ``[T, R]`` (or ``[T, 1, R]``): the new tokens' latents;
        replicated.
      kv_cache: ``[N * P_local, page_size, L + R]``, pages sharded over ``dcp_axis``
        (:func:`jax_mla.dcp_shardings`), holding each request's context in the DCP layout.
      block_tables: ``[N, B', max_pages_local]`` int32 rank-local tables, axis 0 over
        ``dcp_axis`` (e.g. the step's ``PagedCacheManager(world_size=N).block_tables``).
      context_lens: ``[B]`` int32 *global* tokens cached before the new ones (0 = none);
        replicated. Rank ``r`` holds a local prefix of ``dcp_local_seq_lens(context_lens, N, r,
        interleave)`` of them.
      cu_seqlens: ``[B + 1]`` int32 offsets of each request's new tokens in ``q``.
      kv_b_proj: ``[L, H_total, P + V]`` (``W_UK | W_UV``).
      mesh, dcp_axis, head_axis, interleave, combine: as in :func:`jax_mla.dcp_mla_attention`
        (static).
      scale: softmax scale (static). workspace_tokens: ``W`` (static): the most context rows a
        device gathers and up-projects at once, per chunk, for its ``H * N`` heads.
      rows: ``[B]`` int32 row of ``block_tables`` of each request (``B' >= B``); None: row
        ``b`` (``B' == B``).
      k_scale: per-tensor float32 scale of an fp8 cache.
      return_lse: also return the LSE (static). max_seqlen, backend, config: as in
        :func:`jax_mla.mla_prefill` (static).

    Returns:
      ``out [T, H_total, V]`` in q's dtype, heads sharded over ``(head_axis, dcp_axis)`` (as
      :func:`jax_mla.dcp_mla_attention`'s output), and with ``return_lse`` ``lse [T, H_total]``
      float32 likewise: equal to one-device attention of each new token over its request's
      whole context plus the new tokens up to itself.

    Cost per device: the context part reads ``1/N`` of every request's context and up-projects
    it for ``H * N`` heads (the one-device work over ``N``); the causal part is the one-device
    work of ``H`` heads. Sent: the combine of ``[T, H * N, V]`` float32 partials (``ag_rs``:
    ``(N-1) * T * H * N * 4`` LSE bytes plus a ``(N-1) * T * H * V * 4`` reduce-scatter;
    ``a2a``: ``(N-1) * T * H * (V + 1) * 4``). Jittable.
    """
    _check_mesh(mesh, dcp_axis, head_axis)
    if combine not in COMBINES:
        raise ValueError(f"combine={combine!r} must be one of {COMBINES}")
    n = mesh.shape[dcp_axis]
    tp = 1 if head_axis is None else mesh.shape[head_axis]
    q, kv_c_normed, k_pe, context_lens, cu_seqlens = (
        jnp.asarray(a) for a in (q, kv_c_normed, k_pe, context_lens, cu_seqlens))
    if len(block_tables.shape) != 3 or block_tables.shape[0] != n:
        raise ValueError(f"block_tables must be [N={n}, B, max_pages_local] (rank-local), got "
                         f"shape {tuple(block_tables.shape)}")
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise TypeError(f"block_tables must be an integer array (int32), got "
                        f"{block_tables.dtype}")
    if rows is None:
        rows = jnp.arange(block_tables.shape[1], dtype=jnp.int32)
    rows = jnp.asarray(rows)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"rows must be an int [B] array, got {rows.dtype}{list(rows.shape)}")
    b = rows.shape[0]
    check_context_lens(context_lens, b)
    k_pe, nope = check_prefill_shapes(q, kv_c_normed, k_pe, kv_cache, kv_b_proj, cu_seqlens, b,
                                      workspace_tokens)
    check_layout(n, interleave, kv_cache.shape[1])
    if q.shape[1] % (n * tp):
        raise ValueError(
            f"q has H_total={q.shape[1]} heads, not divisible by the DCP world size {n} times "
            f"the head-parallel size {tp}: every device needs the same whole number of heads")
    if kv_cache.shape[0] % n:
        raise ValueError(f"kv_cache has {kv_cache.shape[0]} pages, not divisible by the DCP "
                         f"world size {n}: it must be [N * P_local, page_size, D]")
    _check_values(kv_cache, block_tables, rows, context_lens, n, int(interleave), k_scale)
    impl, target = resolve_prefill(backend, q, q, q, config)
    out, lse = _dcp_prefill(
        q, kv_c_normed, k_pe, kv_cache, block_tables, rows.astype(jnp.int32), context_lens,
        cu_seqlens, kv_b_proj, k_scale, mesh=mesh, scale=checks.static_scale(scale),
        workspace_tokens=workspace_tokens, nope=nope, interleave=int(interleave),
        dcp_axis=dcp_axis, head_axis=head_axis, combine=combine, backend=impl.name,
        target=target, max_seqlen=max_seqlen, config=config)
    return (out, lse) if return_lse else out


def _check_values(kv_cache, block_tables, rows, context_lens, n, interleave, k_scale):
    """Lengths, rows and every rank's pages (``jax_mla.checks``: eager, checked or clamped)."""
    checks.cache_scale(k_scale, kv_cache.dtype, is_fp8(kv_cache.dtype), "k_scale")
    width = block_tables.shape[2]
    checks.seq_lens_in_capacity(
        context_lens, n * width * kv_cache.shape[1], name="context_lens",
        capacity_is=f"the world size {n} x max_pages_local {width} x page_size "
                    f"{kv_cache.shape[1]}: what the sharded tables hold")
    checks.seq_lens_in_capacity(rows, block_tables.shape[1] - 1, name="rows",
                                capacity_is="the last row of block_tables")
    if not checks.is_concrete(block_tables, rows, context_lens) and not checks.checking():
        return
    local = dcp_local_seq_lens(context_lens, n, None, interleave).T  # [N, B]
    tables = jnp.take(block_tables, jnp.clip(rows, 0, block_tables.shape[1] - 1), axis=1)
    checks.pages_in_cache(tables.reshape(-1, width), local.reshape(-1), kv_cache.shape[1],
                          kv_cache.shape[0] // n, name="block_tables", ranks=n)


@functools.partial(jax.jit, static_argnames=(
    "mesh", "scale", "workspace_tokens", "nope", "interleave", "dcp_axis", "head_axis",
    "combine", "backend", "target", "max_seqlen", "config"))
def _dcp_prefill(q, kv_c, k_pe, kv_cache, block_tables, rows, context_lens, cu_seqlens,
                 kv_b_proj, k_scale, *, mesh, scale, workspace_tokens, nope, interleave,
                 dcp_axis, head_axis, combine, backend, target, max_seqlen, config):
    n = mesh.shape[dcp_axis]
    attend_opts = dict(scale=scale, backend=backend, target=target, max_seqlen=max_seqlen,
                       config=config, fp8=None)

    def body(q_g, kv_loc, bt_loc, rows, ctx, cu, kv_c, k_pe, w_g, k_scale):
        # q_g [T, H*N, P+R], w_g [L, H*N, P+V]: the heads of this device's head-parallel group.
        rank = jax.lax.axis_index(dcp_axis)
        t, hg = q_g.shape[:2]
        h = hg // n
        local_ctx = dcp_local_seq_lens(ctx, n, rank, interleave)  # a local prefix per request
        table = jnp.take(bt_loc[0], jnp.clip(rows, 0, bt_loc.shape[1] - 1), axis=0)
        o, lse = context_attention(prefill_attend(q_g, cu, **attend_opts), kv_loc, table,
                                   local_ctx, w_g, k_scale, num_rows=t,
                                   workspace_tokens=workspace_tokens, nope=nope,
                                   dtype=q_g.dtype)
        if combine == "ag_rs":
            o, lse = combine_ag_rs(o, lse, dcp_axis, rank, h)
        else:
            o, lse = combine_a2a(o, lse, dcp_axis, n)
        # The causal part of this device's own H heads (head block `rank` of the group): each
        # head's runs on one rank only.
        own = lambda x: jax.lax.dynamic_slice_in_dim(x, rank * h, h, axis=1)
        k, v = up_project(kv_c, k_pe, own(w_g), nope, q_g.dtype)
        o_new, lse_new = prefill_attend(own(q_g), cu, **attend_opts)(k, v, None, causal=True)
        out, lse = merge_attn_states(o, lse, o_new.astype(jnp.float32), lse_new)
        return out.astype(q_g.dtype), lse

    group, rep, pages = P(None, head_axis), P(), P(dcp_axis)
    hs = _head_spec(dcp_axis, head_axis)
    in_specs = (group, pages, pages, rep, rep, rep, rep, rep, group,
                None if k_scale is None else rep)
    fn = _shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(None, hs), P(None, hs)))
    args = (q, kv_cache, block_tables, rows, context_lens, cu_seqlens, kv_c, k_pe, kv_b_proj)
    # Arrays that already carry the layout pass through; others are placed (replicated inputs
    # are small; the cache and tables are sliced, never gathered).
    args = tuple(place_on_mesh(a, mesh, s) for a, s in zip(args, in_specs))
    return fn(*args, k_scale)
