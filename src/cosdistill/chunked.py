"""The chunk loop: logits GEMMs into preallocated buffers, the fused row step, gradient GEMMs.

Everything the loss costs happens in ``chunked_loss_and_grads``, called from the forward pass: per
chunk of tokens, two cuBLAS GEMMs write the student and teacher logits into reused buffers, the row
step turns the student buffer into d loss / d logits in place, and two more GEMMs turn that into
grad_input (written straight into its slice) and grad_weight (accumulated). Backward only applies
grad_output.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from .row_step import RowStepScales

RowStep = Callable[..., None]

# The two logits buffers (student + teacher, one chunk each) are sized to stay under this.
LOGITS_BUFFER_BUDGET_BYTES = 512 * 2**20
CHUNK_MULTIPLE = 64


def auto_chunk_size(num_tokens: int, vocab_student: int, vocab_teacher: int, itemsize: int) -> int:
    """Largest multiple of CHUNK_MULTIPLE whose two logits buffers fit the budget (at least one multiple)."""
    rows = LOGITS_BUFFER_BUDGET_BYTES // max(1, (vocab_student + vocab_teacher) * itemsize)
    rows = max(CHUNK_MULTIPLE, rows // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return max(1, min(rows, num_tokens))


@dataclass
class ChunkResult:
    hard_loss: torch.Tensor  # fp32 scalars, divided by N
    soft_loss: torch.Tensor
    grad_input: torch.Tensor | None
    grad_weight: torch.Tensor | None  # in accum dtype
    grad_bias: torch.Tensor | None  # fp32


def _logits_into(out, hidden, weight, bias):
    if bias is None:
        torch.mm(hidden, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden, weight.t(), out=out)


def _grad_weight_gemm(grad_weight, grad_logits, hidden, alpha, accumulate):
    """grad_weight = (accumulate ? grad_weight : 0) + alpha * grad_logits^T @ hidden, in grad_weight's dtype.

    beta = 0 on the first chunk: cuBLAS then never reads the uninitialised buffer, so no memset.
    """
    grad_logits_t = grad_logits.t()
    beta = 1.0 if accumulate else 0.0
    if grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits_t, hidden, beta=beta, alpha=alpha)
    elif grad_weight.is_cuda:
        # cuBLAS reads the bf16/fp16 operands and accumulates into the fp32 buffer directly.
        torch.addmm(grad_weight, grad_logits_t, hidden, out_dtype=grad_weight.dtype, beta=beta, alpha=alpha, out=grad_weight)
    else:
        grad_weight.addmm_(grad_logits_t.to(grad_weight.dtype), hidden.to(grad_weight.dtype), beta=beta, alpha=alpha)


def chunked_loss_and_grads(
    student_input: torch.Tensor,  # [T, Hs]
    student_weight: torch.Tensor,  # [Vs, Hs]
    student_bias: torch.Tensor | None,
    teacher_input: torch.Tensor,  # [T, Ht]
    teacher_weight: torch.Tensor,  # [Vt, Ht]
    teacher_bias: torch.Tensor | None,
    labels: torch.Tensor,  # [T]
    scales: RowStepScales,
    get_normaliser: Callable[[], float],
    row_step: RowStep,
    chunk_size: int,
    needs_grad: tuple[bool, bool, bool],  # input, weight, bias
    accum_dtype: torch.dtype,
) -> ChunkResult:
    """``get_normaliser`` returns N; it may wait on the device, so it is called once the first chunk's
    GEMMs and row step are queued (the row step does not need N: 1/N is the gradient GEMMs' alpha)."""
    num_tokens, hidden_student = student_input.shape
    vocab_student, vocab_teacher = student_weight.shape[0], teacher_weight.shape[0]
    device = student_input.device
    write_grad = any(needs_grad)
    chunk = max(1, min(chunk_size, num_tokens))

    student_logits = torch.empty(chunk, vocab_student, dtype=student_weight.dtype, device=device)
    teacher_logits = torch.empty(chunk, vocab_teacher, dtype=teacher_weight.dtype, device=device)
    token_losses = torch.empty(num_tokens, 2, dtype=torch.float32, device=device)
    grad_input = torch.empty(num_tokens, hidden_student, dtype=student_input.dtype, device=device) if needs_grad[0] else None
    grad_weight = None
    if needs_grad[1]:  # the first chunk's GEMM overwrites it; zeros only when there is no chunk
        allocate = torch.empty if num_tokens else torch.zeros
        grad_weight = allocate(vocab_student, hidden_student, dtype=accum_dtype, device=device)
    grad_bias = torch.zeros(vocab_student, dtype=torch.float32, device=device) if needs_grad[2] else None

    inv_normaliser = None
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        hidden = student_input[start:stop]
        chunk_student = student_logits[: stop - start]
        chunk_teacher = teacher_logits[: stop - start]
        _logits_into(chunk_student, hidden, student_weight, student_bias)
        _logits_into(chunk_teacher, teacher_input[start:stop], teacher_weight, teacher_bias)
        row_step(chunk_student, chunk_teacher, labels[start:stop], scales, token_losses[start:stop], write_grad)
        if inv_normaliser is None:
            inv_normaliser = 1.0 / get_normaliser()
        grad_logits = chunk_student  # overwritten in place by the row step
        if grad_input is not None:
            grad_input[start:stop].addmm_(grad_logits, student_weight, beta=0.0, alpha=inv_normaliser)
        if grad_weight is not None:
            _grad_weight_gemm(grad_weight, grad_logits, hidden, inv_normaliser, accumulate=start > 0)
        if grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0, dtype=torch.float32), alpha=inv_normaliser)

    if inv_normaliser is None:
        inv_normaliser = 1.0 / get_normaliser()
    loss_sums = token_losses.sum(0) * inv_normaliser
    return ChunkResult(loss_sums[0], loss_sums[1], grad_input, grad_weight, grad_bias)
