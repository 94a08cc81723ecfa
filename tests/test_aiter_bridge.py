"""The AITER bridge against the stand-in: every route, through the public entry points.

``tests/aiter_standin`` is a torch package with AITER's import paths and Python signatures and
reference math (it checks dtypes, shapes and argument kinds like AITER's host code). With it on
``sys.path``, ``backend="aiter"`` runs the real bridge (``jax_mla.backends.aiter.bridge``:
buffer_callback + ``torch.from_dlpack``) inside ``jax.jit``; results must match the float64 oracle
and the xla backend. On CPU ``ctx.stream`` is absent; on a CUDA GPU the same tests run the
stand-in in torch CUDA on XLA's stream. Nothing here has run on AMD hardware.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla.backends import aiter as aiter_backend
from jax_mla.backends import resolve_backend
from jax_mla.backends.aiter import build_aiter_decode_metadata, triton_kernels
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.problem import detect_target

import oracle
from aiter_standin.harness import forced_standins
from conftest import make_case

PS = 8  # page size of the test caches


@pytest.fixture
def aiter_on():
    """The stand-in as ``aiter`` and the bridge forced on for this (non-ROCm) platform."""
    with forced_standins() as enter:
        yield enter


def _snapshot(*xs):
    return [np.asarray(jax.device_get(x)).copy() for x in jax.tree_util.tree_leaves(xs)]


def _assert_unchanged(before, *xs):
    """Inputs unchanged means bit-identical: compare the raw bytes.

    (``np.testing.assert_array_equal`` is not that: on some numpy builds it reported
    ``nan (ACTUAL), nan (DESIRED)`` mismatches for NaN-poisoned bfloat16 arrays, and it would
    also accept a NaN payload or a -0.0/+0.0 flip.)
    """
    after = [np.asarray(jax.device_get(x)) for x in jax.tree_util.tree_leaves(xs)]
    assert len(before) == len(after), (len(before), len(after))
    for i, (b, a) in enumerate(zip(before, after)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (i, a.dtype, a.shape, b.dtype, b.shape)
        if a.size == 0:
            continue
        ab = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, -1)
        bb = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(b.size, -1)
        diff = np.flatnonzero((ab != bb).any(axis=1))
        if diff.size:
            idx = np.unravel_index(diff[0], a.shape)
            raise AssertionError(
                f"input leaf {i} ({a.dtype}{list(a.shape)}) was modified: {diff.size} element(s) "
                f"differ, first at index {tuple(int(j) for j in idx)}: before {b[idx]!r} "
                f"(bytes {bb[diff[0]].tobytes().hex()}), after {a[idx]!r} "
                f"(bytes {ab[diff[0]].tobytes().hex()})"
            )


def test_assert_unchanged_is_bitwise_and_catches_mutation():
    # The helper itself: NaN-poisoned bf16 equal to itself, a real write caught and located.
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    x = jnp.asarray(np.where(base % 5 == 0, np.nan, base), jnp.bfloat16)
    y = jnp.arange(6, dtype=jnp.int32)
    before = _snapshot(x, y)
    _assert_unchanged(before, x, y)
    _assert_unchanged(before, jnp.array(x), y)
    for leaf, idx, val in ((0, (1, 2, 3), 7.0), (0, (0, 0, 0), -np.nan), (1, (4,), -1)):
        m = np.array((x, y)[leaf])
        m[idx] = val  # a value change, and a NaN turned into another NaN bit pattern
        args = (jnp.asarray(m), y) if leaf == 0 else (x, jnp.asarray(m))
        with pytest.raises(AssertionError, match=rf"leaf {leaf} .*first at index "
                                                 rf"{re.escape(str(idx))}"):
            _assert_unchanged(before, *args)


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


# (id, arch, kv dtype, per-rank heads, dcp N, qlen, K, lens, expected route, persistent)
DECODE_ROUTES = [
    ("asm-persistent", "gfx950", "bf16", 16, 1, 1, 1, [300, 0, 20, 5], "asm", True),
    ("asm-persistent-fold-qlen2", "gfx942", "bf16", 32, 1, 2, 2, [150, 40, 3], "asm", True),
    ("asm-nonpersistent-zero-fill", "gfx942", "bf16", 12, 1, 8, 8, [40, 9], "asm", False),
    ("asm-fp8-fnuz-padded", "gfx942", "fp8", 12, 1, 1, 1, [100, 7, 33], "asm", True),
    ("asm-dcp-lse", "gfx950", "bf16", 6, 2, 1, 1, [90, 0, 31], "asm", True),
    ("gluon-decode", "gfx950", "bf16", 8, 1, 1, 1, [60, 1, 17], "gluon_decode", False),
    ("gluon-verify", "gfx950", "bf16", 12, 1, 3, 3, [45, 2, 20], "gluon_verify", False),
]


@pytest.mark.parametrize("case", DECODE_ROUTES, ids=lambda c: c[0])
def test_decode_route_matches_oracle_and_xla(rng, aiter_on, case):
    _, arch, dt, h, n, qlen, k, lens, kind, persistent = case
    aiter = aiter_on(arch)
    heads = h * n  # the DCP-gathered query heads
    c = make_case(rng, seq_lens=lens, qlen=qlen, num_heads=heads, page_size=PS)
    if dt == "fp8":
        f8 = caps.fp8_dtype(arch)
        q, cache = jnp.asarray(c.q, f8), jnp.asarray(c.cache, f8)
        q_scale, kv_scale = jnp.float32(0.5), jnp.float32(1.5)
    else:
        q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
        q_scale = kv_scale = None
    lse_wanted = n > 1
    md = build_aiter_decode_metadata(c.block_table, c.seq_lens, page_size=PS, num_heads=heads,
                                     qlen=qlen, kv_dtype=cache.dtype, arch=arch, num_cu=8,
                                     mtp_decode_qlen=k, dcp_world_size=n)
    route = md.plan.route
    assert (route.kind, route.persistent) == (kind, persistent)
    before = _snapshot(q, cache, md)
    kw = dict(scale=c.scale, q_scale=q_scale, kv_scale=kv_scale, return_lse=lse_wanted)
    res = jax_mla.mla_attention(q, cache, md, backend="aiter", **kw)
    _assert_unchanged(before, q, cache, md)  # inputs are never written
    out, lse = res if lse_wanted else (res, None)
    assert out.shape == (c.q.shape[0], heads, 512) and out.dtype == jnp.bfloat16
    want, want_lse = oracle.mla_decode(_f32(q), _f32(cache), c.block_table, c.seq_lens,
                                       qlen=qlen, page_size=PS, scale=c.scale, kv_lora_rank=512,
                                       q_scale=0.5 if dt == "fp8" else 1.0,
                                       kv_scale=1.5 if dt == "fp8" else 1.0)
    assert oracle.rel_err(_f32(out), want) < 1e-2
    views = md.replace(plan=None, schedule=None)  # the same views, planned by the call for xla
    xla = jax_mla.mla_attention(q, cache, views, backend="xla", **kw)
    xla_out = xla[0] if lse_wanted else xla
    assert oracle.rel_err(_f32(out), _f32(xla_out)) < 1e-2
    if lse_wanted:
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=2e-3, rtol=1e-3)

    # What AITER was handed: vLLM's head counts, flags and scales.
    if kind == "asm":
        (call,) = aiter.calls("mla_decode_fwd")
        assert call["heads"] == caps.actual_num_heads(heads) == route.kernel_heads
        assert call["plan_passed"] is persistent and call["return_lse"] is lse_wanted
        assert call["max_seqlen_q"] == qlen and call["sm_scale"] == pytest.approx(c.scale)
        assert call["kv_buffer_shape"][1:] == (1, 1, 576)
        if persistent:
            assert call["meta_ptrs_ok"]  # the 2-pointer table the asm kernel reads
        if qlen > 1 and not persistent:
            assert call["o_zero_at_entry"]  # unwritten lanes must not leak
        if dt == "fp8":
            assert (call["q_scale"], call["kv_scale"]) == (0.5, 1.5)
            assert call["q_dtype"] == aiter.dtypes.fp8  # fnuz on gfx942
    else:
        (call,) = aiter.calls("mla_gluon")
        assert call["heads"] == heads and not call["use_2d_view"]
        assert call["q_shape"] == ((len(lens), qlen, heads, 512) if qlen > 1
                                   else (len(lens), heads, 512))
        # AITER reads it only for 64/128 heads: below that its default, with no host sync.
        assert call["min_kv_seq_len"] == (min(lens) if heads in (64, 128) else 1)


def test_single_token_dcp_decode_returns_unpadded_lse(rng, aiter_on):
    # vLLM: H 6, N 2 -> 12 gathered heads, padded to 16; LSE comes back with 12 heads.
    aiter = aiter_on("gfx950")
    c = make_case(rng, seq_lens=[20, 33, 9], qlen=1, num_heads=12, page_size=PS)
    q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
    md = build_aiter_decode_metadata(c.block_table, c.seq_lens, page_size=PS, num_heads=12,
                                     arch="gfx950", num_cu=8, dcp_world_size=2)
    out, lse = jax_mla.mla_attention(q, cache, md, scale=c.scale, backend="aiter",
                                     return_lse=True)
    (call,) = aiter.calls("mla_decode_fwd")
    assert call["heads"] == 16 and call["return_lse"]
    assert out.shape == (3, 12, 512) and lse.shape == (3, 12)


@pytest.mark.parametrize("dt", ["bf16", "fp8"])
def test_segmented_dcp_verify_matches_row_oracle(rng, aiter_on, dt):
    # One rank's share of a DCP verify: every row attends its own causally bounded local
    # window (row_lens), merged across ranks by the DCP combine (not exercised here).
    from jax_mla.dcp import dcp_local_seq_lens

    aiter = aiter_on("gfx950")
    n, rank, qlen, heads = 2, 1, 3, 32
    tot = np.array([41, 3, 18], np.int32)
    local = np.asarray(dcp_local_seq_lens(jnp.asarray(tot), n, rank)).astype(np.int32)
    c = make_case(rng, seq_lens=local, qlen=qlen, num_heads=heads, page_size=PS)
    if dt == "fp8":
        f8 = caps.fp8_dtype("gfx950")
        q, cache = jnp.asarray(c.q, f8), jnp.asarray(c.cache, f8)
        q_scale, kv_scale, qs, ks = jnp.float32(0.5), jnp.float32(1.5), 0.5, 1.5
    else:
        q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
        q_scale = kv_scale = None
        qs = ks = 1.0
    md = build_aiter_decode_metadata(c.block_table, local, page_size=PS, num_heads=heads,
                                     qlen=qlen, kv_dtype=cache.dtype, arch="gfx950", num_cu=8,
                                     dcp_world_size=n, dcp_rank=rank,
                                     dcp_tot_seq_lens=jnp.asarray(tot))
    view = md.schedule.dcp_verify
    assert md.plan.route.kind == "dcp_verify" and view is not None
    before = _snapshot(q, cache, md)
    # The route launches AITER's Triton kernel itself by default (tests/test_aiter_triton_ffi.py);
    # this checks its fallback, the bridge.
    with triton_kernels.use_bridge():
        out, lse = jax_mla.mla_attention(q, cache, md, scale=c.scale, backend="aiter",
                                         return_lse=True, q_scale=q_scale, kv_scale=kv_scale)
    _assert_unchanged(before, q, cache, md)
    row_lens = np.asarray(view.row_lens)
    bt_rows = np.repeat(c.block_table, qlen, axis=0)
    q_in = _f32(q) * qs
    if dt == "fp8":  # vLLM dequantises q to bf16 before the segmented kernel
        q_in = _f32(jnp.asarray(q_in, jnp.bfloat16))
    want, want_lse = oracle.mla_decode(q_in, _f32(cache), bt_rows, row_lens, qlen=1,
                                       page_size=PS, scale=c.scale, kv_lora_rank=512,
                                       kv_scale=ks)
    assert oracle.rel_err(_f32(out), want) < 1e-2
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=2e-3, rtol=1e-3)
    (call,) = aiter.calls("segmented_mla_decode_fwd")
    assert call["skip_reduce"] and call["out_is_none"] and call["q_dtype"] == aiter.dtypes.bf16
    assert call["kv_buffer_shape"] == (cache.shape[0] * PS // view.page_size, view.page_size,
                                       1, 576)
    assert call["kv_descale"] == ks


def test_persistent_plan_equals_aiters_own_planner(rng, aiter_on):
    # The jnp planner vs the stand-in's port of AITER's planner, both driven through the
    # bridge exactly as vLLM calls get_mla_metadata_info_v1 / get_mla_metadata_v1.
    from jax_mla.backends.aiter.bridge import aiter_mla_metadata

    aiter = aiter_on("gfx950", cu_num=8)
    lens = np.array([7, 5, 300, 0], np.int32)
    table = np.arange(4 * 40, dtype=np.int32).reshape(4, 40)
    md = build_aiter_decode_metadata(table, lens, page_size=PS, num_heads=16, qlen=4,
                                     arch="gfx950", num_cu=8, mtp_decode_qlen=4)
    plan = md.schedule.plan
    got = jax.jit(aiter_mla_metadata)(md)
    names = ["work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
             "reduce_partial_map"]
    n_work = int(plan.work_indptr[-1])
    n_red = int(plan.reduce_indptr[-1])
    for name, arr in zip(names, got):
        mine, theirs = np.asarray(getattr(plan, name)), np.asarray(arr)
        if name == "work_info_set":
            mine, theirs = mine[:n_work], theirs[:n_work]
        if name == "reduce_partial_map":
            mine, theirs = mine[:n_red], theirs[:n_red]
        if name == "reduce_final_map":  # AITER writes split tiles only
            split = np.diff(np.asarray(plan.reduce_indptr))[:len(mine)] > 0
            mine, theirs = mine[split], theirs[split]
        np.testing.assert_array_equal(mine, theirs, err_msg=name)
    (call,) = aiter.calls("get_mla_metadata_v1")
    assert call["max_seqlen_qo"] == call["uni_seqlen_qo"] == 4 and call["kv_granularity"] == 16


# --- prefill ----------------------------------------------------------------------------------


def _prefill_case(rng, lens, heads, t_pad=2):
    from jax_mla.prefill import canonical_cu  # noqa: F401  (the entry point canonicalises)

    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1]) + t_pad  # trailing padding rows
    q = rng.standard_normal((t, heads, 192)).astype(np.float32)
    k = rng.standard_normal((t, heads, 192)).astype(np.float32)
    v = rng.standard_normal((t, heads, 128)).astype(np.float32)
    return q, k, v, cu


def test_flash_attn_varlen_prefill_matches_oracle_and_xla(rng, aiter_on):
    from test_prefill_oracle import varlen_attention

    aiter = aiter_on("gfx950")
    qn, kn, vn, cu = _prefill_case(rng, [13, 0, 30], heads=4)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (qn, kn, vn))
    scale = 192 ** -0.5
    before = _snapshot(q, k, v)
    out, lse = jax_mla.mla_prefill(q, k, v, jnp.asarray(cu), scale=scale, return_lse=True,
                                   backend="aiter")
    _assert_unchanged(before, q, k, v)
    want, want_lse = varlen_attention(_f32(q), _f32(k), _f32(v), cu, cu, scale=scale,
                                      causal=True)
    assert oracle.rel_err(_f32(out), want) < 1e-2
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=2e-3, rtol=1e-3)
    ref = jax_mla.mla_prefill(q, k, v, jnp.asarray(cu), scale=scale, backend="xla")
    assert oracle.rel_err(_f32(out), _f32(ref)) < 1e-2
    (call,) = aiter.calls("flash_attn_varlen_func")
    assert call["causal"] and call["return_lse"] and call["softmax_scale"] == pytest.approx(scale)


@pytest.mark.parametrize("heads", [12, 8, 16])  # tile-padded, divisor-padded, aligned
def test_fp8_ps_prefill_matches_oracle(rng, aiter_on, heads):
    from test_prefill_oracle import varlen_attention

    aiter = aiter_on("gfx950", cu_num=4)
    qn, kn, vn, cu = _prefill_case(rng, [300, 5, 40], heads=heads)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (qn, kn, vn))
    scale = 192 ** -0.5
    be = aiter_backend.AiterBackend()
    cfg = aiter_backend.AiterPrefillConfig(kv_cache_fp8=True, arch="gfx950")
    f = jax.jit(lambda q, k, v, cu: be.prefill(q, k, v, cu, None, scale=scale, causal=True,
                                               target=detect_target(), max_seqlen=300,
                                               max_seqlen_k=300, config=cfg, return_lse=False))
    before = _snapshot(q, k, v)
    out, lse = f(q, k, v, jnp.asarray(cu))
    _assert_unchanged(before, q, k, v)
    assert lse is None and out.shape == (q.shape[0], heads, 128)
    f8 = caps.fp8_dtype("gfx950")
    q8, k8, v8 = (_f32(jnp.asarray(x).astype(f8)) for x in (q, k, v))  # unit-scale fp8 cast
    want, _ = varlen_attention(q8, k8, v8, cu, cu, scale=scale, causal=True)
    assert oracle.rel_err(_f32(out), want) < 1e-2
    assert np.all(_f32(out)[cu[-1]:] == 0)  # padding rows
    (ps,) = aiter.calls("mla_prefill_ps_asm_fwd")
    assert ps["q_shape"][1] == caps.fp8_prefill_num_heads(heads) and ps["is_causal"]
    assert ps["scales"] == (1.0, 1.0, 1.0) and ps["q_dtype"] == aiter.dtypes.fp8
    (red,) = aiter.calls("mla_reduce_v1")
    assert red["max_seqlen_q"] == 256 and red["num_kv_splits"] == 0
    # The plan came from the jnp planner on the device (planned for gfx950's 256 CUs off
    # ROCm): AITER's host planner never ran, and the plan split tiles, so the reduce merged.
    assert not aiter.calls("get_ps_metadata_v1")
    from jax_mla.backends.aiter import ps_planner

    plan = ps_planner.plan_ps_prefill(jnp.asarray(cu), num_heads=ps["q_shape"][1],
                                      max_qlen=300, num_cu=256)
    assert int(plan.num_partial_tiles) > 0 and ps["split_rows"] == plan.scratch_rows


# --- honest status and lowering ----------------------------------------------------------------


def test_aiter_backend_refuses_clearly_without_aiter(monkeypatch):
    from jax_mla.backends.aiter import bridge

    monkeypatch.setattr(bridge, "aiter_importable", lambda: False)
    for platform in ("rocm", "cpu", "cuda"):
        with pytest.raises(RuntimeError, match="needs the ROCm/aiter package"):
            resolve_backend("aiter", platform)
    with pytest.raises(RuntimeError, match="needs the ROCm/aiter package"):
        jax_mla.mla_prefill(jnp.ones((2, 1, 192), jnp.bfloat16), jnp.ones((2, 1, 192),
                                                                          jnp.bfloat16),
                            jnp.ones((2, 1, 128), jnp.bfloat16), jnp.array([0, 2]), scale=0.1,
                            backend="aiter")
    assert resolve_backend("auto", "rocm").name != "aiter"


def test_aiter_backend_refuses_off_rocm_even_when_importable(monkeypatch):
    from jax_mla.backends.aiter import bridge

    monkeypatch.setattr(bridge, "aiter_importable", lambda: True)
    with pytest.raises(RuntimeError, match="runs on ROCm"):
        resolve_backend("aiter", "cuda")
    assert resolve_backend("auto", "cuda").name != "aiter"


def test_auto_picks_aiter_on_rocm_when_importable(monkeypatch):
    from jax_mla.backends.aiter import bridge

    monkeypatch.setattr(bridge, "aiter_importable", lambda: True)
    assert resolve_backend("auto", "rocm").name == "aiter"  # one resolution: decode and prefill
    assert resolve_backend("aiter", "rocm").name == "aiter"
    assert "aiter" in jax_mla.available_backends("rocm")


def test_bridge_lowers_to_buffer_callback_custom_calls_for_rocm(rng, aiter_on):
    # Lowering only (nothing runs): the ROCm module holds one GPU buffer-callback custom call
    # per kernel family used, here the persistent asm decode and the FA varlen prefill.
    aiter_on("gfx950")
    c = make_case(rng, seq_lens=[30, 5], qlen=1, num_heads=16, page_size=PS)
    q, cache = jnp.asarray(c.q, jnp.bfloat16), jnp.asarray(c.cache, jnp.bfloat16)
    md = build_aiter_decode_metadata(c.block_table, c.seq_lens, page_size=PS, num_heads=16,
                                     arch="gfx950", num_cu=8)

    def step(q, cache, md, pq, pk, pv, cu):
        o = jax_mla.mla_attention(q, cache, md, scale=c.scale, backend="aiter")
        p = jax_mla.mla_prefill(pq, pk, pv, cu, scale=0.1, backend="aiter")
        return o, p

    pq = jnp.ones((6, 2, 192), jnp.bfloat16)
    pv = jnp.ones((6, 2, 128), jnp.bfloat16)
    cu = jnp.array([0, 6], jnp.int32)
    text = jax.jit(step).trace(q, cache, md, pq, pq, pv, cu).lower(
        lowering_platforms=("rocm",)).as_text()
    targets = [line.split("@")[1].split("(")[0] for line in text.splitlines()
               if "custom_call" in line and "@" in line]
    gpu_cb = [t for t in targets if t == "xla_buffer_python_gpu_callback"]
    assert len(gpu_cb) == 2, targets
    assert "xla_buffer_python_cpu_callback" not in targets
