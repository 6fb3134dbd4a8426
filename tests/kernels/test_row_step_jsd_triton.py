"""The generalized JSD's Triton row step (kernels/row_step_jsd_triton.py), run by Triton's interpreter, against
its torch spec (_row_step_jsd.py); and the kernel's variants through Triton's real compiler for Hopper."""

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import assert_rows_match, exact_reverse_kl_grad, peaked_reverse_kl_rows, run_jsd_split_stages
from cosdistill.reference import generalized_jsd
from cosdistill.testing import (
    RowStepConstants,
    kernels,
    rel_err,
    row_step_jsd_torch,
    row_step_jsd_triton,
)

jsd_kernel = kernels.row_step_jsd_triton

# numpy's overflow and invalid-value warnings inside the interpreted kernel fail the test: an inf or NaN even in
# lanes that are never stored would show, on the GPU, as one where a mask or where-clause was forgotten.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
# The peaked and extreme tests hold the kernel to float64 and to the spec (which computes in float64).
SPEC_FP32_EXTREME_TOL = (1e-5, 1e-5)  # (losses, gradient)
# Reverse KL's gradient, its sums taken against the student's largest column: the other betas' tolerance.
REVERSE_KL_PEAKED_TOL = 1e-5
IGNORE = -7
# (losses, gradient): the math is fp32 on the same inputs in both. A bf16 gradient is rounded to bf16 by both,
# but Triton's interpreter truncates where torch (and the GPU) round to nearest: up to 2^-8 per entry.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-2)}


def labels_for(rows, vocab_student, generator):
    """Random labels with one ignored, one past the vocabulary and one negative (all three count as ignored)."""
    labels = torch.randint(0, vocab_student, (rows,), generator=generator)
    labels[0], labels[3 % rows], labels[5 % rows] = IGNORE, vocab_student, -3
    return labels


def ignored(labels, vocab_student):
    return (labels == IGNORE) | (labels < 0) | (labels >= vocab_student)


def run_both(student, teacher, labels, constants, write_grad, block_size):
    """((gradient, losses) of the Triton step, the same of the spec), each from a copy of ``student`` and
    NaN-poisoned losses."""
    results = []
    for step, kwargs in ((row_step_jsd_triton, dict(block_size=block_size)), (row_step_jsd_torch, {})):
        logits, losses = student.clone(), torch.full((len(labels), 2), float("nan"))
        step(logits, teacher, labels, constants, losses, write_grad, **kwargs)
        results.append((logits, losses))
    return results


def assert_matches_spec(got, expected, ignored_rows, dtype, tolerance=None):
    (got_grad, got_losses), (expected_grad, expected_losses) = got, expected
    loss_tol, grad_tol = tolerance or TOLERANCE[dtype]
    assert torch.isfinite(got_losses).all() and torch.isfinite(got_grad.float()).all()
    for column in (0, 1):  # hard and soft apart: neither may hide in the other's size
        assert rel_err(got_losses[:, column], expected_losses[:, column]) < loss_tol, (column, got_losses, expected_losses)
    assert got_grad.dtype == expected_grad.dtype
    assert rel_err(got_grad, expected_grad) < grad_tol, rel_err(got_grad, expected_grad)
    assert (got_losses[ignored_rows] == 0).all() and torch.count_nonzero(got_grad[ignored_rows]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_student, vocab_teacher, block", [(101, 101, 32), (157, 203, 64)])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_the_torch_spec(beta, temperature, vocab_student, vocab_teacher, block, dtype):
    """Several blocks and a partial one, the teacher's extra vocabulary over the student's zero padding."""
    generator = torch.Generator().manual_seed(vocab_teacher + int(100 * beta) + int(10 * temperature))
    rows = 7
    student = (torch.randn(rows, vocab_student, generator=generator) * 3).to(dtype)
    teacher = (torch.randn(rows, vocab_teacher, generator=generator) * 3).to(dtype)
    labels = labels_for(rows, vocab_student, generator)
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=beta, temperature=temperature, ignore_index=IGNORE)
    got, expected = run_both(student, teacher, labels, constants, True, block)
    assert_matches_spec(got, expected, ignored(labels, vocab_student), dtype)

    if dtype == torch.float32:  # the comparison tells betas 0.1 apart: that gradient lies far outside the tolerance
        wrong_grad = student.clone()
        wrong_scales = RowStepConstants(0.37, 0.81, beta + 0.1 if beta < 1 else 0.9, temperature, IGNORE)
        row_step_jsd_torch(wrong_grad, teacher, labels, wrong_scales, torch.empty(rows, 2), True)
        assert rel_err(got[0], wrong_grad) > 10 * TOLERANCE[dtype][1]


@pytest.mark.parametrize("temperature", [1.0, 3.0])
@pytest.mark.parametrize("beta", BETAS)
def test_without_gradients_the_logits_are_left_alone(beta, temperature):
    generator = torch.Generator().manual_seed(int(100 * beta + temperature))
    rows, vocab_student, vocab_teacher = 6, 130, 141
    student = (torch.randn(rows, vocab_student, generator=generator) * 3).bfloat16()
    teacher = (torch.randn(rows, vocab_teacher, generator=generator) * 3).bfloat16()
    labels = labels_for(rows, vocab_student, generator)
    constants = RowStepConstants(0.37, 0.81, beta, temperature, IGNORE)
    (got_logits, got_losses), (_, expected_losses) = run_both(student, teacher, labels, constants, False, 64)
    assert torch.equal(got_logits, student)
    assert rel_err(got_losses[:, 0], expected_losses[:, 0]) < 1e-5
    assert rel_err(got_losses[:, 1], expected_losses[:, 1]) < 1e-5
    assert (got_losses[ignored(labels, vocab_student)] == 0).all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_chunk_of_ignored_tokens_only(beta):
    student, teacher = torch.randn(5, 70) * 3, torch.randn(5, 90) * 3
    labels = torch.tensor([IGNORE, IGNORE, 70, -1, 10**6])
    constants = RowStepConstants(0.37, 0.81, beta, 2.0, IGNORE)
    for write_grad in (True, False):
        (logits, losses), _ = run_both(student, teacher, labels, constants, write_grad, 32)
        assert (losses == 0).all()
        assert torch.count_nonzero(logits) == 0 if write_grad else torch.equal(logits, student)


@pytest.mark.parametrize("vocab_student, vocab_teacher", [(1, 1), (1, 3), (5, 5), (16, 40)])
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 2.0), (0.3, 0.5)])
def test_small_vocabularies(vocab_student, vocab_teacher, beta, temperature):
    """A single column (softmax 1: only the padding's share moves p), a block longer than the row, a block exactly full."""
    generator = torch.Generator().manual_seed(vocab_student * vocab_teacher)
    student = torch.randn(4, vocab_student, generator=generator) * 3
    teacher = torch.randn(4, vocab_teacher, generator=generator) * 3
    labels = torch.randint(0, vocab_student, (4,), generator=generator)
    labels[1] = IGNORE
    constants = RowStepConstants(0.37, 0.81, beta, temperature, IGNORE)
    got, expected = run_both(student, teacher, labels, constants, True, 16)
    (got_grad, got_losses), (expected_grad, expected_losses) = got, expected
    # A single column's hard loss and hard gradient are 0 up to rounding: an absolute tolerance there.
    torch.testing.assert_close(got_losses, expected_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-6)


def row_float64_reference(student, teacher, labels, constants):
    """(d L / d s, losses [n, 2]) by autograd through the spec's definition (its docstring) in float64."""
    s = student.double().requires_grad_()
    vocab_student = s.shape[1]
    soft = generalized_jsd(s, teacher.double(), constants.beta, constants.temperature)
    counts = ~ignored(labels, vocab_student)
    hard = torch.logsumexp(s, 1) - s.gather(1, torch.where(counts, labels, 0)[:, None])[:, 0]
    losses = torch.stack([torch.where(counts, hard, 0.0), torch.where(counts, soft, 0.0)], 1)
    (constants.weight_hard * losses[:, 0].sum() + constants.weight_soft * losses[:, 1].sum()).backward()
    return s.grad, losses.detach()


def assert_matches_float64(got, student, teacher, labels, constants, grad_tol=1e-5):
    expected_grad, expected_losses = row_float64_reference(student, teacher, labels, constants)
    for column in (0, 1):
        assert rel_err(got[1][:, column], expected_losses[:, column]) < 1e-5, column
    assert rel_err(got[0], expected_grad) < grad_tol, rel_err(got[0], expected_grad)


def logits_of(rows, vocab, peak, generator):
    """Logits of a few units; with ``peak``, one entry per row 60 above the rest."""
    logits = torch.randn(rows, vocab, generator=generator) * 2
    if peak:
        logits[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=generator)] += 60.0
    return logits


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("peaked_model", ["teacher", "student"])
def test_peaked_distributions(peaked_model, beta, temperature):
    """q (or p) underflows to 0 everywhere but one column: the terms of weight 0 must be 0, not NaN."""
    generator = torch.Generator().manual_seed(int(100 * beta + 10 * temperature))
    rows, vocab_student, vocab_teacher = 6, 120, 131
    student = logits_of(rows, vocab_student, peaked_model == "student", generator)
    teacher = logits_of(rows, vocab_teacher, peaked_model == "teacher", generator)
    labels = labels_for(rows, vocab_student, generator)
    constants = RowStepConstants(0.37, 0.81, beta, temperature, IGNORE)
    got, expected = run_both(student, teacher, labels, constants, True, 32)
    assert_matches_spec(got, expected, ignored(labels, vocab_student), torch.float32, (1e-5, 1e-5))
    assert_matches_float64(got, student, teacher, labels, constants, 1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.1, 1e-3])
def test_reverse_kl_peaked_students_keep_fp32s_precision(temperature):
    """Reverse KL where the student's probability sits on one column: there g = a - b and the row sum sum_j p_j g_j
    are large and nearly equal, and their difference is the row's whole gradient. Both taken against the student's
    largest column (the teacher's largest logit among ties), the Triton step, whole and over a vocabulary split
    with that column on either side, holds each row's gradient to fp32's precision of the exact one (mpmath); a
    gradient that underflows is 0. Against the row sum alone, gaps of 30 nats lost the whole gradient at every
    temperature."""
    student, teacher, labels = peaked_reverse_kl_rows(temperature, IGNORE)
    constants = RowStepConstants(0.0, 1.0, 1.0, temperature, IGNORE)
    want = exact_reverse_kl_grad(student, teacher, temperature)
    want[ignored(labels, student.shape[1])] = 0.0
    whole, losses = student.clone(), torch.full((len(labels), 2), float("nan"))
    row_step_jsd_triton(whole, teacher, labels, constants, losses, True, block_size=32)
    split, _, _ = run_jsd_split_stages(student, teacher, labels, constants, [(0, 35), (35, 77)], True)
    for got in (whole, split):
        assert_rows_match(got, want, 1e-5)


def test_reverse_kl_spread_students_keep_fp32s_precision():
    """Reverse KL where the student's probability is spread and the teacher's logit at the student's largest column
    is far below its others: against that column g - g* is large on every column, and each bracket the difference
    of two such terms (4e-6 to 1.1e-5 off here when every row took that form); each row takes the form whose row sum
    is the smaller, here a - b, and stays within fp32's rounding of the exact gradient (mpmath), whole and split."""
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(4, 2000, generator=generator) * 0.01
    teacher = student + torch.randn(4, 2000, generator=generator) * 0.001
    teacher[torch.arange(4), student.argmax(1)] -= 20
    labels = torch.arange(4)
    constants = RowStepConstants(0.0, 1.0, 1.0, 1.0, IGNORE)
    want = exact_reverse_kl_grad(student, teacher, 1.0)
    whole = student.clone()
    row_step_jsd_triton(whole, teacher, labels, constants, torch.empty(4, 2), True)
    split, _, _ = run_jsd_split_stages(student, teacher, labels, constants, [(0, 1000), (1000, 2000)], True)
    for got in (whole, split):
        assert_rows_match(got, want, 1e-6)


@pytest.mark.parametrize("beta", BETAS + [1e-6, 1 - 1e-6])
def test_extreme_logits_and_temperatures(beta):
    """Logits of +-80 at T = 0.5; a student far below its zero padding at T = 1 (the padding holds all of p,
    which the T == 1 path gets as softmax(s) times a ratio that underflows) and both far below 0 without padding
    at T = 0.5 (the partial block's lanes past the row then hold log-probabilities of hundreds: 2^x would
    overflow, which the module's warnings filter turns into a failure); the spec's own extreme, a teacher at
    +-1e4 at T = 0.05 and 20; ordinary logits at T = 1e-20, where weight_soft / T times the gaps passes fp32's
    range."""
    generator = torch.Generator().manual_seed(int(100 * beta))
    rows = 5
    cases = [
        ((torch.rand(rows, 150, generator=generator) - 0.5) * 160, (torch.rand(rows, 160, generator=generator) - 0.5) * 160,
         0.5),
        (torch.randn(rows, 150, generator=generator) * 3 - 200.0, torch.randn(rows, 160, generator=generator) * 3, 1.0),
        (torch.randn(rows, 150, generator=generator) * 3 - 200.0, torch.randn(rows, 150, generator=generator) * 3 - 150.0,
         0.5),
    ]
    spiky_teacher = torch.full((rows, 90), -1e4)
    spiky_teacher[:, 3] = 1e4
    for temperature in (0.05, 20.0):
        cases.append((torch.randn(rows, 90, generator=generator) * 50, spiky_teacher, temperature))
    cases.append((torch.randn(rows, 90, generator=generator), torch.randn(rows, 90, generator=generator), 1e-20))
    for student, teacher, temperature in cases:
        labels = labels_for(rows, student.shape[1], generator)
        constants = RowStepConstants(0.37, 0.81, beta, temperature, IGNORE)
        got, expected = run_both(student, teacher, labels, constants, True, 64)
        assert_matches_spec(got, expected, ignored(labels, student.shape[1]), torch.float32, SPEC_FP32_EXTREME_TOL)
        assert_matches_float64(got, student, teacher, labels, constants)


EDGE_BETAS = [1e-3, 1e-6, 1e-9, 1e-12, 1 - 1e-3, 1 - 1e-6, 1 - 1e-9]


@pytest.mark.parametrize("temperature", [1.0, 4.0])
@pytest.mark.parametrize("beta", EDGE_BETAS)
def test_betas_near_0_and_1_keep_fp32s_relative_precision(beta, temperature, monkeypatch):
    """Within EDGE_MARGIN of beta = 0 or 1 the soft term shrinks with beta (or 1 - beta): MIXED_PRECISE holds it and,
    with the soft term alone, the gradient to fp32's precision against the spec, whole and over a vocabulary split.
    MIXED's one log of (1 - beta) + beta 2^d, precise only absolutely, misses by orders of magnitude there."""
    assert jsd_kernel.mode_of(beta, torch.bfloat16) == jsd_kernel.MIXED_PRECISE.value
    generator = torch.Generator().manual_seed(int(-math.log10(min(beta, 1 - beta))) + int(temperature))
    student, teacher = torch.randn(9, 130, generator=generator) * 3, torch.randn(9, 157, generator=generator) * 3
    labels = torch.tensor([0, 49, 50, 119, IGNORE, 125, 129, 130, 77])
    constants = RowStepConstants(0.0, 1.0, beta, temperature, IGNORE)
    got, expected = run_both(student, teacher, labels, constants, True, 32)
    assert_matches_spec(got, expected, ignored(labels, 130), torch.float32)
    grad, losses, _ = run_jsd_split_stages(student, teacher, labels, constants, SPLITS["student across three shards"], True)
    assert_matches_spec((grad, losses[0]), expected, ignored(labels, 130), torch.float32)
    if beta > 0.5 and temperature == 4.0:  # the teacher's weight dominates: the row reference keeps the gap unshifted
        assert rel_err(got[0], expected[0]) < 1e-6  # shifted in every row, 2e-6 at beta = 1 - 1e-9 (docs/design.md)

    if min(beta, 1 - beta) <= 1e-6:
        monkeypatch.setattr(jsd_kernel, "mode_of", lambda beta, dtype: jsd_kernel.MIXED.value)
        (_, mixed_losses), _ = run_both(student, teacher, labels, constants, True, 32)
        assert rel_err(mixed_losses[:, 1], expected[1][:, 1]) > 100 * TOLERANCE[torch.float32][0]


@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("beta", [0.3, 0.5, 0.7, 0.95, 0.99, 1 - 1e-6, 1 - 1e-9])
def test_a_teacher_peaked_far_from_the_student_keeps_fp32s_precision(beta, temperature, monkeypatch):
    """The soft term alone, fp32 logits, each row's teacher peaked 30 above its other logits: where p sits, the
    student's gap to the mixture is -log(1 - beta) plus a term of the size of q / p, and a bracket formed from
    the unshifted gaps keeps only their absolute precision (MIXED's, 1e-5 to 1e-3 of the gradient at temperature 0.5;
    MIXED_PRECISE's before its row reference, 1e-2 at beta = 1 - 1e-9). MIXED_PRECISE, which fp32 logits take at
    every 0 < beta < 1, holds the gradient to float64 as closely as elsewhere, whole and over a vocabulary split."""
    generator = torch.Generator().manual_seed(int(100 * beta) + int(10 * temperature))
    rows, vocab = 8, 3001
    student, teacher = torch.randn(rows, vocab, generator=generator) * 2, torch.randn(rows, vocab, generator=generator) * 2
    teacher[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=generator)] += 30.0
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[2] = IGNORE
    constants = RowStepConstants(0.0, 1.0, beta, temperature, IGNORE)
    assert jsd_kernel.mode_of(beta, torch.float32) == jsd_kernel.MIXED_PRECISE.value
    got, expected = run_both(student, teacher, labels, constants, True, 512)
    assert_matches_spec(got, expected, ignored(labels, vocab), torch.float32)
    assert_matches_float64(got, student, teacher, labels, constants)
    grad, losses, _ = run_jsd_split_stages(student, teacher, labels, constants, [(0, 1000), (1000, 2900), (2900, vocab)],
                                           True)
    assert_matches_spec((grad, losses[0]), expected, ignored(labels, vocab), torch.float32)

    if beta == 0.7 and temperature == 0.5:
        monkeypatch.setattr(jsd_kernel, "mode_of", lambda beta, dtype: jsd_kernel.MIXED.value)
        (mixed_grad, _), _ = run_both(student, teacher, labels, constants, True, 512)
        assert rel_err(mixed_grad, expected[0]) > 10 * TOLERANCE[torch.float32][1]


def test_strided_rows():
    """Rows of a wider buffer (row stride > vocabulary, as the chunk loop's last chunk): nothing written past them."""
    generator = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(6, 80, generator=generator) * 3, torch.randn(6, 250, generator=generator) * 3
    labels = labels_for(6, 80, generator)
    constants = RowStepConstants(0.37, 0.81, 0.4, 1.5, IGNORE)
    teacher = teacher[:, 7:207]  # the teacher's rows strided too, and offset
    wide = torch.full((6, 100), 12345.0)
    wide[:, :80] = student
    got_losses = torch.full((6, 2), float("nan"))
    row_step_jsd_triton(wide[:, :80], teacher, labels, constants, got_losses, True, block_size=32)
    expected_grad, expected_losses = student.clone(), torch.full((6, 2), float("nan"))
    row_step_jsd_torch(expected_grad, teacher, labels, constants, expected_losses, True)
    assert_matches_spec((wide[:, :80], got_losses), (expected_grad, expected_losses), ignored(labels, 80), torch.float32)
    assert (wide[:, 80:] == 12345.0).all()


@pytest.mark.parametrize("beta", [0.0, 0.6])
def test_labels_outside_the_shard(beta):
    """A shard's columns (vocab_start, vocab_student_total): a label that counts but lies outside them has no
    target logit and no one-hot here (the spec's label_columns), one below vocab_start or past the total none at all."""
    generator = torch.Generator().manual_seed(5)
    student, teacher = torch.randn(6, 70, generator=generator) * 3, torch.randn(6, 75, generator=generator) * 3
    labels = torch.tensor([25, 3, 95, 140, 150, IGNORE])  # in the shard, below it, past it, past it, past the total
    constants = RowStepConstants(0.37, 0.81, beta, 2.0, IGNORE, vocab_start=20, vocab_student_total=150)
    got, expected = run_both(student, teacher, labels, constants, True, 32)
    assert_matches_spec(got, expected, torch.tensor([False] * 4 + [True] * 2), torch.float32)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("change", [
    dict(student_softcap=3.0), dict(teacher_softcap=2.5, teacher_logit_scale=2.0),
    dict(student_softcap=4.0, teacher_softcap=3.0, student_logit_scale=0.5, teacher_logit_scale=1.5),
], ids=["student softcap", "teacher softcap and scale", "both"])
def test_softcaps_and_logit_scales(change, dtype, beta):
    """Each model's logits times its scale, then softcapped (Gemma-2, Cohere), both terms and the gradient's
    chain through them, the teacher's vocabulary padded; T = 1 (the shared softmax) and T != 1."""
    generator = torch.Generator().manual_seed(int(10 * beta) + len(change))
    student = (torch.randn(7, 131, generator=generator) * 4).to(dtype)
    teacher = (torch.randn(7, 140, generator=generator) * 4).to(dtype)
    labels = labels_for(7, 131, generator)
    for temperature in (1.0, 1.7):
        constants = RowStepConstants(0.37, 0.81, beta, temperature, IGNORE, **change)
        got, expected = run_both(student, teacher, labels, constants, True, 32)
        assert_matches_spec(got, expected, ignored(labels, 131), dtype)
        plain, _ = run_both(student, teacher, labels, RowStepConstants(0.37, 0.81, beta, temperature, IGNORE), True, 32)
        assert rel_err(got[0].float(), plain[0].float()) > 1e-2  # the caps and scales change the result


@pytest.mark.parametrize("beta", [0.0, 0.54, 1.0])
def test_a_one_column_student_padded_with_a_capped_teacher_and_a_logit_scale(beta):
    """GPU fuzz case 160 (seed 0) in small: Vs = 1 zero-padded to a large teacher vocabulary, the teacher softcapped
    (q nearly flat), the student's logits scaled (and, once, capped). A one-column softmax is exactly 1, so the hard
    loss and gradient are exactly 0 and the gradient is the soft term's alone, of the order of p ~ 1 / Vt: an
    error of an ulp of s in the hard term (a scaled logit rounded in its max but not in s - max, as FMA
    contraction did on the GPU) outweighed it. The interpreter contracts nothing: the PTX test below holds the
    compiled kernel to the same rounding."""
    generator = torch.Generator().manual_seed(160 + int(100 * beta))
    rows, vocab_teacher = 6, 20011
    student = torch.randn(rows, 1, generator=generator) * 2.5  # either side of the padding's zeros
    teacher = torch.randn(rows, vocab_teacher, generator=generator) * 2
    labels = torch.zeros(rows, dtype=torch.long)
    labels[1] = IGNORE
    caps = [dict(teacher_softcap=2.003707, student_logit_scale=0.8395802),
            dict(student_softcap=1.7, teacher_softcap=2.003707, student_logit_scale=0.8395802, teacher_logit_scale=1.3)]
    for change in caps:
        for temperature in (1.0, 1.7):  # the shared softmax (T == 1) and the two streams
            constants = RowStepConstants(1.2454676, 0.2631615, beta, temperature, IGNORE, **change)
            got, expected = run_both(student, teacher, labels, constants, True, 1024)
            assert_matches_spec(got, expected, ignored(labels, 1), torch.float32, SPEC_FP32_EXTREME_TOL)
            assert (got[1][:, 0] == 0).all()
            hard_only = RowStepConstants(1.2454676, 0.0, beta, temperature, IGNORE, **change)
            (grad, losses), _ = run_both(student, teacher, labels, hard_only, True, 1024)
            assert torch.count_nonzero(grad) == 0 and (losses[:, 0] == 0).all()


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature, weights", [(1.0, (0.0, 1.0)), (1.7, (0.5, 0.5)), (0.6, (0.0, 0.05))])
def test_fp16_lifts_match_the_spec(beta, temperature, weights):
    """fp16 logits: each row's gradient times the spec's power of two (jsd_lift_bound), the same in both, which
    keeps its largest entry at most 1 (at least 1/4 where the bound is the largest |p - q| itself): a small soft
    term alone (weights 0, 0.05) has entries ~1e-4..1e-7, which lifted stay out of fp16's subnormals."""
    generator = torch.Generator().manual_seed(int(beta * 10 + temperature * 100))
    rows, vocab_student, vocab_teacher = 7, 3000, 3013
    student = (torch.randn(rows, vocab_student, generator=generator) * 3).half()
    teacher = (torch.randn(rows, vocab_teacher, generator=generator) * 3).half()
    labels = labels_for(rows, vocab_student, generator)
    constants = RowStepConstants(*weights, beta, temperature, IGNORE, student_softcap=20.0, teacher_logit_scale=1.5)
    plain_grad, plain_losses = student.float(), torch.empty(rows, 2)
    row_step_jsd_torch(plain_grad, teacher.float(), labels, constants, plain_losses, True)  # fp32 storage: no lifts
    results = {}
    for name, step in (("triton", row_step_jsd_triton), ("torch", row_step_jsd_torch)):
        grad, losses, lifts = student.clone(), torch.full((rows, 2), float("nan")), torch.full((rows,), float("nan"))
        step(grad, teacher, labels, constants, losses, True, grad_lifts=lifts)
        results[name] = grad, lifts
        exponents = torch.log2(lifts)
        assert torch.equal(exponents, exponents.round()) and exponents.max() <= 10, lifts
        assert (lifts[ignored(labels, vocab_student)] == 1).all() and torch.isfinite(grad).all()
        valid = ~ignored(labels, vocab_student)
        largest = grad[valid].float().abs().amax(1)  # lifted up to the bound: tight for p - q (beta = 0)
        assert (largest <= 1).all() and (beta != 0 or weights[0] != 0 or (largest >= 0.25).all()), (largest, lifts)
        if weights == (0.0, 0.05) and beta < 1:  # a small soft term alone: its entries lifted (reverse KL's
            assert (lifts[valid] >= 8).all(), lifts  # p log(p / q) at T = 0.6 reach 0.1 here)
        unlifted = grad.float() / lifts[:, None]
        assert rel_err(unlifted[valid], plain_grad[valid]) < 2e-3, name
        torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
    assert torch.equal(results["triton"][1], results["torch"][1])
    torch.testing.assert_close(results["triton"][0].float(), results["torch"][0].float(), rtol=1e-2, atol=1e-4)



@pytest.mark.parametrize("beta", BETAS)
def test_fp16_lifts_match_the_spec_where_the_padding_holds_the_mass(beta):
    """jsd_lift_bound's largest bracket is over the student's own columns (the padding has no gradient): with a
    teacher vocabulary far past the student's and student logits below the padding's zeros, the padding's
    brackets are the row's largest, and a bound that took them in would lift the rows less than the spec (16x at
    Vt = 6 Vs), pushing small entries towards fp16's subnormals. The spec (float64) is the oracle: the same powers
    of two, and the unlifted gradient as the fp32-storage step's."""
    generator = torch.Generator().manual_seed(int(beta * 10) + 5)
    rows, vocab_student, vocab_teacher = 6, 200, 1200
    student = (torch.randn(rows, vocab_student, generator=generator) - 3.0).half()
    teacher = (torch.randn(rows, vocab_teacher, generator=generator) * 2).half()
    labels = labels_for(rows, vocab_student, generator)
    constants = RowStepConstants(0.0, 1.0, beta, 1.0, IGNORE)
    plain_grad = student.double()
    row_step_jsd_torch(plain_grad, teacher.double(), labels, constants, torch.empty(rows, 2), True)
    lifts = {}
    for name, step in (("triton", row_step_jsd_triton), ("torch", row_step_jsd_torch)):
        grad, lifts[name] = student.clone(), torch.full((rows,), float("nan"))
        step(grad, teacher, labels, constants, torch.empty(rows, 2), True, grad_lifts=lifts[name])
        valid = ~ignored(labels, vocab_student)
        assert rel_err(grad.double()[valid] / lifts[name][valid, None], plain_grad[valid]) < 2e-3, name
    assert torch.equal(lifts["triton"], lifts["torch"]), lifts


def test_a_lift_bound_past_fp32s_range_leaves_the_row_as_it_is_in_both():
    """fp16, reverse KL at a temperature near 0: the bound's terms (weight_soft / T times the student's largest
    log-ratio, ~1 / T) pass fp32's range while the soft gradient itself is 0 (the student's p sits on one
    column, where g_k equals the row's sum). Both twins lift such a row by 1, keeping its hard gradient; the spec
    once lifted it by 2^-inf = 0 (NaN once divided out again)."""
    generator = torch.Generator().manual_seed(23)
    rows, vocab = 5, 300
    student = (torch.randn(rows, vocab, generator=generator) * 3).half()
    teacher = (torch.randn(rows, vocab, generator=generator) * 3).half()
    labels = labels_for(rows, vocab, generator)
    constants = RowStepConstants(1.0, 1.0, 1.0, 1e-30, IGNORE)
    valid = ~ignored(labels, vocab)
    expected = torch.softmax(student.double(), 1) - torch.nn.functional.one_hot(torch.where(valid, labels, 0), vocab)
    for step in (row_step_jsd_triton, row_step_jsd_torch):
        grad, lifts = student.clone(), torch.full((rows,), float("nan"))
        with warnings.catch_warnings():  # the bound's overflow, as meant
            warnings.filterwarnings("ignore", "overflow encountered in multiply", RuntimeWarning)
            step(grad, teacher, labels, constants, torch.empty(rows, 2), True, grad_lifts=lifts)
        assert (lifts == 1).all(), (step.__name__, lifts)
        assert rel_err(grad[valid].double(), expected[valid]) < 1e-3, step.__name__


SPLITS = {  # Vs = 130, Vt = 157: the last shard's student columns partial, then none
    "student across three shards": [(0, 50), (50, 120), (120, 157)],
    "a shard of padding only": [(0, 64), (64, 130), (130, 157)],
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("write_grad", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("beta", BETAS)
def test_the_split_stages_give_the_whole_rows_step(beta, temperature, write_grad, split):
    """Over a vocabulary split, every shard's losses are the whole row's and its gradient the whole row's
    columns (against the spec on the unsplit logits): labels in each shard, ignored and out of range."""
    generator = torch.Generator().manual_seed(int(10 * beta) + int(temperature) + 7 * write_grad)
    student, teacher = torch.randn(9, 130, generator=generator) * 3, torch.randn(9, 157, generator=generator) * 3
    labels = torch.tensor([0, 49, 50, 119, IGNORE, 125, 129, 130, 77])  # 130: past the student's vocabulary
    constants = RowStepConstants(0.37, 0.81, beta, temperature, IGNORE)
    grad, losses, _ = run_jsd_split_stages(student, teacher, labels, constants, SPLITS[split], write_grad)
    expected_grad, expected_losses = student.clone(), torch.empty(9, 2)
    row_step_jsd_torch(expected_grad, teacher, labels, constants, expected_losses, write_grad)
    for shard_losses in losses:
        assert torch.equal(shard_losses, losses[0])  # every rank returns the same loss
    if write_grad:
        assert_matches_spec((grad, losses[0]), (expected_grad, expected_losses), ignored(labels, 130), torch.float32)
    else:
        assert torch.equal(grad, student)
        assert rel_err(losses[0], expected_losses) < TOLERANCE[torch.float32][0]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_split_stages_with_softcaps_scales_and_bf16(beta):
    generator = torch.Generator().manual_seed(int(10 * beta) + 3)
    student = (torch.randn(9, 130, generator=generator) * 4).bfloat16()
    teacher = (torch.randn(9, 157, generator=generator) * 4).bfloat16()
    labels = torch.tensor([0, 49, 50, 119, IGNORE, 125, 129, 130, 77])
    for temperature in (1.0, 1.7):
        constants = RowStepConstants(0.37, 0.81, beta, temperature, IGNORE, student_softcap=4.0, teacher_softcap=3.0,
                               student_logit_scale=0.5, teacher_logit_scale=1.5)
        grad, losses, _ = run_jsd_split_stages(student, teacher, labels, constants, SPLITS["a shard of padding only"], True)
        expected_grad, expected_losses = student.clone(), torch.empty(9, 2)
        row_step_jsd_torch(expected_grad, teacher, labels, constants, expected_losses, True)
        assert_matches_spec((grad, losses[0]), (expected_grad, expected_losses), ignored(labels, 130), torch.bfloat16)


@pytest.mark.parametrize("beta", BETAS)
def test_the_split_stages_lift_fp16_rows_as_the_whole_step(beta):
    """Every shard lifts a row by the unsplit kernel's power of two: the largest bracket travels with the sums."""
    generator = torch.Generator().manual_seed(int(10 * beta) + 11)
    student = (torch.randn(7, 3000, generator=generator) * 3).half()
    teacher = (torch.randn(7, 3013, generator=generator) * 3).half()
    labels = labels_for(7, 3000, generator)
    constants = RowStepConstants(0.0, 0.05, beta, 0.6, IGNORE)
    grad, _, lifts = run_jsd_split_stages(student, teacher, labels, constants, [(0, 1000), (1000, 2900), (2900, 3013)], True,
                               lifts=True)
    whole, whole_lifts = student.clone(), torch.full((7,), float("nan"))
    row_step_jsd_triton(whole, teacher, labels, constants, torch.empty(7, 2), True, grad_lifts=whole_lifts)
    assert (whole_lifts > 1).any(), whole_lifts  # the lifts are in play
    for shard_lifts in lifts:
        assert torch.equal(shard_lifts, whole_lifts)
    torch.testing.assert_close(grad.float(), whole.float(), rtol=1e-2, atol=1e-4)


def test_the_split_row_step_over_one_rank_is_the_whole_step():
    """split_jsd_row_step_triton itself, its all-gathers over a group of one."""
    generator = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(7, 101, generator=generator) * 3, torch.randn(7, 120, generator=generator) * 3
    labels = labels_for(7, 101, generator)
    constants = RowStepConstants(0.37, 0.81, 0.5, 1.3, IGNORE)
    got, got_losses = student.clone(), torch.full((7, 2), float("nan"))
    jsd_kernel.split_jsd_row_step_triton(lambda tensor: tensor[None])(got, teacher, labels, constants, got_losses, True)
    expected, expected_losses = student.clone(), torch.empty(7, 2)
    row_step_jsd_torch(expected, teacher, labels, constants, expected_losses, True)
    assert_matches_spec((got, got_losses), (expected, expected_losses), ignored(labels, 101), torch.float32)


COMPILE_FOR_HOPPER = """
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cosdistill.testing import kernels

jsd = kernels.row_step_jsd_triton
kernel = jsd._jsd_row_step_kernel
ints = ("student_row_stride", "teacher_row_stride", "vocab_student", "vocab_teacher", "ignore_index", "vocab_start",
        "vocab_student_total")
aligned = ("student_ptr", "teacher_ptr", "labels_ptr", "losses_ptr", "student_row_stride", "teacher_row_stride",
           "vocab_student", "vocab_teacher")  # as Triton specialises a launch at V = 128256
modes = (0, 1, 2, 3)  # FORWARD, REVERSE, MIXED, MIXED_PRECISE
variants = [*itertools.product(["*bf16"], modes, (True, False), (True, False)),
            *itertools.product(["*fp32"], modes, [False], [True]),
            *itertools.product(["*fp16"], modes, (True, False), [True])]  # fp16: the lifted gradient
for logits, mode, shared, write_grad in variants:
    constants = dict(MODE=mode, SHARED=shared, WRITE_GRAD=write_grad, LIFT=logits == "*fp16", BLOCK=jsd.DEFAULT_BLOCK,
                     STAGES=jsd.DEFAULT_STAGES, STUDENT_CAP=False, TEACHER_CAP=False, student_scale=None,
                     teacher_scale=None)
    types = dict(student_ptr=logits, teacher_ptr=logits, labels_ptr="*i64", losses_ptr="*fp32", lifts_ptr="*fp32",
                 **{name: "i32" for name in ints})
    signature = {name: "constexpr" if name in constants else types.get(name, "fp32") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=jsd.DEFAULT_WARPS, **kernels.TRITON_OPTIONS))
    print(logits, mode, shared, write_grad, len(compiled.asm["cubin"]), compiled.asm["ptx"].count("cp.async.cg"))

# The vocabulary split's three stages: stage 1 per SHARED x REFERENCE, stage 2 per MODE (with LIFT's bracket for
# fp16), stage 3 per MODE x SHARED with gradients (bf16) and per MODE with the lifted gradient (fp16)
split_variants = [
    *[(jsd._jsd_shard_stats_kernel, "*bf16", dict(SHARED=shared, REFERENCE=reference), jsd.LOSS_ONLY_WARPS)
      for shared in (True, False) for reference in (True, False)],
    *[(jsd._jsd_shard_sums_kernel, logits, dict(MODE=mode, LIFT=logits == "*fp16"), jsd.LOSS_ONLY_WARPS)
      for logits in ("*bf16", "*fp16") for mode in modes],
    *[(jsd._jsd_shard_grad_kernel, "*bf16", dict(MODE=mode, SHARED=shared, WRITE_GRAD=True, LIFT=False),
       jsd.DEFAULT_WARPS) for mode in modes for shared in (True, False)],
    *[(jsd._jsd_shard_grad_kernel, "*fp16", dict(MODE=mode, SHARED=False, WRITE_GRAD=True, LIFT=True),
       jsd.DEFAULT_WARPS) for mode in modes],
]
for kernel, logits, flags, num_warps in split_variants:
    constants = dict(**flags, BLOCK=jsd.DEFAULT_BLOCK, STAGES=jsd.DEFAULT_STAGES, STUDENT_CAP=False, TEACHER_CAP=False,
                     student_scale=None, teacher_scale=None)
    types = dict(student_ptr=logits, teacher_ptr=logits, labels_ptr="*i64", stats_ptr="*fp32", sums_ptr="*fp32",
                 losses_ptr="*fp32", lifts_ptr="*fp32", **{name: "i32" for name in ints})
    signature = {name: "constexpr" if name in constants else types.get(name, "fp32") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned if name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, **kernels.TRITON_OPTIONS))
    print(kernel.__name__, logits, *flags.values(), len(compiled.asm["cubin"]), compiled.asm["ptx"].count("cp.async.cg"))
"""


ROUNDED_CAPS_AND_SCALES = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cosdistill.testing import kernels

jsd = kernels.row_step_jsd_triton
kernel = jsd._jsd_row_step_kernel
ints = ("student_row_stride", "teacher_row_stride", "vocab_student", "vocab_teacher", "ignore_index", "vocab_start",
        "vocab_student_total")
# (MODE, SHARED, STUDENT_CAP, TEACHER_CAP), both logit scales on: fuzz case 160's form first
for mode, shared, student_cap, teacher_cap in ((2, True, False, True), (0, True, True, True), (1, False, True, False)):
    constants = dict(MODE=mode, SHARED=shared, WRITE_GRAD=True, LIFT=False, BLOCK=jsd.DEFAULT_BLOCK,
                     STAGES=jsd.DEFAULT_STAGES, STUDENT_CAP=student_cap, TEACHER_CAP=teacher_cap)
    types = dict(student_ptr="*fp32", teacher_ptr="*fp32", labels_ptr="*i64", losses_ptr="*fp32", lifts_ptr="*fp32",
                 **{name: "i32" for name in ints})
    signature = {name: "constexpr" if name in constants else types.get(name, "fp32") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    ptx = triton.compile(ASTSource(kernel, signature, constexprs, {}), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=jsd.DEFAULT_WARPS, **kernels.TRITON_OPTIONS)).asm["ptx"]
    caps = [name for name, on in (("student_cap", student_cap), ("teacher_cap", teacher_cap)) if on]
    for name in caps + ["student_scale", "teacher_scale"]:
        param = kernel.arg_names.index(name)  # all before the constexprs: the PTX parameter's index
        register = re.search(rf"ld\\.param\\.b32\\s+(%r\\d+), \\[_jsd_row_step_kernel_param_{param}\\]", ptx).group(1)
        fused = [line for line in ptx.splitlines() if line.strip().startswith("fma") and re.search(rf"{register}\\b", line)]
        print(mode, shared, name, register, len(fused))

# The cosine kernels load their logits through the same triton_common.load_logits: every kernel that takes
# caps, with both caps and scales on
import sys
sys.path.insert(0, TESTS)
import kernel_compile

for name, kernel, logits_type, constants in kernel_compile.variants():
    if not constants["STUDENT_CAP"] or "aligned" in name:
        continue
    ptx = kernel_compile.compile_for_hopper(kernel, logits_type, constants).asm["ptx"]
    for param_name in ("student_cap", "teacher_cap", "student_scale", "teacher_scale"):
        param = kernel.arg_names.index(param_name)
        register = re.search(rf"ld\\.param\\.b32\\s+(%r\\d+), \\[{kernel.__name__}_param_{param}\\]", ptx).group(1)
        fused = [line for line in ptx.splitlines() if line.strip().startswith("fma") and re.search(rf"{register}\\b", line)]
        print(name.replace(" ", "_"), logits_type, param_name, register, len(fused))
"""


def compiled_for_hopper(script: str) -> list[list[str]]:
    """The words of each line a script prints, run without the interpreter (Triton's real compiler, no GPU)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [line.split() for line in result.stdout.splitlines()]


def test_caps_and_scales_are_rounded_before_any_difference():
    """On the GPU each pass reloads a logit and applies its scale and cap again; contracted into FMAs, the product
    was rounded in the max but exact in s - max, and a one-column student's softmax 2^(s - max) was not 1 (its
    hard gradient 2e-3 of the gradient in GPU fuzz case 160). Through the real compiler for Hopper, with both
    scales and either cap or both, and the cosine kernels' capped variants (the same load_logits): no cap or
    scale enters an FMA (each product is mul.rn, never contracted)."""
    lines = compiled_for_hopper(ROUNDED_CAPS_AND_SCALES.replace("TESTS", repr(str(Path(__file__).resolve().parents[1]))))
    assert len(lines) == 10 + 4 * 8 and all(line[-1] == "0" for line in lines), lines


def test_every_variant_compiles_for_hopper():
    """The interpreter skips Triton's front end and PTX: each MODE x SHARED x WRITE_GRAD for bf16 logits, each
    MODE for fp32 and each MODE x SHARED for fp16's lifted gradient, and the vocabulary split's stages, through the
    real compiler (no GPU needed), with the hot loops' loads prefetched (cp.async)."""
    lines = compiled_for_hopper(COMPILE_FOR_HOPPER)
    assert len(lines) == 28 + 24 and all(int(line[-2]) > 0 and int(line[-1]) > 0 for line in lines), lines



@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_student_near_its_teacher_gets_a_jsd_well_below_naive_fp32s_error(seed):
    """Where the two models nearly agree the JSD is second order in each column's log-ratio d. The kernel forms both
    gaps to the mixture from d (_minus_mixture), so their first-order terms cancel as the math's do; gaps taken as
    differences of fp32 log-probabilities keep each one's rounding (docs/design.md, The generalized JSD, Precision,
    (1)). The kernel is held to a sixth of that naive formula's error."""
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(4, 32000, generator=generator) * 2
    teacher = student + 1e-3 * torch.randn(4, 32000, generator=generator)
    labels = torch.zeros(4, dtype=torch.long)
    constants = RowStepConstants(0.0, 1.0, 0.5, 1.0, IGNORE)
    losses = torch.full((4, 2), float("nan"))
    row_step_jsd_triton(student.clone(), teacher, labels, constants, losses, False)
    want = row_float64_reference(student, teacher, labels, constants)[1][:, 1]
    ours_error = (losses[:, 1].double() - want).abs().max()
    naive_error = (generalized_jsd(student, teacher, constants.beta, constants.temperature).double() - want).abs().max()
    assert ours_error * 6 < naive_error, (ours_error, naive_error)


@st.composite
def precision_cases(draw):
    """fp32 logits drawn to stress the step's precision: any beta (its edges and exact 0 and 1 often), temperatures
    from 0.5 to 8, logits of a few units with, per row, a teacher peak of up to 40 at a random column, the soft
    term alone or with the hard one, a teacher vocabulary often larger than the student's. Where the student's p
    sits on one column, the kernels hold a row's gradient to fp32's absolute precision of its bracket only, but
    for reverse KL's, taken against that column (test_reverse_kl_peaked_students_keep_fp32s_precision; docs/design.md,
    The generalized JSD, Precision, (2)): so students peaked far above their other logits, and T = 0.25 over logits
    of a few units, are not drawn (forward KL with a teacher peaked on the same column: up to ~1e-1 of one row's
    gradient). Nor are vocabularies of a few columns, where two random rows can leave p and q
    so close that the gradient is the difference of nearly equal fp32 log-probabilities (2.5% of a gradient of
    1e-4 at two columns)."""
    rows = draw(st.integers(1, 6))
    vocab_student = draw(st.sampled_from([31, 97, 257, 509, 700]))
    vocab_teacher = vocab_student + draw(st.sampled_from([0, 0, 1, 37, 300]))
    beta = draw(st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.05, 0.95, 1e-9, 1 - 1e-9]), st.floats(1e-9, 1 - 1e-9)))
    temperature = draw(st.one_of(st.sampled_from([1.0, 0.5]), st.floats(0.5, 8.0)))
    teacher_peak = draw(st.sampled_from([0.0, 10.0, 30.0, 40.0]))
    weight_hard = draw(st.sampled_from([0.0, 0.0, 0.37]))
    return rows, vocab_student, vocab_teacher, beta, temperature, teacher_peak, weight_hard, draw(st.integers(0, 2**31))


@settings(max_examples=80, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(precision_cases())
@example((4, 257, 294, 1 - 1e-9, 0.5, 40.0, 0.0, 1))  # a teacher peaked far from the student (_row_reference)
@example((4, 509, 509, 0.7, 0.5, 30.0, 0.0, 2))
def test_fp32_precision_against_float64(case):
    rows, vocab_student, vocab_teacher, beta, temperature, teacher_peak, weight_hard, seed = case
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, vocab_student, generator=generator) * 2
    teacher = torch.randn(rows, vocab_teacher, generator=generator) * 2
    teacher[torch.arange(rows), torch.randint(0, vocab_teacher, (rows,), generator=generator)] += teacher_peak
    labels = torch.randint(0, vocab_student, (rows,), generator=generator)
    constants = RowStepConstants(weight_hard, 1.0, beta, temperature, IGNORE)
    grad, losses = student.clone(), torch.full((rows, 2), float("nan"))
    row_step_jsd_triton(grad, teacher, labels, constants, losses, True, block_size=128)
    want_grad, want_losses = row_float64_reference(student, teacher, labels, constants)
    assert rel_err(losses[:, 1], want_losses[:, 1]) < 1e-5, rel_err(losses[:, 1], want_losses[:, 1])
    assert rel_err(grad, want_grad) < (REVERSE_KL_PEAKED_TOL if beta == 1.0 else 1e-5), rel_err(grad, want_grad)
