"""The MLA layer against Hugging Face transformers' ``DeepseekV3Attention`` (an oracle we did not
write): same random weights, loaded through :func:`jax_mla.model.params_from_hf`; a prefill, a
chunked prefill over cached context mixed with decode rows, step-by-step decode and a verify step
through the paged cache must give transformers' outputs.

transformers runs each request alone with its own ``DynamicCache`` (eager attention, float32);
our layer runs the requests batched through a NaN-poisoned paged cache with permuted pages.
Tolerances: float32 ``rel err < 1e-5`` (measured 2e-7 .. 4e-7, XLA and Triton-interpreter decode
alike); bfloat16 layer vs float32 transformers ``< 2e-2`` (measured 6e-3 .. 8e-3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla.model import AttentionBatch, MLAConfig, YarnScaling, mla_layer, params_from_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

HIDDEN, HEADS, L, R, P, V = 64, 4, 32, 8, 16, 16
PAGE = 4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_config(q_lora_rank, interleave, rope):
    c = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R,
        v_head_dim=V, max_position_embeddings=64, rope_parameters=dict(rope),
        rope_interleave=interleave, num_hidden_layers=1, vocab_size=32, intermediate_size=32,
        moe_intermediate_size=16, n_routed_experts=4, first_k_dense_replace=1)
    c._attn_implementation = "eager"
    return c


class HFRequest:
    """One request run through transformers token chunk by token chunk."""

    def __init__(self, attn, rot, cfg):
        self.attn, self.rot = attn, rot
        self.cache = transformers.DynamicCache(config=cfg)
        self.len = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        xt = torch.from_numpy(x)[None]
        cos, sin = self.rot(xt, torch.arange(self.len, self.len + n)[None])
        # Row i sees every cached token and the new ones up to itself.
        mask = torch.zeros(n, self.len + n)
        mask[:, self.len:] = torch.full((n, n), float("-inf")).triu(1)
        with torch.no_grad():
            out, _ = self.attn(xt, (cos, sin), mask[None, None], cache=self.cache)
        self.len += n
        return out[0].numpy().astype(np.float64)


class PagedRequests:
    """The same requests on our side: a paged cache with permuted pages, NaN in unused slots."""

    def __init__(self, rng, n_req, max_tokens, dtype):
        self.max_pages = -(-max_tokens // PAGE)
        num_pages = n_req * self.max_pages + 3
        self.table = rng.permutation(num_pages)[: n_req * self.max_pages].reshape(
            n_req, self.max_pages).astype(np.int32)
        self.cache = jnp.full((num_pages, PAGE, L + R), jnp.nan, dtype)
        self.lens = np.zeros(n_req, np.int32)

    def slots(self, req, n):
        pos = self.lens[req] + np.arange(n)
        return self.table[req, pos // PAGE] * PAGE + pos % PAGE, pos


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_scenario(q_lora_rank, interleave, rope, dtype, rng, *, backend="xla"):
    """Per phase, the worst relative error of our layer against transformers."""
    torch.manual_seed(int(rng.integers(1 << 30)))
    hcfg = hf_config(q_lora_rank, interleave, rope)
    attn = hf_ds.DeepseekV3Attention(hcfg, layer_idx=0).float().eval()
    with torch.no_grad():  # norms away from 1 so a missed norm weight shows
        for name, prm in attn.named_parameters():
            if "layernorm" in name:
                prm.copy_(1 + 0.2 * torch.randn_like(prm))
    rot = hf_ds.DeepseekV3RotaryEmbedding(hcfg)
    cfg = MLAConfig.from_hf(hcfg)
    params = params_from_hf(attn.state_dict(), cfg, dtype=dtype)

    n_req = 3
    hf = [HFRequest(attn, rot, hcfg) for _ in range(n_req)]
    ours = PagedRequests(rng, n_req, 40, dtype)
    step = jax.jit(mla_layer, static_argnames=("cfg", "workspace_tokens", "decode_backend",
                                               "prefill_backend"), donate_argnums=4)
    errs = {}

    def run(decode_reqs, qlen, prefill_reqs, prefill_counts, phase):
        xs, slots, pos, want = [], [], [], []
        for r in decode_reqs:
            xs.append(rng.standard_normal((qlen, HIDDEN)).astype(np.float32))
            s, p = ours.slots(r, qlen)
            slots.append(s)
            pos.append(p)
        for r, n in zip(prefill_reqs, prefill_counts):
            xs.append(rng.standard_normal((n, HIDDEN)).astype(np.float32))
            s, p = ours.slots(r, n)
            slots.append(s)
            pos.append(p)
        for r, x in zip(list(decode_reqs) + list(prefill_reqs), xs):
            want.append(hf[r](x))
        context = ours.lens[list(prefill_reqs)].copy()
        for r in decode_reqs:
            ours.lens[r] += qlen
        for r, n in zip(prefill_reqs, prefill_counts):
            ours.lens[r] += n
        md = None
        if decode_reqs:
            rows = list(decode_reqs)
            md = jax_mla.build_decode_metadata(jnp.asarray(ours.table[rows]),
                                               jnp.asarray(ours.lens[rows]), page_size=PAGE,
                                               qlen=qlen)
        pre = {}
        if prefill_reqs:
            pre = dict(prefill_block_table=jnp.asarray(ours.table[list(prefill_reqs)]),
                       prefill_context_lens=jnp.asarray(context),
                       prefill_cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(
                           prefill_counts)]).astype(np.int32)))
        batch = AttentionBatch(slot_mapping=jnp.asarray(np.concatenate(slots), jnp.int32),
                               decode=md, **pre)
        y, ours.cache = step(params, cfg, jnp.asarray(np.concatenate(xs), dtype),
                             jnp.asarray(np.concatenate(pos), jnp.int32), ours.cache, batch,
                             workspace_tokens=8 if prefill_reqs else None,
                             decode_backend=backend, prefill_backend="xla")
        errs[phase] = max(errs.get(phase, 0.0), _rel(y.astype(jnp.float32), np.concatenate(want)))

    run([], 1, [0, 1, 2], [5, 9, 3], "prefill")
    # Decode rows for 0 and 2, then request 1's second prompt chunk over its 9 cached tokens
    # (8-token workspace: two context chunks).
    run([0, 2], 1, [1], [4], "mixed")
    for _ in range(3):
        run([0, 1, 2], 1, [], [], "decode")
    run([0, 1, 2], 3, [], [], "verify")
    return errs


FP32_TOL, BF16_TOL = 1e-5, 2e-2


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("interleave", [True, False])
def test_layer_matches_transformers_fp32(q_lora_rank, interleave, rng):
    errs = run_scenario(q_lora_rank, interleave, YARN, jnp.float32, rng)
    assert max(errs.values()) < FP32_TOL, errs


def test_layer_matches_transformers_default_rope(rng):
    errs = run_scenario(24, True, {"rope_type": "default", "rope_theta": 5000.0}, jnp.float32,
                        rng)
    assert max(errs.values()) < FP32_TOL, errs


def test_layer_bf16_close_to_transformers_fp32(rng):
    errs = run_scenario(24, True, YARN, jnp.bfloat16, rng)
    assert max(errs.values()) < BF16_TOL, errs


def test_layer_triton_interpreter_decode(rng):
    """The decode/verify rows through the Triton kernels (interpreted on CPU)."""
    errs = run_scenario(None, True, YARN, jnp.float32, rng, backend="triton")
    assert max(errs.values()) < FP32_TOL, errs


def test_yarn_scale_and_config_mapping():
    cfg = MLAConfig.from_hf(hf_config(24, True, YARN))
    assert cfg.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=16,
                                           mscale=1.0, mscale_all_dim=1.0)
    m = 0.1 * np.log(4.0) + 1
    assert cfg.softmax_scale == pytest.approx((P + R) ** -0.5 * m * m, rel=1e-12)
    attn = hf_ds.DeepseekV3Attention(hf_config(24, True, YARN), layer_idx=0)
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)


def test_loader_errors():
    hcfg = hf_config(24, True, YARN)
    cfg = MLAConfig.from_hf(hcfg)
    sd = hf_ds.DeepseekV3Attention(hcfg, layer_idx=0).state_dict()
    missing = {k: v for k, v in sd.items() if not k.startswith("kv_b_proj")}
    with pytest.raises(KeyError, match="kv_b_proj.weight' is missing"):
        params_from_hf(missing, cfg)
    with pytest.raises(KeyError, match="not used by this MLAConfig"):
        params_from_hf({**sd, "q_proj.weight": sd["q_b_proj.weight"]}, cfg)
    with pytest.raises(NotImplementedError, match="dequantise"):
        params_from_hf({**sd, "o_proj.weight_scale_inv": sd["o_proj.weight"]}, cfg)
    wrong = MLAConfig.from_hf(hf_config(None, True, YARN))
    with pytest.raises(KeyError):
        params_from_hf(sd, wrong)
    # A whole model's dict with the checkpoint's key names.
    full = {f"{jax_mla.model.attention_prefix(3)}{k}": v for k, v in sd.items()}
    full["model.layers.3.mlp.gate_proj.weight"] = sd["o_proj.weight"]
    p = params_from_hf(full, cfg, prefix=jax_mla.model.attention_prefix(3), dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(p["kv_b_proj"]["w"]).reshape(L, -1),
                                  sd["kv_b_proj.weight"].numpy().T)


# On a GPU the layer's float32 dots run at precision HIGHEST and its decode rows through the GPU
# kernels, whose float32 sums round in another order than transformers' CPU ones: stated
# tolerance 1e-4 (the CPU's is 1e-5).
GPU_FP32_TOL = 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_layer_on_the_gpu_matches_transformers_fp32_on_the_cpu(backend, rng):
    """The layer on the GPU (the default route: the Triton kernels through our FFI launcher)
    against transformers' float32 on the CPU: prefill, mixed, decode and verify."""
    from jax_mla.problem import current_platform

    if current_platform() not in ("cuda", "rocm"):
        pytest.skip("needs a GPU (jax's default device)")
    errs = run_scenario(24, True, YARN, jnp.float32, rng, backend=backend)
    assert max(errs.values()) < GPU_FP32_TOL, errs
