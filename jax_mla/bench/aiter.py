"""The AITER bridge on a real GPU, with the torch stand-in of AITER in place of AITER.

Run from a checkout of the repository (it imports the stand-in from ``tests/aiter_standin``)
on an NVIDIA GPU (CUDA jax + CUDA torch), or on a CPU:

    python -m jax_mla.bench.aiter

(a) Contract checks: every bridge route (asm decode persistent / not / fp8 / DCP-LSE, Gluon
    decode and verify, segmented DCP verify, flash-attn varlen prefill, fp8 PS prefill) runs
    through ``backend="aiter"`` inside ``jax.jit``; ``buffer_callback`` hands XLA's CUDA buffers
    to ``torch.from_dlpack`` and the stand-in's torch CUDA math runs on XLA's stream. Each result
    is compared with the xla backend (and a float64 oracle). One ``PASS``/``FAIL`` line per check;
    a failure prints its traceback and the script goes on.
(b) Host overhead: median microseconds per jitted call (dispatch + run + block) of a plain
    jitted op, a no-op bridge round trip, and a small decode through the bridge next to the same
    stand-in call made directly in torch (their difference is the bridge's cost per call).

Writes ``$OUT/aiter_bridge.json`` (``$OUT`` defaults to a folder under the temp directory).
Nothing here is AMD hardware: it proves the stream/DLPack plumbing, not AITER's kernels.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # torch allocates beside XLA

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (os.path.join(_ROOT, "tests", "aiter_standin"), os.path.join(_ROOT, "tests"), _ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

T_START = time.perf_counter()
BUDGET_S = 50.0
PS = 8
RESULTS: dict = {"checks": {}, "overhead_us": {}, "notes": [
    "bridge_noop - plain_jit_op is the buffer_callback + torch.from_dlpack round trip per call",
    "decode_* include the stand-in's Python reference math (not AITER's kernels); "
    "decode_bridge_cost = decode_via_bridge - decode_standin_direct_torch is noisy",
]}


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (den if den > 0 else 1.0))


def make_case(rng, lens, qlen, heads, d=576):
    """A paged cache with a permuted block table; unused slots hold NaN."""
    lens = np.asarray(lens, np.int32)
    need = [-(-int(n) // PS) for n in lens]
    max_pages = max(need + [1]) + 1
    num_phys = sum(need) + 2
    cache = np.full((num_phys, PS, d), np.nan, np.float32)
    perm = rng.permutation(num_phys)
    table = np.full((len(lens), max_pages), perm[-1], np.int32)
    k = 0
    for i, n in enumerate(lens):
        pages = perm[k:k + need[i]]
        k += need[i]
        table[i, :need[i]] = pages
        for j, page in enumerate(pages):
            rows = min(PS, int(n) - j * PS)
            cache[page, :rows] = rng.standard_normal((rows, d))
    q = rng.standard_normal((len(lens) * qlen, heads, d)).astype(np.float32)
    return q, cache, table, lens


def check(name):
    def deco(fn):
        def run():
            if time.perf_counter() - T_START > BUDGET_S:
                print(f"SKIP {name}: time budget spent", flush=True)
                RESULTS["checks"][name] = "skipped"
                return
            t0 = time.perf_counter()
            try:
                detail = fn()
                print(f"PASS {name} ({time.perf_counter() - t0:.1f}s) {detail or ''}", flush=True)
                RESULTS["checks"][name] = "pass"
            except Exception:
                print(f"FAIL {name}", flush=True)
                traceback.print_exc()
                RESULTS["checks"][name] = "fail"
        return run
    return deco


# ---------------------------------------------------------------------------------------------


def decode_checks():
    import jax_mla
    from jax_mla.backends.aiter import build_aiter_decode_metadata
    from jax_mla.backends.aiter import capabilities as caps

    import oracle
    from aiter_standin.harness import standin

    routes = [
        # (name, arch, kv dtype, gathered heads, dcp N, qlen, K, lens, route kind)
        ("asm-persistent", "gfx950", "bf16", 16, 1, 1, 1, [300, 0, 20, 5], "asm"),
        ("asm-persistent-fold-qlen2", "gfx942", "bf16", 32, 1, 2, 2, [150, 40, 3], "asm"),
        ("asm-nonpersistent-zero-fill", "gfx942", "bf16", 12, 1, 8, 8, [40, 9], "asm"),
        ("asm-fp8-fnuz", "gfx942", "fp8", 12, 1, 1, 1, [100, 7, 33], "asm"),
        ("asm-dcp-lse", "gfx950", "bf16", 12, 2, 1, 1, [90, 0, 31], "asm"),
        ("gluon-decode", "gfx950", "bf16", 8, 1, 1, 1, [60, 1, 17], "gluon_decode"),
        ("gluon-verify", "gfx950", "bf16", 12, 1, 3, 3, [45, 2, 20], "gluon_verify"),
    ]
    fns = []
    for name, arch, dt, heads, n, qlen, k, lens, kind in routes:
        def fn(arch=arch, dt=dt, heads=heads, n=n, qlen=qlen, k=k, lens=lens, kind=kind):
            rng = np.random.default_rng(0)
            qn, cn, table, lens_ = make_case(rng, lens, qlen, heads)
            scales = {}
            if dt == "fp8":
                f8 = caps.fp8_dtype(arch)
                q, cache = jnp.asarray(qn, f8), jnp.asarray(cn, f8)
                scales = dict(q_scale=jnp.float32(0.5), kv_scale=jnp.float32(1.5))
            else:
                q, cache = jnp.asarray(qn, jnp.bfloat16), jnp.asarray(cn, jnp.bfloat16)
            with standin(arch=arch, cu_num=8) as aiter:
                md = build_aiter_decode_metadata(table, lens_, page_size=PS, num_heads=heads,
                                                 qlen=qlen, kv_dtype=cache.dtype, arch=arch,
                                                 num_cu=8, mtp_decode_qlen=k, dcp_world_size=n)
                assert md.plan.route.kind == kind, md.plan.route
                q_before = np.asarray(jax.device_get(q)).copy()
                lse_on = n > 1
                res = jax_mla.mla_attention(q, cache, md, scale=192 ** -0.5, backend="aiter",
                                            return_lse=lse_on, **scales)
                ncalls = len(aiter.calls())
            np.testing.assert_array_equal(np.asarray(jax.device_get(q)), q_before)
            views = md.replace(plan=None, schedule=None)
            ref = jax_mla.mla_attention(q, cache, views, scale=192 ** -0.5, backend="xla",
                                        return_lse=lse_on, **scales)
            out, ref_out = (res[0], ref[0]) if lse_on else (res, ref)
            err = _rel(_f32(out), _f32(ref_out))
            want, _ = oracle.mla_decode(_f32(q), _f32(cache), table, lens_, qlen=qlen,
                                        page_size=PS, scale=192 ** -0.5, kv_lora_rank=512,
                                        q_scale=0.5 if dt == "fp8" else 1.0,
                                        kv_scale=1.5 if dt == "fp8" else 1.0)
            err_o = _rel(_f32(out), want)
            assert ncalls >= 1, "the stand-in was never called"
            assert err < 1e-2 and err_o < 1e-2, (err, err_o)
            if lse_on:
                fin = np.isfinite(np.asarray(ref[1]))
                np.testing.assert_allclose(np.asarray(res[1])[fin], np.asarray(ref[1])[fin],
                                           atol=2e-3, rtol=1e-3)
            return f"rel_err vs xla {err:.1e}, vs oracle {err_o:.1e}"

        fns.append(check(f"decode/{name}")(fn))
    return fns


@check("decode/segmented-dcp-verify")
def segmented_check():
    import jax_mla
    from jax_mla.backends.aiter import build_aiter_decode_metadata, triton_kernels
    from jax_mla.dcp import dcp_local_seq_lens

    import oracle
    from aiter_standin.harness import standin

    rng = np.random.default_rng(1)
    n, rank, qlen, heads = 2, 1, 3, 32
    tot = np.array([41, 3, 18], np.int32)
    local = np.asarray(dcp_local_seq_lens(jnp.asarray(tot), n, rank)).astype(np.int32)
    qn, cn, table, _ = make_case(rng, local, qlen, heads)
    q, cache = jnp.asarray(qn, jnp.bfloat16), jnp.asarray(cn, jnp.bfloat16)
    with standin(arch="gfx950", cu_num=8):
        md = build_aiter_decode_metadata(table, local, page_size=PS, num_heads=heads, qlen=qlen,
                                         arch="gfx950", num_cu=8, dcp_world_size=n,
                                         dcp_rank=rank, dcp_tot_seq_lens=jnp.asarray(tot))
        # The bridge (this checks it): by default the route launches AITER's Triton kernel
        # through jax_mla's launcher (backends/aiter/triton_kernels.py).
        with triton_kernels.use_bridge():
            out, lse = jax_mla.mla_attention(q, cache, md, scale=192 ** -0.5, backend="aiter",
                                             return_lse=True)
    row_lens = np.asarray(md.schedule.dcp_verify.row_lens)
    want, want_lse = oracle.mla_decode(_f32(q), _f32(cache), np.repeat(table, qlen, 0),
                                       row_lens, qlen=1, page_size=PS, scale=192 ** -0.5,
                                       kv_lora_rank=512)
    err = _rel(_f32(out), want)
    assert err < 1e-2, err
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=2e-3, rtol=1e-3)
    return f"rel_err vs oracle {err:.1e}"


@check("prefill/flash-attn-varlen")
def fa_check():
    import jax_mla

    from aiter_standin.harness import standin

    rng = np.random.default_rng(2)
    cu = np.array([0, 13, 13, 43], np.int32)
    t = 45
    q, k = (jnp.asarray(rng.standard_normal((t, 4, 192)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((t, 4, 128)), jnp.bfloat16)
    with standin(arch="gfx950", cu_num=8):
        out, lse = jax_mla.mla_prefill(q, k, v, jnp.asarray(cu), scale=192 ** -0.5,
                                       return_lse=True, backend="aiter")
    ref, ref_lse = jax_mla.mla_prefill(q, k, v, jnp.asarray(cu), scale=192 ** -0.5,
                                       return_lse=True, backend="xla")
    err = _rel(_f32(out), _f32(ref))
    assert err < 1e-2, err
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=2e-3)
    return f"rel_err vs xla {err:.1e}"


@check("prefill/fp8-ps+reduce")
def ps_check():
    import jax_mla
    from jax_mla.backends.aiter import AiterBackend
    from jax_mla.backends.aiter import capabilities as caps

    from aiter_standin.harness import standin

    rng = np.random.default_rng(3)
    cu = np.array([0, 300, 305, 345], np.int32)
    t, h = 347, 12
    q, k = (jnp.asarray(rng.standard_normal((t, h, 192)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((t, h, 128)), jnp.bfloat16)
    from jax_mla.backends.aiter import AiterPrefillConfig
    from jax_mla.problem import detect_target

    be = AiterBackend()
    cfg = AiterPrefillConfig(kv_cache_fp8=True, arch="gfx950")
    f = jax.jit(lambda q, k, v, cu: be.prefill(
        q, k, v, cu, None, scale=192 ** -0.5, causal=True, target=detect_target(),
        max_seqlen=300, max_seqlen_k=300, config=cfg, return_lse=False)[0])
    with standin(arch="gfx950", cu_num=4) as aiter:
        out = f(q, k, v, jnp.asarray(cu))
        assert aiter.calls("mla_prefill_ps_asm_fwd"), "the PS path was not taken"
    f8 = caps.fp8_dtype("gfx950")
    q8, k8, v8 = (x.astype(f8).astype(jnp.bfloat16) for x in (q, k, v))
    ref = jax_mla.mla_prefill(q8, k8, v8, jnp.asarray(cu), scale=192 ** -0.5, backend="xla")
    err = _rel(_f32(out), _f32(ref))
    assert err < 1e-2, err
    return f"rel_err vs xla on fp8-rounded inputs {err:.1e}"


# ---------------------------------------------------------------------------------------------


def _median_us(fn, *args, n=200, warm=10):
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


@check("overhead/measure")
def overhead():
    import torch

    import jax_mla
    from jax_mla.backends.aiter import bridge, build_aiter_decode_metadata, force_bridge

    from aiter_standin.harness import standin

    oh = RESULTS["overhead_us"]
    x = jnp.ones((1024,), jnp.float32)
    oh["plain_jit_op"] = _median_us(jax.jit(lambda a: a + 1.0), x)
    oh["bridge_noop"] = _median_us(jax.jit(bridge.noop_call), x)

    # A small decode: B=4, 16 heads, 256 tokens each, persistent asm (the stand-in runs each work
    # of the plan as a torch attention), through the bridge and directly in torch.
    rng = np.random.default_rng(4)
    qn, cn, table, lens_ = make_case(rng, [256] * 4, 1, 16)
    q, cache = jnp.asarray(qn, jnp.bfloat16), jnp.asarray(cn, jnp.bfloat16)
    with standin(arch="gfx950", cu_num=8) as aiter, force_bridge():
        md = build_aiter_decode_metadata(table, lens_, page_size=PS, num_heads=16,
                                         arch="gfx950", num_cu=8)
        f = jax.jit(lambda q, c, m: jax_mla.mla_attention(q, c, m, scale=0.1, backend="aiter"))
        oh["decode_via_bridge"] = _median_us(f, q, cache, md, n=50, warm=3)
        oh["decode_plain_xla"] = _median_us(
            jax.jit(lambda q, c, m: jax_mla.mla_attention(q, c, m, scale=0.1, backend="xla")),
            q, cache, md.replace(plan=None, schedule=None), n=50, warm=3)
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

        def tt(a):
            return torch.from_dlpack(jax.block_until_ready(a)).to(dev)

        tq, tkv = tt(q), tt(cache).view(-1, 1, 1, 576)
        to = torch.empty((4, 16, 512), dtype=torch.bfloat16, device=dev)
        args = [tt(a) for a in (md.qo_indptr, md.paged_kv_indptr, md.paged_kv_indices,
                                md.paged_kv_last_page_len)]
        plan = md.schedule.plan
        wi, wis, ri, rf, rp = (tt(a) for a in (plan.work_indptr, plan.work_info_set,
                                               plan.reduce_indptr, plan.reduce_final_map,
                                               plan.reduce_partial_map))
        meta = torch.tensor([wi.data_ptr(), wis.data_ptr()], dtype=torch.uint64, device=dev)
        one = torch.ones((), dtype=torch.float32, device=dev)

        def direct():
            aiter.mla.mla_decode_fwd(tq, tkv, to, *args, 1, sm_scale=0.1, q_scale=one,
                                     kv_scale=one, work_meta_data=meta, work_indptr=wi,
                                     work_info_set=wis, reduce_indptr=ri, reduce_final_map=rf,
                                     reduce_partial_map=rp)
            if dev.type == "cuda":
                torch.cuda.synchronize()

        for _ in range(3):
            direct()
        ts = []
        for _ in range(50):
            t0 = time.perf_counter()
            direct()
            ts.append(time.perf_counter() - t0)
        oh["decode_standin_direct_torch"] = statistics.median(ts) * 1e6
    oh["decode_bridge_cost"] = oh["decode_via_bridge"] - oh["decode_standin_direct_torch"]
    return ", ".join(f"{k} {v:.0f}us" for k, v in oh.items())


def main():
    from jax_mla.backends.aiter import force_bridge
    from jax_mla.problem import current_platform

    platform = current_platform()
    RESULTS.update(platform=platform, jax=jax.__version__, devices=[str(d) for d in
                                                                   jax.devices()])
    try:
        import torch

        RESULTS["torch"] = torch.__version__
        RESULTS["torch_cuda"] = bool(torch.cuda.is_available())
    except Exception:
        traceback.print_exc()
    print(f"platform {platform}, jax {jax.__version__}, torch {RESULTS.get('torch')}",
          flush=True)
    with force_bridge((platform,)):
        for fn in decode_checks() + [segmented_check, fa_check, ps_check]:
            fn()
    overhead()
    RESULTS["wall_s"] = time.perf_counter() - T_START
    n_fail = sum(v == "fail" for v in RESULTS["checks"].values())
    RESULTS["summary"] = f"{len(RESULTS['checks']) - n_fail}/{len(RESULTS['checks'])} pass"
    out_dir = os.environ.get("OUT", os.path.join(tempfile.gettempdir(), "jax_mla_bench"))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "aiter_bridge.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)
    print(f"{RESULTS['summary']}; wrote {path} in {RESULTS['wall_s']:.1f}s", flush=True)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
