"""Same-run A/B of the Triton backend's tuning, timed by the bench's own timers.

``python -m jax_mla.bench.ab OUT.json VARIANT... -- SHAPE... [--rounds N]``. A VARIANT is
``name`` (the defaults) or ``name:FIELD=VALUE[,FIELD=VALUE]`` with fields of
:class:`jax_mla.TritonTuning` (``general:affine_reduce=0``, ``line:split_plan=line``,
``bn32:block_n=32,num_stages=3``, ``ffi:launcher=ffi,planner=kernel``); a SHAPE is
``B,H,S[,Q[,PAGE[,KV]]]``; ``--no-peers`` leaves FlashMLA out; ``--donated`` also times each
variant's chain with its output buffers donated run to run (``timing.device_time``);
``--in-flight`` also times every row with runs in flight (``timing.device_time(...,
in_flight=True)``; FlashMLA's graph replayed back to back) and FlashMLA's graph by our stream
timer's wall clock (``peers.FlashMLA.wall_time``); ``--serial`` also times our rows' calls back
to back with no dependency and no feeding kernel (``timing.device_time(..., serial=True)``),
as FlashMLA's graph of calls is timed, and with ``--in-flight`` too, those runs in flight. Each
variant is its own plan (the tuning object is part of it, so of the jit cache key): no
environment, no cleared caches.
For every shape the variants are timed in turn, ``--rounds`` times over (interleaved, so drift
shows), and every output is compared with the first variant's.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import numpy as np

from jax_mla.backends.triton import TritonTuning
from jax_mla.bench import peers, profile
from jax_mla.bench.decode import (
    DEEPSEEK_SCALE,
    Shape,
    attention_call,
    builder,
    make_inputs,
    metadata_time,
)
from jax_mla.bench.timing import device_time


def parse_variant(text: str) -> tuple[str, TritonTuning]:
    """``"name:field=value,..."`` -> ``(name, TritonTuning(...))`` (ints, 0/1 flags, or words)."""
    name, _, rest = text.partition(":")
    fields = {f.name: f.type for f in dataclasses.fields(TritonTuning)}
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"variant {text!r}: {key!r} is not a TritonTuning field "
                             f"({', '.join(fields)})")
        kind = str(fields[key])
        kw[key] = value == "1" if "bool" in kind else value if kind == "str" else int(value)
    return name, TritonTuning(**kw)


def run(shapes, variants, rounds: int = 2, gpu_time: bool | None = None,
        peers: bool = True, on_rows=None, donated: bool = False,
        in_flight: bool = False, serial: bool = False) -> list[dict]:
    """Rows of ``{shape, variant, us (rounds), best_us, vs_first, rel_err_vs_first,
    metadata_us, ...}``; with ``gpu_time`` (CUPTI) also ``gpu_us``, ``launches``,
    ``kernels_us``, the metadata's ``metadata_gpu_us`` / ``metadata_launches`` /
    ``metadata_memcpys`` and the compiled call's command buffers. With ``peers``, a
    ``flashmla`` row on the first variant's buffers where FlashMLA is built
    (``peers.py``). With ``donated``, our rows also carry ``donated_us`` (rounds) and
    ``donated_best_us``: the stream time with the chain's outputs donated run to run. With
    ``in_flight``, every row also carries ``in_flight_us`` / ``in_flight_best_us`` (runs
    dispatched back to back), and FlashMLA's ``wall_us`` / ``wall_best_us`` (its graph timed by
    our stream timer's clock: wall around each replay and its wait). With ``serial``, our rows
    also carry ``serial_us`` / ``serial_best_us`` (the calls back to back, no feeding kernel
    between them), and with ``in_flight`` too ``serial_in_flight_us`` /
    ``serial_in_flight_best_us`` (those runs dispatched back to back). Every
    stream time is taken before any CUPTI trace: once CUPTI has traced a process, every launch
    in it costs more. ``on_rows(rows)`` is called with the rows so far after each shape and
    each shape's GPU times (``main`` writes them: a run cut short keeps what it measured)."""
    on_rows = on_rows or (lambda rows: None)
    gpu_time = profile.available() if gpu_time is None else gpu_time
    names = [name for name, _ in variants]
    cases, rows = [], []
    for shape in shapes:
        calls = {name: attention_call(shape, np.random.default_rng(0), tuning=tuning)
                 for name, tuning in variants}
        builds = {name: (builder(shape, tuning=tuning), inputs(shape)) for name, tuning in variants}
        fm = _flashmla(shape, calls[names[0]][1], *builds[names[0]][1]) if peers else None
        times = {name: [] for name in names + (["flashmla"] if fm else [])}
        kept = {name: [] for name in names}
        back = {name: [] for name in names}
        back_flight = {name: [] for name in names}
        flight = {name: [] for name in times}
        walls = []
        for _ in range(rounds):
            for name in names:
                fn, args = calls[name]
                times[name].append(device_time(fn, *args, min_ms=20) * 1e6)
                if donated:
                    kept[name].append(device_time(fn, *args, min_ms=20, donated=True) * 1e6)
                if in_flight:
                    flight[name].append(device_time(fn, *args, min_ms=20, in_flight=True)
                                        * 1e6)
                if serial:
                    back[name].append(device_time(fn, *args, min_ms=20, serial=True) * 1e6)
                if serial and in_flight:
                    back_flight[name].append(device_time(fn, *args, min_ms=20, serial=True,
                                                         in_flight=True) * 1e6)
            if fm:
                try:
                    times["flashmla"].append(fm.stream_time() * 1e6)
                    if in_flight:
                        walls.append(fm.wall_time() * 1e6)
                        flight["flashmla"].append(fm.in_flight_time() * 1e6)
                except RuntimeError as e:  # its capture or launch failed: no row, go on
                    print(f"{shape.name:<28} flashmla     failed: {str(e)[:200]}", flush=True)
                    fm = None
                    del times["flashmla"], flight["flashmla"]
        outs = {name: _outputs(*calls[name]) for name in names}
        if fm:
            outs["flashmla"] = fm.outputs()
        ref_out, ref_lse = outs[names[0]]
        first = min(times[names[0]])
        for name in times:
            out, lse = outs[name]
            fin = np.isfinite(ref_lse)
            row = {"shape": shape.name, "variant": name, "us": times[name],
                   "best_us": min(times[name]), "vs_first": min(times[name]) / first,
                   "rel_err_vs_first": float(np.linalg.norm(out - ref_out)
                                             / np.linalg.norm(ref_out)),
                   "lse_max_abs_err_vs_first": float(np.max(np.abs(lse[fin] - ref_lse[fin]),
                                                            initial=0.0))}
            if name in calls:
                tuning = dict(variants)[name]
                build, (table, lens) = builds[name]
                row["tuning"] = dataclasses.asdict(tuning)
                row["metadata_us"] = metadata_time(build, table, lens, min_ms=5) * 1e6
                if donated:
                    row.update(donated_us=kept[name], donated_best_us=min(kept[name]))
                if serial:
                    row.update(serial_us=back[name], serial_best_us=min(back[name]))
                if serial and in_flight:
                    row.update(serial_in_flight_us=back_flight[name],
                               serial_in_flight_best_us=min(back_flight[name]))
            elif in_flight:
                row.update(wall_us=walls, wall_best_us=min(walls))
            if in_flight:
                row.update(in_flight_us=flight[name], in_flight_best_us=min(flight[name]))
            rows.append(row)
            kept_text = "".join(f" ({label} {row[key]:8.1f} us)" for key, label in (
                ("donated_best_us", "outputs donated"), ("wall_best_us", "wall"),
                ("in_flight_best_us", "in flight"), ("serial_best_us", "serial"),
                ("serial_in_flight_best_us", "serial in flight"))
                if key in row)
            print(f"{shape.name:<28} {name:<12} best {row['best_us']:8.1f} us{kept_text} "
                  f"x{row['vs_first']:.3f} err {row['rel_err_vs_first']:.1e}", flush=True)
        cases.append((shape, calls, builds, fm))
        on_rows(rows)
    if gpu_time:
        for shape, calls, builds, fm in cases:
            for row in rows:
                if row["shape"] != shape.name:
                    continue
                name = row["variant"]
                if name in calls:
                    fn, args = calls[name]
                    k = profile.kernel_times(fn, *args)
                    build, (table, lens) = builds[name]
                    m = profile.kernel_times(build, table, lens)
                    row.update(gpu_us=k["gpu_us"], launches=k["launches"],
                               kernels_us=k["kernels_us"], metadata_gpu_us=m["gpu_us"],
                               metadata_launches=m["launches"],
                               metadata_memcpys=m["memcpy_launches"],
                               **profile.command_buffers(fn, *args))
                elif name == "flashmla":
                    k, m = fm.gpu_time(), fm.metadata_gpu_time()
                    row.update(gpu_us=k["gpu_us"], launches=k["launches"],
                               kernels_us=k["kernels_us"], metadata_gpu_us=m["gpu_us"],
                               metadata_launches=m["launches"])
                print(f"{shape.name:<28} {name:<12} GPU {row['gpu_us']:8.1f} us, "
                      f"{row['launches']:.0f} launches; metadata GPU "
                      f"{row['metadata_gpu_us']:.1f} us in {row['metadata_launches']:.0f}",
                      flush=True)
            on_rows(rows)
    return rows


def inputs(shape):
    """The block table and lengths :func:`attention_call` built for ``shape`` (same seed)."""
    _, _, table, lens, _ = make_inputs(shape, np.random.default_rng(0))
    return table, lens


def _outputs(fn, args):
    out, lse = jax.jit(fn)(*args)
    return np.asarray(out, np.float32), np.asarray(lse, np.float32)


def _flashmla(shape, args, table, lens):
    """FlashMLA on the first variant's buffers, where it is built and can run ``shape``."""
    if peers.flashmla() is None or peers.flashmla_reason(shape.kv, shape.page, shape.heads):
        return None
    q, cache, _ = args
    return peers.FlashMLA(q, cache, table, lens, qlen=shape.qlen, scale=DEEPSEEK_SCALE)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rounds = 2
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        del argv[i:i + 2]
    with_peers = "--no-peers" not in argv
    donated = "--donated" in argv
    in_flight = "--in-flight" in argv
    serial = "--serial" in argv
    argv = [a for a in argv if a not in ("--no-peers", "--donated", "--in-flight", "--serial")]
    path, rest = argv[0], argv[1:]
    split = rest.index("--")
    variants = [parse_variant(v) for v in rest[:split]]
    shapes = [Shape.parse(s) for s in rest[split + 1:]]
    def write(rows):
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

    write(run(shapes, variants, rounds, peers=with_peers, on_rows=write, donated=donated,
              in_flight=in_flight, serial=serial))
    return 0


if __name__ == "__main__":
    sys.exit(main())
