from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in the interpreter, which must be chosen before triton is
# first imported. jax_mla chooses it (triton_importable) when it first launches a kernel on CPU;
# some tests import triton before that (the sm_90 kernel configs check which Gluon API it has).
if importlib.util.find_spec("jax") is not None:
    import jax

    from jax_mla.backends.triton.launch import triton_importable

    if jax.default_backend() == "cpu":
        triton_importable("cpu")

@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps each executable's code into memory; the whole suite in one process compiles
    enough of them to pass the kernel's limit of memory maps per process (vm.max_map_count,
    65530 here), after which a compile crashes deep in LLVM (a segfault or an abort, seen in
    tests/test_schedule.py at 86 % of the suite). The modules share no compiled program worth
    keeping.
    """
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


# Fresh random inputs each run; the seed is printed so a failure can be replayed.
SEED = int(os.environ.get("JAX_MLA_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def pytest_report_header(config):
    return f"jax_mla test seed: JAX_MLA_TEST_SEED={SEED}"


def has_triton_cuda_backend() -> bool:
    """Whether triton's NVIDIA backend is installed (ahead-of-time compiles need no GPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    return os.path.isdir(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia"))


def run_compiler_script(script: str, timeout: int) -> dict:
    """Run ``script`` in a subprocess without TRITON_INTERPRET (this process has it set, and
    triton reads it once) and return the JSON object its last line prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice
    if not env.get("TRITON_CACHE_DIR"):  # "" (jax-triton's import sets it) fails every compile
        env.pop("TRITON_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def rng(request):
    # One stream per test, derived from the session seed and the test's name.
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


# The paged case builder lives in the package (``doctor --validate`` builds its cases with it).
from jax_mla.testing import Case, make_case  # noqa: E402, F401


@pytest.fixture
def aiter_on_rocm(monkeypatch):
    """The AITER stand-in as ``aiter`` (the backend needs it importable) with the warn-once
    state of the native routes reset; nothing forced: the plans target ROCm."""
    import jax

    from jax_mla.backends.aiter import native

    from aiter_standin.harness import forced_standins

    monkeypatch.setattr(native, "_warned", set())
    jax.clear_caches()  # the route is chosen at trace time: no trace from another test
    with forced_standins() as enter:
        enter(arch="gfx950", cu_num=8)
        yield
