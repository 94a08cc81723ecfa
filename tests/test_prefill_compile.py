"""The Triton prefill kernel compiles for Hopper (sm_90) with the real compiler, on CPU.

The interpreter runs the kernel's arithmetic; this checks what it cannot: that the source lowers
through Triton's GPU pipeline, that the default tiles fit Hopper's shared memory, that the key
loop is software-pipelined (async copies), and, when ptxas can say so, that nothing spills.
Runs in a subprocess because the test process has TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest

from conftest import has_triton_cuda_backend, run_compiler_script

SCRIPT = r"""
import json
import jax.numpy as jnp
from jax_mla.backends.triton.launch import ptxas_spills
from jax_mla.backends.triton.aot import prefill_compile_report as compile_report
out = {}
for name, dtype, dqk, dv, causal in [("bf16_192_128_causal", jnp.bfloat16, 192, 128, True),
                                     ("bf16_192_128", jnp.bfloat16, 192, 128, False),
                                     ("fp16_128_128_causal", jnp.float16, 128, 128, True),
                                     ("fp32_192_128_causal", jnp.float32, 192, 128, True)]:
    r = compile_report(dtype, dqk, dv, causal=causal)
    out[name] = dict(shared=r["shared"], pipelined=r["pipelined"], spills=ptxas_spills(r["ptx"]))
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_kernel_compiles_for_sm90():
    report = run_compiler_script(SCRIPT, timeout=300)
    for name, r in report.items():
        assert r["shared"] <= 227 * 1024, (name, r)
        assert r["pipelined"], (name, r)
        if r["spills"] is not None and not name.startswith("fp32"):
            assert r["spills"] == 0, (name, r)
