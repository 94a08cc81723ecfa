"""Decode/verify benchmark: every backend on the same shapes, in roofline terms (PERF.md)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla
from jax_mla.backends import current_platform, resolve_backend
from jax_mla.bench.timing import device_time, dispatch_time
from jax_mla.testing import rel_err

L, R = 512, 64
D = L + R


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq: int
    qlen: int = 1
    page: int = 64
    varlen: bool = False
    tag: str = ""

    @classmethod
    def parse(cls, spec: str) -> Shape:
        """``"B,H,S[,Q[,PAGE]]"``, e.g. ``"64,16,4096,4"`` (the GPU scripts' command lines)."""
        v = [int(x) for x in spec.split(",")]
        if not 3 <= len(v) <= 5:
            raise ValueError(f"shape {spec!r}: expected B,H,S[,Q[,PAGE]]")
        return cls(*v[:3], qlen=v[3] if len(v) > 3 else 1, page=v[4] if len(v) > 4 else 64)

    @property
    def name(self):
        v = " varlen" if self.varlen else ""
        return f"B{self.batch} H{self.heads} S{self.seq} Q{self.qlen} p{self.page}{v}"


def target_shapes(quick: bool = False) -> list[Shape]:
    """The issue's target grid (issue 3) plus the comparisons it asks for."""
    if quick:
        return [Shape(4, 16, 1024), Shape(4, 128, 1024), Shape(4, 16, 1024, qlen=2, page=1)]
    s = [Shape(b, 16, n, tag="h16") for b in (32, 64, 128) for n in (4096, 8192, 32768)]
    s += [Shape(128, 128, n, tag="h128") for n in (4096, 8192)] + [Shape(8, 128, 32768, tag="h128")]
    s += [Shape(64, 16, 4096, page=1, tag="page1"), Shape(128, 128, 4096, page=1, tag="page1")]
    s += [Shape(64, 16, 4096, qlen=q, tag="verify") for q in (2, 3, 4)]
    s += [Shape(64, 16, 4096, varlen=True, tag="varlen"),
          Shape(128, 16, 8192, varlen=True, tag="varlen")]
    s += [Shape(1, 16, 1024, tag="latency"), Shape(1, 128, 1024, tag="latency")]
    s += [Shape(128, 64, 4096, tag="h64"), Shape(128, 32, 4096, tag="h32")]
    return s


def lengths(shape: Shape, rng) -> np.ndarray:
    """Fixed lengths, or normal(mean, mean/2) clipped to [qlen, 2*mean] with the same total."""
    if not shape.varlen:
        return np.full(shape.batch, shape.seq, np.int64)
    x = rng.normal(shape.seq, shape.seq / 2, shape.batch)
    x = np.clip(x, shape.qlen, 2 * shape.seq)
    x = np.round(x * shape.seq * shape.batch / x.sum()).astype(np.int64)
    return np.clip(x, shape.qlen, 2 * shape.seq)


def make_inputs(shape: Shape, rng, dtype=jnp.bfloat16):
    lens = lengths(shape, rng)
    ps = shape.page
    pages = -(-lens // ps)
    max_pages = int(pages.max())
    total = int(pages.sum())
    perm = rng.permutation(total).astype(np.int32)  # shuffled block tables, as in serving
    table = np.zeros((shape.batch, max_pages), np.int32)
    k = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[k:k + n]
        k += n
    key = jax.random.key(int(rng.integers(2**31)))
    k1, k2 = jax.random.split(key)
    cache = jax.random.normal(k1, (total, ps, D), dtype)
    q = jax.random.normal(k2, (shape.batch * shape.qlen, shape.heads, D), dtype)
    return q, cache, jnp.asarray(table), jnp.asarray(lens, jnp.int32)


def roofline(shape: Shape, lens: np.ndarray, seconds: float, ceil: dict, kv_bytes=2) -> dict:
    kv = float(lens.sum()) * D * kv_bytes
    flops = 2.0 * shape.qlen * shape.heads * float(lens.sum()) * (D + L)
    return {
        "us": seconds * 1e6,
        "kv_TBps": kv / seconds / 1e12,
        "TFLOPs": flops / seconds / 1e12,
        "frac_copy": kv / seconds / ceil["copy_bytes_per_s"],
        "frac_matmul": flops / seconds / ceil["bf16_matmul_flops"],
    }


DEEPSEEK_SCALE = 1 / math.sqrt(192.0)  # pre-absorption head dim 128 + 64


def call_metadata(shape: Shape, table, lens, backend: str = "triton"):
    """The metadata (split plan included) :func:`attention_call` builds; built again after a
    knob that the plan reads has changed (``benchmarks/gpu_ab.py``)."""
    return jax.jit(lambda t, n: jax_mla.build_decode_metadata(
        t, n, page_size=shape.page, qlen=shape.qlen, num_heads=shape.heads,
        backend=backend))(table, lens)


def attention_call(shape: Shape, rng, backend: str = "triton", *, scale=DEEPSEEK_SCALE):
    """``(fn, args)``: one layer's ``mla_attention`` (with LSE) on fresh inputs for ``shape``,
    its metadata built once, as the GPU profiling scripts time it."""
    q, cache, table, lens = make_inputs(shape, rng)
    md = call_metadata(shape, table, lens, backend)

    def fn(q, cache, md):
        return jax_mla.mla_attention(q, cache, md, scale=scale, backend=backend, return_lse=True)

    return fn, (q, cache, md)


def run_shape(shape: Shape, backends, ceil: dict, rng, *, scale=DEEPSEEK_SCALE) -> list:
    q, cache, table, lens = make_inputs(shape, rng)
    lens_np = np.asarray(lens)
    rows, outs = [], {}
    for name in backends:
        impl = resolve_backend(name, current_platform())

        def build(table, lens, name=name):
            return jax_mla.build_decode_metadata(table, lens, page_size=shape.page,
                                                 qlen=shape.qlen, num_heads=shape.heads,
                                                 backend=name)

        def e2e(q, cache, md, name=name):
            # What a model calls once per layer: head padding, kernels, merge, unpadding.
            return jax_mla.mla_attention(q, cache, md, scale=scale, backend=name,
                                         return_lse=True)

        md = jax.jit(build)(table, lens)

        def kernels(q, cache, md, impl=impl):
            return impl.decode(q, cache, md, scale=scale, kv_lora_rank=L, q_scale=None,
                               kv_scale=None)

        t_e2e = device_time(e2e, q, cache, md)
        t_dispatch = dispatch_time(e2e, q, cache, md)  # cross-check: an upper bound
        t_k = device_time(kernels, q, cache, md) if name != "xla" else t_e2e
        # Metadata (and the split plan) is built once per step and shared by every layer.
        t_plan = device_time(build, table, lens)
        outs[name] = jax.jit(e2e)(q, cache, md)
        row = {"shape": shape.name, "tag": shape.tag, "backend": name, **dataclasses.asdict(shape),
               **roofline(shape, lens_np, t_e2e, ceil), "kernel_us": t_k * 1e6,
               "e2e_over_kernel": t_e2e / t_k, "metadata_us": t_plan * 1e6,
               "dispatch_us": t_dispatch * 1e6}
        rows.append(row)
    if "xla" in outs:
        ref_o, ref_l = outs["xla"]
        for row in rows:
            o, lse = outs[row["backend"]]
            row["rel_err_vs_xla"] = rel_err(o.astype(jnp.float32), ref_o.astype(jnp.float32))
            fin = np.isfinite(np.asarray(ref_l))
            row["lse_max_abs_err"] = float(np.max(np.abs(np.asarray(lse)[fin]
                                                          - np.asarray(ref_l)[fin])))
            row["speedup_vs_xla"] = [r for r in rows if r["backend"] == "xla"][0]["us"] / row["us"]
    return rows


def tune(plan, ceil: dict, rng, *, scale=DEEPSEEK_SCALE) -> list:
    """Kernel-only time of the Triton backend per tile config (env overrides) and shape.

    ``plan`` is a list of ``(Shape, [(block_n, num_warps, num_stages, ctas_per_sm[, max_rows
    [, wg_split[, min_block_m[, sm90]]]]), ...])``; a ``None`` leaves that knob at its default
    (``sm90``: the Gluon kernel for 64-row tiles on Hopper).
    """
    import os

    impl = resolve_backend("triton", current_platform())
    names = ("JAX_MLA_TRITON_BLOCK_N", "JAX_MLA_TRITON_WARPS", "JAX_MLA_TRITON_STAGES",
             "JAX_MLA_TRITON_CTAS_PER_SM", "JAX_MLA_TRITON_MAX_ROWS", "JAX_MLA_TRITON_WG_SPLIT",
             "JAX_MLA_TRITON_MIN_BLOCK_M", "JAX_MLA_TRITON_SM90_KERNEL")
    rows = []
    for shape, configs in plan:
        q, cache, table, lens = make_inputs(shape, rng)
        # Every config's output is checked against the XLA backend on the same inputs.
        ref_md = jax_mla.build_decode_metadata(table, lens, page_size=shape.page, qlen=shape.qlen,
                                               num_heads=shape.heads, backend="xla")
        ref = jax_mla.mla_attention(q, cache, ref_md, scale=scale, backend="xla")
        ref = np.asarray(ref.astype(jnp.float32))
        for cfg in configs:
            env = {k: v for k, v in zip(names, cfg) if v is not None}
            os.environ.update({k: str(int(v)) for k, v in env.items()})
            row = {"shape": shape.name, "block_n": cfg[0], "num_warps": cfg[1],
                   "num_stages": cfg[2], "ctas_per_sm": cfg[3] if len(cfg) > 3 else None,
                   "max_rows": cfg[4] if len(cfg) > 4 else None,
                   "wg_split": cfg[5] if len(cfg) > 5 else None,
                   "min_block_m": cfg[6] if len(cfg) > 6 else None,
                   "sm90": cfg[7] if len(cfg) > 7 else None}
            try:
                md = jax_mla.build_decode_metadata(table, lens, page_size=shape.page,
                                                   qlen=shape.qlen, num_heads=shape.heads,
                                                   backend="triton")

                def kernels(q, cache, md):
                    return impl.decode(q, cache, md, scale=scale, kv_lora_rank=L, q_scale=None,
                                       kv_scale=None)

                t = device_time(kernels, q, cache, md)
                out = np.asarray(jax.jit(kernels)(q, cache, md)[0].astype(jnp.float32))
                rows.append({**row, **roofline(shape, np.asarray(lens), t, ceil),
                             "rel_err_vs_xla": rel_err(out, ref)})
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is data too
                rows.append({**row, "error": repr(e)[:300]})
            finally:
                for k in env:
                    os.environ.pop(k, None)
            print("tune", rows[-1], flush=True)
    return rows
