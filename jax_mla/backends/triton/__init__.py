"""``backend="triton"``: split-KV Triton decode/verify and a varlen flash-attention prefill.

- ``plan.py``: the route (tile, Triton or Gluon kernel, split plan, reduce), decided once.
- ``schedule.py``: the persistent split-KV schedule, in jnp or as one Triton program.
- ``decode.py``: the decode call (split kernel, then reduce), as the plan says.
- ``prefill.py``: the prefill kernel's tiles and launch.
- ``launch.py``: kernels inside ``jax.jit`` (our FFI launcher or jax-triton on GPUs, the
  interpreter on CPU); ``ffi_launch.py``: the FFI launcher (``docs/launcher.md``).
- ``compiler.py``: hooks in the kernel compile (the Hopper TTGIR rewrite, Gluon kernels).
- ``aot.py``: ahead-of-time compile reports (no GPU needed).

Kernel sources live in ``jax_mla/kernels``. Nothing here imports triton at import time.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_mla.backends.base import Backend, dequantize_qkv, out_dtype
from jax_mla.backends.triton import decode as _decode
from jax_mla.backends.triton import launch
from jax_mla.backends.triton.plan import TritonPlan, TritonTuning, make_plan
from jax_mla.backends.triton.prefill import PrefillTritonConfig, prefill_triton
from jax_mla.backends.triton.schedule import plan_splits, plan_splits_kernel
from jax_mla.problem import Target

__all__ = ["PrefillTritonConfig", "TritonBackend", "TritonPlan", "TritonTuning"]


class TritonBackend(Backend):
    """Triton kernels on CUDA and ROCm (our FFI launcher or jax-triton), and on CPU through
    the interpreter."""

    name = "triton"
    platforms = ("cpu", "cuda", "rocm")

    def unavailable_reason(self, target: Target) -> str | None:
        return super().unavailable_reason(target) or launch.unavailable_reason(target.platform)

    def plan(self, problem, *, tuning: TritonTuning | None = None, **options) -> TritonPlan:
        if options:
            raise TypeError(f"backend='triton' takes no planning options {sorted(options)}; "
                            "pass tuning=TritonTuning(...)")
        if tuning is not None and not isinstance(tuning, TritonTuning):
            raise TypeError(f"tuning must be a TritonTuning, got {type(tuning).__name__}")
        return make_plan(self.name, problem, tuning)

    def schedule(self, plan: TritonPlan, metadata, *, seq_lens=None):
        """The split schedule (``schedule.SplitSchedule``) the plan's kernels walk: one Triton
        program (``plan.planner == "kernel"``) or XLA ops, the same arrays either way.

        The planning program also clamps the lengths and computes their offsets (the schedule's
        ``seq_lens`` and ``kv_indptr``, which ``metadata.with_schedule`` moves into the
        metadata the decode kernels read): from ``seq_lens``, the step's lengths as the caller
        gave them, where given, so that the metadata's own clamp and cumulative sum are left
        unused and XLA drops them (two kernels fewer a step)."""
        kw = dict(qlen=metadata.qlen, block_n=plan.kernel.block_n,
                  num_programs=plan.num_programs, num_head_blocks=plan.kernel.num_head_blocks,
                  mode=plan.split_mode)
        if plan.planner == "kernel":
            lens = metadata.seq_lens if seq_lens is None else seq_lens
            return plan_splits_kernel(lens, max_len=metadata.max_pages * metadata.page_size,
                                      target=plan.problem.target, launcher=plan.launcher,
                                      **kw)
        return plan_splits(metadata.seq_lens, metadata.paged_kv_indptr, **kw)

    def decode(self, q, kv_cache, metadata, *, plan, scale, q_scale, kv_scale, return_lse):
        # The kernel masks partial head blocks itself: no padding (plan.padded_heads == H).
        return _decode.decode(q, kv_cache, metadata, plan=plan, scale=scale, q_scale=q_scale,
                              kv_scale=kv_scale)

    def check_prefill(self, q, k, v, *, config) -> None:
        if config is not None and not isinstance(config, PrefillTritonConfig):
            raise TypeError(f"config must be a PrefillTritonConfig for backend='triton', got "
                            f"{type(config).__name__}")

    def prefill(self, q, k, v, cu_q, cu_k, *, scale, causal, target, max_seqlen, max_seqlen_k,
                config=None, return_lse=True, q_scale=None, k_scale=None, v_scale=None):
        # No fp8 kernel: fp8 inputs run the exact float32 path (out in bf16).
        odt = out_dtype(q.dtype)
        q, k, v = dequantize_qkv(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        t = q.shape[0]
        cu_k = cu_q if cu_k is None else cu_k
        # A trailing key-less sequence covers padding rows, so the kernel writes every row.
        cu_q = jnp.concatenate([cu_q, jnp.full((1,), t, jnp.int32)])
        cu_k = jnp.concatenate([cu_k, cu_k[-1:]])
        out, lse = prefill_triton(q, k, v, cu_q, cu_k, scale=scale, causal=causal,
                                  target=target, config=config)
        return out.astype(odt), lse
