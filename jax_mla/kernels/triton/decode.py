"""Split-KV paged MLA decode/verify and its exact LSE reduce, in Triton (NVIDIA and AMD).

The kernel is persistent: program ``p`` of head block ``hb`` runs the works ``work_indptr[p] ..
work_indptr[p + 1]`` of the split schedule (``backends/triton/schedule.py``) one after another, so
every program does the same amount of KV reading whatever the mix of lengths. A *work* is a KV range
of one request, handled for one block of query heads and all ``Q`` query tokens of that request:
rows ``m = t * HB + h`` pack the verify tokens and heads into one MMA tile, so each latent KV row is
read once per request and head block, not once per query token. The latent row ``[kv_c | k_pe]`` is
both key (all ``L + R`` columns) and value (the first ``L``): one load serves both products.

The grid is one axis, head block fastest: the programs that read the same KV range for different
head blocks run side by side, so the second read of a tile comes from L2, not HBM (128 heads).

Each work's KV range is walked in two loops: tiles every query row sees whole (no masks at all,
the hot loop), then the tail (the ragged end of the range and the causal diagonal of a verify
block) with masks. The block-table entries of a tile are read one iteration ahead of its KV rows
(a loop-carried value): with the table read in the same iteration, Triton's software pipeliner
gives the KV tile a single buffer and the next tile's load waits for this tile's math. Scores
are kept in the base-2 domain (``scale * log2(e)`` folded in), accumulation is float32, and a row
that sees no key keeps ``l = 0``: its output is 0 and its LSE ``-inf``.

Split partials are stored ``evict_last`` and read by the reduce ``evict_first`` (``L2_HINTS``),
so that the KV stream that follows a partial's write (hundreds of MB against a 50 MB L2) does not
push it out to HBM, and their write-backs do not compete with the KV reads. The hints change no
result (``TritonTuning.l2_hints`` turns them off).
"""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    # float32 operands ask for true fp32 products (the exact path); 16-bit ones take the default.
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _dot0(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _converted_here(x):
    """``x`` (a 16-bit tile just converted from fp8), unchanged, behind an inline ``mov`` that
    Triton's layout passes cannot look through (``CVT_ONCE``, CUDA only).

    Without it Triton moves the conversion past the shared-memory read of each dot operand: the
    fp8 tile is converted twice (for ``K^T`` and for ``V``), and the ``V`` operand, which wants
    pairs of rows, is read from shared memory one byte at a time. Held here, the tile is
    converted once in the layout it was loaded in (four fp8 values a register) and reaches both
    products through shared memory as a 16-bit tile (``ldmatrix``), as a bf16 cache does.
    """
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype,
                                     is_pure=False, pack=2)


@triton.jit
def _kv_rows(bt_row_ptr, start, pos, PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
             NUM_PAGES: tl.constexpr):
    """Flat cache row (int64) of each logical position through the block table.

    Callers clamp ``start`` and ``pos`` into the request, so every table read is in bounds; a
    page index outside ``[0, NUM_PAGES)`` is clamped into it (the unchecked semantics of
    ``docs/design.md``, as XLA's gather), so no cache read is out of bounds either.
    """
    if TILE_IN_PAGE:
        # Tiles start on a multiple of BLOCK_N, which divides the page: one table load.
        phys = tl.load(bt_row_ptr + start // PAGE_SIZE).to(tl.int64)
        phys = tl.minimum(tl.maximum(phys, 0), NUM_PAGES - 1)
        return phys * PAGE_SIZE + (pos % PAGE_SIZE)
    phys = tl.load(bt_row_ptr + pos // PAGE_SIZE).to(tl.int64)
    phys = tl.minimum(tl.maximum(phys, 0), NUM_PAGES - 1)
    if PAGE_SIZE == 1:
        return phys
    return phys * PAGE_SIZE + (pos % PAGE_SIZE)


@triton.jit
def _load_kv(kv_ptr, rows, offs_l, offs_r, valid, L: tl.constexpr, R: tl.constexpr,
             EVEN_L: tl.constexpr, EVEN_R: tl.constexpr, MASKED: tl.constexpr):
    """``k_nope [BLOCK_N, BLOCK_L]`` and ``k_pe [BLOCK_N, BLOCK_R]`` of the given cache rows."""
    D: tl.constexpr = L + R
    base = kv_ptr + rows[:, None] * D
    if MASKED:
        k_nope = tl.load(base + offs_l[None, :], mask=valid[:, None] & (offs_l[None, :] < L),
                         other=0.0)
        k_pe = tl.load(base + L + offs_r[None, :], mask=valid[:, None] & (offs_r[None, :] < R),
                       other=0.0)
    else:
        if EVEN_L:
            k_nope = tl.load(base + offs_l[None, :])
        else:
            k_nope = tl.load(base + offs_l[None, :], mask=offs_l[None, :] < L, other=0.0)
        if EVEN_R:
            k_pe = tl.load(base + L + offs_r[None, :])
        else:
            k_pe = tl.load(base + L + offs_r[None, :], mask=offs_r[None, :] < R, other=0.0)
    return k_nope, k_pe


@triton.jit
def _attend(acc, m_i, l_i, q_nope, q_pe, kv_ptr, bt_row, lo, hi, bound, qk_scale,
            L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
            EVEN_L: tl.constexpr, EVEN_R: tl.constexpr, MASKED: tl.constexpr,
            UPCAST: tl.constexpr, IEEE: tl.constexpr, NUM_PAGES: tl.constexpr,
            ROW_SCALE: tl.constexpr, FP8_QK: tl.constexpr, CVT_ONCE: tl.constexpr):
    """Online softmax of the query rows over KV positions ``lo .. hi`` (tiles of BLOCK_N).

    Unmasked (``MASKED`` false): every position of every tile is below ``hi`` and below every
    row's causal bound, so there is no mask and the running max is finite after one tile.
    ``ROW_SCALE``: ``qk_scale`` is one factor a row (``[BLOCK_M]``, see ``F16_MMA``).
    ``FP8_QK``: an fp8 query against an fp8 cache: the scores are fp8 products of the stored
    values (exact, float32 sums; no conversion), and only the values (the first ``L`` columns)
    are converted, to float16 (exact), for ``P @ V``. ``CVT_ONCE``: an fp8 tile is converted
    once, where it was loaded, for both products (``_converted_here``; CUDA).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    last = tl.maximum(hi - 1, 0)
    # Rows of the first tile; each iteration then reads the table for the next one.
    rows = _kv_rows(bt_row, tl.minimum(lo, last), tl.minimum(lo + offs_n, last), PAGE_SIZE,
                    TILE_IN_PAGE, NUM_PAGES)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k_nope, k_pe = _load_kv(kv_ptr, rows, offs_l, offs_r, valid, L, R, EVEN_L, EVEN_R,
                                MASKED)
        rows = _kv_rows(bt_row, tl.minimum(start + BLOCK_N, last),
                        tl.minimum(pos + BLOCK_N, last), PAGE_SIZE, TILE_IN_PAGE, NUM_PAGES)
        if FP8_QK:
            s = _dot(q_nope, tl.trans(k_nope), _dot0(q_pe, tl.trans(k_pe), IEEE), IEEE)
            k_nope = k_nope.to(tl.float16)
            if CVT_ONCE:
                k_nope = _converted_here(k_nope)
        else:
            if UPCAST:
                k_nope = k_nope.to(tl.float32)
                k_pe = k_pe.to(tl.float32)
            else:
                k_nope = k_nope.to(q_nope.dtype)
                k_pe = k_pe.to(q_pe.dtype)
                if CVT_ONCE:
                    k_nope = _converted_here(k_nope)
                    k_pe = _converted_here(k_pe)
            s = _dot(q_nope, tl.trans(k_nope), _dot0(q_pe, tl.trans(k_pe), IEEE), IEEE)
        if ROW_SCALE:
            s = s * qk_scale[:, None]
        else:
            s = s * qk_scale
        if MASKED:
            s = tl.where(pos[None, :] < bound[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen nothing keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_sub = m_new
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _to_f16_rows(q_nope, q_pe, qk_scale):
    """bf16 query rows as float16 for float16 products with an fp8 cache (``F16_MMA``), and the
    score factor of each row.

    An fp8 e4m3 value is exact in float16 and converts in one instruction per pair
    (``cvt.rn.f16x2.e4m3x2``); converting it to bf16 takes about four. A bf16 row is exact in
    float16 too once scaled so that its largest magnitude lies in ``[2^13, 2^14)``: each row is
    multiplied by a power of two ``2^-e`` (exact), and ``2^e`` goes into the row's score factor.
    Components below ``2^-28`` of the row's largest lose bits as float16 subnormals; a zero row
    keeps ``e = 0``; Inf and NaN stay what they were.
    """
    a = tl.maximum(tl.max(tl.abs(q_nope.to(tl.float32)), axis=1),
                   tl.max(tl.abs(q_pe.to(tl.float32)), axis=1))
    expo = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2(a)), a normal
    e = tl.where(a > 0.0, tl.minimum(tl.maximum(expo - 13, -100), 100), 0)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)  # 2^e
    q_nope = (q_nope.to(tl.float32) * down[:, None]).to(tl.float16)
    q_pe = (q_pe.to(tl.float32) * down[:, None]).to(tl.float16)
    return q_nope, q_pe, qk_scale * up


@triton.jit
def _decode_work(w, hb, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr, qk_scale, kv_scale,
                 out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                 H: tl.constexpr, MAX_PAGES: tl.constexpr, Q: tl.constexpr, HB: tl.constexpr,
                 BLOCK_M: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
                 HAS_KV_SCALE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 L2_HINTS: tl.constexpr, NUM_PAGES: tl.constexpr, F16_MMA: tl.constexpr,
                 FP8_QK: tl.constexpr, CVT_ONCE: tl.constexpr):
    """Work ``w`` (one KV range of one request) for head block ``hb``."""
    D: tl.constexpr = L + R
    EVEN_L: tl.constexpr = BLOCK_L == L
    EVEN_R: tl.constexpr = BLOCK_R == R
    wp = work_ptr + w * 8
    b = tl.load(wp)
    ploc = tl.load(wp + 1)
    qo_start = tl.load(wp + 2)
    kv_base = tl.load(kv_indptr_ptr + b)
    lo = tl.load(wp + 4) - kv_base  # KV range of this work, positions within the request
    hi = tl.load(wp + 5) - kv_base
    seq = hi + tl.load(wp + 6)  # kv_offset = tokens of the request after this work's range

    offs_m = tl.arange(0, BLOCK_M)
    t = offs_m // HB
    head = hb * HB + offs_m % HB
    row_ok = (t < Q) & (head < H)
    qrow = (qo_start + t).to(tl.int64) * H + head
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_nope = tl.load(q_ptr + qrow[:, None] * D + offs_l[None, :],
                     mask=row_ok[:, None] & (offs_l[None, :] < L), other=0.0)
    q_pe = tl.load(q_ptr + qrow[:, None] * D + L + offs_r[None, :],
                   mask=row_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    if F16_MMA:
        q_nope, q_pe, qk_scale = _to_f16_rows(q_nope, q_pe, qk_scale)
    # Row t sees positions < seq - Q + t + 1 (right-aligned causal verify block).
    bound = seq - Q + t + 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * MAX_PAGES
    # Tiles below `full` are seen whole by every row (row 0 has the lowest bound, seq - Q + 1).
    full = lo + (tl.maximum(tl.minimum(hi, seq - Q + 1) - lo, 0) // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _attend(acc, m_i, l_i, q_nope, q_pe, kv_ptr, bt_row, lo, full, bound,
                            qk_scale, L, R, BLOCK_L, BLOCK_R, BLOCK_N, PAGE_SIZE, TILE_IN_PAGE,
                            EVEN_L, EVEN_R, False, UPCAST, IEEE, NUM_PAGES, F16_MMA, FP8_QK,
                            CVT_ONCE)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q_nope, q_pe, kv_ptr, bt_row, full, hi, bound,
                            qk_scale, L, R, BLOCK_L, BLOCK_R, BLOCK_N, PAGE_SIZE, TILE_IN_PAGE,
                            EVEN_L, EVEN_R, True, UPCAST, IEEE, NUM_PAGES, F16_MMA, FP8_QK,
                            CVT_ONCE)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    if HAS_KV_SCALE:
        o = o * kv_scale
    o = tl.where(empty[:, None], 0.0, o)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_mask = row_ok[:, None] & (offs_l[None, :] < L)
    if ploc < 0:
        tl.store(out_ptr + qrow[:, None] * L + offs_l[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=o_mask)
        tl.store(lse_ptr + qrow, lse, mask=row_ok)
    else:
        prow = (ploc + t).to(tl.int64) * H + head
        # Kept in L2 for the reduce: the KV stream would evict them first (see module doc).
        part_policy: tl.constexpr = "evict_last" if L2_HINTS else ""
        tl.store(part_out_ptr + prow[:, None] * L + offs_l[None, :], o, mask=o_mask,
                 eviction_policy=part_policy)
        tl.store(part_lse_ptr + prow, lse, mask=row_ok, eviction_policy=part_policy)


@triton.jit
def _wait_for_predecessor(PDL: tl.constexpr):
    """With programmatic dependent launch (``PDL``, CUDA sm_90+) a kernel may start while the
    kernel before it on the stream is still running: wait for it to finish (and its writes to
    be visible) before this program touches any memory. Without PDL: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _release_successor(PDL: tl.constexpr):
    """Let the next kernel on the stream be launched (it waits for this one to end before it
    reads anything): its launch latency then hides under this kernel's tail."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def mla_decode_kernel(
    q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_indptr_ptr, work_ptr, kv_scale_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    QK_SCALE: tl.constexpr, H: tl.constexpr, MAX_PAGES: tl.constexpr, Q: tl.constexpr,
    HB: tl.constexpr, NUM_HB: tl.constexpr, BLOCK_M: tl.constexpr, L: tl.constexpr,
    R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr, HAS_KV_SCALE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, WG_SPLIT: tl.constexpr = False,
    L2_HINTS: tl.constexpr = False, NUM_PAGES: tl.constexpr = 2147483647,
    PDL: tl.constexpr = False, F16_MMA: tl.constexpr = False, FP8_QK: tl.constexpr = False,
    HAS_Q_SCALE: tl.constexpr = False, CVT_ONCE: tl.constexpr = False,
):
    # WG_SPLIT is read by the compiler wrapper, not here: on CUDA it splits the score tile's
    # columns between the two warpgroups of a 64-row, 8-warp program (backends/triton/compiler.py).
    _wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    p = pid // NUM_HB
    hb = pid % NUM_HB
    w0 = tl.load(work_indptr_ptr + p)
    w1 = tl.load(work_indptr_ptr + p + 1)
    # QK_SCALE = softmax scale * log2(e): scores live in the base-2 domain.
    if HAS_KV_SCALE:
        kv_scale = tl.load(kv_scale_ptr)
        qk_scale = kv_scale * QK_SCALE
    else:
        kv_scale = 1.0
        qk_scale = QK_SCALE
    if HAS_Q_SCALE:  # an fp8 query's scale (FP8_QK): scores of the stored values times it
        qk_scale = qk_scale * tl.load(kv_scale_ptr + 1)
    for w in range(w0, w1):
        _decode_work(w, hb, q_ptr, kv_ptr, bt_ptr, kv_indptr_ptr, work_ptr, qk_scale, kv_scale,
                     out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, H, MAX_PAGES, Q, HB, BLOCK_M,
                     L, R, BLOCK_L, BLOCK_R, BLOCK_N, PAGE_SIZE, TILE_IN_PAGE, HAS_KV_SCALE,
                     UPCAST, IEEE, L2_HINTS, NUM_PAGES, F16_MMA, FP8_QK, CVT_ONCE)
    _release_successor(PDL)


@triton.jit
def _load_partials(part_out_ptr, part_lse_ptr, prow0, r, j_ok, offs_h, h_ok, offs_l, l_ok,
                   H: tl.constexpr, L: tl.constexpr, read_policy: tl.constexpr):
    """Row ``r`` of a chunk of partials: LSE ``[S, BLOCK_H]`` and out ``[S, BLOCK_H, BLOCK_L]``."""
    prow = (prow0 + r)[:, None] * H + offs_h[None, :]
    ok = j_ok[:, None] & h_ok[None, :]
    lj = tl.load(part_lse_ptr + prow, mask=ok, other=float("-inf"), eviction_policy=read_policy)
    oj = tl.load(part_out_ptr + prow[:, :, None] * L + offs_l[None, None, :],
                 mask=ok[:, :, None] & l_ok[None, None, :], other=0.0,
                 eviction_policy=read_policy)
    return tl.where(lj == float("inf"), float("-inf"), lj), oj


@triton.jit
def _merge_chunk(m, z, acc, lj, oj):
    """Fold one chunk of partials into the running ``(max, sum of weights, weighted sum)``."""
    m_new = tl.maximum(m, tl.max(lj, axis=0))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_sub)
    wj = tl.exp(lj - m_sub[None, :])
    acc = acc * alpha[:, None] + tl.sum(tl.where(wj[:, :, None] > 0, wj[:, :, None] * oj, 0.0),
                                        axis=0)
    return m_new, z * alpha + tl.sum(wj, axis=0), acc


@triton.jit
def _store_row(out_ptr, lse_ptr, row, m, z, acc, offs_h, h_ok, offs_l, l_ok, lb,
               H: tl.constexpr, L: tl.constexpr):
    """Final row ``row``: ``out = acc / z`` (0 where no partial saw a key) and, from the program
    that holds latent column 0, ``lse = m + log z`` (``-inf`` there)."""
    empty = z == 0.0
    z_safe = tl.where(empty, 1.0, z)
    o = tl.where(empty[:, None], 0.0, acc / z_safe[:, None])
    orow = row.to(tl.int64) * H + offs_h
    tl.store(out_ptr + orow[:, None] * L + offs_l[None, :], o.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & l_ok[None, :])
    if lb == 0:
        m_fin = tl.where(m == float("-inf"), 0.0, m)
        tl.store(lse_ptr + orow, tl.where(empty, float("-inf"), m_fin + tl.log(z_safe)), mask=h_ok)


@triton.jit
def mla_reduce_kernel(
    part_out_ptr, part_lse_ptr, reduce_indptr_ptr, final_map_ptr, partial_map_ptr, tiles_ptr,
    out_in_ptr, lse_in_ptr,
    out_ptr, lse_ptr,
    H: tl.constexpr, L: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr, MAX_ROWS: tl.constexpr, OFF64: tl.constexpr,
    L2_HINTS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Merge the split partials of one query tile (AITER's ``mla_reduce_v1`` semantics).

    Grid ``(len(tiles), head blocks, latent blocks)``; program ``k`` merges tile
    ``i = tiles[k]`` (``-1``: nothing). Tile ``i`` owns partials
    ``partial_map[reduce_indptr[i]:reduce_indptr[i+1]]`` (row offsets into the partial buffers)
    and final rows ``final_map[i] = (qo_start, qo_end)``. Tiles with fewer than two partials were
    written whole by the decode kernel and are left alone (``out_in``/``lse_in`` alias
    ``out``/``lse``).

    One pass with a running max: ``BLOCK_S`` partials are read at once, as one ``[S, H, L]`` tile,
    so the loads of a request's partials are in flight together; the merge is latency-bound (a
    request's partials are a chain of dependent loads), so a program holds a small tile (few
    registers, many programs per SM). Every latent block recomputes the (cheap) weights, so the
    one that holds column 0 also writes the LSE. ``OFF64``: partial offsets need 64 bits.
    """
    _wait_for_predecessor(PDL)
    i = tl.load(tiles_ptr + tl.program_id(0))
    hb = tl.program_id(1)
    lb = tl.program_id(2)
    if i < 0:
        return
    p0 = tl.load(reduce_indptr_ptr + i)
    p1 = tl.load(reduce_indptr_ptr + i + 1)
    if p1 - p0 < 2:
        return
    q0 = tl.load(final_map_ptr + 2 * i)
    q1 = tl.load(final_map_ptr + 2 * i + 1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    h_ok = offs_h < H
    l_ok = offs_l < L
    read_policy: tl.constexpr = "evict_first" if L2_HINTS else ""  # partials are read once
    for r in range(0, MAX_ROWS):
        if q0 + r < q1:
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            z = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
            for c in range(p0, p1, BLOCK_S):
                js = c + offs_s
                j_ok = js < p1
                base = tl.load(partial_map_ptr + js, mask=j_ok, other=0)
                if OFF64:
                    base = base.to(tl.int64)
                lj, oj = _load_partials(part_out_ptr, part_lse_ptr, base, r, j_ok, offs_h, h_ok,
                                        offs_l, l_ok, H, L, read_policy)
                m, z, acc = _merge_chunk(m, z, acc, lj, oj)
            _store_row(out_ptr, lse_ptr, q0 + r, m, z, acc, offs_h, h_ok, offs_l, l_ok, lb, H, L)


@triton.jit
def _piece_rows(c, offs_s, p1, Q: tl.constexpr, OFF64: tl.constexpr):
    """First partial row ``p * Q`` of pieces ``p = c + s < p1`` (consecutive partials)."""
    js = c + offs_s
    rows = js * Q
    if OFF64:
        rows = rows.to(tl.int64)
    return rows, js < p1


@triton.jit
def mla_reduce_affine_kernel(
    part_out_ptr, part_lse_ptr, tiles_ptr, tile_ptr_ptr,
    out_in_ptr, lse_in_ptr,
    out_ptr, lse_ptr,
    H: tl.constexpr, L: tl.constexpr, Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, OFF64: tl.constexpr,
    L2_HINTS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """The reduce for this package's own plans (``schedule.plan_splits``), where the partials of
    a request are consecutive: program ``(k, hb, lb)`` merges split request ``i = tiles[k]``,
    whose pieces ``p0 <= p < p1`` (``tile_ptr[k]``) hold partial rows ``p * Q + r``; final rows
    are ``i * Q + r``. Same merge, in the same order, as :func:`mla_reduce_kernel`.

    The merge is latency-bound: a program's time is its chain of dependent loads. Here the chain is
    two loads deep (``tiles``/``tile_ptr`` together, then the partials) where the general kernel
    needs four (tile, indptr, maps, partials) and two more per verify row. The ``Q`` rows are
    unrolled and row ``r + 1``'s partials are loaded before row ``r`` is merged, so a verify
    tile's rows overlap their loads instead of waiting one after another.
    """
    _wait_for_predecessor(PDL)
    k = tl.program_id(0)
    hb = tl.program_id(1)
    lb = tl.program_id(2)
    i = tl.load(tiles_ptr + k)
    p0 = tl.load(tile_ptr_ptr + 2 * k)
    p1 = tl.load(tile_ptr_ptr + 2 * k + 1)
    if i < 0:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
    h_ok = offs_h < H
    l_ok = offs_l < L
    read_policy: tl.constexpr = "evict_first" if L2_HINTS else ""  # partials are read once
    prow0, j_ok = _piece_rows(p0, offs_s, p1, Q, OFF64)
    lj, oj = _load_partials(part_out_ptr, part_lse_ptr, prow0, 0, j_ok, offs_h, h_ok, offs_l,
                            l_ok, H, L, read_policy)
    for r in tl.static_range(Q):
        cur_l = lj
        cur_o = oj
        if r + 1 < Q:  # the next row's loads go out before this row waits for its own
            lj, oj = _load_partials(part_out_ptr, part_lse_ptr, prow0, r + 1, j_ok, offs_h,
                                    h_ok, offs_l, l_ok, H, L, read_policy)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        z = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
        m, z, acc = _merge_chunk(m, z, acc, cur_l, cur_o)
        for c in range(p0 + BLOCK_S, p1, BLOCK_S):  # requests split more than BLOCK_S ways
            crow0, c_ok = _piece_rows(c, offs_s, p1, Q, OFF64)
            xl, xo = _load_partials(part_out_ptr, part_lse_ptr, crow0, r, c_ok, offs_h, h_ok,
                                    offs_l, l_ok, H, L, read_policy)
            m, z, acc = _merge_chunk(m, z, acc, xl, xo)
        _store_row(out_ptr, lse_ptr, i * Q + r, m, z, acc, offs_h, h_ok, offs_l, l_ok, lb, H, L)
