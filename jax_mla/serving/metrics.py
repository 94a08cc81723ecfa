"""Serving metrics as serving benchmarks report them, from what the engine recorded.

Every request keeps its arrival time and the time each of its tokens reached the host
(``Request.token_times``); every step its kind, bucket and time (``StepReport``). From those:

- ``tokens_per_s``: generated tokens over the serving wall time; ``total_tokens_per_s`` counts
  the prompts' tokens too;
- ``ttft_ms``: time to first token (arrival to the first generated token on the host);
- ``itl_ms``: inter-token latency (between consecutive tokens of a request; a verify step that
  yields several tokens at once gives gaps of 0 for the extra ones, as vLLM counts them);
- ``steps``: step time per kind and bucket (count, mean, p50, p90), and the host's time to
  schedule, build and send a step (``host_ms_p50``: with overlap it runs while the device runs
  the previous step, so it costs nothing while it is shorter than that).

Percentiles are p50 / p90 / p99 (NumPy's linear interpolation).
"""

from __future__ import annotations

import numpy as np

PERCENTILES = (50, 90, 99)


def percentiles(values, pcts=PERCENTILES, scale: float = 1.0) -> dict:
    v = np.asarray(values, np.float64) * scale
    if not v.size:
        return {f"p{p}": None for p in pcts} | {"mean": None, "n": 0}
    return {f"p{p}": float(np.percentile(v, p)) for p in pcts} | {"mean": float(v.mean()),
                                                                  "n": int(v.size)}


def request_latencies(requests) -> tuple[list[float], list[float]]:
    """``(ttft seconds per request, inter-token gaps in seconds)`` of finished requests."""
    ttft, itl = [], []
    for r in requests:
        if r.token_times and r.arrival is not None:
            ttft.append(r.token_times[0] - r.arrival)
            itl += list(np.diff(r.token_times))
    return ttft, itl


def step_table(reports) -> list[dict]:
    """One row per (kind, bucket): count and step times in ms."""
    groups: dict = {}
    for r in reports:
        if r is None or r.kind == "idle":
            continue
        groups.setdefault((r.kind, tuple(r.bucket)), []).append(r)
    rows = []
    for (kind, bucket), reps in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ms = np.array([r.seconds for r in reps]) * 1e3
        rows.append(dict(kind=kind, bucket=list(bucket), steps=len(reps),
                         ms_mean=float(ms.mean()), ms_p50=float(np.median(ms)),
                         ms_p90=float(np.percentile(ms, 90)),
                         host_ms_p50=float(np.median([r.host_seconds for r in reps]) * 1e3),
                         rows=float(np.mean([r.decode_rows + r.prefill_tokens for r in reps])),
                         kv_tokens=float(np.mean([r.kv_tokens for r in reps]))))
    return rows


def summarize(requests, reports, wall_s: float) -> dict:
    """The serving summary: throughput, TTFT and ITL percentiles (ms), and the step table."""
    out_tokens = sum(len(r.output) for r in requests)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    ttft, itl = request_latencies(requests)
    return dict(requests=len(requests), output_tokens=out_tokens, prompt_tokens=prompt_tokens,
                wall_s=wall_s, tokens_per_s=out_tokens / wall_s if wall_s else None,
                total_tokens_per_s=(out_tokens + prompt_tokens) / wall_s if wall_s else None,
                ttft_ms=percentiles(ttft, scale=1e3), itl_ms=percentiles(itl, scale=1e3),
                steps=step_table(reports))


def format_summary(s: dict) -> str:
    """The summary as a console table."""
    def pct(d):
        return " / ".join("-" if d[f"p{p}"] is None else f"{d[f'p{p}']:.2f}" for p in PERCENTILES)

    lines = [f"{s['requests']} requests, {s['output_tokens']} tokens generated "
             f"({s['prompt_tokens']} prompt tokens) in {s['wall_s']:.2f} s: "
             f"{s['tokens_per_s']:.1f} output tokens/s, {s['total_tokens_per_s']:.1f} total",
             f"TTFT ms p50/p90/p99: {pct(s['ttft_ms'])};  ITL ms p50/p90/p99: "
             f"{pct(s['itl_ms'])}",
             f"{'kind':<8} {'bucket (B_d, T_p)':>18} {'steps':>6} {'ms p50':>8} {'ms p90':>8} "
             f"{'host ms':>8}"
             + (f" {'roofline':>9}" if any("roofline_fraction" in r for r in s["steps"]) else "")]
    for r in s["steps"]:
        frac = r.get("roofline_fraction")
        lines.append(f"{r['kind']:<8} {str(tuple(r['bucket'])):>18} {r['steps']:>6} "
                     f"{r['ms_p50']:8.3f} {r['ms_p90']:8.3f} {r['host_ms_p50']:8.3f}"
                     + (f" {frac:9.2f}" if frac is not None else ""))
    return "\n".join(lines)
