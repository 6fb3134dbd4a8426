"""The Triton row step (kernels/row_step_triton.py), run by Triton's interpreter, against the torch row step
(_row_step.py, the spec)."""

import pytest
import torch

from conftest import POISON, random_chunk
from cosdistill.testing import (
    COSINE_TORCH_ROW_STEP,
    COSINE_TRITON_ROW_STEP,
    RowStepConstants,
    rel_err,
    row_grad_triton,
    row_stats_triton,
    row_step_torch,
    row_step_triton,
    scale_and_softcap,
    with_teacher_products,
)


def term_bound(student, constants):
    """Per row, a bound on the size of the terms each gradient entry sums: weight_hard * (p + 1) and
    weight_soft * beta * (|t_v| / (|s| |t|) + |cos| |s_v| / |s|^2) <= 2 |weight_soft * beta| / |s|."""
    s = scale_and_softcap(student.double(), constants.student_logit_scale, constants.student_softcap)
    soft = 2 * abs(constants.weight_soft * constants.beta) / s.norm(dim=1).clamp(min=1e-30)
    return ((2 * abs(constants.weight_hard) + soft) * abs(constants.student_logit_scale)).clamp(min=1.0).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "vocab_student, vocab_teacher, block",
    [(1, 1, 16), (5, 5, 16), (97, 97, 32), (97, 131, 32), (300, 301, 64), (257, 1000, 128), (64, 64, 64)],
)
@pytest.mark.parametrize("write_grad", [True, False])
@pytest.mark.parametrize("softcaps, logit_scales", [((None, None), (1.0, 1.0)), ((4.0, 6.0), (0.5, 1.5))])
def test_triton_row_step_matches_torch(dtype, vocab_student, vocab_teacher, block, write_grad, softcaps, logit_scales):
    rows = 11
    student, teacher, labels = random_chunk(rows, vocab_student, vocab_teacher, dtype)
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=0.6, temperature=1.7, ignore_index=-7,
                           student_softcap=softcaps[0], teacher_softcap=softcaps[1],
                           student_logit_scale=logit_scales[0], teacher_logit_scale=logit_scales[1])
    expected_grad, expected_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_torch(expected_grad, teacher, labels, constants, expected_losses, write_grad)
    got_grad, got_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_triton(got_grad, teacher, labels, constants, got_losses, write_grad, block_size=block)

    assert not (got_losses == POISON).any()
    torch.testing.assert_close(got_losses, expected_losses, rtol=2e-5, atol=2e-5)
    if write_grad:
        assert not (got_grad == POISON).any()
        # atol covers entries that cancel to ~0 (p = 1 when V = 1, cos = 1): the rounding of the terms
        # that cancel, whose size the row's bound on them gives (the soft term's grows as 1 / |s|).
        rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 1e-4)
        error_bound = atol * term_bound(student, constants)[:, None] + rtol * expected_grad.float().abs()
        assert ((got_grad.float() - expected_grad.float()).abs() <= error_bound).all()
        ignored = labels == -7
        assert torch.count_nonzero(got_grad[ignored]) == 0
    else:
        assert torch.equal(got_grad, student)  # the logits are left alone when no gradient is wanted


def test_softcap_of_logits_small_against_the_cap():
    """fp32 rows whose logits are 1e-5..10 times the cap (Gemma-2's 30): tanh(a) must keep its relative
    accuracy as a -> 0, where 1 - exp(-2a) would cancel (the Triton kernel's tanh, before its Taylor
    branch, erred by ~6e-8 / a: 3e-4 in these losses; a property test found 1.3e-5 in a soft loss)."""
    rows, vocab, cap = 12, 97, 30.0
    row_scales = cap * torch.logspace(-5, 1, rows)[:, None]
    student = torch.randn(rows, vocab) * row_scales
    teacher = torch.randn(rows, vocab) * row_scales.flip(0)
    labels = torch.randint(0, vocab, (rows,))
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=0.6, temperature=1.0, ignore_index=-7,
                           student_softcap=cap, teacher_softcap=cap)
    expected_grad, expected_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_torch(expected_grad, teacher, labels, constants, expected_losses, True)
    got_grad, got_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_triton(got_grad, teacher, labels, constants, got_losses, True, block_size=32)
    torch.testing.assert_close(got_losses, expected_losses, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-6 * expected_grad.abs().amax().item())


def test_triton_row_step_on_strided_rows():
    """Rows of a larger buffer (row stride > vocab), as the chunk loop's last, short chunk produces."""
    student, teacher, labels = random_chunk(6, 80, 90, torch.float32)
    wide_student = torch.full((6, 100), POISON)
    wide_student[:, :80] = student
    constants = RowStepConstants(0.5, 0.5, 0.5, 1.0, -7)
    expected_grad, expected_losses = student.clone(), torch.empty(6, 2)
    row_step_torch(expected_grad, teacher, labels, constants, expected_losses, True)
    got_losses = torch.empty(6, 2)
    row_step_triton(wide_student[:, :80], teacher, labels, constants, got_losses, True, block_size=32)
    torch.testing.assert_close(got_losses, expected_losses)
    torch.testing.assert_close(wide_student[:, :80], expected_grad)
    assert (wide_student[:, 80:] == POISON).all()  # nothing written past the row's vocabulary


def test_out_of_range_labels_count_as_ignored_in_the_kernel():
    """The API raises on them, but only after the first chunk's row step is queued: it must not read out of bounds."""
    student, teacher, labels = random_chunk(5, 40, 40, torch.float32)
    labels[1], labels[3] = 40, -3
    constants = RowStepConstants(0.5, 0.5, 0.5, 1.0, -7)
    expected_grad, expected_losses = student.clone(), torch.empty(5, 2)
    row_step_torch(expected_grad, teacher, labels, constants, expected_losses, True)
    got_grad, got_losses = student.clone(), torch.empty(5, 2)
    row_step_triton(got_grad, teacher, labels, constants, got_losses, True, block_size=16)
    assert (expected_losses[[1, 3]] == 0).all() and torch.count_nonzero(expected_grad[[1, 3]]) == 0
    torch.testing.assert_close(got_losses, expected_losses)
    torch.testing.assert_close(got_grad, expected_grad)


def test_triton_statistics_and_gradient_kernels_match_the_fused_kernel():
    student, teacher, labels = random_chunk(7, 300, 301, torch.bfloat16)
    constants = RowStepConstants(0.37, 0.81, 0.6, 1.7, -7)
    fused_grad, fused_losses = student.clone(), torch.full((7, 2), POISON)
    row_step_triton(fused_grad, teacher, labels, constants, fused_losses, True, block_size=64)
    split_grad, split_losses = student.clone(), torch.full((7, 2), POISON)
    stats = row_stats_triton(split_grad, teacher, labels, constants, block_size=64)
    row_grad_triton(split_grad, teacher, labels, stats, constants, split_losses, True, block_size=64)
    assert torch.equal(split_losses, fused_losses) and torch.equal(split_grad, fused_grad)


@pytest.mark.parametrize("vocab, block", [(96, 32), (97, 32), (64, 64), (65, 64)])
def test_label_entry_in_whole_blocks_and_in_the_partial_last_block(vocab, block):
    """The kernel streams whole blocks without masks and the last, partial one with them, and stores the
    label's entry (softmax minus one) after the loop: labels at the first and last column and on both
    sides of a block boundary, each in a row of its own; an ignored row gets zeros even from
    non-finite logits (no 0 * inf)."""
    columns = [0, vocab - 1, block - 1, min(block, vocab - 1), vocab // 2]
    rows = len(columns) + 1
    student, teacher, _ = random_chunk(rows, vocab, vocab, torch.float32)
    labels = torch.tensor(columns + [-7])
    student[-1, 3] = float("inf")
    constants = RowStepConstants(0.7, 0.4, 0.6, 1.3, -7)
    expected_grad, expected_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_torch(expected_grad, teacher, labels, constants, expected_losses, True)
    got_grad, got_losses = student.clone(), torch.full((rows, 2), POISON)
    row_step_triton(got_grad, teacher, labels, constants, got_losses, True, block_size=block)
    torch.testing.assert_close(got_losses, expected_losses, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_grad[-1], torch.zeros(vocab))
    label_entries = got_grad[torch.arange(len(columns)), labels[:-1]]
    assert (label_entries < 0).all()  # the one-hot's -weight_hard dominates the label's entry


def test_row_step_without_teacher_logits_matches_torch():
    """The row step's two stages with teacher_logits None, Triton against the torch spec."""
    rows, vocab = 13, 300
    student = (torch.randn(rows, vocab) * 3).bfloat16()
    labels = torch.randint(0, vocab, (rows,))
    labels[::4] = -100
    constants = RowStepConstants(0.4, 0.6, 0.5, 1.5, -100, student_logit_scale=0.7)
    dot, sum_sq_teacher = torch.randn(rows) * 20, torch.rand(rows) * 100 + 1
    results = []
    for row_step in (COSINE_TORCH_ROW_STEP, COSINE_TRITON_ROW_STEP):
        logits = student.clone()
        losses = torch.full((rows, 2), float("nan"))
        stats = with_teacher_products(row_step.stats(logits, None, labels, constants), dot, sum_sq_teacher, constants)
        row_step.grad(logits, None, labels, stats, constants, losses, True)
        results.append((losses, logits.float()))
    (torch_losses, torch_grad), (triton_losses, triton_grad) = results
    assert rel_err(triton_losses, torch_losses) < 1e-6
    assert rel_err(triton_grad, torch_grad) < 1e-2  # bf16 storage of either
