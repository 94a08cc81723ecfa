"""The jax side of the Triton prefill kernel: tile configs, the block table, the launch.

The kernel (``jax_mla/kernels/triton/prefill.py``) runs one program per (query block, head). The
number of query blocks depends on the lengths, which are data, so the grid is a static upper bound
and a small jnp-built table maps program id -> (sequence, first local row); spare programs exit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_mla import env
from jax_mla.backends.triton.launch import triton_call
from jax_mla.backends.triton.plan import next_pow2, prev_pow2
from jax_mla.paged import expand_indptr
from jax_mla.problem import as_target

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class PrefillTritonConfig:
    """Tile shape and launch parameters of the prefill kernel (all static).

    ``block_m`` query rows and ``block_n`` key rows per tile (powers of two, >= 16 for
    ``tl.dot``); ``num_warps`` and ``num_stages`` as in Triton (ignored by the interpreter).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(
                    f"PrefillTritonConfig.{name} must be a power of two >= 16, got {v!r}")
        for name in ("num_warps", "num_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"PrefillTritonConfig.{name} must be a positive int, got {v!r}")


def head_dim_split(dqk: int, dv: int) -> tuple[int, int, int]:
    """``(D1, D2, BLOCK_DV)``: ``D1`` the largest power of two <= ``dqk``; ``D2`` the rest padded
    to a power of two (0 when none; at least 16 for ``tl.dot``); ``BLOCK_DV`` likewise for ``dv``.
    DeepSeek 192/128 -> (128, 64, 128): two unmasked dots, nope then rope, like MLA kernels."""
    d1 = prev_pow2(dqk)
    rest = dqk - d1
    d2 = max(16, next_pow2(rest)) if rest else 0
    return d1, d2, max(16, next_pow2(dv))


# AMD Instinct, 16-bit types up to 192/128 (``python -m jax_mla.aot``, triton 3.9, compiles):
# 4 warps, so a wave may have 512 VGPRs (at 8 warps the compiler caps it at 256 and the CUDA
# tile spilled, besides taking 96 KiB of LDS). gfx942 (64 KiB of LDS): (64, 32) takes 24 KiB and
# 236 VGPRs; gfx950 (160 KiB): (128, 32) takes 41 KiB and 242 VGPRs. Other AMD archs: gfx942's.
ROCM_PREFILL_CONFIGS = {
    "gfx942": PrefillTritonConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    "gfx950": PrefillTritonConfig(block_m=128, block_n=32, num_warps=4, num_stages=2),
}


def pick_config(dqk: int, dv: int, dtype, target=None) -> PrefillTritonConfig:
    """A tile config by head dims, dtype and target, no autotuning.

    Hopper has ~227 KiB of shared memory per block: the Q tile stays resident and every pipeline
    stage holds one K tile and one V tile, so ``(BM*DQK + stages*BN*(DQK+DV)) * itemsize`` must
    fit, and the fp32 accumulators must fit the registers. Checked by compiling for sm_90 (triton
    3.9 + ptxas, no spills): 192/128 bf16 at (128, 64, 8 warps, 3 stages) takes 168 KiB and 216
    registers; 128/128 at the same tiles 128 KiB; a 128-wide key block spills at both. fp32
    (exact ``ieee`` dots, a correctness path) runs on small tiles. ``target``: a
    :class:`~jax_mla.problem.Target` (None, or not ROCm: the CUDA tiles); on ROCm 16-bit types
    up to 192/128 take :data:`ROCM_PREFILL_CONFIGS`.
    """
    d1, d2, bdv = head_dim_split(dqk, dv)
    if jnp.dtype(dtype).itemsize >= 4:
        # CUDA: 8 warps (sm_90a, triton 3.9: 79-80 registers, 46 KiB, no spills; at 4 warps the
        # same tile took 255 registers and spilled ~1,450 bytes). AMD keeps 4 warps (a wave may
        # have 512 VGPRs only at 4 warps; 168-209 VGPRs, no spills).
        warps = 4 if getattr(target, "platform", None) == "rocm" else 8
        return PrefillTritonConfig(block_m=32, block_n=16, num_warps=warps, num_stages=2)
    if d1 + d2 + bdv <= 384:  # up to DeepSeek's 192/128
        if getattr(target, "platform", None) == "rocm":
            return ROCM_PREFILL_CONFIGS.get(target.arch, ROCM_PREFILL_CONFIGS["gfx942"])
        return PrefillTritonConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return PrefillTritonConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


# Candidates for tuning on the GPU (``jax_mla.bench.prefill.tune_prefill``); all compile without
# spills for 192/128 bf16 on sm_90 and fit shared memory. (128, 32) uses 128 registers and
# 108 KiB, so two blocks share an SM and one's softmax overlaps the other's MMAs.
TUNING_CONFIGS = (
    PrefillTritonConfig(128, 64, 8, 3),
    PrefillTritonConfig(128, 64, 8, 4),
    PrefillTritonConfig(128, 64, 8, 2),
    PrefillTritonConfig(128, 32, 8, 3),
    PrefillTritonConfig(64, 64, 4, 3),
)


def num_query_blocks(num_rows: int, num_seqs: int, block_m: int) -> int:
    """Static grid bound: ``sum_s cdiv(len_s, BM) <= cdiv(T, BM) + num_seqs - 1``."""
    return max(1, -(-num_rows // block_m) + num_seqs - 1)


def query_block_table(cu_q, num_blocks: int, block_m: int, causal: bool):
    """``(blk_seq, blk_m0)`` int32 ``[num_blocks]``: sequence and first local row per program.

    Within a sequence, causal blocks are listed last-first: they see the most keys, so the
    longest programs start first and the short ones fill the tail of the wave.
    """
    lens = cu_q[1:] - cu_q[:-1]
    nblk = (lens + block_m - 1) // block_m
    indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nblk, dtype=jnp.int32)])
    seq, off, valid = expand_indptr(indptr, num_blocks)
    if causal:
        off = nblk[seq] - 1 - off
    blk_seq = jnp.where(valid, seq, -1).astype(jnp.int32)
    blk_m0 = jnp.where(valid, off * block_m, 0).astype(jnp.int32)
    return blk_seq, blk_m0


def prefill_triton(q, k, v, cu_q, cu_k, *, scale: float, causal: bool, target,
                   config: PrefillTritonConfig | None = None):
    """Varlen flash attention through the Triton kernel.

    Args:
      q: ``[T, H, DQK]``; k: ``[Tk, H, DQK]``; v: ``[Tk, H, DV]``, one float dtype.
      cu_q, cu_k: ``[S + 1]`` int32, non-decreasing, ``cu_q[-1] == T`` and ``cu_k[-1] <= Tk``
        (the caller appends a key-less sequence for padding rows so every row is written).
    Returns:
      ``out [T, H, DV]`` in q's dtype and ``lse [T, H]`` float32 (natural log; rows that see no
      key: 0 and ``-inf``).
    """
    t, h, dqk = q.shape
    dv = v.shape[2]
    if config is None:
        config = pick_config(dqk, dv, q.dtype, as_target(target))
    d1, d2, bdv = head_dim_split(dqk, dv)
    nb = num_query_blocks(t, cu_q.shape[0] - 1, config.block_m)
    blk_seq, blk_m0 = query_block_table(cu_q, nb, config.block_m, causal)
    # The interpreter's bf16 arithmetic is unreliable: it computes in fp32 instead.
    upcast = env.interpreter_enabled()
    from jax_mla.kernels.triton.prefill import prefill_fwd_kernel

    out, lse = triton_call(
        prefill_fwd_kernel, q, k, v, cu_q, cu_k, blk_seq, blk_m0,
        grid=(nb, h),
        out_shapes=(jax.ShapeDtypeStruct((t, h, dv), q.dtype),
                    jax.ShapeDtypeStruct((t, h), jnp.float32)),
        target=target, num_warps=config.num_warps, num_stages=config.num_stages,
        QK_SCALE=float(scale) * LOG2E, H=h, DQK=dqk, DV=dv, D1=d1, D2=max(d2, 16),
        BLOCK_DV=bdv, BLOCK_M=config.block_m, BLOCK_N=config.block_n, CAUSAL=bool(causal),
        UPCAST=upcast, IEEE=(jnp.dtype(q.dtype) == jnp.float32 and not upcast),
    )
    return out, lse
