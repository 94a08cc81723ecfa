"""A small decoder-only MLA model: embedding, ``n`` blocks of (RMSNorm, MLA, RMSNorm, SwiGLU),
a final norm and an LM head. Random weights; the serving demo runs it.

One step (:func:`model_step`) serves any mix of decode / verify rows and prefill chunks with
static capacities, so it compiles once per ``qlen``: the step's decode metadata is built and
planned once inside it (:func:`jax_mla.build_decode_metadata`) and shared by every layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_mla.cache import calibrate_fp8_scale
from jax_mla.context import up_project
from jax_mla.metadata import build_decode_metadata
from jax_mla.model.config import MLAConfig
from jax_mla.model.layer import (
    AttentionBatch,
    init_params,
    mla_layer,
    output_projection,
    project_qkv,
    rms_norm,
)
from jax_mla.prefill import mla_prefill


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    num_layers: int
    mla: MLAConfig
    mlp_hidden: int

    @property
    def hidden_size(self) -> int:
        return self.mla.hidden_size


def init_model(cfg: ModelConfig, key, dtype=jnp.bfloat16) -> dict:
    """Random weights (scaled so activations stay O(1) through the residual stream)."""
    h, f = cfg.hidden_size, cfg.mlp_hidden
    k = iter(jax.random.split(key, 4 * cfg.num_layers + 2))

    def normal(shape, fan_in):
        return (jax.random.normal(next(k), shape, jnp.float32) / fan_in ** 0.5).astype(dtype)

    layers = []
    for _ in range(cfg.num_layers):
        layers.append({
            "attn_norm": jnp.ones((h,), dtype), "mlp_norm": jnp.ones((h,), dtype),
            "attn": init_params(cfg.mla, next(k), dtype, std=h ** -0.5),
            "gate_up": normal((h, 2 * f), h), "down": normal((f, h), f),
        })
    return {"embed": normal((cfg.vocab_size, h), 1.0), "layers": layers,
            "norm": jnp.ones((h,), dtype), "lm_head": normal((h, cfg.vocab_size), h)}


def _mlp(p, x):
    g, u = jnp.split(x @ p["gate_up"], 2, axis=-1)
    return (jax.nn.silu(g) * u) @ p["down"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's token arrays, static capacities (``T = B_d * qlen + T_p`` rows).

    tokens, positions, slot_mapping: ``[T]`` int32 (padding rows: slot ``-1``).
    decode_block_table ``[B_d, max_pages]``, decode_seq_lens ``[B_d]`` (new tokens included;
    padding requests 0). prefill_block_table ``[B_p, max_pages]``, prefill_context_lens ``[B_p]``,
    prefill_cu_seqlens ``[B_p + 1]`` (offsets from row ``B_d * qlen``).
    """

    tokens: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    decode_block_table: jax.Array
    decode_seq_lens: jax.Array
    prefill_block_table: jax.Array
    prefill_context_lens: jax.Array
    prefill_cu_seqlens: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "qlen", "workspace_tokens", "backend"),
                   donate_argnums=(2,))
def model_step(params, cfg: ModelConfig, caches, step: StepInputs, *, qlen: int,
               workspace_tokens: int, backend: str = "auto", k_scales=None):
    """``logits [T, vocab]`` float32 and the updated per-layer caches (donated).

    ``k_scales``: ``[num_layers]`` float32 per-layer scales of fp8 caches
    (:func:`calibrate_kv_scales`), None otherwise.
    """
    x = params["embed"][step.tokens]
    page_size = caches[0].shape[1]
    m = cfg.mla
    md = None
    if step.decode_seq_lens.shape[0]:
        md = build_decode_metadata(
            step.decode_block_table, step.decode_seq_lens, page_size=page_size, qlen=qlen,
            num_heads=m.num_heads, q_dtype=x.dtype, kv_dtype=caches[0].dtype,
            kv_lora_rank=m.kv_lora_rank, rope_dim=m.qk_rope_head_dim, backend=backend)
    has_prefill = step.prefill_cu_seqlens.shape[0] > 1
    batch = AttentionBatch(
        slot_mapping=step.slot_mapping, decode=md,
        prefill_block_table=step.prefill_block_table if has_prefill else None,
        prefill_context_lens=step.prefill_context_lens if has_prefill else None,
        prefill_cu_seqlens=step.prefill_cu_seqlens if has_prefill else None)
    new_caches = []
    for i, (p, cache) in enumerate(zip(params["layers"], caches)):
        k_scale = None if k_scales is None else k_scales[i]
        a, cache = mla_layer(p["attn"], m, rms_norm(x, p["attn_norm"], m.rms_norm_eps),
                             step.positions, cache, batch, k_scale=k_scale,
                             workspace_tokens=workspace_tokens if has_prefill else None,
                             decode_backend=backend)
        x = x + a
        x = x + _mlp(p, rms_norm(x, p["mlp_norm"], m.rms_norm_eps))
        new_caches.append(cache)
    x = rms_norm(x, params["norm"], m.rms_norm_eps)
    logits = jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32)
    return logits, new_caches


@functools.partial(jax.jit, static_argnames=("cfg", "fp8_dtype", "margin"))
def calibrate_kv_scales(params, cfg: ModelConfig, tokens, *, fp8_dtype, margin: float = 1.0):
    """Per-layer fp8 cache scales ``[num_layers]`` float32 from sample prompts.

    ``tokens [B, S]`` int32 are run as ``B`` full prompts (positions ``0 .. S-1``, dense causal
    attention, no cache); each layer's scale maps the amax of its ``[kv_c | k_pe]`` onto the fp8
    format's largest value (:func:`jax_mla.cache.calibrate_fp8_scale`).
    """
    m = cfg.mla
    b, s = tokens.shape
    x = params["embed"][tokens.reshape(-1)]
    positions = jnp.tile(jnp.arange(s, dtype=jnp.int32), b)
    cu = jnp.arange(b + 1, dtype=jnp.int32) * s
    scales = []
    for p in params["layers"]:
        h = rms_norm(x, p["attn_norm"], m.rms_norm_eps)
        q, kv_c, k_pe = project_qkv(p["attn"], m, h, positions)
        scales.append(calibrate_fp8_scale([kv_c, k_pe], fp8_dtype, margin=margin))
        k, v = up_project(kv_c, k_pe, p["attn"]["kv_b_proj"]["w"], m.qk_nope_head_dim, x.dtype)
        o = mla_prefill(q, k, v, cu, scale=m.softmax_scale, causal=True, backend="xla")
        x = x + output_projection(p["attn"], o)
        x = x + _mlp(p, rms_norm(x, p["mlp_norm"], m.rms_norm_eps))
    return jnp.stack(scales)
