"""DCP across processes: per-process memory and decode step time for ``N`` processes.

A fixed global context (``--cache-mib`` of latent cache, ``--batch`` requests of equal length)
is spread over every device of ``N`` processes (a 1-D DCP mesh). Each process allocates only its
own devices' pages (:func:`jax_mla.dcp_allocate_cache`) and times the serving loop's decode
step: one new token per request written on its owning rank, the step's metadata, and
:func:`jax_mla.dcp_mla_attention`, one jitted program with the cache donated. It reports, per
process: the cache bytes it holds, its resident memory before the cache and at its peak, and the
step's median wall time.

``python -m jax_mla.bench.dcp_multihost --sweep 1,2,4 --out DIR``: runs the worker under
``jax_mla.launch`` for each ``N`` (``--devices-per-proc`` devices each), prints a table and
writes ``DIR/dcp_multihost.json``. ``--quick``: tiny shapes (seconds, a smoke test).
Run under a launcher directly (``python -m jax_mla.launch --nprocs N -- -m
jax_mla.bench.dcp_multihost``), it is one run's worker: process 0 prints the ``RESULT`` line.

On a CPU host the processes share the host's cores and talk through gloo over loopback, so step
times show overheads, not the scaling of a real cluster; the memory per process is what the
layout gives anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import jax_mla
from jax_mla import distributed
from jax_mla.launch import launch

RESULT = "RESULT "


def worker(args) -> dict:
    """One process of a run (after ``jax_mla.distributed.initialize``); returns process 0's
    summary of every process (None elsewhere)."""
    base = distributed.host_memory()["rss_bytes"] or 0
    mesh = jax.make_mesh((jax.device_count(),), ("dcp",))
    n = jax.device_count()
    lr, rope, ps, b, h = args.kv_lora_rank, args.rope_dim, args.page, args.batch, args.heads
    dtype = jnp.dtype(args.dtype)
    width = lr + rope
    tokens = args.cache_mib * 2**20 // (width * dtype.itemsize)
    seq = tokens // b - args.steps - 2  # room for the new tokens
    max_pages = -(-(seq + args.steps + 2) // (ps * n))
    pages_per_rank = b * max_pages
    mgr = jax_mla.PagedCacheManager(num_pages=pages_per_rank, page_size=ps, max_seqs=b,
                                    max_pages_per_seq=max_pages, world_size=n)
    ids = list(range(b))
    for i in ids:
        mgr.add(i, seq)  # the context's values do not change the step's time
    kv = jax.block_until_ready(jax_mla.dcp_allocate_cache(
        pages_per_rank, ps, width, mesh=mesh, dtype=dtype, fill_value=0.01))
    sh = jax_mla.dcp_shardings(mesh)
    after_alloc = distributed.host_memory()["rss_bytes"] or 0

    def step(kv, q, kv_c, k_pe, pos, req, tables, lens):
        kv = jax_mla.dcp_write_kv_cache(kv, kv_c, k_pe, pos, req, tables, mesh=mesh)
        md = jax_mla.build_dcp_metadata(tables, lens, mesh=mesh, page_size=ps, num_heads=h,
                                        q_dtype=q.dtype, kv_dtype=kv.dtype, kv_lora_rank=lr,
                                        rope_dim=rope, backend=args.backend)
        out = jax_mla.dcp_mla_attention(q, kv, md, mesh=mesh, scale=(lr // 4 + rope) ** -0.5,
                                        combine=args.combine, backend=args.backend,
                                        kv_lora_rank=lr)
        return kv, out

    step = jax.jit(step, donate_argnums=0)
    rng = np.random.default_rng(0)
    times = []
    for k in range(args.steps):
        for i in ids:
            mgr.append(i, 1)
        pos, req = mgr.token_positions(ids, None, 1, capacity=b)
        rows = rng.standard_normal((b, width)).astype(np.float32)
        tables = distributed.host_to_global(mgr.block_tables(ids, rows=b), sh.block_tables)
        q = distributed.host_to_global(
            rng.standard_normal((b, h, width)).astype(dtype), sh.q)
        t0 = time.perf_counter()
        with distributed.guard(f"step {k}"):
            kv, out = step(kv, q, rows[:, :lr].astype(dtype), rows[:, lr:].astype(dtype), pos,
                           req, tables, mgr.seq_lens(ids, rows=b))
            jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    timed = times[args.warmup:] or times
    mem = distributed.host_memory()
    mine = np.array([distributed.addressable_nbytes(kv, distinct=True), base, after_alloc,
                     mem["peak_rss_bytes"] or 0, statistics.median(timed) * 1e6], np.float64)
    every = multihost_utils.process_allgather(mine)  # [processes, 5]: small numbers only
    if jax.process_index() != 0:
        return None
    cache_bytes = int(np.prod(kv.shape)) * dtype.itemsize
    return {
        "processes": jax.process_count(), "devices": n, "platform": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind, "batch": b, "seq_len": int(seq),
        "heads": h, "dtype": dtype.name, "page": ps, "combine": args.combine,
        "cache_bytes_global": cache_bytes, "steps_timed": len(timed),
        "per_process": [
            {"process": i, "cache_bytes": int(r[0]), "rss_before_cache_bytes": int(r[1]),
             "rss_after_alloc_bytes": int(r[2]), "peak_rss_bytes": int(r[3]),
             "step_us": float(r[4])} for i, r in enumerate(every)],
    }


def sweep(args) -> list[dict]:
    """Run the worker under the launcher for each ``N`` of ``--sweep``; process 0's rows."""
    rows = []
    cmd = ["-m", "jax_mla.bench.dcp_multihost", *_worker_args(args)]
    for nprocs in [int(x) for x in args.sweep.split(",")]:
        r = launch(cmd, nprocs=nprocs, devices_per_proc=args.devices_per_proc,
                   timeout_s=args.timeout, heartbeat_timeout_s=30,
                   echo=sys.stderr if args.verbose else None)
        lines = [ln for ln in r.output(0).splitlines() if ln.startswith(RESULT)]
        if r.returncode != 0 or not lines:
            tail = "\n".join(r.output(r.failed_rank or 0).splitlines()[-30:])
            raise RuntimeError(f"N={nprocs}: {r.message}\n{tail}")
        rows.append(json.loads(lines[-1][len(RESULT):]))
    return rows


def _worker_args(args) -> list[str]:
    out = []
    for name in ("cache_mib", "batch", "heads", "page", "kv_lora_rank", "rope_dim", "dtype",
                 "steps", "warmup", "combine", "backend"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def table(rows: list[dict]) -> str:
    mib = 2**20
    """Per ``N``: the largest per-process figures (memory) and the median step time."""
    mib = 2**20
    lines = [f"{'N':>3} {'devices':>7} {'cache/process MiB':>17} {'RSS before MiB':>14} "
             f"{'peak RSS MiB':>12} {'peak - cache':>12} {'step ms':>8}"]
    for r in rows:
        pp = r["per_process"]
        lines.append(
            f"{r['processes']:>3} {r['devices']:>7} "
            f"{max(p['cache_bytes'] for p in pp) / mib:>17.1f} "
            f"{max(p['rss_before_cache_bytes'] for p in pp) / mib:>14.1f} "
            f"{max(p['peak_rss_bytes'] for p in pp) / mib:>12.1f} "
            f"{max(p['peak_rss_bytes'] - p['cache_bytes'] for p in pp) / mib:>12.1f} "
            f"{statistics.median(p['step_us'] for p in pp) / 1e3:>8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_mla.bench.dcp_multihost")
    p.add_argument("--sweep", default=None,
                   help="comma-separated process counts to launch in turn (e.g. 1,2,4)")
    p.add_argument("--devices-per-proc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launched run")
    p.add_argument("--out", default=None, help="folder for dcp_multihost.json (with --sweep)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    p.add_argument("--verbose", action="store_true", help="stream the processes' output")
    p.add_argument("--cache-mib", type=int, default=1024, help="global latent cache, MiB")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=16, help="query heads in all")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    # float32: XLA:CPU widens a bf16 scatter (the cache write) to float32 over the whole cache,
    # which would measure that temporary rather than the layout. On GPUs pass bfloat16.
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps not timed (compiles)")
    p.add_argument("--combine", default="a2a")
    p.add_argument("--backend", default="auto")
    args = p.parse_args(argv)
    if args.quick:
        args.cache_mib, args.batch, args.heads, args.page = 4, 2, 8, 16
        args.kv_lora_rank, args.rope_dim, args.dtype, args.steps = 64, 16, "float32", 3
        args.warmup = 1
    if args.sweep:
        rows = sweep(args)
        print(table(rows))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "dcp_multihost.json"), "w") as f:
                json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
        return 0
    distributed.initialize()
    summary = worker(args)
    if summary is not None:
        print(RESULT + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
