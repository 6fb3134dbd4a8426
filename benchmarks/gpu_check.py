"""Correctness on a CUDA GPU before any timing is trusted.

1. The Triton row step against the torch row step (the spec) at odd and LLM-sized vocabularies, poisoned outputs.
2. The whole loss (impl="cuda", "triton" and "torch") against the float64 naive reference at a few odd shapes.
3. The FP8 teacher path against float64 fed the dequantized teacher; fp16 with a zero student head; with
   two GPUs, the loss on the second while the first is current.
4. At the seed workload (V = 128256, H = 4096, student H/2, bf16, T = 8192 by default): the error of
   losses and gradients against float64 for each grad_weight accumulator dtype, and the peak memory
   above the inputs, to pick the default accum_dtype.

1 and 2 are ``cosdistill check``'s checks (``cosdistill.selfcheck``) at larger sizes.

    PYTHONPATH=src python benchmarks/gpu_check.py [--seed-tokens 8192] [--json out.json]
"""

import argparse
import json
from dataclasses import asdict

import torch

from cosdistill import _teacher_fp8 as fp8
from cosdistill.kernels import row_step_cuda
from cosdistill.kernels.fp8_quantize import quantize_rows_triton
from cosdistill.testing import float64_reference, rel_err
from cosdistill.tools.check import (
    CheckResult,
    LossCase,
    RowStepCase,
    check_loss,
    check_row_step,
    check_teacher_caches,
    compare,
    fused_run,
    random_problem,
    results_table,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ROW_STEP_CASES = [
    RowStepCase(37, 128256, 128256, BF16), RowStepCase(37, 128256, 128320, BF16), RowStepCase(5, 32001, 32001, FP32),
    RowStepCase(9, 151936, 152064, FP16), RowStepCase(3, 1, 1, FP32), RowStepCase(3, 1, 2, FP32),
    RowStepCase(3, 2, 2, FP32), RowStepCase(4, 2, 3, FP32), RowStepCase(4, 17, 17, BF16), RowStepCase(4, 1000, 1000, FP32),
    RowStepCase(37, 128256, 128320, BF16, softcap=30.0), RowStepCase(5, 32001, 32001, FP32, softcap=5.0, logit_scale=0.5),
    RowStepCase(9, 50000, 128256, BF16),  # split in two: the upper half holds no student columns
    RowStepCase(9, 262144, 262144, BF16), RowStepCase(11, 32000, 32000, BF16), RowStepCase(5, 8, 8, BF16),  # CUDA
]
LOSS_CASES = [
    LossCase(300, 32011, 32011, 256, FP32, True, 7, 128),
    LossCase(300, 32011, 32100, 256, BF16, False, 7, 100),
    LossCase(1000, 128256, 128256, 512, BF16, False, 7, None),
    LossCase(257, 5003, 5003, 128, FP16, True, 7, 64),
    LossCase(1000, 128256, 128256, 512, FP16, True, 7, None),  # fp16 at an LLM vocabulary: the lifted gradients
    LossCase(300, 32011, 32100, 256, BF16, True, 7, 128, softcap=10.0),
    LossCase(2500, 128256, 128256, 256, BF16, False, 7, None),  # automatic rows: chunks 2048 + 452, teacher 1024
]
FP8_CASES = [LossCase(300, 32011, 32011, 256, BF16, True, 7, 128), LossCase(1000, 128256, 128320, 512, BF16, True, 7, None),
             LossCase(2500, 128256, 128320, 256, BF16, False, 7, None), LossCase(2500, 128256, 128256, 256, BF16, False, 7, None)]


GRAM_ROW_STEP_CASES = [RowStepCase(37, 128256, 128256, BF16), RowStepCase(9, 262144, 262144, BF16),
                       RowStepCase(11, 32000, 32000, BF16), RowStepCase(5, 8, 8, BF16), RowStepCase(7, 151936, 151936, BF16)]


def check_gram_row_step():
    """The one-model cluster kernel (row_step_cuda.gram_row_step_cuda, the Gram path's row step) against the
    torch spec's two stages with teacher_logits None: losses, gradient and each row's coefficient of t,
    every output poisoned first; a quarter of the rows ignored, one row whose products overflow."""
    from cosdistill._row_step import TORCH_ROW_STEP, RowStepScales, teacher_grad_coefficient, with_teacher_products
    from cosdistill.tools.check import POISON

    scales = RowStepScales(weight_hard=0.37, weight_soft=0.81, beta=0.6, temperature=1.7, ignore_index=-100)
    results = []
    for case in GRAM_ROW_STEP_CASES:
        student = (torch.randn(case.rows, case.vocab_student, device="cuda") * 3).to(BF16)
        labels = torch.randint(0, case.vocab_student, (case.rows,), device="cuda")
        labels[::4] = -100
        norms = student.float().norm(dim=1)
        sum_sq_teacher = (torch.rand(case.rows, device="cuda") + 0.5) * norms**2
        dot = (torch.rand(case.rows, device="cuda") * 2 - 1) * norms * sum_sq_teacher.sqrt()
        dot[1], sum_sq_teacher[1] = float("inf"), float("inf")  # row 1 (not ignored): NaN loss and gradient
        want_grad, want_losses = student.clone(), torch.full((case.rows, 2), POISON, device="cuda")
        stats = with_teacher_products(TORCH_ROW_STEP.stats(want_grad, None, labels, scales), dot, sum_sq_teacher, scales)
        TORCH_ROW_STEP.grad(want_grad, None, labels, stats, scales, want_losses, True)
        want_coefs = teacher_grad_coefficient(stats, labels, case.vocab_student, scales)
        got_grad, got_losses = student.clone(), torch.full((case.rows, 2), POISON, device="cuda")
        got_coefs = torch.full((case.rows,), float("nan"), device="cuda")
        ran = row_step_cuda.gram_row_step_cuda(got_grad, labels, scales, got_losses, torch.stack((dot, sum_sq_teacher), 1),
                                               got_coefs)
        finite = torch.ones(case.rows, dtype=torch.bool, device="cuda")
        finite[1] = False
        errors = dict(
            losses=rel_err(got_losses[finite], want_losses[finite]), grad=rel_err(got_grad[finite], want_grad[finite]),
            coefs=rel_err(got_coefs[finite], want_coefs[finite]),
            overflow_row_nan=float(bool(got_losses[1].isnan().all() and got_grad[1].isnan().all() and got_coefs[1].isnan())),
        )
        passed = (ran and errors["losses"] < 1e-5 and errors["grad"] < 1e-2 and errors["coefs"] < 1e-5
                  and errors["overflow_row_nan"] == 1.0)
        results.append(CheckResult("row step cuda gram vs torch", case.describe(), "1e-5 / 1e-2 / 1e-5, NaN row",
                                   errors, passed))
    return results


def check_fp8():
    """The FP8 teacher path against float64 fed the dequantized teacher: only rounding may differ."""
    results = []
    for case in FP8_CASES:
        args = random_problem(case, "cuda")
        quantized = list(args)
        quantized[2], quantized[3] = fp8.dequantized(args[2]), fp8.dequantized(args[3])
        got = fused_run(args, chunk_size=case.chunk_size, teacher_precision="fp8")
        results.append(compare("loss fp8 teacher vs float64", case.describe(), BF16, got, float64_reference(quantized)))
    return results


def check_fp8_quantization():
    """fp8.quantize_rows on the GPU against the textbook formula on the CPU. The scales may differ by one
    ulp (CUDA divides by a Python number as a multiplication by its reciprocal, s6a); given the GPU's
    scales, the FP8 codes must match bit for bit."""
    rows = (torch.randn(1000, 4099, device="cuda") * torch.logspace(-4, 4, 1000, device="cuda")[:, None]).to(BF16)
    out = torch.empty(1008, 4112, dtype=fp8.FP8, device="cuda")
    scales = torch.empty(1000, 1, device="cuda")
    fp8.quantize_rows(rows, out[:1000, :4099], scales)
    host_rows = rows.cpu().float()
    want_scales = (host_rows.abs().amax(1, keepdim=True) / fp8.FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    scale_ulps = ((scales.cpu() - want_scales).abs() / torch.finfo(torch.float32).eps / want_scales).max().item()
    want = (host_rows / scales.cpu()).to(fp8.FP8)
    mismatched = (out[:1000, :4099].cpu().view(torch.uint8) != want.view(torch.uint8)).sum().item()
    errors = dict(mismatched_codes=float(mismatched), scale_max_ulps=scale_ulps)
    passed = mismatched == 0 and scale_ulps <= 1.0
    results = [CheckResult("fp8 quantize_rows vs the formula on the CPU", "1000 x 4099 bf16", "codes exact, scales 1 ulp",
                           errors, passed)]
    # the Triton twin divides as the CPU does (IEEE division): its scales and codes match exactly
    triton_out = torch.full_like(out.view(torch.uint8), 0x7F).view(fp8.FP8)  # poisoned: NaN codes
    triton_scales = torch.full_like(scales, float("nan"))
    quantize_rows_triton(rows, triton_out[:1000, :4099], triton_scales)
    want = (host_rows / want_scales).to(fp8.FP8)
    mismatched = (triton_out[:1000, :4099].cpu().view(torch.uint8) != want.view(torch.uint8)).sum().item()
    untouched = bool((triton_out.view(torch.uint8)[1000:] == 0x7F).all()
                     and (triton_out.view(torch.uint8)[:, 4099:] == 0x7F).all())
    mismatched_scales = (triton_scales.cpu() != want_scales).sum().item()
    errors = dict(mismatched_codes=float(mismatched), mismatched_scales=float(mismatched_scales),
                  margins_untouched=float(untouched))
    passed = mismatched == 0 and mismatched_scales == 0 and untouched
    results.append(CheckResult("fp8 quantize_rows_triton vs the formula on the CPU", "1000 x 4099 bf16",
                               "codes and scales exact", errors, passed))
    return results


def check_fp16_zero_head():
    """fp16 with a zero (zero-initialised) student head: every row's d loss / d logits (~1e7) is past
    fp16's range and is scaled down, its grad_weight and grad_bias terms taken in fp32 (chunked.py).
    N = 2^32 (num_valid_tokens) so that the exact gradients fit fp16. T = 2500: chunks 2048 + 452."""
    results = []
    for impl in ("triton", "torch"):
        case = LossCase(2500, 128256, 128256, 512, FP16, True, 7, None)
        args = random_problem(case, "cuda")
        with torch.no_grad():
            args[1].zero_()
            args[5].zero_()
        options = dict(num_valid_tokens=2**32)
        got = fused_run(args, impl=impl, **options)
        results.append(compare(f"loss {impl} vs float64, fp16 zero student head", case.describe(), FP16, got,
                               float64_reference(args, **options)))
    return results


def seed_accum_study(tokens):
    """Error vs float64 and peak memory above the inputs for each accum_dtype at the seed workload."""
    args = random_problem(LossCase(tokens, 128256, 128256, 4096, BF16, bias=False, ignore_every=0, chunk_size=None), "cuda")
    ref_losses, ref_grads = float64_reference(args)
    rows = []
    for accum_dtype in (torch.bfloat16, torch.float32):
        for chunk in (None, 1024, 2048):
            fused_run(args, accum_dtype=accum_dtype, chunk_size=chunk)  # warm-up
            for i in (0, 1):
                args[i].grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            losses, grads = fused_run(args, accum_dtype=accum_dtype, chunk_size=chunk)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 1e9
            row = dict(tokens=tokens, accum_dtype=str(accum_dtype), chunk_size=chunk, peak_gb_above_inputs=round(peak, 3),
                       loss_err=rel_err(losses[0], ref_losses[0]), grad_input_err=rel_err(grads[0], ref_grads[0]),
                       grad_weight_err=rel_err(grads[1], ref_grads[1]))
            print("seed accum study", row)
            rows.append(row)
    return rows


def check_second_device():
    """With two GPUs: the loss on cuda:1 while cuda:0 is current (a process that never called set_device),
    impl="auto" (the cluster kernel is launched on the tensors' device and stream) against float64."""
    if torch.cuda.device_count() < 2:
        return []
    case = LossCase(2500, 128256, 128256, 256, BF16, False, 7, None)
    args = random_problem(case, "cuda:1")
    torch.cuda.set_device(0)
    got = fused_run(args)
    return [compare("loss auto on cuda:1, cuda:0 current, vs float64", case.describe(), BF16, got, float64_reference(args))]


def check_never_silently_wrong():
    """On the GPU: the teacher caches against every mutation (selfcheck.check_teacher_caches, at an LLM
    vocabulary: NaN for the changed call, then StaleWeightError); the fingerprint kernel against its torch
    spec on a seed-sized head; the student changed in place before backward; uint8 labels; "auto" on huge
    student logits."""
    from cosdistill import fused_linear_cosine_distill
    from cosdistill._fingerprint import fingerprint_torch, fingerprint_triton

    results = check_teacher_caches("cuda", vocab=32000, hidden_teacher=512, tokens=2048)
    head = torch.randn(128256, 4096, device="cuda", dtype=BF16)
    before = fingerprint_triton(head)
    same = torch.equal(before, fingerprint_torch(head))
    head[77777, 1234] = -head[77777, 1234] - 1.0
    after = fingerprint_triton(head)
    same = same and torch.equal(after, fingerprint_torch(head))
    results.append(CheckResult("fingerprint triton vs torch", "128256 x 4096 bf16, one element changed", "bitwise",
                               {}, same and not torch.equal(before, after), "" if same else "differs from the spec"))
    del head
    args = random_problem(LossCase(3000, 32000, 32000, 512, BF16, False, 7, 1024), "cuda")
    for index, name in ((0, "student_input"), (1, "student_weight")):
        loss = fused_linear_cosine_distill(*args)
        with torch.no_grad():
            args[index].mul_(3.0)
        try:
            loss.backward()
            raised = ""
        except RuntimeError as error:
            raised = str(error).splitlines()[0]
        results.append(CheckResult(f"{name} changed in place before backward", "T=3000 V=32000 bf16", "raises",
                                   {}, "modified by an inplace operation" in raised, raised or "no error"))
        for leaf in (args[0], args[1]):
            leaf.grad = None
    try:
        fused_linear_cosine_distill(*args[:4], args[4].clamp(min=0, max=255).to(torch.uint8))
        raised = ""
    except TypeError as error:
        raised = str(error)
    results.append(CheckResult("uint8 labels", "ignore_index=-100", "raises", {}, "cannot hold" in raised,
                               raised or "no error"))
    case = LossCase(4096, 32000, 32000, 512, BF16, False, 7, None)
    args = random_problem(case, "cuda")
    args[1] = (args[1].detach().float() * 1e36).to(BF16).requires_grad_()
    got = fused_run(args)
    want = fused_run(args, cosine_via="logits")
    result = compare("huge student logits: auto vs logits path", case.describe(), FP32, got, want)
    result.passed = result.passed and all(torch.isfinite(part).all() for part in got[0])
    results.append(result)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed-tokens", type=int, default=8192)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name())
    torch.manual_seed(0)
    checks = (check_row_step("cuda", ROW_STEP_CASES) + check_gram_row_step()
              + check_loss(("cuda", "triton", "torch"), "cuda", LOSS_CASES) + check_fp8_quantization() + check_fp8()
              + check_fp16_zero_head() + check_second_device() + check_never_silently_wrong())
    print(results_table(checks), end="")
    failures = [asdict(result) for result in checks if not result.passed]
    study = seed_accum_study(args.seed_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(failures=failures, accum_study=study), f, indent=1)
    print("GPU CHECK", "FAILED" if failures else "PASSED")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
