"""Does XLA put our launches in command buffers (CUDA graphs), and what does a call cost then?

``python -m jax_mla.bench.cmdbuf OUT.json [SHAPE ...]`` under whatever ``XLA_FLAGS`` the process
was started with. Per shape it writes: the stream time of the bench's chain of dependent calls,
the host-dispatched time per call, the chain under CUPTI (GPU span per call, idle gaps, kernels),
and how XLA grouped the chain's thunks -- read from XLA's own dump of the thunk sequence after its
thunk passes (``--xla_dump_to``, added here when absent). Command buffers are formed after the
HLO passes, so the compiled HLO text cannot show them, and the driver's graph launches are not in
the CUDA runtime records torch's profiler keeps: the dump is the evidence.

The session's ``cmdbuf`` stage runs this once per flag set of :data:`FLAG_SETS` with XLA's
command-buffer logging on, and keeps the log lines that say why a thunk was or was not captured.

What a command buffer costs on the host: before each replay XLA compares the addresses of the
buffers its commands use with those it recorded, and re-records every command that touches one
that moved (a custom call by stream capture into a child graph); the program's outputs are new
each execution, and its temporaries share one allocation. The stream-time chain runs with
XLA's log of those updates captured (:func:`update_summary`: executions, updates, commands
updated and skipped, microseconds), so a chain whose wall time exceeds its GPU span says
whether updates are where the difference goes; ``skip_temp`` runs it with the temporaries at
fixed addresses (``--xla_gpu_command_buffer_update_mode``, where this XLA has it).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import sys
import tempfile

SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096", "128,128,4096")

# Flag sets the stage compares (each in its own process: XLA reads its flags once).
FLAG_SETS = {
    "default": "",
    "off": "--xla_gpu_enable_command_buffer=",
    "min1": "--xla_gpu_graph_min_graph_size=1",
    "skip_temp": "--xla_gpu_command_buffer_update_mode=SKIP_TEMP",
}

# The XLA modules whose compiler log lines are worth keeping: the conversion pass says which
# commands are enabled, which thunk kinds it refused and what it captured.
VMODULE = ("command_buffer_conversion_pass=2,command_buffer_thunk=3,command_executor=3,"
           "custom_call_thunk=3,record_ffi=3")
# XLA runs a command buffer's thunks one by one while a profiler session is active unless told
# otherwise; the chain probe's host breakdown (``jax.profiler``) must see the command buffer.
PROFILE_WITH_COMMAND_BUFFERS = "--xla_enable_command_buffers_during_profiling=true"
_KEEP = re.compile(r"CommandBufferConfig|not lowered|lowering is not enabled|Unsupported thunk"
                   r"|Creating command buffer thunk|Removed command buffer support"
                   r"|disabled for profiling", re.I)
CHAIN = 16


def keep_log_lines(text: str, limit: int = 40) -> list[str]:
    """The distinct command-buffer lines of an XLA log (timestamps and source positions cut)."""
    seen, out = set(), []
    for line in text.splitlines():
        if not _KEEP.search(line):
            continue
        msg = re.sub(r"^.*?\] ", "", line.strip())[:400]
        if msg not in seen:
            seen.add(msg)
            out.append(msg)
    return out[:limit]


# XLA's lines, in the forms of jax 0.10 ("... on device #0 ...") and of jax 0.11, whose device
# logging prefixes the ordinal ("[0] Execute command buffer; num_executions=3",
# "Create/Update command buffer by recoding command buffer cmd sequence after 2 executions since
# last update; num_commands=..; updated_allocs=..; is_first_record=..; needs_update=..").
_EXECUTE = re.compile(r"Execute command buffer(?: on device|;)")
_EXECUTIONS = re.compile(r"Execute command buffer.*?num_executions=(\d+)")
_UPDATE = re.compile(r"(?:Create/)?Update command buffer.*?num_commands=(\d+)"
                     r".*?updated_allocs=(\d+)(?:.*?is_first_record=(\w+))?")
_UPDATED_IN = re.compile(r"(?:Updated|Recorded) command buffer in ([\d.]+)")
_COMMANDS = re.compile(r"Updated (\d+) commands in ([\d.]+).*?skipped (\d+)")
_SKIPPED = re.compile(r"Skip updating command")
_CAPTURES = re.compile(r"fallback to stream capture")
_RECORDS = re.compile(r"FfiCreateLaunch for kernel: (\w+)")
_SEQUENCE = re.compile(r"as a regular thunk sequence because ([^\n;]+)")


def update_summary(text: str) -> dict:
    """XLA's per-execution command-buffer log (``command_buffer_thunk`` and ``command_executor``
    at 3, ``custom_call_thunk`` at 3) in numbers: replays logged and the largest
    ``num_executions`` (executions since the last update: stuck at 1 means an update before
    every replay), updates before a replay (first records apart), and per update the
    allocations that moved, the commands re-recorded and skipped, the microseconds it took; our
    custom calls recorded by stream capture, and launches created through the FFI record stage
    (``ffi_records``); and why a command buffer ran as plain thunks."""
    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    updates = [(int(n), int(a), first) for n, a, first in _UPDATE.findall(text)]
    later = [u for u in updates if u[2].lower() not in ("1", "true")]
    commands = [(int(n), float(us), int(k)) for n, us, k in _COMMANDS.findall(text)]
    return {"executions": len(_EXECUTE.findall(text)),
            "executions_since_update_max": max(map(int, _EXECUTIONS.findall(text)),
                                               default=None),
            "updates": len(later), "first_records": len(updates) - len(later),
            "num_commands": max((n for n, _, _ in updates), default=None),
            "updated_allocs_mean": mean([a for _, a, _ in later]),
            "update_us_mean": mean([float(x) for x in _UPDATED_IN.findall(text)]),
            "commands_updated_mean": mean([n for n, _, _ in commands]),
            "commands_skipped_mean": mean([k for _, _, k in commands]),
            "commands_skipped_logged": len(_SKIPPED.findall(text)),
            "stream_captures": len(_CAPTURES.findall(text)),
            "ffi_records": len(_RECORDS.findall(text)),
            "thunk_sequence_because": sorted(set(_SEQUENCE.findall(text)))}


@contextlib.contextmanager
def captured_stderr():
    """Everything written to file descriptor 2 (XLA's C++ log included) inside the block, as
    ``holder[0]`` afterwards; the text is written back to the real stderr too."""
    holder = [""]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield holder
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            data = tmp.read()
            os.write(2, data)
            holder[0] = data.decode(errors="replace")


def thunk_summary(dump_dir: str, module: str = "jit_many") -> dict:
    """How the thunks of the newest ``module`` in an XLA dump are grouped: command buffers and
    the thunks left outside them, from the thunk sequence after XLA's thunk passes."""
    files = sorted((f for f in glob.glob(os.path.join(dump_dir, "**", f"*{module}*"),
                                         recursive=True)
                    if "thunk" in os.path.basename(f) and os.path.isfile(f)),
                   key=os.path.getmtime)
    after = [f for f in files if "after" in os.path.basename(f)] or files
    if not after:
        return {"thunk_dump": None,
                "dump_files": sorted(os.path.relpath(f, dump_dir) for f in
                                     glob.glob(os.path.join(dump_dir, "**"), recursive=True)
                                     if os.path.isfile(f))[:40]}
    text = open(after[-1]).read()
    kinds = re.findall(r"\bk([A-Z][A-Za-z]+)\b", text)
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return {"thunk_dump": os.path.basename(after[-1]),
            "command_buffers": counts.get("CommandBuffer", 0),
            "thunk_kinds": counts,
            "thunk_text_head": text[:1500]}


CHAIN_LENGTHS = (1, 4, 16, 64, 128)


def compiler_options() -> dict:
    """``JAX_MLA_CHAIN_COMPILER_OPTIONS="name=value[,name=value]"`` as the XLA options the
    chained programs are compiled with (``jax.jit(...).lower(...).compile(compiler_options=)``):
    a flag given to one program instead of the whole process. ``true``/``false`` become
    booleans, digits integers."""
    options = {}
    for item in filter(None, os.environ.get("JAX_MLA_CHAIN_COMPILER_OPTIONS", "").split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = ({"true": True, "false": False}.get(value.lower(), int(value)
                                if value.isdigit() else value))
    return options


def process_knobs() -> dict:
    """What this process's chains ran under, for their rows: the PJRT allocator and client,
    ``XLA_FLAGS``, and whether our custom calls carry their binaries."""
    from jax_mla.backends.triton import ffi_launch

    return {"allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
            "tfrt_gpu_client": os.environ.get("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT",
                                              "0") == "1",
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "embed_binaries": ffi_launch.embed_binaries()}


def chain_walls(many, args, n: int, reps: int) -> tuple[float, float]:
    """Microseconds a call of the compiled chain ``many`` of ``n`` calls, median of ``reps``
    runs each dispatched and waited for: the wall time (dispatch to sync), and the host's
    time to enqueue the run (the dispatch's return)."""
    import statistics
    import time

    import jax

    walls, enqueues = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = many(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        walls.append(time.perf_counter() - t0)
        enqueues.append(t1 - t0)
    return statistics.median(walls) / n * 1e6, statistics.median(enqueues) / n * 1e6


def chain_lengths(specs, ns=CHAIN_LENGTHS, reps: int = 7, profiled: bool = True) -> list[dict]:
    """Where a chained call's wall time goes, per shape of ``specs`` and chain length ``n`` (one
    program of ``n`` dependent calls, as the stream timer builds it): wall per call (dispatch to
    sync, median of ``reps``), host time to enqueue the program (the call's return, before the
    sync) per call, XLA's command-buffer log over those runs (:func:`update_summary`, where the
    process logs it), and, under CUPTI, the GPU span and launches per call, with the host's time
    by profiler event for each shape's longest chain (:func:`host_events`). Wall near the
    enqueue time means the host bounds the chain; wall near the span means the GPU does. Every
    wall time is taken before CUPTI loads: its callbacks slow the host. ``profiled=False``
    leaves CUPTI out (no span, launches or host events)."""

    import jax

    from jax_mla import env
    from jax_mla.backends.triton.launch import LAUNCHERS
    from jax_mla.bench import profile
    from jax_mla.bench.timing import chained

    calls = {spec: chain_call(spec) for spec in specs}
    inside = env.read_flag("JAX_MLA_FFI_COMMAND_BUFFERS", True)
    launcher = env.read_choice("JAX_MLA_TRITON_LAUNCHER", LAUNCHERS, "auto")
    initialize = env.read_flag("JAX_MLA_FFI_INITIALIZE_STAGE", False)
    options = compiler_options()
    rows = []
    for spec, (fn, args) in calls.items():
        for n in ns:
            many = chained(fn, n)
            if options:  # this program alone compiled with them, not the process
                many = many.lower(*args).compile(compiler_options=options)
            jax.block_until_ready(many(*args))
            with captured_stderr() as log:
                wall, enqueue = chain_walls(many, args, n, reps)
            rows.append({"shape": spec, "n": n, "launcher": launcher, **process_knobs(),
                         "compiler_options": options,
                         "ffi_command_buffers": inside,
                         "ffi_initialize_stage": initialize,
                         "wall_us": wall, "enqueue_us": enqueue,
                         "updates": update_summary(log[0])})
    if profiled and profile.available():
        for row in rows:
            fn, args = calls[row["shape"]]
            gaps = profile.chain_gaps(fn, *args, n=row["n"])
            row.update(span_us=gaps["span_us"], launches=gaps["launches"])
            if row["n"] == max(ns):
                row["host_events_us"] = host_events(fn, args, row["n"])
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def host_events(fn, args, n: int, executions: int = 3, top: int = 30) -> dict:
    """The host's own time per chained call by event name, from a ``jax.profiler`` trace of
    ``executions`` runs of a chain of ``n`` calls: XLA's and PJRT's annotations (command-buffer
    thunks executed, recorded or updated, stream captures, launches) summed over the host
    planes, divided by ``executions * n``, the ``top`` largest in microseconds. The trace runs
    CUPTI on a GPU, which slows each driver call: compare names, not absolute times."""
    import jax

    from jax_mla.bench.timing import chained

    many = chained(fn, n)
    jax.block_until_ready(many(*args))

    def run():
        for _ in range(executions):
            jax.block_until_ready(many(*args))

    total: dict[str, float] = {}
    for name, start, end in _host_events(_xplane(run)):
        total[name] = total.get(name, 0.0) + (end - start)
    per = {k: v / 1e3 / (executions * n) for k, v in total.items()}
    return dict(sorted(per.items(), key=lambda kv: -kv[1])[:top])


def _xplane(run):
    """``run()`` under ``jax.profiler`` with XLA's host annotations at their most detailed
    (``host_tracer_level=3``); the profile as ``ProfileData``."""
    import jax
    from jax.profiler import ProfileData

    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 3
    with tempfile.TemporaryDirectory(prefix="jax_mla_trace_") as d:
        with jax.profiler.trace(d, profiler_options=options):
            run()
        [path] = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return ProfileData.from_file(path)


# The host annotations that bound each timed run of :func:`anatomy`.
DISPATCH_EVENT, WAIT_EVENT = "jax_mla_anatomy_dispatch", "jax_mla_anatomy_wait"


def _device_events(data) -> list[tuple[int, int]]:
    """``(start_ns, end_ns)`` of every GPU activity (kernels, memsets, memcpys) in a profile,
    from its device planes' stream lines (all their lines where none is named by stream)."""
    spans = []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream")] or lines
        for line in streams:
            spans.extend((ev.start_ns, ev.start_ns + ev.duration_ns) for ev in line.events)
    return sorted(spans)


def _host_events(data) -> list[tuple[str, int, int]]:
    """``(name, start_ns, end_ns)`` of every host event (every thread of the host planes)."""
    return [(ev.name, ev.start_ns, ev.start_ns + ev.duration_ns)
            for plane in data.planes if plane.name.startswith("/host")
            for line in plane.lines for ev in line.events]


def split_runs(host, device, top: int = 12) -> list[dict]:
    """Each timed run of :func:`anatomy` from its profile's events (``_host_events``,
    ``_device_events``): the run is the host's time from the start of :data:`DISPATCH_EVENT`
    to the end of :data:`WAIT_EVENT` that follows it, cut at the GPU's first and last activity
    inside it into *before* (dispatch until the GPU starts), *span* (the GPU's first start to
    its last end), *after* (the GPU's last end until the wait returns); *busy*, the GPU's
    activities summed (span minus busy is the GPU idle inside the run); *dispatch*, the host's
    dispatch call alone. ``before_events`` and ``after_events``: the host events (every
    thread) overlapping each window, by name, their time clipped to it, the ``top`` largest;
    nested events each count, so compare names, not sums. Microseconds."""
    dispatches = sorted((s, e) for n, s, e in host if n == DISPATCH_EVENT)
    waits = sorted((s, e) for n, s, e in host if n == WAIT_EVENT)
    runs = []
    for d0, d1 in dispatches:
        w = next(((s, e) for s, e in waits if s >= d1), None)
        if w is None:
            continue
        t_end = w[1]
        inside = [(s, e) for s, e in device if s >= d0 and e <= t_end]
        if not inside:
            runs.append({"wall_us": (t_end - d0) / 1e3, "dispatch_us": (d1 - d0) / 1e3,
                         "gpu_events": 0})
            continue
        g0, g1 = inside[0][0], max(e for _, e in inside)

        def overlapping(a, b):
            by: dict[str, float] = {}
            for name, s, e in host:
                if name in (DISPATCH_EVENT, WAIT_EVENT):
                    continue
                cut = min(e, b) - max(s, a)
                if cut > 0:
                    by[name] = by.get(name, 0.0) + cut / 1e3
            return dict(sorted(by.items(), key=lambda kv: -kv[1])[:top])

        runs.append({"wall_us": (t_end - d0) / 1e3, "dispatch_us": (d1 - d0) / 1e3,
                     "before_us": (g0 - d0) / 1e3, "span_us": (g1 - g0) / 1e3,
                     "after_us": (t_end - g1) / 1e3,
                     "busy_us": sum(e - s for s, e in inside) / 1e3, "gpu_events": len(inside),
                     "before_events": overlapping(d0, g0), "after_events": overlapping(g1, t_end)})
    return runs


def anatomy(many, args, n: int, runs: int = 5) -> dict:
    """Where one timed run of the stream timer's chain (``many = timing.chained(fn, n)``,
    compiled, dispatched and waited for as ``timing.device_time`` times it) spends its wall
    time, from a ``jax.profiler`` trace of ``runs`` such runs (host annotations and the GPU's
    activities on one clock): :func:`split_runs` per run, and the median run's figures. A
    stream time above the kernels' is then *before* (the host's dispatch and XLA's work until
    the GPU starts), the GPU's own idle inside *span*, or *after* (the GPU done, the host not
    yet told). The process must keep command buffers on under the profiler
    (:data:`PROFILE_WITH_COMMAND_BUFFERS`), or XLA runs their thunks one by one."""
    import statistics

    import jax

    def run():
        for _ in range(runs):
            with jax.profiler.TraceAnnotation(DISPATCH_EVENT):
                out = many(*args)
            with jax.profiler.TraceAnnotation(WAIT_EVENT):
                jax.block_until_ready(out)

    data = _xplane(run)
    host, device = _host_events(data), _device_events(data)
    rows = split_runs(host, device)
    keys = ("wall_us", "dispatch_us", "before_us", "span_us", "after_us", "busy_us")
    median = {k: statistics.median(r[k] for r in rows) for k in keys
              if rows and all(k in r for r in rows)}
    # Both clocks' extent: GPU activities outside every run would mean two time bases.
    clocks = {"host_ns": [min(s for _, s, _ in host), max(e for *_, e in host)] if host else None,
              "device_ns": [device[0][0], max(e for _, e in device)] if device else None,
              "device_events": len(device)}
    return {"n": n, "runs": rows, "median": median,
            "per_call_us": {k: v / n for k, v in median.items()}, "clocks": clocks}


def xla_control(q, cache, md):
    """The control of :func:`anatomies`: one XLA fusion in place of the attention call, on the
    same arguments, its output shaped like the attention's (so the timer feeds it the same
    way, with the same kernels of its own): what XLA's own op costs the chain on the host."""
    del cache, md
    import jax.numpy as jnp

    return jnp.tanh(q[..., :512].astype(jnp.float32)).astype(q.dtype)


def chain_call(spec: str):
    """``(fn, args)`` for a bench shape spec: the attention call on fresh inputs, or for
    ``xla:SHAPE`` :func:`xla_control` on that shape's arguments."""
    import numpy as np

    from jax_mla.bench.decode import Shape, attention_call

    fn, args = attention_call(Shape.parse(spec.removeprefix("xla:")), np.random.default_rng(0))
    return (xla_control if spec.startswith("xla:") else fn), args


def anatomies(specs, ns=(16, 128), reps: int = 7) -> list[dict]:
    """For each shape of ``specs`` and chain length of ``ns``: the chain's wall and host
    enqueue time a call with no profiler loaded (median of ``reps``, every chain timed before
    the first trace: CUPTI's callbacks slow the host), then its :func:`anatomy` under the
    profiler; the process's client and knobs named in each row. A spec ``xla:SHAPE`` chains
    :func:`xla_control` on that shape's arguments instead of the attention call."""

    import jax

    from jax_mla.bench.timing import chained

    chains = []
    for spec in specs:
        fn, args = chain_call(spec)
        for n in ns:
            many = chained(fn, n)
            jax.block_until_ready(many(*args))
            wall, enqueue = chain_walls(many, args, n, reps)
            chains.append((spec, n, many, args, {"wall_us": wall, "enqueue_us": enqueue}))
    rows = []
    knobs = process_knobs()  # the process's, the same for every chain
    for spec, n, many, args, unprofiled in chains:
        row = {"shape": spec, "tfrt_gpu_client": knobs["tfrt_gpu_client"],
               "embed_binaries": knobs["embed_binaries"],
               "unprofiled_per_call_us": unprofiled, **anatomy(many, args, n)}
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
        rows.append(row)
    return rows


def _take_option(argv, flag: str, default, parse):
    """``flag VALUE`` out of ``argv`` (in place): ``parse(VALUE)``, or ``default``."""
    if flag not in argv:
        return default
    i = argv.index(flag)
    value = parse(argv[i + 1])
    del argv[i:i + 2]
    return value


def _ns(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(","))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--anatomy":
        # ``--anatomy OUT.json [--ns 16,128] [--reps 7] [SHAPE ...]``: :func:`anatomies`.
        ns = _take_option(argv, "--ns", (16, 128), _ns)
        reps = _take_option(argv, "--reps", 7, int)
        rows = anatomies(argv[2:] or ["1,128,1024", "8,16,4096"], ns, reps)
        with open(argv[1], "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    if argv and argv[0] == "--chains":
        # ``--ns 16,128``: those chain lengths only; ``--no-profile``: no CUPTI pass (walls,
        # enqueue times and XLA's update log only).
        profiled = "--no-profile" not in argv
        argv = [a for a in argv if a != "--no-profile"]
        ns = _take_option(argv, "--ns", CHAIN_LENGTHS, _ns)
        out_path, specs = argv[1], argv[2:] or ["1,16,1024", "32,16,4096"]
        rows = chain_lengths(specs, ns, profiled=profiled)
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    out_path, specs = argv[0], argv[1:] or list(SHAPES)
    flags = os.environ.get("XLA_FLAGS", "")
    dump = re.search(r"--xla_dump_to=(\S+)", flags)
    if dump is None:
        dump_dir = tempfile.mkdtemp(prefix="xla_dump_")
        os.environ["XLA_FLAGS"] = (f"{flags} --xla_dump_to={dump_dir} "
                                   "--xla_dump_hlo_module_re=jit_many").strip()
    else:
        dump_dir = dump.group(1)

    import jax
    import numpy as np

    from jax_mla.bench import profile
    from jax_mla.bench.decode import Shape, attention_call
    from jax_mla.bench.timing import chained, device_time, dispatch_time

    rows = []
    for spec in specs:
        shape = Shape.parse(spec)
        fn, args = attention_call(shape, np.random.default_rng(0))
        shutil.rmtree(dump_dir, ignore_errors=True)
        os.makedirs(dump_dir, exist_ok=True)
        many = chained(fn, CHAIN)
        jax.block_until_ready(many(*args))
        row = {"shape": shape.name, "xla_flags": flags, **thunk_summary(dump_dir)}
        with captured_stderr() as log:
            row["stream_us"] = device_time(fn, *args, min_ms=20.0) * 1e6
        row["updates"] = update_summary(log[0])
        row["dispatch_us"] = dispatch_time(fn, *args) * 1e6
        if profile.available():
            row["gpu_us"] = profile.kernel_times(fn, *args)["gpu_us"]
            gaps = profile.chain_gaps(fn, *args, n=CHAIN)
            row.update(chain_span_us=gaps["span_us"], chain_launches=gaps["launches"],
                       chain_gap_us=sum(gaps["gap_before_us"].values()))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "thunk_text_head"}), flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
