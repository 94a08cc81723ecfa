"""Hugging Face ``transformers`` checkpoints onto :mod:`jax_mla.model.layer`'s parameters.

A DeepSeek-V2/V3 checkpoint names one layer's attention weights
``model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj}.weight`` (``.bias`` with ``attention_bias``), linear weights
``[out, in]`` as torch stores them. torch is not imported: any array-like works (a torch tensor,
NumPy, a safetensors slice).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_mla.model.config import MLAConfig
from jax_mla.model.layer import check_params


def attention_prefix(layer: int) -> str:
    """The checkpoint key prefix of layer ``layer``'s attention: ``model.layers.{i}.self_attn.``"""
    return f"model.layers.{layer}.self_attn."


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (bf16 has no NumPy twin: go through float32)
        x = x.detach().cpu().float().numpy()
    return np.asarray(x, dtype=np.float32)


def params_from_hf(state_dict, cfg: MLAConfig, *, prefix: str = "", dtype=jnp.bfloat16) -> dict:
    """One attention layer's parameters from a transformers state dict.

    Args:
      state_dict: mapping of checkpoint keys to arrays (a model's ``state_dict()``, or a layer's).
      cfg: the layer's :class:`MLAConfig` (:meth:`MLAConfig.from_hf` of the checkpoint's config).
      prefix: the keys' prefix, e.g. :func:`attention_prefix` ``(i)`` for a whole model's dict,
        ``""`` for a ``DeepseekV3Attention``'s own.
      dtype: the parameters' dtype.

    Every key under ``prefix`` must be used and every needed key present (a clear ``KeyError``
    otherwise); block-quantised fp8 checkpoints (``weight_scale_inv``) are refused.
    """
    keys = [k for k in state_dict if k.startswith(prefix)]
    quant = [k for k in keys if k.endswith("scale_inv") or k.endswith("weight_scale")]
    if quant:
        raise NotImplementedError(
            f"block-quantised fp8 weights ({quant[0]}) are not supported: dequantise the "
            "checkpoint to bf16 first")
    used, params = set(), {}

    def take(name: str, leaf: str):
        key = f"{prefix}{name}.{leaf}"
        if key not in state_dict:
            raise KeyError(f"{key!r} is missing from the state dict (needed by this MLAConfig)")
        used.add(key)
        return _numpy(state_dict[key])

    h, p, v, lr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    linears = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    linears += ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    for name in linears:
        w = take(name, "weight").T  # [in, out]
        if name == "kv_b_proj":  # rows are head-major (p + v per head): [L, H * (P + V)]
            w = w.reshape(lr, h, p + v)
        params[name] = {"w": w}
        if cfg.attention_bias and name in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
            params[name]["b"] = take(name, "bias")
    for name in ["kv_a_layernorm"] + ([] if cfg.q_lora_rank is None else ["q_a_layernorm"]):
        params[name] = {"scale": take(name, "weight")}
    unused = sorted(set(keys) - used)
    if unused:
        raise KeyError(f"state dict keys under {prefix!r} not used by this MLAConfig: {unused}")
    check_params(params, cfg)
    return {k: {kk: jnp.asarray(vv, dtype) for kk, vv in v.items()} for k, v in params.items()}
