"""Decode context parallel: the latent KV cache sharded along the sequence over a mesh axis.

- ``layout.py``: the integer rules (which rank owns which token, local lengths, slots).
- ``combine.py``: merging the ranks' partials by LSE (``ag_rs`` and ``a2a``).
- ``attention.py``: the mesh layout, the sharded cache (made in place, written in place),
  :func:`build_dcp_metadata` and :func:`dcp_mla_attention`.
- ``prefill.py``: :func:`dcp_prefill_with_context`, prefill rows over a sharded cached context.
"""

from jax_mla.dcp.attention import (
    DcpMetadata,
    DcpShardings,
    build_dcp_metadata,
    dcp_allocate_cache,
    dcp_mla_attention,
    dcp_shard_cache,
    dcp_shardings,
    dcp_write_kv_cache,
)
from jax_mla.dcp.combine import COMBINES, merge_partials, scale_own_partial, to_head_owner_major
from jax_mla.dcp.layout import (
    dcp_local_metadata,
    dcp_local_seq_lens,
    dcp_max_local_pages,
    dcp_slot_mapping,
    dcp_verify_row_lens,
)
from jax_mla.dcp.prefill import dcp_prefill_with_context

__all__ = [
    "COMBINES",
    "DcpMetadata",
    "DcpShardings",
    "build_dcp_metadata",
    "dcp_allocate_cache",
    "dcp_local_metadata",
    "dcp_local_seq_lens",
    "dcp_max_local_pages",
    "dcp_mla_attention",
    "dcp_prefill_with_context",
    "dcp_shard_cache",
    "dcp_shardings",
    "dcp_slot_mapping",
    "dcp_verify_row_lens",
    "dcp_write_kv_cache",
    "merge_partials",
    "scale_own_partial",
    "to_head_owner_major",
]
