"""Where the bench's time goes on the GPU: the kernels of its timing chain and the gaps between.

``python benchmarks/gpu_gaps.py OUT.json SHAPE...`` on the GPU machine records, with CUPTI
(through ``torch.profiler``), every kernel of the bench's timing chain (``jax_mla.bench.timing``:
n calls in one jitted program, each fed a dependency on the previous output). It reports the
chain's GPU span per call, each kernel's own time, and the idle gap before each kernel, by kernel
name: the part of the bench's figure that is neither kernel. For reference it does the same for
XLA's own float32 sum over the same cache (every KV byte read once, no attention).

SHAPE is ``B,H,S[,Q[,PAGE]]``, e.g. ``32,16,4096`` or ``64,16,4096,4``.
"""

import json
import re
import sys


def _kernels(trace_path):
    ev = [e for e in json.load(open(trace_path)).get("traceEvents", [])
          if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    return sorted(ev, key=lambda e: float(e["ts"]))


def _short(name):
    """Our kernels by family; XLA's ops by name without the per-call ``_N`` suffix."""
    for key in ("mla_decode_sm90", "mla_decode", "mla_reduce"):
        if name.startswith(key):
            return key
    return re.sub(r"_\d+$", "", name)[:40]


def gaps(path, specs, n=32):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from jax_mla.bench.decode import Shape, attention_call
    from jax_mla.bench.timing import _chained, device_time

    torch.cuda.init()
    rng = np.random.default_rng(0)
    rows = []

    def chain_profile(fn, args, tag):
        many = _chained(fn, n)
        jax.block_until_ready(many(*args))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            jax.block_until_ready(many(*args))
        trace = f"/tmp/gaps.{tag}.trace.json"  # not under $OUT: the device returns few files
        prof.export_chrome_trace(trace)
        ev = _kernels(trace)
        span = (float(ev[-1]["ts"]) + float(ev[-1]["dur"]) - float(ev[0]["ts"])) / n
        own, gap = {}, {}
        for a, b in zip(ev, ev[1:] + [None]):
            k = _short(a["name"])
            own[k] = own.get(k, 0.0) + float(a["dur"]) / n
            if b is not None:
                kb = _short(b["name"])
                g = float(b["ts"]) - float(a["ts"]) - float(a["dur"])
                gap[kb] = gap.get(kb, 0.0) + g / n
        return {"span_us_per_call": span, "kernel_us_per_call": own,
                "gap_before_us_per_call": gap, "kernels_per_call": len(ev) / n}

    for spec in specs:
        shape = Shape.parse(spec)
        fn, args = attention_call(shape, rng)
        row = {"shape": shape.name, "bench_us": device_time(fn, *args, min_ms=20) * 1e6}
        row |= chain_profile(fn, args, len(rows))
        cache = args[1]
        # Every KV byte the call reads, read once by XLA's own reduction (no attention).
        lens = np.asarray(args[2].seq_lens)
        xla_sum = lambda c: jnp.sum(c, dtype=jnp.float32)  # noqa: E731
        row["xla_sum_bench_us"] = device_time(xla_sum, cache, min_ms=20) * 1e6
        fl = chain_profile(xla_sum, (cache,), f"xla_sum{len(rows)}")
        row["xla_sum_span_us"] = fl["span_us_per_call"]
        row["kv_bytes"] = float(lens.sum()) * cache.shape[-1] * cache.dtype.itemsize
        row["cache_bytes"] = float(cache.size * cache.dtype.itemsize)
        rows.append(row)
        print(json.dumps(row), flush=True)
    json.dump(rows, open(path, "w"), indent=1)


if __name__ == "__main__":
    gaps(sys.argv[1], sys.argv[2:])
