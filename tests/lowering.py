"""Reading what a step lowered for a GPU platform launches (no side effects at import: the
compile scripts of ``conftest.run_compiler_script`` import it without the test setup)."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest


def lowered_launches(text: str, hlo: str) -> dict:
    """What a step lowered for ROCm launches, from its StableHLO ``text`` and its ``hlo``: per
    custom call its target, ``kernel_name``, whether its binary is an ELF, the arch it was
    compiled for, grid and threads; each HLO custom call's target with ``typed`` or ``legacy``;
    and how many lines mention a callback. For the scripts of :func:`run_compiler_script`."""
    calls = [ln for ln in text.splitlines() if "custom_call" in ln]

    def find(pattern, ln):
        m = re.search(pattern, ln)
        return m.group(1) if m else None

    return dict(
        targets=[ln.split("@")[1].split("(")[0] for ln in calls],
        kernels=[find(r'kernel_name = "(\w+)"', ln) for ln in calls if "kernel_name" in ln],
        elf=[bool(re.search(r'binary = dense<"0x7F454C46', ln)) for ln in calls],
        lowered_target=[find(r'target = "(\w+)"', ln) for ln in calls],
        grid=[[int(find(k + r" = (\d+)", ln)) for k in ("grid_x", "grid_y", "grid_z")]
              for ln in calls],
        threads=[int(find(r"block_threads = (\d+)", ln)) for ln in calls],
        typed=[ln.split("custom_call_target=")[1].split(",")[0] + " " + (
            "typed" if "api_version=API_VERSION_TYPED_FFI" in ln else "legacy")
            for ln in hlo.splitlines() if "custom-call(" in ln],
        callbacks=sum("callback" in ln for ln in text.splitlines() + hlo.splitlines()))


def rocm_script(tmp_path, body: str) -> str:
    """A compile script of ``body`` for :func:`conftest.run_compiler_script`: CPU jax, a fresh
    kernel cache under ``tmp_path``, and ``TESTS`` (this folder) defined for its imports."""
    tests = os.path.dirname(os.path.abspath(__file__))
    return (f"import os; os.environ['JAX_MLA_CACHE_DIR'] = {str(tmp_path)!r}; "
            f"os.environ['JAX_PLATFORMS'] = 'cpu'\nTESTS = {tests!r}\n" + body)


def custom_call_targets(text: str) -> list[str]:
    """The targets of a lowered step's StableHLO custom calls, in order."""
    return [m.group(1) for m in re.finditer(r"custom_call @(\w+)", text)]


def one_typed_call(text: str, hlo: str, target: str) -> str:
    """Assert that the lowered step calls ``target`` once, as a typed FFI call, and no Python
    callback; return the StableHLO line of that call."""
    calls = [m.group(1) for m in re.finditer(r"custom_call @(\w+)", text)]
    assert calls.count(target) == 1, calls
    assert not any("callback" in c for c in calls), calls
    typed = [ln for ln in hlo.splitlines() if f'custom_call_target="{target}"' in ln]
    assert len(typed) == 1 and "api_version=API_VERSION_TYPED_FFI" in typed[0], typed
    return next(ln for ln in text.splitlines() if f"@{target}" in ln)


def needs_rocm_compile():
    """A skip marker for tests that compile kernels for an AMD target here: they need the FFI
    launcher library and Triton's AMD backend."""
    from jax_mla.backends.triton import ffi_launch

    reason = ffi_launch.unavailable_reason()
    if reason is not None:
        return pytest.mark.skip(reason=str(reason))
    return pytest.mark.skipif(importlib.util.find_spec("triton.backends.amd") is None,
                              reason="triton without its AMD backend")
