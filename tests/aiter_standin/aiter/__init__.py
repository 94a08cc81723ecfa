"""A faithful stand-in for ROCm/aiter's Python API (jax_mla tests only; see ``_standin``)."""

from . import _standin
from . import dtypes as dtypes
from . import mla as mla
from ._standin import CALLS, calls, configure, get_cu_num, get_gfx, reset_calls
from .ops.attention import (
    get_mla_metadata_info_v1,
    get_mla_metadata_v1,
    get_ps_metadata_info_v1,
    get_ps_metadata_v1,
    mla_prefill_ps_asm_fwd,
    mla_reduce_v1,
)
from .ops.mha import flash_attn_varlen_func

__version__ = "0.0.0+jax_mla.standin"
STANDIN = True

__all__ = [
    "CALLS", "calls", "configure", "dtypes", "flash_attn_varlen_func", "get_cu_num", "get_gfx",
    "get_mla_metadata_info_v1", "get_mla_metadata_v1", "get_ps_metadata_info_v1",
    "get_ps_metadata_v1", "mla", "mla_prefill_ps_asm_fwd", "mla_reduce_v1", "reset_calls",
    "_standin",
]
