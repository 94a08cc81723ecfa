"""The serving benchmark's PyTorch peer (jax_mla/bench/serve_peer.py) against the JAX model.

On CPU the peer runs its torch reference decode and SDPA's math backend, eagerly; the steps here
are what the engine records (decode rows first, prefill chunks packed by cu_seqlens, padding
requests and rows) over a NaN-poisoned cache, and every real sample row's float32 logits must
match an unrolled JAX forward of the same steps built from the model layer (XLA backend).
The FlashMLA route's calling convention is checked through a stub of FlashMLA's documented API;
FlashMLA itself, SDPA's CUDA backends and the CUDA graphs need a GPU and are not run here.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.metadata import build_decode_metadata
from jax_mla.model import MLAConfig, YarnScaling
from jax_mla.model.layer import AttentionBatch, mla_layer, rms_norm
from jax_mla.model.transformer import ModelConfig, init_model

torch = pytest.importorskip("torch")
from jax_mla.bench.serve_peer import TorchPeer, peer_available  # noqa: E402

MLA = MLAConfig(hidden_size=64, num_heads=4, kv_lora_rank=32, q_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                rope_scaling=YarnScaling(factor=2.0, original_max_position_embeddings=32,
                                         mscale=1.0, mscale_all_dim=1.0))
# The other projection and rotary forms: direct query projection, biases, rotate-half pairs.
MLA_DIRECT = dataclasses.replace(MLA, q_lora_rank=None, attention_bias=True, rope_interleave=False,
                                 rope_scaling=None)
CFGS = {"lora_yarn": ModelConfig(vocab_size=64, num_layers=2, mla=MLA, mlp_hidden=96),
        "direct_bias": ModelConfig(vocab_size=64, num_layers=1, mla=MLA_DIRECT, mlp_hidden=96)}
CFG = CFGS["lora_yarn"]
PAGE, NUM_PAGES, MAX_PAGES, MAX_SEQ = 4, 24, 6, 24
WORKSPACE = 32


@functools.cache
def _params(name):
    return init_model(CFGS[name], jax.random.key(3), jnp.float32)


@dataclasses.dataclass
class Step:  # the fields of transformer.StepInputs, as NumPy arrays
    tokens: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    decode_block_table: np.ndarray
    decode_seq_lens: np.ndarray
    prefill_block_table: np.ndarray
    prefill_context_lens: np.ndarray
    prefill_cu_seqlens: np.ndarray


# Two requests on scattered pages; page 0 belongs to no one (padding requests point at it).
PAGES = {"A": [7, 2, 11, 5, 19, 8], "B": [3, 14, 9, 1, 20, 16]}


def _slots(req, start, n):
    pos = np.arange(start, start + n)
    return np.asarray(PAGES[req])[pos // PAGE] * PAGE + pos % PAGE


def _step(toks, decode, prefill, *, qlen, t, b_d, b_p):
    """``decode``: [(request, seq_len)] (its last ``qlen`` tokens are new), padded to ``b_d``;
    ``prefill``: [(request, context, n)], padded to ``b_p``; ``t`` rows in all (padding rows:
    token 0, position 0, slot -1). Request ``r``'s token at position ``p`` is ``toks[r][p]``."""
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, -1, np.int32)
    dtab = np.zeros((b_d, MAX_PAGES), np.int32)
    dlens = np.zeros(b_d, np.int32)
    for b, (req, n) in enumerate(decode):
        rows = slice(b * qlen, (b + 1) * qlen)
        positions[rows] = np.arange(n - qlen, n)
        tokens[rows] = toks[req][n - qlen:n]
        slots[rows] = _slots(req, n - qlen, qlen)
        dtab[b], dlens[b] = PAGES[req], n
    ptab = np.zeros((b_p, MAX_PAGES), np.int32)
    ctx = np.zeros(b_p, np.int32)
    cu = np.zeros(b_p + 1, np.int32)
    off = b_d * qlen
    for j, (req, c, n) in enumerate(prefill):
        positions[off:off + n] = np.arange(c, c + n)
        tokens[off:off + n] = toks[req][c:c + n]
        slots[off:off + n] = _slots(req, c, n)
        ptab[j], ctx[j] = PAGES[req], c
        cu[j + 1:] = cu[j] + n
        off += n
    return Step(tokens, positions, slots, dtab, dlens, ptab, ctx, cu)


# A prefill of two prompts (B's first chunk); a mixed step (A decodes, B's second chunk over its
# cached context); a decode step; a verify step (qlen 2): [(decode, prefill, qlen)].
SCHEDULE = [([], [("A", 0, 9), ("B", 0, 5)], 1),
            ([("A", 10)], [("B", 5, 7)], 1),
            ([("A", 11), ("B", 13)], [], 1),
            ([("A", 13), ("B", 15)], [], 2)]


def _steps(rng, compact=False):
    """[(inputs, qlen)] of SCHEDULE. As the engine records them (default): static capacities,
    3 decode requests x qlen + 14 prefill rows, 2 prefill requests, padding requests and rows
    filling them (one compile per qlen on the JAX side). ``compact``: no padding beyond what
    each step needs (B_d = 0 for the prefill, B_p = 0 for decode / verify, one padding request
    and row in the mixed step)."""
    toks = {r: rng.integers(0, CFG.vocab_size, MAX_SEQ) for r in PAGES}
    out = []
    for decode, prefill, qlen in SCHEDULE:
        if compact:
            b_d = len(decode) + (1 if prefill and decode else 0)
            b_p = len(prefill) + (1 if prefill and decode else 0)
            t = b_d * qlen + sum(n for _, _, n in prefill) + (1 if prefill else 0)
        else:
            b_d, b_p, t = 3, 2, 3 * qlen + 14
        out.append((_step(toks, decode, prefill, qlen=qlen, t=t, b_d=b_d, b_p=b_p), qlen))
    return out


def _sample_rows(step, qlen):
    """(rows, real): the peer's sample rows and which of them belong to a real request."""
    t_d = step.decode_seq_lens.shape[0] * qlen
    cu = step.prefill_cu_seqlens
    rows = list(range(t_d)) + [t_d + int(cu[j + 1]) - 1 for j in range(cu.shape[0] - 1)]
    real = list(np.repeat(step.decode_seq_lens > 0, qlen)) + list(np.diff(cu) > 0)
    return np.asarray(rows), np.asarray(real, bool)


def _layers(params, cfg):
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return list(layers)
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(cfg.num_layers)]


def _jax_step(params, cfg, caches, step, qlen):
    """The model's step unrolled from the layer pieces (XLA backend): logits [T, vocab] f32."""
    s = {f.name: jnp.asarray(getattr(step, f.name)) for f in dataclasses.fields(step)}
    m = cfg.mla
    x = params["embed"][s["tokens"]]
    new = []
    for p, cache in zip(_layers(params, cfg), caches):
        x, cache = _jax_block(p, cfg, x, cache, s, qlen)
        new.append(cache)
    x = rms_norm(x, params["norm"], m.rms_norm_eps)
    logits = jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST)
    return np.asarray(logits), new


@functools.partial(jax.jit, static_argnames=("cfg", "qlen"))
def _jax_block(p, cfg, x, cache, s, qlen):
    """One block (attention and MLP) as transformer.model_step runs it; one compile serves
    every layer of a step shape."""
    m = cfg.mla
    s = Step(**s)
    md = None
    if s.decode_seq_lens.shape[0]:
        md = build_decode_metadata(
            s.decode_block_table, s.decode_seq_lens, page_size=PAGE, qlen=qlen,
            num_heads=m.num_heads, q_dtype=x.dtype, kv_dtype=cache.dtype,
            kv_lora_rank=m.kv_lora_rank, rope_dim=m.qk_rope_head_dim, backend="xla")
    has_prefill = s.prefill_cu_seqlens.shape[0] > 1
    batch = AttentionBatch(
        slot_mapping=s.slot_mapping, decode=md,
        prefill_block_table=s.prefill_block_table if has_prefill else None,
        prefill_context_lens=s.prefill_context_lens if has_prefill else None,
        prefill_cu_seqlens=s.prefill_cu_seqlens if has_prefill else None)
    a, cache = mla_layer(p["attn"], m, rms_norm(x, p["attn_norm"], m.rms_norm_eps),
                         s.positions, cache, batch, decode_backend="xla", prefill_backend="xla",
                         workspace_tokens=WORKSPACE if has_prefill else None)
    x = x + a
    g, u = jnp.split(rms_norm(x, p["mlp_norm"], m.rms_norm_eps) @ p["gate_up"], 2, axis=-1)
    return x + (jax.nn.silu(g) * u) @ p["down"], cache


def _nan_caches(cfg):
    m = cfg.mla
    return [jnp.full((NUM_PAGES, PAGE, m.kv_lora_rank + m.qk_rope_head_dim), jnp.nan,
                     jnp.float32) for _ in range(cfg.num_layers)]


def _peer(params, cfg, **kw):
    return TorchPeer(params, cfg, num_pages=NUM_PAGES, page_size=PAGE, max_seq_len=MAX_SEQ,
                     dtype="float32", cache_fill=float("nan"), **kw)


@pytest.mark.parametrize("name,num_steps", [("lora_yarn", 4), ("direct_bias", 2)])
def test_peer_logits_match_jax(rng, name, num_steps):
    """Every step kind on the DeepSeek-V3 form; the other projection / rotary form through the
    prefill and mixed steps (both attention paths) only, to keep the JAX compiles few."""
    cfg, params = CFGS[name], _params(name)
    peer = _peer(params, cfg)
    caches = _nan_caches(cfg)
    for i, (step, qlen) in enumerate(_steps(rng)[:num_steps]):
        ids, got = peer.step(step, qlen, return_logits=True)
        ref, caches = _jax_step(params, cfg, caches, step, qlen)
        rows, real = _sample_rows(step, qlen)
        assert ids.shape == got.shape[:1] == rows.shape and ids.dtype == np.int32
        ref = ref[rows[real]]
        err = np.linalg.norm(got[real] - ref) / np.linalg.norm(ref)
        assert err < 1e-4, (i, err)
        np.testing.assert_array_equal(ids[real], ref.argmax(-1), err_msg=f"step {i}")
        # The cache is NaN wherever no step wrote (page 0, the pages' unwritten rows); none of
        # it reaches a logit, padding decode requests (pointed at page 0) included.
        t_d = step.decode_seq_lens.shape[0] * qlen
        assert np.isfinite(got[real]).all() and np.isfinite(got[:t_d]).all(), i
        assert (ids[t_d:][~real[t_d:]] == 0).all(), i  # padding prefill requests
    assert torch.isnan(peer.flat).any(), "the poison must still be there: unwritten slots"
    assert peer.backend["decode"] == "torch-reference" and not peer.backend["cuda_graphs"]
    assert set(peer.backend["prefill"]["sdpa"]) == {"causal", "lower_right"}


class _StubFlashMLA:
    """FlashMLA's dense decode API as documented (``get_mla_metadata``,
    ``flash_mla_with_kvcache``), computed by a plain reference, checking how the peer calls it:
    int32 contiguous lens and table, every length >= 1 and every page read a real one, and the
    metadata's reuse rule (planned by its first call; later calls must bring the same shapes
    and lengths)."""

    def __init__(self):
        self.plans = self.calls = 0

    def get_mla_metadata(self):
        return types.SimpleNamespace(planned=None), None

    def flash_mla_with_kvcache(self, q, cache, table, lens, head_dim_v, meta, num_splits, *,
                               softmax_scale, causal):
        b, qn, h, d = q.shape
        pages, page = cache.shape[:2]
        assert cache.shape[2:] == (1, d) and num_splits is None and causal == (qn > 1)
        assert table.dtype == lens.dtype == torch.int32 and lens.is_contiguous()
        assert table.stride(-1) == 1 and table.shape[0] == b == lens.shape[0]
        key = (q.shape, lens.clone(), causal)
        if meta.planned is None:
            meta.planned = key
            self.plans += 1
        assert meta.planned[0] == key[0] and torch.equal(meta.planned[1], key[1])
        self.calls += 1
        assert int(lens.min()) >= 1
        out = torch.zeros(b, qn, h, head_dim_v, dtype=q.dtype)
        for i in range(b):
            n = int(lens[i])
            used = table[i, : -(-n // page)].long()
            assert int(used.min()) >= 0 and int(used.max()) < pages
            kv = cache[used, :, 0].reshape(-1, d)[:n].float()
            for t in range(qn):
                k = kv[: n - qn + t + 1] if causal else kv
                p = torch.softmax(q[i, t].float() @ k.T * softmax_scale, dim=-1)
                out[i, t] = (p @ k[:, :head_dim_v]).to(q.dtype)
        return out, None


def test_flashmla_calling_convention(rng):
    """The FlashMLA route (forced on CPU through a stub of its API) gives the reference route's
    logits: padding requests get a length and a page FlashMLA can read, and their NaN rows
    (page 0 is poisoned) are dropped; one plan per step, shared by the layers."""
    steps = _steps(rng)
    ref, peer = _peer(_params("lora_yarn"), CFG), _peer(_params("lora_yarn"), CFG)
    peer._fm = stub = _StubFlashMLA()
    for i, (step, qlen) in enumerate(steps):
        _, want = ref.step(step, qlen, return_logits=True)
        _, got = peer.step(step, qlen, return_logits=True)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(i))
    assert stub.plans == len(steps) and stub.calls == len(steps) * CFG.num_layers
    assert peer.backend["decode"] == "flashmla"


def test_compact_steps_equal_padded(rng):
    """The same schedule without the static capacities' padding (prefill-only B_d = 0,
    decode-only B_p = 0, T just the rows used) gives the same logits on every real row."""
    seed = int(rng.integers(2**31))  # the same tokens in both forms
    padded = _steps(np.random.default_rng(seed))
    compact = _steps(np.random.default_rng(seed), compact=True)
    a, b = _peer(_params("lora_yarn"), CFG), _peer(_params("lora_yarn"), CFG)
    for i, ((sp, qlen), (sc, _)) in enumerate(zip(padded, compact)):
        _, lp = a.step(sp, qlen, return_logits=True)
        ic, lc = b.step(sc, qlen, return_logits=True)
        rp, realp = _sample_rows(sp, qlen)
        rc, realc = _sample_rows(sc, qlen)
        assert ic.shape == (len(rc),)
        np.testing.assert_allclose(lc[realc], lp[realp], rtol=1e-5, atol=1e-5, err_msg=str(i))


def test_poisoned_slot_reaches_only_its_request(rng):
    """NaN written into one slot A attends shows in A's logits and in no other request's: the
    isolation the previous test relies on is real (the check can fail)."""
    params = _params("lora_yarn")
    peer = _peer(params, CFG)
    steps = _steps(rng)
    peer.step(*steps[0])
    peer.flat[0, int(_slots("A", 3, 1)[0])] = float("nan")
    _, got = peer.step(*steps[1], return_logits=True)
    # Row 0: A's decode row; rows 1, 2: padding decode requests; row 3: B's prefill chunk.
    assert np.isnan(got[0]).all() and np.isfinite(got[1:4]).all()


def test_stacked_layers_and_replay(rng):
    """Stacked layers (a leading num_layers axis) give the list's logits; replay resets the
    cache after its warm-up and returns per-step seconds and the same ids as stepping."""
    params = _params("lora_yarn")
    listed = dict(params, layers=_layers(params, CFG))
    stacked = dict(params, layers=jax.tree.map(lambda *a: jnp.stack(a), *listed["layers"]))
    steps = _steps(rng)
    a, b = _peer(listed, CFG), _peer(stacked, CFG)
    stepped = []
    for step, qlen in steps:
        (ia, la), (_, lb) = a.step(step, qlen, return_logits=True), b.step(
            step, qlen, return_logits=True)
        np.testing.assert_array_equal(la, lb)
        stepped.append(ia)
    r = _peer(params, CFG)
    out = r.replay(steps, warmup=True)
    assert len(out["seconds"]) == len(steps) and all(s > 0 for s in out["seconds"])
    for i, (got, want) in enumerate(zip(out["ids"], stepped)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {i}")
    # The replayed cache is the stepped one: same slots written, the rest still poisoned.
    torch.testing.assert_close(r.flat, a.flat, rtol=0, atol=0, equal_nan=True)
    assert out["backend"]["decode"] == "torch-reference"


def test_errors(rng):
    params = _params("lora_yarn")
    with pytest.raises(NotImplementedError, match="fp8"):
        TorchPeer(params, CFG, num_pages=NUM_PAGES, page_size=PAGE, max_seq_len=MAX_SEQ,
                  dtype="float8_e4m3fn")
    peer = _peer(params, CFG)
    steps = _steps(rng)
    peer.step(*steps[0])
    step = steps[1][0]  # B's second chunk reads its context through the prefill block table
    bad = dataclasses.replace(step, prefill_block_table=step.prefill_block_table + NUM_PAGES)
    with pytest.raises(ValueError, match="page"):
        peer.step(bad, 1)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            _peer(params, CFG, cuda_graphs=True)
        assert "CUDA" in peer_available()
