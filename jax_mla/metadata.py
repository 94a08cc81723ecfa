"""``build_decode_metadata``: one step's paged-KV views and its plan, decided once.

The metadata of a decode/verify step is built once and shared by every layer: the views of the
block table (``jax_mla.paged``), and, when the problem is known (``num_heads`` and the dtypes,
or example arrays), the backend's whole route -- kernel family, tile, split plan, reduce --
as a static :class:`~jax_mla.backends.DecodePlan` plus the plan's arrays. ``mla_attention``
only reads them; a plan that does not match the call is an error that names both.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_mla.backends import get_backend, require_available, resolve_backend
from jax_mla.cache import is_fp8
from jax_mla.paged import DecodeMetadata, check_inputs, checked_views, paged_views
from jax_mla.problem import DecodeProblem, as_target, dtype_name

__all__ = ["DecodeMetadata", "build_decode_metadata", "plan_decode"]


def plan_decode(problem: DecodeProblem, backend: str = "auto", *, tuning=None, options=None):
    """``(backend object, plan)`` for ``problem``: the backend resolved on the problem's target,
    its rules checked (before availability, so an unservable problem says why first), then its
    plan."""
    target = problem.target
    impl = resolve_backend("auto", target) if backend == "auto" else get_backend(backend)
    impl.check(problem)
    require_available(impl, target)
    return impl, impl.plan(problem, tuning=tuning, **(options or {}))


def build_decode_metadata(
    block_table,
    seq_lens,
    *,
    page_size: int | None = None,
    qlen: int = 1,
    flat_capacity: int | None = None,
    num_heads: int | None = None,
    q_dtype=None,
    kv_dtype=None,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    q=None,
    kv_cache=None,
    return_lse: bool = False,
    backend: str = "auto",
    target=None,
    tuning=None,
    options: dict | None = None,
) -> DecodeMetadata:
    """Build :class:`DecodeMetadata` for a decode (``qlen=1``) or verify (``qlen>1``) step.

    Args:
      block_table: ``[B, max_pages]`` int32; entries past a request's used pages are never read.
      seq_lens: ``[B]`` int32 KV length per request, including its ``qlen`` new tokens (which
        must already be written into the cache). Lengths below ``qlen`` leave early rows empty.
      page_size: rows per cache page (static; default: ``kv_cache.shape[1]``).
      qlen: query tokens per request (static; uniform across the batch).
      flat_capacity: static length of ``paged_kv_indices`` (default ``B * max_pages *
        page_size``, always enough); a smaller value bounds memory when the batch's total length
        is known to fit.
      num_heads: query heads of the step. Given (or ``q``), the backend plans the step now: its
        route and tuning (static, in ``metadata.plan``) and the plan's arrays
        (``metadata.schedule``), shared by every layer. Without it the metadata has no plan and
        ``mla_attention`` plans at trace time from the call's arrays.
      q_dtype, kv_dtype: the query and cache dtypes the step will run with (default: bf16, and
        the cache like the query).
      kv_lora_rank, rope_dim: ``L`` and ``R`` (default DeepSeek's 512 and 64).
      q, kv_cache: example arrays (or ``jax.ShapeDtypeStruct``) to read ``num_heads``, the
        dtypes, ``L + R`` and ``page_size`` from.
      return_lse: the calls will ask for the LSE (backends that only make one on request plan
        for it).
      backend: ``"auto"`` (the best available on the target) or a registered name.
      target: platform name or :class:`jax_mla.problem.Target` (default: this process's device).
      tuning: the backend's tuning object (e.g. ``TritonTuning``); default: the environment's
        knobs (``jax_mla.env``), read now.
      options: backend-specific planning options (e.g. AITER's ``arch``, ``num_cu``).

    Jittable (every argument but the arrays is static). Lengths outside ``[0, max_pages *
    page_size]`` raise here when they are concrete; under tracing they are clamped.
    """
    if q is not None:
        num_heads = q.shape[1] if num_heads is None else num_heads
        q_dtype = q.dtype if q_dtype is None else q_dtype
        rope_dim = q.shape[-1] - kv_lora_rank
    if kv_cache is not None:
        kv_dtype = kv_cache.dtype if kv_dtype is None else kv_dtype
        page_size = kv_cache.shape[1] if page_size is None else page_size
    if page_size is None:
        raise ValueError("page_size is required (or pass kv_cache= to read it from)")
    if num_heads is None:
        return paged_views(block_table, seq_lens, page_size=page_size, qlen=qlen,
                           flat_capacity=flat_capacity)
    block_table, seq_lens = jnp.asarray(block_table), jnp.asarray(seq_lens)
    check_inputs(block_table, seq_lens, page_size, qlen, flat_capacity)
    q_dtype = jnp.dtype(jnp.bfloat16 if q_dtype is None else q_dtype)
    kv_dtype = q_dtype if kv_dtype is None else jnp.dtype(kv_dtype)
    problem = DecodeProblem(
        num_seqs=block_table.shape[0], qlen=int(qlen), num_heads=int(num_heads),
        page_size=int(page_size), max_pages=block_table.shape[1],
        kv_lora_rank=int(kv_lora_rank), rope_dim=int(rope_dim), q_dtype=dtype_name(q_dtype),
        kv_dtype=dtype_name(kv_dtype), target=as_target(target), has_kv_scale=is_fp8(kv_dtype),
        return_lse=bool(return_lse))
    impl, plan = plan_decode(problem, backend, tuning=tuning, options=options)
    md = checked_views(block_table, seq_lens, page_size=page_size, qlen=qlen,
                       flat_capacity=flat_capacity, views=impl.views)
    if md.num_seqs == 0 or md.max_pages == 0:  # nothing to schedule: no kernel will run
        return md.replace(plan=plan)
    return with_schedule(md, impl, plan, seq_lens=seq_lens)


def with_schedule(md: DecodeMetadata, impl, plan, *, seq_lens=None) -> DecodeMetadata:
    """``md`` with ``plan`` and the backend's schedule for it. Where the schedule's kernel also
    made the clamped lengths and their offsets (``seq_lens``, ``kv_indptr``: the same values as
    the metadata's), the metadata takes those and the schedule drops its copies: XLA's clamp and
    cumulative sum then feed nothing and are left out of the program, whether the metadata is
    built inside a step or jitted alone. ``seq_lens``: the lengths as the caller gave them."""
    schedule = impl.schedule(plan, md, seq_lens=seq_lens)
    made = {field: getattr(schedule, name, None)
            for field, name in (("seq_lens", "seq_lens"), ("paged_kv_indptr", "kv_indptr"))}
    if any(v is not None for v in made.values()):
        md = md.replace(**{k: v for k, v in made.items() if v is not None})
        schedule = dataclasses.replace(schedule, seq_lens=None, kv_indptr=None)
    return md.replace(plan=plan, schedule=schedule)
