"""The FP8 teacher's per-token quantization in one Triton kernel: the twin of ``_teacher_fp8.quantize_rows``.

torch's version launches four kernels per teacher sub-chunk (the max norm, two on the scales, the
division); this one reads each row, keeps its max in registers, writes the scale and reads the row
again (from L1/L2: a row is a few KB) to store the FP8 codes. Same formula, same codes (docs/design.md,
The FP8 teacher)."""

import torch
import triton
import triton.language as tl

from .._teacher_fp8 import FP8_MAX
from . import TRITON_OPTIONS
from .triton_common import FLOAT32_TINY, INTERPRET

FP8_MAX_CONST: tl.constexpr = tl.constexpr(FP8_MAX)  # a jit global must be a constexpr
BLOCK = 1024  # columns per step: a 4096-wide row in four
WARPS = 4


@triton.jit
def _to_fp8(x):
    """x (fp32, |x| <= FP8_MAX) in e4m3, rounded to nearest even as torch's cast rounds. The
    interpreter's cast (Triton 3.9) rounds ties up, drops the carry into the exponent (1.99 -> 1.0) and
    turns NaNs into numbers, so there x is first rounded on the e4m3 grid in fp32, which that cast then
    takes exactly."""
    if INTERPRET:
        # normal e4m3 (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, ties to even, carry included
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        # subnormal e4m3: multiples of 2^-9; adding 1.5 * 2^23 rounds |x| * 2^9 to an integer, ties to
        # even; the sign is put back from the bits, so that -0.0 and small negatives round to -0.0
        magnitude = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) / 512.0
        subnormal = tl.where(bits < 0, -magnitude, magnitude)
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
        # and a NaN with its top mantissa bits set, which that cast maps to e4m3's NaN code
        x = tl.where(x != x, tl.full(x.shape, 0x7FF00000, tl.int32).to(tl.float32, bitcast=True), x)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(rows, row_stride, out, out_stride, scales, scale_stride, hidden, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    source, target = rows + row * row_stride, out + row * out_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    nans = tl.zeros([BLOCK], dtype=tl.int32)  # tl.maximum and tl.max may drop a NaN: count them
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(source + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
        nans += (x != x).to(tl.int32)
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_CONST), FLOAT32_TINY)  # zero rows stay zero
    scale = tl.where(tl.sum(nans, axis=0) > 0, float("nan"), scale)  # as torch's: a NaN row gets NaN codes
    tl.store(scales + row * scale_stride, scale)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(source + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        # |x / scale| <= FP8_MAX (to rounding, which the cast takes back to FP8_MAX): no saturation
        tl.store(target + cols, _to_fp8(tl.math.div_rn(x, scale)), mask=cols < hidden)


def quantize_rows_triton(rows: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """As _teacher_fp8.quantize_rows: out[i] = rows[i] / scales[i] in FP8, scales[i] = max |rows[i]| / FP8_MAX."""
    if rows.shape[0] == 0:
        return
    if rows.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"quantize_rows_triton needs unit column strides, got rows {rows.stride()} and out {out.stride()}")
    _quantize_rows_kernel[(rows.shape[0],)](
        rows, rows.stride(0), out, out.stride(0), scales, scales.stride(0), rows.shape[1], BLOCK=BLOCK, num_warps=WARPS,
        **TRITON_OPTIONS,
    )
