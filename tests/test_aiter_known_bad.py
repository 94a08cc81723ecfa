"""The table of known-bad AITER kernels (``jax_mla/backends/aiter/known_bad.py``), consulted at
plan time.

Per row: the row names the kernel its shape selects in the pinned ``mla_asm.csv`` (and its
replacement the kernel the folded shape selects); the problem that hits it plans the
replacement and says so; the neighbouring problems plan what vLLM's routing gives; the
override restores the original route; a fixed AITER version is not affected; the replacement
route is exact (its plan against AITER's planner folding the count, executed against the
float64 oracle, and run end to end through the bridge and the stand-in and through the native
launcher with the kernel emulated). Nothing here ran on AMD hardware.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_aiter_kernel_set import PINNED_CSV, edit_csv, write_hsa

import jax_mla
from jax_mla import build_decode_metadata
from jax_mla.backends.aiter import bridge, build_aiter_decode_metadata, known_bad, native
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter import planner as pl

import oracle
from aiter_standin.harness import forced_standins
from conftest import make_case

ROWS = known_bad.KNOWN_BAD
PS = 8


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(known_bad.ALLOW_ENV, raising=False)


@pytest.fixture
def pinned_hsa(tmp_path, monkeypatch):
    """The pinned commit's kernel tables installed as AITER_ASM_DIR (routing reads only them)."""
    root = write_hsa(tmp_path / "hsa")
    monkeypatch.setenv("AITER_ASM_DIR", str(root))
    return root


def _dtype(name, arch):
    return caps.fp8_dtype(arch) if name == "fp8" else jnp.bfloat16


def _md(arch, heads, qlen, q="fp8", kv="fp8", *, lens=(5, 9), page_size=4, k=None, **kw):
    pages = -(-max(lens) // page_size)
    table = jnp.arange(len(lens) * pages, dtype=jnp.int32).reshape(len(lens), pages)
    return build_aiter_decode_metadata(table, jnp.asarray(lens, jnp.int32), page_size=page_size,
                                       num_heads=heads, qlen=qlen, q_dtype=_dtype(q, arch),
                                       kv_dtype=_dtype(kv, arch), arch=arch, num_cu=8,
                                       mtp_decode_qlen=k, **kw)


def _row_md(row, **kw):
    return _md(row.arch, row.heads, row.qlen, row.q, row.kv, return_lse=row.lse, **kw)


def _vllm_route(md):
    """vLLM's route for the problem ``md`` was planned for (no table consulted)."""
    r = md.plan.route
    return caps.decide_route(arch=r.arch, num_heads=r.num_heads, qlen=r.qlen, q_dtype=r.q_dtype,
                             kv_dtype=r.kv_dtype, mtp_decode_qlen=r.mtp_decode_qlen,
                             return_lse=r.return_lse, num_cu=r.num_cu, build=md.plan.build)


def _kernel_for(table, arch, q, kv, gqa, qlen, lse):
    """The kernel AITER's lookup finds for a persistent call: the first csv row whose columns
    equal the rewritten key (``native.find_kernel``'s rule, without the ``.co`` check)."""
    key, _, _ = native.kernel_key(arch=arch, q_type=q, kv_type=kv, gqa=gqa, qlen=qlen,
                                  persistent=True, lse=lse)
    for r in table.rows:
        if all(str(r.get(c) or 0) == str(v) for c, v in key.items()):
            return r["co_name"].removesuffix(".co")
    return None


# --- the table -----------------------------------------------------------------------------------

@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.kernel)
def test_each_row_names_the_kernels_its_shapes_select_in_the_pinned_table(tmp_path, row):
    table = native.kernel_table(row.arch, str(write_hsa(tmp_path / "hsa")))
    assert _kernel_for(table, row.arch, row.q, row.kv, row.heads, row.qlen, row.lse) == \
        row.kernel
    assert row.replacement in known_bad.REPLACEMENTS and row.replacement == "fold16"
    assert _kernel_for(table, row.arch, row.q, row.kv, caps.MIN_HEADS, row.qlen, row.lse) == \
        row.replacement_kernel
    owner_repo, number = row.issue.split("#")
    assert owner_repo == "ROCm/aiter" and number.isdigit()
    assert row.page_size == known_bad.KV_VIEW_PAGE_SIZE  # the only view the asm routes read
    assert row.fixed_in is None or known_bad._release(row.fixed_in) is not None
    assert row.kernel in repr(row) and row.issue in repr(row)
    # the pinned commit (the static table) has the kernel, so the doctor reports it there too
    assert row in known_bad.present_in(caps.static_kernel_set(row.arch))


# --- the problem that hits a row ----------------------------------------------------------------

@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.kernel)
def test_the_problem_that_hits_the_row_plans_the_replacement_and_says_so(pinned_hsa, row):
    md = _row_md(row)
    r, plan = md.plan.route, md.schedule.plan
    assert r.avoided == (row,) and r.force_fold and r.known_bad_allowed == ()
    assert plan.fold_ratio == row.heads // 16 and plan.kernel_heads == 16
    # everything else is vLLM's route
    assert dataclasses.replace(r, avoided=(), force_fold=False) == _vllm_route(md)
    # the launcher looks the kernel up for the plan's heads: the replacement, not the row
    table = native.kernel_table(row.arch)
    assert _kernel_for(table, row.arch, r.q_dtype, r.kv_dtype, plan.kernel_heads, r.qlen,
                       r.return_lse) == row.replacement_kernel
    # said, not silent: in the notes and in the plan's repr
    (note,) = md.plan.notes
    for part in (row.kernel, row.issue, row.replacement_kernel, "avoided",
                 f"{known_bad.ALLOW_ENV}={row.kernel}"):
        assert part in note, (part, note)
    assert row.kernel in repr(md.plan) and "force_fold=True" in repr(md.plan)


def test_a_padded_count_that_reaches_the_kernel_is_routed_around_too(pinned_hsa):
    (row,) = [r for r in ROWS if r.kernel == "mla_a8w8_qh64_qseqlen1_gqaratio64_v3_ps"]
    md = _md("gfx942", 56, 1)  # padded to 64 heads: the same kernel
    assert md.plan.route.kernel_heads == 64 and md.plan.route.avoided == (row,)
    assert md.schedule.plan.fold_ratio == 4


def test_the_cache_page_size_does_not_matter_the_view_is_per_token(pinned_hsa):
    # The asm route hands AITER the per-token view whatever the cache's page size; a view of
    # page size 64 (the one upstream checked the kernel at) would not hit the row, but no asm
    # route reads one.
    (row,) = [r for r in ROWS if r.kernel == "mla_a8w8_qh64_qseqlen1_gqaratio64_v3_ps"]
    md = _md("gfx942", 64, 1, lens=(70, 200), page_size=64)
    assert md.plan.route.avoided == (row,)
    vllm = _vllm_route(md)
    assert known_bad.hits(row, vllm)
    assert not known_bad.hits(row, vllm, page_size=64)


# (arch, heads, qlen, q, kv, return_lse, K): one thing changed from the row's problem.
NEIGHBOURS = [
    ("gfx950", 64, 1, "fp8", "fp8", False, None),  # other arch (gfx950 runs the qh16 qseqlen4)
    ("gfx942", 128, 1, "fp8", "fp8", False, None),  # other heads: native
    ("gfx942", 48, 1, "fp8", "fp8", False, None),  # other heads: AITER folds them itself
    ("gfx942", 16, 1, "fp8", "fp8", False, None),
    ("gfx942", 64, 1, "bf16", "bf16", False, None),  # bf16: AITER folds 64 itself on gfx942
    ("gfx942", 64, 1, "bf16", "fp8", False, None),  # bf16 query over an fp8 cache
    ("gfx942", 64, 2, "fp8", "fp8", False, None),  # qlen 2: AITER folds it itself
    ("gfx942", 64, 1, "fp8", "fp8", True, None),  # with LSE: the _lse_ kernel, not listed
]


@pytest.mark.parametrize("case", NEIGHBOURS, ids=lambda c: "-".join(map(str, c[:6])))
def test_neighbouring_problems_plan_vllms_route(pinned_hsa, case):
    arch, heads, qlen, q, kv, lse, k = case
    md = _md(arch, heads, qlen, q, kv, return_lse=lse, k=k)
    r = md.plan.route
    assert r.avoided == () and r.known_bad_allowed == () and not r.force_fold
    assert md.plan.notes == ()
    assert r == _vllm_route(md)
    if r.persistent:
        assert md.schedule.plan.fold_ratio == caps.fold_ratio(arch, r.kernel_heads, q, kv, qlen)


# --- the override -------------------------------------------------------------------------------

@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.kernel)
@pytest.mark.parametrize("how", ["env-name", "env-all", "option-true", "option-name"])
def test_the_override_restores_the_original_route(pinned_hsa, monkeypatch, row, how):
    kw = {}
    if how == "env-name":
        monkeypatch.setenv(known_bad.ALLOW_ENV, f" {row.kernel} ")
    elif how == "env-all":
        monkeypatch.setenv(known_bad.ALLOW_ENV, "all")
    elif how == "option-true":
        kw = dict(allow_known_bad=True)
    else:
        kw = dict(allow_known_bad=[row.kernel])
    md = _row_md(row, **kw)
    r = md.plan.route
    assert not r.force_fold and r.avoided == () and r.known_bad_allowed == (row,)
    assert dataclasses.replace(r, known_bad_allowed=()) == _vllm_route(md)
    assert md.schedule.plan.fold_ratio == 1 and md.schedule.plan.kernel_heads == row.heads
    (note,) = md.plan.notes
    assert row.kernel in note and row.issue in note and "allowed by the override" in note


def test_the_option_wins_over_the_environment_and_bad_names_are_refused(pinned_hsa,
                                                                       monkeypatch):
    row = ROWS[0]
    monkeypatch.setenv(known_bad.ALLOW_ENV, "all")
    assert _row_md(row, allow_known_bad=False).plan.route.avoided == (row,)
    monkeypatch.setenv(known_bad.ALLOW_ENV, "0")
    assert _row_md(row).plan.route.avoided == (row,)
    monkeypatch.setenv(known_bad.ALLOW_ENV, "mla_a8w8_qh64_typo")
    with pytest.raises(ValueError, match=f"mla_a8w8_qh64_typo, not in the table.*{row.kernel}"):
        _row_md(row)
    assert known_bad.allowed_kernels("") == frozenset()
    assert known_bad.allowed_kernels(" all ") == frozenset(known_bad.KERNELS)
    assert known_bad.allowed_kernels(f"{row.kernel},") == frozenset({row.kernel})


# --- versions -----------------------------------------------------------------------------------

def test_a_version_at_or_past_a_fix_is_not_affected(pinned_hsa, monkeypatch):
    row = dataclasses.replace(ROWS[0], fixed_in="0.1.30")
    monkeypatch.setattr(known_bad, "KNOWN_BAD", (row,))
    for version, hit in (("0.1.30", False), ("0.1.31.post2", False), ("v0.2", False),
                         ("0.1.29", True), ("0.1.30.dev88+gb3eed3fd4", True), ("0.1.30rc1", True),
                         (None, True), ("unknown", True)):
        assert known_bad.affects_version(row, version) is hit, version
        md = _row_md(row, build=caps.AiterBuild(version=version))
        assert (md.plan.route.avoided == (row,)) is hit, version


def test_with_no_fix_known_every_version_is_affected(pinned_hsa):
    row = ROWS[0]
    assert row.fixed_in is None
    md = _row_md(row, build=caps.AiterBuild(version="99.0"))
    assert md.plan.route.avoided == (row,)


def test_the_installed_version_comes_from_the_distribution_metadata(monkeypatch):
    import importlib.metadata

    installed = {"amd-aiter": "0.1.21.post1"}
    seen = []

    def version(name):
        seen.append(name)
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert bridge.installed_version() == "0.1.21.post1" and seen == ["amd-aiter"]
    installed.clear()
    assert bridge.installed_version() is None  # e.g. the stand-in: a source tree, no metadata


# --- the replacement is exact where CPU tests can run it ----------------------------------------

def test_the_replacement_plan_is_aiters_planner_folding_the_count(rng, monkeypatch):
    # AITER's own planner (the statement-by-statement port) with the native clause for the
    # row's shape removed (what ROCm/aiter#4957 proposes) plans exactly the replacement.
    import test_aiter_planner as tp

    row = ROWS[0]
    real = tp.REF.natively_supported

    def without_row(arch, num_heads, q_fp8, kv_fp8, max_seqlen_qo):
        if (arch, num_heads, q_fp8, kv_fp8, max_seqlen_qo) == (
                row.arch, row.heads, row.q == "fp8", row.kv == "fp8", row.qlen):
            return False
        return real(arch, num_heads, q_fp8, kv_fp8, max_seqlen_qo)

    monkeypatch.setattr(tp.REF, "natively_supported", without_row)
    b, cu = 4, 8
    sizes = pl.mla_metadata_sizes(b, row.qlen, row.heads, row.q, row.kv, arch=row.arch,
                                  num_cu=cu, force_fold=True)
    st = pl._static_config(b, row.qlen, row.heads, row.q, row.kv, row.arch, cu, -1, b,
                           row.qlen, "auto", True, 16, force_fold=True)
    assert st.ratio == row.heads // 16 and st.sizes == sizes
    split_seen = False
    for _ in range(5):
        lens = tp._lens(rng, b)
        plan, aux = pl._plan(jnp.asarray(tp._indptr(lens)), st)
        facts, want = tp._ref(lens, row.qlen, row.heads, row.q, row.arch, cu, sizes)
        assert facts["ratio"] == plan.fold_ratio == 4 and facts["variant"] == plan.variant
        for name, arr in want.items():
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), arr, err_msg=name)
        tp._check_properties(plan, {k: int(v) for k, v in aux.items()}, lens, row.qlen,
                             row.heads, cu)
        split_seen |= int(aux["num_reduce"]) > 0
    assert split_seen


def test_the_replacement_plan_executes_to_the_oracle(rng):
    row = ROWS[0]
    c = make_case(rng, seq_lens=[300, 0, 20, 5], qlen=row.qlen, num_heads=row.heads,
                  page_size=PS)
    md = build_decode_metadata(c.block_table, c.seq_lens, page_size=PS, qlen=row.qlen)
    plan = pl.plan_mla_decode(md.paged_kv_indptr, qlen=row.qlen, num_heads=row.heads,
                              q_dtype=row.q, kv_dtype=row.kv, arch=row.arch, num_cu=3,
                              force_fold=True)
    assert plan.fold_ratio == 4 and int(plan.reduce_indptr[-1]) > 0  # folded, and split
    out, lse = pl.execute_plan_reference(jnp.asarray(c.q), jnp.asarray(c.cache), md, plan,
                                         scale=c.scale)
    want, want_lse = oracle.mla_decode(c.q, c.cache, c.block_table, c.seq_lens, qlen=row.qlen,
                                       page_size=PS, scale=c.scale, kv_lora_rank=512)
    assert oracle.rel_err(out, want) < 1e-5
    fin = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=1e-4)


def _fp8_case(rng, row, lens):
    c = make_case(rng, seq_lens=lens, qlen=row.qlen, num_heads=row.heads, page_size=PS)
    f8 = caps.fp8_dtype(row.arch)
    return c, jnp.asarray(c.q, f8), jnp.asarray(c.cache, f8)


def _oracle(c, q, cache, qs, ks):
    f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))  # noqa: E731
    return oracle.mla_decode(f32(q), f32(cache), c.block_table, c.seq_lens, qlen=c.qlen,
                             page_size=PS, scale=c.scale, kv_lora_rank=512, q_scale=qs,
                             kv_scale=ks)


@pytest.mark.parametrize("allow", [False, True], ids=["replacement", "override"])
def test_the_route_through_the_bridge_matches_the_oracle(rng, allow):
    row = ROWS[0]
    with forced_standins() as enter:
        aiter = enter(row.arch, cu_num=8)
        c, q, cache = _fp8_case(rng, row, [300, 0, 20, 5])
        md = build_aiter_decode_metadata(c.block_table, c.seq_lens, page_size=PS,
                                         num_heads=row.heads, qlen=row.qlen,
                                         kv_dtype=cache.dtype, arch=row.arch, num_cu=8,
                                         allow_known_bad=allow)
        assert md.plan.route.force_fold is not allow
        out = jax_mla.mla_attention(q, cache, md, backend="aiter", scale=c.scale,
                                    q_scale=jnp.float32(0.5), kv_scale=jnp.float32(1.5))
        (call,) = aiter.calls("mla_decode_fwd")
    t = c.q.shape[0]
    # AITER was handed the 16-head pseudo-batches (its 16-head kernel), or, overridden, the
    # 64 heads (the listed kernel)
    want_heads, want_rows = (row.heads, t) if allow else (16, t * row.heads // 16)
    assert call["heads"] == want_heads and call["q_shape"][:2] == (want_rows, want_heads)
    assert call["plan_passed"] and call["persistent"]
    want, _ = _oracle(c, q, cache, 0.5, 1.5)
    assert out.shape == (t, row.heads, 512)
    assert oracle.rel_err(np.asarray(out, np.float32), want) < 1e-2


def test_the_route_through_the_native_launcher_matches_the_oracle(rng, pinned_hsa,
                                                                   monkeypatch):
    # The kernel emulated (execute_plan_works), as in tests/test_aiter_native.py: the launcher's
    # folding, reduce and unfolding around it, and the kernel it asks the table for.
    from test_aiter_native import CHOICE, _emulated_stage1

    row = ROWS[0]
    c, q, cache = _fp8_case(rng, row, [9, 70, 33])
    md = build_aiter_decode_metadata(c.block_table, c.seq_lens, page_size=PS,
                                     num_heads=row.heads, qlen=row.qlen, kv_dtype=cache.dtype,
                                     arch=row.arch, num_cu=8)
    route = md.plan.route
    assert route.force_fold and md.schedule.plan.fold_ratio == 4
    asked = []
    table = native.kernel_table(row.arch)
    monkeypatch.setattr(native, "stage1", _emulated_stage1(md, route))
    monkeypatch.setattr(native, "select_kernel", lambda t, **kw: asked.append(kw) or CHOICE)
    out, lse = jax.jit(lambda q, cache, md: native.asm_decode(
        q, cache, md, route, md.schedule, scale=c.scale, q_scale=jnp.float32(0.5),
        kv_scale=jnp.float32(1.5)))(q, cache, md)
    (kw,) = asked
    assert kw["gqa"] == 16 and kw["persistent"]
    assert _kernel_for(table, row.arch, kw["q_type"], kw["kv_type"], kw["gqa"], kw["qlen"],
                       kw["lse"]) == row.replacement_kernel
    want, _ = _oracle(c, q, cache, 0.5, 1.5)
    assert lse is None and out.shape == (3, row.heads, 512)
    assert oracle.rel_err(np.asarray(out, np.float32), want) < 1e-2


def test_a_missing_replacement_kernel_is_refused_naming_the_avoided_one(tmp_path, monkeypatch):
    row = ROWS[0]
    qh16 = "_ZN5aiter36mla_a8w8_qh16_qseqlen1_gqaratio16_psE"
    assert row.replacement_kernel in qh16
    root = write_hsa(tmp_path / "less", {"gfx942": edit_csv(PINNED_CSV["gfx942"], drop=[qh16])})
    monkeypatch.setenv("AITER_ASM_DIR", str(root))
    with pytest.raises(NotImplementedError) as e:
        _row_md(row)
    msg = str(e.value)
    for part in ("no persistent asm MLA decode kernel", "64 heads (run as 4 16-head",
                 row.kernel, row.issue, f"{known_bad.ALLOW_ENV}={row.kernel}"):
        assert part in msg, (part, msg)
    assert _row_md(row, allow_known_bad=True).plan.route.known_bad_allowed == (row,)
