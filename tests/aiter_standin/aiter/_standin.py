"""Stand-in core: the pretend device, the call log, and the reference math every kernel uses.

This package is *not* AITER. It has AITER's import paths and exact Python signatures (read at
ROCm/aiter e4048607) and implements each entry point with plain torch reference math, on CPU
or CUDA tensors, so that jax_mla's bridge can be run and checked without an AMD GPU. Each call
is appended to ``CALLS`` (what was passed: shapes, dtypes, heads, flags, scales) for tests.
Behaviours the bridge must survive are reproduced on purpose: AITER allocates the LSE it
returns, ``set_``s new storage into ``o`` after a folded multi-token persistent decode, leaves
rows it does not compute unwritten (NaN here: ``torch.empty`` made visible), and the segmented
decode leaves inactive segments unwritten.
"""

from __future__ import annotations

import math
import os

import torch

ARCH_CU = {"gfx942": 304, "gfx950": 256}
_CONFIG = {"arch": os.environ.get("AITER_STANDIN_GFX", "gfx950"), "cu_num": None}
CALLS: list[dict] = []


def configure(arch: str | None = None, cu_num: int | None = None) -> None:
    """Pretend to be ``arch`` with ``cu_num`` CUs (default: the flagship part's)."""
    from . import dtypes

    if arch is not None:
        if arch not in ARCH_CU:
            raise ValueError(arch)
        _CONFIG["arch"] = arch
    _CONFIG["cu_num"] = cu_num
    dtypes.fp8 = dtypes.get_dtype_fp8()


def get_gfx() -> str:
    return _CONFIG["arch"]


def get_cu_num() -> int:
    return _CONFIG["cu_num"] or ARCH_CU[_CONFIG["arch"]]


def reset_calls() -> None:
    CALLS.clear()


def record(name: str, **info) -> None:
    CALLS.append(dict(name=name, **info))


def calls(name: str | None = None) -> list[dict]:
    return [c for c in CALLS if name is None or c["name"] == name]


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


def scalar(x) -> float | None:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def dequant(t: torch.Tensor, s) -> torch.Tensor:
    """float32 view; fp8 values are multiplied by their per-tensor scale."""
    y = t.float()
    if is_fp8(t) and s is not None:
        y = y * scalar(s)
    return y


def fill_unwritten(t: torch.Tensor) -> torch.Tensor:
    """What ``torch.empty`` may hold, made deterministic and loud: NaN (floats) / -7 (ints)."""
    return t.fill_(float("nan") if t.is_floating_point() else -7)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale):
    """Exact softmax attention in float32.

    q ``[R, H, Dk]``, k ``[N, Dk]``, v ``[N, Dv]`` (one shared KV head), visible ``[R, N]``.
    Returns ``out [R, H, Dv]`` (0 for empty rows) and ``lse [R, H]`` (natural; -inf if empty).
    """
    if k.shape[0] == 0:  # an empty sequence: nothing to attend
        r, h = q.shape[:2]
        return (torch.zeros((r, h, v.shape[-1]), dtype=torch.float32, device=q.device),
                torch.full((r, h), -math.inf, dtype=torch.float32, device=q.device))
    s = torch.einsum("rhd,nd->rhn", q, k) * scale
    s = torch.where(visible[:, None, :], s, torch.full_like(s, -math.inf))
    m = s.amax(-1)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])
    z = p.sum(-1)
    empty = z == 0
    safe = torch.where(empty, torch.ones_like(z), z)
    out = torch.einsum("rhn,nd->rhd", p, torch.where(visible.any(0)[:, None], v,
                                                       torch.zeros_like(v))) / safe[..., None]
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(z, -math.inf), m_safe + torch.log(safe))
    return out, lse


def ints(t) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def expect(t, name: str, dtypes=None, ndim: int | None = None, shape=None,
           contiguous: bool = False, device=None) -> None:
    """Argument checks in the spirit of AITER's ``TORCH_CHECK``s (raise ``RuntimeError``).

    ``shape`` entries may be ``None`` (any size).
    """
    if not isinstance(t, torch.Tensor):
        raise RuntimeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dts = dtypes if isinstance(dtypes, (tuple, list, set)) else (dtypes,)
        if t.dtype not in dts:
            raise RuntimeError(f"{name} has dtype {t.dtype}, expected one of {tuple(dts)}")
    if ndim is not None and t.dim() != ndim:
        raise RuntimeError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(w is not None and int(g) != int(w)
                                        for g, w in zip(t.shape, shape)):
            raise RuntimeError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if contiguous and not t.is_contiguous():
        raise RuntimeError(f"{name} must be contiguous")
    if device is not None and t.device != device:
        raise RuntimeError(f"{name} is on {t.device}, expected {device}")


def expect_int(x, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, int):
        raise RuntimeError(f"{name} must be a Python int, got {type(x).__name__}")


def expect_scale(x, name: str, device=None) -> None:
    """A per-tensor fp32 scale: a 1-element float32 tensor (AITER reads it on the device)."""
    if x is None:
        return
    expect(x, name, torch.float32, device=device)
    if x.numel() != 1:
        raise RuntimeError(f"{name} must hold one element, got shape {tuple(x.shape)}")
