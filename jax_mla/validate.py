"""``python -m jax_mla doctor --validate [--out FILE.json]``: validate a ROCm host in one run.

Written for the first AMD host this project is lent; runs anywhere. In one process, a few
minutes on a GPU:

- the doctor's host checks (platform, packages, AITER against the manifest, the FFI launcher);
- *conformance*: decode and verify at the head counts, dtypes (bf16; fp8 as the arch stores it:
  ``float8_e4m3fnuz`` on gfx942, ``float8_e4m3fn`` on gfx950), page sizes and qlens AITER's
  routes cover (asm persistent, folded, known-bad avoided, with an LSE, Gluon decode and verify)
  and the two prefill routes (FlashAttention varlen with an LSE, fp8 PS), each through
  ``backend="aiter"`` and ``backend="triton"`` against the float64 oracle of
  :mod:`jax_mla.testing`: rel err below 1e-2 for bf16 and fp8 (bf16 out), 1e-5 for float32;
  rows that see nothing give out 0 and lse -inf; NaN in every cache slot and padding row no
  request owns, NaN-poisoned outputs where kernels are interpreted;
- *kernels*: for AITER's asm decode, fp8 PS prefill, FlashAttention v3 prefill and Gluon decode,
  whether the cases above launched them natively (jax_mla's FFI handlers, read from the lowered
  program's custom calls) or through the Python bridge, and why;
- *notebook05*: what ``notebooks/05_rocm_host.ipynb`` does (the backend it picks, a DeepSeek
  decode and verify step against float64 and XLA, AITER's routes for its cases, the persistent
  schedule covering every request once), as a function;
- *bench*: a few decode shapes, stream time per call (``jax_mla.bench.timing.device_time``).

Every case is one JSON row (name, section, backend, route, kernel, how it ran, errors,
tolerance, status, seconds); the last line printed is ``VALIDATED: ...`` or ``NOT VALIDATED: N
of M failed``, and the exit status is 0 only when no case failed. What ran on what is said
plainly: the real AITER or the test stand-in (``tests/aiter_standin``, which the tests put on
``sys.path``: torch reference math, not AITER's kernels), Triton compiled for the GPU or its
interpreter. Off ROCm a backend that cannot run here is skipped and said; on ROCm it fails.
On a CPU (or with ``--quick``) the shapes are small.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla
from jax_mla import testing
from jax_mla.backends import get_backend, resolve_backend
from jax_mla.backends.aiter import AiterPrefillConfig, bridge, build_aiter_decode_metadata
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.problem import Target, detect_target

PASS, FAIL, SKIP = "pass", "fail", "skip"
TOL = {"bf16": 1e-2, "fp8": 1e-2, "fp32": 1e-5}  # rel err of the output; fp8 gives bf16 out
Q_SCALE = KV_SCALE = 0.05  # fp8 operands store x / scale: |x| ~ 5 stays below fnuz's 240
_DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode/verify problem; ``q``/``kv``: ``"bf16"``, ``"fp8"`` (the arch's) or
    ``"fp32"``; ``backends``: those it runs on (AITER takes bf16 and fp8 only)."""

    name: str
    what: str
    num_heads: int
    qlen: int
    page_size: int
    q: str
    kv: str
    lse: bool = False
    backends: tuple = ("aiter", "triton")


DECODE_CASES = (
    DecodeCase("decode-h16-bf16-p64", "decode, TP8 (16 of DeepSeek's 128 heads)",
               16, 1, 64, "bf16", "bf16"),
    DecodeCase("decode-h128-bf16-p1", "decode, one device (128 heads), per-token pages",
               128, 1, 1, "bf16", "bf16"),
    DecodeCase("verify-h16-bf16-q2-p16", "verify, MTP-1 (qlen 2), TP8", 16, 2, 16, "bf16", "bf16"),
    DecodeCase("decode-h16-fp8-p64", "decode, fp8 query and cache with scales",
               16, 1, 64, "fp8", "fp8"),
    DecodeCase("decode-h16-bf16q-fp8kv-p16", "decode, bf16 query over an fp8 cache",
               16, 1, 16, "bf16", "fp8"),
    DecodeCase("decode-h64-fp8-p1", "decode, 64 fp8 heads (gfx942: the known-bad qh64 kernel "
               "avoided, 4 x 16 heads instead)", 64, 1, 1, "fp8", "fp8"),
    DecodeCase("decode-h64-fp8-lse", "decode with the LSE a DCP combine needs",
               64, 1, 16, "fp8", "fp8", lse=True),
    DecodeCase("decode-h8-bf16-p16", "decode, TP16 (gfx950: Gluon; gfx942: asm, padded to 16)",
               8, 1, 16, "bf16", "bf16"),
    DecodeCase("verify-h12-bf16-q3-p16", "verify, MTP-2 at 12 heads (gfx950: Gluon verify)",
               12, 3, 16, "bf16", "bf16"),
    DecodeCase("decode-h16-fp32-p16", "float32, exact (Triton only: AITER takes bf16 and fp8)",
               16, 1, 16, "fp32", "fp32", backends=("triton",)),
)


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    """One varlen prefill (DeepSeek's MHA form: Dqk 192, Dv 128); ``dtype`` of q, k and v."""

    name: str
    what: str
    num_heads: int
    dtype: str
    lse: bool


PREFILL_CASES = (
    PrefillCase("prefill-h16-bf16-lse", "bf16 with the LSE a chunked-context merge needs "
                "(FlashAttention varlen)", 16, "bf16", True),
    PrefillCase("prefill-h16-fp8", "fp8 q, k, v with scales, no LSE (gfx950: fp8 PS prefill)",
                16, "fp8", False),
)

# Requests of each conformance case: empty ones, one shorter than any verify block, several
# pages; smaller on a CPU (Triton's interpreter, the stand-in's torch math).
DECODE_LENS = {False: [1500, 0, 1, 64, 4097, 300], True: [70, 0, 1, 129]}
PREFILL_LENS = {False: [513, 0, 77, 1200], True: [45, 0, 13]}
# (batch, context, heads) of the bench: bf16, qlen 1, pages of 64.
BENCH_SHAPES = {False: ((1, 4096, 16), (32, 4096, 16), (128, 1024, 16), (32, 4096, 128)),
                True: ((2, 64, 16),)}

# jax_mla's FFI targets (read from a lowered program's custom calls); a Python callback is the
# AITER bridge (or, on a CPU, Triton's interpreter).
NATIVE_TARGETS = {
    "jax_mla_aiter_asm_mla": "AITER's asm decode .co, jax_mla's FFI handler",
    "jax_mla_aiter_asm_prefill_ps": "AITER's fp8 PS prefill .co, jax_mla's FFI handler",
    "jax_mla_aiter_asm_fmha_fwd": "AITER's FlashAttention v3 .co, jax_mla's FFI handler",
    "jax_mla_triton": "Triton kernels, jax_mla's FFI launcher",
}


@dataclasses.dataclass(frozen=True)
class Host:
    """What this process runs on, settled once: the target, the AMD arch AITER's routes are
    planned for (the device's on ROCm; else ``--arch``, the stand-in's, or None), the AITER
    found (real, the stand-in, or none), why each backend cannot run here (None: it can),
    and whether shapes are small."""

    target: Target
    arch: str | None
    num_cu: int | None
    aiter: str
    standin: bool
    build: caps.AiterBuild
    why_not: dict
    small: bool

    @property
    def rocm(self) -> bool:
        return self.target.platform == "rocm"

    def fp8(self):
        return caps.fp8_dtype(self.arch) if self.arch else jnp.dtype(jnp.float8_e4m3fn)

    def aiter_options(self) -> dict | None:
        return dict(arch=self.arch, num_cu=self.num_cu)

    def ran_on(self) -> dict:
        """Per backend, in words, what its cases ran on."""
        device = jax.devices()[0].device_kind
        words = {"xla": f"XLA on {self.target.platform} ({device})",
                 "oracle": "float64 NumPy on the host (jax_mla.testing)"}
        if self.why_not["aiter"]:
            words["aiter"] = f"not run: {self.why_not['aiter']}"
        elif self.standin:
            words["aiter"] = (f"the torch stand-in of AITER's Python API (tests/aiter_standin: "
                              f"reference math, not AITER's kernels) through the Python bridge "
                              f"on {self.target.platform}, routes planned for {self.arch} with "
                              f"{self.num_cu} CUs: not AMD hardware")
        else:
            words["aiter"] = (f"{self.aiter} on {device} ({self.arch}, {self.num_cu} CUs); "
                              "native or bridge per kernel family: see kernels")
        tv = _version("triton")
        if self.why_not["triton"]:
            words["triton"] = f"not run: {self.why_not['triton']}"
        elif self.target.platform == "cpu":
            words["triton"] = (f"Triton {tv}'s interpreter on the CPU (the kernels' code run "
                               "by NumPy: numerics, not a compiled kernel)")
        else:
            words["triton"] = (f"compiled by Triton {tv} for {self.target.arch} and launched "
                               f"on {device}")
        return words

    def short(self) -> str:
        aiter = ("AITER not run" if self.why_not["aiter"] else
                 "AITER = the stand-in (not AMD hardware)" if self.standin else f"{self.aiter}")
        triton = ("Triton not run" if self.why_not["triton"] else "Triton = its interpreter"
                  if self.target.platform == "cpu" else f"Triton compiled for {self.target.arch}")
        return f"{self.target}; {aiter}; {triton}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_host(arch: str | None = None, small: bool = False) -> Host:
    """The :class:`Host` of this process; ``arch`` plans AITER's routes off ROCm (or where jax
    does not name the device's arch)."""
    target = detect_target()
    aiter, standin, broken, num_cu = "", False, None, None
    build = caps.DEFAULT_BUILD
    if bridge.aiter_importable():
        try:
            mod = importlib.import_module("aiter")
            build = bridge.installed_build()
        except Exception as e:  # noqa: BLE001 - a broken install is a finding, not a crash
            broken = f"the installed aiter does not import: {e!r}"[:400]
        else:
            standin = bool(getattr(mod, "STANDIN", False))
            if standin:  # the tests' stand-in plans for the arch and CUs it was set up with
                aiter = "the AITER stand-in (tests/aiter_standin)"
                arch, num_cu = arch or mod.get_gfx(), mod.get_cu_num()
            else:
                aiter = (f"AITER {bridge.installed_version() or '(version unknown)'} at "
                         f"{os.path.dirname(getattr(mod, '__file__', '') or '?')}")
    if target.platform == "rocm":
        arch, num_cu = caps.detect_arch() or arch, target.num_cores
    elif arch is not None and num_cu is None:
        num_cu = caps.ARCH_INFO[arch].num_cu
    why_not = {name: get_backend(name).unavailable_reason(target)
               for name in ("aiter", "triton", "xla")}
    if why_not["aiter"] is None and broken:
        why_not["aiter"] = broken
    elif why_not["aiter"] is None and arch is None:
        why_not["aiter"] = ("jax does not name this device's gfx arch: pass --arch gfx942 or "
                            "gfx950")
    return Host(target=target, arch=arch, num_cu=num_cu, aiter=aiter, standin=standin,
                build=build, why_not=why_not, small=small or target.platform == "cpu")


# -- running one case ---------------------------------------------------------------------------


def _case(section: str, name: str, backend: str | None, fn, *args,
          host: Host | None = None) -> dict:
    """Run ``fn(*args) -> dict`` (its fields, ``failures`` among them) as one row; with
    ``host``, a backend that cannot run here is skipped off ROCm and failed on it; an exception
    fails the row."""
    row = dict(section=section, name=name, backend=backend)
    t0 = time.perf_counter()
    why = host.why_not.get(backend) if host is not None and backend else None
    if why is not None:
        row.update(status=FAIL if host.rocm else SKIP, detail=f"not run: {why}")
    else:
        try:
            got = fn(*args)
            failures = got.pop("failures", [])
            row.update(got)
            row["status"] = FAIL if failures else PASS
            if failures:
                row["detail"] = "; ".join(failures)
        except Exception as e:  # noqa: BLE001 - a case that raises is a finding
            row.update(status=FAIL, detail=f"raised {e!r}"[:600])
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def _launches(text: str) -> tuple[list[str], list[str]]:
    """The custom-call targets of a lowered program (StableHLO ``text``) and the kernel names
    its FFI calls carry."""
    return (re.findall(r"custom_call @(\w+)", text),
            re.findall(r'kernel_name = "([^"]+)"', text))


def how_it_ran(host: Host, backend: str, targets: list[str]) -> str:
    """In words, from the lowered custom calls: natively through jax_mla's FFI, through the
    Python bridge (the stand-in's or AITER's Python API), the interpreter, or XLA."""
    native = sorted({t for t in targets if t in NATIVE_TARGETS})
    callbacks = any("callback" in t for t in targets)
    if backend == "aiter":
        bridge_words = ("Python bridge to the stand-in" if host.standin
                        else "Python bridge to AITER's Python API")
        if native:
            return "native: " + ", ".join(native) + (f" + {bridge_words}" if callbacks else "")
        return bridge_words if callbacks else "XLA ops only"
    if backend == "triton":
        if native:
            return "compiled: " + ", ".join(native)
        if callbacks:
            return ("Triton interpreter" if host.target.platform == "cpu"
                    else "Python callback")
    return "XLA ops" + (f" + {', '.join(sorted(set(targets)))}" if targets else "")


def _run_lowered(host: Host, backend: str, f, *args):
    """``f(*args)`` jitted, with what it launched: ``(result, custom-call info)``."""
    lowered = jax.jit(f).lower(*args)
    targets, kernels = _launches(lowered.as_text())
    result = jax.block_until_ready(lowered.compile()(*args))
    return result, dict(path=how_it_ran(host, backend, targets), custom_calls=targets,
                        kernel=", ".join(dict.fromkeys(kernels)) or None)


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@contextlib.contextmanager
def _poisoned_outputs(on: bool):
    """Interpreted kernels see NaN-filled outputs (``JAX_MLA_POISON_OUTPUTS``, read at run
    time): a row a kernel fails to write shows."""
    old = os.environ.get("JAX_MLA_POISON_OUTPUTS")
    if on:
        os.environ["JAX_MLA_POISON_OUTPUTS"] = "1"
    try:
        yield
    finally:
        if on:
            if old is None:
                os.environ.pop("JAX_MLA_POISON_OUTPUTS", None)
            else:
                os.environ["JAX_MLA_POISON_OUTPUTS"] = old


# -- conformance --------------------------------------------------------------------------------


def _decode_operands(host: Host, case: DecodeCase, c: testing.Case):
    """``q``, the cache, their scales and the float64 inputs the oracle sees (the rounded
    values, times the scales)."""
    qs = Q_SCALE if case.q == "fp8" else None
    ks = KV_SCALE if case.kv == "fp8" else None
    q_dt = host.fp8() if case.q == "fp8" else _DTYPES[case.q]
    kv_dt = host.fp8() if case.kv == "fp8" else _DTYPES[case.kv]
    q = jnp.asarray(c.q / (qs or 1.0)).astype(q_dt)
    cache = jnp.asarray(c.cache / (ks or 1.0)).astype(kv_dt)
    return q, cache, qs, ks, _f32(q) * (qs or 1.0), _f32(cache) * (ks or 1.0)


def _route_words(md) -> tuple[str, str | None]:
    """The route a plan carries, in words, and the kernel family it launches."""
    plan = md.plan
    route = getattr(plan, "route", None)
    kernel = getattr(plan, "kernel", None)
    if route is None and kernel is not None:  # Triton's: the tile, the programs, the launcher
        return (f"{'gluon sm90' if kernel.sm90 else 'triton'} {kernel.block_m}x{kernel.block_n} "
                f"tile, {kernel.num_head_blocks} head block(s), {plan.num_programs} programs, "
                f"{plan.launcher}"), None
    if route is None:
        return f"{plan.backend} plan", None
    words = f"{route.kind} {route.kernel_heads}h" + (" persistent" if route.persistent else "")
    if route.avoided:
        words += " (known-bad kernel avoided: " + ", ".join(r.kernel for r in route.avoided) + ")"
    family = "asm decode" if route.kind == "asm" else (
        "Gluon decode" if route.kind.startswith("gluon") else "segmented Triton verify")
    return words, family


def conformance(host: Host, rng: np.random.Generator) -> list[dict]:
    """Every :data:`DECODE_CASES` and :data:`PREFILL_CASES` case on each of its backends,
    against the float64 oracle."""
    rows = []
    for case in DECODE_CASES:
        c = testing.make_case(rng, seq_lens=DECODE_LENS[host.small], qlen=case.qlen,
                              num_heads=case.num_heads, page_size=case.page_size)
        outs, mine = {}, {}
        for backend in case.backends:
            mine[backend] = _case("conformance", case.name, backend, _decode_case, host, case,
                                  c, backend, outs, host=host)
        if {"aiter", "triton"} <= outs.keys():  # the two GPU backends against each other
            mine["aiter"]["vs_triton_rel_err"] = testing.rel_err(outs["aiter"], outs["triton"])
        rows += mine.values()
    for case in PREFILL_CASES:
        args = _prefill_operands(host, case, rng)
        for backend in ("aiter", "triton"):
            rows.append(_case("conformance", case.name, backend, _prefill_case, host, case,
                              args, backend, host=host))
    return rows


def _decode_case(host: Host, case: DecodeCase, c: testing.Case, backend: str,
                 outs: dict) -> dict:
    q, cache, qs, ks, q_ref, cache_ref = _decode_operands(host, case, c)
    lse_on = case.lse or backend != "aiter"  # AITER makes an LSE only where the route asks
    md = jax_mla.build_decode_metadata(
        c.block_table, c.seq_lens, page_size=c.page_size, qlen=c.qlen, q=q, kv_cache=cache,
        return_lse=lse_on, backend=backend,
        options=host.aiter_options() if backend == "aiter" else None)
    route, family = _route_words(md)

    def step(q, cache, md):
        return jax_mla.mla_attention(q, cache, md, scale=c.scale, backend=backend,
                                     return_lse=lse_on, q_scale=qs, kv_scale=ks)

    res, launched = _run_lowered(host, backend, step, q, cache, md)
    out, lse = res if lse_on else (res, None)
    want, want_lse = testing.numpy_mla_decode(q_ref, cache_ref, c.block_table, c.seq_lens,
                                              qlen=c.qlen, scale=c.scale,
                                              kv_lora_rank=c.kv_lora_rank)
    tol = TOL[case.q]
    errors = testing.oracle_errors(_f32(out), want, tol=tol, lse=lse, want_lse=want_lse)
    out_dtype = jnp.float32 if case.q == "fp32" else jnp.bfloat16
    if out.dtype != out_dtype:
        errors["failures"].append(f"out dtype {out.dtype}, expected {jnp.dtype(out_dtype)}")
    outs[backend] = _f32(out)
    return dict(what=case.what, route=route, family=family if backend == "aiter" else None,
                **launched, q_dtype=str(q.dtype), kv_dtype=str(cache.dtype),
                heads=case.num_heads, qlen=case.qlen, page_size=case.page_size,
                seq_lens=[int(n) for n in c.seq_lens], rel_err=errors["rel_err"],
                lse_err=errors["lse_err"], tolerance=tol, lse_tolerance=4 * max(tol, 1e-4),
                failures=errors["failures"])


def _prefill_operands(host: Host, case: PrefillCase, rng: np.random.Generator):
    """q, k, v (NaN in the padding rows past the last sequence), their scales, ``cu``, and the
    float64 values the oracle sees."""
    lens = PREFILL_LENS[host.small]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1]) + 3  # trailing padding rows: never read
    x = [rng.standard_normal((t, case.num_heads, d)).astype(np.float32) for d in (192, 192, 128)]
    for a in x:
        a[cu[-1]:] = np.nan
    if case.dtype == "fp8":
        scales = (Q_SCALE, KV_SCALE, KV_SCALE)
        qkv = [jnp.asarray(a / s).astype(host.fp8()) for a, s in zip(x, scales)]
    else:
        scales = (None, None, None)
        qkv = [jnp.asarray(a, _DTYPES[case.dtype]) for a in x]
    ref = [_f32(a) * (s or 1.0) for a, s in zip(qkv, scales)]
    return qkv, scales, cu, ref


def _prefill_case(host: Host, case: PrefillCase, args, backend: str) -> dict:
    (q, k, v), (qs, ks, vs), cu, ref = args
    scale = 192 ** -0.5
    config, route, family = None, f"{backend} prefill", None
    if backend == "aiter":
        # The fp8 PS kernel is taken where the arch and build have it (every other condition
        # holds by construction: fp8 inputs, 16 heads, causal, packed alike, no LSE).
        config = AiterPrefillConfig(arch=host.arch, build=host.build)
        ps = case.dtype == "fp8" and caps.fp8_prefill_supported(host.arch, host.build)
        route, family = (("mla_prefill_ps_asm_fwd + mla_reduce_v1", "fp8 PS prefill") if ps
                         else ("flash_attn_varlen_func", "FlashAttention v3 prefill"))

    max_len = int(np.diff(cu).max())

    def step(q, k, v, cu):
        return jax_mla.mla_prefill(q, k, v, cu, scale=scale, return_lse=case.lse,
                                   backend=backend, config=config, q_scale=qs, k_scale=ks,
                                   v_scale=vs, max_seqlen=max_len)

    res, launched = _run_lowered(host, backend, step, q, k, v, jnp.asarray(cu))
    out, lse = res if case.lse else (res, None)
    want, want_lse = testing.numpy_varlen_prefill(*ref, cu, scale=scale, causal=True)
    tol = TOL[case.dtype]
    errors = testing.oracle_errors(_f32(out), want, tol=tol, lse=lse, want_lse=want_lse)
    return dict(what=case.what, route=route, family=family, **launched, q_dtype=str(q.dtype),
                heads=case.num_heads, seq_lens=[int(n) for n in np.diff(cu)],
                rel_err=errors["rel_err"], lse_err=errors["lse_err"], tolerance=tol,
                lse_tolerance=4 * max(tol, 1e-4), failures=errors["failures"])


# -- AITER's kernels: native or bridge -------------------------------------------------------


def kernel_families(host: Host, rows: list[dict]) -> list[dict]:
    """Per AITER kernel family the conformance cases exercised: whether jax_mla's FFI can
    launch it here (and why not), and how each case ran it."""
    from jax_mla.backends.aiter import gluon_kernels, native, native_fmha, native_prefill

    ready = {
        "asm decode": ("jax_mla_aiter_asm_mla", lambda: native.unavailable_reason(host.arch)),
        "fp8 PS prefill": ("jax_mla_aiter_asm_prefill_ps",
                           lambda: native_prefill.unavailable_reason(host.arch)),
        "FlashAttention v3 prefill": ("jax_mla_aiter_asm_fmha_fwd",
                                      lambda: native_fmha.unavailable_reason(
                                          host.arch, num_cu=host.num_cu)),
        "Gluon decode": ("jax_mla_triton",
                         lambda: gluon_kernels.unavailable_reason(host.target, host.arch)),
    }
    out = []
    for family, (ffi_target, reason) in ready.items():
        mine = [r for r in rows if r.get("family") == family and r["backend"] == "aiter"]
        if host.rocm and host.arch:
            try:
                why = reason()
            except Exception as e:  # noqa: BLE001 - a broken install is a finding
                why = f"checking failed: {e!r}"
        elif host.rocm:
            why = "jax does not name this device's gfx arch"
        else:
            why = (f"not a ROCm host ({host.target.platform}): every AITER call goes through "
                   "the Python bridge")
        ran = {r["name"]: ("native" if ffi_target in r.get("custom_calls", []) else "bridge")
               for r in mine if r["status"] != SKIP and "custom_calls" in r}
        out.append(dict(family=family, ffi_target=ffi_target, native_ready=why is None,
                        why_not_native=why, cases=ran,
                        ran=("not exercised" if not ran else
                             "native" if set(ran.values()) == {"native"} else
                             "bridge" if set(ran.values()) == {"bridge"} else "mixed")))
    return out


# -- notebooks/05_rocm_host.ipynb as a function --------------------------------------------------


def notebook05(host: Host) -> list[dict]:
    """The notebook's cells: the backend it picks (``"aiter"`` when usable, else ``"auto"``); a
    DeepSeek-shaped decode and verify step (16 heads, bf16, pages of 64, NaN in unused slots)
    on it and on XLA, each against float64 (rel err < 1e-2) and timed, and the two against each
    other; AITER's route for its seven deployment cases on the arch planned for (both archs
    where there is none); and the persistent schedule covering every request's KV exactly
    once."""
    rows = []
    target = host.target
    usable = host.why_not["aiter"] is None
    backend = "aiter" if usable else "auto"
    used = resolve_backend(backend, target).name
    rows.append(dict(section="notebook05", name="backend", backend=used, status=PASS,
                     seconds=0.0, detail=f"backend={backend!r} -> {used!r}" + (
                         "" if usable else f" (aiter: {host.why_not['aiter']})")))
    L, R, H, PAGE = 512, 64, 16, 64
    SCALE = 192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2  # DeepSeek-V3's YaRN mscale^2
    lens = np.array([300, 1, 70, 64, 150, 204] if host.small else
                    [3000, 1, 700, 64, 1500, 2048], np.int32)
    B = len(lens)
    rng = np.random.default_rng(0)
    pages_per = -(-lens // PAGE)
    num_pages = 1 + int(pages_per.sum())  # page 0 stays unwritten (NaN)
    perm = 1 + rng.permutation(num_pages - 1)
    block_table = np.zeros((B, pages_per.max()), np.int32)
    cache_np = np.full((num_pages, PAGE, L + R), np.nan, np.float32)
    for b, start in enumerate(np.cumsum(pages_per) - pages_per):
        block_table[b, : pages_per[b]] = perm[start : start + pages_per[b]]
        pos = np.arange(lens[b])
        cache_np[block_table[b, pos // PAGE], pos % PAGE] = rng.standard_normal((lens[b], L + R))
    cache = jnp.asarray(cache_np, jnp.bfloat16)
    queries = {qlen: jnp.asarray(rng.standard_normal((B * qlen, H, L + R)), jnp.bfloat16)
               for qlen in (1, 2)}
    attend = jax.jit(lambda q, kv, md: jax_mla.mla_attention(q, kv, md, scale=SCALE))
    kv_bytes = int(lens.sum()) * (L + R) * 2
    steps = {}
    for qlen, step in ((1, "decode"), (2, "verify")):
        q = queries[qlen]
        want, _ = testing.numpy_mla_decode(_f32(q), _f32(cache), block_table, lens, qlen=qlen,
                                           scale=SCALE, kv_lora_rank=L)
        outs = {}
        for name in dict.fromkeys((used, "xla")):
            def one(name=name, q=q, qlen=qlen, want=want, step=step, outs=outs):
                md = jax_mla.build_decode_metadata(
                    block_table, lens, qlen=qlen, q=q, kv_cache=cache, backend=name,
                    options=host.aiter_options() if name == "aiter" else None)
                out = jax.block_until_ready(attend(q, cache, md))
                times = []
                for _ in range(2 if host.small else 5):
                    t0 = time.perf_counter()
                    attend(q, cache, md).block_until_ready()
                    times.append(time.perf_counter() - t0)
                outs[name], steps[step, name] = _f32(out), md
                us = 1e6 * float(np.median(times))
                err = testing.rel_err(_f32(out), want)
                failures = [] if np.isfinite(_f32(out)).all() else ["non-finite output"]
                if not err < 1e-2:
                    failures.append(f"rel err {err:.2e} >= 0.01")
                return dict(route=_route_words(md)[0], rel_err=err, tolerance=1e-2,
                            us_per_call=us, kv_gb_per_s=kv_bytes / us / 1e3,
                            detail=f"qlen {qlen}, {B} requests of {lens.min()}-{lens.max()} "
                                   f"tokens: {us:.0f} us per call (wall, median)",
                            failures=failures)

            rows.append(_case("notebook05", f"{step} (qlen {qlen})", name, one))
        if used != "xla" and {used, "xla"} <= outs.keys():
            err = testing.rel_err(outs[used], outs["xla"])
            rows.append(dict(section="notebook05", name=f"{step} {used} vs xla", backend=used,
                             rel_err=err, tolerance=1e-2, seconds=0.0,
                             status=PASS if err < 1e-2 else FAIL))
    rows += _notebook_routes(host, block_table, lens, steps.get(("decode", "aiter")), used)
    return rows


NOTEBOOK_ROUTES = (  # (what, heads, qlen, cache dtype, LSE): the notebook's deployment cases
    ("decode, TP8", 16, 1, "bf16", False),
    ("verify MTP-1, TP8", 16, 2, "bf16", False),
    ("decode, TP16", 8, 1, "bf16", False),
    ("verify MTP-1, TP16", 8, 2, "bf16", False),
    ("decode, 128 heads", 128, 1, "bf16", False),
    ("decode, fp8 cache", 16, 1, "fp8", False),
    ("decode with LSE (DCP)", 16, 1, "bf16", True),
)


def _notebook_routes(host: Host, block_table, lens, decode_md, used: str) -> list[dict]:
    """The notebook's route table (refusals are answers too) and its schedule check: the works
    of the persistent plan cover every request's KV once, for its decode step and for 128
    requests of 1 to 4096 tokens (planned only)."""
    rows = []
    arches = [host.arch] if host.arch else ["gfx942", "gfx950"]

    def metadata(a, heads, qlen, kv, lse=False, table=block_table, lens=lens):
        tgt = host.target if host.rocm else Target("rocm", a, caps.ARCH_INFO[a].num_cu)
        kv_dtype = caps.fp8_dtype(a) if kv == "fp8" else jnp.bfloat16
        return build_aiter_decode_metadata(table, lens, page_size=64, num_heads=heads,
                                           qlen=qlen, kv_dtype=kv_dtype, return_lse=lse, arch=a,
                                           build=host.build, target=tgt)

    for a in arches:
        for what, heads, qlen, kv, lse in NOTEBOOK_ROUTES:
            def plan(a=a, heads=heads, qlen=qlen, kv=kv, lse=lse):
                try:
                    md = metadata(a, heads, qlen, kv, lse)
                except NotImplementedError as e:  # the kernel tables' answer
                    return dict(route="refused", detail=str(e).split(" (docs")[0])
                r, p = md.plan.route, md.schedule.plan
                return dict(route=_route_words(md)[0], detail=(
                    f"{r.kind}, kernel heads {r.kernel_heads}, persistent {r.persistent}, fold "
                    f"{p.fold_ratio if p is not None else '-'}, works "
                    f"{int(p.work_indptr[-1]) if p is not None else '-'}, {r.num_cu} CUs"))

            rows.append(_case("notebook05", f"route {a}: {what}", "aiter", plan))
    big_lens = np.random.default_rng(1).integers(1, 4097, 128).astype(np.int32)
    big_table = np.arange(128 * 64, dtype=np.int32).reshape(128, 64)
    batches = {
        f"this decode step, {len(lens)} requests": (
            (lambda: decode_md) if used == "aiter" and decode_md is not None
            else (lambda: metadata(arches[0], 16, 1, "bf16"))),
        "128 requests, 1 to 4096 tokens": (
            lambda: metadata(arches[0], 16, 1, "bf16", table=big_table, lens=big_lens)),
    }
    for what, get in batches.items():
        rows.append(_case("notebook05", f"schedule, {what}", "aiter",
                          lambda get=get: _covers_once(get())))
    return rows


def _covers_once(md) -> dict:
    """The works of ``md``'s persistent plan read each request's KV in contiguous pieces that
    cover it exactly once (the notebook's ``works_of``)."""
    plan, indptr = md.schedule.plan, np.asarray(md.paged_kv_indptr)
    cu = np.repeat(np.arange(plan.num_cu), np.diff(np.asarray(plan.work_indptr)))
    w = np.asarray(plan.work_info_set)[: len(cu)]
    req, start, end = w[:, 0] // plan.fold_ratio, w[:, 4], w[:, 5]
    failures = []
    for b in range(len(indptr) - 1):
        order = np.argsort(start[req == b])
        s, e = start[req == b][order], end[req == b][order]
        if indptr[b + 1] == indptr[b]:
            continue
        if not (len(s) and s[0] == indptr[b] and e[-1] == indptr[b + 1]
                and (s[1:] == e[:-1]).all()):
            failures.append(f"request {b}'s KV is not covered exactly once")
    pieces = np.bincount(req, minlength=len(indptr) - 1)
    return dict(route=_route_words(md)[0], failures=failures,
                detail=f"{md.plan.route.arch}: {len(req)} works on {len(set(cu))} of "
                       f"{plan.num_cu} CUs, {int((pieces > 1).sum())} of {len(indptr) - 1} "
                       f"requests split (up to {int(pieces.max())} pieces)")


# -- bench ------------------------------------------------------------------------------------


def bench(host: Host) -> list[dict]:
    """Stream time per call (``jax_mla.bench.timing.device_time``) of a few bf16 decode shapes
    on AITER and Triton, with the KV bandwidth it implies. On a CPU: one tiny shape, one
    repetition, through the stand-in and the interpreter; not a performance figure."""
    from jax_mla.bench import timing

    rows = []
    key = jax.random.key(0)
    for b, ctx, h in BENCH_SHAPES[host.small]:
        pages = -(-ctx // 64)
        q = jax.random.normal(key, (b, h, 576), jnp.bfloat16)
        cache = jax.random.normal(key, (b * pages, 64, 576), jnp.bfloat16)
        table = np.arange(b * pages, dtype=np.int32).reshape(b, pages)
        lens = np.full(b, ctx, np.int32)
        for backend in ("aiter", "triton"):
            def timed(backend=backend, q=q, cache=cache, table=table, lens=lens, b=b, ctx=ctx,
                      h=h):
                md = jax_mla.build_decode_metadata(
                    table, lens, page_size=64, q=q, kv_cache=cache, backend=backend,
                    options=host.aiter_options() if backend == "aiter" else None)

                def fn(q, cache, md):
                    return jax_mla.mla_attention(q, cache, md, scale=0.1, backend=backend)

                out = jax.jit(fn)(q, cache, md)
                sec = (timing.device_time(fn, q, cache, md, min_ms=0.0, reps=1, max_n=2)
                       if host.target.platform == "cpu" else
                       timing.device_time(fn, q, cache, md, min_ms=20.0, reps=5))
                us = sec * 1e6
                gbps = b * ctx * 576 * 2 / sec / 1e9
                finite = bool(np.isfinite(_f32(out)).all())
                return dict(route=_route_words(md)[0], us_per_call=us, kv_gb_per_s=gbps,
                            detail=f"B{b} context {ctx} H{h} bf16: {us:.1f} us per call "
                                   f"(stream time), {gbps:.1f} GB/s of KV" + (
                                       "; on a CPU: not a performance figure"
                                       if host.target.platform == "cpu" else ""),
                            failures=[] if finite else ["non-finite output"])

            rows.append(_case("bench", f"decode B{b} ctx{ctx} H{h}", backend, timed, host=host))
    return rows


# -- the report -------------------------------------------------------------------------------


def _doctor_rows(host_checks) -> list[dict]:
    return [dict(section="doctor", name=r["check"], backend=None, seconds=0.0,
                 status=FAIL if r["status"] == "FAIL" else PASS,
                 detail=("warn: " if r["status"] == "warn" else "") + r["detail"])
            for r in host_checks]


def verdict(rows: list[dict]) -> str:
    failed = sum(r["status"] == FAIL for r in rows)
    ran = sum(r["status"] in (PASS, FAIL) for r in rows)
    skipped = sum(r["status"] == SKIP for r in rows)
    tail = f" ({skipped} skipped)" if skipped else ""
    if failed:
        return f"NOT VALIDATED: {failed} of {ran} failed{tail}"
    return f"VALIDATED: {ran} of {ran} passed{tail}"


def run(*, quick: bool = False, arch: str | None = None, host_checks=(),
        seed: int = 0) -> dict:
    """Every section; the report :func:`main` writes (module docstring)."""
    t0 = time.perf_counter()
    host = probe_host(arch, small=quick)
    rows = _doctor_rows(host_checks)
    with _poisoned_outputs(host.target.platform == "cpu"):
        rows += conformance(host, np.random.default_rng(seed))
        rows += notebook05(host)
        rows += bench(host)
    failed = sum(r["status"] == FAIL for r in rows)
    return dict(
        verdict=verdict(rows), validated=failed == 0,
        host=dict(platform=host.target.platform, target=str(host.target),
                  device=jax.devices()[0].device_kind, arch=host.arch, num_cu=host.num_cu,
                  aiter=host.aiter or None, aiter_is_standin=host.standin,
                  aiter_build=repr(host.build), small_shapes=host.small,
                  jax=jax.__version__, jaxlib=_version("jaxlib"), triton=_version("triton"),
                  torch=_version("torch"), jax_mla=_version("jax_mla")),
        ran_on=host.ran_on(), where=host.short(),
        kernels=kernel_families(host, rows), cases=rows,
        seconds=round(time.perf_counter() - t0, 1))


def _clean(x):
    """JSON-safe: non-finite floats as strings (``"inf"``, ``"nan"``), numpy scalars as
    Python ones."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else str(float(x))
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _line(r: dict) -> str:
    err = ""
    if r.get("rel_err") is not None:
        err = f"rel err {r['rel_err']:.1e} (tol {r['tolerance']:g})"
        if r.get("lse_err") is not None:
            err += f", lse err {r['lse_err']:.1e}"
    parts = [r.get("route"), r.get("path"), err, r.get("detail") if r["status"] != PASS
             or r["section"] in ("doctor", "bench") or not (err or r.get("route")) else None]
    text = "  ".join(p for p in parts if p)
    return (f"{r['status']:>4}  {r['section']:<11} {r['name'][:44]:<44} "
            f"{(r['backend'] or '-'):<6} {text}")


def main(args, host_checks=()) -> int:
    """Run, write the JSON (``args.out``), print a line a case, what ran where and the
    verdict (or the JSON itself with ``args.json``); 0 only when no case failed."""
    report = _clean(run(quick=args.quick, arch=getattr(args, "arch", None),
                        host_checks=host_checks))
    out = getattr(args, "out", None) or "jax_mla_validate.json"
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report["cases"]:
            print(_line(r))
        for name, words in report["ran_on"].items():
            print(f"ran on: {name:<6} {words}")
        for k in report["kernels"]:
            how = (", ".join(f"{n} {v}" for n, v in k["cases"].items())
                   or f"no case here routes to it on {report['host']['arch']}")
            print(f"AITER {k['family']}: {k['ran']} ({how})"
                  + ("" if k["native_ready"] else f"; not native: {k['why_not_native']}"))
        print(f"wrote {out} ({report['seconds']} s)")
        print(f"{report['verdict']} -- {report['where']}")
    return 0 if report["validated"] else 1
