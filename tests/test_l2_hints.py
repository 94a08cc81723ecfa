"""Split partials are kept in L2 between the decode kernel and the reduce (``L2_HINTS``).

The decode kernels store partials ``evict_last`` and the reduce reads them ``evict_first``; the
hints change no result (the conformance suite runs with them), only where the lines live. On the
H200 the decode kernel ran 1-12 % faster with them at 11 of 14 shapes, the same at B=1, and
1.4 % slower at B=128, S=32k (``benchmarks/results/h200/RESULTS.md``). Here, without a
GPU: the hints are in the PTX of the Triton kernels compiled for sm_90, and
``JAX_MLA_TRITON_L2_HINTS=0`` takes them out. (The Gluon kernel's PTX is checked in
``test_gluon_sm90.py``.)
"""

import types

import numpy as np
import pytest

from conftest import has_triton_cuda_backend, run_compiler_script

SCRIPT = r"""
import json
import os
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jax_mla.backends.triton.aot import compile_report
from jax_mla.kernels.triton import decode

def compile_ptx(fn, names, types, consts):
    src = ASTSource(fn=fn, signature=dict(zip(names, types)) | dict.fromkeys(consts, "constexpr"),
                    constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(len(names))})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=1)).asm["ptx"]

def reduce_ptx(hints):
    names = ("part_out_ptr", "part_lse_ptr", "reduce_indptr_ptr", "final_map_ptr",
             "partial_map_ptr", "tiles_ptr", "out_in_ptr", "lse_in_ptr", "out_ptr", "lse_ptr")
    types = ["*fp32", "*fp32", "*i32", "*i32", "*i32", "*i32", "*bf16", "*fp32", "*bf16", "*fp32"]
    return compile_ptx(decode.mla_reduce_kernel, names, types,
               dict(H=16, L=512, BLOCK_H=16, BLOCK_L=16, BLOCK_S=8, MAX_ROWS=1, OFF64=False,
                    L2_HINTS=hints, PDL=False))

def affine_ptx(hints):
    names = ("part_out_ptr", "part_lse_ptr", "tiles_ptr", "tile_ptr_ptr", "out_in_ptr",
             "lse_in_ptr", "out_ptr", "lse_ptr")
    types = ["*fp32", "*fp32", "*i32", "*i32", "*bf16", "*fp32", "*bf16", "*fp32"]
    return compile_ptx(decode.mla_reduce_affine_kernel, names, types,
               dict(H=16, L=512, Q=2, BLOCK_H=16, BLOCK_L=16, BLOCK_S=8, OFF64=False,
                    L2_HINTS=hints, PDL=False))

out = {}
for hints in ("1", "0"):
    os.environ["JAX_MLA_TRITON_L2_HINTS"] = hints
    ptx = compile_report(16, 1, 64, wg_split=False)["ptx"]
    red = reduce_ptx(hints == "1")
    aff = affine_ptx(hints == "1")
    out[hints] = dict(
        affine_evict_first=len(re.findall(r"ld\.global[^;]*evict_first", aff)),
        affine_loads=len(re.findall(r"ld\.global", aff)),
        decode_evict_last=len(re.findall(r"st\.global[^;]*evict_last", ptx)),
        decode_stores=len(re.findall(r"st\.global", ptx)),
        reduce_evict_first=len(re.findall(r"ld\.global[^;]*evict_first", red)),
        reduce_loads=len(re.findall(r"ld\.global", red)))
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_partials_carry_l2_hints_in_the_ptx():
    r = run_compiler_script(SCRIPT, timeout=600)
    on, off = r["1"], r["0"]
    # The 16-row decode kernel: the partial stores (out and LSE) are hinted, the final ones not.
    assert 0 < on["decode_evict_last"] < on["decode_stores"], r
    assert off["decode_evict_last"] == 0 < off["decode_stores"], r
    # Both reduces: the partial reads are evict_first, the plan's integers are not.
    assert 0 < on["reduce_evict_first"] < on["reduce_loads"], r
    assert off["reduce_evict_first"] == 0, r
    assert 0 < on["affine_evict_first"] < on["affine_loads"], r
    assert off["affine_evict_first"] == 0 < off["affine_loads"], r


def test_l2_hints_knob_reaches_every_kernel(monkeypatch):
    from jax_mla.backends.triton import decode as td
    from jax_mla.backends.triton.plan import (
        TritonTuning,
        general_reduce_config,
        kernel_config,
        reduce_config,
    )
    from jax_mla.backends.triton.schedule import plan_splits
    from jax_mla.problem import as_target

    args = dict(num_heads=16, qlen=1, page_size=64, max_pages=4, kv_lora_rank=512, rope_dim=64,
                scale=0.1)
    seen = {}

    def fake_call(kernel, *a, **kw):
        seen[kernel.__name__] = kw["L2_HINTS"]
        return [np.zeros(s.shape, s.dtype) for s in kw["out_shapes"]]

    monkeypatch.setattr(td, "triton_call", fake_call)
    sched = types.SimpleNamespace(reduce_indptr=np.zeros(3, np.int32),
                                  reduce_final_map=np.zeros((2, 2), np.int32),
                                  reduce_partial_map=np.zeros(4, np.int32), qlen=1)
    lens = np.array([100, 7], np.int32)
    ours = plan_splits(lens, np.array([0, 100, 107], np.int32), qlen=1, block_n=16,
                       num_programs=4)
    out, lse = np.zeros((2, 16, 512), np.float32), np.zeros((2, 16), np.float32)
    target = as_target("cuda")
    for value, want in (("0", False), ("1", True), (None, True)):
        if value is None:
            monkeypatch.delenv("JAX_MLA_TRITON_L2_HINTS", raising=False)
        else:
            monkeypatch.setenv("JAX_MLA_TRITON_L2_HINTS", value)
        # The knob is read once, when a plan (its tile and reduce) is made.
        cfg = kernel_config(16, 1, 64, target, sm90=False)
        tuning = TritonTuning.from_env()
        assert td.decode_constexprs(cfg, **args)["L2_HINTS"] is want
        assert td.sm90_constexprs(cfg, **args)["L2_HINTS"] is want
        general = general_reduce_config(512, target, tuning.l2_hints)
        td.reduce_partials(out, lse, sched, out, lse, config=general, target="cuda")
        assert seen["mla_reduce_kernel"] is want  # AITER's layout
        affine = reduce_config(4, 2, 512, target, tuning)
        td.reduce_partials(out, lse, ours, out, lse, config=affine, target="cuda")
        assert seen["mla_reduce_affine_kernel"] is want  # this package's plans
