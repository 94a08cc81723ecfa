"""jax_mla: DeepSeek-style Multi-head Latent Attention for JAX over a paged latent KV cache.

Public API:
  write_kv_cache         write new tokens' ``[kv_c | k_pe]`` rows into the paged cache
  calibrate_fp8_scale    the per-tensor fp8 cache scale from sample activations
  build_decode_metadata  one step's metadata and plan, built once and shared by every layer
  DecodeMetadata         the metadata pytree
  mla_attention          jitted MLA decode/verify: ``out [T, H, L]`` (+ natural-log ``lse``)
  merge_attn_states      exact LSE merge of two partial attention results
  build_dcp_metadata     one DCP step's per-rank metadata and plan
  dcp_mla_attention      decode/verify with the cache sharded along the sequence over a mesh axis
  dcp_prefill_with_context  prefill rows over a cached context sharded the DCP way
  dcp_*                  the DCP sharding rule, slot mapping, cache write and layout helpers
  dcp_allocate_cache     a DCP cache made in place: each device (process) creates only its pages
  distributed            multi-process / multi-host runs on jax.distributed (``initialize``);
                         ``python -m jax_mla.launch`` starts the processes of one on a host
  mla_prefill            varlen (causal) MHA-form prefill attention: ``out [T, H, Dv]`` (+ ``lse``)
  mla_prefill_with_context  prefill over the cached context, in workspace-bounded chunks
  mla_mixed_step         decode rows (absorbed) then prefill rows (MHA) in one step
  PrefillTritonConfig, TritonTuning  the Triton backend's prefill tile and decode tuning
  Target                 where kernels run (platform, arch, cores), for planning ahead of time
  heads                  AITER's head-count rules and exact pad/unpad maps
  available_backends     backends usable on the current platform
  PagedCacheManager      host-side page allocator: static-shape block tables, lengths and slot
                         mappings for a serving loop (DCP too); CacheFull when a pool runs out
  model                  the DeepSeek MLA layer (``jax_mla.model.mla_layer``), transformers loading
  serving                the cache manager and a continuous-batching engine (the demo's)
"""

from jax_mla import distributed, heads, model, serving
from jax_mla.attention import mla_attention
from jax_mla.backends import available_backends, register_backend, registered_backends
from jax_mla.backends.triton import PrefillTritonConfig, TritonTuning
from jax_mla.cache import calibrate_fp8_scale, write_kv_cache
from jax_mla.checks import checked
from jax_mla.context import mla_mixed_step, mla_prefill_with_context
from jax_mla.dcp import (
    DcpMetadata,
    DcpShardings,
    build_dcp_metadata,
    dcp_allocate_cache,
    dcp_local_metadata,
    dcp_local_seq_lens,
    dcp_max_local_pages,
    dcp_mla_attention,
    dcp_prefill_with_context,
    dcp_shard_cache,
    dcp_shardings,
    dcp_slot_mapping,
    dcp_verify_row_lens,
    dcp_write_kv_cache,
)
from jax_mla.merge import merge_attn_states
from jax_mla.metadata import DecodeMetadata, build_decode_metadata
from jax_mla.prefill import mla_prefill
from jax_mla.problem import Target
from jax_mla.serving import CacheFull, PagedCacheManager

__version__ = "0.1.0"

__all__ = [
    "CacheFull",
    "DcpMetadata",
    "DcpShardings",
    "DecodeMetadata",
    "PagedCacheManager",
    "PrefillTritonConfig",
    "Target",
    "TritonTuning",
    "available_backends",
    "build_dcp_metadata",
    "build_decode_metadata",
    "calibrate_fp8_scale",
    "checked",
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
    "distributed",
    "heads",
    "merge_attn_states",
    "mla_attention",
    "model",
    "mla_mixed_step",
    "mla_prefill",
    "mla_prefill_with_context",
    "register_backend",
    "registered_backends",
    "serving",
    "write_kv_cache",
]
