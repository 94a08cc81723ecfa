"""Does XLA capture the Triton calls in CUDA graphs (command buffers), and what does it save?

``python benchmarks/gpu_graphs.py OUT.json SHAPE...`` on the GPU machine, once per ``XLA_FLAGS``
setting (XLA reads its flags once, when the backend starts; ``h200_session.py graphs_ab`` runs
the variants as separate processes). A SHAPE is ``B,H,S[,Q[,PAGE]]``. For every shape it writes:
- ``command_buffers``: how often ``command_buffer`` appears in the compiled text of the bench's
  chain of 8 calls (0: nothing was captured);
- ``us``: the bench's serial timer, best of two;
- ``rel_err_vs_xla`` and ``lse_max_abs_err``: one call against the XLA backend, same process.
"""

import json
import os
import sys


def main(argv):
    import jax
    import numpy as np

    import jax_mla
    from jax_mla.bench.decode import DEEPSEEK_SCALE, Shape, attention_call, call_metadata
    from jax_mla.bench.timing import _chained, device_time
    from jax_mla.testing import rel_err

    path, shapes = argv[0], [Shape.parse(s) for s in argv[1:]]
    rows = []
    for shape in shapes:
        fn, args = attention_call(shape, np.random.default_rng(0))
        q, cache, md = args
        xla_md = call_metadata(shape, md.block_table, md.seq_lens, backend="xla")
        text = _chained(fn, 8).lower(*args).compile().as_text()
        out, lse = (np.asarray(a, np.float32) for a in jax.jit(fn)(*args))
        xout, xlse = (np.asarray(a, np.float32) for a in jax_mla.mla_attention(
            q, cache, xla_md, scale=DEEPSEEK_SCALE, backend="xla", return_lse=True))
        fin = np.isfinite(xlse)
        row = {"shape": shape.name, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "command_buffers": text.count("command_buffer"),
               "us": min(device_time(fn, *args, min_ms=20) * 1e6 for _ in range(2)),
               "rel_err_vs_xla": rel_err(out, xout),
               "lse_max_abs_err": float(np.max(np.abs(lse[fin] - xlse[fin]))),
               "lse_inf_rows_match": bool(np.array_equal(np.isfinite(lse), fin))}
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump(rows, open(path, "w"), indent=1)

if __name__ == "__main__":
    main(sys.argv[1:])
