"""Vocabulary-parallel LM heads (Megatron style): both heads split along the vocabulary over a group.

Each rank holds rows [start, stop) of the teacher's head and the same rows of the student's (up to
the student's vocabulary, which may be smaller), and every rank sees the same hidden states and
labels. Pass the local shards and a ``VocabParallelOptions`` to ``fused_linear_cosine_distill``:

    options = VocabParallelOptions.even_split(vocab_teacher, vocab_student, group)
    loss = fused_linear_cosine_distill(
        hidden_s, options.student_rows(student_weight), hidden_t, options.teacher_rows(teacher_weight),
        labels, vocab_parallel=options)

Per chunk, each rank computes its logits and the per-token statistics of its columns (max, sum of
exp, target logit, s.t, |s|^2, |t|^2, see _row_step.ROW_STATS); the statistics are all-gathered and
combined (O(tokens) traffic, never the logits), and each rank writes the gradient of its own logits.
Every rank returns the same loss. grad_input is summed over the group inside the loss (so the hidden
states' upstream must not all-reduce it again); grad_weight and grad_bias are each rank's own shard's.
Each call checks the split, and every rank raises where it is wrong: before the first GEMM, one all-gather
of what the host knows, read at once (the ranks' rows tile the vocabulary; they agree on the tokens, options
and all that sizes the collectives); behind the first chunk's GEMMs, one of the hidden states' and labels'
hashes, read where the call waits for its label count (_split_check.py).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._groups import check_member

# all_gather_into_tensor, named all_gather_single from torch 2.13 (the old name warns there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class VocabParallelOptions:
    """This rank's rows [start, stop) of both heads; ``vocab_student`` is the student's whole vocabulary,
    ``vocab_teacher`` the teacher's (``even_split`` sets it): the ranks' rows must cover it exactly. None stands for
    a teacher vocabulary equal to the student's; a split whose rows go past the student's must name it."""

    start: int
    stop: int
    vocab_student: int
    group: dist.ProcessGroup | None = None
    vocab_teacher: int | None = None

    def __post_init__(self):
        if self.group is not None:
            check_member(self.group, "VocabParallelOptions")
        if not 0 <= self.start < self.stop:
            raise ValueError(f"VocabParallelOptions needs 0 <= start < stop, got start={self.start}, stop={self.stop}")
        within_teacher = self.vocab_teacher is None or (self.vocab_student <= self.vocab_teacher
                                                        and self.stop <= self.vocab_teacher)
        if self.vocab_student <= 0 or not within_teacher:
            raise ValueError(f"VocabParallelOptions needs 0 < vocab_student <= vocab_teacher and stop <= vocab_teacher, "
                             f"got vocab_student={self.vocab_student}, vocab_teacher={self.vocab_teacher}, stop={self.stop}")

    @classmethod
    def even_split(cls, vocab_teacher: int, vocab_student: int | None = None, group=None) -> "VocabParallelOptions":
        """This rank's slice of a contiguous split of the teacher's vocabulary into near-equal parts."""
        vocab_student = vocab_teacher if vocab_student is None else vocab_student
        if not 0 < vocab_student <= vocab_teacher:
            raise ValueError(f"VocabParallelOptions.even_split needs 0 < vocab_student <= vocab_teacher, got "
                             f"vocab_student={vocab_student}, vocab_teacher={vocab_teacher}")
        check_member(group, "VocabParallelOptions.even_split")
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        if vocab_teacher < ranks:
            raise ValueError(f"VocabParallelOptions.even_split cannot split vocab_teacher={vocab_teacher} rows over the "
                             f"group's {ranks} ranks: each rank needs one")
        base, extra = divmod(vocab_teacher, ranks)
        start = rank * base + min(rank, extra)
        return cls(start, start + base + (rank < extra), vocab_student, group, vocab_teacher)

    def teacher_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full teacher head weight or bias."""
        vocab_teacher = self.vocab_student if self.vocab_teacher is None else self.vocab_teacher
        if full.shape[0] != vocab_teacher:  # a larger head's rows past it would be left out of the loss, silently
            hint = ("" if self.vocab_teacher is not None else ": a teacher vocabulary larger than the student's needs "
                    "vocab_teacher (VocabParallelOptions.even_split sets it)")
            raise ValueError(f"teacher_rows needs the full teacher head ({vocab_teacher} rows), got "
                             f"{tuple(full.shape)}{hint}")
        return full[self.start : self.stop]

    def student_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full student head weight or bias (none past the student's vocabulary)."""
        if full.shape[0] != self.vocab_student:
            raise ValueError(f"student_rows needs the full student head, {self.vocab_student} rows, got "
                             f"{tuple(full.shape)}")
        return full[self.start : max(self.start, min(self.stop, self.vocab_student))]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[ranks, *tensor.shape], gathered flat into one buffer (gloo takes no stacked form): no list of outputs to
        copy out and stack."""
        ranks = dist.get_world_size(self.group)
        gathered = tensor.new_empty(ranks * tensor.numel())
        _all_gather_single(gathered, tensor.contiguous().view(-1), group=self.group)
        return gathered.view(ranks, *tensor.shape)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)
