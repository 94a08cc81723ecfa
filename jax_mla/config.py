"""Every environment knob jax_mla reads, in one place.

- ``JAX_MLA_POISON_OUTPUTS=1``: interpreted (CPU) kernels see their output buffers filled with
  NaN (floats) or -1 (ints) before they run, so a lane a kernel forgets to write is caught.
- ``JAX_MLA_TRITON_BLOCK_N`` / ``_WARPS`` / ``_STAGES``: override the Triton decode tile
  (for tuning sweeps; the defaults were picked on the H200).
- ``JAX_MLA_TRITON_MAX_ROWS``: most MMA rows (query tokens x heads) one decode program holds
  (default 64; tuning sweeps).
- ``JAX_MLA_TRITON_MIN_BLOCK_M``: smallest MMA tile (rows) a decode program uses, e.g. 64 to
  pad a 16-row block to one 64-row wgmma tile (tuning sweeps).
- ``JAX_MLA_TRITON_CTAS_PER_SM``: persistent decode programs per multiprocessor (default: what
  the tile's registers and shared memory allow, ``_GPU_TILES`` in ``backends/triton.py``;
  tuning sweeps).
- ``JAX_MLA_TRITON_WG_SPLIT=0``: compile the 64-row decode tile as Triton lays it out (both
  warpgroups compute the whole score tile) instead of splitting its columns between them
  (``backends/triton_ttgir.py``; default on, CUDA only; for A/B measurements).
- ``JAX_MLA_TRITON_SM90_KERNEL=0``: serve 64-row decode tiles on Hopper with the Triton kernel
  instead of the Gluon two-warpgroup kernel (``kernels/gluon/decode_sm90.py``; default on; for
  A/B measurements and as an escape hatch).
- ``JAX_MLA_TRITON_L2_HINTS=0``: store split partials with the default L2 policy instead of
  ``evict_last`` (and read them in the reduce without ``evict_first``); for A/B measurements.
- ``JAX_MLA_TRITON_AFFINE_REDUCE=0``: merge this package's split plans with the general reduce
  kernel (AITER's partial maps) instead of the one that reads their consecutive partials
  directly; for A/B measurements.
- ``JAX_MLA_TRITON_REDUCE_BLOCK_S``: partials a reduce program reads at once (default: about
  what one request splits into, ``reduce_block_s`` in ``backends/triton.py``; tuning sweeps).
- ``JAX_MLA_TRITON_REDUCE_BLOCK_L``: latent columns a reduce program of the affine kernel merges
  (default: ``reduce_block_l``, wider where chunks hold fewer partials; tuning sweeps).
- ``JAX_MLA_SPLIT_PLAN``: how the split schedule cuts the batch (``jax_mla/schedule.py``):
  ``auto`` (default) takes the even-pieces plan where it is no longer than the line plan plus
  one block, ``line`` never takes it, ``even`` takes it wherever it fits; for A/B measurements.
- ``TRITON_INTERPRET``: Triton's own switch; on CPU jax_mla sets it to 1 if triton is not yet
  imported (see ``backends/triton_launch.py``).
"""

from __future__ import annotations

import os


def poison_outputs() -> bool:
    return os.environ.get("JAX_MLA_POISON_OUTPUTS", "0") == "1"


def aiter_small_head_mode() -> str:
    """``JAX_MLA_AITER_SMALL_HEAD_MODE``: ``auto`` (default), ``gluon`` or ``asm`` (any case).

    How AITER serves fewer than 16 decode heads (vLLM's ``VLLM_ROCM_AITER_MLA_ASM_PADDING``):
    ``auto`` uses the Gluon kernel for divisors of 16 on gfx950 and padded asm otherwise,
    ``gluon`` uses Gluon wherever the arch has it, ``asm`` always pads to 16 for the asm kernel.
    """
    mode = os.environ.get("JAX_MLA_AITER_SMALL_HEAD_MODE", "auto").strip().lower() or "auto"
    if mode not in ("auto", "gluon", "asm"):
        raise ValueError(
            f"JAX_MLA_AITER_SMALL_HEAD_MODE={mode!r} must be one of 'auto', 'gluon', 'asm'"
        )
    return mode


def triton_decode_overrides() -> dict:
    """Triton decode tile overrides: ``block_n``, ``num_warps``, ``num_stages`` (those set)."""
    names = {"block_n": "JAX_MLA_TRITON_BLOCK_N", "num_warps": "JAX_MLA_TRITON_WARPS",
             "num_stages": "JAX_MLA_TRITON_STAGES"}
    return {k: int(os.environ[v]) for k, v in names.items() if os.environ.get(v)}


def triton_ctas_per_sm() -> int | None:
    v = os.environ.get("JAX_MLA_TRITON_CTAS_PER_SM")
    return int(v) if v else None


def triton_max_rows() -> int | None:
    v = os.environ.get("JAX_MLA_TRITON_MAX_ROWS")
    return int(v) if v else None


def triton_wg_split() -> bool:
    return os.environ.get("JAX_MLA_TRITON_WG_SPLIT", "1") != "0"


def triton_min_block_m() -> int | None:
    v = os.environ.get("JAX_MLA_TRITON_MIN_BLOCK_M")
    return int(v) if v else None


def triton_l2_hints() -> bool:
    return os.environ.get("JAX_MLA_TRITON_L2_HINTS", "1") != "0"


def triton_sm90_kernel() -> bool:
    return os.environ.get("JAX_MLA_TRITON_SM90_KERNEL", "1") != "0"


def triton_affine_reduce() -> bool:
    return os.environ.get("JAX_MLA_TRITON_AFFINE_REDUCE", "1") != "0"


def triton_reduce_block_s() -> int | None:
    v = os.environ.get("JAX_MLA_TRITON_REDUCE_BLOCK_S")
    return int(v) if v else None


def split_plan_mode() -> str:
    from jax_mla.schedule import PLAN_MODES

    mode = os.environ.get("JAX_MLA_SPLIT_PLAN", "auto").strip().lower() or "auto"
    if mode not in PLAN_MODES:
        raise ValueError(f"JAX_MLA_SPLIT_PLAN={mode!r} must be one of {', '.join(PLAN_MODES)}")
    return mode


def triton_reduce_block_l() -> int | None:
    v = os.environ.get("JAX_MLA_TRITON_REDUCE_BLOCK_L")
    return int(v) if v else None
