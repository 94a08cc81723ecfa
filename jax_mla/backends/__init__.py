"""The backend registry: every kernel family is one package with one registration.

Built-in backends are registered by name and the class's import path, and imported the first
time they are asked for, so ``import jax_mla`` loads no kernel library and no ROCm code.
``"auto"`` picks, per platform, the first available backend of :data:`AUTO_ORDER`, else the XLA
reference. Adding a backend: subclass :class:`Backend` in a package of its own and call
:func:`register_backend` (an instance, or a lazy ``"module:Class"`` path with its platforms).
"""

from __future__ import annotations

import dataclasses
import importlib

from jax_mla.backends.base import Backend, DecodePlan
from jax_mla.backends.xla import XlaBackend
from jax_mla.problem import Target, as_target

__all__ = ["AUTO_ORDER", "Backend", "DecodePlan", "available_backends", "get_backend",
           "register_backend", "registered_backends", "require_available", "resolve_backend",
           "unregister_backend"]

#: Order tried by ``backend="auto"`` on each platform (first available wins; else ``"xla"``).
AUTO_ORDER = {"rocm": ("aiter", "triton"), "cuda": ("triton",)}


@dataclasses.dataclass
class _Lazy:
    path: str  # "package.module:Class"
    platforms: tuple[str, ...]  # where it can ever run: others are answered without importing


_REGISTRY: dict[str, Backend | _Lazy] = {}


def register_backend(backend: Backend | str, *, name: str | None = None,
                     platforms: tuple[str, ...] | None = None) -> None:
    """Register a :class:`Backend` instance, or ``"module:Class"`` (with ``name`` and the
    ``platforms`` it may run on) to be imported on first use."""
    if isinstance(backend, str):
        if name is None or platforms is None:
            raise ValueError("a lazy backend needs name= and platforms=")
        _REGISTRY[name] = _Lazy(backend, tuple(platforms))
        return
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a jax_mla Backend, got {type(backend).__name__}")
    _REGISTRY[name or backend.name] = backend


def unregister_backend(name: str) -> None:
    """Remove ``name`` from the registry (no error if absent)."""
    _REGISTRY.pop(name, None)


def registered_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The registered backend ``name`` (imported on first use), available here or not."""
    if name not in _REGISTRY:
        raise ValueError(f"backend={name!r} is not one of {('auto',) + registered_backends()}")
    entry = _REGISTRY[name]
    if isinstance(entry, _Lazy):
        module, _, cls = entry.path.partition(":")
        entry = getattr(importlib.import_module(module), cls)()
        _REGISTRY[name] = entry
    return entry


def _available(name: str, target: Target) -> bool:
    entry = _REGISTRY[name]
    if isinstance(entry, _Lazy) and target.platform not in entry.platforms:
        return False
    return get_backend(name).supported_on(target)


def available_backends(target=None) -> tuple[str, ...]:
    """Names of the backends usable on ``target`` (a platform name, a Target, or None: here)."""
    target = as_target(target)
    return tuple(n for n in _REGISTRY if _available(n, target))


def require_available(backend: Backend, target: Target) -> Backend:
    """``backend`` if it can run on ``target``, else a clear ``RuntimeError``."""
    reason = backend.unavailable_reason(target)
    if reason is not None:
        raise RuntimeError(f"{reason}; available here: {available_backends(target)}")
    return backend


def resolve_backend(name: str, target=None) -> Backend:
    """The backend for ``name`` on ``target`` (``"auto"``: the best available), checked."""
    target = as_target(target)
    if name == "auto":
        for cand in AUTO_ORDER.get(target.platform, ()):
            if cand in _REGISTRY and _available(cand, target):
                return get_backend(cand)
        return get_backend("xla")
    return require_available(get_backend(name), target)


register_backend(XlaBackend())
register_backend("jax_mla.backends.triton:TritonBackend", name="triton",
                 platforms=("cpu", "cuda", "rocm"))
register_backend("jax_mla.backends.aiter:AiterBackend", name="aiter", platforms=("rocm",))
