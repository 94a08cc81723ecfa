"""A 16-bit query split in two e4m3 parts for the Gluon fp8 kernel's ``SPLIT_Q``, in one pass.

The same values as ``backends/triton/decode.py``'s ``split_query_e4m3`` in XLA ops, bit for bit
wherever a row is finite (its docstring has the arithmetic): per row ``s``, a power of two that
puts the row's largest magnitude in ``[64, 128)``, ``hi`` the scaled row rounded to e4m3's
normal numbers (4 significant bits, ties to even; magnitudes under ``2^-6`` flushed to zero
with their sign, as ``lax.reduce_precision`` does) and ``lo`` the rest rounded to e4m3. A row
holding an infinity or a NaN gets ``s`` NaN. Both parts are rounded here, on their float32
bits, so the final conversions to e4m3 are exact (Triton's interpreter rounds subnormals
otherwise than the hardware and XLA). XLA made that four kernels on an H100 (the row
maximum, two small ones and the elementwise pass, 49.6 µs at 16384 rows of 576); this is one
read of the query and one write of the parts, and it writes the row scales after the leading
scales (the cache's ``kv_scale``) into the kernel's scale vector, so no concatenation follows.
"""

import triton
import triton.language as tl

# float32 bit patterns: the top 1 + 8 + 3 bits (sign, exponent, e4m3's mantissa) and e4m3's
# smallest normal magnitude, 2^-6.
_HI_MASK = tl.constexpr(-1048576)  # 0xFFF00000 as int32
_MIN_NORMAL = tl.constexpr(0.015625)


@triton.jit
def mla_split_query_e4m3_kernel(
    q_ptr,  # [ROWS, D] bf16 / fp16
    lead_ptr,  # [N_LEAD] float32: the scales before the rows' (kv_scale)
    parts_ptr,  # out [ROWS, 2 D] float8_e4m3fn: hi, then lo
    scales_ptr,  # out [N_LEAD + ROWS] float32
    ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
    N_LEAD: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid == 0:
        lead = tl.arange(0, N_LEAD)
        tl.store(scales_ptr + lead, tl.load(lead_ptr + lead))
    rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, BLOCK_D)
    live = rows < ROWS
    mask = live[:, None] & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    amax = tl.max(ax, axis=1)
    bad = tl.max(tl.where(mask & ~(ax < float("inf")), 1, 0), axis=1) > 0  # inf or NaN
    # The biased exponent e of the row's largest magnitude (at least 8): s = 2^(e - 133),
    # 1 / s = 2^(133 - e).
    e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 8)
    inv = ((260 - e) << 23).to(tl.float32, bitcast=True)
    s = tl.where(bad, float("nan"), ((e - 6) << 23).to(tl.float32, bitcast=True))
    y = x * inv[:, None]
    # Round to 3 mantissa bits, ties to even, on the bit pattern (|y| < 128: no carry reaches
    # the sign), then flush what falls under e4m3's normal range, keeping the sign.
    yb = y.to(tl.int32, bitcast=True)
    rb = (yb + 0x7FFFF + ((yb >> 20) & 1)) & _HI_MASK
    hi = rb.to(tl.float32, bitcast=True)
    hi = tl.where(tl.abs(hi) < _MIN_NORMAL, (rb & -2147483648).to(tl.float32, bitcast=True), hi)
    # The rest, rounded to e4m3 here (ties to even, subnormals in steps of 2^-9, the sign of a
    # zero kept) so that the conversion below is exact whatever converter runs it.
    lo = y - hi
    lb = lo.to(tl.int32, bitcast=True)
    sign = lb & -2147483648
    normal = ((lb + 0x7FFFF + ((lb >> 20) & 1)) & _HI_MASK).to(tl.float32, bitcast=True)
    steps = (tl.abs(lo) * 512.0 + 12582912.0) - 12582912.0  # rint(|lo| 2^9): 1.5 2^23 trick
    sub = ((steps * 0.001953125).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    lo = tl.where(tl.abs(lo) < _MIN_NORMAL, sub, normal)
    out = rows[:, None].to(tl.int64) * (2 * D) + cols[None, :]
    tl.store(parts_ptr + out, hi.to(tl.float8e4nv), mask=mask)
    tl.store(parts_ptr + out + D, lo.to(tl.float8e4nv), mask=mask)
    tl.store(scales_ptr + N_LEAD + rows, s, mask=live)


def launch_config(rows: int, d: int) -> tuple[tuple[int], dict]:
    """``(grid, constexprs)`` for ``rows`` rows of ``d``: four rows a program (one a warp, the
    row's columns across its lanes)."""
    per_program = 4
    return ((triton.cdiv(max(rows, 1), per_program),),
            dict(ROWS=rows, D=d, BLOCK_D=triton.next_power_of_2(d),
                 ROWS_PER_PROGRAM=per_program))
