"""Random problems through impl="auto" (on the CPU "triton") and "torch", each against float64 and each other:
on a CUDA GPU at LLM sizes (pytest -m gpu; --fuzz-cases, --fuzz-seed), and on the CPU in tiny sizes.

Each case draws the soft term (the cosine loss, or in one case of four the generalized JSD), sizes (T
0..3000, 2-D or 3-D inputs, student and teacher hidden sizes, Vs 1..140000 with tiny, prime and LLM
vocabularies, Vt >= Vs), dtype, biases, ignore pattern, loss weights and beta (zeros included),
temperature, chunk size, softcaps, logit scales, num_valid_tokens, accum_dtype and grad_output, plus a
seed for its tensors. T is capped so that the float64 reference (the naive version
on float64 copies, the oracle) stays cheap: T * Vt * (Hs + Ht) and T * Vt are bounded.

Compared: loss, soft, hard and the gradients of student_input, student_weight, student_bias, by
||got - want|| / ||float64||, within TOLERANCE[dtype]; the rules for results that are zero by
construction or by symmetry, for gradients their dtype cannot hold, for grad_weight's chunk-by-chunk
accumulator and for logits held in their dtype follow tests/test_properties.py (see
``measure``). A case is drawn from the seed and its index alone, so its test id reproduces it:

    python -m pytest -m gpu "tests/gpu/test_fuzz.py::test_case_matches_float64_and_torch[cuda-17]"
"""

import dataclasses
import json
import math
import random
from dataclasses import asdict, dataclass, replace

import pytest
import torch

from conftest import on_devices
from cosdistill.reference import NAIVE_LOSSES
from cosdistill.testing import (
    FUSED_LOSSES,
    Options,
    accumulation_floor,
    float64_reference,
    ignore_some_labels,
    kernels,
    logits_rounding_floors,
    random_student_teacher,
    rel_err,
)
from cosdistill.testing import teacher_gram as gram
from cosdistill.tools.bench import DTYPES

# (losses, gradients), relative to the float64 result's norm
TOLERANCE = {"fp32": (1e-5, 1e-4), "bf16": (5e-3, 2e-2), "fp16": (2e-3, 5e-3)}
FLOAT64_ZERO = 1e-12  # a float64 norm below this is zero up to rounding
QUANTITIES = ("loss", "soft", "hard", "grad_input", "grad_weight", "grad_bias")
COMPARISONS = ("fast vs float64", "torch vs float64", "fast vs torch")
PRIMES = (2, 3, 5, 7, 31, 97, 127, 257, 1021, 4093, 4999, 32003, 65521, 131071)
LLM_VOCABS = (32000, 32001, 50257, 65536, 128256)
COVERAGE = (  # (label, test on a case's parameters): what the GPU cases must exercise
    ("jsd", lambda c: c["loss"] == "jsd"),
    ("jsd, forward KL (beta = 0)", lambda c: c["loss"] == "jsd" and c["beta"] == 0),
    ("jsd, reverse KL (beta = 1)", lambda c: c["loss"] == "jsd" and c["beta"] == 1),
    ("jsd, softcap", lambda c: c["loss"] == "jsd" and bool(c["student_softcap"] or c["teacher_softcap"])),
    ("jsd, fp16", lambda c: c["loss"] == "jsd" and c["dtype"] == "fp16"),
    ("T = 0", lambda c: c["tokens"] == 0),
    ("T = 1", lambda c: c["tokens"] == 1),
    ("3-D", lambda c: c["batch"] is not None),
    ("Vs <= 8", lambda c: c["vocab_student"] <= 8),
    ("Vs >= 32000", lambda c: c["vocab_student"] >= 32000),
    ("Vt > Vs", lambda c: c["vocab_teacher"] > c["vocab_student"]),
    ("all ignored", lambda c: c["ignore"] == "all"),
    ("a zero weight or beta", lambda c: 0.0 in (c["weight_hard_loss"], c["weight_soft_loss"], c["beta"])),
    ("softcap", lambda c: bool(c["student_softcap"] or c["teacher_softcap"])),
    ("logit scale", lambda c: c["student_logit_scale"] != 1 or c["teacher_logit_scale"] != 1),
    ("num_valid_tokens", lambda c: c["num_valid_tokens"] is not None),
    ("grad_output != 1", lambda c: c["grad_output"] != 1),
    ("fp32 accumulator", lambda c: c["accum_dtype"] == "fp32"),
    ("cluster row step applies", lambda c: cluster_eligible(Case(**c))),
    ("Gram path (auto)", lambda c: gram_taken(Case(**c))),
    ("given chunk size", lambda c: c["chunk_size"] is not None),
)


@dataclass(frozen=True)
class Limits:
    max_tokens: int
    min_hidden: int
    max_hidden: int
    max_vocab: int
    max_work: float  # T * Vt * (Hs + Ht): the float64 reference's GEMM time
    max_cells: int  # T * Vt: its float64 logits' memory


GPU_LIMITS = Limits(max_tokens=3000, min_hidden=16, max_hidden=1024, max_vocab=140000, max_work=3e11, max_cells=2 * 10**8)
TINY_LIMITS = Limits(max_tokens=12, min_hidden=4, max_hidden=16, max_vocab=300, max_work=1e5, max_cells=4000)


@dataclass(frozen=True)
class Case:
    index: int
    seed: int  # of the tensors
    tokens: int
    batch: int | None  # None: [T, H] inputs; else [batch, T // batch, H]
    hidden_student: int
    hidden_teacher: int
    vocab_student: int
    vocab_teacher: int
    dtype: str
    student_bias: bool
    teacher_bias: bool
    ignore: str  # "none", "some" (30% at random), "alternating" or "all"
    ignore_index: int
    weight_hard_loss: float
    weight_soft_loss: float
    beta: float
    temperature: float
    chunk_size: int | None
    student_softcap: float | None
    teacher_softcap: float | None
    student_logit_scale: float
    teacher_logit_scale: float
    num_valid_tokens: int | None
    accum_dtype: str | None
    grad_output: float
    loss: str = "cosine"  # the soft term: "cosine" or "jsd"

    def options(self) -> dict:
        """The keyword arguments that the fused loss and the naive reference share."""
        return dict(
            weight_hard_loss=self.weight_hard_loss, weight_soft_loss=self.weight_soft_loss, beta=self.beta,
            ignore_index=self.ignore_index, temperature=self.temperature, num_valid_tokens=self.num_valid_tokens,
            student_softcap=self.student_softcap, teacher_softcap=self.teacher_softcap,
            student_logit_scale=self.student_logit_scale, teacher_logit_scale=self.teacher_logit_scale,
        )

    def describe(self) -> str:
        layout = f"[{self.batch}, {self.tokens // self.batch}, H]" if self.batch else "[T, H]"
        return (f"case {self.index}: {self.dtype} T={self.tokens} {layout} Hs={self.hidden_student} "
                f"Ht={self.hidden_teacher} Vs={self.vocab_student} Vt={self.vocab_teacher}")


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def draw_vocab(rng: random.Random, limits: Limits) -> int:
    kind = rng.choice(["tiny", "prime", "llm", "any", "any", "any"])
    if kind == "tiny":
        return rng.randint(1, min(8, limits.max_vocab))
    if kind == "prime":
        return rng.choice([p for p in PRIMES if p <= limits.max_vocab])
    if kind == "llm" and LLM_VOCABS[0] <= limits.max_vocab:
        return rng.choice([v for v in LLM_VOCABS if v <= limits.max_vocab])
    return log_uniform(rng, 1, limits.max_vocab)


def draw_weights(rng: random.Random) -> dict:
    """Loss weights and beta (0.01 to 0.9999, or 1: nearer 0 or 1 the soft term only shrinks into fp16's underflow;
    test_gpu_check holds those betas); in one case of four some of them are zero."""
    weights = dict(weight_hard_loss=rng.uniform(0.01, 2.0), weight_soft_loss=rng.uniform(0.01, 2.0),
                   beta=rng.choice([rng.uniform(0.01, 0.9999), 1.0]))
    if rng.random() < 0.25:
        for name in rng.choice([["weight_hard_loss"], ["weight_soft_loss"], ["beta"], ["weight_hard_loss", "beta"],
                                list(weights)]):
            weights[name] = 0.0
    return weights


def draw_chunk_size(rng: random.Random, tokens: int) -> int | None:
    """None (the automatic size), or a size giving at most 32 chunks, or a tiny one at small T. More chunks
    would measure the bf16 grad_weight accumulator (accum_dtype), a documented trade-off, not a bug."""
    fewest = max(1, -(-tokens // 32))
    kind = rng.choice(["auto", "auto", "random", "random", "tiny"])
    if kind == "auto":
        return None
    if kind == "tiny" and tokens <= 256:
        return rng.choice([1, 7, 64])
    return rng.randint(fewest, tokens + 64)


def draw_case(rng: random.Random, index: int, limits: Limits) -> Case:
    vocab_student = draw_vocab(rng, limits)
    vocab_teacher = rng.choice([
        vocab_student, vocab_student + rng.randint(1, 64), rng.randint(vocab_student, max(vocab_student, limits.max_vocab)),
    ])
    hidden_student = log_uniform(rng, limits.min_hidden, limits.max_hidden)
    hidden_teacher = rng.choice([rng.randint(hidden_student, limits.max_hidden),
                                 log_uniform(rng, limits.min_hidden, limits.max_hidden)])
    work_per_token = vocab_teacher * (hidden_student + hidden_teacher)
    most_tokens = max(1, int(min(limits.max_tokens, limits.max_work / work_per_token, limits.max_cells / vocab_teacher)))
    draw = rng.random()  # T = 0 and T = 1 in one case of 25 each, small T favoured in a third
    if draw < 0.08:
        tokens = 0 if draw < 0.04 else 1
    else:
        tokens = log_uniform(rng, 1, most_tokens) if draw < 0.4 else rng.randint(1, most_tokens)
    divisors = [b for b in range(1, tokens + 1) if tokens % b == 0] if tokens else [1, 2, 3]
    softcap = lambda: rng.uniform(1.0, 30.0) if rng.random() < 0.25 else None  # noqa: E731
    logit_scale = lambda: rng.uniform(0.25, 2.0) if rng.random() < 0.25 else 1.0  # noqa: E731
    case = Case(
        index=index,
        seed=rng.randrange(2**31),
        tokens=tokens,
        batch=rng.choice(divisors) if rng.random() < 0.25 else None,
        hidden_student=hidden_student,
        hidden_teacher=hidden_teacher,
        vocab_student=vocab_student,
        vocab_teacher=vocab_teacher,
        dtype=rng.choice(list(TOLERANCE)),
        student_bias=rng.random() < 0.5,
        teacher_bias=rng.random() < 0.5,
        ignore=rng.choice(["none", "none", "some", "some", "alternating", "all"]),
        ignore_index=rng.choice([-100, -1]),
        **draw_weights(rng),
        temperature=1.0 if rng.random() < 0.5 else rng.uniform(0.25, 5.0),
        chunk_size=draw_chunk_size(rng, tokens),
        student_softcap=softcap(),
        teacher_softcap=softcap(),
        student_logit_scale=logit_scale(),
        teacher_logit_scale=logit_scale(),
        num_valid_tokens=rng.randint(1, 2 * max(1, tokens)) if rng.random() < 0.15 else None,
        accum_dtype=rng.choice([None, "fp32"]),
        grad_output=rng.choice([1.0, 1.0, 1.0, -2.5, 0.3]),
    )
    if rng.random() < 0.25:  # one case in four where the CUDA cluster row step applies (row_step_cuda.py)
        vocab = max(8, vocab_student // 8 * 8)
        case = dataclasses.replace(case, dtype="bf16", vocab_student=vocab, vocab_teacher=vocab, student_softcap=None,
                                   teacher_softcap=None, student_logit_scale=1.0, teacher_logit_scale=1.0)
    if rng.random() < 0.25:  # the generalized JSD
        case = dataclasses.replace(case, loss="jsd", dtype=rng.choice(["bf16", "fp16", "fp32"]))
    return case


def gram_taken(case: Case) -> bool:
    """Whether cosine_via="auto" takes the Gram path (gram.py; its teacher-scale guard aside: the fuzz's
    heads are of order one)."""
    heads_allow = case.loss == "cosine" and not (
        case.student_bias or case.teacher_bias or case.student_softcap or case.teacher_softcap or case.dtype == "fp16")
    return heads_allow and gram.gram_is_cheaper(case.tokens, case.vocab_student, case.vocab_teacher,
                                                case.hidden_student, case.hidden_teacher, write_grad_weight=True)


def cluster_eligible(case: Case) -> bool:
    """Whether impl="auto" runs the case's row steps in the CUDA cluster kernel (on Hopper; row_step_cuda.py)."""
    options = case.options()
    del options["num_valid_tokens"]  # the rest are Options fields
    constants = Options(**options).constants
    return case.loss == "cosine" and not gram_taken(case) and kernels.row_step_cuda.applies(
        DTYPES[case.dtype], case.vocab_student, case.vocab_teacher, constants)


def fast_impl(device, case: Case) -> str:
    """What users get on the device ("auto": the CUDA cluster kernel where it applies, else Triton); on the CPU,
    Triton in its interpreter."""
    return "auto" if device.type == "cuda" else "triton"


def draw_cases(seed: int, count: int, limits: Limits) -> list[Case]:
    rng = random.Random(seed)
    return [draw_case(rng, index, limits) for index in range(count)]


def build_problem(case: Case, device) -> list:
    """[student_input, student_weight, teacher_input, teacher_weight, labels, student_bias, teacher_bias] from
    the case's seed (cosdistill.testing.random_student_teacher: logits of a few units, like a trained head's)."""
    gen = torch.Generator(device=device).manual_seed(case.seed)
    lead = (case.tokens,) if case.batch is None else (case.batch, case.tokens // case.batch)
    labels = torch.randint(0, case.vocab_student, lead, generator=gen, device=device)
    ignore_some_labels(labels, case.ignore, case.ignore_index, gen)
    return random_student_teacher(labels, case.hidden_student, case.hidden_teacher, case.vocab_student,
                                  case.vocab_teacher, DTYPES[case.dtype], with_student_bias=case.student_bias,
                                  with_teacher_bias=case.teacher_bias, generator=gen)


def fused_result(args, case: Case, impl: str):
    """[loss, soft, hard] and the student gradients of the fused loss, for the case's grad_output."""
    for i in (0, 1, 5):
        if args[i] is not None:
            args[i].grad = None
    losses = FUSED_LOSSES[case.loss](
        *args, chunk_size=case.chunk_size, return_soft_hard_loss=True, impl=impl,
        accum_dtype=case.accum_dtype and DTYPES[case.accum_dtype], **case.options(),
    )
    (losses[0] * case.grad_output).backward()
    return [loss.detach() for loss in losses] + [args[i].grad for i in (0, 1, 5) if args[i] is not None]


def reference_result(args, case: Case):
    """The same from the naive version on float64 copies (grad_output applied in float64)."""
    losses, grads = float64_reference(args, loss=case.loss, **case.options())
    return losses + [grad * case.grad_output for grad in grads]


def measure(got, want, reference, tolerance, exact_zero, floor, design_floor=0.0, accumulation=0.0) -> dict:
    """{error, bound, kind, floor, passed} of got against want; it passes when error <= bound. ``reference`` is
    the float64 result, whose norm scales the error, so that fast vs torch is held to the same scale as
    each vs float64.

    * "exact zero": the result is zero by construction (no valid token; for gradients also both terms
      weighted out): got must equal want (zero) exactly.
    * "absolute": the float64 result is zero up to its own rounding (a symmetry, e.g. Vs = 1): ||got - want||
      must be below the tolerance in absolute terms (the cancelling terms are of order one at most).
    * "relative": ||got - want|| / ||reference||. ``floor`` is the error that the case's dtype forces on any
      implementation (see dtype_floors); when it reaches the tolerance, the bound is tolerance + floor.
      ``accumulation`` (grad_weight: testing.accumulation_floor) is added to the bound; an error still past
      it is held to tolerance + max(floor, design_floor) + accumulation, ``design_floor`` being the error that
      holding the logits in their dtype alone gives (testing.logits_rounding_floors).
    """
    diff = (got.detach().double() - want.detach().double()).norm().item()
    scale = reference.norm().item()
    if exact_zero:
        error, bound, kind = diff, 0.0, "exact zero"
    elif scale < FLOAT64_ZERO:
        error, bound, kind = diff, tolerance, "absolute"
    else:
        error, kind = diff / scale, "relative"
        bound = (tolerance if floor < tolerance else tolerance + floor) + accumulation
        if not error <= bound:
            bound = tolerance + max(floor, design_floor) + accumulation
    return dict(error=error, bound=bound, kind=kind, floor=floor, passed=error <= bound)  # False for NaN


def dtype_floors(args, case: Case, reference) -> list[float]:
    """Per quantity, the error against float64 that the case's dtype alone causes:

    * losses: that of the naive version run in the dtype, which like the fused loss holds the logits in it
      (bf16 logits put a single token's cross-entropy ~1e-2 off, e.g. at T = 1); 0 in fp32;
    * gradients: that of the float64 gradient rounded to the dtype (fp16 subnormals hold a few bits only).
    """
    if case.dtype == "fp32":
        loss_floors = [0.0] * 3
    else:
        with torch.no_grad():
            naive = NAIVE_LOSSES[case.loss](*args, **case.options())
        loss_floors = [rel_err(loss, ref) for loss, ref in zip(naive, reference)]
    return loss_floors + [rel_err(ref.to(DTYPES[case.dtype]), ref) for ref in reference[3:]]


def compare(got, want, reference, dtype: str, no_valid_token: bool, weighted_out: bool, floors=None,
            design_floors=(0.0, 0.0, 0.0), accumulation=0.0) -> dict:
    """{quantity: measure(...)} for got = [loss, soft, hard, grads...] against want; floors: dtype_floors';
    design_floors (grad_input, grad_weight, grad_bias) and accumulation (grad_weight): see measure."""
    loss_tolerance, grad_tolerance = TOLERANCE[dtype]
    floors = floors or [0.0] * len(reference)
    results = {}
    for index, (name, g, w, r, floor) in enumerate(zip(QUANTITIES, got, want, reference, floors)):
        is_grad = index >= 3
        if g is None or g.shape != r.shape or (is_grad and g.dtype != DTYPES[dtype]):
            wrong = None if g is None else (tuple(g.shape), str(g.dtype))
            results[name] = dict(error=math.inf, bound=0.0, kind=f"wrong result {wrong}", floor=floor, passed=False)
            continue
        exact_zero = no_valid_token or (is_grad and weighted_out)
        if is_grad:
            results[name] = measure(g, w, r, grad_tolerance, exact_zero, floor, design_floors[index - 3],
                                    accumulation if name == "grad_weight" else 0.0)
        else:
            results[name] = measure(g, w, r, loss_tolerance, exact_zero, floor)
    return results


def check_case(case: Case, device) -> dict:
    """{comparison: compare(...)} for the three comparisons."""
    args = build_problem(case, device)
    reference = reference_result(args, case)
    floors = dtype_floors(args, case, reference)
    fast, torch_ = fused_result(args, case, fast_impl(device, case)), fused_result(args, case, "torch")
    labels = args[4]
    no_valid_token = not bool((labels != case.ignore_index).any())
    soft_weight = case.weight_soft_loss * (case.beta if case.loss == "cosine" else 1.0)  # beta mixes the JSD's terms
    weighted_out = case.weight_hard_loss == 0 and soft_weight == 0
    pairs = dict(zip(COMPARISONS, [(fast, reference), (torch_, reference), (fast, torch_)]))
    dtype = DTYPES[case.dtype]
    design = (logits_rounding_floors(args, dtype, case.grad_output, loss=case.loss, **case.options()) if case.tokens
              else [0.0] * 3)
    accumulation = accumulation_floor(dtype, case.accum_dtype and DTYPES[case.accum_dtype], case.chunk_size,
                                      case.tokens, case.vocab_student, case.vocab_teacher)
    return {name: compare(got, want, reference, case.dtype, no_valid_token, weighted_out, floors, design, accumulation)
            for name, (got, want) in pairs.items()}


def failures(errors: dict) -> list[str]:
    """"comparison: quantity error > bound" for each comparison that failed."""
    return [f"{comparison}: {name} {result['error']:.2e} > {result['bound']:.2e} ({result['kind']})"
            for comparison, results in errors.items() for name, result in results.items() if not result["passed"]]




CPU_CASES = 14  # tiny cases on the CPU, drawn from --fuzz-seed as the GPU's are (two of them JSD at seed 0, one fp16)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_case_matches_float64_and_torch":
        seed, count = metafunc.config.getoption("fuzz_seed"), metafunc.config.getoption("fuzz_cases")
        metafunc.parametrize("device, case", on_devices(draw_cases(seed, CPU_CASES, TINY_LIMITS),
                                                        draw_cases(seed, count, GPU_LIMITS), lambda case: case.index))


def test_case_matches_float64_and_torch(device, case):
    """The fast path and torch each within the case's bounds of float64, and of each other."""
    failed = failures(check_case(case, torch.device(device)))
    assert not failed, f"{case.describe()}: {'; '.join(failed)}; parameters {json.dumps(asdict(case))}"


def test_a_case_depends_on_the_seed_and_its_index_alone():
    """So a failed case's test id reproduces it in a run of any number of cases."""
    assert draw_cases(3, 6, TINY_LIMITS)[:4] == draw_cases(3, 4, TINY_LIMITS)
    assert draw_cases(3, 6, GPU_LIMITS)[:4] == draw_cases(3, 4, GPU_LIMITS)


def test_the_default_gpu_cases_exercise_every_feature():
    """Each entry of COVERAGE holds for some of the 240 cases of seed 0 (pytest -m gpu's default)."""
    cases = [asdict(case) for case in draw_cases(0, 240, GPU_LIMITS)]
    counts = {label: sum(map(holds, cases)) for label, holds in COVERAGE}
    assert all(counts.values()), counts


def failed_quantities(results):
    return [name for name, result in results.items() if not result["passed"]]


def a_case_with_every_term():
    case = draw_cases(0, 1, TINY_LIMITS)[0]
    return replace(case, tokens=9, batch=None, vocab_student=37, vocab_teacher=41, dtype="fp32", student_bias=True,
                   ignore="some", weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, num_valid_tokens=None)


@pytest.mark.parametrize("wrong", ["loss", "soft", "hard", "grad_input", "grad_weight", "grad_bias"])
def test_comparison_fails_a_perturbed_result(wrong):
    """The comparison cannot pass vacuously: a result off by 10x the tolerance, or NaN, fails that quantity alone."""
    case = a_case_with_every_term()
    args = build_problem(case, torch.device("cpu"))
    reference = reference_result(args, case)
    got = fused_result(args, case, "torch")
    assert not failed_quantities(compare(got, reference, reference, "fp32", False, False))

    index = QUANTITIES.index(wrong)
    perturbed = list(got)
    perturbed[index] = got[index] * (1 + 1e-3)  # 10x the fp32 gradient tolerance, 100x the loss tolerance
    assert failed_quantities(compare(perturbed, reference, reference, "fp32", False, False)) == [wrong]
    nan = list(got)
    nan[index] = torch.full_like(got[index], float("nan"))
    assert failed_quantities(compare(nan, got, reference, "fp32", False, False)) == [wrong]


def test_the_design_floor_covers_logits_held_in_their_dtype():
    """A low temperature and a large student logit scale magnify the logits' bf16 rounding past the gradient
    tolerance, in the fast path and torch alike (a fresh-seed GPU case, temperature 0.45 and scale 1.9, was off
    by 2.2e-2 in both): the design floor accounts for it, to a tenth, and the comparison then passes."""
    case = replace(a_case_with_every_term(), tokens=300, hidden_student=64, hidden_teacher=96, vocab_student=136,
                   vocab_teacher=136, dtype="bf16", loss="jsd", beta=1.0, temperature=0.25, student_logit_scale=2.0)
    args = build_problem(case, torch.device("cpu"))
    reference = reference_result(args, case)
    got = fused_result(args, case, "torch")
    design = logits_rounding_floors(args, torch.bfloat16, case.grad_output, loss=case.loss, **case.options())
    error = rel_err(got[3], reference[3])
    assert error > TOLERANCE["bf16"][1] and abs(error - design[0]) < 0.1 * error, (error, design)
    floors = dtype_floors(args, case, reference)
    assert not failed_quantities(compare(got, reference, reference, "bf16", False, False, floors, design))


def test_comparison_requires_exact_zeros_by_construction():
    case = replace(a_case_with_every_term(), ignore="all")
    args = build_problem(case, torch.device("cpu"))
    reference = reference_result(args, case)
    got = fused_result(args, case, "torch")
    assert not failed_quantities(compare(got, reference, reference, "fp32", True, True))
    got[3] = got[3] + 1e-30
    result = compare(got, reference, reference, "fp32", True, True)["grad_input"]
    assert result["kind"] == "exact zero" and not result["passed"]
