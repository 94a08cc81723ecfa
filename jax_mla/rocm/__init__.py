"""AMD ROCm support through AITER: capability tables, routing, the persistent planner, the bridge.

- :mod:`jax_mla.rocm.capabilities` -- per-arch kernel tables and vLLM's routing predicates.
- :mod:`jax_mla.rocm.planner` -- ``get_mla_metadata_info_v1`` / ``get_mla_metadata_v1`` in jnp,
  and :func:`execute_plan_reference`, an exact consumer of the plan.
- :mod:`jax_mla.rocm.metadata` -- :func:`build_aiter_decode_metadata` (route + plan carried in
  ``DecodeMetadata.schedule``), uniform-MTP padding, the DCP-verify row view.
- :mod:`jax_mla.rocm.segments` -- the base-2 segment merge of the segmented DCP verify.
- :mod:`jax_mla.rocm.bridge` -- the only module that imports ``aiter`` (lazily).

Nothing here has run on AMD hardware; see ``docs/rocm.md``.
"""

from jax_mla.rocm.capabilities import (
    ARCH_INFO,
    AiterBuild,
    AiterRoute,
    decide_route,
    detect_arch,
    fp8_dtype,
)
from jax_mla.rocm.metadata import (
    AiterDecodeSchedule,
    DcpVerifyView,
    build_aiter_decode_metadata,
    uniform_padded_mtp_qo_len,
)
from jax_mla.rocm.planner import (
    MlaMetadataSizes,
    MlaWorkPlan,
    execute_plan_reference,
    mla_metadata_sizes,
    plan_mla_decode,
)
from jax_mla.rocm.segments import merge_mla_segments

__all__ = [
    "ARCH_INFO",
    "AiterBuild",
    "AiterDecodeSchedule",
    "AiterRoute",
    "DcpVerifyView",
    "MlaMetadataSizes",
    "MlaWorkPlan",
    "build_aiter_decode_metadata",
    "decide_route",
    "detect_arch",
    "execute_plan_reference",
    "fp8_dtype",
    "merge_mla_segments",
    "mla_metadata_sizes",
    "plan_mla_decode",
    "uniform_padded_mtp_qo_len",
]
