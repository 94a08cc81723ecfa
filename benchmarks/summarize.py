"""Markdown tables from a results folder (decode.json, prefill.json, dcp_split_*.json).

    python benchmarks/summarize.py benchmarks/results/2026-12-02-h200 [--copy 4.27e12]
        [--matmul 7.9e14]

Ratios use the ceilings given on the command line (default: the copy bandwidth and bf16 matmul
rate measured on the project's H200, PERF.md), not the ones stored in the files, so a run whose
in-run ceiling probe was broken can still be read against the right roofs.
"""

from __future__ import annotations

import argparse
import json
import os

# FlashMLA and vLLM's Triton MLA on the same H200 (PERF.md, 2026-12-02): microseconds per call.
PEERS = {
    "B32 H16 S4096 Q1 p64": (56, 112),
    "B64 H16 S4096 Q1 p64": (96, 127),
    "B128 H16 S8192 Q1 p64": (316, 433),
    "B32 H16 S32768 Q1 p64": (320, 430),
    "B128 H16 S32768 Q1 p64": (1182, None),
    "B128 H128 S4096 Q1 p64": (275, 1770),
    "B128 H128 S8192 Q1 p64": (540, 3430),
    "B8 H128 S32768 Q1 p64": (134, 852),
    "B64 H16 S4096 Q2 p64": (97, None),
    "B64 H16 S4096 Q4 p64": (101, None),
}


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _by_shape(rows):
    """``[(shape, triton_row, xla_row)]`` for the shapes the Triton backend ran."""
    by = {}
    for r in rows:
        by.setdefault(r["shape"], {})[r["backend"]] = r
    return [(shape, d["triton"], d.get("xla")) for shape, d in by.items() if "triton" in d]


def decode_table(rows, copy, matmul):
    out = ["| shape | XLA µs | Triton µs (serial) | Triton µs (overlapped) | TB/s | % copy | "
           "TFLOP/s | % matmul | × XLA | × FlashMLA | × vLLM Triton | rel err |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, t, x in _by_shape(rows):
        us = t["us"]
        tbps = t["kv_TBps"] * 1e12
        tf = t["TFLOPs"] * 1e12
        fm, vt = PEERS.get(shape, (None, None))
        out.append(
            f"| {shape} | {_f(x and x['us'], 0)} | {_f(us)} | {_f(t.get('dispatch_us'))} | "
            f"{tbps / 1e12:.2f} | {100 * tbps / copy:.0f} | {tf / 1e12:.0f} | "
            f"{100 * tf / matmul:.0f} | {_f(x and x['us'] / us, 1)} | "
            f"{_f(fm and fm / us, 2)} | {_f(vt and vt / us, 2)} | "
            f"{t.get('rel_err_vs_xla', float('nan')):.1e} |")
    return "\n".join(out)


def prefill_table(rows, matmul):
    out = ["| shape | XLA µs | Triton µs | Triton TFLOP/s | % matmul | × XLA |",
           "|---|---|---|---|---|---|"]
    for shape, t, x in _by_shape(rows):
        out.append(f"| {shape} | {_f(x and x['us'], 0)} | {_f(t['us'], 0)} | {t['TFLOPs']:.0f} | "
                   f"{100 * t['TFLOPs'] * 1e12 / matmul:.0f} | {_f(t.get('speedup_vs_xla'), 1)} |")
    return "\n".join(out)


def dcp_table(rows):
    out = ["| shape | N | local S | gathered heads | local attention µs | merge µs (ag_rs / a2a) "
           "| merge share (ag_rs / a2a) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['world_size']} | {r['local_seq_len']} | "
                   f"{r['gathered_heads']} | {r['local_attn_s'] * 1e6:.0f} | "
                   f"{r['merge_ag_rs_s'] * 1e6:.1f} / {r['merge_a2a_s'] * 1e6:.1f} | "
                   f"{100 * r['merge_share_ag_rs']:.1f}% / {100 * r['merge_share_a2a']:.1f}% |")
    return "\n".join(out)


def kernel_times_table(rows, copy):
    """GPU time per call from CUPTI kernel records (``benchmarks/gpu_kernel_times.py``)."""
    from jax_mla.bench.decode import D

    out = ["| shape | GPU µs / call | split kernel µs | reduce µs | split kernel TB/s | "
           "% copy |", "|---|---|---|---|---|---|"]
    for r in rows:
        k = r["kernels_us_per_call"]
        split = sum(v for n, v in k.items() if "decode" in n)
        red = sum(v for n, v in k.items() if "reduce" in n)
        b, h, s_ = (int(t[1:]) for t in r["shape"].split()[:3])
        kv = b * s_ * D * 2
        out.append(f"| {r['shape']} | {r['gpu_us_per_call']:.1f} | {split:.1f} | {red:.1f} | "
                   f"{kv / split / 1e6:.2f} | {100 * kv / split * 1e6 / copy:.0f} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--copy", type=float, default=4.27e12)
    p.add_argument("--matmul", type=float, default=7.9e14)
    a = p.parse_args(argv)
    parts = []
    path = os.path.join(a.folder, "decode.json")
    if os.path.exists(path):
        parts += ["## Decode / verify", decode_table(json.load(open(path))["rows"], a.copy,
                                                     a.matmul)]
    path = os.path.join(a.folder, "prefill.json")
    if os.path.exists(path):
        parts += ["## Prefill", prefill_table(json.load(open(path))["rows"], a.matmul)]
    path = os.path.join(a.folder, "kernel_times.json")
    if os.path.exists(path):
        parts += ["## GPU time per call (CUPTI kernel records)",
                  kernel_times_table(json.load(open(path)), a.copy)]
    for name in sorted(os.listdir(a.folder)):
        if name.startswith("dcp_split") and name.endswith(".json"):
            parts += [f"## DCP split ({name})", dcp_table(json.load(open(os.path.join(
                a.folder, name)))["rows"])]
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
