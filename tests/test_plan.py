"""The plan of a call (_plan.py): the chunk sizes it picks and the order in which it sets the call up."""

import dataclasses
import gc
import math
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_problem, record_write_grad, reference, rel_err, run_fused
from cosdistill import FusedLinearCosineDistillLoss, api, fused_linear_cosine_distill
from cosdistill.testing import FUSED_LOSSES, TORCH, ChunkRows, chunk_rows, options_of, plan


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
    """The automatic student chunk and teacher sub-chunk at LLM vocabularies, with and without gradients."""
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


def test_small_calls_run_the_last_grad_weight_gemm_in_forward():
    """One chunk of at least 1024 tokens whose four GEMMs come to under 10^12 FLOPs (host-bound from an idle GPU:
    V = 32000 at T = 1024, not at 2048 nor at the seed vocabulary), with the chunk rows the plan picks."""
    def small(tokens, vocab, student=(2048,), teacher_hidden=4096, chunk_size=None):
        rows = chunk_rows(chunk_size, tokens, vocab, vocab, 2)
        return plan.small_call(rows, tokens, (vocab, *student), (vocab, teacher_hidden))

    assert small(1024, 32000) and small(1472, 32000) and not small(1536, 32000)  # 0.97 and 1.01 * 10^12
    assert not small(2048, 32000) and not small(1024, 128256)  # 1.3 and 2.7 * 10^12 FLOPs
    assert not small(1000, 32000)  # fewer tokens: grad_output's pass over grad_weight would cost about the GEMM
    assert not small(1024, 32000, chunk_size=512)  # two chunks: the last one's GEMM runs while backward starts
    assert small(4096, 32000, student=(512,), teacher_hidden=1024)  # a smaller model: 0.76 * 10^12


def test_where_the_row_steps_run_beside_the_teacher_gemms():
    """For the JSD on CUDA: teacher logits in more than one sub-chunk, the second teacher buffer within the hard
    budget, no vocabulary split."""
    fast = dataclasses.replace(TORCH, name="triton")  # a stand-in: only its identity counts

    def beside(tokens, vocab, loss="jsd", backend=fast, device="cuda", teacher="logits", vocab_parallel=None,
               write_grad=True):
        rows = chunk_rows(None, tokens, vocab, vocab, 2, write_grad=write_grad)
        return plan.row_step_beside_gemms(loss, backend, torch.device(device), teacher, rows, tokens, vocab, vocab, 2,
                                          vocab_parallel)

    assert beside(8192, 128256) and beside(2048, 128256) and beside(8192, 151936) and beside(8192, 32000)
    assert beside(8192, 128256, teacher="fp8")
    assert not beside(8192, 128256, loss="cosine")
    assert not beside(8192, 128256, backend=TORCH)  # the spec's temporaries would get a second stream's cache
    assert not beside(1024, 128256)  # one sub-chunk
    assert not beside(4096, 32000)  # one chunk of one sub-chunk
    assert not beside(8192, 262144)  # 2048 / 512 rows: a second 512-row buffer passes 1.25 GiB
    assert not beside(8192, 128256, write_grad=False)  # 2048-row sub-chunks: likewise
    assert not beside(8192, 128256, device="cpu")
    assert not beside(8192, 128256, teacher="gram")
    assert not beside(8192, 128256, vocab_parallel=object())


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


def test_the_function_api_checks_each_set_of_options_once():
    """options_of hands back one checked Options per distinct set of values (the function is called with the same
    keywords at every step); an unhashable value still gets Options' own error, naming the argument."""
    first = options_of(weight_hard_loss=0.3, beta=0.7)
    assert options_of(weight_hard_loss=0.3, beta=0.7) is first
    assert options_of(weight_hard_loss=0.3, beta=0.8) is not first
    assert first.constants is first.constants and first.constants.beta == 0.7
    with pytest.raises(TypeError, match="chunk_size must be an int or None, got list \\[4\\]"):
        options_of(chunk_size=[4])
    # Values equal to a checked set's but of another type are checked, not taken for it (1024.0 == 1024)
    assert options_of(chunk_size=1024).chunk_size == 1024
    for wrong in (1024.0, True):
        with pytest.raises(TypeError, match=f"chunk_size must be an int or None, got {type(wrong).__name__} {wrong}"):
            options_of(chunk_size=wrong)
    # -0.0 == 0.0 with one hash: each zero keeps its sign (the other's options once gave the losses theirs) and
    # its own cached options (made anew at every call, they filled the plan cache)
    for zero in (0.0, -0.0, 0.0):
        assert math.copysign(1.0, options_of(weight_hard_loss=zero).constants.weight_hard) == math.copysign(1.0, zero)
    assert options_of(weight_hard_loss=-0.0) is options_of(weight_hard_loss=-0.0)


def test_a_tensor_valued_option_is_read_at_every_call_and_never_cached():
    """A weight or beta kept in a one-element tensor may change in place between calls: each call's options read
    its value, and no cache keeps the tensor alive."""
    beta = torch.tensor(0.7)
    assert options_of(beta=beta).constants.beta == pytest.approx(0.7)
    beta.fill_(0.2)
    assert options_of(beta=beta).constants.beta == pytest.approx(0.2)
    alive = weakref.ref(beta)
    del beta
    gc.collect()
    assert alive() is None


def recorded_plans(monkeypatch) -> list:
    """Records each plan make_plan makes."""
    made, make_plan = [], plan.make_plan
    monkeypatch.setattr(plan, "make_plan", lambda *a, **k: made.append(make_plan(*a, **k)) or made[-1])
    return made


def test_a_call_of_a_seen_signature_reuses_its_plan_and_gives_the_same_numbers(monkeypatch):
    """The checks and the plan run once per signature (_plan.checked_plan): the host's time before the first GEMM.
    Fresh values of the same shapes reuse it and match the float64 reference."""
    made = recorded_plans(monkeypatch)
    for _ in range(3):
        problem = make_problem(ignore_every=4)
        losses = fused_linear_cosine_distill(*problem.args(), cosine_via="logits", return_soft_hard_loss=True)
        losses[0].backward()
        want_losses, want_grads = reference(problem)
        assert all(rel_err(got, want) < 1e-5 for got, want in zip(losses, want_losses))
        assert all(rel_err(leaf.grad, want) < 1e-5 for leaf, want in zip(problem.student_leaves(), want_grads))
    assert len(made) == 1


def test_every_part_of_the_signature_makes_a_new_plan(monkeypatch):
    """Shapes, dtypes, gradients asked for, grad mode, options and the count's kind each make their own plan."""
    made = recorded_plans(monkeypatch)
    problem = make_problem(tokens=12)
    calls = [
        lambda p: fused_linear_cosine_distill(*p.args(), cosine_via="logits"),
        lambda p: fused_linear_cosine_distill(*p.args(), cosine_via="logits", weight_hard_loss=0.3),
        lambda p: fused_linear_cosine_distill(*p.args(), cosine_via="logits", num_valid_tokens=7),
        lambda p: fused_linear_cosine_distill(*p.args(), cosine_via="logits", num_valid_tokens=torch.tensor(7.0)),
    ]
    for call in calls:
        call(problem)
    fused_linear_cosine_distill(*make_problem(tokens=13).args(), cosine_via="logits")
    fused_linear_cosine_distill(*make_problem(tokens=12, dtype=torch.bfloat16).args(), cosine_via="logits")
    with torch.no_grad():
        fused_linear_cosine_distill(*problem.args(), cosine_via="logits")
    problem.student_weight.requires_grad_(False)
    fused_linear_cosine_distill(*problem.args(), cosine_via="logits")
    assert len(made) == 8
    assert made[-1].needs_grad == (True, False, True) and made[-2].needs_grad == (False, False, False)


def test_the_checks_still_fail_after_a_good_call_of_the_signature():
    """A reused plan never skips a check that would fail: what the checks read is all in the signature."""
    problem = make_problem(tokens=12)
    fused_linear_cosine_distill(*problem.args(), num_valid_tokens=5)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="num_valid_tokens must be (> 0|finite)"):
            fused_linear_cosine_distill(*problem.args(), num_valid_tokens=bad)
    fused_linear_cosine_distill(*problem.args(), num_valid_tokens=1)
    with pytest.raises(TypeError, match="num_valid_tokens must be a real number, got bool"):
        fused_linear_cosine_distill(*problem.args(), num_valid_tokens=True)  # equal to 1, but not a count
    fused_linear_cosine_distill(*problem.args(), num_valid_tokens=torch.tensor(5))
    for bad in (torch.tensor([5, 5]), torch.tensor(True)):
        with pytest.raises(TypeError, match="one-element real tensor"):
            fused_linear_cosine_distill(*problem.args(), num_valid_tokens=bad)
    args = list(problem.args())
    args[4] = problem.labels[:-1]
    with pytest.raises(ValueError, match="true_labels shape"):
        fused_linear_cosine_distill(*args)
    args[4] = problem.labels.float()
    with pytest.raises(TypeError, match=r"true_labels must be an integer tensor \(int8 to int64, or uint8\)"):
        fused_linear_cosine_distill(*args)
    args[4] = problem.labels.tolist()
    with pytest.raises(TypeError, match="true_labels must be a torch.Tensor"):
        fused_linear_cosine_distill(*args)
    args = list(problem.args())
    args[3] = problem.teacher_weight.detach()
    fused_linear_cosine_distill(*args)
    for sparse in (args[3].to_sparse_csr(), args[3].to_sparse()):
        args[3] = sparse  # of the dense call's type, shape, dtype, device and requires_grad
        with pytest.raises(TypeError, match="teacher_weight must be a dense \\(strided\\) tensor, got layout"):
            fused_linear_cosine_distill(*args)


@pytest.mark.parametrize("loss", [fused_linear_cosine_distill, FusedLinearCosineDistillLoss()])
def test_a_weight_that_is_none_or_sparse_raises_before_auto_weighs_the_gram_path(loss):
    """Without biases "auto" asks whether the Gram path applies, from the weights, before the checks: a None weight
    raised an AttributeError there and a sparse teacher weight a NotImplementedError from the Gram cache."""
    problem = make_problem(tokens=9, bias=False)
    for index, name in ((1, "student_weight"), (3, "teacher_weight")):
        args = list(problem.args())
        args[index] = None
        with pytest.raises(TypeError, match=f"{name} is required, got None"):
            loss(*args)
    args = list(problem.args())
    args[3] = problem.teacher_weight.detach().to_sparse()
    with pytest.raises(TypeError, match="teacher_weight must be a dense \\(strided\\) tensor, got layout"):
        loss(*args)


def test_auto_asks_the_gram_cache_at_every_call_and_a_split_is_never_reused(monkeypatch):
    """"auto" on the cosine loss weighs the teacher's cached Gram matrix: a teacher that changes between calls takes
    the logits path, one that stays takes the Gram path again, each with its plan. A vocabulary split's object may
    change: never reused. The plans stay bounded."""
    made, teachers, run = recorded_plans(monkeypatch), [], api.run
    monkeypatch.setattr(api, "run", lambda p, *a, **k: teachers.append(p.teacher) or run(p, *a, **k))
    problem = make_problem(tokens=200, hidden_student=16, hidden_teacher=64, vocab_student=300, bias=False)
    for changed in (False, False, True, True, False, False):
        if changed:
            torch.autograd.graph.increment_version(problem.teacher_weight)
        fused_linear_cosine_distill(*problem.args())
    assert teachers == ["gram", "gram", "logits", "logits", "gram", "gram"] and len(made) == 2
    assert plan._call_signature(plan.Options(), problem.args(), None, vocab_parallel=object()) is None
    for tokens in range(1, plan.MAX_PLANS + 10):
        fused_linear_cosine_distill(*make_problem(tokens=tokens).args())
    assert len(plan._plans) == plan.MAX_PLANS  # the oldest went (all went at once before: every shape missed again)
    assert list(plan._plans.values()) == made[-plan.MAX_PLANS:]


def test_under_deterministic_algorithms_auto_does_not_weigh_the_gram_cache(monkeypatch):
    """The Gram cache's state depends on the process's earlier calls (a run resumed from a checkpoint starts without
    it), and the two paths round differently: under torch.use_deterministic_algorithms "auto" counts the teacher's
    Gram matrix as not cached, so that the same call gives the same bits whatever came before."""
    teachers, run = [], api.run
    monkeypatch.setattr(api, "run", lambda p, *a, **k: teachers.append(p.teacher) or run(p, *a, **k))
    problem = make_problem(tokens=200, hidden_student=16, hidden_teacher=64, vocab_student=300, bias=False)
    results = []
    torch.use_deterministic_algorithms(True)
    try:
        for changed in (False, False, True, False):
            if changed:
                torch.autograd.graph.increment_version(problem.teacher_weight)
            for leaf in problem.student_leaves():
                leaf.grad = None
            losses, grads = run_fused(problem)
            results.append([*losses, *grads])
    finally:
        torch.use_deterministic_algorithms(False)
    assert teachers == ["logits"] * 4
    assert all(torch.equal(got, want) for result in results[1:] for got, want in zip(result, results[0]))


# Each of a call's settings and the values it cycles through; a sequence of calls changes one at a time.
CALL_SETTINGS = dict(tokens=(200, 201), dtype=(torch.float32, torch.bfloat16), bias=(False, True), grad=(True, False),
                     weight_grad=(True, False), loss=("cosine", "jsd"), cosine_via=("auto", "logits"),
                     weight_hard=(0.5, 0.3), count=(None, 4, 4.0, "tensor", 5))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from([*CALL_SETTINGS, "teacher changed", "same again"]), min_size=4, max_size=16))
def test_a_reused_plan_is_the_plan_a_fresh_call_makes(steps):
    """Calls that change one setting at a time (shape, dtype, bias, gradients, grad mode, loss, options, count) or
    the teacher in place, or repeat: each runs the plan make_plan makes for it from scratch, given what the Gram
    cache told the call (at these sizes "auto" takes the Gram path where the teacher's Gram matrix is kept)."""
    from cosdistill.testing import teacher_gram

    plan._plans.clear()
    problems, answers, run_plans = {}, [], []
    will_hold, run = teacher_gram.teacher_grams.will_hold, api.run
    teacher_gram.teacher_grams.will_hold = lambda weight: answers.append(will_hold(weight)) or answers[-1]
    api.run = lambda chosen_plan, *args: run_plans.append(chosen_plan) or run(chosen_plan, *args)
    chosen = {name: 0 for name in CALL_SETTINGS}
    try:
        for step in steps:
            if step in chosen:
                chosen[step] = (chosen[step] + 1) % len(CALL_SETTINGS[step])
            call = {name: CALL_SETTINGS[name][index] for name, index in chosen.items()}
            key = (call["tokens"], call["dtype"], call["bias"])
            if key not in problems:
                problems[key] = make_problem(tokens=call["tokens"], hidden_student=16, hidden_teacher=64,
                                             vocab_student=300, dtype=call["dtype"], bias=call["bias"])
            problem = problems[key]
            if step == "teacher changed":
                torch.autograd.graph.increment_version(problem.teacher_weight)
            problem.student_weight.requires_grad_(call["weight_grad"])
            count = torch.tensor(4.0) if call["count"] == "tensor" else call["count"]
            options = dict(weight_hard_loss=call["weight_hard"], num_valid_tokens=count)
            if call["loss"] == "cosine":
                options["cosine_via"] = call["cosine_via"]
            asked = len(answers)
            with torch.set_grad_enabled(call["grad"]):
                FUSED_LOSSES[call["loss"]](*problem.args(), **options)
                needs_grad = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad
                                   for t in (problem.student_input, problem.student_weight, problem.student_bias))
            told = answers[asked] if len(answers) > asked else None
            # the call's own options, not the reused plan's: a plan kept across other options must not match
            called = plan.Options(weight_hard_loss=call["weight_hard"], loss=call["loss"],
                                  cosine_via=call["cosine_via"] if call["loss"] == "cosine" else "logits")
            fresh = plan.make_plan(called, problem.student_weight, problem.student_bias,
                                   problem.teacher_weight, problem.teacher_bias, call["tokens"], needs_grad, None, told)
            assert run_plans[-1] == fresh, (steps, call)
    finally:
        teacher_gram.teacher_grams.will_hold, api.run = will_hold, run
