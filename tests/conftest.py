"""Shared by the tests: the random problem and its float64 reference, the ``impl`` fixture, and the ``gpu``
marker's machinery.

Triton runs in its interpreter on the CPU (TRITON_INTERPRET=1, set before triton is imported), except in a
run of the GPU tests alone (``pytest -m gpu``) on a CUDA machine, where the kernels run compiled. Tests
marked ``gpu`` are left out by default (pyproject.toml's addopts) and skipped, with the reason, where they
cannot run.
"""

import os

# The Triton kernels run on the CPU through Triton's interpreter; it must be set before triton is imported.
INTERPRETER_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from cosdistill import fused_linear_cosine_distill  # noqa: E402
from cosdistill.testing import chunk_rows, float64_reference, random_student_teacher, rel_err  # noqa: E402, F401

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 2e-2), torch.float16: (2e-3, 5e-3)}  # (loss, grads)


@pytest.fixture(autouse=True)
def seeded_by_name(request):
    """Each test draws from a seed of its own id, so that its random inputs do not depend on which tests ran
    before it in the process (adding a test would otherwise change the draws of every later one)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test's calls make their own plans: one reused from an earlier test's call of the same signature
    (_plan.checked_plan) would skip what a test patches inside make_plan. And the Gram cache takes each test's new
    weights as held, whatever the weights of earlier tests, freed after one call, taught it (will_hold)."""
    from cosdistill.testing import plan, teacher_gram

    plan._plans.clear()
    teacher_gram.teacher_grams.values_outlive_calls = True


def pytest_addoption(parser):
    group = parser.getgroup("cosdistill GPU tests (-m gpu)")
    group.addoption("--fuzz-cases", type=int, default=240, help="random cases of tests/gpu/test_fuzz.py on the GPU")
    group.addoption("--fuzz-seed", type=int, default=0, help="the seed they are drawn from")
    group.addoption("--seed-tokens", type=int, default=8192, help="T of the accumulator check at the seed workload")


def runs_only_gpu_tests(config) -> bool:
    """Whether the -m expression keeps the tests marked gpu and leaves the others out (``-m gpu``)."""
    from _pytest.mark.expression import Expression

    expression = Expression.compile(config.option.markexpr or "gpu or not gpu")
    return (expression.evaluate(lambda name, **kwargs: name == "gpu")
            and not expression.evaluate(lambda name, **kwargs: False))


def pytest_configure(config):
    if INTERPRETER_SET_HERE and runs_only_gpu_tests(config) and torch.cuda.is_available():
        del os.environ["TRITON_INTERPRET"]  # no test has imported triton yet: the kernels run compiled


def gpu_skip_reason() -> str | None:
    """Why the tests marked gpu cannot run in this process, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton runs in its interpreter in this run: run the GPU tests on their own, pytest -m gpu"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    for item in items:
        if reason and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=reason))


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def on_devices(cpu_cases, cuda_cases, describe=str) -> list:
    """(device, case) parameters: the CPU's cases as ordinary tests, the CUDA ones marked gpu."""
    return ([pytest.param("cpu", case, id=f"cpu-{describe(case)}") for case in cpu_cases]
            + [pytest.param("cuda", case, id=f"cuda-{describe(case)}", marks=pytest.mark.gpu) for case in cuda_cases])


@dataclass
class Problem:
    student_input: torch.Tensor
    student_weight: torch.Tensor
    teacher_input: torch.Tensor
    teacher_weight: torch.Tensor
    labels: torch.Tensor
    student_bias: torch.Tensor | None
    teacher_bias: torch.Tensor | None

    def args(self):
        return (self.student_input, self.student_weight, self.teacher_input, self.teacher_weight, self.labels,
                self.student_bias, self.teacher_bias)

    def student_leaves(self):
        return [t for t in (self.student_input, self.student_weight, self.student_bias) if t is not None]


def make_problem(tokens=37, hidden_student=16, hidden_teacher=24, vocab_student=101, vocab_teacher=None,
                 dtype=torch.float32, bias=True, ignore_every=0, batch=None) -> Problem:
    """Fresh random inputs (never zeros); logits of order a few units, like a trained LM head's."""
    lead = (tokens,) if batch is None else (batch, tokens // batch)
    labels = torch.randint(0, vocab_student, lead)
    if ignore_every:
        labels.view(-1)[::ignore_every] = -100
    return problem_around(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher or vocab_student,
                          dtype, with_student_bias=bias, with_teacher_bias=bias)


def problem_around(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher, dtype, *,
                   with_student_bias: bool, with_teacher_bias: bool, generator=None) -> Problem:
    """A Problem for these labels: cosdistill.testing.random_student_teacher's tensors."""
    return Problem(*random_student_teacher(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher,
                                           dtype, with_student_bias=with_student_bias,
                                           with_teacher_bias=with_teacher_bias, generator=generator))


def reference(problem: Problem, grad_output=1.0, **kwargs):
    """(loss, soft, hard) and the student gradients, in float64, through the naive full-logits version."""
    return float64_reference(problem.args(), grad_output, **kwargs)


def run_fused(problem, grad_output=1.0, **kwargs):
    """[loss, soft, hard] of the fused loss, and the student gradients of grad_output * loss."""
    kwargs.setdefault("return_soft_hard_loss", True)
    losses = fused_linear_cosine_distill(*problem.args(), **kwargs)
    (losses[0] * grad_output).backward()
    return list(losses), [leaf.grad for leaf in problem.student_leaves()]


def assert_matches_reference(problem, dtype, grad_output=1.0, ref_kwargs=None, **kwargs):
    """The fused loss's losses and student gradients within TOLERANCE[dtype] of the float64 reference."""
    losses, grads = run_fused(problem, grad_output, **kwargs)
    ref_losses, ref_grads = reference(problem, grad_output, **(ref_kwargs or {}))
    loss_tol, grad_tol = TOLERANCE[dtype]
    for name, got, want in zip(("loss", "soft", "hard"), losses, ref_losses):
        assert got.dtype == torch.float32 and torch.isfinite(got)
        assert rel_err(got, want) < loss_tol, (name, got.item(), want.item())
    for leaf, got, want in zip(problem.student_leaves(), grads, ref_grads):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert rel_err(got, want) < grad_tol, (tuple(leaf.shape), rel_err(got, want))


POISON = 12345.0  # what the row step's outputs hold before it writes them


def random_chunk(rows, vocab_student, vocab_teacher, dtype):
    """(student logits, teacher logits, labels) of one chunk, every third label ignored (-7)."""
    student = (torch.randn(rows, vocab_student) * 3).to(dtype)
    teacher = (torch.randn(rows, vocab_teacher) * 3).to(dtype)
    labels = torch.randint(0, vocab_student, (rows,))
    labels[::3] = -7  # ignored
    return student, teacher, labels


def record_write_grad(monkeypatch, module) -> list:
    """Replaces ``module.chunk_rows`` with one that records each call's ``write_grad``; the list it fills."""
    seen = []

    def recording_chunk_rows(*args, **kwargs):
        seen.append(kwargs["write_grad"])
        return chunk_rows(*args, **kwargs)

    monkeypatch.setattr(module, "chunk_rows", recording_chunk_rows)
    return seen


@pytest.fixture(params=["torch", "triton"])
def impl(request):
    return request.param


def run_jsd_split_stages(student, teacher, labels, constants, bounds, write_grad, lifts=False):
    """(gradient, losses per shard, lifts per shard) of the JSD Triton step's stages over a vocabulary split at
    the teacher's column ``bounds``, each shard a rank: every rank's stage, then the combination that
    split_jsd_row_step_triton makes of the all-gathered [ranks, ...] between the stages. Losses and lifts are
    NaN-poisoned."""
    from cosdistill.testing import kernels

    jsd = kernels.row_step_jsd_triton
    vocab_student, poisoned = student.shape[1], functools.partial(torch.full, fill_value=float("nan"),
                                                                  device=student.device)
    shards = [(student[:, min(a, vocab_student):min(b, vocab_student)].clone(), teacher[:, a:b],
               replace(constants, vocab_start=a, vocab_student_total=vocab_student)) for a, b in bounds]
    stats = jsd.combine_jsd_stats_triton(torch.stack([jsd.jsd_shard_stats_triton(s, t, labels, shard_constants)
                                                 for s, t, shard_constants in shards]), constants.temperature)
    sums = jsd.combine_jsd_sums_triton(torch.stack([jsd.jsd_shard_sums_triton(s, t, labels, stats, shard_constants,
                                                                         write_grad and lifts)
                                               for s, t, shard_constants in shards]))
    losses, shard_lifts = [], []
    for s, t, shard_constants in shards:
        losses.append(poisoned((len(labels), 2)))
        shard_lifts.append(poisoned((len(labels),)) if lifts else None)
        jsd.jsd_shard_grad_triton(s, t, labels, stats, sums, shard_constants, losses[-1], write_grad, shard_lifts[-1])
    return torch.cat([shard[0] for shard in shards], dim=1), losses, shard_lifts


def peaked_reverse_kl_rows(temperature, ignore_index, vocab_student=70, vocab_teacher=77, dtype=torch.float32):
    """(student, teacher, labels) of 8 rows, most of whose student probability sits on one column: over T, gaps of
    20 to 1000 nats (that row's gradient underflows to 0), the top in either half of the columns, teachers spread
    or peaked elsewhere (in the padding too), a tie of the student's top across the halves with two teacher logits
    there, a row not peaked and an ignored one. Reverse KL's gradient there is the difference of two terms of the
    gap's order."""
    generator = torch.Generator().manual_seed(11)
    student = torch.randn(8, vocab_student, generator=generator, dtype=torch.float64) * 3
    teacher = torch.randn(8, vocab_teacher, generator=generator, dtype=torch.float64) * 3
    for row, (top, gap, teacher_peak) in enumerate([(5, 20, None), (50, 60, None), (65, 30, 10), (3, 1000, 40),
                                                    (8, 40, None), (vocab_student - 1, 25, vocab_teacher - 3)]):
        student[row, top] += gap
        if teacher_peak is not None:
            teacher[row, teacher_peak] += gap / 2
    student[4, 60] = student[4, 8]
    labels = torch.randint(0, vocab_student, (8,), generator=generator)
    labels[7] = ignore_index
    return (student * temperature).to(dtype), (teacher * temperature).to(dtype), labels


def exact_reverse_kl_grad(student, teacher, temperature, digits=60):
    """[n, Vs] float64: d KL(p || q) / d s of each row (s zero-padded to the teacher's columns) on the logits'
    exact values, in the textbook form (1 / T) p (g - sum_j p_j g_j), g = a - b, through mpmath at ``digits``
    digits, far past the cancellation that form meets where p sits on one column."""
    import mpmath

    rows = []
    with mpmath.workdps(digits):
        for s, t in zip(student.double().tolist(), teacher.double().tolist()):
            s_over_t = [mpmath.mpf(x) / temperature for x in s] + [mpmath.mpf(0)] * (len(t) - len(s))
            t_over_t = [mpmath.mpf(x) / temperature for x in t]
            log_z_s = mpmath.log(mpmath.fsum(mpmath.exp(x) for x in s_over_t))
            log_z_t = mpmath.log(mpmath.fsum(mpmath.exp(x) for x in t_over_t))
            p = [mpmath.exp(x - log_z_s) for x in s_over_t]
            g = [(x - log_z_s) - (y - log_z_t) for x, y in zip(s_over_t, t_over_t)]
            row_sum = mpmath.fsum(p_j * g_j for p_j, g_j in zip(p, g))
            rows.append([float(p[k] * (g[k] - row_sum) / temperature) for k in range(len(s))])
    return torch.tensor(rows, dtype=torch.float64)


def assert_rows_match(got, want, tolerance):
    """Each row of ``got`` within ``tolerance`` of ``want``'s by relative error, and exactly 0 where ``want``'s is."""
    for row, (got_row, want_row) in enumerate(zip(got.double().cpu(), want)):
        if not want_row.any():
            assert not got_row.any(), row
        else:
            assert rel_err(got_row, want_row) < tolerance, (row, rel_err(got_row, want_row))
