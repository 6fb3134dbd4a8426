"""Side-by-side benchmark of the fused loss against the naive version, Liger-Kernel and a GEMM floor.

One process, one workload, every provider on the same tensors:

* ``ours``  - ``fused_linear_cosine_distill`` (once per chunk size / accum dtype setting asked for);
* ``ours-logits`` / ``ours-gram`` - ours with ``cosine_via`` forced to "logits" / "gram" (``ours`` picks
  between them: "auto"), checked as ours is;
* ``ours-fp8`` - the same with ``teacher_precision="fp8"`` (automatic chunk size, default accumulator),
  where the device has FP8 tensor cores;
* ``ours-fp8-quantized`` - ours-fp8's GEMMs from a teacher head quantized once before timing
  (``quantize_teacher_weight``), passed as the teacher weight: nothing cached, nothing checked;
* ``ours-unchecked`` / ``ours-fp8-unchecked`` - ours and ours-fp8 with the teacher caches reused without
  their content check (_weight_cache.py): the A/B of what that check costs;
* ``ours-metrics`` - ours asked for the student's entropy and top-1 hits too (``StudentMetrics``, as TRL's
  trainers log them): the A/B of their kernel;
* ``ours-changing-teacher`` - ours with the teacher weight's version counter moved before every call, as
  an EMA or online-distillation teacher's is (no kernel runs for it): what "auto" costs there;
* ``naive`` - ``naive_cosine_distill``: full logits and autograd;
* ``liger`` - Liger-Kernel's ``LigerFusedLinearCosineSimilarityLoss``, if it can be imported;
* ``trl`` (the JSD alone) - TRL's ``ChunkedDivergenceFunction``, the loss of its ``DistillationTrainer``: the
  generalized JSD at the same beta and temperature, without the hard term (its trainer has none), so one
  term less than the others compute;
* ``floor`` - the four GEMMs of the loss computed from both heads' logits (two in forward mode), on the
  whole T; the Gram path (_teacher_gram.py) replaces the teacher's with smaller ones and can run under it.

Mode "full" times forward + ``loss.backward()``; mode "forward" times the forward under ``no_grad``.
Each provider is timed in steady state: its own calls first run for ``settle_s`` seconds (3 on CUDA),
so that the GPU's power limiter has cut the clock as it does in a training job. Before timing, ours'
loss is checked against the naive loss at every bench size, and ours' loss and student gradients
against the naive version in float64 on a small problem. The loss errors of liger and
ours-fp8 (FP8 quantization: about 1e-3 to 1e-2) are reported for information and are not checked.
"""

import contextlib
import csv
import importlib.metadata
import inspect
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import _teacher_fp8 as fp8
from .._options import check_accum_dtype, options_of
from .._student_metrics import StudentMetrics
from .._weight_cache import Cached, WeightCache
from ..api import fused_linear_cosine_distill, fused_linear_jsd
from ..reference import NAIVE_LOSSES
from ..testing import float64_reference, naive_in_row_blocks, rel_err

PROVIDERS = ("ours", "ours-logits", "ours-gram", "ours-fp8", "ours-fp8-quantized", "ours-unchecked",
             "ours-fp8-unchecked", "ours-changing-teacher", "ours-metrics", "naive", "liger", "trl", "floor")
DEFAULT_PROVIDERS = ("ours", "ours-fp8", "naive", "liger", "floor")
LOSSES = ("cosine", "jsd")
JSD_PROVIDERS = ("ours", "ours-fp8", "ours-fp8-quantized", "ours-metrics", "naive", "liger", "trl",
                 "floor")  # with a JSD form
MODES = ("full", "forward")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# The beta and temperature the JSD rows run at (fused_linear_jsd's defaults, which ours, naive and Liger take)
JSD_DEFAULTS = {name: parameter.default for name, parameter in inspect.signature(fused_linear_jsd).parameters.items()
                if name in ("beta", "temperature")}

# Relative error above which the correctness check fails.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}

# The small problem on which ours' gradients are checked against float64.
SMALL_TOKENS, SMALL_VOCAB, SMALL_HIDDEN = 64, 1000, 64
SMALL_ERROR_KEYS = ("small_loss_rel_err", "small_grad_input_rel_err", "small_grad_weight_rel_err")

SEED = 0


@dataclass(frozen=True)
class Workload:
    tokens: tuple[int, ...]
    vocab: int
    hidden: int  # teacher
    student_hidden: int
    dtype: torch.dtype
    warmup: int
    reps: int
    rounds: int = 1  # > 1: providers timed in turn, round after round (time_providers)
    # Warm-up also lasts until a provider's own calls have kept the GPU busy this long, so that the power
    # limiter's clock is a training job's, not a light phase's (docs/design.md, The power cap).
    settle_s: float = 0.0
    loss: str = "cosine"  # or "jsd": ours, the naive version and Liger's, of the generalized JSD
    beta: float | None = None  # the JSD's, every provider's (None: fused_linear_jsd's default)

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.beta is not None and self.loss != "jsd":
            raise ValueError(f"beta is the generalized JSD's: it needs loss 'jsd', got loss {self.loss!r}")
        if self.beta is not None and not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        sizes = dict(vocab=self.vocab, hidden=self.hidden, student_hidden=self.student_hidden, reps=self.reps,
                     rounds=self.rounds)
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not self.tokens or min(self.tokens) <= 0:
            raise ValueError(f"tokens must be a non-empty list of positive counts, got {list(self.tokens)}")
        if len(set(self.tokens)) < len(self.tokens):  # each T's rows take their ratio from that T's floor
            raise ValueError(f"tokens must not repeat a count, got {list(self.tokens)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s}")

    def resized(self, vocab: int | None = None, hidden: int | None = None) -> "Workload":
        """The same workload with another vocabulary and teacher hidden size (the student's half of it)."""
        hidden = hidden or self.hidden
        return replace(self, vocab=vocab or self.vocab, hidden=hidden, student_hidden=hidden // 2)

    def describe(self) -> str:
        return (
            f"V={self.vocab} (student and teacher), teacher H={self.hidden}, student H={self.student_hidden}, "
            f"dtype={DTYPE_NAMES[self.dtype]}, T={','.join(map(str, self.tokens))}, labels uniform in [0, V) "
            f"(none ignored), warm-up {self.warmup}" + (f" and >= {self.settle_s:g} s" if self.settle_s else "")
            + f", median of {self.reps}"
            + (f" in each of {self.rounds} interleaved rounds (order rotated), then the median over rounds"
               if self.rounds > 1 else "")
            + f", seed {SEED}" + ("" if self.loss == "cosine" else f", loss {self.loss}")
            + ("" if self.beta is None else f", beta {self.beta:g}")
        )

    def loss_options(self) -> dict:
        """The loss keywords every provider takes beyond the tensors: the JSD's beta where given."""
        return {} if self.beta is None else {"beta": self.beta}


CPU_WORKLOAD = Workload(tokens=(256, 512), vocab=8192, hidden=512, student_hidden=256, dtype=torch.float32, warmup=1, reps=5)
CUDA_WORKLOAD = Workload(
    tokens=(1024, 2048, 4096, 8192), vocab=128256, hidden=4096, student_hidden=2048, dtype=torch.bfloat16, warmup=3, reps=10,
    settle_s=3.0,
)


@dataclass(frozen=True)
class OursSetting:
    chunk_size: int | None  # None: the API's automatic size
    accum_dtype: torch.dtype | None  # None: the API's default (the weight's dtype)
    label: str
    teacher_precision: str | None = None  # None: the teacher GEMM in the teacher's dtype
    cosine_via: str = "auto"
    content_check: bool = True  # False: the teacher caches skip their content check (A/B of its cost only)
    changing_teacher: bool = False  # True: the teacher weight's version moves before every call
    quantized_teacher: bool = False  # True: the teacher weight passed as Tensors.quantized_teacher's head
    loss: str = "cosine"  # or "jsd": fused_linear_jsd
    beta: float | None = None  # the JSD's (Workload.beta)
    student_metrics: bool = False  # True: each call also fills in a StudentMetrics

    def loss_options(self) -> dict:
        """The loss keywords beyond the tensors and the setting's own: the JSD's beta where given."""
        return {} if self.beta is None else {"beta": self.beta}


FP8_SETTING = OursSetting(None, None, "ours-fp8", teacher_precision="fp8")
FORCED_SETTINGS = {name: OursSetting(None, None, f"ours-{name}", cosine_via=name) for name in ("logits", "gram")}
FORCED_SETTINGS["unchecked"] = OursSetting(None, None, "ours-unchecked", content_check=False)
FORCED_SETTINGS["changing-teacher"] = OursSetting(None, None, "ours-changing-teacher", changing_teacher=True)
FORCED_SETTINGS["metrics"] = OursSetting(None, None, "ours-metrics", student_metrics=True)
FP8_UNCHECKED_SETTING = replace(FP8_SETTING, label="ours-fp8-unchecked", content_check=False)
FP8_QUANTIZED_SETTING = OursSetting(None, None, "ours-fp8-quantized", quantized_teacher=True)


@contextlib.contextmanager
def content_checks_skipped():
    """The teacher caches reused on their identity check alone, as before the content check existed."""
    original = WeightCache.check_contents
    WeightCache.check_contents = lambda self, weight, storage, entry, *args: Cached(entry.value, None)
    try:
        yield
    finally:
        WeightCache.check_contents = original


def ours_settings(chunk_sizes=None, accum_dtypes=None) -> list[OursSetting]:
    """One setting per (chunk size, accum dtype) pair; labelled "ours" when neither is swept."""
    settings = []
    for chunk_size, accum_dtype in itertools.product(chunk_sizes or [None], accum_dtypes or [None]):
        tags = []
        if chunk_sizes:
            tags.append(f"c={chunk_size or 'auto'}")
        if accum_dtypes:
            tags.append(f"acc={DTYPE_NAMES[accum_dtype]}")
        label = f"ours[{','.join(tags)}]" if tags else "ours"
        settings.append(OursSetting(chunk_size, accum_dtype, label))
    return settings


@dataclass
class BenchResult:
    header: str
    rows: list[dict]
    check_passed: bool | None  # None: no provider of ours ran whose errors are checked
    notes: list[str] = field(default_factory=list)


CHECK_VERDICTS = {True: "passed", False: "FAILED", None: "NOT RUN"}


@dataclass
class Tensors:
    student_input: torch.Tensor  # [T, Hs], requires grad
    student_weight: torch.Tensor  # [V, Hs], requires grad
    teacher_input: torch.Tensor  # [T, Ht]
    teacher_weight: torch.Tensor  # [V, Ht]
    labels: torch.Tensor  # [T]
    quantized_head: fp8.Fp8TeacherWeight | None = None  # teacher_weight's, made by the first call that asks

    def quantized_teacher(self) -> fp8.Fp8TeacherWeight:
        """teacher_weight quantized once, as a caller holding a frozen teacher would (it never changes here)."""
        if self.quantized_head is None:
            self.quantized_head = fp8.quantize_teacher_weight(self.teacher_weight)
        return self.quantized_head

    def args(self):
        return self.student_input, self.student_weight, self.teacher_input, self.teacher_weight, self.labels

    def clear_grads(self):
        self.student_input.grad = None
        self.student_weight.grad = None


def make_tensors(tokens, vocab, hidden, student_hidden, dtype, device, seed=SEED) -> Tensors:
    """Random normal hidden states, weights scaled by 1/sqrt(hidden) so logits are of order one."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)

    return Tensors(
        student_input=randn(tokens, student_hidden).requires_grad_(),
        student_weight=randn(vocab, student_hidden, scale=student_hidden**-0.5).requires_grad_(),
        teacher_input=randn(tokens, hidden),
        teacher_weight=randn(vocab, hidden, scale=hidden**-0.5),
        labels=torch.randint(0, vocab, (tokens,), generator=generator, device=device),
    )


def ours_loss(setting: OursSetting, tensors: Tensors) -> torch.Tensor:
    if setting.changing_teacher:
        torch.autograd.graph.increment_version(tensors.teacher_weight)
    if setting.loss == "jsd" and setting.cosine_via != "auto":
        raise ValueError(f"{setting.label}: the JSD has no cosine_via")
    args = list(tensors.args())
    if setting.quantized_teacher:
        args[3] = tensors.quantized_teacher()
    metrics = StudentMetrics() if setting.student_metrics else None
    with contextlib.nullcontext() if setting.content_check else content_checks_skipped():
        if setting.loss == "jsd":
            return fused_linear_jsd(*args, chunk_size=setting.chunk_size, accum_dtype=setting.accum_dtype,
                                    teacher_precision=setting.teacher_precision, student_metrics=metrics,
                                    **setting.loss_options())
        return fused_linear_cosine_distill(
            *args, chunk_size=setting.chunk_size, accum_dtype=setting.accum_dtype,
            teacher_precision=setting.teacher_precision, cosine_via=setting.cosine_via, student_metrics=metrics,
        )


# Each provider is a function (tensors, mode) -> a no-argument callable that runs one step.


def loss_provider(loss_of):
    """The provider whose step computes ``loss_of(tensors)``, and its backward in mode "full"."""
    def build(tensors: Tensors, mode: str):
        def step():
            loss = loss_of(tensors)
            if mode == "full":
                loss.backward()

        return step

    return build


def ours_provider(setting: OursSetting):
    return loss_provider(lambda tensors: ours_loss(setting, tensors))


def naive_provider(loss_name: str, options: dict):
    return loss_provider(lambda tensors: NAIVE_LOSSES[loss_name](*tensors.args(), **options)[0])


def liger_loss_of(liger_loss: torch.nn.Module, tensors: Tensors) -> torch.Tensor:
    out = liger_loss(*tensors.args(), None, None)
    return out[0] if isinstance(out, tuple) else out


def trl_loss_of(divergence, tensors: Tensors, options: dict) -> torch.Tensor:
    """TRL DistillationTrainer's loss on the bench's tensors: the per-token generalized JSD of ``divergence``
    (``ChunkedDivergenceFunction``) at fused_linear_jsd's default temperature and ``options``' beta (its default
    where none), summed and divided by the token count, as its trainer divides it."""
    x_s, w_s, x_t, w_t, _labels = tensors.args()
    per_token, _entropy = divergence.apply(x_s, w_s, None, x_t, w_t, None, options.get("beta", JSD_DEFAULTS["beta"]),
                                           JSD_DEFAULTS["temperature"])
    return per_token.sum() / per_token.shape[0]


def floor_provider(tensors: Tensors, mode: str):
    """The GEMMs alone, into outputs allocated here (so they count as inputs in the memory column)."""
    x_s, w_s = tensors.student_input.detach(), tensors.student_weight.detach()
    x_t, w_t = tensors.teacher_input, tensors.teacher_weight
    tokens, vocab = x_s.shape[0], w_s.shape[0]
    student_logits = x_s.new_empty(tokens, vocab)
    teacher_logits = x_t.new_empty(tokens, w_t.shape[0])
    if mode == "full":
        grad_logits = torch.randn(tokens, vocab, device=x_s.device).to(x_s.dtype)
        grad_input = torch.empty_like(x_s)
        grad_weight = torch.empty_like(w_s)

    def step():
        torch.mm(x_s, w_s.t(), out=student_logits)
        torch.mm(x_t, w_t.t(), out=teacher_logits)
        if mode == "full":
            torch.mm(grad_logits, w_s, out=grad_input)
            torch.mm(grad_logits.t(), x_s, out=grad_weight)

    return step


def load_release(label: str, package: str, release: str, module: str, load):
    """(load(), None) where ``package`` is installed at ``release``, else (None, why provider ``label`` is skipped);
    ``load`` imports from ``module``."""
    try:
        version = importlib.metadata.version(package)
        loaded = load()
    except (ImportError, importlib.metadata.PackageNotFoundError) as error:
        return None, f"{label} skipped: cannot import {module} ({error})"
    if version != release:
        return None, f"{label} skipped: {package} {version} is installed, the bench compares {release}"
    return loaded, None


LIGER_VERSION = "0.8.5"  # the release the ledger's liger rows are, and docs/reference.md's parity is held to
TRL_VERSION = "1.16.0"  # the release the ledger's trl rows are


def load_liger(device: torch.device, loss: str = "cosine", options=None):
    """Liger's loss module for this loss and its ``options`` (Workload.loss_options), or None with the reason if it
    cannot be imported or is another release."""
    def liger_module():
        from liger_kernel.chunked_loss import LigerFusedLinearCosineSimilarityLoss, LigerFusedLinearJSDLoss

        return LigerFusedLinearJSDLoss if loss == "jsd" else LigerFusedLinearCosineSimilarityLoss

    module, why_not = load_release("liger", "liger-kernel", LIGER_VERSION, "liger_kernel.chunked_loss", liger_module)
    return (None, why_not) if module is None else (module(compiled=device.type == "cuda", **(options or {})), None)


def load_trl_divergence():
    """TRL's ``ChunkedDivergenceFunction``, or None with the reason if it cannot be imported or is another release."""
    def divergence():
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        return ChunkedDivergenceFunction

    return load_release("trl", "trl", TRL_VERSION, "trl.kernels.chunked_divergence", divergence)


def median_ms(step, tensors: Tensors | None, device: torch.device, warmup: int, reps: int, settle_s: float = 0.0) -> float:
    """Median wall time of ``step`` in ms after at least ``warmup`` untimed calls and at least ``settle_s``
    seconds of them; the tensors' grads (if any) cleared before each call."""
    clear_grads = tensors.clear_grads if tensors is not None else lambda: None
    start = time.perf_counter()
    calls = 0
    while calls < warmup or time.perf_counter() - start < settle_s:
        clear_grads()
        step()
        calls += 1
        if device.type == "cuda" and settle_s:
            torch.cuda.synchronize(device)  # the clock measures GPU time, not queueing
    times = []
    for _ in range(reps):
        clear_grads()
        times.append(call_ms(step, device))
    return statistics.median(times)


def call_ms(step, device: torch.device) -> float:
    """Wall time of one call of ``step`` in ms: CUDA events around it, the GPU idle before it."""
    if device.type != "cuda":
        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def peak_gb_above_inputs(step, tensors: Tensors, device: torch.device) -> float | None:
    """Peak CUDA memory of one call above what was allocated before it, in GB; None off CUDA."""
    if device.type != "cuda":
        return None
    tensors.clear_grads()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 1e9


def small_problem_errors(setting: OursSetting, workload: Workload, device: torch.device) -> dict:
    """Ours' loss and student grads against the naive version on float64 copies, at T=64, V=1000, H=64."""
    tensors = make_tensors(SMALL_TOKENS, SMALL_VOCAB, SMALL_HIDDEN, SMALL_HIDDEN // 2, workload.dtype, device)
    loss = ours_loss(setting, tensors)
    loss.backward()
    (expected, _, _), (grad_input, grad_weight) = float64_reference([*tensors.args(), None, None], loss=setting.loss,
                                                                    **setting.loss_options())
    errors = (
        rel_err(loss, expected),
        rel_err(tensors.student_input.grad, grad_input),
        rel_err(tensors.student_weight.grad, grad_weight),
    )
    return dict(zip(SMALL_ERROR_KEYS, errors))


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def environment_header(device: torch.device, workload: Workload, modes: str) -> str:
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU ({torch.get_num_threads()} threads)"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"device: {device_name} | torch {torch.__version__} | triton {triton_version()} | {date} | "
        f"mode {modes} | workload: {workload.describe()}"
    )


def check_arguments(workload: Workload, providers, modes, settings) -> None:
    """ValueError for providers, modes and settings that do not make a run (before any tensor is made)."""
    if not providers:
        raise ValueError(f"providers must name at least one of {', '.join(PROVIDERS)}")
    if settings is not None and "ours" not in providers:
        raise ValueError("chunk sizes and accumulator dtypes are settings of provider 'ours': add it to the providers")
    forced = sorted(set(providers) - {"ours", "naive", "liger", "trl", "floor"})
    if settings is not None and forced:  # those run their own fixed settings: an A/B against them would compare two
        raise ValueError(f"chunk sizes and accumulator dtypes are settings of provider 'ours' alone: time {forced} "
                         "in a run without them")
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        raise ValueError(f"unknown providers {sorted(unknown)}; choose from {', '.join(PROVIDERS)}")
    if len(set(providers)) < len(providers):
        raise ValueError(f"providers must not repeat a name, got {list(providers)}")
    if "ours-gram" in providers and workload.dtype == torch.float16:  # the Gram path refuses fp16 heads
        raise ValueError("provider 'ours-gram' runs in bf16 or fp32, not fp16")
    if workload.loss != "jsd" and "trl" in providers:
        raise ValueError("provider 'trl' (TRL's chunked divergence) is the generalized JSD: time it with loss 'jsd'")
    if workload.loss == "jsd" and set(providers) - set(JSD_PROVIDERS):
        raise ValueError(f"with loss 'jsd' the providers are among {', '.join(JSD_PROVIDERS)}, got "
                         f"{sorted(set(providers) - set(JSD_PROVIDERS))}")
    if not modes or set(modes) - set(MODES) or len(set(modes)) < len(modes):
        raise ValueError(f"modes must be one or both of {MODES}, each once, got {list(modes)}")
    for setting in settings or ():  # the options' own checks, before any tensor is made
        options_of(chunk_size=setting.chunk_size, accum_dtype=setting.accum_dtype)
        check_accum_dtype(setting.accum_dtype, workload.dtype)


def run_bench(workload: Workload, device: torch.device, providers=DEFAULT_PROVIDERS, modes=("full",),
              settings=None) -> BenchResult:
    """Check ours, then time every provider in every mode at every T, on the same tensors per T; rows in
    (T, mode, provider) order."""
    check_arguments(workload, providers, modes, settings)
    loss = workload.loss
    ours_setting_list = ([replace(setting, loss=loss, beta=workload.beta) for setting in settings or ours_settings()]
                         if "ours" in providers else [])
    settings = ours_setting_list + [replace(setting, loss=loss, beta=workload.beta) for setting in
                                    FORCED_SETTINGS.values() if setting.label in providers]
    notes = []

    liger_loss = None
    if "liger" in providers:
        liger_loss, why_not = load_liger(device, loss, workload.loss_options())
        if liger_loss is None:
            notes.append(why_not)
    trl_divergence = None
    if "trl" in providers:
        trl_divergence, why_not = load_trl_divergence()
        if trl_divergence is None:
            notes.append(why_not)
    fp8_settings = []  # timed; loss error reported, not checked
    for setting in (replace(FP8_SETTING, loss=loss, beta=workload.beta),
                    replace(FP8_QUANTIZED_SETTING, loss=loss, beta=workload.beta),
                    replace(FP8_UNCHECKED_SETTING, loss=loss, beta=workload.beta)):
        if setting.label in providers:
            try:
                fp8.check_supported(device)
                fp8_settings.append(setting)
            except ValueError as error:
                notes.append(f"{setting.label} skipped: {error}")
    builders = {}  # row label -> function (tensors, mode) -> step
    for name in providers:
        if name == "ours":
            builders.update({setting.label: ours_provider(setting) for setting in ours_setting_list})
        elif name in ("ours-logits", "ours-gram", "ours-unchecked", "ours-changing-teacher", "ours-metrics"):
            builders[name] = ours_provider(next(setting for setting in settings if setting.label == name))
        elif name in [setting.label for setting in fp8_settings]:
            builders[name] = ours_provider(next(setting for setting in fp8_settings if setting.label == name))
        elif name == "naive":
            builders["naive"] = naive_provider(loss, workload.loss_options())
        elif name == "liger" and liger_loss is not None:
            builders["liger"] = loss_provider(lambda tensors: liger_loss_of(liger_loss, tensors))
        elif name == "trl" and trl_divergence is not None:
            builders["trl"] = loss_provider(lambda tensors: trl_loss_of(trl_divergence, tensors, workload.loss_options()))
        elif name == "floor":
            builders["floor"] = floor_provider

    small_errors = {setting.label: small_problem_errors(setting, workload, device) for setting in settings}
    ours_errors = [error for errors in small_errors.values() for error in errors.values()]

    rows = []
    with progress_bar(len(workload.tokens) * len(modes) * len(builders) * workload.rounds) as bar:
        for tokens in workload.tokens:
            tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)
            # checked as each mode's timed calls run: the plan depends on whether gradients are on (the Gram path,
            # the teacher's sub-chunks, the JSD's side stream)
            errors_by_mode = {mode: bench_size_errors(tensors, settings + fp8_settings, liger_loss, loss, mode == "full",
                                                      trl_divergence, workload.loss_options()) for mode in modes}
            ours_errors += [errors[setting.label] for errors in errors_by_mode.values() for setting in settings]
            for mode in modes:
                timings = time_providers(builders, tensors, device, mode, workload, notes, bar)
                for label, (milliseconds, peak_gb, round_ms) in timings.items():
                    rows.append({
                        "provider": label,
                        "T": tokens,
                        "mode": mode,
                        "median_ms": milliseconds,
                        "round_ms": round_ms,  # JSON only: each round's median
                        "ratio_to_floor": None,
                        "ratio_to_floor_by_round": None,  # with --rounds > 1
                        "peak_gb_above_inputs": peak_gb,
                        "loss_rel_err": errors_by_mode[mode].get(label),
                        **small_errors.get(label, dict.fromkeys(SMALL_ERROR_KEYS)),
                    })
            del tensors

    floors = {(row["T"], row["mode"]): row for row in rows if row["provider"] == "floor"}
    for row in rows:
        floor = floors.get((row["T"], row["mode"]))
        if floor and floor["median_ms"] and row["median_ms"] is not None:
            row["ratio_to_floor"] = row["median_ms"] / floor["median_ms"]
        # each round against the floor's same round (the clock drifts between rounds): the spread of the ratio
        if floor and len(row["round_ms"] or ()) > 1 and len(floor["round_ms"] or ()) == len(row["round_ms"]):
            if all(mine is not None and theirs for mine, theirs in zip(row["round_ms"], floor["round_ms"])):
                row["ratio_to_floor_by_round"] = [mine / theirs for mine, theirs in zip(row["round_ms"], floor["round_ms"])]

    tolerance = TOLERANCE[workload.dtype]
    check_passed = all(error <= tolerance for error in ours_errors) if ours_errors else None  # False for a NaN too
    if not ours_errors:
        notes.append("NOT CHECKED: no provider of ours ran whose errors are checked (the FP8 ones' are reported "
                     "only): add provider 'ours'")
    elif not check_passed:
        notes.append(f"CHECK FAILED: an error of ours exceeds {tolerance:g} ({DTYPE_NAMES[workload.dtype]})")
    return BenchResult(environment_header(device, workload, ", ".join(modes)), rows, check_passed, notes)


def progress_bar(total: int):
    """A tqdm bar on stderr (the table goes to stdout), or a context yielding None if tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return contextlib.nullcontext()
    return tqdm(total=total, desc="bench", unit="timing", file=sys.stderr)


def worst(*errors: float) -> float:
    """The largest error, NaN where any is (max keeps an earlier finite value over a later NaN)."""
    return math.nan if any(math.isnan(error) for error in errors) else max(errors)


def bench_size_errors(tensors: Tensors, settings, liger_loss, loss: str = "cosine", with_grads: bool = True,
                      trl_divergence=None, options=None) -> dict:
    """Each ours setting's relative error against the naive loss on fp32 copies at this size (run in row blocks, so
    that it fits wherever ours does): its loss's, and ``with_grads`` the largest of its loss's, grad_input's and
    grad_weight's, run with gradients on as the timed full mode runs it; Liger's loss error beside them, and TRL's
    against the naive soft term; ``options`` the loss keywords of the naive version and TRL's
    (Workload.loss_options)."""
    with torch.set_grad_enabled(with_grads):
        (naive_loss, naive_soft, _), naive_grads = naive_in_row_blocks([*tensors.args(), None, None], torch.float32,
                                                                       loss=loss, **(options or {}))
        errors = {}
        for setting in settings:
            tensors.clear_grads()
            got = ours_loss(setting, tensors)
            errors[setting.label] = rel_err(got, naive_loss)
            if with_grads:
                got.backward()
                errors[setting.label] = worst(errors[setting.label], rel_err(tensors.student_input.grad, naive_grads[0]),
                                              rel_err(tensors.student_weight.grad, naive_grads[1]))
        tensors.clear_grads()
        if liger_loss is not None:
            with torch.no_grad():
                errors["liger"] = rel_err(liger_loss_of(liger_loss, tensors), naive_loss)
        if trl_divergence is not None:
            with torch.no_grad():
                errors["trl"] = rel_err(trl_loss_of(trl_divergence, tensors, options or {}), naive_soft)
    return errors


def round_order(items: list, round_index: int) -> list:
    """The items as round ``round_index`` runs them: each round starts one item later, so that none always runs first
    (the clock drifts over a run)."""
    shift = round_index % len(items) if items else 0
    return items[shift:] + items[:shift]


def time_providers(builders, tensors: Tensors, device, mode, workload: Workload, notes, bar) -> dict:
    """label -> (median ms, peak GB above inputs, each round's median ms); (None, None, rounds so far) and
    a note for one that runs out of memory.

    Each round times every provider in turn (median of ``reps`` calls, after ``warmup`` calls in the
    first round, one in later rounds, and ``settle_s`` seconds of calls in every round); a provider's
    time is the median over rounds of its round medians. With several rounds, clocks that drift over
    a run (docs/benchmarks.md) drift under every provider alike, and each round starts one provider later in the list, so that no
    provider is always the one timed first."""
    steps, times = {}, {label: [] for label in builders}
    timings = {label: (None, None, times[label]) for label in builders}
    for round_index in range(workload.rounds):
        last_round = round_index == workload.rounds - 1
        for label, build in round_order(list(builders.items()), round_index):
            if bar is not None:
                bar.update()
            if round_index > 0 and label not in steps:  # it ran out of memory in an earlier round
                continue
            try:
                if round_index == 0:  # built when first timed: a round allocates provider after provider
                    step = build(tensors, mode)
                    steps[label] = torch.no_grad()(step) if mode == "forward" else step
                warmup = workload.warmup if round_index == 0 else min(1, workload.warmup)
                times[label].append(median_ms(steps[label], tensors, device, warmup, workload.reps, workload.settle_s))
                if last_round:
                    timings[label] = (statistics.median(times[label]), peak_gb_above_inputs(steps[label], tensors, device),
                                      times[label])
            except torch.OutOfMemoryError:
                notes.append(f"{label} ran out of memory at T={tensors.labels.numel()}")
                steps.pop(label, None)
            finally:
                tensors.clear_grads()
    return timings


TABLE_COLUMNS = (  # (row key, heading, format string or function)
    ("provider", "provider", "{}"),
    ("T", "T", "{}"),
    ("mode", "mode", "{}"),
    ("median_ms", "median ms", "{:.2f}"),
    ("ratio_to_floor", "x floor", "{:.2f}"),
    ("ratio_to_floor_by_round", "x floor by round", lambda ratios: " / ".join(f"{ratio:.2f}" for ratio in ratios)),
    ("peak_gb_above_inputs", "peak GB above inputs", "{:.2f}"),
    ("loss_rel_err", "err vs naive", "{:.1e}"),
    ("small_loss_rel_err", "small: loss err", "{:.1e}"),
    ("small_grad_input_rel_err", "small: grad_input err", "{:.1e}"),
    ("small_grad_weight_rel_err", "small: grad_weight err", "{:.1e}"),
)


def markdown_table(result: BenchResult) -> str:
    """The header line, the rows as a Markdown table ("-" where a value does not apply), the check and notes."""
    lines = [
        result.header,
        "",
        "| " + " | ".join(heading for _, heading, _ in TABLE_COLUMNS) + " |",
        "|" + "|".join("---" if key in ("provider", "mode") else "---:" for key, _, _ in TABLE_COLUMNS) + "|",
    ]
    for row in result.rows:
        cells = ("-" if row[key] is None else fmt(row[key]) if callable(fmt) else fmt.format(row[key])
                 for key, _, fmt in TABLE_COLUMNS)
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"check: {CHECK_VERDICTS[result.check_passed]} (err vs naive at each T and mode, against the naive "
        "version in fp32, run as the timed mode runs: ours' the largest of the loss's, grad_input's and grad_weight's "
        "in full mode, the loss's in forward; liger's and trl's their loss's; ours-fp8's, as ours', for information "
        f"only; small = T={SMALL_TOKENS}, V={SMALL_VOCAB}, H={SMALL_HIDDEN}, student H={SMALL_HIDDEN // 2} against "
        "float64)",
        *result.notes,
    ]
    return "\n".join(lines) + "\n"


LEDGER_COLUMNS = ("date", "commit", "gpu", "torch", "triton", "workload", "mode", "T", "provider", "ms",
                  "ratio_to_floor", "ratio_to_floor_by_round", "peak_gb_above_inputs", "command")


def source_commit(ledger: str | None = None) -> str:
    """The commit measured: $COSDISTILL_COMMIT (set where the tree was copied without its .git, by whoever copied
    it), else git's HEAD, "-dirty" where any file of the repository differs from it but ``ledger``, the tracked
    ledger this run appends to (the benchmark scripts and the build files measure too). An installed package (no
    source checkout of its own around it) records its version instead: a repository around site-packages is
    someone else's."""
    if os.environ.get("COSDISTILL_COMMIT"):
        return os.environ["COSDISTILL_COMMIT"]
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=package, check=True).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if os.path.realpath(os.path.join(top, "src", "cosdistill")) != os.path.realpath(package):
            return installed_version()
        excluded = [] if ledger is None else [f":(top,exclude){os.path.relpath(os.path.realpath(ledger), top)}"]
        changed = git("status", "--porcelain", "--untracked-files=all", "--", ":(top)", *excluded)
        return git("rev-parse", "--short=7", "HEAD") + ("-dirty" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return installed_version()


def installed_version() -> str:
    try:
        return f"v{importlib.metadata.version('cosdistill')}"
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


PROJECT_LEDGER = Path(__file__).resolve().parents[3] / "benchmarks" / "results.csv"  # in a source checkout


def check_ledger_path(path: str, on_gpu: bool, rounds: int | None = None) -> None:
    """ValueError where a run's rows must not go to the ledger at path: under two ``rounds`` (the ledger's figures
    are medians over providers timed in turn; None: a script that times no rounds), or the project's ledger off a
    GPU (it holds GPU timings, and a CPU run's rows would show in its tables beside them)."""
    if rounds is not None and rounds < 2:
        raise ValueError(f"--ledger needs --rounds >= 2, got {rounds}")
    if not on_gpu and PROJECT_LEDGER.exists() and os.path.exists(path) and os.path.samefile(path, PROJECT_LEDGER):
        raise ValueError(f"--ledger {path} is the project's ledger of GPU timings: a run off the GPU writes its rows "
                         "to another file")


def append_ledger_rows(path: str, gpu: str, workload: str, rows, command: str) -> None:
    """Appends rows to the ledger at path, its header first if the file is new: each row's (mode, T, provider,
    ms, ratio to the floor, per-round values, peak GB), between today's date, the commit, the GPU and the
    versions, and the command. Every script that measures writes through here; a CPU run's ``gpu`` ends in
    "cpu"."""
    check_ledger_path(path, on_gpu=not gpu.endswith("cpu"))
    fresh = not os.path.exists(path) or os.path.getsize(path) == 0
    prefix = [datetime.now(timezone.utc).strftime("%Y-%m-%d"), source_commit(path), gpu, torch.__version__,
              triton_version(), workload]
    with open(path, "a", newline="") as file:
        writer = csv.writer(file)
        if fresh:
            writer.writerow(LEDGER_COLUMNS)
        writer.writerows(prefix + list(row) + [command] for row in rows)


def append_to_ledger(result: BenchResult, workload: Workload, device: torch.device, path: str, command: str):
    """One CSV row per timed (T, mode, provider), appended to the ledger at path (its header first if new)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = (f"V={workload.vocab} H={workload.hidden} Hs={workload.student_hidden} "
             f"{DTYPE_NAMES[workload.dtype]} rounds={workload.rounds}")
    if workload.loss != "cosine":
        shape += f" loss={workload.loss}"
    if workload.beta is not None and workload.beta != JSD_DEFAULTS["beta"]:  # the default's rows name none
        shape += f" beta={workload.beta:g}"
    rows = [
        (row["mode"], row["T"], row["provider"], f"{row['median_ms']:.4f}",
         "" if row["ratio_to_floor"] is None else f"{row['ratio_to_floor']:.4f}",
         " ".join(f"{ratio:.4f}" for ratio in row["ratio_to_floor_by_round"] or ()),
         "" if row["peak_gb_above_inputs"] is None else f"{row['peak_gb_above_inputs']:.3f}")
        for row in result.rows if row["median_ms"] is not None
    ]
    append_ledger_rows(path, gpu, shape, rows, command)


def write_json(result: BenchResult, path: str):
    with open(path, "w") as file:
        json.dump(asdict(result), file, indent=2)


def write_plot(result: BenchResult, path: str):
    """A PNG: median ms vs T per provider (log-log), and each provider's time as % of the floor's vs T; with
    both modes, the no-grad forward dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    times, percent_of_floor = figure.subplots(1, 2)
    tokens = sorted({row["T"] for row in result.rows})
    modes = list(dict.fromkeys(row["mode"] for row in result.rows))
    for (index, provider), mode in itertools.product(enumerate(dict.fromkeys(row["provider"] for row in result.rows)), modes):
        style = dict(marker="o", color=f"C{index}", linestyle="--" if mode == "forward" else "-",
                     label=provider if len(modes) == 1 else f"{provider} ({mode})")  # one colour per provider
        timed = [row for row in result.rows
                 if row["provider"] == provider and row["mode"] == mode and row["median_ms"] is not None]
        times.plot([row["T"] for row in timed], [row["median_ms"] for row in timed], **style)
        against_floor = [row for row in timed if row["ratio_to_floor"] is not None]
        if provider != "floor" and against_floor:
            percents = [100 * row["ratio_to_floor"] for row in against_floor]
            percent_of_floor.plot([row["T"] for row in against_floor], percents, **style)
    percent_of_floor.axhline(100, color="gray", linestyle="--", label="floor")
    times.set(yscale="log", ylabel="median time (ms)", title="time")
    percent_of_floor.set(ylabel="time (% of floor)", title="time relative to the GEMM floor")
    for axes in (times, percent_of_floor):
        axes.set_xscale("log", base=2)
        axes.set_xticks(tokens, [str(t) for t in tokens])
        axes.set_xticks([], minor=True)
        axes.set_xlabel("tokens T")
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle(textwrap.fill(result.header, 160), fontsize=9)
    figure.savefig(path, dpi=120)
