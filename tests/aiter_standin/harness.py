"""Test helpers: the stand-in ``aiter`` on ``sys.path`` only while a test needs it."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

STANDIN_DIR = os.path.dirname(os.path.abspath(__file__))


def _drop_aiter_modules():
    for name in [m for m in sys.modules if m == "aiter" or m.startswith("aiter.")]:
        del sys.modules[name]


@contextlib.contextmanager
def standin(arch: str = "gfx950", cu_num: int | None = 8):
    """Import the stand-in as ``aiter`` (configured for ``arch``/``cu_num``); undo afterwards."""
    _drop_aiter_modules()
    sys.path.insert(0, STANDIN_DIR)
    importlib.invalidate_caches()
    try:
        aiter = importlib.import_module("aiter")
        assert getattr(aiter, "STANDIN", False), "a real aiter shadows the stand-in"
        aiter.configure(arch=arch, cu_num=cu_num)
        aiter.reset_calls()
        yield aiter
    finally:
        sys.path.remove(STANDIN_DIR)
        _drop_aiter_modules()
        importlib.invalidate_caches()


@contextlib.contextmanager
def forced_standins(on_enter=None):
    """Yield ``enter(arch=..., cu_num=...)``: each call imports the stand-in as ``aiter`` (as
    :func:`standin`) with the bridge forced on for this platform; all undone at exit.
    ``on_enter(module)`` runs after each import (e.g. to make ``detect_arch`` report its arch)."""
    from jax_mla.backends import aiter as aiter_backend
    from jax_mla.problem import current_platform

    stack = []

    def enter(arch="gfx950", cu_num=8):
        ctx = standin(arch=arch, cu_num=cu_num)
        mod = ctx.__enter__()
        stack.append(ctx)
        if on_enter is not None:
            on_enter(mod)
        return mod

    try:
        with aiter_backend.force_bridge((current_platform(),)):
            yield enter
    finally:
        for ctx in reversed(stack):
            ctx.__exit__(None, None, None)


def load_metadata_ref(name: str = "_metadata_ref"):
    """A plain-Python port of one of AITER's planners (``_metadata_ref``: the decode planner,
    ``_ps_metadata_ref``: the PS prefill one), without making ``aiter`` importable."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"_aiter{name}", os.path.join(STANDIN_DIR, "aiter", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
