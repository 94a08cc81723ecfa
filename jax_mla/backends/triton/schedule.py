"""The split-KV work schedule, built in ``jax.numpy`` (static shapes, no host sync).

A *work* is one KV range of one request. The decode kernel is persistent: it runs ``P`` programs
per head block (about as many as the GPU holds at once), and program ``p`` walks its works
``work_indptr[p] .. work_indptr[p + 1]`` one after another. The plan cuts the batch the way
FlashMLA's tile scheduler and AITER's persistent planner do: every request costs
``ceil(seq_lens[b] / BLOCK_N)`` KV blocks plus a fixed per-work overhead, the requests are laid end
to end, and the line is cut into ``P`` pieces of equal cost. A program's piece may end inside one
request and go on into the next; each (program, request) overlap is one work. So every program
does the same amount of work, whatever the mix of lengths, and there is no second wave. There are
at most ``P + B`` works, the static capacity. Two other plans are taken instead where they do
better (decided on the device, per call):

- *whole requests*: when the batch has about as many requests as there are programs or more,
  moving every cut to the nearest request boundary often unbalances the programs by a few percent
  only; then no request is split and there is nothing to merge;
- *even pieces*: the line's cuts fall anywhere in a request, often leaving a sliver of a block or
  two that still loads the queries and writes a whole partial. With no more requests than
  programs, each request can instead be cut into ``k_b`` nearly equal pieces of at most ``t``
  blocks, one piece a program, ``t`` the least size that needs at most ``P`` programs. For fixed
  lengths that is ``P // B`` equal pieces a request (B64, 132 programs: halves, 128 partials
  instead of 188). It is taken when its longest program, with every work's overhead counted, is
  at most ``EVEN_SLACK_BLOCKS`` over the line plan's.

The plan uses AITER's layout (``get_mla_metadata_v1``), so the same reduce consumes both:
``work_info_set[w] = (batch_idx, partial_qo_loc, qo_start, qo_end, kv_start, kv_end, kv_offset,
0)`` with ``kv_start/kv_end`` indexing the flat token space of ``paged_kv_indptr`` and
``kv_offset`` the request's tokens after ``kv_end``; ``partial_qo_loc = -1`` marks a work that
covers its whole request and writes the final output, otherwise its ``Q`` rows go to partial rows
``[partial_qo_loc, partial_qo_loc + Q)``. ``reduce_indptr [B+1]``, ``reduce_final_map [B, 2]``
and ``reduce_partial_map [capacity]`` say which partial rows merge into which final rows;
``reduce_tiles`` and ``reduce_tile_ptr`` (ours, not AITER's) list the requests that were split
and where their partials are, so the reduce launches programs for those only and each program finds
its partials with one load. A request's partial rows are consecutive: piece ``s`` of the ``k``-th
split request (in request order) writes rows ``[(p0 + s) * Q, (p0 + s + 1) * Q)`` with
``p0 = reduce_indptr[request]``, which is what ``reduce_partial_map`` says in AITER's terms.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_mla.backends.triton.launch import triton_call
from jax_mla.paged import expand_indptr

OVERHEAD_BLOCKS = 1  # fixed cost of a work (query load, output write), in KV blocks
# A plan that splits no request is taken when its longest program is at most this fraction
# (num, den) over the equal share: about what the partial writes and the reduce of a split cost.
NO_SPLIT_SLACK = (1, 16)
# The even-pieces plan is taken when its longest program is at most this many blocks over the
# line plan's (both counting every work's overhead): it writes fewer partials, of fewer pieces.
EVEN_SLACK_BLOCKS = 1
_GRID = 128  # candidate piece sizes evaluated at once by the even-pieces search
PLAN_MODES = ("auto", "line", "even")


@dataclasses.dataclass(frozen=True)
class SplitSchedule:
    """A split-KV plan (AITER layout; see the module docstring).

    Attributes:
      work_indptr: ``[P + 1]`` int32: program ``p`` runs works ``work_indptr[p] .. [p + 1]``.
      work_info_set: ``[max_works, 8]`` int32, ``max_works = P + B``; works in order.
      num_works: ``[1]`` int32 valid works.
      reduce_indptr: ``[B + 1]`` int32.
      reduce_final_map: ``[B, 2]`` int32 ``(qo_start, qo_end)``.
      reduce_partial_map: ``[max_works]`` int32 partial row offsets; tail -1.
      reduce_tiles: ``[max(1, min(B, P - 1))]`` int32: the requests that were split, ascending,
        tail -1. The reduce runs one tile per entry: P programs cut at most P - 1 requests.
      reduce_tile_ptr: ``[len(reduce_tiles), 2]`` int32: ``reduce_indptr[t], reduce_indptr[t + 1]``
        of each listed request ``t`` (``0, 0`` in the tail): its partials, read in one load.
      seq_lens, kv_indptr: ``[B]`` and ``[B + 1]`` int32, the lengths the plan was made for
        (clamped as the metadata's) and their offsets, the ``paged_kv_indptr`` the works'
        ``kv_start`` / ``kv_end`` index. ``metadata.with_schedule`` moves them into the
        metadata, so that where the planning kernel computes them XLA computes nothing else
        for the step (None: not given, or moved).
      block_n: static KV tile; every work starts on a multiple of it.
      num_head_blocks, qlen: static shape the plan was made for.
    """

    work_indptr: jax.Array
    work_info_set: jax.Array
    num_works: jax.Array
    reduce_indptr: jax.Array
    reduce_final_map: jax.Array
    reduce_partial_map: jax.Array
    reduce_tiles: jax.Array
    reduce_tile_ptr: jax.Array
    seq_lens: jax.Array | None = None
    kv_indptr: jax.Array | None = None
    block_n: int = 64
    num_head_blocks: int = 1
    qlen: int = 1

    @property
    def max_works(self) -> int:
        return self.work_info_set.shape[0]

    @property
    def num_programs(self) -> int:
        return self.work_indptr.shape[0] - 1


jax.tree_util.register_dataclass(
    SplitSchedule,
    data_fields=["work_indptr", "work_info_set", "num_works", "reduce_indptr", "reduce_final_map",
                 "reduce_partial_map", "reduce_tiles", "reduce_tile_ptr", "seq_lens",
                 "kv_indptr"],
    meta_fields=["block_n", "num_head_blocks", "qlen"],
)


def _pieces(blocks, t):
    """Pieces of at most ``t`` blocks each request splits into (an empty request: one)."""
    return jnp.maximum(1, -(-blocks // t))


def _least_fitting_piece(blocks, p_count, lo, hi):
    """About the least ``t`` in ``[lo, hi]`` whose pieces number at most ``p_count``, or ``hi``.

    Two rounds of ``_GRID`` candidates (the piece count falls as ``t`` grows): exact when the
    window holds at most ``_GRID ** 2`` values."""
    for _ in range(2):
        step = jnp.maximum(1, -(-(hi - lo) // (_GRID - 1)))
        cand = jnp.minimum(lo + step * jnp.arange(_GRID, dtype=jnp.int32), hi)
        fits = jnp.sum(_pieces(blocks[None, :], cand[:, None]), axis=1) <= p_count
        i = jnp.argmax(fits)  # the first that fits (hi, the last candidate, if none does)
        hi = jnp.where(jnp.any(fits), cand[i], hi)
        lo = jnp.where(i > 0, cand[jnp.maximum(i - 1, 0)] + 1, lo)
    return hi


def _even_piece_cuts(blocks, starts, p_count, big):
    """The even-pieces plan: request ``b`` in ``k_b`` nearly equal pieces of at most ``t`` blocks,
    one piece a program, with the least ``t`` that needs at most ``p_count`` programs.

    Returns the program starts in cost units (``big`` for programs left idle) and the plan's
    longest program (its blocks plus one work's overhead), ``big`` if no ``t`` fits (more requests
    than programs)."""
    b = blocks.shape[0]
    lo = jnp.maximum(1, -(-jnp.sum(blocks) // p_count))
    hi = jnp.maximum(jnp.max(blocks), lo)
    t = _least_fitting_piece(blocks, p_count, lo, hi)
    k = _pieces(blocks, t)
    ends = jnp.cumsum(k)
    fits = ends[-1] <= p_count
    p = jnp.arange(p_count, dtype=jnp.int32)
    r = jnp.minimum(jnp.searchsorted(ends, p, side="right"), b - 1)
    j = p - (ends[r] - k[r])  # piece j of request r holds blocks [j n / k, (j + 1) n / k)
    first = starts[r] + jnp.where(j == 0, 0, OVERHEAD_BLOCKS + (j * blocks[r]) // k[r])
    cuts = jnp.where(p < ends[-1], first, big)
    longest = jnp.max(-(-blocks // k)) + OVERHEAD_BLOCKS
    return cuts, jnp.where(fits, longest, big)


@functools.partial(jax.jit, static_argnames=("qlen", "block_n", "num_programs",
                                             "num_head_blocks", "mode"))
def plan_splits(seq_lens, kv_indptr, *, qlen, block_n, num_programs, num_head_blocks=1,
                mode="auto") -> SplitSchedule:
    """Balanced persistent plan for ``seq_lens [B]`` over ``num_programs`` programs.

    Cost units: request ``b`` owns units ``[start_b, start_b + cost_b)`` of one line, unit 0 of it
    the per-work overhead and unit ``1 + k`` its KV block ``k``. Program ``p`` owns units
    ``[p * chunk, (p + 1) * chunk)`` (a start that falls just after a request's overhead unit moves
    back to the request's start), or, when that splits no request at a cost of at most
    ``NO_SPLIT_SLACK`` over ``chunk``, from the request boundary nearest ``p * chunk``; or, with
    ``mode`` ``"auto"`` (the default) where the even-pieces plan is at most ``EVEN_SLACK_BLOCKS``
    longer, or ``"even"`` wherever it fits, from the start of its piece ``p`` (programs past the
    last piece idle); ``"line"`` never takes it. The works are the pieces between consecutive cut
    points (request starts and program starts), in order, so each program's works are contiguous.
    """
    if mode not in PLAN_MODES:
        raise ValueError(f"plan_splits: mode must be one of {PLAN_MODES}, got {mode!r}")
    b = seq_lens.shape[0]
    p_count = num_programs
    cap = p_count + b
    seq_lens = seq_lens.astype(jnp.int32)
    blocks = -(-seq_lens // block_n)
    cost = blocks + OVERHEAD_BLOCKS
    ends = jnp.cumsum(cost)
    starts = ends - cost
    total = ends[-1]
    chunk = jnp.maximum(1, -(-total // p_count))
    big = jnp.iinfo(jnp.int32).max
    prog_cuts = jnp.arange(p_count, dtype=jnp.int32) * chunk
    # A program start that would leave a piece holding only a request's overhead unit moves back
    # to the request's start: that program takes the unit (the balance stays within one unit).
    rb = jnp.clip(jnp.searchsorted(starts, prog_cuts, side="right") - 1, 0, b - 1)
    a = prog_cuts - starts[rb]
    prog_cuts = jnp.where((a > 0) & (a <= OVERHEAD_BLOCKS), starts[rb], prog_cuts)
    # Whole requests only, when that costs little balance: every program start moves to the
    # nearest request boundary, and if no program then holds more than NO_SPLIT_SLACK over the
    # equal share, nothing is split (no partials, nothing to reduce).
    bounds = jnp.concatenate([starts, total[None]])
    j = jnp.searchsorted(bounds, prog_cuts, side="left")
    below = bounds[jnp.maximum(j - 1, 0)]
    above = bounds[jnp.minimum(j, b)]
    snapped = jnp.where(prog_cuts - below <= above - prog_cuts, below, above).at[0].set(0)
    longest = jnp.max(jnp.concatenate([snapped[1:], total[None]]) - snapped)
    whole = longest * NO_SPLIT_SLACK[1] <= chunk * (NO_SPLIT_SLACK[1] + NO_SPLIT_SLACK[0])
    if mode != "line":
        even_cuts, even_cost = _even_piece_cuts(blocks, starts, p_count, big)
        # The line plan's honest cost: a program that starts inside a request pays that work's
        # overhead too (the line counts each request's overhead once, at its start).
        span = jnp.concatenate([prog_cuts[1:], total[None]]) - prog_cuts
        span = jnp.where(prog_cuts < total, jnp.minimum(span, total - prog_cuts), 0)
        inside = starts[rb] != prog_cuts
        line_cost = jnp.max(span + jnp.where(inside, OVERHEAD_BLOCKS, 0))
        take = even_cost < big if mode == "even" else even_cost <= line_cost + EVEN_SLACK_BLOCKS
        prog_cuts = jnp.where(take, even_cuts, prog_cuts)
    prog_cuts = jnp.where(whole, snapped, prog_cuts)
    prog_cuts = jnp.where(prog_cuts < total, prog_cuts, big)
    cuts = jnp.sort(jnp.concatenate([starts, prog_cuts]))
    dup = jnp.concatenate([jnp.zeros((1,), bool), cuts[1:] == cuts[:-1]])
    cuts = jnp.sort(jnp.where(dup, big, cuts))  # distinct cut points first, ascending
    valid = cuts < big
    n_works = jnp.sum(valid).astype(jnp.int32)
    u0 = jnp.where(valid, cuts, total)
    u1 = jnp.where(valid, jnp.concatenate([u0[1:], total[None]]), total)
    r = jnp.clip(jnp.searchsorted(starts, u0, side="right") - 1, 0, b - 1).astype(jnp.int32)
    prog = jnp.searchsorted(prog_cuts, u0, side="right") - 1  # the last program start <= u0
    prog = jnp.where(valid, prog, p_count).astype(jnp.int32)
    # Request-local units -> KV blocks (unit 0 is the overhead), then token positions.
    a0 = u0 - starts[r]
    a1 = u1 - starts[r]
    n = seq_lens[r]
    lo = jnp.minimum(jnp.maximum(a0 - OVERHEAD_BLOCKS, 0) * block_n, n)
    hi = jnp.minimum(jnp.maximum(a1 - OVERHEAD_BLOCKS, 0) * block_n, n)
    # Works per request and each work's index within its request.
    per_req = jax.ops.segment_sum(valid.astype(jnp.int32), r, num_segments=b)
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_req)[:-1]])
    s = jnp.arange(cap, dtype=jnp.int32) - first[r]
    split = per_req > 1
    zero = jnp.zeros((1,), jnp.int32)
    reduce_indptr = jnp.concatenate([zero, jnp.cumsum(jnp.where(split, per_req, 0))])
    reduce_indptr = reduce_indptr.astype(jnp.int32)
    ploc = jnp.where(split[r], (reduce_indptr[r] + s) * qlen, -1)
    qo = r * qlen
    base = kv_indptr[r]
    info = jnp.stack([r, ploc, qo, qo + qlen, base + lo, base + hi, n - hi,
                      jnp.zeros_like(r)], axis=1)
    info = jnp.where(valid[:, None], info, 0).astype(jnp.int32)
    work_indptr = jnp.searchsorted(prog, jnp.arange(p_count + 1, dtype=jnp.int32),
                                   side="left").astype(jnp.int32)
    pr, ps_, pvalid = expand_indptr(reduce_indptr, cap)
    partial_map = jnp.where(pvalid, (reduce_indptr[pr] + ps_) * qlen, -1).astype(jnp.int32)
    qo_b = jnp.arange(b, dtype=jnp.int32) * qlen
    tiles = jnp.nonzero(split, size=max(1, min(b, p_count - 1)), fill_value=-1)[0]
    tiles = tiles.astype(jnp.int32)
    t = jnp.maximum(tiles, 0)
    tile_ptr = jnp.stack([reduce_indptr[t], reduce_indptr[t + 1]], axis=1)
    tile_ptr = jnp.where((tiles >= 0)[:, None], tile_ptr, 0)
    return SplitSchedule(
        work_indptr=work_indptr,
        work_info_set=info,
        num_works=n_works[None],
        reduce_indptr=reduce_indptr,
        reduce_final_map=jnp.stack([qo_b, qo_b + qlen], axis=1),
        reduce_partial_map=partial_map,
        reduce_tiles=tiles,
        reduce_tile_ptr=tile_ptr.astype(jnp.int32),
        seq_lens=seq_lens,
        kv_indptr=jnp.asarray(kv_indptr).astype(jnp.int32),
        block_n=block_n,
        num_head_blocks=num_head_blocks,
        qlen=qlen,
    )


_MODE_IDS = {"auto": 0, "line": 1, "even": 2}


def default_plan_chunks(num_seqs: int, num_programs: int) -> tuple[int, int, int]:
    """The planning kernel's chunks of requests, programs and works: each the next power of two
    of its count, within [16, 128] requests and [16, 512] programs and works (no step of the
    kernel compares every request with every program, so wide vectors are cheap)."""
    def pow2(n):
        return 1 << max(0, n - 1).bit_length()

    return (min(128, max(16, pow2(num_seqs))), min(512, max(16, pow2(num_programs))),
            min(512, max(16, pow2(num_programs + num_seqs))))


def plan_splits_kernel(seq_lens, *, qlen, block_n, num_programs, num_head_blocks=1,
                       mode="auto", max_len=None, target="cuda", launcher=None,
                       chunks=None, num_warps=8) -> SplitSchedule:
    """:func:`plan_splits` as one Triton program (``kernels/triton/plan.py``): the same arrays,
    bit for bit, in a single launch instead of XLA's chain of small kernels.

    ``seq_lens``: the lengths as given; the program clamps them into ``[0, max_len]`` (None: no
    upper bound), as the metadata's ``seq_lens``, and computes their offsets
    (``paged_kv_indptr``) itself: the schedule's ``seq_lens`` and ``kv_indptr``.

    ``chunks``: requests, programs and works a program handles at once (powers of two; by
    default :func:`default_plan_chunks`);
    ``num_warps``: the program's warps; ``target`` and ``launcher`` as ``launch.triton_call``.
    Jittable; nothing is read back to the host.
    """
    from jax_mla.kernels.triton import plan as plan_kernel  # imports triton: at trace time

    if mode not in PLAN_MODES:
        raise ValueError(f"plan_splits_kernel: mode must be one of {PLAN_MODES}, got {mode!r}")
    b, p = seq_lens.shape[0], num_programs
    cap, nt = p + b, max(1, min(b, p - 1))
    i32 = jnp.int32
    shapes = [((p + 1,), i32), ((cap, 8), i32), ((1,), i32), ((b + 1,), i32), ((b, 2), i32),
              ((cap,), i32), ((nt,), i32), ((nt, 2), i32), ((b,), i32), ((b + 1,), i32),
              ((plan_kernel.scratch_size(b, p),), i32)]
    cb, cp, cw = chunks or default_plan_chunks(b, p)
    max_len = jnp.iinfo(jnp.int32).max if max_len is None else int(max_len)
    outs = triton_call(
        plan_kernel.mla_plan_kernel, jnp.asarray(seq_lens).astype(i32),
        grid=(1,), out_shapes=[jax.ShapeDtypeStruct(s, d) for s, d in shapes],
        target=target, launcher=launcher, num_warps=num_warps, num_stages=1,
        B=b, P=p, NT=nt, QLEN=qlen, BLOCK_N=block_n, MODE=_MODE_IDS[mode],
        OVERHEAD=OVERHEAD_BLOCKS, SLACK_NUM=NO_SPLIT_SLACK[0], SLACK_DEN=NO_SPLIT_SLACK[1],
        EVEN_SLACK=EVEN_SLACK_BLOCKS, GRID=_GRID, CB=cb, CP=cp, CW=cw, MAX_LEN=max_len)
    (work_indptr, info, num_works, reduce_indptr, final_map, partial_map, tiles, tile_ptr, lens,
     kv_indptr, _) = outs
    return SplitSchedule(
        work_indptr=work_indptr, work_info_set=info, num_works=num_works,
        reduce_indptr=reduce_indptr, reduce_final_map=final_map,
        reduce_partial_map=partial_map, reduce_tiles=tiles, reduce_tile_ptr=tile_ptr,
        seq_lens=lens, kv_indptr=kv_indptr, block_n=block_n,
        num_head_blocks=num_head_blocks, qlen=qlen)
