"""``python -m jax_mla doctor --validate``: the host validation, run on CPU with the AITER
stand-in (``tests/aiter_standin``) and Triton's interpreter, small shapes."""

import argparse
import json

import numpy as np
import pytest

from jax_mla import testing, validate
from jax_mla.__main__ import main as cli
from jax_mla.backends.aiter import bridge
from jax_mla.problem import Target

import oracle
from aiter_standin.harness import forced_standins


def _report(path):
    with open(path) as f:
        return json.load(f)


def test_validate_with_the_standin_runs_every_case_and_says_what_ran_where(tmp_path, capsys):
    out = tmp_path / "validate.json"
    with forced_standins() as enter:
        enter(arch="gfx950", cu_num=8)
        rc = cli(["doctor", "--validate", "--quick", "--out", str(out)])
    text = capsys.readouterr().out
    last = text.strip().splitlines()[-1]
    assert rc == 0, text[-4000:]
    assert last.startswith("VALIDATED: ") and "failed" not in last, last
    assert "AITER = the stand-in (not AMD hardware)" in last and "interpreter" in last, last
    report = _report(out)
    assert report["validated"] and report["verdict"] in last
    rows = report["cases"]
    assert {r["section"] for r in rows} == {"doctor", "conformance", "notebook05", "bench"}
    assert all(r["status"] == "pass" for r in rows), [r for r in rows if r["status"] != "pass"]
    for r in rows:
        assert {"name", "section", "backend", "status", "seconds"} <= r.keys(), r
    conf = [r for r in rows if r["section"] == "conformance"]
    want = {(c.name, b) for c in validate.DECODE_CASES for b in c.backends}
    want |= {(c.name, b) for c in validate.PREFILL_CASES for b in ("aiter", "triton")}
    assert {(r["name"], r["backend"]) for r in conf} == want
    for r in conf:
        assert r["rel_err"] < r["tolerance"] and r["route"], r
        assert r["path"] == ("Python bridge to the stand-in" if r["backend"] == "aiter"
                             else "Triton interpreter"), r
    aiter = [r for r in conf if r["backend"] == "aiter"]
    # gfx950's routes: asm (persistent, fp8, LSE), Gluon decode and verify, both prefills
    assert {r["route"].split()[0] for r in aiter} >= {"asm", "gluon_decode", "gluon_verify",
                                                      "flash_attn_varlen_func",
                                                      "mla_prefill_ps_asm_fwd"}
    assert {r["q_dtype"] for r in aiter} >= {"bfloat16", "float8_e4m3fn"}
    assert any(r["lse_err"] is not None for r in aiter)
    fams = {k["family"]: k for k in report["kernels"]}
    assert set(fams) == {"asm decode", "fp8 PS prefill", "FlashAttention v3 prefill",
                         "Gluon decode"}
    for k in fams.values():
        assert k["ran"] == "bridge" and "not a ROCm host" in k["why_not_native"], k
    assert "stand-in" in report["ran_on"]["aiter"] and "not AMD hardware" in \
        report["ran_on"]["aiter"]
    assert "interpreter" in report["ran_on"]["triton"]
    nb = {r["name"]: r for r in rows if r["section"] == "notebook05"}
    assert nb["backend"]["backend"] == "aiter"
    assert nb["decode aiter vs xla"]["rel_err"] < 1e-2
    assert sum(name.startswith("route gfx950") for name in nb) == 7
    bench = [r for r in rows if r["section"] == "bench"]
    assert {r["backend"] for r in bench} == {"aiter", "triton"}
    assert all(r["us_per_call"] > 0 for r in bench)


def test_a_kernel_off_by_five_percent_is_not_validated(tmp_path, monkeypatch, capsys):
    """AITER's asm decode answering 5 % high (every gfx942 decode case routes to it): those
    cases fail against the oracle, Triton's pass, the verdict says how many, exit status 1."""
    real = bridge.asm_decode

    def wrong(*a, **k):
        out, lse = real(*a, **k)
        return out * 1.05, lse

    monkeypatch.setattr(bridge, "asm_decode", wrong)
    monkeypatch.setattr(validate, "notebook05", lambda host: [])
    monkeypatch.setattr(validate, "bench", lambda host: [])
    out = tmp_path / "v.json"
    with forced_standins() as enter:
        enter(arch="gfx942", cu_num=8)
        rc = validate.main(argparse.Namespace(quick=True, json=False, out=str(out), arch=None))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    rows = _report(out)["cases"]
    failed = {(r["name"], r["backend"]) for r in rows if r["status"] == "fail"}
    asm = {(r["name"], "aiter") for r in rows if r.get("family") == "asm decode"}
    assert rc == 1 and len(asm) == 9, (rc, asm)
    assert failed == asm, failed
    assert last.startswith(f"NOT VALIDATED: 9 of {len(rows)} failed"), last
    assert all("rel err" in r["detail"] for r in rows if r["status"] == "fail")
    assert {r["kv_dtype"] for r in rows if "fp8" in r["name"] and "kv_dtype" in r} == {
        "float8_e4m3fnuz"}
    assert not _report(out)["validated"]


def test_a_backend_that_cannot_run_is_skipped_off_rocm_and_fails_on_rocm(monkeypatch):
    monkeypatch.setattr(bridge, "aiter_importable", lambda: False)
    monkeypatch.setattr(validate, "notebook05", lambda host: [])
    monkeypatch.setattr(validate, "bench", lambda host: [])
    monkeypatch.setattr(validate, "PREFILL_CASES", ())
    case = validate.DECODE_CASES[0]
    monkeypatch.setattr(validate, "DECODE_CASES", (case,))
    report = validate.run(quick=True)
    aiter, triton = report["cases"]
    assert aiter["status"] == "skip" and "not importable" in aiter["detail"], aiter
    assert triton["status"] == "pass", triton
    assert report["verdict"] == "VALIDATED: 1 of 1 passed (1 skipped)"
    assert report["ran_on"]["aiter"].startswith("not run: ")
    # On ROCm nothing may be skipped: AITER missing there is a failure.
    monkeypatch.setattr(validate, "DECODE_CASES", (validate.DecodeCase(
        case.name, case.what, 16, 1, 64, "bf16", "bf16", backends=("aiter",)),))
    monkeypatch.setattr(validate, "detect_target", lambda: Target("rocm", "gfx942", 304))
    report = validate.run(quick=True)
    (row,) = report["cases"]
    assert row["status"] == "fail" and report["verdict"] == "NOT VALIDATED: 1 of 1 failed"


def test_the_package_oracles_agree_with_the_suites_and_the_bounds_catch_faults():
    from test_prefill_oracle import varlen_attention

    rng = np.random.default_rng(0)
    c = testing.make_case(rng, seq_lens=[30, 0, 1, 17], qlen=2, num_heads=3, page_size=8,
                          kv_lora_rank=32, rope_dim=16)
    got = testing.numpy_mla_decode(c.q, c.cache, c.block_table, c.seq_lens, qlen=2,
                                   scale=c.scale, kv_lora_rank=32)
    want = oracle.mla_decode(c.q, c.cache, c.block_table, c.seq_lens, qlen=2, page_size=8,
                             scale=c.scale, kv_lora_rank=32)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    cu = np.array([0, 9, 9, 20], np.int32)
    q, k, v = (rng.standard_normal((22, 2, d)) for d in (12, 12, 8))
    want = varlen_attention(q, k, v, cu, cu, scale=0.3, causal=True)
    for x in (q, k, v):
        x[20:] = np.nan  # padding rows: never read
    got = testing.numpy_varlen_prefill(q, k, v, cu, scale=0.3, causal=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)

    out, lse = want
    assert testing.oracle_errors(out, out, tol=1e-5, lse=lse, want_lse=lse)["failures"] == []
    bad = out.copy()
    bad[20] = 1.0  # a padding row written
    assert any("empty row" in f for f in testing.oracle_errors(
        bad, out, tol=1.0, lse=lse, want_lse=lse)["failures"])
    bad_lse = lse.copy()
    bad_lse[21] = 0.0
    assert "empty rows must have lse -inf" in testing.oracle_errors(
        out, out, tol=1e-5, lse=bad_lse, want_lse=lse)["failures"]
    nan = out.copy()
    nan[0, 0, 0] = np.nan
    errs = testing.oracle_errors(nan, out, tol=1e-5)["failures"]
    assert any("non-finite" in f for f in errs), errs


@pytest.mark.parametrize("x, s", [(float("inf"), "inf"), (np.float32("nan"), "nan"),
                                  (np.int64(3), 3)])
def test_the_json_is_strict(x, s):
    assert validate._clean({"a": [x]}) == {"a": [s]}
