"""A serving loop with continuous batching over the paged latent cache, shaped to its work.

Each step runs one compiled :func:`jax_mla.model.transformer.serve_step` chosen from a small set
of **buckets**, the smallest that fits the step's work:

- decode (or verify) only: ``B_d`` requests of ``qlen = 1 + spec_tokens`` rows, ``B_d`` from
  ``decode_buckets`` (default: powers of two up to ``max_decode``);
- prefill or mixed: ``T_p`` prompt tokens from ``prefill_buckets`` (default: powers of two
  from ``max(16, prefill_tokens / 16)`` up to ``prefill_tokens``) in up to
  ``max_prefill_seqs`` chunks, after ``B_d`` decode requests from ``mixed_decode_buckets``
  (default: 0 and ``max_decode``).

Every bucket is compiled ahead of serving (:meth:`Engine.compile`), so serving never compiles
(``Engine.compiles_since_warmup`` counts every XLA compilation of the process after it).
Requests join as soon as the cache and the step have room (chunked prefill: a long prompt is
served over several steps, each chunk attending the cached earlier ones), leave when done, and
give their pages back.

On the device: the model's layers run as one scan, the caches are donated, sampling (greedy,
or temperature / top-k / top-p per request) happens in the step, and only the sampled ids come
back. **Overlap** (``overlap=True``, plain decode without checks): the host schedules and sends
step ``n + 1`` before it reads step ``n``'s ids; a decode row whose input token is still on the
device reads it there (``serve_step``'s ``feed``). The host thus waits once per step, for ids it
needs anyway, while the device has the next step queued.

- **Speculative verify** (``spec_tokens = k > 0``): each decode request proposes ``k`` draft
  tokens by prompt lookup (the tokens that followed the latest earlier occurrence of its last
  token), the model scores ``1 + k`` rows in one verify step, and the longest prefix of drafts
  equal to the tokens sampled at the rows before them is kept, plus the next sampled token
  (with greedy sampling: the model's own choices; with random sampling this keeps the target
  distribution exactly, since every kept token was sampled from it given the kept prefix);
  rejected tokens are dropped from the cache (``PagedCacheManager.truncate``).
- **Preemption**: when the cache cannot grow a running request, the newest one is evicted (its
  pages freed) and requeued; it recomputes its tokens by prefill when it is readmitted.
- **Checks**: every ``check_every`` steps, the logits of up to two of the step's requests are
  recomputed from scratch (their whole history as one prefill, XLA backend, a fresh cache) and
  compared with the step's. The recompute runs at ``precision=HIGHEST`` in float32 on every
  platform; its tolerance is stated per platform and dtype (:func:`check_tolerance`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.cache import is_fp8
from jax_mla.model.sampling import SamplingParams
from jax_mla.model.transformer import (
    ModelConfig,
    StepInputs,
    init_caches,
    model_step,
    serve_step,
)
from jax_mla.serving.pages import CacheFull, PagedCacheManager

# --- compilations, counted for the whole process --------------------------------------------

_COMPILES = [0]


def _on_event(event: str, *_args, **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compile_count() -> int:
    """XLA compilations of this process so far (every ``jit``, eager op and ``.compile()``)."""
    return _COMPILES[0]


def check_tolerance(dtype, platform: str | None = None, cache_dtype=None) -> float:
    """The per-step check's tolerance on logits (relative error against the recompute).

    float32 on a CPU: 1e-4 (both sides float32 arithmetic; measured ~1e-6). float32 on a GPU:
    1e-3 (every float32 matmul of the model runs at ``precision=HIGHEST``, not the GPU's default
    TF32, but the step's attention kernels and XLA's GPU reductions still sum in other orders
    than the recompute, and the differences grow through the layers; before the model's MLP
    and LM head took HIGHEST, TF32 gave 2.6e-4 at the demo's shapes on an H100). bfloat16: 5e-2.
    An fp8 cache: 8e-2 (``docs/model.md``).
    """
    if cache_dtype is not None and is_fp8(cache_dtype):
        return 8e-2
    if jnp.dtype(dtype) != jnp.float32:
        return 5e-2
    platform = platform or jax.devices()[0].platform
    return 1e-4 if platform == "cpu" else 1e-3


def _pow2_ladder(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


@dataclasses.dataclass
class Request:
    """A prompt, how many tokens to generate and how to sample them; ``output`` fills as the
    engine runs (``temperature`` 0: greedy)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    cached: int = 0  # tokens written in the cache
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    preemptions: int = 0
    arrival: float | None = None  # perf_counter() at submit
    arrival_step: int | None = None  # the first step sent after submit
    token_times: list[float] = dataclasses.field(default_factory=list)  # when each was read
    token_steps: list[int] = dataclasses.field(default_factory=list)  # which step made each
    pending: list = dataclasses.field(default_factory=list)  # (step, slot) still on the device

    @property
    def known(self) -> list[int]:
        """Tokens the host has read (prompt, then output)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens, those still on the device included."""
        return len(self.prompt) + len(self.output) + len(self.pending)

    @property
    def prefill_target(self) -> int:
        """Tokens to prefill: the whole prompt, or after a preemption everything but the last
        token (the next decode input)."""
        return len(self.prompt) if self.num_tokens == len(self.prompt) else self.num_tokens - 1

    @property
    def in_prefill(self) -> bool:
        return self.cached < self.prefill_target

    @property
    def done(self) -> bool:
        return len(self.output) + len(self.pending) >= self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Capacities of the step and its buckets (each bucket compiles once)."""

    num_pages: int = 256
    page_size: int = 16
    max_seq_len: int = 512
    max_decode: int = 8
    max_prefill_seqs: int = 2
    prefill_tokens: int = 64
    spec_tokens: int = 0
    workspace_tokens: int = 256
    backend: str = "auto"
    check_every: int = 0
    check_tol: float | None = None  # None: check_tolerance() for the platform and dtypes
    cache_dtype: str | None = None  # None: the model's dtype; an fp8 name: needs k_scales
    decode_buckets: tuple[int, ...] | None = None
    prefill_buckets: tuple[int, ...] | None = None
    mixed_decode_buckets: tuple[int, ...] | None = None
    overlap: bool = True  # schedule step n + 1 before reading step n (plain decode, no checks)
    record: bool = False  # keep every step's inputs and ids (Engine.records: a replayable trace)
    layer_loop: str = "scan"  # jax_mla.model.transformer.LAYER_LOOPS
    sampling: str = "greedy"  # or "random": per-request temperature / top_k / top_p
    sample_cap: int = 256  # candidates top-k / top-p choose among (jax_mla.model.sampling)
    seed: int = 0
    compile_workers: int | None = None  # threads compiling buckets (default: up to 4)
    # XLA options of the step's compilation, e.g. (("xla_gpu_enable_dynamic_slice_fusion",
    # True),): pairs, so that the config stays hashable.
    compiler_options: tuple = ()

    def buckets(self) -> list[tuple[int, int]]:
        """Every step shape ``(B_d, T_p)`` the engine runs, decode-only ones first."""
        dec = self.decode_buckets or _pow2_ladder(1, self.max_decode)
        pre = self.prefill_buckets or _pow2_ladder(
            min(self.prefill_tokens, max(16, self.prefill_tokens // 16)), self.prefill_tokens)
        mixed = self.mixed_decode_buckets
        if mixed is None:
            mixed = (0, self.max_decode)
        for name, ladder, top in (("decode_buckets", dec, self.max_decode),
                                  ("prefill_buckets", pre, self.prefill_tokens),
                                  ("mixed_decode_buckets", mixed, self.max_decode)):
            if list(ladder) != sorted(set(ladder)) or max(ladder) != top or min(ladder) < 0:
                raise ValueError(f"{name} must be increasing, distinct, >= 0 and end at {top}, "
                                 f"got {ladder}")
        if min(dec) < 1 or min(pre) < 1:
            raise ValueError("decode_buckets and prefill_buckets must be >= 1")
        return [(b, 0) for b in dec] + [(b, t) for t in pre for b in mixed]


@dataclasses.dataclass
class StepReport:
    kind: str  # "decode", "verify", "prefill", "mixed", "idle"
    decode_rows: int
    prefill_tokens: int
    new_tokens: int
    seconds: float  # the step's time on the device as the host saw it (see Engine.step)
    check_err: float | None = None
    running: int = 0  # requests admitted after the step
    waiting: int = 0  # requests queued after the step
    pages_used: int = 0
    bucket: tuple[int, int] = (0, 0)  # (B_d, T_p) of the compiled step
    kv_tokens: int = 0  # cached tokens the decode rows read (one layer)
    step: int = 0
    host_seconds: float = 0.0  # the host's scheduling, inputs and dispatch of the step


@dataclasses.dataclass
class _InFlight:
    step: int
    kind: str
    bucket: tuple
    decode: list
    drafts: list
    prefill: list
    inputs: StepInputs
    feed: np.ndarray
    ids: jax.Array
    logits: jax.Array
    dispatched: float
    kv_tokens: int
    host_seconds: float


def _draft(tokens: list[int], k: int) -> list[int]:
    """Prompt-lookup drafts: the ``k`` tokens after the latest earlier occurrence of the last
    token (the last token repeated where history has none)."""
    last = tokens[-1]
    for i in range(len(tokens) - 2, -1, -1):
        if tokens[i] == last:
            d = tokens[i + 1: i + 1 + k]
            return d + [last] * (k - len(d))
    return [last] * k


class Engine:
    """Continuous batching for :mod:`jax_mla.model.transformer` (single device)."""

    def __init__(self, params, cfg: ModelConfig, ecfg: EngineConfig, *, dtype=jnp.bfloat16,
                 k_scales=None):
        self.params, self.cfg, self.ecfg = params, cfg, ecfg
        self.dtype = jnp.dtype(dtype)
        self.cache_dtype = self.dtype if ecfg.cache_dtype is None else jnp.dtype(ecfg.cache_dtype)
        if is_fp8(self.cache_dtype) and k_scales is None:
            raise ValueError(f"cache_dtype={self.cache_dtype} needs k_scales (per-layer fp8 "
                             "scales: jax_mla.model.transformer.calibrate_kv_scales)")
        if ecfg.sampling not in ("greedy", "random"):
            raise ValueError(f"sampling must be 'greedy' or 'random', got {ecfg.sampling!r}")
        self.k_scales = None if k_scales is None else jnp.asarray(k_scales, jnp.float32)
        self.qlen = 1 + ecfg.spec_tokens
        self.bucket_list = ecfg.buckets()
        self.num_samples = ecfg.max_decode * self.qlen + ecfg.max_prefill_seqs
        if ecfg.check_tol is None:
            ecfg = self.ecfg = dataclasses.replace(ecfg, check_tol=check_tolerance(
                self.dtype, cache_dtype=self.cache_dtype))
        max_pages = -(-ecfg.max_seq_len // ecfg.page_size)
        self.pages = PagedCacheManager(
            num_pages=ecfg.num_pages, page_size=ecfg.page_size,
            max_seqs=ecfg.max_decode + ecfg.max_prefill_seqs, max_pages_per_seq=max_pages)
        self.caches = init_caches(cfg, ecfg.num_pages, ecfg.page_size, self.cache_dtype)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, in admission order
        self.finished: list[Request] = []
        self.steps = 0
        self.worst_check: float | None = None
        self._compiled: dict = {}
        self._key = jax.random.key(ecfg.seed)
        self._prev_ids = jnp.zeros((self.num_samples,), jnp.int32)
        self._inflight: _InFlight | None = None
        self._last_ready = 0.0
        self.compile_seconds: float | None = None
        self.check_seconds = 0.0  # spent in the per-step checks' recomputes
        self.check_compiles = 0  # compilations of those recomputes (not the serving's)
        self._compiles_at_warmup: int | None = None
        self.records: list[dict] = []  # with EngineConfig(record=True): see _resolve_one

    # --- requests ------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError(f"request {req.rid}: the prompt is empty")
        if len(req.prompt) + req.max_new_tokens + self.ecfg.spec_tokens > self.ecfg.max_seq_len:
            raise ValueError(
                f"request {req.rid}: prompt {len(req.prompt)} + max_new_tokens "
                f"{req.max_new_tokens} (+ {self.ecfg.spec_tokens} draft tokens) exceeds "
                f"max_seq_len={self.ecfg.max_seq_len}")
        if req.temperature and self.ecfg.sampling != "random":
            raise ValueError(f"request {req.rid}: temperature={req.temperature} needs an engine "
                             "with EngineConfig(sampling='random')")
        if req.temperature < 0 or req.top_k < 0 or not 0 < req.top_p <= 1:
            raise ValueError(f"request {req.rid}: temperature >= 0, top_k >= 0 and 0 < top_p <= "
                             f"1 are required, got {req.temperature}, {req.top_k}, {req.top_p}")
        req.arrival = time.perf_counter() if req.arrival is None else req.arrival
        req.arrival_step = self.steps + 1 if req.arrival_step is None else req.arrival_step
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and self._inflight is None

    def serve(self, requests, arrivals: int, *, progress: bool = False,
              max_calls: int | None = None):
        """Serve ``requests`` as a stream until every one finishes: ``arrivals`` of them are
        submitted before each step. Returns ``(reports, wall seconds)``, the reports of the
        steps whose ids were read (:meth:`step`). ``max_calls``: raise ``RuntimeError`` after
        that many steps (a test's guard against an engine that stops making progress)."""
        pending = list(requests)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(r.max_new_tokens for r in pending), unit="tok", desc="serving")
        reports, calls = [], 0
        t0 = time.perf_counter()
        while pending or not self.idle:
            for _ in range(arrivals):
                if pending:
                    self.submit(pending.pop(0))
            rep = self.step()
            calls += 1
            if max_calls is not None and calls > max_calls:
                raise RuntimeError(f"no end after {max_calls} steps: {len(self.running)} "
                                   f"running, {len(self.waiting)} waiting")
            if rep is None:
                continue
            reports.append(rep)
            if bar is not None:
                bar.update(rep.new_tokens)
                s = self.pages.stats()
                bar.set_postfix(run=len(self.running), wait=len(self.waiting),
                                pages=f"{s['pages_used']}/{s['usable_pages']}", step=rep.kind)
        if bar is not None:
            bar.close()
        return reports, time.perf_counter() - t0

    # --- compilation ---------------------------------------------------------------------------

    def _bucket_for(self, n_decode: int, n_prefill_tokens: int) -> tuple[int, int]:
        fits = [(b, t) for b, t in self.bucket_list
                if b >= n_decode and t >= n_prefill_tokens and (t > 0) == (n_prefill_tokens > 0)
                and (b > 0 or n_decode == 0)]
        return min(fits, key=lambda bt: (bt[1], bt[0]))

    def _dummy_inputs(self, bucket) -> StepInputs:
        b_d, t_p = bucket
        e, q = self.ecfg, self.qlen
        t = b_d * q + t_p
        b_p = e.max_prefill_seqs if t_p else 0
        mp = self.pages.max_pages_per_seq
        return StepInputs(
            tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
            slot_mapping=np.full(t, -1, np.int32),
            decode_block_table=np.zeros((b_d, mp), np.int32),
            decode_seq_lens=np.zeros(b_d, np.int32),
            prefill_block_table=np.zeros((b_p, mp), np.int32),
            prefill_context_lens=np.zeros(b_p, np.int32),
            prefill_cu_seqlens=np.zeros(b_p + 1, np.int32))

    def _sampling_inputs(self, rows: int, reqs_rows=()):
        if self.ecfg.sampling == "greedy":
            return None
        temp = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        for row, req in reqs_rows:
            temp[row], top_k[row], top_p[row] = req.temperature, req.top_k, req.top_p
        return SamplingParams(temp, top_k, top_p)

    def _args(self, inputs: StepInputs, feed, sampling, step_no: int):
        return (self.params, self.caches, inputs, feed, self._prev_ids, self._key,
                np.int32(step_no), sampling, self.k_scales)

    def _lower(self, bucket):
        e = self.ecfg
        inputs = self._dummy_inputs(bucket)
        rows = bucket[0] * self.qlen + (e.max_prefill_seqs if bucket[1] else 0)
        args = self._args(inputs, np.full(inputs.tokens.shape, -1, np.int32),
                          self._sampling_inputs(rows), 0)
        fn = jax.jit(
            lambda p, c, s, f, prev, key, n, samp, ks: serve_step(
                p, self.cfg, c, s, f, prev, jax.random.fold_in(key, n), samp, qlen=self.qlen,
                workspace_tokens=e.workspace_tokens, num_samples=self.num_samples,
                backend=e.backend, k_scales=ks, sample_cap=e.sample_cap,
                layer_loop=e.layer_loop),
            donate_argnums=(1,))
        return fn.lower(*args).compile(dict(e.compiler_options) or None)

    def compile(self, progress: bool = False, log=print) -> float:
        """Compile every bucket ahead of serving and run each once on padding (nothing is
        written); returns the seconds it took. Serving compiles nothing after this."""
        todo = [b for b in self.bucket_list if b not in self._compiled]
        t0 = time.perf_counter()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), unit="bucket", desc="compiling")
        workers = self.ecfg.compile_workers or min(4, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            futures = {pool.submit(self._lower, b): b for b in todo}
            for fut in concurrent.futures.as_completed(futures):
                self._compiled[futures[fut]] = fut.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        for b in todo:  # first runs: whatever a compiled program does once happens now
            inputs = self._dummy_inputs(b)
            rows = b[0] * self.qlen + (self.ecfg.max_prefill_seqs if b[1] else 0)
            ids, _, self.caches = self._compiled[b](
                *self._args(inputs, np.full(inputs.tokens.shape, -1, np.int32),
                            self._sampling_inputs(rows), 0))
            ids.block_until_ready()
        seconds = time.perf_counter() - t0
        self.compile_seconds = (self.compile_seconds or 0.0) + seconds
        self._compiles_at_warmup = compile_count()
        if log is not None and todo:
            log(f"compiled {len(todo)} step shapes in {seconds:.1f} s "
                f"({len(self.bucket_list)} buckets: (decode requests, prefill tokens) "
                f"{self.bucket_list})")
        return seconds

    @property
    def compiles_since_warmup(self) -> int | None:
        """XLA compilations of the process since :meth:`compile` (None before it), the
        per-step checks' own recomputes left out."""
        if self._compiles_at_warmup is None:
            return None
        return compile_count() - self._compiles_at_warmup - self.check_compiles

    # --- scheduling ----------------------------------------------------------------------------

    def _preempt(self, protect: set) -> bool:
        """Evict the newest running request not in ``protect`` (ids scheduled this step)."""
        for victim in reversed(self.running):
            if victim.rid not in protect:
                self.running.remove(victim)
                self.pages.free(victim.rid)
                victim.cached = 0
                victim.preemptions += 1
                self.waiting.appendleft(victim)
                return True
        return False

    def _grow(self, req: Request, n: int, protect: set) -> bool:
        """Make room for ``n`` more tokens of ``req``, preempting newer requests if needed."""
        protect.add(req.rid)
        while True:
            try:
                self.pages.append(req.rid, n)
                return True
            except CacheFull:
                if not self._preempt(protect):
                    protect.discard(req.rid)
                    return False

    def _schedule(self):
        e = self.ecfg
        decode, protect = [], set()
        for req in list(self.running):
            if len(decode) == e.max_decode:
                break
            if req in self.running and not req.in_prefill and not req.done and \
                    self._grow(req, self.qlen, protect):
                decode.append(req)
        prefill, budget = [], e.prefill_tokens
        for req in [r for r in self.running if r.in_prefill]:
            if len(prefill) == e.max_prefill_seqs or budget == 0:
                break
            n = min(budget, req.prefill_target - req.cached)
            if req in self.running and self._grow(req, n, protect):
                prefill.append((req, n))
                budget -= n
        # Admit new requests while the step and the cache have room (never by preempting).
        while self.waiting and len(prefill) < e.max_prefill_seqs and budget and \
                len(self.running) < self.pages.max_seqs:
            req = self.waiting[0]
            n = min(budget, req.prefill_target - req.cached)
            if not self.pages.can_add(n):
                break
            self.waiting.popleft()
            self.pages.add(req.rid, n)
            self.running.append(req)
            prefill.append((req, n))
            budget -= n
        return decode, prefill

    # --- one step ------------------------------------------------------------------------------

    def _inputs(self, bucket, decode, drafts, prefill, prev_step: int | None):
        e, q = self.ecfg, self.qlen
        b_d, t_p = bucket
        b_p = e.max_prefill_seqs if t_p else 0
        td = b_d * q
        t = td + t_p
        tokens = np.zeros(t, np.int32)
        feed = np.full(t, -1, np.int32)
        positions = np.zeros(t, np.int32)
        for i, req in enumerate(decode):
            if req.pending:  # its input token is the previous step's, still on the device
                step_no, slot = req.pending[-1]
                assert step_no == prev_step and q == 1, "only the previous step's ids feed"
                feed[i] = slot
            else:
                tokens[i * q] = req.known[-1]
            tokens[i * q + 1:(i + 1) * q] = drafts[i]
            positions[i * q:(i + 1) * q] = req.cached + np.arange(q)
        off = td
        for req, n in prefill:
            tokens[off:off + n] = req.known[req.cached:req.cached + n]
            positions[off:off + n] = req.cached + np.arange(n)
            off += n
        ids = [r.rid for r in decode]
        slots = np.full(t, -1, np.int32)
        if td:
            slots[:td] = self.pages.slot_mapping(ids, None, q, capacity=td)
        pids = [r.rid for r, _ in prefill]
        counts = [n for _, n in prefill]
        if t_p:
            slots[td:] = self.pages.slot_mapping(pids, None, counts, capacity=t_p)
        cu = np.zeros(b_p + 1, np.int32)
        cu[1:len(counts) + 1] = np.cumsum(counts)
        cu[len(counts) + 1:] = cu[len(counts)]
        ctx = np.zeros(b_p, np.int32)
        ctx[:len(prefill)] = [r.cached for r, _ in prefill]
        inputs = StepInputs(
            tokens=tokens, positions=positions, slot_mapping=slots,
            decode_block_table=self.pages.block_tables(ids, rows=b_d),
            decode_seq_lens=self.pages.seq_lens(ids, rows=b_d),
            prefill_block_table=self.pages.block_tables(pids, rows=b_p),
            prefill_context_lens=ctx, prefill_cu_seqlens=cu)
        rows = [(i * q + j, r) for i, r in enumerate(decode) for j in range(q)]
        rows += [(td + j, r) for j, (r, _) in enumerate(prefill)]
        return inputs, feed, self._sampling_inputs(td + b_p, rows)

    def _overlapping(self) -> bool:
        e = self.ecfg
        return e.overlap and e.spec_tokens == 0 and not e.check_every

    def step(self) -> StepReport | None:
        """Schedule and send one step; return the report of the step whose ids were read
        during this call (with overlap, the previous one; None when none was read).

        A report's ``seconds`` is the time from the later of the step's send and the previous
        step's ids being read until its own ids were read: with the device kept busy, the
        step's own time on the device plus the reading of its ids.
        """
        e, q = self.ecfg, self.qlen
        t_host = time.perf_counter()
        decode, prefill = self._schedule()
        if not decode and not prefill:
            if self._inflight is not None:
                return self._resolve()
            if self.running or self.waiting:
                raise CacheFull(
                    "the cache cannot hold even one request's next tokens: raise num_pages",
                    needed=1, free=self.pages.num_free_pages)
            return StepReport("idle", 0, 0, 0, 0.0)
        self.steps += 1
        n_pre = sum(n for _, n in prefill)
        bucket = self._bucket_for(len(decode), n_pre)
        drafts = [_draft(r.known, e.spec_tokens) for r in decode] if e.spec_tokens else \
            [[] for _ in decode]
        prev = self._inflight
        inputs, feed, sampling = self._inputs(bucket, decode, drafts, prefill,
                                              None if prev is None else prev.step)
        if bucket not in self._compiled:
            self._compiled[bucket] = self._lower(bucket)
        kv_tokens = int(inputs.decode_seq_lens.sum())
        t0 = time.perf_counter()
        ids, logits, self.caches = self._compiled[bucket](
            *self._args(inputs, feed, sampling, self.steps))
        host = time.perf_counter() - t_host  # scheduling, inputs and the dispatch
        self._prev_ids = ids
        kind = ("verify" if q > 1 else "decode") if decode else "prefill"
        if decode and prefill:
            kind = "mixed"
        flight = _InFlight(self.steps, kind, bucket, decode, drafts, prefill, inputs, feed, ids,
                           logits, t0, kv_tokens, host)
        # What the host can account for before the ids: cache positions, pending tokens.
        b_p = e.max_prefill_seqs if bucket[1] else 0
        for i, req in enumerate(decode):
            if q == 1:
                req.cached += 1
                req.pending.append((self.steps, i))
        for j, (req, n) in enumerate(prefill):
            req.cached += n
            # A prompt's last chunk samples its first token; a preempted request's recompute
            # samples nothing (its next input is already known).
            if not req.in_prefill and req.num_tokens == len(req.prompt):
                req.pending.append((self.steps, self.num_samples - b_p + j))
        self._inflight = flight
        if q == 1:
            self._retire()
        if prev is not None:
            report = self._resolve_one(prev)
            if not self._overlapping():
                self._resolve()
            return report
        if not self._overlapping():
            return self._resolve()
        return None

    def _retire(self):
        for req in [r for r in self.running if r.done and not r.in_prefill]:
            self.running.remove(req)
            self.pages.free(req.rid)  # later steps run after this one on the device
            self.finished.append(req)

    def _resolve(self) -> StepReport | None:
        """Read the in-flight step's ids (waits for it)."""
        flight, self._inflight = self._inflight, None
        return None if flight is None else self._resolve_one(flight)

    def _resolve_one(self, f: _InFlight) -> StepReport:
        e, q = self.ecfg, self.qlen
        ids = np.asarray(f.ids)
        now = time.perf_counter()
        seconds = now - max(f.dispatched, self._last_ready)
        self._last_ready = now
        if e.record:
            # The step as it ran, with the tokens it read on the device filled in from the
            # previous step's ids: replayable by another implementation (the bench's peer).
            inputs = f.inputs
            if (f.feed >= 0).any():
                prev = self.records[-1]["ids"]
                tokens = np.where(f.feed >= 0, prev[np.maximum(f.feed, 0)], inputs.tokens)
                inputs = dataclasses.replace(inputs, tokens=tokens.astype(np.int32))
            self.records.append(dict(step=f.step, kind=f.kind, bucket=f.bucket, qlen=q,
                                     inputs=inputs, ids=ids, seconds=seconds))
        check = None
        if e.check_every and f.step % e.check_every == 0:
            c0, t0 = compile_count(), time.perf_counter()
            check = self._check(f)
            self.check_compiles += compile_count() - c0
            self.check_seconds += time.perf_counter() - t0
            self._last_ready = time.perf_counter()
        new = 0
        for i, req in enumerate(f.decode):
            if q == 1:
                step_no, slot = req.pending.pop(0)
                assert step_no == f.step
                req.output.append(int(ids[slot]))
                req.token_times.append(now)
                req.token_steps.append(f.step)
                new += 1
                continue
            rows = ids[i * q:(i + 1) * q]
            a = 0
            while a < e.spec_tokens and f.drafts[i][a] == rows[a] and \
                    len(req.output) + a + 1 < req.max_new_tokens:
                a += 1
            req.output += f.drafts[i][:a] + [int(rows[a])]
            req.token_times += [now] * (a + 1)
            req.token_steps += [f.step] * (a + 1)
            req.accepted_drafts += a
            req.proposed_drafts += e.spec_tokens
            req.cached += 1 + a
            if a < e.spec_tokens:
                self.pages.truncate(req.rid, req.cached)
            new += a + 1
        for req, _ in f.prefill:
            if req.pending and req.pending[0][0] == f.step:
                _, slot = req.pending.pop(0)
                req.output.append(int(ids[slot]))
                req.token_times.append(now)
                req.token_steps.append(f.step)
                new += 1
        if q > 1:
            self._retire()
        return StepReport(f.kind, len(f.decode) * q, sum(n for _, n in f.prefill), new,
                          seconds, check, running=len(self.running), waiting=len(self.waiting),
                          pages_used=self.pages.num_used_pages, bucket=f.bucket,
                          kv_tokens=f.kv_tokens, step=f.step, host_seconds=f.host_seconds)

    # --- the per-step check --------------------------------------------------------------------

    def _check(self, f: _InFlight) -> float:
        """Worst relative error of the step's sampled-row logits for up to two requests against
        the same tokens recomputed from scratch (one prefill over the whole history, XLA
        backend, float32 at ``precision=HIGHEST``, a cache in the model's dtype: an fp8
        cache's error is part of what is measured)."""
        q, worst = self.qlen, 0.0
        logits = np.asarray(f.logits)
        inputs = f.inputs
        td = f.bucket[0] * q
        rows = [(r, i * q, i * q, q) for i, r in enumerate(f.decode)][:1]
        off = td
        for j, (r, n) in enumerate(f.prefill):
            rows.append((r, off + n - 1, td + j, 1))  # its last row: the one sampled
            off += n
        for req, start, srow, n in rows[:2]:
            hist_len = int(inputs.positions[start + n - 1]) + 1
            toks = np.concatenate([np.asarray(req.known[:int(inputs.positions[start])],
                                              np.int32), inputs.tokens[start:start + n]])
            ref = reference_logits(self.params, self.cfg, toks, self.dtype,
                                   self.ecfg.page_size)[hist_len - n:hist_len]
            got = logits[srow:srow + n]
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            worst = max(worst, err)
        self.worst_check = worst if self.worst_check is None else max(self.worst_check, worst)
        return worst


def reference_logits(params, cfg: ModelConfig, tokens: np.ndarray, dtype, page_size: int):
    """Logits ``[n, vocab]`` of ``tokens`` run as one fresh prefill (XLA backend, float32
    matmuls at ``precision=HIGHEST``).

    The length is padded to a power of two (at least 16) so checks reuse few compilations.
    """
    n = len(tokens)
    cap = max(16, 1 << (n - 1).bit_length())
    pages = -(-cap // page_size)
    caches = init_caches(cfg, pages, page_size, dtype)
    tok = np.zeros(cap, np.int32)
    tok[:n] = tokens
    slots = np.full(cap, -1, np.int32)
    slots[:n] = np.arange(n)
    inputs = StepInputs(
        tokens=tok, positions=np.minimum(np.arange(cap), n - 1).astype(np.int32),
        slot_mapping=slots, decode_block_table=np.zeros((0, pages), np.int32),
        decode_seq_lens=np.zeros((0,), np.int32),
        prefill_block_table=np.arange(pages, dtype=np.int32)[None],
        prefill_context_lens=np.zeros(1, np.int32), prefill_cu_seqlens=np.array([0, n], np.int32))
    with jax.default_matmul_precision("highest"):
        logits, _ = model_step(params, cfg, caches, jax.tree.map(jnp.asarray, inputs), qlen=1,
                               workspace_tokens=cap, backend="xla")
    return np.array(logits[:n])
