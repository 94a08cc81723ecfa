"""Backend registry: every kernel family implements :class:`Backend` and registers itself.

The entry point (:func:`jax_mla.mla_attention`) validates and canonicalises the arguments, asks the
chosen backend how many heads it wants, pads, calls ``decode``, and unpads. A backend is a small
object; adding one never touches the entry point.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    """Static description of one decode/verify call, as backends see it."""

    num_rows: int  # T = B * Q
    num_heads: int  # real query heads H
    kv_lora_rank: int  # L
    rope_dim: int  # R
    qlen: int  # Q
    page_size: int
    q_dtype: object
    kv_dtype: object
    platform: str  # jax platform of the computation: "cpu", "cuda", "rocm", ...


class Backend(Protocol):
    name: str

    def is_available(self, platform: str) -> bool:
        """Whether this backend can run on ``platform`` in this process."""

    def check(self, problem: DecodeProblem) -> None:
        """Raise ``ValueError``/``NotImplementedError`` for a problem it cannot serve."""

    def padded_heads(self, problem: DecodeProblem) -> int:
        """Head count the kernel is called with (``problem.num_heads`` = no padding)."""

    def decode(self, q, kv_cache, metadata, *, scale, kv_lora_rank, q_scale, kv_scale):
        """``q [T, Hp, D]`` -> ``(out [T, Hp, L] float32 or q dtype, lse [T, Hp] float32)``."""


_REGISTRY: dict[str, Backend] = {}
# Order tried by backend="auto" on each platform (first available wins); "xla" is the fallback.
_AUTO_ORDER = {"rocm": ("aiter", "triton"), "cuda": ("triton",)}


def register_backend(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def registered_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def current_platform() -> str:
    """``"cpu"``, ``"cuda"``, ``"rocm"``, ... (jax names both GPU kinds ``"gpu"``)."""
    platform = jax.default_backend()
    if platform == "gpu":
        version = str(getattr(jax.devices()[0].client, "platform_version", "")).lower()
        return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return platform


def available_backends(platform: str | None = None) -> tuple[str, ...]:
    """Names of the registered backends usable on ``platform`` (default: jax's default)."""
    platform = platform or current_platform()
    return tuple(n for n, b in _REGISTRY.items() if b.is_available(platform))


def resolve_backend(name: str, platform: str) -> Backend:
    """The backend for ``name`` (``"auto"`` picks the best available) or a clear error."""
    if name == "auto":
        for cand in _AUTO_ORDER.get(platform, ()):
            b = _REGISTRY.get(cand)
            if b is not None and b.is_available(platform):
                return b
        return _REGISTRY["xla"]
    if name not in _REGISTRY:
        raise ValueError(
            f"backend={name!r} is not one of {('auto',) + registered_backends()}"
        )
    b = _REGISTRY[name]
    if not b.is_available(platform):
        reason = getattr(b, "unavailable_reason", None)
        if reason is not None:
            raise RuntimeError(
                f"{reason(platform)}; available here: {available_backends(platform)}")
        raise RuntimeError(
            f"backend={name!r} is not available on platform {platform!r}; available here: "
            f"{available_backends(platform)}"
        )
    return b


def _register_builtin() -> None:
    from jax_mla.backends import aiter, triton, xla

    register_backend(xla.XlaBackend())
    register_backend(triton.TritonBackend())
    register_backend(aiter.AiterBackend())  # never imports aiter itself; ROCm-only availability


_register_builtin()
