"""The teacher side that forms the teacher's logits: its logits GEMM in sub-chunks of each chunk, each
followed by the row step on those rows. The GEMM is ``TeacherHead``'s (the weight's own dtype) or
``_teacher_fp8.Fp8TeacherHead``'s. With a ``SideStream`` (CUDA), each row step runs on a second stream
beside the next sub-chunk's teacher GEMM, which goes into a second buffer (docs/design.md, Chunking and
buffers, The row step beside the teacher GEMM)."""

import functools
from typing import Protocol

import torch

from ._chunk_loop import ChunkRows
from ._device import logits_into
from ._fingerprint import as_words
from ._row_step import RowStepConstants


class LogitsHead(Protocol):
    """What ``LogitsTeacher`` asks of a head: ``TeacherHead`` below, or ``_teacher_fp8.Fp8TeacherHead``."""

    vocab: int  # the logit columns the row step reads
    logits_dtype: torch.dtype
    buffer_columns: int  # the GEMM's output columns (vocab, or more where the GEMM pads)
    poison: torch.Tensor | None  # 0-d, NaN where the cached weight copy it was built from was stale
    later: object | None  # that copy's content check, left to the first row step (_weight_cache.LaterCheck)

    def buffer_rows(self, rows: int) -> int: ...  # a logits buffer's rows for a sub-chunk of this many
    def start_chunk(self, hidden: torch.Tensor) -> None: ...  # the chunk's teacher hidden rows
    def logits_into(self, out: torch.Tensor, start: int, stop: int) -> None: ...  # out[:stop - start] = their logits


class TeacherHead:
    """The teacher's logits GEMM in the weight's own dtype (a ``LogitsHead``)."""

    poison = None  # a head built from a cached copy of the weight: NaN where that copy was stale (_weight_cache.py)
    later = None  # or that copy's content check, left to the first row step (_weight_cache.LaterCheck)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.vocab, self.logits_dtype = weight.shape[0], weight.dtype
        self.buffer_columns = self.vocab  # the GEMM's output columns: its logits alone

    def buffer_rows(self, rows: int) -> int:
        return rows

    def start_chunk(self, hidden: torch.Tensor) -> None:
        """The chunk's teacher hidden rows, which ``logits_into`` then takes in sub-chunks."""
        self.chunk_hidden = hidden

    def logits_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        """out[:stop - start] = the chunk's rows start..stop @ weight.T (+ bias)."""
        logits_into(out[: stop - start], self.chunk_hidden[start:stop], self.weight, self.bias)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One per device, shared by the calls of every stream on it: what a step allocates there goes back to its pool
    when freed, and its next use waits only for that call's stream (so a tensor another stream reads is marked as
    used by it: the poison in ``LogitsTeacher._step_and_check``)."""
    return torch.cuda.Stream(device)


class SideStream:
    """The row steps' stream beside the caller's, on which the teacher GEMMs stay. ``run`` queues a row
    step behind everything queued so far on the caller's stream (its logits, the student's); ``record``
    marks the end of a step's reads of a buffer, which ``wait`` makes the caller's stream wait for before
    the buffer is written again; ``join`` makes it wait for every step (before the gradient GEMMs read
    d loss / d s, and before any tensor the steps read can be freed)."""

    def __init__(self, device: torch.device):
        self.caller, self.side = torch.cuda.current_stream(device), _side_stream(device)
        self.read = [torch.cuda.Event(), torch.cuda.Event()]  # per buffer

    def run(self, step, *args) -> None:
        self.side.wait_stream(self.caller)
        with torch.cuda.stream(self.side):
            step(*args)

    def record(self, buffer: int) -> None:
        self.read[buffer].record(self.side)

    def wait(self, buffer: int) -> None:
        self.caller.wait_event(self.read[buffer])

    def join(self) -> None:
        self.caller.wait_stream(self.side)


class LogitsTeacher:
    """_chunk_loop.TeacherSide through the teacher's logits: ``head`` (a LogitsHead) forms
    them ``rows.teacher`` at a time, and ``row_step`` (the backend's, or its vocabulary-split form) reads them.
    With ``side`` (a SideStream), each row step is queued on the side stream and then, on the caller's, the GEMM
    of the sub-chunk after it (the next chunk's first at a chunk's end), so that the two run together: the step
    waits only for what the caller's stream had queued before it. A head whose cached weight
    copy's check is left to it (``head.later``) has the first row step take that check's hash where
    ``hashing_step`` can (RowStepImpl.hashing_step), else ``fingerprint`` hashes the weight after it."""

    adds_grad_input_share = False  # d loss / d s alone makes the gradients

    def __init__(self, head: LogitsHead, row_step, constants: RowStepConstants, rows: ChunkRows, side: SideStream | None = None,
                 hashing_step=None, fingerprint=None):
        self.head, self.step, self.constants, self.rows, self.side = head, row_step, constants, rows, side
        self.poison, self.later = head.poison, head.later
        self.hashing_step, self.fingerprint = hashing_step, fingerprint
        self.buffers = []

    def start(self, student_input: torch.Tensor, teacher_input: torch.Tensor) -> None:
        """The logits buffers, allocated once the first student GEMM is queued."""
        shape = (self.head.buffer_rows(self.rows.teacher), self.head.buffer_columns)
        self.buffers = [torch.empty(shape, dtype=self.head.logits_dtype, device=teacher_input.device)
                        for _ in range(1 if self.side is None else 2)]
        self.teacher_input = teacher_input
        self.next_row = 0  # the first row of the chunk whose row steps come next
        self.head_chunk = None  # the first row of the chunk the head holds
        self.ahead = None  # (buffer, stop) of the sub-chunk whose GEMM is queued ahead of its row step (side stream)

    def _queue_logits(self, start: int, buffer: int) -> int:
        """Queue the teacher GEMM of the sub-chunk starting at row ``start`` of the call into buffers[buffer];
        its stop. Chunks start at multiples of rows.student, sub-chunks at multiples of rows.teacher in them."""
        chunk_start = start // self.rows.student * self.rows.student
        chunk_stop = min(chunk_start + self.rows.student, len(self.teacher_input))
        if self.head_chunk != chunk_start:
            self.head.start_chunk(self.teacher_input[chunk_start:chunk_stop])
            self.head_chunk = chunk_start
        stop = min(start + self.rows.teacher, chunk_stop)
        self.head.logits_into(self.buffers[buffer], start - chunk_start, stop - chunk_start)
        return stop

    def row_step(self, student_logits, student_hidden, teacher_hidden, labels, token_losses, write_grad, grad_lifts=None):
        """The chunk's row steps, one per sub-chunk of teacher logits; student_logits becomes d loss / d s."""
        chunk_start = start = self.next_row
        if len(labels) and teacher_hidden.data_ptr() != self.teacher_input[chunk_start].data_ptr():
            raise RuntimeError("LogitsTeacher.row_step takes the chunks of its teacher_input in order")
        self.next_row += len(labels)
        while start < self.next_row:
            if self.ahead is None:
                buffer, stop = 0, self._queue_logits(start, 0)
            else:
                buffer, stop = self.ahead
            rows = slice(start - chunk_start, stop - chunk_start)
            args = (student_logits[rows], self.buffers[buffer][: stop - start, : self.head.vocab], labels[rows], self.constants,
                    token_losses[rows], write_grad, *(() if grad_lifts is None else (grad_lifts[rows],)))
            step = self.step if self.later is None else self._step_and_check
            if self.side is None:
                step(*args)
            else:
                self.side.run(step, *args)
                self.side.record(buffer)
                self.ahead = None
                if stop < len(self.teacher_input):  # the next GEMM, into the buffer the step before this read
                    self.side.wait(1 - buffer)
                    self.ahead = 1 - buffer, self._queue_logits(stop, 1 - buffer)
            start = stop
        if self.side is not None:
            self.side.join()

    def _step_and_check(self, *args) -> None:
        """A row step and the cached weight copy's content check, its hash taken by the step where it can."""
        later, self.later = self.later, None
        partials = None if self.hashing_step is None else self.hashing_step(*args, words=as_words(later.weight))
        if partials is None:  # the step did not run
            self.step(*args)
        self.poison = later.finish(self.fingerprint(later.weight) if partials is None else partials)
        if self.side is not None and self.poison is not None:
            # made on the side stream, read by the caller's: freed, it must wait for the caller's queued reads, not
            # only for the side stream's next use, which waits for the caller of that call alone
            self.poison.record_stream(self.side.caller)

    def check_range(self) -> None:
        """Nothing to check: the row step rescales rows of any range."""

    def grad_input_share_into(self, grad_input_rows: torch.Tensor, inv_normaliser: float) -> bool:
        return False

    def accumulate(self, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> None:
        """No share of grad_weight beyond d loss / d s's."""

    def grad_weight_share_into(self, grad_weight: torch.Tensor, alpha: float, beta: float) -> bool:
        return False
