"""A hash of a tensor's bits, computed on its device: how a cached value derived from a weight proves
that the weight's contents have not changed (_weight_cache.py).

The weight is read as a matrix of 32-bit words b[r, c] (two bf16 or fp16 elements each where its rows
allow, else one 16-bit element each, sign-extended; fp32 elements as they are). Each word is first mixed,
m = mix(b) (multiply, xor-shift, multiply, xor-shift: a bijection of 32-bit words), and each lane of the hash is

    sum over r of  row_key(r) * (sum over c of m[r, c] * column_key(c))   mod 2^32

with odd 32-bit keys, key(i) = mix(i * multiplier + increment) | 1. Changing any one word changes every lane:
mix and multiplying by an odd number are bijections mod 2^32, so a changed word always changes its term.
The mix makes a structured edit's changes depend on the words it changes: unmixed, edits that move only the
words' top bits or add one power of two to every word cancel in the sums (two sign flips add 2^31 twice;
doubling a power-of-two-shaped fp32 head adds 2^23 to each word), and with one multiply after a xor-shift by 16
the same sign flip in both halves of a word changed it by a constant, 2^31 + 2^16. Mixed positions make the
keys unrelated: keys linear in the position agree in their low 16 bits for rows 2^16 apart, so such constant
changes in two rows that far apart cancelled in both lanes about half the time. Two lanes with different keys
then make an accidental match of a larger change about 2^-64 likely. Integer sums do not depend on their
order, so the hash is exact and reproducible.

``fingerprint_torch`` is the spec and the CPU path; its products mod 2^32 are taken from 16-bit halves,
whose sums float64 matrix products give exactly. Its Triton twin (kernels/fingerprint.py) computes the
same numbers in one read, with int32 arithmetic that wraps mod 2^32. ``stale_check_torch`` compares a hash
with the one kept, on the device (its Triton twin in one launch).
"""

import torch

MASK = 2**32 - 1
# Per lane: (row multiplier, row increment, column multiplier, column increment) of the keys mod 2^32, as
# signed int32 values (the Triton kernel's arithmetic).
LANE_KEYS = ((-1640531535, 2135587861, -2048144789, 1013904223), (-1028477387, 374761393, 668265261, -1150833019))
ROWS_PER_SLICE = 1024  # the spec's float64 copies of the rows: bounded memory
# mix(b): b *= MIX[0]; b ^= b >> MIX[1]; b *= MIX[2]; b ^= b >> MIX[3] (products mod 2^32, shifts of the unsigned
# word); the multipliers as signed int32 values, as the keys
MIX = (0x7FEB352D, 16, 0x846CA68B - 2**32, 15)


def as_words(weight: torch.Tensor) -> torch.Tensor:
    """The weight's bits as a 2-D int32 or int16 tensor, without a copy where its rows are contiguous (and it is not
    a lazily negated view, whose bits are those of its negation: it is copied)."""
    words = weight.detach().resolve_neg()
    words = words.reshape(words.shape[0], -1) if words.dim() != 2 else words
    if words.element_size() == 4:
        return words.view(torch.int32)
    return words.view(torch.int32) if in_pairs(words) else words.view(torch.int16)


def in_pairs(words: torch.Tensor) -> bool:
    """Whether a 2-D 16-bit tensor's elements are read two to a 32-bit word (its layout allows it)."""
    return (words.stride(-1) == 1 and words.shape[1] % 2 == 0 and words.stride(0) % 2 == 0
            and words.data_ptr() % 4 == 0)


def lanes_of(partials: torch.Tensor) -> torch.Tensor:
    """The hash from partial lanes [..., 2] (the kernels' int32 per program or block, wrapped mod 2^32; or the
    lanes themselves, [2] int64): [2] int64."""
    # a negative partial is its lane less 2^32: the same mod 2^32
    return partials.reshape(-1, 2).sum(0, dtype=torch.int64) & MASK


def hash_differs(partials: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Whether the hash of ``partials`` (as ``lanes_of``'s) differs from the kept lanes ``expected``: 0-d bool."""
    return (lanes_of(partials) != expected).any()


def stale_check_torch(partials: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(changed, poison) on the device: changed as ``hash_differs``; poison 0-d fp32, NaN where it is true, else 0."""
    changed = hash_differs(partials, expected)
    return changed, torch.where(changed, float("nan"), 0.0)


def _keys(positions: torch.Tensor, multiplier: int, increment: int) -> torch.Tensor:
    """Odd keys in [0, 2^32), int64."""
    return mix_words_torch(positions * (multiplier & MASK) + (increment & MASK)) | 1


def mix_words_torch(bits: torch.Tensor) -> torch.Tensor:
    """mix of each word's 32 bits (int64 holding signed or unsigned 32-bit values): int64 in [0, 2^32)."""
    words = bits & MASK
    for multiplier, shift in (MIX[:2], MIX[2:]):
        words = _times_mod(words, words.new_tensor(multiplier & MASK))
        words = words ^ (words >> shift)
    return words


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
        bits = mix_words_torch(words[start : start + ROWS_PER_SLICE].to(torch.int64))
        low, high = (bits & 0xFFFF).double(), (bits >> 16).double()
        shifted = (high @ key_low + low @ key_high).long() & 0xFFFF
        inner = ((low @ key_low).long() + (shifted << 16)) & MASK  # [n, lanes]
        row = torch.arange(start, start + len(bits), device=device)
        row_keys = torch.stack([_keys(row, *lane[:2]) for lane in LANE_KEYS], 1)
        lanes += _times_mod(inner, row_keys).sum(0)
    return lanes & MASK
