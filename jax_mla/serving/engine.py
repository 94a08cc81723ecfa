"""A serving loop with continuous batching over the paged latent cache.

Every step is one call of :func:`jax_mla.model.transformer.model_step` with static capacities:
``max_decode`` decode (or verify) requests of ``qlen = 1 + spec_tokens`` rows each, then up to
``max_prefill_seqs`` prompt chunks packed into ``prefill_tokens`` rows. Requests join as soon as
the cache and the step have room (chunked prefill: a long prompt is served over several steps, each
chunk attending the cached earlier ones), leave when done, and give their pages back.

- **Speculative verify** (``spec_tokens = k > 0``): each decode request proposes ``k`` draft
  tokens by prompt lookup (the tokens that followed the latest earlier occurrence of its last
  token), the model scores ``1 + k`` rows in one verify step (``qlen = 1 + k``), and the longest
  prefix matching the greedy choice is kept, plus the model's own next token; rejected tokens
  are dropped from the cache (``PagedCacheManager.truncate``).
- **Preemption**: when the cache cannot grow a running request, the newest one is evicted (its
  pages freed) and requeued; it recomputes its tokens by prefill when it is readmitted.
- **Checks**: every ``check_every`` steps, the logits of up to two of the step's requests are
  recomputed from scratch (their whole history as one prefill, XLA backend, a fresh cache) and
  compared with the step's: paging, chunking, absorbed decode and verify against the MHA form.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla.cache import is_fp8
from jax_mla.model.transformer import ModelConfig, StepInputs, model_step
from jax_mla.serving.pages import CacheFull, PagedCacheManager


@dataclasses.dataclass
class Request:
    """A prompt and how many tokens to generate; ``output`` fills as the engine runs."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # tokens of ``known`` written in the cache
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    preemptions: int = 0

    @property
    def known(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefill_target(self) -> int:
        """Tokens to prefill: the whole prompt, or after a preemption everything but the last
        known token (the next decode input)."""
        return len(self.prompt) if not self.output else len(self.known) - 1

    @property
    def in_prefill(self) -> bool:
        return self.cached < self.prefill_target

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static capacities of the step (each distinct value compiles once)."""

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
    check_tol: float = 1e-4
    cache_dtype: str | None = None  # None: the model's dtype; an fp8 name: needs k_scales


@dataclasses.dataclass
class StepReport:
    kind: str  # "decode", "verify", "prefill", "mixed", "idle"
    decode_rows: int
    prefill_tokens: int
    new_tokens: int
    seconds: float
    check_err: float | None = None
    running: int = 0  # requests admitted after the step
    waiting: int = 0  # requests queued after the step
    pages_used: int = 0


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
        cache_dtype = self.dtype if ecfg.cache_dtype is None else jnp.dtype(ecfg.cache_dtype)
        if is_fp8(cache_dtype) and k_scales is None:
            raise ValueError(f"cache_dtype={cache_dtype} needs k_scales (per-layer fp8 scales: "
                             "jax_mla.model.transformer.calibrate_kv_scales)")
        self.k_scales = None if k_scales is None else jnp.asarray(k_scales, jnp.float32)
        m = cfg.mla
        d = m.kv_lora_rank + m.qk_rope_head_dim
        self.qlen = 1 + ecfg.spec_tokens
        max_pages = -(-ecfg.max_seq_len // ecfg.page_size)
        self.pages = PagedCacheManager(
            num_pages=ecfg.num_pages, page_size=ecfg.page_size,
            max_seqs=ecfg.max_decode + ecfg.max_prefill_seqs, max_pages_per_seq=max_pages)
        self.caches = [jnp.full((ecfg.num_pages, ecfg.page_size, d), jnp.nan, cache_dtype)
                       for _ in range(cfg.num_layers)]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, in admission order
        self.finished: list[Request] = []
        self.steps = 0
        self.worst_check: float | None = None

    def submit(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError(f"request {req.rid}: the prompt is empty")
        if len(req.prompt) + req.max_new_tokens + self.ecfg.spec_tokens > self.ecfg.max_seq_len:
            raise ValueError(
                f"request {req.rid}: prompt {len(req.prompt)} + max_new_tokens "
                f"{req.max_new_tokens} (+ {self.ecfg.spec_tokens} draft tokens) exceeds "
                f"max_seq_len={self.ecfg.max_seq_len}")
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

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
            if req in self.running and not req.in_prefill and \
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

    def _inputs(self, decode, drafts, prefill):
        e, q = self.ecfg, self.qlen
        td = e.max_decode * q
        t = td + e.prefill_tokens
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        for i, req in enumerate(decode):
            tokens[i * q:(i + 1) * q] = [req.known[-1]] + drafts[i]
            positions[i * q:(i + 1) * q] = req.cached + np.arange(q)
        off = td
        for req, n in prefill:
            tokens[off:off + n] = req.known[req.cached:req.cached + n]
            positions[off:off + n] = req.cached + np.arange(n)
            off += n
        ids = [r.rid for r in decode]
        slots = np.full(t, -1, np.int32)
        slots[:td] = self.pages.slot_mapping(ids, None, q, capacity=td)
        pids = [r.rid for r, _ in prefill]
        counts = [n for _, n in prefill]
        slots[td:] = self.pages.slot_mapping(pids, None, counts, capacity=e.prefill_tokens)
        cu = np.zeros(e.max_prefill_seqs + 1, np.int32)
        cu[1:len(counts) + 1] = np.cumsum(counts)
        cu[len(counts) + 1:] = cu[len(counts)]
        ctx = np.zeros(e.max_prefill_seqs, np.int32)
        ctx[:len(prefill)] = [r.cached for r, _ in prefill]
        return StepInputs(
            tokens=tokens, positions=positions, slot_mapping=slots,
            decode_block_table=self.pages.block_tables(ids, rows=e.max_decode),
            decode_seq_lens=self.pages.seq_lens(ids, rows=e.max_decode),
            prefill_block_table=self.pages.block_tables(pids, rows=e.max_prefill_seqs),
            prefill_context_lens=ctx, prefill_cu_seqlens=cu)

    def step(self) -> StepReport:
        """Schedule, run one model step, sample greedily, retire finished requests."""
        e, q = self.ecfg, self.qlen
        decode, prefill = self._schedule()
        if not decode and not prefill:
            if self.running or self.waiting:
                raise CacheFull(
                    "the cache cannot hold even one request's next tokens: raise num_pages",
                    needed=1, free=self.pages.num_free_pages)
            return StepReport("idle", 0, 0, 0, 0.0)
        drafts = [_draft(r.known, e.spec_tokens) for r in decode]
        inputs = self._inputs(decode, drafts, prefill)
        t0 = time.perf_counter()
        logits, self.caches = model_step(
            self.params, self.cfg, self.caches, jax.tree.map(jnp.asarray, inputs), qlen=q,
            workspace_tokens=e.workspace_tokens, backend=e.backend, k_scales=self.k_scales)
        logits = np.array(logits)  # a copy: the device buffer is not ours to keep
        seconds = time.perf_counter() - t0
        self.steps += 1
        check = None
        if e.check_every and self.steps % e.check_every == 0:
            check = self._check(decode, prefill, inputs, logits)
        new = 0
        choice = logits.argmax(-1)
        for i, req in enumerate(decode):
            rows = choice[i * q:(i + 1) * q]
            a = 0
            while a < e.spec_tokens and drafts[i][a] == rows[a] and \
                    len(req.output) + a + 1 < req.max_new_tokens:
                a += 1
            req.output += drafts[i][:a] + [int(rows[a])]
            req.accepted_drafts += a
            req.proposed_drafts += e.spec_tokens
            req.cached += 1 + a
            if a < e.spec_tokens:
                self.pages.truncate(req.rid, req.cached)
            new += a + 1
        off = e.max_decode * q
        for req, n in prefill:
            req.cached += n
            if not req.in_prefill and not req.output:
                req.output.append(int(choice[off + n - 1]))
                new += 1
            off += n
        for req in [r for r in self.running if r.done]:
            self.running.remove(req)
            self.pages.free(req.rid)
            self.finished.append(req)
        kind = ("verify" if q > 1 else "decode") if decode else "prefill"
        if decode and prefill:
            kind = "mixed"
        return StepReport(kind, len(decode) * q, sum(n for _, n in prefill), new, seconds, check,
                          running=len(self.running), waiting=len(self.waiting),
                          pages_used=self.pages.num_used_pages)

    # --- the per-step check --------------------------------------------------------------------

    def _check(self, decode, prefill, inputs, logits) -> float:
        """Worst relative error of this step's logits for up to two requests against the same
        tokens recomputed from scratch (one prefill over the whole history, XLA backend, a
        cache in the model's dtype: an fp8 cache's error is part of what is measured)."""
        q, worst = self.qlen, 0.0
        rows = [(r, i * q, q) for i, r in enumerate(decode)][:1]
        off = self.ecfg.max_decode * q
        for r, n in prefill:
            rows.append((r, off, n))
            off += n
        for req, start, n in rows[:2]:
            hist_len = int(inputs.positions[start + n - 1]) + 1
            toks = np.concatenate([np.asarray(req.known[:int(inputs.positions[start])], np.int32),
                                   inputs.tokens[start:start + n]])
            ref = reference_logits(self.params, self.cfg, toks, self.dtype,
                                   self.ecfg.page_size)[hist_len - n:hist_len]
            got = logits[start:start + n]
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            worst = max(worst, err)
        self.worst_check = worst if self.worst_check is None else max(self.worst_check, worst)
        return worst


def reference_logits(params, cfg: ModelConfig, tokens: np.ndarray, dtype, page_size: int):
    """Logits ``[n, vocab]`` of ``tokens`` run as one fresh prefill (XLA backend).

    The length is padded to a power of two (at least 16) so checks reuse few compilations.
    """
    n = len(tokens)
    cap = max(16, 1 << (n - 1).bit_length())
    pages = -(-cap // page_size)
    m = cfg.mla
    caches = [jnp.full((pages, page_size, m.kv_lora_rank + m.qk_rope_head_dim), jnp.nan, dtype)
              for _ in range(cfg.num_layers)]
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
    logits, _ = model_step(params, cfg, caches, jax.tree.map(jnp.asarray, inputs), qlen=1,
                           workspace_tokens=cap, backend="xla")
    return np.array(logits[:n])
