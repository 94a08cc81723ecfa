"""Same-run A/B of the Triton backend's tuning, timed by the bench's own timers.

``python -m jax_mla.bench.ab OUT.json VARIANT... -- SHAPE... [--rounds N]``. A VARIANT is
``name`` (the defaults) or ``name:FIELD=VALUE[,FIELD=VALUE]`` with fields of
:class:`jax_mla.TritonTuning` (``general:affine_reduce=0``, ``line:split_plan=line``,
``bn32:block_n=32,num_stages=3``, ``ffi:launcher=ffi,planner=kernel``); a SHAPE is
``B,H,S[,Q[,PAGE[,KV]]]``. Each variant is its own plan (the tuning object is part of it, so
of the jit cache key): no environment, no cleared caches. For every shape the variants are timed
in turn, ``--rounds`` times over (interleaved, so drift shows), and every output is compared
with the first variant's.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import numpy as np

from jax_mla.backends.triton import TritonTuning
from jax_mla.bench import profile
from jax_mla.bench.decode import Shape, attention_call
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


def run(shapes, variants, rounds: int = 2, gpu_time: bool | None = None) -> list[dict]:
    gpu_time = profile.available() if gpu_time is None else gpu_time
    rows = []
    for shape in shapes:
        calls = {name: attention_call(shape, np.random.default_rng(0), tuning=tuning)
                 for name, tuning in variants}
        times = {name: [] for name, _ in variants}
        ref = None
        errs = {}
        for _ in range(rounds):
            for name, _ in variants:
                fn, args = calls[name]
                times[name].append(device_time(fn, *args, min_ms=20) * 1e6)
        for name, tuning in variants:
            fn, args = calls[name]
            out = np.asarray(jax.jit(fn)(*args)[0], np.float32)
            ref = out if ref is None else ref
            errs[name] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            row = {"shape": shape.name, "variant": name, "tuning": dataclasses.asdict(tuning),
                   "us": times[name], "best_us": min(times[name]),
                   "vs_first": min(times[name]) / min(times[variants[0][0]]),
                   "rel_err_vs_first": errs[name]}
            if gpu_time:
                row["gpu_us"] = profile.kernel_times(fn, *args)["gpu_us"]
            rows.append(row)
            print(f"{shape.name:<28} {name:<12} best {row['best_us']:8.1f} us "
                  f"x{row['vs_first']:.3f} err {errs[name]:.1e}", flush=True)
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rounds = 2
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        del argv[i:i + 2]
    path, rest = argv[0], argv[1:]
    split = rest.index("--")
    variants = [parse_variant(v) for v in rest[:split]]
    shapes = [Shape.parse(s) for s in rest[split + 1:]]
    rows = run(shapes, variants, rounds)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
