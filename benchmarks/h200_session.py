"""One device session on the H200: correctness on the GPU, a tile sweep, and the benchmark.

Run from the repo root on the GPU machine (see benchmarks/README.md); writes under $OUT.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np

OUT = os.environ.get("OUT", "/tmp/out")
STAGES = sys.argv[1].split(",") if len(sys.argv) > 1 else ["tests", "tune", "bench"]


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def stage_tests():
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "tests/test_conformance.py"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    open(f"{OUT}/pytest_gpu.txt", "w").write(r.stdout + r.stderr)
    tail = r.stdout.strip().splitlines()[-1:] if r.stdout else r.stderr[-2000:]
    log("pytest rc", r.returncode, tail)


def stage_tune():
    from jax_mla.bench import decode
    from jax_mla.bench.timing import ceilings

    ceil = ceilings()
    shapes = [decode.Shape(64, 16, 8192), decode.Shape(128, 128, 4096),
              decode.Shape(64, 16, 4096, qlen=4)]
    configs = [(bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)]
    rows = decode.tune(shapes, configs, ceil, np.random.default_rng(0))
    json.dump({"ceil": ceil, "rows": rows}, open(f"{OUT}/tune.json", "w"), indent=1)
    for r in rows:
        log(r.get("shape"), r.get("block_n"), r.get("num_warps"), r.get("num_stages"),
            f"{r.get('us', float('nan')):.1f}us", f"{r.get('kv_TBps', float('nan')):.2f}TB/s",
            f"{r.get('TFLOPs', float('nan')):.0f}TF", r.get("error", ""))


def stage_bench():
    from jax_mla.bench.__main__ import main

    main(["--out", f"{OUT}/bench", "--plot"] + sys.argv[2:])


for st in STAGES:
    log("stage", st)
    try:
        globals()[f"stage_{st}"]()
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        log("stage failed", st, repr(e)[:500])
