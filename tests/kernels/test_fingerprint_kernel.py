"""The hash of a cached teacher weight in Triton (kernels/fingerprint.py) against its torch spec
(_fingerprint.py), bit for bit, and the spec sees any one changed element."""

import pytest
import torch

from cosdistill.testing import fingerprint_torch, fingerprint_triton, lanes_of, stale_check_torch, stale_check_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (37, 19), (300, 48), (17, 1030)])
def test_the_triton_fingerprint_is_the_torch_spec_and_sees_any_one_changed_element(dtype, shape):
    weight = torch.randn(shape).to(dtype)
    want = fingerprint_torch(weight)
    assert torch.equal(fingerprint_triton(weight), want)
    assert torch.equal(fingerprint_triton(weight.t().contiguous().t()), fingerprint_torch(weight.t().contiguous().t()))
    for index in {0, weight.numel() // 2, weight.numel() - 1}:
        changed = weight.clone()
        bits = changed.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
        bits[index] ^= 1  # one bit of one element
        assert not torch.equal(fingerprint_torch(changed), want)
        assert torch.equal(fingerprint_triton(changed), fingerprint_torch(changed))
    swapped = weight.clone()
    swapped[[0, -1]] = swapped[[-1, 0]]
    assert shape[0] == 1 or torch.equal(swapped, weight) or not torch.equal(fingerprint_torch(swapped), want)


def _sign_flips(weight, indices):
    changed = weight.clone()
    changed.view(-1)[indices] = -changed.view(-1)[indices]
    return changed


# Edits that only move words' top bits or add one power of two to every word: a sum of the words times odd keys
# mod 2^32 misses them (two sign flips add 2^31 twice; doubling a power-of-two-shaped fp32 head adds 2^23 to every
# word), so each word is mixed first.
STRUCTURED_EDITS = {
    "two sign flips": lambda weight: _sign_flips(weight, [0, weight.numel() - 1]),
    "two sign flips, odd columns": lambda weight: _sign_flips(weight, [1, 3]),
    "every sign": torch.neg,
    "odd columns' signs": lambda weight: weight * torch.tensor([1.0, -1.0]).repeat(weight.shape[1] // 2).to(weight.dtype),
    "times 2": lambda weight: weight * 2,
    "times 0.5": lambda weight: weight * 0.5,
    "times 4": lambda weight: weight * 4,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 32), (100, 30), (256, 128)])
@pytest.mark.parametrize("edit", list(STRUCTURED_EDITS))
def test_edits_of_the_top_bits_and_powers_of_two_change_the_hash(dtype, shape, edit):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    changed = STRUCTURED_EDITS[edit](weight)
    assert not torch.equal(changed, weight)
    want = fingerprint_torch(changed)
    assert not torch.equal(want, fingerprint_torch(weight))
    assert torch.equal(fingerprint_triton(changed), want)


def test_the_same_edit_in_rows_2_to_the_16_apart_changes_the_hash():
    """Both bf16 halves of a word negated, in two rows 65536 apart (a vocabulary past 65536 rows: Llama-3's 128256):
    such an edit changed the mixed word by a constant, 2^31 + 2^16, and keys linear in the row agree mod 2^16 there,
    so the two changes cancelled in both lanes about one time in two, leaving a stale copy in use."""
    distance, pairs = 2**16, 32
    weight = torch.randn(distance + pairs, 8, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = fingerprint_torch(weight)
    words = weight.view(torch.int32)
    both_signs = torch.tensor(-0x7FFF8000, dtype=torch.int32)  # bits 31 and 15
    missed = 0
    for row in range(pairs):
        changed = weight.clone()
        changed.view(torch.int32)[[row, row + distance], row % 4] = words[[row, row + distance], row % 4] ^ both_signs
        missed += torch.equal(fingerprint_torch(changed), want)
    assert missed == 0
    small = weight[:64].clone()
    small.view(torch.int32)[[0, 63], 1] ^= both_signs
    assert torch.equal(fingerprint_triton(small), fingerprint_torch(small))


@pytest.mark.parametrize("count", [1, 3, 4096, 9001])
def test_the_triton_stale_check_is_the_torch_spec(count):
    """Partial lanes as the kernels leave them (int32, wrapped) or the lanes themselves ([2] int64): unchanged
    gives 0 and a zero poison; a hash off by one in either lane, or by 2^32 - 1, gives NaN."""
    generator = torch.Generator().manual_seed(count)
    partials = torch.randint(-2**31, 2**31, (count, 2), dtype=torch.int64, generator=generator).to(torch.int32)
    lanes = lanes_of(partials)
    for hashed in (partials, lanes):
        for expected, stale in ((lanes, False), (lanes ^ torch.tensor([1, 0]), True), (lanes ^ torch.tensor([0, 1]), True),
                                ((lanes + 2**32 - 1) % 2**32, True)):
            for changed, poison in (stale_check_triton(hashed, expected), stale_check_torch(hashed, expected)):
                assert changed.dim() == poison.dim() == 0 and poison.dtype == torch.float32
                assert bool(changed) == stale
                assert torch.isnan(poison) if stale else poison == 0


@pytest.mark.parametrize("labels", [torch.randint(-100, 50000, (37,)), torch.randint(0, 9, (6,), dtype=torch.int32),
                                    torch.zeros(0, dtype=torch.int64)], ids=["int64", "int32", "empty"])
def test_labels_and_empty_batches_hash_as_the_spec(labels):
    """The vocabulary split's check hashes labels as [T, 1] and hidden states of any T (_split_check.queue_hash_check)."""
    column = labels.reshape(-1, 1)
    assert torch.equal(fingerprint_triton(column), fingerprint_torch(column))
    if labels.numel():
        changed = column.clone()
        changed[-1] += 1
        assert not torch.equal(fingerprint_torch(changed), fingerprint_torch(column))
    empty = torch.zeros(0, 24, dtype=torch.bfloat16)
    assert torch.equal(fingerprint_triton(empty), fingerprint_torch(empty))
