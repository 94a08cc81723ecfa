"""One device session: GPU correctness and every benchmark, in one call, each stage to ``$OUT``.

``python -m jax_mla.bench.session STAGE[,STAGE...] [-- BENCH ARGS]`` from a checkout (the test
stages run its ``tests/``). A stage that fails is logged and the next one runs. Stages:

- ``env``: devices, versions, clocks;
- ``tests``: the conformance suite on the GPU (``tests_quick``: without its long ragged cases);
- ``bench``: the decode grid, both timers, every backend (``python -m jax_mla.bench`` with the
  arguments after ``--``);
- ``kernels``: each kernel's GPU time and launches per call (CUPTI) at :data:`KERNEL_SHAPES`;
- ``gaps``: where the stream time goes at :data:`GAP_SHAPES`: the timing chain under CUPTI, each
  kernel's time and the GPU's idle gap before it;
- ``prefill``: the prefill check and grid; ``dcp``: DCP simulated on one GPU;
- ``aiter``: the AITER bridge against the stand-in, and its host cost per call;
- ``ab``: the Triton tuning A/B of :data:`AB_VARIANTS` at :data:`AB_SHAPES`;
- ``launcher``: the FFI launcher (``docs/launcher.md``): builds its library if this checkout has
  none, runs its GPU test and the conformance suite through it (with the planning kernel), then
  the A/B of :data:`LAUNCHER_VARIANTS` (jax-triton, FFI, FFI + planning kernel) at
  :data:`LAUNCHER_SHAPES`, both timers, into ``launcher_ab.json``.

Results go to ``$OUT`` (JSON and CSV; no logs or traces); ``python -m jax_mla.bench.report``
turns a folder of them into ``RESULTS.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

OUT = os.environ.get("OUT", os.path.join(tempfile.gettempdir(), "jax_mla_bench"))
T0 = time.time()

KERNEL_SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096", "64,16,4096", "64,16,4096,4",
                 "128,16,8192", "128,128,4096", "8,128,32768", "64,16,4096,1,64,fp8",
                 "128,128,4096,1,64,fp8")
GAP_SHAPES = ("1,16,1024", "32,16,4096", "64,16,4096,4", "128,128,4096")
AB_SHAPES = ("32,16,4096", "64,16,4096,4", "128,128,4096")
AB_VARIANTS = ("base", "general:affine_reduce=0", "line:split_plan=line", "no_l2:l2_hints=0")
LAUNCHER_SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096", "64,16,4096", "128,16,8192",
                   "32,16,32768", "128,128,4096", "64,16,4096,4", "64,16,4096,1,64,fp8")
LAUNCHER_VARIANTS = ("jt:launcher=jax_triton", "ffi:launcher=ffi",
                     "ffik:launcher=ffi,planner=kernel")


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _python(args, timeout, name, **extra_env):
    """Run ``python args...`` with the GPU environment (no interpreter); log its tail."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OUT"] = OUT
    env.update(extra_env)
    try:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                           timeout=timeout, env=env)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"TIMEOUT after {timeout}s\n{e.stdout or ''}", -1
    tail = [ln for ln in str(text).strip().splitlines() if ln.strip()][-12:]
    log(f"{name} rc={rc}\n  " + "\n  ".join(tail))
    return rc


def stage_env(_):
    import jax

    log("devices", jax.devices(), "jax", jax.__version__)
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,"
                        "power.draw,temperature.gpu", "--format=csv"], capture_output=True,
                       text=True)
    log(r.stdout.strip())


def stage_tests(_):
    _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py"], 480,
            "conformance")


def stage_tests_quick(_):
    _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py", "-k",
             "not long_ragged"], 300, "conformance (quick)")


def stage_bench(bench_args):
    _python(["-m", "jax_mla.bench", "--out", OUT, *bench_args], 1200, "bench")


def stage_kernels(_):
    import numpy as np

    from jax_mla.bench import profile
    from jax_mla.bench.decode import Shape, attention_call

    rows = []
    for spec in KERNEL_SHAPES:
        shape = Shape.parse(spec)
        fn, args = attention_call(shape, np.random.default_rng(0))
        row = {"shape": shape.name, **profile.kernel_times(fn, *args)}
        rows.append(row)
        log(f"{shape.name}: GPU {row['gpu_us']:.1f} us, {row['launches']:.1f} launches/call "
            + " | ".join(f"{k} {v:.1f}" for k, v in row["kernels_us"].items()))
    with open(os.path.join(OUT, "kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)


def stage_gaps(_):
    import numpy as np

    from jax_mla.bench import profile
    from jax_mla.bench.decode import Shape, attention_call

    rows = []
    for spec in GAP_SHAPES:
        shape = Shape.parse(spec)
        fn, args = attention_call(shape, np.random.default_rng(0))
        row = {"shape": shape.name, **profile.chain_gaps(fn, *args)}
        rows.append(row)
        log(f"{shape.name}: span {row['span_us']:.1f} us/call; kernels "
            + ", ".join(f"{k} {v:.1f}" for k, v in row["kernels_us"].items()) + "; gaps "
            + ", ".join(f"{k} {v:.1f}" for k, v in row["gap_before_us"].items()))
    with open(os.path.join(OUT, "gaps.json"), "w") as f:
        json.dump(rows, f, indent=1)


def stage_prefill(_):
    _python(["-m", "jax_mla.bench.prefill", "--out", os.path.join(OUT, "prefill.json")], 900,
            "prefill")


def stage_dcp(_):
    _python(["-m", "jax_mla.bench.dcp_split", "--out", OUT], 600, "dcp")


def stage_aiter(_):
    env_note = "XLA_PYTHON_CLIENT_PREALLOCATE=false leaves GPU memory for the torch stand-in"
    log(env_note)
    _python(["-m", "jax_mla.bench.aiter"], 240, "aiter bridge")


def stage_ab(_):
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, "ab.json"), *AB_VARIANTS, "--",
             *AB_SHAPES], 900, "ab")


def _ffi_library() -> str:
    """The FFI launcher library: the installed one, else built here with the C++ compiler
    (``docs/launcher.md``, *Building*) into ``$OUT``'s parent, outside the results."""
    import jax.ffi

    from jax_mla.backends.triton import ffi_launch

    if ffi_launch.unavailable_reason() is None:
        return ffi_launch.library_path()
    path = os.path.join(os.path.dirname(os.path.abspath(OUT)), "libjax_mla_triton_launch.so")
    subprocess.run(["c++", "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                    "-isystem", jax.ffi.include_dir(), "ffi/triton_launch.cc", "-o", path,
                    "-ldl"], check=True)
    return path


def stage_launcher(_):
    lib = _ffi_library()
    log("FFI library", lib)
    env = dict(JAX_MLA_FFI_LIBRARY=lib, JAX_MLA_TRITON_LAUNCHER="ffi")
    _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ffi_launch.py"], 300,
            "ffi launcher tests", **env)
    _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_conformance.py", "-k",
             "triton"], 480, "conformance through the FFI launcher", **env,
            JAX_MLA_TRITON_PLANNER="kernel")
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, "launcher_ab.json"),
             *LAUNCHER_VARIANTS, "--", *LAUNCHER_SHAPES], 900, "launcher ab",
            JAX_MLA_FFI_LIBRARY=lib)


STAGES = {name[len("stage_"):]: fn for name, fn in globals().items()
          if name.startswith("stage_")}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    stages = argv[0].split(",") if argv else ["env", "tests", "bench"]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"unknown stages {unknown}; stages: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    os.makedirs(OUT, exist_ok=True)
    for name in stages:
        log(f"== {name}")
        try:
            STAGES[name](bench_args)
        except Exception as e:  # noqa: BLE001 - a failing stage is logged; the others still run
            log(f"stage {name} failed: {e!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
