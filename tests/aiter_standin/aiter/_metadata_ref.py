"""Plain-Python port of AITER's MLA decode metadata planner (``get_mla_metadata_v1`` fast mode).

Translated statement by statement from ``csrc/kernels/mla/metadata/v1_2_device.cuh`` at
ROCm/aiter e4048607: ``kn_get_mla_metadata_v1_2`` (the sequential single-warp planner) and
``kn_get_mla_metadata_v1_2_parallel`` (the closed-form prefix-scan planner AITER dispatches for
qlen 1 without q splitting or folding), plus the host dispatch ``get_mla_metadata_v1_2_device``.
Non-sparse, no CP round-robin, ``page_size == 1`` only (what vLLM uses). Loops are written the
way the device code runs them (lane 0 for the warp-parallel bits), not vectorised, so that this
file can be read side by side with the CUDA source. It is jax_mla's test oracle for
``jax_mla.backends.aiter.planner`` and the planner behind the stand-in's ``get_mla_metadata_v1``.

Buffers are numpy int32 arrays written in place, like AITER writes device tensors; entries AITER
leaves unwritten keep whatever the caller put there.
"""

from __future__ import annotations

import numpy as np

_FILL_WARPS = 8


def _cdiv(a, b):
    return (a + b - 1) // b


def natively_supported(arch, num_heads, q_fp8, kv_fp8, max_seqlen_qo):
    return (
        num_heads == 16
        or (arch in ("gfx942", "gfx950") and num_heads == 64 and q_fp8 and kv_fp8
            and max_seqlen_qo == 1)
        or (arch == "gfx950" and not q_fp8 and not kv_fp8)
        or (arch == "gfx942" and num_heads == 128 and q_fp8 and kv_fp8)
        or (arch == "gfx950" and q_fp8 and kv_fp8 and num_heads in (32, 64, 128))
    )


def packed_qo_len_per_wg(arch, num_heads, max_seqlen_qo, q_fp8, kv_fp8):
    packed = num_heads * max_seqlen_qo
    if (arch == "gfx950" and not q_fp8 and not kv_fp8 and packed >= 64 and num_heads <= 64
            and (packed < 128 or num_heads == 48)):
        return 64
    if arch == "gfx950" and q_fp8 and kv_fp8 and num_heads == 32 and max_seqlen_qo == 3:
        return 64
    return 128


class _Params:
    pass


class _QoState:
    """``QoState<Traits>``: uniform (``kUniSeqlenQo >= 0``) or read from the indptr."""

    def __init__(self, uni_seqlen_qo, lds_seqlens_qo, qo_indptr):
        self.unique = uni_seqlen_qo > 0
        self.uni = uni_seqlen_qo
        self.lds = lds_seqlens_qo
        self.indptr = qo_indptr

    def seqlen(self, b):
        return self.uni if self.unique else self.lds[b]

    def begin(self, b):
        return self.uni * b if self.unique else int(self.indptr[b])

    def end(self, b):
        return self.uni * (b + 1) if self.unique else int(self.indptr[b + 1])


def _num_qo_tiles(p, qo, b):
    if p.qo_splits:
        s = qo.seqlen(b)
        if p.num_heads * 2 > p.ppw:
            return s
        return _cdiv(s * p.num_heads, p.ppw)
    return 1


def _sum_blocks(p, qo, kv_indptr, lds_qo):
    total = 0
    for bid in range(p.num_batches):
        bid_ori = bid // p.qk_batch_ratio
        seqlen_kv = int(kv_indptr[bid_ori + 1] - kv_indptr[bid_ori])
        if not qo.unique:
            lds_qo[bid] = int(p.qo_indptr[bid_ori + 1] - p.qo_indptr[bid_ori])
        nb = _cdiv(seqlen_kv, p.kv_granularity)
        total += (nb + p.overhead) * _num_qo_tiles(p, qo, bid)
    return total


def _sequential(p, kv_indptr, out):
    work_indptr, work_info, reduce_indptr, final_map, partial_map = out
    lds_qo = [0] * p.num_batches
    qo = _QoState(p.uni_seqlen_qo, lds_qo, p.qo_indptr)
    sum_blocks = _sum_blocks(p, qo, kv_indptr, lds_qo)
    reduce_indptr[0] = 0
    work_indptr[0] = 0
    payload = _cdiv(sum_blocks, p.num_splits) + p.overhead
    o, gran = p.overhead, p.kv_granularity

    def seqlen_kv_of(bid):
        bid_ori = bid // p.qk_batch_ratio
        return int(kv_indptr[bid_ori + 1] - kv_indptr[bid_ori])

    curr_batch = 0
    curr_kv_block = 0
    curr_n_split_idx = 0
    curr_qo_tile_idx = 0
    curr_sub_head_idx = 0
    curr_kv_begin = 0
    curr_kv_end = int(kv_indptr[1])
    curr_kv_seqlen = curr_kv_end - curr_kv_begin
    num_works = partial_idx = tot_qo_tiles = last_reduce_indptr = 0
    cur_tail_done = False

    def batch_tail_of(num_qo_tiles, qo_start):
        bt = num_qo_tiles - 1 - curr_qo_tile_idx
        if p.qk_batch_ratio != 1:
            bt = num_qo_tiles - (qo_start // p.qk_batch_ratio) % p.ori_seqlen_qo - 1
        return max(bt, 0) if p.is_causal else 0

    for cid in range(p.num_cu):
        remain = payload
        while curr_batch < p.num_batches:
            num_qo_tiles = _num_qo_tiles(p, qo, curr_batch)
            qo_tile_size = _cdiv(qo.seqlen(curr_batch), num_qo_tiles)
            num_kv_blocks = _cdiv(curr_kv_seqlen, gran)
            remain_kv_blocks = num_kv_blocks - curr_kv_block
            qo_start = qo.begin(curr_batch) + curr_qo_tile_idx * qo_tile_size
            qo_end = min(qo_start + qo_tile_size, qo.end(curr_batch))
            kv_start = curr_kv_begin + curr_kv_block * gran
            bt = batch_tail_of(num_qo_tiles, qo_start)
            if remain >= remain_kv_blocks + o or cur_tail_done:
                num_splits = curr_n_split_idx + 1
                kv_end = min(kv_start + remain_kv_blocks * gran, curr_kv_end - bt)
                if (0 < curr_kv_end - kv_end < p.tail_done_threshold) or cur_tail_done:
                    kv_end = min(curr_kv_end - bt, curr_kv_end)
                if curr_n_split_idx > 0:
                    ploc = partial_idx
                    reduce_indptr[tot_qo_tiles + 1] = last_reduce_indptr + num_splits
                    final_map[tot_qo_tiles] = (qo_start, qo_end)
                    for idx in range(num_splits):
                        partial_map[last_reduce_indptr + idx] = (
                            partial_idx - (curr_n_split_idx - idx) * qo_tile_size)
                    partial_idx += qo_tile_size
                    last_reduce_indptr += num_splits
                else:
                    ploc = -1
                    reduce_indptr[tot_qo_tiles + 1] = last_reduce_indptr
                work_info[num_works] = (curr_batch, ploc, qo_start, qo_end, kv_start, kv_end,
                                        curr_kv_end - kv_end, 0)
                tot_qo_tiles += 1
                num_works += 1
                remain -= remain_kv_blocks + o
                curr_qo_tile_idx = 0 if curr_qo_tile_idx == num_qo_tiles - 1 else \
                    curr_qo_tile_idx + 1
                if not p.qo_splits or curr_qo_tile_idx == 0:
                    curr_batch += 1
                    curr_sub_head_idx = 0 if curr_sub_head_idx == p.qk_batch_ratio - 1 else \
                        curr_sub_head_idx + 1
                    if curr_batch < p.num_batches:
                        if curr_sub_head_idx == 0:
                            curr_kv_seqlen = seqlen_kv_of(curr_batch)
                            curr_kv_begin = curr_kv_end
                            curr_kv_end = curr_kv_begin + curr_kv_seqlen
                        curr_kv_block = 0
                        curr_n_split_idx = 0
                        cur_tail_done = False
                else:
                    curr_kv_block = 0
                    curr_n_split_idx = 0
                    cur_tail_done = False
            else:
                if remain > o:
                    consuming = remain - o
                    kv_end = min(kv_start + consuming * gran, curr_kv_end - bt)
                    if curr_kv_end - kv_end < p.tail_done_threshold:
                        cur_tail_done = True
                    if not cur_tail_done:
                        work_info[num_works] = (curr_batch, partial_idx, qo_start, qo_end,
                                                kv_start, kv_end, curr_kv_end - kv_end, 0)
                        partial_idx += qo_tile_size
                        num_works += 1
                        curr_kv_block += consuming
                        curr_n_split_idx += 1
                if not cur_tail_done:
                    break
        work_indptr[cid + 1] = num_works
    for i in range(tot_qo_tiles, len(reduce_indptr)):
        reduce_indptr[i] = last_reduce_indptr
    # Not AITER output: what a test needs to know about the run.
    return dict(payload=payload, num_works=num_works, unassigned=p.num_batches - curr_batch)


def _parallel(p, kv_indptr, out):
    work_indptr, work_info, reduce_indptr, final_map, partial_map = out
    qo = _QoState(p.uni_seqlen_qo, None, p.qo_indptr)
    o, gran = p.overhead, p.kv_granularity
    seqlens = [int(kv_indptr[b + 1] - kv_indptr[b]) for b in range(p.num_batches)]
    sum_blocks = sum(_cdiv(s, gran) + o for s in seqlens)
    payload = _cdiv(sum_blocks, p.num_splits) + o
    bpc = payload - o
    reduce_indptr[0] = 0
    work_indptr[0] = 0
    # Phase 1 (lane 0 of warp 0): the per-batch prefix scan.
    start_cu, remain_pl, works_before, reduce_before, partial_before = [], [], [], [], []
    curr_cu, remain, num_works, last_reduce, partial_idx = 0, payload, 0, 0, 0
    for bid in range(p.num_batches):
        start_cu.append(curr_cu)
        remain_pl.append(remain)
        works_before.append(num_works)
        reduce_before.append(last_reduce)
        partial_before.append(partial_idx)
        nb = _cdiv(seqlens[bid], gran)
        tile = qo.seqlen(bid)
        if nb + o <= remain:
            num_works += 1
            remain -= nb + o
        else:
            if remain > o:
                rb = nb - (remain - o)
                fresh = _cdiv(rb, bpc)
                frags = fresh + 1
                curr_cu += fresh
                remain = payload - ((rb - (fresh - 1) * bpc) + o)
            else:
                fresh = _cdiv(nb, bpc)
                frags = fresh
                curr_cu += fresh
                remain = payload - ((nb - (fresh - 1) * bpc) + o)
            num_works += frags
            if frags > 1:
                last_reduce += frags
                partial_idx += frags * tile
    total_works, total_reduce = num_works, last_reduce
    # Phase 2a.
    for cid in range(1, p.num_cu + 1):
        work_indptr[cid] = total_works
    # Phase 2b (one warp per batch).
    for bid in range(p.num_batches):
        s_cu, rem = start_cu[bid], remain_pl[bid]
        kv_begin = int(kv_indptr[bid] - kv_indptr[0])
        kv_end = int(kv_indptr[bid + 1] - kv_indptr[0])
        nb = _cdiv(kv_end - kv_begin, gran)
        tile = qo.seqlen(bid)
        qo_start, qo_end = qo.begin(bid), qo.end(bid)
        fits = nb + o <= rem
        if fits:
            fresh, frags, waste = 1, 1, False
        elif rem > o:
            fresh = _cdiv(nb - (rem - o), bpc)
            frags, waste = fresh + 1, False
        else:
            fresh = _cdiv(nb, bpc)
            frags, waste = fresh, True
        split = frags > 1
        first = rem - o
        if split:
            reduce_indptr[bid + 1] = reduce_before[bid] + frags
            final_map[bid] = (qo_start, qo_end)
        else:
            reduce_indptr[bid + 1] = reduce_before[bid]
        if waste and s_cu + 1 <= p.num_cu:
            work_indptr[s_cu + 1] = works_before[bid]
        for f in range(frags):
            if fits:
                b0, b1, fcu = 0, nb, s_cu
            elif not waste:
                b0 = 0 if f == 0 else first + (f - 1) * bpc
                b1 = first + f * bpc if f < fresh else nb
                fcu = s_cu + f
            else:
                b0 = f * bpc
                b1 = (f + 1) * bpc if f < fresh - 1 else nb
                fcu = s_cu + 1 + f
            ks = kv_begin + b0 * gran
            ke = min(kv_begin + b1 * gran, kv_end)
            w = works_before[bid] + f
            ploc = partial_before[bid] + f * tile if split else -1
            work_info[w] = (bid, ploc, qo_start, qo_end, ks, ke, kv_end - ke, 0)
            if split:
                partial_map[reduce_before[bid] + f] = partial_before[bid] + f * tile
            if f != frags - 1 and fcu + 1 <= p.num_cu:
                work_indptr[fcu + 1] = w + 1
    for i in range(p.num_batches, len(reduce_indptr)):
        reduce_indptr[i] = total_reduce
    return dict(payload=payload, num_works=total_works, unassigned=0)


def get_mla_metadata_v1_2(qo_indptr, kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                          num_heads_k, is_causal, work_info_set, work_indptr, reduce_indptr,
                          reduce_final_map, reduce_partial_map, *, page_size=1, kv_granularity=16,
                          max_seqlen_qo=-1, uni_seqlen_qo=-1, max_split_per_batch=-1,
                          arch="gfx950", cu_count=256, lds_bytes=160 * 1024, q_fp8=False,
                          kv_fp8=False, use_parallel_env=True):
    """Host dispatch + planner. Returns a dict of run facts (payload, num_works, variant)."""
    if page_size != 1:
        raise NotImplementedError("the reference port covers page_size == 1 (vLLM's choice)")
    qo_indptr = np.asarray(qo_indptr)
    kv_indptr = np.asarray(kv_indptr)
    p = _Params()
    p.qo_indptr = qo_indptr
    p.num_batches = len(kv_indptr) - 1
    num_heads = num_heads_k * num_heads_per_head_k
    p.qk_batch_ratio = 1
    native = natively_supported(arch, num_heads, q_fp8, kv_fp8, max_seqlen_qo)
    if not native and num_heads % 16 == 0:
        p.qk_batch_ratio = num_heads // 16
        num_heads = 16
        p.num_batches *= p.qk_batch_ratio
    assert native or num_heads in (16, 128) or (num_heads == 32 and q_fp8 and kv_fp8) or (
        num_heads == 64 and q_fp8 and kv_fp8 and max_seqlen_qo == 1), "AITER_CHECK"
    if p.qk_batch_ratio != 1 and uni_seqlen_qo <= 0:
        raise NotImplementedError("AITER reads past qo_indptr when folding a non-uniform batch")
    p.num_heads = num_heads
    p.num_cu = cu_count // num_heads_k
    p.num_splits = p.num_cu if max_split_per_batch < 0 else min(
        p.num_cu, max_split_per_batch * p.num_batches)
    p.kv_granularity = kv_granularity
    p.uni_seqlen_qo = uni_seqlen_qo
    p.ori_seqlen_qo = uni_seqlen_qo
    p.is_causal = is_causal
    p.overhead = max(1, _cdiv(16, page_size))
    p.tail_done_threshold = max_seqlen_qo
    p.ppw = packed_qo_len_per_wg(arch, num_heads, max_seqlen_qo, q_fp8, kv_fp8)
    packed_max = max_seqlen_qo * num_heads_per_head_k
    p.qo_splits = not (0 < packed_max <= p.ppw)
    out = (work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map)
    scratch = 4 * (3 + 5 * p.num_batches)
    use_parallel = (use_parallel_env and max_seqlen_qo == 1 and not p.qo_splits
                    and page_size == 1 and p.qk_batch_ratio == 1)
    qo_bytes = 0 if uni_seqlen_qo > 0 else 4 * p.num_batches
    if use_parallel and scratch + qo_bytes <= lds_bytes:
        facts = _parallel(p, kv_indptr, out)
        facts["variant"] = "parallel"
    else:
        facts = _sequential(p, kv_indptr, out)
        facts["variant"] = "sequential"
    facts.update(num_cu=p.num_cu, overhead=p.overhead, ratio=p.qk_batch_ratio,
                 num_batches=p.num_batches)
    return facts
