"""AITER's persistent split-KV decode planner in ``jax.numpy``: buffer sizes, the plan, a consumer.

Three pieces, all pure and jittable:

- :func:`mla_metadata_sizes` -- the static buffer sizes of ``get_mla_metadata_info_v1``
  (docs/design.md §7.9), from the batch capacity, qlen, padded heads, dtypes and CU count.
- :func:`plan_mla_decode` -- ``get_mla_metadata_v1`` fast mode (AITER's ``v1_2`` device planner)
  for page size 1: from ``kv_indptr`` to the five plan arrays, with static capacities and no host
  sync. AITER runs one of two kernels: a closed-form prefix scan (qlen 1, no q split, no fold) and
  a sequential single-lane greedy fill (everything else). Both walk the (batch, q-tile) items in
  order carrying one (CU, remaining payload) state; here that walk is a ``lax.scan`` with a
  closed-form step per item (how many fragments, where they land), and every work, reduce and
  partial entry is then written in one vectorised pass. The two AITER variants differ only for an
  empty batch that meets a full CU (the prefix scan drops it); ``variant`` reproduces either.
- :func:`execute_plan_reference` -- runs every work of a plan with exact float32 math
  (:func:`execute_plan_works`: partial ``out`` + ``lse`` for split works, final rows for unsplit
  ones) and reduces with ``reduce_indptr / reduce_final_map / reduce_partial_map``
  (:func:`reduce_plan_reference`, through ``jax_mla.merge``): the second consumer of the plan
  format, tested against the float64 oracle. The third is jax_mla's Triton reduce kernel
  (``jax_mla.backends.triton.reduce_partials``), driven by the same plan in the tests.

The plan is AITER's, bit for bit where AITER writes something; entries AITER leaves unwritten are
``-1`` here (AITER's buffers hold stale values there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_mla.backends.aiter import capabilities as caps
from jax_mla.cache import dequantize
from jax_mla.merge import merge_lse_weights, weighted_sum

_HI = jax.lax.Precision.HIGHEST
WORK_INFO_FIELDS = ("batch_idx", "partial_qo_loc", "qo_start", "qo_end", "kv_start", "kv_end",
                    "kv_offset", "pad")
KV_GRANULARITY = 16  # vLLM passes kv_granularity=16
_BIG = 1 << 30


def _cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# get_mla_metadata_info_v1


@dataclasses.dataclass(frozen=True)
class MlaMetadataSizes:
    """Buffer sizes of ``get_mla_metadata_info_v1`` (non intra-batch mode).

    Attributes:
      max_splits: ``cu_num * occupancy`` (occupancy 1: the experimental HK kernel is off).
      max_work: rows of ``work_info_set [max_work, 8]``.
      tile_cnt: query tiles: ``reduce_indptr [tile_cnt + 1]``, ``reduce_final_map [tile_cnt, 2]``.
      partial_capacity: length of ``reduce_partial_map``; the decode scratch holds
        ``partial_capacity * max_seqlen_qo`` partial rows.
      tiles_per_batch: ``max_qo_tiles_per_batch`` the sizes assume.
    """

    max_splits: int
    max_work: int
    tile_cnt: int
    partial_capacity: int
    tiles_per_batch: int

    def shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        """The six ``(shape, dtype)`` pairs, in AITER's return order."""
        return (
            ((2,), "uint64"),  # work_metadata_ptrs
            ((self.max_splits + 1,), "int32"),  # work_indptr
            ((self.max_work, 8), "int32"),  # work_info_set
            ((self.tile_cnt + 1,), "int32"),  # reduce_indptr
            ((self.tile_cnt, 2), "int32"),  # reduce_final_map
            ((self.partial_capacity,), "int32"),  # reduce_partial_map
        )


def mla_metadata_sizes(batch_size: int, max_seqlen_qo: int, num_head_qo: int, q_dtype, kv_dtype,
                       *, arch: str, num_cu: int | None = None, is_sparse: bool = False,
                       fast_mode: bool = True, max_split_per_batch: int = -1,
                       force_fold: bool = False) -> MlaMetadataSizes:
    """``get_mla_metadata_info_v1(batch_size, max_seqlen_qo, num_head_qo, q, kv, is_sparse, ...)``.

    ``num_head_qo`` is the padded head count the kernel sees (vLLM: ``get_actual_mla_num_heads``).
    Example (gfx950, B=256, qlen 1, 16 heads, bf16): work_indptr 257, work_info [511, 8],
    reduce_indptr 257, final_map [256, 2], partial_map 510. ``force_fold``: the plan folds a
    count AITER serves natively (a known-bad native kernel routed around, ``known_bad.py``);
    its buffers are sized by AITER's rule for the counts it folds, ``ceil(packed / 16)`` tiles
    per request (enough for the pseudo-batches).
    """
    if num_head_qo % 8 != 0:
        raise ValueError(
            f"get_mla_metadata_info_v1 asserts num_head_qo % 8 == 0, got {num_head_qo}")
    gfx = caps.arch_info(arch).name
    max_splits = caps.arch_info(arch).num_cu if num_cu is None else int(num_cu)
    q8 = caps.dtype_name(q_dtype) == "fp8"
    kv8 = caps.dtype_name(kv_dtype) == "fp8"
    h = int(num_head_qo)
    qlen = 1 if is_sparse else int(max_seqlen_qo)
    packed = qlen * h
    tiles = _cdiv(packed, 16)
    if force_fold:
        pass  # the rule of every count AITER folds; the native counts' rules below do not apply
    elif (gfx == "gfx950" and not q8 and not kv8 and packed >= 64 and h <= 64
            and (packed < 128 or h == 48)) or (gfx == "gfx950" and q8 and kv8 and h == 32
                                               and qlen == 3):
        tiles = qlen if h * 2 > 64 else _cdiv(packed, 64)
    elif (h == 16 or (gfx == "gfx942" and h == 128 and q8 and kv8)
          or (gfx == "gfx950" and q8 and kv8 and ((h == 32 and qlen == 4) or h in (64, 128)))
          or (h == 64 and q8 and kv8 and qlen == 1)):
        tiles = _cdiv(packed, 128)
    elif gfx == "gfx950" and (packed >= 128 or h > 64) and not q8 and not kv8 and h != 48:
        tiles = qlen if h * 2 > 128 else _cdiv(packed, 128)
    b = batch_size * max_seqlen_qo if is_sparse else int(batch_size)
    tile_cnt = b * tiles
    if fast_mode:
        max_work = (b + max_splits - 1) * tiles
        max_split_tiles = min(b + max_splits - 1, (max_splits - 1) * 2) * tiles
    else:
        max_work = max_split_tiles = tile_cnt * max_splits
    if max_split_per_batch > 0:
        max_split_tiles = max(max_split_tiles,
                              tile_cnt + min(max_splits, max_split_per_batch * b))
    return MlaMetadataSizes(max_splits, max_work, tile_cnt, max_split_tiles, tiles)


# ---------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class MlaWorkPlan:
    """AITER's persistent split-KV decode schedule (``get_mla_metadata_v1`` outputs).

    A *pseudo-batch* is a request, or -- when AITER folds heads (``fold_ratio > 1``: 32..128
    heads not natively served run as 16-head pseudo-rows) -- one 16-head group of a request:
    pseudo-batch ``b'`` reads the KV of request ``b' // fold_ratio`` and owns query rows
    ``[qlen * b', qlen * (b' + 1))`` of the *folded* query (``q.view(T * F, 16, D)`` for qlen 1;
    ``[B, qlen, F, 16, D] -> [B, F, qlen, 16, D]`` flattened otherwise). A *tile* is a
    (pseudo-batch, q-tile) item, numbered in that order; without q splitting (``tiles_per_batch
    == 1``) tile = pseudo-batch.

    Attributes (data, int32):
      work_indptr: ``[num_cu + 1]``; CU slot ``c`` runs works ``[work_indptr[c],
        work_indptr[c + 1])``.
      work_info_set: ``[max_work, 8]``, one row per work, AITER's ``MlaWorkInfo`` layout:
        ``0 batch_idx`` pseudo-batch; ``1 partial_qo_loc`` -1 when the work covers its tile's
        whole KV and writes final rows ``[qo_start, qo_end)``, else the first of ``qo_end -
        qo_start`` scratch rows it writes a normalised partial output and natural-log LSE to;
        ``2 qo_start``, ``3 qo_end`` (folded) query rows; ``4 kv_start``, ``5 kv_end`` positions
        in ``paged_kv_indices`` (token level: page size 1); ``6 kv_offset`` = request KV end minus
        ``kv_end`` (places the right-aligned causal mask); ``7 pad`` 0. Rows past the last work
        are -1.
      reduce_indptr: ``[tile_cnt + 1]``; the partials of tile ``i`` are
        ``reduce_partial_map[reduce_indptr[i]:reduce_indptr[i + 1]]`` (empty for an unsplit
        tile); the tail past the last tile holds the total.
      reduce_final_map: ``[tile_cnt, 2]`` ``(qo_start, qo_end)`` of each split tile; -1 for
        unsplit tiles and the tail (AITER leaves those unwritten).
      reduce_partial_map: ``[partial_capacity]`` first scratch row of each partial, grouped per
        tile in fragment (KV) order; -1 past the end. Row ``i`` of a split tile merges scratch
        rows ``reduce_partial_map[k] + i``.

    Static attributes: ``num_cu``, ``max_work``, ``tile_cnt``, ``partial_capacity`` (capacities
    from :func:`mla_metadata_sizes`), ``num_batches`` (requests), ``qlen``, ``num_heads`` (the
    padded head count of the call), ``kernel_heads`` (after the fold), ``fold_ratio``,
    ``tiles_per_batch``, ``tile_size`` (query rows per tile), ``kv_granularity``, ``overhead``
    (fixed per-work cost in KV blocks), ``variant`` (``"parallel"`` or ``"sequential"``),
    ``arch``.
    """

    work_indptr: jax.Array
    work_info_set: jax.Array
    reduce_indptr: jax.Array
    reduce_final_map: jax.Array
    reduce_partial_map: jax.Array
    num_cu: int = 0
    max_work: int = 0
    tile_cnt: int = 0
    partial_capacity: int = 0
    num_batches: int = 0
    qlen: int = 1
    num_heads: int = 16
    kernel_heads: int = 16
    fold_ratio: int = 1
    tiles_per_batch: int = 1
    tile_size: int = 1
    kv_granularity: int = KV_GRANULARITY
    overhead: int = 16
    variant: str = "parallel"
    arch: str = "gfx950"

    @property
    def scratch_rows(self) -> int:
        """Rows of the partial-output scratch AITER allocates: ``partial_capacity * qlen``."""
        return self.partial_capacity * self.qlen

    def replace(self, **kw) -> MlaWorkPlan:
        return dataclasses.replace(self, **kw)


_PLAN_DATA = ["work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
              "reduce_partial_map"]
_PLAN_META = [f.name for f in dataclasses.fields(MlaWorkPlan) if f.name not in _PLAN_DATA]
jax.tree_util.register_dataclass(MlaWorkPlan, data_fields=_PLAN_DATA, meta_fields=_PLAN_META)


@dataclasses.dataclass(frozen=True)
class _Static:
    num_batches: int
    qlen: int
    num_heads: int
    kernel_heads: int
    ratio: int
    tiles: int
    tile_size: int
    num_cu: int
    num_splits: int
    overhead: int
    gran: int
    threshold: int
    parallel: bool
    causal: bool
    sizes: MlaMetadataSizes
    arch: str


def _static_config(num_batches, qlen, num_heads, q_dtype, kv_dtype, arch, num_cu,
                   max_split_per_batch, capacity_batch, capacity_qlen, variant, causal,
                   kv_granularity, force_fold=False) -> _Static:
    info = caps.arch_info(arch)
    cu = info.num_cu if num_cu is None else int(num_cu)
    h = int(num_heads)
    ratio = caps.fold_ratio(arch, h, q_dtype, kv_dtype, qlen, force_fold=force_fold)
    hk = 16 if ratio > 1 else h
    nb = num_batches * ratio
    q8 = caps.dtype_name(q_dtype) == "fp8"
    kv8 = caps.dtype_name(kv_dtype) == "fp8"
    packed = hk * qlen
    ppw = 128
    if (arch == "gfx950" and not q8 and not kv8 and packed >= 64 and hk <= 64
            and (packed < 128 or hk == 48)):
        ppw = 64
    elif arch == "gfx950" and q8 and kv8 and hk == 32 and qlen == 3:
        ppw = 64
    # AITER decides q splitting on the *unfolded* packed length, the tile count on the folded.
    qo_splits = not (0 < qlen * h <= ppw)
    if qo_splits:
        tiles = qlen if hk * 2 > ppw else _cdiv(qlen * hk, ppw)
    else:
        tiles = 1
    splits = cu if max_split_per_batch < 0 else min(cu, max_split_per_batch * nb)
    # The closed-form kernel needs its per-batch scratch (3 + 5B words) in LDS.
    parallel_ok = qlen == 1 and not qo_splits and ratio == 1 and 4 * (3 + 5 * nb) <= \
        info.lds_bytes
    if variant == "auto":
        parallel = parallel_ok
    elif variant in ("parallel", "sequential"):
        parallel = variant == "parallel"
        if parallel and not parallel_ok:
            raise ValueError("the parallel planner variant needs qlen 1, no q split, no fold")
    else:
        raise ValueError(f"variant={variant!r} must be 'auto', 'parallel' or 'sequential'")
    sizes = mla_metadata_sizes(capacity_batch, capacity_qlen, h, q_dtype, kv_dtype, arch=arch,
                               num_cu=cu, max_split_per_batch=max_split_per_batch,
                               force_fold=force_fold and ratio > 1)
    n_items = nb * tiles
    if n_items > sizes.tile_cnt or n_items + cu - 1 > sizes.max_work:
        raise ValueError(
            f"plan needs {n_items} tiles / up to {n_items + cu - 1} works but the buffers sized "
            f"for batch {capacity_batch}, qlen {capacity_qlen} hold {sizes.tile_cnt} / "
            f"{sizes.max_work}"
        )
    return _Static(num_batches, qlen, h, hk, ratio, tiles, _cdiv(qlen, tiles), cu, splits,
                   16, int(kv_granularity), qlen, parallel, bool(causal), sizes, arch)


def plan_mla_decode(kv_indptr, *, qlen: int, num_heads: int, q_dtype, kv_dtype, arch: str,
                    num_cu: int | None = None, max_split_per_batch: int = -1,
                    capacity_batch: int | None = None, capacity_qlen: int | None = None,
                    variant: str = "auto", causal: bool = True,
                    kv_granularity: int = KV_GRANULARITY,
                    force_fold: bool = False) -> MlaWorkPlan:
    """``get_mla_metadata_v1`` fast mode, page size 1, uniform ``qlen``: the persistent plan.

    Args:
      kv_indptr: ``[B + 1]`` int32 token indptr (``paged_kv_indptr``), ``kv_indptr[0] == 0``.
      qlen: uniform query rows per request (``max_seqlen_qo = uni_seqlen_qo``). Static.
      num_heads: padded query heads the kernel is called with (``num_heads_per_head_k``; one KV
        head). Static.
      q_dtype, kv_dtype: the kernel's dtypes (fp8 changes folding and tiling). Static.
      arch: ``"gfx942"`` or ``"gfx950"``. Static.
      num_cu: CU count (default: the arch's flagship part, 304 / 256). Static.
      capacity_batch, capacity_qlen: what the buffers are sized for (default ``B``, ``qlen``;
        vLLM sizes them with ``max_num_seqs`` and ``_mtp_decode_qlen``). Static.
      variant: ``"auto"`` (what AITER dispatches), ``"parallel"`` or ``"sequential"``. Static.
      force_fold: fold the heads into 16-head pseudo-batches even where AITER serves the count
        natively (the route's ``force_fold``: that native kernel is known bad). Static.

    Returns a :class:`MlaWorkPlan`. Jittable; nothing is read back to the host.
    """
    kv_indptr = jnp.asarray(kv_indptr)
    if kv_indptr.ndim != 1 or kv_indptr.shape[0] < 2:
        raise ValueError(f"kv_indptr must be [B + 1] with B >= 1, got {tuple(kv_indptr.shape)}")
    b = kv_indptr.shape[0] - 1
    st = _static_config(b, int(qlen), int(num_heads), caps.dtype_name(q_dtype),
                        caps.dtype_name(kv_dtype), arch, num_cu, int(max_split_per_batch),
                        b if capacity_batch is None else int(capacity_batch),
                        int(qlen) if capacity_qlen is None else int(capacity_qlen), variant,
                        causal, kv_granularity, bool(force_fold))
    plan, _ = _plan(kv_indptr.astype(jnp.int32), st)
    return plan


@functools.partial(jax.jit, static_argnums=(1,))
def _plan(kv_indptr, st: _Static):
    o, gran, th, ts = st.overhead, st.gran, st.threshold, st.tile_size
    n_items = st.num_batches * st.ratio * st.tiles
    item = jnp.arange(n_items, dtype=jnp.int32)
    pb = item // st.tiles  # pseudo-batch
    k = item % st.tiles  # q-tile within it
    req = pb // st.ratio
    kv_begin = kv_indptr[req]
    kv_end = kv_indptr[req + 1]
    length = kv_end - kv_begin
    nblk = (length + gran - 1) // gran
    qs = st.qlen * pb + k * ts
    qe = jnp.minimum(qs + ts, st.qlen * (pb + 1))
    if st.causal:
        if st.ratio != 1:
            bt = st.tiles - (qs // st.ratio) % st.qlen - 1
        else:
            bt = st.tiles - 1 - k
        bt = jnp.maximum(bt, 0)
    else:
        bt = jnp.zeros_like(k)
    sum_blocks = jnp.sum(nblk + o)
    payload = (sum_blocks + st.num_splits - 1) // st.num_splits + o
    bpc = payload - o
    # A fragment that would leave fewer than `threshold` tokens of its tile swallows the rest
    # (AITER's "tail done"): piece end c (in blocks) triggers it iff c * gran > L - threshold.
    tail_ok = bt < th
    tail_at = jnp.floor_divide(length - th, gran) + 1

    def step(carry, x):
        cu, r = carry
        nb, tok, tat = x
        waste = (r < nb + o) & (r <= o)
        drop = waste & (nb == 0) if st.parallel else jnp.zeros_like(waste)
        move = waste & ~drop
        cu1 = jnp.where(move, cu + 1, cu)
        r1 = jnp.where(move, payload, r)
        fits = r1 >= nb + o
        first = r1 - o
        tail0 = ~fits & tok & (first >= tat)
        single = fits | tail0
        j_fit = jnp.maximum((nb - first + bpc - 1) // bpc, 1)
        j_tail = jnp.where(tok, jnp.maximum((tat - first + bpc - 1) // bpc, 1), _BIG)
        j_last = jnp.minimum(j_fit, j_tail)
        n = jnp.where(drop, 0, jnp.where(single, 1, j_last + 1))
        rest = nb - (first + (j_last - 1) * bpc)
        r_out = jnp.where(single, r1 - (nb + o), payload - (rest + o))
        r_out = jnp.where(drop, 0, r_out)
        cu_out = jnp.where(single | drop, cu1, cu1 + j_last)
        return (cu_out, r_out), (cu1, n, first)

    init = (jnp.int32(0), payload.astype(jnp.int32))
    _, (cu_start, n, first) = jax.lax.scan(step, init, (nblk, tail_ok, tail_at), unroll=8)

    works_end = jnp.cumsum(n)
    works_before = works_end - n
    total_works = works_end[-1]
    split = n > 1
    red_n = jnp.where(split, n, 0)
    red_end = jnp.cumsum(red_n)
    red_before = red_end - red_n
    total_reduce = red_end[-1]
    part_before = jnp.cumsum(red_n * ts) - red_n * ts

    # Works: work w is fragment j of item i.
    w = jnp.arange(st.sizes.max_work, dtype=jnp.int32)
    valid = w < total_works
    i = jnp.minimum(jnp.searchsorted(works_end, w, side="right"), n_items - 1).astype(jnp.int32)
    j = w - works_before[i]
    last = j == n[i] - 1
    blk0 = jnp.where(j == 0, 0, first[i] + (j - 1) * bpc)
    ks = kv_begin[i] + blk0 * gran
    ke = jnp.where(last, kv_end[i] - bt[i],
                   jnp.minimum(kv_begin[i] + (first[i] + j * bpc) * gran, kv_end[i]))
    ploc = jnp.where(split[i], part_before[i] + j * ts, -1)
    info = jnp.stack([pb[i], ploc, qs[i], qe[i], ks, ke, kv_end[i] - ke, jnp.zeros_like(w)], -1)
    info = jnp.where(valid[:, None], info, -1).astype(jnp.int32)
    work_cu = jnp.where(valid, cu_start[i] + j, _BIG)
    c = jnp.arange(st.num_cu + 1, dtype=jnp.int32)
    work_indptr = jnp.searchsorted(work_cu, c - 1, side="right").astype(jnp.int32)
    # The last CU slot ends at the total (AITER's prefix-scan kernel writes it that way too).
    work_indptr = work_indptr.at[st.num_cu].set(total_works)

    tiles_cap = st.sizes.tile_cnt
    reduce_indptr = jnp.full((tiles_cap + 1,), total_reduce, jnp.int32)
    reduce_indptr = reduce_indptr.at[0].set(0).at[1:n_items + 1].set(red_end)
    final_map = jnp.full((tiles_cap, 2), -1, jnp.int32)
    final_map = final_map.at[:n_items].set(
        jnp.where(split[:, None], jnp.stack([qs, qe], -1), -1))
    e = jnp.arange(st.sizes.partial_capacity, dtype=jnp.int32)
    ei = jnp.minimum(jnp.searchsorted(red_end, e, side="right"), n_items - 1).astype(jnp.int32)
    partial_map = jnp.where(e < total_reduce, part_before[ei] + (e - red_before[ei]) * ts, -1)

    plan = MlaWorkPlan(
        work_indptr=work_indptr, work_info_set=info, reduce_indptr=reduce_indptr,
        reduce_final_map=final_map, reduce_partial_map=partial_map.astype(jnp.int32),
        num_cu=st.num_cu, max_work=st.sizes.max_work, tile_cnt=tiles_cap,
        partial_capacity=st.sizes.partial_capacity, num_batches=st.num_batches, qlen=st.qlen,
        num_heads=st.num_heads, kernel_heads=st.kernel_heads, fold_ratio=st.ratio,
        tiles_per_batch=st.tiles, tile_size=ts, kv_granularity=gran, overhead=o,
        variant="parallel" if st.parallel else "sequential", arch=st.arch,
    )
    aux = dict(payload=payload, num_works=total_works, num_reduce=total_reduce)
    return plan, aux


# ---------------------------------------------------------------------------------------------
# Head folding of the query, as AITER's persistent decode does it


def fold_rows(x: jax.Array, qlen: int, ratio: int) -> jax.Array:
    """``[T, F * 16, ...] -> [T * F, 16, ...]`` in AITER's pseudo-row order (see MlaWorkPlan)."""
    if ratio == 1:
        return x
    t, h = x.shape[:2]
    rest = x.shape[2:]
    if qlen == 1:
        return x.reshape((t * ratio, h // ratio) + rest)
    x = x.reshape((t // qlen, qlen, ratio, h // ratio) + rest)
    x = jnp.swapaxes(x, 1, 2)
    return x.reshape((t * ratio, h // ratio) + rest)


def unfold_rows(x: jax.Array, qlen: int, ratio: int) -> jax.Array:
    """Inverse of :func:`fold_rows`."""
    if ratio == 1:
        return x
    tf, hk = x.shape[:2]
    rest = x.shape[2:]
    t = tf // ratio
    if qlen == 1:
        return x.reshape((t, hk * ratio) + rest)
    x = x.reshape((t // qlen, ratio, qlen, hk) + rest)
    x = jnp.swapaxes(x, 1, 2)
    return x.reshape((t, hk * ratio) + rest)


# ---------------------------------------------------------------------------------------------
# A consumer: run the plan exactly


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank"))
def execute_plan_works(q, kv_cache, metadata, plan: MlaWorkPlan, *, scale: float,
                       kv_lora_rank: int = 512, q_scale=None, kv_scale=None):
    """Stage 1 of AITER's persistent decode, exact in float32: run every work of ``plan``.

    Args:
      q: ``[T, Hp, D]`` query at the padded head count ``plan.num_heads``, rows ``b * qlen + t``.
      kv_cache: ``[num_pages, page_size, D]``.
      metadata: :class:`jax_mla.DecodeMetadata` the plan was built from (its
        ``paged_kv_indptr``/``paged_kv_indices`` are what the works index).
      plan: :class:`MlaWorkPlan`.
    Returns, in the *folded* row order (``T * fold_ratio`` rows of ``kernel_heads`` heads):
      ``final [T*F, Hk, L]`` / ``final_lse [T*F, Hk]`` written by unsplit works (0 / ``-inf``
      elsewhere) and ``partial [scratch_rows, Hk, L]`` / ``partial_lse [scratch_rows, Hk]``
      (normalised partial outputs and natural-log LSEs at ``partial_qo_loc`` rows; 0 / ``-inf``
      where no work wrote). Memory grows with ``max_work * max_seq_len``: a reference for
      tests, not a kernel.
    """
    md = metadata
    qlen, ratio, ts, hk = plan.qlen, plan.fold_ratio, plan.tile_size, plan.kernel_heads
    lr = kv_lora_rank
    d = q.shape[-1]
    qf = fold_rows(dequantize(q, q_scale), qlen, ratio)  # [T*F, Hk, D]
    rows_f = qf.shape[0]
    kv_flat = dequantize(kv_cache.reshape(-1, d), kv_scale)
    lmax = md.max_seq_len
    kv_indptr = md.paged_kv_indptr
    info = plan.work_info_set

    def one_work(wi):
        pb, ploc, qs, qe, ks, ke = (wi[0], wi[1], wi[2], wi[3], wi[4], wi[5])
        req = jnp.clip(pb // ratio, 0, md.num_seqs - 1)
        length = kv_indptr[req + 1] - kv_indptr[req]
        rows = qs + jnp.arange(ts, dtype=jnp.int32)
        row_ok = (rows < qe) & (pb >= 0)
        t = rows - qlen * pb  # row within its request
        idx = ks + jnp.arange(lmax, dtype=jnp.int32)
        kv_ok = idx < ke
        slots = md.paged_kv_indices[jnp.clip(idx, 0, md.flat_capacity - 1)]
        kv = kv_flat[jnp.clip(slots, 0, kv_flat.shape[0] - 1)]
        kv = jnp.where(kv_ok[:, None], kv, 0.0)  # never multiply an unused (NaN) slot
        pos = idx - kv_indptr[req]
        see = kv_ok[None, :] & row_ok[:, None] & (pos[None, :] < length - qlen + t[:, None] + 1)
        qrow = qf[jnp.clip(rows, 0, rows_f - 1)]  # [ts, Hk, D]
        s = jnp.einsum("rhd,kd->rhk", qrow, kv, precision=_HI) * scale
        s = jnp.where(see[:, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1)
        m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
        p = jnp.exp(s - m_safe[..., None])
        z = jnp.sum(p, axis=-1)
        empty = z == 0
        out = jnp.einsum("rhk,kl->rhl", p, kv[:, :lr], precision=_HI)
        out = jnp.where(empty[..., None], 0.0, out / jnp.where(empty, 1.0, z)[..., None])
        lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, z)))
        final_rows = jnp.where(row_ok & (ploc < 0), rows, rows_f)  # rows_f: dropped
        part_rows = jnp.where(row_ok & (ploc >= 0), ploc + (rows - qs), plan.scratch_rows)
        return out, lse, final_rows, part_rows

    out_w, lse_w, frows, prows = jax.vmap(one_work)(info)
    out_w = out_w.reshape(-1, hk, lr)
    lse_w = lse_w.reshape(-1, hk)
    final = jnp.zeros((rows_f, hk, lr), jnp.float32).at[frows.reshape(-1)].set(out_w, mode="drop")
    final_lse = jnp.full((rows_f, hk), -jnp.inf, jnp.float32).at[frows.reshape(-1)].set(
        lse_w, mode="drop")
    part = jnp.zeros((plan.scratch_rows, hk, lr), jnp.float32).at[prows.reshape(-1)].set(
        out_w, mode="drop")
    part_lse = jnp.full((plan.scratch_rows, hk), -jnp.inf, jnp.float32).at[
        prows.reshape(-1)].set(lse_w, mode="drop")
    return final, final_lse, part, part_lse


@jax.jit
def reduce_plan_reference(final, final_lse, partial, partial_lse, plan: MlaWorkPlan):
    """Stage 2 (``mla_reduce_v1`` semantics) in jnp: tile ``i`` with >= 2 partials merges rows
    ``reduce_partial_map[k] + r`` into final rows ``reduce_final_map[i][0] + r``; other tiles
    keep what their single work wrote. Folded row order in and out (see
    :func:`execute_plan_works`)."""
    rows_f, hk, lr = final.shape
    ts = plan.tile_size
    max_frag = min(plan.num_cu, plan.partial_capacity) + 1
    tiles = jnp.arange(plan.tile_cnt, dtype=jnp.int32)
    lo, hi = plan.reduce_indptr[:-1], plan.reduce_indptr[1:]
    kk = lo[:, None] + jnp.arange(max_frag, dtype=jnp.int32)[None, :]  # [tiles, frag]
    frag_ok = kk < hi[:, None]
    starts = plan.reduce_partial_map[jnp.clip(kk, 0, plan.partial_capacity - 1)]
    r = jnp.arange(ts, dtype=jnp.int32)
    src = jnp.clip(starts[..., None] + r, 0, plan.scratch_rows - 1)  # [tiles, frag, ts]
    lses = jnp.where(frag_ok[..., None, None], partial_lse[src], -jnp.inf)
    w, lse_m = merge_lse_weights(lses, axis=1)
    out_m = weighted_sum(w, partial[src], axis=1)  # [tiles, ts, Hk, L]
    fm = plan.reduce_final_map
    dst = fm[:, 0:1] + r[None, :]
    do = ((hi - lo) >= 2)[:, None] & (dst < fm[:, 1:2]) & (tiles < plan.tile_cnt)[:, None]
    dst = jnp.where(do, dst, rows_f)
    final = final.at[dst.reshape(-1)].set(out_m.reshape(-1, hk, lr), mode="drop")
    final_lse = final_lse.at[dst.reshape(-1)].set(lse_m.reshape(-1, hk), mode="drop")
    return final, final_lse


def execute_plan_reference(q, kv_cache, metadata, plan: MlaWorkPlan, *, scale: float,
                           kv_lora_rank: int = 512, q_scale=None, kv_scale=None):
    """Run ``plan`` exactly (:func:`execute_plan_works` then :func:`reduce_plan_reference`).

    Returns ``out [T, Hp, L] float32`` and ``lse [T, Hp] float32`` (natural log), unfolded.
    Rows no work covers, or that see no KV, give 0 and ``-inf``.
    """
    parts = execute_plan_works(q, kv_cache, metadata, plan, scale=scale,
                               kv_lora_rank=kv_lora_rank, q_scale=q_scale, kv_scale=kv_scale)
    final, final_lse = reduce_plan_reference(*parts, plan)
    return (unfold_rows(final, plan.qlen, plan.fold_ratio),
            unfold_rows(final_lse, plan.qlen, plan.fold_ratio))
