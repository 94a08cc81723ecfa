"""``aiter.ops.triton._triton_kernels.attention.mla`` stand-in: the segmented decode kernel.

``_mla_decode_fwd_kernel`` has the JIT parameter list of ROCm/aiter e4048607's kernel of that
name (names, order, which are ``tl.constexpr``, the ``tl.int64``/``tl.int32`` annotations and
the defaults; pinned in ``jax_mla/backends/aiter/manifest.json``), so jax_mla's launcher binds
and compiles it exactly as it would AITER's. The body is this stand-in's own, written from the
documented semantics of the segmented decode (one program per (query block, KV head, segment)):

- a sequence's KV is cut into ``NUM_SEGMENTS_PER_SEQ`` segments of ``tiles_per_segment =
  ceil(seq_len / (NUM_SEGMENTS_PER_SEQ * TILE_SIZE))`` tiles; a segment starting at or past
  ``seq_len`` returns at once and writes nothing;
- query row ``pos`` of a sequence (``num_tokens_per_seq`` rows each) sees keys
  ``< seq_len - num_tokens_per_seq + pos + 1``;
- scores are taken in the log2 domain (``scale * log2(e) * q_scale * kv_scale``), and each
  segment stores ``segm_output = kv_scale * sum 2^(s - M) v`` (unnormalised), ``segm_max = M``
  and ``segm_expsum = sum 2^(s - M)`` (started at 1 with ``M = -inf``, which the first tile
  scales to 0).

Only the non-shuffled bf16/fp8 layout is implemented (``SHUFFLED_KV_CACHE`` and
``query_scales_ptr`` are accepted and must be off/None). It runs under Triton's interpreter
(CPU tests) and compiles for gfx942/gfx950 (the ROCm lowering test); it has never run on a GPU.
"""

import triton
import triton.language as tl


@triton.jit
def _cdiv(x, y):
    return (x + y - 1) // y


@triton.jit
def _mla_decode_fwd_kernel(
    segm_output_ptr,
    segm_max_ptr,
    segm_expsum_ptr,
    query_ptr,
    query_scales_ptr,
    kv_buffer_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale,
    q_scale_ptr,
    kv_scale_ptr,
    num_query_heads: tl.constexpr,
    num_kv_heads: tl.constexpr,
    block_tables_stride: tl.int64,
    query_stride_0: tl.int64,
    query_stride_1: tl.int64,
    query_scales_stride_0: tl.int64,
    query_scales_stride_1: tl.int64,
    KV_LORA_RANK: tl.constexpr,
    QK_ROPE_HEAD_DIM: tl.constexpr,
    stride_kv_buffer_0: tl.int64,
    stride_kv_buffer_1: tl.int64,
    stride_kv_buffer_2: tl.int64,
    stride_kv_buffer_3: tl.constexpr,
    query_start_len_ptr,
    num_tokens_per_seq: tl.int32,
    TILE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SEGMENTS_PER_SEQ: tl.constexpr,
    num_warps: tl.constexpr,
    waves_per_eu: tl.constexpr,
    num_stages: tl.constexpr,
    NUM_HEAD_BLOCKS: tl.constexpr = 1,
    ALL_DECODE: tl.constexpr = False,
    SHUFFLED_KV_CACHE: tl.constexpr = False,
    IS_Q_FP8: tl.constexpr = False,
    IS_KV_FP8: tl.constexpr = False,
):
    tl.static_assert(not SHUFFLED_KV_CACHE, "stand-in: no shuffled KV cache")
    GQA: tl.constexpr = num_query_heads // num_kv_heads
    LOG2E: tl.constexpr = 1.4426950408889634
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)

    # Which sequence, which of its token blocks, which head block.
    blocks_per_seq = _cdiv(num_tokens_per_seq, BLOCK_Q) * NUM_HEAD_BLOCKS
    if ALL_DECODE:
        seq = block // NUM_HEAD_BLOCKS
    else:
        seq = block // blocks_per_seq
    local = block - seq * blocks_per_seq
    token_block = local // NUM_HEAD_BLOCKS
    head_block = local % NUM_HEAD_BLOCKS

    seq_len = tl.load(seq_lens_ptr + seq)
    per_seg = _cdiv(seq_len, NUM_SEGMENTS_PER_SEQ * TILE_SIZE)  # tiles per segment
    first_tile = seg * per_seg
    if first_tile * TILE_SIZE >= seq_len:
        return  # an empty segment: nothing written

    factor = scale * LOG2E
    if q_scale_ptr is not None:
        factor = factor * tl.load(q_scale_ptr)
    if kv_scale_ptr is not None:
        kv_scale = tl.load(kv_scale_ptr)
        factor = factor * kv_scale

    m = tl.arange(0, BLOCK_M)
    pos = token_block * BLOCK_Q + m // GQA  # query row within the sequence
    head = kv_head * GQA + head_block * BLOCK_M + m % GQA
    row_ok = (pos < num_tokens_per_seq) & (head < num_query_heads)
    row = tl.load(query_start_len_ptr + seq) + pos
    q_off = row.to(tl.int64)[:, None] * query_stride_0 + head.to(tl.int64)[:, None] * query_stride_1
    lr = tl.arange(0, KV_LORA_RANK)
    rr = tl.arange(0, QK_ROPE_HEAD_DIM)
    q_nope = tl.load(query_ptr + q_off + lr[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(query_ptr + q_off + KV_LORA_RANK + rr[None, :], mask=row_ok[:, None],
                   other=0.0)

    context = seq_len - num_tokens_per_seq
    bound = context + pos + 1  # keys visible to each row
    last_row = token_block * BLOCK_Q + (BLOCK_M - 1) // GQA
    reach = tl.minimum(context + last_row + 1, seq_len)
    tiles = _cdiv(reach, TILE_SIZE)
    end_tile = tl.minimum(first_tile + per_seg, tiles)

    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, KV_LORA_RANK], tl.float32)
    t = tl.arange(0, TILE_SIZE)
    table = block_tables_ptr + seq * block_tables_stride
    for j in range(first_tile, end_tile):
        page = tl.load(table + j).to(tl.int64)
        base = kv_buffer_ptr + page * stride_kv_buffer_0 + kv_head * stride_kv_buffer_2
        keys = base + t[:, None] * stride_kv_buffer_1
        kv_nope = tl.load(keys + lr[None, :] * stride_kv_buffer_3).to(q_nope.dtype)
        k_pe = tl.load(keys + (KV_LORA_RANK + rr[None, :]) * stride_kv_buffer_3).to(q_pe.dtype)
        s = tl.dot(q_nope, tl.trans(kv_nope)) + tl.dot(q_pe, tl.trans(k_pe))
        s = s * factor
        key = j * TILE_SIZE + t
        s = tl.where(key[None, :] < bound[:, None], s, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(s, axis=1))
        new_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.math.exp2(s - new_max[:, None])
        shrink = tl.math.exp2(run_max - new_max)
        run_sum = run_sum * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + tl.dot(p.to(kv_nope.dtype), kv_nope)
        run_max = new_max

    if kv_scale_ptr is not None:
        acc = acc * kv_scale
    stat = (row.to(tl.int64) * num_query_heads + head) * NUM_SEGMENTS_PER_SEQ + seg
    tl.store(segm_output_ptr + stat[:, None] * KV_LORA_RANK + lr[None, :], acc,
             mask=row_ok[:, None])
    tl.store(segm_max_ptr + stat, run_max, mask=row_ok)
    tl.store(segm_expsum_ptr + stat, run_sum, mask=row_ok)
