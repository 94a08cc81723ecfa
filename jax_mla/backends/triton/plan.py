"""The Triton backend's route, decided once per problem: tile, kernel, split plan, reduce.

Everything here is a pure function of the problem, the target and a frozen
:class:`TritonTuning`; the result is a :class:`TritonPlan` carried in the decode metadata
(static, part of the jit cache key). The decode call only reads it.

Rules (measured figures behind them: ``benchmarks/results/h200/RESULTS.md``):

- A program's MMA tile holds ``Q x heads-per-block`` rows, at most ``MAX_ROWS`` (the float32
  ``[rows, L]`` accumulator is what the register file bounds); more heads make more head
  blocks. Rows pack ``m = t * HB + h`` so a latent row is read once per request and head block;
  split heads take a power of two a block where that needs no more blocks (shifts, not
  divisions, in the kernel: :func:`pow2_heads_per_block`).
- 16 rows: ``mma.sync``, the KV tile double-buffered, two programs per SM. 64 rows (wgmma on
  Hopper): on Hopper the Gluon two-warpgroup kernel where it serves the dtypes and geometry
  (:func:`sm90_supported`), else the Triton tile with its score columns split between the two
  warpgroups (``compile.split_broadcast_wgmma``).
- 17..32 rows fit neither MMA shape: on Hopper one 64-row wgmma tile, half of it padding;
  elsewhere two 16-row head blocks that share each KV tile through L2.
- A float32 cache (the exact path) takes 16-row programs on every GPU. CUDA: 16-token KV tiles,
  two stages, two programs an SM (:data:`CUDA_FP32_TILE`; the 64-row tile took 304 KiB of
  shared memory). An fp8 cache's 16-row programs on CUDA take 16-token tiles at four stages,
  three programs an SM (:data:`CUDA_FP8_TILE`: the 32-token tile spilled in its conversion;
  three cut the decode kernel's time by 10 % on the H200).
- AMD Instinct has tiles of its own per architecture (:data:`ROCM_TILES`): at most 32 rows
  (16 for float32 caches), 4 warps, 16-token KV tiles, fitting gfx942's 64 KiB of LDS with no
  spills (float32 on gfx942 compiled with Triton's in-thread transpose off: ``compiler.py``).
- The grid is persistent: exactly the programs the GPU holds at once (``ctas_per_sm`` per SM).
- The reduce reads a request's partials in chunks of about what the even-pieces plan cuts a
  fixed-length request into (at most 8), over a ``[chunk, 16, columns]`` tile of 8 x 16 x 16
  floats (72 registers a thread on sm_90a: ~7 programs per SM); one head on CUDA: twice the
  columns (:data:`CUDA_ONE_HEAD_REDUCE_WIDEN`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect

import jax.numpy as jnp

from jax_mla import env
from jax_mla.backends.base import DecodePlan
from jax_mla.backends.triton.launch import LAUNCHERS, resolve_launcher
from jax_mla.backends.triton.schedule import PLAN_MODES
from jax_mla.cache import is_fp8
from jax_mla.problem import DecodeProblem, Target, as_target

LOG2E = 1.4426950408889634
MAX_ROWS = 64
PLANNERS = ("auto", "kernel", "jnp")
# CUDA tiles by MMA rows, and how many programs of that tile one multiprocessor holds at once
# (registers and shared memory from ptxas for sm_90a; tuned on the H200).
GPU_TILES = {
    16: {"block_n": 32, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 2},
    64: {"block_n": 64, "num_warps": 8, "num_stages": 2, "ctas_per_sm": 1},
}
# float32 caches (the exact path; its ``ieee`` dots run on FMA units, not tensor cores) on CUDA:
# 16-row programs, 16-token KV tiles, two stages. sm_90a (``python -m jax_mla.aot``, triton
# 3.9): 73 KiB, 48-167 registers, no spills in any of the 64 decode / verify variants, three
# programs an SM. The 16-bit tiles did not fit: 16 rows x 32 tokens x 3 stages took 182 KiB and
# spilled ~4 KB; the 64-row tile took 304 KiB (more than the 227 KiB a block may have). Three
# stages (109 KiB) spilled 8 bytes at Q = 3; 8 warps spilled 52-76 bytes at Q = 3. Chosen for
# fitting, not speed: unmeasured on the H200. Two programs an SM: under triton 3.6 (the GPU
# image's) the tile takes 180-191 registers at 16 and 128 heads, ``Q = 1, 2, 4``, and three
# would not all be resident (``python -m jax_mla.aot`` fails such a persistent grid).
CUDA_FP32_MAX_ROWS = 16
CUDA_FP32_TILE = {"block_n": 16, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 2}
# fp8 caches on CUDA at 16 rows: 16-token KV tiles, 4 stages (the 16-bit tile's 32 tokens at 3
# stages spilled 48-156 bytes at 255 registers under triton 3.9's ptxas, 12-16 under triton
# 3.6's; the fp8 -> bf16 conversion of a 32-token tile is what overflows). Converted once where
# it is loaded (``CVT_ONCE``), every 16-row variant compiles for sm_90a to 155-168 registers and
# 62-63 KiB with no spills (``python -m jax_mla.aot``, triton 3.6 and 3.9), so three fit an SM;
# on the H200 (2026-12-05, B64 H16 S4k bf16 query) three took the decode kernel from 154 to
# 138 us (the step 159 -> 146 us GPU, 180 -> 174 us stream) where the 16-bit tile lost 34 % at
# three. The 64-row fp8 tile still spills under triton 3.9 (docs/aot.md).
CUDA_FP8_TILE = {"block_n": 16, "num_warps": 4, "num_stages": 4, "ctas_per_sm": 3}
# float16 products of an fp8 cache (``fp8_f16``) take 164-173 registers at that tile: two
# programs an SM hold them (three would leave a third of the persistent grid waiting; ``python
# -m jax_mla.aot`` fails such a grid). The tile does not know the query's dtype, so an fp8
# query, whose kernel ignores the flag, runs two as well.
CUDA_FP8_F16_CTAS_PER_SM = 2
# The Triton 64-row tile of an fp8 cache on CUDA takes a multiple of this many heads a block
# (``kernel_config``; a power of two where that needs no more blocks). On an H100 (2026-12-05,
# benchmarks/results/h100/, 4k-token requests) blocks of 9, 10, 11, 14, 15, 18 and 21 heads
# were off by 0.03-0.1 in the LSE, and 8, 12, 16 and 20 met the other tilings (within 2e-6);
# Triton's interpreter is exact at all of them. Not explained (the CUDA build of the tile, or
# its compiler); the conformance suite's fp8 head-block cases check it on the GPU. Against
# powers of two alone (the rule before), 20 heads a block at 128 heads ``Q = 3`` was 1.09x
# faster and 12 at 32 heads ``Q = 5`` 1.29x. 0: no rule.
CUDA_FP8_64_HEAD_MULTIPLE = 4
# The affine reduce at one head (``BLOCK_H = 1``) on CUDA takes twice the columns: ptxas 13.x
# (triton 3.9, ``--regAllocOptLevel=2``) spilled 8 bytes at 32 registers for the narrow tiles
# (4 x 32 at Q = 5, 8 x 16 at Q = 4 and 5); the wider ones compile without spills for Q = 1..8.
CUDA_ONE_HEAD_REDUCE_WIDEN = 2
# AMD Instinct, by architecture: tiles by MMA rows that fit the CU's LDS (64 KiB on gfx90a /
# gfx942, 160 KiB on gfx950) with no spills, from ``python -m jax_mla.aot`` (triton 3.9:
# compiles, not runs; docs/aot.md). Registers bind, not LDS: a wave has 512 VGPRs (AGPRs
# included) only while a workgroup has at most 4 waves, one a SIMD; at 8 warps the compiler caps
# a wave at 256 and the CUDA 64-row tile spilled 800-1500 registers. So 4 warps, 16-token KV
# tiles and one stage (two stages spilled a register or two in fp16 and fp8); programs hold at
# most 32 rows (``ROCM_MAX_ROWS``: the 64-row tile spilled SGPRs in verify, and its Q alone took
# all 64 KiB). 250-360 VGPRs: one wave a SIMD, one program a CU. gfx950 takes the same tiles
# (its larger LDS does not lift the register bound).
_ROCM_TILES = {16: {"block_n": 16, "num_warps": 4, "num_stages": 1, "ctas_per_sm": 1},
               32: {"block_n": 16, "num_warps": 4, "num_stages": 1, "ctas_per_sm": 1}}
ROCM_TILES = {"gfx942": _ROCM_TILES, "gfx950": _ROCM_TILES}
ROCM_DEFAULT_ARCH = "gfx942"  # other or unnamed AMD architectures: the 64 KiB LDS tiles
ROCM_MAX_ROWS = 32
# float32 caches (the exact path) on ROCm: 16-row tiles (32 rows spill more), whose KV tile
# needs two LDS buffers (three stages, 73 KiB) not to spill: on gfx950; gfx942's 64 KiB holds
# one (two stages), where it fits with Triton's in-thread transpose pass off (``compiler.py``;
# with it 2-8 VGPRs spilled, docs/aot.md).
ROCM_FP32_MAX_ROWS = 16
ROCM_FP32_TILES = {
    "gfx942": {"block_n": 16, "num_warps": 4, "num_stages": 2, "ctas_per_sm": 1},
    "gfx950": {"block_n": 16, "num_warps": 4, "num_stages": 3, "ctas_per_sm": 1},
}
# The Gluon sm_90 kernel: 4 warps compile the default partition (warpgroup 0), the worker
# partition adds 4 more; the schedule hands it KV ranges in pairs of 64-token tiles.
SM90_TILE = {"block_n": 128, "num_warps": 4, "num_stages": 1, "ctas_per_sm": 1, "sm90": True}
# The interpreter (CPU): small tiles keep CI fast and exercise several tiles per work.
INTERPRETER_TILE = {"block_n": 16, "num_warps": 1, "num_stages": 1}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (``n >= 1``)."""
    return 1 << (n.bit_length() - 1)


def pow2_heads_per_block(num_heads: int, hb: int, nhb: int) -> int:
    """Heads a block when heads are split into ``nhb`` blocks of at most ``hb``: the largest
    power of two that still needs only ``nhb`` blocks, else ``hb``. Rows pack as
    ``t * HB + h``, so a power of two makes the kernel's ``m // HB`` and ``m % HB`` shifts;
    the 64-row fp8 verify tile at 16 heads, ``Q = 5..7`` (12, 10, 9 heads a block, 8 from
    here), spilled 284-664 bytes for that under triton 3.6. The block count, hence the KV
    traffic and the grid, does not change."""
    if nhb == 1:
        return hb
    p2 = prev_pow2(hb)
    return p2 if -(-num_heads // p2) == nhb else hb


@dataclasses.dataclass(frozen=True)
class TritonTuning:
    """Overrides of the Triton backend's rules (None / the default: the rule decides).

    ``block_n``, ``num_warps``, ``num_stages``: the Triton decode tile (any of them set keeps
    the Gluon kernel out); ``ctas_per_sm``: programs per SM; ``max_rows``: most MMA rows a
    program holds; ``min_block_m``: smallest MMA tile; ``wg_split``: split the 64-row Triton
    tile's score columns between warpgroups (CUDA); ``sm90_kernel``: the Gluon kernel for 64-row
    tiles on Hopper; ``l2_hints``: keep split partials in L2; ``affine_reduce``: the two-load
    reduce for this package's plans; ``reduce_block_s`` / ``reduce_block_l``: the reduce's chunk
    and column block; ``split_plan``: ``auto``, ``line`` or ``even``; ``planner``: how the split
    schedule is computed, ``kernel`` (one Triton program, ``kernels/triton/plan.py``), ``jnp``
    (XLA ops) or ``auto`` (the kernel on GPUs, jnp on CPU, where the interpreter would be slower
    than XLA); both give the same arrays, bit for bit. ``launcher``: how kernels reach XLA on GPUs,
    ``ffi`` (jax_mla's own FFI handler; a CUDA command buffer captures its launch), ``ffi_record``
    (the same handler with XLA's record stage on CUDA, which puts its launch in the command buffer
    as a kernel node: opt-in, it changed no stream time on an H100), ``jax_triton`` or ``auto``
    (``launch.resolve_launcher``). ``pdl``: programmatic dependent launch of the Triton decode and
    reduce kernels on Hopper (each may be launched while the kernel before it finishes, and waits
    for it before touching memory; off: on the H200 it changed neither GPU nor stream time beyond
    noise). ``fp8_f16``: an fp8 cache's products in float16 on CUDA (and the interpreter): the cache
    converts to float16 in one instruction a pair, to bf16 in about four; bf16 query rows are scaled
    by a power of two each to fit float16 exactly (``kernels/triton/decode.py``, ``_to_f16_rows``).
    Off: on the H200 it was slower than bf16 products at three programs an SM, which float16
    products do not fit. ``fp8_qk``: an fp8 query against an fp8 cache in fp8 products on CUDA (and
    the interpreter): the scores are exact products of the stored values, nothing of the cache
    converted for them; the values go to float16 for ``P @ V``. On by default; off: the query is
    dequantised to bf16 first (an XLA kernel before the decode kernel, and bf16 products), as
    before. ``fp8_convert_once``: on CUDA an fp8 cache's tile is converted to 16 bits once, in the
    layout it was loaded in, and reaches both products through shared memory (``CVT_ONCE`` in
    ``kernels/triton/decode.py``); off: Triton's own placement (converted per operand, the ``V``
    operand read a byte at a time). On by default. ``pow2_head_blocks``: split heads take a power of
    two a block where that needs no more blocks (:func:`pow2_heads_per_block`); off: as many as the
    rows allow. On by default. ``sm90_fp8``: an fp8 query against an fp8 cache on Hopper through the
    Gluon two-warpgroup kernel (``kernels/gluon/decode_sm90_fp8.py``: fp8 wgmma scores, ``V`` in
    float16) where the 64-row tile serves it; off: the Triton 64-row tile. On by default (on an
    H100, 2026-12-05: 1.32-1.45x faster than the Triton tile at four shapes). ``sm90_split_q``: a
    16-bit query against an fp8 cache through the same Gluon kernel, the query split into two e4m3
    parts and a power-of-two scale a row (``decode.split_query_e4m3``, XLA's ops: exact for a bf16
    query but for elements under ``2^-8`` of their row's largest), so the scores are fp8 products
    too; off: the Triton tiles (bf16 products of the converted tile). None (the default): on where
    the installed Triton is one under which the kernel compiles without spills
    (:data:`SPLIT_Q_TRITON`: 3.6 and 3.9; on an H100, 2026-12-06, it met the oracle and took
    0.66-0.76x the Triton tiles' stream time at five shapes); under other Tritons only in place of
    the Triton 64-row tile (which triton 3.9 spills inside its KV loop); True / False force it.
    ``split_q_kernel``: that split made by one Triton kernel (``kernels/triton/split_query.py``, the
    same values) instead of XLA ops, which took four kernels and 49.6 µs at B128 H128 on an H100. On
    by default (on an H100, 2026-12-07, same run: outputs bit for bit those of XLA's split, GPU time
    3.8 % / 6.3 % and stream time 1.3 % / 7.2 % lower at B64 H16 S4k / B128 H128 S4k).
    ``split_acc``: with the split, the low part's products summed in an accumulator of their own and
    added to the high part's after the MMAs' wait (the kernel's ``SPLIT_ACC``); on an H100
    (2026-12-07, ``bench.split_probe``) the LSE's largest error against the oracle fell from 3.5e-3
    / 8.2e-3 to 1.1e-3 / 1.5e-3 at two ragged shapes (8-bit wgmma is said to accumulate with fewer
    bits than float32); off by default (same run: 2.4 % / 1.6 % more GPU time and 5.7 % / 2.2 % more
    stream time at those shapes, for an answer already within its bounds).
    ``one_call``: the decode kernel and the reduce after it launched by one
    custom call (``launch.triton_sequence``; with the ``ffi`` launcher, one command of XLA's
    instead of two); off: two custom calls. Other launchers run the two in turn either way. On by
    default (on an H200, 2026-12-07: outputs bit for bit those of two calls; runs in flight at
    B1 H128 S1k 15.1 µs a call against 19.4, level elsewhere within the run's noise).
    """

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    ctas_per_sm: int | None = None
    max_rows: int | None = None
    min_block_m: int | None = None
    wg_split: bool = True
    sm90_kernel: bool = True
    l2_hints: bool = True
    affine_reduce: bool = True
    reduce_block_s: int | None = None
    reduce_block_l: int | None = None
    split_plan: str = "auto"
    planner: str = "auto"
    launcher: str = "auto"
    pdl: bool = False
    fp8_f16: bool = False
    fp8_qk: bool = True
    fp8_convert_once: bool = True
    pow2_head_blocks: bool = True
    sm90_fp8: bool = True
    sm90_split_q: bool | None = None
    split_q_kernel: bool = True
    split_acc: bool = False
    one_call: bool = True

    def __post_init__(self):
        if self.split_plan not in PLAN_MODES:
            raise ValueError(f"split_plan={self.split_plan!r} must be one of {PLAN_MODES}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner={self.planner!r} must be one of {PLANNERS}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r} must be one of {LAUNCHERS}")

    @classmethod
    def from_env(cls) -> TritonTuning:
        """The knobs of ``jax_mla.env`` (read now, once per plan)."""
        return cls(
            block_n=env.read_int("JAX_MLA_TRITON_BLOCK_N"),
            num_warps=env.read_int("JAX_MLA_TRITON_WARPS"),
            num_stages=env.read_int("JAX_MLA_TRITON_STAGES"),
            ctas_per_sm=env.read_int("JAX_MLA_TRITON_CTAS_PER_SM"),
            max_rows=env.read_int("JAX_MLA_TRITON_MAX_ROWS"),
            min_block_m=env.read_int("JAX_MLA_TRITON_MIN_BLOCK_M"),
            wg_split=env.read_flag("JAX_MLA_TRITON_WG_SPLIT", True),
            sm90_kernel=env.read_flag("JAX_MLA_TRITON_SM90_KERNEL", True),
            l2_hints=env.read_flag("JAX_MLA_TRITON_L2_HINTS", True),
            affine_reduce=env.read_flag("JAX_MLA_TRITON_AFFINE_REDUCE", True),
            reduce_block_s=env.read_int("JAX_MLA_TRITON_REDUCE_BLOCK_S"),
            reduce_block_l=env.read_int("JAX_MLA_TRITON_REDUCE_BLOCK_L"),
            split_plan=split_plan_mode(),
            planner=env.read_choice("JAX_MLA_TRITON_PLANNER", PLANNERS, "auto"),
            launcher=env.read_choice("JAX_MLA_TRITON_LAUNCHER", LAUNCHERS, "auto"),
            pdl=env.read_flag("JAX_MLA_TRITON_PDL", False),
            fp8_f16=env.read_flag("JAX_MLA_TRITON_FP8_F16", False),
            fp8_qk=env.read_flag("JAX_MLA_TRITON_FP8_QK", True),
            fp8_convert_once=env.read_flag("JAX_MLA_TRITON_FP8_CONVERT_ONCE", True),
            pow2_head_blocks=env.read_flag("JAX_MLA_TRITON_POW2_HEAD_BLOCKS", True),
            sm90_fp8=env.read_flag("JAX_MLA_TRITON_SM90_FP8", True),
            sm90_split_q=env.read_flag("JAX_MLA_TRITON_SM90_SPLIT_Q", None),
            split_q_kernel=env.read_flag("JAX_MLA_TRITON_SPLIT_Q_KERNEL", True),
            split_acc=env.read_flag("JAX_MLA_TRITON_SPLIT_ACC", False),
            one_call=env.read_flag("JAX_MLA_TRITON_ONE_CALL", True),
        )

    @property
    def tile_overrides(self) -> dict:
        names = ("block_n", "num_warps", "num_stages")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


def split_plan_mode() -> str:
    """``JAX_MLA_SPLIT_PLAN``: how the split schedule cuts the batch (``auto`` by default)."""
    return env.read_choice("JAX_MLA_SPLIT_PLAN", PLAN_MODES, "auto")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One decode launch configuration (static)."""

    heads_per_block: int  # HB
    num_head_blocks: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int = 1
    wg_split: bool = False  # score tile split across warpgroups (compile.py)
    sm90: bool = False  # the Gluon two-warpgroup kernel (kernels/gluon/decode_sm90.py)
    l2_hints: bool = True  # split partials stored evict_last (read evict_first by the reduce)
    pdl: bool = False  # programmatic dependent launch (the Triton kernel on Hopper)


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    """How split partials are merged: the kernel and its tile (static)."""

    affine: bool  # the two-load kernel for this package's consecutive partials
    block_s: int  # partials a program reads at once
    block_l: int  # latent columns a program merges
    l2_hints: bool
    pdl: bool = False  # programmatic dependent launch (Hopper)


@dataclasses.dataclass(frozen=True)
class TritonPlan(DecodePlan):
    """The Triton backend's route for one problem.

    Attributes (besides :class:`~jax_mla.backends.DecodePlan`'s):
      kernel: the decode launch configuration.
      num_programs: persistent programs per head block.
      split_mode: the split schedule's mode (``auto``, ``line`` or ``even``).
      planner: ``kernel`` or ``jnp``: how the split schedule is computed.
      launcher: ``ffi``, ``jax_triton`` (GPUs) or ``interpret`` (CPU): how kernels are launched.
      reduce: the reduce's kernel and tile.
      tuning: the overrides the plan was made with.
    """

    kernel: KernelConfig = None
    num_programs: int = 1
    split_mode: str = "auto"
    planner: str = "jnp"
    launcher: str = "interpret"
    reduce: ReduceConfig = None
    tuning: TritonTuning = None

    @property
    def interpret(self) -> bool:
        return not self.problem.target.gpu

    def mismatches(self, problem: DecodeProblem) -> list[str]:
        out = super().mismatches(problem)
        if self.kernel.sm90 and problem.has_kv_scale and not is_fp8(problem.kv_dtype):
            out.append("has_kv_scale: planned False (the Hopper kernel takes none), call True")
        return out


@functools.cache
def gluon_available() -> bool:
    """Whether this triton has the Gluon pieces the sm_90 kernel uses (triton 3.6's API)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    params = list(inspect.signature(gl.warp_specialize).parameters)
    return params[:3] == ["functions_and_args", "worker_num_warps", "worker_num_regs"]


def sm90_supported(q_dtype, kv_dtype, kv_lora_rank: int, rope_dim: int, has_kv_scale: bool,
                   *, fp8: bool = False, split_q: bool = False) -> bool:
    """What the Gluon sm_90 kernels serve, DeepSeek geometry only: a 16-bit query and cache of
    one dtype with no cache scale (``kernels/gluon/decode_sm90.py``); with ``fp8`` an fp8
    query against an fp8 cache, scales allowed (``decode_sm90_fp8.py``, fp8 scores), and with
    ``split_q`` a 16-bit query against an fp8 cache (the same kernel, the query split in two
    e4m3 parts)."""
    if (kv_lora_rank, rope_dim) != (512, 64):
        return False
    if is_fp8(q_dtype) and is_fp8(kv_dtype):
        return fp8
    sixteen = jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if is_fp8(kv_dtype):
        return split_q and sixteen
    return sixteen and jnp.dtype(q_dtype) == jnp.dtype(kv_dtype) and not has_kv_scale


def sm90_fp8(tuning: TritonTuning, page_size: int) -> bool:
    """Whether the Gluon fp8 kernel may serve an fp8 query and cache at ``page_size``
    (``TritonTuning.sm90_fp8`` and fp8 scores, ``fp8_qk``, both on; a page size
    :func:`sm90_fp8_page_size` allows)."""
    return bool(tuning.sm90_fp8 and tuning.fp8_qk and tuning.sm90_kernel
                and sm90_fp8_page_size(page_size))


# Triton releases (major, minor) under whose compiler the split-query kernel
# (``TritonTuning.sm90_split_q``) compiles for sm_90 without spills, so the default takes it at
# every row count: 3.6, the GPU image's, which ran it (H100, 2026-12-06), and 3.9 since the
# kernel stopped holding loop-invariant rows through its loops (2026-12-06: it had spilled up to
# 232 bytes under 3.9's ptxas; ``tests/test_gluon_sm90.py`` checks this table against the
# compiler it runs). Under other Tritons the default takes it only in place of the Triton 64-row
# tile, which spills 524-932 bytes under 3.9, 29-43 spill instructions inside its KV loop.
SPLIT_Q_TRITON = ((3, 6), (3, 9))


@functools.cache
def triton_release() -> tuple[int, int] | None:
    """The installed Triton's (major, minor), or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def sm90_split_q(tuning: TritonTuning, page_size: int, tile_rows: int) -> bool:
    """Whether the Gluon fp8 kernel may serve a 16-bit query against an fp8 cache at
    ``page_size`` (``TritonTuning.sm90_split_q``; the page sizes of
    :func:`sm90_fp8_page_size`). By default: where the installed Triton is in
    :data:`SPLIT_Q_TRITON`, or in place of the Triton 64-row tile (``tile_rows``: the rows of
    the Triton tile the problem would take otherwise)."""
    want = tuning.sm90_split_q
    if want is None:
        want = triton_release() in SPLIT_Q_TRITON or tile_rows >= 64
    return bool(want and tuning.sm90_kernel and sm90_fp8_page_size(page_size))


def sm90_fp8_page_size(page_size: int) -> bool:
    """Page sizes the Gluon fp8 kernel serves: 1, 16 and multiples of 64. Its registers are at
    the limit under triton 3.9's ptxas: pages of 2-8 tokens (a table read a row) spilled 72-148
    bytes, 32 tokens 16 bytes (2026-12-05, CPU); those take the Triton 64-row tile."""
    return page_size in (1, 16) or page_size % 64 == 0


def rocm_tile(arch: str | None, rows: int, fp32: bool) -> dict:
    """The AMD tile for a program of ``rows`` MMA rows on ``arch`` (:data:`ROCM_TILES`, or
    :data:`ROCM_FP32_TILES` for a float32 cache; other architectures take gfx942's)."""
    if fp32:
        return ROCM_FP32_TILES.get(arch, ROCM_FP32_TILES[ROCM_DEFAULT_ARCH])
    return ROCM_TILES.get(arch, ROCM_TILES[ROCM_DEFAULT_ARCH])[16 if rows <= 16 else 32]


def pdl_enabled(target, tuning: TritonTuning) -> bool:
    """Programmatic dependent launch: asked for, and a Hopper GPU (``griddepcontrol``)."""
    target = as_target(target)
    return bool(tuning.pdl) and target.platform == "cuda" and target.hopper


def kernel_config(num_heads: int, qlen: int, page_size: int, target, *, sm90: bool = True,
                  tuning: TritonTuning | None = None, kv_dtype=None) -> KernelConfig:
    """The decode tile for ``H`` heads x ``Q`` tokens on ``target`` (see the module's rules).

    ``sm90``: whether the Gluon kernel may serve 64-row tiles on Hopper (False where it cannot
    serve the call's dtypes or geometry). ``tuning`` defaults to the environment's.
    ``kv_dtype``: the cache's dtype (None: a 16-bit one); on ROCm a float32 cache takes 16-row
    tiles, others at most 32 rows.
    """
    target = as_target(target)
    tuning = TritonTuning.from_env() if tuning is None else tuning
    rocm = target.platform == "rocm"
    fp32 = kv_dtype is not None and jnp.dtype(kv_dtype).itemsize >= 4
    fp8 = kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1
    cuda_fp32 = fp32 and target.platform == "cuda"
    max_rows = tuning.max_rows or MAX_ROWS
    if rocm and not tuning.max_rows:
        max_rows = ROCM_FP32_MAX_ROWS if fp32 else ROCM_MAX_ROWS
    elif cuda_fp32 and not tuning.max_rows:
        max_rows = CUDA_FP32_MAX_ROWS
    min_block_m = tuning.min_block_m or 16
    if (target.gpu and not tuning.max_rows and 16 < qlen * num_heads <= 32 and qlen <= 16
            and not cuda_fp32):
        if target.hopper:
            min_block_m = max(min_block_m, 64)
        elif min_block_m <= 16:
            max_rows = 16
    if (fp8 and sm90 and target.hopper and tuning.sm90_kernel and not tuning.max_rows
            and not tuning.tile_overrides and qlen * num_heads <= 16):
        # An fp8 cache the Gluon fp8 kernel serves: its 64-row programs beat the Triton 16-row
        # tile however few rows are real (fp8 products, V converted once a tile; on an H100,
        # 2026-12-06, B64 H16 S4k fp8 query: 91.9 against 186.8 µs).
        min_block_m = max(min_block_m, 64)
    hb = num_heads if qlen * num_heads <= max_rows else max(1, max_rows // qlen)
    nhb = -(-num_heads // hb)
    if tuning.pow2_head_blocks:
        hb = pow2_heads_per_block(num_heads, hb, nhb)
    block_m = max(min_block_m, next_pow2(qlen * hb))
    k = CUDA_FP8_64_HEAD_MULTIPLE
    if (k and tuning.pow2_head_blocks and fp8 and target.platform == "cuda" and block_m == 64
            and hb % k and hb > k):
        # The tile stays: with at most 16 tokens a program (hb >= 4), a block keeps over 32 rows
        # (``hb - hb % 4 > hb / 2`` for hb > 4), or the tile was padded to 64.
        hb -= hb % k
        nhb = -(-num_heads // hb)
        hb = pow2_heads_per_block(num_heads, hb, nhb)
        nhb = -(-num_heads // hb)
    common = dict(heads_per_block=hb, num_head_blocks=nhb, block_m=block_m,
                  l2_hints=tuning.l2_hints, pdl=pdl_enabled(target, tuning))
    if not target.gpu:
        return KernelConfig(**common, **INTERPRETER_TILE, ctas_per_sm=tuning.ctas_per_sm or 1)
    if (sm90 and block_m == 64 and target.hopper and tuning.sm90_kernel
            and not tuning.tile_overrides and gluon_available()):
        return KernelConfig(**common, **SM90_TILE)
    if rocm:
        tile = dict(rocm_tile(target.arch, block_m, fp32))
    elif cuda_fp32:
        tile = dict(CUDA_FP32_TILE)
    elif fp8 and block_m <= 16:
        tile = dict(CUDA_FP8_TILE)
        if tuning.fp8_f16:
            tile["ctas_per_sm"] = CUDA_FP8_F16_CTAS_PER_SM
    else:
        tile = dict(GPU_TILES[16 if block_m <= 16 else 64])
    tile.update(tuning.tile_overrides)
    if tuning.ctas_per_sm:
        tile["ctas_per_sm"] = tuning.ctas_per_sm
    # wgmma (Hopper): two warpgroups over 64 rows would both compute the whole score tile.
    tile["wg_split"] = (target.hopper and block_m == 64 and tile["num_warps"] in (8, 16)
                        and tuning.wg_split)
    return KernelConfig(**common, **tile)


def num_programs(cfg: KernelConfig, target) -> int:
    """Persistent programs per head block: the whole grid is resident at once."""
    return max(1, as_target(target).num_cores * cfg.ctas_per_sm // cfg.num_head_blocks)


def reduce_block_s(num_programs: int, batch: int, gpu: bool,
                   tuning: TritonTuning | None = None) -> int:
    """Partials an affine reduce program reads at once: what a request of a fixed-length batch
    splits into under the even-pieces plan, so most requests take one round trip; 2 to 8."""
    tuning = TritonTuning.from_env() if tuning is None else tuning
    if tuning.reduce_block_s is not None:
        return tuning.reduce_block_s
    if not gpu:
        return 4
    per = max(1, num_programs // max(batch, 1))
    return max(2, min(next_pow2(per), 8))


def reduce_block_l(block_s: int, lr: int, gpu: bool, tuning: TritonTuning | None = None) -> int:
    """Latent columns an affine reduce program merges: a ``[block_s, 16, block_l]`` tile of
    8 x 16 x 16 float32 on a GPU, so chunks of fewer partials take wider column blocks."""
    tuning = TritonTuning.from_env() if tuning is None else tuning
    if tuning.reduce_block_l is not None:
        return tuning.reduce_block_l
    if not gpu:
        return min(128, next_pow2(lr))
    return min(16 * max(1, 8 // block_s), next_pow2(lr))


def reduce_config(programs: int, batch: int, kv_lora_rank: int, target: Target,
                  tuning: TritonTuning, num_heads: int | None = None) -> ReduceConfig:
    """The reduce for this package's plans: the affine kernel's chunk and columns, or with
    ``tuning.affine_reduce`` off the general kernel's tile. ``num_heads``: one head on CUDA
    takes :data:`CUDA_ONE_HEAD_REDUCE_WIDEN` times the columns (None: as for many heads)."""
    if not tuning.affine_reduce:
        return general_reduce_config(kv_lora_rank, target, tuning.l2_hints)
    block_s = reduce_block_s(programs, batch, target.gpu, tuning)
    block_l = reduce_block_l(block_s, kv_lora_rank, target.gpu, tuning)
    if num_heads == 1 and target.platform == "cuda" and tuning.reduce_block_l is None:
        block_l = min(block_l * CUDA_ONE_HEAD_REDUCE_WIDEN, next_pow2(kv_lora_rank))
    return ReduceConfig(affine=True, block_s=block_s, block_l=block_l, l2_hints=tuning.l2_hints,
                        pdl=pdl_enabled(target, tuning))


def general_reduce_config(kv_lora_rank: int, target: Target, l2_hints: bool = True
                          ) -> ReduceConfig:
    """The general reduce (any partial map, e.g. AITER's plans): rounds of 8 partials (4 in the
    interpreter) over 16 latent columns on a GPU, a ``[8, 16, 16]`` float32 tile."""
    gpu = target.gpu
    return ReduceConfig(affine=False, block_s=8 if gpu else 4,
                        block_l=min(16 if gpu else 128, next_pow2(kv_lora_rank)),
                        l2_hints=l2_hints)


def make_plan(name: str, problem: DecodeProblem, tuning: TritonTuning | None = None
              ) -> TritonPlan:
    """The :class:`TritonPlan` for ``problem`` (``tuning``: the environment's by default)."""
    tuning = TritonTuning.from_env() if tuning is None else tuning
    p, target = problem, problem.target
    # The Triton tile a 16-bit query against an fp8 cache would take otherwise (its rows decide
    # the split-query default, :func:`sm90_split_q`).
    tile_rows = kernel_config(p.num_heads, p.qlen, p.page_size, target, sm90=False,
                              tuning=tuning, kv_dtype=p.kv_dtype).block_m
    sm90 = sm90_supported(p.q_dtype, p.kv_dtype, p.kv_lora_rank, p.rope_dim, p.has_kv_scale,
                          fp8=sm90_fp8(tuning, p.page_size),
                          split_q=sm90_split_q(tuning, p.page_size, tile_rows))
    cfg = kernel_config(p.num_heads, p.qlen, p.page_size, target, sm90=sm90, tuning=tuning,
                        kv_dtype=p.kv_dtype)
    programs = num_programs(cfg, target)
    # "auto": one planning program on GPUs (a few microseconds); XLA ops under the interpreter.
    planner = tuning.planner if tuning.planner != "auto" else "kernel" if target.gpu else "jnp"
    return TritonPlan(
        backend=name, problem=problem, padded_heads=p.num_heads, kernel=cfg,
        num_programs=programs, split_mode=tuning.split_plan, planner=planner,
        launcher=resolve_launcher(target, tuning.launcher),
        reduce=reduce_config(programs, p.num_seqs, p.kv_lora_rank, target, tuning,
                             num_heads=p.num_heads),
        tuning=tuning)
