"""The DCP layout rules: which rank holds which token, and where (docs/design.md §8).

Decode context parallel splits each request's context round robin over ``N`` ranks of a mesh
axis, ``I`` = ``interleave`` tokens at a time: global position ``p`` is owned by rank
``(p // I) % N`` and stored at local position ``(p // (I * N)) * I + p % I``. Local positions keep
global order, so every rank's shard is an ordinary paged cache with its own block table.

Verify (``Q > 1``) needs per-*row* local lengths: row ``t`` of a request of global length ``S``
sees the global prefix ``S - Q + t + 1``, whose local part on a rank is a local prefix of length
``dcp_local_seq_lens(S - Q + t + 1)``. That is not ``local_len(S) - Q + t`` (the dropped tokens
sit on different ranks), so the local call treats every row as its own ``qlen = 1`` request with
its own length and its request's block table row (:func:`dcp_local_metadata`).

Pure integer functions in ``jax.numpy``: the rank may be a traced ``jax.lax.axis_index``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.paged import VIEWS, DecodeMetadata, flat_slot_ids, paged_views


def check_layout(world_size, interleave, page_size=None):
    for name, v in (("world_size", world_size), ("interleave", interleave)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if page_size is not None and page_size % interleave:
        raise ValueError(
            f"page_size={page_size} must be a multiple of interleave={interleave}: a page holds "
            f"whole interleave runs of one rank (docs/design.md §8.6, page_size % I == 0)"
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
    check_layout(world_size, interleave)
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
    check_layout(world_size, interleave, page_size)
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
    check_layout(world_size, interleave, page_size)
    cap = int(max_pages) * int(page_size)
    base = (cap // (interleave * world_size)) * interleave
    local = base + min(max(cap - base * world_size, 0), interleave)
    return max(1, -(-local // page_size))


def dcp_local_metadata(block_table, seq_lens, *, qlen: int, page_size: int, world_size: int,
                       rank, interleave: int = 1, flat_capacity: int | None = None,
                       views=VIEWS) -> tuple[DecodeMetadata, jax.Array]:
    """Metadata for one rank's local attention: every query row as its own ``qlen=1`` request.

    A row's visible local set is a local prefix of length ``dcp_verify_row_lens`` (global causal
    bound first), so each row gets that length and its request's block-table row; decode
    (``Q = 1``) is the special case with one row per request.

    Args:
      block_table: ``[B, max_pages_local]`` int32 this rank's block table.
      seq_lens: ``[B]`` int global lengths including the ``Q`` new tokens.
      qlen: ``Q`` (static). page_size: the local cache's page size (static).
      world_size, rank, interleave: as in :func:`dcp_local_seq_lens`.
      flat_capacity: as in :func:`jax_mla.build_decode_metadata` (rows are its requests).
      views: the optional views to build (``jax_mla.paged.VIEWS``).
    Returns:
      ``(metadata, row_lens)``: :class:`jax_mla.DecodeMetadata` without a plan over ``T = B * Q``
      requests with ``qlen = 1``, and ``row_lens [T]`` int32 (0 = this rank holds nothing of
      that row).
    """
    check_layout(world_size, interleave, page_size)
    block_table = jnp.asarray(block_table)
    row_lens = dcp_verify_row_lens(seq_lens, qlen, world_size, rank, interleave)
    rows = jnp.repeat(block_table, qlen, axis=0) if qlen > 1 else block_table
    md = paged_views(rows, row_lens, page_size=page_size, qlen=1, flat_capacity=flat_capacity,
                     views=views)
    return md, row_lens


def shard_cache(kv_cache, block_table, seq_lens, *, world_size: int, interleave: int = 1,
                fill_value=0.0):
    """A single-device paged cache rearranged into the DCP layout, unplaced (see
    :func:`jax_mla.dcp_shard_cache`, which also places it on a mesh)."""
    block_table = jnp.asarray(block_table)
    seq_lens = jnp.asarray(seq_lens)
    if block_table.ndim != 2 or seq_lens.shape != (block_table.shape[0],):
        raise ValueError(
            f"block_table must be [B, max_pages] and seq_lens [B]; got {tuple(block_table.shape)}"
            f" and {tuple(seq_lens.shape)}"
        )
    page_size = kv_cache.shape[1]
    check_layout(world_size, interleave, page_size)
    mpl = dcp_max_local_pages(block_table.shape[1], page_size, world_size, interleave)
    return _shard_cache(kv_cache, block_table, seq_lens, jnp.asarray(fill_value),
                        world_size=int(world_size), interleave=int(interleave), mpl=mpl)


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

