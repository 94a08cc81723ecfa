"""The device session's memcheck stage (``jax_mla.bench.session``), with the sanitizer and
pytest faked: one process a case, a retry only for a process that died of a signal, and one
row a case in ``memcheck.json`` whose result is the last try's."""

import json
import subprocess

import pytest

from jax_mla.bench import session


def _fake_run(outcomes, calls):
    """``subprocess.run`` for the stage: collection answers with ids; a sanitized case
    answers with the next outcome queued for it and writes its sanitizer log."""

    def run(cmd, capture_output=True, text=True, timeout=None, env=None):
        if "--collect-only" in cmd:
            file = cmd[cmd.index("--collect-only") + 1]
            ids = [f"{file}::test_{name}" for name in outcomes if name.startswith(
                "c" if "conformance" in file else "b")]
            return subprocess.CompletedProcess(cmd, 0, "\n".join(ids) + "\n\n2 tests", "")
        assert cmd[0] == "compute-sanitizer" and "--kernel-name" in cmd
        case = cmd[-1].split("::test_")[1]
        calls.append(case)
        kind = outcomes[case].pop(0)
        log = cmd[cmd.index("--log-file") + 1]
        with open(log, "w") as f:
            f.write("========= COMPUTE-SANITIZER\n")
            if kind != "signal":
                errors = 2 if kind == "errors" else 0
                f.write(f"========= ERROR SUMMARY: {errors} errors\n")
        if kind == "timeout":
            raise subprocess.TimeoutExpired(cmd, timeout)
        out = {"passed": (0, "1 passed in 3.1s"), "failed": (1, "1 failed in 2.0s"),
               "skipped": (0, "1 skipped in 0.4s"), "errors": (9, "1 passed in 3.0s"),
               "signal": (-11, "")}[kind]
        return subprocess.CompletedProcess(cmd, out[0], out[1], "")

    return run


def test_memcheck_stage_runs_a_process_a_case_and_retries_only_signals(tmp_path, monkeypatch):
    outcomes = {"c_ok": ["passed"], "c_flaky": ["signal", "signal", "passed"],
                "c_dies": ["signal"] * 3, "c_bad": ["errors"], "c_skip": ["skipped"],
                "b_fails": ["failed"], "b_slow": ["timeout"]}
    want = {"c_ok": ("passed", 1, 0), "c_flaky": ("passed", 3, 0),
            "c_dies": ("signal", 3, None), "c_bad": ("memcheck errors", 1, 2),
            "c_skip": ("skipped", 1, 0), "b_fails": ("failed", 1, 0),
            "b_slow": ("timeout", 1, 0)}
    calls = []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session.subprocess, "run", _fake_run(outcomes, calls))
    monkeypatch.delenv("JAX_MLA_MEMCHECK_ONLY", raising=False)
    session.stage_memcheck_conformance(None)
    rows = json.loads((tmp_path / "memcheck.json").read_text())
    assert len(rows) == len(want) and len(calls) == sum(t for _, t, _ in want.values())
    for row in rows:
        name = row["test"].split("::test_")[1]
        result, tries, errors = want[name]
        assert (row["result"], len(row["tries"]), row["errors"]) == (result, tries, errors), row
    signals = (tmp_path / "memcheck_signal.txt").read_text()
    assert signals.count("== tests/") == 5 and "c_dies" in signals and "c_ok" not in signals


@pytest.mark.parametrize("only, picked", [("c_ok,b_", ["c_ok", "b_x"]), ("1", ["c_x"])])
def test_memcheck_only_picks_cases_by_index_or_piece(tmp_path, monkeypatch, only, picked):
    outcomes = {"c_ok": ["passed"], "c_x": ["passed"], "b_x": ["passed"]}
    calls = []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session.subprocess, "run", _fake_run(outcomes, calls))
    monkeypatch.setenv("JAX_MLA_MEMCHECK_ONLY", only)
    session.stage_memcheck_conformance(None)
    assert calls == picked
