"""Peers timed beside jax_mla on the *same buffers* and by the same two timers: FlashMLA.

FlashMLA (deepseek-ai/FlashMLA's Hopper dense decode, bf16, page 64) is not a dependency and
none of its code is in this project: build it where it is wanted (``benchmarks/README.md``),
put it on ``sys.path``, and the benches add a ``flashmla`` row wherever :func:`flashmla_reason`
allows. Its inputs are our arrays, viewed by torch through DLPack (no copy):

- GPU time: the CUPTI sum of one call's kernels (``profile.py``), the scheduling metadata
  planned once beforehand, as ours is;
- stream time: one CUDA graph of ``n`` calls on one stream (each starts when the previous one
  ends), replayed and timed by CUDA events; also by our own timer's two clocks: wall time
  around a replay and its wait (``wall_time``), and replays in flight (``in_flight_time``);
- metadata: its first call plans the split schedule (``get_decoding_sched_meta``); the kernels
  that a fresh plan adds to a call are its metadata cost.
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy as np

L = 512  # FlashMLA's head_dim_v: the latent rank


@functools.cache
def flashmla():
    """The ``flash_mla`` module where it imports (with torch and CUDA), else None."""
    try:
        import flash_mla
        import torch
    except ImportError:
        return None
    return flash_mla if torch.cuda.is_available() else None


def flashmla_reason(kv: str, page: int, heads: int, kv_lora_rank: int = L,
                    head_dim: int = L + 64) -> str | None:
    """Why FlashMLA's dense decode cannot run this problem (None: it can)."""
    if kv != "bf16":
        return f"FlashMLA's dense Hopper decode is bf16 only (kv {kv})"
    if page != 64:
        return f"FlashMLA's pages hold 64 tokens (page {page})"
    if kv_lora_rank != L or head_dim != L + 64:
        return "FlashMLA's decode is for L=512, R=64"
    if heads > 128:
        return f"FlashMLA takes at most 128 query heads per KV head ({heads})"
    return None


class FlashMLA:
    """One FlashMLA decode over jax_mla's arrays: ``q [B*Q, H, 576]``, ``cache [pages, 64,
    576]``, ``table int32 [B, max_pages]``, ``lens int32 [B]``."""

    def __init__(self, q, cache, table, lens, *, qlen: int, scale: float, module=None):
        import torch

        self.fm = module or flashmla()
        t, h, d = q.shape
        self.rows, self.heads, self.qlen = t, h, qlen
        self.q = torch.from_dlpack(q).view(t // qlen, qlen, h, d)
        self.cache = torch.from_dlpack(cache).unsqueeze(2)  # [pages, 64, 1 KV head, 576]
        self.table = torch.from_dlpack(table)
        self.lens = torch.from_dlpack(lens)
        self.scale = float(scale)
        self.meta = self.plan()
        self.call()  # plans the split schedule once: later calls reuse it, as ours do

    def plan(self):
        meta, _ = self.fm.get_mla_metadata()
        return meta

    def call(self, meta=None):
        return self.fm.flash_mla_with_kvcache(
            self.q, self.cache, self.table, self.lens, L, self.meta if meta is None else meta,
            None, softmax_scale=self.scale, causal=self.qlen > 1)

    def outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(out [B*Q, H, L] float32, lse [B*Q, H] float32)``, in jax_mla's layout."""
        import torch

        out, lse = self.call()
        if out.is_cuda:
            torch.cuda.synchronize()
        out = out.float().reshape(self.rows, self.heads, L).cpu().numpy()
        lse = lse.transpose(1, 2).reshape(self.rows, self.heads).float().cpu().numpy()
        return out, lse

    def _graph(self, min_ms: float, max_n: int):
        """``(graph, n)``: one CUDA graph of ``n`` calls on one stream, ``n`` enough for about
        ``min_ms`` (at most ``max_n``), captured once per ``(min_ms, max_n)``."""
        import torch

        graphs = self.__dict__.setdefault("_graphs", {})
        if (min_ms, max_n) in graphs:
            return graphs[min_ms, max_n]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        one = _events_time(self.call, 10)
        n = int(max(2, min(max_n, (min_ms * 1e-3) // max(one, 1e-6))))
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture: XLA's own threads in this process (buffer frees, event polls)
        # may call CUDA meanwhile, which invalidates a global-mode capture ("operation failed
        # due to a previous error during capture", H100, 2026-12-06).
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(n):
                self.call()
        graph.replay()
        torch.cuda.synchronize()
        graphs[min_ms, max_n] = graph, n
        return graph, n

    def stream_time(self, min_ms: float = 20.0, reps: int = 5, max_n: int = 128) -> float:
        """Median seconds per call in a CUDA graph of dependent calls (one stream), a replay
        timed by CUDA events."""
        graph, n = self._graph(min_ms, max_n)
        return statistics.median(_events_time(graph.replay, 1) for _ in range(reps)) / n

    def wall_time(self, min_ms: float = 20.0, reps: int = 5, max_n: int = 128) -> float:
        """The same graph timed as ours is (``timing.device_time``): wall clock around one
        replay and the wait for it, median seconds per call."""
        import torch

        graph, n = self._graph(min_ms, max_n)

        def one():
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        return statistics.median(one() for _ in range(reps)) / n

    def in_flight_time(self, min_ms: float = 20.0, reps: int = 5, max_n: int = 128) -> float:
        """The same graph timed as ours is in flight (``timing.device_time(...,
        in_flight=True)``): replays back to back for about ``timing.IN_FLIGHT_MS``, one wait at
        the end, wall clock; median seconds per call."""
        import torch

        from jax_mla.bench import timing

        graph, n = self._graph(min_ms, max_n)
        return timing.in_flight_wall(graph.replay, torch.cuda.synchronize, reps) / n

    def gpu_time(self, calls: int = 20) -> dict:
        """``{"gpu_us", "launches", "kernels_us"}`` per call (CUPTI), the plan reused."""
        return _cupti(self.call, calls)

    def metadata_gpu_time(self, calls: int = 20) -> dict:
        """What planning afresh adds to a call: ``{"gpu_us", "launches", "kernels_us"}``."""
        steady = _cupti(self.call, calls)["kernels_us"]
        fresh = _cupti(lambda: self.call(self.plan()), calls)
        extra = {k: v for k, v in fresh["kernels_us"].items() if k not in steady}
        return {"gpu_us": sum(extra.values()),
                "launches": sum(fresh["launch_by_family"][k] for k in extra),
                "kernels_us": extra}


def _events_time(fn, n: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / n


def _cupti(fn, calls: int) -> dict:
    import torch

    from jax_mla.bench import profile

    fn()
    torch.cuda.synchronize()

    def run():
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()

    per, count = {}, {}
    events = profile._profile(run)
    for e in events:
        k = profile.family(e["name"])
        per[k] = per.get(k, 0.0) + float(e.get("dur", 0.0)) / calls
        count[k] = count.get(k, 0.0) + 1.0 / calls
    return {"gpu_us": sum(per.values()), "launches": len(events) / calls, "kernels_us": per,
            "launch_by_family": count}
