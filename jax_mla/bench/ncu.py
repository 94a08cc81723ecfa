"""Where a kernel's time goes, from Nsight Compute: one call's kernels, ours and the peers'.

``python -m jax_mla.bench.ncu OUT.json [CASE ...]`` profiles each case in a process of its own
under ``ncu`` and writes, per kernel, its duration, its throughputs as fractions of the GPU's
peaks (SM, tensor pipe, DRAM), the bytes it read from DRAM, its launch (grid, block, registers,
shared memory, achieved occupancy) and its warps' stall reasons. A case is ``WHO:SPEC``:

- ``jax_mla:B,H,S[,Q[,PAGE[,KV]]]`` (a decode shape, ``bench.decode.Shape``): one
  ``mla_attention`` call with its metadata built beforehand, every kernel of the call;
- ``flashmla:B,H,S[,Q]``: FlashMLA's decode on the same kind of inputs (where it is built;
  ``bench.peers``);
- ``prefill:B,H,S`` and ``cudnn:B,H,S``: causal prefill (qk 192, v 128, bf16), ours and torch's
  cuDNN SDPA.

Nsight Compute under a whole JAX process did not profile a kernel within 300 s
(2026-12-03, every launch intercepted and profiled from the start). Here profiling is off until
the call being measured (``--profile-from-start off``; the child brackets its last call with the
driver's ``cuProfilerStart`` / ``cuProfilerStop``), only the application process is attached
(Triton's ptxas runs unwatched), and XLA's command buffers are off so that each kernel is a
launch of its own. Clocks are left as they are (``--clock-control none``), so durations compare
with the CUPTI times of the other benches; each metric pass replays the kernel.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy",
            "LaunchStats", "WarpStateStats")
OURS = ("jax_mla", "prefill")  # the others are peers (FlashMLA, cuDNN)
DEFAULT_CASES = ("jax_mla:128,128,4096", "flashmla:128,128,4096", "jax_mla:64,16,4096",
                 "flashmla:64,16,4096", "jax_mla:64,16,4096,1,64,fp8",
                 "jax_mla:128,128,4096,1,64,fp8", "prefill:1,16,8192", "cudnn:1,16,8192")
# One value a kernel each (raw metric name -> key in the output).
METRICS = {
    "gpu__time_duration.sum": "us",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "warps_active_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block": "shared_bytes",
    "launch__occupancy_limit_registers": "occupancy_limit_registers",
}
# Asked for by name as well as through the sections (the sections' DRAM figures differ between
# Nsight Compute versions); a run that rejects them is repeated without.
EXTRA_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"
TENSOR = re.compile(r"^sm__pipe_tensor\w*_cycles_active\.avg\.pct_of_peak_sustained_active$")
STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active"
                   r"\.ratio$")
UNIT = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
        "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def parse_raw_csv(text: str) -> list[dict]:
    """Kernels from ``ncu --import R --csv --page raw``: a header of metric names, a row of
    units, then a row a kernel. Durations in µs, bytes in bytes; the tensor pipes' busy
    fractions under ``tensor_pct`` (the busiest), stall reasons (cycles a warp waits per issued
    instruction) under ``stalls``, largest first."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return []
    header, units, data = rows[0], rows[1], rows[2:]
    out = []
    for values in data:
        rec = dict(zip(header, values))
        unit = dict(zip(header, units))
        k = {"kernel": rec.get("Kernel Name", "?")}
        for metric, key in METRICS.items():
            if metric in rec and (x := _number(rec[metric], unit.get(metric, ""))) is not None:
                k[key] = x
        tensor = {m: _number(v, "") for m, v in rec.items() if TENSOR.match(m)}
        tensor = {m: v for m, v in tensor.items() if v is not None}
        if tensor:
            k["tensor_pct"] = max(tensor.values())
            k["tensor_pipes"] = tensor
        stalls = {}
        for m, v in rec.items():
            hit = STALL.match(m)
            # "selected" is the issuing itself (1 a warp), not a wait
            if (hit and hit.group(1) not in ("selected", "not_selected")
                    and (x := _number(v, "")) is not None and x > 0):
                stalls[hit.group(1)] = max(stalls.get(hit.group(1), 0.0), x)
        k["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
        out.append(k)
    return out


def _number(text: str, unit: str):
    try:
        x = float(text.replace(",", ""))
    except ValueError:
        return None
    return x * UNIT.get(unit, 1.0)


def _profiler(on: bool) -> None:
    """The CUDA driver's profiler range (what ``--profile-from-start off`` waits for)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    rc = cuda.cuProfilerStart() if on else cuda.cuProfilerStop()
    if rc != 0:
        raise RuntimeError(f"cuProfiler{'Start' if on else 'Stop'} returned {rc}")


def _measured(call, sync) -> None:
    """Two calls to warm up, then the profiled one."""
    for _ in range(2):
        sync(call())
    _profiler(True)
    sync(call())
    _profiler(False)


def child(case: str) -> None:
    """Run one case's call three times, the last inside the profiler range."""
    who, spec = case.split(":", 1)
    import jax
    import numpy as np

    if who in ("jax_mla", "flashmla"):
        from jax_mla.bench import ab, decode, peers

        shape = decode.Shape.parse(spec)
        fn, args = decode.attention_call(shape, np.random.default_rng(0))
        if who == "jax_mla":
            f = jax.jit(fn)
            _measured(lambda: f(*args), jax.block_until_ready)
            return
        import torch

        if peers.flashmla() is None:
            raise SystemExit("FlashMLA is not built here")
        q, cache, _ = args
        fm = peers.FlashMLA(q, cache, *ab.inputs(shape), qlen=shape.qlen,
                            scale=decode.DEEPSEEK_SCALE)
        _measured(fm.call, lambda _: torch.cuda.synchronize())
        return
    b, h, s = (int(x) for x in spec.split(","))
    scale = 192 ** -0.5
    if who == "prefill":
        import functools

        import jax.numpy as jnp

        from jax_mla import mla_prefill
        from jax_mla.bench import prefill

        shape = prefill.uniform(b, s, h)
        q, k, v, cu = prefill._inputs(shape, jnp.bfloat16, jax.random.key(0))
        f = jax.jit(functools.partial(mla_prefill, scale=scale, causal=True, max_seqlen=s,
                                      backend="triton"))
        _measured(lambda: f(q, k, v, cu), jax.block_until_ready)
        return
    if who == "cudnn":
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(b, h, s, 192, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        v = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            _measured(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale), lambda _: torch.cuda.synchronize())
        return
    raise SystemExit(f"unknown case {case!r}: WHO is jax_mla, flashmla, prefill or cudnn")


def profile_case(case: str, ncu: str, timeout: int, workdir: str) -> dict:
    """One case under ``ncu`` in a process of its own; its kernels (:func:`parse_raw_csv`)."""
    rep = os.path.join(workdir, re.sub(r"\W+", "_", case))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # torch (FlashMLA, cuDNN) beside
    env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"),
                                              "--xla_gpu_enable_command_buffer="]))
    t = time.time()
    row: dict = {"case": case}
    for extra in (["--metrics", EXTRA_METRICS], []):
        cmd = [ncu, "--profile-from-start", "off", "--target-processes", "application-only",
               "--clock-control", "none", *(a for s in SECTIONS for a in ("--section", s)),
               *extra, "-f", "-o", rep, sys.executable, "-m", "jax_mla.bench.ncu", "--child",
               case]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            row["rc"] = r.returncode
            tail = (r.stdout + r.stderr).strip().splitlines()[-6:]
        except subprocess.TimeoutExpired:
            row["rc"], tail = -1, [f"TIMEOUT after {timeout} s"]
            break
        if r.returncode == 0 or "metric" not in (r.stdout + r.stderr).lower():
            break
    row["seconds"] = round(time.time() - t, 1)
    if os.path.exists(rep + ".ncu-rep"):
        raw = subprocess.run([ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "raw"],
                             capture_output=True, text=True, timeout=120)
        row["kernels"] = parse_raw_csv(raw.stdout)
    if not row.get("kernels"):
        row["log"] = tail
    return row


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child(argv[1])
        return 0
    timeout = 150
    if "--timeout" in argv:
        i = argv.index("--timeout")
        timeout = int(argv[i + 1])
        del argv[i:i + 2]
    if not argv:
        print(__doc__)
        return 2
    from jax_mla.bench import report

    path, cases = argv[0], argv[1:] or list(DEFAULT_CASES)
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case in cases:
            rows.append(profile_case(case, ncu, timeout, workdir))
            print(report.ncu_table(rows[-1:]), *rows[-1].get("log", []), sep="\n",
                  flush=True)
            with open(path, "w") as f:  # after every case: a call cut short keeps what ran
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
