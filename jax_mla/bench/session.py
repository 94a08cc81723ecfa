"""One device session: GPU correctness and every benchmark, in one call, each stage to ``$OUT``.

``python -m jax_mla.bench.session STAGE[,STAGE...] [-- BENCH ARGS]`` from a checkout (the test
stages run its ``tests/``). A stage that fails is logged and the next one runs. Stages:

- ``env``: devices, versions, clocks;
- ``tests``: the conformance suite on the GPU (``tests_quick``: without its long ragged cases);
- ``bench``: the decode grid, both timers, every backend (``python -m jax_mla.bench`` with the
  arguments after ``--``); ``bench_triton``: the Triton backend's alone;
- ``kernels``: each kernel's GPU time and launches per call (CUPTI) at :data:`KERNEL_SHAPES`;
- ``gaps``: where the stream time goes at :data:`GAP_SHAPES` (or the shapes after ``--``): the
  timing chain under CUPTI, fed and with the calls back to back (three runs back to back),
  each kernel's time, the GPU's idle gap before it, every run's span and the idle time between
  runs;
- ``prefill``: the prefill check and grid; ``dcp``: DCP simulated on one GPU;
- ``aiter``: the AITER bridge against the stand-in, and its host cost per call;
- ``ab``: the Triton tuning A/B of :data:`AB_VARIANTS` at :data:`AB_SHAPES`; ``ab_fp8``: the
  fp8-cache tiles of :data:`FP8_AB_VARIANTS` at :data:`FP8_AB_SHAPES`; ``ab_fp8q``: fp8 queries
  in fp8 products or dequantised (:data:`FP8Q_AB_SHAPES`); ``ab_fp8_verify``: fp8 verify's
  head blocks of a power of two against the old ones (:data:`FP8_VERIFY_AB`); ``head_blocks``:
  which head blocks the CUDA fp8 64-row tile gets right (:data:`HEAD_BLOCK_AB`); ``sm90_fp8``:
  the Gluon fp8 kernel's GPU conformance cases and its A/B against the Triton tile
  (:data:`SM90_FP8_AB`); ``ab_pdl``: programmatic dependent launch on and off at
  :data:`PDL_AB_SHAPES`; ``stream_init``: stream times with and without XLA's initialize
  stage, a process each (:data:`STREAM_INIT_SHAPES`);
- ``memcheck``: the Triton fuzz cases under compute-sanitizer, in the background
  (``memcheck_wait`` waits for it; the session's end too); ``memcheck_fuzz``: the same in the
  foreground; ``memcheck_conformance``: the Triton and Gluon conformance cases and the
  bad-value tests, one sanitized process a case, into ``memcheck.json``;
- ``graphs``: the command buffers XLA forms around our launches (:data:`GRAPH_SHAPES`);
  ``cmdbuf``: whether XLA captures them, read from its thunk dump and log, and the stream time
  with command buffers on, off and at any size (``jax_mla.bench.cmdbuf``); ``cmdbuf_chains``:
  wall, host enqueue and GPU span per call against the chain's length, and XLA's log of
  command-buffer updates, by stream capture (the default), through the record stage, with
  XLA's initialize stage too, and outside command buffers (:data:`CHAIN_VARIANTS`);
- ``planner``: a step's metadata on the GPU, and the planning kernel's knobs
  (``python -m jax_mla.bench.planner``);
- ``launcher_tests``: the FFI launcher (``docs/launcher.md``): builds its library if this
  checkout has none, runs its GPU tests and the planning kernel's bit-exactness test;
  ``conformance_ffi``: the Triton half of the conformance suite through both (the GPU
  defaults); ``conformance_shards``: every Triton and Gluon case in processes side by side,
  one row a case into ``conformance_ffi.json``;
- ``split_q``: the Gluon fp8 kernel with a 16-bit query split in two e4m3 parts, its
  conformance cases and an A/B against the Triton tiles (:data:`SPLIT_Q_AB`); ``split_probe``:
  the same kernel on made query parts whose answers are known (``jax_mla.bench.split_probe``).
- ``allocators``: chained calls' wall time and XLA's command-buffer updates under each of the
  PJRT client's allocators (:data:`ALLOCATORS`), a process each, into ``alloc_<name>.json``.
- ``anatomy``: where a waited run of the stream timer's chain spends its wall time (the host
  until the GPU starts, the GPU's span and idle, the GPU done until the wait returns, with the
  host's events in each window), under :data:`ANATOMY_VARIANTS`, into ``anatomy.json``.
- ``update_modes``: the FFI path's two timers under each command-buffer update mode the
  installed XLA knows (``--xla_gpu_command_buffer_update_mode``), into ``update_mode_*.json``.
- ``launcher``: the A/B of :data:`LAUNCHER_VARIANTS` (jax-triton with XLA-op metadata, FFI
  with the planning kernel) at :data:`LAUNCHER_SHAPES` (or the shapes after ``--``): both
  timers (the stream time also with runs in flight and with our calls back to back,
  FlashMLA's graph also by our clock), metadata, command buffers, into ``launcher_ab.json``;
  ``record``: our launches captured or recorded through XLA's record stage
  (:data:`RECORD_AB`, ``record_ab.json``); ``one_call``: the decode kernel and its reduce as
  two custom calls, as one launch sequence, and as one with PDL between them
  (:data:`ONE_CALL_AB`, every timer, FlashMLA beside, ``one_call_ab.json``).
- ``ncu``: Nsight Compute's counters for one call's kernels, ours beside FlashMLA's and cuDNN's
  (``jax_mla.bench.ncu``, ``ncu.json``; the cases after ``--``).

Where FlashMLA's reduced tree was carried (:data:`PEERS`), it is built in the background at the
start and the ``bench``, ``launcher`` and ``one_call`` stages time it beside ours.

Results go to ``$OUT`` (JSON and CSV; no logs or traces); ``python -m jax_mla.bench.report``
turns a folder of them into ``RESULTS.md``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

OUT = os.environ.get("OUT", os.path.join(tempfile.gettempdir(), "jax_mla_bench"))
T0 = time.time()

KERNEL_SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096", "64,16,4096", "64,16,4096,4",
                 "128,16,8192", "128,128,4096", "8,128,32768", "64,16,4096,1,64,fp8",
                 "128,128,4096,1,64,fp8")
GAP_SHAPES = ("1,16,1024", "1,128,1024", "8,16,4096", "32,16,4096", "64,16,4096,4",
              "128,128,4096")
AB_SHAPES = ("32,16,4096", "64,16,4096,4", "128,128,4096")
AB_VARIANTS = ("base", "general:affine_reduce=0", "line:split_plan=line", "no_l2:l2_hints=0")
LAUNCHER_SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096", "64,16,4096", "128,16,8192",
                   "32,16,32768", "128,128,4096", "64,16,4096,4", "64,16,4096,1,64,fp8")
# jax-triton with XLA-op metadata (the path before the FFI launcher), and the defaults since (the
# FFI launcher, captured into command buffers, and the planning kernel).
LAUNCHER_VARIANTS = ("jax_triton:launcher=jax_triton,planner=jnp",
                     "ffi:launcher=ffi,planner=kernel")
# Our launches captured into command buffers (the default) or recorded through XLA's record
# stage (``launcher="ffi_record"``), both timers, no peers.
RECORD_AB = ("record_ab.json", ("ffi:launcher=ffi", "record:launcher=ffi_record"),
             ("1,16,1024", "8,16,4096", "32,16,4096", "128,128,4096"))


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ``python`` arguments that run pytest quietly, without its cache (a checkout's tests).
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
_CHILD_ENV_DROP: set[str] = set()  # variables this driver set for itself only
PEERS = os.path.join(".peers", "flashmla")  # FlashMLA's reduced tree (benchmarks/README.md)
_peer_build = None


def start_peer_build():
    """Build FlashMLA in the background where its tree was carried (``PEERS``): about two
    minutes of nvcc while the first stages run. Its log goes beside ``$OUT``, not in it."""
    global _peer_build
    if not os.path.isdir(PEERS) or _peer_build is not None:
        return
    if _peer_library():  # carried back from an earlier call (``peer_save``): peer_path uses it
        log("FlashMLA already built:", _peer_library())
        return
    log_path = os.path.join(os.path.dirname(os.path.abspath(OUT)), "flashmla_build.log")
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "8"))
    with open(log_path, "w") as f:
        _peer_build = subprocess.Popen([sys.executable, "flashmla_setup.py", "build_ext",
                                        "--inplace"], cwd=PEERS, stdout=f, stderr=f, env=env)
    log("building FlashMLA in the background, log", log_path)


def _peer_library() -> str | None:
    lib = os.path.join(PEERS, "flash_mla")
    names = [n for n in os.listdir(lib) if n.startswith("cuda.") and n.endswith(".so")] \
        if os.path.isdir(lib) else []
    return os.path.join(lib, names[0]) if names else None


def stage_peers(_):
    """Start FlashMLA's build now (the ``bench`` and ``launcher`` stages start it otherwise)."""
    start_peer_build()


def stage_peer_save(_):
    """Wait for FlashMLA's build and put its extension in ``$OUT``, to be carried back into
    ``.peers/flashmla/flash_mla/`` on a later call (the build is skipped then)."""
    import shutil

    if peer_path() and _peer_library():
        shutil.copy(_peer_library(), OUT)
        log("FlashMLA extension saved:", os.path.basename(_peer_library()),
            os.path.getsize(_peer_library()), "bytes")


def peer_path() -> str | None:
    """FlashMLA's folder once its build has finished well (waits for it), or where its
    extension was carried in already built; else None."""
    if _peer_build is None:
        return os.path.abspath(PEERS) if _peer_library() else None
    try:
        rc = _peer_build.wait(timeout=600)
    except subprocess.TimeoutExpired:
        log("FlashMLA build still running after 600 s: no FlashMLA column")
        return None
    if rc != 0:
        log(f"FlashMLA build failed (rc={rc}): no FlashMLA column")
        return None
    return os.path.abspath(PEERS)


def _python(args, timeout, name, *, peers=None, **extra_env):
    """Run ``python args...`` with the GPU environment (no interpreter); log its tail. FlashMLA,
    where built, is on its path (and XLA leaves torch half the GPU's memory) for the benches,
    or where ``peers`` says so."""
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and k not in _CHILD_ENV_DROP}
    env["OUT"] = OUT
    benches = (["-m", "jax_mla.bench"], ["-m", "jax_mla.bench.ab"])
    peer = peer_path() if (args[:2] in benches if peers is None else peers) else None
    if peer:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [peer, env.get("PYTHONPATH")]))
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
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
    _python([*PYTEST, "tests/test_conformance.py"], 480,
            "conformance")


def stage_tests_quick(_):
    _python([*PYTEST, "tests/test_conformance.py", "-k",
             "not long_ragged"], 300, "conformance (quick)")


def stage_bench(bench_args):
    _python(["-m", "jax_mla.bench", "--out", OUT, *bench_args], 1200, "bench")


def stage_bench_triton(_):
    """The decode grid for the Triton backend alone (and FlashMLA where built)."""
    _python(["-m", "jax_mla.bench", "--out", OUT, "--backends", "triton"], 1200, "bench")


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


def stage_gaps(shapes):
    """The timing chain on the GPU's timeline (``profile.chain_gaps``), per shape (those given
    after ``--``, else :data:`GAP_SHAPES`) twice: the stream timer's fed chain (``chain: fed``)
    and the calls back to back with no feeding kernel (``chain: serial``). The launches go
    through the FFI launcher (built here if need be), and each row names the launcher that ran:
    without the library, ``auto`` would fall back to jax-triton, whose calls XLA cannot capture
    in command buffers, and the timeline would be that path's. Each row also says whether the
    decode kernel and its reduce were one custom call (``one_call``,
    ``JAX_MLA_TRITON_ONE_CALL``)."""
    import numpy as np

    from jax_mla.backends.triton import TritonTuning
    from jax_mla.backends.triton.launch import resolve_launcher
    from jax_mla.bench import profile
    from jax_mla.bench.decode import Shape, attention_call
    from jax_mla.problem import detect_target

    _ffi_library()
    launcher = resolve_launcher(detect_target())
    one_call = TritonTuning.from_env().one_call
    rows = []
    for spec in shapes or GAP_SHAPES:
        shape = Shape.parse(spec)
        fn, args = attention_call(shape, np.random.default_rng(0))
        for chain in ("fed", "serial"):
            row = {"shape": shape.name, "chain": chain, "launcher": launcher,
                   "one_call": one_call,
                   **profile.chain_gaps(fn, *args, serial=chain == "serial")}
            rows.append(row)
            between = row.get("between_runs_us")
            log(f"{shape.name} {chain}: span {row['span_us']:.1f} us/call, runs "
                + ", ".join(f"{x:.1f}" for x in row.get("run_span_us") or []) + " us/call, "
                + ("-" if between is None else f"{between:.1f}") + " us between runs; kernels "
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


# fp8 caches at 16 heads: the 16-row tile (``plan.CUDA_FP8_TILE``: 16 tokens, 4 stages, 3
# programs an SM, with the tile converted once where it was loaded) against Triton's own
# placement of the conversion (``cvt0``: per product, ``V`` read a byte at a time), 2 programs an
# SM (the default until 2026-12-05), the 32-token tile (which fits once the conversion is
# held: 254 registers), and float16 products (``fp8_f16``) at both tiles; one bf16 shape beside
# them is the reference the fp8 target is a ratio to.
FP8_AB_SHAPES = ("64,16,4096,1,64,fp8", "128,16,8192,1,64,fp8", "64,16,4096")
FP8_AB_VARIANTS = ("base", "cvt0:fp8_convert_once=0", "c2:ctas_per_sm=2",
                   "bn32s3:block_n=32,num_stages=3", "f16:fp8_f16=1",
                   "f16bn32:fp8_f16=1,block_n=32,num_stages=3")


# Programmatic dependent launch: each kernel launched while its predecessor finishes (issue 21's
# stream-time target); the small calls are where launch gaps weigh most.
PDL_AB_SHAPES = ("1,16,1024", "1,128,1024", "8,16,4096", "32,16,4096", "128,16,8192",
                 "128,128,4096")
PDL_AB_VARIANTS = ("base", "pdl:pdl=1")


def stage_ab_pdl(_):
    _ffi_library()  # PDL is the launcher's: without the library the rows would be jax-triton's
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, "ab_pdl.json"), *PDL_AB_VARIANTS,
             "--", *PDL_AB_SHAPES], 400, "ab pdl")


# fp8 queries against fp8 caches: multiplied as they are (``fp8_qk``, the default) against
# dequantised to bf16 first (the path before), beside the bf16-query fp8 and bf16 shapes. At 128
# heads, two tiles that fit Triton 3.9's ptxas as well as 3.6's (the 64-row fp8 tile spills
# 228-580 B under 3.9, none under 3.6): 32-row programs (``mr32``; 4 head blocks, no spill
# under either) and 16-token tiles at 4 stages (``bn16s4``; fp8 queries only spill-free).
FP8Q_AB_SHAPES = ("64,16,4096,1,64,fp8q", "64,16,4096,1,64,fp8", "128,128,4096,1,64,fp8q",
                  "128,128,4096,1,64,fp8", "128,128,4096")
FP8Q_AB_VARIANTS = ("base", "dq:fp8_qk=0", "mr32:max_rows=32",
                    "bn16s4:block_n=16,num_stages=4")


def stage_ab_fp8q(_):
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, "ab_fp8q.json"), *FP8Q_AB_VARIANTS,
             "--", *FP8Q_AB_SHAPES], 400, "ab fp8q")


def stage_ab_fp8(_):
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, "ab_fp8.json"), *FP8_AB_VARIANTS,
             "--", *FP8_AB_SHAPES], 400, "ab fp8")


@functools.cache
def _ffi_library() -> str:
    """The FFI launcher library: the installed one, else built here with the C++ compiler
    (``docs/launcher.md``, *Building*) into ``$OUT``'s parent, outside the results, and named
    in ``JAX_MLA_FFI_LIBRARY`` for this process and the stages' subprocesses."""
    import jax.ffi

    from jax_mla.backends.triton import ffi_launch

    if ffi_launch.unavailable_reason() is None:
        return ffi_launch.library_path()
    path = os.path.join(os.path.dirname(os.path.abspath(OUT)), "libjax_mla_triton_launch.so")
    t = time.time()
    subprocess.run(["c++", "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                    "-isystem", jax.ffi.include_dir(), "ffi/triton_launch.cc", "-o", path,
                    "-ldl"], check=True)
    os.environ["JAX_MLA_FFI_LIBRARY"] = path
    log(f"built the FFI launcher library in {time.time() - t:.1f} s: {path}")
    return path


# When device time is short: the fp8 decisions in two small A/Bs (16 heads: the tile's
# conversion, programs an SM, float16 products, beside bf16; 128 heads: the tiles that fit
# Triton 3.9 against the default, and dequantised queries), then the fp8 conformance cases.
SHORT_FP8_ABS = (
    ("ab_fp8_h16.json", ("base", "cvt0:fp8_convert_once=0", "c2:ctas_per_sm=2", "f16:fp8_f16=1"),
     ("64,16,4096,1,64,fp8", "64,16,4096")),
    ("ab_fp8_h128.json", ("base", "mr32:max_rows=32", "bn16s4:block_n=16,num_stages=4",
                          "dq:fp8_qk=0"),
     ("128,128,4096,1,64,fp8", "128,128,4096,1,64,fp8q")),
)


def stage_ab_fp8_short(_):
    lib = _ffi_library()
    for name, variants, shapes in SHORT_FP8_ABS:
        _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, name), *variants, "--", *shapes],
                300, name, JAX_MLA_FFI_LIBRARY=lib)


def stage_ab_fp8_h128(_):
    """Only the 128-head half of :func:`stage_ab_fp8_short`."""
    name, variants, shapes = SHORT_FP8_ABS[1]
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, name), *variants, "--", *shapes],
            300, name, JAX_MLA_FFI_LIBRARY=_ffi_library())


# The fp8 verify's head blocks: at 16 heads (timed on an H100, 2026-12-05: power-of-two blocks
# as fast or faster; the old 10 + 6 and 9 + 7 off in the LSE) and at 32, 64, 128 heads (where a
# multiple of four a block, ``plan.CUDA_FP8_64_HEAD_MULTIPLE``, differs from the rows' own
# blocks), against the old blocks.
FP8_VERIFY_AB = ("ab_fp8_verify.json", ("base", "hb0:pow2_head_blocks=0"),
                 ("64,16,4096,6,64,fp8q", "64,16,4096,7,64,fp8", "64,32,4096,5,64,fp8",
                  "64,64,4096,6,64,fp8", "32,128,4096,7,64,fp8", "32,128,4096,3,64,fp8q"))


def stage_ab_fp8_verify(_):
    name, variants, shapes = FP8_VERIFY_AB
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, name), *variants, "--", *shapes],
            300, name, JAX_MLA_FFI_LIBRARY=_ffi_library())


# The Gluon fp8 kernel (``sm90_fp8``, ``kernels/gluon/decode_sm90_fp8.py``: fp8 wgmma scores)
# against the Triton 64-row tile, fp8 queries and caches where the tile has 64 rows, beside the
# bf16 shape the fp8 target is a ratio to.
SM90_FP8_AB = ("ab_sm90_fp8.json", ("base", "g8:sm90_fp8=1"),
               ("128,128,4096,1,64,fp8q", "64,16,4096,4,64,fp8q", "32,128,4096,3,64,fp8q",
                "128,16,8192,4,64,fp8q", "128,128,4096"))


def _conformance_then_ab(cases: str, title: str, ab, *ab_args, timeout: int = 300):
    """The conformance cases ``-k cases`` (GPU only), then the A/B ``ab`` (file, variants,
    shapes), both through the FFI launcher."""
    lib = _ffi_library()
    _python([*PYTEST, "tests/test_conformance.py", "-k",
             cases], 240, title, JAX_MLA_FFI_LIBRARY=lib)
    name, variants, shapes = ab
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, name), *variants, "--", *shapes,
             *ab_args], timeout, name, JAX_MLA_FFI_LIBRARY=lib)


def stage_sm90_fp8(_):
    """The Gluon fp8 kernel's conformance cases (GPU only), then :data:`SM90_FP8_AB`."""
    _conformance_then_ab("sm90_fp8", "Gluon fp8 kernel conformance", SM90_FP8_AB)


# A 16-bit query against an fp8 cache: the Triton tiles (``sm90_split_q=0``) first, then the
# Gluon fp8 kernel with the query split in two e4m3 parts (``sm90_split_q``, the default where
# the installed Triton compiles it without spills) by the split kernel (the default) and by
# XLA's ops (``sqx``); the bf16 shapes first, so that a run cut short still has the comparison
# the fp8 targets are stated against.
SPLIT_Q_AB = ("ab_split_q.json",
              ("tile:sm90_split_q=0", "sq:sm90_split_q=1",
               "sqx:sm90_split_q=1,split_q_kernel=0"),
              ("64,16,4096", "128,128,4096", "128,128,4096,1,64,fp8", "64,16,4096,1,64,fp8",
               "32,128,4096,3,64,fp8", "64,16,4096,4,64,fp8", "128,16,8192,1,64,fp8"))


def stage_split_q(_):
    """The split-query kernel's conformance cases (GPU only), then :data:`SPLIT_Q_AB`."""
    _conformance_then_ab("sm90_split", "Gluon split-query kernel conformance", SPLIT_Q_AB,
                         "--no-peers", timeout=330)


def stage_split_probe(_):
    """The split-query kernel on made query parts (``jax_mla.bench.split_probe``)."""
    _python(["-m", "jax_mla.bench.split_probe", os.path.join(OUT, "split_probe.json")], 240,
            "split probe", JAX_MLA_FFI_LIBRARY=_ffi_library())


# Which head blocks the CUDA fp8 64-row tile gets wrong: 10, 9 and 21 heads a block were off
# (0.03-0.1 in the LSE), 12 was exact (2026-12-05, H100). Blocks of 20, 18 (128 heads, Q3),
# 15, 14 (64 heads, Q4), 12 and 11 (32 heads, Q5), against the power-of-two default.
HEAD_BLOCK_AB = ("ab_fp8_head_blocks.json",
                 ("base", "hb0:pow2_head_blocks=0", "m60:pow2_head_blocks=0,max_rows=60",
                  "m56:pow2_head_blocks=0,max_rows=56"),
                 ("32,128,4096,3,64,fp8", "64,64,4096,4,64,fp8", "64,32,4096,5,64,fp8"))


def stage_head_blocks(_):
    name, variants, shapes = HEAD_BLOCK_AB
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, name), *variants, "--", *shapes],
            300, name, JAX_MLA_FFI_LIBRARY=_ffi_library())


# Stream time with the execute stage alone (the default) and with XLA's initialize stage
# registered too, one process each (registration is per process), same machine.
STREAM_INIT_SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096")


def stage_stream_init(_):
    for name, flag in (("execute", "0"), ("initialize", "1")):
        _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, f"stream_{name}.json"), "ffi",
                 "--", *STREAM_INIT_SHAPES, "--rounds", "3"], 200, f"stream {name}",
                JAX_MLA_FFI_LIBRARY=_ffi_library(), JAX_MLA_FFI_INITIALIZE_STAGE=flag)


def stage_conformance_fp8(_):
    _python([*PYTEST, "tests/test_conformance.py", "-k",
             "triton and fp8"], 300, "fp8 conformance through the FFI launcher",
            JAX_MLA_FFI_LIBRARY=_ffi_library())


def stage_launcher_tests(_):
    lib = _ffi_library()
    log("FFI library", lib)
    env = dict(JAX_MLA_FFI_LIBRARY=lib)
    _python([*PYTEST, "tests/test_ffi_launch.py",
             "tests/test_schedule.py", "-k", "ffi or launch or planning_kernel"], 360,
            "FFI launcher and planning kernel tests", **env)


def stage_conformance_ffi(_):
    # The defaults on a GPU: the FFI launcher and the planning kernel.
    _python([*PYTEST, "tests/test_conformance.py", "-k",
             "triton"], 420, "conformance through the FFI launcher",
            JAX_MLA_FFI_LIBRARY=_ffi_library())


# The sharded conformance run: how many pytest processes share the GPU, and the wall limit.
CONFORMANCE_SHARDS = int(os.environ.get("JAX_MLA_CONFORMANCE_SHARDS", 4))
CONFORMANCE_LIMIT = int(os.environ.get("JAX_MLA_CONFORMANCE_LIMIT", 480))


def stage_conformance_shards(_):
    """Every Triton and Gluon conformance case (long ragged ones included) through the GPU
    defaults (the FFI launcher, one custom call a layer, the planning kernel), in
    :data:`CONFORMANCE_SHARDS` pytest processes side by side (at most a fifth of the GPU's
    memory each; compiling, not the GPU, is what takes the time), one row a case into
    ``conformance_ffi.json``: ``{test, outcome, seconds}`` and a summary by outcome. At the
    wall limit (:data:`CONFORMANCE_LIMIT`) a process still running is interrupted (pytest then
    still writes the cases it finished) and the cases it had not reached are ``not run``."""
    import signal

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ids = _collect("tests/test_conformance.py", "triton or sm90", env)
    lib = _ffi_library()
    env.update(OUT=OUT, JAX_MLA_FFI_LIBRARY=lib, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION=f"{min(0.2, 0.9 / CONFORMANCE_SHARDS):.3f}")
    tmp = tempfile.mkdtemp(prefix="jax_mla_conformance_")
    shards = [ids[i::CONFORMANCE_SHARDS] for i in range(CONFORMANCE_SHARDS)]
    log(f"{len(ids)} cases in {len(shards)} processes")
    procs = []
    for i, shard in enumerate(shards):
        xml = os.path.join(tmp, f"shard{i}.xml")
        with open(os.path.join(tmp, f"shard{i}.log"), "w") as out:
            procs.append((xml, out.name, subprocess.Popen(
                [sys.executable, *PYTEST, f"--junitxml={xml}", *shard], env=env,
                stdout=out, stderr=subprocess.STDOUT)))
    t = time.time()
    for _, _, proc in procs:
        try:
            proc.wait(timeout=max(1.0, CONFORMANCE_LIMIT - (time.time() - t)))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest writes its JUnit file on the way out
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    table = junit_rows([xml for xml, _, _ in procs], ids)
    counts: dict[str, int] = {}
    for row in table:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    with open(os.path.join(OUT, "conformance_ffi.json"), "w") as f:
        json.dump({"summary": counts, "shards": len(shards),
                   "wall_s": round(time.time() - t, 1), "cases": table}, f, indent=1)
    log(f"conformance through the FFI launcher in {time.time() - t:.0f} s: {counts}")
    for row in table:
        if row["outcome"] in ("failed", "not run"):
            log(f"  {row['outcome']}: {row['test']}")
    for _, path, _ in procs:
        tail = [ln for ln in open(path).read().splitlines() if ln.strip()][-3:]
        log("  " + " | ".join(tail))


def _collect(file: str, expr: str, env: dict) -> list[str]:
    """The ids pytest collects from ``file`` with ``-k expr``, in its order."""
    collected = subprocess.run([sys.executable, *PYTEST, "--collect-only", file, "-k", expr],
                               capture_output=True, text=True, env=env)
    return [ln.strip() for ln in collected.stdout.splitlines() if "::" in ln]


def junit_rows(paths, ids) -> list[dict]:
    """One ``{test, outcome, seconds}`` a collected id from pytest's JUnit files at ``paths``
    (those that exist): ``passed``, ``failed`` (a failure or an error), ``skipped``,
    ``xfailed``; an id no file reports is ``not run``."""
    import xml.etree.ElementTree as ET

    rows = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            kids = {c.tag: c for c in case}
            outcome = ("failed" if {"failure", "error"} & set(kids) else
                       "skipped" if "skipped" in kids else "passed")
            if "skipped" in kids and "xfail" in (kids["skipped"].get("type") or ""):
                outcome = "xfailed"
            module = case.get("classname", "").replace(".", "/") + ".py"
            name = f"{module}::{case.get('name')}"
            rows[name] = {"test": name, "outcome": outcome,
                          "seconds": round(float(case.get("time") or 0), 2)}
    return [rows.get(i, {"test": i, "outcome": "not run"}) for i in ids]


def stage_record(shapes):
    name, variants, default_shapes = RECORD_AB
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, name), *variants, "--",
             *(shapes or default_shapes), "--no-peers"], 300, "record ab",
            JAX_MLA_FFI_LIBRARY=_ffi_library())


def stage_launcher(shapes):
    lib = _ffi_library()
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, "launcher_ab.json"),
             *LAUNCHER_VARIANTS, "--", *(shapes or LAUNCHER_SHAPES), "--in-flight", "--serial"],
            560, "launcher ab", JAX_MLA_FFI_LIBRARY=lib)


# The decode kernel and its reduce as two custom calls (the default), as one launch sequence,
# and as one with programmatic dependent launch between its kernels.
ONE_CALL_AB = ("one_call_ab.json",
               ("two:launcher=ffi,planner=kernel,one_call=0",
                "one:launcher=ffi,planner=kernel,one_call=1",
                "one_pdl:launcher=ffi,planner=kernel,one_call=1,pdl=1"),
               ("1,16,1024", "1,128,1024", "8,16,4096", "32,16,4096", "128,16,8192",
                "128,128,4096"))


def stage_one_call(shapes):
    name, variants, default_shapes = ONE_CALL_AB
    _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, name), *variants, "--",
             *(shapes or default_shapes), "--in-flight", "--serial"], 560, "one call ab",
            JAX_MLA_FFI_LIBRARY=_ffi_library())


GRAPH_SHAPES = ("1,16,1024", "32,16,4096", "128,128,4096")


def stage_graphs(_):
    """The command buffers (CUDA graphs) XLA forms at :data:`GRAPH_SHAPES` around our launches,
    in three programs: one ``mla_attention`` call, the bench's chain of 8 dependent calls, and a
    4-layer step (attention, then a projection back to the query, per layer); the compiled HLO of
    the first shape's step goes to ``$OUT``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_mla.bench import profile
    from jax_mla.bench.decode import Shape, attention_call
    from jax_mla.bench.timing import chained

    _ffi_library()
    rows = []
    for i, spec in enumerate(GRAPH_SHAPES):
        shape = Shape.parse(spec)
        fn, args = attention_call(shape, np.random.default_rng(0))
        w = jax.random.normal(jax.random.key(0), (512, 576), jnp.bfloat16) * 0.05

        def step(q, cache, md, w, fn=fn):
            for _ in range(4):
                out = fn(q, cache, md)[0]
                q = jnp.einsum("thl,ld->thd", out, w).astype(q.dtype)
            return q

        programs = {"call": (fn, args), "chain8": (chained(fn, 8), args),
                    "step4": (step, (*args, w))}
        for name, (f, a) in programs.items():
            rows.append({"shape": shape.name, "program": name,
                         "xla_flags": os.environ.get("XLA_FLAGS", ""),
                         **profile.command_buffers(f, *a), **profile.graph_launches(f, *a)})
            log(rows[-1])
        if i == 0:
            with open(os.path.join(OUT, "step_hlo.txt"), "w") as f:
                f.write(jax.jit(step).lower(*args, w).compile().as_text())
    with open(os.path.join(OUT, "graphs.json"), "w") as f:
        json.dump(rows, f, indent=1)


MEMCHECK_RUNS = (
    # name: script arguments (after ``python``), time limit in seconds. The fuzz runs take
    # about 30 s each under the sanitizer; the conformance and bad-value cases run one a
    # process (``memcheck_conformance``).
    ("fuzz_valid", ["tests/fuzz_cases.py", "valid", "triton", "8"], 150),
    ("fuzz_invalid", ["tests/fuzz_cases.py", "invalid", "triton", "12"], 150),
)
_memcheck = None


def _memcheck_env(lib) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(JAX_MLA_FFI_LIBRARY=lib, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), "tests",
                                                        env.get("PYTHONPATH")])),
               # XLA's GEMM autotuning would run dozens of candidates under the sanitizer, and
               # each CUDA graph it forms would be patched when instantiated; the kernels and
               # their arguments are the same launched one by one.
               XLA_FLAGS=(env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
                          " --xla_gpu_enable_command_buffer=").strip(),
               # Every program compiled once is kept, in the machine's temporary folder (never
               # under $OUT, nested or not: its files would crowd out the results that come
               # back): a case's sanitized run loads what its warm-up run compiled
               # (``_memcheck_case``).
               JAX_COMPILATION_CACHE_DIR=os.path.join(tempfile.gettempdir(),
                                                      "jax_mla_memcheck_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _sanitized(log_path, args, kernels=None) -> list:
    """``python args`` under compute-sanitizer's memcheck, its report to ``log_path``; only
    ``kernels`` (a ``--kernel-name`` filter) instrumented where given."""
    return ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9",
            *(["--kernel-name", kernels] if kernels else []),
            *(["--kernel-name-exclude", MEMCHECK_KERNEL_EXCLUDE]
              if MEMCHECK_KERNEL_EXCLUDE else []),
            "--log-file", log_path, sys.executable, *args]


def _memcheck_runs(lib, runs=MEMCHECK_RUNS):
    env = _memcheck_env(lib)
    for name, args, limit in runs:
        path = os.path.join(OUT, f"memcheck_{name}.txt")
        cmd = _sanitized(path, args)
        t = time.time()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            rc, text = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = -1, f"TIMEOUT after {limit}s\n{e.stdout or ''}"
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
        tail = [ln for ln in lines if " PASSED" in ln or " FAILED" in ln][-12:] + lines[-6:]
        summary = [ln for ln in open(path).read().splitlines() if "ERROR SUMMARY" in ln] \
            if os.path.exists(path) else []
        log(f"memcheck {name} rc={rc} in {time.time() - t:.0f} s {summary}\n  "
            + "\n  ".join(tail))


def stage_cmdbuf(_):
    """Command buffers around our launches, one process per flag set of
    :data:`jax_mla.bench.cmdbuf.FLAG_SETS`: the chain's stream and GPU time, the thunks XLA
    captured (its thunk dump); rows to ``cmdbuf.json``, XLA's command-buffer log lines to the
    session log."""
    from jax_mla.bench import cmdbuf

    lib = _ffi_library()
    rows = []
    for name, flags in cmdbuf.FLAG_SETS.items():
        path = os.path.join(os.path.dirname(os.path.abspath(OUT)), f"cmdbuf_{name}.json")
        env = {k: v for k, v in os.environ.items()
               if k != "TRITON_INTERPRET" and k not in _CHILD_ENV_DROP}
        env.update(XLA_FLAGS=flags, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=cmdbuf.VMODULE,
                   JAX_MLA_FFI_LIBRARY=lib)
        t = time.time()
        try:
            r = subprocess.run([sys.executable, "-m", "jax_mla.bench.cmdbuf", path],
                               capture_output=True, text=True, timeout=240, env=env)
            text, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = f"TIMEOUT\n{e.stdout or ''}{e.stderr or ''}", -1
        lines = cmdbuf.keep_log_lines(str(text))
        got = json.load(open(path)) if os.path.exists(path) else []
        for row in got:
            row["flag_set"] = name  # the log lines go to the session log, not the results
        rows += got
        tail = [ln for ln in str(text).splitlines() if ln.strip()][-4:]
        log(f"cmdbuf {name} rc={rc} in {time.time() - t:.0f} s\n  " + "\n  ".join(lines)
            + "\n  " + "\n  ".join(json.dumps({k: row.get(k) for k in (
                "shape", "command_buffers", "stream_us", "gpu_us", "chain_span_us",
                "dispatch_us", "updates", "thunk_kinds", "dump_files")}) for row in got)
            + ("\n  " + "\n  ".join(tail) if rc else ""))
    with open(os.path.join(OUT, "cmdbuf.json"), "w") as f:
        json.dump(rows, f, indent=1)


# The chain probe's variants: our launches in XLA's command buffers by stream capture (the
# default), through XLA's record stage (``launcher="ffi_record"``), with XLA's initialize stage
# registered too, and outside command buffers.
CHAIN_VARIANTS = {"on": dict(JAX_MLA_FFI_COMMAND_BUFFERS="1", JAX_MLA_FFI_INITIALIZE_STAGE="0"),
                  "record": dict(JAX_MLA_FFI_COMMAND_BUFFERS="1",
                                 JAX_MLA_FFI_INITIALIZE_STAGE="0",
                                 JAX_MLA_TRITON_LAUNCHER="ffi_record"),
                  "init": dict(JAX_MLA_FFI_COMMAND_BUFFERS="1", JAX_MLA_FFI_INITIALIZE_STAGE="1"),
                  "off": dict(JAX_MLA_FFI_COMMAND_BUFFERS="0", JAX_MLA_FFI_INITIALIZE_STAGE="0")}


def stage_cmdbuf_chains(_):
    """Wall, host enqueue and GPU span per call against the chain's length, XLA's command-buffer
    log over the timed runs, and the host's time by profiler event for the longest chain
    (``python -m jax_mla.bench.cmdbuf --chains``, command buffers kept on under the profiler),
    one process per :data:`CHAIN_VARIANTS` entry, to ``cmdbuf_chains_<variant>.json``."""
    from jax_mla.bench import cmdbuf

    for name, knobs in CHAIN_VARIANTS.items():
        _python(["-m", "jax_mla.bench.cmdbuf", "--chains",
                 os.path.join(OUT, f"cmdbuf_chains_{name}.json")], 150, f"cmdbuf_chains {name}",
                JAX_MLA_FFI_LIBRARY=_ffi_library(), TF_CPP_MIN_LOG_LEVEL="0",
                TF_CPP_VMODULE=cmdbuf.VMODULE, XLA_FLAGS=cmdbuf.PROFILE_WITH_COMMAND_BUFFERS,
                **knobs)


# The PJRT client's allocators (``XLA_PYTHON_CLIENT_ALLOCATOR``, as jaxlib 0.11 passes it to
# the GPU plugin), its TFRT client, and XLA's temporaries in a pool of their own
# (``--xla_gpu_temp_buffer_use_separate_color``, "the fixed address on every iteration"): which
# of them keeps a program's buffers where the last execution had them, so that XLA need not
# update the command buffer before each replay. On an H100 (2026-12-07) only the TFRT client
# did, and not for every run of our chains (``anatomy`` below; benchmarks/results/h100/
# tried.md); the temp pool given to one program (``temp_color_jit``) fails, as the pool is
# made when the client starts.
TEMP_COLOR = {"XLA_FLAGS": "--xla_gpu_temp_buffer_use_separate_color=true"}
ALLOCATORS = {"default": {},
              "temp_color": TEMP_COLOR,
              "cuda_async": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"},
              "temp_color_async": {**TEMP_COLOR, "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"},
              "vmm": {"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm"},
              "temp_color_jit": {"JAX_MLA_CHAIN_COMPILER_OPTIONS":
                                 "xla_gpu_temp_buffer_use_separate_color=true"},
              "tfrt": {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"},
              "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}}
ALLOCATOR_SHAPES = ("1,128,1024", "8,16,4096", "32,16,4096")
# What the allocator processes log: XLA's update decision per execution, not per command.
ALLOCATOR_VMODULE = "command_buffer_thunk=3"


def stage_allocators(shapes):
    """Wall and host enqueue time a call in chains of 16 and 128 dependent calls, and XLA's
    command-buffer updates over the timed runs (``cmdbuf --chains --no-profile``), one process
    per :data:`ALLOCATORS` entry (``JAX_MLA_ALLOCATORS`` picks some), at
    :data:`ALLOCATOR_SHAPES` (or the shapes after ``--``), to ``alloc_<name>.json``."""
    names = os.environ.get("JAX_MLA_ALLOCATORS", ",".join(ALLOCATORS)).split(",")
    lib = _ffi_library()
    for name in names:
        _python(["-m", "jax_mla.bench.cmdbuf", "--chains", os.path.join(OUT, f"alloc_{name}.json"),
                 "--ns", "16,128", "--no-profile", *(shapes or ALLOCATOR_SHAPES)], 120,
                f"allocator {name}", JAX_MLA_FFI_LIBRARY=lib, TF_CPP_MIN_LOG_LEVEL="0",
                TF_CPP_VMODULE=ALLOCATOR_VMODULE, **ALLOCATORS[name])


# Where a waited run of the stream timer's chain spends its wall time (``cmdbuf --anatomy``):
# under the default client and the TFRT one, each with the kernels' binaries in the custom
# calls' attributes (the default) and without them (named by hash; a measurement knob); our
# launches through XLA's record stage; and with XLA's command buffers off.
ANATOMY_VARIANTS = {"default": {},
                    "no_embed": {"JAX_MLA_FFI_EMBED_BINARIES": "0"},
                    "tfrt": {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"},
                    "tfrt_no_embed": {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1",
                                      "JAX_MLA_FFI_EMBED_BINARIES": "0"},
                    "record": {"JAX_MLA_TRITON_LAUNCHER": "ffi_record"},
                    "no_graphs": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
                    "no_graphs_no_embed": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=",
                                           "JAX_MLA_FFI_EMBED_BINARIES": "0"}}
ANATOMY_SHAPES = ("1,128,1024", "8,16,4096")
ANATOMY_NS = os.environ.get("JAX_MLA_ANATOMY_NS", "16,128")  # chain lengths
ANATOMY_REPS = int(os.environ.get("JAX_MLA_ANATOMY_REPS", 7))  # unprofiled timings a chain


def stage_anatomy(shapes):
    """:data:`ANATOMY_VARIANTS` (``JAX_MLA_ANATOMY_VARIANTS`` picks some), a process each
    (``python -m jax_mla.bench.cmdbuf --anatomy``, chains of :data:`ANATOMY_NS` calls, command
    buffers kept on under the profiler), at :data:`ANATOMY_SHAPES` (or the shapes after
    ``--``): every row, its variant named, into ``anatomy.json``."""
    from jax_mla.bench import cmdbuf

    names = os.environ.get("JAX_MLA_ANATOMY_VARIANTS", ",".join(ANATOMY_VARIANTS)).split(",")
    lib = _ffi_library()
    rows = []
    with tempfile.TemporaryDirectory(prefix="jax_mla_anatomy_") as d:
        for name in names:
            path = os.path.join(d, f"{name}.json")
            _python(["-m", "jax_mla.bench.cmdbuf", "--anatomy", path, "--ns", ANATOMY_NS,
                     "--reps", str(ANATOMY_REPS), *(shapes or ANATOMY_SHAPES)], 120,
                    f"anatomy {name}",
                    JAX_MLA_FFI_LIBRARY=lib,
                    **{"XLA_FLAGS": cmdbuf.PROFILE_WITH_COMMAND_BUFFERS, **ANATOMY_VARIANTS[name]})
            if os.path.exists(path):
                with open(path) as f:
                    rows.extend({"variant": name, **row} for row in json.load(f))
    with open(os.path.join(OUT, "anatomy.json"), "w") as f:
        json.dump(rows, f, indent=1)


# XLA's ways of keeping a command buffer's addresses (``--xla_gpu_command_buffer_update_mode``):
# the names differ between XLA versions; the stage times those the installed jaxlib knows.
UPDATE_MODES = ("ALWAYS_UPDATE", "NEVER_UPDATE", "CAPTURE_CMD_NEVER_UPDATE", "SKIP_TEMP",
                "SKIP_PROFILED", "DYNAMIC_ALLOCATE", "VMM_PERSISTENT_TEMP")
DEFAULT_UPDATE_MODES = ("ALWAYS_UPDATE", "DYNAMIC_ALLOCATE")  # what "default" runs
UPDATE_MODE_SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096", "64,16,4096", "128,128,4096")


def known_update_modes() -> list[str]:
    """The :data:`UPDATE_MODES` whose names are in the installed jaxlib's binaries (each
    binary mapped, not read, and the search stops once every name is found)."""
    import glob as _glob
    import mmap

    import jaxlib

    roots = [os.path.dirname(jaxlib.__file__)]
    with contextlib.suppress(ImportError):
        import jax_plugins

        roots += list(jax_plugins.__path__)
    left, found = set(UPDATE_MODES), set()
    for root in roots:
        for path in _glob.glob(os.path.join(root, "**", "*.so*"), recursive=True):
            if not left or os.path.getsize(path) == 0:
                continue
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                found |= {name for name in left if m.find(name.encode()) >= 0}
            left -= found
    return [m for m in UPDATE_MODES if m in found]


def stage_update_modes(_):
    """The FFI path's stream and GPU time under each command-buffer update mode this XLA knows,
    a process each (XLA reads its flags once), to ``update_mode_<MODE>.json``; the default
    flags run first as ``update_mode_default.json``."""
    modes = known_update_modes()
    log("update modes known here:", modes)
    lib = _ffi_library()
    for mode in ["default", *(m for m in modes if m not in DEFAULT_UPDATE_MODES)]:
        flags = "" if mode == "default" else f"--xla_gpu_command_buffer_update_mode={mode}"
        _python(["-m", "jax_mla.bench.ab", os.path.join(OUT, f"update_mode_{mode}.json"),
                 "--no-peers", "ffi", "--", *UPDATE_MODE_SHAPES, "--rounds", "2"], 150,
                f"update mode {mode}", JAX_MLA_FFI_LIBRARY=lib, XLA_FLAGS=flags)


# The cases :func:`stage_memcheck_conformance` sanitizes: (pytest file, ``-k`` expression).
MEMCHECK_CASES = (
    ("tests/test_conformance.py", "triton or sm90"),
    ("tests/test_bad_values.py", "triton or clamps"),
)
MEMCHECK_KERNELS = "kns=mla_"
MEMCHECK_KERNEL_EXCLUDE = os.environ.get("JAX_MLA_MEMCHECK_KERNEL_EXCLUDE")
MEMCHECK_CASE_LIMIT = int(os.environ.get("JAX_MLA_MEMCHECK_LIMIT", 60))
MEMCHECK_TRIES = 3
# Run each case once without the sanitizer first (``JAX_MLA_MEMCHECK_WARM=0``: not).
MEMCHECK_WARM = os.environ.get("JAX_MLA_MEMCHECK_WARM", "1") != "0"


def stage_memcheck_conformance(_):
    """Every case of :data:`MEMCHECK_CASES` (the Triton and Gluon conformance cases, long ragged
    ones included, and the bad-value tests on the Triton backend) under the sanitizer, one
    process a case, one after another, in the foreground; a process that dies of a signal is
    run again (up to :data:`MEMCHECK_TRIES` times). One row a case into ``memcheck.json``:
    ``{test, result, errors, tries: [{rc, seconds, errors, outcome}]}``.

    Why this shape: four sanitized processes side by side wrote nothing in 300 s, and one
    process running many cases stalled (2026-12-05/06); one case a process finishes in 4-22 s
    on an H100. On 2026-12-06, on one of three machines, 23 of 42 sanitized processes died of
    SIGSEGV 3-5 s after starting, before pytest reported anything, at random cases that passed
    on the other machines: hence the retries, and a row keeps every try."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ids = [i for file, expr in MEMCHECK_CASES for i in _collect(file, expr, env)]
    # A rerun of some cases: ``JAX_MLA_MEMCHECK_ONLY`` names them by index in the collection
    # or by a piece of their test id (comma-separated; a piece takes every id it is in).
    only = os.environ.get("JAX_MLA_MEMCHECK_ONLY")
    if only:
        ids = [x for key in only.split(",")
               for x in ([ids[int(key)]] if key.strip().isdigit() else
                         [i for i in ids if key.strip() in i])]
    log(f"{len(ids)} cases, one sanitized process each")
    lib, rows = _ffi_library(), []
    for case in ids:
        tries = []
        while len(tries) < MEMCHECK_TRIES:
            tries.append(_memcheck_case(lib, case))
            if tries[-1]["outcome"] != "signal":
                break
        last = tries[-1]
        rows.append({"test": case, "result": last["outcome"], "errors": last["errors"],
                     "tries": tries})
        log(f"memcheck {case}: {last['outcome']}, errors {last['errors']}, "
            f"{len(tries)} tries, {last['seconds']:.0f} s")
        with open(os.path.join(OUT, "memcheck.json"), "w") as f:
            json.dump(rows, f, indent=1)


def _memcheck_case(lib, case) -> dict:
    """One sanitized pytest process for one test id: ``{rc, seconds, errors, outcome}``, the
    outcome ``passed``, ``failed``, ``skipped``, ``xfailed``, ``memcheck errors``, ``timeout``,
    ``signal`` (the process died of one before pytest's summary; its sanitizer log and output
    tail go to ``$OUT/memcheck_signal.txt``) or ``no result``. A timeout's output tail, with
    the stacks pytest's faulthandler printed before the limit, goes to
    ``$OUT/memcheck_timeout.txt``.

    With :data:`MEMCHECK_WARM`, the case first runs once without the sanitizer (``warm``:
    its ``{rc, seconds}``), so that XLA's programs and Triton's kernels are compiled and cached
    before the sanitized run. On 2026-12-06 (H100) two cases did not finish in 190-200 s
    under the sanitizer, both in XLA's compilation of a program of XLA ops (the jnp planner's,
    the block-table check's), not in a kernel; a third passed in 14 s once the machine's
    Triton cache was warm, after timeouts on fresh machines."""
    log_path = os.path.join(OUT, "memcheck_case.txt")
    env = _memcheck_env(lib)
    warm = None
    if MEMCHECK_WARM:
        t = time.time()
        try:
            rc = subprocess.run([sys.executable, *PYTEST, case], capture_output=True,
                                text=True, timeout=MEMCHECK_CASE_LIMIT, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = None
        warm = {"rc": rc, "seconds": round(time.time() - t, 1)}
    # pytest's faulthandler prints every thread's stack shortly before the limit: where a case
    # that does not finish is (``$OUT/memcheck_timeout.txt``).
    cmd = _sanitized(log_path, [*PYTEST, "-o",
                                f"faulthandler_timeout={max(1, MEMCHECK_CASE_LIMIT - 25)}", case],
                     MEMCHECK_KERNELS)
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=MEMCHECK_CASE_LIMIT,
                           env=env)
        rc, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, ""
        tail = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (e.stdout, e.stderr))
        with open(os.path.join(OUT, "memcheck_timeout.txt"), "a") as f:
            f.write(f"== {case}\n{tail[-6000:]}\n")
    sanitizer = open(log_path).read() if os.path.exists(log_path) else ""
    m = re.search(r"ERROR SUMMARY: (\d+) error", sanitizer)
    errors = int(m.group(1)) if m else None
    # pytest's last line: "1 passed in 3.10s", "1 skipped ...", "1 failed ...", "1 error ...".
    said = set(re.findall(r"\b\d+ (passed|failed|skipped|xfailed|xpassed|errors?)\b", text))
    if rc is None:
        outcome = "timeout"
    elif errors:
        outcome = "memcheck errors"
    elif said & {"failed", "error", "errors"}:
        outcome = "failed"
    elif said:
        outcome = "passed" if said & {"passed", "xpassed"} else sorted(said)[0]
    elif rc < 0 or rc > 128:
        outcome = "signal"
        with open(os.path.join(OUT, "memcheck_signal.txt"), "a") as f:
            f.write(f"== {case} rc={rc}\n{sanitizer[-3000:]}\n-- output\n{text[-3000:]}\n")
    else:
        outcome = "no result"
    return {"rc": rc, "seconds": round(time.time() - t, 1), "errors": errors,
            "outcome": outcome, **({"warm": warm} if warm else {})}


def stage_memcheck(_):
    """Under ``compute-sanitizer --tool memcheck`` (:data:`MEMCHECK_RUNS`): the fuzz suite's
    valid and invalid problems (deliberately out-of-range block tables included); each log to
    ``memcheck_*.txt``.
    Started in the background (it needs little of the GPU and is not timed); the session waits
    for it before it ends, or at the ``memcheck_wait`` stage."""
    import threading

    global _memcheck
    lib = _ffi_library()
    _memcheck = threading.Thread(target=_memcheck_runs, args=(lib,), daemon=True)
    _memcheck.start()
    log("memcheck started in the background")


def stage_memcheck_fuzz(_):
    """The fuzz suite's valid and invalid problems on the Triton backend under the sanitizer,
    in the foreground (nothing else runs on the GPU meanwhile)."""
    _memcheck_runs(_ffi_library())


def stage_memcheck_wait(_):
    if _memcheck is not None:
        _memcheck.join()


def stage_ncu(cases):
    """Nsight Compute's view of one call's kernels (``jax_mla.bench.ncu``; the cases after
    ``--``, else its defaults): ours into ``ncu.json`` while FlashMLA builds, then the peers'
    (FlashMLA's, cuDNN's) into ``ncu_peers.json``."""
    from jax_mla.bench import ncu

    cases = cases or list(ncu.DEFAULT_CASES)
    ours = [c for c in cases if c.split(":")[0] in ncu.OURS]
    theirs = [c for c in cases if c not in ours]
    lib = _ffi_library()
    for name, group in (("ncu.json", ours), ("ncu_peers.json", theirs)):
        if group:
            _python(["-m", "jax_mla.bench.ncu", os.path.join(OUT, name), *group], 400, name,
                    peers=group is theirs, JAX_MLA_FFI_LIBRARY=lib)


def stage_planner(_):
    _ffi_library()
    _python(["-m", "jax_mla.bench.planner", os.path.join(OUT, "planner.json")], 300, "planner")


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
    # This process's own stages (env, kernels, gaps, graphs) are small: it takes GPU memory as
    # it goes instead of 75 % of it up front, which the stages' subprocesses need.
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        _CHILD_ENV_DROP.add("XLA_PYTHON_CLIENT_PREALLOCATE")
    if {"bench", "bench_triton", "launcher", "one_call", "ncu"} & set(stages):
        start_peer_build()
    for name in stages:
        log(f"== {name}")
        try:
            STAGES[name](bench_args)
        except Exception as e:  # noqa: BLE001 - a failing stage is logged; the others still run
            log(f"stage {name} failed: {e!r}")
    stage_memcheck_wait(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
