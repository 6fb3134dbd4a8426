"""A hash of a tensor's bits, computed on its device: how a cached value derived from a weight proves
that the weight's contents have not changed (weight_cache.py).

The weight is read as a matrix of 16-bit words b[r, c] (bf16 and fp16 elements; fp32 elements as two
words each). Each lane of the hash is

    sum over r of  row_key(r) * (sum over c of b[r, c] * column_key(c))   mod 2^32

with odd 16-bit keys drawn from each position by a linear congruence. Changing any one word changes
every lane: the change in bits is below 2^16 in size and its key, row_key * column_key, is odd, so
their product is never a multiple of 2^32. Two lanes with different keys make an accidental match of a
larger change about 2^-64 likely. Integer sums do not depend on their order, so the hash is exact and
reproducible. ``fingerprint_torch`` is the spec (and the CPU path: the inner sums are exact float64
matrix products, each term below 2^31); the Triton kernel computes the same numbers in one read.
"""

import torch
import triton
import triton.language as tl

MASK = 2**32 - 1
# Per lane: (row multiplier, row increment, column multiplier, column increment) of the keys mod 2^16.
LANE_KEYS = ((0x9E37, 0x79B9, 0x85EB, 0xCA6B), (0xC2B3, 0xAE3D, 0x27D5, 0xEB2F))
ROWS_PER_SLICE = 1024  # the spec's float64 copy of the rows: bounded memory


def _key(position: torch.Tensor, multiplier: int, increment: int) -> torch.Tensor:
    return ((position * multiplier + increment) & 0xFFFF) | 1


def as_words(weight: torch.Tensor) -> torch.Tensor:
    """The weight's bits as a 2-D int16 tensor, without a copy where its rows are contiguous."""
    words = weight.detach()
    words = words.reshape(words.shape[0], -1) if words.dim() != 2 else words
    if words.element_size() == 4 and words.stride(-1) != 1:
        words = words.contiguous()  # an fp32 element's two words must lie side by side
    return words.view(torch.int16)


def fingerprint_torch(weight: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the weight's device, each lane in [0, 2^32)."""
    words = as_words(weight)
    rows, cols = words.shape
    column = torch.arange(cols, dtype=torch.int64, device=words.device)
    column_keys = torch.stack([_key(column, *keys[2:]) for keys in LANE_KEYS], 1).double()  # [cols, lanes]
    lanes = torch.zeros(len(LANE_KEYS), dtype=torch.int64, device=words.device)
    for start in range(0, rows, ROWS_PER_SLICE):
        inner = (words[start : start + ROWS_PER_SLICE].double() @ column_keys).long() & MASK  # exact: < 2^53
        row = torch.arange(start, start + len(inner), dtype=torch.int64, device=words.device)
        row_keys = torch.stack([_key(row, *keys[:2]) for keys in LANE_KEYS], 1)
        lanes += ((inner * row_keys) & MASK).sum(0)
    return lanes & MASK


@triton.jit
def _fingerprint_kernel(words_ptr, rows, cols, stride_row, stride_col, partials_ptr, KEYS_0: tl.constexpr,
                        KEYS_1: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """partials[program] = both lanes over BLOCK_ROWS rows, in int32 arithmetic (wrapping: mod 2^32)."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offsets = tl.arange(0, BLOCK_COLS)
    inner_0 = tl.zeros([BLOCK_ROWS], tl.int32)
    inner_1 = tl.zeros([BLOCK_ROWS], tl.int32)
    for start in range(0, cols, BLOCK_COLS):
        col = start + offsets
        inside = (row < rows)[:, None] & (col < cols)[None, :]
        pointers = words_ptr + row.to(tl.int64)[:, None] * stride_row + col[None, :].to(tl.int64) * stride_col
        bits = tl.load(pointers, mask=inside, other=0).to(tl.int32)
        inner_0 += tl.sum(bits * (((col * KEYS_0[2] + KEYS_0[3]) & 0xFFFF) | 1)[None, :], axis=1)
        inner_1 += tl.sum(bits * (((col * KEYS_1[2] + KEYS_1[3]) & 0xFFFF) | 1)[None, :], axis=1)
    lane_0 = tl.sum(inner_0 * (((row * KEYS_0[0] + KEYS_0[1]) & 0xFFFF) | 1), axis=0)
    lane_1 = tl.sum(inner_1 * (((row * KEYS_1[0] + KEYS_1[1]) & 0xFFFF) | 1), axis=0)
    tl.store(partials_ptr + 2 * tl.program_id(0), lane_0)
    tl.store(partials_ptr + 2 * tl.program_id(0) + 1, lane_1)


BLOCK_ROWS, BLOCK_COLS = 8, 512


def fingerprint_triton(weight: torch.Tensor) -> torch.Tensor:
    """fingerprint_torch's numbers in one Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    words = as_words(weight)
    rows, cols = words.shape
    programs = max(1, triton.cdiv(rows, BLOCK_ROWS))
    partials = torch.empty(programs, 2, dtype=torch.int32, device=words.device)
    _fingerprint_kernel[(programs,)](words, rows, cols, words.stride(0), words.stride(1), partials, LANE_KEYS[0],
                                     LANE_KEYS[1], BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
    return (partials.to(torch.int64) & MASK).sum(0) & MASK


def fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """The weight's hash, [2] int64, computed on its device without a host read."""
    return fingerprint_triton(weight) if weight.is_cuda else fingerprint_torch(weight)
