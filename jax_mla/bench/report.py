"""``RESULTS.md`` for one device's results folder, generated from its JSON files.

    python -m jax_mla.bench.report benchmarks/results/h200

Reads whatever of these the folder holds (the stages of ``python -m jax_mla.bench.session``):
``decode.json`` (the grid, both timers), ``decode_before.json`` (the same grid run in the same
session on an earlier tree, for a before/after table), ``kernels.json`` and ``kernels_before.json``
(CUPTI per kernel), ``prefill.json``, ``dcp_split.json``, ``aiter_bridge.json``, ``ab.json``,
``ab_fp8.json``, ``ab_fp8_verify.json``, ``ab_fp8_head_blocks.json``, ``ab_sm90_fp8.json``,
``ab_pdl.json``, ``ab_split_q.json``, ``ab_split_q_more.json``, ``ab_split_acc.json``,
``split_probe.json``,
``update_mode_*.json`` (the FFI path under each XLA command-buffer update mode, a process each),
``stream_execute.json``, ``stream_initialize.json``, ``record_ab.json``, ``cmdbuf.json``,
``cmdbuf_chains*.json``, ``launcher_ab.json``, ``one_call_ab.json``, ``jax_versions_ab.json``,
``graphs.json``,
``planner.json``, ``latency_ab.json``, ``conformance.json``
(the GPU test summary), ``conformance_ffi.json`` (one case a row), ``client_ab.json`` (the
default PJRT client against its TFRT client), ``allocators.json`` (chained calls and XLA's
command-buffer updates under each allocator), ``anatomy.json`` (a waited run of the stream
timer's chain cut at the GPU's first and last activity, per client and knob), and
``tried.md`` (what was measured and kept or dropped, in words), and writes ``RESULTS.md``
next to them. Ratios are against the device's reference ceilings (docs/design.md §10.4: the
H200's 4.27 TB/s copy and 790 TFLOP/s bf16 matmul); the bench's own in-run probes are shown
beside them, since they move with the GPU's clocks from run to run.
"""

from __future__ import annotations

import glob
import json
import os
import sys

REFERENCE_CEILINGS = {"copy_bytes_per_s": 4.27e12, "bf16_matmul_flops": 7.9e14}


def _load(folder, name):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _e(x):
    return "-" if x is None else f"{x:.1e}"


def decode_table(data) -> str:
    env, rows = data["environment"], data["rows"]
    # Runs since 2026-12-06 also time every row with runs in flight (``timing.device_time``).
    flight = any("in_flight_us" in r for r in rows)
    ceil = REFERENCE_CEILINGS
    probe = (f" (the run's own probes: {env['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
             f"{env['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s)" if "copy_bytes_per_s" in env else "")
    out = [f"Device {env.get('device')}, jax {env.get('jax')}, triton {env.get('triton')}, "
           f"jax-triton {env.get('jax_triton')}, {env.get('date')}. {env.get('note', '')}", "",
           f"Ratios against copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s and bf16 matmul "
           f"{ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s{probe}.", "",
           "| shape | backend | stream µs | " + ("in flight µs | " if flight else "")
           + "GPU µs | launches | TB/s | % copy | TFLOP/s | % matmul | × XLA | metadata µs "
           "(launches) | rel err |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if flight else "")]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r.get('backend', '-')} | error: "
                       f"{r['error'][:80]} " + "|" * (10 + flight))
            continue
        out.append(
            f"| {r['shape']} | {r['backend']} | {_f(r['us'])} | "
            + (f"{_f(r.get('in_flight_us'))} | " if flight else "") + f"{_f(r.get('gpu_us'))} | "
            f"{_f(r.get('launches'), 0)} | {r['kv_TBps']:.2f} | "
            f"{100 * r['kv_TBps'] * 1e12 / ceil['copy_bytes_per_s']:.0f} | {r['TFLOPs']:.0f} | "
            f"{100 * r['TFLOPs'] * 1e12 / ceil['bf16_matmul_flops']:.0f} | "
            f"{_f(r.get('speedup_vs_xla'))} | {_f(r.get('metadata_us'))} "
            f"({_f(r.get('metadata_launches'), 0)}) | {_e(r.get('rel_err_vs_xla'))} |")
    return "\n".join(out)


def before_after_table(before, after, backend="triton") -> str:
    """Stream time (and GPU time where both have it) of the same shapes, before and after."""
    b = {r["shape"]: r for r in before["rows"] if r.get("backend") == backend and "us" in r}
    out = ["| shape | before µs | after µs | after / before | before GPU µs | after GPU µs |",
           "|---|---|---|---|---|---|"]
    ratios = []
    for r in after["rows"]:
        if r.get("backend") != backend or "us" not in r or r["shape"] not in b:
            continue
        o = b[r["shape"]]
        ratios.append(r["us"] / o["us"])
        out.append(f"| {r['shape']} | {o['us']:.1f} | {r['us']:.1f} | {ratios[-1]:.3f} | "
                   f"{_f(o.get('gpu_us'))} | {_f(r.get('gpu_us'))} |")
    if ratios:
        ratios.sort()
        out.append("")
        out.append(f"After / before over {len(ratios)} shapes: median "
                   f"{ratios[len(ratios) // 2]:.3f}, range {ratios[0]:.3f} to {ratios[-1]:.3f}.")
    return "\n".join(out)


def latency_table(data) -> str:
    out = [data.get("note", ""), "", "| shape | before best µs | after best µs | before rounds | "
           "after rounds |", "|---|---|---|---|---|"]
    for spec, b in data["before"].items():
        a = data["after"].get(spec, {})
        out.append(f"| {spec} | {b['best_us']:.1f} | {_f(a.get('best_us'))} | "
                   f"{', '.join(f'{x:.1f}' for x in b['rounds_us'])} | "
                   f"{', '.join(f'{x:.1f}' for x in a.get('rounds_us', []))} |")
    return "\n".join(out)


def kernels_table(rows, before=None) -> str:
    prev = {r["shape"]: r for r in (before or [])}
    out = ["| shape | GPU µs / call | launches / call | memcpys / call | kernels (µs) | "
           "before: GPU µs, launches |", "|---|---|---|---|---|---|"]
    for r in rows:
        ks = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["kernels_us"].items(),
                                                        key=lambda kv: -kv[1])[:4])
        p = prev.get(r["shape"])
        pb = (f"{p['gpu_us']:.1f}, {p['launches']:.0f} ({p.get('memcpy_launches', 0):.0f} memcpys)"
              if p else "-")
        out.append(f"| {r['shape']} | {r['gpu_us']:.1f} | {r['launches']:.0f} | "
                   f"{r.get('memcpy_launches', 0):.0f} | {ks} | {pb} |")
    return "\n".join(out)


def prefill_table(data) -> str:
    out = ["| shape | backend | µs | TFLOP/s | × XLA |", "|---|---|---|---|---|"]
    for r in data.get("rows", []):
        out.append(f"| {r['shape']} | {r['backend']} | {r['us']:.1f} | {r['TFLOPs']:.0f} | "
                   f"{_f(r.get('speedup_vs_xla'))} |")
    return "\n".join(out)


def dcp_table(data) -> str:
    out = ["| shape | N | local tokens | gathered heads | local attention µs | merge ag_rs µs | "
           "merge a2a µs | merge share (ag_rs / a2a) |", "|---|---|---|---|---|---|---|---|"]
    for r in data.get("rows", []):
        if "local_attn_s" not in r:
            continue
        out.append(f"| {r['shape']} | {r['world_size']} | {r['local_seq_len']} | "
                   f"{r['gathered_heads']} | {r['local_attn_s'] * 1e6:.1f} | "
                   f"{r['merge_ag_rs_s'] * 1e6:.1f} | {r['merge_a2a_s'] * 1e6:.1f} | "
                   f"{r['merge_share_ag_rs']:.2f} / {r['merge_share_a2a']:.2f} |")
    return "\n".join(out)


def update_modes_table(by_mode: dict) -> str:
    """``update_mode_<MODE>.json`` (the session's ``update_modes`` stage): per shape and XLA
    command-buffer update mode, stream and GPU time and their ratio (one process a mode)."""
    out = ["| shape | update mode | stream µs | GPU µs | stream ÷ GPU |", "|---|---|---|---|---|"]
    shapes = list(dict.fromkeys(r["shape"] for rows in by_mode.values() for r in rows))
    for shape in shapes:
        for mode, rows in by_mode.items():
            for r in rows:
                if r["shape"] != shape or r["variant"] == "flashmla":
                    continue
                gpu = r.get("gpu_us")
                ratio = f"{r['best_us'] / gpu:.3f}" if gpu else "-"
                out.append(f"| {shape} | {mode} | {r['best_us']:.1f} | {_f(gpu)} | {ratio} |")
    return "\n".join(out)


# Stream columns a run may add (``bench.ab --donated`` / ``--in-flight`` / ``--serial``), where
# a row has them.
_AB_STREAMS = (("donated_best_us", "outputs donated µs"),
               ("wall_best_us", "FlashMLA's graph, our clock µs"),
               ("in_flight_best_us", "runs in flight µs"),
               ("serial_best_us", "calls back to back, no feeding kernel µs"),
               ("serial_in_flight_best_us", "calls back to back, runs in flight µs"))
# Those of them a table also divides by the GPU time.
_AB_RATIOS = (("in_flight_best_us", "in flight"), ("serial_best_us", "back to back"),
              ("serial_in_flight_best_us", "back to back in flight"))


def _stream_columns(rows) -> tuple[list, list]:
    """The extra stream columns ``rows`` have (``(key, label)``), and those of them divided by
    the GPU time in a column of their own (``(key, label)``: runs in flight, calls back to
    back)."""
    extra = [(key, label) for key, label in _AB_STREAMS if any(key in r for r in rows)]
    keys = {key for key, _ in extra}
    return extra, [(key, label) for key, label in _AB_RATIOS if key in keys]


def _ratio_cells(r, ratios) -> str:
    """A row's ``key / GPU`` cells (``-`` where it has no GPU time or no such stream time)."""
    gpu = r.get("gpu_us")
    return "".join(f"{_f(r[key] / gpu if gpu and r.get(key) else None, 3)} | "
                   for key, _ in ratios)


def ab_table(rows) -> str:
    extra, ratios = _stream_columns(rows)
    out = ["| shape | variant | best stream µs | " + "".join(f"{label} | " for _, label in extra)
           + "× first | GPU µs | " + "".join(f"{label} ÷ GPU | " for _, label in ratios)
           + "rel err vs first | LSE max abs err vs first |",
           "|---|---|---|---|---|---|---|" + "---|" * (len(extra) + len(ratios))]
    for r in rows:
        # "-": not compared (rows of separate processes)
        gpu = r.get("gpu_us")
        out.append(f"| {r['shape']} | {r['variant']} | {r['best_us']:.1f} | "
                   + "".join(f"{_f(r.get(key))} | " for key, _ in extra)
                   + f"{r['vs_first']:.3f} | {_f(gpu)} | " + _ratio_cells(r, ratios)
                   + f"{_e(r.get('rel_err_vs_first'))} | {_e(r.get('lse_max_abs_err_vs_first'))} |")
    return "\n".join(out)


# Same-run tuning A/Bs (``python -m jax_mla.bench.ab``), by file.
AB_FILES = (("ab.json", "Tuning A/B (same run)"),
            ("ab_fp8.json", "fp8 caches: tiles, conversion and products (same run)"),
            ("ab_fp8_verify.json", "fp8 verify: head blocks and rows a program (same run)"),
            ("ab_fp8_head_blocks.json",
             "fp8 64-row tile (CUDA): which head blocks are right (same run)"),
            ("ab_sm90_fp8.json", "The Gluon fp8 kernel against the Triton tile (same run)"),
            ("ab_pdl.json", "Programmatic dependent launch (same run)"),
            ("ab_split_q.json", "A 16-bit query against an fp8 cache: the Gluon fp8 kernel "
             "with the query split by XLA in two e4m3 parts (`sq`) against the Triton tiles "
             "(`tile`), bf16 beside (same run)"),
            ("ab_split_q_more.json", "The same at more shapes, stream time only (`sq64`: "
             "64-row tiles at every head count; another run)"),
            ("ab_split_acc.json", "The split-query path: XLA's split (`sq`, then the "
             "default), the low part's products summed apart (`sqa`, `split_acc`) and the "
             "split as one Triton kernel (`sqk`, `split_q_kernel`, the default since) (same "
             "run)"),
            ("ab_fp8_lean.json", "The Gluon fp8 kernel before (`held`) and after (`lean`) it "
             "stopped holding loop-invariant rows through its KV loops (two processes, one "
             "machine, one call)"),
            ("record_ab.json", "Our launches captured into command buffers (`ffi`, the default) "
             "or recorded through XLA's record stage (`record`) (same run)"),
            ("donated_ab.json", "Stream time with fresh output buffers each run (`best "
             "stream`) and with the chain's outputs donated run to run (same run)"),
            ("stream_execute.json", "Stream time, XLA's execute stage only (one process)"),
            ("stream_initialize.json",
             "Stream time, XLA's initialize stage registered too (another process)"))


def memcheck_table(rows) -> str:
    """``memcheck.json`` (the session's ``memcheck_conformance`` stage): one sanitized process a
    case; every try's outcome and seconds (after the call or session it ran in, where the
    rows gather several), the last one's the result."""
    out = ["| case | result | memcheck errors | tries (outcome, s) |", "|---|---|---|---|"]
    for r in rows:
        tries = ", ".join((f"{t['call']}: " if "call" in t else "") + t["outcome"]
                          + ("" if t["seconds"] is None else f" {t['seconds']:.0f}")
                          for t in r["tries"]) or "-"
        errors = "-" if r["errors"] is None else r["errors"]
        out.append(f"| `{r['test'].split('/')[-1]}` | {r['result']} | {errors} | {tries} |")
    return "\n".join(out)


def split_probe_table(rows) -> str:
    """``split_probe.json`` (``python -m jax_mla.bench.split_probe``): per case, the split's own
    error on the device, the share of nonzero low parts, and each made-parts variant's error
    against its own float64 answer (NaN rows in brackets)."""
    names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    out = ["| case | split rel err | low part nonzero | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r[n]['rel_err']:.1e}" + (f" ({r[n]['nan_rows']} NaN rows)"
                                             if r[n].get("nan_rows") else "") for n in names]
        out.append(f"| {r['case']} | {r['split_rel_err']:.1e} | {r['lo_nonzero']:.3f} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def cmdbuf_table(rows) -> str:
    """``cmdbuf.json`` (``python -m jax_mla.bench.cmdbuf``): per flag set and shape, the
    command buffers XLA formed, the chain's stream time, the kernels' GPU time and the span
    of one call's kernels in the chain; where the run logged them, the command-buffer updates
    XLA made before its replays while the stream time was taken, and their mean cost."""
    out = ["| flag set | shape | command buffers | stream µs | GPU µs | chain span µs | "
           "updates / replays | µs an update |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        up = r.get("updates") or {}
        ups = f"{up['updates']} / {up['executions']}" if "updates" in up else "-"
        out.append(f"| {r['flag_set']} | {r['shape']} | {r['command_buffers']} | "
                   f"{_f(r.get('stream_us'))} | {_f(r.get('gpu_us'))} | "
                   f"{_f(r.get('chain_span_us'))} | {ups} | {_f(up.get('update_us_mean'))} |")
    return "\n".join(out)


def _inside(row) -> str:
    """Whether a chain row's launches ran in command buffers: yes, no, or - (not recorded);
    ``recorded`` where they went in through XLA's record stage (``launcher="ffi_record"``),
    ``+ init`` where XLA's initialize stage was registered too."""
    inside = row.get("ffi_command_buffers")
    mode = "-" if inside is None else ("yes" if inside else "no")
    if inside and row.get("launcher") == "ffi_record":
        mode += ", recorded"
    return mode + (" + init" if row.get("ffi_initialize_stage") else "")


def _updates(row) -> str:
    """XLA's command-buffer log of a chain row's timed runs: updates before a replay (first
    records), the most executions between updates, our calls recorded by stream capture and
    launches created through the record stage."""
    u = row.get("updates")
    if not u or not (u.get("executions") or u.get("updates") or u.get("first_records")):
        return "- | - | - | - | -"
    return (f"{u.get('updates', 0)} ({u.get('first_records', 0)}) | "
            f"{_f(u.get('executions_since_update_max'), 0)} | {u.get('stream_captures', 0)} | "
            f"{u.get('ffi_records', 0)} | {_f(u.get('update_us_mean'), 0)}")


def chains_table(rows) -> str:
    """``cmdbuf_chains*.json`` (``python -m jax_mla.bench.cmdbuf --chains``): per shape and
    chain length, wall and host enqueue time per call, and the GPU span per call (CUPTI), with
    our launches in command buffers or outside them (``JAX_MLA_FFI_COMMAND_BUFFERS``), with or
    without XLA's initialize stage (``JAX_MLA_FFI_INITIALIZE_STAGE``), and what XLA's log said
    of command-buffer updates while the chain was timed."""
    out = ["| shape | our calls in command buffers | calls chained | wall µs a call | "
           "enqueue µs a call | GPU span µs a call | wall - span | XLA updates (first records) "
           "| most runs between updates | calls stream-captured | launches recorded | µs an "
           "update (log on) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        span = r.get("span_us")
        out.append(f"| {r['shape']} | {_inside(r)} | {r['n']} | {_f(r['wall_us'])} | "
                   f"{_f(r['enqueue_us'])} | {_f(span)} | "
                   f"{_f(r['wall_us'] - span if span is not None else None)} | "
                   f"{_updates(r)} |")
    return "\n".join(out)


def allocators_table(data) -> str:
    """``allocators.json`` (the session's ``allocators`` stage, merged): per PJRT allocator or
    client and shape, chained calls' wall and host enqueue time a call, and XLA's
    command-buffer updates over the timed runs, with the allocations that moved; a client
    that could not run says why."""
    out = [data.get("note", ""), "",
           "| allocator / client | shape | calls chained | wall µs a call | enqueue µs a call | "
           "updates / runs | allocations moved | most runs between updates | µs an update "
           "(log on) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if "error" in r:
            out.append(f"| {r['client']} | - | - | failed: {r['error'][:90]} | - | - | - | - "
                       "| - |")
            continue
        u = r.get("updates") or {}
        out.append(f"| {r['client']} | {r['shape']} | {r['n']} | {_f(r['wall_us'])} | "
                   f"{_f(r['enqueue_us'])} | {u.get('updates', 0)} / {u.get('executions', 0)} "
                   f"| {_f(u.get('updated_allocs_mean'))} | "
                   f"{_f(u.get('executions_since_update_max'), 0)} | "
                   f"{_f(u.get('update_us_mean'), 0)} |")
    return "\n".join(out)


def anatomy_table(data) -> str:
    """``anatomy.json`` (the session's ``anatomy`` stage, curated): per variant, shape and
    chain length, the chain's wall and enqueue time a call without a profiler, and under one
    where a waited run's time goes (host until the GPU starts, the GPU's span and busy time,
    the GPU done until the wait returns) with XLA's update and graph launch before the GPU
    starts; then the chains timed with XLA's update log (``chains``)."""
    out = [data.get("note", ""), "",
           "| call | variant | shape | calls chained | wall / enqueue µs a call | profiled: "
           "before / span / busy / after µs a call | XLA's update, graph launch µs a run "
           "(runs) |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        u, p = r["unprofiled_per_call_us"], r["profiled_per_call_us"]
        ev, runs = r.get("before_events_run_us", {}), r.get("runs_with_event", {})
        update = (f"{_f(ev['command_buffer::update'], 0)} ({runs['command_buffer::update']})"
                  if "command_buffer::update" in ev else "none")
        launch = next((f"{_f(ev[k], 0)}" for k in ("cuGraphLaunch", "command_buffer::execute")
                       if k in ev), "-")
        out.append(f"| {r['call']} | {r['variant']} | {r['shape']} | {r['n']} | "
                   f"{_f(u['wall_us'])} / {_f(u['enqueue_us'])} | "
                   f"{_f(p.get('before_us'))} / {_f(p.get('span_us'))} / "
                   f"{_f(p.get('busy_us'))} / {_f(p.get('after_us'))} | {update}, {launch} |")
    chains = data.get("chains") or []
    if chains:
        out += ["", "| process | shape | calls chained | wall / enqueue µs a call | updates / "
                "runs | commands updated | stream captures |", "|---|---|---|---|---|---|---|"]
        for c in chains:
            u = c["updates"]
            out.append(f"| {c['process']} | {c['shape']} | {c['n']} | {_f(c['wall_us'])} / "
                       f"{_f(c['enqueue_us'])} | "
                       + (f"{u.get('updates', 0)} / {u.get('executions', 0)} | "
                          f"{_f(u.get('commands_updated_mean'), 0)} | "
                          f"{u.get('stream_captures', 0)} |" if c.get("log") else
                          "log off | - | - |"))
    return "\n".join(out)


def conformance_runs_table(data) -> str:
    """``conformance_ffi.json`` (the ``conformance_shards`` stage): the run's outcomes by count,
    each case that did not pass, and the other runs' summaries and failures."""
    counts = ", ".join(f"{v} {k}" for k, v in sorted(data["summary"].items()))
    out = [data.get("note", ""), "",
           f"{counts} ({data.get('shards')} processes, {_f(data.get('wall_s'), 0)} s)."]
    out += [f"- {c['outcome']}: `{c['test']}`" for c in data["cases"]
            if c["outcome"] not in ("passed", "xfailed", "skipped")]
    for run in data.get("other_runs", []):
        text = ", ".join(f"{k}: {v}" for k, v in run["summary"].items())
        out += [f"- {run['run']}: {text}."] + [f"  - failed: `{f}`" for f in run.get("failed", [])]
    return "\n".join(out)


def host_events_table(rows, top: int = 12) -> str:
    """The host's time per chained call by event name (``host_events_us`` of the longest chain
    of each shape and launch mode; a profiler trace, CUPTI on: names compare, not totals)."""
    out = ["| shape | our calls in command buffers | calls chained | host event | µs a call |",
           "|---|---|---|---|---|"]
    for r in rows:
        for name, us in list(r["host_events_us"].items())[:top]:
            out.append(f"| {r['shape']} | {_inside(r)} | {r['n']} | `{name}` | {us:.2f} |")
    return "\n".join(out)


def launcher_table(rows) -> str:
    """The launcher A/B (``launcher_ab.json``): both timers (the stream time also with runs in
    flight and with our calls back to back, FlashMLA's graph also by our clock, where
    measured), stream over GPU time,
    metadata, command buffers, and FlashMLA beside where it ran. Rows gathered from several
    runs (each shape's variants in one) name theirs (``run``) in a last column."""
    extra, ratios = _stream_columns(rows)
    runs = any("run" in r for r in rows)
    out = ["| shape | variant | stream µs | " + "".join(f"{label} | " for _, label in extra)
           + "GPU µs | stream / GPU | " + "".join(f"{label} / GPU | " for _, label in ratios)
           + "launches | metadata GPU µs (launches, memcpys) | command buffers (FFI calls in "
           "them / all) | rel err vs first |" + (" run |" if runs else ""),
           "|---|---|---|---|---|---|---|---|---|"
           + "---|" * (len(extra) + len(ratios) + runs)]
    for r in rows:
        gpu = r.get("gpu_us")
        cb = ("-" if "command_buffers" not in r else str(r["command_buffers"]) + (
            f" ({r['custom_calls_in_command_buffers']} / {r['custom_calls']})"
            if "custom_calls" in r else ""))
        md = (f"{_f(r.get('metadata_gpu_us'))} ({_f(r.get('metadata_launches'), 0)}, "
              f"{_f(r.get('metadata_memcpys'), 0)})")
        out.append(f"| {r['shape']} | {r['variant']} | {r['best_us']:.1f} | "
                   + "".join(f"{_f(r.get(key))} | " for key, _ in extra) + f"{_f(gpu)} | "
                   f"{_f(r['best_us'] / gpu if gpu else None, 3)} | "
                   + _ratio_cells(r, ratios)
                   + f"{_f(r.get('launches'), 0)} | {md} | {cb} | "
                   f"{r['rel_err_vs_first']:.1e} |" + (f" {r.get('run', '-')} |" if runs else ""))
    return "\n".join(out)


def gaps_table(rows) -> str:
    """``gaps.json`` (the session's ``gaps`` stage): the timing chain on the GPU's timeline
    (CUPTI), per call: its span, our kernels' time and the timer's own (the kernels that feed
    each call its dependency on the one before; none in the back-to-back chain), the idle gaps
    between kernels, every run's span and the idle time between runs; the launcher that ran
    (``-`` for rows from before it was recorded)."""
    out = ["| shape | chain | launcher | span µs a call | our kernels µs | the timer's kernels µs "
           "| gaps µs | span less the timer's kernels µs | each run's span µs a call | "
           "idle between runs µs |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = sum(v for k, v in r["kernels_us"].items() if k.startswith("mla_"))
        timer = sum(v for k, v in r["kernels_us"].items() if not k.startswith("mla_"))
        gaps = sum(r["gap_before_us"].values())
        spans = ", ".join(f"{x:.1f}" for x in r.get("run_span_us") or []) or "-"
        out.append(f"| {r['shape']} | {r.get('chain', 'fed')} | {r.get('launcher', '-')} | "
                   f"{r['span_us']:.1f} | "
                   f"{ours:.1f} | {timer:.1f} | {gaps:.1f} | {r['span_us'] - timer:.1f} | "
                   f"{spans} | {_f(r.get('between_runs_us'))} |")
    return "\n".join(out)


def graphs_table(rows) -> str:
    out = ["| shape | program | XLA flags | command buffers in the HLO | our calls in them / all "
           "| graph launches / single kernel launches per call (CUDA API) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        api = ("-" if "graph_launches" not in r else
               f"{r['graph_launches']:.1f} / {r['single_launches']:.1f}")
        out.append(f"| {r['shape']} | {r.get('program', 'call')} | {r.get('xla_flags') or '-'} | "
                   f"{r['command_buffers']} | {r['custom_calls_in_command_buffers']} / "
                   f"{r['custom_calls']} | {api} |")
    return "\n".join(out)


def planner_table(rows) -> str:
    """``planner.json`` (``python -m jax_mla.bench.planner``): a step's metadata, GPU µs
    (launches, memcpys), with the split plan in XLA ops and in the planning kernel, and the
    planning kernel alone under each chunk/warp variant."""
    names = list(rows[0]["variants"]) if rows else []
    out = ["| shape | programs | jnp plan | planning kernel | "
           + " | ".join(f"kernel alone: {n}" for n in names) + " |",
           "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        j, k = r["jnp"], r["kernel"]
        cells = [f"{r['variants'][n]['gpu_us']:.1f}" + ("" if r["variants"][n]["exact"]
                                                         else " (differs!)") for n in names]
        out.append(f"| {r['shape']} | {r['num_programs']} | {j['gpu_us']:.1f} "
                   f"({j['launches']:.0f}, {j['memcpys']:.0f}) | {k['gpu_us']:.1f} "
                   f"({k['launches']:.0f}, {k['memcpys']:.0f}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ncu_table(rows) -> str:
    """``ncu*.json`` (``python -m jax_mla.bench.ncu``): each case's kernels, XLA's fusions under
    10 µs summed into one line, with Nsight Compute's figures: duration, SM and tensor-pipe busy
    fractions, DRAM throughput and bytes read, registers, achieved warps and the three largest
    stall reasons (cycles a warp waits per issued instruction)."""
    def pct(k, key):
        return f"{k[key]:.1f}" if k.get(key) is not None else "-"

    out = ["| case | kernel | µs | SM % | tensor % | DRAM % | DRAM read MB | registers | "
           "warps active % | largest stalls |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernels = r.get("kernels", [])
        big = [k for k in kernels if k.get("us", 0) >= 10 or not _is_xla(k["kernel"])]
        small = [k for k in kernels if k not in big]
        for k in big:
            stalls = ", ".join(f"{n} {v:.2f}" for n, v in list(k.get("stalls", {}).items())[:3])
            read = k.get("dram_read_bytes")
            read = "-" if read is None else f"{read / 1e6:.1f}"
            out.append(f"| {r['case']} | {_kernel_name(k['kernel'])} | {k.get('us', 0):.1f} | "
                       f"{pct(k, 'sm_pct')} | {pct(k, 'tensor_pct')} | {pct(k, 'dram_pct')} | "
                       f"{read} | {k.get('registers', 0):.0f} | {pct(k, 'warps_active_pct')} | "
                       f"{stalls} |")
        if small:
            out.append(f"| {r['case']} | {len(small)} XLA kernels under 10 µs | "
                       f"{sum(k.get('us', 0) for k in small):.1f} | | | | | | | |")
        if not kernels:
            out.append(f"| {r['case']} | (nothing profiled: rc {r.get('rc')}) | | | | | | | | |")
    return "\n".join(out)


def _is_xla(name: str) -> bool:
    return name.startswith(("loop_", "input_", "wrapped_", "fusion"))


def _kernel_name(name: str) -> str:
    """A kernel's name without its template arguments (FlashMLA's are long)."""
    return name.split("<")[0].replace("void ", "")


# The sections that are one launcher table each: (file, title, what its variants are).
LAUNCHER_SECTIONS = (
    ("launcher_ab.json", "Launchers and metadata (each shape's rows in one run)",
     "`jax_triton`: jax-triton's custom call with the split plan in XLA ops (the path before "
     "the FFI launcher); `ffi_jnp` (older runs): our FFI handler, same metadata; `ffi`: our FFI "
     "handler and the planning kernel (the defaults); `ffi_again`: the same again (an A/A: the "
     "run's noise); `record`: the FFI handler through XLA's record stage "
     "(`launcher=\"ffi_record\"`); `flashmla`: FlashMLA on the first variant's buffers (stream "
     "time: one CUDA graph)."),
    ("one_call_ab.json", "The decode kernel and its reduce as one custom call (same run)",
     "`two`: two custom calls (`one_call=0`); `one`: one launch sequence "
     "(`jax_mla_triton_sequence`, the default); `one_pdl`: the sequence with programmatic "
     "dependent launch between its kernels (`pdl=1`); `flashmla`: FlashMLA on the first "
     "variant's buffers. All through the FFI launcher with the planning kernel."),
    ("jax_versions_ab.json", "jax 0.11.2 against jax 0.12.1 (one machine, a process each)",
     "`ffi` / `record`: the FFI path with its defaults, its launches captured into command "
     "buffers or recorded through XLA's record stage, under the jax named (0.12.1 carried as "
     "wheels, the launcher library built against its headers); `tfrt`: the process started "
     "with `XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1`. Rows of one `run` ran in one device "
     "call; `rel err vs first` is against that process's first variant."),
    ("client_ab.json", "The default PJRT client against its TFRT client (a process each)",
     "`default_client` / `tfrt_client`: the FFI path with its defaults, the process started "
     "without and with `XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1`; `flashmla_*`: FlashMLA on the "
     "same buffers in that process (a control between the two processes)."),
)


def _pct(d, key="p50"):
    return "-" if not d or d.get(key) is None else f"{d[key]:.2f}"


def serve_tables(data: dict) -> str:
    """``serve.json`` (``python -m jax_mla.bench serve``): per preset, ours against the peer and
    the roofline, then the step table and the decode step's profile."""
    out = ["| preset | who | tokens/s | total tokens/s | TTFT ms p50 / p90 / p99 | ITL ms "
           "p50 / p90 / p99 | compile s (buckets) | steady compiles |",
           "|---|---|---|---|---|---|---|---|"]
    detail = []
    for name, run in data.items():
        o = run["ours"]
        lat = lambda d: " / ".join(_pct(d, f"p{p}") for p in (50, 90, 99))  # noqa: E731
        out.append(f"| {name} | jax_mla | {_f(o['tokens_per_s'])} | "
                   f"{_f(o['total_tokens_per_s'])} | {lat(o['ttft_ms'])} | {lat(o['itl_ms'])} "
                   f"| {_f(run.get('compile_s'))} ({len(run.get('buckets', []))}) | "
                   f"{run.get('steady_compiles')} |")
        peer = run.get("peer") or {}
        if "tokens_per_s" in peer:
            out.append(f"| {name} | PyTorch + FlashMLA | {_f(peer['tokens_per_s'])} | "
                       f"{_f(peer['total_tokens_per_s'])} | {lat(peer['ttft_ms'])} | "
                       f"{lat(peer['itl_ms'])} | - | - |")
            same = peer.get("ours_same_timeline")
            if same:
                out.append(f"| {name} | jax_mla, the peer's timeline | "
                           f"{_f(same['tokens_per_s'])} | {_f(same['total_tokens_per_s'])} | "
                           f"{lat(same['ttft_ms'])} | {lat(same['itl_ms'])} | - | - |")
        elif peer:
            out.append(f"| {name} | peer | {peer.get('skipped') or peer.get('error', '')[:80]} "
                       "| | | | | |")
        rows = ["| kind | bucket (B_d, T_p) | steps | ours ms p50 | peer ms p50 | roofline ms | "
                "ours × roofline | roofline fraction |", "|---|---|---|---|---|---|---|---|"]
        peer_steps = {(r["kind"], tuple(r["bucket"])): r for r in peer.get("steps", [])}
        for r in o["steps"]:
            ps = peer_steps.get((r["kind"], tuple(r["bucket"])), {})
            rows.append(f"| {r['kind']} | {tuple(r['bucket'])} | {r['steps']} | "
                        f"{_f(r['ms_p50'], 3)} | {_f(ps.get('ms_p50'), 3)} | "
                        f"{_f(r.get('roofline_ms'), 3)} | {_f(r.get('x_roofline'), 2)} | "
                        f"{_f(r.get('roofline_fraction'), 2)} |")
        env = run.get("environment", {})
        ceil = run.get("ceilings", {})
        agree = peer.get("greedy_agreement")
        agree = None if agree is None else 100 * agree
        detail += [f"### {name}", "",
                   f"{env.get('device')}, jax {env.get('jax')}, triton {env.get('triton')}, "
                   f"torch {env.get('torch')}, {env.get('date')}; copy "
                   f"{(ceil.get('copy_bytes_per_s') or 0) / 1e12:.2f} TB/s, bf16 matmul "
                   f"{(ceil.get('bf16_matmul_flops') or 0) / 1e12:.0f} TFLOP/s (this run's "
                   f"probes). Peer: {json.dumps(peer.get('backend'))}; greedy ids agreeing "
                   f"with ours: {_f(agree)} %.",
                   "", *rows, ""]
        prof = run.get("profile")
        if prof and "groups_us" in prof:
            detail += [f"Decode bucket {tuple(prof['bucket'])} under CUPTI ({prof['kv_tokens']} "
                       f"cached tokens read per layer): {prof['gpu_us']:.0f} µs of kernels, "
                       f"{prof['launches']:.0f} launches.", "",
                       "| group | µs |", "|---|---|"]
            detail += [f"| {g} | {us:.1f} |" for g, us in prof["groups_us"].items()]
            detail += ["", "| kernel | µs | group |", "|---|---|---|"]
            detail += [f"| `{n}` | {us:.1f} | {g} |" for n, us, g in prof["top_kernels_us"]]
            detail.append("")
    return "\n".join(out + [""] + detail)


def report(folder: str) -> str:
    name = os.path.basename(os.path.normpath(folder))
    parts = [f"# Results: {name}", "",
             f"Generated by `python -m jax_mla.bench.report {folder}` from the JSON files of "
             "this folder (the latest device session). Stream time: wall time per call in a "
             "chain of dependent calls. GPU time: the CUPTI sum of a call's kernels.", ""]
    srv = _load(folder, "serve.json")
    if srv:
        parts += ["## A served model (`python -m jax_mla.bench serve`)", "",
                  "The engine serving a fixed-seed trace after compiling every bucket ahead; "
                  "the peer replays the same steps (same weights, requests, scheduler decisions "
                  "and tokens) in PyTorch: FlashMLA decode, SDPA prefill, cuBLAS, a CUDA graph "
                  "per decode bucket. Roofline: decode steps' bytes (weights, KV read, cache "
                  "written) over the run's copy bandwidth; prefill and mixed steps' FLOPs over "
                  "its bf16 matmul rate.", "", serve_tables(srv), ""]
    conf = _load(folder, "conformance.json")
    if conf:
        parts += ["## GPU conformance", "", conf.get("summary", ""), ""]
    cf = _load(folder, "conformance_ffi.json")
    if cf:
        parts += ["## GPU conformance through the FFI launcher, one case a row", "",
                  conformance_runs_table(cf), ""]
    dec = _load(folder, "decode.json")
    if dec:
        parts += ["## Decode grid", "", decode_table(dec), ""]
    before = _load(folder, "decode_before.json")
    if dec and before:
        parts += ["## Before and after (same session)", "",
                  before.get("environment", {}).get("note", ""), "",
                  before_after_table(before, dec), ""]
    lat = _load(folder, "latency_ab.json")
    if lat:
        parts += ["## Stream time at small shapes, before and after, without CUPTI", "",
                  latency_table(lat), ""]
    ker = _load(folder, "kernels.json")
    if ker:
        parts += ["## Kernels per call (CUPTI)", "",
                  kernels_table(ker, _load(folder, "kernels_before.json")), ""]
    for file, title, legend in LAUNCHER_SECTIONS:
        rows = _load(folder, file)
        if rows:
            parts += [f"## {title}", "", legend, "", launcher_table(rows), ""]
    an = _load(folder, "anatomy.json")
    if an:
        parts += ["## Where a waited run of the stream timer's chain goes (host and GPU on "
                  "one clock)", "", anatomy_table(an), ""]
    al = _load(folder, "allocators.json")
    if al:
        parts += ["## Chained calls under each PJRT allocator and client (a process each)", "",
                  allocators_table(al), ""]
    gaps = _load(folder, "gaps.json")
    if gaps:
        parts += ["## The timing chain on the GPU's timeline (CUPTI)", "",
                  "32 calls of the stream timer's program, profiled: `fed`, each call fed "
                  "its dependency on the one before by kernels the timer adds (a copy, an add "
                  "and an in-place update of one query element); `serial`, the calls back to "
                  "back on a query copy each, with no kernel of the timer's. Per call of the "
                  "first run: the span from the first kernel's start to the last one's end, "
                  "our kernels (`mla_*`), the timer's kernels and the idle time between "
                  "kernels; where measured (runs of the program dispatched back to back), "
                  "every run's span and the GPU's idle time between runs.", "",
                  gaps_table(gaps), ""]
    pl = _load(folder, "planner.json")
    if pl:
        parts += ["## A step's metadata (CUPTI)", "", planner_table(pl), ""]
    gr = _load(folder, "graphs.json")
    if gr:
        parts += ["## Command buffers", "", graphs_table(gr), ""]
    for file, title in AB_FILES:
        ab = _load(folder, file)
        if ab:
            parts += [f"## {title}", "", ab_table(ab), ""]
    probe = _load(folder, "split_probe.json")
    if probe:
        parts += ["## The split-query kernel on made query parts (`bench.split_probe`)", "",
                  split_probe_table(probe), ""]
    modes = {}
    for path in sorted(glob.glob(os.path.join(folder, "update_mode_*.json"))):
        name = os.path.basename(path)
        if rows := _load(folder, name):
            modes[name[len("update_mode_"):-len(".json")]] = rows
    if modes:
        parts += ["## Stream time under XLA's command-buffer update modes (a process each)", "",
                  update_modes_table(modes), ""]
    cb = _load(folder, "cmdbuf.json")
    if cb:
        parts += ["## Command buffers around the chain (one process per XLA flag set)", "",
                  cmdbuf_table(cb), ""]
    chains = [r for f in ("cmdbuf_chains.json", "cmdbuf_chains_on.json",
                          "cmdbuf_chains_record.json", "cmdbuf_chains_init.json",
                          "cmdbuf_chains_off.json")
              for r in (_load(folder, f) or [])]
    if chains:
        parts += ["## Where a chained call's wall time goes, by chain length", "",
                  chains_table(chains), ""]
        traced = [r for r in chains if r.get("host_events_us")]
        if traced:
            parts += ["### The host's time a chained call, by profiler event", "",
                      host_events_table(traced), ""]
    mc = _load(folder, "memcheck.json")
    if mc:
        parts += ["## compute-sanitizer memcheck, one process a case", "",
                  "Only our kernels (`mla_*`) instrumented; command buffers and GEMM autotuning "
                  "off; a process that died of a signal was run again. Where the file gathers "
                  "several calls or sessions, each try is named by the one it ran in.", "",
                  memcheck_table(mc), ""]
    for file, title in (("ncu.json", "Nsight Compute: our kernels"),
                        ("ncu_peers.json", "Nsight Compute: the peers' kernels"),
                        ("ncu_dram.json", "Nsight Compute: our kernels, with DRAM bytes")):
        rows = _load(folder, file)
        if rows:
            parts += [f"## {title}", "", "One call's kernels under `ncu` (clocks as they are, "
                      "each metric pass a replay; `python -m jax_mla.bench.ncu`).", "",
                      ncu_table(rows), ""]
    pre = _load(folder, "prefill.json")
    if pre:
        parts += ["## Prefill", "", prefill_table(pre), ""]
    dcp = _load(folder, "dcp_split.json")
    if dcp:
        parts += ["## DCP simulated on one GPU", "", dcp_table(dcp), ""]
    aiter = _load(folder, "aiter_bridge.json")
    if aiter:
        parts += ["## AITER bridge with the stand-in (not AMD hardware)", "",
                  f"{aiter.get('summary')}; host µs per call: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in aiter.get("overhead_us", {}).items()),
                  ""]
    tried = os.path.join(folder, "tried.md")
    if os.path.exists(tried):
        with open(tried) as f:
            parts += [f.read().strip(), ""]
    return "\n".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m jax_mla.bench.report RESULTS_FOLDER", file=sys.stderr)
        return 2
    text = report(argv[0])
    with open(os.path.join(argv[0], "RESULTS.md"), "w") as f:
        f.write(text)
    print(f"wrote {os.path.join(argv[0], 'RESULTS.md')} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
