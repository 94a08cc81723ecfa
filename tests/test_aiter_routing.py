"""AITER routing as data: vLLM's predicates, gate tables and builder cases (CPU, no aiter).

docs/design.md §7.6 (predicates), §7.7 (persistent-schedule gate tables), §4.6 (segment merge),
§7.8 (kernel tables), §7.10 (uniform-MTP padding) and the cases of vLLM's own unit tests.
"""

from __future__ import annotations

import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter.schedule import (
    build_aiter_decode_metadata,
    build_dcp_verify_view,
    uniform_padded_mtp_qo_len,
)
from jax_mla.backends.aiter.segments import merge_mla_segments

NO_GLUON = caps.AiterBuild(gluon_kernel=False)


def _route(arch, k, qlen, heads, dt="bf16", build=caps.DEFAULT_BUILD, mode="auto", **kw):
    return caps.decide_route(arch=arch, num_heads=heads, qlen=qlen, q_dtype=dt, kv_dtype=dt,
                             mtp_decode_qlen=k, build=build, mode=mode, **kw)


# --- §7.7: the persistent-schedule gate, both of vLLM's parametrized tables --------------------

# (K = _mtp_decode_qlen, qlen, heads, kv dtype) -> persistent?  (gfx950: a Gluon build)
GATE_TABLE = [
    (1, 1, 16, "bf16", True),
    (4, 2, 16, "bf16", True),
    (4, 4, 16, "bf16", True),
    (1, 1, 24, "bf16", True),  # pads to 32
    (2, 4, 16, "bf16", False),  # qlen > K
    (1, 1, 8, "bf16", False),  # Gluon decode
    (4, 4, 8, "bf16", False),  # Gluon verify
    (1, 1, 12, "bf16", True),  # non-divisor -> padded asm
    (8, 8, 12, "bf16", False),  # Gluon verify
    (1, 1, 8, "fp8", True),
    (1, 1, 12, "fp8", True),
    (1, 1, 16, "fp8", True),
    (8, 8, 8, "fp8", True),
    (8, 8, 12, "fp8", True),
]

# Without a Gluon build: (qlen = K, heads, kv dtype) -> persistent?
GATE_TABLE_NO_GLUON = [
    (1, 12, "bf16", True),
    (4, 12, "bf16", True),
    (1, 12, "fp8", True),
    (8, 12, "fp8", True),
    (8, 12, "bf16", False),
    (8, 16, "bf16", True),
]


@pytest.mark.parametrize("row", GATE_TABLE, ids=lambda r: "-".join(map(str, r)))
def test_persistent_metadata_gate(row):
    k, qlen, heads, dt, want = row
    r = _route("gfx950", k, qlen, heads, dt)
    assert r.persistent is want
    assert r.kernel_heads == (caps.actual_num_heads(heads) if r.kind == "asm" else heads)
    if r.kind == "asm":
        assert r.zero_fill is (qlen > 1 and not want)
    # The predicate itself, as vLLM evaluates it.
    gd = caps.use_gluon_decode(heads, qlen, dt, arch="gfx950", mode="auto")
    gv = caps.use_gluon_verify(heads, qlen, dt, arch="gfx950", mode="auto")
    assert caps.use_persistent_schedule(heads, qlen, dt, k, gluon_decode=gd,
                                        gluon_verify=gv) is want


@pytest.mark.parametrize("row", GATE_TABLE_NO_GLUON, ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("where", ["gfx942", "gfx950-no-gluon-build"])
def test_persistent_metadata_gate_without_gluon_build(row, where):
    qlen, heads, dt, want = row
    arch, build = ("gfx942", caps.DEFAULT_BUILD) if where == "gfx942" else ("gfx950", NO_GLUON)
    r = _route(arch, qlen, qlen, heads, dt, build=build)
    assert r.kind == "asm" and r.persistent is want
    assert r.zero_fill is (qlen > 1 and not want)


def test_gate_admits_bf16_qlen8_on_gfx942_but_no_kernel_exists():
    # docs/design.md §7.8: vLLM's gate says persistent for (8, 16, bf16), but gfx942 has no bf16
    # persistent kernel above qlen 4; gfx950 runs it natively. The kernel check says so early.
    r942 = _route("gfx942", 8, 8, 16)
    assert r942.persistent
    with pytest.raises(NotImplementedError, match="no persistent asm MLA decode kernel"):
        caps.check_route_kernels(r942)
    caps.check_route_kernels(_route("gfx950", 8, 8, 16, build=NO_GLUON))


def test_qlen_above_k_runs_non_persistent_and_zero_fills():
    r = _route("gfx950", 2, 4, 16)
    assert r.kind == "asm" and not r.persistent and r.zero_fill


# --- §7.6 predicates and the small-head knob ---------------------------------------------------

NON_DIVISOR = [3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]
DIVISOR = [1, 2, 4, 8]


def test_nondivisor_and_multitoken_never_use_gluon_decode():
    for n in NON_DIVISOR:
        assert not caps.use_gluon_decode(n, 1, "bf16", arch="gfx950", mode="auto")
    for n in DIVISOR:
        assert not caps.use_gluon_decode(n, 2, "bf16", arch="gfx950", mode="auto")
        assert not caps.use_gluon_decode(n, 1, "fp8", arch="gfx950", mode="gluon")
    assert not caps.use_gluon_decode(16, 1, "bf16", arch="gfx950", mode="gluon")


@pytest.mark.parametrize("n", DIVISOR)
def test_divisor_gluon_selection_follows_arch(n):
    assert caps.use_gluon_decode(n, 1, "bf16", arch="gfx950", mode="auto")
    assert not caps.use_gluon_decode(n, 1, "bf16", arch="gfx942", mode="auto")
    assert not caps.use_gluon_decode(n, 1, "bf16", arch="gfx950", build=NO_GLUON, mode="auto")


def test_small_head_env_default_is_auto(monkeypatch):
    monkeypatch.delenv("JAX_MLA_AITER_SMALL_HEAD_MODE", raising=False)
    assert caps.small_head_mode() == "auto"
    monkeypatch.setenv("JAX_MLA_AITER_SMALL_HEAD_MODE", " GLUON ")
    assert caps.small_head_mode() == "gluon"
    monkeypatch.setenv("JAX_MLA_AITER_SMALL_HEAD_MODE", "fast")
    with pytest.raises(ValueError, match="auto"):
        caps.small_head_mode()


def test_small_head_env_force_asm_disables_gluon(monkeypatch):
    monkeypatch.setenv("JAX_MLA_AITER_SMALL_HEAD_MODE", "asm")
    for n in DIVISOR + NON_DIVISOR:
        assert not caps.use_gluon_decode(n, 1, "bf16", arch="gfx950")
        assert not caps.use_gluon_verify(n, 4, "bf16", arch="gfx950")
    r = _route("gfx950", 1, 1, 8, mode=None)
    assert r.kind == "asm" and r.kernel_heads == 16 and r.persistent


def test_small_head_env_force_gluon_follows_arch(monkeypatch):
    monkeypatch.setenv("JAX_MLA_AITER_SMALL_HEAD_MODE", "gluon")
    for n in DIVISOR + NON_DIVISOR:
        assert caps.use_gluon_decode(n, 1, "bf16", arch="gfx950")
    caps._gluon_warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not caps.use_gluon_decode(12, 1, "bf16", arch="gfx942")
        assert not caps.use_gluon_decode(8, 1, "bf16", arch="gfx942")
    assert len([x for x in w if "no Gluon MLA kernel" in str(x.message)]) == 1  # warns once


def test_small_head_env_auto_matches_arch_gate(monkeypatch):
    monkeypatch.setenv("JAX_MLA_AITER_SMALL_HEAD_MODE", "auto")
    for n in range(1, 16):
        for arch in caps.ARCHES:
            want = 16 % n == 0 and arch == "gfx950"
            assert caps.use_gluon_decode(n, 1, "bf16", arch=arch) is want


def test_gluon_verify_predicate():
    assert caps.use_gluon_verify(12, 4, "bf16", arch="gfx950", mode="auto")  # any n < 16
    assert not caps.use_gluon_verify(12, 1, "bf16", arch="gfx950", mode="auto")
    assert not caps.use_gluon_verify(12, 4, "bf16", 2, arch="gfx950", mode="auto")  # DCP
    assert not caps.use_gluon_verify(12, 4, "fp8", arch="gfx950", mode="auto")
    assert not caps.use_gluon_verify(16, 4, "bf16", arch="gfx950", mode="auto")
    assert not caps.use_gluon_verify(12, 4, "bf16", arch="gfx942", mode="gluon")


def test_head_counts_and_native_h24():
    assert caps.actual_num_heads(24) == 32  # AITER HEAD: reducer yes, metadata no
    assert caps.actual_num_heads(24, caps.AiterBuild(native_h24_metadata=True)) == 24
    assert caps.actual_num_heads(24, caps.AiterBuild(native_h24_reducer=False,
                                                     native_h24_metadata=True)) == 32
    assert caps.fp8_prefill_num_heads(24) == 32  # no H24 carve-out for prefill
    assert [caps.actual_num_heads(n) for n in (1, 12, 16, 17, 31, 128, 144)] == \
        [16, 16, 16, 32, 32, 128, 144]
    with pytest.raises(ValueError):
        caps.actual_num_heads(129)
    # An fp8-prefill head count is padded the same way as decode otherwise.
    assert caps.fp8_prefill_num_heads(12) == 16


def test_arch_facts():
    assert caps.fp8_dtype("gfx942") == jnp.float8_e4m3fnuz
    assert caps.fp8_dtype("gfx950") == jnp.float8_e4m3fn
    assert caps.ARCH_INFO["gfx942"].num_cu == 304 and caps.ARCH_INFO["gfx950"].num_cu == 256
    assert caps.gluon_decode_supported("gfx950") and not caps.gluon_decode_supported("gfx942")
    assert caps.fp8_prefill_supported("gfx950") and not caps.fp8_prefill_supported("gfx942")
    assert not caps.fp8_prefill_supported("gfx950", caps.AiterBuild(fp8_prefill_kernels=False))
    assert [caps.segmented_page_size(b) for b in (1, 16, 64, 1536, 24)] == [1, 16, 64, 128, 8]
    with pytest.raises(ValueError, match="arch"):
        caps.arch_info("gfx90a")


def test_detect_arch_reads_the_compute_capability():
    class Dev:
        def __init__(self, cc):
            self.compute_capability = cc

    assert caps.detect_arch(Dev("gfx942:sramecc+:xnack-")) == "gfx942"
    assert caps.detect_arch(Dev("gfx950")) == "gfx950"
    assert caps.detect_arch(Dev("9.0")) is None
    assert caps.detect_arch(Dev("gfx90a")) is None


# --- DCP routes ----------------------------------------------------------------------------------


def test_dcp_routes():
    r = _route("gfx950", 1, 1, 12, dcp_world_size=2)
    assert r.kind == "asm" and r.return_lse and r.kernel_heads == 16
    r = _route("gfx950", 4, 4, 32, dcp_world_size=2)
    assert r.kind == "dcp_verify" and r.return_lse and not r.persistent
    r = _route("gfx950", 4, 4, 32, "fp8", dcp_world_size=2)
    assert r.kind == "dcp_verify"  # test_dcp_fp8_verify_build_uses_segmented
    for kw in (dict(arch="gfx942"), dict(arch="gfx950", cp_interleave=2),
               dict(arch="gfx950", build=caps.AiterBuild(segmented_kernel=False))):
        arch = kw.pop("arch")
        with pytest.raises(RuntimeError, match="requires segmented MLA"):
            _route(arch, 4, 4, 32, dcp_world_size=2, **kw)
    # A tiny DCP config gathers < 16 heads: Gluon is not taken for verify, and decode asks
    # Gluon for the LSE the DCP combine needs (vLLM handed it None there).
    r = _route("gfx950", 1, 1, 8, dcp_world_size=2)
    assert r.kind == "gluon_decode" and r.return_lse


def test_kernel_table_checks():
    # gfx942: the only persistent LSE kernel is fp8 gqa64 qlen 1.
    assert caps.asm_kernel_available("gfx942", "fp8", "fp8", 64, 1, persistent=True, lse=True)
    assert not caps.asm_kernel_available("gfx942", "bf16", "bf16", 16, 1, persistent=True,
                                         lse=True)
    assert caps.asm_kernel_available("gfx950", "bf16", "bf16", 48, 8, persistent=True, lse=True)
    assert caps.asm_kernel_available("gfx942", "fp8", "fp8", 16, 8, persistent=True) is False
    assert caps.asm_kernel_available("gfx950", "fp8", "fp8", 16, 8, persistent=True) is True
    assert caps.fold_ratio("gfx942", 128, "bf16", "bf16", 1) == 8
    assert caps.fold_ratio("gfx950", 128, "bf16", "bf16", 1) == 1
    assert caps.fold_ratio("gfx942", 64, "fp8", "fp8", 1) == 1
    assert caps.fold_ratio("gfx942", 64, "fp8", "fp8", 2) == 4
    with pytest.raises(ValueError, match="144 heads"):
        caps.fold_ratio("gfx942", 144, "bf16", "bf16", 1)
    with pytest.raises(NotImplementedError, match="bf16 or fp8 query"):
        caps.check_route_kernels(_route("gfx950", 1, 1, 16, "fp16"))


# Each fact the static tables had wrong against hsa/<arch>/mla/mla_asm.csv at ROCm/aiter
# e4048607 (read through asm_mla.cu's key rewrite); tests/test_aiter_kernel_set.py checks the
# whole tables against that csv. (arch, q, kv, kernel heads, qlen, persistent, lse) -> served?
CORRECTED_FACTS = [
    # gfx942 ships the 8-head qlen-2 bf16 kernel only persistent (subQ16_mqa16_ps); split-KV
    # 8 heads is qlen 1 only there (gfx950 has qlen 2 split-KV).
    ("gfx942", "bf16", "bf16", 8, 1, False, False, True),
    ("gfx942", "bf16", "bf16", 8, 2, False, False, False),
    ("gfx950", "bf16", "bf16", 8, 2, False, False, True),
    ("gfx942", "bf16", "bf16", 8, 2, True, False, True),
    ("gfx942", "bf16", "bf16", 8, 2, True, True, False),
    # gfx942 split-KV bf16 64 heads: qlen 1 keys the qseqlen1 gqa64 kernel, which only gfx950
    # ships; qlen >= 2 runs the generic one, as 32 and 128 heads do at every qlen.
    ("gfx942", "bf16", "bf16", 64, 1, False, False, False),
    ("gfx942", "bf16", "bf16", 64, 2, False, False, True),
    ("gfx942", "bf16", "bf16", 32, 1, False, False, True),
    ("gfx942", "bf16", "bf16", 128, 1, False, False, True),
    ("gfx950", "bf16", "bf16", 64, 1, False, False, True),
    # gfx942's persistent fp8 64-head qlen-1 kernel, with its LSE variant, is real (the only
    # persistent LSE there); fp8 64 heads has no split-KV kernel.
    ("gfx942", "fp8", "fp8", 64, 1, True, True, True),
    ("gfx942", "fp8", "fp8", 64, 2, True, False, False),
    ("gfx942", "fp8", "fp8", 64, 1, False, False, False),
    # split-KV fp8 16 heads: qlen 3 pads to the qseqlen4 kernel (as persistent does)
    ("gfx942", "fp8", "fp8", 16, 3, False, False, True),
    ("gfx950", "fp8", "fp8", 16, 3, False, False, True),
    ("gfx950", "fp8", "fp8", 16, 5, False, False, False),
    # gfx950 ships the bf16-q / fp8-KV persistent qseqlen4 kernel too (no LSE variant)
    ("gfx950", "bf16", "fp8", 16, 4, True, False, True),
    ("gfx950", "bf16", "fp8", 16, 4, True, True, False),
    ("gfx950", "bf16", "fp8", 16, 5, True, False, False),
    # gfx950 fp8 persistent LSE, unknown before: gqa16 qlen 2 has none, gqa32 qlen 1 and gqa8
    # qlen 4 have one
    ("gfx950", "fp8", "fp8", 16, 2, True, False, True),
    ("gfx950", "fp8", "fp8", 16, 2, True, True, False),
    ("gfx950", "fp8", "fp8", 32, 1, True, True, True),
    ("gfx950", "fp8", "fp8", 8, 4, True, True, True),
    # gfx950 bf16 persistent 8 heads reach the generic kernels from qlen 8 (gqa * qlen >= 64)
    ("gfx950", "bf16", "bf16", 8, 7, True, False, False),
    ("gfx950", "bf16", "bf16", 8, 8, True, True, True),
    # unchanged, pinned with them: the split-KV bf16 16-head qseqlen8 kernel is taken to serve
    # qlen <= 8 only (AITER's rewrite keys every qlen > 4 to it, but does not hand it the head
    # count as the generic kernels get it); gfx942 drops ps for bf16 128 heads (no persistent
    # 128-head bf16 kernel: AITER folds to 16)
    ("gfx942", "bf16", "bf16", 16, 8, False, False, True),
    ("gfx942", "bf16", "bf16", 16, 9, False, False, False),
    ("gfx942", "bf16", "bf16", 128, 1, True, False, False),
]


@pytest.mark.parametrize("fact", CORRECTED_FACTS, ids=lambda f: "-".join(map(str, f)))
def test_kernel_tables_state_the_pinned_csvs_facts(fact):
    arch, q, kv, heads, qlen, persistent, lse, want = fact
    got = caps.asm_kernel_served(caps.ASM_KERNELS[arch], q, kv, heads, qlen,
                                 persistent=persistent, lse=lse)
    assert got is want


def test_bf16_query_over_an_fp8_cache_routes_on_gfx950():
    # The corrected gfx950 table has the bf16-q / fp8-KV persistent kernel: 128 heads fold onto it
    r = caps.decide_route(arch="gfx950", num_heads=128, qlen=2, q_dtype="bf16", kv_dtype="fp8")
    assert r.kind == "asm" and r.persistent
    caps.check_route_kernels(r)
    with pytest.raises(NotImplementedError, match="that returns an LSE"):
        caps.check_route_kernels(caps.decide_route(arch="gfx950", num_heads=128, qlen=2,
                                                   q_dtype="bf16", kv_dtype="fp8",
                                                   return_lse=True))


# --- builder cases (vLLM's builder tests) --------------------------------------------------------


def test_dcp_verify_row_view_is_causal_per_row():
    v = build_dcp_verify_view(jnp.array([[7, 8, 9], [10, 11, 12]]), jnp.array([10, 12]), qlen=4,
                              kernel_block_size=2, dcp_world_size=2, dcp_rank=0)
    assert np.asarray(v.row_lens).tolist() == [4, 4, 5, 5, 5, 5, 6, 6]
    assert np.asarray(v.qo_indptr).tolist() == list(range(9))
    assert np.asarray(v.block_table).tolist() == [[7, 8, 9]] * 4 + [[10, 11, 12]] * 4
    assert v.max_kv_seq_len == 6 and v.page_size == 2


def test_dcp_verify_rows_sum_to_the_global_window_across_ranks():
    tot = np.array([10, 12, 3, 1])
    qlen = 4
    s = sum(np.asarray(build_dcp_verify_view(jnp.zeros((4, 8), jnp.int32), jnp.asarray(tot),
                                             qlen=qlen, kernel_block_size=2, dcp_world_size=2,
                                             dcp_rank=r).row_lens) for r in range(2))
    want = [max(0, int(n) - qlen + t + 1) for n in tot for t in range(qlen)]
    assert s.tolist() == want


def test_dcp_verify_row_view_uses_static_graph_bound():
    v = build_dcp_verify_view(jnp.array([[0, 1]]), jnp.array([1000]), qlen=3,
                              kernel_block_size=1536, dcp_world_size=8, dcp_rank=0)
    assert np.asarray(v.row_lens).tolist() == [125] * 3
    assert v.page_size == 128 and v.max_kv_seq_len == 3072
    assert np.asarray(v.block_table).tolist() == [list(range(24))] * 3


def test_dcp_fp8_verify_build_uses_segmented():
    f8 = caps.fp8_dtype("gfx950")
    md = build_aiter_decode_metadata(jnp.zeros((2, 8), jnp.int32), jnp.array([5, 6]),
                                     page_size=2, num_heads=32, qlen=4, kv_dtype=f8,
                                     arch="gfx950", dcp_world_size=2, dcp_rank=0,
                                     dcp_tot_seq_lens=jnp.array([10, 12]))
    assert md.schedule.dcp_verify is not None and md.schedule.plan is None
    assert md.plan.route.q_dtype == "fp8"


@pytest.mark.parametrize("heads", [8, 16, 24, 32, 64, 128])
@pytest.mark.parametrize("k", [2, 3, 5])  # deepseek_mtp 1+1, 1+2, parallel drafting 1+2*2
def test_mtp_builder_init_sizes_native_fp8_metadata(heads, k):
    from aiter_standin.harness import standin

    f8 = caps.fp8_dtype("gfx950")
    max_num_seqs = 6
    # Shapes only (eval_shape: traced, never compiled or run).
    md = jax.eval_shape(lambda bt, sl: build_aiter_decode_metadata(
        bt, sl, page_size=4, num_heads=heads, qlen=1, kv_dtype=f8, arch="gfx950",
        mtp_decode_qlen=k, capacity_batch=max_num_seqs), jnp.zeros((3, 4), jnp.int32),
        jnp.array([5, 6, 7]))
    plan = md.schedule.plan
    assert plan is not None
    with standin(arch="gfx950", cu_num=None) as aiter:
        want = aiter.get_mla_metadata_info_v1(max_num_seqs, k, caps.actual_num_heads(heads),
                                              aiter.dtypes.fp8, aiter.dtypes.fp8,
                                              is_sparse=False, fast_mode=True)
    got = [plan.work_indptr.shape, plan.work_info_set.shape, plan.reduce_indptr.shape,
           plan.reduce_final_map.shape, plan.reduce_partial_map.shape]
    assert [tuple(np.atleast_1d(s)) for s, _ in want[1:]] == [tuple(g) for g in got]


def test_mtp_decode_qlen4_keeps_uniform_rows_with_metadata():
    md = build_aiter_decode_metadata(jnp.arange(8).reshape(2, 4), jnp.array([7, 5]),
                                     page_size=2, num_heads=16, qlen=4, arch="gfx950",
                                     mtp_decode_qlen=4, num_cu=8)
    assert np.asarray(md.qo_indptr).tolist() == [0, 4, 8]
    assert md.plan.route.persistent and md.schedule.plan.qlen == 4


def test_min_kv_seq_len_ignores_cudagraph_padding_rows():
    b, qlen, ps = 8, 8, 16
    lens = np.zeros(b, np.int32)
    lens[0] = 1032
    qo = np.zeros(b, np.int32)
    qo[0] = qlen
    table = np.arange(b * 65, dtype=np.int32).reshape(b, 65)
    md = build_aiter_decode_metadata(table, lens, page_size=ps, num_heads=12, qlen=qlen,
                                     arch="gfx950", qo_lens=qo)
    assert md.plan.route.kind == "gluon_verify"
    assert int(md.schedule.min_kv_seq_len) == 1032


def test_full_cudagraph_padded_uniform_mtp_synthesizes_decode_indptr():
    md = build_aiter_decode_metadata(jnp.arange(8).reshape(2, 4), jnp.array([7, 0]),
                                     page_size=2, num_heads=16, qlen=4, arch="gfx950",
                                     mtp_decode_qlen=4, qo_lens=jnp.array([4, 0]), num_cu=8)
    assert np.asarray(md.seq_lens).tolist() == [7, 4]
    assert np.asarray(md.paged_kv_indptr).tolist() == [0, 7, 11]
    assert np.asarray(md.qo_indptr).tolist() == [0, 4, 8]
    assert md.plan.route.persistent and md.plan.route.qlen == 4
    with pytest.raises(ValueError, match="uniform"):
        build_aiter_decode_metadata(jnp.arange(8).reshape(2, 4), jnp.array([0, 7]),
                                    page_size=2, num_heads=16, qlen=4, arch="gfx950",
                                    qo_lens=jnp.array([0, 4]))


def test_decode_expands_kernel_block_page_indices():
    md = build_aiter_decode_metadata(jnp.array([[10, 11, 99], [20, 21, 22]]), jnp.array([3, 5]),
                                     page_size=2, num_heads=16, arch="gfx950")
    n = int(md.paged_kv_indptr[-1])
    assert np.asarray(md.paged_kv_indices)[:n].tolist() == [20, 21, 22, 40, 41, 42, 43, 44]
    assert np.asarray(md.paged_kv_last_page_len).tolist() == [1, 1]


# --- §7.10: _uniform_padded_mtp_qo_len, exhaustive differential -------------------------------


def _uniform_ref(qo, max_qo, tokens):
    """The conditions of docs/design.md §7.10, written independently."""
    b = len(qo)
    if b == 0 or tokens <= 0 or tokens <= sum(qo) or tokens % b:
        return 0
    u = tokens // b
    if u <= 1 or 0 not in qo:
        return 0
    pos = [x for x in qo if x > 0]
    if pos and (any(x != u for x in pos) or max_qo != u):
        return 0
    first = qo.index(0)
    if any(x > 0 for x in qo[first:]):
        return 0
    return u


def test_uniform_padded_mtp_qo_len_named_cases():
    assert uniform_padded_mtp_qo_len([4, 4, 0, 0], 4, 16) == 4
    assert uniform_padded_mtp_qo_len([4, 0, 4, 0], 4, 16) == 0
    assert uniform_padded_mtp_qo_len([4, 2, 0, 0], 4, 16) == 0


def test_uniform_padded_mtp_qo_len_exhaustive():
    for b in range(1, 5):
        for qo in itertools.product(range(4), repeat=b):
            for tokens in range(13):
                for max_qo in range(5):
                    assert uniform_padded_mtp_qo_len(np.array(qo), max_qo, tokens) == \
                        _uniform_ref(list(qo), max_qo, tokens), (qo, tokens, max_qo)


# --- §4.6: the base-2 segment merge ------------------------------------------------------------


def test_segmented_verify_reduce_returns_natural_lse_and_masks_empty_rows():
    acc = np.zeros((2, 1, 2, 4), np.float32)
    acc[:, 0, 0] = 1.0
    acc[:, 0, 1] = 3.0
    mx = np.array([[[0.0, 1.0]]] * 2, np.float32)
    es = np.ones((2, 1, 2), np.float32)
    out, lse = merge_mla_segments(jnp.asarray(acc), jnp.asarray(mx), jnp.asarray(es),
                                  jnp.array([2, 0]), tile_size=1)
    np.testing.assert_allclose(np.asarray(out)[0, 0], 7 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(lse[0, 0]), math.log(3), rtol=1e-6)
    assert np.all(np.asarray(out)[1] == 0) and np.isneginf(float(lse[1, 0]))


def test_segment_merge_masks_unwritten_segments(rng):
    # Segments past a row's active count hold garbage (NaN): they must not leak.
    t, h, s, lr, tile = 3, 2, 8, 4, 4
    lens = np.array([5, 30, 1])
    acc = rng.standard_normal((t, h, s, lr)).astype(np.float32)
    mx = rng.standard_normal((t, h, s)).astype(np.float32)
    es = rng.random((t, h, s)).astype(np.float32) + 0.5
    tps = np.maximum(1, -(-lens // (s * tile)))
    act = -(-lens // (tps * tile))
    for i in range(t):
        acc[i, :, act[i]:] = np.nan
        mx[i, :, act[i]:] = np.nan
        es[i, :, act[i]:] = np.nan
    out, lse = merge_mla_segments(jnp.asarray(acc), jnp.asarray(mx), jnp.asarray(es),
                                  jnp.asarray(lens), tile_size=tile)
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(lse)))
    for i in range(t):
        a = act[i]
        a64, m64, e64 = (x[i, :, :a].astype(np.float64) for x in (acc, mx, es))
        m = m64.max(-1)
        w = np.exp2(m64 - m[:, None])
        z = (e64 * w).sum(-1)
        want = (a64 * w[..., None]).sum(1) / z[:, None]
        # A float64 oracle and a norm-relative bound: one output is a sum of signed terms, and an
        # element near 0 after cancellation has no float32 relative accuracy to speak of (8.9e-5
        # on 2.1e-4 was seen in CI).
        got = np.asarray(out)[i]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
        np.testing.assert_allclose(np.asarray(lse)[i], (m + np.log2(z)) * math.log(2),
                                   rtol=1e-5, atol=1e-6)
