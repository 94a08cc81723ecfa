"""AITER's PS prefill planner (``get_ps_metadata_v1``) in ``jax.numpy``: sizes and the plan.

AITER plans its fp8 persistent-scheduling (PS) prefill, ``mla_prefill_ps_asm_fwd`` +
``mla_reduce_v1``, with a *host* algorithm (``get_ps_metadata_v1_2_host``,
``csrc/kernels/mla/metadata/v1_2_host.cuh`` at ROCm/aiter e4048607): it copies the indptrs to
the host, plans there and copies the plan back, so vLLM runs it once per step on CPU copies of
``query_start_loc``. This module computes the same five arrays on the device from the device
``query_start_loc``, with static shapes and no host sync:

- :func:`ps_metadata_sizes` -- ``get_ps_metadata_info_v1``'s buffer sizes from the static batch
  bound, the static query-length bound, the (padded) head count and the CU count.
- :func:`plan_ps_prefill` -- the plan, bit for bit what AITER's host planner writes into buffers
  of those sizes, tails included (see :class:`PsPrefillPlan`).
- :func:`aiter_ps_metadata` -- AITER's own planner through a callback (imports ``aiter``), for
  an on-hardware differential check; the prefill route does not use it.

How AITER's algorithm reduces to closed form. Each request's query rows are cut into tiles of
``qlen_granularity`` rows, visited per request in ping-pong order (0, n-1, 1, n-2, ...); a tile
needs ``ceil(causal KV length / kvlen_granularity)`` KV *units*. The CUs are split into
``gcd(heads, CUs)`` clusters of ``tgs = CUs / clusters`` thread groups, each cluster serving
``heads / clusters`` KV heads; every cluster splits the same unit stream the same way. Thread
group ``t`` has a quota of ``avg + (t < rem)`` units (``avg, rem = divmod(total units, tgs)``)
and takes units greedily from the stream. Because every tile needs at least one unit (causal,
KV length >= query length) and AITER's "does the rest fit" test on the remaining *tokens* is
equivalent to the same test on the remaining *units* (both sides are multiples of the unit),
thread group ``t`` takes exactly the stream units ``[C_t, C_{t+1})`` with ``C_t = t * avg +
min(t, rem)``. So a work is one piece of the stream cut at every tile boundary and every
``C_t``; a tile cut into several pieces is *split* and each of its pieces writes a partial
(``partial_o_loc = qlen_granularity * (split pieces before it)``). Works are listed cluster by
cluster, thread group by thread group, then per KV head of the cluster, then piece by piece.
The reduce maps list the split tiles in query order (AITER keys an ordered map by
``(qo_start, qo_end)``). Everything below is that arithmetic, vectorised: prefix sums and
``searchsorted`` over static-capacity arrays.

The route's fixed arguments (vLLM's ``_build_fp8_prefill_ps_metadata``): gqa ratio 1,
``qhead_granularity=1``, ``qlen_granularity=256``, ``kvlen_granularity=128``, ``block_size=1``,
causal. The KV indptr defaults to the query indptr (new tokens only).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter.planner import _BIG, _cdiv

QLEN_GRANULARITY = caps.FP8_PREFILL_TILE_Q  # 256 query rows a tile
KVLEN_GRANULARITY = 128  # vLLM passes kvlen_granularity=128
QHEAD_GRANULARITY = 1
WORK_INFO_FIELDS = ("batch_idx", "partial_o_loc", "qo_start", "qo_end", "kv_start", "kv_end",
                    "kv_offset", "q_head_range")

# ---------------------------------------------------------------------------------------------
# get_ps_metadata_info_v1


@dataclasses.dataclass(frozen=True)
class PsMetadataSizes:
    """Buffer sizes of ``get_ps_metadata_info_v1(batch_size, num_head_k, max_qlen, 256)``.

    Attributes:
      num_cu: CU count (``work_indptr [num_cu + 1]``).
      num_clusters: ``gcd(num_head_k, num_cu)``; ``tgs_per_cluster = num_cu / num_clusters``.
      qo_splits: ``ceil(max_qlen / qlen_granularity)``, query tiles a request may have.
      tile_cnt: ``batch_size * qo_splits``: ``reduce_indptr [tile_cnt + 1]``,
        ``reduce_final_map [tile_cnt, 2]``.
      max_works: rows of ``work_info [max_works, 8]``.
      max_partials: length of ``reduce_partial_map`` (vLLM reserves ``max_partials *
        qlen_granularity`` partial scratch rows).
      split_pieces_bound: a tighter bound on the partials a plan can have: every thread-group
        quota boundary cuts at most one tile, and the pieces of the cut tiles number at most
        twice the cuts, so ``min(tile_cnt + tgs - 1, 2 * (tgs - 1))`` (AITER's
        ``max_partials`` carries an extra factor ``qo_splits``).
    """

    num_cu: int
    num_clusters: int
    tgs_per_cluster: int
    qo_splits: int
    tile_cnt: int
    max_works: int
    max_partials: int

    @property
    def split_pieces_bound(self) -> int:
        tgs = self.tgs_per_cluster
        return min(self.tile_cnt + tgs - 1, 2 * (tgs - 1))

    def shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        """The six ``(shape, dtype)`` pairs, in AITER's return order."""
        return (
            ((2,), "uint64"),  # work_metadata_ptrs
            ((self.num_cu + 1,), "int32"),  # work_indptr
            ((self.max_works, 8), "int32"),  # work_info
            ((self.tile_cnt + 1,), "int32"),  # reduce_indptr
            ((self.tile_cnt, 2), "int32"),  # reduce_final_map
            ((self.max_partials,), "int32"),  # reduce_partial_map
        )


def ps_metadata_sizes(batch_size: int, num_head_k: int, max_qlen: int,
                      qlen_granularity: int = QLEN_GRANULARITY, *,
                      num_cu: int) -> PsMetadataSizes:
    """``get_ps_metadata_info_v1`` on a device with ``num_cu`` CUs.

    Example (256 CUs, 16 heads, batch 2, max qlen 8192): 16 clusters of 16 CUs, 32 tiles a
    request: work_info [17 * 32 * 16, 8] = [8704, 8], reduce_indptr 65, partial map
    min(17, 30) * 32 = 544.
    """
    for name, x in (("batch_size", batch_size), ("num_head_k", num_head_k),
                    ("max_qlen", max_qlen), ("qlen_granularity", qlen_granularity),
                    ("num_cu", num_cu)):
        if int(x) < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")
    cu = int(num_cu)
    clusters = math.gcd(int(num_head_k), cu)
    per = cu // clusters
    qsplit = _cdiv(int(max_qlen), int(qlen_granularity))
    b = int(batch_size)
    return PsMetadataSizes(
        num_cu=cu, num_clusters=clusters, tgs_per_cluster=per, qo_splits=qsplit,
        tile_cnt=b * qsplit, max_works=(b + per - 1) * qsplit * int(num_head_k),
        max_partials=min(b + per - 1, (per - 1) * 2) * qsplit)


# ---------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class PsPrefillPlan:
    """AITER's PS prefill schedule: what ``get_ps_metadata_v1`` leaves in its five buffers.

    Attributes (data, int32):
      work_indptr: ``[num_cu + 1]``; CU ``c`` runs works ``[work_indptr[c], work_indptr[c+1])``
        (CU ``c`` is thread group ``c % tgs`` of cluster ``c // tgs``). Every entry is written.
      work_info: ``[max_works, 8]``, one row per work: ``0 batch_idx``; ``1 partial_o_loc`` -1
        when the work covers its whole query tile and writes final rows, else the first of the
        ``qo_end - qo_start`` partial scratch rows it writes; ``2 qo_start``, ``3 qo_end``
        global query rows; ``4 kv_start``, ``5 kv_end`` positions in ``kv_indices``;
        ``6 kv_offset`` 0 for a tile's last piece, else the request's KV length minus the
        request-local ``kv_end``; ``7 q_head_range`` ``head | (head + 1) << 16``. Rows past the
        last work are 0 (AITER copies its zero-initialised host vector back whole).
      reduce_indptr: ``[tile_cnt + 1]``; split tile ``i`` (in query order) merges partials
        ``reduce_partial_map[reduce_indptr[i]:reduce_indptr[i + 1]]``; every entry past the
        last split tile holds the total (AITER fills the tail with it).
      reduce_final_map: ``[tile_cnt, 2]`` ``(qo_start, qo_end)`` of each split tile, in query
        order; rows past them are 0.
      reduce_partial_map: ``[max_partials]`` first scratch row of each partial, ascending
        within a tile; entries past the total are 0.
      num_partial_tiles: ``[]`` the total number of partials (vLLM's ``num_partial_tiles =
        reduce_indptr[-1]``), on the device.
      num_works: ``[]`` works written (``work_indptr[-1]``).

    Static attributes: ``num_cu``, ``num_heads`` (``num_heads_k``, the padded head count),
    ``num_clusters``, ``tgs_per_cluster``, ``max_works``, ``tile_cnt``, ``max_partials``,
    ``num_batches`` (``len(qo_indptr) - 1``), ``max_qlen``, ``qlen_granularity``,
    ``kvlen_granularity``.
    """

    work_indptr: jax.Array
    work_info: jax.Array
    reduce_indptr: jax.Array
    reduce_final_map: jax.Array
    reduce_partial_map: jax.Array
    num_partial_tiles: jax.Array
    num_works: jax.Array
    num_cu: int = 0
    num_heads: int = 16
    num_clusters: int = 1
    tgs_per_cluster: int = 1
    max_works: int = 0
    tile_cnt: int = 0
    max_partials: int = 0
    num_batches: int = 0
    max_qlen: int = 0
    qlen_granularity: int = QLEN_GRANULARITY
    kvlen_granularity: int = KVLEN_GRANULARITY

    @property
    def scratch_rows(self) -> int:
        """Rows of a partial scratch (``splitData``/``splitLse``) every plan of these sizes
        fits: ``qlen_granularity`` rows per partial, at most
        :attr:`PsMetadataSizes.split_pieces_bound` partials (at least one row block, so the
        buffer is never empty). Static; smaller than vLLM's ``max_partials * 256``."""
        tgs = self.tgs_per_cluster
        bound = min(self.tile_cnt + tgs - 1, 2 * (tgs - 1))
        return max(bound, 1) * self.qlen_granularity

    def arrays(self) -> tuple[jax.Array, ...]:
        """``(work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map)``."""
        return (self.work_indptr, self.work_info, self.reduce_indptr, self.reduce_final_map,
                self.reduce_partial_map)


_PLAN_DATA = ["work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
              "reduce_partial_map", "num_partial_tiles", "num_works"]
_PLAN_META = [f.name for f in dataclasses.fields(PsPrefillPlan) if f.name not in _PLAN_DATA]
jax.tree_util.register_dataclass(PsPrefillPlan, data_fields=_PLAN_DATA, meta_fields=_PLAN_META)


@dataclasses.dataclass(frozen=True)
class _Static:
    num_batches: int
    num_heads: int
    max_qlen: int
    qg: int
    kg: int
    hg: int
    sizes: PsMetadataSizes


def plan_ps_prefill(qo_indptr, kv_indptr=None, *, num_heads: int, max_qlen: int,
                    num_cu: int | None = None, arch: str = "gfx950",
                    capacity_batch: int | None = None,
                    qlen_granularity: int = QLEN_GRANULARITY,
                    kvlen_granularity: int = KVLEN_GRANULARITY,
                    qhead_granularity: int = QHEAD_GRANULARITY) -> PsPrefillPlan:
    """``get_ps_metadata_v1`` as vLLM calls it, on the device: the PS prefill plan.

    Args:
      qo_indptr: ``[B + 1]`` int32 query indptr (``query_start_loc``), non-decreasing from 0.
      kv_indptr: ``[B + 1]`` KV indptr (token level: block size 1); default ``qo_indptr``.
        Each request's KV length must be at least its query length (causal, right-aligned).
      num_heads: ``num_heads_k`` the kernel is called with (the padded head count, gqa 1).
      max_qlen: static bound on a request's query length (sizes the buffers; a longer request
        has tiles the buffers cannot hold, and AITER would overrun them).
      num_cu: CU count the plan is for (AITER uses the device's; the kernel's grid is
        ``len(work_indptr) - 1``, so any count is correct). Default: ``arch``'s flagship part.
      capacity_batch: the batch bound the buffers are sized for (default ``B``; vLLM sizes them
        with ``max_num_seqs``). Requests past the live ones should have length 0.
      qlen_granularity, kvlen_granularity, qhead_granularity: AITER's granularities (vLLM: 256,
        128, 1).

    Returns a :class:`PsPrefillPlan`. Jittable (everything but ``qo_indptr``/``kv_indptr`` is
    static); nothing is read back to the host.
    """
    qo_indptr = jnp.asarray(qo_indptr)
    if qo_indptr.ndim != 1 or qo_indptr.shape[0] < 2:
        raise ValueError(f"qo_indptr must be [B + 1] with B >= 1, got {tuple(qo_indptr.shape)}")
    kv_indptr = qo_indptr if kv_indptr is None else jnp.asarray(kv_indptr)
    if kv_indptr.shape != qo_indptr.shape:
        raise ValueError(f"kv_indptr {tuple(kv_indptr.shape)} must match qo_indptr "
                         f"{tuple(qo_indptr.shape)}")
    b = qo_indptr.shape[0] - 1
    cap = b if capacity_batch is None else int(capacity_batch)
    if cap < b:
        raise ValueError(f"capacity_batch {cap} is below the batch of {b} requests")
    cu = caps.arch_info(arch).num_cu if num_cu is None else int(num_cu)
    if int(kvlen_granularity) < 1 or int(kvlen_granularity) & (int(kvlen_granularity) - 1):
        raise ValueError(f"kvlen_granularity must be a power of 2 (AITER checks), got "
                         f"{kvlen_granularity}")
    sizes = ps_metadata_sizes(cap, int(num_heads), int(max_qlen), int(qlen_granularity),
                              num_cu=cu)
    st = _Static(b, int(num_heads), int(max_qlen), int(qlen_granularity),
                 int(kvlen_granularity), int(qhead_granularity), sizes)
    return _plan(qo_indptr.astype(jnp.int32), kv_indptr.astype(jnp.int32), st)


def _search(a, v, side):
    return jnp.searchsorted(a, v, side=side).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(2,))
def _plan(qo, kvp, st: _Static) -> PsPrefillPlan:
    sz = st.sizes
    i32 = jnp.int32
    qg, kg = st.qg, st.kg
    tgs, hpc = sz.tgs_per_cluster, st.num_heads // sz.num_clusters
    nt = sz.tile_cnt  # tile capacity: requests of at most max_qlen rows
    pc = nt + tgs - 1  # piece capacity of one cluster (each quota boundary adds <= 1)

    qlen = qo[1:] - qo[:-1]
    ctx = kvp[1:] - kvp[:-1]  # context_lens (block size 1)
    ntiles = (qlen + qg - 1) // qg  # tiles per request
    tile_end = jnp.cumsum(ntiles).astype(i32)
    tile_begin = tile_end - ntiles
    total_tiles = tile_end[-1]

    def tile_rows(req, idx):
        lo = idx * qg
        hi = jnp.minimum(lo + qg, qlen[req])
        return lo, hi

    # Step 1: the tile stream (request order, ping-pong within a request) and its KV units.
    s = jnp.arange(nt, dtype=i32)
    s_ok = s < total_tiles
    s_req = jnp.minimum(_search(tile_end, s, "right"), st.num_batches - 1)
    i = s - tile_begin[s_req]
    n = ntiles[s_req]
    s_idx = jnp.where(i % 2 == 0, i // 2, n - 1 - i // 2)
    s_lo, s_hi = tile_rows(s_req, s_idx)
    eff = jnp.minimum(ctx[s_req] - qlen[s_req] + s_hi, ctx[s_req])  # causal KV of the tile
    units = jnp.where(s_ok, (eff + kg - 1) // kg, 0)
    u_end = jnp.cumsum(units).astype(i32)
    u_begin = u_end - units
    total = u_end[-1]

    # Step 2: thread group t takes stream units [C_t, C_{t+1}).
    avg, rem = total // tgs, total % tgs
    t_all = jnp.arange(tgs + 1, dtype=i32)
    c = t_all * avg + jnp.minimum(t_all, rem)
    # Quota boundaries strictly inside a tile cut it (boundaries < total are distinct).
    first_cut = _search(c, u_begin, "right")
    cuts = _search(c, u_end, "left") - first_cut
    npieces = jnp.where(s_ok, 1 + cuts, 0)
    p_end = jnp.cumsum(npieces).astype(i32)
    p_begin = p_end - npieces
    num_pieces = p_end[-1]
    split = npieces > 1
    split_before = (jnp.cumsum(jnp.where(split, npieces, 0)) - jnp.where(split, npieces, 0)
                    ).astype(i32)

    # The pieces of one cluster, in stream order.
    p = jnp.arange(pc, dtype=i32)
    p_ok = p < num_pieces
    ps = jnp.minimum(_search(p_end, p, "right"), nt - 1)  # its stream tile
    j = p - p_begin[ps]
    last = j == npieces[ps] - 1
    cut_at = jnp.clip(first_cut[ps] + j - 1, 0, tgs)
    a = jnp.where(j == 0, u_begin[ps], c[cut_at])  # first unit of the piece
    e = jnp.where(last, u_end[ps], c[jnp.clip(first_cut[ps] + j, 0, tgs)])
    p_tg = jnp.where(p_ok, _search(c, a, "right") - 1, _BIG)
    req = s_req[ps]
    kv_begin, kv_stop = kvp[req], kvp[req + 1]
    kv_start = kv_begin + (a - u_begin[ps]) * kg
    kv_end = jnp.minimum(kv_start + (e - a) * kg, kv_stop)
    kv_offset = jnp.where(last, 0, ctx[req] - (kv_end - kv_begin))
    ploc = jnp.where(split[ps], qg * (split_before[ps] + j), -1)
    lo, hi = s_lo[ps], s_hi[ps]
    piece = jnp.stack([req, ploc, qo[req] + lo, qo[req] + hi, kv_start, kv_end, kv_offset], -1)

    # Works: cluster, then thread group, then KV head of the cluster, then piece.
    first_piece = _search(p_tg, t_all, "left")  # [tgs + 1]; first_piece[tgs] = num_pieces
    g = hpc * first_piece
    per_cluster = hpc * num_pieces
    w = jnp.arange(sz.max_works, dtype=i32)
    w_ok = w < sz.num_clusters * per_cluster
    cl = w // jnp.maximum(per_cluster, 1)
    r = w - cl * per_cluster
    t = jnp.clip(_search(g, r, "right") - 1, 0, tgs - 1)
    rr = r - g[t]
    np_t = jnp.maximum(first_piece[t + 1] - first_piece[t], 1)
    head = cl * hpc + rr // np_t
    pw = jnp.clip(first_piece[t] + rr % np_t, 0, pc - 1)
    hrange = ((head + 1) * st.hg << 16) | ((head * st.hg) & 0xFFFF)
    info = jnp.concatenate([piece[pw], hrange[:, None]], -1)
    work_info = jnp.where(w_ok[:, None], info, 0).astype(i32)
    num_works = sz.num_clusters * per_cluster
    k = jnp.arange(sz.num_cu, dtype=i32)
    work_indptr = jnp.concatenate(
        [jnp.zeros((1,), i32), (k // tgs) * per_cluster + g[k % tgs + 1]]).astype(i32)

    # Reduce maps: split tiles in query order (AITER's ordered map on (qo_start, qo_end)).
    m = jnp.arange(nt, dtype=i32)
    m_ok = m < total_tiles
    m_req = jnp.minimum(_search(tile_end, m, "right"), st.num_batches - 1)
    m_idx = m - tile_begin[m_req]
    n = ntiles[m_req]
    visit = jnp.where(m_idx < (n + 1) // 2, 2 * m_idx, 2 * (n - 1 - m_idx) + 1)  # ping-pong
    m_s = jnp.clip(tile_begin[m_req] + visit, 0, nt - 1)  # its stream tile
    m_split = m_ok & split[m_s]
    cnt = jnp.where(m_split, npieces[m_s], 0)
    red_end = jnp.cumsum(cnt).astype(i32)
    total_partials = red_end[-1]
    rank = jnp.cumsum(m_split.astype(i32)) - 1
    dst = jnp.where(m_split, rank, nt)  # nt: dropped
    m_lo, m_hi = tile_rows(m_req, m_idx)
    reduce_indptr = jnp.full((nt + 1,), total_partials, i32).at[0].set(0)
    reduce_indptr = reduce_indptr.at[dst + 1].set(red_end, mode="drop")
    final_map = jnp.zeros((nt, 2), i32).at[dst].set(
        jnp.stack([qo[m_req] + m_lo, qo[m_req] + m_hi], -1), mode="drop")
    x = jnp.arange(sz.max_partials, dtype=i32)
    xm = jnp.minimum(_search(red_end, x, "right"), nt - 1)
    xj = x - (red_end[xm] - cnt[xm])
    partial_map = jnp.where(x < total_partials, qg * (split_before[m_s[xm]] + xj), 0)

    return PsPrefillPlan(
        work_indptr=work_indptr, work_info=work_info, reduce_indptr=reduce_indptr,
        reduce_final_map=final_map, reduce_partial_map=partial_map.astype(i32),
        num_partial_tiles=total_partials, num_works=num_works.astype(i32), num_cu=sz.num_cu,
        num_heads=st.num_heads, num_clusters=sz.num_clusters, tgs_per_cluster=tgs,
        max_works=sz.max_works, tile_cnt=nt, max_partials=sz.max_partials,
        num_batches=st.num_batches, max_qlen=st.max_qlen, qlen_granularity=qg,
        kvlen_granularity=kg)


# ---------------------------------------------------------------------------------------------
# The plan from AITER itself (on-hardware differential check of plan_ps_prefill)


def aiter_ps_metadata(qo_indptr, kv_indptr=None, *, num_heads: int, max_qlen: int,
                      capacity_batch: int | None = None):
    """Run AITER's ``get_ps_metadata_info_v1`` + ``get_ps_metadata_v1`` as vLLM does.

    Returns ``(work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map)``
    as AITER leaves them, sized by AITER for its device's CU count (imports ``aiter`` and
    ``torch``; the planner runs on host copies of the indptrs: a device->host copy per call).
    For checking :func:`plan_ps_prefill` (with ``num_cu`` = that CU count) against the real
    planner on a ROCm host; the prefill route never calls it.
    """
    import contextlib
    import importlib

    import torch
    from jax.experimental import buffer_callback

    aiter = importlib.import_module("aiter")
    qo_indptr = jnp.asarray(qo_indptr, jnp.int32)
    kv_indptr = qo_indptr if kv_indptr is None else jnp.asarray(kv_indptr, jnp.int32)
    b = qo_indptr.shape[0] - 1
    info = aiter.get_ps_metadata_info_v1(batch_size=b if capacity_batch is None
                                         else int(capacity_batch), num_head_k=int(num_heads),
                                         max_qlen=int(max_qlen),
                                         qlen_granularity=QLEN_GRANULARITY)
    dims = [tuple(int(x) for x in (s if isinstance(s, tuple) else (s,))) for s, _ in info]
    shapes = [jax.ShapeDtypeStruct(d, jnp.int32) for d in dims[1:]]

    def callback(ctx, outs, qo, kvp):
        outs_t = [torch.from_dlpack(o) for o in outs]
        dev = outs_t[0].device
        try:  # run on XLA's stream (bridge.py explains); CPU has none
            stream = ctx.stream if dev.type == "cuda" else None
        except Exception:
            stream = None
        with (torch.cuda.stream(torch.cuda.ExternalStream(int(stream), device=dev)) if stream
              else contextlib.nullcontext()):
            meta, wp, wi, ri, rf, rp = (torch.empty(d, dtype=dt, device=dev)
                                        for d, (_, dt) in zip(dims, info))
            qo_cpu = torch.from_dlpack(qo).cpu()
            kv_cpu = torch.from_dlpack(kvp).cpu()
            aiter.get_ps_metadata_v1(qo_cpu, kv_cpu, kv_cpu[1:] - kv_cpu[:-1], 1,
                                     int(num_heads), meta, wp, wi, ri, rf, rp,
                                     qhead_granularity=QHEAD_GRANULARITY,
                                     qlen_granularity=QLEN_GRANULARITY,
                                     kvlen_granularity=KVLEN_GRANULARITY, block_size=1,
                                     is_causal=True)
            for o, buf in zip(outs_t, (wp, wi, ri, rf, rp)):
                o.copy_(buf)

    return tuple(buffer_callback.buffer_callback(callback, tuple(shapes))(qo_indptr, kv_indptr))
