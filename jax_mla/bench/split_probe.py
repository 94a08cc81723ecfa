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
  (``SPLIT_ACC``; the oracle's answer).

It also checks that the parts come back as the query on the device (``s (hi + lo)``).
``python -m jax_mla.bench.split_probe [OUT.json]`` (a GPU with the Gluon fp8 kernel).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

CASES = ((64, 1, 64, (300, 5)), (16, 4, 16, (4321, 777)))  # heads, qlen, page size, lengths
KV_SCALE = 0.05


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


EXTRA_CONSTEXPRS = {"real_acc2": {"SPLIT_ACC": True}}  # the kernel's variant, by name


def _problem(rng, heads, qlen, page, lens):
    lens = np.asarray(lens, np.int32)
    pages = -(-lens // page)
    table = np.zeros((len(lens), int(pages.max())), np.int32)
    perm = rng.permutation(int(pages.sum())).astype(np.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start:start + n]
        start += n
    cache = rng.standard_normal((int(pages.sum()), page, 576)).astype(np.float32)
    q = rng.standard_normal((len(lens) * qlen, heads, 576)).astype(np.float32)
    return q, cache, table, lens


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import jax_mla
    from jax_mla.backends.triton import TritonTuning
    from jax_mla.backends.triton import decode as tdecode
    from jax_mla.testing import numpy_mla_decode, rel_err

    real = tdecode.split_query_e4m3
    constexprs = tdecode.sm90_constexprs
    rows = []
    rng = np.random.default_rng(0)
    try:
        for heads, qlen, page, lens in CASES:
            q, cache, table, lens = _problem(rng, heads, qlen, page, lens)
            qb = jnp.asarray(q, jnp.bfloat16)
            kv = jnp.asarray(cache / KV_SCALE).astype(jnp.float8_e4m3fn)
            scale = 192 ** -0.5
            want, want_lse = numpy_mla_decode(
                np.asarray(qb, np.float32), np.asarray(kv, np.float32) * KV_SCALE, table, lens,
                qlen=qlen, scale=scale, kv_lora_rank=512)
            parts, s = jax.jit(real)(qb)
            p = np.asarray(parts).astype(np.float32)
            back = np.asarray(s).reshape(q.shape[:2])[..., None] * (p[..., :576] + p[..., 576:])
            qf = np.asarray(qb, np.float32)
            row = dict(case=f"H{heads} Q{qlen} p{page} {list(map(int, lens))}",
                       split_rel_err=float(np.abs(back - qf).max() / np.abs(qf).max()),
                       lo_nonzero=float(np.mean(p[..., 576:] != 0)))
            md = jax_mla.build_decode_metadata(table, lens, page_size=page, qlen=qlen,
                                               tuning=TritonTuning(sm90_split_q=True))
            outs = {}
            for name, fn in _variants(real).items():
                tdecode.split_query_e4m3 = fn
                extra = EXTRA_CONSTEXPRS.get(name, {})
                tdecode.sm90_constexprs = (lambda *a, _x=extra, **k: constexprs(*a, **k) | _x)
                jax.clear_caches()
                out, lse = jax_mla.mla_attention(qb, kv, md, scale=scale, backend="triton",
                                                 return_lse=True, kv_lora_rank=512,
                                                 kv_scale=KV_SCALE)
                o = np.asarray(out, np.float32)
                outs[name] = o
                row[name] = dict(rel_err=rel_err(np.nan_to_num(o, nan=1e9), want),
                                 nan_rows=int(np.isnan(o).any(-1).sum()))
            for a, b in (("hi_zero", "zero_hi"), ("lo_zero", "zero_lo"),
                         ("hi_zero", "hi_hi_half")):
                row[f"{a}_vs_{b}"] = float(np.nanmax(np.abs(outs[a] - outs[b])))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        tdecode.split_query_e4m3 = real
        tdecode.sm90_constexprs = constexprs
    if argv:
        with open(argv[0], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
