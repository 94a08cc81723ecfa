"""``python -m jax_mla.aot --target gfx942 [--json]``: does every kernel fit the target?

Every Triton kernel variant the ``triton`` backend would launch on a target is compiled with
Triton's own compiler, on this host, with no GPU: decode (``Q = 1``) and verify (``Q = 2..8``)
for 1 to 128 heads in each cache dtype the backend takes there (bf16, fp16, the target's fp8
e4m3 flavour with a scale, fp32), the reduce of their split partials, the planning kernel that
makes their schedule, the kernel that splits a 16-bit query in two e4m3 parts for the Gluon fp8
kernel (Hopper), and the prefill kernel (DeepSeek's 192/128 head dims, causal or not).

What is launched is not re-derived here: each variant's step (metadata, decode, prefill) is
traced with :func:`jax.eval_shape` through the backend's own code, with its ``triton_call``
replaced by a recorder, so the kernels, dtypes, constexprs, warps and stages are exactly the
launches the backend makes. Launches that are the same binary (kernel, signature, constexprs,
warps, stages) compile once; every ``(kernel, num_heads, qlen, dtypes)`` row is reported.

Per binary: shared memory / LDS (Triton's metadata), registers and spills (CUDA: the ``-v``
report of the installed Triton's own cubin step, its ptxas and flags; AMD: the AMDGPU metadata
of the assembly, VGPRs counting AGPRs), and the programs an SM / CU holds at once
(:func:`occupancy`). The exit status is 1 when a row exceeds its target's :data:`LIMITS`
(shared memory, registers) or spills at all. Where a CUDA binary spills, the row also says how
many spill instructions sit in its innermost loops (``loop_spills``, from the SASS): those run
once a KV tile, the others once a work.

These are compiles, not runs: a kernel that fits may still be slow, and nothing here needs (or
touches) a GPU. Needs Triton's real compiler, so ``TRITON_INTERPRET`` must be unset.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib
import json
import math
import multiprocessing
import os
import re
import sys
from unittest import mock

KV_LORA_RANK, ROPE_DIM = 512, 64  # DeepSeek's latent geometry (decode)
PREFILL_DQK, PREFILL_DV = 192, 128  # DeepSeek's prefill head dims
PAGE_SIZE, MAX_PAGES = 64, 64  # the block table of the traced steps (4096 tokens a request)
HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
QLENS = tuple(range(1, 9))
DTYPES = ("bf16", "fp16", "fp8", "fp8q", "fp32")  # fp8: bf16 queries, fp8q: fp8 ones


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one target's hardware allows, and what the occupancy estimate needs.

    ``shared``: bytes of shared memory (CUDA, the opt-in maximum) or LDS (AMD) one block /
    workgroup may use; ``shared_per_core``: per SM / CU; ``registers``: per thread (CUDA) or
    VGPRs including AGPRs per wave (AMD); ``num_cores``: SMs / CUs of the reference part (the
    persistent grid is sized by it); ``fp8``: the target's fp8 e4m3 cache dtype (None: none).
    """

    platform: str
    num_cores: int
    shared: int
    shared_per_core: int
    registers: int
    fp8: str | None


KIB = 1024
LIMITS = {
    # H100 / H200 SXM: CUDA C++ Programming Guide, "Technical Specifications per Compute
    # Capability" (9.0): 227 KiB of shared memory per block (opt-in), 228 KiB per SM, 255
    # registers per thread, 64 K registers, 2048 threads and 32 blocks per SM; 132 SMs.
    "sm_90": Limits("cuda", 132, 227 * KIB, 228 * KIB, 255, "float8_e4m3fn"),
    # MI250X (CDNA2): AMD "Instinct MI200 ISA" guide: 64 KiB of LDS per CU, 512 VGPRs a wave
    # (256 arch + 256 AGPRs), 4 SIMDs a CU; 110 CUs a GCD. No fp8 in CDNA2.
    "gfx90a": Limits("rocm", 110, 64 * KIB, 64 * KIB, 512, None),
    # MI300X (CDNA3): AMD "Instinct MI300 ISA" guide: 64 KiB of LDS per CU, 512 VGPRs a wave
    # (unified arch + AGPR file); 304 CUs. fp8 is the FNUZ flavour (e4m3fnuz).
    "gfx942": Limits("rocm", 304, 64 * KIB, 64 * KIB, 512, "float8_e4m3fnuz"),
    # MI355X (CDNA4): AMD "Instinct MI350 ISA" guide and the CDNA4 white paper: 160 KiB of LDS
    # per CU, 512 VGPRs a wave; 256 CUs. fp8 is OCP e4m3fn.
    "gfx950": Limits("rocm", 256, 160 * KIB, 160 * KIB, 512, "float8_e4m3fn"),
}
# Occupancy model. CUDA (sm_90, the same guide): 65536 registers an SM, allocated per warp in
# units of 256, 2048 threads and 32 blocks an SM, 1 KiB of shared memory reserved per block.
# AMD CDNA: 4 SIMDs a CU, each with 512 VGPRs a lane, allocated in units of 8, and at most 8
# waves a SIMD (AMD's ISA guides, "occupancy").
CUDA_REGS_PER_SM, CUDA_REG_UNIT, CUDA_THREADS, CUDA_BLOCKS = 65536, 256, 2048, 32
CUDA_RESERVED = KIB
AMD_SIMDS, AMD_VGPRS, AMD_VGPR_UNIT, AMD_WAVES_PER_SIMD = 4, 512, 8, 8

# Launch constexprs that make a kernel's tile (reported as its config).
TILE_KEYS = {
    "mla_decode_kernel": ("HB", "NUM_HB", "BLOCK_M", "BLOCK_N", "WG_SPLIT"),
    "mla_decode_sm90_kernel": ("HB", "NUM_HB"),
    "mla_decode_sm90_fp8_kernel": ("HB", "NUM_HB"),
    "mla_reduce_affine_kernel": ("BLOCK_H", "BLOCK_S", "BLOCK_L"),
    "mla_reduce_kernel": ("BLOCK_H", "BLOCK_S", "BLOCK_L"),
    "mla_plan_kernel": ("CB", "CP", "CW"),
    "mla_split_query_e4m3_kernel": ("BLOCK_D", "ROWS_PER_PROGRAM"),
    "prefill_fwd_kernel": ("BLOCK_M", "BLOCK_N"),
}


@dataclasses.dataclass(frozen=True)
class Job:
    """One distinct binary: what makes two launches compile to the same code."""

    kernel: str  # "module:function"
    dtypes: tuple[str, ...]  # the pointer parameters' dtypes, operands then results
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int
    options: tuple[tuple[str, object], ...] = ()  # further compile options (waves_per_eu, ...)


class _Recorder:
    """Stands in for ``launch.triton_call`` (and ``triton_sequence``, kernel by kernel): records
    each launch as a :class:`Job` and returns zeros of the output shapes, so a step traces
    through the backend unchanged."""

    def __init__(self):
        self.jobs: list[Job] = []
        self.programs: list[int] = []  # each launch's grid size, beside ``jobs``

    def __call__(self, kernel, *args, grid, out_shapes, target, launcher=None,
                 input_output_aliases=None, num_warps=4, num_stages=2, compile_options=None,
                 **constexprs):
        import jax.numpy as jnp

        fn = getattr(kernel, "fn", kernel)
        dtypes = tuple(jnp.dtype(a.dtype).name for a in args) + tuple(
            jnp.dtype(s.dtype).name for s in out_shapes)
        self.jobs.append(Job(f"{fn.__module__}:{fn.__name__}", dtypes,
                             tuple(sorted(constexprs.items())), num_warps, num_stages,
                             tuple(sorted((compile_options or {}).items()))))
        self.programs.append(math.prod(grid))
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shapes)

    def sequence(self, steps, arrays, *, out_shapes, target, launcher=None):
        """Stands in for ``launch.triton_sequence``: each step recorded as its own launch."""
        from jax_mla.backends.triton import launch

        return launch.sequence_in_turn(steps, tuple(arrays), tuple(out_shapes), self,
                                       target=target, launcher=launcher)

    @contextlib.contextmanager
    def patched(self):
        from jax_mla.backends.triton import decode, prefill, schedule

        with (mock.patch.object(decode, "triton_call", self),
              mock.patch.object(decode, "triton_sequence", self.sequence),
              mock.patch.object(schedule, "triton_call", self),
              mock.patch.object(prefill, "triton_call", self)):
            yield self


def make_target(name: str):
    """The :class:`~jax_mla.problem.Target` of ``LIMITS[name]``'s reference part."""
    from jax_mla.problem import Target

    lim = LIMITS[name]
    return Target(lim.platform, name, lim.num_cores)


def cache_dtype(target_name: str, dtype: str):
    """The jnp cache dtype for ``bf16``, ``fp16``, ``fp8`` / ``fp8q`` (the target's flavour) or
    ``fp32``."""
    import jax.numpy as jnp

    if dtype in ("fp8", "fp8q"):
        return jnp.dtype(LIMITS[target_name].fp8)
    return jnp.dtype({"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}[dtype])


def _short(dtype) -> str:
    import jax.numpy as jnp

    name = jnp.dtype(dtype).name
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
        name, name.replace("float8_", "fp8"))


def _decode_launches(target, heads: int, qlen: int, dtype, batch: int,
                     fp8_query: bool = False) -> list[tuple[Job, int]]:
    """The launches of one decode/verify step (planning kernel, decode kernel, reduce), each
    with its grid's program count. ``fp8_query``: an fp8 query (with its scale) against the
    fp8 cache, else a bf16 one."""
    import jax
    import jax.numpy as jnp

    import jax_mla
    from jax_mla.backends.triton.plan import TritonTuning
    from jax_mla.cache import is_fp8

    fp8 = is_fp8(dtype)
    q_dtype = (dtype if fp8_query else jnp.bfloat16) if fp8 else dtype
    tuning = dataclasses.replace(TritonTuning.from_env(), launcher="ffi")
    S = jax.ShapeDtypeStruct

    def step(q, cache, block_table, seq_lens):
        md = jax_mla.build_decode_metadata(
            block_table, seq_lens, page_size=PAGE_SIZE, qlen=qlen, num_heads=heads, q=q,
            kv_cache=cache, backend="triton", target=target, tuning=tuning)
        return jax_mla.mla_attention(q, cache, md, scale=0.1, backend="triton",
                                     kv_scale=jnp.float32(0.5) if fp8 else None,
                                     q_scale=jnp.float32(0.25) if fp8_query else None)

    with _Recorder().patched() as rec:
        jax.eval_shape(step, S((batch * qlen, heads, KV_LORA_RANK + ROPE_DIM), q_dtype),
                       S((batch * MAX_PAGES, PAGE_SIZE, KV_LORA_RANK + ROPE_DIM), dtype),
                       S((batch, MAX_PAGES), jnp.int32), S((batch,), jnp.int32))
    return list(zip(rec.jobs, rec.programs))


def _prefill_launches(target, heads: int, dtype, causal: bool) -> list[Job]:
    """The launches of one prefill call (fp8 inputs take the backend's float32 path)."""
    import jax
    import jax.numpy as jnp

    from jax_mla.backends.triton import TritonBackend
    from jax_mla.cache import is_fp8

    t = 256
    S = jax.ShapeDtypeStruct
    scales = dict.fromkeys(("q_scale", "k_scale", "v_scale"),
                           jnp.float32(1.0)) if is_fp8(dtype) else {}

    def call(q, k, v, cu):
        return TritonBackend().prefill(q, k, v, cu, None, scale=PREFILL_DQK ** -0.5,
                                       causal=causal, target=target, max_seqlen=t,
                                       max_seqlen_k=t, **scales)

    with _Recorder().patched() as rec:
        jax.eval_shape(call, S((t, heads, PREFILL_DQK), dtype), S((t, heads, PREFILL_DQK), dtype),
                       S((t, heads, PREFILL_DV), dtype), S((3,), jnp.int32))
    return rec.jobs


def _label(job: Job, qlen) -> str:
    fn = job.kernel.split(":")[1]
    if fn.startswith("mla_decode"):
        return "decode" if qlen == 1 else "verify"
    return {"mla_reduce_affine_kernel": "reduce", "mla_reduce_kernel": "reduce_general",
            "mla_plan_kernel": "plan", "mla_split_query_e4m3_kernel": "split_query",
            "prefill_fwd_kernel": "prefill"}[fn]


def variants(target_name: str, heads=HEADS, qlens=QLENS, dtypes=DTYPES, batch: int = 64
             ) -> list[tuple[dict, Job]]:
    """``(row, job)`` for every launch of every variant on ``target_name`` (rows unfilled).

    ``dtypes``: cache dtypes (``fp8`` is skipped where the target has none); prefill runs in
    each of them too (``fp8``: the float32 path the backend takes) for every head count.
    ``batch``: requests per decode step (it sizes the planning kernel and the reduce's chunk).
    """
    target = make_target(target_name)
    dtypes = [d for d in dtypes if not d.startswith("fp8") or LIMITS[target_name].fp8]
    out = []

    def add(job, heads, qlen, dtypes_label, programs=None):
        fn = job.kernel.split(":")[1]
        consts = dict(job.constexprs)
        config = {k: consts[k] for k in TILE_KEYS[fn] if k in consts}
        config.update(num_warps=job.num_warps, num_stages=job.num_stages)
        row = dict(kernel=_label(job, qlen), function=fn, num_heads=heads, qlen=qlen,
                   dtypes=dtypes_label, config=config)
        if fn.startswith("mla_decode"):  # a persistent grid: all of it resident at once
            row.update(programs=programs, cores=target.num_cores)
        out.append((row, job))

    for name in dtypes:
        kv = cache_dtype(target_name, name)
        label = f"{'bf16' if name == 'fp8' else _short(kv)}/{_short(kv)}"
        for qlen in qlens:
            for h in heads:
                for job, programs in _decode_launches(target, h, qlen, kv, batch,
                                                      name == "fp8q"):
                    add(job, h, qlen, label, programs)
        if name == "fp8q":
            continue  # prefill has no fp8-query form of its own (fp8 rows above)
        for h in heads:
            for causal in (True, False):
                for job in _prefill_launches(target, h, kv, causal):
                    add(job, h, None, f"{_short(kv)}{'' if causal else ' noncausal'}")
    return out


# --- compiling (in worker processes) --------------------------------------------------------

def _amdgcn_stats(asm: str) -> dict:
    """Registers and spills from the AMDGPU metadata of the kernel's assembly."""
    def field(name):
        m = re.search(rf"\.{name}:\s+(\d+)", asm)
        if m is None:
            raise RuntimeError(f"no .{name} in the kernel's AMDGPU metadata")
        return int(m.group(1))

    return dict(registers=field("vgpr_count"), sgprs=field("sgpr_count"),
                spills=field("vgpr_spill_count") + field("sgpr_spill_count"),
                scratch=field("private_segment_fixed_size"))


def compile_job(target_name: str, job: Job) -> dict:
    """Compile ``job`` for ``target_name``: ``{lds, registers, spills, scratch, threads}`` (and
    ``sgprs`` on AMD), or ``{error}`` when Triton refuses it."""
    from jax_mla.backends.triton import compiler, ffi_launch

    module, name = job.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    tt_target = ffi_launch.triton_target(make_target(target_name))
    sig, consts, attrs, _ = ffi_launch.specialization(kernel, job.dtypes, dict(job.constexprs))
    try:
        cc, _ = compiler.compile_for_target(kernel, signature=sig, constexprs=consts,
                                            attrs=attrs, target=tt_target,
                                            num_warps=job.num_warps, num_stages=job.num_stages,
                                            options=dict(job.options))
    except Exception as e:  # noqa: BLE001 - a variant Triton cannot compile is a reported failure
        return dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
    md = cc.metadata
    stats = (compiler.ptxas_stats(cc.asm["ptx"], tt_target) if tt_target.backend == "cuda"
             else _amdgcn_stats(cc.asm["amdgcn"]))
    return dict(lds=int(md.shared), threads=md.num_warps * tt_target.warp_size, **stats)


def occupancy(target_name: str, threads: int, lds: int, registers: int) -> int:
    """Programs of this size an SM (CUDA) or CU (AMD) holds at once, by registers, shared
    memory / LDS and thread slots (the model under :data:`LIMITS`)."""
    lim = LIMITS[target_name]
    if lim.platform == "cuda":
        warps = -(-threads // 32)
        per_warp = -(-max(registers, 1) * 32 // CUDA_REG_UNIT) * CUDA_REG_UNIT
        by_regs = CUDA_REGS_PER_SM // per_warp // warps
        by_shared = lim.shared_per_core // (lds + CUDA_RESERVED)
        return min(by_regs, by_shared, CUDA_THREADS // threads, CUDA_BLOCKS)
    waves = -(-threads // 64)
    per_simd = min(AMD_WAVES_PER_SIMD,
                   AMD_VGPRS // (-(-max(registers, 1) // AMD_VGPR_UNIT) * AMD_VGPR_UNIT))
    by_regs = AMD_SIMDS * per_simd // waves
    by_lds = lim.shared_per_core // lds if lds else math.inf
    return int(min(by_regs, by_lds, AMD_SIMDS * AMD_WAVES_PER_SIMD // waves))


def _worker_init():
    # Triton reads TRITON_INTERPRET once, at import: the workers must never see it.
    os.environ.pop("TRITON_INTERPRET", None)


def compile_all(target_name: str, jobs, processes: int = 2, progress: bool = False) -> dict:
    """``{job: result of compile_job}`` for the distinct ``jobs``, in ``processes`` workers."""
    jobs = list(dict.fromkeys(jobs))
    results = {}
    ctx = multiprocessing.get_context("spawn")  # jax's threads do not survive a fork
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx,
                                                initializer=_worker_init) as pool:
        futures = {pool.submit(compile_job, target_name, j): j for j in jobs}
        done = concurrent.futures.as_completed(futures)
        if progress:
            from tqdm import tqdm

            done = tqdm(done, total=len(jobs), desc=f"compiling for {target_name}",
                        unit="binary", file=sys.stderr)
        for fut in done:
            results[futures[fut]] = fut.result()
    return results


def problems(row: dict, target_name: str) -> list[str]:
    """What in ``row`` exceeds the target's limits (empty: it fits)."""
    lim = LIMITS[target_name]
    if "error" in row:
        return [f"does not compile ({row['error']})"]
    out = []
    if row["lds"] > lim.shared:
        out.append(f"shared memory {row['lds']} > {lim.shared} bytes")
    if row["registers"] > lim.registers:
        out.append(f"registers {row['registers']} > {lim.registers}")
    if row["spills"]:
        where = ("" if row.get("loop_spills") is None else
                 f" ({row['loop_spills']} spill instructions in innermost loops)")
        out.append(f"spills {row['spills']}{where}")
    if "programs" in row and row["programs"] > row["occupancy"] * row["cores"]:
        out.append(f"persistent grid of {row['programs']} programs > {row['occupancy']} "
                   f"resident a core x {row['cores']} cores")
    return out


def check(target_name: str, heads=HEADS, qlens=QLENS, dtypes=DTYPES, batch: int = 64,
          processes: int = 2, progress: bool = False) -> list[dict]:
    """Every row of :func:`variants`, compiled and filled in (``lds``, ``registers``,
    ``spills``, ``scratch``, ``occupancy``, ``problems``; ``binary``: which distinct compile
    the row shares)."""
    pairs = variants(target_name, heads, qlens, dtypes, batch)
    results = compile_all(target_name, [j for _, j in pairs], processes, progress)
    ids = {job: i for i, job in enumerate(results)}
    rows = []
    for row, job in pairs:
        res = results[job]
        row = dict(row, target=target_name, binary=ids[job], **res)
        if "error" not in res:
            row["occupancy"] = occupancy(target_name, res["threads"], res["lds"],
                                         res["registers"])
        row["problems"] = problems(row, target_name)
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    """The compact human table: one line per row, the failures marked."""
    head = ("kernel", "function", "heads", "q", "dtypes", "config", "lds", "regs", "spill",
            "occ", "")
    lines = [head]
    for r in rows:
        cfg = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                       for k, v in r["config"].items())
        lines.append((r["kernel"], r["function"], str(r["num_heads"]), str(r["qlen"] or "-"),
                      r["dtypes"], cfg, str(r.get("lds", "-")), str(r.get("registers", "-")),
                      str(r.get("spills", "-")), str(r.get("occupancy", "-")),
                      "FAIL: " + "; ".join(r["problems"]) if r["problems"] else ""))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in lines)


def summary(rows: list[dict], target_name: str) -> str:
    """One line: rows, distinct binaries, the largest LDS and register counts, spills, fails."""
    ok = [r for r in rows if "error" not in r]
    lim = LIMITS[target_name]
    return (f"{target_name}: {len(rows)} rows ({len({r['binary'] for r in rows})} distinct "
            f"binaries), max shared/LDS "
            f"{max((r['lds'] for r in ok), default=0)} of {lim.shared} bytes, max registers "
            f"{max((r['registers'] for r in ok), default=0)} of {lim.registers}, spills "
            f"{sum(r['spills'] for r in ok)}, {sum(bool(r['problems']) for r in rows)} over "
            "the limits")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jax_mla.aot", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, choices=sorted(LIMITS))
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--heads", type=_ints, default=HEADS, help="head counts (default: 1..128)")
    p.add_argument("--qlen", type=_ints, default=QLENS, help="query tokens (default: 1..8)")
    p.add_argument("--dtypes", type=lambda s: tuple(s.split(",")), default=DTYPES,
                   help=f"cache dtypes, of {','.join(DTYPES)} (default: all)")
    p.add_argument("--batch", type=int, default=64, help="requests per decode step (64)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="compiler processes (default: 2)")
    args = p.parse_args(argv)
    unknown = set(args.dtypes) - set(DTYPES)
    if unknown:
        p.error(f"unknown dtypes {sorted(unknown)}")
    from jax_mla import env

    if env.interpreter_enabled():
        p.error("TRITON_INTERPRET=1 is set: these are compiles with Triton's real compiler")
    if not os.environ.get("TRITON_CACHE_DIR", "unset").strip():
        del os.environ["TRITON_CACHE_DIR"]  # "" (jax-triton's import sets it) fails compiles
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, quietly
    import jax

    jax.config.update("jax_platforms", "cpu")  # tracing only: never initialise a GPU
    rows = check(args.target, args.heads, args.qlen, args.dtypes, args.batch, args.jobs,
                 progress=not args.json and sys.stderr.isatty())
    if args.json:
        print(json.dumps(rows))
    else:
        print(_table(rows))
        print(summary(rows, args.target))
    bad = [r for r in rows if r["problems"]]
    for r in bad:
        print(f"{args.target}: {r['kernel']} {r['num_heads']} heads, qlen {r['qlen']}, "
              f"{r['dtypes']}, config {r['config']}: {'; '.join(r['problems'])}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
