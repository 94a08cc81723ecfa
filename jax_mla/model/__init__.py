"""MLA inside a model: the DeepSeek attention layer, its rotary embedding, checkpoint loading.

  MLAConfig, YarnScaling   the layer's geometry and rotary settings (``MLAConfig.from_hf``)
  init_params              random parameters (a dict pytree)
  mla_layer                one step: project, rope, cache write, attention, output projection
  AttentionBatch           where the step's tokens go and what they attend
  Parallel                 the cache sharded along pages over a mesh axis (DCP), heads over another
  project_qkv              the layer's q / latent / rope projections alone
  params_from_hf           a transformers state dict onto the parameters
"""

from jax_mla.model.config import MLAConfig, YarnScaling
from jax_mla.model.hf import attention_prefix, params_from_hf
from jax_mla.model.layer import (
    AttentionBatch,
    Parallel,
    check_params,
    init_params,
    mla_layer,
    output_projection,
    parallel_from_cache,
    project_qkv,
)

__all__ = [
    "AttentionBatch",
    "MLAConfig",
    "Parallel",
    "YarnScaling",
    "attention_prefix",
    "check_params",
    "init_params",
    "mla_layer",
    "output_projection",
    "parallel_from_cache",
    "params_from_hf",
    "project_qkv",
]
