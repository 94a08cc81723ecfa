"""The property-based fuzz suite (``fuzz_cases.py``) on every CPU backend, each run in its own
process: random valid problems against the float64 oracle, random invalid ones against the
documented errors (eager and ``jax_mla.checked``) and the unchecked result. A crash inside a
kernel is a failed test with its output, not a lost test run. A fixed budget of examples keeps
it within CI time; every run draws fresh ones."""

import os
import subprocess
import sys

import pytest

import jax_mla

BACKENDS = [b for b in jax_mla.available_backends() if b != "aiter"]
EXAMPLES = {"xla": 25, "triton": 10}  # the Triton interpreter costs seconds an example
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["valid", "invalid"])
def test_fuzz_in_a_subprocess(backend, kind):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, os.path.join(HERE, "fuzz_cases.py"), kind, backend,
                          str(EXAMPLES.get(backend, 10))], capture_output=True, text=True,
                         env=env, timeout=900)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, f"rc={res.returncode} (negative: killed by a signal)\n{tail}"
    assert res.stdout.strip().splitlines()[-1].startswith("ok"), tail
