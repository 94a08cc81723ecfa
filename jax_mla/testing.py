"""Float64 NumPy oracles for MLA decode/verify and varlen prefill, the conformance bounds, and
the paged case builder, for demos, the doctor's checks and ``doctor --validate``.

(The test suite carries its own oracles, written separately, so a shared mistake cannot hide;
it builds its cases with :func:`make_case`.)
"""

from __future__ import annotations

import dataclasses

import numpy as np


def numpy_mla_decode(q, kv_cache, block_table, seq_lens, *, qlen, scale, kv_lora_rank,
                     q_scale=1.0, kv_scale=1.0):
    """``(out [T, H, L], lse [T, H])`` float64 for rows ``b * qlen + t``.

    Row ``t`` of request ``b`` attends positions ``< seq_lens[b] - qlen + t + 1``.
    """
    q = np.asarray(q, np.float64) * q_scale
    cache = np.asarray(kv_cache, np.float64)
    block_table = np.asarray(block_table)
    seq_lens = np.asarray(seq_lens)
    page_size = cache.shape[1]
    t_rows, h, _ = q.shape
    out = np.zeros((t_rows, h, kv_lora_rank))
    lse = np.full((t_rows, h), -np.inf)
    for b, n in enumerate(seq_lens):
        pos = np.arange(int(n))
        kv = cache[block_table[b, pos // page_size], pos % page_size] * kv_scale  # [n, D]
        rows = slice(b * qlen, (b + 1) * qlen)
        s = np.einsum("thd,nd->thn", q[rows], kv) * scale
        bound = int(n) - qlen + np.arange(qlen) + 1
        s = np.where(pos[None, None, :] < bound[:, None, None], s, -np.inf)
        m = s.max(axis=-1, initial=-np.inf)
        seen = np.isfinite(m)
        p = np.exp(s - np.where(seen, m, 0.0)[..., None])
        z = p.sum(axis=-1)
        zs = np.where(seen, z, 1.0)
        out[rows] = np.where(seen[..., None], np.einsum("thn,nl->thl", p, kv[:, :kv_lora_rank])
                             / zs[..., None], 0.0)
        lse[rows] = np.where(seen, m + np.log(zs), -np.inf)
    return out, lse


def rel_err(got, want) -> float:
    """``||got - want|| / ||want||`` in float64."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (den if den > 0 else 1.0))


def numpy_varlen_prefill(q, k, v, cu_q, cu_k=None, *, scale, causal=True):
    """``(out [T, H, Dv], lse [T, H])`` float64 of varlen attention over packed sequences.

    Sequence ``b``: query rows ``cu_q[b] .. cu_q[b+1]`` against key rows ``cu_k[b] ..
    cu_k[b+1]`` (``cu_k`` default ``cu_q``); causal is bottom-right aligned (local row ``i``
    sees local keys ``j <= i + sk - sq``). Rows outside every sequence, and rows that see no
    key: out 0, lse -inf. Rows past ``cu_q[-1]`` (padding) are never read, so they may be NaN.
    """
    cu_q = np.asarray(cu_q)
    cu_k = cu_q if cu_k is None else np.asarray(cu_k)
    t, h = np.shape(q)[:2]
    out = np.zeros((t, h, np.shape(v)[-1]))
    lse = np.full((t, h), -np.inf)
    for b in range(len(cu_q) - 1):
        qs = np.asarray(q[cu_q[b]:cu_q[b + 1]], np.float64)
        ks = np.asarray(k[cu_k[b]:cu_k[b + 1]], np.float64)
        vs = np.asarray(v[cu_k[b]:cu_k[b + 1]], np.float64)
        sq, sk = len(qs), len(ks)
        if sq == 0 or sk == 0:
            continue
        s = np.einsum("ihd,jhd->hij", qs, ks) * scale
        if causal:
            s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
        m = s.max(axis=-1, initial=-np.inf)  # [H, sq]
        seen = np.isfinite(m)
        p = np.exp(s - np.where(seen, m, 0.0)[..., None])
        z = np.where(seen, p.sum(axis=-1), 1.0)
        rows = slice(cu_q[b], cu_q[b + 1])
        out[rows] = np.where(seen.T[..., None],
                             np.einsum("hij,jhv->ihv", p, vs) / z.T[..., None], 0.0)
        lse[rows] = np.where(seen, m + np.log(z), -np.inf).T
    return out, lse


def oracle_errors(out, want_out, *, tol, lse=None, want_lse=None) -> dict:
    """``out`` (and ``lse``) against the float64 oracle's, with the conformance suite's bounds:
    ``rel_err < tol`` over the whole output; rows the oracle leaves empty (lse -inf) give out 0
    and lse -inf; every output finite; the LSE of the other rows within ``4 * max(tol, 1e-4)``,
    absolute (a log: bf16's 1e-2 relative is ~0.01 there).

    Returns ``{"rel_err", "lse_err" (None without an LSE), "failures": [what broke, in
    words]}``; no failures means the result conforms.
    """
    out = np.asarray(out, np.float64)
    want_out = np.asarray(want_out, np.float64)
    failures = []
    if out.shape != want_out.shape:
        return dict(rel_err=float("nan"), lse_err=None,
                    failures=[f"out shape {out.shape}, expected {want_out.shape}"])
    err = rel_err(out, want_out)
    if not np.all(np.isfinite(out)):
        failures.append(f"{int(np.sum(~np.isfinite(out)))} non-finite output values")
    if not err < tol:
        failures.append(f"rel err {err:.2e} >= {tol:g}")
    lse_err = None
    if want_lse is not None:
        empty = np.isneginf(np.asarray(want_lse))
        if np.any(out[empty] != 0):
            failures.append(f"{int(np.sum(np.any(out[empty] != 0, -1)))} empty row(s) with "
                            "out != 0")
        if lse is not None:
            lse = np.asarray(lse, np.float64)
            if not np.all(np.isneginf(lse[empty])):
                failures.append("empty rows must have lse -inf")
            if (~empty).any():
                diff = np.abs(lse[~empty] - np.asarray(want_lse)[~empty])
                lse_err = float(np.max(np.where(np.isnan(diff), np.inf, diff)))
                if not lse_err < max(tol, 1e-4) * 4:
                    failures.append(f"lse err {lse_err:.2e} >= {max(tol, 1e-4) * 4:g}")
    return dict(rel_err=err, lse_err=lse_err, failures=failures)


@dataclasses.dataclass
class Case:
    """One paged decode/verify problem for :func:`numpy_mla_decode` (float32 values; callers
    cast them)."""

    q: np.ndarray  # [T, H, D] float32 values (cast by the caller)
    cache: np.ndarray  # [P, page_size, D] float32, unused slots NaN
    block_table: np.ndarray  # [B, max_pages] int32, unused entries point at NaN pages / -1
    seq_lens: np.ndarray  # [B] int32
    qlen: int
    page_size: int
    kv_lora_rank: int
    scale: float


def make_case(rng, *, seq_lens, qlen, num_heads, page_size, kv_lora_rank=512, rope_dim=64,
              extra_pages=2, scale=None) -> Case:
    """A paged cache with a permuted block table; every slot no request uses is NaN."""
    seq_lens = np.asarray(seq_lens, np.int32)
    b = len(seq_lens)
    d = kv_lora_rank + rope_dim
    need = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max(need + [1]) + extra_pages
    num_phys = sum(need) + extra_pages + 1
    cache = np.full((num_phys, page_size, d), np.nan, np.float32)
    perm = rng.permutation(num_phys)
    block_table = np.full((b, max_pages), -1, np.int32)
    nan_pages = list(perm[sum(need):])
    k = 0
    for i, n in enumerate(seq_lens):
        pages = perm[k:k + need[i]]
        k += need[i]
        block_table[i, :need[i]] = pages
        # Unused entries: some -1, some pointing at NaN pages (a kernel must not read either).
        for j in range(need[i], max_pages):
            if rng.random() < 0.5:
                block_table[i, j] = nan_pages[rng.integers(len(nan_pages))]
        for p_i, page in enumerate(pages):
            rows = min(page_size, int(n) - p_i * page_size)
            cache[page, :rows] = rng.standard_normal((rows, d))
    q = rng.standard_normal((b * qlen, num_heads, d)).astype(np.float32)
    if scale is None:
        scale = 1.0 / np.sqrt(192.0)
    return Case(q, cache, block_table, seq_lens, qlen, page_size, kv_lora_rank, float(scale))
