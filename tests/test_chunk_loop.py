"""The chunk loop (_chunk_loop.py): teacher sub-chunks, the last chunk's deferred GEMM, and when the host reads N."""

import dataclasses

import pytest
import torch

from conftest import TOLERANCE, assert_matches_reference, make_problem, reference, rel_err
from cosdistill import fused_linear_cosine_distill
from cosdistill.testing import (
    TORCH,
    ChunkRows,
    LabelCounts,
    LogitsTeacher,
    Options,
    TeacherHead,
    chunked_loss_and_grads,
    plan,
)


@pytest.mark.parametrize("rows", [ChunkRows(16, 5), ChunkRows(10, 3), ChunkRows(37, 36), ChunkRows(8, 8)])
@pytest.mark.parametrize("fp8_like_buffer", [False, True])
def test_teacher_logits_in_sub_chunks(impl, rows, fp8_like_buffer, monkeypatch):
    """The automatic sizes give the teacher's logits GEMM and the row step fewer rows than the student's
    chunk (seed workload: 1024 of 2048); small sizes here, forced, with odd remainders at both levels.
    ``fp8_like_buffer``: a teacher buffer with more rows than asked for, as the FP8 head's padding."""
    monkeypatch.setattr(plan, "chunk_rows", lambda *args, **kwargs: rows)
    if fp8_like_buffer:
        monkeypatch.setattr(TeacherHead, "buffer_rows", lambda self, n: n + 3)
    problem = make_problem(tokens=37, vocab_teacher=131, ignore_every=4)
    assert_matches_reference(problem, torch.float32, impl=impl)


@pytest.mark.parametrize("dtype, weight_grad, tokens, deferred", [
    (torch.float32, True, 37, True), (torch.bfloat16, True, 37, True),
    (torch.float32, True, 16, False),  # one chunk: backward does not wait for grad_output
    (torch.float32, False, 37, False),  # nothing deferred without grad_weight
    (torch.float16, True, 37, False),  # fp16: grad_input's rows are written with their lifts in forward
])
def test_last_chunk_grad_input_gemm_runs_in_backward(monkeypatch, dtype, weight_grad, tokens, deferred):
    """Where backward reads grad_output on the host before the last grad_weight GEMM (several chunks), the
    last chunk's grad_input GEMM waits for backward too, so the GPU has it to run meanwhile: those rows,
    poisoned after forward, come out right after a backward with grad_output != 1."""
    results = []

    def recording(*args, **kwargs):
        results.append(chunked_loss_and_grads(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(plan, "chunked_loss_and_grads", recording)
    problem = make_problem(tokens=tokens, dtype=dtype)
    problem.student_weight.requires_grad_(weight_grad)
    losses = fused_linear_cosine_distill(*problem.args(), chunk_size=16, return_soft_hard_loss=True)
    gradients = results[0].gradients
    assert (gradients.last_grad_input is not None) == deferred
    if deferred:
        assert gradients.last_grad_input.data_ptr() == gradients.grad_input[32].data_ptr()
        assert gradients.last_grad_input.shape == (5, problem.student_input.shape[1])
        gradients.last_grad_input.fill_(float("nan"))
    (losses[0] * -1.5).backward()
    _, ref_grads = reference(problem, -1.5)
    assert rel_err(problem.student_input.grad, ref_grads[0]) < TOLERANCE[dtype][1]


@pytest.mark.parametrize("grad", [True, False])
def test_host_reads_n_only_where_gradients_need_it(grad):
    """With gradients the host reads N once the first chunk's row steps are queued (1/N is the gradient
    GEMMs' alpha); without, only after every chunk is queued, the loss divided by N on the device."""
    problem = make_problem(tokens=37, ignore_every=3)
    row_steps, steps_before_read = [], []
    row_step = TORCH.row_step.step

    def counting_row_step(*args, **kwargs):
        row_steps.append(1)
        return row_step(*args, **kwargs)

    class RecordingCounts(LabelCounts):
        def wait(self):
            steps_before_read.append(len(row_steps))
            return super().wait()

    labels = problem.labels
    teacher = LogitsTeacher(TeacherHead(problem.teacher_weight, None), counting_row_step, Options().scales, 8)
    result = chunked_loss_and_grads(
        problem.student_input.detach(), problem.student_weight.detach(), None, problem.teacher_input, teacher, labels,
        RecordingCounts(labels, -100, problem.student_weight.shape[0], None, TORCH, 0.5, 0.5), ChunkRows(16, 8),
        (grad, grad, False), torch.float32, TORCH.scale_unless_one)
    assert len(row_steps) == 5 and steps_before_read == ([2] if grad else [5])
    ref_losses, _ = reference(dataclasses.replace(problem, student_bias=None, teacher_bias=None))
    assert rel_err(0.5 * result.hard_loss + 0.5 * result.soft_loss, ref_losses[0]) < TOLERANCE[torch.float32][0]
