"""``python -m jax_mla.bench``: time every backend on the same shapes, in roofline terms.

Prints a table, writes ``decode.json`` and ``decode.csv`` (with device, versions and date) to
``--out`` (default: a folder under the system's temp directory, never the repository), and
optionally a plot. Ratios are against the copy bandwidth and bf16 matmul rate measured at the
start of the same run, and against the XLA backend measured in the same run. Both timers are
reported: stream time (``us``) and, on a CUDA GPU, GPU time (``gpu_us``, CUPTI).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile

import numpy as np

import jax_mla
from jax_mla.bench import decode, profile, timing
from jax_mla.bench.timing import ceilings, environment

DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "jax_mla_bench")

def print_table(rows, cols):
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write(rows, env, out_dir, name):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1, default=float)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]

    names = sorted({r["shape"] for r in rows}, key=lambda s: [r["shape"] for r in rows].index(s))
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.5), 4))
    for backend in sorted({r["backend"] for r in rows}):
        ys = [next((r["frac_copy"] for r in rows if r["shape"] == n and r["backend"] == backend),
                   np.nan) for n in names]
        ax.plot(range(len(names)), ys, "o-", label=backend)
    ax.set_xticks(range(len(names)), names, rotation=75, fontsize=7)
    ax.set_ylabel("fraction of measured copy bandwidth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the served model (jax_mla/bench/serve.py)
        from jax_mla.bench import serve

        return serve.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m jax_mla.bench")
    p.add_argument("--backends", default=None, help="comma list (default: all available)")
    p.add_argument("--quick", action="store_true", help="a few small shapes (smoke test)")
    p.add_argument("--tags", default=None, help="only shapes with these tags (comma list)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--plot", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gpu-time", action="store_true", help="skip the CUPTI pass")
    p.add_argument("--min-ms", type=float, default=20.0,
                   help="shortest timed program (ms): amortises its dispatch and sync")
    args = p.parse_args(argv)
    timing.MIN_MS = args.min_ms
    if args.quick:
        timing.smoke()
    backends = (args.backends.split(",") if args.backends
                else [b for b in jax_mla.available_backends() if b != "aiter"])
    env = environment()
    print(json.dumps(env))
    if env["platform"] == "cpu" or args.quick:
        # The probes (a 1 GiB copy, an 8192^2 matmul) would dominate a CPU or smoke run.
        ceil = {"copy_bytes_per_s": float("nan"), "bf16_matmul_flops": float("nan"),
                "plausible": None, "skipped": "no ceiling probes on a CPU or with --quick"}
        print(ceil["skipped"])
    else:
        ceil = ceilings()
        print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
              f"{ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    env.update(ceil)
    shapes = decode.target_shapes(args.quick)
    if args.tags:
        shapes = [s for s in shapes if s.tag in args.tags.split(",")]
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        def tqdm(x, **_):
            return x
    # Inputs depend on (seed, shape index) only: the GPU-time pass rebuilds the same ones.
    for i, shape in enumerate(tqdm(shapes, desc="decode", file=sys.stdout)):
        try:
            rows += decode.run_shape(shape, backends, ceil, np.random.default_rng([args.seed, i]))
        except Exception as e:  # noqa: BLE001 - a shape that fails is data; the rest still run
            rows.append({"shape": shape.name, "backend": "-", "error": repr(e)[:300]})
        write(rows, env, args.out, "decode")  # after every shape: a timeout keeps what ran
    if profile.available() and not args.no_gpu_time:
        for i, shape in enumerate(tqdm(shapes, desc="GPU time (CUPTI)", file=sys.stdout)):
            try:
                got = decode.gpu_time_rows(shape, backends, np.random.default_rng([args.seed, i]))
            except Exception as e:  # noqa: BLE001 - stream times stand without it
                print(f"{shape.name}: no GPU time ({e!r:.200})")
                continue
            for r in rows:
                if r["shape"] == shape.name and r.get("backend") in got:
                    r.update(got[r["backend"]])
            write(rows, env, args.out, "decode")
    print_table(rows, ["shape", "backend", "us", "gpu_us", "launches", "kernel_us",
                       "metadata_us", "metadata_launches", "kv_TBps", "TFLOPs", "frac_copy",
                       "frac_matmul", "speedup_vs_xla", "rel_err_vs_xla", "lse_max_abs_err",
                       "error"])
    if args.plot:
        plot(rows, os.path.join(args.out, "decode.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
