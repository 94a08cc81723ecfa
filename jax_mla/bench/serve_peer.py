"""A PyTorch peer of the serving model, for the serving benchmark only (never used by the engine).

:class:`TorchPeer` runs the same small decoder-only MLA model as :mod:`jax_mla.model.transformer`
(same weights, shared with JAX through DLPack, same math) the way a strong PyTorch server would:

- matmuls through cuBLAS (``torch.matmul`` in the model dtype, float32 accumulate);
- decode / verify rows absorbed (``q_nope @ W_UK``) and attended over the paged latent cache by
  FlashMLA's dense decode where it imports (CUDA, bf16, pages of 64, L=512, R=64), else by a plain
  torch reference (gather the pages, masked float32 softmax: what runs on CPU in the tests);
- prefill rows in the MHA form (context and new latents up-projected per head) through
  ``torch.nn.functional.scaled_dot_product_attention``, one call per request, bottom-right causal;
- each decode-only step shape captured once as a CUDA graph and replayed.

It replays recorded engine steps (:class:`jax_mla.model.transformer.StepInputs` of NumPy arrays
plus ``qlen``: the engine's own scheduler decisions) and reports each step's wall seconds and the
greedy ids of its sample rows, so both sides do the same work on the same cache layout.

Step format (as the engine writes it): rows ``0 .. T_d - 1`` are ``B_d`` decode requests of
``qlen`` rows each (padding requests: seq_len 0, slots -1), then the prefill rows packed by
``prefill_cu_seqlens`` (offsets from row ``T_d``; padding requests have equal entries), then
trailing padding rows (slot -1). Trailing padding rows are never computed here: the peer runs the
``T_d + cu[-1]`` rows that carry tokens (decode padding requests are kept: they are part of the
decode batch's graph shape). Sample rows: every decode row, then the last row of each prefill
request (``0`` for a padding request).

Not covered: fp8 caches (a clear error), DCP. Nothing of FlashMLA's code is here; its Python API
is called at run time (:func:`jax_mla.bench.peers.flashmla`). On one GPU shared with JAX, leave
torch room (e.g. ``XLA_PYTHON_CLIENT_MEM_FRACTION``): JAX preallocates most of the memory.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jax_mla.bench.peers import flashmla, flashmla_reason

_DTYPES = ("bfloat16", "float16", "float32")


def peer_available() -> str | None:
    """None where the full peer runs (torch with CUDA, and ``flash_mla`` imports), else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if flashmla() is None:
        return "flash_mla does not import (build it as benchmarks/README.md says)"
    return None


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES and "float8" not in name:
        import jax.numpy as jnp

        name = jnp.dtype(dtype).name
    if "float8" in name:
        raise NotImplementedError(
            f"the torch serving peer has no fp8 KV cache (dtype {name}): fp8 is out of its scope; "
            "compare a bf16 engine run")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {name}")
    return name


def _to_torch(a, device, dtype):
    """A jax (or NumPy) array as a torch tensor on ``device`` in ``dtype``: shared through
    DLPack where it can be, else copied through NumPy."""
    import torch

    try:
        t = torch.from_dlpack(a)
    except Exception:  # any DLPack refusal (device, dtype, sharding, version): copy instead
        h = np.asarray(a)
        t = (torch.from_numpy(h.view(np.int16)).view(torch.bfloat16)
             if h.dtype.name == "bfloat16" else torch.from_numpy(np.ascontiguousarray(h)))
    return t.to(device=device, dtype=dtype)


def _stacked_layers(layers):
    """The per-layer pytree with a leading ``num_layers`` axis (a list of layers is stacked)."""
    if isinstance(layers, (list, tuple)):
        import jax
        import jax.numpy as jnp

        return jax.tree.map(lambda *a: jnp.stack(a), *layers)
    return layers


@dataclasses.dataclass
class _Plan:
    """One step as the host sees it: row counts, prefill requests, and every int array the
    device needs, packed into one int32 buffer (one host->device copy per step)."""

    qlen: int
    b_d: int  # decode requests (padding included)
    t_d: int  # decode rows, b_d * qlen
    rows: int  # rows computed: t_d + prefill tokens (trailing padding rows dropped)
    max_pages: int
    requests: list  # prefill requests with tokens: (first row from t_d, tokens, context, ws row)
    workspace: int  # prefill workspace rows (context + new of every request)
    any_context: bool
    num_ids: int  # t_d + B_p
    sample_pad: np.ndarray  # [num_ids] bool: ids of padding prefill requests (returned as 0)
    packed: np.ndarray  # int32
    sizes: tuple  # lengths of the packed fields, in _FIELDS order

    @property
    def decode_only(self) -> bool:
        return self.t_d > 0 and self.rows == self.t_d

    @property
    def graph_key(self):
        """What fixes a decode-only step's device shapes (its packed buffer's layout)."""
        return self.b_d, self.qlen, self.max_pages, self.num_ids


_STEP_FIELDS = ("tokens", "positions", "slot_mapping", "decode_block_table", "decode_seq_lens",
                "prefill_block_table", "prefill_context_lens", "prefill_cu_seqlens")

# tok, pos, slots [rows]; lens, lens_eff [b_d]; table [b_d * max_pages]; sample [S];
# ctx_src, ctx_dst [context rows]; new_dst [prefill rows].
_FIELDS = ("tok", "pos", "slots", "lens", "lens_eff", "table", "sample", "ctx_src", "ctx_dst",
           "new_dst")


class TorchPeer:
    """The serving model in PyTorch over its own paged latent cache (see the module docstring).

    Args:
      params: the model's parameter pytree (:func:`jax_mla.model.transformer.init_model`):
        ``embed``, ``norm``, ``lm_head`` and ``layers``, stacked (a leading ``num_layers`` axis on
        every leaf) or a list of per-layer dicts (stacked here).
      cfg: the :class:`jax_mla.model.transformer.ModelConfig`.
      num_pages, page_size: the cache's geometry (per layer ``[num_pages, page_size, L + R]``),
        as the engine's, so its block tables and slots apply unchanged.
      max_seq_len: the longest position + 1 (sizes the rotary tables).
      dtype: model and cache dtype (``"bfloat16"``, ``"float16"``, ``"float32"``; fp8 raises
        ``NotImplementedError``). Weights in another dtype are cast (copied).
      device: a torch device; default where the jax arrays live (a GPU, else the CPU).
      use_flashmla: ``"auto"`` (where it can run), True (required), False (torch reference).
      cuda_graphs: capture each decode-only step shape as a CUDA graph: ``"auto"`` (on CUDA),
        True (required), False (never).
      cache_fill: what the cache holds before any write. NaN (default, as the engine's caches
        start) poisons it: a read of a slot no step wrote shows up in the logits. Every path
        here selects rather than multiplies where it may touch such slots (FlashMLA zero-fills
        the out-of-range rows of a request's last page itself).
    """

    def __init__(self, params, cfg, *, num_pages: int, page_size: int, max_seq_len: int,
                 dtype="bfloat16", device=None, use_flashmla="auto", cuda_graphs="auto",
                 cache_fill: float = float("nan")):
        import jax
        import jax.numpy as jnp
        import torch

        from jax_mla.model.rope import rope_cos_sin

        name = _dtype_name(dtype)
        self.cfg, self.m = cfg, cfg.mla
        m = self.m
        self.dtype = getattr(torch, name)
        if device is None:
            devices = getattr(params["embed"], "devices", lambda: ())()
            on_gpu = any(d.platform in ("gpu", "cuda") for d in devices)
            device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_pages, self.page_size, self.max_seq_len = num_pages, page_size, max_seq_len
        self.cache_fill = float(cache_fill)
        self.L, self.R = m.kv_lora_rank, m.qk_rope_head_dim
        self.H, self.P, self.V = m.num_heads, m.qk_nope_head_dim, m.v_head_dim
        self.scale = float(m.softmax_scale)

        # Weights: views of the jax buffers where DLPack shares them (kept alive with them).
        self._jax_params = params
        conv = lambda a: _to_torch(a, self.device, self.dtype)
        self.embed, self.norm, self.lm_head = (conv(params[k]) for k in ("embed", "norm",
                                                                          "lm_head"))
        stacked = jax.tree.map(conv, _stacked_layers(params["layers"]))
        self.layers = [self._layer(jax.tree.map(lambda t, i=i: t[i], stacked))
                       for i in range(cfg.num_layers)]
        cos, sin = rope_cos_sin(m, jnp.arange(max_seq_len, dtype=jnp.int32), jnp.dtype(name))
        self.cos, self.sin = conv(cos), conv(sin)
        self._lm_head_mode = self._pick_lm_head()

        # The cache: per layer a flat [num_pages * page_size + 1, L + R] buffer; the last row is
        # where skipped slots (-1, out of range) are written, so a write needs no host filter
        # (and a captured graph none either). Never reallocated: graphs hold its address.
        self.capacity = num_pages * page_size
        self.flat = torch.empty(cfg.num_layers, self.capacity + 1, self.L + self.R,
                                dtype=self.dtype, device=self.device)
        self.paged = [f[:self.capacity].view(num_pages, page_size, 1, self.L + self.R)
                      for f in self.flat]
        self.reset_cache()

        if self.device.type != "cuda":
            reason = f"FlashMLA needs CUDA (device {self.device})"
        elif flashmla() is None:
            reason = "flash_mla does not import"
        else:
            reason = flashmla_reason("bf16" if name == "bfloat16" else name, page_size, self.H,
                                     self.L, self.L + self.R)
        if use_flashmla is True and reason:
            raise RuntimeError(f"use_flashmla=True but FlashMLA cannot run here: {reason}")
        self._fm = flashmla() if use_flashmla and not reason else None
        self._decode_reason = reason if use_flashmla else "use_flashmla=False"
        if cuda_graphs is True and self.device.type != "cuda":
            raise RuntimeError(f"cuda_graphs=True needs a CUDA device (device {self.device})")
        self._use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._graphs = {}
        self._pool = torch.cuda.graph_pool_handle() if self._use_graphs else None
        self._sdpa_choice = {}  # mask kind -> (backend, pad v) found on first use

    # --- setup ---------------------------------------------------------------------------------

    def _layer(self, p):
        """One layer's torch weights, with the absorbed decode's per-head layouts made once."""
        a = p["attn"]
        kvb = a["kv_b_proj"]["w"]  # [L, H, P + V]
        a["kv_b_flat"] = kvb.reshape(self.L, -1)  # up-projection [L, H * (P + V)]
        a["w_uk_t"] = kvb[..., :self.P].permute(1, 2, 0).contiguous()  # [H, P, L]
        a["w_uv"] = kvb[..., self.P:].permute(1, 0, 2).contiguous()  # [H, L, V]
        return p

    def _pick_lm_head(self) -> str:
        """How the logits are made: JAX multiplies the model-dtype rows by ``lm_head`` with a
        float32 result (no rounding to the model dtype). cuBLAS does that directly where torch
        has ``mm(..., out_dtype=float32)``; else a float32 copy of ``lm_head`` is kept."""
        import torch

        if self.dtype == torch.float32:
            return "float32"
        try:
            x = torch.ones(2, 2, dtype=self.dtype, device=self.device)
            torch.mm(x, x, out_dtype=torch.float32)
            return "mm out_dtype=float32"
        except (RuntimeError, TypeError, NotImplementedError):
            self._lm_head_f32 = self.lm_head.float()
            return "float32 copy of lm_head"

    def reset_cache(self, fill: float | None = None) -> None:
        """Fill every layer's cache with ``fill`` (default: ``cache_fill``), in place."""
        self.flat.fill_(self.cache_fill if fill is None else fill)

    @property
    def backend(self) -> dict:
        """What runs: decode attention, SDPA backends found so far, graphs, logits matmul."""
        import torch

        sdpa = {k: v[0].name.lower() + (" (v padded to the qk head dim)" if v[1] else "")
                for k, v in self._sdpa_choice.items()}
        return {
            "device": str(self.device) + (f" ({torch.cuda.get_device_name(self.device)})"
                                          if self.device.type == "cuda" else ""),
            "torch": torch.__version__, "dtype": str(self.dtype).removeprefix("torch."),
            "decode": "flashmla" if self._fm is not None else "torch-reference",
            "decode_note": None if self._fm is not None else self._decode_reason,
            "prefill": {"sdpa": sdpa, "mask": "causal / causal_lower_right per request"},
            "cuda_graphs": self._use_graphs,
            "graphs": sorted(self._graphs),  # (B_d, qlen, max_pages, num_ids) captured
            "lm_head": self._lm_head_mode,
            "rows": "trailing padding rows of a step are not computed",
        }

    # --- host side -----------------------------------------------------------------------------

    def _plan(self, inputs, qlen: int) -> _Plan:
        """Validate one step's arrays and pack what the device needs."""
        tok, pos, slots, dtab, dlens, ptab, ctx, cu = (np.asarray(getattr(inputs, f))
                                                       for f in _STEP_FIELDS)
        qlen = int(qlen)
        b_d, t = dlens.shape[0], tok.shape[0]
        t_d = b_d * qlen
        if qlen < 1 or t_d > t:
            raise ValueError(f"qlen={qlen} with B_d={b_d} decode requests needs T >= {t_d} rows, "
                             f"got T={t}")
        b_p = max(cu.shape[0] - 1, 0)
        if b_p and (cu[0] != 0 or np.any(np.diff(cu) < 0) or t_d + cu[-1] > t):
            raise ValueError(f"prefill_cu_seqlens must start at 0, not decrease and fit the "
                             f"T - T_d = {t - t_d} rows: {cu.tolist()}")
        n_p = int(cu[-1]) if b_p else 0
        rows = t_d + n_p
        page, mp = self.page_size, dtab.shape[1] if dtab.ndim == 2 else 0

        # Decode requests: every page a real request reads must exist; padding requests read
        # page 0 (FlashMLA gets them qlen rows of it; their outputs are zeroed).
        lens = dlens.astype(np.int32)
        if b_d:
            if np.any(lens > mp * page) or np.any((lens > 0) & (lens < qlen)):
                raise ValueError(f"decode_seq_lens {lens.tolist()} must lie in [qlen={qlen}, "
                                 f"max_pages * page_size = {mp * page}] (0: padding)")
            used = np.arange(mp)[None, :] * page < lens[:, None]
            self._check_pages(dtab[used], "decode_block_table")
        table = np.where(lens[:, None] > 0, np.clip(dtab, 0, self.num_pages - 1), 0)
        lens_eff = np.where(lens > 0, lens, qlen).astype(np.int32)

        # Rows that carry tokens: positions must have rotary entries.
        real = np.zeros(rows, bool)
        real[:t_d] = np.repeat(lens > 0, qlen)
        real[t_d:] = True
        p = pos[:rows]
        if np.any(p[real] < 0) or np.any(p[real] >= self.max_seq_len):
            raise ValueError(f"positions must lie in [0, max_seq_len={self.max_seq_len})")
        cap = self.capacity
        s = slots[:rows].astype(np.int64)
        s = np.where((s < 0) | (s >= cap), cap, s)

        # Prefill requests: workspace rows [context | new] per request, and the sample rows.
        requests, ctx_src, ctx_dst, new_dst, sample = [], [], [], [], list(range(t_d))
        pad = [False] * t_d
        w = 0
        for j in range(b_p):
            a, n, c = int(cu[j]), int(cu[j + 1] - cu[j]), int(ctx[j]) if ctx.size else 0
            sample.append(t_d + a + n - 1 if n else 0)
            pad.append(n == 0)
            if n == 0:
                continue
            if c:
                cp = np.arange(c)
                if c > ptab.shape[1] * page:
                    raise ValueError(f"prefill request {j}: context {c} exceeds its block table")
                pages = ptab[j, cp // page]
                self._check_pages(pages, "prefill_block_table")
                ctx_src.append(pages.astype(np.int64) * page + cp % page)
                ctx_dst.append(np.arange(w, w + c))
            new_dst.append(np.arange(w + c, w + c + n))
            requests.append((a, n, c, w))
            w += c + n
        fields = (np.clip(tok[:rows], 0, self.cfg.vocab_size - 1),
                  np.clip(p, 0, self.max_seq_len - 1), s, lens, lens_eff, table.reshape(-1),
                  np.asarray(sample), *(np.concatenate(x) if x else np.zeros(0)
                                        for x in (ctx_src, ctx_dst, new_dst)))
        packed = np.concatenate([np.asarray(f).astype(np.int32).reshape(-1) for f in fields])
        return _Plan(qlen=qlen, b_d=b_d, t_d=t_d, rows=rows, max_pages=mp, requests=requests,
                     workspace=w, any_context=bool(ctx_src), num_ids=t_d + b_p,
                     sample_pad=np.asarray(pad, bool), packed=packed,
                     sizes=tuple(int(np.asarray(f).size) for f in fields))

    def _check_pages(self, pages, what):
        bad = np.asarray(pages)
        bad = bad[(bad < 0) | (bad >= self.num_pages)]
        if bad.size:
            raise ValueError(f"{what} reads page {int(bad[0])}, outside the cache's "
                             f"{self.num_pages} pages")

    def _views(self, buf, plan: _Plan) -> dict:
        """Named views of a device copy of ``plan.packed``, indices as int64 (one cast per
        step, inside the forward: a graph's replay must redo it from its static buffer)."""
        wide = buf.long()  # index tensors; FlashMLA's lens and table stay int32
        out, off = {}, 0
        for name, n in zip(_FIELDS, plan.sizes):
            src = buf if name in ("lens", "lens_eff", "table") else wide
            out[name] = src[off:off + n]
            off += n
        out["table"] = out["table"].view(plan.b_d, plan.max_pages)
        return out

    # --- the model -----------------------------------------------------------------------------

    def _rms(self, x, scale):
        import torch

        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.m.rms_norm_eps)
        return scale * xf.to(x.dtype)

    @staticmethod
    def _linear(x, p):
        y = x @ p["w"]
        return y + p["b"] if "b" in p else y

    def _rope(self, x, cos, sin):
        import torch

        r = x.shape[-1]
        if self.m.rope_interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : r // 2], x[..., r // 2:]
        shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (r // 2,)
        c, s = cos.view(shape), sin.view(shape)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def _project(self, a, x, cos, sin):
        """``q [T, H, P + R]``, latent rows ``[kv_c | k_pe] [T, L + R]`` (layer.project_qkv)."""
        import torch

        if "q_proj" in a:
            q = self._linear(x, a["q_proj"])
        else:
            qa = self._linear(x, a["q_a_proj"])
            q = self._linear(self._rms(qa, a["q_a_layernorm"]["scale"]), a["q_b_proj"])
        q = q.view(x.shape[0], self.H, self.P + self.R)
        ckv = self._linear(x, a["kv_a_proj_with_mqa"])
        kv_c = self._rms(ckv[:, :self.L], a["kv_a_layernorm"]["scale"])
        k_pe = self._rope(ckv[:, self.L:], cos, sin)
        q = torch.cat([q[..., :self.P], self._rope(q[..., self.P:], cos, sin)], dim=-1)
        return q, torch.cat([kv_c, k_pe], dim=-1)

    def _forward(self, buf, plan: _Plan):
        """The step's logits ``[num_ids, vocab]`` float32 from ``buf``, the device copy of
        ``plan.packed``. No host sync and, for a decode-only plan, no host-dependent control
        flow: this is what a CUDA graph captures (``buf`` its static input)."""
        import torch
        import torch.nn.functional as F

        d = self._views(buf, plan)
        x = self.embed[d["tok"]]
        cos, sin = self.cos[d["pos"]], self.sin[d["pos"]]
        dec = self._decode_state(d, plan) if plan.t_d else None
        for i, lw in enumerate(self.layers):
            a = lw["attn"]
            q, lat = self._project(a, self._rms(x, lw["attn_norm"]), cos, sin)
            self.flat[i].index_copy_(0, d["slots"], lat)
            parts = []
            if plan.t_d:
                parts.append(self._decode_rows(i, a, q[:plan.t_d], dec, plan))
            if plan.rows > plan.t_d:
                parts.append(self._prefill_rows(i, a, q[plan.t_d:], lat[plan.t_d:], d, plan))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = x + self._linear(out.reshape(plan.rows, -1), a["o_proj"])
            g, u = (self._rms(x, lw["mlp_norm"]) @ lw["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ lw["down"]
        xs = self._rms(x[d["sample"]], self.norm)
        if self._lm_head_mode == "float32":
            return xs @ self.lm_head
        if self._lm_head_mode.startswith("mm"):
            return torch.mm(xs, self.lm_head, out_dtype=torch.float32)
        return xs.float() @ self._lm_head_f32

    # --- decode / verify rows ------------------------------------------------------------------

    def _decode_state(self, d, plan: _Plan) -> dict:
        """What every layer's decode attention shares in one step."""
        import torch

        b, q = plan.b_d, plan.qlen
        lens = d["lens"]
        st = {"row_ok": (lens > 0)[:, None].expand(b, q).reshape(-1)}
        if self._fm is not None:
            # FlashMLA plans its split schedule from the seq lens on the first call with a fresh
            # metadata object (a kernel on the stream, not the host) and the later layers of the
            # step reuse it (same shapes and lens, as its interface requires). A fresh object per
            # forward means: eagerly, one plan per step; in a CUDA graph, the planning kernel is
            # captured with the first layer's call and re-runs on every replay over the static
            # lens tensor, so a replayed step never uses a plan made for other lengths.
            st["meta"] = self._fm.get_mla_metadata()[0]
            st["table"] = d["table"]
            st["lens_eff"] = d["lens_eff"]
            return st
        s = plan.max_pages * self.page_size
        ar = torch.arange(s, device=self.device)
        st["gather"] = (d["table"].long()[:, :, None] * self.page_size
                        + torch.arange(self.page_size, device=self.device)).reshape(b, s)
        st["in_len"] = ar[None, :] < lens[:, None]  # [B, S]
        last = lens[:, None] - q + torch.arange(q, device=self.device)[None, :]  # [B, Q]
        st["key_ok"] = ar[None, None, :] <= last[:, :, None]  # [B, Q, S]
        st["any_key"] = st["key_ok"].any(-1)
        return st

    def _decode_rows(self, i, a, q, st, plan: _Plan):
        """Absorbed decode: ``q [T_d, H, P + R]`` -> ``[T_d, H, V]`` (context.py _decode_rows)."""
        import torch

        b, qn, t_d = plan.b_d, plan.qlen, plan.t_d
        ql_nope = torch.bmm(q[..., :self.P].transpose(0, 1), a["w_uk_t"]).transpose(0, 1)
        qa = torch.cat([ql_nope, q[..., self.P:]], dim=-1)  # [T_d, H, L + R]
        if self._fm is not None:
            out, _ = self._fm.flash_mla_with_kvcache(
                qa.view(b, qn, self.H, self.L + self.R), self.paged[i], st["table"],
                st["lens_eff"], self.L, st["meta"], None, softmax_scale=self.scale,
                causal=qn > 1)
            latent = out.view(t_d, self.H, self.L)
        else:
            latent = self._reference_decode(i, qa, st, plan)
        # Padding requests attended page 0 (FlashMLA) or nothing: select, never multiply.
        latent = torch.where(st["row_ok"][:, None, None], latent, 0)
        return torch.bmm(latent.transpose(0, 1), a["w_uv"]).transpose(0, 1)

    def _reference_decode(self, i, qa, st, plan: _Plan):
        """Paged MQA over the latent cache in float32 (the fallback where FlashMLA is not)."""
        import torch

        b, qn = plan.b_d, plan.qlen
        kv = self.flat[i][st["gather"]]  # [B, S, L + R]
        kv = torch.where(st["in_len"][..., None], kv, 0).float()  # unwritten slots may be NaN
        qf = qa.view(b, qn, self.H, -1).float()
        s = torch.einsum("bqhd,bsd->bqhs", qf, kv) * self.scale
        s = s.masked_fill(~st["key_ok"][:, :, None, :], float("-inf"))
        p = torch.where(st["any_key"][:, :, None, None], torch.softmax(s, dim=-1), 0)
        out = torch.einsum("bqhs,bsl->bqhl", p, kv[..., :self.L])
        return out.reshape(plan.t_d, self.H, self.L).to(qa.dtype)

    # --- prefill rows --------------------------------------------------------------------------

    def _prefill_rows(self, i, a, q, lat, d, plan: _Plan):
        """MHA prefill: each request's new rows over its cached context plus themselves.

        ``q [N, H, P + R]``, ``lat [N, L + R]`` (this step's prefill latents) -> ``[N, H, V]``.
        Context latents are read from the cache (``ctx_src``), new ones taken from ``lat``; all
        are up-projected at once into a workspace (context.up_project), then one SDPA per
        request, bottom-right causal.
        """
        import torch

        if plan.any_context:
            ws = lat.new_empty(plan.workspace, self.L + self.R)
            ws[d["ctx_dst"]] = self.flat[i][d["ctx_src"]]
            ws[d["new_dst"]] = lat
        else:
            ws = lat
        w = ws.shape[0]
        kv = (ws[:, :self.L] @ a["kv_b_flat"]).view(w, self.H, self.P + self.V)
        k = torch.cat([kv[..., :self.P], ws[:, None, self.L:].expand(w, self.H, self.R)], dim=-1)
        v = kv[..., self.P:]
        out = q.new_zeros(q.shape[0], self.H, self.V)
        for r0, n, c, w0 in plan.requests:
            out[r0:r0 + n] = self._sdpa(q[r0:r0 + n], k[w0:w0 + c + n], v[w0:w0 + c + n], c)
        return out

    def _sdpa_candidates(self):
        from torch.nn.attention import SDPBackend

        if self.device.type != "cuda":
            return [(SDPBackend.MATH, False)]
        # cuDNN and memory-efficient take v's head dim (128) apart from q/k's (192); FlashAttention
        # wants them equal, so it gets v padded with zeros (the output's extra columns dropped).
        return [(SDPBackend.CUDNN_ATTENTION, False), (SDPBackend.FLASH_ATTENTION, True),
                (SDPBackend.EFFICIENT_ATTENTION, False), (SDPBackend.MATH, False)]

    def _sdpa(self, q, k, v, context: int):
        """``q [n, H, Dqk]`` over ``k [c + n, H, Dqk]``, ``v [c + n, H, V]`` -> ``[n, H, V]``:
        row ``t`` sees keys ``0 .. c + t``. The first SDPA backend that takes each mask kind
        (plain causal, lower-right causal) is kept while it takes the shapes."""
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        n, s = q.shape[0], k.shape[0]
        kind = "lower_right" if context else "causal"
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

        def run(backend, pad):
            vv = F.pad(vt, (0, qt.shape[-1] - vt.shape[-1])) if pad else vt
            with sdpa_kernel([backend]):
                if context:
                    o = F.scaled_dot_product_attention(qt, kt, vv, attn_mask=causal_lower_right(
                        n, s), scale=self.scale)
                else:
                    o = F.scaled_dot_product_attention(qt, kt, vv, is_causal=True,
                                                       scale=self.scale)
            return o[..., :vt.shape[-1]]

        chosen = self._sdpa_choice.get(kind)
        candidates = [chosen] if chosen else []
        candidates += [c for c in self._sdpa_candidates() if c != chosen]
        errors = []
        for backend, pad in candidates:
            try:
                o = run(backend, pad)
            except RuntimeError as e:  # this backend does not take these shapes / this mask
                errors.append(f"{backend.name}: {(str(e).splitlines() or [''])[0][:200]}")
                continue
            self._sdpa_choice[kind] = backend, pad
            return o[0].transpose(0, 1)
        raise RuntimeError("no SDPA backend runs the prefill attention: " + "; ".join(errors))

    # --- steps ---------------------------------------------------------------------------------

    def _run(self, plan: _Plan):
        """Device logits ``[num_ids, vocab]`` float32 of one step (padding samples included)."""
        import torch

        if plan.rows == 0:
            return torch.zeros(plan.num_ids, self.cfg.vocab_size, device=self.device)
        host = torch.from_numpy(plan.packed)
        if plan.decode_only and self._use_graphs:
            return self._graph_run(plan, host)
        return self._forward(host.to(self.device), plan)

    def _graph_run(self, plan: _Plan, host):
        """Replay the decode-only graph of this step's shape, capturing it the first time.

        Capture runs the forward twice eagerly on a side stream first (allocator and library
        warm-up, FlashMLA's first calls). Those runs write this step's own latents into its own
        slots, exactly what the replay then writes again, so they leave the cache as the step
        itself does. Capture is thread-local: XLA's threads in the same process may touch CUDA
        meanwhile (see peers.FlashMLA._graph).
        """
        import torch

        g = self._graphs.get(plan.graph_key)
        if g is None:
            static = host.to(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(static, plan)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward(static, plan)
            g = self._graphs[plan.graph_key] = graph, static, logits
        graph, static, logits = g
        static.copy_(host)
        graph.replay()
        return logits

    def step(self, inputs, qlen: int, *, return_logits: bool = False):
        """Run one step; returns ids ``[T_d + B_p]`` int32 (host, so synchronised), and with
        ``return_logits`` also their float32 logits ``[T_d + B_p, vocab]`` (padding prefill
        requests: id 0, logits NaN)."""
        plan = self._plan(inputs, qlen)
        logits = self._run(plan)
        ids = logits.argmax(-1).to("cpu").numpy().astype(np.int32)
        ids[plan.sample_pad] = 0
        if not return_logits:
            return ids
        out = logits.float().to("cpu").numpy().copy()
        out[plan.sample_pad] = np.nan
        return ids, out

    def replay(self, steps, warmup: bool = True) -> dict:
        """Replay ``steps`` (a list of ``(inputs, qlen)``) in order from a fresh cache.

        Each step's seconds are host wall time around :meth:`step`: packing and copying its
        inputs, the launches (or the graph replay), the wait, and the copy of its ids to the
        host (the engine reads its ids every step too). With ``warmup``, the first step of each
        distinct shape runs once beforehand (capturing the decode graphs, choosing the SDPA
        backends, loading kernels); the cache is then refilled, so the timed pass sees only
        what its own steps wrote.

        Returns ``{"seconds": [float], "ids": [np.ndarray], "backend": dict}``.
        """
        import torch

        cuda = self.device.type == "cuda"
        if warmup:
            seen = set()
            for inputs, qlen in steps:
                plan = self._plan(inputs, qlen)
                key = (plan.decode_only, qlen, *(np.shape(getattr(inputs, f))
                                                  for f in _STEP_FIELDS))
                if key not in seen:
                    seen.add(key)
                    self.step(inputs, qlen)
        if cuda:
            torch.cuda.synchronize(self.device)
        self.reset_cache()
        if cuda:
            torch.cuda.synchronize(self.device)
        seconds, ids = [], []
        for inputs, qlen in steps:
            t0 = time.perf_counter()
            ids.append(self.step(inputs, qlen))
            seconds.append(time.perf_counter() - t0)
        return {"seconds": seconds, "ids": ids, "backend": self.backend}
