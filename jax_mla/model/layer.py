"""A DeepSeek-V2/V3 MLA attention layer in plain JAX over the paged latent cache.

Parameters are a dict pytree (weights ``[in, out]``, JAX's convention; :mod:`jax_mla.model.hf`
maps a transformers state dict onto it)::

    q_proj.w            [hidden, H * (P + R)]          (q_lora_rank None)
    q_a_proj.w (.b)     [hidden, q_lora_rank]          (else)
    q_a_layernorm.scale [q_lora_rank]
    q_b_proj.w          [q_lora_rank, H * (P + R)]
    kv_a_proj_with_mqa.w (.b)  [hidden, L + R]
    kv_a_layernorm.scale       [L]
    kv_b_proj.w         [L, H, P + V]                  (W_UK = [..., :P], W_UV = [..., P:])
    o_proj.w (.b)       [H * V, hidden]

One step (:func:`mla_layer`) over a batch ordered as vLLM orders it, decode rows first:

1. project: ``q [T, H, P + R]`` (rope on its last R), ``kv_c [T, L]`` (after ``kv_a_layernorm``),
   ``k_pe [T, R]`` (rotated), from the hidden states and each token's position;
2. write ``[kv_c | k_pe]`` into the paged cache at ``batch.slot_mapping`` (fp8: scaled, saturated);
3. attend: decode / verify rows absorbed (``q_nope @ W_UK`` -> :func:`jax_mla.mla_attention` over
   the latent cache -> ``@ W_UV``), prefill rows in the MHA form over their cached context plus
   themselves (:func:`jax_mla.mla_mixed_step`); softmax scale ``1/sqrt(P + R)`` times YaRN's
   ``mscale_all_dim`` factor squared;
4. ``o_proj``.

With the cache sharded along pages over a mesh axis (decode context parallel, :class:`Parallel`),
the cache write, the decode rows and the prefill rows over cached context run through
:func:`jax_mla.dcp_write_kv_cache`, :func:`jax_mla.dcp_mla_attention` and
:func:`jax_mla.dcp_prefill_with_context`: each device attends over its own pages and the
partials merge by LSE, so the compiled step moves queries and LSE-weighted outputs between
devices, never the cache. Heads sharded over ``head_axis`` run as head parallel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from jax_mla.cache import write_kv_cache
from jax_mla.context import absorb_query, mla_mixed_step, unabsorb_output, up_project
from jax_mla.dcp import (
    DcpMetadata,
    dcp_mla_attention,
    dcp_prefill_with_context,
    dcp_shardings,
    dcp_write_kv_cache,
)
from jax_mla.dcp.attention import place_on_mesh
from jax_mla.metadata import DecodeMetadata
from jax_mla.model.config import MLAConfig
from jax_mla.model.rope import apply_rope, rope_cos_sin
from jax_mla.prefill import mla_prefill

_HI = jax.lax.Precision.HIGHEST


def _precision(dtype):
    return _HI if jnp.dtype(dtype) == jnp.float32 else None


def init_params(cfg: MLAConfig, key, dtype=jnp.bfloat16, *, std: float = 0.02) -> dict:
    """Random parameters (normal ``std``; norm scales near 1), as a dict pytree in ``dtype``."""
    h, p, r, v, lr = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                      cfg.kv_lora_rank)
    shapes = {"kv_a_proj_with_mqa": (cfg.hidden_size, lr + r), "kv_b_proj": (lr, h, p + v),
              "o_proj": (h * v, cfg.hidden_size)}
    if cfg.q_lora_rank is None:
        shapes["q_proj"] = (cfg.hidden_size, h * (p + r))
    else:
        shapes["q_a_proj"] = (cfg.hidden_size, cfg.q_lora_rank)
        shapes["q_b_proj"] = (cfg.q_lora_rank, h * (p + r))
    keys = iter(jax.random.split(key, 2 * len(shapes) + 2))
    params = {name: {"w": (std * jax.random.normal(next(keys), s, jnp.float32)).astype(dtype)}
              for name, s in shapes.items()}
    if cfg.attention_bias:
        for name in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
            if name in params:
                params[name]["b"] = (std * jax.random.normal(
                    next(keys), (shapes[name][-1],), jnp.float32)).astype(dtype)
    norms = {"kv_a_layernorm": lr}
    if cfg.q_lora_rank is not None:
        norms["q_a_layernorm"] = cfg.q_lora_rank
    for name, n in norms.items():
        params[name] = {"scale": (1 + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)
                                  ).astype(dtype)}
    return params


def check_params(params: dict, cfg: MLAConfig) -> None:
    """Raise ``ValueError`` naming the parameter unless ``params`` has ``cfg``'s shapes."""
    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.float32))
    have = {k: {kk: getattr(vv, "shape", None) for kk, vv in v.items()}
            for k, v in params.items()} if isinstance(params, dict) else None
    if have is None:
        raise TypeError(f"params must be a dict pytree, got {type(params).__name__}")
    for name, leaves in want.items():
        for leaf, sd in leaves.items():
            got = have.get(name, {}).get(leaf)
            if got != sd.shape:
                raise ValueError(f"params[{name!r}][{leaf!r}] must have shape {sd.shape} for this "
                                 f"MLAConfig, got {got}")
    extra = sorted(f"{k}.{kk}" for k, v in have.items() for kk in v
                   if kk not in want.get(k, {}))
    if extra:
        raise ValueError(f"params has entries this MLAConfig does not use: {extra}")


def rms_norm(x, scale, eps: float):
    """RMSNorm as DeepSeek computes it: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def _linear(x, p):
    y = jnp.dot(x, p["w"].astype(x.dtype), precision=_precision(x.dtype),
                preferred_element_type=jnp.float32).astype(x.dtype)
    return y + p["b"].astype(x.dtype) if "b" in p else y


def project_qkv(params: dict, cfg: MLAConfig, x, positions):
    """``x [T, hidden]``, ``positions [T]`` -> ``q [T, H, P + R]`` (rope part rotated),
    ``kv_c [T, L]`` (normed), ``k_pe [T, R]`` (rotated), in ``x``'s dtype."""
    t = x.shape[0]
    if cfg.q_lora_rank is None:
        q = _linear(x, params["q_proj"])
    else:
        qa = _linear(x, params["q_a_proj"])
        q = _linear(rms_norm(qa, params["q_a_layernorm"]["scale"], cfg.rms_norm_eps),
                    params["q_b_proj"])
    q = q.reshape(t, cfg.num_heads, cfg.qk_head_dim)
    ckv = _linear(x, params["kv_a_proj_with_mqa"])
    kv_c = rms_norm(ckv[:, : cfg.kv_lora_rank], params["kv_a_layernorm"]["scale"],
                    cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    nope = cfg.qk_nope_head_dim
    q_pe = apply_rope(q[..., nope:], cos, sin, interleave=cfg.rope_interleave)
    k_pe = apply_rope(ckv[:, cfg.kv_lora_rank:], cos, sin, interleave=cfg.rope_interleave)
    return jnp.concatenate([q[..., :nope], q_pe], axis=-1), kv_c, k_pe


def output_projection(params: dict, out):
    """``out [T, H, V]`` -> ``[T, hidden]``."""
    return _linear(out.reshape(out.shape[0], -1), params["o_proj"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    """Where one step's tokens go and what they attend, shared by every layer of the step.

    ``T`` rows: ``T_d = decode.num_rows`` decode/verify rows first (``B_d`` requests x ``qlen``,
    padded requests with length 0), then prefill rows packed per request by
    ``prefill_cu_seqlens`` (trailing padding rows allowed). Arrays have static capacities, so a
    jitted step serves every mix of the same sizes.

    slot_mapping: ``[T]`` int32 flat cache slots of the step's tokens (``-1``: padding, skipped).
    decode: the decode rows' :class:`jax_mla.DecodeMetadata` (``seq_lens`` count the new tokens),
      or None.
    prefill_block_table ``[B_p, max_pages]``, prefill_context_lens ``[B_p]`` (tokens cached
      before this step's), prefill_cu_seqlens ``[B_p + 1]`` (offsets from row ``T_d``): None
      without prefill rows.

    With a DCP-sharded cache (:class:`Parallel`): ``decode`` is the step's
    :class:`jax_mla.DcpMetadata`; the write goes by ``positions`` ``[T]`` (global, ``-1``:
    padding), ``request_ids`` ``[T]`` (rows of ``block_tables``) and ``block_tables`` ``[N, B,
    max_pages_local]`` (rank-local, e.g. ``PagedCacheManager(world_size=N).block_tables``);
    ``slot_mapping`` is unused. Prefill rows read their context through the same tables: request
    ``b``'s row is ``request_ids`` of its first new token, so ``prefill_block_table`` stays None;
    ``prefill_context_lens`` stays global (each rank derives its own part from the layout), or
    None when every prefill row attends only itself.
    """

    slot_mapping: jax.Array | None
    decode: DecodeMetadata | DcpMetadata | None = None
    prefill_block_table: jax.Array | None = None
    prefill_context_lens: jax.Array | None = None
    prefill_cu_seqlens: jax.Array | None = None
    positions: jax.Array | None = None
    request_ids: jax.Array | None = None
    block_tables: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How the layer's cache and heads are laid out over a mesh (static).

    ``dcp_axis``: the cache's pages are sharded over this axis (decode context parallel: each
    device holds its own pages of every request, :func:`jax_mla.dcp_shardings`);
    ``head_axis``: query heads are also split over this axis (head parallel); ``interleave``:
    DCP tokens per rank turn; ``combine``: the LSE merge's collective (``"ag_rs"`` or
    ``"a2a"``).
    """

    mesh: Mesh | AbstractMesh
    dcp_axis: str = "dcp"
    head_axis: str | None = None
    interleave: int = 1
    combine: str = "ag_rs"

    @property
    def shardings(self):
        return dcp_shardings(self.mesh, dcp_axis=self.dcp_axis, head_axis=self.head_axis)


def parallel_from_cache(kv_cache) -> Parallel | None:
    """The :class:`Parallel` a cache's own sharding implies, or None.

    A cache whose pages (axis 0) are sharded over one mesh axis of size > 1 is DCP over that
    axis. Readable from concrete arrays and, under ``jax.jit``, from arrays typed with an
    explicit-axes mesh (``jax.sharding.AxisType.Explicit``); with auto axes a traced array does
    not carry its sharding, so pass ``parallel=`` to :func:`mla_layer`.
    """
    sh = getattr(kv_cache, "sharding", None)
    if not isinstance(sh, NamedSharding):
        try:
            sh = jax.typeof(kv_cache).sharding
        except (AttributeError, TypeError):
            return None
    if not isinstance(sh, NamedSharding) or not len(sh.spec) or sh.spec[0] is None:
        return None
    axis = sh.spec[0]
    if isinstance(axis, tuple):
        if len(axis) != 1:
            return None
        axis = axis[0]
    mesh = sh.mesh  # a Mesh, or under jax.jit the AbstractMesh of an explicit-axes mesh
    if not isinstance(mesh, (Mesh, AbstractMesh)) or dict(mesh.shape).get(axis, 1) == 1:
        return None
    return Parallel(mesh=mesh, dcp_axis=axis)


def mla_layer(params: dict, cfg: MLAConfig, x, positions, kv_cache, batch: AttentionBatch, *,
              workspace_tokens: int | None = None, k_scale=None, decode_backend: str = "auto",
              prefill_backend: str = "auto", parallel: Parallel | str | None = "auto",
              **attention_options):
    """One MLA attention layer step: ``x [T, hidden]`` -> ``(y [T, hidden], kv_cache)``.

    Args:
      params: this layer's parameters (:func:`init_params` or
        :func:`jax_mla.model.params_from_hf`).
      cfg: the layer's :class:`MLAConfig` (static).
      x: ``[T, hidden]`` hidden states, rows ordered as ``batch`` says.
      positions: ``[T]`` int32 position of each token in its request (rope).
      kv_cache: ``[num_pages, page_size, L + R]`` this layer's cache (donate it under jit).
      batch: :class:`AttentionBatch`.
      workspace_tokens: chunked-context workspace of the prefill rows (static; required with
        prefill rows).
      k_scale: per-tensor float32 scale of an fp8 cache (:func:`jax_mla.calibrate_fp8_scale`).
      decode_backend, prefill_backend: as in :func:`jax_mla.mla_mixed_step`.
      parallel: a :class:`Parallel` (static), ``None`` (one device's cache), or ``"auto"``: the
        cache's own sharding decides (:func:`parallel_from_cache`), else one device.
      attention_options: passed on to :func:`jax_mla.mla_mixed_step` (one device: e.g.
        ``q_fp8``/``q_scale`` for an fp8 decode query, ``prefill_fp8`` for fp8 prefill
        attention) or :func:`jax_mla.dcp_mla_attention` (DCP).
    """
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [T, hidden={cfg.hidden_size}], got {tuple(x.shape)}")
    if positions.shape != x.shape[:1]:
        raise ValueError(f"positions must be [T={x.shape[0]}], got {tuple(positions.shape)}")
    if kv_cache.ndim != 3 or kv_cache.shape[2] != cfg.kv_lora_rank + cfg.qk_rope_head_dim:
        raise ValueError(f"kv_cache must be [num_pages, page_size, L + R = "
                         f"{cfg.kv_lora_rank + cfg.qk_rope_head_dim}], got {tuple(kv_cache.shape)}")
    if parallel == "auto":
        parallel = parallel_from_cache(kv_cache)
    elif parallel is not None and not isinstance(parallel, Parallel):
        raise TypeError(f"parallel must be a Parallel, None or 'auto', got {parallel!r}")
    q, kv_c, k_pe = project_qkv(params, cfg, x, positions)
    if parallel is not None:
        out, kv_cache = _dcp_step(params, cfg, q, kv_c, k_pe, kv_cache, batch, parallel,
                                  workspace_tokens=workspace_tokens, k_scale=k_scale,
                                  decode_backend=decode_backend, prefill_backend=prefill_backend,
                                  **attention_options)
        return output_projection(params, out), kv_cache
    if batch.slot_mapping is None:
        raise ValueError("AttentionBatch.slot_mapping is required with a single-device cache "
                         "(positions / request_ids / block_tables serve a DCP-sharded one)")
    kv_cache = write_kv_cache(kv_cache, kv_c, k_pe, batch.slot_mapping, k_scale=k_scale)
    out = mla_mixed_step(
        q, kv_c, k_pe, kv_cache, params["kv_b_proj"]["w"], batch.decode,
        batch.prefill_block_table, batch.prefill_context_lens, batch.prefill_cu_seqlens,
        scale=cfg.softmax_scale, workspace_tokens=workspace_tokens, k_scale=k_scale,
        decode_backend=decode_backend, prefill_backend=prefill_backend, **attention_options)
    return output_projection(params, out), kv_cache


def _dcp_step(params, cfg, q, kv_c, k_pe, kv_cache, batch, par: Parallel, *, workspace_tokens,
              k_scale, decode_backend, prefill_backend, **options):
    """The layer's cache write and attention with the cache sharded over ``par.dcp_axis``."""
    for name in ("positions", "request_ids", "block_tables"):
        if getattr(batch, name) is None:
            raise ValueError(f"a DCP-sharded cache needs AttentionBatch.{name} (the write goes "
                             "to the rank that owns each token)")
    md = batch.decode
    if md is not None and not isinstance(md, DcpMetadata):
        raise TypeError("with a DCP-sharded cache, AttentionBatch.decode must be a DcpMetadata "
                        f"(jax_mla.build_dcp_metadata), got {type(md).__name__}")
    if options.get("prefill_fp8") and batch.prefill_cu_seqlens is not None:
        raise NotImplementedError("prefill_fp8 (fp8 prefill attention) is not supported with a "
                                  "DCP-sharded cache: prefill rows attend in q's dtype there")
    options.pop("prefill_fp8", None)
    kv_cache = dcp_write_kv_cache(kv_cache, kv_c, k_pe, batch.positions, batch.request_ids,
                                  batch.block_tables, mesh=par.mesh, interleave=par.interleave,
                                  dcp_axis=par.dcp_axis, k_scale=k_scale)
    t = q.shape[0]
    t_d = 0 if md is None else md.row_lens.shape[-1]
    kv_b_proj = params["kv_b_proj"]["w"]
    parts = []
    if t_d:
        def attend(qa):  # heads go where dcp_shardings puts them inside (q is small)
            return dcp_mla_attention(
                qa, kv_cache, md, mesh=par.mesh, scale=cfg.softmax_scale,
                dcp_axis=par.dcp_axis, head_axis=par.head_axis, combine=par.combine,
                backend=decode_backend, kv_lora_rank=cfg.kv_lora_rank, kv_scale=k_scale,
                **options)

        nope = cfg.qk_nope_head_dim
        latent = attend((absorb_query(q[:t_d], kv_b_proj, nope), q[:t_d, :, nope:]))
        parts.append(unabsorb_output(latent, kv_b_proj, nope, q.dtype))
    if batch.prefill_cu_seqlens is not None:
        if batch.prefill_block_table is not None:
            raise ValueError(
                "with a DCP-sharded cache, prefill rows read their pages from the rank-local "
                "AttentionBatch.block_tables (the row of each request's first new token in "
                "request_ids): leave AttentionBatch.prefill_block_table None")
        if batch.prefill_context_lens is None:  # prompts in one chunk: themselves only
            k, v = up_project(kv_c[t_d:], k_pe[t_d:], kv_b_proj, cfg.qk_nope_head_dim, q.dtype)
            parts.append(mla_prefill(q[t_d:], k, v, batch.prefill_cu_seqlens,
                                     scale=cfg.softmax_scale, causal=True,
                                     backend=prefill_backend))
        else:
            parts.append(_dcp_prefill_rows(cfg, q, kv_c, k_pe, kv_cache, kv_b_proj, batch, t_d,
                                           par, workspace_tokens=workspace_tokens,
                                           k_scale=k_scale, backend=prefill_backend))
    elif t_d != t:
        raise ValueError(f"q has T={t} rows but the DCP metadata covers {t_d}")
    if len(parts) == 1:
        return parts[0], kv_cache
    # Decode and prefill rows leave their heads laid out differently (explicit mesh axes
    # refuse to concatenate them as they are): both go where the decode output is.
    spec = par.shardings.out.spec
    return jnp.concatenate([place_on_mesh(x, par.mesh, spec) for x in parts]), kv_cache


def _dcp_prefill_rows(cfg, q, kv_c, k_pe, kv_cache, kv_b_proj, batch, t_d, par, *,
                      workspace_tokens, k_scale, backend):
    """Prefill rows over their cached context on a DCP-sharded cache: ``[T - T_d, H, V]``."""
    if workspace_tokens is None:
        raise ValueError("workspace_tokens is required when prefill rows have cached context")
    cu = jnp.asarray(batch.prefill_cu_seqlens).astype(jnp.int32)
    # Request b's block-table row is the one its first new token is written through; a request
    # with no new tokens this step has no queries, so its context is dropped, not looked up.
    first = jnp.clip(t_d + cu[:-1], 0, q.shape[0] - 1)
    rows = jnp.asarray(batch.request_ids).astype(jnp.int32)[first]
    ctx = jnp.where(cu[1:] > cu[:-1], jnp.asarray(batch.prefill_context_lens), 0)
    return dcp_prefill_with_context(
        q[t_d:], kv_c[t_d:], k_pe[t_d:], kv_cache, batch.block_tables, ctx, cu, kv_b_proj,
        mesh=par.mesh, scale=cfg.softmax_scale, workspace_tokens=workspace_tokens, rows=rows,
        interleave=par.interleave, dcp_axis=par.dcp_axis, head_axis=par.head_axis,
        combine=par.combine, k_scale=k_scale, backend=backend)
