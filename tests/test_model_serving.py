"""The model as it is served: layers as one scan over stacked parameters and one cache buffer,
steps shaped to their work (buckets), sampling on the device, the host one step behind the
device (overlap), the recorded trace, and the serving metrics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.metadata import build_decode_metadata
from jax_mla.model import MLAConfig, YarnScaling
from jax_mla.model.sampling import SamplingParams, sample
from jax_mla.model.transformer import (
    ModelConfig,
    StepInputs,
    init_caches,
    init_model,
    layer_params,
    model_step,
    sample_rows,
    serve_step,
    stack_layers,
)
from jax_mla.serving import metrics
from jax_mla.serving.engine import Engine, EngineConfig, Request, compile_count

MLA = MLAConfig(hidden_size=64, num_heads=4, kv_lora_rank=32, q_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                rope_scaling=YarnScaling(factor=2.0, original_max_position_embeddings=32,
                                         mscale=1.0, mscale_all_dim=1.0))
CFG = ModelConfig(vocab_size=64, num_layers=3, mla=MLA, mlp_hidden=96)
SMALL = dict(num_pages=48, page_size=8, max_seq_len=64, max_decode=4, max_prefill_seqs=2,
             prefill_tokens=16, workspace_tokens=32, backend="xla", decode_buckets=(2, 4),
             prefill_buckets=(16,), mixed_decode_buckets=(4,))


@pytest.fixture(scope="module")
def params():
    return init_model(CFG, jax.random.key(3), jnp.float32)


def _requests(seed, n, prompt=(3, 20), new=(2, 8), **kw):
    rng = np.random.default_rng(seed)
    return [Request(rid=i, prompt=rng.integers(0, CFG.vocab_size, int(rng.integers(*prompt)))
                    .tolist(), max_new_tokens=int(rng.integers(*new)), **kw) for i in range(n)]


def _serve(engine, reqs, arrivals=2):
    return engine.serve(reqs, arrivals, max_calls=400)[0]


def _mixed_step(rng, page_size=8, pages=6):
    """Request 0 decodes (10 cached + 1 new), request 1 prefills 5 tokens after 7 cached."""
    table = np.arange(2 * pages, dtype=np.int32).reshape(2, pages)[:, ::-1].copy()
    slot = lambda r, p: int(table[r, p // page_size]) * page_size + p % page_size  # noqa: E731
    t = 1 + 8  # one decode row, an 8-token prefill bucket holding 5
    tokens = rng.integers(0, CFG.vocab_size, t).astype(np.int32)
    positions = np.array([10] + [7, 8, 9, 10, 11] + [0, 0, 0], np.int32)
    slots = np.array([slot(0, 10)] + [slot(1, p) for p in range(7, 12)] + [-1] * 3, np.int32)
    return StepInputs(
        tokens=tokens, positions=positions, slot_mapping=slots,
        decode_block_table=table[:1], decode_seq_lens=np.array([11], np.int32),
        prefill_block_table=table[1:], prefill_context_lens=np.array([7], np.int32),
        prefill_cu_seqlens=np.array([0, 5], np.int32))


def _filled_caches(rng, pages=12, page_size=8):
    c = rng.standard_normal((CFG.num_layers, pages, page_size, CFG.cache_width))
    c[:, :, 6:] = np.nan  # never read: rows past every length in _mixed_step's pages
    return jnp.asarray(c.astype(np.float32))


def test_scan_equals_the_python_loop(params, rng):
    """The scanned layers over one cache buffer equal the unrolled model, logits and caches."""
    step = jax.tree.map(jnp.asarray, _mixed_step(rng))
    caches = _filled_caches(rng)
    caches = caches.at[:, :, 6:].set(0.0)  # the same finite contents on both sides
    got, c_scan = model_step(params, CFG, caches.copy(), step, qlen=1, workspace_tokens=16,
                             backend="xla", layer_loop="scan")
    want, c_loop = model_step(params, CFG, caches.copy(), step, qlen=1, workspace_tokens=16,
                              backend="xla", layer_loop="python")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(c_scan), np.asarray(c_loop))
    assert np.abs(np.asarray(c_scan) - np.asarray(caches)).max() > 0  # the step wrote
    with pytest.raises(ValueError, match="layer_loop"):
        model_step(params, CFG, caches, step, qlen=1, workspace_tokens=16, layer_loop="x")


def test_layers_keep_to_their_own_pages(params, rng):
    """Each layer writes only its own slice of the shared buffer, and a page index past a
    layer's pages is clamped into them (never another layer's)."""
    step = _mixed_step(rng)
    caches = _filled_caches(rng)
    before = np.asarray(caches)
    _, after = model_step(params, CFG, caches, jax.tree.map(jnp.asarray, step), qlen=1,
                          workspace_tokens=16, backend="xla")
    after = np.asarray(after)
    for layer in range(CFG.num_layers):
        written = ~np.all((after[layer] == before[layer]) | (np.isnan(after[layer])
                                                             & np.isnan(before[layer])), axis=-1)
        flat = np.flatnonzero(written.reshape(-1))
        want = np.sort(step.slot_mapping[step.slot_mapping >= 0])
        np.testing.assert_array_equal(flat, want)
    # A table entry pointing past the pool: clamped to the last page of the same layer.
    bad = dataclasses.replace(step, decode_block_table=step.decode_block_table + 1000)
    logits, _ = model_step(params, CFG, jnp.asarray(before), jax.tree.map(jnp.asarray, bad),
                           qlen=1, workspace_tokens=16, backend="xla")
    assert np.isfinite(np.asarray(logits)[1:6]).all()  # the prefill rows are untouched


def test_page_offset_moves_every_index():
    table = np.array([[3, 1, 0], [2, 0, 0]], np.int32)
    md = build_decode_metadata(table, np.array([40, 9], np.int32), page_size=16)
    moved = md.with_page_offset(100)
    np.testing.assert_array_equal(np.asarray(moved.block_table), table + 100)
    idx, new = np.asarray(md.page_indices), np.asarray(moved.page_indices)
    np.testing.assert_array_equal(new, np.where(idx >= 0, idx + 100, -1))
    flat, new = np.asarray(md.paged_kv_indices), np.asarray(moved.paged_kv_indices)
    np.testing.assert_array_equal(new, np.where(flat >= 0, flat + 1600, -1))
    assert (flat == -1).any()  # the -1 tail is there, and stayed


def test_stacked_layers_round_trip(params):
    layers = [layer_params(params, i) for i in range(CFG.num_layers)]
    again = stack_layers(layers)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params["layers"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_serve_step_samples_what_the_logits_say(params, rng):
    """Device greedy sampling at the sampled rows equals the host's argmax of the full logits;
    ``feed`` reads tokens from the previous ids; ids land at their fixed places."""
    step = _mixed_step(rng)
    caches = _filled_caches(rng).at[:, :, 6:].set(0.0)
    num = 4 * 1 + 2
    prev = jnp.asarray(rng.integers(0, CFG.vocab_size, num), jnp.int32)
    feed = np.full(step.tokens.shape, -1, np.int32)
    feed[0] = 3  # the decode row's token comes from the previous step's ids, slot 3
    ids, logits, _ = serve_step(params, CFG, caches.copy(), jax.tree.map(jnp.asarray, step),
                                feed, prev, jax.random.key(0), qlen=1, workspace_tokens=16,
                                num_samples=num, backend="xla")
    fed = dataclasses.replace(step, tokens=np.where(feed >= 0, np.asarray(prev)[3], step.tokens)
                              .astype(np.int32))
    full, _ = model_step(params, CFG, caches.copy(), jax.tree.map(jnp.asarray, fed), qlen=1,
                         workspace_tokens=16, backend="xla")
    rows = np.asarray(sample_rows(fed, 1))
    np.testing.assert_array_equal(rows, [0, 5])  # the decode row, the prefill's last row
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full)[rows], rtol=1e-5,
                               atol=1e-5)
    want = np.asarray(full)[rows].argmax(-1)
    ids = np.asarray(ids)
    assert ids[0] == want[0] and ids[num - 1] == want[1], (ids, want)


def test_sampling_rules():
    key = jax.random.key(1)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((6, 50)), jnp.float32)
    greedy = np.asarray(logits).argmax(-1)
    np.testing.assert_array_equal(np.asarray(sample(logits, key, None)), greedy)
    ones = jnp.ones((6,), jnp.float32)
    for params in (SamplingParams(0 * ones, jnp.zeros(6, jnp.int32), ones),  # temperature 0
                   SamplingParams(ones, jnp.ones(6, jnp.int32), ones),  # top-k 1
                   SamplingParams(ones, jnp.zeros(6, jnp.int32), 1e-6 * ones)):  # top-p ~0
        np.testing.assert_array_equal(np.asarray(sample(logits, key, params)), greedy)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7)])
def test_sampling_distribution(top_k, top_p):
    """Draws follow softmax(logits / T) restricted to the top-k / top-p set (chi-square)."""
    z = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.0], np.float32)
    n, t = 20000, 0.8
    logits = jnp.asarray(np.tile(z, (n, 1)))
    params = SamplingParams(jnp.full((n,), t), jnp.full((n,), top_k, jnp.int32),
                            jnp.full((n,), top_p))
    ids = np.asarray(sample(logits, jax.random.key(7), params))
    p = np.exp(z / t - (z / t).max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros(z.size, bool)
    if top_k:
        keep[order[:top_k]] = True
    else:
        before = np.cumsum(p[order]) - p[order]
        keep[order[before < top_p]] = True
    want = np.where(keep, p, 0)
    want /= want.sum()
    counts = np.bincount(ids, minlength=z.size)
    assert counts[~keep].sum() == 0, counts
    exp = want[keep] * n
    chi2 = float(((counts[keep] - exp) ** 2 / exp).sum())
    assert chi2 < 30, (chi2, counts, exp)  # df <= 7: p < 1e-4 of failing by chance


def test_buckets_and_their_choice(params):
    e = EngineConfig(max_decode=8, prefill_tokens=512, backend="xla")
    assert e.buckets() == [(1, 0), (2, 0), (4, 0), (8, 0), (0, 32), (8, 32), (0, 64), (8, 64),
                           (0, 128), (8, 128), (0, 256), (8, 256), (0, 512), (8, 512)]
    eng = Engine(params, CFG, EngineConfig(**SMALL), dtype=jnp.float32)
    assert eng._bucket_for(1, 0) == (2, 0) and eng._bucket_for(3, 0) == (4, 0)
    assert eng._bucket_for(0, 5) == (4, 16) and eng._bucket_for(2, 16) == (4, 16)
    with pytest.raises(ValueError, match="decode_buckets must be increasing"):
        EngineConfig(max_decode=8, decode_buckets=(4, 2, 8)).buckets()
    with pytest.raises(ValueError, match="prefill_buckets .* end at 64"):
        EngineConfig(prefill_tokens=64, prefill_buckets=(16, 32)).buckets()


def test_steady_state_never_compiles(params):
    """Every bucket compiled ahead: serving a stream of requests compiles nothing; the counter
    does see a compilation when one happens."""
    eng = Engine(params, CFG, EngineConfig(**SMALL), dtype=jnp.float32)
    eng.compile(log=None)
    assert eng.compiles_since_warmup == 0
    reports = _serve(eng, _requests(11, 8))
    assert len(eng.finished) == 8
    assert {r.bucket for r in reports} >= {(2, 0), (4, 0), (4, 16)}
    assert eng.compiles_since_warmup == 0
    x = np.ones((3, 5, 7), np.float32)
    before = compile_count()
    jax.jit(lambda x: x * 3 + 1)(x)
    assert compile_count() == before + 1 and eng.compiles_since_warmup == 1


def test_overlap_gives_the_synchronous_tokens(params):
    """The host one step behind (tokens fed on the device) serves exactly the tokens of the
    synchronous loop; the recorded trace replays to the same ids."""
    runs = {}
    for overlap in (False, True):
        eng = Engine(params, CFG, dataclasses.replace(EngineConfig(**SMALL), overlap=overlap,
                                                      record=True), dtype=jnp.float32)
        reqs = _requests(5, 7)
        _serve(eng, reqs)
        runs[overlap] = ({r.rid: r.output for r in eng.finished}, eng)
        assert all(len(r.output) == r.max_new_tokens for r in eng.finished)
        assert all(len(r.token_times) == len(r.output) == len(r.token_steps)
                   for r in eng.finished)
    assert runs[True][0] == runs[False][0]
    eng = runs[True][1]
    assert any((np.asarray(rec["inputs"].tokens) != 0).any() for rec in eng.records)
    # Replay the trace with model_step on a fresh cache: the same greedy ids, step by step.
    caches = init_caches(CFG, eng.ecfg.num_pages, eng.ecfg.page_size, jnp.float32)
    for rec in eng.records:
        logits, caches = model_step(params, CFG, caches, jax.tree.map(jnp.asarray,
                                                                       rec["inputs"]),
                                    qlen=1, workspace_tokens=32, backend="xla")
        rows = np.asarray(sample_rows(rec["inputs"], 1))
        want = np.asarray(logits)[rows].argmax(-1)
        b_d, t_p = rec["bucket"]
        b_p = 2 if t_p else 0
        got = np.concatenate([rec["ids"][:b_d], rec["ids"][eng.num_samples - b_p:]])
        live = np.concatenate([rec["inputs"].decode_seq_lens > 0,
                               np.diff(rec["inputs"].prefill_cu_seqlens) > 0])
        np.testing.assert_array_equal(got[live], want[live])


def test_random_sampling_engine(params):
    """Per-request temperatures: reproducible with the seed, and a temperature-0 request
    gets the greedy tokens whatever its neighbours do."""
    def run(seed):
        eng = Engine(params, CFG, dataclasses.replace(EngineConfig(**SMALL), sampling="random",
                                                      seed=seed), dtype=jnp.float32)
        reqs = _requests(9, 6, temperature=1.0, top_k=20, top_p=0.9)
        reqs[0].temperature = 0.0
        _serve(eng, reqs)
        return {r.rid: r.output for r in eng.finished}

    a, b, c = run(0), run(0), run(1)
    assert a == b and a != c
    greedy = Engine(params, CFG, EngineConfig(**SMALL), dtype=jnp.float32)
    _serve(greedy, _requests(9, 6)[:1])
    assert greedy.finished[0].output == a[0]
    with pytest.raises(ValueError, match="sampling='random'"):
        greedy.submit(Request(9, [1, 2], 3, temperature=0.5))


def test_serving_metrics():
    reqs = [Request(0, [1, 2, 3], 3, output=[4, 5, 6], arrival=10.0,
                    token_times=[10.5, 10.7, 11.0]),
            Request(1, [1], 2, output=[7, 8], arrival=10.2, token_times=[10.4, 10.5])]
    s = metrics.summarize(reqs, [], wall_s=2.0)
    assert s["output_tokens"] == 5 and s["tokens_per_s"] == 2.5
    assert s["total_tokens_per_s"] == (5 + 4) / 2.0
    assert s["ttft_ms"]["p50"] == pytest.approx(350.0) and s["ttft_ms"]["n"] == 2
    assert s["itl_ms"]["n"] == 3 and s["itl_ms"]["p50"] == pytest.approx(200.0)
    assert "TTFT ms p50/p90/p99" in metrics.format_summary(s)
