"""The row step's spec (_row_step.py), held by each implementation: a vocabulary split's statistics combine
to the whole row's step, and fp16 rows are lifted out of fp16's subnormals and kept below its largest value."""

from dataclasses import replace

import pytest
import torch

from conftest import POISON, TOLERANCE, random_chunk, rel_err
from cosdistill.testing import (
    COSINE_TORCH_ROW_STEP,
    COSINE_TRITON_ROW_STEP,
    RowStepConstants,
    combine_row_stats,
    row_step_torch,
    row_step_triton,
)


def shard_bounds(vocab_teacher, shards, generator):
    """Random contiguous split of [0, Vt) into `shards` pieces (some may hold no student columns)."""
    cuts = torch.randperm(vocab_teacher - 1, generator=generator)[: shards - 1] + 1
    edges = [0, *sorted(cuts.tolist()), vocab_teacher]
    return list(zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("impl_name", ["torch", "triton"])
@pytest.mark.parametrize("vocab_student, vocab_teacher, shards", [(97, 97, 2), (61, 131, 3), (40, 200, 4), (7, 7, 7)])
@pytest.mark.parametrize("softcaps", [(None, None), (4.0, 6.0)])
def test_statistics_of_vocabulary_shards_combine_to_the_whole_row_step(impl_name, vocab_student, vocab_teacher,
                                                                       shards, softcaps):
    """Each shard's statistics, combined, then each shard's gradient: the unsplit row step, column for column."""
    impl = {"torch": COSINE_TORCH_ROW_STEP, "triton": COSINE_TRITON_ROW_STEP}[impl_name]
    generator = torch.Generator().manual_seed(vocab_teacher * shards)
    rows = 9
    student, teacher, labels = random_chunk(rows, vocab_student, vocab_teacher, torch.float32)
    constants = RowStepConstants(0.4, 0.7, 0.6, 1.3, -7, student_softcap=softcaps[0], teacher_softcap=softcaps[1])
    whole_grad, whole_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_torch(whole_grad, teacher, labels, constants, whole_losses, True)

    bounds = shard_bounds(vocab_teacher, shards, generator)
    pieces = [(student[:, start:min(stop, vocab_student)].contiguous(), teacher[:, start:stop].contiguous(),
               replace(constants, vocab_start=start, vocab_student_total=vocab_student)) for start, stop in bounds]
    stats = combine_row_stats(torch.stack([impl.stats(s, t, labels, sc) for s, t, sc in pieces]))
    for s, t, sc in pieces:
        losses = torch.full((rows, 2), POISON)
        impl.grad(s, t, labels, stats, sc, losses, True)
        torch.testing.assert_close(losses, whole_losses, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(torch.cat([s for s, _, _ in pieces], 1), whole_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl_name", ["torch", "triton"])
def test_shards_whose_sums_fit_fp32_where_their_total_does_not_combine_to_the_whole_row_step(impl_name):
    """Student logits ~9e18 over three shards of four columns: each shard's |s|^2 (~3.3e38) is in fp32's range, so
    the Triton statistics keep it unscaled, and the total is past it (it came out inf: cos 0, no soft gradient).
    The gradient is held to the whole row step's by each row's relative error: with logits equal to 1%, single
    entries are differences of near-equal terms (1e-4 of the row's size), which fp32 rounds at 1e-5 of themselves
    in about one random draw in ten."""
    impl = {"torch": COSINE_TORCH_ROW_STEP, "triton": COSINE_TRITON_ROW_STEP}[impl_name]
    rows, vocab = 5, 12
    student = 9e18 * (1 + 0.01 * torch.rand(rows, vocab))
    teacher, labels = torch.randn(rows, vocab), torch.randint(0, vocab, (rows,))
    constants = RowStepConstants(0.3, 1.0, 0.5, 1.0, -7)
    whole_grad, whole_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_torch(whole_grad, teacher, labels, constants, whole_losses, True)
    pieces = [(student[:, start:start + 4].contiguous(), teacher[:, start:start + 4].contiguous(),
               replace(constants, vocab_start=start, vocab_student_total=vocab)) for start in (0, 4, 8)]
    shard_stats = torch.stack([impl.stats(s, t, labels, sc) for s, t, sc in pieces])
    stats = combine_row_stats(shard_stats)
    assert torch.isfinite(stats).all()
    for s, t, sc in pieces:
        losses = torch.full((rows, 2), POISON)
        impl.grad(s, t, labels, stats, sc, losses, True)
        torch.testing.assert_close(losses, whole_losses, rtol=1e-5, atol=0)
    combined = torch.cat([s for s, _, _ in pieces], 1)
    assert max(rel_err(got, want) for got, want in zip(combined, whole_grad)) < TOLERANCE[torch.float32][1]


@pytest.mark.parametrize("weights", [(0.0, 0.05), (0.5, 0.5), (0.0, 0.0)])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_fp16_lifts_match_torch_and_keep_gradients_in_fp16_range(weights, softcap):
    """fp16: each row's gradient times 2^k (row_step.row_lift_bound, lift_for), the same in both twins.
    A soft term alone at V = 3000 has entries ~1e-5 (subnormal in fp16): lifted (k > 0) they are
    not; a student row of norm 0 has entries ~1e7, past fp16's 65504: scaled down (k < 0) they fit."""
    rows, vocab = 7, 3000
    student, teacher, labels = random_chunk(rows, vocab, vocab, torch.float16)
    student[2] = 0.0
    labels[2] = 5  # counted
    constants = RowStepConstants(weights[0], weights[1], beta=0.8, temperature=1.3, ignore_index=-7,
                           student_softcap=softcap)
    plain_grad, plain_losses = student.float(), torch.empty(rows, 2)
    row_step_torch(plain_grad, teacher.float(), labels, constants, plain_losses, True)  # fp32: all in range
    results = {}
    for name, step in (("torch", row_step_torch), ("triton", row_step_triton)):
        grad, losses, lifts = student.clone(), torch.empty(rows, 2), torch.full((rows,), POISON)
        step(grad, teacher, labels, constants, losses, True, lifts)
        results[name] = grad, lifts
        exponents = torch.log2(lifts)
        assert torch.equal(exponents, exponents.round()) and exponents.max() <= 10
        if weights == (0.0, 0.05):
            assert (lifts[[0, 1, 3, 4, 5, 6]] >= 2**8).all(), lifts  # lifted far from fp16's subnormals
        if weights != (0.0, 0.0):
            assert lifts[2] <= 2**-6, lifts  # scaled down: entries ~weight_soft * beta / eps
        assert torch.isfinite(grad).all()
        valid = labels != -7
        unlifted = grad.float() / lifts[:, None]
        # entries below the lifted row's subnormal step 2^-24 (a softmax tail next to a -1) stay lost
        atol = 2**-24 / lifts[valid, None]
        assert ((unlifted[valid] - plain_grad[valid]).abs() <= 2e-3 * plain_grad[valid].abs() + atol).all()
    assert torch.equal(results["torch"][1], results["triton"][1])
    torch.testing.assert_close(results["triton"][0].float(), results["torch"][0].float(), rtol=1e-2, atol=1e-4)
