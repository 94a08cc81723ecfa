"""Float64 NumPy oracles, written from the formulas of docs/design.md §1, independent of jax_mla."""

from __future__ import annotations

import numpy as np


def logical_kv(cache, block_table, seq_len, page_size):
    """``[seq_len, D]`` float64 rows of one request, read through its block table."""
    pos = np.arange(seq_len)
    pages = np.asarray(block_table)[pos // page_size]
    return np.asarray(cache, np.float64)[pages, pos % page_size]


def mla_decode(q, cache, block_table, seq_lens, *, qlen, page_size, scale, kv_lora_rank,
               q_scale=1.0, kv_scale=1.0):
    """``out [T, H, L]``, ``lse [T, H]`` in float64; rows ``b * qlen + t``."""
    q = np.asarray(q, np.float64) * q_scale
    t_rows, h, _ = q.shape
    out = np.zeros((t_rows, h, kv_lora_rank))
    lse = np.full((t_rows, h), -np.inf)
    for b, n in enumerate(np.asarray(seq_lens)):
        kv = logical_kv(cache, block_table[b], int(n), page_size) * kv_scale
        for t in range(qlen):
            row = b * qlen + t
            see = int(n) - qlen + t + 1
            if see <= 0:
                continue
            k = kv[:see]
            s = q[row] @ k.T * scale  # [H, see]
            m = s.max(axis=-1, keepdims=True)
            p = np.exp(s - m)
            z = p.sum(axis=-1, keepdims=True)
            out[row] = (p / z) @ k[:, :kv_lora_rank]
            lse[row] = (m + np.log(z))[:, 0]
    return out, lse


def softmax_union(scores_a, vals_a, scores_b, vals_b):
    """Direct softmax over the union of two score sets: ``out``, ``lse`` (float64)."""
    s = np.concatenate([scores_a, scores_b], axis=-1).astype(np.float64)
    v = np.concatenate([vals_a, vals_b], axis=-2).astype(np.float64)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    z = p.sum(axis=-1, keepdims=True)
    return np.einsum("...s,...sd->...d", p / z, v), (m + np.log(z))[..., 0]


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    den = np.linalg.norm(want)
    return np.linalg.norm(got - want) / (den if den > 0 else 1.0)
