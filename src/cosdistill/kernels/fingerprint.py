"""The fingerprint of ``_fingerprint.py`` in one Triton kernel: the same numbers as its torch spec, in one read."""

import torch
import triton
import triton.language as tl

from .._fingerprint import LANE_KEYS, as_words, lanes_of


@triton.jit
def _fingerprint_kernel(words_ptr, rows, cols, stride_row, stride_col, partials_ptr, KEYS_0: tl.constexpr,
                        KEYS_1: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
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
        bits = tl.load(pointers, mask=inside, other=0).to(tl.int32)
        inner_0 += bits * ((col * KEYS_0[2] + KEYS_0[3]) | 1)[None, :]
        inner_1 += bits * ((col * KEYS_1[2] + KEYS_1[3]) | 1)[None, :]
    lane_0 = tl.sum(tl.sum(inner_0, axis=1) * ((row * KEYS_0[0] + KEYS_0[1]) | 1), axis=0)
    lane_1 = tl.sum(tl.sum(inner_1, axis=1) * ((row * KEYS_1[0] + KEYS_1[1]) | 1), axis=0)
    tl.store(partials_ptr + 2 * tl.program_id(0), lane_0)
    tl.store(partials_ptr + 2 * tl.program_id(0) + 1, lane_1)


BLOCK_ROWS, BLOCK_COLS, WARPS = 16, 512, 8  # the fastest tile measured on the H200 (docs/design.md)


def fingerprint_triton(weight: torch.Tensor) -> torch.Tensor:
    """fingerprint_torch's numbers in one Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    words = as_words(weight)
    rows, cols = words.shape
    programs = max(1, triton.cdiv(rows, BLOCK_ROWS))
    partials = torch.empty(programs, 2, dtype=torch.int32, device=words.device)
    _fingerprint_kernel[(programs,)](words, rows, cols, words.stride(0), words.stride(1), partials, LANE_KEYS[0],
                                     LANE_KEYS[1], BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, num_warps=WARPS)
    return lanes_of(partials)
