"""MLA decode/verify for Hopper (sm_90) in Gluon: two warpgroups, one KV tile each (the seesaw).

The Triton kernel's 64-row tile lets both warpgroups work on the same 64-token KV tile, so each
computes 32 score columns per ``Q`` read from shared memory, and nothing overlaps its softmax.
Here the two warpgroups are explicit partitions (``gl.warp_specialize``) that take a *pair* of
tiles at a time, in the schedule FlashMLA calls the seesaw:

- warpgroup 0 owns KV buffer 0 and output columns ``[0, L/2)``; warpgroup 1 owns buffer 1 and
  columns ``[L/2, L)``;
- each computes the whole ``[64, 64]`` score tile of its own buffer (``Q @ K^T``, n = 64), so a
  ``Q`` read from shared memory feeds twice the MMA work;
- warpgroup 0 goes first: its row max ``m0`` and row sums, and its probabilities ``P0`` (written
  over the rope columns of buffer 0, which ``Q @ K^T`` has finished with) are published through
  shared memory; warpgroup 1 takes ``m1 = max(m0, rowmax(S1))`` and publishes ``P1`` the same
  way. Each warpgroup then applies both tiles to its half of the output:
  ``O = (O * 2^(m - m0) + P0 @ V0) * 2^(m0 - m1) + P1 @ V1``, one of the two products from
  registers, the other from the partner's ``P`` in shared memory. So one warpgroup's softmax runs
  under the other's MMAs, and warpgroup 1 overlaps its softmax with its own ``P0 @ V0``.

Loads are ``cp.async`` gathers through the block table (any page size), split between the
warpgroups so that every region of a buffer is refilled by its *last reader* as soon as it is
done with it: no "buffer free" barriers. A buffer's "full" barrier completes when the copies of
both warpgroups have landed (``cp.async.mbarrier.arrive.noinc``, one arrival per thread). The
block-table entries of a pair are read one pair ahead, so a copy never waits on a table read
(which matters most at page size 1). The split schedule hands out KV ranges in pairs of tiles
(``block_n`` 128), so only a work's last pair can be half empty.

Not (yet) done as FlashMLA does: ``Q @ K^T`` starts only when a whole tile has landed (FlashMLA
waits per 64-column slice), and each work's first pair and ``Q`` are loaded when the work starts,
not under the previous work's last pair.

Works (KV ranges of one request, see ``backends/triton/schedule.py``) come from the same persistent
split schedule as the Triton kernel, and their results (final rows or split partials) are the same,
so the same reduce merges them. Rows ``m = t * HB + h`` pack verify tokens and heads; a row sees
positions below its causal bound; a row that sees nothing gets out 0 and LSE -inf.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# cp.async global -> shared: ``async_copy_global_to_shared`` in triton 3.6 (the GPU image),
# ``async_load`` from triton 3.7 on (CPU CI compiles this kernel for sm_90 with a newer triton).
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# A barrier of the partition's warps: ``thread_barrier`` in 3.6, ``barrier`` later.
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

BLOCK_M = gl.constexpr(64)  # rows (tokens x heads) per program: one wgmma M
BLOCK_N = gl.constexpr(64)  # KV positions per tile; a pair of tiles per step
NUM_THREADS_WG = gl.constexpr(128)
CHUNK = gl.constexpr(16)  # rows per cp.async batch
LN2 = gl.constexpr(0.6931471805599453)

# Barriers (one int64 word each).
_FULL0 = gl.constexpr(0)  # buffer 0 loaded: both warpgroups' copies (256 arrivals)
_FULL1 = gl.constexpr(1)  # buffer 1 loaded
_QBAR = gl.constexpr(2)  # Q of this work loaded (warpgroup 0's copies, 128 arrivals)
_P0 = gl.constexpr(3)  # warpgroup 0 published m0, rowsum(P0) and P0 (1 arrival)
_P1 = gl.constexpr(4)  # warpgroup 1 published m1, rowsum(P1) and P1
_QFREE = gl.constexpr(5)  # warpgroup 1 is done with this work's Q (1 arrival)
_NUM_BARS = gl.constexpr(6)
# Registers a thread of the worker partition (warpgroup 1) may keep: all of them. A program takes
# 217 KiB of shared memory, so an SM runs one and nothing else could use registers the worker
# gave back; at 232 (the earlier setting) the worker spilled 16-248 bytes under triton 3.9's
# ptxas (CUDA 13, ``--regAllocOptLevel=2``), most where the head block is not a power of two
# (``m // HB``); at 256 no variant spills with triton 3.6 or 3.9 (``python -m jax_mla.aot``).
WORKER_REGS = gl.constexpr(256)


@gluon.jit
def _opaque(x):
    """``x``, but unknown to the compiler: shared-memory views taken from it are formed inside the
    loop that uses them, not hoisted (LLVM would keep every wgmma descriptor of the loop live in
    registers from the kernel's start, and spill them)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _views(sQn3, sQr3, sKn, sKr, counter):
    """``Q`` and both KV buffers, as views indexed by an opaque 0 formed here (see ``_opaque``);
    ``counter`` is any loop-variant integer."""
    z = _opaque(counter * 0)
    return (sQn3.index(z), sQr3.index(z), sKn.index(z), sKr.index(z), sKn.index(z + 1),
            sKr.index(z + 1))


@gluon.jit
def _chunk_rows(bt_row, start, hi, r0: gl.constexpr, PAGE_SIZE: gl.constexpr,
                TILE_IN_PAGE: gl.constexpr, layout: gl.constexpr, NUM_PAGES: gl.constexpr):
    """Flat cache rows (int32) of positions ``start + r0 .. + CHUNK``, clamped into the request
    (the copies zero-fill positions past ``hi``; see ``_load_part``), page indices clamped into
    ``[0, NUM_PAGES)`` (as the Triton kernel's ``_kv_rows``)."""
    last = gl.maximum(hi - 1, 0)
    pos = gl.minimum(start + r0 + gl.arange(0, CHUNK, layout=layout), last)
    if TILE_IN_PAGE:
        phys = gl.load(bt_row + gl.minimum(start, last) // PAGE_SIZE)
        phys = gl.minimum(gl.maximum(phys, 0), NUM_PAGES - 1)
        return phys * PAGE_SIZE + (pos % PAGE_SIZE)
    phys = gl.load(bt_row + pos // PAGE_SIZE)
    phys = gl.minimum(gl.maximum(phys, 0), NUM_PAGES - 1)
    if PAGE_SIZE == 1:
        return phys
    return phys * PAGE_SIZE + (pos % PAGE_SIZE)


@gluon.jit
def _tile_rows(bt_row, start, hi, PAGE_SIZE: gl.constexpr, TILE_IN_PAGE: gl.constexpr,
               LOAD: gl.constexpr, NUM_PAGES: gl.constexpr):
    """The cache rows of the tile at ``start``, as four 16-row chunks in the copy layout.

    Read from the block table a pair ahead of the copies that use them: a copy waits for its
    addresses, so a table read just before it would put an L2 round trip on every tile."""
    layout: gl.constexpr = gl.SliceLayout(1, LOAD)
    return (_chunk_rows(bt_row, start, hi, 0, PAGE_SIZE, TILE_IN_PAGE, layout, NUM_PAGES),
            _chunk_rows(bt_row, start, hi, CHUNK, PAGE_SIZE, TILE_IN_PAGE, layout, NUM_PAGES),
            _chunk_rows(bt_row, start, hi, 2 * CHUNK, PAGE_SIZE, TILE_IN_PAGE, layout, NUM_PAGES),
            _chunk_rows(bt_row, start, hi, 3 * CHUNK, PAGE_SIZE, TILE_IN_PAGE, layout, NUM_PAGES))


@gluon.jit
def _load_part(dst, kv_ptr, rows, start, hi, col0: gl.constexpr, NCOLS: gl.constexpr,
               D: gl.constexpr, LOAD: gl.constexpr):
    """cp.async columns ``col0 .. col0 + NCOLS`` of the KV tile at ``start`` (cache ``rows``
    from :func:`_tile_rows`) into ``dst`` ``[BLOCK_N, NCOLS]``, 16 rows at a time (few pointer
    registers); positions past ``hi`` read as 0."""
    offs_c = col0 + gl.arange(0, NCOLS, layout=gl.SliceLayout(0, LOAD))
    for i in gl.static_range(BLOCK_N // CHUNK):
        valid = start + i * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LOAD)) < hi
        ptrs = kv_ptr + rows[i].to(gl.int64)[:, None] * D + offs_c[None, :]
        _cp_async(dst.slice(i * CHUNK, CHUNK, dim=0), ptrs,
                  mask=valid[:, None] & (offs_c[None, :] >= 0))


@gluon.jit
def _query_rows(m, qo_start, hb, H: gl.constexpr, Q: gl.constexpr, HB: gl.constexpr):
    """Rows ``m = t * HB + h`` of a work starting at query token ``qo_start``, head block
    ``hb``: ``(ok, qrow)``, whether each is a real row (inside the verify block and the heads)
    and its query row ``token * H + head`` (int64; clamped into range where not ``ok``)."""
    t = m // HB
    head = hb * HB + m % HB
    ok = (t < Q) & (head < H)
    qrow = (qo_start + gl.minimum(t, Q - 1)).to(gl.int64) * H + gl.minimum(head, H - 1)
    return ok, qrow


@gluon.jit
def _load_q(sQn, sQr, q_ptr, qo_start, hb, H: gl.constexpr, Q: gl.constexpr, HB: gl.constexpr,
            L: gl.constexpr, R: gl.constexpr, LOAD: gl.constexpr):
    """cp.async the work's query rows ``m = t * HB + h`` into ``sQn``/``sQr``; rows past the
    verify block or the heads read as 0."""
    D: gl.constexpr = L + R
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, LOAD))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LOAD))
    for r0 in gl.static_range(0, BLOCK_M, CHUNK):
        m = r0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LOAD))
        ok, qrow = _query_rows(m, qo_start, hb, H, Q, HB)
        base = q_ptr + qrow * D
        _cp_async(sQn.slice(r0, CHUNK, dim=0), base[:, None] + offs_l[None, :],
                  mask=ok[:, None] & (offs_l[None, :] >= 0))
        _cp_async(sQr.slice(r0, CHUNK, dim=0), base[:, None] + L + offs_r[None, :],
                  mask=ok[:, None] & (offs_r[None, :] >= 0))


@gluon.jit
def _work(work_ptr, kv_indptr_ptr, bt_ptr, w, MAX_PAGES: gl.constexpr):
    """Work ``w``: its partial slot (negative: final rows), first query row, KV range
    ``[lo, hi)`` within the request, the request's length, its block-table row and its pairs of
    tiles (see ``backends/triton/schedule.py``)."""
    wp = work_ptr + w * 8
    b = gl.load(wp)
    ploc = gl.load(wp + 1)
    qo_start = gl.load(wp + 2)
    kv_base = gl.load(kv_indptr_ptr + b)
    lo = gl.load(wp + 4) - kv_base
    hi = gl.load(wp + 5) - kv_base
    seq = hi + gl.load(wp + 6)
    bt_row = bt_ptr + b.to(gl.int64) * MAX_PAGES
    n_pairs = (hi - lo + 2 * BLOCK_N - 1) // (2 * BLOCK_N)
    return ploc, qo_start, lo, hi, seq, bt_row, n_pairs


@gluon.jit
def _write_back(ROLE: gl.constexpr, acc, m_i, l_i, o_scale, offs_m, t_s, hb, ploc, qo_start,
                out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, H: gl.constexpr,
                Q: gl.constexpr, HB: gl.constexpr, L: gl.constexpr, O_L: gl.constexpr,
                L2_HINTS: gl.constexpr, SCALED: gl.constexpr, z):
    """A work's end: this warpgroup's half of the output columns (times ``o_scale`` where
    ``SCALED``), final or a split partial; warpgroup 0 also writes the LSE. Empty rows: out 0,
    LSE -inf. ``z``: 0, or an opaque 0 (``_opaque``: the fp8 kernel's) that keeps the rows'
    heads and tokens from being hoisted out of the work loop and held through it."""
    LH: gl.constexpr = L // 2
    col0: gl.constexpr = ROLE * LH
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    # Split partials are kept in L2 for the reduce (see the Triton kernel's module doc).
    part_policy: gl.constexpr = "evict_last" if L2_HINTS else ""
    l_o = gl.convert_layout(l_i, ROW_O)
    empty = l_o == 0.0
    if SCALED:
        o = acc * (o_scale / gl.where(empty, 1.0, l_o))[:, None]
    else:
        o = acc / gl.where(empty, 1.0, l_o)[:, None]
    o = gl.where(empty[:, None], 0.0, o)
    offs_mo = gl.arange(0, BLOCK_M, layout=ROW_O) + z
    t_o = offs_mo // HB
    head_o = hb * HB + offs_mo % HB
    ok_o = (t_o < Q) & (head_o < H)
    offs_c = col0 + gl.arange(0, LH, layout=gl.SliceLayout(0, O_L))
    o_mask = ok_o[:, None] & (offs_c[None, :] < L)
    if ploc < 0:
        orow = (qo_start + t_o).to(gl.int64) * H + head_o
        gl.store(out_ptr + orow[:, None] * L + offs_c[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=o_mask)
    else:
        orow = (ploc + t_o).to(gl.int64) * H + head_o
        gl.store(part_out_ptr + orow[:, None] * L + offs_c[None, :], o, mask=o_mask,
                 eviction_policy=part_policy)
    if ROLE == 0:
        empty_s = l_i == 0.0
        m_f = gl.where(m_i == float("-inf"), 0.0, m_i)
        lse = gl.where(empty_s, float("-inf"),
                       (m_f + gl.log2(gl.where(empty_s, 1.0, l_i))) * LN2)
        head_s = hb * HB + offs_m % HB
        ok_s = (t_s < Q) & (head_s < H)
        if ploc < 0:
            gl.store(lse_ptr + (qo_start + t_s).to(gl.int64) * H + head_s, lse, mask=ok_s)
        else:
            gl.store(part_lse_ptr + (ploc + t_s).to(gl.int64) * H + head_s, lse, mask=ok_s,
                     eviction_policy=part_policy)


@gluon.jit
def _exchange(ROLE: gl.constexpr, sM0, sS0, sM1, sS1):
    """The row max and row sum buffers this warpgroup publishes, then the partner's."""
    if ROLE == 0:
        return sM0, sS0, sM1, sS1
    else:
        return sM1, sS1, sM0, sS0


@gluon.jit
def _barrier_views(bars):
    """``full0, full1, qbar, p0bar, p1bar, qfree`` (see ``_FULL0`` .. ``_QFREE``)."""
    return (bars.index(_FULL0), bars.index(_FULL1), bars.index(_QBAR), bars.index(_P0),
            bars.index(_P1), bars.index(_QFREE))


@gluon.jit
def _init_barriers(bars):
    """The program's barriers (see ``_FULL0`` .. ``_QFREE``)."""
    mbarrier.init(bars.index(_FULL0), count=2 * NUM_THREADS_WG)
    mbarrier.init(bars.index(_FULL1), count=2 * NUM_THREADS_WG)
    mbarrier.init(bars.index(_QBAR), count=NUM_THREADS_WG)
    mbarrier.init(bars.index(_P0), count=1)
    mbarrier.init(bars.index(_P1), count=1)
    mbarrier.init(bars.index(_QFREE), count=1)


@gluon.jit
def _role(ROLE: gl.constexpr, hb, w0, w1, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr,
          qk_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
          sQn3, sQr3, sKn, sKr, sM0, sS0, sM1, sS1, bars,
          H: gl.constexpr, MAX_PAGES: gl.constexpr, Q: gl.constexpr, HB: gl.constexpr,
          L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, TILE_IN_PAGE: gl.constexpr,
          L2_HINTS: gl.constexpr, NUM_PAGES: gl.constexpr):
    """One warpgroup's part of every work of this program (``ROLE`` 0 or 1, see the module)."""
    D: gl.constexpr = L + R
    LH: gl.constexpr = L // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, LH, 16])
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                          warps_per_cta=[4, 1], order=[1, 0])
    dt: gl.constexpr = kv_ptr.dtype.element_ty
    sM_me, sS_me, sM_you, sS_you = _exchange(ROLE, sM0, sS0, sM1, sS1)
    full0, full1, qbar, p0bar, p1bar, qfree = _barrier_views(bars)

    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    offs_m = gl.arange(0, BLOCK_M, layout=ROW_S)
    t_s = offs_m // HB
    pc = 0  # pairs done (both roles count the same pairs): barrier phases
    for w in range(w0, w1):
        wi = w - w0
        ploc, qo_start, lo, hi, seq, bt_row, n_pairs = _work(work_ptr, kv_indptr_ptr, bt_ptr, w,
                                                             MAX_PAGES)
        sQn, sQr, sKn0, sKr0, sKn1, sKr1 = _views(sQn3, sQr3, sKn, sKr, wi)
        # Q (warpgroup 0), once warpgroup 1 is done with the last work's.
        if ROLE == 0:
            mbarrier.wait(qfree, (wi - 1) & 1, pred=wi > 0)
            _load_q(sQn, sQr, q_ptr, qo_start, hb, H, Q, HB, L, R, LOAD)
            async_copy.mbarrier_arrive(qbar, increment_count=False)
        # Pair 0 of this work: each role copies the regions it is the last reader of.
        if n_pairs > 0:
            rows_a = _tile_rows(bt_row, lo, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD, NUM_PAGES)
            rows_b = _tile_rows(bt_row, lo + BLOCK_N, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD, NUM_PAGES)
            if ROLE == 0:
                _load_part(sKn0.slice(0, LH, dim=1), kv_ptr, rows_a, lo, hi, 0, LH, D, LOAD)
                async_copy.mbarrier_arrive(full0, increment_count=False)
                _load_part(sKn1.slice(0, LH, dim=1), kv_ptr, rows_b, lo + BLOCK_N,
                           hi, 0, LH, D, LOAD)
                _load_part(sKr1, kv_ptr, rows_b, lo + BLOCK_N, hi, L, R, D, LOAD)
                async_copy.mbarrier_arrive(full1, increment_count=False)
            else:
                _load_part(sKn0.slice(LH, LH, dim=1), kv_ptr, rows_a, lo, hi, LH, LH, D, LOAD)
                _load_part(sKr0, kv_ptr, rows_a, lo, hi, L, R, D, LOAD)
                async_copy.mbarrier_arrive(full0, increment_count=False)
                _load_part(sKn1.slice(LH, LH, dim=1), kv_ptr, rows_b, lo + BLOCK_N,
                           hi, LH, LH, D, LOAD)
                async_copy.mbarrier_arrive(full1, increment_count=False)
        mbarrier.wait(qbar, wi & 1)

        bound = seq - Q + t_s + 1  # row t sees positions < seq - Q + t + 1
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([BLOCK_M], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, LH], gl.float32, O_L)
        for j in range(0, n_pairs):
            start = lo + (2 * j + ROLE) * BLOCK_N  # my tile
            nxt = lo + (2 * j + 2) * BLOCK_N  # the next pair's first tile
            ph = pc & 1
            # The next pair's cache rows, read now so that its copies need not wait for them.
            nrows_a = _tile_rows(bt_row, nxt, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD, NUM_PAGES)
            nrows_b = _tile_rows(bt_row, nxt + BLOCK_N, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD,
                                 NUM_PAGES)
            sQn, sQr, sKn0, sKr0, sKn1, sKr1 = _views(sQn3, sQr3, sKn, sKr, pc)
            if ROLE == 0:
                sKn_me = sKn0
                sKr_me = sKr0
                sKn_you = sKn1
                sKr_you = sKr1
            else:
                sKn_me = sKn1
                sKr_me = sKr1
                sKn_you = sKn0
                sKr_you = sKr0
            if ROLE == 0:
                mbarrier.wait(full0, ph)
            else:
                mbarrier.wait(full1, ph)
            fence_async_shared()
            s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)
            s = warpgroup_mma(sQn, sKn_me.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(sQr, sKr_me.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])
            pos = start + offs_n
            keep = (pos[None, :] < hi) & (pos[None, :] < bound[:, None])
            s = gl.where(keep, s * qk_scale, float("-inf"))
            if ROLE == 0:
                m0 = gl.maximum(m_i, gl.max(s, axis=1))
                m0s = gl.where(m0 == float("-inf"), 0.0, m0)
                p = gl.exp2(s - m0s[:, None])
                rs0 = gl.sum(p, axis=1)
                pb = p.to(dt)
                sKr_me.store(pb)  # P0 over the rope columns Q @ K^T is done with
                sM_me.store(m0)
                sS_me.store(rs0)
                fence_async_shared()
                _barrier()
                mbarrier.arrive(p0bar)
                a0 = gl.exp2(m_i - m0s)
                l_i = l_i * a0 + rs0
                acc = acc * gl.convert_layout(a0, ROW_O)[:, None]
                acc = warpgroup_mma(gl.convert_layout(pb, P_OP), sKn_me.slice(0, LH, dim=1), acc,
                                    is_async=True)
                mbarrier.wait(p1bar, ph)
                m1 = sM_you.load(ROW_S)
                rs1 = sS_you.load(ROW_S)
                acc = warpgroup_mma_wait(0, deps=[acc])
                # Buffer 0's left half is mine to refill (the next pair's first tile).
                if j + 1 < n_pairs:
                    _load_part(sKn0.slice(0, LH, dim=1), kv_ptr, nrows_a, nxt, hi, 0, LH, D, LOAD)
                    async_copy.mbarrier_arrive(full0, increment_count=False)
                m1s = gl.where(m1 == float("-inf"), 0.0, m1)
                a1 = gl.exp2(m0 - m1s)
                l_i = l_i * a1 + rs1
                m_i = m1
                acc = acc * gl.convert_layout(a1, ROW_O)[:, None]
                fence_async_shared()
                acc = warpgroup_mma(sKr_you, sKn_you.slice(0, LH, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                if j + 1 < n_pairs:
                    _load_part(sKn1.slice(0, LH, dim=1), kv_ptr, nrows_b, nxt + BLOCK_N,
                               hi, 0, LH, D, LOAD)
                    _load_part(sKr1, kv_ptr, nrows_b, nxt + BLOCK_N, hi, L, R, D, LOAD)
                    async_copy.mbarrier_arrive(full1, increment_count=False)
            else:
                mbarrier.wait(p0bar, ph)
                m0 = sM_you.load(ROW_S)
                rs0 = sS_you.load(ROW_S)
                m0s = gl.where(m0 == float("-inf"), 0.0, m0)
                a0 = gl.exp2(m_i - m0s)
                l_i = l_i * a0 + rs0
                acc = acc * gl.convert_layout(a0, ROW_O)[:, None]
                fence_async_shared()
                acc = warpgroup_mma(sKr_you, sKn_you.slice(LH, LH, dim=1), acc, is_async=True)
                # My softmax runs under P0 @ V0.
                m1 = gl.maximum(m0, gl.max(s, axis=1))
                m1s = gl.where(m1 == float("-inf"), 0.0, m1)
                p = gl.exp2(s - m1s[:, None])
                rs1 = gl.sum(p, axis=1)
                pb = p.to(dt)
                acc = warpgroup_mma_wait(0, deps=[acc])
                if j + 1 < n_pairs:
                    _load_part(sKn0.slice(LH, LH, dim=1), kv_ptr, nrows_a, nxt,
                               hi, LH, LH, D, LOAD)
                sKr_me.store(pb)  # P1 over my rope columns
                sM_me.store(m1)
                sS_me.store(rs1)
                fence_async_shared()
                _barrier()
                mbarrier.arrive(p1bar)
                if j + 1 < n_pairs:
                    # Buffer 0's rope columns held P0, which P0 @ V0 has read.
                    _load_part(sKr0, kv_ptr, nrows_a, nxt, hi, L, R, D, LOAD)
                    async_copy.mbarrier_arrive(full0, increment_count=False)
                a1 = gl.exp2(m0 - m1s)
                l_i = l_i * a1 + rs1
                m_i = m1
                acc = acc * gl.convert_layout(a1, ROW_O)[:, None]
                acc = warpgroup_mma(gl.convert_layout(pb, P_OP), sKn_me.slice(LH, LH, dim=1), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                if j + 1 < n_pairs:
                    _load_part(sKn1.slice(LH, LH, dim=1), kv_ptr, nrows_b, nxt + BLOCK_N,
                               hi, LH, LH, D, LOAD)
                    async_copy.mbarrier_arrive(full1, increment_count=False)
            pc += 1
        if ROLE == 1:
            mbarrier.arrive(qfree)

        _write_back(ROLE, acc, m_i, l_i, 1.0, offs_m, t_s, hb, ploc, qo_start, out_ptr, lse_ptr,
                    part_out_ptr, part_lse_ptr, H, Q, HB, L, O_L, L2_HINTS, False, 0)


@gluon.jit
def mla_decode_sm90_kernel(
    q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_indptr_ptr, work_ptr, kv_scale_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    QK_SCALE: gl.constexpr, H: gl.constexpr, MAX_PAGES: gl.constexpr, Q: gl.constexpr,
    HB: gl.constexpr, NUM_HB: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    PAGE_SIZE: gl.constexpr, TILE_IN_PAGE: gl.constexpr, L2_HINTS: gl.constexpr = False,
    NUM_PAGES: gl.constexpr = 2147483647,
):
    """Grid: persistent programs x head blocks, head block fastest (as the Triton kernel).
    Launched with 4 warps (warpgroup 0); warpgroup 1 is the worker partition."""
    pid = gl.program_id(0)
    p = pid // NUM_HB
    hb = pid % NUM_HB
    w0 = gl.load(work_indptr_ptr + p)
    w1 = gl.load(work_indptr_ptr + p + 1)
    dt: gl.constexpr = kv_ptr.dtype.element_ty
    NV: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    VEC: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    sQn = gl.allocate_shared_memory(dt, [1, BLOCK_M, L], NV)
    sQr = gl.allocate_shared_memory(dt, [1, BLOCK_M, R], NV)
    sKn = gl.allocate_shared_memory(dt, [2, BLOCK_N, L], NV)
    sKr = gl.allocate_shared_memory(dt, [2, BLOCK_N, R], NV)
    sM0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    sS0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    sM1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    sS1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    bars = gl.allocate_shared_memory(gl.int64, [_NUM_BARS, 1], mbarrier.MBarrierLayout())
    _init_barriers(bars)
    qk_scale = QK_SCALE
    gl.warp_specialize(
        [(_role, (gl.constexpr(0), hb, w0, w1, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr,
                  qk_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sQn, sQr, sKn, sKr,
                  sM0, sS0, sM1, sS1, bars, H, MAX_PAGES, Q, HB, L, R, PAGE_SIZE,
                  TILE_IN_PAGE, L2_HINTS, NUM_PAGES)),
         (_role, (gl.constexpr(1), hb, w0, w1, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr,
                  qk_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sQn, sQr, sKn, sKr,
                  sM0, sS0, sM1, sS1, bars, H, MAX_PAGES, Q, HB, L, R, PAGE_SIZE,
                  TILE_IN_PAGE, L2_HINTS, NUM_PAGES))],
        [4], [WORKER_REGS])
