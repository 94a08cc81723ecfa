"""The MLA layer's geometry and rotary settings (DeepSeek-V2/V3, Kimi K2).

Field names follow Hugging Face's ``DeepseekV3Config`` so a checkpoint's config maps one to one
(:meth:`MLAConfig.from_hf`). DeepSeek-V3: hidden 7168, 128 heads, ``q_lora_rank`` 1536,
``kv_lora_rank`` 512, nope 128 + rope 64 per query/key head, v 128, YaRN factor 40 on an original
4096 positions with ``mscale = mscale_all_dim = 1``.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN rotary scaling (``rope_scaling`` / ``rope_parameters`` with type yarn).

    ``factor``: context extension; ``original_max_position_embeddings``: the pretraining length;
    ``beta_fast``/``beta_slow``: the rotation counts bounding the ramp between extrapolated and
    interpolated frequencies; ``mscale``/``mscale_all_dim``: YaRN's magnitude factors. The cos/sin
    tables are multiplied by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the
    softmax scale by ``mscale(factor, mscale_all_dim) ** 2`` (it scales every dimension of
    ``q·k``, not only the rotary ones). ``attention_factor`` overrides the table factor.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"YarnScaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings < 1:
            raise ValueError("YarnScaling.original_max_position_embeddings must be >= 1, got "
                             f"{self.original_max_position_embeddings}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude factor ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """One MLA attention layer. Hashable: usable as a static jit argument.

    ``q_lora_rank=None`` is the direct query projection (DeepSeek-V2-Lite); otherwise the query
    goes down to ``q_lora_rank``, through an RMSNorm, and up to the heads.
    """

    hidden_size: int
    num_heads: int
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {v!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MLAConfig.q_lora_rank must be None or >= 1, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                "MLAConfig.qk_rope_head_dim must be even (rotary pairs), got "
                f"{self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(qk_head_dim)`` times YaRN's ``mscale_all_dim`` factor squared."""
        s = self.qk_head_dim ** -0.5
        y = self.rope_scaling
        if y is not None and y.mscale_all_dim:
            m = yarn_mscale(y.factor, y.mscale_all_dim)
            s = s * m * m
        return s

    @classmethod
    def from_hf(cls, config) -> MLAConfig:
        """From a ``transformers`` DeepSeek-V2/V3 config object (or its ``to_dict()``)."""
        c = config if isinstance(config, dict) else config.to_dict()
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if kind == "yarn":
            factor = rope.get("factor")
            orig = rope["original_max_position_embeddings"]
            if factor is None:
                factor = c["max_position_embeddings"] / orig
            scaling = YarnScaling(
                factor=float(factor), original_max_position_embeddings=int(orig),
                beta_fast=float(rope.get("beta_fast") or 32),
                beta_slow=float(rope.get("beta_slow") or 1),
                mscale=float(rope.get("mscale") or 1.0),
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                attention_factor=rope.get("attention_factor"),
                truncate=bool(rope.get("truncate", True)))
            # transformers' attention factor uses mscale only when both are set.
            if not (rope.get("mscale") and rope.get("mscale_all_dim")) and \
                    rope.get("attention_factor") is None:
                scaling = dataclasses.replace(scaling, attention_factor=yarn_mscale(factor))
        elif kind != "default":
            raise NotImplementedError(f"rotary scaling {kind!r} is not supported (default or yarn)")
        return cls(
            hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"],
            kv_lora_rank=c["kv_lora_rank"], q_lora_rank=c.get("q_lora_rank"),
            qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"], rope_theta=float(theta), rope_scaling=scaling,
            rope_interleave=bool(c.get("rope_interleave", True)),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(c.get("attention_bias", False)))
