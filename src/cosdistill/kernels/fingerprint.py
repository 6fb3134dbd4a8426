"""The fingerprint of ``_fingerprint.py`` in one Triton kernel: the same numbers as its torch spec, in one read."""

import torch
import triton
import triton.language as tl

from .._fingerprint import LANE_KEYS, MIX, as_words, lanes_of
from . import TRITON_OPTIONS


@triton.jit
def _shift_right(bits, SHIFT: tl.constexpr):
    """bits >> SHIFT as an unsigned 32-bit word's (a logical shift), for int32 bits."""
    return (bits.to(tl.uint32, bitcast=True) >> SHIFT).to(tl.int32, bitcast=True)


@triton.jit
def _mix(bits, MIX: tl.constexpr):
    """_fingerprint.mix_words_torch on int32 words, wrapping mod 2^32."""
    bits = bits * MIX[0]
    bits = bits ^ _shift_right(bits, MIX[1])
    bits = bits * MIX[2]
    return bits ^ _shift_right(bits, MIX[3])


@triton.jit
def _key(positions, MULTIPLIER: tl.constexpr, INCREMENT: tl.constexpr, MIX: tl.constexpr):
    """_fingerprint._keys on int32 positions: odd, wrapping mod 2^32."""
    return _mix(positions * MULTIPLIER + INCREMENT, MIX) | 1


@triton.jit
def _fingerprint_kernel(words_ptr, rows, cols, stride_row, stride_col, partials_ptr, KEYS_0: tl.constexpr,
                        KEYS_1: tl.constexpr, MIX: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """partials[program] = both lanes over BLOCK_ROWS rows, in int32 arithmetic (wrapping: mod 2^32). The
    column sums are kept per column until the end: one multiply-add per word and lane in the loop."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offsets = tl.arange(0, BLOCK_COLS)
    inner_0 = tl.zeros([BLOCK_ROWS, BLOCK_COLS], tl.int32)
    inner_1 = tl.zeros([BLOCK_ROWS, BLOCK_COLS], tl.int32)
    for start in range(0, cols, BLOCK_COLS):
        col = start + offsets
        inside = (row < rows)[:, None] & (col < cols)[None, :]
        pointers = words_ptr + row.to(tl.int64)[:, None] * stride_row + col[None, :].to(tl.int64) * stride_col
        bits = _mix(tl.load(pointers, mask=inside, other=0).to(tl.int32), MIX)  # mix(0) = 0
        inner_0 += bits * _key(col, KEYS_0[2], KEYS_0[3], MIX)[None, :]
        inner_1 += bits * _key(col, KEYS_1[2], KEYS_1[3], MIX)[None, :]
    lane_0 = tl.sum(tl.sum(inner_0, axis=1) * _key(row, KEYS_0[0], KEYS_0[1], MIX), axis=0)
    lane_1 = tl.sum(tl.sum(inner_1, axis=1) * _key(row, KEYS_1[0], KEYS_1[1], MIX), axis=0)
    tl.store(partials_ptr + 2 * tl.program_id(0), lane_0)
    tl.store(partials_ptr + 2 * tl.program_id(0) + 1, lane_1)


BLOCK_ROWS, BLOCK_COLS, WARPS = 16, 512, 8  # the tile chosen by measurement (docs/design.md)


def fingerprint_triton(weight: torch.Tensor) -> torch.Tensor:
    """fingerprint_torch's numbers in one Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    words = as_words(weight)
    rows, cols = words.shape
    programs = max(1, triton.cdiv(rows, BLOCK_ROWS))
    partials = torch.empty(programs, 2, dtype=torch.int32, device=words.device)
    _fingerprint_kernel[(programs,)](words, rows, cols, words.stride(0), words.stride(1), partials, LANE_KEYS[0],
                                     LANE_KEYS[1], MIX, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, num_warps=WARPS,
                                     **TRITON_OPTIONS)
    return lanes_of(partials)


@triton.jit
def _stale_check_kernel(partials_ptr, count, expected_ptr, changed_ptr, poison_ptr, BLOCK: tl.constexpr):
    """changed = whether the partial lanes' sums mod 2^32 differ from expected's lanes; poison = NaN if so, else 0.
    One program."""
    offsets = tl.arange(0, BLOCK)
    lane_0 = tl.zeros([BLOCK], tl.int64)
    lane_1 = tl.zeros([BLOCK], tl.int64)
    for start in range(0, count, BLOCK):
        index = start + offsets
        inside = index < count
        lane_0 += tl.load(partials_ptr + 2 * index, mask=inside, other=0).to(tl.int64)
        lane_1 += tl.load(partials_ptr + 2 * index + 1, mask=inside, other=0).to(tl.int64)
    # int64 sums of int32 partials do not overflow; their low 32 bits (the int32 cast keeps those) are the lanes
    changed = ((tl.sum(lane_0, axis=0).to(tl.int32) != tl.load(expected_ptr).to(tl.int32))
               | (tl.sum(lane_1, axis=0).to(tl.int32) != tl.load(expected_ptr + 1).to(tl.int32)))
    tl.store(changed_ptr, changed.to(tl.int32))
    tl.store(poison_ptr, tl.where(changed, float("nan"), 0.0))


# Wide: the one program's loads wait in turn, and the JSD's hashing step leaves one partial per block
STALE_CHECK_BLOCK, STALE_CHECK_WARPS = 4096, 8


def stale_check_triton(partials: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_fingerprint.stale_check_torch in one kernel: (changed, 0-d int32; poison, 0-d fp32)."""
    partials = partials.reshape(-1, 2)
    changed = torch.empty((), dtype=torch.int32, device=partials.device)
    poison = torch.empty((), dtype=torch.float32, device=partials.device)
    _stale_check_kernel[(1,)](partials, partials.shape[0], expected, changed, poison, BLOCK=STALE_CHECK_BLOCK,
                              num_warps=STALE_CHECK_WARPS, **TRITON_OPTIONS)
    return changed, poison
