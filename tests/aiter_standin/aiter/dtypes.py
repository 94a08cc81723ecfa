"""``aiter.dtypes``: torch dtypes by AITER's names; ``fp8`` follows the (pretend) arch."""

import torch

from ._standin import get_gfx

defaultDtypes = {"gfx942": {"fp8": torch.float8_e4m3fnuz}, "gfx950": {"fp8": torch.float8_e4m3fn}}


def get_dtype_fp8():
    return defaultDtypes[get_gfx()]["fp8"]


fp8 = get_dtype_fp8()
fp16 = torch.float16
bf16 = torch.bfloat16
fp32 = torch.float32
u32 = torch.uint32
i32 = torch.int32
i16 = torch.int16
i8 = torch.int8
u8 = torch.uint8
i64 = torch.int64
u64 = torch.uint64
