"""``python -m jax_mla doctor``: one command that checks a host end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jax_mla
from jax_mla import doctor

from aiter_standin.harness import standin


def test_the_doctor_passes_on_this_host_and_checks_every_backend():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "jax_mla", "doctor", "--quick", "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout)
    checks = {row["check"]: row for row in rows}
    assert {"jax", "target", "triton", "torch", "FFI launcher"} <= set(checks), rows
    for backend in jax_mla.available_backends():
        row = checks[f"decode {backend}"]
        assert row["status"] == "ok" and row["rel_err"] < 1e-5, row
        assert row["us_per_call"] > 0, row
    assert all(row["status"] in ("ok", "warn") for row in rows), rows


def test_a_wrong_answer_fails_the_doctor(monkeypatch, capsys):
    import jax_mla.testing

    real = jax_mla.testing.numpy_mla_decode

    def off_by_one_percent(*a, **k):
        out, lse = real(*a, **k)
        return out * 1.01, lse

    monkeypatch.setattr(jax_mla.testing, "numpy_mla_decode", off_by_one_percent)
    monkeypatch.setattr(doctor, "_launcher_checks", lambda target: [])
    rc = doctor.main(doctor.argparse.Namespace(json=False, quick=True))
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "FAIL  decode xla" in text and "rel err 9.9e-03" in text, text


def test_the_doctor_checks_an_installed_aiter_against_the_manifest():
    with standin():
        rows = doctor._aiter_checks("rocm")
    assert rows[0]["check"] == "aiter API" and rows[0]["status"] == "ok", rows
    assert "matches the manifest pinned at ROCm/aiter e4048607" in rows[0]["detail"], rows
    assert np.all([r["status"] != "FAIL" for r in rows])


def test_the_doctor_says_how_the_launcher_is_registered(monkeypatch):
    """The FFI launcher's row says which stages are registered (the record stage where the
    library has it), whether XLA may put the calls in command buffers and when kernels load,
    with the measurement knob that changed it."""
    from jax_mla.backends.triton import ffi_launch
    from jax_mla.problem import detect_target

    if ffi_launch.unavailable_reason() is not None:
        pytest.skip(ffi_launch.unavailable_reason())
    for knob in ("JAX_MLA_FFI_INITIALIZE_STAGE", "JAX_MLA_FFI_COMMAND_BUFFERS",
                 "JAX_MLA_FFI_PRELOAD"):
        monkeypatch.delenv(knob, raising=False)
    [row] = [r for r in doctor._launcher_checks(detect_target()) if r["check"] == "FFI launcher"]
    assert row["detail"].count("execute stage only") == 1, row
    assert "command-buffer compatible, kernels load when traced" in row["detail"], row
    # Before a CUDA step is traced with launcher="ffi_record": whether the library has the
    # record stage; after, whether its target was registered, and why not.
    for tried, record, words in (
            ([], True, "record stage built (used by launcher='ffi_record')"),
            ([], False, "no record stage (FFI headers older than jaxlib 0.11)"),
            ([None], True, "record stage registered on CUDA (jax_mla_triton_record)"),
            (["no CUDA device in this process"], True, "no record stage (no CUDA device")):
        monkeypatch.setattr(ffi_launch, "record_available", lambda record=record: record)
        monkeypatch.setattr(ffi_launch, "_record_reason", tried)
        [row] = [r for r in doctor._launcher_checks(detect_target())
                 if r["check"] == "FFI launcher"]
        assert words in row["detail"], row
    monkeypatch.setenv("JAX_MLA_FFI_INITIALIZE_STAGE", "1")
    monkeypatch.setenv("JAX_MLA_FFI_COMMAND_BUFFERS", "0")
    monkeypatch.setenv("JAX_MLA_FFI_PRELOAD", "0")
    [row] = [r for r in doctor._launcher_checks(detect_target()) if r["check"] == "FFI launcher"]
    for words in ("initialize + execute stages", "JAX_MLA_FFI_COMMAND_BUFFERS=0",
                  "JAX_MLA_FFI_PRELOAD=0"):
        assert words in row["detail"], row


def _known_bad_lines(rows):
    return [r for r in rows if r["check"].startswith("AITER known-bad")]


def test_the_doctor_reports_the_known_bad_kernels_of_the_installed_aiter(tmp_path, monkeypatch):
    """A line per kernel of the known-bad table the kernel set plans read has (the installed
    ``mla_asm.csv``, or the static table where none is found): the kernel, the issue, the
    route taken instead, or that the override keeps it."""
    from test_aiter_kernel_set import PINNED_CSV, edit_csv, write_hsa

    from jax_mla.backends.aiter import bridge, known_bad, native

    (row,) = known_bad.KNOWN_BAD
    monkeypatch.delenv(known_bad.ALLOW_ENV, raising=False)
    root = write_hsa(tmp_path / "hsa")
    monkeypatch.setenv("AITER_ASM_DIR", str(root))
    with standin():
        (line,) = _known_bad_lines(doctor._aiter_checks("cpu"))
    assert line["status"] == "warn" and line["check"] == f"AITER known-bad kernel ({row.arch})"
    for part in (row.kernel, row.issue, row.symptom, row.replacement_kernel,
                 str(root / row.arch / "mla" / "mla_asm.csv"), "version unknown",
                 f"{known_bad.ALLOW_ENV}={row.kernel} keeps it"):
        assert part in line["detail"], (part, line)

    monkeypatch.setenv(known_bad.ALLOW_ENV, row.kernel)  # the override: launched, and said
    monkeypatch.setattr(bridge, "installed_version", lambda: "0.1.21.post1")
    with standin():
        (line,) = _known_bad_lines(doctor._aiter_checks("cpu"))
    assert line["status"] == "warn", line
    assert "AITER 0.1.21.post1" in line["detail"] and "allows it" in line["detail"], line
    monkeypatch.setenv(known_bad.ALLOW_ENV, "no_such_kernel")
    with standin():
        (line,) = _known_bad_lines(doctor._aiter_checks("cpu"))
    assert line["status"] == "FAIL" and "no_such_kernel" in line["detail"], line
    monkeypatch.delenv(known_bad.ALLOW_ENV)

    # an install without the kernel: one ok line
    qh64 = "_ZN5aiter39mla_a8w8_qh64_qseqlen1_gqaratio64_v3_psE"
    fixed = write_hsa(tmp_path / "without",
                      {"gfx942": edit_csv(PINNED_CSV["gfx942"], drop=[qh64])})
    monkeypatch.setenv("AITER_ASM_DIR", str(fixed))
    with standin():
        (line,) = _known_bad_lines(doctor._aiter_checks("cpu"))
    assert line["status"] == "ok" and "none of the 1 kernel(s)" in line["detail"], line

    # no hsa directory: plans read the static table (the pinned commit's), which has it
    monkeypatch.delenv("AITER_ASM_DIR")
    monkeypatch.setattr(native, "asm_dir", lambda: None)
    with standin():
        (line,) = _known_bad_lines(doctor._aiter_checks("cpu"))
    assert line["status"] == "warn" and "the static table" in line["detail"], line
    assert row.kernel in line["detail"] and row.replacement_kernel in line["detail"], line
