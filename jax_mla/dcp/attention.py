"""Decode context parallel (DCP): the latent KV cache sharded along the sequence over a mesh axis.

MLA has one latent KV head, so head (tensor) parallelism alone duplicates the whole cache on every
rank. DCP instead splits each request's context round robin over ``N`` ranks of a mesh axis, so
``N`` devices hold ``N`` times the context (docs/design.md §8; the rules: ``layout.py``):

- each rank all-gathers the query heads of its DCP group (``[T, H, D] -> [T, H * N, D]``), runs
  :func:`jax_mla.mla_attention` (any backend) over its shard with its local lengths and LSE, and
  forces rows with no local token to ``lse = -inf``;
- the ``N`` partials merge exactly by LSE, and each rank keeps its own ``H`` heads
  (``combine.py``).

A step's per-rank metadata and plan are built once by :func:`build_dcp_metadata` and shared by
every layer. New tokens are written only on the rank that owns them (:func:`dcp_write_kv_cache`),
into a cache each device creates for itself (:func:`dcp_allocate_cache`: across processes, each
holds only its own devices' pages); :func:`dcp_shard_cache` moves an existing single-device cache
into this layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_mla import checks
from jax_mla.attention import mla_attention, split_q
from jax_mla.backends import get_backend
from jax_mla.cache import check_cache, is_fp8, write_kv_cache
from jax_mla.dcp.combine import COMBINES, combine_a2a, combine_ag_rs
from jax_mla.dcp.layout import (
    check_layout,
    dcp_local_metadata,
    dcp_slot_mapping,
    shard_cache,
)
from jax_mla.merge import sanitize_lse
from jax_mla.metadata import plan_decode, with_schedule
from jax_mla.paged import DecodeMetadata
from jax_mla.problem import DecodeProblem, as_target, dtype_name

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
    # An AbstractMesh is what a traced array's sharding names under jax.jit (explicit axes).
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for name, ax in (("dcp_axis", dcp_axis), ("head_axis", head_axis)):
        if ax is not None and ax not in mesh.axis_names:
            raise ValueError(f"{name}={ax!r} is not an axis of the mesh {mesh.axis_names}")
    if head_axis == dcp_axis:
        raise ValueError(f"head_axis and dcp_axis must differ, both are {dcp_axis!r}")



def dcp_shard_cache(kv_cache, block_table, seq_lens, *, world_size: int, interleave: int = 1,
                    fill_value=0.0, mesh: Mesh | None = None, dcp_axis: str = "dcp"):
    """Shard a single-device paged cache into the DCP layout (tests, demos, migration).

    Rank ``r`` gets the tokens it owns (docs/design.md §8.2) of every request, at their local
    positions, in ``B * max_pages_local`` pages of its own: request ``b``'s local page ``j`` is
    rank-local page ``b * max_pages_local + j``. Slots that hold no token are ``fill_value``.

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
    kv, tables = shard_cache(kv_cache, block_table, seq_lens, world_size=world_size,
                             interleave=interleave, fill_value=fill_value)
    if mesh is not None:
        sh = dcp_shardings(mesh, dcp_axis=dcp_axis)
        kv, tables = jax.device_put(kv, sh.kv_cache), jax.device_put(tables, sh.block_tables)
    return kv, tables


def dcp_allocate_cache(pages_per_rank: int, page_size: int, width: int = 576, *, mesh: Mesh,
                       dtype=jnp.bfloat16, dcp_axis: str = "dcp", fill_value=0.0) -> jax.Array:
    """A DCP cache made where it lives: each device creates only its own pages.

    The cache comes out of a jitted fill whose output sharding is the DCP layout, so no host
    copy of it exists and no device (no process, under ``jax.distributed``) allocates pages
    another rank holds: a process whose devices hold ``k`` of the ``N`` DCP ranks holds ``k /
    N`` of the cache (times the replicas over the other mesh axes, e.g. a head axis). Fill it
    with :func:`dcp_write_kv_cache`; :class:`jax_mla.PagedCacheManager` (``world_size=N``,
    ``num_pages=pages_per_rank``) hands out its pages.

    Args:
      pages_per_rank: ``P_local``, pages of each DCP rank. page_size: rows per page.
      width: ``L + R`` (576 for DeepSeek). dtype: the cache dtype (fp8 too).
      mesh, dcp_axis: the mesh and its DCP axis (``N`` = its size).
      fill_value: every slot's value (NaN makes stray reads visible in tests).
    Returns:
      ``[N * pages_per_rank, page_size, width]`` sharded like ``dcp_shardings(mesh).kv_cache``:
      rank ``r`` holds pages ``[r * P_local, (r + 1) * P_local)``.
    """
    _check_mesh(mesh, dcp_axis, None)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a concrete jax.sharding.Mesh (its devices hold the "
                        f"cache), got {type(mesh).__name__}")
    for name, v in (("pages_per_rank", pages_per_rank), ("page_size", page_size),
                    ("width", width)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    shape = (mesh.shape[dcp_axis] * int(pages_per_rank), int(page_size), int(width))
    return _allocator(shape, jnp.dtype(dtype), float(fill_value),
                      NamedSharding(mesh, P(dcp_axis)))()


@functools.lru_cache(maxsize=16)
def _allocator(shape, dtype, fill_value, sharding):
    # The sharding as the jitted fill's output sharding: XLA sizes each device's buffer to its
    # shard and fills it in place (each process runs only its own devices' part).
    return jax.jit(functools.partial(jnp.full, shape, fill_value, dtype), out_shardings=sharding)


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
    check_layout(n, interleave, kv_cache.shape[1])
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
    kv_cache = place_on_mesh(kv_cache, mesh, P(dcp_axis))
    block_tables = place_on_mesh(block_tables, mesh, P(dcp_axis))
    rows = [place_on_mesh(jnp.asarray(x), mesh, rep) for x in (kv_c, k_pe, positions, request_ids)]
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


def place_on_mesh(x, mesh, spec):
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



@dataclasses.dataclass(frozen=True)
class DcpMetadata:
    """One DCP step's metadata for every rank, built once (:func:`build_dcp_metadata`).

    Attributes:
      local: the ranks' :class:`jax_mla.DecodeMetadata`, planned, every array with a leading
        rank axis ``[N, ...]`` sharded over ``dcp_axis``: rank ``r``'s is over its shard, every
        query row its own ``qlen = 1`` request.
      row_lens: ``[N, T]`` int32 each rank's local KV length of every query row (0: nothing).
      qlen, interleave, dcp_axis: static: ``Q``, ``I`` and the mesh axis it was built for.
    """

    local: DecodeMetadata
    row_lens: jax.Array
    qlen: int = 1
    interleave: int = 1
    dcp_axis: str = "dcp"


jax.tree_util.register_dataclass(DcpMetadata, data_fields=["local", "row_lens"],
                                 meta_fields=["qlen", "interleave", "dcp_axis"])


def build_dcp_metadata(block_tables, seq_lens, *, mesh: Mesh, page_size: int, num_heads: int,
                       qlen: int = 1, interleave: int = 1, dcp_axis: str = "dcp",
                       head_axis: str | None = None, q_dtype=None, kv_dtype=None,
                       kv_lora_rank: int = 512, rope_dim: int = 64, backend: str = "auto",
                       flat_capacity: int | None = None, target=None, tuning=None,
                       options: dict | None = None) -> DcpMetadata:
    """Every rank's local metadata and the local kernel's plan for one DCP step, built once.

    Args:
      block_tables: ``[N, B, max_pages_local]`` int32 rank-local block tables, axis 0 over
        ``dcp_axis``.
      seq_lens: ``[B]`` int32 *global* lengths including the ``Q`` new tokens; replicated.
      mesh, dcp_axis, head_axis, interleave, qlen: as in :func:`dcp_mla_attention` (static).
      page_size: the local caches' page size (static; a multiple of ``interleave``).
      num_heads: ``H_total``, the query heads of the step (``q.shape[1]``); each local call runs
        the ``H_total / TP`` heads of its DCP group.
      q_dtype, kv_dtype, kv_lora_rank, rope_dim, backend, target, tuning, options: as in
        :func:`jax_mla.build_decode_metadata`, for the local call (which always returns an LSE).
      flat_capacity: of each rank's flat token view (its requests are the ``B * Q`` rows).
    Returns:
      :class:`DcpMetadata`. Jittable; no collective: each rank builds its own part.
    """
    _check_mesh(mesh, dcp_axis, head_axis)
    n = mesh.shape[dcp_axis]
    tp = 1 if head_axis is None else mesh.shape[head_axis]
    check_layout(n, interleave, page_size)
    if not isinstance(qlen, (int, np.integer)) or qlen < 1:
        raise ValueError(f"qlen must be a positive int, got {qlen!r}")
    block_tables, seq_lens = jnp.asarray(block_tables), jnp.asarray(seq_lens)
    _check_tables(block_tables, seq_lens, n)
    checks.seq_lens_in_capacity(
        seq_lens, n * block_tables.shape[2] * page_size,
        capacity_is=f"the world size {n} x max_pages_local {block_tables.shape[2]} x page_size "
                    f"{page_size}: what the sharded tables hold")
    if num_heads % (n * tp):
        raise ValueError(
            f"q has H_total={num_heads} heads, not divisible by the DCP world size {n} times the "
            f"head-parallel size {tp}: every device needs the same whole number of heads"
        )
    q_dtype = jnp.dtype(jnp.bfloat16 if q_dtype is None else q_dtype)
    kv_dtype = q_dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    problem = DecodeProblem(
        num_seqs=block_tables.shape[1] * qlen, qlen=1, num_heads=num_heads // tp,
        page_size=int(page_size), max_pages=block_tables.shape[2],
        kv_lora_rank=int(kv_lora_rank), rope_dim=int(rope_dim), q_dtype=dtype_name(q_dtype),
        kv_dtype=dtype_name(kv_dtype), target=as_target(target), has_kv_scale=is_fp8(kv_dtype),
        return_lse=True)
    _, plan = plan_decode(problem, backend, tuning=tuning, options=options)
    return _build_dcp(block_tables, seq_lens, mesh=mesh, plan=plan, qlen=int(qlen),
                      interleave=int(interleave), dcp_axis=dcp_axis, flat_capacity=flat_capacity)


def _check_tables(block_tables, seq_lens, n):
    if len(block_tables.shape) != 3 or block_tables.shape[0] != n:
        raise ValueError(
            f"block_tables must be [N={n}, B, max_pages_local], got {tuple(block_tables.shape)}"
        )
    if len(seq_lens.shape) != 1 or seq_lens.shape[0] != block_tables.shape[1]:
        raise ValueError(
            f"seq_lens must be [B={block_tables.shape[1]}] (block_tables is [N, B, pages]), got "
            f"shape {tuple(seq_lens.shape)}"
        )


@functools.partial(jax.jit, static_argnames=("mesh", "plan", "qlen", "interleave", "dcp_axis",
                                             "flat_capacity"))
def _build_dcp(block_tables, seq_lens, *, mesh, plan, qlen, interleave, dcp_axis,
               flat_capacity):
    n = mesh.shape[dcp_axis]
    impl = get_backend(plan.backend)

    def body(bt_loc, lens):
        md, row_lens = dcp_local_metadata(bt_loc[0], lens, qlen=qlen,
                                          page_size=plan.problem.page_size, world_size=n,
                                          rank=jax.lax.axis_index(dcp_axis),
                                          interleave=interleave, flat_capacity=flat_capacity,
                                          views=impl.views)
        md = with_schedule(md, impl, plan)
        return jax.tree.map(lambda x: x[None], md), row_lens[None]

    fn = _shard_map(body, mesh=mesh, in_specs=(P(dcp_axis), P()),
                    out_specs=(P(dcp_axis), P(dcp_axis)))
    local, row_lens = fn(place_on_mesh(block_tables, mesh, P(dcp_axis)),
                         place_on_mesh(seq_lens, mesh, P()))
    return DcpMetadata(local=local, row_lens=row_lens, qlen=qlen, interleave=interleave,
                       dcp_axis=dcp_axis)


def dcp_mla_attention(
    q,
    kv_cache,
    metadata,
    seq_lens=None,
    *,
    mesh: Mesh,
    scale: float,
    qlen: int | None = None,
    interleave: int | None = None,
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
      metadata: the step's :class:`DcpMetadata` (:func:`build_dcp_metadata`, built once for
        every layer), or the rank-local block tables ``[N, B, max_pages_local]`` int32 (axis 0
        over ``dcp_axis``) with ``seq_lens``, from which it is built in this call.
      seq_lens: ``[B]`` int32 *global* lengths including the ``Q`` new tokens (already written on
        their owning ranks, see :func:`dcp_slot_mapping`); replicated. Only with block tables.
      mesh: the ``jax.sharding.Mesh`` (static). scale: softmax scale (static).
      qlen: ``Q``; interleave: ``I`` (static; ``page_size % I == 0``): default 1, or the
        metadata's (a different value is an error).
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
    q, lr = split_q(q, kv_lora_rank)
    _check_mesh(mesh, dcp_axis, head_axis)
    if combine not in COMBINES:
        raise ValueError(f"combine={combine!r} must be one of {COMBINES}")
    n = mesh.shape[dcp_axis]
    tp = 1 if head_axis is None else mesh.shape[head_axis]
    check_cache(kv_cache)
    if isinstance(metadata, DcpMetadata):
        if seq_lens is not None:
            raise ValueError("pass seq_lens with block tables only: DcpMetadata carries them")
        for name, got, want in (("qlen", qlen, metadata.qlen),
                                ("interleave", interleave, metadata.interleave),
                                ("dcp_axis", dcp_axis, metadata.dcp_axis)):
            if got is not None and got != want:
                raise ValueError(f"{name}={got!r} but the DcpMetadata was built for {want!r}")
        md = metadata
    else:
        qlen, interleave = qlen or 1, interleave or 1
        if seq_lens is None:
            raise ValueError("seq_lens is required with block tables (or pass a DcpMetadata)")
        _check_dcp_inputs(q, kv_cache, metadata, seq_lens, n, tp, qlen, interleave)
        md = build_dcp_metadata(
            metadata, seq_lens, mesh=mesh, page_size=kv_cache.shape[1], num_heads=q.shape[1],
            qlen=qlen, interleave=interleave, dcp_axis=dcp_axis, head_axis=head_axis,
            q_dtype=q.dtype, kv_dtype=kv_cache.dtype, kv_lora_rank=lr,
            rope_dim=q.shape[-1] - lr, backend=backend)
    _check_dcp_inputs(q, kv_cache, md.row_lens, None, n, tp, md.qlen, md.interleave)
    _check_dcp_values(kv_cache, md, n, kv_scale, q_scale)
    return _dcp_mla_attention(
        q, kv_cache, md, kv_scale, q_scale, mesh=mesh, scale=checks.static_scale(scale),
        head_axis=head_axis, combine=combine, backend=backend, return_lse=bool(return_lse),
        kv_lora_rank=lr)


def _check_dcp_values(kv_cache, md, n, kv_scale, q_scale):
    """Scales, and every rank's pages against its local cache (``jax_mla.checks``)."""
    checks.cache_scale(kv_scale, kv_cache.dtype, is_fp8(kv_cache.dtype), "kv_scale")
    if q_scale is not None:
        checks.scale_values(q_scale, "q_scale")
    bt, lens = md.local.block_table, md.local.seq_lens  # [N, rows, pages], [N, rows]
    checks.pages_in_cache(bt.reshape(-1, bt.shape[-1]), lens.reshape(-1), kv_cache.shape[1],
                          kv_cache.shape[0] // n, name="block_tables", ranks=n)


def _check_dcp_inputs(q, kv_cache, tables_or_row_lens, seq_lens, n, tp, qlen, interleave):
    if not isinstance(qlen, (int, np.integer)) or qlen < 1:
        raise ValueError(f"qlen must be a positive int, got {qlen!r}")
    check_layout(n, interleave, kv_cache.shape[1])
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
    if seq_lens is None:  # a DcpMetadata: row_lens [N, B * Q]
        rows = tables_or_row_lens.shape[1]
        if t != rows:
            raise ValueError(f"q has T={t} rows but the DcpMetadata describes {rows} (B * Q)")
        return
    _check_tables(jnp.asarray(tables_or_row_lens), jnp.asarray(seq_lens), n)
    b = jnp.shape(seq_lens)[0]
    if t != b * qlen:
        raise ValueError(
            f"q has T={t} rows but B={b} requests x qlen={qlen} = {b * qlen}: T must equal B * Q"
        )


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "scale", "head_axis", "combine", "backend", "return_lse",
                     "kv_lora_rank"),
)
def _dcp_mla_attention(q, kv_cache, md, kv_scale, q_scale, *, mesh, scale, head_axis, combine,
                       backend, return_lse, kv_lora_rank):
    dcp_axis = md.dcp_axis
    n = mesh.shape[dcp_axis]
    hs = _head_spec(dcp_axis, head_axis)
    out_dtype = jnp.bfloat16 if is_fp8(q.dtype) else q.dtype
    # Optional scales travel as explicit replicated operands (None is an empty pytree).
    scales = (kv_scale, q_scale)
    scale_specs = tuple(None if s is None else P() for s in scales)

    def body(q_loc, kv_loc, md_loc, scales_loc):
        rank = jax.lax.axis_index(dcp_axis)
        h = q_loc.shape[1]
        q_all = jax.lax.all_gather(q_loc, dcp_axis, axis=1, tiled=True)  # [T, H*N, D] rank-major
        local = jax.tree.map(lambda x: x[0], md_loc.local)
        row_lens = md_loc.row_lens[0]
        out, lse = mla_attention(q_all, kv_loc, local, scale=scale, backend=backend,
                                 return_lse=True, kv_lora_rank=kv_lora_rank,
                                 kv_scale=scales_loc[0], q_scale=scales_loc[1])
        # Empty local rows: kernels may leave garbage (or +inf) there; -inf gives weight 0.
        lse = jnp.where(row_lens[:, None] > 0, sanitize_lse(lse), -jnp.inf)
        if combine == "ag_rs":
            out, lse = combine_ag_rs(out, lse, dcp_axis, rank, h)
        else:
            out, lse = combine_a2a(out, lse, dcp_axis, n)
        return out.astype(out_dtype), lse

    specs = (P(None, hs), P(dcp_axis), P(dcp_axis))
    fn = _shard_map(body, mesh=mesh, in_specs=(*specs, scale_specs),
                    out_specs=(P(None, hs), P(None, hs)))
    # Arrays that already carry the layout pass through; others are placed (a slice, never a
    # gather: each device keeps only its part).
    q, kv_cache = place_on_mesh(q, mesh, specs[0]), place_on_mesh(kv_cache, mesh, specs[1])
    md = jax.tree.map(lambda x: place_on_mesh(x, mesh, P(dcp_axis)), md)
    out, lse = fn(q, kv_cache, md, scales)
    return (out, lse) if return_lse else out
