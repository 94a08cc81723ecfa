"""``python -m jax_mla.aot``: every Triton kernel the backend launches on a target, compiled with
Triton's real compiler on this host (no GPU), fits the target's shared memory / LDS and
registers with no spills (docs/aot.md).

The CLI runs in a subprocess without TRITON_INTERPRET (this process runs Triton's interpreter,
which triton reads once). The AMD targets are checked on a subset of the full sweep (1, 16 and
128 heads; Q = 1 and 8; every cache dtype but gfx942's float32; prefill), sm_90 kernel by
kernel (16-bit 16-row tiles, the Gluon kernels, fp8 rows at 16 and 128 heads, the one-head
reduce, float32 decode and prefill). That keeps the file to a few minutes on two cores;
docs/aot.md has the full sweep's figures.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import has_triton_cuda_backend

KEYS = {"kernel", "num_heads", "qlen", "dtypes", "lds", "registers", "spills", "occupancy",
        "config"}
SUBSET = ("--heads", "1,16,128", "--qlen", "1,8")
HAS_AMD = (importlib.util.find_spec("triton") is not None
           and importlib.util.find_spec("triton.backends.amd") is not None)
needs_amd = pytest.mark.skipif(not HAS_AMD, reason="triton without its AMD backend")
needs_cuda = pytest.mark.skipif(not has_triton_cuda_backend(),
                                reason="triton without its NVIDIA backend")


def run_aot(*args, extra_env=None, timeout=900) -> subprocess.CompletedProcess:
    """``python -m jax_mla.aot *args`` with TRITON_INTERPRET and the tile knobs unset."""
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith(("JAX_MLA_TRITON_", "JAX_MLA_SPLIT"))}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if not env.get("TRITON_CACHE_DIR"):  # "" (jax-triton's import sets it) fails every compile
        env.pop("TRITON_CACHE_DIR", None)
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "jax_mla.aot", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def check_fits(target: str, *args, kernels=None):
    """Every row fits (``kernels``: only the rows of these kernels are checked, the others may
    fail)."""
    from jax_mla.aot import LIMITS

    res = run_aot("--target", target, "--json", *args)
    if kernels is None:
        assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    if kernels is not None:
        rows = [r for r in rows if r["kernel"] in kernels]
        assert rows, kernels
    limit = LIMITS[target]
    for row in rows:
        assert KEYS <= set(row), row
        assert row["lds"] <= limit.shared and row["spills"] == 0, row
        assert row["registers"] <= limit.registers and row["occupancy"] >= 1, row
        assert not row["problems"], row  # a persistent decode grid all resident, among others
    return rows


def assert_covers(rows, dtypes):
    decode = [r for r in rows if r["kernel"] in ("decode", "verify")]
    assert {r["num_heads"] for r in decode} >= {1, 128}
    assert {r["qlen"] for r in decode} >= {1, 8}
    assert {r["dtypes"].split("/")[1] for r in decode} == set(dtypes)
    kernels = {r["kernel"] for r in rows}
    assert {"decode", "verify", "reduce", "plan", "prefill"} <= kernels, kernels
    # One row per launch of every variant, compiled once per distinct binary.
    assert len({r["binary"] for r in rows}) < len(rows)


@needs_amd
@pytest.mark.parametrize("target,dtypes,caches", [
    ("gfx942", "bf16,fp16,fp8,fp32", {"bf16", "fp16", "fp8e4m3fnuz", "fp32"}),
    ("gfx950", "bf16,fp16,fp8,fp32", {"bf16", "fp16", "fp8e4m3fn", "fp32"})])
def test_rocm_kernels_fit(target, dtypes, caches):
    """gfx942: every variant within 64 KiB of LDS; gfx950 within 160 KiB; no spills on either
    (gfx942's float32 cache: the next test)."""
    assert_covers(check_fits(target, *SUBSET, "--dtypes", dtypes), caches)


@needs_amd
def test_gfx942_fp32_fits():
    """A float32 cache on gfx942: the 16-row tile at two stages fits 64 KiB with no spills once
    Triton's in-thread transpose pass is off for it (``compiler.py``; with the pass it spilled
    2-8 VGPRs, and no other tile fitted)."""
    check_fits("gfx942", "--heads", "1", "--qlen", "1", "--dtypes", "fp32")


@needs_cuda
def test_sm90_kernels_fit():
    """The variants the CUDA tiles serve without spilling under triton 3.9's ptxas: bf16 / fp16
    at 16 rows (the H200-tuned tiles), prefill, planning and reduce kernels; the one-head reduce
    at Q = 4 and 5 (twice the columns: the narrow tiles spilled 8 bytes)."""
    rows = check_fits("sm_90", "--heads", "1,16", "--qlen", "1", "--dtypes", "bf16,fp16")
    assert {r["kernel"] for r in rows} == {"decode", "reduce", "plan", "prefill"}
    rows = check_fits("sm_90", "--heads", "1", "--qlen", "4,5", "--dtypes", "bf16")
    assert {r["config"]["BLOCK_L"] for r in rows if r["kernel"] == "reduce"} == {64}


@needs_cuda
def test_sm90_fp32_decode_fits():
    """A float32 cache on sm_90: 16-row programs, 16-token KV tiles at two stages (73 KiB; the
    64-row tile took 304 KiB, more than a block may have), no spills; its reduce and planning
    kernels too (its prefill: the next test)."""
    rows = check_fits("sm_90", "--heads", "1,128", "--qlen", "1,8", "--dtypes", "fp32",
                      kernels={"decode", "verify", "reduce", "plan"})
    decode = [r for r in rows if r["kernel"] in ("decode", "verify")]
    assert {(r["config"]["BLOCK_M"], r["config"]["BLOCK_N"], r["config"]["num_stages"])
            for r in decode} == {(16, 16, 2)}
    assert max(r["programs"] for r in decode) <= 2 * 132  # the tile's two programs an SM
    assert min(r["occupancy"] for r in decode) >= 2


@needs_cuda
def test_sm90_fp32_prefill_fits():
    """Prefill's float32 tile (fp8 inputs take it too) at 8 warps on CUDA: 79-80 registers, no
    spills (at 4 warps it spilled ~1,450 bytes)."""
    check_fits("sm_90", "--heads", "1", "--qlen", "1", "--dtypes", "fp32")


@needs_cuda
def test_sm90_gluon_kernel_fits():
    """The Gluon two-warpgroup kernel (64-row bf16 / fp16 tiles): its worker partition keeps all
    256 registers (``WORKER_REGS``; at 232 it spilled 16-248 bytes under triton 3.9's ptxas,
    most at head blocks that are not a power of two, HB = 21 at Q = 3)."""
    rows = check_fits("sm_90", "--heads", "32,128", "--qlen", "1,3,4", "--dtypes", "bf16,fp16")
    gluon = [r for r in rows if r["function"] == "mla_decode_sm90_kernel"]
    assert len(gluon) == 12 and {r["config"]["HB"] for r in gluon} >= {21, 64}, gluon


def _split_q_default() -> bool:
    from jax_mla.backends.triton.plan import SPLIT_Q_TRITON, triton_release

    return triton_release() in SPLIT_Q_TRITON


@needs_cuda
def test_sm90_fp8_16_row_tile_fits():
    """An fp8 cache at 16 rows or fewer (1-16 heads at Q = 1, verify at few heads): with a bf16
    query, the Gluon fp8 kernel's 64-row programs, the query split in two e4m3 parts, where this
    Triton compiles them without spills (``plan.SPLIT_Q_TRITON``), else 16-token KV tiles at
    four stages (``plan.CUDA_FP8_TILE``) that convert to bf16 without spilling; an fp8 query
    (``fp8q``) takes the Gluon fp8 kernel's 64-row programs, which fit too."""
    rows = check_fits("sm_90", "--heads", "1,4,16", "--qlen", "1", "--dtypes", "fp8,fp8q",
                      kernels={"decode", "reduce", "plan"})
    rows += check_fits("sm_90", "--heads", "1,4", "--qlen", "3,4", "--dtypes", "fp8,fp8q",
                       kernels={"verify", "reduce", "plan"})
    # bf16 queries, and fp8 ones multiplied as they are (FP8_QK)
    assert {r["dtypes"].split("/")[0] for r in rows if r["kernel"] == "decode"} == {
        "bf16", "fp8e4m3fn"}
    kernels = [r for r in rows if r["kernel"] in ("decode", "verify")]
    bf16 = [r for r in kernels if r["dtypes"].startswith("bf16")]
    if _split_q_default():
        assert {r["function"] for r in bf16} == {"mla_decode_sm90_fp8_kernel"}, bf16
    else:
        tiles = {(r["config"]["BLOCK_M"], r["config"]["BLOCK_N"], r["config"]["num_stages"])
                 for r in bf16}
        assert tiles == {(16, 16, 4)}, tiles
    assert {r["function"] for r in kernels if r["dtypes"].startswith("fp8")} == {
        "mla_decode_sm90_fp8_kernel"}, kernels


_CVT_SCRIPT = """
import importlib, json, re
from jax_mla import aot
from jax_mla.backends.triton import TritonTuning, compiler, ffi_launch
from jax_mla.backends.triton import plan as plan_mod
out = {}
for once in (True, False):
    plan_mod.TritonTuning.from_env = classmethod(  # the Triton tile: no split-query kernel
        lambda cls, once=once: TritonTuning(fp8_convert_once=once, sm90_split_q=False))
    [(row, job)] = [rj for rj in aot.variants("sm_90", (16,), (1,), ("fp8",), 8)
                    if rj[0]["kernel"] == "decode"]
    module, name = job.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    tt = ffi_launch.triton_target(aot.make_target("sm_90"))
    sig, consts, attrs, _ = ffi_launch.specialization(kernel, job.dtypes, dict(job.constexprs))
    cc, _ = compiler.compile_for_target(kernel, signature=sig, constexprs=consts, attrs=attrs,
                                        target=tt, num_warps=job.num_warps,
                                        num_stages=job.num_stages)
    ptx = cc.asm["ptx"]
    out[str(once)] = dict(
        cvt_once=consts.get("CVT_ONCE"),
        byte_loads=len(re.findall(r"ld\\.shared(?:\\.v\\d)?\\.[ub]8", ptx)),
        ldmatrix=len(re.findall(r"ldmatrix", ptx)),
        converts=len(re.findall(r"cvt\\.rn\\.f16x2\\.e4m3x2", ptx)))
print(json.dumps(out))
"""


@needs_cuda
def test_sm90_fp8_tile_is_converted_once_where_it_was_loaded():
    """``CVT_ONCE`` (the default on CUDA): the Triton fp8 tile (the split-query kernel forced
    off, as at page sizes the Gluon kernel does not take) goes to 16 bits once, in its load
    layout, and both products read it through ``ldmatrix``; Triton's own placement converts
    it per product and reads the ``V`` operand from shared memory one byte at a time."""
    from conftest import run_compiler_script

    got = run_compiler_script(_CVT_SCRIPT, timeout=600)
    once, per_product = got["True"], got["False"]
    assert once["cvt_once"] is True and per_product["cvt_once"] is False, got
    assert once["byte_loads"] == 0 and per_product["byte_loads"] > 0, got
    assert once["ldmatrix"] > per_product["ldmatrix"], got
    assert once["converts"] < per_product["converts"], got


@needs_cuda
def test_sm90_gluon_fp8_kernel_fits():
    """An fp8 query against an fp8 cache takes the Gluon fp8 kernel (``decode_sm90_fp8.py``, the
    default on Hopper) at 64-row tiles and, as 64-row programs, at 16 rows or fewer: about
    189 KiB of shared memory and no spills, where the Triton 64-row tile spilled 212-928 bytes
    under triton 3.9. (Under 3.9 it spilled 16 bytes at 40 and 96 heads, ``Q = 2`` and 4, until
    2026-12-06; none since, at those head counts either; docs/aot.md.)"""
    rows = check_fits("sm_90", "--heads", "16,128", "--qlen", "1,4", "--dtypes", "fp8q",
                      kernels={"decode", "verify"})
    gluon = [r for r in rows if r["function"] == "mla_decode_sm90_fp8_kernel"]
    assert {(r["num_heads"], r["qlen"]) for r in gluon} == {(16, 1), (16, 4), (128, 1),
                                                            (128, 4)}, rows


@needs_cuda
def test_sm90_fp8_64_row_tile_fits():
    """128 heads, a bf16 query against an fp8 cache: the split-query Gluon kernel (the plan's
    default there under every Triton), which fits with no spills under triton 3.6 and 3.9 (under
    3.9 it spilled 144-232 bytes outside its KV loops until it stopped holding loop-invariant
    rows through them, 2026-12-06; the Triton 64-row tile it replaces spills 524-932 bytes)."""
    rows = check_fits("sm_90", "--heads", "128", "--qlen", "1,3", "--dtypes", "fp8")
    assert {r["function"] for r in rows if r["kernel"] in ("decode", "verify")} == {
        "mla_decode_sm90_fp8_kernel"}, rows


@needs_cuda
def test_a_persistent_grid_larger_than_the_gpu_holds_fails():
    """The decode grid is persistent (``ctas_per_sm`` programs an SM, all resident at once):
    four programs an SM of the 16-row bf16 tile (two fit: 191 registers, 93 KiB) is named as
    a grid the GPU cannot hold; the rows carry the grid's size and the SM count."""
    res = run_aot("--target", "sm_90", "--heads", "16", "--qlen", "1", "--dtypes", "bf16",
                  "--json", extra_env={"JAX_MLA_TRITON_CTAS_PER_SM": "4"})
    assert res.returncode == 1, res.stderr[-3000:]
    [row] = [r for r in json.loads(res.stdout) if r["kernel"] == "decode"]
    assert (row["programs"], row["cores"]) == (4 * 132, 132), row
    assert row["occupancy"] < 4, row
    assert any(p.startswith(f"persistent grid of {4 * 132} programs > {row['occupancy']} "
                            "resident a core x 132 cores") for p in row["problems"]), row
    assert "persistent grid" in res.stderr, res.stderr[-3000:]


@needs_amd
def test_an_oversize_tile_fails_naming_the_variant():
    """A 64-token KV tile at three stages (the environment's tile knobs) takes 100+ KiB of LDS:
    the check exits 1 and names the variant and what it exceeds."""
    res = run_aot("--target", "gfx942", "--heads", "16", "--qlen", "1", "--dtypes", "bf16",
                  extra_env={"JAX_MLA_TRITON_BLOCK_N": "64", "JAX_MLA_TRITON_STAGES": "3"})
    assert res.returncode == 1, res.stderr[-3000:]
    assert "decode 16 heads, qlen 1, bf16/bf16" in res.stderr, res.stderr[-3000:]
    assert "shared memory" in res.stderr and "> 65536 bytes" in res.stderr, res.stderr[-3000:]
    assert "FAIL" in res.stdout


def test_rocm_tiles_and_limits():
    """The tables the check enforces: ROCm tiles have 4 warps and at most 32 rows (float32
    caches 16); the limits agree with the FFI launcher's shared-memory table."""
    import jax.numpy as jnp

    from jax_mla.aot import LIMITS, occupancy
    from jax_mla.backends.triton.ffi_launch import SHARED_LIMITS
    from jax_mla.backends.triton.plan import TritonTuning, kernel_config
    from jax_mla.problem import Target

    for arch, lim in LIMITS.items():
        assert SHARED_LIMITS[arch] == lim.shared, arch
    tun = TritonTuning()
    for arch in ("gfx942", "gfx950", None):
        target = Target("rocm", arch, 304)
        for heads, block_m in ((16, 16), (128, 32)):
            cfg = kernel_config(heads, 1, 64, target, tuning=tun, kv_dtype=jnp.bfloat16)
            assert (cfg.block_m, cfg.num_warps, cfg.block_n, cfg.num_stages) == (
                block_m, 4, 16, 1), (arch, cfg)
        assert kernel_config(128, 1, 64, target, tuning=tun, kv_dtype=jnp.float32).block_m == 16
    cuda = Target("cuda", "sm_90", 132)
    fp32 = kernel_config(128, 1, 64, cuda, tuning=tun, kv_dtype=jnp.float32)
    assert (fp32.block_m, fp32.block_n, fp32.num_warps, fp32.num_stages, fp32.ctas_per_sm,
            fp32.sm90) == (16, 16, 4, 2, 2, False), fp32  # two resident under triton 3.6
    assert kernel_config(16, 2, 64, cuda, tuning=tun, kv_dtype=jnp.float32).block_m == 16
    # A bf16 query against an fp8 cache (the Gluon fp8 kernel does not serve it: sm90=False)
    fp8 = kernel_config(16, 1, 64, cuda, sm90=False, tuning=tun, kv_dtype=jnp.float8_e4m3fn)
    assert (fp8.block_m, fp8.block_n, fp8.num_warps, fp8.num_stages, fp8.ctas_per_sm) == (
        16, 16, 4, 4, 3), fp8
    # ... and an fp8 one, which it serves: its 64-row programs at 16 rows
    fp8q = kernel_config(16, 1, 64, cuda, tuning=tun, kv_dtype=jnp.float8_e4m3fn)
    assert (fp8q.block_m, fp8q.sm90) == (64, True), fp8q
    f16 = kernel_config(16, 1, 64, cuda, sm90=False, tuning=TritonTuning(fp8_f16=True),
                        kv_dtype=jnp.float8_e4m3fn)
    assert (f16.block_n, f16.num_stages, f16.ctas_per_sm) == (16, 4, 2), f16  # 173 registers
    # (an fp8 cache never takes the Gluon kernel: make_plan passes sm90=False for it)
    fp8_64 = kernel_config(128, 1, 64, cuda, sm90=False, tuning=tun, kv_dtype=jnp.float8_e4m3fn)
    assert (fp8_64.block_m, fp8_64.block_n, fp8_64.wg_split) == (64, 64, True), fp8_64
    # The 16-bit CUDA tiles are the H200-tuned ones.
    assert kernel_config(16, 1, 64, cuda, tuning=tun, kv_dtype=jnp.bfloat16).block_n == 32
    assert kernel_config(128, 1, 64, cuda, tuning=tun, kv_dtype=jnp.bfloat16).block_m == 64
    # sm_90: the 16-row tile (243 registers, 91 KiB) two to an SM; gfx942: 4 waves of 338
    # VGPRs, one workgroup a CU, or four at 64 VGPRs when LDS allows.
    assert occupancy("sm_90", 128, 93184, 243) == 2
    assert occupancy("gfx942", 256, 18432, 338) == 1
    assert occupancy("gfx942", 256, 16384, 64) == 4
