"""A hash of a tensor's bits, computed on its device: how a cached value derived from a weight proves
that the weight's contents have not changed (weight_cache.py).

The weight is read as a matrix of 32-bit words b[r, c] (two bf16 or fp16 elements each where its rows
allow, else one 16-bit element each; fp32 elements as they are). Each lane of the hash is

    sum over r of  row_key(r) * (sum over c of b[r, c] * column_key(c))   mod 2^32

with odd 32-bit keys drawn from each position by a linear congruence. Changing any one word changes
every lane: multiplying by an odd number is a bijection mod 2^32, so a changed word always changes its
term. Two lanes with different keys make an accidental match of a larger change about 2^-64 likely.
Integer sums do not depend on their order, so the hash is exact and reproducible.

``fingerprint_torch`` is the spec and the CPU path; its products mod 2^32 are taken from 16-bit halves,
whose sums float64 matrix products give exactly. The Triton kernel computes the same numbers in one
read, with int32 arithmetic that wraps mod 2^32.
"""

import torch
import triton
import triton.language as tl

MASK = 2**32 - 1
# Per lane: (row multiplier, row increment, column multiplier, column increment) of the keys mod 2^32, as
# signed int32 values (the Triton kernel's arithmetic).
LANE_KEYS = ((-1640531535, 2135587861, -2048144789, 1013904223), (-1028477387, 374761393, 668265261, -1150833019))
ROWS_PER_SLICE = 1024  # the spec's float64 copies of the rows: bounded memory


def as_words(weight: torch.Tensor) -> torch.Tensor:
    """The weight's bits as a 2-D int32 or int16 tensor, without a copy where its rows are contiguous."""
    words = weight.detach()
    words = words.reshape(words.shape[0], -1) if words.dim() != 2 else words
    if words.element_size() == 4:
        return words.view(torch.int32)
    pairs = (words.stride(-1) == 1 and words.shape[1] % 2 == 0 and words.stride(0) % 2 == 0
             and words.data_ptr() % 4 == 0)
    return words.view(torch.int32) if pairs else words.view(torch.int16)


def _keys(positions: torch.Tensor, multiplier: int, increment: int) -> torch.Tensor:
    """Odd keys in [0, 2^32), int64."""
    return ((positions * (multiplier & MASK) + (increment & MASK)) & MASK) | 1


def _times_mod(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left * right mod 2^32 for int64 values in [0, 2^32), exactly (through 16-bit halves)."""
    low = (left & 0xFFFF) * right
    high = (((left >> 16) * (right & 0xFFFF)) & 0xFFFF) << 16
    return (low + high) & MASK


def fingerprint_torch(weight: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the weight's device, each lane in [0, 2^32)."""
    words = as_words(weight)
    rows, cols = words.shape
    device = words.device
    column_keys = torch.stack([_keys(torch.arange(cols, device=device), *lane[2:]) for lane in LANE_KEYS], 1)
    # sum_c b k = sum_c b_lo k_lo + 2^16 (b_hi k_lo + b_lo k_hi) mod 2^32, b = b_hi 2^16 + b_lo; each sum exact
    key_low, key_high = (column_keys & 0xFFFF).double(), (column_keys >> 16).double()
    lanes = torch.zeros(len(LANE_KEYS), dtype=torch.int64, device=device)
    for start in range(0, rows, ROWS_PER_SLICE):
        bits = words[start : start + ROWS_PER_SLICE].to(torch.int64)
        low, high = (bits & 0xFFFF).double(), (bits >> 16).double()
        shifted = (high @ key_low + low @ key_high).long() & 0xFFFF
        inner = ((low @ key_low).long() + (shifted << 16)) & MASK  # [n, lanes]
        row = torch.arange(start, start + len(bits), device=device)
        row_keys = torch.stack([_keys(row, *lane[:2]) for lane in LANE_KEYS], 1)
        lanes += _times_mod(inner, row_keys).sum(0)
    return lanes & MASK


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
    return (partials.to(torch.int64) & MASK).sum(0) & MASK


def fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """The weight's hash, [2] int64, computed on its device without a host read."""
    return fingerprint_triton(weight) if weight.is_cuda else fingerprint_torch(weight)
