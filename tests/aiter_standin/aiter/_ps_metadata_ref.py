"""Plain-Python port of AITER's *host* PS prefill planner (``get_ps_metadata_v1``).

Translated statement by statement from ``csrc/kernels/mla/metadata/v1_2_host.cuh`` at
ROCm/aiter e4048607: ``get_ps_metadata_v1_2_host`` (the divide-and-conquer driver),
``kn_generate_ps_metadata`` (one cluster of thread groups: query tiles, then a greedy fill of
each thread group's KV-unit quota) and ``generate_reduce_info`` (works grouped by their
``(qo_start, qo_end)`` in an ordered map of sets), plus the size arithmetic of
``get_ps_metadata_info_v1`` (``aiter/ops/attention.py``). Loops and variable names follow the
C++ so the two can be read side by side; nothing is vectorised. It is jax_mla's test oracle for
``jax_mla.backends.aiter.ps_planner`` and the planner behind the stand-in's
``get_ps_metadata_v1``.

AITER builds every output in a zero-initialised host vector as large as the caller's buffer
(``WorkInfo()``/``FinalLoc()`` value-initialise to zeros) and copies the *whole* vector back,
so the entries past the plan are zeros -- except ``reduce_indptr``, whose tail AITER fills with
the total partial count. This port does the same: the buffers it returns are exactly what the
device tensors hold after the call.
"""

from __future__ import annotations

import math

import numpy as np

SPLIT_KV_OVERHEAD = 0  # #define SPLIT_KV_OVERHEAD 0
K_SIZE_WORK_INFO_IN_DW = 8


def gcd(a, b):
    while b != 0:
        temp = b
        b = a % b
        a = temp
    return a


def integer_divide_ceil(x, y):
    # ck_tile's integer_divide_ceil: (x + y - 1) / y with C's truncating division.
    return int((x + y - 1) / y)


def _i32(x):
    """Wrap to int32 like the C++ ``int32_t`` arithmetic."""
    return (int(x) + (1 << 31)) % (1 << 32) - (1 << 31)


def pack_dword(low_part, high_part):
    return _i32((high_part << 16) | (low_part & 0xFFFF))


def unpack_dword(dw):
    high_part = (dw >> 16) & 0xFFFF
    low_part = dw & 0xFFFF
    return low_part, high_part


def get_ps_metadata_info_v1(batch_size, num_head_k, max_qlen, qlen_granularity=256, *,
                            cu_num):
    """The six ``(shape, dtype name)`` pairs of ``aiter.get_ps_metadata_info_v1``."""
    num_clusters = math.gcd(num_head_k, cu_num)
    cus_per_cluster = cu_num // num_clusters
    max_qo_split_per_batch = math.ceil(max_qlen / qlen_granularity)
    qo_tile_cnt = batch_size * max_qo_split_per_batch
    max_works = (batch_size + cus_per_cluster - 1) * max_qo_split_per_batch * num_head_k
    max_partials = (min(batch_size + cus_per_cluster - 1, (cus_per_cluster - 1) * 2)
                    * max_qo_split_per_batch)
    return (
        ((2,), "uint64"),  # work_metadata_ptrs
        ((cu_num + 1,), "int32"),  # work_indptr
        ((max_works, 8), "int32"),  # work_info
        ((qo_tile_cnt + 1,), "int32"),  # reduce_indptr
        ((qo_tile_cnt, 2), "int32"),  # reduce_final_map
        ((max_partials,), "int32"),  # reduce_partial_map
    )


class WorkInfo:
    """``union WorkInfo``; ``WorkInfo()`` is all zeros."""

    __slots__ = ("batch_idx", "partial_o_loc", "qo_start", "qo_end", "kv_start", "kv_end",
                 "kv_offset", "q_head_range")

    def __init__(self, *fields):
        fields = fields or (0,) * K_SIZE_WORK_INFO_IN_DW
        for name, value in zip(self.__slots__, fields):
            setattr(self, name, int(value))

    def dwords(self):
        return [getattr(self, name) for name in self.__slots__]


class FinalLoc:
    """``union FinalLoc``; ``FinalLoc()`` is ``{0, 0}``."""

    __slots__ = ("qo_start", "qo_end")

    def __init__(self, qo_start=0, qo_end=0):
        self.qo_start = int(qo_start)
        self.qo_end = int(qo_end)


class QTile:
    __slots__ = ("batch_idx", "qo_start", "qo_end", "num_blocks", "effective_kv_length")

    def __init__(self, batch_idx, qo_start, qo_end, num_blocks, effective_kv_length):
        self.batch_idx = batch_idx
        self.qo_start = qo_start  # global
        self.qo_end = qo_end  # global
        self.num_blocks = num_blocks
        self.effective_kv_length = effective_kv_length


def generate_reduce_info(num_work, work_info, reduce_indptr, reduce_final_map,
                         reduce_partial_map):
    reduce_map = {}  # std::map<std::vector<int32_t>, std::set<int32_t>>: iterated sorted
    for i in range(num_work):
        work = work_info[i]
        if work.partial_o_loc == -1:
            continue
        q_head_start, q_head_end = unpack_dword(work.q_head_range)  # unused, as in AITER

        final_loc = (work.qo_start, work.qo_end)
        partial_loc = work.partial_o_loc
        reduce_map.setdefault(final_loc, set()).add(partial_loc)

    final_idx = 0
    partial_idx = 0
    for final_loc in sorted(reduce_map):
        partial_loc_vec = sorted(reduce_map[final_loc])
        num_partials = len(partial_loc_vec)
        reduce_indptr[final_idx + 1] = reduce_indptr[final_idx] + num_partials
        reduce_final_map[final_idx] = FinalLoc(final_loc[0], final_loc[1])
        # std::copy past the vector's end would be undefined behaviour: fail loudly instead.
        assert partial_idx + num_partials <= len(reduce_partial_map), "reduce_partial_map"
        reduce_partial_map[partial_idx:partial_idx + num_partials] = partial_loc_vec
        final_idx += 1
        partial_idx += len(partial_loc_vec)
    for i in range(final_idx, len(reduce_indptr)):
        reduce_indptr[i] = partial_idx


def kn_generate_ps_metadata(seqlens_qo_indptr, pages_kv_indptr, context_lens, gqa_ratio,
                            num_heads_k, qhead_granularity, qlen_granularity, kvlen_granularity,
                            block_size, is_causal, work_indptr, work_info, available_tgs=256,
                            cluster_id=0, current_work_idx=0):
    batch_size = len(seqlens_qo_indptr) - 1

    assert kvlen_granularity % block_size == 0
    blocks_per_unit = kvlen_granularity // block_size

    # Step 1: count split units
    query_tiles = []
    total_units = 0  # split units

    for batch_idx in range(batch_size):
        qo_length = seqlens_qo_indptr[batch_idx + 1] - seqlens_qo_indptr[batch_idx]
        kv_length = context_lens[batch_idx]
        # Split query sequence into tiles
        query_tile_ranges = []
        for q_offset in range(0, qo_length, qlen_granularity):
            local_qo_start = q_offset
            local_qo_end = min(q_offset + qlen_granularity, qo_length)
            query_tile_ranges.append((local_qo_start, local_qo_end))

        num_query_tile_ranges = len(query_tile_ranges)

        for i in range(num_query_tile_ranges):
            # ping-pong allocate between head & tail: 0, n-1, 1, n-2, 2, n-3, ...
            idx = (i // 2) if (i % 2 == 0) else (num_query_tile_ranges - 1 - i // 2)

            local_qo_start = query_tile_ranges[idx][0]
            local_qo_end = query_tile_ranges[idx][1]

            # For causal attention, each query position can only attend to earlier positions,
            # limiting the KV range
            effective_kv_length = (min(kv_length - qo_length + local_qo_end, kv_length)
                                   if is_causal else kv_length)
            num_units = integer_divide_ceil(effective_kv_length, kvlen_granularity)
            query_tiles.append(QTile(batch_idx,
                                     local_qo_start + seqlens_qo_indptr[batch_idx],
                                     local_qo_end + seqlens_qo_indptr[batch_idx],
                                     num_units * blocks_per_unit,
                                     effective_kv_length))
            total_units += num_units
    average = total_units // available_tgs  # both non-negative: C's / and % agree
    reminder = total_units % available_tgs

    # Step 2: distribute split units
    current_tile_idx = 0  # index of query_tile
    current_block_idx = 0  # index of split blocks within a query_tile
    partial_tile_idx = 0  # index of partial_tile for reduce
    for tg_idx in range(available_tgs):
        # duplicate (parallel)
        for k_head_offset in range(num_heads_k):
            k_head_idx = cluster_id * num_heads_k + k_head_offset
            qhead_range = pack_dword(k_head_idx * qhead_granularity,
                                     (k_head_idx + 1) * qhead_granularity)
            saved_tile_idx = current_tile_idx
            saved_block_idx = current_block_idx
            saved_partial_tile_idx = partial_tile_idx

            # allocate_work(): the C++ lambda, inlined.
            blocks_capacity = ((average + 1) * blocks_per_unit if tg_idx < reminder
                               else average * blocks_per_unit)
            # Allocate KV units to this TG until quota is filled
            while current_tile_idx < len(query_tiles) and blocks_capacity > 0:
                current_tile = query_tiles[current_tile_idx]
                remaining_blocks = current_tile.num_blocks - current_block_idx
                remaining_kv_len = (current_tile.effective_kv_length
                                    - current_block_idx * block_size)

                consuming_blocks = 0
                kv_start = current_block_idx + pages_kv_indptr[current_tile.batch_idx]
                if remaining_kv_len <= blocks_capacity * block_size + SPLIT_KV_OVERHEAD:
                    consuming_blocks = remaining_blocks
                    # This TG can process all of this qo_tile's remaining_blocks to the causal
                    # boundary
                    if current_block_idx == 0:
                        partial_o_loc = -1  # -1 - no split
                    else:
                        partial_o_loc = qlen_granularity * partial_tile_idx
                        partial_tile_idx += 1
                    kv_end = min(kv_start + consuming_blocks,
                                 pages_kv_indptr[current_tile.batch_idx + 1])

                    work_info[current_work_idx] = WorkInfo(
                        current_tile.batch_idx, partial_o_loc, current_tile.qo_start,
                        current_tile.qo_end, kv_start, kv_end, 0, qhead_range)
                    current_work_idx += 1
                    current_tile_idx += 1
                    current_block_idx = 0
                else:
                    # This TG can only process part of this qo tile's KV units under
                    # blocks_capacity
                    consuming_blocks = blocks_capacity
                    partial_o_loc = qlen_granularity * partial_tile_idx
                    partial_tile_idx += 1

                    kv_end = min(kv_start + consuming_blocks,
                                 pages_kv_indptr[current_tile.batch_idx + 1])
                    kv_length = context_lens[current_tile.batch_idx]
                    kv_offset = (kv_length
                                 - (kv_end - pages_kv_indptr[current_tile.batch_idx])
                                 * block_size)

                    work_info[current_work_idx] = WorkInfo(
                        current_tile.batch_idx, partial_o_loc, current_tile.qo_start,
                        current_tile.qo_end, kv_start, kv_end, kv_offset, qhead_range)
                    current_work_idx += 1
                    current_block_idx += consuming_blocks
                blocks_capacity -= consuming_blocks

            if k_head_offset != num_heads_k - 1:
                current_tile_idx = saved_tile_idx
                current_block_idx = saved_block_idx
                partial_tile_idx = saved_partial_tile_idx
        work_indptr[cluster_id * available_tgs + tg_idx + 1] = current_work_idx
    return current_work_idx


def get_ps_metadata_v1_2_host(seqlens_qo_indptr, pages_kv_indptr, context_lens, gqa_ratio,
                              num_heads_k, work_indptr_numel, work_info_rows,
                              reduce_indptr_numel, reduce_final_map_rows,
                              reduce_partial_map_numel, qhead_granularity, qlen_granularity,
                              kvlen_granularity, block_size, is_causal, *, available_tgs):
    """The driver; returns the five buffers as numpy int32 arrays of the callers' sizes.

    ``available_tgs`` is ``hipDeviceProp_t::multiProcessorCount`` (the CU count).
    """
    batch_size = len(seqlens_qo_indptr) - 1
    num_heads_q = num_heads_k * gqa_ratio  # noqa: F841  (computed, unused, in AITER)

    # 1. divide
    num_clusters = gcd(num_heads_k, available_tgs)
    tgs_per_cluster = available_tgs // num_clusters
    kheads_per_cluster = num_heads_k // num_clusters

    # prepare host buffer (copy indptr/lens from device to host)
    p_seqlens_qo_indptr = [int(x) for x in seqlens_qo_indptr[:batch_size + 1]]
    p_pages_kv_indptr = [int(x) for x in pages_kv_indptr[:batch_size + 1]]
    p_context_lens = [int(x) for x in context_lens[:batch_size]]

    work_indptr_vec = [0] * work_indptr_numel
    work_info_vec = [WorkInfo() for _ in range(work_info_rows)]
    reduce_indptr_vec = [0] * reduce_indptr_numel
    reduce_final_map_vec = [FinalLoc() for _ in range(reduce_final_map_rows)]
    reduce_partial_map_vec = [0] * reduce_partial_map_numel

    # 2. conquer (parallel)
    for cluster_id in range(num_clusters):
        current_work_idx = work_indptr_vec[cluster_id * tgs_per_cluster]
        kn_generate_ps_metadata(p_seqlens_qo_indptr, p_pages_kv_indptr, p_context_lens,
                                gqa_ratio, kheads_per_cluster, qhead_granularity,
                                qlen_granularity, kvlen_granularity, block_size, is_causal,
                                work_indptr_vec, work_info_vec, tgs_per_cluster, cluster_id,
                                current_work_idx)

    actual_works = work_indptr_vec[-1]
    generate_reduce_info(actual_works, work_info_vec, reduce_indptr_vec, reduce_final_map_vec,
                         reduce_partial_map_vec)

    # H2D: the whole vectors are copied into the caller's buffers.
    return dict(
        work_indptr=np.asarray(work_indptr_vec, np.int32),
        work_info=np.asarray([w.dwords() for w in work_info_vec], np.int32).reshape(-1, 8),
        reduce_indptr=np.asarray(reduce_indptr_vec, np.int32),
        reduce_final_map=np.asarray([(f.qo_start, f.qo_end) for f in reduce_final_map_vec],
                                    np.int32).reshape(-1, 2),
        reduce_partial_map=np.asarray(reduce_partial_map_vec, np.int32),
    )


def plan(qo_indptr, kv_indptr=None, context_lens=None, *, num_heads_k, max_qlen, cu_num,
         batch_size=None, qhead_granularity=1, qlen_granularity=256, kvlen_granularity=128,
         block_size=1, is_causal=True):
    """vLLM's call (``_build_fp8_prefill_ps_metadata``) with buffers from the info sizes.

    ``kv_indptr`` defaults to ``qo_indptr`` and ``context_lens`` to ``diff(kv_indptr)``;
    ``batch_size`` (the buffers' batch bound) to ``len(qo_indptr) - 1``.
    """
    qo = [int(x) for x in qo_indptr]
    kv = qo if kv_indptr is None else [int(x) for x in kv_indptr]
    ctx = ([kv[i + 1] - kv[i] for i in range(len(kv) - 1)] if context_lens is None
           else [int(x) for x in context_lens])
    b = len(qo) - 1 if batch_size is None else batch_size
    shapes = [s for s, _ in get_ps_metadata_info_v1(b, num_heads_k, max_qlen, qlen_granularity,
                                                    cu_num=cu_num)]
    return get_ps_metadata_v1_2_host(
        qo, kv, ctx, 1, num_heads_k, shapes[1][0], shapes[2][0], shapes[3][0], shapes[4][0],
        shapes[5][0], qhead_granularity, qlen_granularity, kvlen_granularity, block_size,
        is_causal, available_tgs=cu_num)
