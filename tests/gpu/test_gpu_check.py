"""Correctness on a CUDA GPU before any timing is trusted (pytest -m gpu, on an H200), each check also run on
the CPU at small sizes (Triton in its interpreter) as an ordinary test.

1. The row step: Triton, Triton split in two and, where it applies, the CUDA cluster kernel against the torch
   spec at odd and LLM-sized vocabularies, into poisoned outputs (cosdistill.tools.check.check_row_step);
   the Gram path's one-model cluster kernel.
2. The whole loss (each impl, the logits and the Gram path) against the float64 naive reference at a few
   odd shapes (check_loss).
3. FP8: the quantization against its formula; the FP8 teacher path against float64 fed the dequantized
   teacher. fp16 with a zero student head; with two GPUs, the loss on the second while the first is current.
4. Never a silently wrong number: the teacher caches against every mutation, the fingerprint kernel on a
   seed-sized head, a student changed before backward, uint8 labels, "auto" on huge student logits.
5. At the seed workload (V = 128256, teacher H = 4096, student H = 2048, bf16, T = --seed-tokens): the error
   against float64 of each grad_weight accumulator dtype and chunk size, and the peak memory above the inputs.
"""

import pytest
import torch

from conftest import DEVICES, assert_rows_match, exact_reverse_kl_grad, on_devices, peaked_reverse_kl_rows, run_jsd_split_stages
from cosdistill import StaleWeightError, StudentMetrics, fused_linear_cosine_distill, quantize_teacher_weight
from cosdistill.testing import (
    COSINE_TORCH_ROW_STEP,
    FUSED_LOSSES,
    RowStepConstants,
    accumulation_floor,
    backend_for,
    fingerprint_torch,
    fingerprint_triton,
    float64_reference,
    kernels,
    plan,
    quantize_rows_triton,
    rel_err,
    row_step_jsd_torch,
    student_metrics_torch,
    teacher_grad_coefficient,
    weight_cache,
    with_teacher_products,
)
from cosdistill.testing import teacher_fp8 as fp8
from cosdistill.tools.check import (
    LOSS_TOLERANCE,
    POISON,
    ROW_STEP_TOLERANCE,
    LossCase,
    RowStepCase,
    check_jsd,
    check_loss,
    check_row_step,
    check_teacher_caches,
    compare,
    fused_run,
    random_problem,
    results_table,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
row_step_cuda = kernels.row_step_cuda


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def describe(case):
    return case.describe()


def assert_passed(results):
    assert results and all(result.passed for result in results), results_table(results)


def cluster_kernel_or_skip(device):
    if not row_step_cuda.available(torch.device(device)):
        pytest.skip("needs thread block clusters (compute capability 9.0) and NVRTC")


def fp8_or_skip(device, monkeypatch):
    """On the CPU the FP8 GEMMs run through torch's reference _scaled_mm; a GPU needs FP8 tensor cores."""
    if device == "cpu":
        monkeypatch.setattr(fp8, "check_supported", lambda *args: None)
        return
    try:
        fp8.check_supported(torch.device(device))
    except ValueError as error:
        pytest.skip(str(error))


ROW_STEP_CASES = on_devices([
    RowStepCase(7, 1283, 1283, BF16), RowStepCase(7, 1283, 1347, BF16), RowStepCase(5, 3201, 3201, FP32),
    RowStepCase(9, 1519, 1527, FP16), RowStepCase(3, 1, 1, FP32), RowStepCase(3, 1, 2, FP32),
    RowStepCase(3, 2, 2, FP32), RowStepCase(4, 2, 3, FP32), RowStepCase(4, 17, 17, BF16), RowStepCase(4, 1000, 1000, FP32),
    RowStepCase(7, 1283, 1347, BF16, softcap=30.0), RowStepCase(5, 3201, 3201, FP32, softcap=5.0, logit_scale=0.5),
    RowStepCase(9, 500, 1283, BF16), RowStepCase(3, 2624, 2624, BF16), RowStepCase(11, 320, 320, BF16),
    RowStepCase(5, 8, 8, BF16), RowStepCase(6, 1, 1283, BF16, softcap=30.0, logit_scale=0.5),
], [
    RowStepCase(37, 128256, 128256, BF16), RowStepCase(37, 128256, 128320, BF16), RowStepCase(5, 32001, 32001, FP32),
    RowStepCase(9, 151936, 152064, FP16), RowStepCase(3, 1, 1, FP32), RowStepCase(3, 1, 2, FP32),
    RowStepCase(3, 2, 2, FP32), RowStepCase(4, 2, 3, FP32), RowStepCase(4, 17, 17, BF16), RowStepCase(4, 1000, 1000, FP32),
    RowStepCase(37, 128256, 128320, BF16, softcap=30.0), RowStepCase(5, 32001, 32001, FP32, softcap=5.0, logit_scale=0.5),
    RowStepCase(9, 50000, 128256, BF16),  # split in two: the upper half holds no student columns
    RowStepCase(9, 262144, 262144, BF16), RowStepCase(11, 32000, 32000, BF16), RowStepCase(5, 8, 8, BF16),  # CUDA
    RowStepCase(6, 1, 61339, BF16, softcap=30.0, logit_scale=0.5),  # one student column: its softmax exactly 1
], describe)


@pytest.mark.parametrize("device, case", ROW_STEP_CASES)
def test_row_step_matches_the_spec(device, case):
    """Triton, Triton split over two vocabulary shards, and the cluster kernel where it applies: the torch spec."""
    assert_passed(check_row_step(device, [case]))


@pytest.mark.parametrize("device, vocab", on_devices([1283], [128256]))
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_row_steps_take_a_student_norm_under_the_clamp_as_constant(device, vocab, dtype):
    """Rows whose student norm is under the cosine's clamp (0 < |s| < eps T): the clamped norm is a constant, so
    their soft gradient is along t alone. Triton and, where it applies, the cluster kernel against the spec, the
    soft term alone (such rows' gradient, ~1 / (eps T), dwarfs the others')."""
    constants = RowStepConstants(weight_hard=0.0, weight_soft=0.81, beta=0.6, temperature=1.7, ignore_index=-100)
    teacher = torch.randn(6, vocab, device=device) * 3
    student = torch.randn(6, vocab, device=device) * 3
    for row, share in ((1, 0.5), (4, 0.9)):  # of the clamp; near the teacher's direction, so that a term along s
        # (cos / clamp^2 times s, cos of the order of the rows' alignment) would show at bf16's tolerance too
        student[row] = (student[row] + teacher[row]) * share * constants.norm_clamp / (student[row] + teacher[row]).norm()
    student, teacher = student.to(dtype), teacher.to(dtype)
    labels = torch.randint(0, vocab, (6,), device=device)
    steps = {"triton": kernels.row_step_triton.row_step_triton}
    if row_step_cuda.available(torch.device(device)) and row_step_cuda.applies(dtype, vocab, vocab, constants):
        assert row_step_cuda.supported(student, teacher, labels, constants, True, None)
        steps["cuda"] = row_step_cuda.row_step_cuda
    want_grad, want_losses = student.clone(), torch.full((6, 2), POISON, device=device)
    COSINE_TORCH_ROW_STEP.step(want_grad, teacher, labels, constants, want_losses, True)
    tol_loss, tol_grad = ROW_STEP_TOLERANCE[dtype]
    for name, step in steps.items():
        got_grad, got_losses = student.clone(), torch.full((6, 2), POISON, device=device)
        step(got_grad, teacher, labels, constants, got_losses, True)
        assert rel_err(got_losses, want_losses) < tol_loss, name
        assert rel_err(got_grad.float(), want_grad.float()) < tol_grad, name


GRAM_ROW_STEP_CASES = on_devices([], [
    RowStepCase(37, 128256, 128256, BF16), RowStepCase(9, 262144, 262144, BF16), RowStepCase(11, 32000, 32000, BF16),
    RowStepCase(5, 8, 8, BF16), RowStepCase(7, 151936, 151936, BF16),
], describe)


@pytest.mark.parametrize("device, case", GRAM_ROW_STEP_CASES)
def test_gram_cluster_row_step_matches_the_spec(device, case):
    """The one-model cluster kernel (the Gram path's row step) against the torch spec's two stages with
    teacher_logits None: losses, gradient and each row's coefficient of t, every output poisoned first; a
    quarter of the rows ignored, one row whose products overflow (NaN there)."""
    cluster_kernel_or_skip(device)
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=0.6, temperature=1.7, ignore_index=-100)
    student = (torch.randn(case.rows, case.vocab_student, device=device) * 3).to(BF16)
    labels = torch.randint(0, case.vocab_student, (case.rows,), device=device)
    labels[::4] = -100
    norms = student.float().norm(dim=1)
    sum_sq_teacher = (torch.rand(case.rows, device=device) + 0.5) * norms**2
    dot = (torch.rand(case.rows, device=device) * 2 - 1) * norms * sum_sq_teacher.sqrt()
    dot[1], sum_sq_teacher[1] = float("inf"), float("inf")  # row 1 (not ignored): NaN loss and gradient
    want_grad, want_losses = student.clone(), torch.full((case.rows, 2), POISON, device=device)
    stats = with_teacher_products(COSINE_TORCH_ROW_STEP.stats(want_grad, None, labels, constants), dot, sum_sq_teacher, constants)
    COSINE_TORCH_ROW_STEP.grad(want_grad, None, labels, stats, constants, want_losses, True)
    want_coefs = teacher_grad_coefficient(stats, labels, case.vocab_student, constants)
    got_grad, got_losses = student.clone(), torch.full((case.rows, 2), POISON, device=device)
    got_coefs = torch.full((case.rows,), float("nan"), device=device)
    assert row_step_cuda.gram_row_step_cuda(got_grad, labels, constants, got_losses,
                                            torch.stack((dot, sum_sq_teacher), 1), got_coefs)
    finite = torch.ones(case.rows, dtype=torch.bool, device=device)
    finite[1] = False
    assert rel_err(got_losses[finite], want_losses[finite]) < 1e-5
    assert rel_err(got_grad[finite], want_grad[finite]) < 1e-2
    assert rel_err(got_coefs[finite], want_coefs[finite]) < 1e-5
    assert got_losses[1].isnan().all() and got_grad[1].isnan().all() and got_coefs[1].isnan()



# (rows, vocab, beta, temperature): every form at the seed vocabulary, a few at the others.
JSD_CLUSTER_FORMS = [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.3, 2.0), (0.5, 0.7), (0.0, 3.0), (1.0, 0.5)]
JSD_CLUSTER_CASES = ([(37, 128256, *form) for form in JSD_CLUSTER_FORMS]
                     + [(rows, vocab, *form) for rows, vocab in ((9, 262144), (11, 32000), (5, 8), (7, 151936), (6, 1000),
                                                                 (13, 65536))
                        for form in ((0.5, 1.0), (0.0, 2.0), (1.0, 1.5))])


@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab, beta, temperature", JSD_CLUSTER_CASES)
@pytest.mark.parametrize("write_grad", [True, False])
def test_jsd_cluster_row_step_matches_the_spec(rows, vocab, beta, temperature, write_grad):
    """The JSD's cluster kernel against the torch spec (float64) and the Triton step, into NaN-poisoned losses:
    a quarter of the rows ignored, one row with a peaked teacher and one with a peaked student, int32 labels
    on odd vocabularies. Without gradients the step is Triton's (supported says no) and the logits stay as
    they were."""
    cluster_kernel_or_skip("cuda")
    jsd_cuda = kernels.row_step_jsd_cuda
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=beta, temperature=temperature, ignore_index=-100)
    student = (torch.randn(rows, vocab, device="cuda") * 3).to(BF16)
    teacher = (torch.randn(rows, vocab, device="cuda") * 3).to(BF16)
    teacher[1] *= 30
    student[2 % rows] *= 30
    labels = torch.randint(0, vocab, (rows,), device="cuda", dtype=torch.int32 if vocab % 3 else torch.int64)
    labels[::4] = -100
    assert jsd_cuda.supported(student, teacher, labels, constants, write_grad, None) == write_grad
    assert jsd_cuda._fitting_kernel(vocab, labels.dtype, 0, jsd_cuda.mode_of(beta, BF16), temperature == 1.0) is not None
    results = {}
    for name, step in (("cuda", jsd_cuda.row_step_jsd_cuda), ("triton", kernels.row_step_jsd_triton.row_step_jsd_triton),
                       ("torch", row_step_jsd_torch)):
        logits, losses = student.clone(), torch.full((rows, 2), POISON, device="cuda")
        step(logits, teacher, labels, constants, losses, write_grad)
        results[name] = logits, losses
    ignored = labels == -100
    got_grad, got_losses = results["cuda"]
    assert torch.isfinite(got_losses).all() and (got_losses[ignored] == 0).all()
    for other, loss_tol in (("torch", 2e-5), ("triton", 1e-5)):
        want_grad, want_losses = results[other]
        for column in (0, 1):  # hard and soft apart: neither may hide in the other's size
            assert rel_err(got_losses[:, column], want_losses[:, column]) < loss_tol, (other, column)
        if write_grad:
            assert rel_err(got_grad, want_grad) < 1e-2, other
    if write_grad:
        assert torch.isfinite(got_grad.float()).all() and torch.count_nonzero(got_grad[ignored]) == 0
    else:
        assert torch.equal(got_grad, student)


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_jsd_cluster_row_step_at_a_temperature_near_0(beta):
    """At T = 1e-20 weight_soft / T times a gap passes fp32's range; the step scales the bracket by p times that
    coefficient, so columns where p is 0 give 0, not inf times 0. Each row is a permutation of distinct bf16
    logits, so that p is one column's and the true gradient is finite."""
    cluster_kernel_or_skip("cuda")
    rows, vocab = 6, 256
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=beta, temperature=1e-20, ignore_index=-100)
    distinct = torch.arange(vocab, device="cuda", dtype=torch.float32) / 16  # exact in bf16
    student = torch.stack([distinct[torch.randperm(vocab, device="cuda")] for _ in range(rows)]).to(BF16)
    teacher = torch.stack([distinct[torch.randperm(vocab, device="cuda")] for _ in range(rows)]).to(BF16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[0] = -100
    assert kernels.row_step_jsd_cuda.supported(student, teacher, labels, constants, True, None)
    (got_grad, got_losses), (want_grad, want_losses) = jsd_step_and_spec(
        kernels.row_step_jsd_cuda.row_step_jsd_cuda, student, teacher, labels, constants, True)
    assert torch.isfinite(got_grad.float()).all() and torch.isfinite(got_losses).all()
    for column in (0, 1):  # hard and soft apart: reverse KL's soft term is of order 1 / T here
        assert rel_err(got_losses[:, column], want_losses[:, column]) < 1e-5, column
    assert rel_err(got_grad, want_grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.1, 1e-3])
def test_jsd_reverse_kl_peaked_students_keep_their_gradient(temperature):
    """Reverse KL where the student's probability sits on one column (gaps of 20 to 1000 nats over T, a tie of the
    student's top across the cluster's blocks): the cluster kernel, the Triton step and its split stages, each
    with g and the row sum against the student's largest column, give each row's exact gradient (mpmath) to bf16's
    storage; against the row sum alone gaps of 30 nats lost the whole gradient."""
    cluster_kernel_or_skip("cuda")
    student, teacher, labels = (tensor.cuda() for tensor in peaked_reverse_kl_rows(temperature, -100, 256, 256, BF16))
    constants = RowStepConstants(weight_hard=0.0, weight_soft=1.0, beta=1.0, temperature=temperature, ignore_index=-100)
    assert kernels.row_step_jsd_cuda.supported(student, teacher, labels, constants, True, None)
    want = exact_reverse_kl_grad(student.cpu(), teacher.cpu(), temperature)
    want[labels.cpu() == -100] = 0.0
    for step in (kernels.row_step_jsd_cuda.row_step_jsd_cuda, kernels.row_step_jsd_triton.row_step_jsd_triton):
        grad, losses = student.clone(), torch.full((len(labels), 2), POISON, device="cuda")
        step(grad, teacher, labels, constants, losses, True)
        assert_rows_match(grad, want, 4e-3)
    split, _, _ = run_jsd_split_stages(student, teacher, labels, constants, [(0, 40), (40, 256)], True)
    assert_rows_match(split, want, 4e-3)


def jsd_step_and_spec(step, student, teacher, labels, constants, write_grad):
    """((gradient, losses) of ``step``, the same of the float64 spec), each from a copy of ``student`` and
    NaN-poisoned losses."""
    results = []
    for run in (step, row_step_jsd_torch):
        logits, losses = student.clone(), torch.full((len(labels), 2), POISON, device=student.device)
        run(logits, teacher, labels, constants, losses, write_grad)
        results.append((logits, losses))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
@pytest.mark.parametrize("temperature", [1.0, 4.0])
@pytest.mark.parametrize("beta", [1e-3, 1e-6, 1e-9, 1 - 1e-6, 1 - 1e-9])
def test_jsd_betas_near_0_and_1_keep_fp32s_precision(beta, temperature, vocab):
    """Within EDGE_MARGIN of beta = 0 or 1 the JSD step is the Triton step's MIXED_PRECISE (the cluster kernel declines),
    here compiled, its logs and exponentials the GPU's approximate instructions: on fp32 logits with the soft term
    alone, its losses and gradient against the float64 spec, into NaN-poisoned losses."""
    jsd_cuda = kernels.row_step_jsd_cuda
    constants = RowStepConstants(weight_hard=0.0, weight_soft=1.0, beta=beta, temperature=temperature, ignore_index=-100)
    student, teacher = torch.randn(16, vocab, device="cuda") * 3, torch.randn(16, vocab, device="cuda") * 3
    labels = torch.randint(0, vocab, (16,), device="cuda")
    labels[::5] = -100
    assert not jsd_cuda.supported(student.to(BF16), teacher.to(BF16), labels, constants, True, None)
    for write_grad in (True, False):
        (got_grad, got_losses), (want_grad, want_losses) = jsd_step_and_spec(
            jsd_cuda.JSD_CUDA_ROW_STEP.step, student, teacher, labels, constants, write_grad)
        assert rel_err(got_losses[:, 1], want_losses[:, 1]) < 1e-5, write_grad
        assert rel_err(got_grad, want_grad) < 1e-5 if write_grad else torch.equal(got_grad, student)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("beta", [0.5, 0.95, 1 - 1e-6])
def test_jsd_a_teacher_peaked_far_from_the_student_keeps_fp32s_precision(beta, temperature, vocab):
    """fp32 logits run MIXED_PRECISE at every 0 < beta < 1 (the cluster kernel takes bf16 only), here compiled: with
    each row's teacher peaked 30 above its other logits and the soft term alone, the gradient's bracket in its row
    reference form; losses and gradient against the float64 spec, into NaN-poisoned losses."""
    constants = RowStepConstants(weight_hard=0.0, weight_soft=1.0, beta=beta, temperature=temperature, ignore_index=-100)
    student, teacher = torch.randn(16, vocab, device="cuda") * 2, torch.randn(16, vocab, device="cuda") * 2
    teacher[torch.arange(16), torch.randint(0, vocab, (16,))] += 30.0
    labels = torch.randint(0, vocab, (16,), device="cuda")
    labels[::5] = -100
    assert kernels.row_step_jsd_triton.mode_of(beta, torch.float32) == kernels.row_step_jsd_triton.MIXED_PRECISE.value
    (got_grad, got_losses), (want_grad, want_losses) = jsd_step_and_spec(
        kernels.row_step_jsd_triton.row_step_jsd_triton, student, teacher, labels, constants, True)
    assert rel_err(got_losses[:, 1], want_losses[:, 1]) < 1e-5
    assert rel_err(got_grad, want_grad) < 1e-5


# (rows, vocab, beta, temperature, the hashed weight's shape): the seed's, odd weights, a short launch
JSD_HASH_CASES = [(1024, 128256, 0.5, 1.0, (128256, 4096)), (300, 32000, 0.0, 2.0, (32000, 520)),
                  (260, 65536, 1.0, 1.0, (40007, 1000)), (257, 1000, 0.5, 0.7, (1000, 4)), (3, 32000, 0.5, 1.0, (32000, 512))]


@pytest.mark.gpu
@pytest.mark.parametrize("rows, vocab, beta, temperature, weight_shape", JSD_HASH_CASES)
def test_the_jsd_cluster_step_takes_a_weight_hash_along_with_the_same_bits(rows, vocab, beta, temperature,
                                                                          weight_shape):
    """The cluster step that hashes a weight on the side (row_step_jsd_cuda_hashing) writes the plain step's bits
    and the fingerprint kernel's hash; it declines (None, nothing written) where the launch is too short for the
    weight or the weight's words are not 16-byte rows, and the hash then sees one changed element."""
    from cosdistill.testing import as_words, lanes_of

    cluster_kernel_or_skip("cuda")
    jsd_cuda = kernels.row_step_jsd_cuda
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=beta, temperature=temperature, ignore_index=-100)
    student = (torch.randn(rows, vocab, device="cuda") * 3).to(BF16)
    teacher = (torch.randn(rows, vocab, device="cuda") * 3).to(BF16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::4] = -100
    weight = torch.randn(weight_shape, device="cuda", dtype=BF16)
    plain_logits, plain_losses = student.clone(), torch.full((rows, 2), POISON, device="cuda")
    jsd_cuda.row_step_jsd_cuda(plain_logits, teacher, labels, constants, plain_losses, True)
    logits, losses = student.clone(), torch.full((rows, 2), POISON, device="cuda")
    partials = jsd_cuda.row_step_jsd_cuda_hashing(logits, teacher, labels, constants, losses, True, words=as_words(weight))
    if rows * 8 * jsd_cuda.HASH_ROWS_PER_BLOCK < weight_shape[0] or weight_shape[1] % 8:
        assert partials is None and torch.equal(logits, student) and (losses == POISON).all()
        return
    assert torch.equal(logits, plain_logits) and torch.equal(losses, plain_losses)
    assert torch.equal(lanes_of(partials), fingerprint_triton(weight))
    weight[weight_shape[0] * 3 // 5, weight_shape[1] // 3] += 1.0
    changed = jsd_cuda.row_step_jsd_cuda_hashing(logits, teacher, labels, constants, losses, True, words=as_words(weight))
    assert torch.equal(lanes_of(changed), fingerprint_triton(weight)) and not torch.equal(lanes_of(changed),
                                                                                        lanes_of(partials))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab, beta, temperature", [(128256, 0.0, 1.0), (128256, 0.5, 1.0), (128256, 1.0, 1.0),
                                                      (128256, 0.3, 2.0), (32000, 0.0, 0.7), (32003, 1.0, 1.5)])
@pytest.mark.parametrize("weights", [(0.0, 1.0), (0.5, 0.5)])
def test_jsd_triton_fp16_lifts_match_the_spec(vocab, beta, temperature, weights):
    """The Triton step's lifted fp16 gradient (which the plan runs on a GPU only once this has passed there)
    against the torch spec: the same powers of two, the same losses, the unlifted gradient at fp16's rounding of
    the fp32 one; a quarter of the rows ignored, a peaked teacher, a softcap and a logit scale."""
    rows = 23
    constants = RowStepConstants(*weights, beta, temperature, -100, student_softcap=30.0, teacher_logit_scale=1.3)
    student = (torch.randn(rows, vocab, device="cuda") * 3).to(FP16)
    teacher = (torch.randn(rows, vocab, device="cuda") * 3).to(FP16)
    teacher[1] *= 10
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::4] = -100
    plain_grad, plain_losses = student.float(), torch.full((rows, 2), POISON, device="cuda")
    row_step_jsd_torch(plain_grad, teacher.float(), labels, constants, plain_losses, True)  # fp32 storage: no lifts
    results = {}
    for name, step in (("triton", kernels.row_step_jsd_triton.row_step_jsd_triton), ("torch", row_step_jsd_torch)):
        grad, losses = student.clone(), torch.full((rows, 2), POISON, device="cuda")
        lifts = torch.full((rows,), POISON, device="cuda")
        step(grad, teacher, labels, constants, losses, True, grad_lifts=lifts)
        valid = labels != -100
        assert rel_err(losses, plain_losses) < 1e-5, name
        assert torch.isfinite(grad).all() and (lifts[~valid] == 1).all()
        assert rel_err(grad[valid].float() / lifts[valid, None], plain_grad[valid]) < 2e-3, name
        results[name] = lifts
    assert torch.equal(results["triton"], results["torch"])


@pytest.mark.gpu
def test_jsd_triton_fp16_lift_bound_past_fp32s_range_leaves_the_row_as_it_is():
    """Compiled: reverse KL at T = 1e-30, whose lift bound passes fp32's range while the soft gradient is 0,
    lifts each row by 1 in the Triton step as in the spec, keeping the hard gradient softmax(s) - onehot."""
    rows, vocab = 23, 32003
    constants = RowStepConstants(1.0, 1.0, 1.0, 1e-30, -100)
    student = (torch.randn(rows, vocab, device="cuda") * 3).to(FP16)
    teacher = (torch.randn(rows, vocab, device="cuda") * 3).to(FP16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::4] = -100
    valid = labels != -100
    expected = torch.softmax(student.double(), 1)
    expected[torch.arange(rows, device="cuda"), labels.clamp(0)] -= 1
    for step in (kernels.row_step_jsd_triton.row_step_jsd_triton, row_step_jsd_torch):
        grad, lifts = student.clone(), torch.full((rows,), POISON, device="cuda")
        step(grad, teacher, labels, constants, torch.full((rows, 2), POISON, device="cuda"), True, grad_lifts=lifts)
        assert (lifts == 1).all(), lifts
        assert rel_err(grad[valid].double(), expected[valid]) < 1e-3



# (Vs, Vt, the teacher's column bounds of each rank): the seed's vocabulary over two ranks, a padded student over
# three (its last shard partial, then none of its columns)
JSD_SPLIT_CASES = {"seed over 2": (128256, 128256, [(0, 64128), (64128, 128256)]),
                   "padded over 3": (30000, 32003, [(0, 12000), (12000, 29000), (29000, 32003)]),
                   "a padding-only shard": (30000, 32003, [(0, 16000), (16000, 30000), (30000, 32003)])}


@pytest.mark.gpu
@pytest.mark.parametrize("split", JSD_SPLIT_CASES)
@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.3, 2.0), (0.5, 0.7)])
@pytest.mark.parametrize("write_grad", [True, False])
def test_the_jsd_triton_split_stages_give_the_whole_rows_step(split, beta, temperature, write_grad):
    """The vocabulary split's three Triton stages, each shard a rank (the combinations between them as the
    all-gathers make them), against the unsplit Triton step and the torch spec: every shard the same losses, its
    columns' gradient; a quarter of the rows ignored, a peaked teacher and a peaked student, NaN-poisoned losses."""
    vocab_student, vocab_teacher, bounds = JSD_SPLIT_CASES[split]
    rows = 37
    constants = RowStepConstants(weight_hard=0.37, weight_soft=0.81, beta=beta, temperature=temperature, ignore_index=-100)
    student = (torch.randn(rows, vocab_student, device="cuda") * 3).to(BF16)
    teacher = (torch.randn(rows, vocab_teacher, device="cuda") * 3).to(BF16)
    teacher[1] *= 30
    student[2] *= 30
    labels = torch.randint(0, vocab_student, (rows,), device="cuda")
    labels[::4] = -100
    grad, losses, _ = run_jsd_split_stages(student, teacher, labels, constants, bounds, write_grad)
    assert all(torch.equal(shard_losses, losses[0]) for shard_losses in losses)
    ignored = labels == -100
    assert torch.isfinite(losses[0]).all() and (losses[0][ignored] == 0).all()
    for name, step, loss_tol in (("triton", kernels.row_step_jsd_triton.row_step_jsd_triton, 1e-5),
                                 ("torch", row_step_jsd_torch, 2e-5)):
        want_grad, want_losses = student.clone(), torch.full((rows, 2), POISON, device="cuda")
        step(want_grad, teacher, labels, constants, want_losses, write_grad)
        for column in (0, 1):
            assert rel_err(losses[0][:, column], want_losses[:, column]) < loss_tol, (name, column)
        if write_grad:
            assert rel_err(grad, want_grad) < 1e-2, name
    if write_grad:
        assert torch.isfinite(grad.float()).all() and torch.count_nonzero(grad[ignored]) == 0
    else:
        assert torch.equal(grad, student)


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_jsd_triton_split_stages_lift_fp16_rows_as_the_whole_step(beta):
    """fp16 logits over a vocabulary split: every shard lifts a row by the unsplit Triton step's power of two."""
    rows, vocab = 23, 128256
    constants = RowStepConstants(0.0, 1.0, beta, 1.3, -100, student_softcap=30.0, teacher_logit_scale=1.3)
    student = (torch.randn(rows, vocab, device="cuda") * 3).to(FP16)
    teacher = (torch.randn(rows, vocab, device="cuda") * 3).to(FP16)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[::4] = -100
    grad, _, lifts = run_jsd_split_stages(student, teacher, labels, constants, [(0, 50000), (50000, vocab)], True,
                                          lifts=True)
    whole, whole_lifts = student.clone(), torch.full((rows,), POISON, device="cuda")
    kernels.row_step_jsd_triton.row_step_jsd_triton(whole, teacher, labels, constants,
                                                    torch.empty(rows, 2, device="cuda"), True, grad_lifts=whole_lifts)
    assert (whole_lifts > 1).any()
    assert all(torch.equal(shard_lifts, whole_lifts) for shard_lifts in lifts)
    torch.testing.assert_close(grad.float(), whole.float(), rtol=1e-2, atol=1e-4)

LOSS_CASES = on_devices([
    LossCase(30, 3203, 3203, 32, FP32, True, 7, 13),
    LossCase(30, 3203, 3290, 32, BF16, False, 7, 10),
    LossCase(60, 1283, 1283, 64, BF16, False, 7, None),
    LossCase(26, 503, 503, 32, FP16, True, 7, 8),
    LossCase(100, 1283, 1283, 64, FP16, True, 7, None),
    LossCase(30, 3203, 3290, 32, BF16, True, 7, 13, softcap=10.0),
    LossCase(130, 1283, 1283, 32, BF16, False, 7, 64),
], [
    LossCase(300, 32011, 32011, 256, FP32, True, 7, 128),
    LossCase(300, 32011, 32100, 256, BF16, False, 7, 100),
    LossCase(1000, 128256, 128256, 512, BF16, False, 7, None),
    LossCase(257, 5003, 5003, 128, FP16, True, 7, 64),
    LossCase(1000, 128256, 128256, 512, FP16, True, 7, None),  # fp16 at an LLM vocabulary: the lifted gradients
    LossCase(300, 32011, 32100, 256, BF16, True, 7, 128, softcap=10.0),
    LossCase(2500, 128256, 128256, 256, BF16, False, 7, None),  # automatic rows: chunks 2048 + 452, teacher 1024
], describe)


@pytest.mark.parametrize("device, case", LOSS_CASES)
def test_loss_matches_float64(device, case):
    """Each impl on the device (the cluster kernel's too, on Hopper), the logits and the Gram path: float64's."""
    cluster = device == "cuda" and row_step_cuda.available(torch.device(device))
    assert_passed(check_loss(("cuda", "triton", "torch") if cluster else ("triton", "torch"), device, [case]))


JSD_CASES = on_devices([
    LossCase(30, 3203, 3290, 32, FP32, True, 7, 13),
    LossCase(60, 1283, 1283, 64, BF16, False, 7, None),
], [
    LossCase(300, 32011, 32100, 256, BF16, True, 7, 128),
    LossCase(1000, 128256, 128256, 512, BF16, False, 7, None),
], describe)


@pytest.mark.parametrize("device, case", JSD_CASES)
def test_jsd_matches_float64(device, case):
    """fused_linear_jsd (forward KL, JSD, reverse KL) on the device against its naive version in float64."""
    cluster = device == "cuda" and row_step_cuda.available(torch.device(device))
    assert_passed(check_jsd(("cuda", "triton", "torch") if cluster else ("triton", "torch"), device, [case]))


@pytest.mark.gpu
@pytest.mark.parametrize("teacher_precision", [None, "fp8"])
@pytest.mark.parametrize("loss", [dict(loss="cosine"), dict(loss="jsd", beta=0.5, temperature=1.5)], ids=["cosine", "jsd"])
@pytest.mark.parametrize("grad_output", [1.0, -1.5])
def test_a_small_call_s_grad_weight_made_in_forward_matches_float64(teacher_precision, loss, grad_output, monkeypatch):
    """V = 32000, T = 1024, the bench's hidden sizes: a small call (_plan.small_call), whose last grad_weight GEMM
    runs in forward and whose backward scales grad_input and grad_weight by grad_output in one Triton launch,
    writing only where it is not 1.
    FP8: against float64 on the dequantized teacher."""
    if teacher_precision:
        fp8_or_skip("cuda", monkeypatch)
    case = LossCase(1024, 32000, 32000, 4096, BF16, False, 7, None)
    assert plan.small_call(plan.chunk_rows(None, 1024, 32000, 32000, 2), 1024, (32000, 2048), (32000, 4096))
    args = random_problem(case, "cuda")
    reference_args = list(args)
    if teacher_precision:
        reference_args[2], reference_args[3] = fp8.fp8_rounded(args[2]), fp8.fp8_rounded(args[3])
    want = float64_reference(reference_args, grad_output, **loss)
    losses = FUSED_LOSSES[loss["loss"]](*args, return_soft_hard_loss=True, teacher_precision=teacher_precision,
                                        **{key: value for key, value in loss.items() if key != "loss"})
    (losses[0] * grad_output).backward()
    got = (list(losses), [args[0].grad, args[1].grad])
    assert_passed([compare(f"small call grad_output={grad_output:g}", case.describe(), BF16, got, want)])


@pytest.mark.parametrize("device, size", on_devices([(37, 1100)], [(1000, 4099)], lambda size: "x".join(map(str, size))))
def test_fp8_quantization_is_the_formula(device, size):
    """fp8.quantize_rows on the device against the textbook formula on the CPU: the scales may differ by one ulp
    (CUDA divides by a Python number as a multiplication by its reciprocal); given the device's scales, the FP8
    codes match bit for bit. The Triton twin divides as the CPU does: its scales and codes match exactly, and
    it writes nothing outside its slice of the buffer."""
    rows, hidden = size
    values = (torch.randn(rows, hidden, device=device) * torch.logspace(-4, 4, rows, device=device)[:, None]).to(BF16)
    out = torch.empty(rows + 8, hidden + 13, dtype=fp8.FP8, device=device)
    scales = torch.empty(rows, 1, device=device)
    fp8.quantize_rows(values, out[:rows, :hidden], scales)
    host_values = values.cpu().float()
    want_scales = (host_values.abs().amax(1, keepdim=True) / fp8.FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    scale_ulps = ((scales.cpu() - want_scales).abs() / torch.finfo(torch.float32).eps / want_scales).max().item()
    want = (host_values / scales.cpu()).to(fp8.FP8)
    assert (out[:rows, :hidden].cpu().view(torch.uint8) != want.view(torch.uint8)).sum() == 0
    assert scale_ulps <= 1.0

    triton_out = torch.full_like(out.view(torch.uint8), 0x7F).view(fp8.FP8)  # poisoned: NaN codes
    triton_scales = torch.full_like(scales, float("nan"))
    quantize_rows_triton(values, triton_out[:rows, :hidden], triton_scales)
    want = (host_values / want_scales).to(fp8.FP8)
    assert (triton_out[:rows, :hidden].cpu().view(torch.uint8) != want.view(torch.uint8)).sum() == 0
    assert (triton_scales.cpu() != want_scales).sum() == 0
    assert (triton_out.view(torch.uint8)[rows:] == 0x7F).all() and (triton_out.view(torch.uint8)[:, hidden:] == 0x7F).all()


FP8_CASES = on_devices([
    LossCase(30, 3203, 3203, 32, BF16, True, 7, 13), LossCase(100, 1283, 1290, 64, BF16, True, 7, None),
    LossCase(250, 1283, 1290, 32, BF16, False, 7, None), LossCase(250, 1283, 1283, 32, BF16, False, 7, None),
], [
    LossCase(300, 32011, 32011, 256, BF16, True, 7, 128), LossCase(1000, 128256, 128320, 512, BF16, True, 7, None),
    LossCase(2500, 128256, 128320, 256, BF16, False, 7, None), LossCase(2500, 128256, 128256, 256, BF16, False, 7, None),
], describe)


@pytest.mark.parametrize("loss", [dict(loss="cosine"), dict(loss="jsd", beta=0.5, temperature=1.5)],
                         ids=["cosine", "jsd"])
@pytest.mark.parametrize("device, case", FP8_CASES)
def test_fp8_teacher_matches_float64_on_the_dequantized_teacher(device, case, loss, monkeypatch):
    """The FP8 teacher path against float64 fed the dequantized teacher: only rounding may differ."""
    fp8_or_skip(device, monkeypatch)
    args = random_problem(case, device)
    quantized = list(args)
    quantized[2], quantized[3] = fp8.fp8_rounded(args[2]), fp8.fp8_rounded(args[3])
    got = fused_run(args, chunk_size=case.chunk_size, teacher_precision="fp8", **loss)
    want = float64_reference(quantized, **loss)
    assert_passed([compare(f"{loss['loss']} fp8 teacher vs float64", case.describe(), BF16, got, want)])


@pytest.mark.parametrize("loss", [dict(loss="cosine"), dict(loss="jsd", beta=0.5, temperature=1.5)],
                         ids=["cosine", "jsd"])
@pytest.mark.parametrize("device, case", FP8_CASES)
def test_a_quantized_teacher_head_gives_the_fp8_teacher_s_numbers(device, case, loss, monkeypatch):
    """An Fp8TeacherWeight as teacher_weight: the losses and gradients of teacher_precision="fp8" on the weight it
    was made from, bit for bit (the cached copy's check adds nothing to them)."""
    fp8_or_skip(device, monkeypatch)
    args = random_problem(case, device)
    want = fused_run(args, chunk_size=case.chunk_size, teacher_precision="fp8", **loss)
    want = [t.clone() for t in want[0]], [t.clone() for t in want[1]]
    quantized = list(args)
    quantized[3] = quantize_teacher_weight(args[3])
    got = fused_run(quantized, chunk_size=case.chunk_size, **loss)
    for name, a, b in zip(("loss", "soft", "hard", "grad_input", "grad_weight", "grad_bias"), [*got[0], *got[1]],
                          [*want[0], *want[1]]):
        assert torch.equal(a, b), (name, case.describe(), rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("loss", [dict(loss="cosine", cosine_via="logits"), dict(loss="jsd", beta=0.5, temperature=1.5)],
                         ids=["cosine", "jsd"])
@pytest.mark.parametrize("teacher_precision", [None, "fp8"])
@pytest.mark.parametrize("chunk_size, grad", [(None, True), (1024, False)], ids=["automatic rows", "no grad, 1024 rows"])
def test_row_steps_beside_the_teacher_gemms_give_the_bits_of_one_stream(loss, teacher_precision, chunk_size, grad,
                                                                         monkeypatch):
    """The row steps on a second stream beside the teacher GEMMs (forced, for both losses) against the same call
    with everything on one stream: the same kernels on the same data, so the same bits. 4500 tokens at the
    seed vocabulary: chunks of 2048, 2048 and 404 rows, teacher sub-chunks of 1024 (or, forced, 1024 and 1024)."""
    if teacher_precision:
        fp8_or_skip("cuda", monkeypatch)
    case = LossCase(4500, 128256, 128256, 512, BF16, True, 7, chunk_size)
    args = random_problem(case, "cuda")
    name, options = loss["loss"], dict(loss, chunk_size=chunk_size, teacher_precision=teacher_precision)
    del options["loss"]
    for index in (0, 1, 5):
        args[index].requires_grad_(grad)
    sides = []
    side_stream = plan.SideStream
    monkeypatch.setattr(plan, "SideStream", lambda device: sides.append(side_stream(device)) or sides[-1])

    def run():
        if grad:
            return fused_run(args, loss=name, **options)
        with torch.no_grad():
            return FUSED_LOSSES[name](*args, return_soft_hard_loss=True, **options), []

    monkeypatch.setattr(plan, "row_step_beside_gemms", lambda *a: True)
    beside = run()
    monkeypatch.setattr(plan, "row_step_beside_gemms", lambda *a: False)
    plan._plans.clear()  # a new plan, which the patch decides: the call's signature is the first's
    alone = run()
    assert len(sides) == 1
    for got, want in zip([*beside[0], *beside[1]], [*alone[0], *alone[1]]):
        assert torch.isfinite(got).all() and torch.equal(got, want), (got - want).abs().max()


METRICS_CASES = {"cpu": LossCase(250, 1283, 1283, 64, BF16, True, 7, 96),
                 "cuda": LossCase(4500, 128256, 128256, 512, BF16, True, 7, None)}  # chunks 2048, 2048, 404


@pytest.mark.parametrize("device, loss", on_devices(["cosine", "jsd"], ["cosine", "jsd"]))
@pytest.mark.parametrize("teacher_precision", [None, "fp8"])
def test_student_metrics_read_each_chunk_before_its_row_step_overwrites_it(device, loss, teacher_precision,
                                                                           monkeypatch):
    """The student's entropy and top-1 hits of a call whose row steps run beside the teacher GEMMs on a second
    stream (forced on a GPU, for both losses), against the spec on the whole bf16 logits. The chunks' GEMMs may round a
    logit otherwise than one GEMM over all rows, hence the tolerance; metrics of a chunk already turned into its
    gradient (entries ~1e-5: entropy ~log V) would be off by whole nats and hit ~1 / V of the labels."""
    fp8_or_skip(device, monkeypatch)
    case = METRICS_CASES[device]
    args = random_problem(case, device)
    if device == "cuda":
        monkeypatch.setattr(plan, "row_step_beside_gemms", lambda *a: True)
    logits = torch.nn.functional.linear(args[0].detach(), args[1].detach(), args[5].detach())
    labels = args[4]
    hits = torch.arange(len(labels), device=device) % 2 == 1
    labels[hits & (labels != -100)] = logits.argmax(1)[hits & (labels != -100)]  # half the labels the top logit
    metrics = StudentMetrics(temperature=1.3)
    fused_run(args, loss=loss, teacher_precision=teacher_precision, chunk_size=case.chunk_size, temperature=2.0,
              student_metrics=metrics)
    want = torch.empty(len(labels), 2, device=device)
    student_metrics_torch(logits, labels, RowStepConstants(0.5, 0.5, 0.5, 2.0, -100), 1.3, want)
    valid = labels != -100
    assert (metrics.entropy[~valid] == 0).all() and not metrics.top1[~valid].any()
    torch.testing.assert_close(metrics.entropy, want[:, 0], rtol=0, atol=2e-2)
    agree = (metrics.top1 == (want[:, 1] != 0))[valid].float().mean().item()
    assert agree > 0.99 and want[valid, 1].mean().item() > 0.4, agree


ZERO_HEAD_CASES = {"cpu": LossCase(250, 1283, 1283, 64, FP16, True, 7, 64),
                   "cuda": LossCase(2500, 128256, 128256, 512, FP16, True, 7, None)}  # chunks 2048 + 452


@pytest.mark.parametrize("device, impl", on_devices(["triton", "torch"], ["triton", "torch"]))
def test_fp16_with_a_zero_student_head_matches_float64(device, impl):
    """A zero (zero-initialised) student head: every row's d loss / d logits (~1e7) is past fp16's range and is
    scaled down, its grad_weight and grad_bias terms taken in fp32. N = 2^32 (num_valid_tokens) so that the
    exact gradients fit fp16."""
    case = ZERO_HEAD_CASES[device]
    args = random_problem(case, device)
    with torch.no_grad():
        args[1].zero_()
        args[5].zero_()
    options = dict(num_valid_tokens=2**32)
    got = fused_run(args, impl=impl, chunk_size=case.chunk_size, **options)
    assert_passed([compare(f"loss {impl} vs float64, fp16 zero student head", case.describe(), FP16, got,
                           float64_reference(args, **options))])


@pytest.mark.gpu
@pytest.mark.parametrize("loss, teacher_precision", [("cosine", None), ("jsd", None), ("jsd", "fp8")])
def test_the_loss_on_a_second_gpu_while_the_first_is_current(loss, teacher_precision, monkeypatch):
    """impl="auto" on cuda:1 in a process whose current device is cuda:0: the cluster kernels (the JSD's first
    taking the FP8 copy's hash along) are compiled for and launched on the tensors' device and stream, twice (the
    second call reuses the plan and the cached copy)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    if teacher_precision:
        fp8_or_skip("cuda:1", monkeypatch)
    case = LossCase(2500, 128256, 128256, 256, BF16, False, 7, None)
    args = random_problem(case, "cuda:1")
    options = dict(loss=loss) if loss == "cosine" else dict(loss=loss, beta=0.5, temperature=1.5)
    reference_args = list(args)
    if teacher_precision:
        reference_args[2], reference_args[3] = fp8.fp8_rounded(args[2]), fp8.fp8_rounded(args[3])
    want = float64_reference(reference_args, **options)
    torch.cuda.set_device(0)
    for call in ("first", "second"):
        got = fused_run(args, teacher_precision=teacher_precision, **options)
        assert_passed([compare(f"{loss} {teacher_precision or 'bf16'} teacher on cuda:1, cuda:0 current, {call} call, "
                               "vs float64", case.describe(), BF16, got, want)])


@pytest.mark.parametrize("device, sizes", on_devices([dict(vocab=97, hidden_teacher=12, tokens=120)],
                                                     [dict(vocab=32000, hidden_teacher=512, tokens=2048)],
                                                     lambda sizes: f"V={sizes['vocab']}"))
def test_the_teacher_caches_never_give_a_stale_number(device, sizes):
    """Every mutation of TEACHER_MUTATIONS: the fresh copy's answer, or the error (on a GPU: NaN for the changed
    call, then the error)."""
    assert_passed(check_teacher_caches(device, **sizes))


SLEEP_CYCLES = 2_000_000_000  # about a second of one GPU thread: longer than the host takes to queue a call


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_a_copy_built_on_one_stream_is_read_on_another_only_after_its_build(loss, monkeypatch):
    """The FP8 copy built on one stream behind a long kernel, as by another thread's call that has not reached its
    first host read, then a call on a second stream: that call waits for the build, without which it would read
    the copy's memory, and its hash's, unwritten."""
    fp8_or_skip("cuda", monkeypatch)
    case = LossCase(2048, 32000, 32000, 512, BF16, False, 7, None)
    args = random_problem(case, "cuda")
    options = dict(loss=loss) if loss == "cosine" else dict(loss=loss, beta=0.5, temperature=1.5)
    reference_args = list(args)
    reference_args[2], reference_args[3] = fp8.fp8_rounded(args[2]), fp8.fp8_rounded(args[3])
    want = float64_reference(reference_args, **options)
    warm_up = list(args)
    warm_up[3] = args[3].clone()
    for _ in ("build", "reuse"):  # every kernel compiled and loaded, so that no compile hides the race below
        fused_run(warm_up, teacher_precision="fp8", **options)
    torch.cuda.synchronize()
    builder, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(builder):
        torch.cuda._sleep(SLEEP_CYCLES)
        fp8.quantized_weights.get(args[3], backend_for("auto", args[3].device))
    assert not builder.query()  # the premise: the build is still to run when the other stream's call starts
    with torch.cuda.stream(reader):
        got = fused_run(args, teacher_precision="fp8", **options)
    torch.cuda.synchronize()
    assert_passed([compare(f"{loss} FP8 teacher, its copy built on another stream", case.describe(), BF16, got, want)])


@pytest.mark.gpu
def test_a_cached_value_let_go_while_another_stream_reads_it_keeps_its_memory():
    """A value reused on a second stream, then let go by the cache while that stream is still to read it: the
    allocator must not hand its memory to the building stream before the read (the reuse marks it as used by the
    reader). Without a reader, the same block goes straight back to the building stream's next allocation."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached block but those this test frees
    weights = weight_cache.WeightCache("test copy", lambda weight: weight * 2)
    weight = torch.randn((1 << 22) + 1, device="cuda")
    backend = backend_for("auto", weight.device)
    address = weights.get(weight, backend).value.data_ptr()
    weights.entries.clear()
    assert torch.empty_like(weight).data_ptr() == address  # the premise: a block let go is taken at once

    address = weights.get(weight, backend).value.data_ptr()
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        reused = weights.get(weight, backend)
        torch.cuda._sleep(SLEEP_CYCLES)
        read = reused.value.sum()
    del reused
    weights.entries.clear()
    overwrite = torch.full_like(weight, 7.0)
    assert overwrite.data_ptr() != address
    torch.cuda.synchronize()
    assert read.item() == pytest.approx((weight * 2).sum().item(), rel=1e-5)


@pytest.mark.parametrize("device, shape", on_devices([(300, 48)], [(128256, 4096)], lambda shape: "x".join(map(str, shape))))
def test_the_fingerprint_kernel_is_the_spec_and_sees_one_changed_element(device, shape):
    head = torch.randn(shape, device=device, dtype=BF16)
    before = fingerprint_triton(head)
    assert torch.equal(before, fingerprint_torch(head))
    row, column = shape[0] * 3 // 5, shape[1] * 3 // 10
    head[row, column] = -head[row, column] - 1.0
    after = fingerprint_triton(head)
    assert torch.equal(after, fingerprint_torch(head)) and not torch.equal(before, after)


STUDENT_CASES = {"cpu": LossCase(300, 320, 320, 32, BF16, False, 7, 128),
                 "cuda": LossCase(3000, 32000, 32000, 512, BF16, False, 7, 1024)}


@pytest.mark.parametrize("device, changed", on_devices(["student_input", "student_weight"],
                                                       ["student_input", "student_weight"]))
def test_a_student_changed_in_place_before_backward_raises(device, changed):
    args = random_problem(STUDENT_CASES[device], device)
    index = ("student_input", "student_weight").index(changed)
    loss = fused_linear_cosine_distill(*args)
    with torch.no_grad():
        args[index].mul_(3.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_uint8_labels_that_cannot_hold_ignore_index_raise(device):
    args = random_problem(STUDENT_CASES[device], device)
    with pytest.raises(TypeError, match="cannot hold"):
        fused_linear_cosine_distill(*args[:4], args[4].clamp(min=0, max=255).to(torch.uint8))


class OneRankSplit:
    """The vocabulary split's protocol over one rank and no process group: its collectives are the tensor itself."""

    def __init__(self, vocab):
        self.start, self.stop, self.vocab_student, self.vocab_teacher = 0, vocab, vocab, vocab

    def all_gather(self, tensor):
        return tensor[None]

    def all_reduce(self, tensor):
        pass


STALE_SPLIT_CASES = {"cpu": LossCase(120, 97, 97, 16, FP32, False, 7, 64),
                     "cuda": LossCase(3000, 32011, 32011, 512, BF16, False, 7, None)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_under_a_vocabulary_split_a_stale_fp8_copy_raises_in_its_call(device, loss, monkeypatch):
    """Under a split the cached copy's comparison rides on the split's hash check, which every rank reads where the
    call waits for its label count: the call that finds the copy stale raises (an unsplit call on a GPU returns NaN
    and the next call raises); the next call rebuilds the copy and gives the numbers of a head quantized afresh."""
    fp8_or_skip(device, monkeypatch)
    case = STALE_SPLIT_CASES[device]
    args = list(random_problem(case, device))
    split, weight = OneRankSplit(case.vocab_teacher), args[3]
    options = dict(loss=loss, chunk_size=case.chunk_size, vocab_parallel=split)
    first = fused_run(args, teacher_precision="fp8", **options)
    assert all(torch.isfinite(value).all() for value in first[0])
    weight.data[5] += 1.0  # through .data: no version counter moves
    with pytest.raises(StaleWeightError, match="this call found that copy stale"):
        fused_run(args, teacher_precision="fp8", **options)
    rebuilt = fused_run(args, teacher_precision="fp8", **options)
    fresh = fused_run(args[:3] + [quantize_teacher_weight(weight)] + args[4:], **options)
    for got, want in zip(rebuilt[0] + rebuilt[1], fresh[0] + fresh[1]):
        assert torch.equal(got, want)


HUGE_LOGITS_CASES = {"cpu": LossCase(256, 300, 300, 16, BF16, False, 7, None),
                     "cuda": LossCase(4096, 32000, 32000, 512, BF16, False, 7, None)}


def cosines_far_from_0(args):
    """The teacher's first half of features made the student's, so that the cosines are far from 0."""
    hidden = args[0].shape[1]
    args[2][:, :hidden], args[3][:, :hidden] = args[0].detach(), args[1].detach()


def scaled_student_head(args, factor):
    args[1] = (args[1].detach().float() * factor).to(args[1].dtype).requires_grad_()


def scaled_teacher_head(args, factor):
    args[3] = (args[3].float() * factor).to(args[3].dtype)


def fast_row_step_or_skip(device, impl):
    if impl == "cuda" and not (device == "cuda" and row_step_cuda.available(torch.device(device))):
        pytest.skip("the cluster kernel runs on Hopper only")


@pytest.mark.parametrize("device", DEVICES)
def test_auto_on_huge_student_logits_gives_the_logits_path_s_finite_answer(device):
    """Student logits ~1e37: the Gram path's products would overflow, so "auto" runs the call on the logits path."""
    case = HUGE_LOGITS_CASES[device]
    args = random_problem(case, device)
    scaled_student_head(args, 1e36)
    got = fused_run(args)
    want = fused_run(args, cosine_via="logits")
    assert all(torch.isfinite(part).all() for part in got[0])
    assert_passed([compare("huge student logits: auto vs logits path", case.describe(), FP32, got, want)])


@pytest.mark.parametrize("device, impl", on_devices(["triton"], ["cuda", "triton"]))  # CUDA's step: Hopper alone
def test_cosine_student_logits_whose_squares_over_t2_pass_fp32s_range(device, impl):
    """Student logits ~1e16 at T = 1e-3: |s|^2 fits fp32, |s|^2 / T^2 does not, which the fast row steps' norms
    overflowed (a cosine of 0). Each row step gives the torch spec's numbers."""
    fast_row_step_or_skip(device, impl)
    case = HUGE_LOGITS_CASES[device]
    args = random_problem(case, device)
    cosines_far_from_0(args)
    scaled_student_head(args, 1e16)
    got = fused_run(args, impl=impl, temperature=1e-3, cosine_via="logits")
    want = fused_run(args, impl="torch", temperature=1e-3, cosine_via="logits")
    assert_passed([compare(f"student logits ~1e16 at T = 1e-3: {impl} vs torch", case.describe(), BF16, got, want)])


@pytest.mark.parametrize("device, impl", on_devices(["triton"], ["cuda", "triton"]))  # CUDA's step: Hopper alone
def test_cosine_student_logits_past_the_cluster_kernels_exponent(device, impl):
    """Student logits ~1e7: the cluster kernel's exponent, one FFMA of s log2e less max log2e, rounds max log2e by
    up to half a nat there, so it hands such rows to the Triton rescue. Each row step gives the torch spec's numbers."""
    fast_row_step_or_skip(device, impl)
    case = HUGE_LOGITS_CASES[device]
    args = random_problem(case, device)
    cosines_far_from_0(args)
    scaled_student_head(args, 1e7)
    got = fused_run(args, impl=impl, cosine_via="logits")
    want = fused_run(args, impl="torch", cosine_via="logits")
    assert_passed([compare(f"student logits ~1e7: {impl} vs torch", case.describe(), BF16, got, want)])


@pytest.mark.parametrize("device", DEVICES)
def test_the_gram_path_on_student_logits_past_the_cluster_kernels_exponent(device):
    """The Gram path has no rescue: where its cluster kernel runs, student logits ~1e7 give NaN, never a wrong
    number; where Triton's step runs, the torch spec's numbers."""
    case = HUGE_LOGITS_CASES[device]
    args = random_problem(case, device)
    cosines_far_from_0(args)
    scaled_student_head(args, 1e7)
    got = fused_run(args, cosine_via="gram")
    if device == "cuda" and row_step_cuda.available(torch.device(device)):
        assert all(torch.isnan(part).all() for part in got[0])
    else:
        want = fused_run(args, impl="torch", cosine_via="gram")
        assert_passed([compare("gram, student logits ~1e7: vs torch", case.describe(), BF16, got, want)])


@pytest.mark.parametrize("device, impl", on_devices(["triton"], ["cuda", "triton"]))  # CUDA's step: Hopper alone
def test_cosine_tokens_of_zeros_at_a_tiny_temperature(device, impl):
    """At T = 1e-13 a token of zeros has a coefficient of t, 1 / (1e-8 T)^2, past fp32's range, which must not
    meet t = 0 (inf times 0). Each row step gives the torch spec's numbers."""
    fast_row_step_or_skip(device, impl)
    case = HUGE_LOGITS_CASES[device]
    args = random_problem(case, device)
    with torch.no_grad():
        args[0][2] = 0.0  # the student's logits, all zero
        args[2][5] = 0.0  # the teacher's
        args[0][3], args[2][3] = 0.0, 0.0  # both (a token not ignored: every 7th is)
    got = fused_run(args, impl=impl, temperature=1e-13, cosine_via="logits")
    want = fused_run(args, impl="torch", temperature=1e-13, cosine_via="logits")
    assert_passed([compare(f"tokens of zeros at T = 1e-13: {impl} vs torch", case.describe(), BF16, got, want)])


@pytest.mark.parametrize("device, impl", on_devices(["triton"], ["cuda", "triton"]))  # CUDA's step: Hopper alone
@pytest.mark.parametrize(("side", "size"), [("student", 1e-23), ("student", 1e-24), ("teacher", 1e-24)])
def test_cosine_logits_whose_squares_are_subnormal(device, impl, side, size):
    """Logits ~1e-23 (their squares keep few bits in fp32) or ~1e-24 (none: a plain sum of 0) at T = 1e-18, where
    the norms' clamp does not hide them: the fast row steps take such rows with unit-scaled sums. The losses only:
    the student's gradient coefficient, ~1 / |s|^2, passes fp32's range at such student logits (docs/design.md)."""
    fast_row_step_or_skip(device, impl)
    case = HUGE_LOGITS_CASES[device]
    args = random_problem(case, device)
    cosines_far_from_0(args)
    (scaled_student_head if side == "student" else scaled_teacher_head)(args, size)
    got = fused_run(args, impl=impl, temperature=1e-18, cosine_via="logits")
    want = fused_run(args, impl="torch", temperature=1e-18, cosine_via="logits")
    assert_passed([compare(f"{side} logits ~{size:g} at T = 1e-18: {impl} vs torch", case.describe(), BF16,
                           (got[0], []), (want[0], []))])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("side", ["student", "teacher"])
def test_the_gram_path_on_logits_whose_squares_are_subnormal(device, side):
    """Logits ~1e-24 at T = 1: the norms' clamp hides them, so the Gram path's plain sums and products serve
    (its cluster kernel, which has no rescue, must not refuse such rows). The torch spec's numbers."""
    case = HUGE_LOGITS_CASES[device]
    args = random_problem(case, device)
    (scaled_student_head if side == "student" else scaled_teacher_head)(args, 1e-24)
    got = fused_run(args, cosine_via="gram")
    want = fused_run(args, impl="torch", cosine_via="gram")
    assert_passed([compare(f"gram, {side} logits ~1e-24: vs torch", case.describe(), BF16, got, want)])


SEED_VOCAB, SEED_HIDDEN = {"cpu": (1283, 128), "cuda": (128256, 4096)}, {"cpu": 128, "cuda": 4096}
SEED_CHUNKS = {"cpu": {"auto": None, "small": 64, "large": 128}, "cuda": {"auto": None, "small": 1024, "large": 2048}}


@pytest.fixture(scope="module")
def seed_problem(request):
    """The seed workload's inputs (on the CPU, a small one) and their float64 losses and gradients."""
    device = request.param
    tokens = request.config.getoption("seed_tokens") if device == "cuda" else 512
    vocab, hidden = SEED_VOCAB[device][0], SEED_HIDDEN[device]
    torch.manual_seed(0)
    args = random_problem(LossCase(tokens, vocab, vocab, hidden, BF16, bias=False, ignore_every=0, chunk_size=None),
                          device)
    return args, float64_reference(args)


@pytest.mark.parametrize("seed_problem", DEVICES, indirect=True)
@pytest.mark.parametrize("accum_dtype", [BF16, FP32], ids=["bf16 accumulator", "fp32 accumulator"])
@pytest.mark.parametrize("chunk", ["auto", "small", "large"])
def test_grad_weight_accumulator_at_the_seed_workload(seed_problem, accum_dtype, chunk, record_property):
    """Each accumulator dtype and chunk size: the losses and gradients within check's tolerances of float64,
    grad_weight's widened by what its accumulator adds per chunk (accumulation_floor); the peak memory above
    the inputs is printed and recorded, to pick the default accum_dtype by."""
    args, (ref_losses, ref_grads) = seed_problem
    device = args[0].device
    tokens, vocab = args[4].numel(), args[1].shape[0]
    chunk_size = SEED_CHUNKS[device.type][chunk]
    fused_run(args, accum_dtype=accum_dtype, chunk_size=chunk_size)  # warm-up
    args[0].grad = args[1].grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    losses, grads = fused_run(args, accum_dtype=accum_dtype, chunk_size=chunk_size)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = round((torch.cuda.max_memory_allocated() - base) / 1e9, 3)
        record_property("peak_gb_above_inputs", peak)
        print(f"T={tokens} accum_dtype={accum_dtype} chunk_size={chunk_size}: {peak} GB above the inputs")
    errors = dict(loss=rel_err(losses[0], ref_losses[0]), grad_input=rel_err(grads[0], ref_grads[0]),
                  grad_weight=rel_err(grads[1], ref_grads[1]))
    record_property("errors", errors)
    loss_tolerance, grad_tolerance = LOSS_TOLERANCE[BF16]
    accumulation = accumulation_floor(BF16, accum_dtype, chunk_size, tokens, vocab, vocab)
    assert errors["loss"] < loss_tolerance and errors["grad_input"] < grad_tolerance, errors
    assert errors["grad_weight"] < grad_tolerance + accumulation, (errors, accumulation)


AUTOCAST_CASES = {"cpu": LossCase(200, 301, 301, 32, FP32, False, 7, 64),
                  "cuda": LossCase(4096, 32000, 32000, 1024, FP32, False, 7, None)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [dict(loss="cosine", cosine_via="gram"), dict(loss="cosine", cosine_via="logits"),
                                     dict(loss="jsd", beta=0.3, temperature=1.5)], ids=["gram", "logits", "jsd"])
def test_autocast_changes_no_bit(device, options):
    """fp32 heads under torch.autocast give autocast's absence's bits: the Gram path's fp32 products ran in bf16
    under it, and the W_t^T W_t built so served later calls (here the first call builds it, the second reads it)."""
    case = AUTOCAST_CASES[device]
    args = random_problem(case, device)
    with torch.autocast(device, dtype=BF16):
        cast = fused_run(args, **options)
    plain = fused_run(args, **options)
    args[3] = args[3].detach().clone()  # a weight no cache has seen
    fresh = fused_run(args, **options)
    for got, again, want in zip(cast[0] + cast[1], plain[0] + plain[1], fresh[0] + fresh[1]):
        assert torch.equal(got, want) and torch.equal(again, want)
