"""The teacher side that forms the teacher's logits: per chunk, its logits GEMM in sub-chunks into one
reused buffer, each followed by the row step on those rows. The GEMM is ``TeacherHead``'s (the weight's
own dtype) or ``_teacher_fp8.Fp8TeacherHead``'s."""

import torch

from ._row_step import RowStepScales


def logits_into(out, hidden, weight, bias):
    """out = hidden @ weight.T (+ bias), into out."""
    if bias is None:
        torch.mm(hidden, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden, weight.t(), out=out)


class TeacherHead:
    """The teacher's logits GEMM in the weight's own dtype."""

    poison = None  # a head built from a cached copy of the weight: NaN where that copy was stale (_weight_cache.py)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.vocab, self.logits_dtype = weight.shape[0], weight.dtype

    def buffer_rows(self, rows: int) -> int:
        return rows

    def start_chunk(self, hidden: torch.Tensor) -> None:
        """The chunk's teacher hidden rows, which ``logits_into`` then takes in sub-chunks."""
        self.chunk_hidden = hidden

    def logits_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        """out[:stop - start] = the chunk's rows start..stop @ weight.T (+ bias)."""
        logits_into(out[: stop - start], self.chunk_hidden[start:stop], self.weight, self.bias)


class LogitsTeacher:
    """_chunk_loop.TeacherSide through the teacher's logits: ``head`` (TeacherHead or Fp8TeacherHead) forms
    them ``sub_rows`` at a time, and ``row_step`` (the backend's, or its vocabulary-split form) reads them."""

    adds_grad_input_share = False  # d loss / d s alone makes the gradients

    def __init__(self, head, row_step, scales: RowStepScales, sub_rows: int):
        self.head, self.step, self.scales, self.sub_rows = head, row_step, scales, sub_rows
        self.poison = head.poison
        self.buffer = None

    def start(self, student_input: torch.Tensor, teacher_input: torch.Tensor) -> None:
        """The logits buffer, allocated once the first student GEMM is queued."""
        self.buffer = torch.empty(self.head.buffer_rows(self.sub_rows), self.head.vocab, dtype=self.head.logits_dtype,
                                  device=teacher_input.device)

    def row_step(self, student_logits, student_hidden, teacher_hidden, labels, token_losses, write_grad, lifts=None):
        """The chunk's row steps, one per sub-chunk of teacher logits; student_logits becomes d loss / d s."""
        self.head.start_chunk(teacher_hidden)
        for start in range(0, len(labels), self.sub_rows):
            stop = min(start + self.sub_rows, len(labels))
            self.head.logits_into(self.buffer, start, stop)
            grad_lifts = () if lifts is None else (lifts[start:stop],)
            self.step(student_logits[start:stop], self.buffer[: stop - start], labels[start:stop], self.scales,
                          token_losses[start:stop], write_grad, *grad_lifts)

    def check_range(self) -> None:
        """Nothing to check: the row step rescales rows of any range."""

    def grad_input_share_into(self, grad_input_rows: torch.Tensor, inv_normaliser: float) -> bool:
        return False

    def accumulate(self, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> None:
        """No share of grad_weight beyond d loss / d s's."""

    def grad_weight_share_into(self, grad_weight: torch.Tensor, alpha: float, beta: float) -> bool:
        return False
