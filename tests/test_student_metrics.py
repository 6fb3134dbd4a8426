"""The student's per-token metrics (_student_metrics.py, kernels/student_metrics.py): the Triton kernel against the
torch spec, both against entropy and argmax on float64 full logits, through the loss calls of both losses on every
path, and their errors."""

import pytest
import torch

from conftest import make_problem
from cosdistill import FusedLinearJSDLoss, StudentMetrics, fused_linear_cosine_distill, fused_linear_jsd
from cosdistill.testing import RowStepConstants, scale_and_softcap, student_metrics_torch, student_metrics_triton


def full_logits_metrics(logits, labels, temperature, ignore_index=-100, scale=1.0, cap=None):
    """(entropy, top1) from whole float64 logits [..., V], written directly from their definitions."""
    s = scale_and_softcap(logits.double(), scale, cap)
    log_p = torch.log_softmax(s / temperature, dim=-1)
    valid = labels != ignore_index
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, entropy, 0.0), valid & (s.argmax(-1) == labels)


def rows_with_ties(rows, vocab, dtype, labels):
    """Random logits whose rows 1 and 2 hold their largest value twice, far apart (across the kernel's blocks where
    the vocabulary is long enough): row 1's label is the first of the two, row 2's the second."""
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    if vocab >= 2:
        first, second = 0, vocab - 1
        for row in (1, 2):
            logits[row, first] = logits[row, second] = logits[row].float().max() + 1
        labels[1], labels[2] = first, second
    return logits


@pytest.mark.parametrize("vocab", [1, 7, 1000, 9001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature, scale, cap", [(1.0, 1.0, None), (0.05, 1.0, None), (7.0, 0.5, 30.0),
                                                     (2.0, 3.0, 5.0)])
def test_the_triton_kernel_and_the_spec_match_float64_full_logits(vocab, dtype, temperature, scale, cap):
    rows = 11
    labels = torch.randint(0, vocab, (rows,))
    logits = rows_with_ties(rows, vocab, dtype, labels)
    labels[4] = logits[4].float().argmax()  # a hit with no tie
    labels[::5] = -100
    constants = RowStepConstants(0.5, 0.5, 0.5, 1.0, -100, student_softcap=cap, student_logit_scale=scale)
    want_entropy, want_top1 = full_logits_metrics(logits, labels, temperature, scale=scale, cap=cap)
    for compute in (student_metrics_torch, student_metrics_triton):
        out = torch.full((rows, 2), float("nan"))
        compute(logits, labels, constants, temperature, out)
        torch.testing.assert_close(out[:, 0].double(), want_entropy, rtol=2e-5, atol=2e-6, msg=compute.__name__)
        assert torch.equal(out[:, 1] != 0, want_top1), compute.__name__
        assert set(out[:, 1].tolist()) <= {0.0, 1.0}
    if vocab >= 2 and labels[1] != -100:
        assert want_top1[1] and not want_top1[2]  # the first of two equal largest logits


@pytest.mark.parametrize("vocab", [300, 5000])
def test_masked_columns_late_maxima_and_nan_rows_match_the_spec(vocab):
    """Columns at -inf (a bias that masks part of the vocabulary) count for nothing, also where a whole stretch of the
    row (each lane's first columns, a kernel's whole block) holds only them; a row whose largest logit is its last
    column, one that grows at every column, one of a single finite column, and one all -inf (NaN, as the spec's
    softmax gives, and a hit at column 0, as its argmax); a NaN logit makes its row's entropy NaN as in the spec (its
    top1 is not defined: torch.argmax takes the NaN as the largest, the kernel does not)."""
    rows = 8
    logits = torch.randn(rows, vocab, dtype=torch.float64) * 4
    logits[0, : vocab // 2] = float("-inf")
    logits[1, ::3] = float("-inf")
    logits[2, -1] = 40.0
    logits[3] = torch.linspace(-30, 30, vocab, dtype=torch.float64)
    logits[4] = float("-inf")
    logits[4, vocab // 3] = 1.5
    logits[5] = float("-inf")
    logits[6, vocab // 2] = float("nan")
    labels = torch.tensor([vocab - 1, 1, vocab - 1, vocab - 1, vocab // 3, 0, 0, 7])
    constants = RowStepConstants(0.5, 0.5, 0.5, 1.0, -100)
    want = torch.empty(rows, 2, dtype=torch.float64)
    student_metrics_torch(logits, labels, constants, 0.7, want)
    assert want[5, 0].isnan() and want[6, 0].isnan() and want[4, 0] == 0 and want[2:5, 1].eq(1).all()
    got = torch.full((rows, 2), float("nan"))
    student_metrics_triton(logits.float(), labels, constants, 0.7, got)
    torch.testing.assert_close(got[:, 0].double(), want[:, 0], rtol=2e-5, atol=2e-6, equal_nan=True)
    defined = torch.arange(rows) != 6
    assert torch.equal(got[defined, 1].double(), want[defined, 1])


def test_the_kernel_takes_a_strided_chunk_of_a_buffer():
    """The chunk loop hands it the leading rows of a wider buffer's view (and slices of labels and out)."""
    buffer = torch.randn(20, 300)
    labels = torch.randint(0, 300, (20,))
    constants = RowStepConstants(0.5, 0.5, 0.5, 1.0, -100)
    want = torch.empty(20, 2)
    student_metrics_torch(buffer, labels, constants, 1.5, want)
    got = torch.full((20, 2), float("nan"))
    student_metrics_triton(buffer[5:12], labels[5:12], constants, 1.5, got[5:12])
    torch.testing.assert_close(got[5:12], want[5:12], rtol=2e-6, atol=2e-6)
    assert got[:5].isnan().all() and got[12:].isnan().all()


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_a_loss_call_fills_in_the_student_metrics_and_its_numbers_do_not_change(loss, impl, chunk_size):
    """The metrics of every chunk, read before the row step turns its logits into their gradient; the loss and the
    gradients the same to the bit as a call without them."""
    fused = fused_linear_jsd if loss == "jsd" else fused_linear_cosine_distill
    problem = make_problem(tokens=24, batch=2, vocab_student=97, vocab_teacher=103, ignore_every=4)
    options = dict(temperature=1.7, chunk_size=chunk_size, impl=impl, student_softcap=20.0, student_logit_scale=0.8,
                   return_soft_hard_loss=True)
    plain = fused(*problem.args(), **options)
    plain[0].backward()
    plain_grads = [leaf.grad.clone() for leaf in problem.student_leaves()]
    for leaf in problem.student_leaves():
        leaf.grad = None
    metrics = StudentMetrics(temperature=0.9)
    with_metrics = fused(*problem.args(), **options, student_metrics=metrics)
    with_metrics[0].backward()
    for got, want in zip(with_metrics, plain):
        assert torch.equal(got, want)
    for leaf, want in zip(problem.student_leaves(), plain_grads):
        assert torch.equal(leaf.grad, want)

    logits = problem.student_input.detach().double() @ problem.student_weight.detach().double().T
    logits += problem.student_bias.detach().double()
    want_entropy, want_top1 = full_logits_metrics(logits, problem.labels, 0.9, scale=0.8, cap=20.0)
    assert metrics.entropy.shape == problem.labels.shape and metrics.entropy.dtype == torch.float32
    torch.testing.assert_close(metrics.entropy.double(), want_entropy, rtol=2e-5, atol=2e-6)
    assert metrics.top1.dtype == torch.bool and torch.equal(metrics.top1, want_top1)
    assert torch.equal(metrics.counted, problem.labels != -100) and not metrics.counted.all()
    assert not metrics.entropy.requires_grad


def test_the_gram_path_fills_them_in_too():
    problem = make_problem(tokens=40, bias=False)
    metrics = StudentMetrics()
    fused_linear_cosine_distill(*problem.args()[:5], cosine_via="gram", chunk_size=16, student_metrics=metrics)
    logits = problem.student_input.detach().double() @ problem.student_weight.detach().double().T
    want_entropy, want_top1 = full_logits_metrics(logits, problem.labels, 1.0)
    torch.testing.assert_close(metrics.entropy.double(), want_entropy, rtol=2e-5, atol=2e-6)
    assert torch.equal(metrics.top1, want_top1)


def test_the_module_forward_takes_them():
    problem = make_problem(tokens=9)
    metrics = StudentMetrics()
    FusedLinearJSDLoss()(*problem.args(), student_metrics=metrics)
    assert metrics.entropy.shape == (9,) and metrics.top1.shape == (9,)


def test_no_tokens_give_empty_metrics():
    problem = make_problem(tokens=0)
    metrics = StudentMetrics()
    fused_linear_jsd(*problem.args(), student_metrics=metrics)
    assert metrics.entropy.shape == (0,) and metrics.top1.shape == (0,)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), True, "1", 4e-39])
def test_a_bad_temperature_raises(temperature):
    with pytest.raises(ValueError, match="StudentMetrics' temperature must be a positive finite number"):
        StudentMetrics(temperature=temperature)


def test_a_temperature_changed_after_it_was_made_is_checked_at_the_call():
    problem = make_problem(tokens=6)
    metrics = StudentMetrics()
    metrics.temperature = 0.0
    with pytest.raises(ValueError, match="StudentMetrics' temperature must be a positive finite number, got 0.0"):
        fused_linear_jsd(*problem.args(), student_metrics=metrics)


def test_what_is_not_a_student_metrics_raises():
    problem = make_problem(tokens=6)
    with pytest.raises(TypeError, match="student_metrics must be a cosdistill.StudentMetrics, got dict"):
        fused_linear_jsd(*problem.args(), student_metrics={})


def test_under_torch_compile_the_call_runs_eagerly_and_a_full_graph_raises():
    problem = make_problem(tokens=10, bias=False)
    args = problem.args()[:5]

    def step(metrics):
        return fused_linear_jsd(*args, student_metrics=metrics) * 2

    torch._dynamo.reset()
    # the break of the student_metrics branch, in the code Dynamo quotes (the user's line names student_metrics too)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="eager_for_student_metrics = torch.compiler.disable"):
        torch.compile(step, fullgraph=True)(StudentMetrics())
    torch._dynamo.reset()
    metrics = StudentMetrics()
    loss = torch.compile(step)(metrics)
    loss.backward()
    want = 2 * fused_linear_jsd(*args)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    logits = problem.student_input.detach().double() @ problem.student_weight.detach().double().T
    torch.testing.assert_close(metrics.entropy.double(), full_logits_metrics(logits, problem.labels, 1.0)[0],
                               rtol=2e-5, atol=2e-6)
    assert problem.student_weight.grad is not None
