"""The Gram path (_teacher_gram.py, cosine_via="gram"): no teacher logits, against float64 and the logits path,
and "auto" on inputs whose products the Gram path cannot hold."""

import dataclasses

import pytest
import torch

from conftest import TOLERANCE, assert_matches_reference, make_problem, reference, rel_err, run_fused
from cosdistill import StudentMetrics, fused_linear_cosine_distill
from cosdistill.reference import naive_cosine_distill
from cosdistill.testing import (
    COSINE_TORCH_ROW_STEP,
    TORCH,
    backends,
    plan,
    teacher_grad_coefficient,
    with_teacher_products,
)
from cosdistill.testing import teacher_gram as gram
from test_weight_cache import assert_same, gram_calls, student_and_labels, teacher_module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_teacher", [101, 131])
@pytest.mark.parametrize("chunk_size", [None, 7, 16])
def test_matches_reference(impl, dtype, vocab_teacher, chunk_size):
    problem = make_problem(dtype=dtype, bias=False, vocab_teacher=vocab_teacher, ignore_every=4)
    assert_matches_reference(problem, dtype, impl=impl, chunk_size=chunk_size, cosine_via="gram")


@pytest.mark.parametrize("options", [
    dict(temperature=2.5, beta=0.3, weight_hard_loss=0.2, weight_soft_loss=1.5),
    dict(student_logit_scale=0.5, teacher_logit_scale=3.0),
    dict(num_valid_tokens=50),
    dict(weight_hard_loss=0.0),
])
def test_options(impl, options):
    problem = make_problem(tokens=29, bias=False, vocab_teacher=131, ignore_every=3)
    assert_matches_reference(problem, torch.float32, ref_kwargs=options, impl=impl, chunk_size=8, cosine_via="gram",
                             **options)


@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
@pytest.mark.parametrize("grad_output", [1.0, -0.375])
def test_grad_output_and_accumulator(accum_dtype, grad_output):
    """grad_output reaches the soft term's share of grad_weight (added before the last chunk's GEMM in
    backward) and of grad_input; one chunk (nothing accumulated yet) and several."""
    for chunk_size in (None, 10):
        problem = make_problem(tokens=37, bias=False, dtype=torch.bfloat16, ignore_every=5)
        assert_matches_reference(problem, torch.bfloat16, grad_output=grad_output, chunk_size=chunk_size,
                                 accum_dtype=accum_dtype, cosine_via="gram")


@pytest.mark.parametrize("leaf", ["student_input", "student_weight", None])
def test_only_some_gradients(leaf):
    problem = make_problem(tokens=23, bias=False, ignore_every=4)
    for name in ("student_input", "student_weight"):
        getattr(problem, name).requires_grad_(name == leaf)
    grad_context = torch.enable_grad() if leaf else torch.no_grad()
    with grad_context:
        losses = fused_linear_cosine_distill(*problem.args(), chunk_size=6, cosine_via="gram", return_soft_hard_loss=True)
        if leaf:
            losses[0].backward()
    want_losses, want_grads = reference(problem)
    for got, expected in zip(losses, want_losses):
        assert rel_err(got, expected) < TOLERANCE[torch.float32][0]
    if leaf:
        index = ("student_input", "student_weight").index(leaf)
        assert rel_err(getattr(problem, leaf).grad, want_grads[index]) < TOLERANCE[torch.float32][1]


def test_agrees_with_the_logits_path(impl):
    problem = make_problem(tokens=41, bias=False, vocab_teacher=131, ignore_every=6)
    via_gram = run_fused(problem, impl=impl, chunk_size=9, cosine_via="gram")
    for leaf in problem.student_leaves():
        leaf.grad = None
    via_logits = run_fused(problem, impl=impl, chunk_size=9, cosine_via="logits")
    for got, want in zip(via_gram[0] + via_gram[1], via_logits[0] + via_logits[1]):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("setting, blocker", [
    (dict(bias=True), "a student_bias or teacher_bias"),
    (dict(student_softcap=30.0), "a softcap"),
    (dict(teacher_softcap=30.0), "a softcap"),
    (dict(dtype=torch.float16), "bf16 or fp32"),
    (dict(teacher_dtype=torch.float32), "both alike"),
])
def test_gram_refuses_what_it_cannot_run(setting, blocker):
    problem = make_problem(tokens=9, bias=setting.get("bias", False), dtype=setting.get("dtype", torch.bfloat16))
    if "teacher_dtype" in setting:
        problem.teacher_input, problem.teacher_weight = problem.teacher_input.float(), problem.teacher_weight.float()
    options = {key: value for key, value in setting.items() if key.endswith("softcap")}
    with pytest.raises(ValueError, match=f"cosine_via='gram' cannot run with .*{blocker}"):
        fused_linear_cosine_distill(*problem.args(), cosine_via="gram", **options)
    # "auto" takes the logits path instead, and is right
    assert_matches_reference(problem, problem.student_weight.dtype, ref_kwargs=options, cosine_via="auto", **options)


def test_gram_refuses_fp8_and_a_vocabulary_split():
    problem = make_problem(tokens=9, bias=False)
    heads = (problem.student_weight, None, problem.teacher_weight, None, 9, (True, True, False))
    with pytest.raises(ValueError, match="teacher_precision='fp8'"):
        plan.gram_applies(plan.Options(cosine_via="gram", teacher_precision="fp8"), *heads, vocab_parallel=None)
    with pytest.raises(ValueError, match="vocab_parallel"):
        plan.gram_applies(plan.Options(cosine_via="gram"), *heads, vocab_parallel=object())


def test_cosine_via_must_be_known():
    problem = make_problem(tokens=5, bias=False)
    with pytest.raises(ValueError, match="cosine_via must be one of"):
        fused_linear_cosine_distill(*problem.args(), cosine_via="gramm")


# (T, V, teacher H, student H, full step?) -> whether the Gram path was faster on the H200
# (two runs with cosine_via forced both ways at each shape, in the git history before the ledger;
# V = 151936 even in one run, 5% slower in the other).
H200_WINNERS = [
    ((1024, 128256, 4096, 2048, True), False), ((2048, 128256, 4096, 2048, True), False),
    ((4096, 128256, 4096, 2048, True), False), ((8192, 128256, 4096, 2048, True), True),
    ((1024, 128256, 4096, 2048, False), False), ((2048, 128256, 4096, 2048, False), False),
    ((4096, 128256, 4096, 2048, False), True),
    ((8192, 128256, 4096, 2048, False), True), ((3000, 128256, 4096, 2048, True), False),
    ((4096, 262144, 2048, 1024, True), True), ((4096, 32000, 4096, 2048, True), False),
    ((4096, 151936, 3584, 1792, True), False),
]


@pytest.mark.parametrize("shape, gram_won", H200_WINNERS)
def test_auto_picks_the_h200_winner(shape, gram_won):
    tokens, vocab, hidden, student_hidden, full = shape
    assert gram.gram_is_cheaper(tokens, vocab, vocab, student_hidden, hidden, write_grad_weight=full) == gram_won


def test_auto_runs_the_gram_path_where_it_is_cheaper(monkeypatch):
    calls, row_step = [], gram.GramTeacher.row_step

    def recording_row_step(self, student_logits, *args):
        calls.append(len(student_logits))
        return row_step(self, student_logits, *args)

    monkeypatch.setattr(gram.GramTeacher, "row_step", recording_row_step)
    long_problem = make_problem(tokens=400, hidden_student=4, hidden_teacher=6, vocab_student=50, bias=False)
    assert_matches_reference(long_problem, torch.float32, chunk_size=128)
    assert len(calls) == 4  # 400 tokens in chunks of 128
    calls.clear()
    short_problem = make_problem(tokens=5, hidden_student=4, hidden_teacher=6, vocab_student=50, bias=False)
    assert_matches_reference(short_problem, torch.float32)
    assert not calls


def test_teacher_gram_is_cached_until_the_weight_changes():
    weight = torch.randn(300, 12)
    first = gram.teacher_grams.get(weight, TORCH).value
    assert gram.teacher_grams.get(weight, TORCH).value is first
    with torch.no_grad():
        weight.mul_(2.0)  # in place: the version counter moves
    second = gram.teacher_grams.get(weight, TORCH).value
    assert second is not first
    torch.testing.assert_close(second[0][0], 4.0 * first[0][0])
    torch.testing.assert_close(second[1], 4.0 * first[1])


def test_bf16_products_keep_fp32_accuracy():
    """h @ G for bf16 rows and an fp32 Gram matrix: the matrix in two bf16 parts keeps its ~2^-16
    accuracy, where one bf16 copy would round it at 2^-9."""
    rows = torch.randn(64, 48).bfloat16()
    matrix = torch.randn(48, 32)
    want = rows.double() @ matrix.double()
    got = gram._times(rows, gram._split(matrix, torch.bfloat16))
    assert rel_err(got, want) < 3e-5
    assert rel_err(rows.double() @ matrix.bfloat16().double(), want) > 1e-3


@pytest.mark.parametrize("noise", [1.0, 0.1, 0.01])
def test_bf16_gradients_lose_what_the_student_part_s_rounding_leaves(noise):
    """The soft gradient is a teacher part (exact, through C) less a student part stored in the bf16 gradient of the
    logits; as the student nears the teacher their difference shrinks to ~sqrt(2 (1 - cos)) of either, and the
    student part's rounding (2^-9) stays: the error against float64 is about 1.7 * 2^-9 / sqrt(2 (1 - cos))
    (docs/reference.md, the Gram path), 3e-3 at 1 - cos = 0.68, 2e-2 at 0.024, 0.15 at 2.5e-4."""
    tokens, hidden, vocab = 128, 16, 1024
    generator = torch.Generator().manual_seed(3)
    teacher_input, teacher_weight = torch.randn(tokens, hidden, generator=generator), torch.randn(
        vocab, hidden, generator=generator) * 0.5
    student_input = (teacher_input + noise * torch.randn(tokens, hidden, generator=generator)).bfloat16()
    student_weight = (teacher_weight + noise * torch.randn(vocab, hidden, generator=generator)).bfloat16()
    teacher_input, teacher_weight = teacher_input.bfloat16(), teacher_weight.bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    options = dict(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0)
    exact = [student_input.double().requires_grad_(), student_weight.double().requires_grad_()]
    one_minus_cos = naive_cosine_distill(*exact, teacher_input.double(), teacher_weight.double(), labels, **options)[0]
    one_minus_cos.backward()
    leaves = [student_input.requires_grad_(), student_weight.requires_grad_()]
    fused_linear_cosine_distill(*leaves, teacher_input, teacher_weight, labels, cosine_via="gram", **options).backward()
    bound = 2.5 * 2**-9 / (2 * one_minus_cos.item()) ** 0.5
    for leaf, want in zip(leaves, exact):
        assert bound / 2.5 < rel_err(leaf.grad, want.grad) < bound


def test_overflowing_products_raise_for_gram_and_auto_takes_the_logits_path():
    """Logits near bf16's max: the Gram path's fp32 products would overflow. cosine_via="gram" raises
    saying so; "auto" finds the bound past RANGE_LIMIT and runs the call on the logits path."""
    inputs = torch.tensor([[2.0**64], [-(2.0**64)], [2.0**63]], dtype=torch.bfloat16)
    student_weight = (torch.rand(37, 1) * 2 - 1).mul(2.0**63).bfloat16()
    teacher_weight = (torch.rand(37, 1) * 2 - 1).mul(2.0**63).bfloat16()
    labels = (inputs.double() * student_weight.double().t()).argmax(1)
    args = (inputs.clone().requires_grad_(), student_weight.clone().requires_grad_(), inputs, teacher_weight, labels)
    with pytest.raises(ValueError, match="too large for the Gram path"):
        fused_linear_cosine_distill(*args, cosine_via="gram")
    metrics = StudentMetrics()  # the logits path's run fills it in again, every chunk (the Gram attempt stopped early)
    loss, soft, _ = fused_linear_cosine_distill(*args, cosine_via="auto", return_soft_hard_loss=True, chunk_size=1,
                                                student_metrics=metrics)
    want = naive_cosine_distill(*[tensor.double() for tensor in args[:4]], labels)
    assert rel_err(loss, want[0]) < 5e-3 and rel_err(soft, want[1]) < 5e-3
    assert metrics.top1.all() and torch.equal(metrics.entropy, torch.zeros(3))  # each row's softmax one-hot


def test_the_logits_path_after_the_range_check_runs_with_the_gram_attempt_s_buffers_freed(monkeypatch):
    """"auto" falling back from the Gram path (a diverged step's NaN): the logits path ran inside the except block,
    where the exception's frames and the first attempt's names kept its logits buffer, gradients and Gram matrices,
    so the fallback's peak held two calls' buffers (about 1 GB more at the seed workload)."""
    import gc
    import weakref

    from cosdistill.testing import plan

    first_attempt, alive_at_the_second = [], []
    chunk_loop = plan.chunked_loss_and_grads

    def spy(*args, **kwargs):
        student_logits = args[12]
        if first_attempt:
            alive_at_the_second.append([ref() is not None for ref in first_attempt])
        first_attempt.extend([weakref.ref(student_logits), weakref.ref(args[4])])  # the buffer, the teacher side
        return chunk_loop(*args, **kwargs)

    monkeypatch.setattr(plan, "chunked_loss_and_grads", spy)
    generator = torch.Generator().manual_seed(8)
    student_input, student_weight, teacher_input, labels = student_and_labels(generator=generator)
    teacher_weight = teacher_module(generator=generator).weight
    teacher_input = teacher_input.clone()
    teacher_input[3, 1] = float("nan")
    gc.disable()  # freed by reference counting, as a GPU's memory must be
    try:
        loss = fused_linear_cosine_distill(student_input, student_weight, teacher_input, teacher_weight, labels,
                                           cosine_via="auto")
    finally:
        gc.enable()
    assert torch.isnan(loss) and alive_at_the_second == [[False, False]]


def test_a_one_kernel_gram_step_is_used_where_the_impl_has_one(monkeypatch):
    """GramTeacher.row_step hands the row step to the implementation's gram_step (the CUDA one-model kernel)
    with each row's raw s.t and |t|^2, and keeps the coefficients it writes; where gram_step declines, the
    two stages run. The stand-in computes what the kernel must: the torch spec's two stages."""
    calls = []

    def gram_step(student_logits, labels, constants, token_losses, products, coefficients):
        calls.append(products.shape)
        if len(calls) > 1:
            return False  # declines from the second chunk on
        stats = with_teacher_products(COSINE_TORCH_ROW_STEP.stats(student_logits, None, labels, constants), products[:, 0],
                                      products[:, 1], constants)
        COSINE_TORCH_ROW_STEP.grad(student_logits, None, labels, stats, constants, token_losses, True)
        coefficients.copy_(teacher_grad_coefficient(stats, labels, student_logits.shape[1], constants))
        return True

    monkeypatch.setattr(backends, "TORCH", dataclasses.replace(
        backends.TORCH, cosine_row_step=dataclasses.replace(COSINE_TORCH_ROW_STEP, gram_step=gram_step)))
    problem = make_problem(tokens=30, bias=False, vocab_teacher=131, ignore_every=4)
    assert_matches_reference(problem, torch.float32, impl="torch", chunk_size=16, cosine_via="gram")
    assert calls == [(16, 2), (14, 2)]


def test_auto_gives_the_finite_answer_for_huge_student_logits(monkeypatch):
    """Student logits ~1e37 beside a moderate teacher: the Gram path's products would overflow, so "auto"
    runs the call on the logits path (the bound is read with N), and "gram" raises."""
    calls = gram_calls(monkeypatch)
    generator = torch.Generator().manual_seed(6)
    student_input, student_weight, teacher_input, labels = student_and_labels(generator=generator)
    huge_weight = (student_weight.detach() * 1e36).requires_grad_()
    args = (student_input, huge_weight, teacher_input, teacher_module(generator=generator).weight, labels)
    got = fused_linear_cosine_distill(*args, return_soft_hard_loss=True)
    want = fused_linear_cosine_distill(*args, cosine_via="logits", return_soft_hard_loss=True)
    assert calls[0] and all(torch.isfinite(part) for part in got)
    assert_same(got, want)
    with pytest.raises(ValueError, match="too large for the Gram path"):
        fused_linear_cosine_distill(*args, cosine_via="gram")


def test_the_gram_path_s_range_check_takes_no_tokens_and_non_finite_inputs():
    """No tokens: nothing to bound (loss 0, zero gradients); an inf hidden state: "auto" runs the logits
    path, which gives a non-finite loss, never a finite one."""
    generator = torch.Generator().manual_seed(8)
    student_input, student_weight, teacher_input, labels = student_and_labels(generator=generator)
    teacher_weight = teacher_module(generator=generator).weight
    empty = (student_input[:0].detach().requires_grad_(), student_weight, teacher_input[:0], teacher_weight, labels[:0])
    loss = fused_linear_cosine_distill(*empty, cosine_via="gram")
    loss.backward()
    assert loss == 0 and not student_weight.grad.any()
    poisoned = teacher_input.clone()
    poisoned[6, 3] = float("inf")  # a token that counts (every fifth is ignored)
    loss = fused_linear_cosine_distill(student_input, student_weight, poisoned, teacher_weight, labels)
    assert not torch.isfinite(loss)
