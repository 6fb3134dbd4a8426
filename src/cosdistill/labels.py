"""N, the loss's divisor, and the check for labels outside [0, Vs): counted on the device.

The chunk loop launches the count behind the first student GEMM, divides the loss by it on the device, and
reads it on the host only after the first row step is queued (without gradients: after everything),
so the host read stalls nothing (chunked.Normaliser). On CUDA the count is one Triton
kernel: as ten small torch kernels it held up the first row step by ~0.03 ms. So are the losses' sums
divided by N and weighted (six torch kernels before).
"""

import torch
import triton
import triton.language as tl

from .device import HostCopy

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
def _mean_losses_kernel(token_losses_ptr, num_tokens, normaliser_ptr, normaliser, weight_hard, weight_soft, loss_ptr,
                        soft_ptr, hard_ptr, N_FROM: tl.constexpr, BLOCK: tl.constexpr):
    """hard, soft = the columns of token_losses [T, 2] summed, each term divided by N first (terms near
    fp32's max must not overflow the sum); loss = weight_hard * hard + weight_soft * soft. One program."""
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
    tl.store(hard_ptr, hard_sum)
    tl.store(soft_ptr, soft_sum)
    tl.store(loss_ptr, weight_hard * hard_sum + weight_soft * soft_sum)


def count_labels_triton(labels: torch.Tensor, ignore_index: int, vocab_student: int) -> torch.Tensor:
    """[counted, out of range] as int32 on labels' device (contiguous 1-D labels)."""
    counts = torch.empty(2, dtype=torch.int32, device=labels.device)
    _count_labels_kernel[(1,)](labels, labels.numel(), ignore_index, vocab_student, counts, BLOCK=BLOCK)
    return counts


def mean_losses_triton(token_losses, counts, given, weight_hard: float, weight_soft: float):
    """mean_losses_torch in one kernel: (loss, soft, hard), three fp32 scalars."""
    if given is None:
        n_from, normaliser_tensor, normaliser = N_COUNTED, counts, 0.0
    elif torch.is_tensor(given):
        n_from, normaliser_tensor, normaliser = N_GIVEN_TENSOR, given.to(token_losses.device).reshape(()), 0.0
    else:
        n_from, normaliser_tensor, normaliser = N_GIVEN_NUMBER, counts, float(given)  # counts: not read
    loss, soft, hard = (torch.empty((), dtype=torch.float32, device=token_losses.device) for _ in range(3))
    _mean_losses_kernel[(1,)](token_losses, len(token_losses), normaliser_tensor, normaliser, weight_hard, weight_soft,
                              loss, soft, hard, N_FROM=n_from, BLOCK=BLOCK)
    return loss, soft, hard


def mean_losses_torch(token_losses, counts, given, weight_hard: float, weight_soft: float):
    """(loss, soft, hard) from token_losses [T, 2]: each column's sum divided by N, N the counted labels
    (counts[0], at least 1) or ``given`` (a number or a one-element tensor)."""
    normaliser = (counts[0].clamp(min=1) if given is None
                  else given.to(torch.float32).reshape(()) if torch.is_tensor(given) else float(given))
    # divided first: terms near fp32's max must not overflow the sum
    hard, soft = ((token_losses[:, column] / normaliser).sum() for column in (0, 1))
    return weight_hard * hard + weight_soft * soft, soft, hard


def _out_of_range(labels: torch.Tensor, ignore_index: int, vocab_student: int) -> torch.Tensor:
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab_student))


def count_labels_torch(labels: torch.Tensor, ignore_index: int, vocab_student: int) -> torch.Tensor:
    return torch.stack([(labels != ignore_index).sum(), _out_of_range(labels, ignore_index, vocab_student).sum()])


class LabelCounts:
    """chunked.Normaliser for these labels: N is num_valid_tokens if given, else the number of labels
    that are not ignore_index (at least 1); ``wait`` raises for labels outside [0, Vs)."""

    def __init__(self, labels, ignore_index, vocab_student, num_valid_tokens):
        self.labels, self.ignore_index, self.vocab_student = labels, ignore_index, vocab_student
        self.num_valid_tokens = num_valid_tokens

    def launch(self):
        count = count_labels_triton if self.labels.is_cuda else count_labels_torch
        self.device_counts = count(self.labels, self.ignore_index, self.vocab_student)
        self.counts = HostCopy(self.device_counts)

    def mean_losses(self, token_losses: torch.Tensor, weight_hard: float, weight_soft: float):
        """(loss, soft, hard) without a host read: the per-token losses' column sums divided by N (the
        launched count, at least 1, or num_valid_tokens as given), the loss weighted."""
        mean_losses = mean_losses_triton if token_losses.is_cuda else mean_losses_torch
        return mean_losses(token_losses, self.device_counts, self.num_valid_tokens, weight_hard, weight_soft)

    def wait(self) -> float:
        num_valid, num_out_of_range = self.counts.get().tolist()
        if num_out_of_range:
            examples = self.labels[_out_of_range(self.labels, self.ignore_index, self.vocab_student)]
            raise ValueError(
                f"true_labels has {num_out_of_range} labels outside [0, {self.vocab_student}) that are not "
                f"ignore_index={self.ignore_index}, e.g. {examples[:5].tolist()}"
            )
        if self.num_valid_tokens is None:
            return float(max(1, num_valid))
        given = self.num_valid_tokens
        normaliser = float(given.item() if torch.is_tensor(given) else given)
        if not normaliser > 0:
            raise ValueError(f"num_valid_tokens must be > 0, got {normaliser}")
        return normaliser
