"""The decode metadata pytree and its paged-KV views, built with ``jax.numpy`` (jittable, static
shapes). Planning (which kernels, which split) is not here: ``jax_mla.metadata`` adds the plan.

Built once per step and carried as a pytree; kernels only read it. Two equivalent views of each
request's KV are kept, because different kernels want different ones (docs/design.md §3):

- the page-level (block-table) form: ``block_table [B, max_pages]`` plus the compact
  ``page_indptr / page_indices / last_page_len`` triple (FlashInfer's paged-KV convention);
- AITER's flattened per-token form (page size 1): ``paged_kv_indptr [B+1]`` counts tokens,
  ``paged_kv_indices [capacity]`` holds flat slot ids ``block_table[b, t // page_size] *
  page_size + t % page_size``, and ``paged_kv_last_page_len`` is all ones.

Every array has a shape fixed by ``B``, ``max_pages`` and the static capacities, so a jitted step
does not recompile as lengths change. Unused tails are filled with -1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import checks


@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    """Everything the decode/verify kernels read for one step.

    Shapes: ``B`` requests, ``Q = qlen`` query tokens each, ``T = B * Q`` rows ordered
    ``b * Q + t``. ``seq_lens[b]`` counts every token of request ``b`` including its ``Q`` new
    ones; row ``t`` of request ``b`` attends cache positions ``0 .. seq_lens[b] - Q + t``.

    Attributes:
      block_table: ``[B, max_pages]`` int32 physical page of each logical page.
      seq_lens: ``[B]`` int32 KV length of each request.
      qo_indptr: ``[B + 1]`` int32, ``arange(B + 1) * Q``.
      page_indptr: ``[B + 1]`` int32 cumsum of pages used, ``ceil(seq_lens / page_size)``.
      page_indices: ``[B * max_pages]`` int32 used pages of every request, packed; tail -1.
      last_page_len: ``[B]`` int32 valid rows of each request's last page (0 when empty).
      paged_kv_indptr: ``[B + 1]`` int32 cumsum of ``seq_lens`` (AITER's token indptr).
      paged_kv_indices: ``[flat_capacity]`` int32 flat slot of every KV token, packed; tail -1.
      paged_kv_last_page_len: ``[B]`` int32 ones (page size 1 in the flat view).

      The page-level view (``page_indptr``, ``page_indices``, ``last_page_len``) and the flat
      view (``paged_kv_indices``, ``paged_kv_last_page_len``) are built only where asked
      (:data:`VIEWS`): metadata planned for a backend carries the views that backend reads, and
      None for the others (the flat view alone is ``B * max_pages * page_size`` entries).
      schedule: the plan's arrays (a backend-specific pytree, e.g. the split schedule), or
        None when the plan needs none or the metadata has no plan.
      qlen: static ``Q``.
      page_size: static page size of the cache the metadata addresses.
      plan: static :class:`jax_mla.backends.DecodePlan` (hashable: part of the jit cache key):
        the backend, route and tuning decided when the metadata was built, or None for metadata
        built without a problem (``mla_attention`` then plans at trace time).
    """

    block_table: jax.Array
    seq_lens: jax.Array
    qo_indptr: jax.Array
    page_indptr: jax.Array | None
    page_indices: jax.Array | None
    last_page_len: jax.Array | None
    paged_kv_indptr: jax.Array
    paged_kv_indices: jax.Array | None
    paged_kv_last_page_len: jax.Array | None
    schedule: Any = None
    qlen: int = 1
    page_size: int = 1
    plan: Any = None

    @property
    def num_seqs(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_rows(self) -> int:
        return self.num_seqs * self.qlen

    @property
    def max_pages(self) -> int:
        return self.block_table.shape[1]

    @property
    def max_seq_len(self) -> int:
        """Static capacity: the most KV tokens one request can hold."""
        return self.max_pages * self.page_size

    @property
    def flat_capacity(self) -> int:
        if self.paged_kv_indices is None:
            raise ValueError("this metadata has no flat per-token view (its plan reads none)")
        return self.paged_kv_indices.shape[0]

    def replace(self, **kw) -> DecodeMetadata:
        return dataclasses.replace(self, **kw)

    def with_page_offset(self, offset) -> DecodeMetadata:
        """The same metadata addressing pages ``offset`` further on (an int or int32 scalar,
        traced or not): every page index of the block table and the page-level view moves by
        ``offset`` and every flat slot by ``offset * page_size``; -1 tails stay -1.

        A model whose layers share one cache array ``[num_layers * num_pages, ...]`` (layer
        ``i`` owning pages ``i * num_pages ..``) builds the step's metadata once and reads layer
        ``i`` through ``md.with_page_offset(i * num_pages)``: no per-layer metadata, and no copy
        of the layer's cache for the kernels (they index the whole array)."""
        def shift(a, by):
            return None if a is None else jnp.where(a >= 0, a + by, a).astype(a.dtype)

        offset = jnp.asarray(offset, jnp.int32)
        return self.replace(block_table=shift(self.block_table, offset),
                            page_indices=shift(self.page_indices, offset),
                            paged_kv_indices=shift(self.paged_kv_indices,
                                                   offset * self.page_size))


_META = ("qlen", "page_size", "plan")
_DATA = [f.name for f in dataclasses.fields(DecodeMetadata) if f.name not in _META]
jax.tree_util.register_dataclass(DecodeMetadata, data_fields=_DATA, meta_fields=list(_META))


def uniform_qo_indptr(num_seqs: int, qlen: int) -> jax.Array:
    """``[0, Q, 2Q, ..., B*Q]`` int32."""
    return jnp.arange(num_seqs + 1, dtype=jnp.int32) * qlen


def expand_indptr(indptr: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each packed position ``i < capacity``: its segment ``r``, offset in it, and validity."""
    i = jnp.arange(capacity, dtype=jnp.int32)
    r = jnp.searchsorted(indptr[1:], i, side="right").astype(jnp.int32)
    r = jnp.minimum(r, indptr.shape[0] - 2)
    off = i - indptr[r]
    return r, off, i < indptr[-1]


def flat_slot_ids(block_table, positions, page_size: int, rows=None):
    """Flat slot ``block_table[row, pos // page_size] * page_size + pos % page_size``."""
    page = jnp.clip(positions // page_size, 0, block_table.shape[1] - 1)
    if rows is None:
        phys = jnp.take_along_axis(block_table, page, 1)
    else:
        phys = block_table[rows, page]
    return phys * page_size + positions % page_size


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_inputs(block_table, seq_lens, page_size, qlen, flat_capacity):
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(qlen, (int, np.integer)) or qlen < 1:
        raise ValueError(f"qlen must be a positive int, got {qlen!r}")
    if block_table.ndim != 2:
        raise ValueError(
            f"block_table must be [B, max_pages], got shape {tuple(block_table.shape)}"
        )
    if seq_lens.ndim != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(
            f"seq_lens must be [B={block_table.shape[0]}], got shape {tuple(seq_lens.shape)}"
        )
    for name, a in (("block_table", block_table), ("seq_lens", seq_lens)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array (int32), got {a.dtype}")
    if flat_capacity is not None and flat_capacity < 0:
        raise ValueError(f"flat_capacity must be >= 0, got {flat_capacity}")
    cap = block_table.shape[1] * page_size
    checks.seq_lens_in_capacity(seq_lens, cap)
    if flat_capacity is not None and seq_lens.size and (
            checks.is_concrete(seq_lens) or checks.checking()):
        total = jnp.sum(seq_lens)
        checks.expect(total <= flat_capacity,
                      f"sum(seq_lens) = {{total}} exceeds flat_capacity={flat_capacity}",
                      total=total)


#: The optional views: ``"pages"`` (FlashInfer's page-level view), ``"flat"`` (AITER's
#: per-token view).
VIEWS = ("pages", "flat")


def paged_views(block_table, seq_lens, *, page_size: int, qlen: int = 1,
                flat_capacity: int | None = None, views=VIEWS) -> DecodeMetadata:
    """:class:`DecodeMetadata` without a plan: the checked, canonical paged-KV views.

    Arguments as :func:`jax_mla.build_decode_metadata`; ``views``: which optional views to build
    (:data:`VIEWS`; the block table, lengths, ``qo_indptr`` and ``paged_kv_indptr`` always are).
    Jittable (every argument but the arrays is static). Lengths outside ``[0, max_pages *
    page_size]`` raise here when they are concrete; under tracing they are clamped.
    """
    block_table = jnp.asarray(block_table)
    seq_lens = jnp.asarray(seq_lens)
    check_inputs(block_table, seq_lens, page_size, qlen, flat_capacity)
    return checked_views(block_table, seq_lens, page_size=page_size, qlen=qlen,
                         flat_capacity=flat_capacity, views=views)


def checked_views(block_table, seq_lens, *, page_size: int, qlen: int,
                  flat_capacity: int | None, views) -> DecodeMetadata:
    """:func:`paged_views` of arrays that :func:`check_inputs` has already passed."""
    views = tuple(v for v in VIEWS if v in tuple(views))
    if flat_capacity is None:
        flat_capacity = block_table.shape[0] * block_table.shape[1] * page_size
    return _build(block_table, seq_lens, page_size=int(page_size), qlen=int(qlen),
                  flat_capacity=int(flat_capacity), views=views)


@functools.partial(jax.jit, static_argnames=("page_size", "qlen", "flat_capacity", "views"))
def _build(block_table, seq_lens, *, page_size, qlen, flat_capacity, views):
    b, max_pages = block_table.shape
    block_table = block_table.astype(jnp.int32)
    seq_lens = jnp.clip(seq_lens.astype(jnp.int32), 0, max_pages * page_size)
    zero = jnp.zeros((1,), jnp.int32)
    kv_indptr = jnp.concatenate([zero, jnp.cumsum(seq_lens, dtype=jnp.int32)])
    md = DecodeMetadata(
        block_table=block_table, seq_lens=seq_lens, qo_indptr=uniform_qo_indptr(b, qlen),
        page_indptr=None, page_indices=None, last_page_len=None, paged_kv_indptr=kv_indptr,
        paged_kv_indices=None, paged_kv_last_page_len=None, qlen=qlen, page_size=page_size)
    if "pages" in views:
        num_pages = -(-seq_lens // page_size)
        page_indptr = jnp.concatenate([zero, jnp.cumsum(num_pages, dtype=jnp.int32)])
        r, off, valid = expand_indptr(page_indptr, b * max_pages)
        page_indices = jnp.where(valid, block_table[r, jnp.clip(off, 0, max_pages - 1)], -1)
        last_page_len = jnp.where(seq_lens > 0, seq_lens - (num_pages - 1) * page_size, 0)
        md = md.replace(page_indptr=page_indptr, page_indices=page_indices,
                        last_page_len=last_page_len.astype(jnp.int32))
    if "flat" in views:
        r, off, valid = expand_indptr(kv_indptr, flat_capacity)
        kv_indices = jnp.where(valid, flat_slot_ids(block_table, off, page_size, rows=r), -1)
        md = md.replace(paged_kv_indices=kv_indices.astype(jnp.int32),
                        paged_kv_last_page_len=jnp.ones((b,), jnp.int32))
    return md
