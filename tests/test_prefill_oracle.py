"""Float64 NumPy oracles for prefill, written from docs/design.md §9, independent of jax_mla.

The tests at the bottom check the oracles themselves against the decode oracle (the absorbed form
of the same attention) and the direct softmax in ``oracle.py``.
"""

from __future__ import annotations

import numpy as np

from oracle import logical_kv, mla_decode, softmax_union


def varlen_attention(q, k, v, cu_q, cu_k, *, scale, causal):
    """``out [T, H, Dv]``, ``lse [T, H]`` float64. Sequence ``b``: rows ``cu_q[b]..cu_q[b+1]``
    against keys ``cu_k[b]..cu_k[b+1]``; causal is bottom-right aligned (row ``i`` sees keys
    ``j <= i + sk - sq``). Rows outside every sequence, and rows that see nothing: 0, -inf."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    t, h, _ = q.shape
    out = np.zeros((t, h, v.shape[2]))
    lse = np.full((t, h), -np.inf)
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        sq, sk = len(qs), len(ks)
        if sq == 0 or sk == 0:
            continue
        s = np.einsum("ihd,jhd->hij", qs, ks) * scale
        see = np.ones((sq, sk), bool)
        if causal:
            see = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(see[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        rows = np.isfinite(m[0, :, 0])
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        z = p.sum(axis=-1, keepdims=True)
        o = np.einsum("hij,jhv->ihv", p / np.where(z == 0, 1, z), vs)
        lz = (m + np.log(np.where(z == 0, 1, z)))[..., 0].T
        out[cu_q[b]:cu_q[b + 1]][rows] = o[rows]
        lse[cu_q[b]:cu_q[b + 1]][rows] = lz[rows]
    return out, lse


def mla_prefill_over_context(q, kv_c, k_pe, cache, block_table, context_lens, cu, kv_b_proj, *,
                             page_size, scale, k_scale=1.0):
    """One-shot MHA attention of each request's new tokens over its whole sequence.

    Request ``b``'s latents are its ``context_lens[b]`` cached rows (dequantised with
    ``k_scale``) followed by its new rows ``kv_c[cu[b]:cu[b+1]] | k_pe[...]``; keys
    ``[latent_c @ W_UK | k_pe]``, values ``latent_c @ W_UV``; new token ``i`` sees positions
    ``<= context_len + i``. Returns float64 ``out [T, H, V]``, ``lse [T, H]``.
    """
    w = np.asarray(kv_b_proj, np.float64)
    lrank, h, _ = w.shape
    rope = np.asarray(k_pe).shape[-1]
    nope = np.asarray(q).shape[2] - rope
    new = np.concatenate([np.asarray(kv_c, np.float64), np.asarray(k_pe, np.float64)], axis=1)
    ks, vs, cu_k = [], [], [0]
    for b in range(len(cu) - 1):
        ctx = logical_kv(cache, block_table[b], int(context_lens[b]), page_size) * k_scale
        lat = np.concatenate([ctx, new[cu[b]:cu[b + 1]]], axis=0)
        kv = np.einsum("nl,lhd->nhd", lat[:, :lrank], w)
        pe = np.broadcast_to(lat[:, None, lrank:], (len(lat), h, rope))
        ks.append(np.concatenate([kv[..., :nope], pe], axis=-1))
        vs.append(kv[..., nope:])
        cu_k.append(cu_k[-1] + len(lat))
    return varlen_attention(q, np.concatenate(ks), np.concatenate(vs), cu, np.asarray(cu_k),
                            scale=scale, causal=True)


def test_varlen_attention_matches_direct_softmax(rng):
    h, dqk, dv = 2, 8, 5
    cu = np.array([0, 3, 3, 7])
    q = rng.standard_normal((8, h, dqk))
    k = rng.standard_normal((7, h, dqk))
    v = rng.standard_normal((7, h, dv))
    out, lse = varlen_attention(q, k, v, cu, cu, scale=0.3, causal=True)
    for b, row, see in ((0, 2, 3), (2, 4, 2)):  # sequence, row, keys it sees
        s = np.einsum("hd,khd->hk", q[row], k[cu[b]:cu[b] + see]) * 0.3
        vals = np.broadcast_to(v[cu[b]:cu[b] + see].transpose(1, 0, 2), (h, see, dv))
        want_o, want_l = softmax_union(s[:, :1], vals[:, :1], s[:, 1:], vals[:, 1:])
        np.testing.assert_allclose(out[row], want_o, rtol=1e-12)
        np.testing.assert_allclose(lse[row], want_l, rtol=1e-12)
    assert np.all(out[7] == 0) and np.all(np.isneginf(lse[7]))  # padding row


def test_mha_oracle_equals_absorbed_decode_oracle(rng):
    """The MHA form over a context and the absorbed latent form agree (MLA's identity)."""
    lrank, rope, nope, dv, h, page = 12, 4, 6, 5, 3, 4
    lens = np.array([6, 9])  # context + 1 new token each
    d = lrank + rope
    cache = rng.standard_normal((8, page, d))
    table = np.array([[3, 0, 7], [5, 1, 2]])
    w = rng.standard_normal((lrank, h, nope + dv)) / np.sqrt(lrank)
    q = rng.standard_normal((2, h, nope + rope))
    new = np.stack([logical_kv(cache, table[b], lens[b], page)[-1] for b in range(2)])
    out, lse = mla_prefill_over_context(q, new[:, :lrank], new[:, lrank:], cache, table, lens - 1,
                                        np.array([0, 1, 2]), w, page_size=page, scale=0.25)
    q_abs = np.concatenate([np.einsum("thp,lhp->thl", q[..., :nope], w[..., :nope]),
                            q[..., nope:]], axis=-1)
    lat, lse_d = mla_decode(q_abs, cache, table, lens, qlen=1, page_size=page, scale=0.25,
                            kv_lora_rank=lrank)
    np.testing.assert_allclose(out, np.einsum("thl,lhv->thv", lat, w[..., nope:]), rtol=1e-10)
    np.testing.assert_allclose(lse, lse_d, rtol=1e-12)
