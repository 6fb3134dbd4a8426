"""What the tests, the benchmarks and ``cosdistill check`` share: a random problem, the float64 reference
of the loss and its gradients, and the relative error between two results."""

import torch

from .reference import naive_cosine_distill


def rel_err(actual, expected) -> float:
    """|actual - expected| / |expected| in float64 (Frobenius norms); |actual - expected| where expected is 0."""
    actual, expected = actual.detach().double(), expected.detach().double()
    denominator = expected.norm()
    difference = (actual - expected).norm()
    return (difference if denominator == 0 else difference / denominator).item()


def random_student_teacher(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher, dtype,
                           student_bias, teacher_bias, generator=None) -> list:
    """[student_input, student_weight, teacher_input, teacher_weight, labels, student_bias, teacher_bias]
    for these labels, on their device: random normal hidden states, weights scaled by 2 / sqrt(H) (logits
    of a few units, like a trained head's), drawn in that order from ``generator`` (default: torch's)."""
    def randn(*shape, scale=1.0, requires_grad=False):
        values = torch.randn(*shape, generator=generator, device=labels.device) * scale
        return values.to(dtype).requires_grad_(requires_grad)

    lead = tuple(labels.shape)
    return [
        randn(*lead, hidden_student, requires_grad=True),
        randn(vocab_student, hidden_student, scale=2 / hidden_student**0.5, requires_grad=True),
        randn(*lead, hidden_teacher),
        randn(vocab_teacher, hidden_teacher, scale=2 / hidden_teacher**0.5),
        labels,
        randn(vocab_student, requires_grad=True) if student_bias else None,
        randn(vocab_teacher) if teacher_bias else None,
    ]


def float64_reference(args, grad_output=1.0, **options):
    """(loss, soft, hard) and the gradients of the student's input, weight and bias (where given; None
    where it does not require grad), from the naive version on float64 copies of args (the seven of
    random_student_teacher), for this grad_output."""
    upcast = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in args]
    losses = naive_cosine_distill(*upcast, **options)
    if losses[0].requires_grad:
        (losses[0] * grad_output).backward()
    grads = [upcast[i].grad for i in (0, 1, 5) if upcast[i] is not None]
    return [loss.detach() for loss in losses], grads
