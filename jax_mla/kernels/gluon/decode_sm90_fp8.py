"""MLA decode/verify for Hopper (sm_90) in Gluon, an fp8 query against an fp8 cache.

The schedule is :mod:`decode_sm90`'s seesaw (two warpgroups, one KV tile each, warpgroup 0's
softmax published first; read that module's doc first). What differs is where the bytes live:

- ``Q`` and both KV tiles stay fp8 in shared memory (36 + 2 x 36 KiB), and the scores are fp8
  wgmma products of the stored values (``Q @ K^T`` is K-major on both sides, which is what
  8-bit wgmma takes), summed in float32: nothing is converted for them.
- ``P @ V`` reduces over tokens, which 8-bit wgmma cannot take from ``V``'s layout
  (``[tokens, L]``, N-major). Each warpgroup converts its half of ``V``'s columns to float16
  (exact for e4m3 and e5m2) into its own ``[64, L/2]`` buffer (2 x 32 KiB), once per tile:
  its own tile's half under its score MMAs, the partner's half when the partner's scores are
  done. The probabilities go out in float16 too (``P0``/``P1`` in their own 8 KiB buffers:
  an fp8 tile's rope columns are too narrow to hold them). About 188 KiB a program.
- Refills follow the last reader of each region: warpgroup 0 refills buffer 0's left half
  and rope columns and buffer 1's left half; warpgroup 1 the rest.
- The scale of the scores is ``softmax scale x kv_scale x q_scale`` (the stored values'
  products), the output's ``kv_scale`` (``V`` as stored).
- ``SPLIT_Q``: a 16-bit query, split beforehand by XLA into two e4m3 parts and a power-of-two
  scale a row (``backends.triton.decode.split_query_e4m3``). Both parts are copied in (2 x 36
  KiB), each is multiplied against the tile (four score MMAs, one accumulator), and each row's
  scores take their row's scale. (A first version split the query in the kernel; its products
  went wrong whenever the low part held values that varied, on an H100 with triton 3.6, with
  the same products right over constants or over a copy of the high part.)

Works, rows (``m = t * HB + h``), causal bounds, empty rows (out 0, LSE -inf) and the split
partials are the bf16 kernel's, so the same reduce merges them.
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

from jax_mla.kernels.gluon.decode_sm90 import (
    _NUM_BARS,
    BLOCK_M,
    BLOCK_N,
    CHUNK,
    WORKER_REGS,
    _barrier,
    _barrier_views,
    _chunk_rows,
    _cp_async,
    _exchange,
    _init_barriers,
    _opaque,
    _query_rows,
    _work,
    _write_back,
)


@gluon.jit
def _views(sQn3, sQr3, sKn, sKr, sV, sP, counter, SPLIT_Q: gl.constexpr):
    """``Q`` (and with ``SPLIT_Q`` its low part; else ``Q`` again), both KV buffers, both ``V``
    halves and both ``P`` buffers as views indexed by an opaque 0 formed here (see
    ``decode_sm90._opaque``); ``counter``: any loop-variant integer."""
    z = _opaque(counter * 0)
    if SPLIT_Q:
        zq = z + 1
    else:
        zq = z
    return (sQn3.index(z), sQr3.index(z), sQn3.index(zq), sQr3.index(zq), sKn.index(z),
            sKr.index(z), sKn.index(z + 1), sKr.index(z + 1), sV.index(z), sV.index(z + 1),
            sP.index(z), sP.index(z + 1))


@gluon.jit
def _chunk_start(start, hi, r0: gl.constexpr):
    """The first position of the 16-row chunk at ``start + r0``, clamped into the request (a
    chunk past ``hi``, whose copies zero-fill, reads the last position's page)."""
    p0 = gl.minimum(start + r0, gl.maximum(hi - 1, 0))
    return p0 - p0 % CHUNK


@gluon.jit
def _chunk_page(bt_row, start, hi, r0: gl.constexpr, PAGE_SIZE: gl.constexpr,
                NUM_PAGES: gl.constexpr):
    """The page (clamped into the cache) that holds the chunk at ``start + r0``, where a chunk
    lies in one page (the page size a multiple of 16, tiles starting at multiples of 64)."""
    phys = gl.load(bt_row + _chunk_start(start, hi, r0) // PAGE_SIZE)
    return gl.minimum(gl.maximum(phys, 0), NUM_PAGES - 1)


@gluon.jit
def _tile_rows(bt_row, start, hi, PAGE_SIZE: gl.constexpr, TILE_IN_PAGE: gl.constexpr,
               LOAD: gl.constexpr, NUM_PAGES: gl.constexpr):
    """What the tile at ``start`` reads from the block table, a pair ahead of its copies (see
    ``decode_sm90._tile_rows``), as four 16-row chunks: where a chunk lies in one page, the
    page alone (a scalar; ``_load_part`` makes the chunk's consecutive rows from it just before
    its copies, so that the rows' registers are not held through the MMAs: held, they pushed
    triton 3.9's ptxas into spilling at 32+ rows); else the chunk's rows
    (``decode_sm90._chunk_rows``)."""
    layout: gl.constexpr = gl.SliceLayout(1, LOAD)
    if TILE_IN_PAGE:
        page = _chunk_page(bt_row, start, hi, 0, PAGE_SIZE, NUM_PAGES)
        return page, page, page, page
    elif PAGE_SIZE % CHUNK == 0:
        return (_chunk_page(bt_row, start, hi, 0, PAGE_SIZE, NUM_PAGES),
                _chunk_page(bt_row, start, hi, CHUNK, PAGE_SIZE, NUM_PAGES),
                _chunk_page(bt_row, start, hi, 2 * CHUNK, PAGE_SIZE, NUM_PAGES),
                _chunk_page(bt_row, start, hi, 3 * CHUNK, PAGE_SIZE, NUM_PAGES))
    else:
        return (_chunk_rows(bt_row, start, hi, 0, PAGE_SIZE, TILE_IN_PAGE, layout, NUM_PAGES),
                _chunk_rows(bt_row, start, hi, CHUNK, PAGE_SIZE, TILE_IN_PAGE, layout, NUM_PAGES),
                _chunk_rows(bt_row, start, hi, 2 * CHUNK, PAGE_SIZE, TILE_IN_PAGE, layout,
                            NUM_PAGES),
                _chunk_rows(bt_row, start, hi, 3 * CHUNK, PAGE_SIZE, TILE_IN_PAGE, layout,
                            NUM_PAGES))


@gluon.jit
def _load_part(dst, kv_ptr, rows, start, hi, col0: gl.constexpr, NCOLS: gl.constexpr,
               D: gl.constexpr, LOAD: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """cp.async columns ``col0 .. col0 + NCOLS`` of the KV tile at ``start`` into ``dst``
    ``[BLOCK_N, NCOLS]``, 16 rows at a time, in the copy layout ``LOAD`` (``rows``: the tile's
    chunks from ``_tile_rows``: pages, or rows in any layout of the same rows); positions past
    ``hi`` read as 0."""
    row_l: gl.constexpr = gl.SliceLayout(1, LOAD)
    offs_c = col0 + gl.arange(0, NCOLS, layout=gl.SliceLayout(0, LOAD))
    for i in gl.static_range(BLOCK_N // CHUNK):
        valid = start + i * CHUNK + gl.arange(0, CHUNK, layout=row_l) < hi
        if PAGE_SIZE % CHUNK == 0:
            r = (rows[i] * PAGE_SIZE + _chunk_start(start, hi, i * CHUNK) % PAGE_SIZE
                 + gl.arange(0, CHUNK, layout=row_l))
        else:
            r = gl.convert_layout(rows[i], row_l)
        ptrs = kv_ptr + r.to(gl.int64)[:, None] * D + offs_c[None, :]
        _cp_async(dst.slice(i * CHUNK, CHUNK, dim=0), ptrs,
                  mask=valid[:, None] & (offs_c[None, :] >= 0))


@gluon.jit
def _load_q(sQn, sQr, q_ptr, qo_start, hb, H: gl.constexpr, Q: gl.constexpr, HB: gl.constexpr,
            L: gl.constexpr, R: gl.constexpr, LOAD: gl.constexpr, LOADR: gl.constexpr,
            STRIDE: gl.constexpr, z):
    """cp.async the work's query rows ``m = t * HB + h`` (latent columns in ``LOAD``, rope
    columns in ``LOADR``; ``STRIDE`` elements a query row); rows past the verify block or the
    heads read as 0. ``z``: an opaque 0 (``decode_sm90._opaque``), so that the rows' heads are
    made here, not hoisted out of the work loop and held through it."""
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, LOAD))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LOADR))
    for r0 in gl.static_range(0, BLOCK_M, CHUNK):
        m = r0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LOAD)) + z
        ok, qrow = _query_rows(m, qo_start, hb, H, Q, HB)
        base = q_ptr + qrow * STRIDE
        _cp_async(sQn.slice(r0, CHUNK, dim=0), base[:, None] + offs_l[None, :],
                  mask=ok[:, None] & (offs_l[None, :] >= 0))
        base_r = gl.convert_layout(base, gl.SliceLayout(1, LOADR))
        ok_r = gl.convert_layout(ok, gl.SliceLayout(1, LOADR))
        _cp_async(sQr.slice(r0, CHUNK, dim=0), base_r[:, None] + L + offs_r[None, :],
                  mask=ok_r[:, None] & (offs_r[None, :] >= 0))


@gluon.jit
def _row_scales(ptr, qo_start, hb, H: gl.constexpr, Q: gl.constexpr, HB: gl.constexpr,
                layout: gl.constexpr):
    """The scales of the work's query rows ``m = t * HB + h`` (``ptr``: one float a query row,
    ``[T * H]``), in ``layout`` ``[BLOCK_M]``; rows past the verify block or the heads read 1."""
    ok, qrow = _query_rows(gl.arange(0, BLOCK_M, layout=layout), qo_start, hb, H, Q, HB)
    return gl.load(ptr + qrow, mask=ok, other=1.0)


@gluon.jit
def _convert_v(dst, src, CVT: gl.constexpr):
    """``dst`` (float16 ``[BLOCK_N, L/2]``) = ``src`` (the fp8 tile's half of ``V``), 16 rows
    at a time through registers (exact). The caller fences and syncs before an MMA reads it."""
    for i in gl.static_range(BLOCK_N // CHUNK):
        x = src.slice(i * CHUNK, CHUNK, dim=0).load(CVT)
        dst.slice(i * CHUNK, CHUNK, dim=0).store(x.to(gl.float16))


@gluon.jit
def _scores_and_v(sQn, sQr, sQnl, sQrl, sKn, sKr, v_dst, v_src, LOAD: gl.constexpr,
                  SPLIT_Q: gl.constexpr, SPLIT_ACC: gl.constexpr):
    """A tile's scores ``Q @ K^T`` (latent and rope columns), waited for, with ``v_dst = v_src``
    converted under the MMAs (``_convert_v``). With ``SPLIT_Q`` the low part's products too,
    into the same sum, or with ``SPLIT_ACC`` into their own, added after the wait. (The MMAs'
    accumulator cannot be passed into a function under triton 3.9: it is made here.)"""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64, 32])
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)
    s = warpgroup_mma(sQn, sKn.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(sQr, sKr.permute((1, 0)), s, is_async=True)
    if SPLIT_Q and SPLIT_ACC:
        t = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)
        t = warpgroup_mma(sQnl, sKn.permute((1, 0)), t, is_async=True)
        t = warpgroup_mma(sQrl, sKr.permute((1, 0)), t, is_async=True)
        _convert_v(v_dst, v_src, LOAD)
        s, t = warpgroup_mma_wait(0, deps=[s, t])
        s = s + t
    else:
        if SPLIT_Q:
            s = warpgroup_mma(sQnl, sKn.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(sQrl, sKr.permute((1, 0)), s, is_async=True)
        _convert_v(v_dst, v_src, LOAD)
        s = warpgroup_mma_wait(0, deps=[s])
    return s


@gluon.jit
def _scaled(s, qk_scale, sRS, i, ROW_S: gl.constexpr, SPLIT_Q: gl.constexpr):
    """The scores times their scale: ``qk_scale`` for the tile, or with ``SPLIT_Q`` one a row,
    read from ``sRS.index(i)`` a tile at a time (``i`` opaque, so that the read stays in the
    loop: held in registers through it, the scales pushed triton 3.9's ptxas into spilling).
    A row's scale is read by the threads that stored it (its replicas in one quad store the same
    value), so the store needs no barrier; the warpgroup barrier of every tile orders a work's
    last read before the next work's store."""
    if SPLIT_Q:
        return s * sRS.index(i).load(ROW_S)[:, None]
    else:
        return s * qk_scale


@gluon.jit
def _role(ROLE: gl.constexpr, hb, w0, w1, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr,
          qk_scale, o_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
          sQn3, sQr3, kv_scale_ptr, sRS, sKn, sKr, sV, sP, sM0, sS0, sM1, sS1, bars,
          H: gl.constexpr, MAX_PAGES: gl.constexpr, Q: gl.constexpr, HB: gl.constexpr,
          L: gl.constexpr, R: gl.constexpr, PAGE_SIZE: gl.constexpr, TILE_IN_PAGE: gl.constexpr,
          L2_HINTS: gl.constexpr, NUM_PAGES: gl.constexpr, SPLIT_Q: gl.constexpr,
          SPLIT_ACC: gl.constexpr):
    """One warpgroup's part of every work of this program (``ROLE`` 0 or 1, see the module)."""
    D: gl.constexpr = L + R
    LH: gl.constexpr = L // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64, 32])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, LH, 16])
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    # 16-byte copies of 16 rows x 128 fp8 columns (the latent halves), 8-byte ones of the
    # 64 rope columns; the same layout converts V.
    LOAD: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                          warps_per_cta=[4, 1], order=[1, 0])
    LOADR: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                           warps_per_cta=[4, 1], order=[1, 0])
    sM_me, sS_me, sM_you, sS_you = _exchange(ROLE, sM0, sS0, sM1, sS1)
    full0, full1, qbar, p0bar, p1bar, qfree = _barrier_views(bars)

    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    offs_m = gl.arange(0, BLOCK_M, layout=ROW_S)
    pc = 0  # pairs done (both roles count the same pairs): barrier phases
    for w in range(w0, w1):
        wi = w - w0
        ploc, qo_start, lo, hi, seq, bt_row, n_pairs = _work(work_ptr, kv_indptr_ptr, bt_ptr, w,
                                                             MAX_PAGES)
        sQn, sQr, sQnl, sQrl, sKn0, sKr0, sKn1, sKr1, sV0, sV1, sP0, sP1 = _views(
            sQn3, sQr3, sKn, sKr, sV, sP, wi, SPLIT_Q)
        if ROLE == 0:
            mbarrier.wait(qfree, (wi - 1) & 1, pred=wi > 0)
            zq = _opaque(wi * 0)
            if SPLIT_Q:  # the parts side by side in a row: hi, then lo
                _load_q(sQn, sQr, q_ptr, qo_start, hb, H, Q, HB, L, R, LOAD, LOADR, 2 * D, zq)
                _load_q(sQnl, sQrl, q_ptr + D, qo_start, hb, H, Q, HB, L, R, LOAD, LOADR, 2 * D,
                        zq)
            else:
                _load_q(sQn, sQr, q_ptr, qo_start, hb, H, Q, HB, L, R, LOAD, LOADR, D, zq)
            async_copy.mbarrier_arrive(qbar, increment_count=False)
        # Pair 0 of this work: each role copies the regions it is the last reader of.
        if n_pairs > 0:
            rows_a = _tile_rows(bt_row, lo, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD, NUM_PAGES)
            rows_b = _tile_rows(bt_row, lo + BLOCK_N, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD, NUM_PAGES)
            if ROLE == 0:
                _load_part(sKn0.slice(0, LH, dim=1), kv_ptr, rows_a, lo, hi, 0, LH, D, LOAD,
                           PAGE_SIZE)
                _load_part(sKr0, kv_ptr, rows_a, lo, hi, L, R, D, LOADR, PAGE_SIZE)
                async_copy.mbarrier_arrive(full0, increment_count=False)
                _load_part(sKn1.slice(0, LH, dim=1), kv_ptr, rows_b, lo + BLOCK_N, hi, 0, LH, D,
                           LOAD, PAGE_SIZE)
                async_copy.mbarrier_arrive(full1, increment_count=False)
            else:
                _load_part(sKn0.slice(LH, LH, dim=1), kv_ptr, rows_a, lo, hi, LH, LH, D, LOAD,
                           PAGE_SIZE)
                async_copy.mbarrier_arrive(full0, increment_count=False)
                _load_part(sKn1.slice(LH, LH, dim=1), kv_ptr, rows_b, lo + BLOCK_N, hi, LH, LH,
                           D, LOAD, PAGE_SIZE)
                _load_part(sKr1, kv_ptr, rows_b, lo + BLOCK_N, hi, L, R, D, LOADR, PAGE_SIZE)
                async_copy.mbarrier_arrive(full1, increment_count=False)
        mbarrier.wait(qbar, wi & 1)
        if SPLIT_Q:  # each row's scale, kept in shared memory (see _scaled)
            sRS.index(ROLE).store(qk_scale * _row_scales(kv_scale_ptr + 1, qo_start, hb, H, Q,
                                                         HB, ROW_S))

        # Row t sees positions < seq - Q + t + 1 (t made here, not held through the work loop).
        bound = seq - Q + (offs_m + _opaque(wi * 0)) // HB + 1
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
        l_i = gl.zeros([BLOCK_M], gl.float32, ROW_S)
        acc = gl.zeros([BLOCK_M, LH], gl.float32, O_L)
        for j in range(0, n_pairs):
            start = lo + (2 * j + ROLE) * BLOCK_N  # my tile
            nxt = lo + (2 * j + 2) * BLOCK_N  # the next pair's first tile
            ph = pc & 1
            nrows_a = _tile_rows(bt_row, nxt, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD, NUM_PAGES)
            nrows_b = _tile_rows(bt_row, nxt + BLOCK_N, hi, PAGE_SIZE, TILE_IN_PAGE, LOAD,
                                 NUM_PAGES)
            sQn, sQr, sQnl, sQrl, sKn0, sKr0, sKn1, sKr1, sV0, sV1, sP0, sP1 = _views(
                sQn3, sQr3, sKn, sKr, sV, sP, pc, SPLIT_Q)
            if ROLE == 0:
                mbarrier.wait(full0, ph)
                fence_async_shared()
                # My scores, and V0's left half converted under their MMAs.
                s = _scores_and_v(sQn, sQr, sQnl, sQrl, sKn0, sKr0, sV0,
                                  sKn0.slice(0, LH, dim=1), LOAD, SPLIT_Q, SPLIT_ACC)
                pos = start + offs_n
                keep = (pos[None, :] < hi) & (pos[None, :] < bound[:, None])
                s = gl.where(keep, _scaled(s, qk_scale, sRS, ROLE + _opaque(pc * 0), ROW_S,
                                           SPLIT_Q), float("-inf"))
                m0 = gl.maximum(m_i, gl.max(s, axis=1))
                m0s = gl.where(m0 == float("-inf"), 0.0, m0)
                p = gl.exp2(s - m0s[:, None])
                rs0 = gl.sum(p, axis=1)
                pb = p.to(gl.float16)
                sP0.store(pb)
                sM_me.store(m0)
                sS_me.store(rs0)
                fence_async_shared()  # P0 and V0's left half, for the MMAs
                _barrier()
                mbarrier.arrive(p0bar)
                a0 = gl.exp2(m_i - m0s)
                l_i = l_i * a0 + rs0
                acc = acc * gl.convert_layout(a0, ROW_O)[:, None]
                acc = warpgroup_mma(gl.convert_layout(pb, P_OP), sV0, acc, is_async=True)
                mbarrier.wait(p1bar, ph)
                m1 = sM_you.load(ROW_S)
                rs1 = sS_you.load(ROW_S)
                acc = warpgroup_mma_wait(0, deps=[acc])
                # Buffer 0's left half and rope columns are mine to refill.
                if j + 1 < n_pairs:
                    _load_part(sKn0.slice(0, LH, dim=1), kv_ptr, nrows_a, nxt, hi, 0, LH, D, LOAD,
                               PAGE_SIZE)
                    _load_part(sKr0, kv_ptr, nrows_a, nxt, hi, L, R, D, LOADR, PAGE_SIZE)
                    async_copy.mbarrier_arrive(full0, increment_count=False)
                # V1's left half: warpgroup 1's scores on buffer 1 are done (it published P1).
                _convert_v(sV0, sKn1.slice(0, LH, dim=1), LOAD)
                m1s = gl.where(m1 == float("-inf"), 0.0, m1)
                a1 = gl.exp2(m0 - m1s)
                l_i = l_i * a1 + rs1
                m_i = m1
                acc = acc * gl.convert_layout(a1, ROW_O)[:, None]
                fence_async_shared()
                _barrier()
                acc = warpgroup_mma(sP1, sV0, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                if j + 1 < n_pairs:
                    _load_part(sKn1.slice(0, LH, dim=1), kv_ptr, nrows_b, nxt + BLOCK_N, hi, 0,
                               LH, D, LOAD, PAGE_SIZE)
                    async_copy.mbarrier_arrive(full1, increment_count=False)
            else:
                mbarrier.wait(full1, ph)
                mbarrier.wait(full0, ph)  # V0's right half, converted under my scores
                fence_async_shared()
                # My scores, and V0's right half converted under their MMAs.
                s = _scores_and_v(sQn, sQr, sQnl, sQrl, sKn1, sKr1, sV1,
                                  sKn0.slice(LH, LH, dim=1), LOAD, SPLIT_Q, SPLIT_ACC)
                pos = start + offs_n
                keep = (pos[None, :] < hi) & (pos[None, :] < bound[:, None])
                s = gl.where(keep, _scaled(s, qk_scale, sRS, ROLE + _opaque(pc * 0), ROW_S,
                                           SPLIT_Q), float("-inf"))
                mbarrier.wait(p0bar, ph)
                m0 = sM_you.load(ROW_S)
                rs0 = sS_you.load(ROW_S)
                m0s = gl.where(m0 == float("-inf"), 0.0, m0)
                a0 = gl.exp2(m_i - m0s)
                l_i = l_i * a0 + rs0
                acc = acc * gl.convert_layout(a0, ROW_O)[:, None]
                fence_async_shared()  # V0's right half, for the MMA
                _barrier()
                acc = warpgroup_mma(sP0, sV1, acc, is_async=True)
                # My softmax runs under P0 @ V0.
                m1 = gl.maximum(m0, gl.max(s, axis=1))
                m1s = gl.where(m1 == float("-inf"), 0.0, m1)
                p = gl.exp2(s - m1s[:, None])
                rs1 = gl.sum(p, axis=1)
                pb = p.to(gl.float16)
                acc = warpgroup_mma_wait(0, deps=[acc])
                # Buffer 0's right half: converted, and warpgroup 0's scores were done (P0).
                if j + 1 < n_pairs:
                    _load_part(sKn0.slice(LH, LH, dim=1), kv_ptr, nrows_a, nxt, hi, LH, LH, D,
                               LOAD, PAGE_SIZE)
                    async_copy.mbarrier_arrive(full0, increment_count=False)
                sP1.store(pb)
                sM_me.store(m1)
                sS_me.store(rs1)
                fence_async_shared()
                _barrier()
                mbarrier.arrive(p1bar)
                _convert_v(sV1, sKn1.slice(LH, LH, dim=1), LOAD)  # my own tile's right half
                a1 = gl.exp2(m0 - m1s)
                l_i = l_i * a1 + rs1
                m_i = m1
                acc = acc * gl.convert_layout(a1, ROW_O)[:, None]
                fence_async_shared()
                _barrier()
                acc = warpgroup_mma(gl.convert_layout(pb, P_OP), sV1, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                if j + 1 < n_pairs:
                    _load_part(sKn1.slice(LH, LH, dim=1), kv_ptr, nrows_b, nxt + BLOCK_N, hi, LH,
                               LH, D, LOAD, PAGE_SIZE)
                    _load_part(sKr1, kv_ptr, nrows_b, nxt + BLOCK_N, hi, L, R, D, LOADR, PAGE_SIZE)
                    async_copy.mbarrier_arrive(full1, increment_count=False)
            pc += 1
        if ROLE == 1:
            mbarrier.arrive(qfree)

        z = _opaque(w * 0)  # the write-back's rows made here, not held through the loops
        _write_back(ROLE, acc, m_i, l_i, o_scale, offs_m + z, (offs_m + z) // HB, hb, ploc,
                    qo_start, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, H, Q, HB, L, O_L,
                    L2_HINTS, True, z)


@gluon.jit
def mla_decode_sm90_fp8_kernel(
    q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_indptr_ptr, work_ptr, kv_scale_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    QK_SCALE: gl.constexpr, H: gl.constexpr, MAX_PAGES: gl.constexpr, Q: gl.constexpr,
    HB: gl.constexpr, NUM_HB: gl.constexpr, L: gl.constexpr, R: gl.constexpr,
    PAGE_SIZE: gl.constexpr, TILE_IN_PAGE: gl.constexpr, L2_HINTS: gl.constexpr = False,
    NUM_PAGES: gl.constexpr = 2147483647, HAS_KV_SCALE: gl.constexpr = False,
    HAS_Q_SCALE: gl.constexpr = False, SPLIT_Q: gl.constexpr = False,
    SPLIT_ACC: gl.constexpr = False,
):
    """Grid: persistent programs x head blocks, head block fastest (as the bf16 kernel).
    ``kv_scale_ptr``: ``[kv_scale]``, or ``[kv_scale, q_scale]`` with ``HAS_Q_SCALE``, or with
    ``SPLIT_Q`` ``[kv_scale, row scales [T * H]...]`` and ``q_ptr`` the query's two e4m3 parts
    ``[T, H, 2 (L + R)]`` (``backends.triton.decode.split_query_e4m3``); ``SPLIT_ACC``
    (``TritonTuning.split_acc``): the low part's products summed apart, then added.
    Launched with 4 warps (warpgroup 0); warpgroup 1 is the worker partition."""
    pid = gl.program_id(0)
    p = pid // NUM_HB
    hb = pid % NUM_HB
    w0 = gl.load(work_indptr_ptr + p)
    w1 = gl.load(work_indptr_ptr + p + 1)
    LH: gl.constexpr = L // 2
    if HAS_KV_SCALE:
        o_scale = gl.load(kv_scale_ptr)
    else:
        o_scale = 1.0
    qk_scale = QK_SCALE * o_scale
    if HAS_Q_SCALE:
        qk_scale = qk_scale * gl.load(kv_scale_ptr + 1)
    NV8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    NV8R: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    NV16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2)
    VEC: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    if SPLIT_Q:  # a 16-bit query held as two e4m3 parts
        sQn = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, L], NV8)
        sQr = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, R], NV8R)
    else:
        sQn = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [1, BLOCK_M, L], NV8)
        sQr = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [1, BLOCK_M, R], NV8R)
    sKn = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [2, BLOCK_N, L], NV8)
    sKr = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [2, BLOCK_N, R], NV8R)
    sV = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, LH], NV16)
    sP = gl.allocate_shared_memory(gl.float16, [2, BLOCK_M, BLOCK_N], NV16)
    sRS = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], VEC)  # row scales, a role each
    sM0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    sS0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    sM1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    sS1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], VEC)
    bars = gl.allocate_shared_memory(gl.int64, [_NUM_BARS, 1], mbarrier.MBarrierLayout())
    _init_barriers(bars)
    gl.warp_specialize(
        [(_role, (gl.constexpr(0), hb, w0, w1, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr,
                  qk_scale, o_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sQn, sQr,
                  kv_scale_ptr, sRS, sKn, sKr, sV, sP, sM0, sS0, sM1, sS1, bars, H, MAX_PAGES,
                  Q, HB, L, R, PAGE_SIZE, TILE_IN_PAGE, L2_HINTS, NUM_PAGES, SPLIT_Q,
                  SPLIT_ACC)),
         (_role, (gl.constexpr(1), hb, w0, w1, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr,
                  qk_scale, o_scale, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, sQn, sQr,
                  kv_scale_ptr, sRS, sKn, sKr, sV, sP, sM0, sS0, sM1, sS1, bars, H, MAX_PAGES,
                  Q, HB, L, R, PAGE_SIZE, TILE_IN_PAGE, L2_HINTS, NUM_PAGES, SPLIT_Q,
                  SPLIT_ACC))],
        [4], [WORKER_REGS])
