"""AITER decode metadata: the plan's arrays, and the AITER-specific metadata builder.

:func:`build_aiter_decode_metadata` is vLLM's ``AiterMLAMetadataBuilder._build_decode`` in jnp:
it decides the route once (``plan.make_plan``), builds what that route reads -- the persistent
split-KV plan (asm), the per-row DCP-verify view (segmented verify), the minimum live KV length
(Gluon) -- and carries the route in ``DecodeMetadata.plan`` and the arrays in
``DecodeMetadata.schedule`` (an :class:`AiterDecodeSchedule`). The attention call only reads
them.

Differences from vLLM, all forced by static shapes: the DCP-verify table always has the
static width (vLLM's full-CUDA-graph layout) and its ``max_kv_seq_len`` is the static local
capacity; uniform-MTP dummy padding is expressed with per-request ``qo_lens`` instead of a
padded ``query_start_loc``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter.plan import AiterPlan, make_plan
from jax_mla.backends.aiter.planner import MlaWorkPlan, plan_mla_decode
from jax_mla.dcp.layout import dcp_verify_row_lens
from jax_mla.paged import DecodeMetadata, paged_views
from jax_mla.problem import DecodeProblem, as_target, dtype_name


@dataclasses.dataclass(frozen=True)
class DcpVerifyView:
    """One paged-KV row per verify token, for the segmented DCP verify (vLLM's
    ``AiterMLADCPVerifyMetadata``).

    Attributes:
      row_lens: ``[B * Q]`` int32 this rank's KV length of each verify row, causally bounded in
        global coordinates before sharding (row ``b * Q + t``).
      block_table: ``[B * Q, max_local_pages]`` int32 subpage ids (the same list for every row of
        a request; ``row_lens`` picks the prefix).
      qo_indptr: ``[B * Q + 1]`` int32 ``arange``: one query per row.
      page_size: static subpage size (also the segmented kernel's TILE_SIZE).
      max_kv_seq_len: static kernel-visible bound (the local capacity).
    """

    row_lens: jax.Array
    block_table: jax.Array
    qo_indptr: jax.Array
    page_size: int = 1
    max_kv_seq_len: int = 1


jax.tree_util.register_dataclass(DcpVerifyView, data_fields=["row_lens", "block_table",
                                                             "qo_indptr"],
                                 meta_fields=["page_size", "max_kv_seq_len"])


@dataclasses.dataclass(frozen=True)
class AiterDecodeSchedule:
    """The arrays the AITER backend reads for one step (``DecodeMetadata.schedule``); the
    route itself is ``DecodeMetadata.plan.route``.

    Attributes:
      plan: :class:`~.planner.MlaWorkPlan` when the route is persistent, else None.
      dcp_verify: :class:`DcpVerifyView` for the segmented DCP-verify route, else None.
      min_kv_seq_len: int32 scalar, the smallest KV length over live requests (Gluon's bh64
        regime bound; 1 when there is none).
    """

    plan: MlaWorkPlan | None = None
    dcp_verify: DcpVerifyView | None = None
    min_kv_seq_len: jax.Array | None = None


jax.tree_util.register_dataclass(AiterDecodeSchedule,
                                 data_fields=["plan", "dcp_verify", "min_kv_seq_len"],
                                 meta_fields=[])


# ---------------------------------------------------------------------------------------------
# Uniform-MTP padding (docs/design.md §7.10)


def uniform_padded_mtp_qo_len(qo_len, max_qo_len: int, num_decode_tokens: int) -> int:
    """``U > 1`` iff the batch is a uniform MTP block padded with empty dummy requests, else 0.

    All of: ``B > 0``, ``num_decode_tokens > 0``, ``num_decode_tokens > sum(qo_len)``,
    ``num_decode_tokens % B == 0``, ``U = num_decode_tokens // B > 1``, some ``qo_len == 0``,
    every positive ``qo_len == U`` and ``max_qo_len == U`` (when any is positive), and the zeros
    form a suffix. ``[4,4,0,0]`` with 16 tokens -> 4; ``[4,0,4,0]`` -> 0; ``[4,2,0,0]`` -> 0.
    Host function (vLLM runs it on CPU copies).
    """
    q = np.asarray(qo_len).reshape(-1).astype(np.int64)
    b = q.shape[0]
    t = int(num_decode_tokens)
    if b == 0 or t <= 0 or t <= int(q.sum()) or t % b != 0:
        return 0
    u = t // b
    if u <= 1:
        return 0
    zero = q == 0
    if not zero.any():
        return 0
    pos = q[~zero]
    if pos.size and (np.any(pos != u) or int(max_qo_len) != u):
        return 0
    first_zero = int(np.argmax(zero))
    if np.any(~zero[first_zero:]):
        return 0
    return u


# ---------------------------------------------------------------------------------------------
# DCP verify view (docs/design.md §7.11)


def build_dcp_verify_view(block_table, dcp_tot_seq_lens, *, qlen: int, kernel_block_size: int,
                          dcp_world_size: int, dcp_rank: int,
                          cp_interleave: int = 1) -> DcpVerifyView:
    """The segmented-verify row view (vLLM's ``_build_dcp_verify_row_view``), static width.

    Subpage ``p`` of request ``r`` is ``block_table[r, p // ppb] * ppb + p % ppb`` with
    ``ppb = kernel_block_size // page`` and ``page = segmented_page_size(kernel_block_size)``;
    every row of a request gets the same table row; ``row_lens`` come from
    :func:`jax_mla.dcp.dcp_verify_row_lens` (causal bound in global coordinates, then sharded).
    """
    block_table = jnp.asarray(block_table).astype(jnp.int32)
    b, max_pages = block_table.shape
    page = caps.segmented_page_size(kernel_block_size)
    ppb = kernel_block_size // page
    max_local_pages = max_pages * ppb
    p = jnp.arange(max_local_pages, dtype=jnp.int32)
    table = block_table[:, p // ppb] * ppb + p % ppb  # [B, max_local_pages]
    return DcpVerifyView(
        row_lens=dcp_verify_row_lens(dcp_tot_seq_lens, qlen, dcp_world_size, dcp_rank,
                                     cp_interleave),
        block_table=jnp.repeat(table, qlen, axis=0),
        qo_indptr=jnp.arange(b * qlen + 1, dtype=jnp.int32),
        page_size=page,
        max_kv_seq_len=max_pages * kernel_block_size,
    )


# ---------------------------------------------------------------------------------------------
# The builder


VIEWS = ("flat",)  # AITER's kernels read the per-token view (page size 1)


def _default_q_dtype(kv_dtype):
    # vLLM's _mla_q_dtype: decode q is quantised to fp8 whenever the cache is fp8.
    return kv_dtype if caps.dtype_name(kv_dtype) == "fp8" else jnp.bfloat16


def build_schedule(plan: AiterPlan, md: DecodeMetadata, *, dcp_rank: int = 0,
                   cp_interleave: int = 1, dcp_tot_seq_lens=None,
                   live=None) -> AiterDecodeSchedule:
    """The arrays ``plan``'s route reads for ``md`` (jittable).

    ``live`` (``[B]`` bool, optional) marks real requests; ``min_kv_seq_len`` ignores the rest.
    ``dcp_tot_seq_lens`` (``[B]`` global lengths) and ``dcp_rank`` feed the segmented
    DCP-verify view.
    """
    route = plan.route
    work = view = None
    if route.persistent:
        work = plan_mla_decode(md.paged_kv_indptr, qlen=md.qlen, num_heads=route.kernel_heads,
                               q_dtype=route.q_dtype, kv_dtype=route.kv_dtype, arch=route.arch,
                               num_cu=route.num_cu, capacity_batch=plan.capacity_batch,
                               capacity_qlen=route.mtp_decode_qlen, force_fold=route.force_fold)
    if route.kind == "dcp_verify":
        if dcp_tot_seq_lens is None:
            raise ValueError("the segmented DCP-verify route needs dcp_tot_seq_lens (global lens)")
        view = build_dcp_verify_view(md.block_table, dcp_tot_seq_lens, qlen=md.qlen,
                                     kernel_block_size=md.page_size,
                                     dcp_world_size=route.dcp_world_size, dcp_rank=dcp_rank,
                                     cp_interleave=cp_interleave)
    big = jnp.iinfo(jnp.int32).max
    lens = md.seq_lens if live is None else jnp.where(live, md.seq_lens, big)
    min_kv = jnp.min(lens, initial=big)
    min_kv = jnp.where(min_kv == big, 1, min_kv).astype(jnp.int32)
    return AiterDecodeSchedule(plan=work, dcp_verify=view, min_kv_seq_len=min_kv)


def aiter_problem(md: DecodeMetadata, *, num_heads: int, q_dtype, kv_dtype, target=None,
                  return_lse: bool = False) -> DecodeProblem:
    """The :class:`~jax_mla.problem.DecodeProblem` of an AITER step over ``md`` (D = 576)."""
    return DecodeProblem(
        num_seqs=md.num_seqs, qlen=md.qlen, num_heads=int(num_heads), page_size=md.page_size,
        max_pages=md.max_pages, kv_lora_rank=512, rope_dim=64, q_dtype=dtype_name(q_dtype),
        kv_dtype=dtype_name(kv_dtype), target=as_target(target),
        has_kv_scale=caps.dtype_name(kv_dtype) == "fp8", return_lse=bool(return_lse))


def build_aiter_decode_metadata(block_table, seq_lens, *, page_size: int, num_heads: int,
                                qlen: int = 1, q_dtype=None, kv_dtype=jnp.bfloat16,
                                arch: str | None = None, num_cu: int | None = None,
                                mtp_decode_qlen: int | None = None, dcp_world_size: int = 1,
                                dcp_rank: int = 0, cp_interleave: int = 1,
                                dcp_tot_seq_lens=None, qo_lens=None,
                                return_lse: bool | None = None,
                                small_head_mode: str | None = None,
                                build: caps.AiterBuild | None = None,
                                capacity_batch: int | None = None,
                                flat_capacity: int | None = None,
                                check_kernels: bool = True, target=None,
                                allow_known_bad=None) -> DecodeMetadata:
    """:func:`jax_mla.build_decode_metadata` for ``backend="aiter"``, with AITER's options.

    Args:
      block_table, seq_lens, page_size, qlen, flat_capacity: as ``build_decode_metadata``
        (``seq_lens`` are this rank's local lengths under DCP).
      num_heads: decode query heads ``n_dec = H * dcp_world_size`` (what ``q.shape[1]`` will be).
      q_dtype, kv_dtype: the decode dtypes (``q_dtype`` defaults as vLLM: fp8 with an fp8
        cache, else bf16). They select kernels, folding and tiling; the call checks them.
      arch: ``"gfx942"``/``"gfx950"``; default: the target's (detected from the jax device).
      num_cu: CU count (default: the device's; off a ROCm device the arch's flagship part).
      mtp_decode_qlen: ``K``, the largest qlen decode is handed (default ``qlen``).
      dcp_world_size, dcp_rank, cp_interleave, dcp_tot_seq_lens: DCP; ``dcp_tot_seq_lens``
        (``[B]`` global lengths) is required for the segmented verify route.
      qo_lens: ``[B]`` real query tokens per request for a uniform-MTP step padded with dummy
        requests (0 tokens): dummies get ``seq_len = qlen`` (a valid causal window) and are
        ignored by ``min_kv_seq_len``. Concrete values are validated against
        :func:`uniform_padded_mtp_qo_len`.
      return_lse: have the kernel return the LSE (default: ``dcp_world_size > 1``, vLLM's
        choice; ``mla_attention(..., return_lse=True)`` needs it).
      small_head_mode: ``auto|gluon|asm`` (default: ``JAX_MLA_AITER_SMALL_HEAD_MODE``).
      build: :class:`~.capabilities.AiterBuild` (default: probed from the installed aiter).
      capacity_batch: batch the plan buffers are sized for (default ``B``).
      check_kernels: raise early where the kernel tables say the chosen route has no kernel.
      target: where the step runs (default: this process's device).
      allow_known_bad: known-bad AITER kernels to launch anyway (``True``, kernel names, or
        ``False``; default: ``JAX_MLA_AITER_ALLOW_KNOWN_BAD``). Without it a route that would
        launch one takes the replacement the table names (``known_bad.py``), and
        ``md.plan.notes`` says so.

    Jittable with every non-array argument static.
    """
    seq_lens = jnp.asarray(seq_lens)
    block_table = jnp.asarray(block_table)
    live = None
    if qo_lens is not None:
        qo_lens = jnp.asarray(qo_lens)
        if qo_lens.shape != seq_lens.shape:
            raise ValueError(f"qo_lens {qo_lens.shape} must match seq_lens {seq_lens.shape}")
        if not isinstance(qo_lens, jax.core.Tracer):
            q = np.asarray(qo_lens)
            b = q.shape[0]
            if np.any((q != 0) & (q != qlen)):
                raise ValueError(f"qo_lens must be {qlen} (real) or 0 (dummy), got {q.tolist()}")
            if (q == 0).any() and qlen > 1:
                u = uniform_padded_mtp_qo_len(q, int(q.max(initial=0)) or qlen, b * qlen)
                if u != qlen:
                    raise ValueError(
                        f"qo_lens {q.tolist()} is not a uniform qlen={qlen} block padded with "
                        "trailing dummy requests"
                    )
        live = qo_lens > 0
        if qlen > 1:
            # vLLM gives each dummy request seq_len = max_qo_len: a valid, causal-consistent
            # window over (null) block-table entries, so no kernel row is ill-defined.
            seq_lens = jnp.where(live, seq_lens, qlen).astype(seq_lens.dtype)
    md = paged_views(block_table, seq_lens, page_size=page_size, qlen=qlen,
                     flat_capacity=flat_capacity, views=VIEWS)
    q_dtype = _default_q_dtype(kv_dtype) if q_dtype is None else q_dtype
    problem = aiter_problem(md, num_heads=num_heads, q_dtype=q_dtype, kv_dtype=kv_dtype,
                            target=target)
    plan = make_plan("aiter", problem, arch=arch, num_cu=num_cu,
                     mtp_decode_qlen=mtp_decode_qlen, dcp_world_size=dcp_world_size,
                     cp_interleave=cp_interleave, return_lse=return_lse,
                     small_head_mode=small_head_mode, build=build,
                     capacity_batch=capacity_batch, check_kernels=check_kernels,
                     allow_known_bad=allow_known_bad)
    sched = build_schedule(plan, md, dcp_rank=dcp_rank, cp_interleave=cp_interleave,
                           dcp_tot_seq_lens=dcp_tot_seq_lens, live=live)
    return md.replace(plan=plan, schedule=sched)
