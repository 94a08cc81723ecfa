"""The entry kernel through which jax_mla launches AITER's segmented MLA decode kernel.

AITER's ``_mla_decode_fwd_kernel`` (``aiter.ops.triton._triton_kernels.attention.mla``) takes its
outputs first and a dozen scalars (the softmax scale, strides, tokens per sequence) as runtime
parameters. jax_mla's launchers pass a kernel its arrays only, operands then results, and every
scalar as a compile-time value (``jax_mla/backends/triton/ffi_launch.py``). This entry has that
form -- the arrays, inputs then outputs, then constexprs -- and calls AITER's kernel, handed in
as the constexpr ``KERNEL``, with every one of its parameters given by name: the body compiled
is AITER's own, inlined, with the scalars baked in as constants (as Triton itself specialises
a scalar of 1). ``KERNEL_KEY`` is the kernel's source hash, so that a changed AITER kernel is a
new compile, never a cached binary of the old one. No parameter of the call is left to its
default (triton 3.6 fails to compile a helper called so; tests/test_kernel_source.py).

``jax_mla/backends/aiter/triton_kernels.py`` computes every value, as AITER's ``mla_decode_fwd``
computes them, and launches this through ``jax_mla.backends.triton.launch.triton_call``.
"""

import triton
import triton.language as tl


@triton.jit
def mla_aiter_segmented_entry_kernel(
        query_ptr, kv_buffer_ptr, block_tables_ptr, seq_lens_ptr, query_start_len_ptr,
        kv_scale_ptr, segm_output_ptr, segm_max_ptr, segm_expsum_ptr,
        KERNEL: tl.constexpr, KERNEL_KEY: tl.constexpr, SCALE: tl.constexpr,
        NUM_QUERY_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        BLOCK_TABLES_STRIDE: tl.constexpr, QUERY_STRIDE_0: tl.constexpr,
        QUERY_STRIDE_1: tl.constexpr, KV_LORA_RANK: tl.constexpr,
        QK_ROPE_HEAD_DIM: tl.constexpr, STRIDE_KV_0: tl.constexpr, STRIDE_KV_1: tl.constexpr,
        STRIDE_KV_2: tl.constexpr, STRIDE_KV_3: tl.constexpr,
        NUM_TOKENS_PER_SEQ: tl.constexpr, TILE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, NUM_SEGMENTS_PER_SEQ: tl.constexpr, NUM_WARPS: tl.constexpr,
        WAVES_PER_EU: tl.constexpr, NUM_STAGES: tl.constexpr, NUM_HEAD_BLOCKS: tl.constexpr,
        ALL_DECODE: tl.constexpr, IS_Q_FP8: tl.constexpr, IS_KV_FP8: tl.constexpr):
    KERNEL(
        segm_output_ptr=segm_output_ptr,
        segm_max_ptr=segm_max_ptr,
        segm_expsum_ptr=segm_expsum_ptr,
        query_ptr=query_ptr,
        query_scales_ptr=None,
        kv_buffer_ptr=kv_buffer_ptr,
        block_tables_ptr=block_tables_ptr,
        seq_lens_ptr=seq_lens_ptr,
        scale=SCALE,
        q_scale_ptr=None,
        kv_scale_ptr=kv_scale_ptr,
        num_query_heads=NUM_QUERY_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        block_tables_stride=BLOCK_TABLES_STRIDE,
        query_stride_0=QUERY_STRIDE_0,
        query_stride_1=QUERY_STRIDE_1,
        query_scales_stride_0=0,
        query_scales_stride_1=0,
        KV_LORA_RANK=KV_LORA_RANK,
        QK_ROPE_HEAD_DIM=QK_ROPE_HEAD_DIM,
        stride_kv_buffer_0=STRIDE_KV_0,
        stride_kv_buffer_1=STRIDE_KV_1,
        stride_kv_buffer_2=STRIDE_KV_2,
        stride_kv_buffer_3=STRIDE_KV_3,
        query_start_len_ptr=query_start_len_ptr,
        num_tokens_per_seq=NUM_TOKENS_PER_SEQ,
        TILE_SIZE=TILE_SIZE,
        BLOCK_Q=BLOCK_Q,
        BLOCK_M=BLOCK_M,
        NUM_SEGMENTS_PER_SEQ=NUM_SEGMENTS_PER_SEQ,
        num_warps=NUM_WARPS,
        waves_per_eu=WAVES_PER_EU,
        num_stages=NUM_STAGES,
        NUM_HEAD_BLOCKS=NUM_HEAD_BLOCKS,
        ALL_DECODE=ALL_DECODE,
        SHUFFLED_KV_CACHE=False,
        IS_Q_FP8=IS_Q_FP8,
        IS_KV_FP8=IS_KV_FP8,
    )


@triton.jit
def mla_aiter_gluon_reduce_entry_kernel(
        logits_ptr, mid_lse_ptr, kv_indptr_ptr, o_ptr, final_lse_ptr,
        KERNEL: tl.constexpr, KERNEL_KEY: tl.constexpr, STRIDE_L_B: tl.constexpr,
        STRIDE_L_S: tl.constexpr, STRIDE_L_H: tl.constexpr, STRIDE_L_SPLIT: tl.constexpr,
        STRIDE_ML_B: tl.constexpr, STRIDE_ML_S: tl.constexpr, STRIDE_ML_H: tl.constexpr,
        STRIDE_ML_SPLIT: tl.constexpr, STRIDE_O_B: tl.constexpr, STRIDE_O_S: tl.constexpr,
        STRIDE_O_H: tl.constexpr, STRIDE_FL_B: tl.constexpr, STRIDE_FL_S: tl.constexpr,
        STRIDE_FL_H: tl.constexpr, NUM_KV_SPLITS: tl.constexpr, HEAD_DIM_CKV: tl.constexpr,
        HAS_FINAL_LSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """AITER's Gluon route's reduce, ``_mla_softmax_reducev_kernel`` (a Triton kernel, handed in
    as ``KERNEL``), in jax_mla's launch form: the split outputs and LSEs of
    ``mla_aiter_gluon_entry_kernel`` (``jax_mla/kernels/gluon/aiter_entry.py``) in, the final
    output and LSE out, every stride a constant (``backends/aiter/gluon_kernels.py``)."""
    KERNEL(
        Logits=logits_ptr,
        Mid_lse=mid_lse_ptr,
        O=o_ptr,
        Final_lse=final_lse_ptr,
        B_seq_len=kv_indptr_ptr,
        stride_l_b=STRIDE_L_B,
        stride_l_qs=STRIDE_L_S,
        stride_l_h=STRIDE_L_H,
        stride_l_s=STRIDE_L_SPLIT,
        stride_ml_b=STRIDE_ML_B,
        stride_ml_qs=STRIDE_ML_S,
        stride_ml_h=STRIDE_ML_H,
        stride_ml_s=STRIDE_ML_SPLIT,
        stride_o_b=STRIDE_O_B,
        stride_o_qs=STRIDE_O_S,
        stride_o_h=STRIDE_O_H,
        stride_fl_b=STRIDE_FL_B,
        stride_fl_qs=STRIDE_FL_S,
        stride_fl_h=STRIDE_FL_H,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        HEAD_DIM_CKV=HEAD_DIM_CKV,
        HAS_FINAL_LSE=HAS_FINAL_LSE,
        USE_2D_VIEW=False,
        BLOCK_S=BLOCK_S,
        BLOCK_N=BLOCK_N,
    )
