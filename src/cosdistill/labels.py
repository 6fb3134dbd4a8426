"""N, the loss's divisor, and the check for labels outside [0, Vs): counted on the device.

The chunk loop launches the count behind the first student GEMM, divides the loss by it on the device, and
reads it on the host only after the first row step is queued (without gradients: after everything),
so the host read stalls nothing (chunked.Normaliser). On CUDA the count is one Triton
kernel: as ten small torch kernels it held up the first row step by ~0.03 ms (benchmarks/NOTES.md
item 26).
"""

import torch
import triton
import triton.language as tl

from .chunked import HostCopy

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


def count_labels_triton(labels: torch.Tensor, ignore_index: int, vocab_student: int) -> torch.Tensor:
    """[counted, out of range] as int32 on labels' device (contiguous 1-D labels)."""
    counts = torch.empty(2, dtype=torch.int32, device=labels.device)
    _count_labels_kernel[(1,)](labels, labels.numel(), ignore_index, vocab_student, counts, BLOCK=BLOCK)
    return counts


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

    def on_device(self) -> torch.Tensor | float:
        """N without a host read: the launched count (at least 1), or num_valid_tokens as given."""
        given = self.num_valid_tokens
        if given is None:
            return self.device_counts[0].clamp(min=1)
        return given.to(self.labels.device, torch.float32).reshape(()) if torch.is_tensor(given) else float(given)

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
