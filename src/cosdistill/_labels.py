"""N, the loss's divisor, and the check for labels outside [0, Vs): counted on the device.

The chunk loop launches the count behind the first student GEMM, divides the loss by it on the device, and
reads it on the host only after the first row step is queued (without gradients: after everything),
so the host read stalls nothing (_chunk_loop.Normaliser). ``count_labels_torch`` and ``mean_losses_torch``
are the specs of the Triton kernels in kernels/labels.py.
"""

import math

import torch

from ._device import HostCopy


def mean_losses_torch(token_losses, counts, given, weight_hard: float, weight_soft: float, poison=None):
    """(loss, soft, hard) from token_losses [T, 2]: each column's sum divided by N, N the counted labels
    (counts[0], at least 1) or ``given`` (a number or a one-element tensor); ``poison`` (0-d: NaN where a
    cached teacher copy was stale, else 0), if given, added to each."""
    normaliser = (counts[0].clamp(min=1) if given is None
                  else given.to(torch.float32).reshape(()) if torch.is_tensor(given) else float(given))
    # divided first: terms near fp32's max must not overflow the sum
    hard, soft = ((token_losses[:, column] / normaliser).sum() for column in (0, 1))
    losses = weight_hard * hard + weight_soft * soft, soft, hard
    return losses if poison is None else tuple(value + poison for value in losses)


def _out_of_range(labels: torch.Tensor, ignore_index: int, vocab_student: int) -> torch.Tensor:
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab_student))


def count_labels_torch(labels: torch.Tensor, ignore_index: int, vocab_student: int) -> torch.Tensor:
    return torch.stack([(labels != ignore_index).sum(), _out_of_range(labels, ignore_index, vocab_student).sum()])


class LabelCounts:
    """_chunk_loop.Normaliser for these labels: N is num_valid_tokens if given, else the number of labels
    that are not ignore_index (at least 1); ``wait`` raises for labels outside [0, Vs). The count and the
    mean are the backend's (_backends.py)."""

    def __init__(self, labels, ignore_index, vocab_student, num_valid_tokens, backend, weight_hard, weight_soft):
        self.labels, self.ignore_index, self.vocab_student = labels, ignore_index, vocab_student
        self.num_valid_tokens, self.backend = num_valid_tokens, backend
        self.weight_hard, self.weight_soft = weight_hard, weight_soft

    def launch(self):
        self.device_counts = self.backend.count_labels(self.labels, self.ignore_index, self.vocab_student)
        self.counts = HostCopy(self.device_counts)

    def mean_losses(self, token_losses: torch.Tensor, poison: torch.Tensor | None = None):
        """(loss, soft, hard) without a host read: the per-token losses' column sums divided by N (the
        launched count, at least 1, or num_valid_tokens as given), the loss weighted, the poison added."""
        return self.backend.mean_losses(token_losses, self.device_counts, self.num_valid_tokens, self.weight_hard,
                                        self.weight_soft, poison)

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
        if not -math.inf < normaliser < math.inf:  # a number was checked before; a tensor's value is read here
            raise ValueError(f"num_valid_tokens must be finite, got {normaliser} (data_parallel_num_valid_tokens "
                             "gives NaN to every rank where one rank's labels, or its data parallel loss's "
                             "options, were refused)")
        if not normaliser > 0:
            raise ValueError(f"num_valid_tokens must be > 0, got {normaliser}")
        return normaliser
