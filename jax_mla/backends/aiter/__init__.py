"""``backend="aiter"``: AMD ROCm through AITER's kernels.

- ``capabilities.py``: per-arch kernel tables and vLLM's routing predicates (pure data).
- ``known_bad.py``: AITER kernels known to fail, and the route taken instead (consulted when a
  plan is built; ``JAX_MLA_AITER_ALLOW_KNOWN_BAD`` keeps one).
- ``plan.py``: the route, decided once per problem (:class:`AiterPlan`).
- ``planner.py``: AITER's persistent split-KV planner (``get_mla_metadata_v1``) in jnp, and an
  exact consumer of its plans.
- ``schedule.py``: the route's arrays and :func:`build_aiter_decode_metadata`.
- ``segments.py``: the base-2 segment merge of the segmented DCP verify.
- ``bridge.py``: AITER's Python API through ``buffer_callback`` + torch (imports ``aiter``
  lazily, at trace time).
- ``triton_kernels.py``: AITER's segmented Triton decode kernel (the installed ``JITFunction``,
  checked against the pinned JIT signature) launched by jax_mla's Triton launcher; imports it at
  trace time. The bridge is its fallback.
- ``native.py``: AITER's asm MLA decode ``.co`` kernels launched by jax_mla's FFI handler
  (``ffi/aiter_asm.cc``), no torch or Python per call; the bridge is its fallback.
- ``backend.py``: :class:`AiterBackend`.

Nothing here has run on AMD hardware; see ``docs/rocm.md``.
"""

from jax_mla.backends.aiter.backend import AiterBackend, AiterPrefillConfig, force_bridge
from jax_mla.backends.aiter.capabilities import (
    ARCH_INFO,
    AiterBuild,
    AiterRoute,
    decide_route,
    detect_arch,
    fp8_dtype,
)
from jax_mla.backends.aiter.plan import AiterPlan
from jax_mla.backends.aiter.planner import (
    MlaMetadataSizes,
    MlaWorkPlan,
    execute_plan_reference,
    mla_metadata_sizes,
    plan_mla_decode,
)
from jax_mla.backends.aiter.schedule import (
    AiterDecodeSchedule,
    DcpVerifyView,
    build_aiter_decode_metadata,
    uniform_padded_mtp_qo_len,
)
from jax_mla.backends.aiter.segments import merge_mla_segments

__all__ = [
    "ARCH_INFO",
    "AiterBackend",
    "AiterBuild",
    "AiterDecodeSchedule",
    "AiterPlan",
    "AiterPrefillConfig",
    "AiterRoute",
    "DcpVerifyView",
    "MlaMetadataSizes",
    "MlaWorkPlan",
    "build_aiter_decode_metadata",
    "decide_route",
    "detect_arch",
    "execute_plan_reference",
    "fp8_dtype",
    "force_bridge",
    "merge_mla_segments",
    "mla_metadata_sizes",
    "plan_mla_decode",
    "uniform_padded_mtp_qo_len",
]
