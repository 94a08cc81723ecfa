"""The entry kernel through which jax_mla launches AITER's Gluon MLA decode kernel (gfx950).

AITER's ``_mla_gluon`` (``aiter.ops.triton.gluon.mla_gluon``) takes two query pointers (``q_nope``
and ``q_pe``), two cache pointers, outputs among its inputs and some thirty scalars (the softmax
and KV scales, strides) at run time. jax_mla's launchers pass a kernel its arrays only, operands
then results, and every scalar as a compile-time value (``jax_mla/backends/triton/ffi_launch.py``).
This entry has that form and calls AITER's kernel, handed in as the constexpr ``KERNEL``, with
every parameter by name, as AITER's ``mla_gluon`` calls it for vLLM's flat form
(``use_2d_view=False``, one token a page-table entry, the rope columns in the latent rows):

- ``q [T, H, 576]``: ``Q_nope`` is ``q``, ``Q_pe`` is ``q + 512`` (the same rows; AITER's two
  views of one tensor), strides ``(batch, query position, head)``;
- the cache ``[tokens, 576]`` is both ``Kv_c_cache`` and ``K_pe_cache`` (``KV_PE_OFFSET`` 512);
- ``O`` is the split outputs ``[B, QLEN, H, NUM_KV_SPLITS, 512]`` (with one split: the final
  output itself), ``Mid_lse`` / ``Final_lse`` the LSE arrays; an unused one is a one-element
  array AITER's kernel never touches (its use is behind ``NUM_KV_SPLITS`` / ``RETURN_LSE``), and
  ``Attn_sink`` (off) points at ``Mid_lse``'s array.

The strides become run-time scalars of the kernel again (``gl.to_tensor``), as AITER's kernel
widens some of them (``.to(gl.int64)``) past 2 GB of cache. ``KERNEL_KEY`` is the kernel's source
hash, so a changed AITER kernel is a new compile. The reduce (``_mla_softmax_reducev_kernel``, a
Triton kernel) has its own entry in ``jax_mla/kernels/triton/aiter_entry.py``.
``jax_mla/backends/aiter/gluon_kernels.py`` computes every value as AITER's wrapper does.
Compiled for gfx950 on CPU hosts; never run here (no AMD GPU, and Gluon has no interpreter).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def mla_aiter_gluon_entry_kernel(
        q_ptr, kv_ptr, kv_indices_ptr, kv_indptr_ptr, o_ptr, mid_lse_ptr, final_lse_ptr,
        KERNEL: gl.constexpr, KERNEL_KEY: gl.constexpr, SM_SCALE: gl.constexpr,
        KV_SCALE: gl.constexpr, STRIDE_Q_B: gl.constexpr, STRIDE_Q_S: gl.constexpr,
        STRIDE_Q_H: gl.constexpr, STRIDE_KV: gl.constexpr, STRIDE_O_B: gl.constexpr,
        STRIDE_O_S: gl.constexpr, STRIDE_O_H: gl.constexpr, STRIDE_O_SPLIT: gl.constexpr,
        STRIDE_ML_B: gl.constexpr, STRIDE_ML_S: gl.constexpr, STRIDE_ML_H: gl.constexpr,
        STRIDE_ML_SPLIT: gl.constexpr, STRIDE_FL_B: gl.constexpr, STRIDE_FL_S: gl.constexpr,
        STRIDE_FL_H: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_KV_SPLITS: gl.constexpr, HEAD_DIM_CKV: gl.constexpr, HEAD_DIM_KPE: gl.constexpr,
        WITHIN_2GB: gl.constexpr, NUM_XCDS: gl.constexpr, NHEAD: gl.constexpr,
        REGIME: gl.constexpr, RETURN_LSE: gl.constexpr, QLEN: gl.constexpr):
    KERNEL(
        Q_nope=q_ptr,
        Q_pe=q_ptr + HEAD_DIM_CKV,
        Kv_c_cache=kv_ptr,
        K_pe_cache=kv_ptr,
        Req_to_tokens=kv_indices_ptr,
        B_seq_len=kv_indptr_ptr,
        O=o_ptr,
        Attn_sink=mid_lse_ptr,
        sm_scale=SM_SCALE,
        kv_scale=KV_SCALE,
        stride_q_nope_bs=gl.to_tensor(STRIDE_Q_B),
        stride_q_nope_s=gl.to_tensor(STRIDE_Q_S),
        stride_q_nope_h=gl.to_tensor(STRIDE_Q_H),
        stride_q_pe_bs=gl.to_tensor(STRIDE_Q_B),
        stride_q_pe_s=gl.to_tensor(STRIDE_Q_S),
        stride_q_pe_h=gl.to_tensor(STRIDE_Q_H),
        stride_kv_c_bs=gl.to_tensor(STRIDE_KV),
        stride_k_pe_bs=gl.to_tensor(STRIDE_KV),
        stride_req_to_tokens_bs=gl.to_tensor(0),
        stride_o_b=gl.to_tensor(STRIDE_O_B),
        stride_o_s=gl.to_tensor(STRIDE_O_S),
        stride_o_h=gl.to_tensor(STRIDE_O_H),
        stride_o_split=gl.to_tensor(STRIDE_O_SPLIT),
        Mid_lse=mid_lse_ptr,
        stride_mid_lse_b=gl.to_tensor(STRIDE_ML_B),
        stride_mid_lse_s=gl.to_tensor(STRIDE_ML_S),
        stride_mid_lse_h=gl.to_tensor(STRIDE_ML_H),
        stride_mid_lse_split=gl.to_tensor(STRIDE_ML_SPLIT),
        Final_lse=final_lse_ptr,
        stride_final_lse_b=gl.to_tensor(STRIDE_FL_B),
        stride_final_lse_s=gl.to_tensor(STRIDE_FL_S),
        stride_final_lse_h=gl.to_tensor(STRIDE_FL_H),
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        PAGE_SIZE=1,
        HEAD_DIM_CKV=HEAD_DIM_CKV,
        HEAD_DIM_KPE=HEAD_DIM_KPE,
        KV_PE_OFFSET=HEAD_DIM_CKV,
        USE_2D_VIEW=False,
        WITHIN_2GB=WITHIN_2GB,
        NUM_XCDS=NUM_XCDS,
        NHEAD=NHEAD,
        REGIME=REGIME,
        RETURN_LSE=RETURN_LSE,
        QLEN=QLEN,
        HAS_PE=True,
        HAS_ATTN_SINK=False,
    )
