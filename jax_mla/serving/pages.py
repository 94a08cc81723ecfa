"""Host-side paged KV cache manager: which pages each request owns, as static-shape arrays.

A serving loop keeps one :class:`PagedCacheManager` next to its cache. Requests are added with
their first tokens, grown by decode / verify tokens, truncated when speculative tokens are
rejected, and freed when they finish; pages come from a free list (released pages are reused,
last released first). Every step the manager hands out the arrays the device step takes, each
with a shape fixed by static capacities, so a jitted step never recompiles as requests come and
go:

- :meth:`PagedCacheManager.block_tables` ``[rows, max_pages_per_seq]`` int32 (DCP: ``[N, rows,
  max_pages_per_seq]``, the rank-local tables :func:`jax_mla.build_dcp_metadata` and
  :func:`jax_mla.dcp_write_kv_cache` take) and :meth:`~PagedCacheManager.seq_lens` ``[rows]``,
  for :func:`jax_mla.build_decode_metadata`;
- :meth:`~PagedCacheManager.slot_mapping` ``[capacity]`` int32 flat slots for
  :func:`jax_mla.write_kv_cache` (DCP: ``[N, capacity]``, each rank's own slots), ``-1`` padded;
- :meth:`~PagedCacheManager.token_positions` ``(positions, request_ids)`` ``[capacity]`` each,
  for RoPE and for :func:`jax_mla.dcp_write_kv_cache`.

Decode context parallel (``world_size = N > 1``): each of the ``N`` ranks of the DCP mesh axis
has a pool of its own ``num_pages`` pages (the sharded cache is ``[N * num_pages, page_size,
D]``, rank ``r`` holding pages ``[r * num_pages, (r + 1) * num_pages)``; block tables hold
rank-local page ids). A request of global length ``S`` holds ``ceil(local_r / page_size)``
pages on rank ``r``, ``local_r = dcp_local_seq_lens(S, N, r, I)``, and each rank's pool runs out
on its own. The layout is the one of ``jax_mla/dcp/layout.py``: entry ``j`` of a rank's table
covers the "virtual block" of global positions ``[j * page_size * N, (j + 1) * page_size * N)``,
of which every rank stores exactly ``page_size`` tokens (``page_size % interleave == 0``), so a
request's token layout is the layout inside one virtual block, read once from
:func:`jax_mla.dcp_local_seq_lens`, repeated block after block (``tests/test_pages.py`` checks
the slots against :func:`jax_mla.dcp_slot_mapping` and the page counts against
:func:`jax_mla.dcp_local_seq_lens`).

Pure NumPy on the host: jax is called once per ``(page_size, world_size, interleave)`` (DCP only,
on the CPU where it has one) to read that in-block layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

import numpy as np

from jax_mla.dcp.layout import check_layout, dcp_local_seq_lens

__all__ = ["CacheFull", "PagedCacheManager"]


class CacheFull(RuntimeError):
    """A pool lacks the pages an ``add`` / ``append`` needs; nothing was allocated.

    Attributes:
      needed: ``[world_size]`` int pages the operation needed on each rank.
      free: ``[world_size]`` int pages each rank had free.
      seq_id: the request the operation was for.
    """

    def __init__(self, message: str, *, needed, free, seq_id=None):
        super().__init__(message)
        self.needed = np.asarray(needed)
        self.free = np.asarray(free)
        self.seq_id = seq_id


@functools.lru_cache(maxsize=64)
def _block_layout(page_size: int, world_size: int, interleave: int):
    """The layout inside one virtual block of ``span = page_size * world_size`` global positions.

    Returns ``(local [span + 1, N], owner [span], row [span])``: ``local[v, r]`` tokens of the
    block's first ``v`` on rank ``r`` (:func:`dcp_local_seq_lens`), and for position ``v`` of the
    block its owning rank and its row in that rank's page (its local index in the block).
    """
    span = page_size * world_size
    v = np.arange(span + 1)
    if world_size == 1:
        local = v[:, None]  # one rank holds everything, in order
    else:
        local = np.asarray(_on_host(dcp_local_seq_lens, v, world_size, None, interleave))
    local = local.astype(np.int64)
    step = np.diff(local, axis=0)  # [span, N]: 1 on the owner of each position
    if not ((step >= 0).all() and (step.sum(1) == 1).all() and (local[-1] == page_size).all()):
        raise AssertionError(  # the layout module changed its rules: the manager must follow
            f"dcp_local_seq_lens(page_size={page_size}, world_size={world_size}, interleave="
            f"{interleave}) is not a layout in which a virtual block of page_size * world_size "
            f"positions puts page_size tokens on every rank")
    owner = step.argmax(1)
    row = local[np.arange(span), owner]
    for a in (local, owner, row):
        a.setflags(write=False)
    return local, owner, row


def _on_host(fn, *args):
    """``fn(*args)`` with jax's default device set to the CPU where there is one (no accelerator
    work for host-side bookkeeping)."""
    import jax

    try:
        # This process's own CPU device: under jax.distributed, jax.devices("cpu")[0] belongs
        # to process 0 and other processes cannot compute on it.
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return fn(*args)
    with jax.default_device(cpu):
        return fn(*args)


def _int(name: str, value, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


@dataclasses.dataclass
class _Seq:
    row: int  # its row of the manager's tables [N, max_seqs, max_pages_per_seq]
    length: int
    npages: np.ndarray  # [N] int64 pages held on each rank (entries past them are 0)


class PagedCacheManager:
    """Allocates cache pages to requests and builds a step's static-shape arrays (host side).

    Args:
      num_pages: pages in each rank's pool (``world_size == 1``: the one cache's
        ``kv_cache.shape[0]``).
      page_size: rows per page (``kv_cache.shape[1]``); a multiple of ``interleave``.
      max_seqs: most live requests (the batch rows the step is compiled for).
      max_pages_per_seq: the block table's static width per rank (with DCP: local pages per rank
        per request; size it for a global capacity with :func:`jax_mla.dcp_max_local_pages`).
        A request holds at most :attr:`max_seq_len` ``= max_pages_per_seq * page_size *
        world_size`` tokens.
      world_size: ``N`` DCP ranks, each with its own pool of ``num_pages`` (1: no DCP).
      interleave: ``I``, DCP tokens per rank turn (as in :func:`jax_mla.dcp_local_seq_lens`).
      reserved_pages: the pages ``[0, reserved_pages)`` of every pool are never handed out (e.g.
        a scratch or null page the engine keeps for itself).

    Sequence ids are any hashable values. Errors: ``KeyError`` for an unknown id; ``ValueError``
    / ``TypeError`` for a bad argument (a duplicate id, ``max_seqs`` live already, more tokens
    than :attr:`max_seq_len`, positions not allocated, ...); :class:`CacheFull` when a pool lacks
    pages. ``add`` and ``append`` are all-or-nothing: on any error nothing changes.
    """

    def __init__(self, *, num_pages: int, page_size: int, max_seqs: int,
                 max_pages_per_seq: int, world_size: int = 1, interleave: int = 1,
                 reserved_pages: int = 0):
        self.num_pages = _int("num_pages", num_pages, low=1)
        self.page_size = _int("page_size", page_size, low=1)
        self.max_seqs = _int("max_seqs", max_seqs, low=1)
        self.max_pages_per_seq = _int("max_pages_per_seq", max_pages_per_seq, low=1)
        self.world_size = _int("world_size", world_size, low=1)
        self.interleave = _int("interleave", interleave, low=1)
        self.reserved_pages = _int("reserved_pages", reserved_pages)
        check_layout(self.world_size, self.interleave, self.page_size)
        if self.reserved_pages >= self.num_pages:
            raise ValueError(
                f"reserved_pages={reserved_pages} must be < num_pages={num_pages}: no page would "
                f"be left to hand out")
        self._span = self.page_size * self.world_size
        self._local, self._owner, self._row = _block_layout(
            self.page_size, self.world_size, self.interleave)
        # Free lists, popped from the end: fresh pools hand out low pages first; a released page
        # is the next one handed out on its rank.
        self._free = [list(range(self.num_pages - 1, self.reserved_pages - 1, -1))
                      for _ in range(self.world_size)]
        self._seqs: dict[Hashable, _Seq] = {}
        # Every live request's block table, one row each (rows reused like pages); unused
        # entries 0. A step's tables are a gather of rows, not a per-request copy.
        self._tables = np.zeros((self.world_size, self.max_seqs, self.max_pages_per_seq),
                                np.int32)
        self._free_rows = list(range(self.max_seqs - 1, -1, -1))

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        """Most tokens (global) one request can hold: ``max_pages_per_seq * page_size *
        world_size`` (what :func:`jax_mla.build_dcp_metadata` accepts for these tables)."""
        return self.max_pages_per_seq * self._span

    @property
    def usable_pages(self) -> int:
        """Pages each pool can hand out: ``num_pages - reserved_pages``."""
        return self.num_pages - self.reserved_pages

    @property
    def num_free_pages(self) -> int:
        """Free pages: of the one pool (``world_size == 1``), summed over the ranks' pools
        otherwise (each rank runs out on its own: see :attr:`num_free_pages_per_rank`)."""
        return sum(len(f) for f in self._free)

    @property
    def num_free_pages_per_rank(self) -> np.ndarray:
        """``[world_size]`` int64 free pages of each rank's pool."""
        return np.array([len(f) for f in self._free], np.int64)

    @property
    def num_used_pages(self) -> int:
        """Pages held by requests (summed over ranks with DCP)."""
        return self.world_size * self.usable_pages - self.num_free_pages

    @property
    def num_used_pages_per_rank(self) -> np.ndarray:
        """``[world_size]`` int64 pages held by requests on each rank."""
        return self.usable_pages - self.num_free_pages_per_rank

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list:
        """Live request ids, in the order they were added."""
        return list(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def pages_needed(self, num_tokens: int) -> np.ndarray:
        """``[world_size]`` int64 pages a request of ``num_tokens`` (global) tokens holds on each
        rank: ``ceil(local_r / page_size)``, ``local_r`` its tokens on rank ``r``."""
        num_tokens = _int("num_tokens", num_tokens)
        blocks, off = divmod(num_tokens, self._span)
        return blocks + (self._local[off] > 0).astype(np.int64)

    def seq_len(self, seq_id) -> int:
        """Tokens (global) allocated to ``seq_id``."""
        return self._get(seq_id).length

    # --- allocation ----------------------------------------------------------------------------

    def can_add(self, num_tokens: int) -> bool:
        """Whether :meth:`add` of a request of ``num_tokens`` tokens would succeed now (a seat
        under ``max_seqs`` and the pages on every rank). A request longer than
        :attr:`max_seq_len` never fits: ``ValueError``, not ``False``."""
        self._check_len(num_tokens, "num_tokens")
        return len(self._seqs) < self.max_seqs and bool(
            (self.pages_needed(num_tokens) <= self.num_free_pages_per_rank).all())

    def can_append(self, seq_id, num_tokens: int = 1) -> bool:
        """Whether :meth:`append` would succeed now (pages on every rank; ``False`` past
        :attr:`max_seq_len`)."""
        seq = self._get(seq_id)
        num_tokens = _int("num_tokens", num_tokens)
        if seq.length + num_tokens > self.max_seq_len:
            return False
        need = self.pages_needed(seq.length + num_tokens) - seq.npages
        return bool((need <= self.num_free_pages_per_rank).all())

    def add(self, seq_id, num_tokens: int) -> None:
        """Add request ``seq_id`` with room for its first ``num_tokens`` tokens (0 allowed).

        Raises ``ValueError`` for a duplicate id, ``max_seqs`` live requests, or ``num_tokens >
        max_seq_len``; :class:`CacheFull` when a pool lacks pages (nothing is allocated then).
        """
        try:
            hash(seq_id)
        except TypeError:
            raise TypeError(f"seq_id must be hashable (a dict key), got {seq_id!r}") from None
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already in the cache: ids must be unique "
                             f"among live requests (free it first)")
        self._check_len(num_tokens, "num_tokens")
        if len(self._seqs) >= self.max_seqs:
            raise ValueError(
                f"cannot add seq {seq_id!r}: max_seqs={self.max_seqs} requests are live already "
                f"(the static batch size); free one first")
        seq = _Seq(self._free_rows[-1], 0, np.zeros(self.world_size, np.int64))
        self._grow(seq_id, seq, int(num_tokens), f"add seq {seq_id!r} with {num_tokens} tokens")
        self._seqs[seq_id] = seq
        self._free_rows.pop()

    def append(self, seq_id, num_tokens: int = 1) -> None:
        """Grow ``seq_id`` by ``num_tokens`` tokens (decode / verify), all-or-nothing.

        Raises ``ValueError`` past :attr:`max_seq_len`, :class:`CacheFull` when a pool lacks
        pages (the request is unchanged then).
        """
        seq = self._get(seq_id)
        num_tokens = _int("num_tokens", num_tokens)
        new = seq.length + num_tokens
        if new > self.max_seq_len:
            raise ValueError(
                f"cannot append {num_tokens} tokens to seq {seq_id!r}: its length {seq.length} "
                f"+ {num_tokens} = {new} exceeds max_seq_len={self.max_seq_len} (max_pages_per_seq"
                f" {self.max_pages_per_seq} x page_size {self.page_size}"
                + (f" x world_size {self.world_size}" if self.world_size > 1 else "") + ")")
        self._grow(seq_id, seq, new, f"append {num_tokens} tokens to seq {seq_id!r} (length "
                                     f"{seq.length} -> {new})")

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Shrink ``seq_id`` to its first ``num_tokens`` tokens (rejected speculative tokens),
        releasing the pages no longer needed. ``num_tokens`` must lie in ``[0, seq_len]``."""
        seq = self._get(seq_id)
        num_tokens = _int("num_tokens", num_tokens)
        if num_tokens > seq.length:
            raise ValueError(
                f"cannot truncate seq {seq_id!r} to num_tokens={num_tokens}: it holds only "
                f"{seq.length} (truncate shrinks; use append to grow)")
        self._release(seq, self.pages_needed(num_tokens))
        seq.length = num_tokens

    def free(self, seq_id) -> None:
        """Remove ``seq_id`` and release all its pages."""
        seq = self._get(seq_id)
        self._release(seq, np.zeros(self.world_size, np.int64))
        del self._seqs[seq_id]
        self._free_rows.append(seq.row)

    def _grow(self, seq_id, seq: _Seq, new_len: int, what: str) -> None:
        need = self.pages_needed(new_len) - seq.npages
        free = self.num_free_pages_per_rank
        if (need > free).any():
            raise CacheFull(self._full_message(what, need, free), needed=need, free=free,
                            seq_id=seq_id)
        for r in range(self.world_size):
            for _ in range(int(need[r])):
                self._tables[r, seq.row, seq.npages[r]] = self._free[r].pop()
                seq.npages[r] += 1
        seq.length = new_len

    def _release(self, seq: _Seq, keep: np.ndarray) -> None:
        table = self._tables[:, seq.row]
        for r in range(self.world_size):
            while seq.npages[r] > keep[r]:
                seq.npages[r] -= 1
                self._free[r].append(int(table[r, seq.npages[r]]))
                table[r, seq.npages[r]] = 0

    def _full_message(self, what, need, free) -> str:
        if self.world_size == 1:
            return (f"cannot {what}: needs {int(need[0])} more pages, {int(free[0])} free (pool "
                    f"of {self.usable_pages} usable pages of {self.page_size} tokens); free or "
                    f"truncate other requests first")
        short = ", ".join(f"rank {r} needs {int(need[r])} pages but has {int(free[r])} free"
                          for r in np.flatnonzero(need > free))
        return (f"cannot {what}: {short} (pages needed per rank {need.tolist()}, free per rank "
                f"{free.tolist()}; each rank's pool has {self.usable_pages} usable pages of "
                f"{self.page_size} tokens, world_size={self.world_size}, interleave="
                f"{self.interleave}); free or truncate other requests first")

    # --- a step's arrays -----------------------------------------------------------------------

    def block_tables(self, seq_ids, *, rows: int) -> np.ndarray:
        """The block tables of ``seq_ids`` (row ``b`` is ``seq_ids[b]``), padded to ``rows``.

        Returns int32 ``[rows, max_pages_per_seq]`` (``world_size == 1``), or ``[world_size,
        rows, max_pages_per_seq]`` rank-local tables (DCP, as :func:`jax_mla.build_dcp_metadata`
        and :func:`jax_mla.dcp_write_kv_cache` take them). Padding rows and unused columns hold
        0: a valid page that is never read (the length covers none of it).
        """
        seqs = self._batch(seq_ids, rows)
        out = np.zeros((self.world_size, rows, self.max_pages_per_seq), np.int32)
        out[:, :len(seqs)] = self._tables[:, [s.row for s in seqs]]
        return out[0] if self.world_size == 1 else out

    def seq_lens(self, seq_ids, *, rows: int) -> np.ndarray:
        """int32 ``[rows]`` global lengths of ``seq_ids``, padding rows 0."""
        seqs = self._batch(seq_ids, rows)
        out = np.zeros(rows, np.int32)
        out[:len(seqs)] = [s.length for s in seqs]
        return out

    def token_positions(self, seq_ids, starts, counts, *, capacity: int):
        """``(positions, request_ids)``, int32 ``[capacity]`` each: tokens ``start .. start +
        count - 1`` of each request, packed request after request (``request_ids``: the row in
        ``seq_ids``); padding has position ``-1`` and request 0 (what
        :func:`jax_mla.dcp_write_kv_cache` skips). Arguments as in :meth:`slot_mapping`."""
        seqs, pos, req = self._tokens(seq_ids, starts, counts, capacity)
        positions = np.full(capacity, -1, np.int32)
        request_ids = np.zeros(capacity, np.int32)
        positions[:pos.size] = pos
        request_ids[:req.size] = req
        return positions, request_ids

    def slot_mapping(self, seq_ids, starts, counts, *, capacity: int) -> np.ndarray:
        """Flat cache slots of tokens ``start .. start + count - 1`` of each request.

        Args:
          seq_ids: the requests, in the order their tokens are packed.
          starts: first position of each (a sequence or one int for all), or ``None``: the last
            ``count`` tokens of each (the ones just added by ``add`` / ``append``).
          counts: tokens of each (a sequence or one int for all), >= 0.
          capacity: static length of the result, >= ``sum(counts)``.
        Returns:
          int32 ``[capacity]`` slots ``page * page_size + row`` (``world_size == 1``), or
          ``[world_size, capacity]``: row ``r`` holds rank ``r``'s own slots (rank-local pages)
          and ``-1`` where another rank owns the token; ``-1`` padding past ``sum(counts)``.
          Token ``i`` of the packing sits at index ``i`` of every row, matching
          :meth:`token_positions`.
        Positions must be allocated already (``start + count <= seq_len``): ``ValueError``.
        """
        seqs, pos, req = self._tokens(seq_ids, starts, counts, capacity)
        out = np.full((self.world_size, capacity), -1, np.int32)
        if pos.size:
            blk, off = np.divmod(pos, self._span)
            owner = self._owner[off]
            row = np.array([s.row for s in seqs])[req]
            page = self._tables[owner, row, blk].astype(np.int64)
            out[owner, np.arange(pos.size)] = page * self.page_size + self._row[off]
        return out[0] if self.world_size == 1 else out

    def _tokens(self, seq_ids, starts, counts, capacity):
        capacity = _int("capacity", capacity)
        seqs = self._batch(seq_ids, None)
        n = len(seqs)
        counts = self._per_seq("counts", counts, n)
        if starts is None:
            starts = np.array([s.length for s in seqs], np.int64) - counts
            bad = np.flatnonzero(starts < 0)
            if bad.size:
                b = int(bad[0])
                raise ValueError(
                    f"counts[{b}] = {int(counts[b])} exceeds the length {seqs[b].length} of seq "
                    f"{seq_ids[b]!r} (starts=None takes each request's last count tokens)")
        else:
            starts = self._per_seq("starts", starts, n)
        ends = starts + counts
        for b, seq in enumerate(seqs):
            if ends[b] > seq.length:
                raise ValueError(
                    f"positions {int(starts[b])}..{int(ends[b]) - 1} of seq {seq_ids[b]!r} "
                    f"(starts[{b}], counts[{b}]) are not allocated: it holds {seq.length} tokens "
                    f"(add or append them first)")
        total = int(counts.sum())
        if total > capacity:
            raise ValueError(f"sum(counts) = {total} tokens exceed capacity={capacity} (the "
                             f"static token count of the step)")
        pos = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)] or
                             [np.zeros(0, np.int64)]).astype(np.int64)
        req = np.repeat(np.arange(n), counts)
        return seqs, pos, req

    @staticmethod
    def _per_seq(name, values, n) -> np.ndarray:
        if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
            a = np.full(n, int(values), np.int64)
        else:
            a = np.asarray(values)
            if a.shape != (n,):
                raise ValueError(f"{name} must be one int or [len(seq_ids)={n}] ints, got shape "
                                 f"{a.shape}")
            if n and not np.issubdtype(a.dtype, np.integer):
                raise TypeError(f"{name} must hold ints, got dtype {a.dtype}")
            a = a.astype(np.int64)
        bad = np.flatnonzero(a < 0)
        if bad.size:
            raise ValueError(f"{name}[{int(bad[0])}] = {int(a[bad[0]])} must be >= 0")
        return a

    def _batch(self, seq_ids, rows) -> list[_Seq]:
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
            raise TypeError(f"seq_ids must be a list or tuple of request ids, got {seq_ids!r}")
        seqs = [self._get(s) for s in seq_ids]
        if len({id(s) for s in seqs}) != len(seqs):
            dup = next(s for i, s in enumerate(seq_ids) if s in list(seq_ids)[:i])
            raise ValueError(f"seq_ids lists {dup!r} twice: each request takes one row")
        if rows is not None:
            rows = _int("rows", rows)
            if rows < len(seqs):
                raise ValueError(
                    f"rows={rows} must be >= len(seq_ids)={len(seqs)} (rows is the static batch "
                    f"size of the step; seq_ids fill the first rows)")
        return seqs

    def _get(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id {seq_id!r} is not in the cache (add it first; live: "
                           f"{len(self._seqs)} requests)") from None
        except TypeError:
            raise TypeError(f"seq_id must be hashable (a dict key), got {seq_id!r}") from None

    def _check_len(self, num_tokens, name) -> None:
        _int(name, num_tokens)
        if num_tokens > self.max_seq_len:
            raise ValueError(
                f"{name}={num_tokens} exceeds max_seq_len={self.max_seq_len}, the most tokens one "
                f"request can hold (max_pages_per_seq {self.max_pages_per_seq} x page_size "
                f"{self.page_size}" + (f" x world_size {self.world_size}"
                                       if self.world_size > 1 else "") + ")")

    # --- reporting -----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters for a progress line: ``seqs``, ``max_seqs``, ``tokens`` (sum of lengths),
        ``pages_used`` / ``pages_free`` (summed over ranks), ``pages_used_per_rank`` /
        ``pages_free_per_rank`` (lists), ``usable_pages`` (per pool), ``utilization`` (used /
        usable on the fullest rank), ``slot_fill`` (tokens / slots of the pages held)."""
        used = self.num_used_pages_per_rank
        tokens = sum(s.length for s in self._seqs.values())
        slots = int(used.sum()) * self.page_size
        return {
            "seqs": len(self._seqs),
            "max_seqs": self.max_seqs,
            "tokens": tokens,
            "pages_used": int(used.sum()),
            "pages_free": self.num_free_pages,
            "pages_used_per_rank": used.tolist(),
            "pages_free_per_rank": self.num_free_pages_per_rank.tolist(),
            "usable_pages": self.usable_pages,
            "utilization": float(used.max()) / self.usable_pages,
            "slot_fill": tokens / slots if slots else 1.0,
            "page_size": self.page_size,
            "world_size": self.world_size,
        }

    def __repr__(self) -> str:
        s = self.stats()
        if self.world_size == 1:
            pages = f"pages used {s['pages_used']}/{self.usable_pages}"
        else:
            pages = (f"pages used per rank {s['pages_used_per_rank']}/{self.usable_pages}, "
                     f"world_size={self.world_size}, interleave={self.interleave}")
        return (f"PagedCacheManager(seqs {s['seqs']}/{self.max_seqs}, tokens {s['tokens']}, "
                f"{pages}, page_size={self.page_size}, max_seq_len={self.max_seq_len})")

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the bookkeeping is consistent: every usable page of
        every pool is free or held by exactly one request, no reserved page is handed out, and
        every request holds exactly :meth:`pages_needed` of its length on each rank (tests and
        debugging; ``O(pages)``)."""
        rows = [s.row for s in self._seqs.values()]
        assert len(set(rows)) == len(rows) and not set(rows) & set(self._free_rows), (
            "a table row is used twice")
        assert len(rows) + len(self._free_rows) == self.max_seqs, "table rows leaked"
        for r in range(self.world_size):
            held = [int(p) for s in self._seqs.values()
                    for p in self._tables[r, s.row, :s.npages[r]]]
            every = held + self._free[r]
            assert len(every) == len(set(every)), f"rank {r}: a page is owned twice"
            assert sorted(every) == list(range(self.reserved_pages, self.num_pages)), (
                f"rank {r}: free + held pages are not the usable pool")
        for sid, s in self._seqs.items():
            assert (s.npages == self.pages_needed(s.length)).all(), (
                f"seq {sid!r}: holds {s.npages.tolist()} pages for length {s.length}")
            cols = np.arange(self.max_pages_per_seq)
            assert not self._tables[:, s.row][cols[None, :] >= s.npages[:, None]].any(), (
                f"seq {sid!r}: unused block-table entries are not 0")
        free_rows = self._tables[:, self._free_rows]
        assert not free_rows.any(), "a free table row is not 0"
