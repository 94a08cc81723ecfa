"""The split-KV work schedule, built in ``jax.numpy`` (static shapes, no host sync).

A *work* is one KV range of one request; the decode kernel runs one program per (work, head
block). Requests are cut into pieces of about equal size so that the pieces fill the GPU's
multiprocessors whatever the mix of lengths (FlashMLA's and AITER's aim, in a closed form that
jit can trace): with ``blocks(b) = ceil(seq_lens[b] / BLOCK_N)`` and a per-work overhead, the
batch's cost is spread over ``target_works`` programs, and request ``b`` is split into
``ceil(blocks(b) / blocks_per_split)`` balanced pieces. The total never exceeds
``target_works + B``, the static capacity.

The plan uses AITER's layout (``get_mla_metadata_v1``), so the same reduce consumes both:
``work_info_set[w] = (batch_idx, partial_qo_loc, qo_start, qo_end, kv_start, kv_end, kv_offset,
0)`` with ``kv_start/kv_end`` indexing the flat token space of ``paged_kv_indptr`` and
``kv_offset`` the request's tokens after ``kv_end``; ``partial_qo_loc = -1`` marks a work that
covers its whole request and writes the final output, otherwise its ``Q`` rows go to partial rows
``[partial_qo_loc, partial_qo_loc + Q)``. ``reduce_indptr [B+1]``, ``reduce_final_map [B, 2]``
and ``reduce_partial_map [capacity]`` say which partial rows merge into which final rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_mla.metadata import expand_indptr

OVERHEAD_BLOCKS = 1  # fixed cost of a work (query load, output write), in KV blocks


@dataclasses.dataclass(frozen=True)
class SplitSchedule:
    """A split-KV plan (AITER layout; see the module docstring).

    Attributes:
      work_info_set: ``[max_works, 8]`` int32.
      num_works: ``[1]`` int32 valid works (programs past it exit at once).
      reduce_indptr: ``[B + 1]`` int32.
      reduce_final_map: ``[B, 2]`` int32 ``(qo_start, qo_end)``.
      reduce_partial_map: ``[max_works]`` int32 partial row offsets; tail -1.
      block_n: static KV tile; every work starts on a multiple of it.
      num_head_blocks, qlen: static shape the plan was made for.
    """

    work_info_set: jax.Array
    num_works: jax.Array
    reduce_indptr: jax.Array
    reduce_final_map: jax.Array
    reduce_partial_map: jax.Array
    block_n: int = 64
    num_head_blocks: int = 1
    qlen: int = 1

    @property
    def max_works(self) -> int:
        return self.work_info_set.shape[0]


jax.tree_util.register_dataclass(
    SplitSchedule,
    data_fields=["work_info_set", "num_works", "reduce_indptr", "reduce_final_map",
                 "reduce_partial_map"],
    meta_fields=["block_n", "num_head_blocks", "qlen"],
)


@functools.partial(jax.jit, static_argnames=("qlen", "block_n", "target_works",
                                             "num_head_blocks", "max_splits"))
def plan_splits(seq_lens, kv_indptr, *, qlen, block_n, target_works, num_head_blocks=1,
                max_splits=64) -> SplitSchedule:
    """Balanced split plan for ``seq_lens [B]`` (see the module docstring)."""
    b = seq_lens.shape[0]
    seq_lens = seq_lens.astype(jnp.int32)
    blocks = -(-seq_lens // block_n)
    total = jnp.sum(blocks + OVERHEAD_BLOCKS)
    bps = jnp.maximum(1, -(-total // target_works))  # blocks per split
    splits = jnp.clip(-(-blocks // bps), 1, max_splits).astype(jnp.int32)
    zero = jnp.zeros((1,), jnp.int32)
    work_indptr = jnp.concatenate([zero, jnp.cumsum(splits)])
    max_works = target_works + b
    r, s, valid = expand_indptr(work_indptr, max_works)
    k = splits[r]
    blk_lo = (s * blocks[r]) // k
    blk_hi = ((s + 1) * blocks[r]) // k
    n = seq_lens[r]
    lo = jnp.minimum(blk_lo * block_n, n)
    hi = jnp.minimum(blk_hi * block_n, n)
    base = kv_indptr[r]
    split = splits > 1
    part_per_req = jnp.where(split, splits, 0)
    reduce_indptr = jnp.concatenate([zero, jnp.cumsum(part_per_req)]).astype(jnp.int32)
    slot = reduce_indptr[r] + s  # partial slot of split works
    ploc = jnp.where(split[r], slot * qlen, -1)
    qo = r * qlen
    info = jnp.stack([r, ploc, qo, qo + qlen, base + lo, base + hi, n - hi,
                      jnp.zeros_like(r)], axis=1)
    info = jnp.where(valid[:, None], info, 0).astype(jnp.int32)
    pr, ps_, pvalid = expand_indptr(reduce_indptr, max_works)
    partial_map = jnp.where(pvalid, (reduce_indptr[pr] + ps_) * qlen, -1).astype(jnp.int32)
    qo_b = jnp.arange(b, dtype=jnp.int32) * qlen
    return SplitSchedule(
        work_info_set=info,
        num_works=work_indptr[-1:],
        reduce_indptr=reduce_indptr,
        reduce_final_map=jnp.stack([qo_b, qo_b + qlen], axis=1),
        reduce_partial_map=partial_map,
        block_n=block_n,
        num_head_blocks=num_head_blocks,
        qlen=qlen,
    )
