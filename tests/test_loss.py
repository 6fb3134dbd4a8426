"""The fused loss against the float64 naive reference: losses and every student gradient."""

import dataclasses

import pytest
import torch

from conftest import TOLERANCE, make_problem, record_write_grad, reference, rel_err
from cosdistill import FusedLinearCosineDistillLoss, api, fused_linear_cosine_distill
from cosdistill import _plan as plan
from cosdistill._backends import TORCH
from cosdistill._chunk_loop import ChunkRows, chunked_loss_and_grads
from cosdistill._labels import LabelCounts
from cosdistill._plan import Options, chunk_rows
from cosdistill._teacher_logits import LogitsTeacher, TeacherHead


def run_fused(problem, grad_output=1.0, **kwargs):
    kwargs.setdefault("return_soft_hard_loss", True)
    losses = fused_linear_cosine_distill(*problem.args(), **kwargs)
    (losses[0] * grad_output).backward()
    return list(losses), [leaf.grad for leaf in problem.student_leaves()]


def assert_matches_reference(problem, dtype, grad_output=1.0, ref_kwargs=None, **kwargs):
    losses, grads = run_fused(problem, grad_output, **kwargs)
    ref_losses, ref_grads = reference(problem, grad_output, **(ref_kwargs or {}))
    loss_tol, grad_tol = TOLERANCE[dtype]
    for name, got, want in zip(("loss", "soft", "hard"), losses, ref_losses):
        assert got.dtype == torch.float32 and torch.isfinite(got)
        assert rel_err(got, want) < loss_tol, (name, got.item(), want.item())
    for leaf, got, want in zip(problem.student_leaves(), grads, ref_grads):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert rel_err(got, want) < grad_tol, (tuple(leaf.shape), rel_err(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("vocab_teacher", [101, 131])
def test_matches_reference(impl, dtype, bias, vocab_teacher):
    problem = make_problem(dtype=dtype, bias=bias, vocab_teacher=vocab_teacher, ignore_every=4)
    assert_matches_reference(problem, dtype, impl=impl, chunk_size=16)


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 16, 37, 1000])
def test_chunk_sizes(impl, chunk_size):
    problem = make_problem(tokens=37, ignore_every=3)
    assert_matches_reference(problem, torch.float32, impl=impl, chunk_size=chunk_size)


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


@pytest.mark.parametrize("grad_enabled, student_requires_grad, want_write_grad",
                         [(True, True, True), (False, True, False), (True, False, False)])
def test_chunk_rows_are_told_whether_gradients_are_wanted(grad_enabled, student_requires_grad, want_write_grad,
                                                          monkeypatch):
    """Without gradients the teacher's sub-chunks may be longer (chunk_rows' write_grad)."""
    seen = record_write_grad(monkeypatch, plan)
    problem = make_problem(tokens=9)
    for leaf in problem.student_leaves():
        leaf.requires_grad_(student_requires_grad)
    with torch.set_grad_enabled(grad_enabled):
        fused_linear_cosine_distill(*problem.args())
    assert seen == [want_write_grad]


def test_automatic_chunk_rows():
    seed = dict(vocab_student=128256, vocab_teacher=128256, itemsize=2)
    assert chunk_rows(None, 8192, **seed) == ChunkRows(2048, 1024)  # 0.79 GB of logits buffers
    assert chunk_rows(None, 3000, **seed) == ChunkRows(2048, 1024)
    assert chunk_rows(None, 1024, **seed) == ChunkRows(1024, 1024)
    assert chunk_rows(None, 100, **seed) == ChunkRows(100, 100)
    assert chunk_rows(None, 8192, 32000, 32000, 2) == ChunkRows(4160, 4160)  # 512 MiB of buffers for both
    assert chunk_rows(None, 4096, 32000, 32000, 2) == ChunkRows(4096, 4096)
    assert chunk_rows(None, 8192, 50257, 50257, 2) == ChunkRows(2624, 2624)
    assert chunk_rows(None, 8192, 262144, 262144, 2) == ChunkRows(2048, 512)  # the teacher's rows shrink first
    assert chunk_rows(None, 8192, 151936, 151936, 2) == ChunkRows(2048, 1024)
    assert chunk_rows(None, 8192, 300000, 300000, 2) == ChunkRows(1152, 1024)  # 2048 / 512 would pass 1.25 GiB
    assert chunk_rows(None, 8192, 600000, 600000, 4) == ChunkRows(256, 256)  # past the 1.25 GiB budget: fewer
    assert chunk_rows(None, 0, **seed) == ChunkRows(1, 1)
    # without gradients the teacher's sub-chunks grow to the student's chunk where both fit 1.25 GiB
    assert chunk_rows(None, 8192, **seed, write_grad=False) == ChunkRows(2048, 2048)
    assert chunk_rows(None, 1024, **seed, write_grad=False) == ChunkRows(1024, 1024)
    assert chunk_rows(None, 8192, 262144, 262144, 2, write_grad=False) == ChunkRows(2048, 512)  # 2 GiB would not
    assert chunk_rows(512, 8192, **seed, write_grad=False) == ChunkRows(512, 512)
    assert chunk_rows(512, 8192, **seed) == ChunkRows(512, 512)  # a given chunk_size holds for both
    assert chunk_rows(512, 100, **seed) == ChunkRows(100, 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_options_and_3d_inputs(impl, dtype):
    problem = make_problem(tokens=36, batch=3, dtype=dtype, vocab_teacher=130, ignore_every=5)
    options = dict(weight_hard_loss=0.3, weight_soft_loss=1.7, beta=0.8, temperature=2.5)
    assert_matches_reference(problem, dtype, grad_output=-2.5, ref_kwargs=options, impl=impl, chunk_size=10, **options)


@pytest.mark.parametrize("chunk_size", [8, None])  # several chunks: on the last GEMM's alpha and beta; one: on its rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_output_scales_gradients(impl, chunk_size, dtype):
    problem = make_problem(dtype=dtype)
    assert_matches_reference(problem, dtype, grad_output=3.25, impl=impl, chunk_size=chunk_size)


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16])
def test_fp32_and_bf16_grad_weight_accumulation(impl, accum_dtype):
    problem = make_problem(tokens=64, dtype=torch.bfloat16)
    assert_matches_reference(problem, torch.bfloat16, impl=impl, chunk_size=8, accum_dtype=accum_dtype)


def test_num_valid_tokens_overrides_normaliser(impl):
    problem = make_problem(ignore_every=2)
    assert_matches_reference(problem, torch.float32, ref_kwargs=dict(num_valid_tokens=50), impl=impl,
                             num_valid_tokens=torch.tensor(50))


def test_non_contiguous_inputs(impl):
    base = make_problem(tokens=40, hidden_student=32, hidden_teacher=48)
    problem = make_problem(tokens=20, hidden_student=16, hidden_teacher=24)
    with torch.no_grad():
        problem.student_input = base.student_input[::2, ::2].clone().requires_grad_()  # a strided leaf below
        problem.teacher_input = base.teacher_input[::2, ::2]
        problem.teacher_weight = torch.randn(24, problem.teacher_weight.shape[0]).t()
        problem.labels = torch.randint(0, 101, (40,))[::2]
    leaf = torch.randn(16, 101, requires_grad=True)  # student weight as a transposed view of a leaf
    problem.student_weight = leaf.t()
    assert not problem.student_weight.is_contiguous() and not problem.teacher_input.is_contiguous()
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl, chunk_size=6)
    loss.backward()
    ref_losses, ref_grads = reference(problem)
    assert rel_err(loss, ref_losses[0]) < 1e-5
    assert rel_err(problem.student_input.grad, ref_grads[0]) < 1e-5
    assert rel_err(leaf.grad.t(), ref_grads[1]) < 1e-5


def test_liger_positional_order_and_module(impl):
    problem = make_problem(ignore_every=6)
    positional = fused_linear_cosine_distill(*problem.args(), 0.2, 0.8, 0.4, -100, 1.5, True, 5, True, impl=impl)
    module = FusedLinearCosineDistillLoss(0.2, 0.8, 0.4, -100, 1.5, True, 5, True, impl=impl)
    from_module = module(*problem.args())
    ref_losses, _ = reference(problem, weight_hard_loss=0.2, weight_soft_loss=0.8, beta=0.4, temperature=1.5)
    for got, again, want in zip(positional, from_module, ref_losses):
        assert torch.equal(got, again)
        assert rel_err(got, want) < 1e-5


def test_no_grad_does_no_gradient_work(impl, monkeypatch):
    problem = make_problem()
    calls = []
    original = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        loss = fused_linear_cosine_distill(*problem.args(), impl=impl)
    assert not loss.requires_grad and calls == []
    ref_losses, _ = reference(problem)
    assert rel_err(loss, ref_losses[0]) < 1e-5


def test_nothing_requires_grad_gives_plain_loss(impl, monkeypatch):
    """Also without the autograd Function, under no_grad or with frozen leaves alike."""
    problem = make_problem()
    with_grad = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True)
    monkeypatch.setattr(api._AttachGradients, "apply", None)  # a call would raise
    with torch.no_grad():
        no_grad = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True)
    for leaf in problem.student_leaves():
        leaf.requires_grad_(False)
    frozen = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True)
    for losses in (no_grad, frozen):
        assert not any(value.requires_grad for value in losses)
        torch.testing.assert_close(losses, tuple(value.detach() for value in with_grad), rtol=1e-6, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(no_grad, frozen))
    assert rel_err(frozen[0], reference(problem)[0][0]) < 1e-5


def test_only_weight_requires_grad(impl):
    problem = make_problem(bias=False)
    problem.student_input.requires_grad_(False)
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl, chunk_size=9)
    loss.backward()
    assert problem.student_input.grad is None
    assert rel_err(problem.student_weight.grad, reference(problem)[1][1]) < 1e-5


def test_soft_and_hard_are_logged_without_gradient(impl):
    problem = make_problem()
    loss, soft, hard = fused_linear_cosine_distill(*problem.args(), return_soft_hard_loss=True, impl=impl)
    assert loss.requires_grad and not soft.requires_grad and not hard.requires_grad
    torch.testing.assert_close(loss, 0.5 * soft + 0.5 * hard)


def test_the_loss_may_be_scaled_in_place_before_backward(impl):
    """The loss is a tensor of its own, not the chunk loop's passed on (autograd forbids modifying that
    in place): loss /= accumulation steps must scale the gradients."""
    problem = make_problem(ignore_every=4)
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl)
    loss /= 4
    loss.backward()
    ref_losses, ref_grads = reference(problem, 0.25)
    assert rel_err(loss, 0.25 * ref_losses[0]) < 1e-5
    for leaf, want in zip(problem.student_leaves(), ref_grads):
        assert rel_err(leaf.grad, want) < 1e-5


def test_the_first_gemm_is_queued_before_the_rest_of_the_set_up(monkeypatch):
    """The bench times a call from an idle GPU: the first student GEMM goes out as soon as the plan is made,
    before the teacher side, the label count and the autograd Function."""
    order = []
    for name in ("start_student_logits", "TeacherHead", "LabelCounts"):
        original = getattr(plan, name)
        monkeypatch.setattr(plan, name, lambda *a, _f=original, _n=name, **k: order.append(_n) or _f(*a, **k))
    original_apply = api._AttachGradients.apply
    monkeypatch.setattr(api._AttachGradients, "apply", lambda *a: order.append("apply") or original_apply(*a))
    problem = make_problem()
    fused_linear_cosine_distill(*problem.args()).backward()
    assert order == ["start_student_logits", "TeacherHead", "LabelCounts", "apply"]
    assert rel_err(problem.student_weight.grad, reference(problem)[1][1]) < 1e-5


def test_same_inputs_give_bitwise_equal_outputs(impl):
    problem = make_problem(dtype=torch.bfloat16, ignore_every=3)
    first_losses, first_grads = run_fused(problem, impl=impl, chunk_size=8)
    first_grads = [g.clone() for g in first_grads]
    for leaf in problem.student_leaves():
        leaf.grad = None
    second_losses, second_grads = run_fused(problem, impl=impl, chunk_size=8)
    for a, b in zip(first_losses + first_grads, second_losses + second_grads):
        assert torch.equal(a, b)


def test_all_tokens_ignored_gives_zero_loss_and_gradients(impl):
    problem = make_problem()
    problem.labels.fill_(-100)
    losses, grads = run_fused(problem, impl=impl, chunk_size=8)
    assert all(loss.item() == 0.0 for loss in losses)
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_zero_tokens_gives_zero_loss(impl):
    problem = make_problem(tokens=0)
    losses, grads = run_fused(problem, impl=impl)
    assert all(loss.item() == 0.0 for loss in losses)
    assert grads[0].shape == (0, 16) and torch.count_nonzero(grads[1]) == 0


@pytest.mark.parametrize("where", ["student_input", "teacher_weight"])
def test_nan_input_gives_nan_loss(impl, where):
    problem = make_problem(bias=False)
    with torch.no_grad():
        getattr(problem, where).view(-1)[5] = float("nan")
    assert torch.isnan(fused_linear_cosine_distill(*problem.args(), impl=impl))


def test_ignored_tokens_get_zero_gradient_and_do_not_change_the_loss(impl):
    problem = make_problem(tokens=30, ignore_every=3)
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl, chunk_size=7)
    loss.backward()
    ignored = problem.labels == -100
    assert torch.count_nonzero(problem.student_input.grad[ignored]) == 0
    assert torch.count_nonzero(problem.student_input.grad[~ignored]) > 0
    kept = make_problem(tokens=20)
    kept.student_input, kept.teacher_input = problem.student_input[~ignored], problem.teacher_input[~ignored]
    kept.student_weight, kept.teacher_weight = problem.student_weight, problem.teacher_weight
    kept.student_bias, kept.teacher_bias, kept.labels = problem.student_bias, problem.teacher_bias, problem.labels[~ignored]
    assert rel_err(loss, fused_linear_cosine_distill(*kept.args(), impl=impl)) < 1e-6


def test_fp16_gradients_do_not_underflow_at_many_tokens(impl):
    """dlogits are kept unnormalised (1/N goes into the GEMMs); p / N would sit in fp16's subnormals here."""
    problem = make_problem(tokens=1500, hidden_student=8, hidden_teacher=8, vocab_student=64, dtype=torch.float16)
    assert_matches_reference(problem, torch.float16, impl=impl, chunk_size=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("caps", [(5.0, None), (None, 3.0), (2.5, 4.0)])
@pytest.mark.parametrize("logit_scales", [(1.0, 1.0), (0.5, 2.0)])
def test_logit_softcapping_and_scale(impl, dtype, caps, logit_scales):
    """Gemma-2 style c * tanh(logits / c) on each head, small caps so that tanh really bends, after a
    Cohere style logit scale."""
    options = dict(student_softcap=caps[0], teacher_softcap=caps[1], temperature=1.5,
                   student_logit_scale=logit_scales[0], teacher_logit_scale=logit_scales[1])
    problem = make_problem(dtype=dtype, vocab_teacher=120, ignore_every=4)
    assert_matches_reference(problem, dtype, ref_kwargs=options, impl=impl, chunk_size=10, **options)


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


@pytest.mark.parametrize("chunk_size", [16, None])
def test_backward_with_create_graph(chunk_size):
    """backward(create_graph=True) (e.g. a gradient penalty elsewhere in the model) runs backward in grad mode:
    the gradients come out the same (constants: the loss has no second derivative here)."""
    problem = make_problem(tokens=37)
    loss = fused_linear_cosine_distill(*problem.args(), chunk_size=chunk_size)
    (loss * 0.75).backward(create_graph=True)
    _, ref_grads = reference(problem, 0.75)
    for leaf, want in zip(problem.student_leaves(), ref_grads):
        assert rel_err(leaf.grad, want) < TOLERANCE[torch.float32][1]


@pytest.mark.parametrize("grad", [True, False])
def test_host_reads_n_only_where_gradients_need_it(grad):
    """With gradients the host reads N once the first chunk's row steps are queued (1/N is the gradient
    GEMMs' alpha); without, only after every chunk is queued, the loss divided by N on the device."""
    problem = make_problem(tokens=37, ignore_every=3)
    row_steps, steps_before_read = [], []
    row_step = TORCH.row_step.step

    def counting_row_step(*args, **kwargs):
        row_steps.append(1)
        return row_step(*args, **kwargs)

    class RecordingCounts(LabelCounts):
        def wait(self):
            steps_before_read.append(len(row_steps))
            return super().wait()

    labels = problem.labels
    teacher = LogitsTeacher(TeacherHead(problem.teacher_weight, None), counting_row_step, Options().scales, 8)
    result = chunked_loss_and_grads(
        problem.student_input.detach(), problem.student_weight.detach(), None, problem.teacher_input, teacher, labels,
        RecordingCounts(labels, -100, problem.student_weight.shape[0], None, TORCH, 0.5, 0.5), ChunkRows(16, 8),
        (grad, grad, False), torch.float32, TORCH.scale_unless_one)
    assert len(row_steps) == 5 and steps_before_read == ([2] if grad else [5])
    ref_losses, _ = reference(dataclasses.replace(problem, student_bias=None, teacher_bias=None))
    assert rel_err(0.5 * result.hard_loss + 0.5 * result.soft_loss, ref_losses[0]) < TOLERANCE[torch.float32][0]


@pytest.mark.parametrize("given", [40, 40.0, torch.tensor(40), torch.tensor(40.0), torch.tensor([40.0])],
                         ids=["int", "float", "int tensor", "0-d tensor", "1-element tensor"])
@pytest.mark.parametrize("grad", [True, False])
def test_num_valid_tokens_forms(given, grad):
    """N as a number or a one-element tensor divides the loss on the device and the gradients on the host alike."""
    problem = make_problem(tokens=37, ignore_every=4)
    with torch.set_grad_enabled(grad):
        losses = fused_linear_cosine_distill(*problem.args(), chunk_size=16, return_soft_hard_loss=True,
                                             num_valid_tokens=given)
    ref_losses, ref_grads = reference(problem, num_valid_tokens=40)
    for got, want in zip(losses, ref_losses):
        assert got.dtype == torch.float32 and got.shape == ()
        assert rel_err(got, want) < TOLERANCE[torch.float32][0]
    if grad:
        losses[0].backward()
        for leaf, want in zip(problem.student_leaves(), ref_grads):
            assert rel_err(leaf.grad, want) < TOLERANCE[torch.float32][1]
