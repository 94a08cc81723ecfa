"""The device session's memcheck stage (``jax_mla.bench.session``), with the sanitizer and
pytest faked: one process a case, a retry only for a process that died of a signal, and one
row a case in ``memcheck.json`` whose result is the last try's."""

import json
import os
import subprocess

import pytest

from jax_mla.bench import session


def _fake_run(outcomes, calls, warmed=None):
    """``subprocess.run`` for the stage: collection answers with ids; a case's warm-up run
    passes; a sanitized case answers with the next outcome queued for it and writes its
    sanitizer log."""
    warmed = [] if warmed is None else warmed

    def run(cmd, capture_output=True, text=True, timeout=None, env=None):
        if "--collect-only" in cmd:
            file = cmd[cmd.index("--collect-only") + 1]
            ids = [f"{file}::test_{name}" for name in outcomes if name.startswith(
                "c" if "conformance" in file else "b")]
            return subprocess.CompletedProcess(cmd, 0, "\n".join(ids) + "\n\n2 tests", "")
        # The compilation cache never lands under $OUT, nor beside a nested one (the files
        # that come back from the device are few).
        cache = env["JAX_COMPILATION_CACHE_DIR"]
        assert cache and not cache.startswith(os.path.dirname(os.path.abspath(session.OUT)))
        assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
        if cmd[0] != "compute-sanitizer":  # the warm-up: the same case, no sanitizer
            assert "pytest" in cmd and "--log-file" not in cmd
            warmed.append(cmd[-1].split("::test_")[1])
            return subprocess.CompletedProcess(cmd, 0, "1 passed in 1.0s", "")
        assert "--kernel-name" in cmd
        case = cmd[-1].split("::test_")[1]
        assert warmed[-1:] == [case] or not session.MEMCHECK_WARM
        calls.append(case)
        kind = outcomes[case].pop(0)
        log = cmd[cmd.index("--log-file") + 1]
        with open(log, "w") as f:
            f.write("========= COMPUTE-SANITIZER\n")
            if kind != "signal":
                errors = 2 if kind == "errors" else 0
                f.write(f"========= ERROR SUMMARY: {errors} errors\n")
        if kind == "timeout":  # pytest's faulthandler has printed the stacks by then
            assert any(a.startswith("faulthandler_timeout=") for a in cmd)
            raise subprocess.TimeoutExpired(cmd, timeout, output=b"Timeout (0:02:55)!\n"
                                            b"Thread 0x1 (most recent call first):\n  in wait")
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
    calls, warmed = [], []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session.subprocess, "run", _fake_run(outcomes, calls, warmed))
    monkeypatch.setattr(session, "MEMCHECK_WARM", True)
    monkeypatch.delenv("JAX_MLA_MEMCHECK_ONLY", raising=False)
    session.stage_memcheck_conformance(None)
    rows = json.loads((tmp_path / "memcheck.json").read_text())
    assert len(rows) == len(want) and len(calls) == sum(t for _, t, _ in want.values())
    # Every sanitized try came after a warm-up of its own case, and says so.
    assert warmed == calls
    assert all(t["warm"]["rc"] == 0 for row in rows for t in row["tries"])
    for row in rows:
        name = row["test"].split("::test_")[1]
        result, tries, errors = want[name]
        assert (row["result"], len(row["tries"]), row["errors"]) == (result, tries, errors), row
    signals = (tmp_path / "memcheck_signal.txt").read_text()
    assert signals.count("== tests/") == 5 and "c_dies" in signals and "c_ok" not in signals
    stuck = (tmp_path / "memcheck_timeout.txt").read_text()
    assert stuck.startswith("== tests/") and "b_slow" in stuck and "in wait" in stuck


@pytest.mark.parametrize("only, picked", [("c_ok,b_", ["c_ok", "b_x"]), ("1", ["c_x"])])
def test_memcheck_only_picks_cases_by_index_or_piece(tmp_path, monkeypatch, only, picked):
    outcomes = {"c_ok": ["passed"], "c_x": ["passed"], "b_x": ["passed"]}
    calls, warmed = [], []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session.subprocess, "run", _fake_run(outcomes, calls, warmed))
    monkeypatch.setattr(session, "MEMCHECK_WARM", False)
    monkeypatch.setenv("JAX_MLA_MEMCHECK_ONLY", only)
    session.stage_memcheck_conformance(None)
    assert calls == picked and warmed == []
    rows = json.loads((tmp_path / "memcheck.json").read_text())
    assert not any("warm" in t for row in rows for t in row["tries"])


def test_the_one_call_stage_times_its_variants_with_every_timer(tmp_path, monkeypatch):
    """``one_call``: one ``bench.ab`` process over :data:`session.ONE_CALL_AB`'s variants (two
    calls, one sequence, one with PDL), runs in flight and calls back to back, the FFI library
    named, into ``one_call_ab.json``; shapes after ``--`` replace the default ones; variants
    parse as the A/B reads them."""
    from jax_mla.bench import ab

    seen = []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session, "_python",
                        lambda args, timeout, what, **env: seen.append((args, env)))
    session.stage_one_call(None)
    session.stage_one_call(["8,16,4096"])
    (args, env), (args2, _) = seen
    name, variants, shapes = session.ONE_CALL_AB
    assert args[:3] == ["-m", "jax_mla.bench.ab", str(tmp_path / name)]
    assert args[3:3 + len(variants)] == list(variants) and "--in-flight" in args
    assert "--serial" in args and env == {"JAX_MLA_FFI_LIBRARY": "/nowhere/lib.so"}
    assert args[args.index("--") + 1:args.index("--in-flight")] == list(shapes)
    assert args2[args2.index("--") + 1:args2.index("--in-flight")] == ["8,16,4096"]
    tunings = dict(ab.parse_variant(v) for v in variants)
    assert [t.one_call for t in tunings.values()] == [False, True, True]
    assert [t.pdl for t in tunings.values()] == [False, False, True]


def _junit(path, cases):
    """A JUnit file as pytest writes it: ``cases`` maps a test name to its outcome."""
    body = {"passed": "", "failed": '<failure message="boom"/>', "error": '<error message="x"/>',
            "skipped": '<skipped type="pytest.skip" message="no"/>',
            "xfailed": '<skipped type="pytest.xfail" message="known"/>'}
    rows = "".join(f'<testcase classname="tests.test_conformance" name="{name}" time="1.25">'
                   f"{body[outcome]}</testcase>" for name, outcome in cases.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}'
                    "</testsuite></testsuites>")


def test_junit_rows_reads_every_outcome_and_marks_unreported_cases_not_run(tmp_path):
    _junit(tmp_path / "a.xml", {"test_a": "passed", "test_b": "failed", "test_c": "error"})
    _junit(tmp_path / "b.xml", {"test_d": "skipped", "test_e": "xfailed"})
    ids = [f"tests/test_conformance.py::test_{k}" for k in "abcdef"]
    rows = session.junit_rows([str(tmp_path / "a.xml"), str(tmp_path / "b.xml"),
                               str(tmp_path / "missing.xml")], ids)
    assert [r["test"] for r in rows] == ids
    assert [r["outcome"] for r in rows] == ["passed", "failed", "failed", "skipped", "xfailed",
                                            "not run"]
    assert rows[0]["seconds"] == 1.25 and "seconds" not in rows[-1]


def test_conformance_shards_split_the_cases_and_interrupt_a_process_at_the_limit(
        tmp_path, monkeypatch):
    """Every collected case goes to exactly one shard process, each with the FFI library named
    and a share of the GPU's memory; a process past the wall limit gets SIGINT (so pytest
    still writes what it finished), and its unreached cases are ``not run``."""
    import signal

    ids = [f"tests/test_conformance.py::test_{i}[triton]" for i in range(7)]
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session, "CONFORMANCE_SHARDS", 3)
    monkeypatch.setattr(session, "CONFORMANCE_LIMIT", 0)
    monkeypatch.setattr(session.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, "\n".join(ids) + "\n\n7 tests collected", ""))
    started = []

    class Proc:
        def __init__(self, cmd, env, stdout, stderr):
            self.xml = next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1]
            self.cases = [a for a in cmd if "::" in a]
            self.env, self.signals, self.last = env, [], len(started) == 2
            started.append(self)
            stdout.write("..\n2 passed\n")

        def wait(self, timeout=None):
            if self.last and not self.signals:  # the slow shard: still running at the limit
                raise subprocess.TimeoutExpired("pytest", timeout)
            finished = self.cases[:1] if self.signals else self.cases
            _junit(__import__("pathlib").Path(self.xml),
                   {c.split("::")[1]: "passed" for c in finished})
            return 0

        def send_signal(self, sig):
            self.signals.append(sig)

    monkeypatch.setattr(session.subprocess, "Popen", Proc)
    session.stage_conformance_shards(None)
    assert sorted(c for p in started for c in p.cases) == sorted(ids) and len(started) == 3
    assert all(p.env["JAX_MLA_FFI_LIBRARY"] == "/nowhere/lib.so" for p in started)
    assert all(float(p.env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) <= 0.3 for p in started)
    assert [p.signals for p in started] == [[], [], [signal.SIGINT]]
    got = json.loads((tmp_path / "conformance_ffi.json").read_text())
    slow = started[2].cases
    assert got["summary"] == {"passed": 7 - len(slow) + 1, "not run": len(slow) - 1}
    assert [c["outcome"] for c in got["cases"] if c["test"] in slow[1:]] == ["not run"] * (
        len(slow) - 1)


def test_the_allocator_stage_runs_a_chain_process_per_allocator(tmp_path, monkeypatch):
    """``allocators``: one ``cmdbuf --chains`` process per allocator named in
    ``JAX_MLA_ALLOCATORS``, with that allocator's environment and XLA's update log on."""
    seen = []
    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session, "_python",
                        lambda args, timeout, what, **env: seen.append((args, env)))
    monkeypatch.setenv("JAX_MLA_ALLOCATORS", "default,temp_color,cuda_async")
    session.stage_allocators(["1,128,1024"])
    assert [a[2:4] for a, _ in seen] == [["--chains", str(tmp_path / f"alloc_{n}.json")]
                                         for n in ("default", "temp_color", "cuda_async")]
    assert all(a[-1] == "1,128,1024" and "--no-profile" in a for a, _ in seen)
    envs = [env for _, env in seen]
    assert "XLA_FLAGS" not in envs[0] and "XLA_PYTHON_CLIENT_ALLOCATOR" not in envs[0]
    assert envs[1]["XLA_FLAGS"] == "--xla_gpu_temp_buffer_use_separate_color=true"
    assert envs[2]["XLA_PYTHON_CLIENT_ALLOCATOR"] == "cuda_async"
    assert all(e["TF_CPP_VMODULE"] == session.ALLOCATOR_VMODULE for e in envs)


def test_the_anatomy_stage_merges_a_process_per_variant(tmp_path, monkeypatch):
    """``anatomy``: one ``cmdbuf --anatomy`` process per variant named in
    ``JAX_MLA_ANATOMY_VARIANTS``, with that variant's environment and command buffers kept on
    under the profiler; their rows in one ``anatomy.json``, each naming its variant (a process
    that wrote nothing adds no row)."""
    from jax_mla.bench import cmdbuf

    seen = []

    def fake_python(args, timeout, what, **env):
        seen.append((args, env))
        if "JAX_MLA_FFI_EMBED_BINARIES" in env:
            return 1  # wrote nothing
        with open(args[args.index("--anatomy") + 1], "w") as f:
            json.dump([{"shape": args[-1], "n": 16}], f)
        return 0

    monkeypatch.setattr(session, "OUT", str(tmp_path))
    monkeypatch.setattr(session, "_ffi_library", lambda: "/nowhere/lib.so")
    monkeypatch.setattr(session, "_python", fake_python)
    monkeypatch.setenv("JAX_MLA_ANATOMY_VARIANTS", "default,no_embed,tfrt")
    session.stage_anatomy(["8,16,4096"])
    assert [a[:3] for a, _ in seen] == [["-m", "jax_mla.bench.cmdbuf", "--anatomy"]] * 3
    assert all(a[3:] == [a[3], "--ns", "16,128", "--reps", "7", "8,16,4096"] for a, _ in seen)
    envs = [env for _, env in seen]
    assert all(e["XLA_FLAGS"] == cmdbuf.PROFILE_WITH_COMMAND_BUFFERS for e in envs)
    assert envs[1]["JAX_MLA_FFI_EMBED_BINARIES"] == "0"
    assert envs[2]["XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"] == "1"
    with open(tmp_path / "anatomy.json") as f:
        rows = json.load(f)
    assert rows == [{"variant": "default", "shape": "8,16,4096", "n": 16},
                    {"variant": "tfrt", "shape": "8,16,4096", "n": 16}]
