"""Ahead-of-time compiles of the Triton backend's kernels, with no GPU: what each launch would
compile to (shared memory, wgmma shapes, TTGIR, PTX). Used by the compile tests and tuning.

Needs Triton's real compiler: not under ``TRITON_INTERPRET=1`` (run these in a process that
did not choose the interpreter).
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax.numpy as jnp

from jax_mla import env
from jax_mla.backends.triton.compiler import compile_for_target
from jax_mla.backends.triton.decode import decode_constexprs, sm90_constexprs
from jax_mla.backends.triton.plan import kernel_config
from jax_mla.backends.triton.prefill import LOG2E, PrefillTritonConfig, head_dim_split, pick_config


def _check_compiler():
    if env.interpreter_enabled():
        raise RuntimeError("ahead-of-time compiles need TRITON_INTERPRET unset before triton is "
                           "imported")


def _decode_kernels():
    from jax_mla.kernels.triton import decode

    return decode


def wgmma_shapes(ptx: str) -> dict:
    """``{"m64n32k16": count, ...}``: the wgmma instructions in ``ptx``."""
    return dict(collections.Counter(
        re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))


def _decode_signature(consts: dict, q: str = "bf16", kv: str = "bf16") -> dict:
    """Signature, constexprs and alignment attributes of a decode launch (every decode kernel
    takes the same arrays; a bf16 query and cache unless ``q`` / ``kv`` name Triton types such
    as ``fp8e4nv``; the output is bf16), for ahead-of-time compiles."""
    names = ("q_ptr", "kv_ptr", "bt_ptr", "kv_indptr_ptr", "work_indptr_ptr", "work_ptr",
             "kv_scale_ptr", "out_ptr", "lse_ptr", "part_out_ptr", "part_lse_ptr")
    types = [f"*{q}", f"*{kv}"] + ["*i32"] * 4 + ["*fp32", "*bf16"] + ["*fp32"] * 3
    return dict(signature=dict(zip(names, types)) | dict.fromkeys(consts, "constexpr"),
                constexprs=consts,
                attrs={(i,): [["tt.divisibility", 16]] for i in range(len(names))})


def compile_report(num_heads: int, qlen: int = 1, page_size: int = 64, *, wg_split: bool,
                   kv_lora_rank: int = 512, rope_dim: int = 64, arch: int = 90) -> dict:
    """Compile the bf16 decode kernel for ``sm_<arch>`` as jax-triton would (no GPU needed).

    The tile is the Hopper one for ``num_heads`` x ``qlen`` with ``wg_split`` forced; with it the
    TTGIR goes through ``compiler.split_broadcast_wgmma`` and is compiled from the rewritten
    text. Returns ``{"shared": bytes, "rewrites": int, "wgmma": {shape: count in the PTX},
    "ttgir": str, "ptx": str, "config": KernelConfig}``. Needs TRITON_INTERPRET unset.
    """
    from triton.backends.compiler import GPUTarget

    _check_compiler()
    cfg = dataclasses.replace(kernel_config(num_heads, qlen, page_size, "cuda", sm90=False),
                              wg_split=wg_split)
    consts = decode_constexprs(cfg, num_heads=num_heads, qlen=qlen, page_size=page_size,
                               max_pages=64, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                               scale=1 / 192 ** 0.5)
    cc, rewrites = compile_for_target(
        _decode_kernels().mla_decode_kernel, **_decode_signature(consts),
        target=GPUTarget("cuda", arch, 32), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dict(shared=cc.metadata.shared, rewrites=rewrites, wgmma=wgmma_shapes(cc.asm["ptx"]),
                ttgir=cc.asm["ttgir"], ptx=cc.asm["ptx"], config=cfg)


def sm90_compile_report(num_heads: int, qlen: int = 1, page_size: int = 64, *,
                        arch: int = 90, fp8: str | None = None, query: str = "fp8e4nv") -> dict:
    """Compile a Gluon sm_90 decode kernel as the backend would (no GPU needed): the bf16 one,
    or with ``fp8`` (the cache's Triton type, ``fp8e4nv`` or ``fp8e5``) the fp8 one with both
    scales, for an e4m3 query (``query``, the default) or a 16-bit one (``"bf16"``/``"fp16"``,
    split in two e4m3 parts before it, which the kernel takes).

    Returns ``{"shared": bytes, "num_warps": total warps, "wgmma": {shape: count in the PTX},
    "ptx": str, "config": KernelConfig}``. Needs TRITON_INTERPRET unset.
    """
    from triton.backends.compiler import GPUTarget

    from jax_mla.backends.triton.decode import _sm90_kernel

    _check_compiler()
    kv_dtype = None if fp8 is None else jnp.float8_e4m3fn
    cfg = kernel_config(num_heads, qlen, page_size, "cuda", kv_dtype=kv_dtype)
    if not cfg.sm90:
        raise ValueError(f"{num_heads} heads x Q={qlen} is not served by the sm_90 kernel")
    consts = sm90_constexprs(cfg, num_heads=num_heads, qlen=qlen, page_size=page_size,
                             max_pages=64, kv_lora_rank=512, rope_dim=64, scale=1 / 192 ** 0.5)
    types = {}
    if fp8 is not None:
        split = not query.startswith("fp8")
        consts |= dict(HAS_KV_SCALE=True, HAS_Q_SCALE=not split, SPLIT_Q=split, SPLIT_ACC=False)
        types = dict(q="fp8e4nv" if split else query, kv=fp8)  # split: the two e4m3 parts
    cc, _ = compile_for_target(_sm90_kernel(fp8 is not None),
                               **_decode_signature(consts, **types),
                               target=GPUTarget("cuda", arch, 32), num_warps=cfg.num_warps)
    return dict(shared=cc.metadata.shared, num_warps=cc.metadata.num_warps,
                wgmma=wgmma_shapes(cc.asm["ptx"]), ptx=cc.asm["ptx"], config=cfg)


def prefill_compile_report(dtype, dqk: int, dv: int, *, causal: bool = True,
                           num_heads: int = 16, config: PrefillTritonConfig | None = None,
                           arch: int = 90) -> dict:
    """Compile the prefill kernel ahead of time for ``sm_<arch>`` (no GPU needed) and report on it.

    Returns ``{"shared": bytes, "pipelined": bool (async copies present), "ttgir": str,
    "ptx": str, "config": PrefillTritonConfig}``. Uses the same constexprs and 16-byte pointer
    alignment that jax-triton assumes. Needs the real compiler, so not under TRITON_INTERPRET=1.
    """
    _check_compiler()
    from triton.backends.compiler import GPUTarget

    from jax_mla.kernels.triton.prefill import prefill_fwd_kernel

    tt = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16",
          jnp.dtype(jnp.float32): "fp32"}[jnp.dtype(dtype)]
    config = config or pick_config(dqk, dv, dtype)
    d1, d2, bdv = head_dim_split(dqk, dv)
    names = ("Q", "K", "V", "CU_Q", "CU_K", "BLK_SEQ", "BLK_M0", "Out", "Lse")
    sig = dict(zip(names, [f"*{tt}"] * 3 + ["*i32"] * 4 + [f"*{tt}", "*fp32"]))
    consts = dict(QK_SCALE=dqk ** -0.5 * LOG2E, H=num_heads, DQK=dqk, DV=dv, D1=d1,
                  D2=max(d2, 16), BLOCK_DV=bdv, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                  CAUSAL=bool(causal), UPCAST=False, IEEE=tt == "fp32")
    sig.update(dict.fromkeys(consts, "constexpr"))
    cc, _ = compile_for_target(
        prefill_fwd_kernel, signature=sig, constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in range(len(names))},
        target=GPUTarget("cuda", arch, 32), num_warps=config.num_warps,
        num_stages=config.num_stages)
    ttgir = cc.asm["ttgir"]
    return dict(shared=cc.metadata.shared, pipelined="async_copy_global_to_local" in ttgir,
                ttgir=ttgir, ptx=cc.asm["ptx"], config=config)
