"""The backend contract: one base class whose defaults are the exact XLA reference.

A backend is a kernel family. It says where it runs (:meth:`Backend.unavailable_reason`), what it
serves (:meth:`Backend.check`), decides a route once per step (:meth:`Backend.plan`, static data;
:meth:`Backend.schedule`, the plan's arrays) and runs it (:meth:`Backend.decode`,
:meth:`Backend.prefill`). Whatever a subclass does not override is the reference, so a new
backend can start by accelerating one path. The entry points (``mla_attention``, ``mla_prefill``,
``build_decode_metadata``) name no backend: they ask the registry (``jax_mla.backends``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_mla import reference
from jax_mla.cache import dequantize, is_fp8
from jax_mla.problem import DecodeProblem, Target

# Fields of a problem a plan must match exactly (the rest are derived from the metadata itself
# or only matter to some backends, which compare them in their own plans).
_MATCHED = ("num_heads", "qlen", "page_size", "kv_lora_rank", "rope_dim", "q_dtype", "kv_dtype")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A backend's decision for one decode/verify problem (static, hashable).

    Attributes:
      backend: the registered name of the backend that made it.
      problem: the problem it was made for.
      padded_heads: heads the kernels run with; the entry pads ``q`` to it and unpads the
        results (``problem.num_heads``: no padding).
    """

    backend: str
    problem: DecodeProblem
    padded_heads: int

    def mismatches(self, problem: DecodeProblem) -> list[str]:
        """``["field: planned X, call Y", ...]`` where ``problem`` differs from the plan's."""
        out = [f"{f}: planned {getattr(self.problem, f)}, call {getattr(problem, f)}"
               for f in _MATCHED if getattr(self.problem, f) != getattr(problem, f)]
        planned, call = self.problem.target, problem.target
        if planned.platform != call.platform or (
                planned.arch and call.arch and planned.arch != call.arch):
            out.append(f"target: planned {planned}, call {call}")
        return out


class Backend:
    """A kernel family. The defaults are the exact XLA reference, on every platform."""

    name: str = "xla"
    #: platforms the backend can ever run on (None: all)
    platforms: tuple[str, ...] | None = None
    #: the optional metadata views its kernels read (``jax_mla.paged.VIEWS``)
    views: tuple[str, ...] = ()

    # -- where it runs ---------------------------------------------------------------------

    def unavailable_reason(self, target: Target) -> str | None:
        """Why the backend cannot run on ``target`` in this process (None: it can)."""
        if self.platforms is not None and target.platform not in self.platforms:
            return (f"backend={self.name!r} runs on {', '.join(self.platforms)}, not "
                    f"{target.platform!r}")
        return None

    def supported_on(self, target: Target) -> bool:
        return self.unavailable_reason(target) is None

    # -- decode ----------------------------------------------------------------------------

    def check(self, problem: DecodeProblem) -> None:
        """Raise ``ValueError`` / ``NotImplementedError`` for a problem it cannot serve."""

    def plan(self, problem: DecodeProblem, *, tuning=None, **options) -> DecodePlan:
        """The route for ``problem`` (static). ``tuning``/``options``: backend-specific."""
        if tuning is not None or options:
            raise TypeError(f"backend={self.name!r} takes no tuning or planning options, got "
                            f"{sorted(options) + (['tuning'] if tuning is not None else [])}")
        return DecodePlan(self.name, problem, problem.num_heads)

    def schedule(self, plan: DecodePlan, metadata, *, seq_lens=None):
        """The plan's arrays for one step (a pytree, jnp-built, jittable); None if it needs none.
        ``seq_lens``: the step's lengths as the caller gave them, before the metadata's clamp
        (None: not at hand), for a backend that computes the metadata's lengths itself: a
        schedule (a dataclass) with ``seq_lens`` / ``kv_indptr`` arrays hands them to the
        metadata (``metadata.with_schedule``), which must then be the metadata's values."""
        return None

    def decode(self, q, kv_cache, metadata, *, plan: DecodePlan, scale: float, q_scale,
               kv_scale, return_lse: bool):
        """``q [T, Hp, D]`` (padded to ``plan.padded_heads``) -> ``(out [T, Hp, L], lse [T, Hp]
        float32)``. ``out`` is float32 or q's dtype; rows that see nothing: 0 and ``-inf``."""
        p = plan.problem
        return reference.paged_mla_reference(q, kv_cache, metadata, scale=scale,
                                             kv_lora_rank=p.kv_lora_rank, q_scale=q_scale,
                                             kv_scale=kv_scale)

    # -- prefill ---------------------------------------------------------------------------

    def check_prefill(self, q, k, v, *, config) -> None:
        """Raise for prefill inputs it cannot serve; ``config`` is the backend's own prefill
        configuration type (this one takes none)."""
        if config is not None:
            raise TypeError(f"backend={self.name!r} takes no prefill config, got {config!r}")

    def prefill(self, q, k, v, cu_q, cu_k, *, scale: float, causal: bool, target: Target,
                max_seqlen: int | None, max_seqlen_k: int | None, config=None,
                return_lse: bool = True, q_scale=None, k_scale=None, v_scale=None):
        """Varlen MHA-form attention.

        ``q [T, H, Dqk]``, ``k [Tk, H, Dqk]``, ``v [Tk, H, Dv]``; ``cu_q`` / ``cu_k`` ``[B + 1]``
        int32 canonical offsets (``cu_k`` None: keys packed like the queries). Returns ``(out
        [T, H, Dv] in q's dtype, lse [T, H] float32)``; rows past ``cu_q[-1]`` and rows that
        see no key give 0 and ``-inf``. ``lse`` may be None when ``return_lse`` is False.

        fp8 q, k, v (one fp8 dtype) come with ``q_scale``, ``k_scale``, ``v_scale`` (float32
        scalars; the entry passes them only then) and give a bf16 ``out``; a backend without an
        fp8 kernel attends :func:`dequantize_qkv` of them, as this reference does.
        """
        odt = out_dtype(q.dtype)
        q, k, v = dequantize_qkv(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        cu_k = cu_q if cu_k is None else cu_k
        out, lse = reference.prefill_reference(q, k, v, cu_q, cu_k, scale=scale, causal=causal,
                                               max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k)
        return out.astype(odt), lse


def out_dtype(q_dtype):
    """The attention output dtype for a query dtype: bf16 for fp8 queries, else q's."""
    return jnp.dtype(jnp.bfloat16) if is_fp8(q_dtype) else jnp.dtype(q_dtype)


def dequantize_qkv(q, k, v, *, q_scale=None, k_scale=None, v_scale=None, dtype=jnp.float32):
    """fp8 prefill inputs as ``dtype`` values ``fp8 * scale`` (computed in float32: exact for
    float32); float inputs unchanged."""
    if not is_fp8(q.dtype):
        return q, k, v
    return tuple(dequantize(x, s).astype(dtype)
                 for x, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
