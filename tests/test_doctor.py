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
