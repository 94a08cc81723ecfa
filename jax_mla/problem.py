"""What a call is, as static data: the target device and the decode problem.

A :class:`Target` names where kernels run (platform, architecture, multiprocessor count); a
:class:`DecodeProblem` is everything static about one decode/verify step that a backend needs to
choose its route. Both are frozen and hashable: a plan built from them is part of the jit cache
key, so a different problem or target is a different compiled program, never a silent re-plan.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

GPU_PLATFORMS = ("cuda", "rocm")
PLATFORMS = ("cpu",) + GPU_PLATFORMS


def current_platform() -> str:
    """``"cpu"``, ``"cuda"``, ``"rocm"``, ... of jax's default backend (jax calls both GPU kinds
    ``"gpu"``; the client's platform version says which)."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return platform


@dataclasses.dataclass(frozen=True)
class Target:
    """Where kernels run.

    Attributes:
      platform: ``"cpu"``, ``"cuda"`` or ``"rocm"``.
      arch: ``"sm_90"``-style CUDA architecture, ``"gfx942"``-style AMD one, or None (CPU, or an
        AMD device jax does not name).
      num_cores: streaming multiprocessors (CUDA) or compute units (ROCm) of the device; the
        persistent kernels size their grids by it. On CPU it is the interpreter's pretend count.
    """

    platform: str
    arch: str | None = None
    num_cores: int = 4

    @property
    def gpu(self) -> bool:
        return self.platform in GPU_PLATFORMS

    @property
    def hopper(self) -> bool:
        """A CUDA GPU with wgmma (compute capability 9.x)."""
        return self.platform == "cuda" and (self.arch or "").startswith("sm_9")

    def __str__(self) -> str:
        return f"{self.platform}:{self.arch}" if self.arch else self.platform


# A GPU platform with no device attached (ahead-of-time lowering on a CPU host) is planned for
# the project's reference device of that platform.
_OFFLINE = {"cuda": Target("cuda", "sm_90", 132), "rocm": Target("rocm", None, 132)}


def _cuda_arch(cc) -> str:
    major, _, minor = str(cc).partition(".")
    return f"sm_{major}{minor or '0'}"


@functools.cache
def detect_target(platform: str | None = None) -> Target:
    """The :class:`Target` of the first device of ``platform`` (default: jax's default).

    For a GPU platform with no device in this process the project's reference device is assumed
    (an H200 for ``"cuda"``), so plans can be built and lowered ahead of time on a CPU host.
    """
    platform = platform or current_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform {platform!r} is not one of {PLATFORMS}")
    if platform == "cpu":
        return Target("cpu", None, 4)
    try:
        dev = jax.devices(platform)[0]
    except RuntimeError:  # no such backend in this process
        return _OFFLINE[platform]
    cores = int(getattr(dev, "core_count", 0) or _OFFLINE[platform].num_cores)
    cc = getattr(dev, "compute_capability", None)
    if platform == "cuda":
        return Target("cuda", _cuda_arch(cc) if cc else "sm_90", cores)
    arch = str(cc or "").split(":")[0] or None
    return Target("rocm", arch if arch and arch.startswith("gfx") else None, cores)


def as_target(target) -> Target:
    """``None`` (this process's default device), a platform name, or a :class:`Target`."""
    if target is None:
        return detect_target()
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        return detect_target(target)
    raise TypeError(f"target must be a platform name or a jax_mla Target, got {target!r}")


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """Everything static about one decode/verify step, as backends see it.

    Attributes:
      num_seqs: ``B`` requests (``T = B * Q`` rows).
      qlen: ``Q`` query tokens per request.
      num_heads: real query heads ``H`` (the call's ``q.shape[1]``).
      page_size: rows per cache page.
      max_pages: block-table width (static capacity per request).
      kv_lora_rank: ``L``; rope_dim: ``R`` (``D = L + R``).
      q_dtype, kv_dtype: dtype names of the query and the cache.
      has_kv_scale: the call passes a per-tensor cache scale.
      return_lse: the caller needs the LSE (backends whose kernels only make one on request
        plan for it).
      target: where the kernels run.
    """

    num_seqs: int
    qlen: int
    num_heads: int
    page_size: int
    max_pages: int
    kv_lora_rank: int
    rope_dim: int
    q_dtype: str
    kv_dtype: str
    target: Target
    has_kv_scale: bool = False
    return_lse: bool = False
