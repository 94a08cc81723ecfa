"""The split-KV schedule in one Triton program: the plan of ``backends/triton/schedule.py``,
bit for bit, in a single launch.

``plan_splits`` (jnp) is the definition; this kernel computes the same arrays without XLA's chain
of small kernels (sorts, binary searches as while loops, scatters, cumulative sums) that made a
step's metadata cost hundreds of launches on a GPU. One program walks the requests and the
programs in chunks (``CB`` requests, ``CP`` programs, ``CW`` works at a time), keeps per-request
and per-program intermediates in ``scratch`` (global memory, re-read after a block barrier), and
writes every output of the schedule. No step compares every program with every request: the
binary searches (the request a program's cut falls in) become marks that each request scatters
at its first program, then a running maximum over programs; the sort of cut points becomes a
merge of two sorted lists (request starts, and program starts that are new), each element
stored at its rank, with per-request counts of new starts (atomic adds) for the offsets. Every
step is O(B + P) vector work, a few dependent loads deep.

All arithmetic is int32 on non-negative values (``//`` then truncates like floor division).
Cost units, plans and the choice between them: see ``schedule.py``.
"""

import triton
import triton.language as tl

BIG = tl.constexpr(2147483647)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _cummax(x):
    return tl.associative_scan(x, 0, _max2)


@triton.jit
def _pick(vec, offs, i):
    """``vec[i]`` for a scalar index ``i`` into a block ``vec`` indexed by ``offs``."""
    return tl.sum(tl.where(offs == i, vec, 0), axis=0)


@triton.jit
def mla_plan_kernel(
    seq_lens_ptr,
    work_indptr_ptr, work_info_ptr, num_works_ptr, reduce_indptr_ptr, final_map_ptr,
    partial_map_ptr, tiles_ptr, tile_ptr_ptr, lens_ptr, kv_indptr_ptr, scratch_ptr,
    B: tl.constexpr, P: tl.constexpr, NT: tl.constexpr, QLEN: tl.constexpr,
    BLOCK_N: tl.constexpr, MODE: tl.constexpr, OVERHEAD: tl.constexpr, SLACK_NUM: tl.constexpr,
    SLACK_DEN: tl.constexpr, EVEN_SLACK: tl.constexpr, GRID: tl.constexpr, CB: tl.constexpr,
    CP: tl.constexpr, CW: tl.constexpr, MAX_LEN: tl.constexpr = 2147483647,
):
    """``MODE``: 0 auto, 1 line, 2 even. ``seq_lens_ptr``: the lengths as given; the kernel
    clamps them into ``[0, MAX_LEN]`` and writes them (``lens_ptr [B]``) with their offsets
    (``kv_indptr_ptr [B + 1]``), the metadata's ``seq_lens`` and ``paged_kv_indptr``, so that
    no other kernel of the step computes them. Scratch (int32, :func:`scratch_size`): ``[0, B)``
    request starts, ``[B, 2B)`` blocks, ``[2B, 3B)`` pieces ``k``, ``[3B, 4B)`` cumulative pieces,
    ``[4B, 5B + 1)`` each request's first work (its rank), then per program the line cuts, the
    whole-request cuts, the even cuts and the final cuts (``P`` each), then per work its unit
    and its request (``P + B`` each), then per program what gives its first work, the two
    plans' search marks, and ``count(starts <= cut)`` for each plan's cut and the final one
    (``P`` each), then per request the new program starts inside it (``B``)."""
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
    S_U0: tl.constexpr = S_CUT + P
    S_R: tl.constexpr = S_U0 + CAP
    S_PV: tl.constexpr = S_R + CAP
    S_LMARK: tl.constexpr = S_PV + P  # line plan: the last request starting at or before p's cut
    S_EMARK: tl.constexpr = S_LMARK + P  # even plan: the request whose pieces begin at p
    S_LLE: tl.constexpr = S_EMARK + P  # count(starts <= cut), for each plan's cut and the final
    S_SLE: tl.constexpr = S_LLE + P
    S_ELE: tl.constexpr = S_SLE + P
    S_LE: tl.constexpr = S_ELE + P
    S_CNT: tl.constexpr = S_LE + P  # new program starts inside each request
    ob = tl.arange(0, CB)
    op = tl.arange(0, CP)
    ow = tl.arange(0, CW)

    # Requests: blocks, starts on the cost line, the total, and the even plan's bounds.
    zero = tl.zeros([], tl.int32)
    carry = zero
    tokens = zero
    sum_blocks = zero
    max_blocks = zero
    tl.store(kv_indptr_ptr, zero)
    for c in range(0, B, CB):
        i = c + ob
        m = i < B
        n = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + i, mask=m, other=0), 0), MAX_LEN)
        tl.store(lens_ptr + i, n, mask=m)
        tl.store(kv_indptr_ptr + 1 + i, tl.cumsum(n, axis=0) + tokens, mask=m)
        tokens = tokens + tl.sum(n, axis=0)
        blocks = (n + BLOCK_N - 1) // BLOCK_N
        cost = tl.where(m, blocks + OVERHEAD, 0)
        ends = tl.cumsum(cost, axis=0) + carry
        tl.store(scratch_ptr + S_START + i, ends - cost, mask=m)
        tl.store(scratch_ptr + S_BLOCKS + i, blocks, mask=m)
        tl.store(scratch_ptr + S_CNT + i, tl.zeros([CB], tl.int32), mask=m)
        carry = carry + tl.sum(cost, axis=0)
        sum_blocks = sum_blocks + tl.sum(tl.where(m, blocks, 0), axis=0)
        max_blocks = tl.maximum(max_blocks, tl.max(tl.where(m, blocks, 0), axis=0))
    total = carry
    chunk = tl.maximum(1, (total + P - 1) // P)
    for c in range(0, P, CP):
        p = c + op
        tl.store(scratch_ptr + S_LMARK + p, tl.zeros([CP], tl.int32), mask=p < P)
        tl.store(scratch_ptr + S_EMARK + p, tl.zeros([CP], tl.int32), mask=p < P)
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
        # Searches as running maxima over programs: request i marks the first program whose
        # line cut reaches its start, and the program that runs its first piece.
        st = tl.load(scratch_ptr + S_START + i, mask=m, other=0)
        first_p = (st + chunk - 1) // chunk
        tl.atomic_max(scratch_ptr + S_LMARK + first_p, i, mask=m & (first_p < P))
        tl.store(scratch_ptr + S_EMARK + kend - k, i, mask=m & (kend - k < P))
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
    run_l = zero
    run_e = zero
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pc = p * chunk
        # count(starts <= pc) - 1
        rb = tl.maximum(_cummax(tl.load(scratch_ptr + S_LMARK + p, mask=mp, other=0)), run_l)
        run_l = tl.max(rb, axis=0)
        st = tl.load(scratch_ptr + S_START + rb)
        a = pc - st
        pc = tl.where((a > 0) & (a <= OVERHEAD), st, pc)
        tl.store(scratch_ptr + S_LINE + p, pc, mask=mp)
        tl.store(scratch_ptr + S_LLE + p, rb + 1, mask=mp)
        # Nearest request boundary: bounds are the starts, then the total; j = count(starts <
        # pc) + (total < pc).
        j = rb + (pc != st).to(tl.int32) + (total < pc).to(tl.int32)
        ib = tl.maximum(j - 1, 0)
        below = tl.where(ib < B, tl.load(scratch_ptr + S_START + tl.minimum(ib, B - 1)), total)
        ia = tl.minimum(j, B)
        above = tl.where(ia < B, tl.load(scratch_ptr + S_START + tl.minimum(ia, B - 1)), total)
        lower = pc - below <= above - pc
        snap = tl.where(lower, below, above)
        snap_le = tl.where(lower, tl.minimum(ib + 1, B), tl.minimum(ia + 1, B))
        snap = tl.where(p == 0, 0, snap)
        snap_le = tl.where(p == 0, 1, snap_le)
        tl.store(scratch_ptr + S_SNAP + p, snap, mask=mp)
        tl.store(scratch_ptr + S_SLE + p, snap_le, mask=mp)
        # Even pieces: program p runs piece j of request r = min(count(kend <= p), B - 1).
        r = tl.maximum(_cummax(tl.load(scratch_ptr + S_EMARK + p, mask=mp, other=0)), run_e)
        run_e = tl.max(r, axis=0)
        k = tl.load(scratch_ptr + S_K + r)
        kend = tl.load(scratch_ptr + S_KEND + r)
        blk = tl.load(scratch_ptr + S_BLOCKS + r)
        jj = p - (kend - k)
        first = tl.load(scratch_ptr + S_START + r) + tl.where(
            jj == 0, 0, OVERHEAD + (jj * blk) // tl.maximum(k, 1))
        tl.store(scratch_ptr + S_ELE + p, r + 1, mask=mp)
        tl.store(scratch_ptr + S_EVEN + p, tl.where(p < pieces_total, first, BIG), mask=mp)
    tl.debug_barrier()
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pc = tl.load(scratch_ptr + S_LINE + p, mask=mp, other=total)
        nxt = tl.load(scratch_ptr + S_LINE + p + 1, mask=p + 1 < P, other=total)
        span = tl.where(pc < total, tl.minimum(nxt - pc, total - pc), 0)
        rb = tl.load(scratch_ptr + S_LLE + p, mask=mp, other=1) - 1
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
        le = tl.load(scratch_ptr + S_LLE + p, mask=mp, other=0)
        le = tl.where(take, tl.load(scratch_ptr + S_ELE + p, mask=mp, other=0), le)
        le = tl.where(whole, tl.load(scratch_ptr + S_SLE + p, mask=mp, other=0), le)
        le = tl.where(pc < total, le, B)
        pc = tl.where(pc < total, pc, BIG)
        tl.store(scratch_ptr + S_CUT + p, pc, mask=mp)
        tl.store(scratch_ptr + S_LE + p, le, mask=mp)
    tl.debug_barrier()

    # Works: the distinct cut points (request starts, and program starts that are new) in
    # order, each stored at its rank with its request.
    new_before = zero
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pc = tl.load(scratch_ptr + S_CUT + p, mask=mp, other=BIG)
        prev = tl.load(scratch_ptr + S_CUT + p - 1, mask=mp & (p > 0), other=-1)
        le = tl.load(scratch_ptr + S_LE + p, mask=mp, other=B)  # count(starts <= pc)
        rb = tl.minimum(tl.maximum(le - 1, 0), B - 1)
        on_start = tl.load(scratch_ptr + S_START + rb) == pc
        new = mp & (pc < BIG) & (pc != prev) & (~on_start)
        rank = le + tl.cumsum(new.to(tl.int32), axis=0) - 1 + new_before
        tl.store(scratch_ptr + S_U0 + rank, pc, mask=new)
        tl.store(scratch_ptr + S_R + rank, rb, mask=new)
        tl.atomic_add(scratch_ptr + S_CNT + rb, tl.full([CP], 1, tl.int32), mask=new)
        # The program's first work, once the requests' ranks are known: its own rank (a new
        # cut), its request's first work (-2 - rb: a cut on a request's start), or the program
        # before's (-1: a repeated cut; beyond the works, the count of works).
        pv = tl.where(new, rank, tl.where(on_start & (pc < BIG), -2 - rb, -1))
        tl.store(scratch_ptr + S_PV + p, pv, mask=mp)
        new_before = new_before + tl.sum(new.to(tl.int32), axis=0)
    n_works = B + new_before
    tl.debug_barrier()
    carry = zero
    for c in range(0, B, CB):
        i = c + ob
        m = i < B
        st = tl.load(scratch_ptr + S_START + i, mask=m, other=0)
        # New program starts below this request's start: those inside the requests before it.
        cnt = tl.load(scratch_ptr + S_CNT + i, mask=m, other=0)
        before = tl.cumsum(cnt, axis=0) - cnt + carry
        carry = carry + tl.sum(cnt, axis=0)
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

    # Per work: its KV range and partial rows; then each program's first work.
    for c in range(0, CAP, CW):
        w = c + ow
        mw = w < CAP
        valid = w < n_works
        u0 = tl.load(scratch_ptr + S_U0 + w, mask=valid, other=total)
        u1 = tl.load(scratch_ptr + S_U0 + w + 1, mask=w + 1 < n_works, other=total)
        r = tl.load(scratch_ptr + S_R + w, mask=valid, other=B - 1)
        st = tl.load(scratch_ptr + S_START + r)
        n = tl.load(lens_ptr + r)
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
    # Each program's first work: cuts are sorted, so a repeated cut's value is the running
    # maximum of the values before it.
    run = zero
    for c in range(0, P, CP):
        p = c + op
        mp = p < P
        pv = tl.load(scratch_ptr + S_PV + p, mask=mp, other=-1)
        pc = tl.load(scratch_ptr + S_CUT + p, mask=mp, other=BIG)
        first = tl.load(scratch_ptr + S_RANK + tl.maximum(-2 - pv, 0), mask=mp & (pv <= -2),
                        other=0)
        val = tl.where(pv >= 0, pv, tl.where(pv <= -2, first, 0))
        val = tl.where(pc < BIG, val, n_works)
        val = tl.maximum(_cummax(val), run)
        tl.store(work_indptr_ptr + p, val, mask=mp)
        run = tl.maximum(run, tl.max(tl.where(mp, val, 0), axis=0))
    tl.store(work_indptr_ptr + P, n_works)


def scratch_size(num_seqs: int, num_programs: int) -> int:
    """int32 words of scratch :func:`mla_plan_kernel` needs."""
    b, p = num_seqs, num_programs
    return 5 * b + 1 + 4 * p + 2 * (p + b) + 7 * p + b
