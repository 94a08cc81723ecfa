"""Decode/verify benchmark: every backend on the same shapes, two timers, in roofline terms.

Each row times one layer's ``mla_attention`` (head padding, kernels, merge, unpadding) with its
metadata built once, as a model step shares it across layers:

- ``us``: *stream time*, the wall time per call in a chain of dependent calls
  (``timing.device_time``), and the roofline figures from it (TB/s of KV read, TFLOP/s, fractions
  of the ceilings measured in the same run; FLOPs and bytes as in docs/design.md §10);
- ``gpu_us``: *GPU time*, the CUPTI sum of the call's kernels (``profile.kernel_times``, on a
  CUDA GPU with torch), with ``launches`` per call. It is measured in a second pass
  (:func:`gpu_time_rows`), after every stream time: once CUPTI has traced a process, every launch
  in it costs more, which a stream time would then count;
- ``kernel_us``: the backend's ``decode`` alone (no padding or casts) in the same chain;
- ``metadata_us`` / ``metadata_gpu_us`` / ``metadata_launches``: building the step's metadata
  and plan arrays, once per step.

Where FlashMLA is built (``peers.py``), a ``flashmla`` row times it on the same buffers by the
same timers (its stream time: a CUDA graph of dependent calls).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla
from jax_mla.backends import get_backend
from jax_mla.bench import peers, profile
from jax_mla.bench.timing import device_time, dispatch_time
from jax_mla.testing import rel_err

L, R = 512, 64
D = L + R
# fp8: an e4m3 cache read with bf16 queries; fp8q: with e4m3 queries too (their own scale).
KV_DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "fp8q": jnp.float8_e4m3fn}
DEEPSEEK_SCALE = 1 / math.sqrt(192.0)  # pre-absorption head dim 128 + 64
FP8_KV_SCALE = 0.05  # the cache stores x / 0.05: unit normals in e4m3's range
FP8_Q_SCALE = 0.02  # an fp8 query stores x / 0.02


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq: int
    qlen: int = 1
    page: int = 64
    varlen: bool = False
    tag: str = ""
    kv: str = "bf16"

    @classmethod
    def parse(cls, spec: str) -> Shape:
        """``"B,H,S[,Q[,PAGE[,KV]]]"``, e.g. ``"64,16,4096,4"`` or ``"128,128,4096,1,64,fp8"``
        (KV: ``bf16``, ``fp8`` or ``fp8q``, an fp8 cache with fp8 queries)."""
        parts = spec.split(",")
        if not 3 <= len(parts) <= 6:
            raise ValueError(f"shape {spec!r}: expected B,H,S[,Q[,PAGE[,KV]]]")
        kv = parts.pop() if len(parts) == 6 else "bf16"
        if kv not in KV_DTYPES:
            raise ValueError(f"shape {spec!r}: KV must be one of {tuple(KV_DTYPES)}")
        v = [int(x) for x in parts]
        return cls(*v[:3], qlen=v[3] if len(v) > 3 else 1, page=v[4] if len(v) > 4 else 64,
                   kv=kv)

    @property
    def name(self):
        v = " varlen" if self.varlen else ""
        k = "" if self.kv == "bf16" else f" {self.kv}"
        return f"B{self.batch} H{self.heads} S{self.seq} Q{self.qlen} p{self.page}{v}{k}"


def target_shapes(quick: bool = False) -> list[Shape]:
    """The decode grid: 16 heads (memory-bound) and 128 heads (compute-bound), page 1, verify,
    varlen, B=1 latency, 32 and 64 heads, and fp8 caches."""
    if quick:
        return [Shape(4, 16, 256), Shape(4, 128, 256), Shape(4, 16, 256, qlen=2, page=1)]
    s = [Shape(b, 16, n, tag="h16") for b in (32, 64, 128) for n in (4096, 8192, 32768)]
    s += [Shape(128, 128, n, tag="h128") for n in (4096, 8192)] + [Shape(8, 128, 32768, tag="h128")]
    s += [Shape(64, 16, 4096, page=1, tag="page1"), Shape(128, 128, 4096, page=1, tag="page1")]
    s += [Shape(64, 16, 4096, qlen=q, tag="verify") for q in (2, 3, 4)]
    s += [Shape(64, 16, 4096, varlen=True, tag="varlen"),
          Shape(128, 16, 8192, varlen=True, tag="varlen")]
    s += [Shape(1, 16, 1024, tag="latency"), Shape(1, 128, 1024, tag="latency")]
    s += [Shape(128, 64, 4096, tag="h64"), Shape(128, 32, 4096, tag="h32")]
    s += [Shape(64, 16, 4096, tag="fp8", kv="fp8"), Shape(128, 128, 4096, tag="fp8", kv="fp8")]
    s += [Shape(64, 16, 4096, tag="fp8", kv="fp8q"), Shape(128, 128, 4096, tag="fp8", kv="fp8q")]
    return s


def lengths(shape: Shape, rng) -> np.ndarray:
    """Fixed lengths, or normal(mean, mean/2) clipped to [qlen, 2*mean] with the same total."""
    if not shape.varlen:
        return np.full(shape.batch, shape.seq, np.int64)
    x = rng.normal(shape.seq, shape.seq / 2, shape.batch)
    x = np.clip(x, shape.qlen, 2 * shape.seq)
    x = np.round(x * shape.seq * shape.batch / x.sum()).astype(np.int64)
    return np.clip(x, shape.qlen, 2 * shape.seq)


def make_inputs(shape: Shape, rng):
    """``(q bf16, cache, block_table, seq_lens, kv_scale or None)`` with shuffled pages."""
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
    kv_dtype = KV_DTYPES[shape.kv]
    kv_scale = None
    cache = jax.random.normal(k1, (total, ps, D), jnp.bfloat16)
    if shape.kv in ("fp8", "fp8q"):
        kv_scale = jnp.float32(FP8_KV_SCALE)
        cache = (cache.astype(jnp.float32) / FP8_KV_SCALE).astype(kv_dtype)
    q = jax.random.normal(k2, (shape.batch * shape.qlen, shape.heads, D), jnp.bfloat16)
    if shape.kv == "fp8q":
        q = (q.astype(jnp.float32) / FP8_Q_SCALE).astype(kv_dtype)
    return q, cache, jnp.asarray(table), jnp.asarray(lens, jnp.int32), kv_scale


def q_scale_of(shape: Shape):
    """The query's scale: :data:`FP8_Q_SCALE` for ``fp8q`` shapes, else None."""
    return jnp.float32(FP8_Q_SCALE) if shape.kv == "fp8q" else None


def roofline(shape: Shape, lens: np.ndarray, seconds: float, ceil: dict) -> dict:
    kv = float(lens.sum()) * D * jnp.dtype(KV_DTYPES[shape.kv]).itemsize
    flops = 2.0 * shape.qlen * shape.heads * float(lens.sum()) * (D + L)
    return {
        "us": seconds * 1e6,
        "kv_TBps": kv / seconds / 1e12,
        "TFLOPs": flops / seconds / 1e12,
        "frac_copy": kv / seconds / ceil["copy_bytes_per_s"],
        "frac_matmul": flops / seconds / ceil["bf16_matmul_flops"],
    }


def builder(shape: Shape, backend: str = "triton", tuning=None):
    """The step's metadata builder for ``shape`` (plan included), as a jittable function."""
    def build(table, lens):
        return jax_mla.build_decode_metadata(
            table, lens, page_size=shape.page, qlen=shape.qlen, num_heads=shape.heads,
            q_dtype=KV_DTYPES[shape.kv] if shape.kv == "fp8q" else jnp.bfloat16,
            kv_dtype=KV_DTYPES[shape.kv], backend=backend, tuning=tuning)

    return build


def attention_call(shape: Shape, rng, backend: str = "triton", *, tuning=None,
                   scale=DEEPSEEK_SCALE):
    """``(fn, args)``: one layer's ``mla_attention`` (with LSE) on fresh inputs for ``shape``,
    its metadata built once: ``fn(q, cache, md)``."""
    q, cache, table, lens, kv_scale = make_inputs(shape, rng)
    md = jax.jit(builder(shape, backend, tuning))(table, lens)
    return _e2e(kv_scale, scale, q_scale_of(shape)), (q, cache, md)


def run_shape(shape: Shape, backends, ceil: dict, rng, *, scale=DEEPSEEK_SCALE) -> list:
    """One row per backend for ``shape`` (same inputs): stream times, errors against XLA."""
    q, cache, table, lens, kv_scale = make_inputs(shape, rng)
    lens_np = np.asarray(lens)
    rows, outs = [], {}
    for name in backends:
        build = builder(shape, name)
        md = jax.jit(build)(table, lens)
        impl = get_backend(name)
        e2e = _e2e(kv_scale, scale, q_scale_of(shape))

        def kernels(q, cache, md, impl=impl):
            return impl.decode(q, cache, md, plan=md.plan, scale=scale,
                               q_scale=q_scale_of(shape), kv_scale=kv_scale, return_lse=True)

        t_e2e = device_time(e2e, q, cache, md)
        row = {"shape": shape.name, "tag": shape.tag, "backend": name,
               **dataclasses.asdict(shape), **roofline(shape, lens_np, t_e2e, ceil),
               "in_flight_us": device_time(e2e, q, cache, md, in_flight=True) * 1e6,
               "dispatch_us": dispatch_time(e2e, q, cache, md) * 1e6,
               "kernel_us": (device_time(kernels, q, cache, md) if name != "xla" else t_e2e) * 1e6,
               "metadata_us": metadata_time(build, table, lens) * 1e6}
        row["e2e_over_kernel"] = row["us"] / row["kernel_us"]
        outs[name] = jax.jit(e2e)(q, cache, md)
        rows.append(row)
    fm = flashmla(shape, q, cache, table, lens, scale)
    if fm is not None:
        rows.append({"shape": shape.name, "tag": shape.tag, "backend": "flashmla",
                     **dataclasses.asdict(shape),
                     **roofline(shape, lens_np, fm.stream_time(), ceil),
                     "in_flight_us": fm.in_flight_time() * 1e6})
        outs["flashmla"] = tuple(jnp.asarray(x) for x in fm.outputs())
    if "xla" in outs:
        ref_o, ref_l = outs["xla"]
        xla_us = next(r["us"] for r in rows if r["backend"] == "xla")
        for row in rows:
            o, lse = outs[row["backend"]]
            row["rel_err_vs_xla"] = rel_err(o.astype(jnp.float32), ref_o.astype(jnp.float32))
            fin = np.isfinite(np.asarray(ref_l))
            row["lse_max_abs_err"] = float(np.max(np.abs(np.asarray(lse)[fin]
                                                          - np.asarray(ref_l)[fin])))
            row["speedup_vs_xla"] = xla_us / row["us"]
    return rows


def metadata_time(build, table, lens, **kw) -> float:
    """Stream time of a step's metadata build: the chain feeds each build's dependency into the
    *lengths* (every part of the build reads them; the split plan reads nothing else, so a chain
    through the block table would let XLA merge the plans of consecutive calls)."""
    return device_time(lambda lens, table: build(table, lens), lens, table, **kw)


def _e2e(kv_scale, scale, q_scale=None):
    def e2e(q, cache, md):
        # What a model calls once per layer: head padding, kernels, merge, unpadding.
        return jax_mla.mla_attention(q, cache, md, scale=scale, return_lse=True,
                                     kv_scale=kv_scale, q_scale=q_scale)

    return e2e


def gpu_time_rows(shape: Shape, backends, rng, *, scale=DEEPSEEK_SCALE) -> dict:
    """``{backend: {gpu_us, launches, gpu_kernels_us, metadata_gpu_us, metadata_launches,
    metadata_memcpys}}`` for ``shape`` from CUPTI (run after every stream time of a process)."""
    q, cache, table, lens, kv_scale = make_inputs(shape, rng)
    out = {}
    for name in backends:
        build = builder(shape, name)
        md = jax.jit(build)(table, lens)
        k = profile.kernel_times(_e2e(kv_scale, scale, q_scale_of(shape)), q, cache, md)
        m = profile.kernel_times(build, table, lens)
        out[name] = dict(gpu_us=k["gpu_us"], launches=k["launches"],
                         gpu_kernels_us=k["kernels_us"], metadata_gpu_us=m["gpu_us"],
                         metadata_launches=m["launches"], metadata_memcpys=m["memcpy_launches"])
    fm = flashmla(shape, q, cache, table, lens, scale)
    if fm is not None:
        k, m = fm.gpu_time(), fm.metadata_gpu_time()
        out["flashmla"] = dict(gpu_us=k["gpu_us"], launches=k["launches"],
                               gpu_kernels_us=k["kernels_us"], metadata_gpu_us=m["gpu_us"],
                               metadata_launches=m["launches"])
    return out


def flashmla(shape: Shape, q, cache, table, lens, scale):
    """FlashMLA on these buffers (``peers.py``), where it is built and runs ``shape``."""
    if peers.flashmla() is None or peers.flashmla_reason(shape.kv, shape.page, shape.heads):
        return None
    return peers.FlashMLA(q, cache, table, lens, qlen=shape.qlen, scale=scale)
