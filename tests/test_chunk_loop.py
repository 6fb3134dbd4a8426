"""The chunk loop (_chunk_loop.py): teacher sub-chunks, the last chunk's deferred GEMM, and when the host reads N."""

import dataclasses

import pytest
import torch

from conftest import TOLERANCE, assert_matches_reference, make_problem, reference, rel_err, run_fused
from cosdistill import fused_linear_cosine_distill, fused_linear_jsd
from cosdistill.testing import (
    FUSED_LOSSES,
    TORCH,
    ChunkRows,
    LabelCounts,
    LogitsTeacher,
    Options,
    TeacherHead,
    chunked_loss_and_grads,
    plan,
    weight_cache,
)


@pytest.mark.parametrize("rows", [ChunkRows(16, 5), ChunkRows(10, 3), ChunkRows(37, 36), ChunkRows(8, 8)])
@pytest.mark.parametrize("fp8_like_buffer", [False, True])
def test_teacher_logits_in_sub_chunks(impl, rows, fp8_like_buffer, monkeypatch):
    """The automatic sizes give the teacher's logits GEMM and the row step fewer rows than the student's
    chunk (seed workload: 1024 of 2048); small sizes here, forced, with odd remainders at both levels.
    ``fp8_like_buffer``: a teacher buffer with more rows than asked for, as the FP8 head's padding."""
    monkeypatch.setattr(plan, "chunk_rows", lambda *args, **kwargs: rows)
    if fp8_like_buffer:
        monkeypatch.setattr(TeacherHead, "buffer_rows", lambda self, n: n + 3)
    problem = make_problem(tokens=37, vocab_teacher=131, ignore_every=4)
    assert_matches_reference(problem, torch.float32, impl=impl)


@pytest.mark.parametrize("dtype, weight_grad, tokens, deferred", [
    (torch.float32, True, 37, True), (torch.bfloat16, True, 37, True),
    (torch.float32, True, 16, False),  # one chunk: backward does not wait for grad_output
    (torch.float32, False, 37, False),  # nothing deferred without grad_weight
    (torch.float16, True, 37, False),  # fp16: grad_input's rows are written with their lifts in forward
])
def test_last_chunk_grad_input_gemm_runs_in_backward(monkeypatch, dtype, weight_grad, tokens, deferred):
    """Where backward reads grad_output on the host before the last grad_weight GEMM (several chunks), the
    last chunk's grad_input GEMM waits for backward too, so the GPU has it to run meanwhile: those rows,
    poisoned after forward, come out right after a backward with grad_output != 1."""
    results = []

    def recording(*args, **kwargs):
        results.append(chunked_loss_and_grads(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(plan, "chunked_loss_and_grads", recording)
    problem = make_problem(tokens=tokens, dtype=dtype)
    problem.student_weight.requires_grad_(weight_grad)
    losses = fused_linear_cosine_distill(*problem.args(), chunk_size=16, return_soft_hard_loss=True)
    gradients = results[0].gradients
    assert (gradients.last_grad_input is not None) == deferred
    if deferred:
        assert gradients.last_grad_input.data_ptr() == gradients.grad_input[32].data_ptr()
        assert gradients.last_grad_input.shape == (5, problem.student_input.shape[1])
        gradients.last_grad_input.fill_(float("nan"))
    (losses[0] * -1.5).backward()
    _, ref_grads = reference(problem, -1.5)
    assert rel_err(problem.student_input.grad, ref_grads[0]) < TOLERANCE[dtype][1]


SMALL_CALLS = [  # (dtype, accum_dtype, in_forward)
    (torch.float32, None, True), (torch.bfloat16, None, True), (torch.bfloat16, torch.float32, True),
    (torch.float16, None, False),  # fp16: the lifted rows' grad_output is read on the host, for the GEMM's alpha
]


@pytest.mark.parametrize("impl, dtype, accum_dtype, in_forward, loss, grad_output", [
    *[("torch", *case, loss, grad_output) for case in SMALL_CALLS for loss in ("cosine", "jsd") for grad_output in (1.0, -1.5)],
    # the Triton kernels' scaling of grad_weight, and its skip where grad_output is 1 (1024 rows: slow interpreted)
    ("triton", torch.bfloat16, None, True, "jsd", -1.5), ("triton", torch.bfloat16, None, True, "cosine", 1.0),
    # the cosine loss's Gram path, whose soft share of grad_weight is added after the loop (no biases there)
    ("torch", torch.float32, None, True, "gram", -1.5), ("torch", torch.bfloat16, None, True, "gram", 1.0),
])
def test_a_small_call_runs_the_last_grad_weight_gemm_in_forward(monkeypatch, impl, dtype, accum_dtype, in_forward, loss,
                                                               grad_output):
    """A small call (_plan.small_call: one chunk of 1024 tokens here) leaves no GEMM for backward: grad_weight is
    whole after forward, and backward scales it by grad_output unless that is 1. Both gradients match float64."""
    results = []

    def recording(*args, **kwargs):
        results.append(chunked_loss_and_grads(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(plan, "chunked_loss_and_grads", recording)
    gram = loss == "gram"
    loss = "cosine" if gram else loss
    problem = make_problem(tokens=1024, vocab_student=67, vocab_teacher=75, dtype=dtype, ignore_every=5, bias=not gram)
    kwargs = dict(impl=impl, accum_dtype=accum_dtype, return_soft_hard_loss=True, beta=0.3)
    losses = FUSED_LOSSES[loss](*problem.args(), **kwargs, **dict(cosine_via="gram") if gram else {})
    gradients = results[0].gradients
    assert (gradients.last_grad_logits is None) == in_forward and gradients.scale_grad_weight == in_forward
    ref_losses, ref_grads = reference(problem, grad_output, loss=loss, beta=0.3)
    if in_forward:  # for grad_output = 1, before backward
        assert rel_err(gradients.grad_weight, ref_grads[1] / grad_output) < TOLERANCE[dtype][1]
    (losses[0] * grad_output).backward()
    for leaf, want in zip(problem.student_leaves(), ref_grads):
        assert leaf.grad.dtype == leaf.dtype and rel_err(leaf.grad, want) < TOLERANCE[dtype][1], tuple(leaf.shape)


@pytest.mark.parametrize("grad", [True, False])
def test_host_reads_n_only_where_gradients_need_it(grad):
    """With gradients the host reads N once the first chunk's row steps are queued (1/N is the gradient
    GEMMs' alpha); without, only after every chunk is queued, the loss divided by N on the device."""
    problem = make_problem(tokens=37, ignore_every=3)
    row_steps, steps_before_read = [], []
    row_step = TORCH.cosine_row_step.step

    def counting_row_step(*args, **kwargs):
        row_steps.append(1)
        return row_step(*args, **kwargs)

    class RecordingCounts(LabelCounts):
        def wait(self):
            steps_before_read.append(len(row_steps))
            return super().wait()

    labels = problem.labels
    teacher = LogitsTeacher(TeacherHead(problem.teacher_weight, None), counting_row_step, Options().constants, ChunkRows(16, 8))
    result = chunked_loss_and_grads(
        problem.student_input.detach(), problem.student_weight.detach(), None, problem.teacher_input, teacher, labels,
        RecordingCounts(labels, -100, problem.student_weight.shape[0], None, TORCH, 0.5, 0.5), ChunkRows(16, 8),
        (grad, grad, False), torch.float32, TORCH.scale_unless_one)
    assert len(row_steps) == 5 and steps_before_read == ([2] if grad else [5])
    ref_losses, _ = reference(dataclasses.replace(problem, student_bias=None, teacher_bias=None))
    assert rel_err(0.5 * result.hard_loss + 0.5 * result.soft_loss, ref_losses[0]) < TOLERANCE[torch.float32][0]


class DeferredSide:
    """SideStream's stand-in on the CPU: each row step runs only when the caller's stream would wait for it,
    as late as a GPU may run it. A missing wait then lets the next teacher GEMM overwrite a buffer before the
    step that reads it runs (or a gradient GEMM read d loss / d s before it is written)."""

    def __init__(self, waits=True):
        self.queue, self.waits, self.steps = [], waits, 0

    def run(self, step, *args):
        self.queue.append((step, args))
        self.steps += 1

    def record(self, buffer):
        self.queue.append(buffer)

    def wait(self, buffer):
        if self.waits and buffer in self.queue:
            self._run_through(len(self.queue) - self.queue[::-1].index(buffer))

    def join(self):
        self._run_through(len(self.queue))

    def _run_through(self, count):
        done, self.queue = self.queue[:count], self.queue[count:]
        for item in done:
            if not isinstance(item, int):
                item[0](*item[1])


def deferred_side(monkeypatch, rows, waits=True) -> list[DeferredSide]:
    """Plans with these chunk rows and their row steps on a DeferredSide; the sides made, one per call."""
    sides = []

    def side(device):
        sides.append(DeferredSide(waits))
        return sides[-1]

    monkeypatch.setattr(plan, "chunk_rows", lambda *args, **kwargs: rows)
    monkeypatch.setattr(plan, "row_step_beside_gemms", lambda *args: True)
    monkeypatch.setattr(plan, "SideStream", side)
    return sides


def test_the_poison_made_on_the_side_stream_is_kept_for_the_caller_s_reads(monkeypatch):
    """The cached copy's check, taken by a row step on the side stream, makes the poison there; the caller's stream
    reads it (the losses, backward's grad_output). Marked as used by the caller's stream, its memory is not handed
    out again before those reads, also where another caller's stream uses the same side stream next. Streams are
    stand-ins here, the CPU having none."""
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: recorded.append((tensor, stream)))
    poison, steps = torch.zeros(()), []

    class Head:
        poison = None
        later = weight_cache.LaterCheck(torch.ones(4), finish=lambda partials: poison)

    class Side:
        caller = object()

    teacher = LogitsTeacher(Head(), lambda *args: steps.append(args), None, None, Side(),
                            fingerprint=lambda weight: torch.zeros(2))
    teacher._step_and_check("logits")
    assert steps == [("logits",)] and teacher.poison is poison and teacher.later is None
    assert len(recorded) == 1 and recorded[0][0] is poison and recorded[0][1] is Side.caller


@pytest.mark.parametrize("rows", [ChunkRows(16, 5), ChunkRows(10, 3), ChunkRows(16, 16), ChunkRows(37, 7)])
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_row_steps_beside_the_teacher_gemms_wait_for_their_logits(monkeypatch, impl, rows, loss):
    """The row steps on a second stream (SideStream), each beside the next sub-chunk's teacher GEMM (the next
    chunk's first at a chunk's end) into the other of two buffers: every step reads its own logits, and the
    gradient GEMMs read every step's d loss / d s, however late the steps run."""
    sides = deferred_side(monkeypatch, rows)
    problem = make_problem(tokens=37, vocab_teacher=131, ignore_every=4)
    if loss == "cosine":
        assert_matches_reference(problem, torch.float32, impl=impl, cosine_via="logits")
    else:
        options = dict(beta=0.3, temperature=1.7)
        losses = fused_linear_jsd(*problem.args(), return_soft_hard_loss=True, impl=impl, **options)
        grads = torch.autograd.grad(losses[0], problem.student_leaves())
        want_losses, want_grads = reference(problem, loss="jsd", **options)
        for got, want in zip([*losses, *grads], [*want_losses, *want_grads]):
            assert rel_err(got, want) < 1e-5
    assert sides[0].steps == sub_chunks(37, rows)


def sub_chunks(tokens, rows):
    return sum(-(-(min(start + rows.student, tokens) - start) // rows.teacher) for start in range(0, tokens, rows.student))


def test_row_steps_beside_the_teacher_gemms_fail_without_the_buffer_wait(monkeypatch):
    """The stand-in can fail: without the wait before a buffer is written again, the steps read later logits."""
    sides = deferred_side(monkeypatch, ChunkRows(16, 5), waits=False)
    problem = make_problem(tokens=37, vocab_teacher=131, ignore_every=4)
    losses, grads = run_fused(problem, cosine_via="logits")
    assert sides[0].steps == sub_chunks(37, ChunkRows(16, 5))
    ref_losses, ref_grads = reference(problem)
    assert rel_err(losses[1], ref_losses[1]) > 100 * TOLERANCE[torch.float32][0]
    assert rel_err(grads[0], ref_grads[0]) > 100 * TOLERANCE[torch.float32][1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad", [True, False])
def test_row_steps_beside_the_teacher_gemms_in_half_precision(monkeypatch, dtype, grad):
    """fp16's lifts (written by the steps, read by the gradient GEMMs) and the no-grad forward, beside the GEMMs;
    a teacher buffer with more rows than asked for, as the FP8 head's padding."""
    sides = deferred_side(monkeypatch, ChunkRows(12, 5))
    monkeypatch.setattr(TeacherHead, "buffer_rows", lambda self, n: n + 3)
    problem = make_problem(tokens=37, vocab_teacher=131, ignore_every=4, dtype=dtype)
    if grad:
        assert_matches_reference(problem, dtype, cosine_via="logits")
    else:
        with torch.no_grad():
            losses = fused_linear_cosine_distill(*problem.args(), return_soft_hard_loss=True, cosine_via="logits")
        for got, want in zip(losses, reference(problem)[0]):
            assert rel_err(got, want) < TOLERANCE[dtype][0]
    assert sides[0].steps == sub_chunks(37, ChunkRows(12, 5))


def test_the_logits_teacher_takes_its_chunks_in_order():
    """The teacher side forms each chunk's logits from its own teacher_input (it queues them ahead of the chunk):
    a chunk out of order raises instead of stepping on another chunk's logits."""
    problem = make_problem(tokens=20, bias=False)
    teacher = LogitsTeacher(TeacherHead(problem.teacher_weight, None), TORCH.cosine_row_step.step, Options().constants,
                            ChunkRows(8, 4))
    teacher.start(problem.student_input, problem.teacher_input)
    logits = torch.empty(8, problem.student_weight.shape[0])
    with pytest.raises(RuntimeError, match="in order"):
        teacher.row_step(logits, problem.student_input[8:16], problem.teacher_input[8:16], problem.labels[8:16],
                         torch.empty(8, 2), False)
