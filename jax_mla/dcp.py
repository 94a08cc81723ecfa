"""Decode context parallel (DCP): the latent KV cache sharded along the sequence over a mesh axis.

MLA has one latent KV head, so head (tensor) parallelism alone duplicates the whole cache on every
rank. DCP instead splits each request's context round robin over ``N`` ranks of a mesh axis, so
``N`` devices hold ``N`` times the context (MLA_SPEC.md section 4):

- global position ``p`` is owned by rank ``(p // I) % N`` and stored at local position
  ``(p // (I * N)) * I + p % I``, ``I`` = ``interleave`` tokens at a time. Local positions keep
  global order, so every rank's shard is an ordinary paged cache with its own block table;
- each rank all-gathers the query heads of its DCP group (``[T, H, D] -> [T, H * N, D]``), runs
  :func:`jax_mla.mla_attention` (any backend) over its shard with its local lengths and LSE, and
  forces rows with no local token to ``lse = -inf``;
- the ``N`` partials merge exactly with natural-log LSE weights, and each rank keeps its own ``H``
  heads: all-gather the (small) LSEs + reduce-scatter the weighted outputs (``"ag_rs"``), or
  all-to-all the partials and merge locally (``"a2a"``).

Verify (``Q > 1``) needs per-*row* local lengths: row ``t`` of a request of global length ``S``
sees the global prefix ``S - Q + t + 1``, whose local part on a rank is a local prefix of length
``dcp_local_seq_lens(S - Q + t + 1)``. That is not ``local_len(S) - Q + t`` (the dropped tokens
sit on different ranks), so the local call treats every row as its own ``qlen = 1`` request with
its own length and its request's block table row (:func:`dcp_local_metadata`).

New tokens are written only on the rank that owns them: :func:`dcp_slot_mapping` for one rank,
:func:`dcp_write_kv_cache` for the whole sharded cache inside ``jit``. :func:`dcp_shard_cache`
moves an existing single-device cache into this layout.

Everything here is ``jax.numpy``: the rank may be a traced ``jax.lax.axis_index``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mla.attention import mla_attention
from jax_mla.cache import check_cache, is_fp8, write_kv_cache
from jax_mla.merge import merge_lse_weights, sanitize_lse, weighted_sum
from jax_mla.metadata import DecodeMetadata, build_decode_metadata, flat_slot_ids

COMBINES = ("ag_rs", "a2a")

__all__ = [
    "COMBINES",
    "DcpShardings",
    "dcp_local_metadata",
    "dcp_local_seq_lens",
    "dcp_max_local_pages",
    "dcp_mla_attention",
    "dcp_shard_cache",
    "dcp_shardings",
    "dcp_slot_mapping",
    "dcp_verify_row_lens",
    "dcp_write_kv_cache",
]


# --------------------------------------------------------------------------------------------
# The sharding rule (pure integer functions)
# --------------------------------------------------------------------------------------------


def _check_layout(world_size, interleave, page_size=None):
    for name, v in (("world_size", world_size), ("interleave", interleave)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if page_size is not None and page_size % interleave:
        raise ValueError(
            f"page_size={page_size} must be a multiple of interleave={interleave}: a page holds "
            f"whole interleave runs of one rank (MLA_SPEC.md 4.1, block_size % I == 0)"
        )


def _check_rank(rank, world_size):
    if isinstance(rank, (int, np.integer)) and not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")


def dcp_local_seq_lens(seq_lens, world_size: int, rank=None, interleave: int = 1) -> jax.Array:
    """Tokens of a global length stored on a DCP rank (``get_dcp_local_seq_lens``).

    ``base = (S // I // N) * I``, ``rem = S - base * N``, ``local = base + clip(rem - rank * I,
    0, I)``. Summed over ranks it is ``S``.

    Args:
      seq_lens: ``[...]`` int global lengths (any shape; ``[B]`` or ``[B, Q]``).
      world_size: ``N`` ranks (static).
      rank: int in ``[0, N)``, a traced int32 scalar (``jax.lax.axis_index``), or ``None`` for all
        ranks at once.
      interleave: ``I`` consecutive tokens per rank turn (static).
    Returns:
      int32 ``[...]`` for one rank, or ``[..., N]`` (rank-minor) when ``rank`` is ``None``.
    """
    _check_layout(world_size, interleave)
    _check_rank(rank, world_size)
    s = jnp.maximum(jnp.asarray(seq_lens).astype(jnp.int32), 0)
    if rank is None:
        s = s[..., None]
        rank = jnp.arange(world_size, dtype=jnp.int32)
    base = (s // (interleave * world_size)) * interleave
    rem = s - base * world_size
    return base + jnp.clip(rem - jnp.asarray(rank, jnp.int32) * interleave, 0, interleave)


def dcp_verify_row_lens(total_seq_lens, qlen: int, world_size: int, rank=None,
                        interleave: int = 1) -> jax.Array:
    """Local KV length of every verify row (``dcp_local_verify_row_lens``).

    Row ``t`` of a ``Q``-token block sees the global prefix ``max(S - Q + t + 1, 0)``; the causal
    bound is applied in global coordinates first, then mapped to the shard.

    Args:
      total_seq_lens: ``[B]`` int global lengths, each including its ``Q`` new tokens.
      qlen: ``Q`` query tokens per request (static).
      world_size, rank, interleave: as in :func:`dcp_local_seq_lens`.
    Returns:
      int32 ``[B * Q]`` (rows ``b * Q + t``), or ``[B * Q, N]`` when ``rank`` is ``None``.
    """
    if not isinstance(qlen, (int, np.integer)) or qlen < 1:
        raise ValueError(f"qlen must be a positive int, got {qlen!r}")
    tot = jnp.asarray(total_seq_lens).astype(jnp.int32)
    if tot.ndim != 1:
        raise ValueError(f"total_seq_lens must be [B], got shape {tuple(tot.shape)}")
    t = jnp.arange(1, qlen + 1, dtype=jnp.int32)
    visible = jnp.maximum(tot[:, None] - qlen + t[None, :], 0)  # [B, Q]
    local = dcp_local_seq_lens(visible, world_size, rank, interleave)
    return local.reshape((tot.shape[0] * qlen,) + local.shape[2:])


def _global_positions(local_pos, world_size, rank, interleave):
    """Inverse map: the global position stored at ``local_pos`` on ``rank``."""
    return ((local_pos // interleave) * (interleave * world_size) + rank * interleave
            + local_pos % interleave)


def dcp_slot_mapping(positions, request_ids, block_table, *, page_size: int, world_size: int,
                     rank, interleave: int = 1) -> jax.Array:
    """Cache-write slots on one DCP rank: each new token is written only where it is owned.

    Block-table entry ``j`` of a rank covers the "virtual" block of global positions
    ``[j * bs * N, (j + 1) * bs * N)``, of which the rank stores ``bs`` (``bs = page_size``).
    With ``vb = p // (bs * N)``, ``vo = p % (bs * N)``: owned iff ``(vo // I) % N == rank``, and
    then ``slot = block_table[r, vb] * bs + (vo // (I * N)) * I + vo % I``; otherwise ``-1``.

    Args:
      positions: ``[T]`` int global position of each new token (negative = padding).
      request_ids: ``[T]`` int request (row of ``block_table``) of each token.
      block_table: ``[B, max_pages_local]`` int32 this rank's local block table.
      page_size: ``bs`` rows per page (static; a multiple of ``interleave``).
      world_size, rank, interleave: as in :func:`dcp_local_seq_lens` (``rank`` not ``None``).
    Returns:
      ``[T]`` int32 slots for :func:`jax_mla.write_kv_cache`; ``-1`` for tokens this rank does
      not own and for padding.
    """
    _check_layout(world_size, interleave, page_size)
    if rank is None:
        raise ValueError("rank must be given (an int or a traced axis_index), not None")
    _check_rank(rank, world_size)
    pos = jnp.asarray(positions).astype(jnp.int32)
    req = jnp.asarray(request_ids).astype(jnp.int32)
    block_table = jnp.asarray(block_table)
    if pos.ndim != 1 or req.shape != pos.shape:
        raise ValueError(
            f"positions and request_ids must both be [T]; got {tuple(pos.shape)} and "
            f"{tuple(req.shape)}"
        )
    if block_table.ndim != 2:
        raise ValueError(f"block_table must be [B, max_pages_local], got {block_table.shape}")
    span = page_size * world_size
    vo = pos % span
    owned = ((vo // interleave) % world_size == rank) & (pos >= 0)
    local = (pos // span) * page_size + (vo // (interleave * world_size)) * interleave \
        + vo % interleave
    slot = flat_slot_ids(block_table, local, page_size, rows=req)
    return jnp.where(owned, slot, -1).astype(jnp.int32)


def dcp_max_local_pages(max_pages: int, page_size: int, world_size: int,
                        interleave: int = 1) -> int:
    """Pages per request on the busiest rank for a global capacity of ``max_pages`` pages.

    Rank 0 stores the most tokens of any length, ``dcp_local_seq_lens(cap, N, 0, I)``, which is
    at most ``ceil(cap / (N * I)) * I``.
    """
    _check_layout(world_size, interleave, page_size)
    cap = int(max_pages) * int(page_size)
    base = (cap // (interleave * world_size)) * interleave
    local = base + min(max(cap - base * world_size, 0), interleave)
    return max(1, -(-local // page_size))


# --------------------------------------------------------------------------------------------
# Per-rank metadata and the single-device -> DCP layout helper
# --------------------------------------------------------------------------------------------


def dcp_local_metadata(block_table, seq_lens, *, qlen: int, page_size: int, world_size: int,
                       rank, interleave: int = 1,
                       flat_capacity: int | None = None) -> tuple[DecodeMetadata, jax.Array]:
    """Metadata for one rank's local attention: every query row as its own ``qlen=1`` request.

    A row's visible local set is a local prefix of length ``dcp_verify_row_lens`` (global causal
    bound first), so each row gets that length and its request's block-table row; decode
    (``Q = 1``) is the special case with one row per request.

    Args:
      block_table: ``[B, max_pages_local]`` int32 this rank's block table.
      seq_lens: ``[B]`` int global lengths including the ``Q`` new tokens.
      qlen: ``Q`` (static). page_size: the local cache's page size (static).
      world_size, rank, interleave: as in :func:`dcp_local_seq_lens`.
      flat_capacity: passed to :func:`jax_mla.build_decode_metadata` (rows are its requests).
    Returns:
      ``(metadata, row_lens)``: :class:`jax_mla.DecodeMetadata` over ``T = B * Q`` requests with
      ``qlen = 1``, and ``row_lens [T]`` int32 (0 = this rank holds nothing of that row).
    """
    _check_layout(world_size, interleave, page_size)
    block_table = jnp.asarray(block_table)
    row_lens = dcp_verify_row_lens(seq_lens, qlen, world_size, rank, interleave)
    rows = jnp.repeat(block_table, qlen, axis=0) if qlen > 1 else block_table
    md = build_decode_metadata(rows, row_lens, page_size=page_size, qlen=1,
                               flat_capacity=flat_capacity)
    return md, row_lens


def dcp_shard_cache(kv_cache, block_table, seq_lens, *, world_size: int, interleave: int = 1,
                    fill_value=0.0, mesh: Mesh | None = None, dcp_axis: str = "dcp"):
    """Shard a single-device paged cache into the DCP layout (tests, demos, migration).

    Rank ``r`` gets the tokens it owns (section 4.1) of every request, at their local positions,
    in ``B * max_pages_local`` pages of its own: request ``b``'s local page ``j`` is rank-local
    page ``b * max_pages_local + j``. Slots that hold no token are ``fill_value``.

    Args:
      kv_cache: ``[num_pages, page_size, D]`` the single-device cache.
      block_table: ``[B, max_pages]`` int32 its block table.
      seq_lens: ``[B]`` int lengths of the tokens to move.
      world_size: ``N`` (static). interleave: ``I`` (static; ``page_size % I == 0``).
      fill_value: value of slots that hold no token (NaN makes stray reads visible in tests).
      mesh, dcp_axis: when a mesh is given, both results are placed sharded on axis 0 over
        ``dcp_axis`` (replicated over the other mesh axes), ready for :func:`dcp_mla_attention`.
    Returns:
      ``(kv_cache_dcp [N * B * max_pages_local, page_size, D], block_tables [N, B,
      max_pages_local] int32)``; rank ``r`` owns pages ``[r * P_local, (r + 1) * P_local)`` and
      its block table holds rank-local page ids ``0 .. P_local - 1``.
    """
    check_cache(kv_cache)
    block_table = jnp.asarray(block_table)
    seq_lens = jnp.asarray(seq_lens)
    if block_table.ndim != 2 or seq_lens.shape != (block_table.shape[0],):
        raise ValueError(
            f"block_table must be [B, max_pages] and seq_lens [B]; got {tuple(block_table.shape)}"
            f" and {tuple(seq_lens.shape)}"
        )
    page_size = kv_cache.shape[1]
    _check_layout(world_size, interleave, page_size)
    mpl = dcp_max_local_pages(block_table.shape[1], page_size, world_size, interleave)
    kv, tables = _shard_cache(kv_cache, block_table, seq_lens, jnp.asarray(fill_value),
                              world_size=int(world_size), interleave=int(interleave), mpl=mpl)
    if mesh is not None:
        sh = dcp_shardings(mesh, dcp_axis=dcp_axis)
        kv, tables = jax.device_put(kv, sh.kv_cache), jax.device_put(tables, sh.block_tables)
    return kv, tables


@functools.partial(jax.jit, static_argnames=("world_size", "interleave", "mpl"))
def _shard_cache(kv_cache, block_table, seq_lens, fill_value, *, world_size, interleave, mpl):
    num_pages, ps, d = kv_cache.shape
    b = block_table.shape[0]
    local = jnp.arange(mpl * ps, dtype=jnp.int32)
    ranks = jnp.arange(world_size, dtype=jnp.int32)
    gpos = _global_positions(local[None, :], world_size, ranks[:, None], interleave)  # [N, C]
    valid = gpos[:, None, :] < seq_lens.astype(jnp.int32)[None, :, None]  # [N, B, C]
    # Gather through the original block table; positions past a request's length are masked,
    # so their (possibly -1) table entries are clamped, never trusted.
    src = jax.vmap(lambda g: flat_slot_ids(block_table, jnp.broadcast_to(g, (b, g.shape[0])),
                                           ps))(gpos)
    src = jnp.clip(jnp.where(valid, src, 0), 0, num_pages * ps - 1)
    rows = kv_cache.reshape(num_pages * ps, d)[src]  # [N, B, C, D]
    rows = jnp.where(valid[..., None], rows, fill_value.astype(kv_cache.dtype))
    kv = rows.reshape(world_size * b * mpl, ps, d)
    tables = jnp.broadcast_to(jnp.arange(b * mpl, dtype=jnp.int32).reshape(b, mpl),
                              (world_size, b, mpl))
    return kv, tables


# --------------------------------------------------------------------------------------------
# Mesh layout
# --------------------------------------------------------------------------------------------


class DcpShardings(NamedTuple):
    """NamedShardings of :func:`dcp_mla_attention`'s inputs and outputs on one mesh."""

    q: NamedSharding  # [T, H_total, D]: heads over (head_axis, dcp_axis)
    kv_cache: NamedSharding  # [N * P_local, page_size, D]: pages over dcp_axis
    block_tables: NamedSharding  # [N, B, max_pages_local]: axis 0 over dcp_axis
    seq_lens: NamedSharding  # [B]: replicated
    out: NamedSharding  # [T, H_total, L]: like q
    lse: NamedSharding  # [T, H_total]: like q


def _head_spec(dcp_axis, head_axis):
    # dcp minor: the DCP all-gather then yields one contiguous slab of heads per head-axis rank.
    return dcp_axis if head_axis is None else (head_axis, dcp_axis)


def dcp_shardings(mesh: Mesh, *, dcp_axis: str = "dcp", head_axis: str | None = None):
    """The layout :func:`dcp_mla_attention` expects, as :class:`DcpShardings`.

    Query heads are split over ``(head_axis, dcp_axis)`` (the DCP axis minor), so the device at
    (dcp ``i``, tp ``j``) holds head block ``j * N + i``; the cache and block tables are split
    over ``dcp_axis`` only and replicated over ``head_axis``; ``seq_lens`` is replicated.
    """
    _check_mesh(mesh, dcp_axis, head_axis)
    hs = _head_spec(dcp_axis, head_axis)
    ns = lambda *spec: NamedSharding(mesh, P(*spec))
    return DcpShardings(q=ns(None, hs), kv_cache=ns(dcp_axis), block_tables=ns(dcp_axis),
                        seq_lens=ns(), out=ns(None, hs), lse=ns(None, hs))


def _check_mesh(mesh, dcp_axis, head_axis):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, ax in (("dcp_axis", dcp_axis), ("head_axis", head_axis)):
        if ax is not None and ax not in mesh.axis_names:
            raise ValueError(f"{name}={ax!r} is not an axis of the mesh {mesh.axis_names}")
    if head_axis == dcp_axis:
        raise ValueError(f"head_axis and dcp_axis must differ, both are {dcp_axis!r}")


def dcp_write_kv_cache(kv_cache, kv_c, k_pe, positions, request_ids, block_tables, *,
                       mesh: Mesh, interleave: int = 1, dcp_axis: str = "dcp", k_scale=None):
    """Write new tokens into a DCP-sharded cache: each row lands only on the rank that owns it.

    Every rank sees all ``T`` new rows (replicated) and writes the ones :func:`dcp_slot_mapping`
    gives it; nothing is communicated.

    Args:
      kv_cache: ``[N * P_local, page_size, L + R]``, pages sharded over ``dcp_axis``.
      kv_c: ``[T, L]``, k_pe: ``[T, R]`` (or ``[T, 1, R]``) the new tokens' latents.
      positions: ``[T]`` int global positions (negative = padding, skipped).
      request_ids: ``[T]`` int request of each token (row of the block tables).
      block_tables: ``[N, B, max_pages_local]`` int32 rank-local tables, axis 0 over ``dcp_axis``.
      mesh, interleave, dcp_axis: as in :func:`dcp_mla_attention` (static).
      k_scale: per-tensor float32 scale of an fp8 cache (as in :func:`jax_mla.write_kv_cache`).
    Returns:
      The updated cache, same shape and sharding. Jittable.
    """
    _check_mesh(mesh, dcp_axis, None)
    check_cache(kv_cache)
    n = mesh.shape[dcp_axis]
    _check_layout(n, interleave, kv_cache.shape[1])
    if len(block_tables.shape) != 3 or block_tables.shape[0] != n:
        raise ValueError(
            f"block_tables must be [N={n}, B, max_pages_local], got {tuple(block_tables.shape)}"
        )
    return _dcp_write(kv_cache, kv_c, k_pe, positions, request_ids, block_tables, k_scale,
                      mesh=mesh, interleave=int(interleave), dcp_axis=dcp_axis)


@functools.partial(jax.jit, static_argnames=("mesh", "interleave", "dcp_axis"))
def _dcp_write(kv_cache, kv_c, k_pe, positions, request_ids, block_tables, k_scale, *, mesh,
               interleave, dcp_axis):
    n = mesh.shape[dcp_axis]
    page_size = kv_cache.shape[1]

    def body(kv_loc, bt_loc, kv_c, k_pe, pos, req, k_scale):
        slots = dcp_slot_mapping(pos, req, bt_loc[0], page_size=page_size, world_size=n,
                                 rank=jax.lax.axis_index(dcp_axis), interleave=interleave)
        return write_kv_cache(kv_loc, kv_c, k_pe, slots, k_scale=k_scale)

    rep = P()
    fn = _shard_map(body, mesh=mesh,
                    in_specs=(P(dcp_axis), P(dcp_axis), rep, rep, rep, rep,
                              None if k_scale is None else rep),
                    out_specs=P(dcp_axis))
    kv_cache = _place(kv_cache, mesh, P(dcp_axis))
    block_tables = _place(block_tables, mesh, P(dcp_axis))
    rows = [_place(jnp.asarray(x), mesh, rep) for x in (kv_c, k_pe, positions, request_ids)]
    return fn(kv_cache, block_tables, *rows, k_scale)


# --------------------------------------------------------------------------------------------
# The DCP attention entry
# --------------------------------------------------------------------------------------------


def _shard_map(f, *, mesh, in_specs, out_specs):
    """``jax.shard_map`` (jax >= 0.7), else the deprecated experimental one; no VMA check.

    The local kernel is single-device code of any backend (XLA loops whose carries start from
    constants, opaque custom calls): the varying-manual-axes check would reject it, and every
    output here is per-device data by construction (sharded over the axes it varies on).
    """
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def _place(x, mesh, spec):
    """Constrain ``x`` to ``NamedSharding(mesh, spec)`` inside jit, whatever the axis types.

    Explicit mesh axes (``jax.make_mesh``'s default since jax 0.7) take ``jax.sharding.reshard``;
    Auto axes take ``with_sharding_constraint``; shard_map then sees the layout it expects.
    """
    names = {a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))}
    axis_type = getattr(jax.sharding, "AxisType", None)
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    explicit = axis_type is not None and {types.get(a) for a in names} == {axis_type.Explicit}
    if explicit or (not names and axis_type is not None
                    and any(t == axis_type.Explicit for t in types.values())):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def scale_own_partial(out, lses, rank):
    """AG+RS's local step: this rank's partial weighted for the exact merge, float32.

    Args:
      out: ``[T, H*N, L]`` this rank's partial output (any float dtype).
      lses: ``[N, T, H*N]`` float32 every rank's natural-log LSE (``-inf`` = empty).
      rank: this rank (int or traced scalar).
    Returns:
      ``(part [T, H*N, L] float32, lse [T, H*N] float32)``: summing ``part`` over ranks gives the
      merged output; ``lse`` is the merged LSE. float32 because the sum happens inside the
      reduce-scatter, where bf16 would round at every hop.
    """
    w, lse = merge_lse_weights(lses, axis=0)
    own_w = jax.lax.dynamic_index_in_dim(w, rank, 0, keepdims=True)
    return weighted_sum(own_w, out[None], axis=0), lse


def merge_partials(outs, lses):
    """A2A's local step: the exact merge of ``N`` partials of the same heads.

    ``outs [N, T, H, L]`` (any float dtype), ``lses [N, T, H]`` natural log -> ``(out [T, H, L]
    float32, lse [T, H] float32)``; all-empty rows give 0 and ``-inf``.
    """
    w, lse = merge_lse_weights(lses, axis=0)
    return weighted_sum(w, outs, axis=0), lse


def _combine_ag_rs(out, lse, axis, rank, h):
    """LSE all-gather, local scaling, reduce-scatter (sum) of heads: ``[T, H*N] -> [T, H]``."""
    lses = jax.lax.all_gather(lse, axis)  # [N, T, H*N]: small
    part, lse_all = scale_own_partial(out, lses, rank)
    merged = jax.lax.psum_scatter(part, axis, scatter_dimension=1, tiled=True)
    return merged, jax.lax.dynamic_slice_in_dim(lse_all, rank * h, h, axis=1)


def to_head_owner_major(x, n):
    """``[T, N*H, ...] -> [N, T, H, ...]``: axis 0 = the rank that owns those heads."""
    t, hn = x.shape[:2]
    return jnp.moveaxis(x.reshape(t, n, hn // n, *x.shape[2:]), 1, 0)


def _combine_a2a(out, lse, axis, n):
    """All-to-all the partials so each rank holds the ``N`` partials of its heads; merge locally."""
    # Before the exchange axis 0 is the heads' owner; after it, the partial's source rank.
    outs = jax.lax.all_to_all(to_head_owner_major(out, n), axis, 0, 0, tiled=True)
    lses = jax.lax.all_to_all(to_head_owner_major(lse, n), axis, 0, 0, tiled=True)
    return merge_partials(outs, lses)


def dcp_mla_attention(
    q,
    kv_cache,
    block_tables,
    seq_lens,
    *,
    mesh: Mesh,
    scale: float,
    qlen: int = 1,
    interleave: int = 1,
    dcp_axis: str = "dcp",
    head_axis: str | None = None,
    combine: str = "ag_rs",
    backend: str = "auto",
    return_lse: bool = False,
    kv_lora_rank: int | None = None,
    kv_scale=None,
    q_scale=None,
):
    """MLA decode (``Q = 1``) / verify (``Q > 1``) with the KV cache sharded over ``dcp_axis``.

    Shapes (``N`` = mesh size of ``dcp_axis``, ``TP`` = size of ``head_axis`` or 1, ``H =
    H_total / (TP * N)`` heads per device, ``T = B * Q`` rows ordered ``b * Q + t``; the expected
    shardings are :func:`dcp_shardings`):

    Args:
      q: ``[T, H_total, L + R]`` absorbed queries (or ``(q_nope, q_pe)``), heads sharded over
        ``(head_axis, dcp_axis)``.
      kv_cache: ``[N * P_local, page_size, L + R]``, pages sharded over ``dcp_axis`` (rank ``r``
        holds pages ``[r * P_local, (r + 1) * P_local)``), e.g. from :func:`dcp_shard_cache`.
      block_tables: ``[N, B, max_pages_local]`` int32 rank-local block tables, axis 0 over
        ``dcp_axis``.
      seq_lens: ``[B]`` int32 *global* lengths including the ``Q`` new tokens (already written on
        their owning ranks, see :func:`dcp_slot_mapping`); replicated.
      mesh: the ``jax.sharding.Mesh`` (static). scale: softmax scale (static).
      qlen: ``Q`` (static). interleave: ``I`` (static; ``page_size % I == 0``).
      dcp_axis, head_axis: mesh axis names (static); ``head_axis=None`` means no head parallelism.
      combine: ``"ag_rs"`` or ``"a2a"`` (static), same result; see below.
      backend: the local kernel, any :func:`jax_mla.mla_attention` backend (static).
      return_lse: also return the merged natural-log LSE (static).
      kv_lora_rank, kv_scale, q_scale: as in :func:`jax_mla.mla_attention`.

    Returns:
      ``out [T, H_total, L]`` (q's dtype; bf16 for fp8 q) sharded like ``q``, and with
      ``return_lse`` ``lse [T, H_total] float32`` likewise. Equal to single-device attention over
      the whole context; a row that sees nothing gives out 0 and lse ``-inf``.

    Cost per device (ring collectives; ``L`` latent width, partials ``[T, H*N, L]``):
      ``"ag_rs"``: all-gather of ``(N-1) * T * H * N`` fp32 LSEs, then a reduce-scatter that
      sends ``(N-1) * T * H * L`` fp32 and adds them in the collective (pre-weighted, so it must
      be fp32: summing bf16 in the collective rounds at each hop).
      ``"a2a"``: sends ``(N-1) * T * H * L`` partial outputs in the kernel's dtype plus ``(N-1) *
      T * H`` LSEs, no arithmetic in the collective, then a local ``N``-way merge. It never moves
      more: ``N`` times fewer LSE bytes, and half the output bytes when the partials are bf16. An
      all-to-all is one exchange step (latency ``~1`` hop vs ``N - 1`` for a ring reduce-scatter),
      so it is the cheaper choice on all-to-all fabrics (NVLink/xGMI within a node) and for
      latency-bound decode; ``"ag_rs"`` is the safer choice across multi-hop links (ring/torus,
      inter-node), where NCCL's ring or in-switch (NVLS) reduction is bandwidth-optimal. (Byte
      counts, not measurements: no multi-GPU run has been made; see docs/dcp.md.)

    Jittable; the compiled program gathers only ``q`` and the LSEs, never the KV cache.
    """
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            raise ValueError("q as a tuple must be (q_nope [T, H, L], q_pe [T, H, R])")
        kv_lora_rank = q[0].shape[-1] if kv_lora_rank is None else kv_lora_rank
        q = jnp.concatenate(q, axis=-1)
    _check_mesh(mesh, dcp_axis, head_axis)
    if combine not in COMBINES:
        raise ValueError(f"combine={combine!r} must be one of {COMBINES}")
    n = mesh.shape[dcp_axis]
    tp = 1 if head_axis is None else mesh.shape[head_axis]
    _check_dcp_inputs(q, kv_cache, block_tables, seq_lens, n, tp, qlen, interleave)
    return _dcp_mla_attention(
        q, kv_cache, jnp.asarray(block_tables), jnp.asarray(seq_lens), kv_scale, q_scale,
        mesh=mesh, scale=float(scale), qlen=int(qlen), interleave=int(interleave),
        dcp_axis=dcp_axis, head_axis=head_axis, combine=combine, backend=backend,
        return_lse=bool(return_lse), kv_lora_rank=kv_lora_rank)


def _check_dcp_inputs(q, kv_cache, block_tables, seq_lens, n, tp, qlen, interleave):
    check_cache(kv_cache)
    if not isinstance(qlen, (int, np.integer)) or qlen < 1:
        raise ValueError(f"qlen must be a positive int, got {qlen!r}")
    _check_layout(n, interleave, kv_cache.shape[1])
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H_total, D], got shape {tuple(q.shape)}")
    t, h_total, d = q.shape
    if h_total % (n * tp):
        raise ValueError(
            f"q has H_total={h_total} heads, not divisible by the DCP world size {n} times the "
            f"head-parallel size {tp}: every device needs the same whole number of heads"
        )
    if kv_cache.shape[2] != d:
        raise ValueError(f"q width D={d} must equal the kv_cache width {kv_cache.shape[2]}")
    if kv_cache.shape[0] % n:
        raise ValueError(
            f"kv_cache has {kv_cache.shape[0]} pages, not divisible by the DCP world size {n}: "
            f"it must be [N * P_local, page_size, D] (see dcp_shard_cache)"
        )
    if len(block_tables.shape) != 3 or block_tables.shape[0] != n:
        raise ValueError(
            f"block_tables must be [N={n}, B, max_pages_local], got {tuple(block_tables.shape)}"
        )
    if len(seq_lens.shape) != 1 or seq_lens.shape[0] != block_tables.shape[1]:
        raise ValueError(
            f"seq_lens must be [B={block_tables.shape[1]}] (block_tables is [N, B, pages]), got "
            f"shape {tuple(seq_lens.shape)}"
        )
    if t != seq_lens.shape[0] * qlen:
        raise ValueError(
            f"q has T={t} rows but B={seq_lens.shape[0]} requests x qlen={qlen} = "
            f"{seq_lens.shape[0] * qlen}: T must equal B * Q"
        )


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "scale", "qlen", "interleave", "dcp_axis", "head_axis", "combine",
                     "backend", "return_lse", "kv_lora_rank"),
)
def _dcp_mla_attention(q, kv_cache, block_tables, seq_lens, kv_scale, q_scale, *, mesh, scale,
                       qlen, interleave, dcp_axis, head_axis, combine, backend, return_lse,
                       kv_lora_rank):
    n = mesh.shape[dcp_axis]
    page_size = kv_cache.shape[1]
    hs = _head_spec(dcp_axis, head_axis)
    out_dtype = jnp.bfloat16 if is_fp8(q.dtype) else q.dtype
    # Optional scales travel as explicit replicated operands (None is an empty pytree).
    scales = (kv_scale, q_scale)
    scale_specs = tuple(None if s is None else P() for s in scales)

    def body(q_loc, kv_loc, bt_loc, lens, scales_loc):
        rank = jax.lax.axis_index(dcp_axis)
        h = q_loc.shape[1]
        q_all = jax.lax.all_gather(q_loc, dcp_axis, axis=1, tiled=True)  # [T, H*N, D] rank-major
        md, row_lens = dcp_local_metadata(bt_loc[0], lens, qlen=qlen, page_size=page_size,
                                          world_size=n, rank=rank, interleave=interleave)
        out, lse = mla_attention(q_all, kv_loc, md, scale=scale, backend=backend,
                                 return_lse=True, kv_lora_rank=kv_lora_rank,
                                 kv_scale=scales_loc[0], q_scale=scales_loc[1])
        # Empty local rows: kernels may leave garbage (or +inf) there; -inf gives weight 0.
        lse = jnp.where(row_lens[:, None] > 0, sanitize_lse(lse), -jnp.inf)
        if combine == "ag_rs":
            out, lse = _combine_ag_rs(out, lse, dcp_axis, rank, h)
        else:
            out, lse = _combine_a2a(out, lse, dcp_axis, n)
        return out.astype(out_dtype), lse

    specs = (P(None, hs), P(dcp_axis), P(dcp_axis), P())
    fn = _shard_map(body, mesh=mesh, in_specs=(*specs, scale_specs),
                    out_specs=(P(None, hs), P(None, hs)))
    # Arrays that already carry the layout pass through; others are placed (a slice, never a
    # gather: each device keeps only its part).
    arrays = [_place(x, mesh, spec) for x, spec in zip((q, kv_cache, block_tables, seq_lens),
                                                        specs)]
    out, lse = fn(*arrays, scales)
    return (out, lse) if return_lse else out
