"""The generalized JSD: its torch row step and fused_linear_jsd against a float64 autograd reference, TRL's
generalized_jsd_loss and Liger-Kernel's LigerFusedLinearJSDLoss."""

import dataclasses
import zlib

import pytest
import torch

from conftest import assert_rows_match, exact_reverse_kl_grad, make_problem, peaked_reverse_kl_rows, rel_err
from cosdistill import FusedLinearJSDLoss, fused_linear_jsd
from cosdistill.reference import generalized_jsd, naive_jsd
from cosdistill.testing import (
    RowStepConstants,
    combine_jsd_stats_torch,
    combine_jsd_sums_torch,
    jsd_lift_bound,
    jsd_shard_grad_torch,
    jsd_shard_stats_torch,
    jsd_shard_sums_torch,
    random_student_teacher,
    row_step_jsd_torch,
)

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def loss_reference(problem, beta, temperature, weight_hard=0.5, weight_soft=0.5):
    """(loss, soft, hard) and the student's gradients, from full float64 logits."""
    leaves = [t.detach().double().requires_grad_() for t in (problem.student_input, problem.student_weight)]
    loss, soft, hard = naive_jsd(*leaves, problem.teacher_input.double(), problem.teacher_weight.double(),
                                 problem.labels, weight_hard_loss=weight_hard, weight_soft_loss=weight_soft, beta=beta,
                                 temperature=temperature)
    loss.backward()
    return (loss.detach(), soft.detach(), hard.detach()), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.3, 4.0])
def test_row_step_matches_autograd_of_the_reference(beta, temperature):
    """Losses and d L / d s against autograd through the float64 reference, Vt > Vs, ignored rows."""
    generator = torch.Generator().manual_seed(int(10 * beta + temperature))
    s = torch.randn(9, 40, generator=generator, dtype=torch.float64) * 3
    t = torch.randn(9, 47, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, 40, (9,), generator=generator)
    labels[[2, 5]] = -100
    constants = RowStepConstants(0.3, 1.7, beta, temperature, -100)
    leaf = s.clone().requires_grad_()
    valid = labels != -100
    hard = torch.where(valid, torch.logsumexp(leaf, 1) - leaf.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    soft = torch.where(valid, generalized_jsd(leaf, t, beta, temperature), 0.0)
    (0.3 * hard.sum() + 1.7 * soft.sum()).backward()
    got, losses = s.float(), torch.full((9, 2), float("nan"))
    row_step_jsd_torch(got, t.float(), labels, constants, losses, True)
    assert rel_err(losses[:, 0], hard.detach()) < 1e-6 and rel_err(losses[:, 1], soft.detach()) < 1e-5
    assert rel_err(got, leaf.grad) < 1e-5


def split_stages(s, t, labels, constants, bounds, lift_terms=False):
    """(shards, stats, sums): the logits cut at the teacher's column ``bounds`` (student copies, each with its
    shard's constants), and the two combinations between the stages, as split_jsd_row_step makes them through
    all_gather."""
    vocab_student = s.shape[1]
    shards = [(s[:, min(a, vocab_student):min(b, vocab_student)].clone(), t[:, a:b], dataclasses.replace(
        constants, vocab_start=a, vocab_student_total=vocab_student)) for a, b in bounds]
    stats = combine_jsd_stats_torch(
        torch.stack([jsd_shard_stats_torch(*shard[:2], labels, shard[2]) for shard in shards]), constants.temperature)
    sums = combine_jsd_sums_torch(
        torch.stack([jsd_shard_sums_torch(*shard[:2], stats, shard[2], lift_terms) for shard in shards]))
    return shards, stats, sums


@pytest.mark.parametrize("temperature", [1.0, 0.1, 1e-3])
def test_reverse_kl_peaked_students_match_the_exact_gradient(temperature):
    """Reverse KL where the student's probability sits on one column, its g and row sum taken against the student's
    largest column (the teacher's largest logit among ties): the spec, whole and over a vocabulary split with that
    column on either side, gives each row's exact gradient (mpmath) to its fp32 storage. Against the row sum alone,
    gaps of 60 nats lost the whole gradient even in float64."""
    student, teacher, labels = peaked_reverse_kl_rows(temperature, -100)
    constants = RowStepConstants(0.0, 1.0, 1.0, temperature, -100)
    want = exact_reverse_kl_grad(student, teacher, temperature)
    want[labels == -100] = 0.0
    whole = student.clone()
    row_step_jsd_torch(whole, teacher, labels, constants, torch.empty(len(labels), 2), True)
    shards, stats, sums = split_stages(student, teacher, labels, constants, [(0, 35), (35, 77)])
    for shard in shards:
        jsd_shard_grad_torch(shard[0], shard[1], labels, stats, sums, shard[2], torch.empty(len(labels), 2), True)
    for got in (whole, torch.cat([shard[0] for shard in shards], dim=1)):
        assert_rows_match(got, want, 1e-6)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("write_grad", [True, False])
def test_its_stages_over_a_vocabulary_split_give_the_whole_rows_step(beta, write_grad):
    """Three shards of the columns (the last with none of the student's), each rank's stages with the two
    combinations between them (what split_jsd_row_step does through all_gather), against the whole step."""
    generator = torch.Generator().manual_seed(int(10 * beta))
    s, t = torch.randn(9, 30, generator=generator) * 3, torch.randn(9, 47, generator=generator) * 3
    labels = torch.tensor([0, 15, 16, 29, -100, 3, 40, 22, 7])  # 40: out of range, taken as ignored
    constants = RowStepConstants(0.3, 1.7, beta, 1.5, -100)
    want, want_losses = s.clone(), torch.empty(9, 2)
    row_step_jsd_torch(want, t, labels, constants, want_losses, write_grad)
    shards, stats, sums = split_stages(s, t, labels, constants, [(0, 16), (16, 32), (32, 47)])
    for shard in shards:
        losses = torch.full((9, 2), float("nan"))
        jsd_shard_grad_torch(shard[0], shard[1], labels, stats, sums, shard[2], losses, write_grad)
        assert rel_err(losses, want_losses) < 1e-6
    assert rel_err(torch.cat([shard[0] for shard in shards], dim=1), want) < 1e-6


@pytest.mark.parametrize("beta", BETAS)
def test_fp16_lifts_are_the_same_over_a_vocabulary_split(beta):
    """Each rank's shard of the gradient is lifted by the unsplit step's power of two: the largest bracket is
    combined with the sums, so every rank knows the whole row's bound."""
    generator = torch.Generator().manual_seed(int(10 * beta) + 1)
    s = (torch.randn(9, 300, generator=generator) * 2).half()
    t = (torch.randn(9, 470, generator=generator) * 2).half()
    labels = torch.tensor([0, 150, 160, 299, -100, 3, 400, 220, 7])
    constants = RowStepConstants(0.0, 1.0, beta, 1.3, -100)
    want, want_lifts = s.clone(), torch.empty(9)
    row_step_jsd_torch(want, t, labels, constants, torch.empty(9, 2), True, want_lifts)
    assert (want_lifts > 1).any() and (want_lifts[[4, 6]] == 1).all(), want_lifts  # rows 4 and 6 are ignored
    shards, stats, sums = split_stages(s, t, labels, constants, [(0, 160), (160, 320), (320, 470)], lift_terms=True)
    for shard in shards:
        lifts = torch.full((9,), float("nan"))
        jsd_shard_grad_torch(shard[0], shard[1], labels, stats, sums, shard[2], torch.empty(9, 2), True, lifts)
        assert torch.equal(lifts, want_lifts)
    assert rel_err(torch.cat([shard[0] for shard in shards], dim=1).float(), want.float()) < 1e-3


LIFT_CASES = {  # (student logits, teacher logits) of 6 rows: Vs = 40, Vt = 53
    "plain": lambda g: (torch.randn(6, 40, generator=g) * 3, torch.randn(6, 53, generator=g) * 3),
    "peaked teacher": lambda g: (torch.randn(6, 40, generator=g), torch.randn(6, 53, generator=g).index_fill(
        1, torch.tensor([7]), 60.0)),
    "peaked student": lambda g: (torch.randn(6, 40, generator=g).index_fill(1, torch.tensor([3]), 60.0),
                                 torch.randn(6, 53, generator=g)),
    "flat student, spread teacher": lambda g: (torch.zeros(6, 40), torch.randn(6, 53, generator=g) * 30),
}


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("case", LIFT_CASES)
@pytest.mark.parametrize("weight_hard", [0.0, 0.7])
def test_the_lift_bound_holds(beta, temperature, case, weight_hard):
    """jsd_lift_bound is at least each row's largest |d L / d s|, softcap and logit scale included, on flat,
    peaked and spread rows at temperatures far from 1."""
    generator = torch.Generator().manual_seed(zlib.crc32(repr((beta, temperature, case)).encode()))  # not hash(): salted
    s, t = (x.double() for x in LIFT_CASES[case](generator))
    labels = torch.tensor([0, 5, 39, 12, 21, 30])
    for heads in ({}, dict(student_softcap=5.0, student_logit_scale=1.7, teacher_softcap=8.0)):
        constants = RowStepConstants(weight_hard, 0.9, beta, temperature, -100, **heads)
        stats = jsd_shard_stats_torch(s, t, labels, constants)
        sums = jsd_shard_sums_torch(s, t, stats, constants, lift_terms=True)
        grad = s.clone()
        jsd_shard_grad_torch(grad, t, labels, stats, sums, constants, torch.empty(6, 2), True)
        largest, bound = grad.abs().amax(1), jsd_lift_bound(sums, constants)
        assert (largest <= bound * (1 + 1e-9)).all(), (largest, bound)


@pytest.mark.parametrize("vocab_teacher", [1, 50, 61339])
def test_a_one_column_student_gets_the_soft_terms_gradient_alone(vocab_teacher):
    """softmax(s) is 1 on a student of one column: the hard term's gradient is exactly 0, and the soft term's,
    of order 1 / Vt, must not drown in the hard term's rounding."""
    generator = torch.Generator().manual_seed(vocab_teacher)
    s = torch.randn(5, 1, generator=generator, dtype=torch.float64) * 3
    t = torch.randn(5, vocab_teacher, generator=generator, dtype=torch.float64) * 3
    leaf = s.clone().requires_grad_()
    soft = generalized_jsd(leaf, t, 0.5442, 1.0)
    (1.2 * (torch.logsumexp(leaf, 1) - leaf[:, 0]).sum() + 0.26 * soft.sum()).backward()
    got, losses = s.float(), torch.empty(5, 2)
    row_step_jsd_torch(got, t.float(), torch.zeros(5, dtype=torch.long), RowStepConstants(1.2, 0.26, 0.5442, 1.0, -1),
                       losses, True)
    assert rel_err(got, leaf.grad) < 1e-5


def test_peaked_teacher_and_extreme_temperatures_stay_finite():
    s = torch.randn(4, 30) * 50
    t = torch.full((4, 30), -1e4)
    t[:, 3] = 1e4  # the teacher puts all its mass on one token
    for beta in BETAS:
        for temperature in (0.05, 20.0):
            logits, losses = s.clone(), torch.empty(4, 2)
            row_step_jsd_torch(logits, t, torch.tensor([1, 2, 3, -100]), RowStepConstants(0.5, 0.5, beta, temperature, -100),
                               losses, True)
            assert torch.isfinite(losses).all() and torch.isfinite(logits).all()


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_fused_linear_jsd_matches_float64(beta, temperature, chunk_size):
    problem = make_problem(tokens=37, vocab_teacher=131, bias=False, ignore_every=4)
    losses = fused_linear_jsd(*problem.args()[:5], beta=beta, temperature=temperature, chunk_size=chunk_size,
                              return_soft_hard_loss=True)
    losses[0].backward()
    want_losses, want_grads = loss_reference(problem, beta, temperature)
    for got, want in zip(losses, want_losses):
        assert rel_err(got, want) < 1e-5
    for leaf, want in zip((problem.student_input, problem.student_weight), want_grads):
        assert rel_err(leaf.grad, want) < 1e-5


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("beta", [1e-30, 1e-9, 5e-5, 0.03, 1 - 0.03, 1 - 5e-5, 1 - 1e-9])
def test_betas_near_0_and_1_match_float64(beta, impl):
    """The soft term shrinks with beta (or 1 - beta) near 0 (or 1): every impl takes the betas from 1e-30 (the fast
    row steps refused 0 < beta < 1e-4 and 1 - 1e-4 < beta < 1, where their fp32 mixture was 20% off at 1e-8), and
    holds the soft term and, with the soft term alone, the gradients to fp32's precision against float64."""
    problem = make_problem(tokens=37, vocab_teacher=131, bias=False, ignore_every=4)
    losses = fused_linear_jsd(*problem.args()[:5], beta=beta, weight_hard_loss=0.0, weight_soft_loss=1.0, impl=impl,
                              return_soft_hard_loss=True)
    losses[0].backward()
    want_losses, want_grads = loss_reference(problem, beta, 1.0, weight_hard=0.0, weight_soft=1.0)
    assert 0 < want_losses[1] < 0.1
    assert rel_err(losses[1], want_losses[1]) < 1e-5
    for leaf, want in zip((problem.student_input, problem.student_weight), want_grads):
        assert rel_err(leaf.grad, want) < 1e-5


@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_a_beta_below_fp32s_reach_raises_but_in_the_spec(impl):
    """0 < beta < 1e-30: the fast row steps' fp32 products of beta and the teacher's probabilities underflow (on an
    H200 1e-39 gave a soft term 11 times the spec's, 1e-45 gave 0); they raise on any device, the spec takes it."""
    problem = make_problem(tokens=9, vocab_student=31)
    with pytest.raises(ValueError, match=r"beta=1e-35 is below 1e-30 but not 0: the fast JSD row steps"):
        fused_linear_jsd(*problem.args()[:5], beta=1e-35, impl=impl)
    fused_linear_jsd(*problem.args()[:5], beta=1e-35, impl="torch")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("weight_hard", [0.0, 0.5])
def test_fp16_weights_match_float64(beta, weight_hard, impl):
    """fp16 heads (the row step's lifted fp16 gradients, the chunk loop's fp16 GEMMs) against the naive version in
    float64 on the same fp16 inputs: losses and the student's gradients at fp16's rounding."""
    from cosdistill.testing import float64_reference

    problem = make_problem(tokens=29, vocab_student=2000, vocab_teacher=2013, ignore_every=4, dtype=torch.float16)
    args = problem.args()
    options = dict(weight_hard_loss=weight_hard, weight_soft_loss=1.0, beta=beta, temperature=1.5)
    losses = fused_linear_jsd(*args, chunk_size=8, return_soft_hard_loss=True, impl=impl, **options)
    grads = torch.autograd.grad(losses[0], (problem.student_input, problem.student_weight, problem.student_bias))
    want_losses, want_grads = float64_reference(args, loss="jsd", **options)
    for got, want in zip(losses, want_losses):
        assert rel_err(got, want) < 1e-4
    for got, want in zip(grads, want_grads):
        assert got.dtype == torch.float16 and rel_err(got, want) < 3e-3


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fp16_gradients_below_the_smallest_temperature_raise(beta, impl):
    """fp16 heads below SMALLEST_FP16_JSD_TEMPERATURE: the lift's bound, which grows as the teacher's gap over T^2,
    scaled reverse KL's rows into fp16's subnormals in the spec and the Triton step alike (the gradient 0.11 further
    off float64 than the logits' own rounding at T = 1e-4, wholly off at 1e-6, with no error). With gradients the
    function and the module raise there, for every beta, and run at the smallest temperature itself, as the error
    says; the loss alone runs at any, within float64's on the same fp16 logits."""
    from cosdistill.testing import SMALLEST_FP16_JSD_TEMPERATURE

    assert SMALLEST_FP16_JSD_TEMPERATURE == 1e-3
    torch.manual_seed(0)
    problem = make_problem(tokens=29, vocab_student=2000, vocab_teacher=2013, ignore_every=4, dtype=torch.float16)
    args = problem.args()
    message = r"temperature=0.0009 is below 0.001 with a float16 student_weight.*Pass float32 weights"
    with pytest.raises(ValueError, match=message):
        fused_linear_jsd(*args, beta=beta, temperature=9e-4, impl=impl)
    with pytest.raises(ValueError, match=message):
        FusedLinearJSDLoss(beta=beta, temperature=9e-4, impl=impl)(*args)
    with torch.no_grad():
        got = fused_linear_jsd(*args, beta=beta, temperature=1e-6, impl=impl, return_soft_hard_loss=True)
    # float64 on the logits as the fp16 GEMMs leave them
    student_logits, teacher_logits = (torch.nn.functional.linear(*tensors).double() for tensors in (
        (problem.student_input, problem.student_weight, problem.student_bias),
        (problem.teacher_input, problem.teacher_weight, problem.teacher_bias)))
    valid = problem.labels != -100
    soft = generalized_jsd(student_logits[valid], teacher_logits[valid], beta, 1e-6).sum() / valid.sum()
    hard = torch.nn.functional.cross_entropy(student_logits, problem.labels, ignore_index=-100)
    assert rel_err(got[1], soft) < 1e-5 and rel_err(got[2], hard) < 1e-5

    soft = generalized_jsd(student_logits[valid], teacher_logits[valid], beta, 1e-3).sum() / valid.sum()
    student_leaves = (problem.student_input, problem.student_weight, problem.student_bias)
    for call in (lambda: fused_linear_jsd(*args, beta=beta, temperature=1e-3, impl=impl, return_soft_hard_loss=True),
                 lambda: FusedLinearJSDLoss(beta=beta, temperature=1e-3, impl=impl, return_soft_hard_loss=True)(*args)):
        loss, got_soft, _ = call()
        grads = torch.autograd.grad(loss, student_leaves)
        assert rel_err(got_soft.detach(), soft) < 1e-5
        assert all(torch.isfinite(grad).all() and grad.abs().max() > 0 for grad in grads)


@pytest.mark.parametrize("temperature", [0.02, 1e-3])
@pytest.mark.parametrize("logit_size", [10, 30])
def test_reverse_kl_gradients_at_low_temperatures_match_the_spec_in_the_fast_step(temperature, logit_size):
    """Reverse KL with fp32 heads and logits of a few tens to a hundred at low temperatures, where most rows'
    probability sits on one column and their gradient is the difference of two terms of order the gap over T: the
    Triton step (its row sums against the student's largest column) holds the function's, the module's and
    torch.compile's gradients to the spec's on the same logits (1.0 off, the whole gradient, at T = 0.02 before,
    then refused below T = 0.05); the spec stays within the fp32 logits' rounding of float64, which 1 / T
    magnifies."""
    from cosdistill.testing import float64_reference

    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 2000, (29,), generator=generator)
    labels[::4] = -100
    args = random_student_teacher(labels, 16, 24, 2000, 2013, torch.float32, with_student_bias=True,
                                  with_teacher_bias=True, generator=generator)
    args[1], args[3] = (args[1].detach() * logit_size).requires_grad_(), args[3] * logit_size
    options = dict(beta=1.0, temperature=temperature, weight_hard_loss=0.0, weight_soft_loss=1.0)
    wrt = (args[0], args[1], args[5])
    spec = torch.autograd.grad(fused_linear_jsd(*args, impl="torch", chunk_size=8, **options), wrt)
    calls = {"function": lambda: fused_linear_jsd(*args, impl="triton", chunk_size=8, **options),
             "module": lambda: FusedLinearJSDLoss(impl="triton", chunk_size=8, **options)(*args),
             "compiled": lambda: torch.compile(fused_linear_jsd, backend="eager", fullgraph=True)(
                 *args, impl="triton", chunk_size=8, **options)}
    for name, call in calls.items():
        for got, want in zip(torch.autograd.grad(call(), wrt), spec):
            assert rel_err(got, want) < 1e-5, name
    if logit_size == 10 and temperature == 0.02:
        for got, want in zip(spec, float64_reference(args, loss="jsd", **options)[1]):
            assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 1.8])
def test_softcaps_and_logit_scales_match_the_naive_version(beta, temperature):
    """Each model's logits times its logit scale, then softcapped, before both terms (Gemma-2, Cohere): the
    loss and the student's gradients against the naive version in float64, Vt > Vs, biases, chunks of 7."""
    from cosdistill.testing import float64_reference

    problem = make_problem(tokens=29, vocab_teacher=131, ignore_every=4)
    heads = dict(student_softcap=3.0, teacher_softcap=4.5, student_logit_scale=0.7, teacher_logit_scale=1.6)
    options = dict(beta=beta, temperature=temperature, **heads)
    args = problem.args()
    losses = fused_linear_jsd(*args, chunk_size=7, return_soft_hard_loss=True, **options)
    grads = torch.autograd.grad(losses[0], (problem.student_input, problem.student_weight, problem.student_bias))
    want_losses, want_grads = float64_reference(args, loss="jsd", **options)
    for got, want in zip(losses, want_losses):
        assert rel_err(got, want) < 1e-5
    for got, want in zip(grads, want_grads):
        assert rel_err(got, want) < 1e-5
    plain = fused_linear_jsd(*args, beta=beta, temperature=temperature)
    assert rel_err(plain, losses[0]) > 1e-3  # the caps and scales change the loss


@pytest.mark.parametrize("beta", BETAS)
def test_matches_trls_generalized_jsd_loss(beta):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    problem = make_problem(tokens=24, vocab_teacher=101, vocab_student=101, bias=False, ignore_every=5)
    with torch.no_grad():
        soft = fused_linear_jsd(*problem.args()[:5], beta=beta, temperature=1.5, return_soft_hard_loss=True)[1]
        s = (problem.student_input @ problem.student_weight.t())[None]
        t = (problem.teacher_input @ problem.teacher_weight.t())[None]
        want = gkd.GKDTrainer.generalized_jsd_loss(s, t, labels=problem.labels[None], beta=beta, temperature=1.5)
    assert rel_err(soft, want) < 1e-5


LIGER_CASES = {  # (beta, weight_hard_loss, weight_soft_loss, temperature, ignore_index, every how many labels it is)
    "forward KL": (0.0, 0.4, 0.6, 2.0, -100, 4), "JSD": (0.5, 0.4, 0.6, 2.0, -100, 4),
    "reverse KL": (1.0, 0.4, 0.6, 2.0, -100, 4), "hard term alone, ignore_index 7": (0.2, 1.0, 0.0, 1.0, 7, 3),
    "soft term alone": (0.9, 0.0, 1.0, 0.7, -100, 5), "every label ignored": (0.5, 0.5, 0.5, 1.0, -100, 1),
}


@pytest.mark.parametrize("case", LIGER_CASES)
def test_a_drop_in_for_ligers_module(case):
    """The same constructor and call as LigerFusedLinearJSDLoss, and the same numbers (biases, Vt > Vs)."""
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    beta, weight_hard, weight_soft, temperature, ignore_index, every = LIGER_CASES[case]
    problem = make_problem(tokens=30, vocab_teacher=131, ignore_every=every)
    problem.labels.masked_fill_(problem.labels == -100, ignore_index)
    options = dict(weight_hard_loss=weight_hard, weight_soft_loss=weight_soft, beta=beta, temperature=temperature,
                   ignore_index=ignore_index, return_soft_hard_loss=True)
    ours = FusedLinearJSDLoss(**options)(*problem.args())
    grads = torch.autograd.grad(ours[0], (problem.student_input, problem.student_weight, problem.student_bias))
    theirs = liger.LigerFusedLinearJSDLoss(**options, compiled=False)(*problem.args())
    their_grads = torch.autograd.grad(theirs[0], (problem.student_input, problem.student_weight, problem.student_bias))
    for got, want in zip(ours, theirs):
        assert rel_err(got, want) < 1e-5
    for got, want in zip(grads, their_grads):
        assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_drop_in_for_ligers_module_in_batches_chunks_and_reuse(impl):
    """As Liger's module: [B, L, H] inputs with [B, L] labels, chunks that do not divide the tokens, a grad_output
    other than 1, gradients asked of some tensors only, and one module reused on another shape."""
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    options = dict(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=0.3, temperature=1.7, chunk_size=5)
    ours_module = FusedLinearJSDLoss(**options, impl=impl)
    theirs_module = liger.LigerFusedLinearJSDLoss(**options, compiled=False)
    for tokens, batch, vocab_teacher, needs_grad in ((24, 3, 131, (True, True, True)), (17, None, 101, (False, True, False))):
        problem = make_problem(tokens=tokens, batch=batch, vocab_teacher=vocab_teacher, ignore_every=4)
        inputs = (problem.student_input, problem.student_weight, problem.student_bias)
        for tensor, needed in zip(inputs, needs_grad):
            tensor.requires_grad_(needed)
        wanted = [tensor for tensor in inputs if tensor.requires_grad]
        ours, theirs = ours_module(*problem.args()), theirs_module(*problem.args())
        assert rel_err(ours, theirs) < 1e-5, (tokens, ours.item(), theirs.item())
        grads = torch.autograd.grad(ours, wanted, torch.tensor(2.5))
        their_grads = torch.autograd.grad(theirs, wanted, torch.tensor(2.5))
        for got, want in zip(grads, their_grads):
            assert rel_err(got, want) < 1e-4, tokens


def test_options_the_jsd_does_not_take_raise():
    problem = make_problem(tokens=8, bias=False)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        fused_linear_jsd(*problem.args()[:5], beta=1.5)


def test_under_torch_compile_it_matches_eager():
    problem = make_problem(tokens=21, vocab_teacher=111, bias=False, ignore_every=3)
    eager = fused_linear_jsd(*problem.args()[:5], beta=0.3, temperature=1.5)
    want = torch.autograd.grad(eager, (problem.student_input, problem.student_weight))
    compiled = torch.compile(lambda *args: fused_linear_jsd(*args, beta=0.3, temperature=1.5), fullgraph=True,
                             backend="aot_eager")
    loss = compiled(*problem.args()[:5])
    got = torch.autograd.grad(loss, (problem.student_input, problem.student_weight))
    assert rel_err(loss, eager) < 1e-6
    for got_grad, want_grad in zip(got, want):
        assert rel_err(got_grad, want_grad) < 1e-6
