"""Where the split-query kernel goes wrong (Hopper): its query parts, swapped for made ones.

The Gluon fp8 kernel's ``SPLIT_Q`` path (``TritonTuning.sm90_split_q``) multiplies two e4m3
parts of a 16-bit query against each fp8 tile (``split_query_e4m3`` makes them in XLA). It was
wrong on an H100; this probe runs the same compiled kernel on parts replaced by ones whose
answer is known, so that one run says which read or which value goes wrong:

- ``real``: the parts as made (the answer: the oracle's);
- ``hi_zero`` / ``zero_hi``: the high part and zeros, in one order and the other (both the
  high part's answer, equal to each other bit for bit);
- ``hi_hi_half``: the high part in both buffers, the scales halved (the high part's answer);
- ``hi_hi16``: the high part, and the high part / 16 as the low one, the scales times 16/17
  (the high part's answer, up to the rounding of the sixteenths);
- ``lo_zero`` / ``zero_lo``: the low part alone, in one buffer and the other (equal to each
  other bit for bit);
- ``real_acc2``: the parts as made, the low part's products summed apart and then added
  (``TritonTuning.split_acc``, the kernel's ``SPLIT_ACC``; the oracle's answer).

It also checks that the parts come back as the query on the device (``s (hi + lo)``), and
records each variant's LSE error against the oracle's (the question the split path's LSE bound
left open: whether summing the parts' products apart, ``real_acc2``, brings it down).

The step is planned for the Gluon fp8 kernel with the split (its dtypes and heads given, the
split forced), and each variant must reach it: its split function traced at least once, else
the probe stops with an error instead of writing rows. (Its first run, on 2026-12-06, planned
without the dtypes, and every variant gave the same answer to the last digit: nothing it
swapped in had reached the kernel.)
``python -m jax_mla.bench.split_probe [OUT.json]`` (a GPU with the Gluon fp8 kernel).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

# Two ragged requests each, an e4m3 cache: 64 heads at Q = 1 (page 64), verify at 16 heads
# (Q = 4, page 16), lengths up to twice the mean.
CASES = ("2,64,300,1,64,fp8", "2,16,2048,4,16,fp8")


def _variants(split):
    def parts(q):
        p, s = split(q)
        d = p.shape[-1] // 2
        return p[..., :d], p[..., d:], s

    def made(fn):
        return lambda q: fn(*parts(q))

    e4 = jnp.float8_e4m3fn
    cat = lambda a, b: jnp.concatenate([a, b], axis=-1)  # noqa: E731
    z = jnp.zeros_like
    return {
        "real": split,
        "hi_zero": made(lambda h, lo, s: (cat(h, z(h)), s)),
        "zero_hi": made(lambda h, lo, s: (cat(z(h), h), s)),
        "hi_hi_half": made(lambda h, lo, s: (cat(h, h), s * 0.5)),
        "hi_hi16": made(lambda h, lo, s: (cat(h, (h.astype(jnp.float32) / 16).astype(e4)),
                                          s * (16 / 17))),
        "lo_zero": made(lambda h, lo, s: (cat(lo, z(lo)), s)),
        "zero_lo": made(lambda h, lo, s: (cat(z(lo), lo), s)),
        "real_acc2": split,
    }


EXTRA_TUNING = {"real_acc2": {"split_acc": True}}  # the kernel's variant, by name


def split_metadata(table, lens, shape, q_dtype, kv_dtype, **tuning):
    """The step's metadata planned for the Gluon fp8 kernel with the query split (forced) by
    XLA's ops (whose function the variants replace), ``tuning``'s other fields set, or a clear
    error where the plan takes another kernel (off Hopper, or a route that changed): the probe
    means nothing unless its parts reach that kernel."""
    import jax_mla
    from jax_mla.backends.triton import TritonTuning

    md = jax_mla.build_decode_metadata(table, lens, page_size=shape.page, qlen=shape.qlen,
                                       num_heads=shape.heads, q_dtype=q_dtype,
                                       kv_dtype=kv_dtype, backend="triton",
                                       tuning=TritonTuning(sm90_split_q=True,
                                                           split_q_kernel=False, **tuning))
    if not md.plan.kernel.sm90:
        raise SystemExit(f"split probe: the plan for {shape.name} takes {md.plan.kernel}, not "
                         "the Gluon fp8 kernel (it needs a Hopper GPU)")
    return md


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import dataclasses

    import jax_mla
    from jax_mla.backends.triton import decode as tdecode
    from jax_mla.bench.decode import DEEPSEEK_SCALE, Shape, make_inputs
    from jax_mla.testing import numpy_mla_decode, rel_err

    real = tdecode.split_query_e4m3
    rows = []
    rng = np.random.default_rng(0)
    try:
        for spec in CASES:
            shape = dataclasses.replace(Shape.parse(spec), varlen=True)
            qb, kv, table, lens, kv_scale = make_inputs(shape, rng)
            qf = np.asarray(qb, np.float32)
            want, want_lse = numpy_mla_decode(
                qf, np.asarray(kv, np.float32) * float(kv_scale), table, lens, qlen=shape.qlen,
                scale=DEEPSEEK_SCALE, kv_lora_rank=512)
            parts, s = jax.jit(real)(qb)
            p = np.asarray(parts).astype(np.float32)
            back = np.asarray(s).reshape(qf.shape[:2])[..., None] * (p[..., :576] + p[..., 576:])
            row = dict(case=f"{shape.name} {np.asarray(lens).tolist()}",
                       split_rel_err=float(np.abs(back - qf).max() / np.abs(qf).max()),
                       lo_nonzero=float(np.mean(p[..., 576:] != 0)))
            outs = {}
            for name, fn in _variants(real).items():
                md = split_metadata(table, lens, shape, qb.dtype, kv.dtype,
                                    **EXTRA_TUNING.get(name, {}))
                traced = []
                tdecode.split_query_e4m3 = (lambda q, _fn=fn, _seen=traced:
                                            _seen.append(1) or _fn(q))
                jax.clear_caches()
                out, lse = jax.jit(lambda q, c, m, _s=kv_scale: jax_mla.mla_attention(
                    q, c, m, scale=DEEPSEEK_SCALE, backend="triton", kv_lora_rank=512,
                    kv_scale=_s, return_lse=True))(qb, kv, md)
                if not traced:
                    raise SystemExit(f"split probe: variant {name} did not reach the split "
                                     "path (its split function was never traced)")
                o = np.asarray(out, np.float32)
                outs[name] = o
                finite = np.isfinite(want_lse)
                row[name] = dict(rel_err=rel_err(np.nan_to_num(o, nan=1e9), want),
                                 nan_rows=int(np.isnan(o).any(-1).sum()),
                                 lse_max_abs_err=float(np.max(np.abs(
                                     np.asarray(lse)[finite] - want_lse[finite]))))
            for a, b in (("hi_zero", "zero_hi"), ("lo_zero", "zero_lo"),
                         ("hi_zero", "hi_hi_half")):
                row[f"{a}_vs_{b}"] = float(np.nanmax(np.abs(outs[a] - outs[b])))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        tdecode.split_query_e4m3 = real
    if argv:
        with open(argv[0], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
