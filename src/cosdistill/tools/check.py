"""``cosdistill check``: the correctness self-test on the present device.

* The whole loss (each row-step path) against the naive version run on float64 copies, at small odd
  shapes: fp32 and bf16, biases, Vt > Vs, ignored tokens, chunk sizes that do not divide T.
* The generalized JSD (fused_linear_jsd) against its naive version in float64, forward KL, JSD and reverse KL.
* The Triton row step against the torch row step (the spec), into poisoned outputs: the fused kernel,
  and the statistics and gradient kernels as a vocabulary split over two ranks runs them.
* The cached teacher copies (the Gram matrix, the FP8 weight) against every way of changing the teacher weight:
  each call gives a fresh copy's answer or raises, never a stale number.

The Triton paths run on CUDA, and on the CPU only under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before triton is imported, i.e. in the environment of the process.
The GPU checks (tests/gpu, ``pytest -m gpu``) reuse these functions with larger cases.
"""

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass, field

import torch

from .._row_step import RowStepConstants, RowStepImpl, combine_row_stats, row_step_torch
from ..api import FUSED_LOSSES
from ..testing import float64_reference, random_student_teacher, rel_err

POISON = 12345.0
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
LOSS_TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (5e-3, 2e-2), torch.float16: (5e-3, 2e-2)}  # (losses, grads)
ROW_STEP_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-2), torch.float16: (1e-5, 1e-2)}


@dataclass(frozen=True)
class LossCase:
    tokens: int
    vocab_student: int
    vocab_teacher: int
    hidden_teacher: int  # the student's is half
    dtype: torch.dtype
    bias: bool
    ignore_every: int  # every n-th label is ignore_index; 0: none
    chunk_size: int | None  # None: the API's automatic size
    softcap: float | None = None  # the student's logit softcap; the teacher's is 1.5 times it
    logit_scale: float = 1.0  # the student's logit scale; the teacher's is twice it
    # The loss's weights, beta (the cosine term's weight; the JSD's is JSD_BETAS'), ignore_index and a given
    # normaliser: each case other values than the defaults, so that an option dropped or swapped shows
    weights: tuple[float, float, float] = (0.5, 0.5, 0.5)  # weight_hard_loss, weight_soft_loss, beta
    ignore_index: int = -100
    num_valid_tokens: float | None = None

    def options(self, loss="cosine") -> dict:
        weight_hard, weight_soft, beta = self.weights
        options = dict(student_logit_scale=self.logit_scale, teacher_logit_scale=2 * self.logit_scale,
                       weight_hard_loss=weight_hard, weight_soft_loss=weight_soft, ignore_index=self.ignore_index,
                       num_valid_tokens=self.num_valid_tokens)
        if loss == "cosine":
            options["beta"] = beta
        if self.softcap is not None:
            options.update(student_softcap=self.softcap, teacher_softcap=1.5 * self.softcap)
        return options

    def gram_applies(self) -> bool:
        """Whether cosine_via="gram" runs this case (no bias, no softcap, not fp16)."""
        return not self.bias and self.softcap is None and self.dtype != torch.float16

    def describe(self) -> str:
        return (
            f"T={self.tokens} Vs={self.vocab_student} Vt={self.vocab_teacher} Ht={self.hidden_teacher} "
            f"{DTYPE_NAMES[self.dtype]}{' bias' if self.bias else ''} ignore 1/{self.ignore_every or '-'} "
            f"chunk={self.chunk_size or 'auto'}{f' softcap={self.softcap:g}' if self.softcap else ''}"
            f"{f' logit scale={self.logit_scale:g}' if self.logit_scale != 1 else ''}"
            f" weights={'/'.join(f'{weight:g}' for weight in self.weights)}"
            f"{f' ignore_index={self.ignore_index}' if self.ignore_index != -100 else ''}"
            f"{f' N={self.num_valid_tokens:g}' if self.num_valid_tokens is not None else ''}"
        )


@dataclass(frozen=True)
class RowStepCase:
    rows: int
    vocab_student: int
    vocab_teacher: int
    dtype: torch.dtype
    softcap: float | None = None  # the student's logit softcap; the teacher's is 1.5 times it
    logit_scale: float = 1.0  # the student's logit scale; the teacher's is twice it

    def describe(self) -> str:
        capped = f" softcap={self.softcap:g}" if self.softcap else ""
        scaled = f" logit scale={self.logit_scale:g}" if self.logit_scale != 1 else ""
        return f"rows={self.rows} Vs={self.vocab_student} Vt={self.vocab_teacher} {DTYPE_NAMES[self.dtype]}{capped}{scaled}"


LOSS_CASES = (
    LossCase(37, 101, 101, 24, torch.float32, True, 5, 16, weights=(0.3, 0.9, 0.7)),
    LossCase(37, 101, 131, 24, torch.bfloat16, False, 4, 10, weights=(0.2, 1.3, 0.6)),
    LossCase(50, 1500, 1531, 64, torch.float32, True, 7, None, weights=(0.7, 0.4, 0.8), num_valid_tokens=61.0),
    LossCase(29, 257, 300, 32, torch.bfloat16, True, 3, 8, weights=(0.4, 1.1, 0.3), ignore_index=-1),
    LossCase(33, 211, 240, 32, torch.float32, True, 4, 7, softcap=3.0, logit_scale=0.5, weights=(0.6, 0.8, 0.9)),
    LossCase(41, 1000, 1000, 32, torch.bfloat16, True, 5, 16),  # the CUDA cluster row step applies
    LossCase(31, 700, 733, 32, torch.float16, True, 4, 8, weights=(0.3, 1.2, 0.4)),  # the lifted fp16 gradients
    # the soft term alone, fp32, no bias: the Gram path at fp32's tolerance, where a hard term would hide its part
    LossCase(43, 301, 317, 32, torch.float32, False, 6, 9, weights=(0.0, 1.0, 1.0)),
)
ROW_STEP_CASES = (
    RowStepCase(5, 1, 1, torch.float32),
    RowStepCase(11, 97, 131, torch.bfloat16),
    RowStepCase(7, 300, 301, torch.float32),
    RowStepCase(5, 2500, 2600, torch.bfloat16),
    RowStepCase(6, 1000, 1100, torch.float32, softcap=4.0, logit_scale=0.5),
    RowStepCase(6, 40, 130, torch.bfloat16),  # split in two, the upper half holds no student columns
    RowStepCase(6, 2000, 2001, torch.float16),  # with the per-row lifts of fp16 gradients
    RowStepCase(9, 2504, 2504, torch.bfloat16),  # the CUDA cluster row step applies: 8 blocks per row
    RowStepCase(3, 100008, 100008, torch.bfloat16),  # 16 blocks per row
)


@dataclass
class CheckResult:
    name: str
    case: str
    tolerance: str
    errors: dict[str, float] = field(default_factory=dict)
    passed: bool = False
    failure: str = ""  # the exception a check raised, if any


def random_problem(case: LossCase, device):
    """[student_input, student_weight, teacher_input, teacher_weight, labels, student_bias, teacher_bias]."""
    labels = torch.randint(0, case.vocab_student, (case.tokens,), device=device)
    if case.ignore_every:
        labels[:: case.ignore_every] = case.ignore_index
    return random_student_teacher(labels, case.hidden_teacher // 2, case.hidden_teacher, case.vocab_student,
                                  case.vocab_teacher, case.dtype, with_student_bias=case.bias, with_teacher_bias=case.bias)


def fused_run(args, loss="cosine", **kwargs):
    """(loss, soft, hard) and the student gradients of the fused loss (``loss``: "cosine" or "jsd"); under no_grad
    the gradients are None."""
    for i in (0, 1, 5):
        if args[i] is not None:
            args[i].grad = None
    losses = FUSED_LOSSES[loss](*args, return_soft_hard_loss=True, **kwargs)
    if torch.is_grad_enabled():
        losses[0].backward()
    return list(losses), [args[i].grad for i in (0, 1, 5) if args[i] is not None]


def compare(name, case, dtype, got, want) -> CheckResult:
    """Each loss and gradient of got = (losses, grads) against want, within LOSS_TOLERANCE[dtype]."""
    tol_loss, tol_grad = LOSS_TOLERANCE[dtype]
    loss_errors = {key: rel_err(a, b) for key, a, b in zip(("loss", "soft", "hard"), got[0], want[0])}
    grad_errors = {key: rel_err(a, b) for key, a, b in zip(("grad_input", "grad_weight", "grad_bias"), got[1], want[1])}
    # all(<), not max(): max keeps an earlier finite value over a later NaN
    passed = all(error < tol_loss for error in loss_errors.values()) and all(
        error < tol_grad for error in grad_errors.values())
    return CheckResult(name, case, f"{tol_loss:g} / {tol_grad:g}", loss_errors | grad_errors, passed)


def check_loss(impls, device, cases=LOSS_CASES) -> list[CheckResult]:
    results = []
    for case in cases:
        args = random_problem(case, device)
        want = float64_reference(args, **case.options())
        # the teacher's logits GEMM, and where it applies the Gram path too (_teacher_gram.py)
        for impl, cosine_via in itertools.product(impls, ("logits", "gram") if case.gram_applies() else ("logits",)):
            name = f"loss {impl}{' gram' if cosine_via == 'gram' else ''} vs float64"
            results += run_and_compare(name, case, args, want, impl=impl, chunk_size=case.chunk_size,
                                       cosine_via=cosine_via, **case.options())
    return results


def run_and_compare(name, case: LossCase, args, want, **options) -> list[CheckResult]:
    """The call with gradients against ``want``, and the same call under no_grad (another plan: longer teacher
    sub-chunks, other kernels) against its losses; a crash is a failed check, reported in the table."""
    results = []
    for grad in (True, False):
        run_name = f"{name}{'' if grad else ', no_grad'}"
        try:
            with torch.set_grad_enabled(grad):
                losses, grads = fused_run(args, **options)
            got, expected = ((losses, grads), want) if grad else ((losses, []), (want[0], []))
            results.append(compare(run_name, case.describe(), case.dtype, got, expected))
        except Exception as error:
            results.append(failed(run_name, case.describe(), error))
    return results


JSD_BETAS = (0.0, 1e-6, 0.5, 1 - 1e-6, 1.0)  # forward KL, the JSD (its form near 0 and 1 too), reverse KL


def check_jsd(impls, device, cases=LOSS_CASES) -> list[CheckResult]:
    """fused_linear_jsd of each impl against its naive version in float64, at each JSD_BETAS, on the cases, their
    options, softcaps and logit scales included."""
    results = []
    for case in cases:
        args = random_problem(case, device)
        for beta in JSD_BETAS:
            options = dict(loss="jsd", beta=beta, temperature=1.5, **case.options("jsd"))
            try:
                want = float64_reference(args, **options)
            except Exception as error:  # a crash is a failed check, reported in the table
                results.append(failed(f"jsd beta={beta:g} reference", case.describe(), error))
                continue
            for impl in impls:
                results += run_and_compare(f"jsd {impl} beta={beta:g} vs float64", case, args, want, impl=impl,
                                           chunk_size=case.chunk_size, **options)
    return results


def split_in_two(impl: RowStepImpl, student, teacher, labels, constants, token_losses, write_grad, grad_lifts=None) -> None:
    """The row step the way a vocabulary split over two ranks runs it (cosdistill.distributed): each
    half's statistics, combined, then each half's losses and gradient, in place in ``student``."""
    vocab_student, middle = student.shape[1], teacher.shape[1] // 2
    bounds = ((0, middle), (middle, teacher.shape[1]))
    halves = [(student[:, min(start, vocab_student):min(stop, vocab_student)], teacher[:, start:stop],
               dataclasses.replace(constants, vocab_start=start, vocab_student_total=vocab_student))
              for start, stop in bounds]
    stats = combine_row_stats(torch.stack([impl.stats(s, t, labels, half) for s, t, half in halves]))
    for s, t, half in halves:
        impl.grad(s, t, labels, stats, half, token_losses, write_grad, grad_lifts)


def check_row_step(device, cases=ROW_STEP_CASES) -> list[CheckResult]:
    from ..kernels import row_step_cuda
    from ..kernels.row_step_triton import COSINE_TRITON_ROW_STEP  # imports triton: only on CUDA or under the interpreter

    runs = {
        "row step triton vs torch": COSINE_TRITON_ROW_STEP.step,
        "row step triton split in two vs torch": lambda *args: split_in_two(COSINE_TRITON_ROW_STEP, *args),
    }
    if _cuda_row_step_available(device):
        runs["row step cuda vs torch"] = row_step_cuda.COSINE_CUDA_ROW_STEP.step
    # each run again with the soft term alone: beside the hard term's, its gradient is small enough to hide under
    # the bf16 tolerance (a step that dropped it passed)
    runs |= {f"{name}, soft term alone": run for name, run in runs.items()}
    results = []
    for (name, run), case in ((run, case) for run in runs.items() for case in cases):
        if "split" in name and case.vocab_teacher < 2:
            continue
        constants = RowStepConstants(
            weight_hard=0.0 if "alone" in name else 0.37, weight_soft=0.81, beta=0.6, temperature=1.7,
            ignore_index=-100, student_softcap=case.softcap, teacher_softcap=case.softcap and 1.5 * case.softcap,
            student_logit_scale=case.logit_scale, teacher_logit_scale=2 * case.logit_scale,
        )
        if "cuda" in name:  # the cluster kernel takes plain scales only: the teacher's scale as the student's
            constants = dataclasses.replace(constants, teacher_logit_scale=constants.student_logit_scale)
            if not row_step_cuda.applies(case.dtype, case.vocab_student, case.vocab_teacher, constants):
                continue  # elsewhere it runs the Triton kernel, checked above
        tol_loss, tol_grad = ROW_STEP_TOLERANCE[case.dtype]
        student = (torch.randn(case.rows, case.vocab_student, device=device) * 3).to(case.dtype)
        teacher = (torch.randn(case.rows, case.vocab_teacher, device=device) * 3).to(case.dtype)
        labels = torch.randint(0, case.vocab_student, (case.rows,), device=device)
        labels[::4] = -100
        # fp16: the gradients lifted by powers of two, as the chunk loop asks for (_row_step.py)
        lifts = [torch.full((case.rows,), POISON, device=device) for _ in range(2)] if case.dtype == torch.float16 else []
        want_grad, want_losses = student.clone(), torch.full((case.rows, 2), POISON, device=device)
        row_step_torch(want_grad, teacher, labels, constants, want_losses, True, *lifts[:1])
        got_grad, got_losses = student.clone(), torch.full((case.rows, 2), POISON, device=device)
        if "cuda" in name and not row_step_cuda.supported(got_grad, teacher, labels, constants, True, None):
            results.append(failed(name, case.describe(), RuntimeError("the cluster kernel would not run here")))
            continue  # a pass would be the Triton fallback's
        try:
            run(got_grad, teacher, labels, constants, got_losses, True, *lifts[1:])
        except Exception as error:
            results.append(failed(name, case.describe(), error))
            continue
        if case.vocab_student == 1:
            # The exact gradient is 0 (p = 1 and |cos| = 1): both sides hold only rounding noise, so
            # check that the noise is small in absolute terms instead of relative to noise.
            errors = dict(losses=(got_losses - want_losses).abs().max().item(), grad=got_grad.float().abs().max().item())
        else:
            errors = dict(losses=rel_err(got_losses, want_losses), grad=rel_err(got_grad.float(), want_grad.float()))
        if lifts:
            errors["lifts differing"] = int((lifts[0] != lifts[1]).sum())
        unwritten = int((got_losses == POISON).sum())
        passed = errors["losses"] < tol_loss and errors["grad"] < tol_grad and not unwritten and not errors.get("lifts differing")
        failure = f"{unwritten} token losses left unwritten (still the poison)" if unwritten else ""
        results.append(CheckResult(name, case.describe(), f"{tol_loss:g} / {tol_grad:g}", errors, passed, failure))
    return results


def _new_like(weight, generator, vocab=None):
    values = torch.randn(vocab or weight.shape[0], weight.shape[1], generator=generator) * weight.shape[1] ** -0.5
    return values.to(weight.device, weight.dtype)


def _optimizer_step(head, generator, **options):
    head.weight.requires_grad_(True)
    head.weight.grad = _new_like(head.weight, generator)
    torch.optim.AdamW([head.weight], lr=0.1, **options).step()
    head.weight.grad = None
    head.weight.requires_grad_(False)


def _negate_first_and_last(weight):
    weight.view(-1)[0].neg_()
    weight.view(-1)[-1].neg_()


def _ema(weight, update, momentum=0.99):
    weight.mul_(momentum).add_(update, alpha=1 - momentum)


# Every way of changing a frozen teacher head (an nn.Linear's weight) that the caches must see:
# name -> (head, generator) -> None
TEACHER_MUTATIONS = {
    "weight.data = new": lambda head, gen: setattr(head.weight, "data", _new_like(head.weight, gen)),
    "weight.data = new, another vocabulary": lambda head, gen: setattr(
        head.weight, "data", _new_like(head.weight, gen, vocab=head.weight.shape[0] + 7)),
    "vector_to_parameters": lambda head, gen: torch.nn.utils.vector_to_parameters(
        _new_like(head.weight, gen).flatten(), [head.weight]),
    "load_state_dict": lambda head, gen: head.load_state_dict({"weight": _new_like(head.weight, gen)}),
    "EMA on the parameter, no_grad": lambda head, gen: torch.no_grad()(_ema)(head.weight, _new_like(head.weight, gen)),
    "optimizer step": lambda head, gen: _optimizer_step(head, gen, foreach=False),
    "fused optimizer step": lambda head, gen: _optimizer_step(head, gen, fused=True),
    "weight.data.copy_": lambda head, gen: head.weight.data.copy_(_new_like(head.weight, gen)),
    "EMA through .data": lambda head, gen: _ema(head.weight.data, _new_like(head.weight, gen)),
    "one row through .data": lambda head, gen: head.weight.data[-1].add_(0.01),
    # edits that move only the words' top bits or one power of two in each (docs/design.md, Cached teacher copies)
    "every sign through .data": lambda head, gen: head.weight.data.neg_(),
    "times 2 through .data": lambda head, gen: head.weight.data.mul_(2),
    "two signs through .data": lambda head, gen: _negate_first_and_last(head.weight.data),
}


def mutation_outcome(run, head, mutate, generator, tolerance=1e-5) -> tuple[str, float]:
    """Runs ``run(teacher_weight)`` -> (losses and gradients), changes the teacher with ``mutate``, and
    says what the calls after gave: "rebuilt" (the answer of a fresh copy), "raised" (StaleWeightError,
    then the fresh copy's answer), "NaN, then raised" (every output NaN, the next call the error, the one
    after the fresh copy's answer) or "WRONG"; with the largest relative error against the fresh copy."""
    from .._weight_cache import StaleWeightError

    def error_to_fresh(got):
        want = run(head.weight.detach().clone())
        errors = [rel_err(a, b) for a, b in zip(got, want)]
        return math.nan if any(math.isnan(error) for error in errors) else max(errors)

    run(head.weight)
    run(head.weight)  # a reuse, unchanged
    mutate(head, generator)
    try:
        got = run(head.weight)
    except StaleWeightError:
        error = error_to_fresh(run(head.weight))
        return ("raised" if error <= tolerance else "WRONG"), error
    if all(torch.isnan(part).all() for part in got):
        try:
            run(head.weight)
        except StaleWeightError:
            error = error_to_fresh(run(head.weight))
            return ("NaN, then raised" if error <= tolerance else "WRONG"), error
        return "WRONG", float("nan")
    error = error_to_fresh(got)
    return ("rebuilt" if error <= tolerance else "WRONG"), error


def check_teacher_caches(device, losses=("cosine", "jsd"), vocab=1000, hidden_teacher=64, tokens=512) -> list[CheckResult]:
    """The teacher's cached copies (its Gram matrix; on FP8 GPUs its FP8 copy, under the cosine loss and the JSD)
    against every mutation in TEACHER_MUTATIONS: each call gives a fresh copy's answer or raises, never a stale
    number (_weight_cache.py)."""
    from .. import _teacher_fp8 as fp8

    options = {"Gram matrix": dict(cosine_via="gram")}
    try:
        fp8.check_supported(torch.device(device))
        options["FP8 copy"] = dict(teacher_precision="fp8")
        # the JSD's cluster row step takes the copy's hash along (RowStepImpl.hashing_step)
        options["FP8 copy, JSD"] = dict(teacher_precision="fp8", loss="jsd")
    except ValueError:
        pass
    options = {what: extra for what, extra in options.items() if extra.get("loss", "cosine") in losses}
    results = []
    for (what, extra), (name, mutate) in itertools.product(options.items(), TEACHER_MUTATIONS.items()):
        generator = torch.Generator().manual_seed(0)
        head = torch.nn.Linear(hidden_teacher, vocab, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
        head.weight.data = _new_like(head.weight, generator)
        labels = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
        labels[::7] = -100
        args = random_student_teacher(labels, hidden_teacher // 2, hidden_teacher, vocab, vocab, torch.bfloat16,
                                      with_student_bias=False, with_teacher_bias=False,
                                      generator=torch.Generator(device).manual_seed(1))

        def run(teacher_weight, args=args, extra=extra):
            vocab_now = teacher_weight.shape[0]  # a new vocabulary: the student's head is cut to match
            student = [args[0], args[1][:vocab_now].detach().requires_grad_(), args[2], teacher_weight, args[4]]
            losses, grads = fused_run(student + [None, None], **extra)
            return [*losses, *grads]

        try:
            outcome, error = mutation_outcome(run, head, mutate, generator)
        except Exception as error:
            results.append(failed(f"teacher {what}: {name}", f"V={vocab} Ht={hidden_teacher} T={tokens} bf16", error))
            continue
        results.append(CheckResult(f"teacher {what}: {name}", f"V={vocab} Ht={hidden_teacher} T={tokens} bf16",
                                   "1e-05 against a fresh copy", {"to fresh copy": error}, outcome != "WRONG",
                                   outcome))
    return results


def failed(name, case, error) -> CheckResult:
    message = str(error).splitlines()[0] if str(error) else ""
    return CheckResult(name, case, "-", failure=f"{type(error).__name__}: {message}")


def _cuda_row_step_available(device) -> bool:
    from ..kernels import row_step_cuda  # imports triton: only on CUDA or under the interpreter

    return row_step_cuda.available(torch.device(device))


def run_selfcheck(device, losses=("cosine", "jsd")) -> tuple[str, list[CheckResult]]:
    """(a header naming the device and the paths checked, the results) with a fixed seed, for the soft terms in
    ``losses``."""
    torch.manual_seed(0)
    triton_too = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    from_cuda = ("cuda",) if device.type == "cuda" and _cuda_row_step_available(device) else ()
    impls = ("torch", "triton", *from_cuda) if triton_too else ("torch",)
    results = []
    if "cosine" in losses:
        results += check_loss(impls, device) + (check_row_step(device) if triton_too else [])
    if "jsd" in losses:
        results += check_jsd(impls, device)
    results += check_teacher_caches(device, losses)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        paths = f"torch, triton{' and the CUDA cluster row step' if from_cuda else ''}"
    elif triton_too:
        paths = "torch and triton (in Triton's interpreter, TRITON_INTERPRET=1)"
    else:
        paths = "torch only (set TRITON_INTERPRET=1 to run the Triton kernel in Triton's interpreter too)"
    return (f"cosdistill check on {name}, torch {torch.__version__}; soft terms {' and '.join(losses)}; paths checked: "
            f"{paths}", results)


def results_table(results) -> str:
    """A Markdown table, one row per check, and a last line saying whether all passed."""
    lines = ["| check | case | errors | tolerance (losses / grads) | result |", "|---|---|---|---|---|"]
    for result in results:
        errors = "; ".join(filter(None, [", ".join(f"{key} {value:.1e}" for key, value in result.errors.items()),
                                         result.failure]))
        lines.append(f"| {result.name} | {result.case} | {errors} | {result.tolerance} | {'ok' if result.passed else 'FAIL'} |")
    num_failed = sum(not result.passed for result in results)
    lines += ["", f"{num_failed} of {len(results)} checks FAILED" if num_failed else f"all {len(results)} checks passed"]
    return "\n".join(lines) + "\n"
