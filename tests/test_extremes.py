"""Extreme values on purpose: huge logits, degenerate rows, tiny shapes, non-finite inputs.

Every case runs through the torch and the Triton row step against the float64 naive version.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import cosdistill.reference
from conftest import TOLERANCE, Problem, make_problem, reference, rel_err
from cosdistill import fused_linear_cosine_distill, fused_linear_jsd
from cosdistill.testing import FUSED_LOSSES

FP16_MAX = torch.finfo(torch.float16).max  # 65504 = 32 * 2047


def run(problem, impl, **kwargs):
    losses = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True, **kwargs)
    losses[0].backward()
    return [loss.detach() for loss in losses], [leaf.grad for leaf in problem.student_leaves()]


def assert_matches_float64(problem, impl, dtype, **kwargs):
    (want_losses, want_grads) = reference(problem, **kwargs)
    got_losses, got_grads = run(problem, impl, **kwargs)
    loss_tol, grad_tol = TOLERANCE[dtype]
    for got in [*got_losses, *got_grads]:
        assert torch.isfinite(got).all()
    for got, want in zip(got_losses, want_losses):
        # soft = beta * (1 - cos) cancels when cos ~ 1 (a token or two): fp32's 1 - cos is good to ~1e-7 absolute
        assert rel_err(got, want) < loss_tol or abs(got.item() - want.item()) < 1e-6, (got, want)
    for got, want in zip(got_grads, want_grads):
        assert rel_err(got, want) < grad_tol


def one_feature_problem(input_values, weight_values, teacher_weight_values, labels, dtype):
    """Hidden size 1: each logit is exactly input * weight, so logits can be put anywhere, even at a dtype's max."""
    def leaf(values, grad):
        return torch.tensor(values, dtype=dtype)[:, None].requires_grad_(grad)

    return Problem(leaf(input_values, True), leaf(weight_values, True), leaf(input_values, False),
                   leaf(teacher_weight_values, False), torch.tensor(labels), None, None)


def test_logits_of_magnitude_1e4_in_fp32(impl):
    problem = make_problem(tokens=29, vocab_student=131, dtype=torch.float32, ignore_every=4)
    for tensor in (problem.student_input, problem.teacher_input):
        tensor.data *= 3000.0  # logits of order 1e4
    assert_matches_float64(problem, impl, torch.float32)


@pytest.mark.parametrize("temperature", [1.0, 1e-3])
def test_student_logits_whose_squares_fit_fp32_and_whose_squares_over_t2_do_not(impl, temperature):
    """Student logits of order 1e16, teacher logits of order 1: |s|^2 fits fp32, |s|^2 / T^2 at T = 1e-3 does not.
    The fast row steps multiplied the sums by 1 / T^2, which overflowed to a clamped norm of inf: a cosine of 0,
    a finite soft term of beta, where T cancels but in the norms' clamp."""
    problem = make_problem(tokens=29, vocab_student=131, dtype=torch.float32, ignore_every=4)
    problem.student_input.data *= 1e16
    assert_matches_float64(problem, impl, torch.float32, temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_at_the_largest_value_of_the_dtype(impl, dtype):
    """Logits at +-max of the dtype; no overflow in the sum of exponentials or in |s|^2. Labels point at
    each row's largest logit (any other label's cross-entropy, ~2 * max, is itself past fp32's range)."""
    generator = torch.Generator().manual_seed(3)
    vocab = 37
    if dtype == torch.bfloat16:  # 2^64 * (2 - 2^-7) * 2^63 = bf16's max
        scale_input, top_weight = 2.0**64, (2 - 2**-7) * 2.0**63
    else:  # 32 * 2047 = fp16's max
        scale_input, top_weight = 32.0, 2047.0
    inputs = [scale_input, -scale_input, scale_input, scale_input, -scale_input]
    student_weight = (torch.rand(vocab, generator=generator) * 2 - 1) * top_weight
    teacher_weight = (torch.rand(vocab, generator=generator) * 2 - 1) * top_weight
    student_weight[3] = student_weight[10] = top_weight  # two logits at the max: hard loss log 2
    student_weight[20], teacher_weight[5] = -top_weight, -top_weight
    rounded_weight = student_weight.to(dtype).double()
    labels = [int((value * rounded_weight).argmax()) for value in inputs]
    problem = one_feature_problem(inputs, student_weight.tolist(), teacher_weight.tolist(), labels, dtype)
    assert (problem.student_input[0] * problem.student_weight[3]).item() == torch.finfo(dtype).max

    (want_losses, want_grads) = reference(problem)
    got_losses, got_grads = run(problem, impl)
    loss_tol, grad_tol = TOLERANCE[dtype]
    for got, want in zip(got_losses, want_losses):
        assert torch.isfinite(got) and rel_err(got, want) < loss_tol, (got, want)
    # The exact gradients here are tiny differences (the two tied logits' softmax terms cancel in
    # grad_input; the soft term is ~1 / |s| ~ 1e-39): held to the scale of one token's gradient,
    # max |weight| / N for grad_input and max |input| / N for grad_weight.
    tokens = len(inputs)
    scales = (problem.student_weight.abs().max().double() / tokens, problem.student_input.abs().max().double() / tokens)
    for got, want, scale in zip(got_grads, want_grads, scales):
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max() < grad_tol * scale


def test_all_equal_logits(impl):
    """Equal head rows: the gradient reaching student_input cancels to rounding (exactly 0 in float64),
    so it is held to an absolute bound; the weight's gradient to the usual relative one. The bound sits below the
    grad_input GEMM's worst-case rounding (V ulps of max |w|), which about one draw in 150 reaches: the draw is the
    test's own, not whatever the tests before it left in the global generator."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        problem = make_problem(tokens=9, vocab_student=50, vocab_teacher=61, bias=False)
    problem.student_weight.data[:] = problem.student_weight.data[0]
    problem.teacher_weight.data[:] = problem.teacher_weight.data[0]
    (want_losses, (_, want_grad_weight)) = reference(problem)
    got_losses, (got_grad_input, got_grad_weight) = run(problem, impl)
    for got, want in zip(got_losses, want_losses):
        assert rel_err(got, want) < 1e-6
    assert rel_err(got_grad_weight, want_grad_weight) < 1e-5
    assert got_grad_input.abs().max() < 1e-6 * problem.student_weight.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 1e-13])
def test_tokens_whose_student_or_teacher_logits_are_all_zero(impl, dtype, temperature):
    """cos as cosine_similarity defines it (norms clamped at 1e-8 T): finite loss and finite gradient. At T = 1e-13
    a token of zeros has a coefficient of t, 1 / (1e-8 T)^2, past fp32's range: it must not meet t = 0."""
    problem = make_problem(tokens=11, vocab_student=40, dtype=dtype, bias=False)
    problem.student_input.data[2] = 0.0  # student logits all zero
    problem.teacher_input.data[5] = 0.0  # teacher logits all zero
    problem.student_input.data[7] = 0.0
    problem.teacher_input.data[7] = 0.0  # both
    assert_matches_float64(problem, impl, dtype, temperature=temperature)


def soft_term_with_each_norm_clamped(student_logits, teacher_logits, beta, temperature):
    """The cosine soft term as the spec writes it, cos = a.b / (max(|a|, eps) max(|b|, eps)): autograd through
    torch.maximum takes a clamped norm as the constant it is."""
    a = F.pad(student_logits, (0, teacher_logits.shape[-1] - student_logits.shape[-1])) / temperature
    b = teacher_logits / temperature
    clamped = [torch.maximum(x.norm(dim=-1), torch.tensor(1e-8, dtype=x.dtype)) for x in (a, b)]
    return beta * (1 - (a * b).sum(-1) / clamped[0] / clamped[1])


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_tokens_whose_student_norm_is_under_the_clamp(impl, monkeypatch, temperature):
    """Student logits of norm 0 < |s| < 1e-8 T: the clamped norm, 1e-8 T, is a constant, so the soft term's
    gradient is along t alone (-beta t / (1e-8 T |t|)), with no term along s. Held to the spec's formula in float64:
    cosine_similarity's loss is the same, but its backward gives such rows a few percent more or less."""
    problem = make_problem(tokens=13, vocab_student=40, vocab_teacher=47, dtype=torch.float32, bias=False)
    with torch.no_grad():
        for row, share in ((2, 0.5), (7, 0.9)):  # of the clamp
            logits = problem.student_input[row] @ problem.student_weight.T
            problem.student_input[row] *= share * 1e-8 * temperature / logits.norm()
    with monkeypatch.context() as patch:
        patch.setattr(cosdistill.reference, "cosine_soft_term", soft_term_with_each_norm_clamped)
        want_losses, want_grads = reference(problem, temperature=temperature)
    got_losses, got_grads = run(problem, impl, temperature=temperature)
    for got, want in zip(got_losses, want_losses):
        assert rel_err(got, want) < TOLERANCE[torch.float32][0], (got, want)
    for got, want in zip(got_grads, want_grads):
        assert rel_err(got, want) < TOLERANCE[torch.float32][1]


@pytest.mark.parametrize(("side", "size"), [("student", 1e-23), ("student", 1e-24), ("teacher", 1e-24)])
def test_logits_whose_squares_are_subnormal_in_fp32(impl, side, size):
    """Logits of order 1e-23 (fp32 holds their squares with few bits) or 1e-24 (none: a plain sum of 0), at a
    temperature where the norms' clamp (1e-8 T) does not hide them: the fast row steps take such rows with
    unit-scaled sums. The losses only: the student's gradient coefficient, ~1 / |s|^2, passes fp32's range at
    such student logits (docs/design.md)."""
    problem = make_problem(tokens=29, vocab_student=131, dtype=torch.float32, ignore_every=4, bias=False)
    getattr(problem, f"{side}_input").data *= size
    want_losses, _ = reference(problem, temperature=1e-18)
    with torch.no_grad():
        got_losses = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True,
                                                 temperature=1e-18)
    for got, want in zip(got_losses, want_losses):
        assert rel_err(got, want) < TOLERANCE[torch.float32][0], (got, want)


def test_teacher_logits_whose_squares_round_to_0_in_fp32(impl):
    """Teacher logits of order 1e-24: a plain fp32 |t|^2 of 0 is not a teacher of zeros, whose coefficient of t the
    row steps may drop. With no hard term the teacher's part is half the gradient."""
    problem = make_problem(tokens=29, vocab_student=131, dtype=torch.float32, ignore_every=4, bias=False)
    problem.teacher_input.data *= 1e-24
    assert_matches_float64(problem, impl, torch.float32, weight_hard_loss=0.0)


@pytest.mark.parametrize("zero", ["three hidden states", "the student head"])
@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("grad_output", [1.0, 1024.0])
def test_fp16_tokens_whose_student_logits_are_all_zero(impl, zero, chunk_size, grad_output):
    """fp16: such a token's d loss / d logits (~weight_soft * beta / eps = 2.5e7) is past fp16's range
    until divided by N. The row step scales its row down, and the chunk loop takes its grad_weight
    and grad_bias terms through fp32 (_fp16_lift.Unlift.correct_scaled_down). With N = 2^32, as
    num_valid_tokens, every exact gradient that reaches those tokens fits fp16 and must come out
    finite and right, in the last chunk (deferred to backward) and the others, the first included.
    A zero head (all rows scaled down, as a zero-initialised new head) exercises grad_weight; zero
    hidden states give those rows no grad_weight term, and the other rows' grad_weight (~1e-11 at
    this N) is below fp16's range: held to its own rounding floor, as in test_properties."""
    problem = make_problem(tokens=11, vocab_student=40, dtype=torch.float16, bias=True)
    problem.student_bias.data.zero_()
    if zero == "the student head":
        problem.student_weight.data.zero_()
    else:
        problem.student_input.data[[0, 2, 10]] = 0.0
    options = dict(num_valid_tokens=2**32)
    (_, want_grads) = reference(problem, grad_output, **options)
    assert max(grad.abs().max().item() for grad in want_grads) < FP16_MAX / 4  # the exact result fits fp16
    losses = fused_linear_cosine_distill(*problem.args(), impl=impl, chunk_size=chunk_size, **options)
    (losses * grad_output).backward()
    grad_tol = TOLERANCE[torch.float16][1]
    for leaf, want in zip(problem.student_leaves(), want_grads):
        floor = rel_err(want.to(torch.float16), want)
        assert torch.isfinite(leaf.grad).all()
        assert rel_err(leaf.grad, want) < (grad_tol if floor < grad_tol else grad_tol + floor), (
            tuple(leaf.shape), rel_err(leaf.grad, want), floor)


@pytest.mark.parametrize("vocab", [2, 3])
def test_single_token_and_tiny_vocabulary(impl, vocab):
    problem = make_problem(tokens=1, vocab_student=vocab, vocab_teacher=vocab + 1)
    assert_matches_float64(problem, impl, torch.float32)


def test_a_vocabulary_of_one(impl):
    """V = 1: the cross-entropy is 0 and a one-entry student vector's direction cannot change, so the
    exact gradient is 0; ours must be rounding noise of it."""
    problem = make_problem(tokens=5, vocab_student=1, vocab_teacher=3)
    (want_losses, _) = reference(problem)
    got_losses, got_grads = run(problem, impl)
    for got, want in zip(got_losses, want_losses):
        assert rel_err(got, want) < 1e-6
    for grad in got_grads:
        assert grad.abs().max() < 1e-6


def test_labels_at_both_ends_of_the_vocabulary(impl):
    problem = make_problem(tokens=8, vocab_student=33)
    problem.labels[:4], problem.labels[4:] = 0, 32
    assert_matches_float64(problem, impl, torch.float32)


@pytest.mark.parametrize("where", ["student_input", "student_weight", "teacher_input", "teacher_weight"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_input_gives_a_non_finite_loss(impl, where, value):
    problem = make_problem(tokens=6, vocab_student=20, bias=False)
    getattr(problem, where).data[1, 0] = value
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl)
    assert not torch.isfinite(loss)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grad_output", [1.0, 0.5])
def test_a_loss_that_is_not_finite_makes_every_gradient_nan(impl, compiled, chunk_size, dtype, grad_output):
    """A teacher bias of -inf over part of the vocabulary (a masked slice) gives the forward KL a NaN loss (0 log 0,
    as TRL's and Liger's give), while the row steps' gradients came out finite: right in the torch step, 98% off in
    the Triton step. A trainer that filters the NaN out of its logs would have applied them; every gradient is NaN
    instead, on every path that applies grad_output (one chunk or several, the fp16 lifts, the compiled op)."""
    problem = make_problem(tokens=12, vocab_student=20, dtype=dtype)
    with torch.no_grad():
        problem.teacher_bias[5:9] = float("-inf")

    def step(*args):
        return fused_linear_jsd(*args, beta=0.0, impl=impl, chunk_size=chunk_size)

    torch._dynamo.reset()
    loss = (torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step)(*problem.args())
    assert loss.isnan()
    (loss * grad_output).backward()
    for leaf in problem.student_leaves():
        assert leaf.grad.isnan().all(), leaf.shape


@pytest.mark.parametrize("beta", [0.5, 0.1, 0.9])
@pytest.mark.parametrize("scale", [1.0, 1e8, 1e16, 1e30])
def test_the_jsd_of_two_peaked_rows_at_any_logit_size(impl, beta, scale):
    """Student and teacher each all but certain of another token: the generalized JSD is the binary entropy of beta
    (M puts 1 - beta and beta on the two tokens). The torch spec formed log-probabilities as logits over T less
    their logsumexp, which cancelled past |logits| / T of ~1e13: half the answer at 1e16 (the Triton step, from
    distances to the row's largest, was right)."""
    vocab, tokens = 7, 3
    student_weight = [0.0] * vocab
    teacher_weight = [0.0] * vocab
    student_weight[1], teacher_weight[4] = 40.0, 40.0  # times the input: each row's one large logit
    problem = one_feature_problem([scale] * tokens, student_weight, teacher_weight, [1] * tokens, torch.float32)
    _, soft, _ = FUSED_LOSSES["jsd"](*problem.args(), beta=beta, impl=impl, return_soft_hard_loss=True)
    want = -beta * math.log(beta) - (1 - beta) * math.log1p(-beta)
    assert abs(soft.item() - want) < (1e-6 if scale == 1.0 else 1e-7) * want


@pytest.mark.parametrize("distance", [1e-6, 1e-9, 1e-12])
def test_the_spec_keeps_the_jsd_near_beta_1(distance):
    """beta within 1e-6..1e-12 of 1: the divergence is of order 1 - beta, and the
    spec formed b - m as d + (a - m), which lost it (1.5e-4 off at 1 - 1e-12, 6.9e-3 at 1 - 1e-14)."""
    problem = make_problem(tokens=13, vocab_student=41, vocab_teacher=47, dtype=torch.float32)
    beta = 1 - distance
    distance = 1 - beta  # exactly the float's (1 - 1e-12 is 1.00009e-12 from 1)
    got = FUSED_LOSSES["jsd"](*problem.args(), beta=beta, impl="torch", return_soft_hard_loss=True)[1]
    s = (problem.student_input.double() @ problem.student_weight.double().T + problem.student_bias.double())
    t = (problem.teacher_input.double() @ problem.teacher_weight.double().T + problem.teacher_bias.double())
    s = torch.nn.functional.pad(s, (0, t.shape[1] - s.shape[1]))
    a, b = s.log_softmax(1), t.log_softmax(1)
    # b - m and a - m with log1p: the mixture (1 - beta) e^a + beta e^b = e^b (1 + (1 - beta) (e^(a - b) - 1))
    b_minus_m = -torch.log1p(distance * torch.expm1(a - b))
    a_minus_m = (a - b) + b_minus_m
    soft = (beta * b.exp() * b_minus_m + distance * a.exp() * a_minus_m).sum(1)
    valid = problem.labels != -100
    want = soft[valid].sum() / valid.sum()
    assert rel_err(got.double(), want) < 1e-6
