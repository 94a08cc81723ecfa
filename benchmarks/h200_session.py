"""One device session on the H200: GPU correctness, tile sweeps, and the benchmarks, in one call.

Run from the repo root on the GPU machine (see benchmarks/README.md), e.g.
``python benchmarks/h200_session.py tests,tune,prefill_tune``; every stage writes under $OUT and
a failing stage is logged without stopping the others.
"""

import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp/out")
STAGES = sys.argv[1].split(",") if len(sys.argv) > 1 else ["tests", "tune", "bench"]
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _pytest(name, files, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = f"TIMEOUT after {timeout}s\n{e.stdout or ''}", -1
    open(f"{OUT}/pytest_{name}.txt", "w").write(text if isinstance(text, str) else str(text))
    tail = [ln for ln in str(text).strip().splitlines() if ln.strip()][-3:]
    log(f"pytest {name} rc={rc}", " | ".join(tail))


def stage_env():
    import jax

    log("devices", jax.devices(), "jax", jax.__version__)
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,"
                        "power.draw,temperature.gpu", "--format=csv"], capture_output=True,
                       text=True)
    log(r.stdout.strip())


def stage_tests():
    _pytest("conformance", ["tests/test_conformance.py"], 400)


def stage_tests_triton():
    _pytest("conformance_triton", ["tests/test_conformance.py", "-k", "triton"], 300)


def stage_tests_sm90():
    """The conformance cases that run the 64-row tile (the Gluon kernel on Hopper)."""
    _pytest("conformance_64row", ["tests/test_conformance.py", "-k", "64_row"], 240)


def stage_aiter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        r = subprocess.run([sys.executable, "benchmarks/gpu_aiter_bridge.py"], capture_output=True,
                           text=True, timeout=120, env=env)
        text = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        text = f"TIMEOUT\n{e.stdout or ''}"
    open(f"{OUT}/aiter_bridge_log.txt", "w").write(str(text))
    log("aiter bridge:", " | ".join(str(text).strip().splitlines()[-14:]))
    _pytest("aiter", ["tests/test_aiter_bridge.py"], 150)


def stage_tests_reduce():
    _pytest("reduce", ["tests/test_schedule.py", "tests/test_aiter_planner.py", "-k", "reduce"],
            200)


def stage_tests_triton_quick():
    """The Triton conformance cases without the long ragged 64-row ones."""
    _pytest("conformance_triton_quick", ["tests/test_conformance.py", "-k",
                                         "triton and not long_ragged"], 200)


def stage_tests_long_ragged():
    """The long ragged conformance cases (64-row tiles, many splits a request)."""
    _pytest("long_ragged", ["tests/test_conformance.py", "-k", "triton and long_ragged"], 300)


def stage_tests_more():
    _pytest("errors_merge", ["tests/test_errors.py", "tests/test_merge.py"], 200)


def _tune(plan_fn, name):
    import numpy as np

    from jax_mla.bench import decode, timing
    from jax_mla.bench.timing import ceilings

    # The bench's 20 ms timer: at the default 3 ms, the 2026-12-03 sweeps read 18-45 % above the
    # same calls' CUPTI GPU time (560-672 against 473-476 us at B128 H128 S4k).
    timing.MIN_MS = 20.0
    ceil = ceilings()
    log("ceilings", {k: f"{v:.4g}" for k, v in ceil.items()})
    rows = decode.tune(plan_fn(decode), ceil, np.random.default_rng(0))
    json.dump({"ceil": ceil, "rows": rows}, open(f"{OUT}/{name}.json", "w"), indent=1)
    for r in rows:
        log(r["shape"], r["block_n"], r["num_warps"], r["num_stages"], r["ctas_per_sm"],
            r["max_rows"], "wg_split", r.get("wg_split"), "min_block_m", r.get("min_block_m"),
            "sm90", r.get("sm90"),
            f"{r.get('us', float('nan')):.1f}us", f"{r.get('kv_TBps', float('nan')):.2f}TB/s",
            f"{r.get('TFLOPs', float('nan')):.0f}TF", f"err {r.get('rel_err_vs_xla', -1):.1e}",
            r.get("error", ""))


def _decode_plan(d):
    """Tile candidates per shape class: (block_n, num_warps, num_stages, ctas_per_sm[, max_rows]).

    ctas_per_sm is the persistent grid's programs per SM: what the tile's registers and shared
    memory allow (ptxas for sm_90a, triton 3.6; none of these spills). max_rows < Q * H splits the
    heads of a verify block over programs that share each KV tile through L2."""
    s = d.Shape
    h16 = [(32, 4, 3, 2), (16, 4, 4, 3), (16, 4, 3, 3), (32, 8, 3, 2), (32, 4, 2, 2)]
    return [
        (s(64, 16, 8192), h16 + [(64, 8, 3, 1)]),
        (s(32, 16, 4096), h16[:2]),
        (s(128, 16, 32768), h16[:3]),
        (s(64, 16, 4096, page=1), h16[:2]),
        (s(64, 16, 4096, varlen=True), h16[:2]),
        (s(64, 16, 4096, qlen=2), [(16, 4, 3, 2), (32, 8, 3, 1), (32, 4, 3, 2, 16),
                                   (16, 4, 4, 3, 16)]),
        (s(64, 16, 4096, qlen=4), [(16, 8, 3, 1), (16, 8, 4, 1), (32, 8, 3, 1),
                                   (32, 4, 3, 2, 16), (16, 4, 4, 3, 16)]),
        (s(128, 128, 4096), [(16, 8, 3, 1), (16, 8, 4, 1), (32, 8, 3, 1), (32, 4, 3, 2, 16),
                             (16, 4, 3, 2, 32)]),
    ]


def _script(name, args, timeout, tail, **env_extra):
    """Run ``python args...`` with the GPU environment; keep its output as ``{name}_log.txt``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra)
    try:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                           timeout=timeout, env=env)
        text = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        text = f"TIMEOUT\n{e.stdout or ''}"
    open(f"{OUT}/{name}_log.txt", "w").write(str(text))
    log(f"{name}:\n" + "\n".join(str(text).strip().splitlines()[-tail:]))


def _kernel_times(name, *specs, **env_extra):
    _script(name, ["benchmarks/gpu_kernel_times.py", f"{OUT}/{name}.json", *specs], 240, 16,
            **env_extra)


def stage_kernel_times():
    _kernel_times("kernel_times")


def stage_kernel_times_nosplit():
    """CUPTI times with the 64-row tile as Triton lays it out (A/B for triton_ttgir.py)."""
    _kernel_times("kernel_times_nosplit", JAX_MLA_TRITON_WG_SPLIT="0")


def stage_tune():
    _tune(_decode_plan, "tune_decode")


def stage_prefill_tune():
    import jax.numpy as jnp

    from jax_mla.backends.triton_prefill import TUNING_CONFIGS
    from jax_mla.bench import prefill
    from jax_mla.bench.timing import device_time

    shapes = [prefill.uniform(2, 8192, 16), prefill.uniform(2, 8192, 128),
              prefill.uniform(16, 1024, 16)]
    rows = prefill.tune_prefill(device_time, shapes=shapes, configs=TUNING_CONFIGS,
                                dtype=jnp.bfloat16)
    json.dump(rows, open(f"{OUT}/tune_prefill.json", "w"), indent=1, default=float)
    for r in rows:
        log(r["shape"], r["block_m"], r["block_n"], r["num_warps"], r["num_stages"],
            f"{r['us']:.1f}us {r['TFLOPs']:.0f}TF")


def stage_prefill():
    from jax_mla.bench.prefill import main

    main(["--out", f"{OUT}/prefill.json"])


def _mini_plan(d):
    s = d.Shape
    return [(s(128, 128, 4096), [(32, 8, 3, 1), (64, 8, 2, 1), (32, 8, 2, 1)]),
            (s(64, 16, 4096, qlen=4), [(32, 8, 3, 1), (64, 8, 2, 1)]),
            (s(32, 16, 4096), [(32, 4, 3, 2)])]


def stage_mini_tune():
    _tune(_mini_plan, "tune_decode_mini")


def _wg_split_plan(d):
    """The 64-row tile with the score tile split across warpgroups (wg 1) or not (wg 0)."""
    s = d.Shape
    base = [(64, 8, 2, 1, None, 0), (64, 8, 2, 1, None, 1)]
    more = [(32, 8, 3, 1, None, 1), (32, 8, 4, 1, None, 1)]
    return [(s(128, 128, 4096), base + more), (s(128, 128, 8192), base),
            (s(64, 16, 4096, qlen=4), base + more[:1]), (s(64, 16, 4096, qlen=3), base),
            (s(128, 64, 4096), base), (s(128, 128, 4096, page=1), base)]


def _wg16_plan(d):
    """Four warpgroups on the 64-row tile (score columns split four ways, 64 accumulator
    registers a thread; ptxas: 128 registers, 100-200 bytes spilled) against two; and Q=2 at 16
    heads as one padded 64-row tile against the two 16-row blocks of the time."""
    s = d.Shape
    cfgs = [(64, 8, 2, 1, None, 1), (64, 16, 2, 1, None, 1), (32, 16, 3, 1, None, 1)]
    # Q=2 at 16 heads: two 16-row blocks (the default) or one 64-row tile half padding.
    q2 = [(None, None, None, None), (64, 8, 2, 1, None, 1, 64)]
    return [(s(128, 128, 4096), cfgs), (s(64, 16, 4096, qlen=4), cfgs[:2]),
            (s(64, 16, 4096, qlen=2), q2)]


def stage_wg16():
    _tune(_wg16_plan, "tune_wg16")


def _final_ab_plan(d):
    """The defaults against the alternatives: 32-row blocks as one padded 64-row tile (default
    on Hopper) or two 16-row blocks (max_rows 16); Q=4 on 8 or 16 warps."""
    s = d.Shape
    pad_or_two = [(None, None, None, None), (None, None, None, None, 16)]
    return [(s(64, 16, 4096, qlen=2), pad_or_two), (s(128, 32, 4096), pad_or_two),
            (s(64, 16, 4096, qlen=4), [(None, None, None, None), (None, 16, None, None)])]


def stage_final_ab():
    _tune(_final_ab_plan, "tune_final_ab")


def stage_sm90_smoke():
    """The Gluon sm_90 kernel on a few small shapes against XLA (out and LSE), tracebacks kept."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_mla
    from jax_mla.bench.decode import DEEPSEEK_SCALE, Shape, make_inputs

    rng = np.random.default_rng(1)
    for shape in [Shape(3, 128, 700), Shape(4, 16, 1000, qlen=4, page=1),
                  Shape(5, 16, 900, qlen=2, page=16), Shape(2, 64, 3000, varlen=True),
                  Shape(3, 32, 333)]:
        try:
            q, cache, table, lens = make_inputs(shape, rng)
            res = {}
            for be in ("xla", "triton"):
                md = jax_mla.build_decode_metadata(table, lens, page_size=shape.page,
                                                   qlen=shape.qlen, num_heads=shape.heads,
                                                   backend=be)
                o, lse = jax.jit(lambda q, c, m, be=be: jax_mla.mla_attention(
                    q, c, m, scale=DEEPSEEK_SCALE, backend=be, return_lse=True))(q, cache, md)
                res[be] = (np.asarray(o.astype(jnp.float32)), np.asarray(lse))
            (o0, l0), (o1, l1) = res["xla"], res["triton"]
            err = np.linalg.norm(o1 - o0) / np.linalg.norm(o0)
            fin = np.isfinite(l0)
            lerr = float(np.max(np.abs(l1[fin] - l0[fin]))) if fin.any() else 0.0
            log("sm90 smoke", shape.name, f"rel err {err:.2e}", f"lse max abs {lerr:.2e}",
                "inf rows match", bool(np.array_equal(np.isfinite(l1), fin)),
                "nan", bool(np.isnan(o1).any()))
        except Exception:  # noqa: BLE001
            import traceback

            log("sm90 smoke FAILED", shape.name, traceback.format_exc()[-3000:])


def _sm90_plan(d):
    """The Gluon sm_90 kernel (sm90 1, the default) against the Triton 64-row tile (sm90 0); the
    last row (16 heads, Q=1: a 16-row tile either way) is a control for drift within the run."""
    s = d.Shape
    ab = [(None,) * 7 + (1,), (None,) * 7 + (0,)]
    return [(s(128, 128, 4096), ab), (s(128, 128, 8192), ab), (s(8, 128, 32768), ab),
            (s(128, 128, 4096, page=1), ab), (s(128, 64, 4096), ab), (s(128, 32, 4096), ab),
            (s(64, 16, 4096, qlen=2), ab), (s(64, 16, 4096, qlen=3), ab),
            (s(64, 16, 4096, qlen=4), ab), (s(64, 16, 4096), ab[:1])]


def _tune16_plan(d):
    """16 heads, Q=1: the 16-row tile at 2 programs per SM (the default) against 1 per SM with
    64-token tiles (132 programs: at B=128, equal lengths, the plan splits no request)."""
    s = d.Shape
    ab = [(32, 4, 3, 2), (64, 4, 3, 1)]
    return [(s(128, 16, 4096), ab), (s(128, 16, 8192), ab), (s(128, 16, 32768), ab),
            (s(128, 16, 4096, varlen=True), ab), (s(128, 16, 4096, page=1), ab),
            (s(256, 16, 4096), ab), (s(64, 16, 4096), ab)]


def stage_tune16():
    _tune(_tune16_plan, "tune16")


def stage_l2_ab():
    """CUPTI times with split partials kept in L2 (evict_last stores, evict_first reads; the
    default) and without the hints (JAX_MLA_TRITON_L2_HINTS=0)."""
    _kernel_times("kernel_times")
    _kernel_times("kernel_times_no_l2_hints", JAX_MLA_TRITON_L2_HINTS="0")


def stage_gaps():
    """The bench chain's kernels and the idle gaps between them (CUPTI)."""
    _script("gaps", ["benchmarks/gpu_gaps.py", f"{OUT}/gaps.json", "32,16,4096", "64,16,4096",
                     "64,16,4096,4", "128,16,4096", "64,16,8192"], 300, 8)


def stage_affine_ab():
    """CUPTI times with the reduce that reads a plan's consecutive partials directly (the
    default) and with the general one (AITER's maps; JAX_MLA_TRITON_AFFINE_REDUCE=0)."""
    _kernel_times("kernel_times")
    _kernel_times("kernel_times_general_reduce", JAX_MLA_TRITON_AFFINE_REDUCE="0")


def stage_affine_ab_small():
    """The same A/B where requests split more than 8 ways (chunks capped at 8)."""
    specs = ["1,16,1024", "8,16,8192", "16,16,8192", "32,16,4096", "2,128,8192",
             "8,128,32768", "1,128,1024"]
    _kernel_times("kernel_times_cap8", *specs)
    _kernel_times("kernel_times_cap8_general", *specs, JAX_MLA_TRITON_AFFINE_REDUCE="0")


def _ab(name, variants, specs, rounds=2, timeout=330):
    _script(name, ["benchmarks/gpu_ab.py", f"{OUT}/{name}.json", *variants, "--rounds",
                   str(rounds), "--", *specs], timeout, 40)


def stage_plan_ab():
    """The even-pieces split plan (the default) against the line plan, by the bench's timer."""
    _ab("plan_ab", ["auto", "line:JAX_MLA_SPLIT_PLAN=line"],
        ["64,16,4096,4", "64,16,4096,3", "64,16,4096,2", "64,16,4096", "32,16,4096",
         "128,16,4096", "32,16,8192", "64,16,8192", "8,128,32768"])


def stage_plan_block_s():
    """Reduce chunks sized to the even plan's pieces (2 or 4 a request) against the rule's."""
    _ab("plan_block_s", ["auto", "bs2:JAX_MLA_TRITON_REDUCE_BLOCK_S=2",
                         "bs4:JAX_MLA_TRITON_REDUCE_BLOCK_S=4"],
        ["64,16,4096,4", "128,16,4096", "64,16,4096"], timeout=200)


def stage_plan_kernel_times():
    """CUPTI times of both kernels under each plan."""
    specs = ["64,16,4096,4", "64,16,4096", "32,16,4096", "128,16,4096", "8,128,32768"]
    _kernel_times("kernel_times_even", *specs)
    _kernel_times("kernel_times_line", *specs, JAX_MLA_SPLIT_PLAN="line")


def stage_sm90():
    _tune(_sm90_plan, "tune_sm90")


def stage_wg_split():
    _tune(_wg_split_plan, "tune_wg_split")


_GRAPH_SHAPES = ["32,16,4096", "64,16,4096", "64,16,4096,4", "128,16,4096", "1,16,1024",
                 "128,128,4096"]
# XLA captures a legacy custom call in a CUDA graph only if its target is listed; jax-triton's
# calls are legacy ``triton_kernel_call``s. jax 0.11.2's XLA no longer knows the listing flag
# (the last variant stops at startup: benchmarks/results/2026-12-04-h200-head/graphs/).
_GRAPH_VARIANTS = {
    "default": "",
    "custom_call": "--xla_gpu_enable_command_buffer=+CUSTOM_CALL",
    "triton_graphs": "--xla_gpu_enable_command_buffer=+CUSTOM_CALL "
                     "--legacy_command_buffer_custom_call_targets=triton_kernel_call",
}


def stage_graphs_ab():
    """The bench's chain with and without the Triton calls captured in CUDA graphs, one process
    per XLA_FLAGS setting (benchmarks/gpu_graphs.py)."""
    for name, flags in _GRAPH_VARIANTS.items():
        _script(f"graphs_{name}", ["benchmarks/gpu_graphs.py", f"{OUT}/graphs_{name}.json",
                                   *_GRAPH_SHAPES], 180, 8,
                XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())


def stage_dcp():
    from jax_mla.bench.dcp_split import main

    main(["--out", f"{OUT}/dcp"])


def stage_bench():
    from jax_mla.bench.__main__ import main

    main(["--out", f"{OUT}/bench", "--plot"] + sys.argv[2:])  # writes after every shape


for st in STAGES:
    log("stage", st)
    try:
        globals()[f"stage_{st}"]()
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        log("stage failed", st, repr(e)[:500])
log("done")
