"""A float64 NumPy oracle for MLA decode/verify, for demos and GPU checks.

(The test suite carries its own oracle, written separately, so a shared mistake cannot hide.)
"""

from __future__ import annotations

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
