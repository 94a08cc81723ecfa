"""``backend="triton"``: the split-KV Triton kernels of ``kernels/triton/decode.py`` in jit.

On Hopper, 64-row decode tiles go to the Gluon kernel of ``kernels/gluon/decode_sm90.py``
instead (same schedule, same partials, same reduce), where it serves the call's dtypes and
geometry (:func:`sm90_supported`).

On CUDA/ROCm the kernels become native XLA custom calls through jax-triton; on CPU they run
under Triton's interpreter (CI). The split schedule comes from the metadata when it was planned
for this shape (``build_decode_metadata(..., num_heads=H)``), else it is planned here, in jnp.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jax_mla.backends import current_platform
from jax_mla.backends.triton_launch import GPU_PLATFORMS, triton_call, triton_importable
from jax_mla.cache import is_fp8
from jax_mla.config import (
    split_plan_mode,
    triton_affine_reduce,
    triton_ctas_per_sm,
    triton_decode_overrides,
    triton_l2_hints,
    triton_max_rows,
    triton_min_block_m,
    triton_reduce_block_l,
    triton_reduce_block_s,
    triton_sm90_kernel,
    triton_wg_split,
)
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
#     Since 2026-12-03 its score tile is split between the two warpgroups on Hopper (wg_split,
#     triton_ttgir.py): no spills, 225 KB, 17-29 % faster; block_n 32 (3-4 stages) and 16 warps
#     stayed slower (benchmarks/results/2026-12-03-h200-wgsplit/).
# A 32-row block is neither MMA shape. As one 32-row mma.sync block it was slowest (Q=2 at 16
# heads: 265-307 us); two 16-row blocks that share each KV tile through L2 took 200 us, and on
# Hopper one 64-row wgmma tile, half padding, with its score columns split between warpgroups
# (triton_ttgir.py) is faster again (211 against 237 us in one 2026-12-03 tune run).
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
    wg_split: bool = False  # score tile split across warpgroups (triton_ttgir.py)
    sm90: bool = False  # the Gluon two-warpgroup kernel (kernels/gluon/decode_sm90.py)


@functools.cache
def _hopper(platform: str) -> bool:
    """Whether ``platform`` is a CUDA GPU with wgmma (sm_90); assumed so when none is attached
    (ahead-of-time compile checks on CPU)."""
    if platform != "cuda":
        return False
    try:
        cc = getattr(jax.devices("cuda")[0], "compute_capability", "9.0")
    except (RuntimeError, ValueError):  # no CUDA backend in this process
        return True
    return str(cc).split(".")[0] == "9"


# The Gluon kernel for Hopper: 4 warps compile the default partition (warpgroup 0), the worker
# partition adds 4 more; the schedule hands it KV ranges in pairs of 64-token tiles.
_SM90_TILE = {"block_n": 128, "num_warps": 4, "num_stages": 1, "ctas_per_sm": 1, "sm90": True}


def kernel_config(num_heads: int, qlen: int, page_size: int, platform: str, *,
                  sm90: bool = True) -> KernelConfig:
    """Tile shape for ``H`` heads x ``Q`` tokens (see ``_GPU_TILES``; env overrides in config).

    ``sm90``: whether the Gluon kernel may serve 64-row tiles on Hopper (``decode`` passes False
    for what it cannot serve: other dtypes or geometries, see :func:`sm90_supported`).
    """
    max_rows = triton_max_rows() or _MAX_ROWS
    min_block_m = triton_min_block_m() or 16
    gpu = platform in GPU_PLATFORMS
    if gpu and not triton_max_rows() and 16 < qlen * num_heads <= 32 and qlen <= 16:
        # Neither MMA shape (see _GPU_TILES). Hopper: one 64-row wgmma tile, half of it padding;
        # elsewhere two 16-row blocks that share each KV tile through L2.
        if _hopper(platform):
            min_block_m = max(min_block_m, 64)
        elif min_block_m <= 16:
            max_rows = 16
    if qlen * num_heads <= max_rows:
        hb = num_heads
    else:
        hb = max(1, max_rows // qlen)
    nhb = -(-num_heads // hb)
    block_m = max(min_block_m, _next_pow2(qlen * hb))
    if not gpu:
        # Interpreter: small tiles keep CI fast and exercise several tiles per work.
        return KernelConfig(hb, nhb, block_m, 16, 1, 1, triton_ctas_per_sm() or 1)
    if (sm90 and block_m == 64 and _hopper(platform) and triton_sm90_kernel()
            and not triton_decode_overrides() and _gluon_available()):
        return KernelConfig(hb, nhb, block_m, **_SM90_TILE)
    tile = dict(_GPU_TILES[16 if block_m <= 16 else 64])
    tile.update(triton_decode_overrides())
    if triton_ctas_per_sm():
        tile["ctas_per_sm"] = triton_ctas_per_sm()
    # wgmma (Hopper, CUDA): two warpgroups over 64 rows would both compute the score tile.
    tile["wg_split"] = (_hopper(platform) and block_m == 64 and tile["num_warps"] in (8, 16)
                        and triton_wg_split())
    return KernelConfig(hb, nhb, block_m, **tile)


@functools.cache
def _gluon_available() -> bool:
    """Whether this triton has the Gluon pieces the sm_90 kernel uses (triton 3.6's API)."""
    try:
        import inspect

        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    params = list(inspect.signature(gl.warp_specialize).parameters)
    return params[:3] == ["functions_and_args", "worker_num_warps", "worker_num_regs"]


def sm90_supported(q_dtype, kv_dtype, kv_lora_rank: int, rope_dim: int, has_kv_scale: bool) -> bool:
    """What the Gluon sm_90 kernel serves: 16-bit Q and cache of one dtype, DeepSeek geometry."""
    return (jnp.dtype(q_dtype) == jnp.dtype(kv_dtype)
            and jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and (kv_lora_rank, rope_dim) == (512, 64) and not has_kv_scale)


def num_sms(platform: str) -> int:
    if platform in GPU_PLATFORMS:
        return int(getattr(jax.devices()[0], "core_count", 132) or 132)
    return 4


def num_programs(cfg: KernelConfig, platform: str) -> int:
    """Persistent programs per head block: the whole grid is resident at once."""
    return max(1, num_sms(platform) * cfg.ctas_per_sm // cfg.num_head_blocks)


def plan(metadata, num_heads: int, platform: str) -> SplitSchedule:
    """The split schedule this backend would use for ``metadata`` and ``num_heads``."""
    return _plan(metadata, kernel_config(num_heads, metadata.qlen, metadata.page_size, platform),
                 platform)


def _plan(metadata, cfg: KernelConfig, platform: str) -> SplitSchedule:
    return plan_splits(metadata.seq_lens, metadata.paged_kv_indptr, qlen=metadata.qlen,
                       block_n=cfg.block_n, num_programs=num_programs(cfg, platform),
                       num_head_blocks=cfg.num_head_blocks, mode=split_plan_mode())


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
        if cfg.sm90 and not sm90_supported(q.dtype, kv_cache.dtype, lr, rd, kv_scale is not None):
            cfg = kernel_config(h, md.qlen, md.page_size, platform, sm90=False)
        if is_fp8(q.dtype):  # dequantise once here; the kernel multiplies in bf16
            q = (q.astype(jnp.float32) * jnp.asarray(q_scale, jnp.float32)).astype(jnp.bfloat16)
        out_dtype = q.dtype
        sched = md.schedule
        if not (isinstance(sched, SplitSchedule) and sched.block_n == cfg.block_n
                and sched.num_head_blocks == cfg.num_head_blocks and sched.qlen == md.qlen
                and sched.num_programs == num_programs(cfg, platform)):
            sched = _plan(md, cfg, platform)
        kv = kv_cache.reshape(-1, d)
        has_scale = kv_scale is not None
        kv_scale_arr = jnp.asarray(1.0 if kv_scale is None else kv_scale, jnp.float32).reshape(1)
        interp = platform not in GPU_PLATFORMS
        upcast = interp
        prow = sched.max_works * md.qlen
        f32 = jnp.float32
        if cfg.sm90:
            kernel = _sm90_kernels().mla_decode_sm90_kernel
            consts = sm90_constexprs(cfg, num_heads=h, qlen=md.qlen, page_size=md.page_size,
                                     max_pages=md.max_pages, kv_lora_rank=lr, rope_dim=rd,
                                     scale=scale)
        else:
            kernel = _kernels().mla_decode_kernel
            consts = decode_constexprs(cfg, num_heads=h, qlen=md.qlen, page_size=md.page_size,
                                       max_pages=md.max_pages, kv_lora_rank=lr, rope_dim=rd,
                                       scale=scale, has_kv_scale=has_scale, upcast=upcast,
                                       ieee=(not upcast) and jnp.dtype(q.dtype) == jnp.float32)
        out, lse, part_out, part_lse = triton_call(
            kernel,
            q, kv, md.block_table, md.paged_kv_indptr, sched.work_indptr, sched.work_info_set,
            kv_scale_arr,
            grid=(sched.num_programs * cfg.num_head_blocks,),
            out_shapes=[jax.ShapeDtypeStruct((t_rows, h, lr), out_dtype),
                        jax.ShapeDtypeStruct((t_rows, h), f32),
                        jax.ShapeDtypeStruct((prow, h, lr), f32),
                        jax.ShapeDtypeStruct((prow, h), f32)],
            platform=platform, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **consts,
        )
        return reduce_partials(part_out, part_lse, sched, out, lse, platform=platform)


def _problem_constexprs(cfg: KernelConfig, *, num_heads, qlen, page_size, max_pages,
                        kv_lora_rank, rope_dim, scale) -> dict:
    """The compile-time arguments both decode kernels take (the same launch contract)."""
    return dict(
        QK_SCALE=float(scale * _LOG2E), H=num_heads, MAX_PAGES=max_pages, Q=qlen,
        HB=cfg.heads_per_block, NUM_HB=cfg.num_head_blocks, L=kv_lora_rank, R=rope_dim,
        PAGE_SIZE=page_size, L2_HINTS=triton_l2_hints())


def decode_constexprs(cfg: KernelConfig, *, num_heads, qlen, page_size, max_pages, kv_lora_rank,
                      rope_dim, scale, has_kv_scale=False, upcast=False, ieee=False) -> dict:
    """The decode kernel's compile-time arguments for tile ``cfg`` and one problem."""
    return _problem_constexprs(
        cfg, num_heads=num_heads, qlen=qlen, page_size=page_size, max_pages=max_pages,
        kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, scale=scale) | dict(
        BLOCK_M=cfg.block_m, BLOCK_L=_next_pow2(kv_lora_rank), BLOCK_R=_next_pow2(rope_dim),
        BLOCK_N=cfg.block_n, TILE_IN_PAGE=page_size % cfg.block_n == 0,
        HAS_KV_SCALE=has_kv_scale, UPCAST=upcast, IEEE=ieee, WG_SPLIT=cfg.wg_split)


def sm90_constexprs(cfg: KernelConfig, *, num_heads, qlen, page_size, max_pages, kv_lora_rank,
                    rope_dim, scale) -> dict:
    """The Gluon sm_90 kernel's compile-time arguments (its tiles are 64 tokens)."""
    return _problem_constexprs(
        cfg, num_heads=num_heads, qlen=qlen, page_size=page_size, max_pages=max_pages,
        kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, scale=scale) | dict(
        TILE_IN_PAGE=page_size % 64 == 0)


def _bf16_signature(consts: dict) -> dict:
    """Signature, constexprs and alignment attributes of a bf16 decode launch (both kernels take
    the same arrays), for ahead-of-time compiles."""
    names = ("q_ptr", "kv_ptr", "bt_ptr", "kv_indptr_ptr", "work_indptr_ptr", "work_ptr",
             "kv_scale_ptr", "out_ptr", "lse_ptr", "part_out_ptr", "part_lse_ptr")
    types = ["*bf16", "*bf16"] + ["*i32"] * 4 + ["*fp32", "*bf16"] + ["*fp32"] * 3
    return dict(signature=dict(zip(names, types)) | dict.fromkeys(consts, "constexpr"),
                constexprs=consts,
                attrs={(i,): [["tt.divisibility", 16]] for i in range(len(names))})


def compile_report(num_heads: int, qlen: int = 1, page_size: int = 64, *, wg_split: bool,
                   kv_lora_rank: int = 512, rope_dim: int = 64, arch: int = 90) -> dict:
    """Compile the bf16 decode kernel for ``sm_<arch>`` as jax-triton would (no GPU needed).

    The tile is the Hopper one for ``num_heads`` x ``qlen`` with ``wg_split`` forced; with it the
    TTGIR goes through ``triton_ttgir.split_broadcast_wgmma`` and is compiled from the rewritten
    text. Returns ``{"shared": bytes, "rewrites": int, "wgmma": {shape: count in the PTX},
    "ttgir": str, "ptx": str, "config": KernelConfig}``. Needs TRITON_INTERPRET unset.
    """
    import collections
    import os
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jax_mla.backends.triton_launch import interpreter_enabled
    from jax_mla.backends.triton_ttgir import split_broadcast_wgmma

    if interpreter_enabled():
        raise RuntimeError("compile_report needs TRITON_INTERPRET unset before triton is imported")
    cfg = dataclasses.replace(kernel_config(num_heads, qlen, page_size, "cuda", sm90=False),
                              wg_split=wg_split)
    consts = decode_constexprs(cfg, num_heads=num_heads, qlen=qlen, page_size=page_size,
                               max_pages=64, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                               scale=1 / 192 ** 0.5)
    src = ASTSource(fn=_kernels().mla_decode_kernel, **_bf16_signature(consts))
    target = GPUTarget("cuda", arch, 32)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cc = triton.compile(src, target=target, options=options)
    rewrites = 0
    if wg_split:
        text, rewrites = split_broadcast_wgmma(cc.asm["ttgir"])
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "mla_decode_kernel.ttgir")
            with open(path, "w") as f:
                f.write(text)
            cc = triton.compile(path, target=target, options=options)
    wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
                                           cc.asm["ptx"]))
    return dict(shared=cc.metadata.shared, rewrites=rewrites, wgmma=dict(wgmma),
                ttgir=cc.asm["ttgir"], ptx=cc.asm["ptx"], config=cfg)


def sm90_compile_report(num_heads: int, qlen: int = 1, page_size: int = 64, *,
                        arch: int = 90) -> dict:
    """Compile the bf16 Gluon sm_90 decode kernel as the backend would (no GPU needed).

    Returns ``{"shared": bytes, "num_warps": total warps, "wgmma": {shape: count in the PTX},
    "ptx": str, "config": KernelConfig}``. Needs TRITON_INTERPRET unset.
    """
    import collections
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from jax_mla.backends.triton_launch import interpreter_enabled

    if interpreter_enabled():
        raise RuntimeError("sm90_compile_report needs TRITON_INTERPRET unset")
    cfg = kernel_config(num_heads, qlen, page_size, "cuda")
    if not cfg.sm90:
        raise ValueError(f"{num_heads} heads x Q={qlen} is not served by the sm_90 kernel")
    consts = sm90_constexprs(cfg, num_heads=num_heads, qlen=qlen, page_size=page_size,
                             max_pages=64, kv_lora_rank=512, rope_dim=64, scale=1 / 192 ** 0.5)
    src = GluonASTSource(fn=_sm90_kernels().mla_decode_sm90_kernel, **_bf16_signature(consts))
    cc = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=cfg.num_warps))
    wgmma = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
                                           cc.asm["ptx"]))
    return dict(shared=cc.metadata.shared, num_warps=cc.metadata.num_warps, wgmma=dict(wgmma),
                ptx=cc.asm["ptx"], config=cfg)


def reduce_partials(part_out, part_lse, sched: SplitSchedule, out, lse, *, platform):
    """Merge split partials into ``out``/``lse`` in place (tiles with < 2 partials untouched)."""
    t_rows, h, lr = out.shape
    block_h = min(16, _next_pow2(h))
    gpu = platform in GPU_PLATFORMS
    h_blocks = math.ceil(h / block_h)
    out_shapes = [jax.ShapeDtypeStruct(out.shape, out.dtype),
                  jax.ShapeDtypeStruct(lse.shape, lse.dtype)]
    consts = dict(H=h, L=lr, BLOCK_H=block_h, OFF64=part_out.size >= 2**31,
                  L2_HINTS=triton_l2_hints())
    if isinstance(sched, SplitSchedule) and triton_affine_reduce():
        # This package's plans: one program per split request (the plan lists them; a program
        # that finds nothing to merge still costs its launch: 20.8 us at 128 heads, B=128, when
        # every request had one), each finding its consecutive partials with one load.
        tiles = sched.reduce_tiles
        block_s = reduce_block_s(sched.num_programs, sched.reduce_final_map.shape[0], gpu)
        block_l = reduce_block_l(block_s, lr, gpu)
        return triton_call(
            _kernels().mla_reduce_affine_kernel,
            part_out, part_lse, tiles, sched.reduce_tile_ptr, out, lse,
            grid=(tiles.shape[0], h_blocks, math.ceil(lr / block_l)), out_shapes=out_shapes,
            input_output_aliases={4: 0, 5: 1}, platform=platform, num_warps=4, num_stages=1,
            Q=sched.qlen, BLOCK_S=block_s, BLOCK_L=block_l, **consts)
    # [S, H, L] = 8 x 16 x 16 float32 per program on a GPU: 72 registers a thread (sm_90a), so
    # ~7 programs per SM hide the latency of each request's chain of loads (8 x 16 x 64 took 249
    # registers: 2 programs per SM, and 101 us at 128 heads, B=128).
    block_l = min(16 if gpu else 128, _next_pow2(lr))
    # Plans in AITER's layout (``rocm.planner``): any partial map, a program for every tile (for
    # this package's plans, with JAX_MLA_TRITON_AFFINE_REDUCE=0: for every split request).
    tiles = getattr(sched, "reduce_tiles", None)
    if tiles is None:
        tiles = jnp.arange(sched.reduce_final_map.shape[0], dtype=jnp.int32)
    return triton_call(
        _kernels().mla_reduce_kernel,
        part_out, part_lse, sched.reduce_indptr, sched.reduce_final_map,
        sched.reduce_partial_map, tiles, out, lse,
        grid=(tiles.shape[0], h_blocks, math.ceil(lr / block_l)), out_shapes=out_shapes,
        input_output_aliases={6: 0, 7: 1}, platform=platform, num_warps=4, num_stages=1,
        BLOCK_S=8 if gpu else 4, BLOCK_L=block_l, MAX_ROWS=sched.qlen, **consts)


def reduce_block_s(num_programs: int, batch: int, gpu: bool) -> int:
    """Partials an affine reduce program reads at once: what a request of a fixed-length batch
    splits into under the even-pieces plan, so that most requests take one round trip, and at
    most 8. (On the H200, same run, chunks of exactly the pieces were faster than one size up:
    B64 H16 S4k Q4 109.4 vs 114.6 us a call (2 vs 4), B128 S4k 167.2 vs 173.4 (2 vs 4), B64 S4k
    94.6 vs 97.4 (4 vs 8): ``benchmarks/results/2026-12-03-h200-even-plan``. Earlier,
    this kernel with chunks of 16 was 0.4-3 us slower than the general one with rounds of 8,
    e.g. B32 H16 S4k 9.3 vs 8.7 us and B8 H128 S32k 16.5 vs 13.5, where with chunks of 4-8 it
    was 17-39 % faster: ``benchmarks/results/2026-12-03-h200-affine-reduce``. Capped at 8, it
    was 12-22 % faster than the general one at those shapes too, e.g. 7.4 vs 8.7 us and 11.6 vs
    13.4: ``benchmarks/results/2026-12-03-h200-fused-merge``.)"""
    if (forced := triton_reduce_block_s()) is not None:
        return forced
    if not gpu:
        return 4
    per = max(1, num_programs // max(batch, 1))  # what the even-pieces plan cuts a request into
    return max(2, min(_next_pow2(per), 8))


def reduce_block_l(block_s: int, lr: int, gpu: bool) -> int:
    """Latent columns an affine reduce program merges: a ``[block_s, 16, block_l]`` tile of
    8 x 16 x 16 float32 on a GPU (72 registers a thread on sm_90a, ~7 programs per SM), so chunks
    of fewer partials take wider column blocks and the grid needs fewer programs."""
    if (forced := triton_reduce_block_l()) is not None:
        return forced
    if not gpu:
        return min(128, _next_pow2(lr))
    return min(16 * max(1, 8 // block_s), _next_pow2(lr))


def _sm90_kernels():
    from jax_mla.kernels.gluon import decode_sm90

    return decode_sm90


def _kernels():
    from jax_mla.kernels.triton import decode

    return decode
