"""Every environment variable jax_mla reads, in one table, read in one place.

Tuning knobs are read once, when a plan is built (``build_decode_metadata``, or
``mla_attention`` planning for metadata built without one), into the frozen tuning object of
that plan; the plan is part of the jit cache key, so changing a variable changes the plan of the
next metadata built and never a compiled program already traced. Passing ``tuning=`` to
``build_decode_metadata`` does the same without the environment.

The table (``docs/tuning.md`` has it too); Triton decode knobs override the rules of
``jax_mla/backends/triton/plan.py``:

- ``JAX_MLA_TRITON_BLOCK_N`` / ``_WARPS`` / ``_STAGES``: the Triton decode tile (any set keeps
  the Gluon kernel out).
- ``JAX_MLA_TRITON_CTAS_PER_SM``: persistent decode programs per multiprocessor.
- ``JAX_MLA_TRITON_MAX_ROWS``: most MMA rows (query tokens x heads) a program holds (64).
- ``JAX_MLA_TRITON_MIN_BLOCK_M``: smallest MMA tile in rows (16).
- ``JAX_MLA_TRITON_WG_SPLIT=0``: the 64-row Triton tile without its warpgroup column split.
- ``JAX_MLA_TRITON_SM90_KERNEL=0``: 64-row tiles on Hopper run Triton, not the Gluon kernel.
- ``JAX_MLA_TRITON_L2_HINTS=0``: split partials with the default L2 policy.
- ``JAX_MLA_TRITON_AFFINE_REDUCE=0``: this package's plans merged by the general reduce.
- ``JAX_MLA_TRITON_REDUCE_BLOCK_S`` / ``_BLOCK_L``: the reduce's chunk and column block.
- ``JAX_MLA_SPLIT_PLAN``: the split schedule, ``auto`` (default), ``line`` or ``even``.
- ``JAX_MLA_TRITON_PLANNER``: how it is computed, ``auto`` (default), ``kernel`` or ``jnp``.
- ``JAX_MLA_TRITON_LAUNCHER``: how Triton kernels reach XLA on GPUs, ``auto`` (default), ``ffi``,
  ``ffi_record`` (the FFI handler with XLA's record stage on CUDA) or ``jax_triton``.
- ``JAX_MLA_TRITON_PDL=1``: programmatic dependent launch of the Triton decode and reduce kernels
  on Hopper (off by default).
- ``JAX_MLA_TRITON_FP8_F16=1``: an fp8 cache's products in float16 rather than bf16 (CUDA; off
  by default).
- ``JAX_MLA_TRITON_FP8_QK=0``: an fp8 query is dequantised to bf16 before an fp8 cache's
  products, rather than multiplied as it is (CUDA).
- ``JAX_MLA_TRITON_FP8_CONVERT_ONCE=0``: an fp8 cache's tile is converted where Triton places
  it (per product), rather than once where it was loaded (CUDA).
- ``JAX_MLA_TRITON_POW2_HEAD_BLOCKS=0``: split heads take as many a block as the rows allow,
  rather than a power of two where that needs no more blocks.
- ``JAX_MLA_TRITON_SM90_FP8=0``: an fp8 query against an fp8 cache takes the Triton 64-row
  tile on Hopper rather than the Gluon two-warpgroup kernel (fp8 wgmma scores).
- ``JAX_MLA_TRITON_SM90_SPLIT_Q=0`` / ``=1``: a 16-bit query against an fp8 cache takes the
  Triton tiles on Hopper (0), or the Gluon fp8 kernel with the query split in two e4m3 parts
  (1). Unset: the Gluon kernel where the installed Triton compiles it without spills
  (``plan.SPLIT_Q_TRITON``), elsewhere only in place of the Triton 64-row tile.
- ``JAX_MLA_TRITON_SPLIT_Q_KERNEL=0``: that split made by XLA ops rather than one Triton kernel
  (the same values; the kernel is the default since it was timed on an H100).
- ``JAX_MLA_TRITON_SPLIT_ACC=1``: with that split, the low part's products summed in an
  accumulator of their own and added after the MMAs (an LSE error 3.2-5.5x smaller for 1.6-2.4 %
  more GPU time on an H100; off by default).
- ``JAX_MLA_TRITON_ONE_CALL=0``: the decode kernel and its reduce as two custom calls rather
  than one launch sequence (``launch.triton_sequence``, the default since it ran on an H200).
- ``JAX_MLA_FFI_LIBRARY``: path of the FFI launcher library (default: the one built at install).
- ``JAX_MLA_FFI_COMMAND_BUFFERS=0``: our FFI targets are registered without the command-buffer
  trait, so XLA launches them outside its command buffers (a measurement knob; read when the
  targets are first registered).
- ``JAX_MLA_FFI_INITIALIZE_STAGE=1``: our GPU targets also register an initialize stage that
  loads each kernel's module before the first launch; XLA then calls it for every call on every
  execution (a measurement knob; read when the targets are first registered).
- ``JAX_MLA_FFI_PRELOAD=0``: kernels are not loaded when their launch is traced, only at their
  first call (possibly inside XLA's capture of a command buffer; a knob to check that path).
- ``JAX_MLA_CACHE_DIR``: where compiled kernels are kept (default ``~/.cache/jax_mla``).
- ``JAX_MLA_AITER_SMALL_HEAD_MODE``: AITER below 16 heads, ``auto`` (default), ``gluon``, ``asm``.
- ``JAX_MLA_AITER_ALLOW_KNOWN_BAD``: AITER kernels of the known-bad table
  (``backends/aiter/known_bad.py``) that routes may launch anyway: comma-separated kernel names,
  or ``all`` (for an AITER with the fix); unset: each is routed around.
- ``JAX_MLA_POISON_OUTPUTS=1``: interpreted (CPU) kernels see their outputs filled with NaN / -1
  before they run (tests; read at run time, not planning).
- ``TRITON_INTERPRET``: Triton's own switch; on a CPU host jax_mla sets it to ``1`` when triton
  is not yet imported.

Multi-process runs (:func:`jax_mla.distributed.initialize`, read when it is called; ``python -m
jax_mla.launch`` sets the first four for every process it starts, and the heartbeat timeout
when given; docs/dcp.md, *Across processes and hosts*):

- ``JAX_MLA_COORDINATOR``: ``host:port`` of the coordinator service process 0 starts.
- ``JAX_MLA_NUM_PROCESSES`` / ``JAX_MLA_PROCESS_ID``: the number of processes and this one's id
  (``0 .. N - 1``).
- ``JAX_MLA_LOCAL_DEVICE_IDS``: comma-separated GPUs this process drives (e.g. ``2,3``); unset:
  all it sees. Ignored on CPU.
- ``JAX_MLA_HEARTBEAT_TIMEOUT``: seconds without a heartbeat after which a process counts as dead
  and every other process stops with an error naming it (default 100, jax's).
- ``JAX_MLA_INIT_TIMEOUT`` / ``JAX_MLA_SHUTDOWN_TIMEOUT``: seconds to wait for every process to
  connect / to reach the shutdown barrier (default 300 each, jax's).
- ``JAX_MLA_GLOO_HOSTNAME``: address the CPU (gloo) collectives listen on (default: the
  coordinator's host when it is a loopback address, else gloo's choice, the host name's address).
- ``JAX_MLA_COORDINATOR_PORT``: the coordinator's port under torchrun (default ``MASTER_PORT +
  1``: torchrun's own store holds ``MASTER_PORT``).
- Read, not ours: torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``; and whether a cluster jax detects by itself is present (``SLURM_JOB_ID``,
  ``OMPI_MCA_orte_hnp_uri``, ``JAX_COORDINATOR_ADDRESS``).

Nothing else in the package reads ``os.environ`` for jax_mla's own settings.
"""

from __future__ import annotations

import os

ENV_VARS = (
    "JAX_MLA_TRITON_BLOCK_N", "JAX_MLA_TRITON_WARPS", "JAX_MLA_TRITON_STAGES",
    "JAX_MLA_TRITON_CTAS_PER_SM", "JAX_MLA_TRITON_MAX_ROWS", "JAX_MLA_TRITON_MIN_BLOCK_M",
    "JAX_MLA_TRITON_WG_SPLIT", "JAX_MLA_TRITON_SM90_KERNEL", "JAX_MLA_TRITON_L2_HINTS",
    "JAX_MLA_TRITON_AFFINE_REDUCE", "JAX_MLA_TRITON_REDUCE_BLOCK_S",
    "JAX_MLA_TRITON_REDUCE_BLOCK_L", "JAX_MLA_SPLIT_PLAN", "JAX_MLA_TRITON_PLANNER",
    "JAX_MLA_TRITON_LAUNCHER", "JAX_MLA_TRITON_PDL", "JAX_MLA_TRITON_FP8_F16",
    "JAX_MLA_TRITON_FP8_QK", "JAX_MLA_TRITON_FP8_CONVERT_ONCE", "JAX_MLA_TRITON_POW2_HEAD_BLOCKS",
    "JAX_MLA_TRITON_SM90_FP8", "JAX_MLA_TRITON_SM90_SPLIT_Q", "JAX_MLA_TRITON_SPLIT_Q_KERNEL",
    "JAX_MLA_TRITON_SPLIT_ACC", "JAX_MLA_TRITON_ONE_CALL", "JAX_MLA_FFI_LIBRARY",
    "JAX_MLA_FFI_COMMAND_BUFFERS",
    "JAX_MLA_FFI_INITIALIZE_STAGE", "JAX_MLA_FFI_EMBED_BINARIES",
    "JAX_MLA_FFI_PRELOAD",
    "JAX_MLA_CACHE_DIR",
    "JAX_MLA_AITER_SMALL_HEAD_MODE", "JAX_MLA_AITER_ALLOW_KNOWN_BAD",
    "JAX_MLA_POISON_OUTPUTS", "TRITON_INTERPRET",
    "JAX_MLA_COORDINATOR", "JAX_MLA_NUM_PROCESSES", "JAX_MLA_PROCESS_ID",
    "JAX_MLA_LOCAL_DEVICE_IDS", "JAX_MLA_HEARTBEAT_TIMEOUT", "JAX_MLA_INIT_TIMEOUT",
    "JAX_MLA_SHUTDOWN_TIMEOUT", "JAX_MLA_GLOO_HOSTNAME", "JAX_MLA_COORDINATOR_PORT",
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "JAX_COORDINATOR_ADDRESS",
)


def _get(name: str, environ=None) -> str | None:
    """``name``'s value stripped, None when unset or blank; from ``environ`` (a mapping) when
    given, else the process environment."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not in jax_mla's table of environment variables")
    v = (os.environ if environ is None else environ).get(name)
    return v.strip() if v is not None and v.strip() else None


def read_str(name: str, environ=None) -> str | None:
    """The text in ``name``, or None when unset or empty."""
    return _get(name, environ)


def read_int(name: str, environ=None) -> int | None:
    """The integer in ``name``, or None when unset or empty."""
    v = _get(name, environ)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} must be an integer") from None


def read_flag(name: str, default: bool) -> bool:
    """``0`` turns a default-on knob off; anything else set turns a default-off knob on."""
    v = _get(name)
    if v is None:
        return default
    return v != "0"


def read_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of ``choices`` (case and surrounding blanks ignored), or a clear error."""
    v = (_get(name) or default).lower()
    if v not in choices:
        raise ValueError(f"{name}={v!r} must be one of {', '.join(choices)}")
    return v


def poison_outputs() -> bool:
    return _get("JAX_MLA_POISON_OUTPUTS") == "1"


def interpreter_enabled() -> bool:
    return _get("TRITON_INTERPRET") == "1"


def choose_interpreter() -> None:
    """On a CPU host, ask Triton for its interpreter (only effective before triton's import)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")


def ffi_library() -> str | None:
    """``JAX_MLA_FFI_LIBRARY``: an explicit path of the FFI launcher library."""
    return _get("JAX_MLA_FFI_LIBRARY")


def cache_dir() -> str | None:
    """``JAX_MLA_CACHE_DIR``: the root of jax_mla's on-disk caches."""
    return _get("JAX_MLA_CACHE_DIR")
