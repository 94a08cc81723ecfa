"""One process of a multi-process DCP run (``tests/test_multiprocess.py``), started by
``jax_mla.launch`` with the ``JAX_MLA_*`` variables of its place in the run.

``python tests/multiprocess_worker.py dcp --seed S``: a serving loop's steps on a DCP cache that
each process allocates and writes only for its own devices (prefill write, a decode step, a
verify step, each one jitted program: write + metadata + attention), for two layouts: a 1-D
DCP mesh over every device (interleave 1, ``ag_rs``) and a 2-D DCP x head-parallel mesh
(interleave 2, ``a2a``). Every process draws the same tokens and queries from the seed and
compares the gathered outputs (small) with the float64 single-device oracle over the whole
context; the cache itself is never gathered.

``python tests/multiprocess_worker.py prefill --seed S``: the model layer (``mla_layer`` with
``Parallel``) on a 1-D DCP mesh over every device (interleave 2): first prompt chunks, then a
step of a decode row and prompt chunks over their cached context (one request new, with none),
each step one jitted program; the outputs are compared with the same steps through the
single-device layer on this process's first device.

``python tests/multiprocess_worker.py fault --seed S --die-rank R --die-step K``: steps in a
loop; inside step ``K`` (a host callback before the first collective) process ``R`` exits
abruptly, and the others must fail on their own within the heartbeat timeout.

The last line a process prints is ``RESULT {json}`` (the test reads it); a failure is a
traceback and a non-zero exit.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
import os
import sys
import time

import jax_mla

CFG = jax_mla.distributed.initialize()  # first: before anything touches a device

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_mla.model import AttentionBatch, MLAConfig, Parallel, init_params, mla_layer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_cases import collectives  # noqa: E402
from oracle import mla_decode, rel_err  # noqa: E402

L, R, H = 32, 16, 16  # latent / rope widths, query heads in all
PAGE = 4  # a multiple of every interleave used
SCALE = 1.0 / np.sqrt(48.0)
VERIFY_Q = 3
SPARE_POOL = 256  # pages per rank
CASES = {  # name: (tp, interleave, combine); dcp = every device / tp
    "dcp_1d": (1, 1, "ag_rs"),
    "dcp_x_tp": (2, 2, "a2a"),
}


def lse_rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(want)
    if not np.array_equal(np.isneginf(got), ~fin):
        return float("inf")  # the empty-row (-inf) pattern differs
    return float(np.linalg.norm(got[fin] - want[fin]) / max(np.linalg.norm(want[fin]), 1e-30))


class Run:
    """One layout's serving loop: the manager, the sharded cache and every request's tokens."""

    def __init__(self, rng, *, tp, interleave, combine):
        ndev = jax.device_count()
        self.n = ndev // tp
        self.mesh = (jax.make_mesh((self.n,), ("dcp",)) if tp == 1
                     else jax.make_mesh((self.n, tp), ("dcp", "tp")))
        self.head_axis = None if tp == 1 else "tp"
        self.interleave, self.combine = interleave, combine
        self.sh = jax_mla.dcp_shardings(self.mesh, head_axis=self.head_axis)
        n, i = self.n, interleave
        # Request 0 leaves most ranks empty; request 2 ends just past a rank turn.
        self.prompts = np.array([1, 4, 2 * i * n - 3, 45], np.int32)
        final = self.prompts + 1 + VERIFY_Q
        self.max_pages = -(-int(final.max()) // (PAGE * n)) + 1
        # Spare pages: a rank's cache then dwarfs every legitimate collective operand.
        self.pool = max(len(final) * self.max_pages + 1, SPARE_POOL)
        self.mgr = jax_mla.PagedCacheManager(
            num_pages=self.pool, page_size=PAGE, max_seqs=len(final),
            max_pages_per_seq=self.max_pages, world_size=n, interleave=i)
        # Every token's latent row, drawn the same on every process (the new tokens of a step
        # are replicated inputs of the write; each rank keeps the ones it owns).
        self.rows = [rng.standard_normal((int(s), L + R)).astype(np.float32) for s in final]
        self.kv = jax_mla.dcp_allocate_cache(self.pool, PAGE, L + R, mesh=self.mesh,
                                             dtype=jnp.float32, fill_value=np.nan)
        self.ids = list(range(len(final)))
        self.steps = {}

    def tables(self):
        b = len(self.ids)
        return (jax_mla.distributed.host_to_global(self.mgr.block_tables(self.ids, rows=b),
                                                   self.sh.block_tables),
                self.mgr.seq_lens(self.ids, rows=b))

    def new_tokens(self, counts):
        pos, req = self.mgr.token_positions(self.ids, None, counts, capacity=int(sum(counts)))
        rows = np.stack([self.rows[r][p] for p, r in zip(pos, req)])
        return rows[:, :L], rows[:, L:], pos, req

    def prefill(self):
        for b in self.ids:
            self.mgr.add(b, int(self.prompts[b]))
        kv_c, k_pe, pos, req = self.new_tokens(self.prompts)
        tables, _ = self.tables()
        self.kv = jax_mla.dcp_write_kv_cache(self.kv, kv_c, k_pe, pos, req, tables,
                                             mesh=self.mesh, interleave=self.interleave)

    def step_fn(self, qlen, hook=None):
        mesh, head_axis, interleave = self.mesh, self.head_axis, self.interleave

        def step(kv, q, kv_c, k_pe, pos, req, tables, lens, step_id):
            if hook is not None:
                q = hook(q, step_id)
            kv = jax_mla.dcp_write_kv_cache(kv, kv_c, k_pe, pos, req, tables, mesh=mesh,
                                            interleave=interleave)
            md = jax_mla.build_dcp_metadata(
                tables, lens, mesh=mesh, page_size=PAGE, num_heads=H, qlen=qlen,
                interleave=interleave, head_axis=head_axis, q_dtype=q.dtype, kv_dtype=kv.dtype,
                kv_lora_rank=L, rope_dim=R)
            out, lse = jax_mla.dcp_mla_attention(q, kv, md, mesh=mesh, scale=SCALE,
                                                 head_axis=head_axis, combine=self.combine,
                                                 return_lse=True, kv_lora_rank=L)
            return kv, out, lse

        return jax.jit(step, donate_argnums=0)

    def step(self, rng, qlen, *, hook=None, step_id=0):
        """Append ``qlen`` tokens to every request, write them, attend; returns ``(out, lse,
        q, compiled HLO text)`` with out/lse gathered to every process (they are small)."""
        for b in self.ids:
            self.mgr.append(b, qlen)
        kv_c, k_pe, pos, req = self.new_tokens([qlen] * len(self.ids))
        tables, lens = self.tables()
        q = rng.standard_normal((len(self.ids) * qlen, H, L + R)).astype(np.float32)
        args = (self.kv, jax_mla.distributed.host_to_global(q, self.sh.q), kv_c, k_pe, pos, req,
                tables, lens, np.int32(step_id))
        key = (qlen, hook is not None)
        if key not in self.steps:
            self.steps[key] = self.step_fn(qlen, hook).lower(*args).compile()
        compiled = self.steps[key]
        self.kv, out, lse = compiled(*args)
        out, lse = multihost_utils.process_allgather((out, lse), tiled=True)
        return out, lse, q, compiled.as_text()

    def oracle(self, q, qlen):
        """float64 single-device attention over every request's whole context."""
        lens = self.mgr.seq_lens(self.ids, rows=len(self.ids))
        cap = -(-int(lens.max()) // PAGE)
        cache = np.zeros((len(self.ids) * cap, PAGE, L + R), np.float32)
        table = np.arange(len(self.ids) * cap, dtype=np.int32).reshape(len(self.ids), cap)
        for b, s in enumerate(lens):
            cache.reshape(len(self.ids), cap * PAGE, L + R)[b, :s] = self.rows[b][:s]
        return mla_decode(q, cache, table, lens, qlen=qlen, page_size=PAGE, scale=SCALE,
                          kv_lora_rank=L)


def tcp_sockets() -> list[dict] | None:
    """Every TCP socket this process holds: ``{"local", "remote", "listen"}`` (``host:port``
    strings), from ``/proc`` (None where there is none)."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        found = []
        for table, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
            if not os.path.exists(table):
                continue
            with open(table) as f:
                for line in f.read().splitlines()[1:]:
                    cols = line.split()
                    if cols[9] in inodes:
                        found.append({"local": _addr(cols[1], v6), "remote": _addr(cols[2], v6),
                                      "listen": cols[3] == "0A"})
        return found
    except OSError:
        return None


def _addr(hexaddr: str, v6: bool) -> str:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if v6:  # four little-endian 32-bit words; an IPv4-mapped address is shown as IPv4
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        text = str(ip.ipv4_mapped or ip)
    else:
        text = str(ipaddress.IPv4Address(raw[::-1]))
    return f"{text}:{int(port, 16)}"


def run_dcp(args) -> dict:
    result = {"cases": {}}
    for name, (tp, interleave, combine) in CASES.items():
        t0 = time.perf_counter()
        rng = np.random.default_rng(args.seed)
        run = Run(rng, tp=tp, interleave=interleave, combine=combine)
        run.prefill()
        case = {"dcp": run.n, "tp": tp, "interleave": interleave, "combine": combine,
                "devices": [d.id for d in run.mesh.devices.flat],
                "local_devices": [d.id for d in jax.local_devices()]}
        rank_cache_elems = run.pool * PAGE * (L + R)
        for what, qlen in (("decode", 1), ("verify", VERIFY_Q)):
            out, lse, q, hlo = run.step(rng, qlen)
            want_o, want_l = run.oracle(q, qlen)
            found = collectives(hlo)
            case[what] = {"out_rel_err": rel_err(out, want_o),
                          "lse_rel_err": lse_rel_err(lse, want_l),
                          "collective_ops": sorted({op for op, _, _ in found}),
                          "biggest_collective_elems": max((n for *_, n in found), default=0),
                          "rank_cache_elems": rank_cache_elems}
        kv = run.kv
        case["cache_bytes_global"] = int(np.prod(kv.shape)) * kv.dtype.itemsize
        case["cache_bytes_distinct"] = jax_mla.distributed.addressable_nbytes(kv, distinct=True)
        case["cache_bytes_held"] = jax_mla.distributed.addressable_nbytes(kv)
        case["seconds"] = time.perf_counter() - t0
        result["cases"][name] = case
    result["tcp_sockets"] = tcp_sockets()
    return result


# (decode ids, qlen), (prefill ids, new tokens, cached context) of each prefill-mode step.
PREFILL_STEPS = (
    (([], 0), ([0, 1, 2], [5, 11, 2], [0, 0, 0])),
    (([0], 1), ([1, 2, 3], [7, 9, 6], [11, 2, 0])),
)


def run_prefill(args) -> dict:
    """The layer's chunked prefill over a DCP-sharded cached context, against one device."""
    cfg = MLAConfig(hidden_size=48, num_heads=8, kv_lora_rank=L, q_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=R, v_head_dim=16)
    # A spare pool: a rank's cache then dwarfs every legitimate collective operand.
    n, interleave, pool, max_pages, ws = jax.device_count(), 2, SPARE_POOL, 8, 8
    mesh = jax.make_mesh((n,), ("dcp",))
    par = Parallel(mesh=mesh, interleave=interleave, combine="a2a")
    rng = np.random.default_rng(args.seed)
    # NumPy leaves: every process passes the same values, each uploads them to its devices.
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(args.seed % 1000),
                                                  jnp.float32, std=0.2))
    managers = [jax_mla.PagedCacheManager(num_pages=pool, page_size=PAGE, max_seqs=4,
                                          max_pages_per_seq=max_pages, world_size=w,
                                          interleave=interleave) for w in (1, n)]
    one_mgr, mgr = managers
    kv = jax_mla.dcp_allocate_cache(pool, PAGE, L + R, mesh=mesh, dtype=jnp.float32,
                                    fill_value=np.nan)
    local = jax.local_devices()[0]  # the single-device reference runs here, in every process
    one_kv = jax.device_put(jnp.full((pool, PAGE, L + R), jnp.nan, jnp.float32), local)

    def dcp_step(params, x, pos, kv, req, tables, dec_tables, dec_lens, ctx, cu, *, qlen):
        md = None if not qlen else jax_mla.build_dcp_metadata(
            dec_tables, dec_lens, mesh=mesh, page_size=PAGE, num_heads=cfg.num_heads,
            qlen=qlen, interleave=interleave, q_dtype=x.dtype, kv_lora_rank=L, rope_dim=R,
            backend="xla")
        batch = AttentionBatch(slot_mapping=None, decode=md, positions=pos, request_ids=req,
                               block_tables=tables, prefill_context_lens=ctx,
                               prefill_cu_seqlens=cu)
        return mla_layer(params, cfg, x, pos, kv, batch, parallel=par, workspace_tokens=ws,
                         decode_backend="xla", prefill_backend="xla")

    def one_step(params, x, pos, kv, batch):
        return mla_layer(params, cfg, x, pos, kv, batch, parallel=None, workspace_tokens=ws,
                         decode_backend="xla", prefill_backend="xla")

    steps = []
    for (dec, qlen), (pre, counts, ctx) in PREFILL_STEPS:
        for m in managers:
            for i in dec:
                m.append(i, qlen)
            for i, c, k in zip(pre, counts, ctx):
                (m.append if k else m.add)(i, c)
        ids, all_counts = dec + pre, [qlen] * len(dec) + counts
        cap = sum(all_counts)
        pos, req = mgr.token_positions(ids, None, all_counts, capacity=cap)
        ctx = np.asarray(ctx, np.int32)
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        x = rng.standard_normal((cap, cfg.hidden_size)).astype(np.float32)
        bd = max(len(dec), 1)
        args_ = (params, x, pos, kv, req, mgr.block_tables(ids, rows=len(ids)),
                 mgr.block_tables(dec, rows=bd), mgr.seq_lens(dec, rows=bd), ctx, cu)
        compiled = jax.jit(functools.partial(dcp_step, qlen=qlen), donate_argnums=3).lower(
            *args_).compile()
        y, kv = compiled(*args_)
        y = multihost_utils.process_allgather(y, tiled=True)
        md = None if not dec else jax_mla.build_decode_metadata(
            one_mgr.block_tables(dec, rows=bd), one_mgr.seq_lens(dec, rows=bd),
            page_size=PAGE, qlen=qlen)
        batch = AttentionBatch(
            slot_mapping=one_mgr.slot_mapping(ids, None, all_counts, capacity=cap), decode=md,
            prefill_block_table=one_mgr.block_tables(pre, rows=len(pre)),
            prefill_context_lens=ctx, prefill_cu_seqlens=cu)
        batch, x_one, pos_one, p_one = jax.device_put((batch, x, pos, params), local)
        want, one_kv = jax.jit(one_step, donate_argnums=3)(p_one, x_one, pos_one, one_kv, batch)
        found = collectives(compiled.as_text())
        steps.append({"decode_rows": len(dec) * qlen, "context": ctx.tolist(),
                      "out_rel_err": rel_err(y, np.asarray(want)),
                      "collective_ops": sorted({op for op, _, _ in found}),
                      "biggest_collective_elems": max((c for *_, c in found), default=0)})
    return {"prefill": {"dcp": n, "interleave": interleave, "steps": steps,
                        "rank_cache_elems": pool * PAGE * (L + R),
                        "cache_bytes_distinct": jax_mla.distributed.addressable_nbytes(
                            kv, distinct=True),
                        "cache_bytes_global": int(np.prod(kv.shape)) * kv.dtype.itemsize}}


def run_fault(args) -> dict:
    rng = np.random.default_rng(args.seed)
    tp, interleave, combine = CASES["dcp_1d"]
    run = Run(rng, tp=tp, interleave=interleave, combine=combine)
    run.prefill()
    me = jax.process_index()

    def die_in_step(x, step_id):
        # Runs on every device with its own slice of q, before the step's first collective.
        if me == args.die_rank and int(step_id) == args.die_step:
            print(f"process {me}: exiting abruptly inside step {int(step_id)} at "
                  f"{time.time():.3f}", flush=True)
            os._exit(17)
        return x

    def hook(q, step_id):
        body = lambda x, s: jax.pure_callback(
            die_in_step, jax.ShapeDtypeStruct(x.shape, x.dtype), x, s)
        return jax.shard_map(body, mesh=run.mesh, in_specs=(P(None, "dcp"), P()),
                             out_specs=P(None, "dcp"), check_vma=False)(q, step_id)

    for k in range(args.die_step + 1):
        print(f"process {me}: step {k} starts at {time.time():.3f}", flush=True)
        with jax_mla.distributed.guard(f"step {k}"):
            out, _, _, _ = run.step(rng, 1, hook=hook, step_id=k)
        print(f"process {me}: step {k} done, out[0, 0, 0] = {float(out[0, 0, 0]):.4f}",
              flush=True)
    return {"finished": True}  # a survivor that gets here did not notice the death


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["dcp", "prefill", "fault"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--die-step", type=int, default=1)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    result = {"dcp": run_dcp, "prefill": run_prefill, "fault": run_fault}[args.mode](args)
    result.update(rank=jax.process_index(), num_processes=jax.process_count(),
                  device_count=jax.device_count(), platform=jax.default_backend(),
                  config_source=CFG.source, seconds=time.perf_counter() - t0,
                  memory=jax_mla.distributed.host_memory())
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
