"""A small decoder-only MLA model: embedding, ``n`` blocks of (RMSNorm, MLA, RMSNorm, SwiGLU),
a final norm and an LM head. Random weights; the serving engine and its benchmark run it.

The layers' parameters are stacked (every leaf has a leading ``num_layers`` axis) and run as one
``lax.scan``, so a step compiles once whatever the depth. The layers' caches are one array
``[num_layers, num_pages, page_size, L + R]``, donated to the step; inside it they are viewed as
``[num_layers * num_pages, ...]`` pages, layer ``i`` owning pages ``i * num_pages ..``, so every
layer's kernels read and write the one buffer in place through page indices moved by
``i * num_pages`` (:meth:`jax_mla.DecodeMetadata.with_page_offset`) -- nothing is sliced out or
copied per layer. The step's decode metadata is built and planned once and shared by every
layer.

- :func:`model_step`: the logits of every row (checks, calibration, tests).
- :func:`serve_step`: what a serving engine runs: logits only at the rows it samples, sampling on
  the device (:mod:`jax_mla.model.sampling`), the next step's decode inputs read from the
  previous step's ids on the device (``feed``), so the host needs nothing back but the ids.
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
    _precision,
    init_params,
    mla_layer,
    output_projection,
    project_qkv,
    rms_norm,
)
from jax_mla.model.sampling import SamplingParams, sample
from jax_mla.prefill import mla_prefill

#: How :func:`model_step` runs its layers: ``"scan"`` (one ``lax.scan``; compile time
#: independent of depth) or ``"python"`` (a Python loop over static slices: the unrolled model,
#: kept as the scan's reference in tests).
LAYER_LOOPS = ("scan", "python")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    num_layers: int
    mla: MLAConfig
    mlp_hidden: int

    @property
    def hidden_size(self) -> int:
        return self.mla.hidden_size

    @property
    def cache_width(self) -> int:
        return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim


def init_model(cfg: ModelConfig, key, dtype=jnp.bfloat16) -> dict:
    """Random weights (scaled so activations stay O(1) through the residual stream).

    ``params["layers"]`` is one pytree whose leaves are stacked over the layers
    (``[num_layers, ...]``); :func:`layer_params` takes one layer's slice.
    """
    h, f = cfg.hidden_size, cfg.mlp_hidden
    k_embed, k_head, k_layers = jax.random.split(key, 3)

    def normal(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / fan_in ** 0.5).astype(dtype)

    def one_layer(k):
        ka, kg, kd = jax.random.split(k, 3)
        return {"attn_norm": jnp.ones((h,), dtype), "mlp_norm": jnp.ones((h,), dtype),
                "attn": init_params(cfg.mla, ka, dtype, std=h ** -0.5),
                "gate_up": normal(kg, (h, 2 * f), h), "down": normal(kd, (f, h), f)}

    layers = jax.jit(jax.vmap(one_layer))(jax.random.split(k_layers, cfg.num_layers))
    return {"embed": normal(k_embed, (cfg.vocab_size, h), 1.0), "layers": layers,
            "norm": jnp.ones((h,), dtype), "lm_head": normal(k_head, (h, cfg.vocab_size), h)}


def layer_params(params: dict, i: int) -> dict:
    """Layer ``i``'s parameters (a static slice of the stacked layers)."""
    return jax.tree.map(lambda a: a[i], params["layers"])


def stack_layers(layers: list[dict]) -> dict:
    """Per-layer parameter dicts (e.g. loaded one by one) -> the stacked pytree of
    ``params["layers"]``."""
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def init_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> jax.Array:
    """The model's paged latent caches ``[num_layers, num_pages, page_size, L + R]``, every
    slot NaN (a read of an unwritten slot shows)."""
    return jnp.full((cfg.num_layers, num_pages, page_size, cfg.cache_width), jnp.nan, dtype)


def _dot(x, w):
    # float32 models multiply in float32 on every platform (GPUs' default is TF32), as the
    # attention layer's projections do.
    return jnp.dot(x, w, precision=_precision(x.dtype))


def _mlp(p, x):
    g, u = jnp.split(_dot(x, p["gate_up"]), 2, axis=-1)
    return _dot(jax.nn.silu(g) * u, p["down"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's token arrays, static capacities (``T = B_d * qlen + T_p`` rows).

    tokens, positions, slot_mapping: ``[T]`` int32 (padding rows: slot ``-1``); slots are of one
    layer's cache (``page * page_size + row``).
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

    @property
    def num_decode_seqs(self) -> int:
        return self.decode_seq_lens.shape[0]

    @property
    def num_prefill_seqs(self) -> int:
        return self.prefill_cu_seqlens.shape[0] - 1


def sample_rows(step: StepInputs, qlen: int):
    """The rows a step samples: every decode/verify row (``B_d * qlen``), then the last row of
    each prefill request's chunk (``B_p``; a padding request's row is row 0, ignored)."""
    t_d = step.num_decode_seqs * qlen
    cu = step.prefill_cu_seqlens
    last = jnp.where(cu[1:] > cu[:-1], t_d + cu[1:] - 1, 0)
    return jnp.concatenate([jnp.arange(t_d, dtype=jnp.int32), last.astype(jnp.int32)])


def _check_caches(cfg: ModelConfig, caches):
    if not hasattr(caches, "ndim") or caches.ndim != 4 or caches.shape[0] != cfg.num_layers \
            or caches.shape[3] != cfg.cache_width:
        raise ValueError(f"caches must be one array [num_layers={cfg.num_layers}, num_pages, "
                         f"page_size, L + R={cfg.cache_width}] (init_caches), got "
                         f"{getattr(caches, 'shape', type(caches).__name__)}")


def forward(params, cfg: ModelConfig, caches, step: StepInputs, *, qlen: int,
            workspace_tokens: int, backend: str = "auto", k_scales=None, tokens=None,
            layer_loop: str = "scan"):
    """The hidden states after the final norm ``[T, hidden]`` and the updated caches.

    Traceable (call it under ``jax.jit``; :func:`model_step` and :func:`serve_step` do).
    ``tokens``: the step's token ids ``[T]`` when not ``step.tokens``.
    """
    _check_caches(cfg, caches)
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    nl, num_pages, page_size, width = caches.shape
    m = cfg.mla
    x = params["embed"][step.tokens if tokens is None else tokens]
    md = None
    if step.num_decode_seqs:
        # Page indices are clamped into the layer's own pages: an index past them must not
        # reach another layer's pages of the shared buffer.
        md = build_decode_metadata(
            jnp.clip(step.decode_block_table, 0, num_pages - 1), step.decode_seq_lens,
            page_size=page_size, qlen=qlen, num_heads=m.num_heads, q_dtype=x.dtype,
            kv_dtype=caches.dtype, kv_lora_rank=m.kv_lora_rank, rope_dim=m.qk_rope_head_dim,
            backend=backend)
    has_prefill = step.num_prefill_seqs > 0
    slots = jnp.where((step.slot_mapping >= 0) & (step.slot_mapping < num_pages * page_size),
                      step.slot_mapping, -1)
    prefill_table = jnp.clip(step.prefill_block_table, 0, num_pages - 1)

    def layer(carry, p, i, k_scale):
        x, flat = carry
        page0 = i * num_pages
        batch = AttentionBatch(
            slot_mapping=jnp.where(slots >= 0, slots + page0 * page_size, -1),
            decode=None if md is None else md.with_page_offset(page0),
            prefill_block_table=prefill_table + page0 if has_prefill else None,
            prefill_context_lens=step.prefill_context_lens if has_prefill else None,
            prefill_cu_seqlens=step.prefill_cu_seqlens if has_prefill else None)
        a, flat = mla_layer(p["attn"], m, rms_norm(x, p["attn_norm"], m.rms_norm_eps),
                            step.positions, flat, batch, k_scale=k_scale,
                            workspace_tokens=workspace_tokens if has_prefill else None,
                            decode_backend=backend, parallel=None)
        x = x + a
        x = x + _mlp(p, rms_norm(x, p["mlp_norm"], m.rms_norm_eps))
        return x, flat

    flat = caches.reshape(nl * num_pages, page_size, width)
    if layer_loop == "scan":
        xs = (params["layers"], jnp.arange(nl, dtype=jnp.int32),
              None if k_scales is None else jnp.asarray(k_scales, jnp.float32))
        (x, flat), _ = jax.lax.scan(lambda c, xs: (layer(c, *xs), None), (x, flat), xs)
    else:
        for i in range(nl):
            k_scale = None if k_scales is None else k_scales[i]
            x, flat = layer((x, flat), layer_params(params, i), i, k_scale)
    x = rms_norm(x, params["norm"], m.rms_norm_eps)
    return x, flat.reshape(caches.shape)


def _logits(params, x):
    return jnp.dot(x, params["lm_head"], precision=_precision(x.dtype),
                   preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "qlen", "workspace_tokens", "backend",
                                             "layer_loop"), donate_argnums=(2,))
def model_step(params, cfg: ModelConfig, caches, step: StepInputs, *, qlen: int,
               workspace_tokens: int, backend: str = "auto", k_scales=None,
               layer_loop: str = "scan"):
    """``logits [T, vocab]`` float32 of every row and the updated caches (donated).

    ``caches``: ``[num_layers, num_pages, page_size, L + R]`` (:func:`init_caches`).
    ``k_scales``: ``[num_layers]`` float32 per-layer scales of an fp8 cache
    (:func:`calibrate_kv_scales`), None otherwise.
    """
    x, caches = forward(params, cfg, caches, step, qlen=qlen, workspace_tokens=workspace_tokens,
                        backend=backend, k_scales=k_scales, layer_loop=layer_loop)
    return _logits(params, x), caches


@functools.partial(jax.jit, static_argnames=("cfg", "qlen", "workspace_tokens", "backend",
                                             "num_samples", "sample_cap", "layer_loop"),
                   donate_argnums=(2,))
def serve_step(params, cfg: ModelConfig, caches, step: StepInputs, feed, prev_ids, key,
               sampling: SamplingParams | None = None, *, qlen: int, workspace_tokens: int,
               num_samples: int, backend: str = "auto", k_scales=None, sample_cap: int = 256,
               layer_loop: str = "scan"):
    """One serving step: ``(ids [num_samples] int32, logits [S, vocab] float32, caches)``.

    Args:
      step: the step's inputs; ``step.tokens`` holds the tokens the host knows.
      feed: ``[T]`` int32: row ``t``'s token is ``prev_ids[feed[t]]`` where ``feed[t] >= 0``
        (a token sampled by the previous step, still on the device), else ``step.tokens[t]``.
      prev_ids: ``[num_samples]`` int32, the previous step's ids (any values on a first step).
      key: a PRNG key for this step (unused when ``sampling`` is None: greedy).
      sampling: per sampled row settings (``S`` rows: :func:`sample_rows`), or None: greedy.
      num_samples: static length of ``ids``, the same for every step shape so that ``ids``
        can feed the next step whatever its shape: the ``S = B_d * qlen + B_p`` sampled rows
        land at ``[0, B_d * qlen)`` and ``[num_samples - B_p, num_samples)``.
    Returns the ids, the logits of the sampled rows (for checks; they stay on the device unless
    read), and the donated caches.
    """
    t_d = step.num_decode_seqs * qlen
    b_p = step.num_prefill_seqs
    if t_d + b_p > num_samples:
        raise ValueError(f"num_samples={num_samples} is smaller than the step's {t_d} decode "
                         f"rows + {b_p} prefill requests")
    tokens = jnp.where(feed >= 0, prev_ids[jnp.clip(feed, 0, num_samples - 1)], step.tokens)
    x, caches = forward(params, cfg, caches, step, qlen=qlen, workspace_tokens=workspace_tokens,
                        backend=backend, k_scales=k_scales, tokens=tokens, layer_loop=layer_loop)
    logits = _logits(params, x[sample_rows(step, qlen)])
    ids = sample(logits, key, sampling, cap=sample_cap)
    at = jnp.concatenate([jnp.arange(t_d, dtype=jnp.int32),
                          num_samples - b_p + jnp.arange(b_p, dtype=jnp.int32)])
    out = jnp.zeros((num_samples,), jnp.int32).at[at].set(ids)
    return out, logits, caches


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

    def layer(x, p):
        h = rms_norm(x, p["attn_norm"], m.rms_norm_eps)
        q, kv_c, k_pe = project_qkv(p["attn"], m, h, positions)
        scale = calibrate_fp8_scale([kv_c, k_pe], fp8_dtype, margin=margin)
        k, v = up_project(kv_c, k_pe, p["attn"]["kv_b_proj"]["w"], m.qk_nope_head_dim, x.dtype)
        o = mla_prefill(q, k, v, cu, scale=m.softmax_scale, causal=True, backend="xla")
        x = x + output_projection(p["attn"], o)
        x = x + _mlp(p, rms_norm(x, p["mlp_norm"], m.rms_norm_eps))
        return x, scale

    _, scales = jax.lax.scan(layer, x, params["layers"])
    return scales
