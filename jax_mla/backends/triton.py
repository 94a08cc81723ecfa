"""``backend="triton"``: the split-KV Triton kernels of ``kernels/triton/decode.py`` in jit.

On CUDA/ROCm the kernels become native XLA custom calls through jax-triton; on CPU they run
under Triton's interpreter (CI). The split schedule comes from the metadata when it was planned
for this shape (``build_decode_metadata(..., num_heads=H)``), else it is planned here, in jnp.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jax_mla.backends import current_platform
from jax_mla.backends.triton_launch import GPU_PLATFORMS, triton_call, triton_importable
from jax_mla.cache import is_fp8
from jax_mla.config import triton_ctas_per_sm, triton_decode_overrides, triton_max_rows
from jax_mla.schedule import SplitSchedule, plan_splits

_LOG2E = 1.4426950408889634
# Rows (query tokens x heads) one program's MMA tile holds at most: the float32 accumulator is
# [rows, 512], which is what the register file bounds.
_MAX_ROWS = 64
# Decode tiles by MMA rows (Q * heads per block), and how many programs of that tile one
# multiprocessor holds at once (registers and shared memory from ptxas for sm_90a, triton 3.6):
# the persistent grid is exactly that many programs per SM, so none waits for a second wave.
# Fastest in the 2026-12-02 H200 sweep (benchmarks/results/2026-12-02-h200/tune_decode.json):
#   16 rows, block_n 32, 4 warps, 3 stages (mma.sync): 191 regs, 93 KB smem, KV double-buffered,
#     2 / SM. B128 S32k 3.66 TB/s; block_n 16 with 3 / SM was 28 % slower, 2 stages (one KV
#     buffer) 8 % slower.
#   64 rows, block_n 64, 8 warps, 2 stages (wgmma): 255 regs (108 bytes spilled), 216 KB, 1 / SM.
#     In one run at 128 heads 819 us against 953 us for block_n 32 / 3 stages (no spills) and
#     1118 us for block_n 32 / 2 stages; block_n 16 was 1.45-1.66x slower. (128-head times
#     vary ~20 % from run to run on this GPU: compare within one run.)
# A 32-row block is neither MMA shape: it is split into two 16-row blocks that share each KV tile
# through L2 (Q=2 at 16 heads: 200 us against 265-307 us as one block).
_GPU_TILES = {
    16: {"block_n": 32, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 2},
    64: {"block_n": 64, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1},
}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    heads_per_block: int  # HB
    num_head_blocks: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1


def kernel_config(num_heads: int, qlen: int, page_size: int, platform: str) -> KernelConfig:
    """Tile shape for ``H`` heads x ``Q`` tokens (see ``_GPU_TILES``; env overrides in config)."""
    max_rows = triton_max_rows() or _MAX_ROWS
    gpu = platform in GPU_PLATFORMS
    if gpu and not triton_max_rows() and 16 < qlen * num_heads <= 32 and qlen <= 16:
        max_rows = 16  # two 16-row blocks, not one 32-row block (see _GPU_TILES)
    if qlen * num_heads <= max_rows:
        hb = num_heads
    else:
        hb = max(1, max_rows // qlen)
    nhb = -(-num_heads // hb)
    block_m = max(16, _next_pow2(qlen * hb))
    if not gpu:
        # Interpreter: small tiles keep CI fast and exercise several tiles per work.
        return KernelConfig(hb, nhb, block_m, 16, 1, 1, triton_ctas_per_sm() or 1)
    tile = dict(_GPU_TILES[16 if block_m <= 16 else 64])
    tile.update(triton_decode_overrides())
    if triton_ctas_per_sm():
        tile["ctas_per_sm"] = triton_ctas_per_sm()
    return KernelConfig(hb, nhb, block_m, **tile)


def num_sms(platform: str) -> int:
    if platform in GPU_PLATFORMS:
        return int(getattr(jax.devices()[0], "core_count", 132) or 132)
    return 4


def num_programs(cfg: KernelConfig, platform: str) -> int:
    """Persistent programs per head block: the whole grid is resident at once."""
    return max(1, num_sms(platform) * cfg.ctas_per_sm // cfg.num_head_blocks)


def plan(metadata, num_heads: int, platform: str) -> SplitSchedule:
    """The split schedule this backend would use for ``metadata`` and ``num_heads``."""
    cfg = kernel_config(num_heads, metadata.qlen, metadata.page_size, platform)
    return plan_splits(metadata.seq_lens, metadata.paged_kv_indptr, qlen=metadata.qlen,
                       block_n=cfg.block_n, num_programs=num_programs(cfg, platform),
                       num_head_blocks=cfg.num_head_blocks)


class TritonBackend:
    name = "triton"

    def is_available(self, platform: str) -> bool:
        return triton_importable(platform)

    def check(self, problem) -> None:
        return None

    def padded_heads(self, problem) -> int:
        return problem.num_heads  # the kernel masks partial head blocks itself

    def plan(self, metadata, num_heads: int, platform: str) -> SplitSchedule:
        return plan(metadata, num_heads, platform)

    def decode(self, q, kv_cache, metadata, *, scale, kv_lora_rank, q_scale, kv_scale):
        platform = current_platform()
        md = metadata
        t_rows, h, d = q.shape
        lr = kv_lora_rank
        rd = d - lr
        cfg = kernel_config(h, md.qlen, md.page_size, platform)
        if is_fp8(q.dtype):  # dequantise once here; the kernel multiplies in bf16
            q = (q.astype(jnp.float32) * jnp.asarray(q_scale, jnp.float32)).astype(jnp.bfloat16)
        out_dtype = q.dtype
        sched = md.schedule
        if not (isinstance(sched, SplitSchedule) and sched.block_n == cfg.block_n
                and sched.num_head_blocks == cfg.num_head_blocks and sched.qlen == md.qlen
                and sched.num_programs == num_programs(cfg, platform)):
            sched = plan(md, h, platform)
        kv = kv_cache.reshape(-1, d)
        has_scale = kv_scale is not None
        kv_scale_arr = jnp.asarray(1.0 if kv_scale is None else kv_scale, jnp.float32).reshape(1)
        interp = platform not in GPU_PLATFORMS
        upcast = interp
        prow = sched.max_works * md.qlen
        f32 = jnp.float32
        out, lse, part_out, part_lse = triton_call(
            _kernels().mla_decode_kernel,
            q, kv, md.block_table, md.paged_kv_indptr, sched.work_indptr, sched.work_info_set,
            kv_scale_arr,
            grid=(sched.num_programs * cfg.num_head_blocks,),
            out_shapes=[jax.ShapeDtypeStruct((t_rows, h, lr), out_dtype),
                        jax.ShapeDtypeStruct((t_rows, h), f32),
                        jax.ShapeDtypeStruct((prow, h, lr), f32),
                        jax.ShapeDtypeStruct((prow, h), f32)],
            platform=platform, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            QK_SCALE=float(scale * _LOG2E), H=h, MAX_PAGES=md.max_pages, Q=md.qlen,
            HB=cfg.heads_per_block, NUM_HB=cfg.num_head_blocks,
            BLOCK_M=cfg.block_m, L=lr, R=rd, BLOCK_L=_next_pow2(lr), BLOCK_R=_next_pow2(rd),
            BLOCK_N=cfg.block_n, PAGE_SIZE=md.page_size,
            TILE_IN_PAGE=md.page_size % cfg.block_n == 0, HAS_KV_SCALE=has_scale,
            UPCAST=upcast, IEEE=(not upcast) and jnp.dtype(q.dtype) == jnp.float32,
        )
        return reduce_partials(part_out, part_lse, sched, out, lse, platform=platform)


def reduce_partials(part_out, part_lse, sched: SplitSchedule, out, lse, *, platform):
    """Merge split partials into ``out``/``lse`` in place (tiles with < 2 partials untouched)."""
    t_rows, h, lr = out.shape
    block_h = min(16, _next_pow2(h))
    gpu = platform in GPU_PLATFORMS
    # [S, H, L] = 8 x 16 x 16 float32 per program on a GPU: 72 registers a thread (sm_90a), so
    # ~7 programs per SM hide the latency of each request's chain of loads (8 x 16 x 64 took 249
    # registers: 2 programs per SM, and 101 us at 128 heads, B=128).
    block_l = min(16 if gpu else 128, _next_pow2(lr))
    block_s = 8 if gpu else 4
    # One program per split request (the plan lists them), not per request: a program that only
    # finds nothing to merge still costs its launch (128 heads, B=128, nothing split: 20.8 us for
    # 32768 such programs). Plans without the list (AITER's) get every tile.
    tiles = getattr(sched, "reduce_tiles", None)
    if tiles is None:
        tiles = jnp.arange(sched.reduce_final_map.shape[0], dtype=jnp.int32)
    out, lse = triton_call(
        _kernels().mla_reduce_kernel,
        part_out, part_lse, sched.reduce_indptr, sched.reduce_final_map,
        sched.reduce_partial_map, tiles, out, lse,
        grid=(tiles.shape[0], math.ceil(h / block_h), math.ceil(lr / block_l)),
        out_shapes=[jax.ShapeDtypeStruct(out.shape, out.dtype),
                    jax.ShapeDtypeStruct(lse.shape, lse.dtype)],
        input_output_aliases={6: 0, 7: 1},
        platform=platform, num_warps=4, num_stages=1,
        H=h, L=lr, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_S=block_s, MAX_ROWS=sched.qlen,
        OFF64=part_out.size >= 2**31,
    )
    return out, lse


def _kernels():
    from jax_mla.kernels.triton import decode

    return decode
