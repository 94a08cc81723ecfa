"""GPU time of each kernel of one jitted ``mla_attention`` call, read with CUPTI (torch.profiler).

CUPTI's kernel records cover every kernel the process launches, JAX's included, so this gives the
call's GPU time with no launch gaps and no host overhead: the split kernel, the reduce, memsets,
and any XLA op around them. Usage on the GPU machine:
``python benchmarks/gpu_kernel_times.py OUT.json [B,H,S[,Q[,PAGE]] ...]`` (default: the shapes
below).
"""

import json
import sys


def shapes():
    from jax_mla.bench.decode import Shape

    return [Shape(1, 16, 1024), Shape(1, 128, 1024), Shape(8, 16, 8192), Shape(16, 16, 8192),
            Shape(32, 16, 4096), Shape(64, 16, 8192), Shape(128, 16, 32768),
            Shape(64, 16, 4096), Shape(64, 16, 4096, qlen=2), Shape(64, 16, 4096, qlen=3),
            Shape(64, 16, 4096, qlen=4), Shape(2, 128, 8192),
            Shape(8, 128, 32768), Shape(128, 128, 4096)]


def main(path, specs=(), calls=20):
    import jax
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from jax_mla.bench.decode import Shape, attention_call

    torch.cuda.init()
    rng = np.random.default_rng(0)
    rows = []
    todo = [Shape.parse(s) for s in specs] if specs else shapes()
    for shape in todo:
        fn, args = attention_call(shape, rng)
        f = jax.jit(fn)
        jax.block_until_ready(f(*args))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                jax.block_until_ready(f(*args))
        trace = f"/tmp/kernel_times.{len(rows)}.trace.json"
        prof.export_chrome_trace(trace)  # every CUPTI kernel record, whoever launched it
        kernels = {}
        for e in json.load(open(trace)).get("traceEvents", []):
            if e.get("cat") not in ("kernel", "gpu_memset"):
                continue
            d = kernels.setdefault(e["name"][:60], [0, 0.0])
            d[0] += 1
            d[1] += float(e.get("dur", 0.0))
        per_call = {k: v[1] / calls for k, v in kernels.items()}
        row = {"shape": shape.name, "calls": calls, "kernels_us_per_call": per_call,
               "gpu_us_per_call": sum(per_call.values()),
               "launches_per_call": sum(v[0] for v in kernels.values()) / calls}
        rows.append(row)
        print(f"{shape.name}: GPU {row['gpu_us_per_call']:.1f} us/call "
              f"({row['launches_per_call']:.1f} kernels) "
              + " | ".join(f"{k[:28]} {v:.1f}" for k, v in per_call.items()), flush=True)
    json.dump(rows, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
