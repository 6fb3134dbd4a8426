"""The label count and the losses' mean, each one Triton kernel (as ten and six small torch kernels
they held up the first row step). Their spec: ``_labels.count_labels_torch`` and ``mean_losses_torch``."""

import torch
import triton
import triton.language as tl

from . import TRITON_OPTIONS

BLOCK = 1024


@triton.jit
def _count_labels_kernel(labels_ptr, num_tokens, ignore_index, vocab_student, counts_ptr, BLOCK: tl.constexpr):
    """counts = [labels that are not ignore_index, those of them outside [0, vocab_student)], one program."""
    offsets = tl.arange(0, BLOCK)
    counted = tl.zeros([BLOCK], tl.int32)
    out_of_range = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_tokens, BLOCK):
        cols = start + offsets
        label = tl.load(labels_ptr + cols, mask=cols < num_tokens, other=ignore_index).to(tl.int64)
        valid = label != ignore_index
        counted += valid.to(tl.int32)
        out_of_range += (valid & ((label < 0) | (label >= vocab_student))).to(tl.int32)
    tl.store(counts_ptr, tl.sum(counted, axis=0))
    tl.store(counts_ptr + 1, tl.sum(out_of_range, axis=0))


# Where _mean_losses_kernel takes N from (constexpr: the kernel reads them)
N_COUNTED, N_GIVEN_TENSOR, N_GIVEN_NUMBER = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _mean_losses_kernel(token_losses_ptr, num_tokens, normaliser_ptr, normaliser, weight_hard, weight_soft, poison_ptr,
                        loss_ptr, soft_ptr, hard_ptr, N_FROM: tl.constexpr, POISONED: tl.constexpr, BLOCK: tl.constexpr):
    """hard, soft = the columns of token_losses [T, 2] summed, each term divided by N first (terms near
    fp32's max must not overflow the sum); loss = weight_hard * hard + weight_soft * soft; POISONED: the
    poison added to each. One program."""
    if N_FROM == N_COUNTED:
        normaliser = tl.maximum(tl.load(normaliser_ptr).to(tl.float32), 1.0)
    elif N_FROM == N_GIVEN_TENSOR:
        normaliser = tl.load(normaliser_ptr).to(tl.float32)
    offsets = tl.arange(0, BLOCK)
    hard = tl.zeros([BLOCK], tl.float32)
    soft = tl.zeros([BLOCK], tl.float32)
    for start in range(0, num_tokens, BLOCK):
        rows = (start + offsets).to(tl.int64)
        in_range = rows < num_tokens
        hard += tl.load(token_losses_ptr + 2 * rows, mask=in_range, other=0.0) / normaliser
        soft += tl.load(token_losses_ptr + 2 * rows + 1, mask=in_range, other=0.0) / normaliser
    hard_sum = tl.sum(hard, axis=0)
    soft_sum = tl.sum(soft, axis=0)
    loss = weight_hard * hard_sum + weight_soft * soft_sum
    if POISONED:
        poison = tl.load(poison_ptr)
        hard_sum, soft_sum, loss = hard_sum + poison, soft_sum + poison, loss + poison
    tl.store(hard_ptr, hard_sum)
    tl.store(soft_ptr, soft_sum)
    tl.store(loss_ptr, loss)


def count_labels_triton(labels: torch.Tensor, ignore_index: int, vocab_student: int) -> torch.Tensor:
    """[counted, out of range] as int32 on labels' device (contiguous 1-D labels)."""
    counts = torch.empty(2, dtype=torch.int32, device=labels.device)
    _count_labels_kernel[(1,)](labels, labels.numel(), ignore_index, vocab_student, counts, BLOCK=BLOCK,
                               **TRITON_OPTIONS)
    return counts


def mean_losses_triton(token_losses, counts, given, weight_hard: float, weight_soft: float, poison=None):
    """mean_losses_torch in one kernel: (loss, soft, hard), three fp32 scalars."""
    if given is None:
        n_from, normaliser_tensor, normaliser = N_COUNTED, counts, 0.0
    elif torch.is_tensor(given):
        n_from, normaliser_tensor, normaliser = N_GIVEN_TENSOR, given.to(token_losses.device).reshape(()), 0.0
    else:
        n_from, normaliser_tensor, normaliser = N_GIVEN_NUMBER, counts, float(given)  # counts: not read
    loss, soft, hard = (torch.empty((), dtype=torch.float32, device=token_losses.device) for _ in range(3))
    _mean_losses_kernel[(1,)](token_losses, len(token_losses), normaliser_tensor, normaliser, weight_hard, weight_soft,
                              loss if poison is None else poison, loss, soft, hard, N_FROM=n_from,
                              POISONED=poison is not None, BLOCK=BLOCK, **TRITON_OPTIONS)
    return loss, soft, hard
