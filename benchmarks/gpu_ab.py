"""Same-run A/B of jax_mla's environment knobs, timed by the bench's own timer.

``python benchmarks/gpu_ab.py OUT.json VARIANT... -- SHAPE...`` on the GPU machine. A VARIANT
is ``name`` or ``name:KEY=VALUE[,KEY=VALUE]`` (``base`` alone: the defaults); a SHAPE is
``B,H,S[,Q[,PAGE]]``. For every shape, the variants are timed in turn, ``--rounds`` times over
(interleaved, so that drift between them shows), each as ``jax_mla.bench.timing.device_time``
with ``min_ms=20`` (the serial chain ``python -m jax_mla.bench`` reports). Knobs are read when
``mla_attention`` is traced, so every measurement starts from cleared JAX caches, and the
metadata (whose split plan reads knobs too) is built again. Every variant's
output is compared with the first variant's (relative error). Writes one JSON row per
(shape, variant) with every round's µs, and prints a table of the best rounds.
"""

import json
import os
import sys


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, env


def main(argv):
    import jax
    import numpy as np

    from jax_mla.bench.decode import Shape, attention_call, call_metadata
    from jax_mla.bench.timing import device_time

    rounds = 2
    if "--rounds" in argv:
        i = argv.index("--rounds")
        rounds = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    path, rest = argv[0], argv[1:]
    split = rest.index("--")
    variants = [parse_variant(v) for v in rest[:split]]
    shapes = [Shape.parse(s) for s in rest[split + 1:]]
    keys = {k for _, env in variants for k in env}
    saved = {k: os.environ.get(k) for k in keys}

    def use(env):
        for k in keys:
            if k in env:
                os.environ[k] = env[k]
            elif saved[k] is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = saved[k]
        jax.clear_caches()  # knobs are read at trace time

    rows = []
    for shape in shapes:
        fn, args = attention_call(shape, np.random.default_rng(0))
        times = {name: [] for name, _ in variants}
        errs = {}
        ref = None
        for _ in range(rounds):
            for name, env in variants:
                use(env)
                q, cache, md = args
                md = call_metadata(shape, md.block_table, md.seq_lens)  # the plan reads knobs
                times[name].append(device_time(fn, q, cache, md, min_ms=20) * 1e6)
                if name not in errs:
                    out = np.asarray(jax.jit(fn)(q, cache, md)[0], np.float32)
                    if ref is None:
                        ref = out
                    errs[name] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        use({})
        base = min(times[variants[0][0]])
        for name, env in variants:
            row = {"shape": shape.name, "variant": name, "env": env, "us": times[name],
                   "best_us": min(times[name]), "vs_first": min(times[name]) / base,
                   "rel_err_vs_first": errs[name]}
            rows.append(row)
            print(f"{shape.name:<24} {name:<12} best {row['best_us']:8.1f} us  "
                  f"x{row['vs_first']:.3f}  rounds {' '.join(f'{t:.1f}' for t in times[name])}"
                  f"  err {errs[name]:.1e}", flush=True)
        json.dump(rows, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
