"""The split-KV schedule in one Triton program: the plan of ``backends/triton/schedule.py``,
bit for bit, in a single launch.

``plan_splits`` (jnp) is the definition; this kernel computes the same arrays without XLA's chain
of small kernels (sorts, binary searches as while loops, scatters, cumulative sums) that made a
step's metadata cost hundreds of launches on a GPU. One program walks the requests and the
programs in chunks (``CB`` requests, ``CP`` programs, ``CW`` works at a time), keeps per-request
and per-program intermediates in ``scratch`` (global memory, re-read after a block barrier), and
writes every output of the schedule. Binary searches become counts over chunks
(``count(a <= x)``); the sort of cut points becomes a merge of two sorted lists (request starts,
and program starts that are new), each element stored at its rank.

All arithmetic is int32 on non-negative values (``//`` then truncates like floor division).
Cost units, plans and the choice between them: see ``schedule.py``.
"""

import triton
import triton.language as tl

BIG = tl.constexpr(2147483647)


@triton.jit
def _count_le(ptr, n, xs, STRICT: tl.constexpr, CB: tl.constexpr):
    """``count(a < x)`` (``STRICT``) or ``count(a <= x)`` for each ``x`` of ``xs``, ``a`` the first
    ``n`` int32 values at ``ptr``, read ``CB`` at a time."""
    acc = tl.zeros(xs.shape, tl.int32)
    offs = tl.arange(0, CB)
    for c in range(0, n, CB):
        i = c + offs
        a = tl.load(ptr + i, mask=i < n, other=BIG)
        if STRICT:
            hit = a[None, :] < xs[:, None]
        else:
            hit = a[None, :] <= xs[:, None]
        acc += tl.sum(hit.to(tl.int32), axis=1)
    return acc


@triton.jit
def _pick(vec, offs, i):
    """``vec[i]`` for a scalar index ``i`` into a block ``vec`` indexed by ``offs``."""
    return tl.sum(tl.where(offs == i, vec, 0), axis=0)


@triton.jit
def mla_plan_kernel(
    seq_lens_ptr, kv_indptr_ptr,
    work_indptr_ptr, work_info_ptr, num_works_ptr, reduce_indptr_ptr, final_map_ptr,
    partial_map_ptr, tiles_ptr, tile_ptr_ptr, scratch_ptr,
    B: tl.constexpr, P: tl.constexpr, NT: tl.constexpr, QLEN: tl.constexpr,
    BLOCK_N: tl.constexpr, MODE: tl.constexpr, OVERHEAD: tl.constexpr, SLACK_NUM: tl.constexpr,
    SLACK_DEN: tl.constexpr, EVEN_SLACK: tl.constexpr, GRID: tl.constexpr, CB: tl.constexpr,
    CP: tl.constexpr, CW: tl.constexpr,
):
    """``MODE``: 0 auto, 1 line, 2 even. Scratch (int32, :func:`scratch_size`): ``[0, B)``
    request starts, ``[B, 2B)`` blocks, ``[2B, 3B)`` pieces ``k``, ``[3B, 4B)`` cumulative pieces,
    ``[4B, 5B + 1)`` each request's first work (its rank), then per program the line cuts, the
    whole-request cuts, the even cuts, the final cuts and whether that cut is a new work
    (``P`` each), then per work its unit, its request and its program (``P + B`` each)."""
    CAP: tl.constexpr = P + B
    S_START: tl.constexpr = 0
    S_BLOCKS: tl.constexpr = B
    S_K: tl.constexpr = 2 * B
    S_KEND: tl.constexpr = 3 * B
    S_RANK: tl.constexpr = 4 * B
    S_LINE: tl.constexpr = 5 * B + 1
    S_SNAP: tl.constexpr = S_LINE + P
    S_EVEN: tl.constexpr = S_SNAP + P
    S_CUT: tl.constexpr = S_EVEN + P
    S_NEW: tl.constexpr = S_CUT + P
    S_U0: tl.constexpr = S_NEW + P
    S_R: tl.constexpr = S_U0 + CAP
    S_PROG: tl.constexpr = S_R + CAP
    ob = tl.arange(0, CB)
    op = tl.arange(0, CP)
    ow = tl.arange(0, CW)

    # Requests: blocks, starts on the cost line, the total, and the even plan's bounds.
    zero = tl.zeros([], tl.int32)
    carry = zero
    sum_blocks = zero
    max_blocks = zero
    for c in range(0, B, CB):
        i = c + ob
        m = i < B
        n = tl.load(seq_lens_ptr + i, mask=m, other=0)
        blocks = (n + BLOCK_N - 1) // BLOCK_N
        cost = tl.where(m, blocks + OVERHEAD, 0)
        ends = tl.cumsum(cost, axis=0) + carry
        tl.store(scratch_ptr + S_START + i, ends - cost, mask=m)
        tl.store(scratch_ptr + S_BLOCKS + i, blocks, mask=m)
        carry = carry + tl.sum(cost, axis=0)
        sum_blocks = sum_blocks + tl.sum(tl.where(m, blocks, 0), axis=0)
        max_blocks = tl.maximum(max_blocks, tl.max(tl.where(m, blocks, 0), axis=0))
    total = carry
    chunk = tl.maximum(1, (total + P - 1) // P)
    tl.debug_barrier()

    # The even-pieces plan: the least piece size t whose pieces need at most P programs, found
    # in two rounds over GRID candidates.
    og = tl.arange(0, GRID)
    lo = tl.maximum(1, (sum_blocks + P - 1) // P)
    hi = tl.maximum(max_blocks, lo)
    for _ in tl.static_range(2):
        step = tl.maximum(1, (hi - lo + GRID - 2) // (GRID - 1))
        cand = tl.minimum(lo + step * og, hi)
        pieces = tl.zeros([GRID], tl.int32)
        for c in range(0, B, CB):
            i = c + ob
            blk = tl.load(scratch_ptr + S_BLOCKS + i, mask=i < B, other=0)
            k = tl.maximum(1, (blk[None, :] + cand[:, None] - 1) // cand[:, None])
            pieces += tl.sum(tl.where((i < B)[None, :], k, 0), axis=1)
        fits = pieces <= P
        i_fit = tl.min(tl.where(fits, og, GRID), axis=0)
        any_fit = i_fit < GRID
        hi_new = tl.where(any_fit, _pick(cand, og, i_fit), hi)
        lo = tl.where(any_fit & (i_fit > 0), _pick(cand, og, i_fit - 1) + 1, lo)
        hi = hi_new
    t = hi
    carry = zero
    longest_piece = zero
    for c in range(0, B, CB):
        i = c + ob
        m = i < B
        blk = tl.load(scratch_ptr + S_BLOCKS + i, mask=m, other=0)
        k = tl.where(m, tl.maximum(1, (blk + t - 1) // t), 0)
        kend = tl.cumsum(k, axis=0) + carry
        tl.store(scratch_ptr + S_K + i, k, mask=m)
        tl.store(scratch_ptr + S_KEND + i, kend, mask=m)
        carry = carry + tl.sum(k, axis=0)
        longest_piece = tl.maximum(longest_piece,
                                   tl.max(tl.where(m, (blk + k - 1) // tl.maximum(k, 1), 0),
                                          axis=0))
    pieces_total = carry
    even_cost = tl.where(pieces_total <= P, longest_piece + OVERHEAD, BIG)
    tl.debug_barrier()

    # Programs: the line plan's cuts (moved back to a request's start when they would leave a
    # piece with only its overhead unit), the nearest-boundary cuts, the even plan's cuts.
    longest_snap = zero
    line_cost = zero
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pc = p * chunk
        rb = tl.minimum(tl.maximum(_count_le(scratch_ptr + S_START, B, pc, False, CB) - 1, 0),
                        B - 1)
        st = tl.load(scratch_ptr + S_START + rb)
        a = pc - st
        pc = tl.where((a > 0) & (a <= OVERHEAD), st, pc)
        tl.store(scratch_ptr + S_LINE + p, pc, mask=mp)
        # Nearest request boundary: bounds are the starts, then the total.
        j = _count_le(scratch_ptr + S_START, B, pc, True, CB) + (total < pc).to(tl.int32)
        ib = tl.maximum(j - 1, 0)
        below = tl.where(ib < B, tl.load(scratch_ptr + S_START + tl.minimum(ib, B - 1)), total)
        ia = tl.minimum(j, B)
        above = tl.where(ia < B, tl.load(scratch_ptr + S_START + tl.minimum(ia, B - 1)), total)
        snap = tl.where(pc - below <= above - pc, below, above)
        snap = tl.where(p == 0, 0, snap)
        tl.store(scratch_ptr + S_SNAP + p, snap, mask=mp)
        # Even pieces: program p runs piece j of request r.
        r = tl.minimum(_count_le(scratch_ptr + S_KEND, B, p, False, CB), B - 1)
        k = tl.load(scratch_ptr + S_K + r)
        kend = tl.load(scratch_ptr + S_KEND + r)
        blk = tl.load(scratch_ptr + S_BLOCKS + r)
        jj = p - (kend - k)
        first = tl.load(scratch_ptr + S_START + r) + tl.where(
            jj == 0, 0, OVERHEAD + (jj * blk) // tl.maximum(k, 1))
        tl.store(scratch_ptr + S_EVEN + p, tl.where(p < pieces_total, first, BIG), mask=mp)
    tl.debug_barrier()
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pc = tl.load(scratch_ptr + S_LINE + p, mask=mp, other=total)
        nxt = tl.load(scratch_ptr + S_LINE + p + 1, mask=p + 1 < P, other=total)
        span = tl.where(pc < total, tl.minimum(nxt - pc, total - pc), 0)
        rb = tl.minimum(tl.maximum(_count_le(scratch_ptr + S_START, B, pc, False, CB) - 1, 0),
                        B - 1)
        inside = tl.load(scratch_ptr + S_START + rb) != pc
        cost = span + tl.where(inside, OVERHEAD, 0)
        line_cost = tl.maximum(line_cost, tl.max(tl.where(mp, cost, 0), axis=0))
        sn = tl.load(scratch_ptr + S_SNAP + p, mask=mp, other=total)
        sn_next = tl.load(scratch_ptr + S_SNAP + p + 1, mask=p + 1 < P, other=total)
        longest_snap = tl.maximum(longest_snap, tl.max(tl.where(mp, sn_next - sn, 0), axis=0))
    whole = longest_snap * SLACK_DEN <= chunk * (SLACK_DEN + SLACK_NUM)
    if MODE == 1:
        take = total < 0
    elif MODE == 2:
        take = even_cost < BIG
    else:
        take = even_cost <= line_cost + EVEN_SLACK
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pc = tl.load(scratch_ptr + S_LINE + p, mask=mp, other=0)
        pc = tl.where(take, tl.load(scratch_ptr + S_EVEN + p, mask=mp, other=0), pc)
        pc = tl.where(whole, tl.load(scratch_ptr + S_SNAP + p, mask=mp, other=0), pc)
        pc = tl.where(pc < total, pc, BIG)
        tl.store(scratch_ptr + S_CUT + p, pc, mask=mp)
    tl.debug_barrier()

    # Works: the distinct cut points (request starts, and program starts that are new) in
    # order, each stored at its rank with its request.
    new_before = zero
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pc = tl.load(scratch_ptr + S_CUT + p, mask=mp, other=BIG)
        prev = tl.load(scratch_ptr + S_CUT + p - 1, mask=mp & (p > 0), other=-1)
        le = _count_le(scratch_ptr + S_START, B, pc, False, CB)
        rb = tl.minimum(tl.maximum(le - 1, 0), B - 1)
        on_start = tl.load(scratch_ptr + S_START + rb) == pc
        new = mp & (pc < BIG) & (pc != prev) & (~on_start)
        rank = le + tl.cumsum(new.to(tl.int32), axis=0) - 1 + new_before
        tl.store(scratch_ptr + S_U0 + rank, pc, mask=new)
        tl.store(scratch_ptr + S_R + rank, rb, mask=new)
        tl.store(scratch_ptr + S_NEW + p, new.to(tl.int32), mask=mp)
        new_before = new_before + tl.sum(new.to(tl.int32), axis=0)
    n_works = B + new_before
    tl.debug_barrier()
    for c in range(0, B, CB):
        i = c + ob
        m = i < B
        st = tl.load(scratch_ptr + S_START + i, mask=m, other=0)
        before = tl.zeros([CB], tl.int32)  # new program starts below this request's start
        for cp in range(0, P, CP):
            p = cp + op
            mp = p < P
            pc = tl.load(scratch_ptr + S_CUT + p, mask=mp, other=BIG)
            new = tl.load(scratch_ptr + S_NEW + p, mask=mp, other=0) != 0
            before += tl.sum((new[None, :] & (pc[None, :] < st[:, None])).to(tl.int32), axis=1)
        rank = i + before
        tl.store(scratch_ptr + S_U0 + rank, st, mask=m)
        tl.store(scratch_ptr + S_R + rank, i, mask=m)
        tl.store(scratch_ptr + S_RANK + i, rank, mask=m)
    tl.store(scratch_ptr + S_RANK + B, n_works)
    tl.debug_barrier()

    # Per request: works, splits, the reduce's indptr and tiles.
    carry = zero
    ntiles = zero
    for c in range(0, B, CB):
        i = c + ob
        m = i < B
        per = tl.load(scratch_ptr + S_RANK + i + 1, mask=m, other=0) - \
            tl.load(scratch_ptr + S_RANK + i, mask=m, other=0)
        split = m & (per > 1)
        red = tl.where(split, per, 0)
        incl = tl.cumsum(red, axis=0) + carry
        tl.store(reduce_indptr_ptr + i + 1, incl, mask=m)
        tpos = tl.cumsum(split.to(tl.int32), axis=0) - 1 + ntiles
        tl.store(tiles_ptr + tpos, i, mask=split & (tpos < NT))
        tl.store(tile_ptr_ptr + 2 * tpos, incl - red, mask=split & (tpos < NT))
        tl.store(tile_ptr_ptr + 2 * tpos + 1, incl, mask=split & (tpos < NT))
        tl.store(final_map_ptr + 2 * i, i * QLEN, mask=m)
        tl.store(final_map_ptr + 2 * i + 1, i * QLEN + QLEN, mask=m)
        carry = carry + tl.sum(red, axis=0)
        ntiles = ntiles + tl.sum(split.to(tl.int32), axis=0)
    tl.store(reduce_indptr_ptr, 0)
    total_reduce = carry
    ont = tl.arange(0, CB)
    for c in range(0, NT, CB):
        i = c + ont
        empty = (i >= ntiles) & (i < NT)
        tl.store(tiles_ptr + i, tl.full([CB], -1, tl.int32), mask=empty)
        tl.store(tile_ptr_ptr + 2 * i, tl.zeros([CB], tl.int32), mask=empty)
        tl.store(tile_ptr_ptr + 2 * i + 1, tl.zeros([CB], tl.int32), mask=empty)
    tl.store(num_works_ptr, n_works)
    tl.debug_barrier()

    # Per work: its KV range, partial rows, program; then each program's first work.
    for c in range(0, CAP, CW):
        w = c + ow
        mw = w < CAP
        valid = w < n_works
        u0 = tl.load(scratch_ptr + S_U0 + w, mask=valid, other=total)
        u1 = tl.load(scratch_ptr + S_U0 + w + 1, mask=w + 1 < n_works, other=total)
        r = tl.load(scratch_ptr + S_R + w, mask=valid, other=B - 1)
        st = tl.load(scratch_ptr + S_START + r)
        n = tl.load(seq_lens_ptr + r)
        lo_kv = tl.minimum(tl.maximum(u0 - st - OVERHEAD, 0) * BLOCK_N, n)
        hi_kv = tl.minimum(tl.maximum(u1 - st - OVERHEAD, 0) * BLOCK_N, n)
        first_w = tl.load(scratch_ptr + S_RANK + r)
        per = tl.load(scratch_ptr + S_RANK + r + 1) - first_w
        red0 = tl.load(reduce_indptr_ptr + r)
        ploc = tl.where(per > 1, (red0 + w - first_w) * QLEN, -1)
        base = tl.load(kv_indptr_ptr + r)
        row = work_info_ptr + w * 8
        zw = tl.zeros([CW], tl.int32)
        tl.store(row + 0, tl.where(valid, r, zw), mask=mw)
        tl.store(row + 1, tl.where(valid, ploc, zw), mask=mw)
        tl.store(row + 2, tl.where(valid, r * QLEN, zw), mask=mw)
        tl.store(row + 3, tl.where(valid, r * QLEN + QLEN, zw), mask=mw)
        tl.store(row + 4, tl.where(valid, base + lo_kv, zw), mask=mw)
        tl.store(row + 5, tl.where(valid, base + hi_kv, zw), mask=mw)
        tl.store(row + 6, tl.where(valid, n - hi_kv, zw), mask=mw)
        tl.store(row + 7, zw, mask=mw)
        tl.store(partial_map_ptr + w, tl.where(w < total_reduce, w * QLEN, -1), mask=mw)
        # This work's program: the last program start at or before it.
        prog = _count_le(scratch_ptr + S_CUT, P, u0, False, CP) - 1
        tl.store(scratch_ptr + S_PROG + w, tl.where(valid, prog, P), mask=mw)
    tl.debug_barrier()
    for c in range(0, P + 1, CP):
        p = c + op
        cnt = _count_le(scratch_ptr + S_PROG, CAP, p, True, CW)
        tl.store(work_indptr_ptr + p, cnt, mask=p < P + 1)


def scratch_size(num_seqs: int, num_programs: int) -> int:
    """int32 words of scratch :func:`mla_plan_kernel` needs."""
    b, p = num_seqs, num_programs
    return 5 * b + 1 + 5 * p + 3 * (p + b)
