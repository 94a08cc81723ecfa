"""What a step's metadata costs on the GPU, and the planning kernel's own knobs.

``python -m jax_mla.bench.planner OUT.json [SHAPE...]``. For each decode shape
(``B,H,S[,Q[,PAGE[,KV]]]``, default :data:`SHAPES`): the whole metadata build with the split
plan in XLA ops (``jnp``) and in the planning kernel (``kernel``), each kernel family's GPU time
(CUPTI) and the launches; then the planning kernel alone under :data:`VARIANTS` (chunks of
requests / programs / works, warps), every variant checked bit for bit against the default.
Needs a CUDA GPU and torch (CUPTI).
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jax_mla.backends.triton import TritonTuning
from jax_mla.backends.triton.schedule import plan_splits_kernel
from jax_mla.bench import profile
from jax_mla.bench.decode import Shape, builder, make_inputs

SHAPES = ("1,16,1024", "1,128,1024", "32,16,4096", "128,16,8192", "128,128,4096", "32,16,32768")
# name: (chunks (requests, programs, works; None: the default), warps)
VARIANTS = {"default": (None, 8), "default_w4": (None, 4), "r32p512w8": ((32, 512, 512), 8),
            "c128w8": ((128, 128, 128), 8)}


def run(specs, path=None) -> list[dict]:
    """The rows, each also written to ``path`` (JSON) as soon as it is measured."""
    rows = []
    for spec in specs:
        shape = Shape.parse(spec)
        _, _, table, lens, _ = make_inputs(shape, np.random.default_rng(0))
        row = {"shape": shape.name}
        for planner in ("jnp", "kernel"):
            build = builder(shape, tuning=TritonTuning(planner=planner))
            k = profile.kernel_times(build, table, lens)
            row[planner] = {"gpu_us": k["gpu_us"], "launches": k["launches"],
                            "memcpys": k["memcpy_launches"], "kernels_us": k["kernels_us"]}
        md = jax.jit(builder(shape))(table, lens)
        plan = md.plan
        kw = dict(qlen=plan.problem.qlen, block_n=plan.kernel.block_n,
                  num_programs=plan.num_programs, num_head_blocks=plan.kernel.num_head_blocks,
                  mode=plan.split_mode, target=plan.problem.target, launcher=plan.launcher)
        row["num_programs"], row["block_n"] = plan.num_programs, plan.kernel.block_n
        ref = None
        row["variants"] = {}
        for name, (chunks, warps) in VARIANTS.items():
            def fn(lens, chunks=chunks, warps=warps, kw=kw):
                return plan_splits_kernel(lens, chunks=chunks, num_warps=warps, **kw)

            got = jax.jit(fn)(md.seq_lens)
            flat = [np.asarray(x) for x in jax.tree.leaves(got)]
            ref = flat if ref is None else ref
            exact = all(np.array_equal(a, b) for a, b in zip(flat, ref))
            k = profile.kernel_times(fn, md.seq_lens)
            row["variants"][name] = {"gpu_us": k["gpu_us"], "launches": k["launches"],
                                     "exact": exact}
        print(json.dumps(row), flush=True)
        rows.append(row)
        if path:
            with open(path, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run(argv[1:] or SHAPES, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
