"""GPU time read from CUPTI: what each kernel of a call costs, with no launch gaps or host time.

``torch.profiler`` records every kernel, memset and memcpy the process launches (JAX's included)
through CUPTI. :func:`kernel_times` runs a jitted call ``calls`` times and returns, per call, each
kernel's time, their sum (the call's *GPU time*) and how many launches a call makes;
:func:`chain_gaps` profiles the bench's timing chain (``timing.chained``) and splits its span into
kernels and the idle gaps between them. Both need torch with CUDA (the GPU machine's image).
"""

from __future__ import annotations

import json
import os
import re
import tempfile

import jax


def _trace(prof) -> list[dict]:
    """Every event of a finished profile (its Chrome trace)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])


def _events(events: list[dict]) -> list[dict]:
    """The GPU's own work (kernels, memsets, memcpys), in time order."""
    ev = [e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    return sorted(ev, key=lambda e: float(e["ts"]))


def _profile(run, raw=False):
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    events = _trace(prof)
    return events if raw else _events(events)


def graph_launches(fn, *args, calls: int = 20) -> dict:
    """How ``jax.jit(fn)``'s calls reach the GPU, per call, from the CUDA API records: graph
    launches (``cuGraphLaunch``/``cudaGraphLaunch``) against kernel launches made one by one.
    Blind to XLA's command buffers: torch's profiler keeps CUDA runtime records, and XLA
    launches its graphs through the driver API (0 here proved nothing on the H200, 2026-12-05);
    ``jax_mla.bench.cmdbuf`` reads XLA's own log and thunk dump instead."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))

    def run():
        for _ in range(calls):
            jax.block_until_ready(f(*args))

    ev = _profile(run, raw=True)
    api = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    graph = sum("GraphLaunch" in e.get("name", "") for e in api)
    single = sum(e.get("name", "") in ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel",
                                       "cudaLaunchKernelExC") for e in api)
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    in_graph = sum(bool((e.get("args") or {}).get("graph id")) for e in kernels)
    return {"graph_launches": graph / calls, "single_launches": single / calls,
            "kernels": len(kernels) / calls, "kernels_in_graphs": in_graph / calls}


def family(name: str) -> str:
    """Our kernels by family; XLA's ops by name without the per-call ``_N`` suffix."""
    for key in ("mla_decode_sm90", "mla_decode", "mla_reduce_affine", "mla_reduce",
                "prefill_fwd"):
        if name.startswith(key):
            return key
    return re.sub(r"_\d+$", "", name)[:48]


def kernel_times(fn, *args, calls: int = 20) -> dict:
    """``{"gpu_us": per call, "launches": per call, "kernels_us": {family: us per call},
    "memcpy_launches": per call}`` for ``jax.jit(fn)(*args)``."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))

    def run():
        for _ in range(calls):
            jax.block_until_ready(f(*args))

    ev = _profile(run)
    per = {}
    for e in ev:
        k = family(e["name"])
        per[k] = per.get(k, 0.0) + float(e.get("dur", 0.0)) / calls
    return {"gpu_us": sum(per.values()), "launches": len(ev) / calls,
            "memcpy_launches": sum(e.get("cat") == "gpu_memcpy" for e in ev) / calls,
            "kernels_us": per}


def chain_gaps(fn, *args, n: int = 32, runs: int = 3, serial: bool = False) -> dict:
    """The timing chain of ``n`` dependent calls under CUPTI, ``runs`` runs of it dispatched
    back to back, each fed the last (``timing.chained(..., fed=True)``, as the stream timer's
    runs in flight); with ``serial``, ``n`` calls back to back with no dependency and no
    feeding kernel (``timing.chained(..., serial=True)``), runs dispatched back to back. The
    first run's GPU span per call, each kernel family's own time and the idle gap before it,
    per call; ``run_span_us``, every run's span per call (a run XLA ran one thunk at a time
    shows there); and ``between_runs_us``, the GPU's mean idle time from one run's last kernel
    to the next one's first (both None where the runs' kernels do not split evenly)."""
    from jax_mla.bench.timing import chained, serial_inputs

    if serial:
        many = chained(fn, n, serial=True)
        inputs = serial_inputs(args, n)
        jax.block_until_ready(many(*inputs))

        def run():
            jax.block_until_ready([many(*inputs) for _ in range(runs)])
    else:
        many = chained(fn, n, fed=True)
        prev = jax.block_until_ready(many(jax.jit(fn)(*args), *args))

        def run():
            out = prev
            for _ in range(runs):
                out = many(out, *args)
            jax.block_until_ready(out)

    ev = _profile(run)
    each = len(ev) // runs if len(ev) % runs == 0 else None
    # Runs that do not split evenly: every call of every run, the gaps between runs included.
    first, calls = (ev[:each], n) if each else (ev, n * runs)
    end = [float(e["ts"]) + float(e["dur"]) for e in ev]
    span = (end[len(first) - 1] - float(first[0]["ts"])) / calls
    own, gap = {}, {}
    for a, b in zip(first, first[1:] + [None]):
        k = family(a["name"])
        own[k] = own.get(k, 0.0) + float(a["dur"]) / calls
        if b is not None:
            kb = family(b["name"])
            gap[kb] = gap.get(kb, 0.0) + (float(b["ts"]) - float(a["ts"])
                                          - float(a["dur"])) / calls
    between = ([float(ev[r * each]["ts"]) - end[r * each - 1] for r in range(1, runs)]
               if each and runs > 1 else None)
    spans = ([(end[(r + 1) * each - 1] - float(ev[r * each]["ts"])) / n for r in range(runs)]
             if each else None)
    return {"span_us": span, "kernels_us": own, "gap_before_us": gap,
            "launches": len(first) / calls, "run_span_us": spans,
            "between_runs_us": sum(between) / len(between) if between else None}


def available() -> bool:
    """Whether CUPTI can be read here (torch with a CUDA device)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _computations(hlo: str) -> dict[str, str]:
    """``{name: body}`` of an HLO module's text (one computation per top-level ``{ ... }``)."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        if name is None:
            m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m and not line.startswith((" ", "HloModule")):
                name, body = m.group(1), []
        elif line.startswith("}"):
            comps[name] = "\n".join(body)
            name = None
        else:
            body.append(line)
    return comps


def command_buffers(fn, *args, targets: tuple[str, ...] | None = None) -> dict:
    """What XLA put in command buffers (CUDA graphs) in ``jax.jit(fn)``'s compiled program:
    ``{"command_buffers", "custom_calls", "custom_calls_in_command_buffers"}``, the custom calls
    counted being those of ``targets`` (None: every launcher target of ``ffi_launch``'s: one
    launch, a launch sequence, a recorded launch)."""
    if targets is None:
        from jax_mla.backends.triton import ffi_launch as fl

        targets = (fl.TARGET_NAME, fl.SEQUENCE_TARGET_NAME, fl.RECORD_TARGET_NAME)
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    comps = _computations(hlo)
    names = "|".join(map(re.escape, targets))
    pattern = re.compile(f'custom_call_target="({names})"')
    cbs = {k: v for k, v in comps.items() if k.startswith("command_buffer")}
    return {"command_buffers": len(cbs), "custom_calls": len(pattern.findall(hlo)),
            "custom_calls_in_command_buffers": sum(len(pattern.findall(v))
                                                   for v in cbs.values())}
