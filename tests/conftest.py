import os

# The Triton kernel runs on the CPU through Triton's interpreter; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from cosdistill.testing import float64_reference, random_student_teacher, rel_err  # noqa: E402, F401

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 2e-2), torch.float16: (2e-3, 5e-3)}  # (loss, grads)


@dataclass
class Problem:
    student_input: torch.Tensor
    student_weight: torch.Tensor
    teacher_input: torch.Tensor
    teacher_weight: torch.Tensor
    labels: torch.Tensor
    student_bias: torch.Tensor | None
    teacher_bias: torch.Tensor | None

    def args(self):
        return (self.student_input, self.student_weight, self.teacher_input, self.teacher_weight, self.labels,
                self.student_bias, self.teacher_bias)

    def student_leaves(self):
        return [t for t in (self.student_input, self.student_weight, self.student_bias) if t is not None]


def make_problem(tokens=37, hidden_student=16, hidden_teacher=24, vocab_student=101, vocab_teacher=None,
                 dtype=torch.float32, bias=True, ignore_every=0, batch=None) -> Problem:
    """Fresh random inputs (never zeros); logits of order a few units, like a trained LM head's."""
    lead = (tokens,) if batch is None else (batch, tokens // batch)
    labels = torch.randint(0, vocab_student, lead)
    if ignore_every:
        labels.view(-1)[::ignore_every] = -100
    return problem_around(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher or vocab_student,
                          dtype, bias, bias)


def problem_around(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher, dtype, student_bias,
                   teacher_bias, generator=None) -> Problem:
    """A Problem for these labels: cosdistill.selfcheck.random_student_teacher's tensors."""
    return Problem(*random_student_teacher(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher,
                                           dtype, student_bias, teacher_bias, generator))


def reference(problem: Problem, grad_output=1.0, **kwargs):
    """(loss, soft, hard) and the student gradients, in float64, through the naive full-logits version."""
    return float64_reference(problem.args(), grad_output, **kwargs)


def record_write_grad(monkeypatch, module) -> list:
    """Replaces ``module.chunk_rows`` with one that records each call's ``write_grad``; the list it fills."""
    from cosdistill._plan import chunk_rows

    seen = []

    def recording_chunk_rows(*args, **kwargs):
        seen.append(kwargs["write_grad"])
        return chunk_rows(*args, **kwargs)

    monkeypatch.setattr(module, "chunk_rows", recording_chunk_rows)
    return seen


@pytest.fixture(params=["torch", "triton"])
def impl(request):
    return request.param
