"""The FP8 teacher path. FP8 GEMMs run on the CPU through torch's reference _scaled_mm, so the math is
tested here with the hardware check switched off; the public API refuses FP8 off FP8-capable GPUs."""

import functools

import pytest
import torch

from conftest import make_problem, reference, rel_err
from cosdistill import (
    Fp8TeacherWeight,
    FusedLinearCosineDistillLoss,
    FusedLinearJSDLoss,
    fused_linear_cosine_distill,
    fused_linear_jsd,
    quantize_teacher_weight,
)
from cosdistill.testing import (
    FUSED_LOSSES,
    TORCH,
    ChunkRows,
    LabelCounts,
    LogitsTeacher,
    chunked_loss_and_grads,
    plan,
)
from cosdistill.testing import teacher_fp8 as fp8


def test_fp8_is_refused_on_the_cpu():
    problem = make_problem()
    with pytest.raises(ValueError,
                       match="teacher_precision='fp8' needs a CUDA GPU with FP8 tensor cores; the tensors are on cpu"):
        fused_linear_cosine_distill(*problem.args(), teacher_precision="fp8")
    with pytest.raises(ValueError, match="teacher_precision must be None or 'fp8'"):
        fused_linear_cosine_distill(*problem.args(), teacher_precision="int4")


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("vocab_teacher, hidden_teacher", [(101, 24), (128, 32), (131, 40)])
def test_fp8_teacher_equals_the_reference_on_the_quantized_teacher(impl, monkeypatch, loss, vocab_teacher,
                                                                   hidden_teacher):
    """Exact up to fp32 rounding once the reference sees the teacher's e4m3-rounded rows (odd shapes get padded:
    the padded rows' zero logits must not reach the JSD's softmax)."""
    monkeypatch.setattr(fp8, "check_supported", lambda *args: None)
    problem = make_problem(tokens=37, vocab_student=101, vocab_teacher=vocab_teacher, hidden_teacher=hidden_teacher,
                           ignore_every=5)
    losses = FUSED_LOSSES[loss](*problem.args(), return_soft_hard_loss=True, teacher_precision="fp8", impl=impl,
                                chunk_size=10)
    losses[0].backward()
    quantized = make_problem(tokens=37, vocab_student=101, vocab_teacher=vocab_teacher, hidden_teacher=hidden_teacher)
    quantized.__dict__.update(problem.__dict__)
    quantized.teacher_input = fp8.fp8_rounded(problem.teacher_input)
    quantized.teacher_weight = fp8.fp8_rounded(problem.teacher_weight)
    ref_losses, ref_grads = reference(quantized, loss=loss)
    for got, want in zip(losses, ref_losses):
        assert rel_err(got, want) < 1e-5
    for leaf, want in zip(problem.student_leaves(), ref_grads):
        assert rel_err(leaf.grad, want) < 1e-5
    # and the FP8 teacher really was quantized: against the unquantized teacher the gradient moves
    # far more than rounding (which the comparison above bounds), yet stays close
    unquantized_grad_weight = reference(problem, loss=loss)[1][1]
    quantized_err = rel_err(problem.student_weight.grad, ref_grads[1])
    assert 100 * quantized_err < rel_err(problem.student_weight.grad, unquantized_grad_weight) < 0.2


def test_quantized_weight_is_cached_until_the_weight_changes():
    weight = torch.randn(50, 32)
    first = fp8.quantized_weights.get(weight, TORCH).value
    assert fp8.quantized_weights.get(weight, TORCH).value[0] is first[0]
    with torch.no_grad():
        weight.mul_(2.0)
    second = fp8.quantized_weights.get(weight, TORCH).value
    assert second[0] is not first[0]
    torch.testing.assert_close(second[1][:, :50], 2 * first[1][:, :50])
    assert second[0].shape == (64, 32) and torch.count_nonzero(second[0][50:].float()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_rows_is_the_rounded_division_by_the_row_scale(dtype):
    """Bit for bit the textbook formula, into a slice of a larger buffer whose other entries it leaves alone."""
    rows = (torch.randn(37, 40) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    rows[5] = 0.0  # scale clamped to the smallest normal: zeros stay zeros
    buffer = torch.full((48, 48), float("nan")).to(fp8.FP8)
    scales = torch.full((37, 1), float("nan"))
    fp8.quantize_rows(rows, buffer[:37, :40], scales)
    want_scales = (rows.float().abs().amax(1, keepdim=True) / fp8.FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    assert torch.equal(scales, want_scales)
    want = (rows.float() / want_scales).to(fp8.FP8)
    assert torch.equal(buffer[:37, :40].view(torch.uint8), want.view(torch.uint8))
    assert buffer[:37, :40].float().abs().amax(1).eq(fp8.FP8_MAX).sum() == 36  # each nonzero row reaches the top code
    assert buffer[37:].float().isnan().all() and buffer[:, 40:].float().isnan().all()


@pytest.mark.parametrize("hidden_teacher", [24, 32])
def test_fp8_sub_chunks_read_their_own_rows_of_the_quantized_chunk(hidden_teacher, monkeypatch):
    """Each chunk is quantized at once and its teacher GEMMs read sub-chunks of it from an offset, each
    rounded up to 16 rows: sub-chunks of 7 rows in chunks of 19, after NaN rows poisoned the whole buffer
    (the rows a GEMM reads past its sub-chunk must never reach the loss or the gradients). Every new
    floating buffer starts as NaN too (the FP8 codes' padded columns must be zeroed)."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    problem = make_problem(tokens=37, vocab_student=101, vocab_teacher=131, hidden_teacher=hidden_teacher,
                           ignore_every=6)
    head = fp8.Fp8TeacherHead(problem.teacher_weight, problem.teacher_bias.detach(), 19, TORCH)
    head.start_chunk(torch.full((head.code_rows, hidden_teacher), float("nan")))  # the whole buffer
    labels = problem.labels
    teacher = LogitsTeacher(head, TORCH.cosine_row_step.step, plan.Options().constants, ChunkRows(19, 7))
    result = chunked_loss_and_grads(
        problem.student_input.detach(), problem.student_weight.detach(), problem.student_bias.detach(),
        problem.teacher_input, teacher, labels, LabelCounts(labels, -100, problem.student_weight.shape[0], None, TORCH,
                                                           0.5, 0.5),
        ChunkRows(19, 7), (True, True, True), torch.float32, TORCH.scale_unless_one)
    grads = result.gradients.finish()
    quantized = make_problem(tokens=37, vocab_student=101, vocab_teacher=131, hidden_teacher=hidden_teacher)
    quantized.__dict__.update(problem.__dict__)
    quantized.teacher_input = fp8.fp8_rounded(problem.teacher_input)
    quantized.teacher_weight = fp8.fp8_rounded(problem.teacher_weight)
    ref_losses, ref_grads = reference(quantized)
    for got, want in zip((result.loss, result.soft_loss, result.hard_loss), ref_losses):
        assert rel_err(got, want) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-5


def test_a_quantized_head_is_the_cached_copy_bit_for_bit():
    """quantize_teacher_weight gives the codes and scales that teacher_precision="fp8" caches, and its
    dequantized weight is the one the FP8 GEMM sees."""
    weight = torch.randn(131, 40, dtype=torch.bfloat16)
    quantized = quantize_teacher_weight(weight)
    codes, scales = fp8.quantized_weights.get(weight, TORCH).value
    assert torch.equal(quantized.codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(quantized.scales, scales)
    assert quantized.shape == (131, 40) and quantized.dtype == torch.bfloat16 and quantized.device == weight.device
    assert torch.equal(quantized.dequantized(), fp8.fp8_rounded(weight))
    moved = quantized.to("meta")
    assert moved.device.type == "meta" and moved.scales.device.type == "meta" and moved.shape == quantized.shape
    with pytest.raises(TypeError, match="takes a device, got the dtype torch.float32: its dtype is the head's"):
        quantized.to(torch.float32)  # the codes cast to float32, which its check then named as malformed codes
    assert repr(quantized) == "Fp8TeacherWeight(shape=(131, 40), dtype=torch.bfloat16, device=cpu)"
    with pytest.raises(TypeError, match=r"weight must be a 2-D .* got shape \(131,\) and dtype torch.bfloat16"):
        quantize_teacher_weight(weight[:, 0])
    with pytest.raises(TypeError, match="got shape \\(3, 4\\) and dtype torch.int64"):
        quantize_teacher_weight(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="got list"):
        quantize_teacher_weight([[1.0]])
    with pytest.raises(ValueError, match=r"codes must be torch.float8_e4m3fn of shape \(144, 48\) for shape \(131, 40\), "
                                         r"got torch.float8_e4m3fn \(144, 40\)"):
        Fp8TeacherWeight(quantized.codes[:, :40], quantized.scales, quantized.shape, quantized.dtype)
    with pytest.raises(ValueError, match=r"scales must be float32 of shape \(1, 144\) on cpu, got torch.float32 \(144, 1\)"):
        Fp8TeacherWeight(quantized.codes, quantized.scales.t(), quantized.shape, quantized.dtype)
    with pytest.raises(TypeError, match=r"a 2-D shape and a bfloat16, float16 or float32 dtype, got shape \(131,\)"):
        Fp8TeacherWeight(quantized.codes, quantized.scales, torch.Size([131]), quantized.dtype)


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("form", ["function", "module", "compiled"])
def test_a_quantized_head_gives_the_fp8_teacher_s_numbers_with_nothing_cached(monkeypatch, impl, loss, form):
    """Passed as teacher_weight, an Fp8TeacherWeight gives what teacher_precision="fp8" gives on the weight it
    was made from, bit for bit (odd shapes, padding, ignored tokens, biases, Vt > Vs, [B, L, H] inputs), through
    the function, the module and torch.compile, and puts nothing in the FP8 cache."""
    monkeypatch.setattr(fp8, "check_supported", lambda *args: None)
    problem = make_problem(tokens=36, batch=2, vocab_student=101, vocab_teacher=131, hidden_teacher=40,
                           ignore_every=5)
    function = fused_linear_jsd if loss == "jsd" else fused_linear_cosine_distill
    module_type = FusedLinearJSDLoss if loss == "jsd" else FusedLinearCosineDistillLoss

    def run(teacher_weight, teacher_precision=None):
        options = dict(chunk_size=10, return_soft_hard_loss=True, impl=impl, teacher_precision=teacher_precision)
        module = module_type(0.3, 0.7, 0.4, **options)
        call = {"function": functools.partial(function, weight_hard_loss=0.3, weight_soft_loss=0.7, beta=0.4, **options),
                "module": module, "compiled": torch.compile(module, backend="eager", fullgraph=True)}[form]
        args = list(problem.args())
        args[3] = teacher_weight
        losses = call(*args)
        losses[0].backward()
        grads = [leaf.grad for leaf in problem.student_leaves()]
        for leaf in problem.student_leaves():
            leaf.grad = None
        return losses, grads

    cached_losses, cached_grads = run(problem.teacher_weight, "fp8")
    fp8.quantized_weights.entries.clear()
    quantized = quantize_teacher_weight(problem.teacher_weight)
    for _ in range(2):  # the second call reuses the first's plan
        losses, grads = run(quantized)
        assert all(torch.equal(a, b) for a, b in zip(losses, cached_losses))
        assert all(torch.equal(a, b) for a, b in zip(grads, cached_grads))
    assert len(fp8.quantized_weights.entries) == 0
    with torch.no_grad():
        problem.teacher_weight.mul_(2.0)  # the caller's weight changed: the head it quantized before did not
    assert all(torch.equal(a, b) for a, b in zip(run(quantized)[0], cached_losses))


def test_a_quantized_head_is_checked_as_its_weight(monkeypatch):
    problem = make_problem(vocab_student=101, vocab_teacher=131, hidden_teacher=40)
    quantized = quantize_teacher_weight(problem.teacher_weight)
    args = list(problem.args())
    args[3] = quantized
    with pytest.raises(ValueError, match="a teacher_weight from quantize_teacher_weight needs a CUDA GPU with FP8 "
                                         "tensor cores; the tensors are on cpu"):
        fused_linear_jsd(*args)
    monkeypatch.setattr(fp8, "check_supported", lambda *args: None)
    assert plan._call_signature(plan.Options(), args, None, None) is not None  # its plan is kept for the next call
    with pytest.raises(TypeError, match="teacher_input dtype torch.bfloat16 differs from teacher_weight dtype torch.float32"):
        fused_linear_jsd(*args[:2], args[2].bfloat16(), *args[3:])
    with pytest.raises(ValueError, match=r"teacher_input hidden size 24 does not match teacher_weight shape \(131, 40\)"):
        fused_linear_jsd(*args[:2], args[2][:, :24], *args[3:])
    with pytest.raises(ValueError, match=r"teacher vocab must be >= student vocab: teacher_weight \(99, 40\)"):
        fused_linear_jsd(*args[:3], quantize_teacher_weight(problem.teacher_weight[:99]), *args[4:6], None)
    with pytest.raises(ValueError, match="cosine_via='gram' cannot run with .*an Fp8TeacherWeight"):
        fused_linear_cosine_distill(*args[:5], cosine_via="gram")
    with pytest.raises(TypeError, match="teacher_weight must be a torch.Tensor or a cosdistill.Fp8TeacherWeight, got tuple"):
        fused_linear_jsd(*args[:3], (quantized.codes, quantized.scales), *args[4:])
