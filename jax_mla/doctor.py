"""``python -m jax_mla doctor [--json]``: check this host end to end, in one command.

What it reports, each as a line that is ``ok``, ``warn`` (works, with a limit worth knowing) or
``FAIL``:

- the platform: jax and jaxlib, the default backend, its devices, the
  :class:`~jax_mla.problem.Target` plans are made for (architecture, SM or CU count);
- the packages each path needs: triton (and which of its backends are installed), torch, AITER
  (where it is, and whether its API matches the pinned manifest, ``backends/aiter/manifest.py``;
  which kernels of the known-bad table, ``backends/aiter/known_bad.py``, its kernel set has,
  and the route taken instead);
- the FFI launcher library (``ffi/``): found, registered, its driver reachable on this GPU;
- on ROCm, AITER's asm decode, fp8 PS prefill, FlashAttention v3 prefill and Gluon decode
  kernels for this arch through our launcher (``backends/aiter/native.py``,
  ``native_prefill.py``, ``native_fmha.py``, ``gluon_kernels.py``):
  served natively, or through the Python bridge and why;
- a tiny decode step on every backend available here, compiled for this device and checked
  against a float64 oracle, with its time per call.

Exit status 0 when nothing failed. ``--json`` prints the checks as a JSON list instead.

``--validate [--out FILE.json]`` validates the host instead (``validate.py``): these checks,
then conformance cases on AITER and Triton against the float64 oracle, AITER's kernels native
or bridged, notebook 05's path and a short bench, one JSON, and a ``VALIDATED`` / ``NOT
VALIDATED: N of M failed`` verdict.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time

import numpy as np

OK, WARN, FAIL = "ok", "warn", "FAIL"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _platform_checks() -> list[dict]:
    import jax

    from jax_mla.problem import current_platform, detect_target

    platform = current_platform()
    target = detect_target()
    devices = jax.devices()
    cores = {"cuda": "SMs", "rocm": "CUs"}.get(target.platform, "pretend cores")
    rows = [dict(check="jax", status=OK,
                 detail=f"jax {jax.__version__}, jaxlib {_version('jaxlib')}, platform "
                        f"{platform}, {len(devices)} device(s): {devices[0].device_kind}"),
            dict(check="target", status=OK if target.gpu or platform == "cpu" else WARN,
                 detail=f"plans are made for {target} with {target.num_cores} {cores}")]
    if platform == "rocm" and target.arch is None:
        rows[-1].update(status=WARN, detail=rows[-1]["detail"] + "; jax does not name this "
                        "device's gfx arch: pass arch= to the AITER metadata builder")
    return rows


def _package_checks(platform: str) -> list[dict]:
    rows = []
    tv = _version("triton")
    if tv is None:
        rows.append(dict(check="triton", status=WARN if platform == "cpu" else FAIL,
                         detail="not installed: backend='triton' is unavailable (pip install "
                                "'jax_mla[cuda]' or '[rocm]')"))
    else:
        import os

        spec = importlib.util.find_spec("triton")
        base = os.path.join(os.path.dirname(spec.origin), "backends")
        have = sorted(d for d in ("nvidia", "amd") if os.path.isdir(os.path.join(base, d)))
        need = {"cuda": "nvidia", "rocm": "amd"}.get(platform)
        rows.append(dict(check="triton", status=FAIL if need and need not in have else OK,
                         detail=f"triton {tv}, compiler backends: {', '.join(have) or 'none'}"))
    torch_v = _version("torch")
    rows.append(dict(check="torch", status=OK if torch_v else WARN,
                     detail=f"torch {torch_v}" if torch_v else
                     "not installed: the Triton interpreter (CPU) and the AITER bridge need it"))
    if platform == "rocm" or importlib.util.find_spec("aiter") is not None:
        rows += _aiter_checks(platform)
    return rows


def _aiter_checks(platform: str) -> list[dict]:
    from jax_mla.backends.aiter import manifest

    try:
        found = manifest.check_installed()
    except Exception as e:  # noqa: BLE001 - a broken install is a finding, not a crash
        found = [f"checking the installed aiter failed: {e!r}"]
    pinned = manifest.load_manifest()["aiter_commit"][:12]
    if found is None:
        return [dict(check="aiter", status=WARN if platform == "rocm" else OK,
                     detail="not installed: backend='aiter' is unavailable (AITER comes with "
                            "the ROCm stack: ROCm/aiter)")]
    row = dict(check="aiter API", status=OK if not found else FAIL,
               detail=(f"matches the manifest pinned at ROCm/aiter {pinned}" if not found else
                       f"{len(found)} difference(s) from ROCm/aiter {pinned}: "
                       + "; ".join(found[:5])))
    return [row, *_known_bad_checks(platform)]


def _known_bad_checks(platform: str) -> list[dict]:
    """One line per kernel of the known-bad table that the kernel set plans read has (the
    installed AITER's ``mla_asm.csv``, or the static table where none is found): the kernel,
    the issue, and the route taken instead (or that the override or a fixed version keeps it).
    Off ROCm every arch the table names is checked."""
    from jax_mla.backends.aiter import bridge, known_bad, native
    from jax_mla.backends.aiter import capabilities as caps

    arch = caps.detect_arch() if platform == "rocm" else None
    arches = (arch,) if arch else tuple(sorted({row.arch for row in known_bad.KNOWN_BAD}))
    try:
        allowed = known_bad.allowed_kernels()
    except ValueError as e:
        return [dict(check="AITER known-bad kernels", status=FAIL, detail=str(e))]
    version = bridge.installed_version()
    said = f"AITER {version}" if version else "AITER's version unknown (taken as affected)"
    rows = []
    for a in arches:
        kernels = native.installed_kernel_set(a)
        for row in known_bad.present_in(kernels):
            if not known_bad.affects_version(row, version):
                status, then = OK, f"fixed from {row.fixed_in}: routes launch it"
            elif row.kernel in allowed:
                status, then = WARN, (f"{known_bad.ALLOW_ENV} allows it: routes of that shape "
                                      "launch it")
            else:
                status, then = WARN, (f"routes of that shape run {row.instead()} instead "
                                      f"({known_bad.ALLOW_ENV}={row.kernel} keeps it)")
            rows.append(dict(check=f"AITER known-bad kernel ({a})", status=status,
                             detail=f"{row.kernel} ({row.shape()}) is in {kernels.source}; "
                                    f"{row.issue}: {row.symptom}; {said}; {then}"))
    if not rows:
        rows.append(dict(check="AITER known-bad kernels", status=OK,
                         detail=f"none of the {len(known_bad.KNOWN_BAD)} kernel(s) of "
                                f"backends/aiter/known_bad.py is in the {', '.join(arches)} "
                                "kernel set(s) plans read"))
    return rows


def _launcher_checks(target) -> list[dict]:
    from jax_mla.backends.triton import ffi_launch

    reason = ffi_launch.unavailable_reason()
    if reason is not None:
        return [dict(check="FFI launcher", status=FAIL if target.gpu else WARN,
                     detail=f"{reason} (on CPU the Triton interpreter runs without it)")]
    rows = [dict(check="FFI launcher", status=OK,
                 detail=f"{ffi_launch.library_path()} ({ffi_launch.launch_mode()})")]
    if target.gpu:
        err = ffi_launch.driver_error(target.platform)
        rows[-1].update(status=FAIL if err else OK,
                        detail=rows[-1]["detail"] + (f"; driver: {err}" if err else
                                                     f"; {target.platform} driver reachable"))
    if target.platform == "rocm" and target.arch:
        from jax_mla.backends.aiter import native

        why = native.unavailable_reason(target.arch)
        rows.append(dict(check="AITER asm via FFI", status=OK if why is None else WARN,
                         detail="AITER's .co kernels launch through jax_mla_aiter_asm_mla" if
                         why is None else f"the Python bridge serves the asm route: {why}"))
        from jax_mla.backends.aiter import gluon_kernels, native_fmha, native_prefill

        for check, why, how in (
                ("AITER fp8 PS prefill via FFI", native_prefill.unavailable_reason(target.arch),
                 "mla_prefill_ps_asm_fwd's .co launches through jax_mla_aiter_asm_prefill_ps"),
                ("AITER FlashAttention prefill via FFI",
                 native_fmha.unavailable_reason(target.arch, num_cu=target.num_cores),
                 "fmha_v3_varlen_fwd's .co launches through jax_mla_aiter_asm_fmha_fwd"),
                ("AITER Gluon decode via FFI",
                 gluon_kernels.unavailable_reason(target, target.arch),
                 "AITER's Gluon MLA kernels launch through jax_mla_triton")):
            rows.append(dict(check=check, status=OK if why is None else WARN,
                             detail=how if why is None else f"the Python bridge serves it: {why}"))
    return rows


def _decode_checks(quick: bool) -> list[dict]:
    """A small DeepSeek-shaped decode (L 512, R 64, 16 heads, page 64) on every backend
    available here, jitted with its metadata, against the float64 oracle; bf16 on a GPU,
    float32 on a CPU (tolerances 2e-2 and 1e-5)."""
    import jax
    import jax.numpy as jnp

    import jax_mla
    from jax_mla.problem import current_platform
    from jax_mla.testing import numpy_mla_decode, rel_err

    gpu = current_platform() != "cpu"
    dtype, tol = (jnp.bfloat16, 2e-2) if gpu else (jnp.float32, 1e-5)
    rng = np.random.default_rng()
    b, h, ps, lr, rd = 3, 16, 64, 512, 64
    lens = rng.integers(1, 300 if quick else 1000, b).astype(np.int32)
    max_pages = -(-int(lens.max()) // ps)
    num_pages = b * max_pages + 2
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    cache = rng.standard_normal((num_pages, ps, lr + rd)).astype(np.float32)
    q = rng.standard_normal((b, h, lr + rd)).astype(np.float32)
    qj, cj = jnp.asarray(q, dtype), jnp.asarray(cache, dtype)
    want, _ = numpy_mla_decode(np.asarray(qj.astype(jnp.float32)),
                               np.asarray(cj.astype(jnp.float32)), table, lens, qlen=1,
                               scale=0.1, kv_lora_rank=lr)
    rows = []
    for backend in jax_mla.available_backends():
        def step(q, cache, table, lens, backend=backend):
            md = jax_mla.build_decode_metadata(table, lens, page_size=ps, q=q, kv_cache=cache,
                                               backend=backend)
            return jax_mla.mla_attention(q, cache, md, scale=0.1, backend=backend)

        try:
            f = jax.jit(step)
            args = (qj, cj, jnp.asarray(table), jnp.asarray(lens))
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(*args))
            first = time.perf_counter() - t0
            n = 3 if quick or not gpu else 50
            t0 = time.perf_counter()
            for _ in range(n):
                out = f(*args)
            jax.block_until_ready(out)
            per = (time.perf_counter() - t0) / n
            err = rel_err(np.asarray(out.astype(jnp.float32)), want)
            ok = bool(np.isfinite(err) and err < tol)
            rows.append(dict(check=f"decode {backend}", status=OK if ok else FAIL,
                             detail=f"B{b} H{h} page {ps} {jnp.dtype(dtype).name}: rel err "
                                    f"{err:.1e} (tolerance {tol:g}), first call {first:.2f} s "
                                    f"(compiles), then {per * 1e6:.0f} us per call (host wall "
                                    f"time, {n} calls)", rel_err=err, us_per_call=per * 1e6))
        except Exception as e:  # noqa: BLE001 - a backend that fails is the finding
            rows.append(dict(check=f"decode {backend}", status=FAIL, detail=repr(e)[:400]))
    return rows


def host_checks() -> list[dict]:
    """The platform, package and launcher checks (everything but the decode)."""
    from jax_mla.problem import current_platform, detect_target

    rows = _platform_checks()
    rows += _package_checks(current_platform())
    rows += _launcher_checks(detect_target())
    return rows


def run(quick: bool = False) -> list[dict]:
    return host_checks() + _decode_checks(quick)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the checks as a JSON list (with --validate: the report)")
    p.add_argument("--quick", action="store_true", help="shorter requests and fewer timed calls")
    p.add_argument("--validate", action="store_true",
                   help="validate this host (a ROCm one): conformance cases on AITER and Triton "
                        "vs a float64 oracle, AITER's kernels native or bridged, notebook 05's "
                        "path, a short bench; writes one JSON, prints VALIDATED or NOT "
                        "VALIDATED (jax_mla/validate.py)")
    p.add_argument("--out", metavar="FILE.json", default=None,
                   help="with --validate: where the JSON goes (default jax_mla_validate.json)")
    p.add_argument("--arch", choices=("gfx942", "gfx950"), default=None,
                   help="with --validate off ROCm: plan AITER's routes for this arch (default: "
                        "the AITER stand-in's, where the tests put it on sys.path)")


def main(args) -> int:
    if getattr(args, "validate", False):
        from jax_mla import validate

        return validate.main(args, host_checks=host_checks())
    rows = run(quick=args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        width = max(len(r["check"]) for r in rows)
        for r in rows:
            print(f"{r['status']:>4}  {r['check']:<{width}}  {r['detail']}")
        failed = sum(r["status"] == FAIL for r in rows)
        print(f"{len(rows)} checks, {failed} failed" + ("" if failed else ": this host is ready"))
    return 1 if any(r["status"] == FAIL for r in rows) else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m jax_mla.doctor")
    add_args(p)
    sys.exit(main(p.parse_args()))
