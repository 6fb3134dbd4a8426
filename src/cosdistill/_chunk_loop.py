"""The chunk loop: logits GEMMs into preallocated buffers, the fused row step, gradient GEMMs.

Everything the loss costs happens in ``chunked_loss_and_grads``: per chunk of tokens, a cuBLAS GEMM
writes the student's logits into a reused buffer, the teacher side (``TeacherSide``: its logits GEMM in
sub-chunks, _teacher_logits.py, or its Gram matrices, _teacher_gram.py) runs the fused row step, which
turns the student buffer into d loss / d logits in place, and two more GEMMs turn that into grad_input
(written straight into its slice) and grad_weight (accumulated). Backward applies grad_output, folding
it into the last chunk's grad_weight GEMM (``Gradients.finish``; a small call runs that GEMM in forward and
scales grad_weight), and runs the last chunk's grad_input GEMM while the host reads grad_output.
"""

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ._device import HostCopy, addmm_into, leading_rows, logits_into
from ._fp16_lift import Unlift


class Normaliser(Protocol):
    """N, counted on the device: ``launch`` queues the count, ``mean_losses`` divides the per-token losses'
    sums by it without a host read, ``wait`` returns it on the host (and may raise)."""

    def launch(self) -> None: ...

    # loss, soft, hard; the poison (0-d, NaN where a cached teacher copy was stale), if given, added to each
    def mean_losses(self, token_losses: torch.Tensor, poison: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]: ...

    def wait(self) -> float: ...


@dataclass(frozen=True)
class ChunkRows:
    student: int  # tokens per chunk: the student's logits GEMM, d loss / d logits, the gradient GEMMs
    teacher: int  # tokens per teacher logits GEMM and row step, inside a chunk (<= student)


class TeacherSide(Protocol):
    """What the chunk loop asks of the teacher; everything that depends on how its terms are formed."""

    adds_grad_input_share: bool  # whether it adds a share of grad_input beside d loss / d s's GEMM
    poison: torch.Tensor | None  # 0-d, NaN where a cached copy of the teacher weight was stale; None: nothing cached

    def start(self, student_input: torch.Tensor, teacher_input: torch.Tensor) -> None:
        """Queued once the first chunk's student GEMM is: buffers, cached matrices."""

    def row_step(self, student_logits, student_hidden, teacher_hidden, labels, token_losses, write_grad,
                 grad_lifts=None) -> None:
        """One chunk's losses into token_losses and (write_grad) d loss / d s into student_logits, in place;
        grad_lifts: fp16's powers of two per row, as the row step takes them."""

    def check_range(self) -> None:
        """Raise if this call's inputs were out of the side's range (read once N is read)."""

    def grad_input_share_into(self, grad_input_rows: torch.Tensor, inv_normaliser: float) -> bool:
        """Write its share of the current chunk's grad_input rows; whether it wrote (adds_grad_input_share)."""

    def accumulate(self, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> None:
        """The current chunk's part of its grad_weight share."""

    def grad_weight_share_into(self, grad_weight: torch.Tensor, alpha: float, beta: float) -> bool:
        """grad_weight = beta * grad_weight + alpha * its share, after the loop; whether it wrote."""


def check_not_creating_graph() -> None:
    """Raise in a backward run with create_graph=True: the gradients come from forward's pass, not from ops that
    autograd could differentiate, so their own gradients (a gradient penalty's) would silently be zero."""
    if torch.is_grad_enabled():
        raise RuntimeError("cosdistill's losses are differentiable once: backward with create_graph=True (a gradient "
                           "penalty, double backward) would give their gradients no gradient of their own")


@dataclass
class Gradients:
    """The student's gradients for grad_output = 1, less the last chunk's grad_weight GEMM, which waits
    for grad_output: scaling by it then rides on that GEMM instead of a pass over grad_weight (docs/design.md,
    Chunking and buffers). The last chunk's grad_input GEMM
    waits too where it can (``last_grad_input``): queued in backward before the host waits to read
    grad_output, it keeps the GPU busy while the host launches the grad_weight GEMM. A small call runs that
    grad_weight GEMM in forward instead (``scale_grad_weight``): its GPU would idle until backward launched it."""

    grad_input: torch.Tensor | None
    grad_weight: torch.Tensor | None  # in the accum dtype
    grad_bias: torch.Tensor | None  # fp32
    last_grad_logits: torch.Tensor | None  # the last chunk's d L / d logits (unnormalised); None: no GEMM waits
    last_hidden: torch.Tensor | None
    accumulate_last: bool  # whether grad_weight already holds earlier chunks
    inv_normaliser: float
    grad_input_lifts: torch.Tensor | None = None  # fp16: grad_input's rows are kept times these
    unlift_rows: int = 1  # rows rescaled at a time in fp32 (grad_input_lifts)
    # fp16: Unlift.correct_scaled_down (_fp16_lift.py) for the last chunk, run here, where the host has waited for
    # the forward already (reading grad_output), so that the forward never waits for the host
    correct_last: Callable[..., bool] | None = None
    last_grad_input: torch.Tensor | None = None  # the last chunk's rows of grad_input, their GEMM not run yet
    student_weight: torch.Tensor | None = None  # for that GEMM
    # 0-d: NaN where the loss is not finite (a stale cached teacher copy's NaN is in it too), else 0; added to
    # grad_output, so that every gradient is NaN then
    poison: torch.Tensor | None = None
    scale_unless_one: Callable | None = None  # the backend's (_backends.py): grad_output onto the finished gradients
    scale_grad_weight: bool = False  # grad_weight is whole already (its last GEMM ran in forward): scale it too

    @torch.no_grad()  # backward(create_graph=True) runs it in grad mode; the views here were made in no_grad
    def finish(self, grad_output: torch.Tensor | None = None, grad_input_dtype: torch.dtype | None = None):
        """(grad_input, grad_weight, grad_bias) for this grad_output (a 0-d tensor; None: 1); grad_input in
        ``grad_input_dtype`` where given (the compiled op's fp32 for fp16 rows, which grad_output scales later)."""
        poison = self.poison  # goes with grad_output into the scale kernel (no launch of its own) where it can
        on_host = self.last_grad_logits is not None and self._scale_on_host()
        if poison is not None and grad_output is not None and (on_host or self.grad_input_lifts is not None):
            grad_output, poison = grad_output + poison, None  # read whole below: it carries the poison to every gradient
        if self.correct_last is not None and self.correct_last(overwrite=not self.accumulate_last):
            self.accumulate_last = True  # grad_weight holds the correction (or is None)
        host_grad_output = None
        if on_host and grad_output is not None:
            host_grad_output = HostCopy(grad_output)  # queued ahead of the GEMM below, so not waiting for it
        if self.last_grad_input is not None:
            self.last_grad_input.addmm_(self.last_grad_logits, self.student_weight, beta=0.0, alpha=self.inv_normaliser)
        if self.last_grad_logits is not None:
            self._last_grad_weight_gemm(grad_output, host_grad_output, poison)
        if self.grad_input is not None and self.grad_input_lifts is not None:
            unlifted = self.grad_input if grad_input_dtype is None else self.grad_input.new_empty(
                self.grad_input.shape, dtype=grad_input_dtype)
            for start in range(0, len(self.grad_input), self.unlift_rows):
                rows = slice(start, start + self.unlift_rows)
                factors = 1.0 / self.grad_input_lifts[rows, None]  # exact: powers of two
                unlifted[rows].copy_(self.grad_input[rows].float() * (factors if grad_output is None else factors * grad_output))
            self.grad_input = unlifted
        # Where grad_output is None the GEMM above and the unlift applied neither it nor the poison.
        unscaled = (self.grad_input if self.grad_input_lifts is None or grad_output is None else None, self.grad_bias,
                    self.grad_weight if self.scale_grad_weight or (self.last_grad_logits is not None and grad_output is None)
                    else None)
        to_scale = tuple(values for values in unscaled if values is not None)
        if (grad_output is not None or poison is not None) and to_scale:  # one launch for all: its host time is
            self.scale_unless_one(to_scale, grad_output, poison)  # what backward costs
        grad_input = self.grad_input if grad_input_dtype is None or self.grad_input is None else self.grad_input.to(
            grad_input_dtype)
        return grad_input, self.grad_weight, self.grad_bias

    def _scale_on_host(self) -> bool:
        """Whether grad_output goes onto the grad_weight GEMM's alpha and beta, read on the host."""
        return self.accumulate_last or self.last_hidden.dtype == torch.float16

    def _last_grad_weight_gemm(self, grad_output, host_grad_output, poison):
        """When this GEMM makes the whole of grad_weight, grad_output goes onto its hidden rows on the
        device. Otherwise (earlier chunks' sum in it; or fp16 rows, which a loss scale could overflow)
        it goes onto the GEMM's alpha and beta, read on the host (``host_grad_output``): a pass over
        grad_weight instead (when grad_output != 1, e.g. 1 / gradient accumulation steps) would cost a
        read and write of all of it, the wait only what the GPU has not queued behind it."""
        hidden, alpha, beta = self.last_hidden, self.inv_normaliser, 1.0 if self.accumulate_last else 0.0
        if host_grad_output is not None:
            scale = float(host_grad_output.get())
            alpha, beta = alpha * scale, beta * scale
        elif grad_output is not None:
            hidden = hidden.clone(memory_format=torch.contiguous_format)  # the scale kernel takes dense rows
            self.scale_unless_one((hidden,), grad_output, poison)
        _grad_weight_gemm(self.grad_weight, self.last_grad_logits, hidden, alpha=alpha, beta=beta)


@dataclass
class ChunkResult:
    loss: torch.Tensor  # fp32 scalars, divided by N; loss = weight_hard * hard + weight_soft * soft
    soft_loss: torch.Tensor
    hard_loss: torch.Tensor
    gradients: Gradients | None  # None when no gradient was asked for


def _grad_weight_gemm(grad_weight, grad_logits, hidden, alpha, beta):
    """grad_weight = beta * grad_weight + alpha * grad_logits^T @ hidden, in grad_weight's dtype.

    beta = 0 on the first chunk: cuBLAS then never reads the uninitialised buffer, so no memset.
    """
    addmm_into(grad_weight, grad_logits.t(), hidden, alpha=alpha, beta=beta)


def start_student_logits(student_input, student_weight, student_bias, rows: ChunkRows) -> torch.Tensor:
    """The student's logits buffer with the first chunk's GEMM queued into it. The set-up calls this as soon as
    the chunk rows are known, before the teacher side's, so that the GPU starts while the host works (the
    bench times a call from an idle GPU; docs/design.md, Host latency)."""
    student_logits = torch.empty(rows.student, student_weight.shape[0], dtype=student_weight.dtype,
                                 device=student_input.device)
    first_rows = min(rows.student, student_input.shape[0])
    logits_into(leading_rows(student_logits, first_rows), leading_rows(student_input, first_rows), student_weight,
                 student_bias)
    return student_logits


def chunked_loss_and_grads(
    student_input: torch.Tensor,  # [T, Hs]
    student_weight: torch.Tensor,  # [Vs, Hs]
    student_bias: torch.Tensor | None,
    teacher_input: torch.Tensor,  # [T, Ht]
    teacher: TeacherSide,
    labels: torch.Tensor,  # [T]
    normaliser: Normaliser,
    rows: ChunkRows,
    needs_grad: tuple[bool, bool, bool],  # input, weight, bias
    accum_dtype: torch.dtype,
    scale_unless_one: Callable,  # the backend's, for grad_output in backward
    reduce_grad_input: Callable[[torch.Tensor], None] | None = None,  # sums it over a vocabulary split
    student_logits: torch.Tensor | None = None,  # from start_student_logits, if the caller queued it; None: here
    grad_weight_in_forward: bool = False,  # the last chunk's grad_weight GEMM too (not with fp16's lifted rows)
    # (student logits, labels, rows of the call): the student's metrics from a chunk's logits before its row step
    metrics_into: Callable[[torch.Tensor, torch.Tensor, slice], None] | None = None,
) -> ChunkResult:
    """The row step does not need N (1/N is the gradient GEMMs' alpha), so N is counted behind the first
    chunk's student logits GEMM and, with gradients, waited for once the first chunk's row step is queued:
    the GPU never idles on it. The loss is divided by N on the device, so that without gradients the host
    reads N (to raise on bad labels) only once everything is queued."""
    num_tokens, hidden_student = student_input.shape
    vocab_student = student_weight.shape[0]
    device = student_input.device
    write_grad = any(needs_grad)
    chunk = rows.student

    # The first chunk's student GEMM and the label count are queued before the other buffers exist: the
    # GPU starts while the host allocates them.
    if student_logits is None:
        student_logits = start_student_logits(student_input, student_weight, student_bias, rows)
    normaliser.launch()
    teacher.start(student_input, teacher_input)
    token_losses = torch.empty(num_tokens, 2, dtype=torch.float32, device=device)
    grad_input = torch.empty(num_tokens, hidden_student, dtype=student_input.dtype, device=device) if needs_grad[0] else None
    grad_weight = None
    if needs_grad[1]:  # the first chunk's GEMM overwrites it; zeros only when there is no chunk
        allocate = torch.empty if num_tokens else torch.zeros
        grad_weight = allocate(vocab_student, hidden_student, dtype=accum_dtype, device=device)
    grad_bias = torch.zeros(vocab_student, dtype=torch.float32, device=device) if needs_grad[2] else None
    lifted = write_grad and student_weight.dtype == torch.float16
    unlift = Unlift(chunk, hidden_student, num_tokens, device) if lifted else None
    # The last chunk's grad_input GEMM runs in backward where backward waits to read grad_output on the
    # host: several chunks (Gradients). With one chunk nothing waits, and the GPU would idle instead
    # while the host went from the row step to backward. Not with fp16's lifted rows either, nor when
    # grad_input is summed over a vocabulary split here in forward, nor when the teacher side adds its
    # share of grad_input (written first).
    defer_grad_input = (num_tokens > chunk and grad_input is not None and grad_weight is not None and unlift is None
                        and reduce_grad_input is None and not teacher.adds_grad_input_share)
    # The last chunk's grad_weight GEMM waits for backward (Gradients), unless the caller runs it here.
    weight_whole_in_forward = grad_weight is not None and num_tokens > 0 and grad_weight_in_forward and unlift is None
    defer_grad_weight = grad_weight is not None and num_tokens > 0 and not weight_whole_in_forward

    inv_normaliser = None  # 1 / N on the host, for the gradient GEMMs
    weight_started = False  # whether grad_weight holds a sum yet (the first GEMM overwrites it)
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        hidden, teacher_hidden = student_input[start:stop], teacher_input[start:stop]
        grad_logits = student_logits[: stop - start]  # the chunk's logits, d loss / d logits after the row step
        if start:  # the first chunk's is queued above
            logits_into(grad_logits, hidden, student_weight, student_bias)
        if metrics_into is not None:  # grad_logits holds the chunk's logits until the row step
            metrics_into(grad_logits, labels[start:stop], slice(start, stop))
        teacher.row_step(grad_logits, hidden, teacher_hidden, labels[start:stop], token_losses[start:stop], write_grad,
                         None if unlift is None else unlift.lifts[: stop - start])
        if write_grad and inv_normaliser is None:
            inv_normaliser = 1.0 / normaliser.wait()
            teacher.check_range()
        if grad_input is not None and unlift is not None:
            unlift.grad_input_into(grad_input, start, grad_logits, student_weight, inv_normaliser, reduce_grad_input)
        elif grad_input is not None and not (defer_grad_input and stop == num_tokens):
            shared = teacher.grad_input_share_into(grad_input[start:stop], inv_normaliser)
            grad_input[start:stop].addmm_(grad_logits, student_weight, beta=1.0 if shared else 0.0, alpha=inv_normaliser)
        if grad_weight is not None:
            teacher.accumulate(hidden, teacher_hidden)
        correct = unlift is not None and (grad_weight is not None or grad_bias is not None)
        raw_hidden = hidden
        if correct:
            unlift.count_scaled_down(stop - start)
        if unlift is not None and grad_weight is not None:
            hidden = unlift.hidden_rows(hidden)
        if grad_weight is not None and (stop < num_tokens or not defer_grad_weight):
            _grad_weight_gemm(grad_weight, grad_logits, hidden, alpha=inv_normaliser, beta=1.0 if weight_started else 0.0)
            weight_started = True
        if grad_bias is not None and unlift is not None:
            unlift.add_grad_bias(grad_bias, grad_logits, inv_normaliser)
        elif grad_bias is not None:
            grad_bias.add_(grad_logits.sum(0, dtype=torch.float32), alpha=inv_normaliser)
        if correct and stop < num_tokens and unlift.correct_scaled_down(
                grad_weight, grad_bias, grad_logits, raw_hidden, inv_normaliser, overwrite=not weight_started):
            weight_started = weight_started or grad_weight is not None

    if grad_input is not None and reduce_grad_input is not None and unlift is None:
        reduce_grad_input(grad_input)
    if grad_weight is not None and num_tokens and teacher.grad_weight_share_into(  # before the last chunk's GEMM
            grad_weight, alpha=inv_normaliser, beta=1.0 if weight_started else 0.0):
        weight_started = True
    loss, soft_loss, hard_loss = normaliser.mean_losses(token_losses, teacher.poison)
    # Every gradient is NaN where the loss is not finite: a trainer that only filters a NaN loss out of its logs
    # (transformers' logging_nan_inf_filter) would otherwise apply whatever finite gradients came with it.
    poison = loss * 0.0 if write_grad else None
    if inv_normaliser is None:  # no gradients (or no tokens): read now, everything else is queued
        inv_normaliser = 1.0 / normaliser.wait()
        teacher.check_range()
    gradients = None
    if write_grad:
        last_start = (num_tokens - 1) // chunk * chunk if num_tokens else 0
        gradients = Gradients(
            grad_input, grad_weight, grad_bias,
            last_grad_logits=student_logits[: num_tokens - last_start] if defer_grad_weight else None,
            last_hidden=hidden if defer_grad_weight else None,  # the last chunk's (divided by its lifts in fp16)
            accumulate_last=weight_started,
            inv_normaliser=inv_normaliser,
            grad_input_lifts=None if unlift is None or grad_input is None else unlift.grad_input_lifts,
            unlift_rows=chunk,
            correct_last=functools.partial(unlift.correct_scaled_down, grad_weight, grad_bias, grad_logits, raw_hidden,
                                           inv_normaliser) if num_tokens and correct else None,
            last_grad_input=grad_input[last_start:] if defer_grad_input else None,
            student_weight=student_weight if defer_grad_input else None,
            poison=poison,
            scale_unless_one=scale_unless_one,
            scale_grad_weight=weight_whole_in_forward,
        )
    return ChunkResult(loss, soft_loss, hard_loss, gradients)
