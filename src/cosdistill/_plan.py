"""Options checked and turned into one ``Plan`` for a call: which backend (_backends.py), which teacher
side (its bf16 logits, its FP8 logits or the Gram matrices), how many rows per chunk, the normaliser.
The eager function and module (api.py) and the torch.compile op (_compile.py) all build the plan here
and run it with ``run``.
"""

import dataclasses
import functools
import math
import numbers
import operator
import struct
from collections.abc import Callable
from typing import Protocol

import torch

from . import _teacher_fp8, _teacher_gram
from ._backends import IMPLS, TORCH, Backend, backend_for
from ._chunk_loop import ChunkResult, ChunkRows, chunked_loss_and_grads, start_student_logits
from ._device import HostCopy
from ._labels import LabelCounts
from ._row_step import RowStepImpl, RowStepScales
from ._teacher_logits import LogitsTeacher, SideStream, TeacherHead

COSINE_VIA = ("auto", "logits", "gram")
LOSSES = ("cosine", "jsd")  # the soft term: cosine similarity (_row_step.py) or generalized JSD (_row_step_jsd.py)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REAL_OPTIONS = ("weight_hard_loss", "weight_soft_loss", "beta", "temperature", "student_logit_scale",
                "teacher_logit_scale")
SOFTCAPS = ("student_softcap", "teacher_softcap")  # real numbers, or None


def is_real_scalar_tensor(value) -> bool:
    """A one-element tensor of a real dtype (not bool, not complex): read on the host, a number."""
    return torch.is_tensor(value) and value.numel() == 1 and not (value.dtype.is_complex or value.dtype == torch.bool)


def check_finite_real(name: str, value) -> None:
    """TypeError unless ``value`` is a real number (a one-element real tensor counts, read on the host), ValueError
    unless finite: a string or a NaN would otherwise reach the row step's constants as a number."""
    is_tensor = torch.is_tensor(value)
    if isinstance(value, bool) or not (is_real_scalar_tensor(value) or (not is_tensor and isinstance(value, numbers.Real))):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    number = float(value) if is_tensor else value
    if not -math.inf < number < math.inf:  # comparisons, not math.isfinite: torch.compile traces them
        raise ValueError(f"{name} must be finite, got {number}")


class VocabParallel(Protocol):
    """Both LM heads split along the vocabulary over ranks: this rank holds the teacher's rows
    [start, stop) and the student's rows from start up to min(stop, vocab_student).
    ``cosdistill.distributed.VocabParallelOptions`` implements it with torch.distributed."""

    start: int
    stop: int
    vocab_student: int  # the student's whole vocabulary
    vocab_teacher: int | None  # the teacher's whole vocabulary, where known: the shards must cover it

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...  # [ranks, *tensor.shape]

    def all_reduce(self, tensor: torch.Tensor) -> None: ...  # sum, in place


@dataclasses.dataclass(frozen=True)
class Options:
    """The loss's options (api.fused_linear_cosine_distill documents each), checked when made: a module
    checks them once, when it is built."""

    weight_hard_loss: float = 0.5
    weight_soft_loss: float = 0.5
    beta: float = 0.5
    ignore_index: int = -100
    temperature: float = 1.0
    chunk_size: int | None = None
    accum_dtype: torch.dtype | None = None
    impl: str = "auto"
    teacher_precision: str | None = None
    student_softcap: float | None = None
    teacher_softcap: float | None = None
    student_logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    cosine_via: str = "auto"
    loss: str = "cosine"

    def __post_init__(self):
        for name in REAL_OPTIONS:
            check_finite_real(name, getattr(self, name))
        if isinstance(self.ignore_index, bool) or not _is_integer(self.ignore_index):
            raise TypeError(f"ignore_index must be an int, got {type(self.ignore_index).__name__} {self.ignore_index!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        for name in SOFTCAPS:
            cap = getattr(self, name)
            if cap is not None:
                check_finite_real(name, cap)
                if not cap > 0:
                    raise ValueError(f"{name} must be > 0 or None, got {cap}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                           or self.chunk_size <= 0):
            raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if self.accum_dtype not in (None, *FLOAT_DTYPES):
            raise TypeError(f"accum_dtype must be None, torch.float32 or the student weight's dtype, got {self.accum_dtype}")
        if self.teacher_precision not in (None, "fp8"):
            raise ValueError(f"teacher_precision must be None or 'fp8', got {self.teacher_precision!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.cosine_via not in COSINE_VIA:
            raise ValueError(f"cosine_via must be one of {COSINE_VIA}, got {self.cosine_via!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.loss == "jsd":
            if not 0.0 <= self.beta <= 1.0:
                raise ValueError(f"beta must be in [0, 1] for the generalized JSD, got {self.beta}")
            if self.cosine_via == "gram":
                raise ValueError("loss='jsd' does not take cosine_via='gram': the divergence needs the teacher's logits")

    @functools.cached_property  # read at every call; a frozen dataclass's __dict__ can still hold it
    def scales(self) -> RowStepScales:
        """The row step's constants."""
        optional = lambda value: None if value is None else float(value)  # noqa: E731
        return RowStepScales(
            float(self.weight_hard_loss), float(self.weight_soft_loss), float(self.beta), float(self.temperature),
            int(self.ignore_index), student_softcap=optional(self.student_softcap),
            teacher_softcap=optional(self.teacher_softcap), student_logit_scale=float(self.student_logit_scale),
            teacher_logit_scale=float(self.teacher_logit_scale),
        )


def _is_integer(value) -> bool:
    try:
        operator.index(value)  # ints, NumPy's and one-element integer tensors; not floats
    except TypeError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one call runs, decided from the options and the tensors' shapes, dtypes and device (and, for
    "auto", whether the teacher's Gram matrix is cached), never from their values."""

    options: Options
    backend: Backend
    row_step: RowStepImpl  # the backend's for the loss
    scales: RowStepScales  # the row step's constants (with the vocabulary split's, if any)
    teacher: str  # "logits", "fp8" or "gram"
    rows: ChunkRows
    needs_grad: tuple[bool, bool, bool]  # input, weight, bias
    accum_dtype: torch.dtype
    vocab_parallel: VocabParallel | None
    fall_back: bool  # on the Gram path: run on the logits path where its range check fails (else raise)
    side_stream: bool = False  # the row steps beside the teacher GEMMs (``row_step_beside_gemms``)


def make_plan(options: Options, student_weight, student_bias, teacher_weight, teacher_bias, num_tokens: int,
              needs_grad, vocab_parallel: VocabParallel | None = None, teacher_gram_cached: bool | None = None) -> Plan:
    """The plan for checked tensors. ``teacher_gram_cached``: see ``gram_applies``."""
    check_accum_dtype(options.accum_dtype, student_weight.dtype)
    backend = backend_for(options.impl, student_weight.device)
    row_step = backend.jsd_row_step if options.loss == "jsd" else backend.row_step
    fp8 = options.teacher_precision == "fp8" or isinstance(teacher_weight, _teacher_fp8.Fp8TeacherWeight)
    if fp8:
        _teacher_fp8.check_supported(teacher_weight.device)
    teacher = "fp8" if fp8 else "logits"
    if gram_applies(options, student_weight, student_bias, teacher_weight, teacher_bias, num_tokens, needs_grad,
                    vocab_parallel, teacher_gram_cached):
        teacher = "gram"
    vocab_student, vocab_teacher, scales = student_weight.shape[0], teacher_weight.shape[0], options.scales
    if vocab_parallel is not None:  # the whole student vocabulary sizes the chunks: every rank runs as many
        vocab_student = vocab_teacher = vocab_parallel.vocab_student
        scales = dataclasses.replace(scales, vocab_start=vocab_parallel.start, vocab_student_total=vocab_student)
    rows = chunk_rows(options.chunk_size, num_tokens, vocab_student, 0 if teacher == "gram" else vocab_teacher,
                      student_weight.element_size(), write_grad=any(needs_grad))
    side_stream = row_step_beside_gemms(options.loss, backend, student_weight.device, teacher, rows, num_tokens,
                                        vocab_student, vocab_teacher, student_weight.element_size(), vocab_parallel)
    return Plan(options, backend, row_step, scales, teacher, rows, tuple(needs_grad),
                options.accum_dtype or default_accum_dtype(student_weight.dtype), vocab_parallel,
                fall_back=options.cosine_via == "auto", side_stream=side_stream)


# Plans of earlier calls by signature (``checked_plan``); cleared when full, so a process that keeps changing
# shapes holds a bounded number.
_plans: dict[tuple, Plan] = {}
MAX_PLANS = 64


def checked_plan(options: Options, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                 student_bias=None, teacher_bias=None, num_valid_tokens=None, vocab_parallel=None) -> Plan:
    """``check_tensors`` then ``make_plan`` (then a vocabulary split's ``check_vocab_parallel``) for an eager call, skipped for
    a call whose signature, everything they read, matches an earlier call's: on an idle GPU their host time
    comes before the first GEMM (docs/design.md, Host latency). Where "auto" weighs the teacher's cached Gram
    matrix, its state is asked at every call and is part of the key."""
    tensors = (student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias)
    signature = _call_signature(options, tensors, num_valid_tokens, vocab_parallel)
    gram_cached = None
    if signature is not None and _weighs_gram_cache(options, student_weight, student_bias, teacher_weight,
                                                    teacher_bias, vocab_parallel):
        gram_cached = _teacher_gram.teacher_grams.will_hold(teacher_weight)
    key = None if signature is None else (*signature, gram_cached)
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        return plan
    check_tensors(*tensors, options.ignore_index, num_valid_tokens)
    needs_grad = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad
                       for t in (student_input, student_weight, student_bias))
    plan = make_plan(options, student_weight, student_bias, teacher_weight, teacher_bias, true_labels.numel(),
                     needs_grad, vocab_parallel, gram_cached)
    if vocab_parallel is not None:
        check_vocab_parallel(plan, true_labels.numel(), student_weight.dtype, true_labels.device,
                             vocab_parallel_shard_error(vocab_parallel, student_weight, teacher_weight))
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def _call_signature(options: Options, tensors, num_valid_tokens, vocab_parallel) -> tuple | None:
    """What check_tensors and make_plan read of a call: the options, whether gradients are on, whether
    num_valid_tokens passes, each tensor's type, shape, dtype, device and requires_grad. None where they must run:
    a vocabulary split (an object the plan holds, which may change), an argument that is not a tensor. The
    options go in by identity, cheaper than hashing their fields: the plan holds them, so their id stays theirs
    while it is kept."""
    if vocab_parallel is not None:
        return None
    if num_valid_tokens is None:
        count = None
    elif isinstance(num_valid_tokens, torch.Tensor):  # check_tensors reads its shape and dtype, not its value
        count = ("tensor", num_valid_tokens.shape, num_valid_tokens.dtype)
    elif isinstance(num_valid_tokens, (int, float)) and not isinstance(num_valid_tokens, bool):
        count = float(num_valid_tokens)
    else:
        return None
    signature = [id(options), torch.is_grad_enabled(), count]
    for tensor in tensors:
        if tensor is not None and not isinstance(tensor, (torch.Tensor, _teacher_fp8.Fp8TeacherWeight)):
            return None
        signature.append(None if tensor is None else
                         (type(tensor), tensor.shape, tensor.dtype, tensor.device, tensor.requires_grad))
    return tuple(signature)


def row_step_beside_gemms(loss: str, backend: Backend, device: torch.device, teacher: str, rows: ChunkRows,
                          num_tokens: int, vocab_student: int, vocab_teacher: int, itemsize: int,
                          vocab_parallel: VocabParallel | None) -> bool:
    """Whether the row steps run on a second stream beside the teacher GEMMs (_teacher_logits.SideStream): for
    the JSD's kernels on CUDA, with teacher logits in more than one sub-chunk, where their second buffer fits the
    hard budget, and without a vocabulary split, whose row step's collectives stay on the caller's stream. Not
    for the cosine loss: its lighter row step gained within the noise, for a peak at Liger's (docs/design.md,
    Chunking and buffers). Not for impl="torch": its row-sized temporaries would be cached for the second
    stream apart from the caller's."""
    if loss != "jsd" or backend is TORCH or device.type != "cuda" or teacher == "gram" or vocab_parallel is not None:
        return False
    if num_tokens <= rows.teacher:
        return False
    return rows.student * vocab_student * itemsize + 2 * rows.teacher * vocab_teacher * itemsize <= MAX_BUFFER_BYTES


def run(plan: Plan, student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, labels,
        num_valid_tokens=None) -> ChunkResult:
    """The loss and, for grad_output = 1, the gradients the plan asks for. 2-D inputs, 1-D labels."""
    # The GPU starts on the first chunk's student GEMM before the teacher side's set-up, whose host time
    # (and any cached teacher copy's check) it then covers.
    student_logits = start_student_logits(student_input, student_weight, student_bias, plan.rows)
    backend, scales = plan.backend, plan.scales
    row_step, reduce_grad_input, split = plan.row_step.step, None, None
    if plan.vocab_parallel is not None:
        split = SplitCheckedFirst(plan.vocab_parallel, functools.partial(
            queue_hash_check, plan.vocab_parallel, student_input, teacher_input, labels))
        row_step, reduce_grad_input = plan.row_step.over_ranks(split.all_gather), split.all_reduce
    side = SideStream(student_input.device) if plan.side_stream else None
    if plan.teacher == "gram":
        teacher = _teacher_gram.GramTeacher(teacher_weight, student_weight, backend, scales,
                                            write_grad_weight=plan.needs_grad[1])
    elif plan.teacher == "fp8":
        # The copy's content check rides on the first row step where it can take the weight's hash along.
        hashing_step = plan.row_step.hashing_step if plan.vocab_parallel is None else None
        head = _teacher_fp8.Fp8TeacherHead(teacher_weight, teacher_bias, plan.rows.student, backend,
                                           hash_later=hashing_step is not None)
        teacher = LogitsTeacher(head, row_step, scales, plan.rows, side, hashing_step, backend.fingerprint)
    else:
        teacher = LogitsTeacher(TeacherHead(teacher_weight, teacher_bias), row_step, scales, plan.rows, side)
    normaliser = LabelCounts(labels, scales.ignore_index, scales.vocab_student_total or student_weight.shape[0],
                             num_valid_tokens, backend, scales.weight_hard, scales.weight_soft)
    if split is not None:
        normaliser = HashesReadFirst(normaliser, split)
    try:
        return chunked_loss_and_grads(
            student_input, student_weight, student_bias, teacher_input, teacher, labels, normaliser, plan.rows,
            plan.needs_grad, plan.accum_dtype, backend.scale_unless_one, reduce_grad_input, student_logits,
        )
    except _teacher_gram.GramOutOfRange:
        if not plan.fall_back:
            raise ValueError(
                "cosine_via='gram': this call's hidden states and heads are too large for the Gram path's fp32 "
                f"products (their bound passes {_teacher_gram.RANGE_LIMIT:.3g}); use cosine_via='logits' or 'auto'"
            ) from None
        logits_plan = make_plan(dataclasses.replace(plan.options, cosine_via="logits"), student_weight, student_bias,
                                teacher_weight, teacher_bias, len(labels), plan.needs_grad, plan.vocab_parallel)
        return run(logits_plan, student_input, student_weight, student_bias, teacher_input, teacher_weight,
                   teacher_bias, labels, num_valid_tokens)


def gram_applies(options: Options, student_weight, student_bias, teacher_weight, teacher_bias, num_tokens,
                 needs_grad, vocab_parallel, teacher_gram_cached: bool | None = None) -> bool:
    """Whether the call takes the Gram path: cosine_via="gram" (raising where it cannot run), or "auto" where
    it can and costs fewer FLOPs. ``teacher_gram_cached``: the Gram cache's ``will_hold`` for the teacher, where
    the caller asked it already; None: asked here."""
    if options.cosine_via == "logits" or options.loss != "cosine":
        return False
    blocked = _gram_blockers(options, student_weight, student_bias, teacher_weight, teacher_bias, vocab_parallel)
    if blocked and options.cosine_via == "gram":
        raise ValueError(f"cosine_via='gram' cannot run with {' and '.join(blocked)}: use cosine_via='logits' or 'auto'")
    if blocked:
        return False
    (vocab_student, hidden_student), (vocab_teacher, hidden_teacher) = student_weight.shape, teacher_weight.shape
    if options.cosine_via == "gram":
        return True
    if teacher_gram_cached is None:
        teacher_gram_cached = _teacher_gram.teacher_grams.will_hold(teacher_weight)
    return _teacher_gram.gram_is_cheaper(num_tokens, vocab_student, vocab_teacher, hidden_student, hidden_teacher,
                                         write_grad_weight=needs_grad[1], teacher_gram_cached=teacher_gram_cached)


def _weighs_gram_cache(options: Options, student_weight, student_bias, teacher_weight, teacher_bias,
                       vocab_parallel) -> bool:
    """Whether ``gram_applies`` weighs the teacher's Gram cache: "auto" on the cosine loss where nothing blocks
    the Gram path."""
    return options.loss == "cosine" and options.cosine_via == "auto" and not _gram_blockers(
        options, student_weight, student_bias, teacher_weight, teacher_bias, vocab_parallel)


def _gram_blockers(options: Options, student_weight, student_bias, teacher_weight, teacher_bias,
                   vocab_parallel) -> list[str]:
    """What keeps this call off the Gram path, named for the error (empty: nothing)."""
    blockers = (
        ("a student_bias or teacher_bias", student_bias is not None or teacher_bias is not None),
        ("a softcap", options.student_softcap is not None or options.teacher_softcap is not None),
        ("teacher_precision='fp8'", options.teacher_precision is not None),
        ("an Fp8TeacherWeight", isinstance(teacher_weight, _teacher_fp8.Fp8TeacherWeight)),
        ("vocab_parallel", vocab_parallel is not None),
        ("", student_weight.dtype == torch.float16 or teacher_weight.dtype != student_weight.dtype),
    )
    named = [name for name, present in blockers if present]
    # The dtypes' name is formatted only when it is needed: this runs at every call.
    return [name or f"{student_weight.dtype} and {teacher_weight.dtype} weights (bf16 or fp32, both alike)"
            for name in named]


def check_accum_dtype(accum_dtype, weight_dtype: torch.dtype) -> None:
    """The accumulator against the student weight's dtype (the options alone check the rest)."""
    if accum_dtype not in (None, torch.float32, weight_dtype):
        raise TypeError(f"accum_dtype must be None, torch.float32 or student_weight's dtype {weight_dtype}, "
                        f"got {accum_dtype}")


def default_accum_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """grad_weight's accumulator when accum_dtype is None: the weight's dtype, except fp16, whose
    partial sums (d loss / d logits times hidden, over N, before grad_output -- a loss scale -- can
    lift them) fall into its subnormals; bf16 has fp32's exponent range."""
    return torch.float32 if weight_dtype == torch.float16 else weight_dtype


@functools.lru_cache(maxsize=64, typed=True)  # typed: 1024.0 == 1024, but only the int is a chunk_size
def _checked(**fields) -> Options:
    return Options(**fields)


def options_of(**fields) -> Options:
    """``Options(**fields)``, one object per distinct set of values: the loss function, called with the same
    keywords at every step, checks them and builds the row step's constants once."""
    try:
        hash(tuple(fields.values()))
    except TypeError:  # an unhashable value: Options names the argument
        return Options(**fields)
    return _checked(**fields)


# At least 1024 rows per chunk: each chunk's grad_weight GEMM reads and writes the whole grad_weight,
# and below ~1024 rows that traffic shows (V = 262144 at 512 rows: 1.34x the floor, at 1024: 1.25x).
# More rows while the two logits buffers stay small (small vocabularies: V = 32000's bare chunk loop
# ran 1.02x the floor at 4096 rows, 1.05x at 2048), and fewer than 1024 only past a
# hard budget. The seed vocabulary's chunks are set by the rules below, not by this one.
MIN_PREFERRED_ROWS = 1024
SMALL_BUFFER_BYTES = 512 * 2**20  # grow the chunk up to this...
MAX_BUFFER_BYTES = 5 * 2**28  # ...and shrink it below MIN_PREFERRED_ROWS only past this (1.25 GiB)
CHUNK_MULTIPLE = 64
# The student's chunk (its logits GEMM and the two gradient GEMMs) this long where the hard budget
# allows, the teacher's logits computed in sub-chunks: the gradient GEMMs cost less per token at 2048
# rows (the grad_weight traffic per chunk halves), for a larger student buffer only. The
# teacher's sub-chunks shrink to MIN_TEACHER_ROWS first to make room (V = 262144: 2048 / 512 ran 3%
# faster than 1024 / 1024; docs/design.md, Chunking and buffers).
MIN_STUDENT_ROWS = 2048
MIN_TEACHER_ROWS = 512


def _budget_rows(row_bytes: int) -> int:
    rows = max(MIN_PREFERRED_ROWS, SMALL_BUFFER_BYTES // row_bytes)
    return min(rows, max(CHUNK_MULTIPLE, MAX_BUFFER_BYTES // row_bytes)) // CHUNK_MULTIPLE * CHUNK_MULTIPLE


@functools.lru_cache(maxsize=256)  # a pure function of its arguments, called every step: ~10 us of host time
def chunk_rows(chunk_size: int | None, num_tokens: int, vocab_student: int, vocab_teacher: int,
               itemsize: int, write_grad: bool = True) -> ChunkRows:
    """Rows per chunk: ``chunk_size`` for both heads if given, else from T, the vocabularies and the
    budgets above (docs/design.md, Chunking and buffers). Without gradients (no grad_weight buffer) the teacher's
    sub-chunks grow to the student's chunk where both buffers fit the hard budget: fewer teacher
    GEMMs, each reading the whole teacher weight."""
    if chunk_size is not None:
        rows = max(1, min(chunk_size, num_tokens))
        return ChunkRows(rows, rows)
    student_row, teacher_row = max(1, vocab_student * itemsize), max(1, vocab_teacher * itemsize)
    teacher = _budget_rows(student_row + teacher_row)
    student = max(teacher, MIN_STUDENT_ROWS)
    room = (MAX_BUFFER_BYTES - student * student_row) // teacher_row // CHUNK_MULTIPLE * CHUNK_MULTIPLE
    if room >= MIN_TEACHER_ROWS:  # the long student chunk fits, with teacher sub-chunks of at most `room` rows
        teacher = min(teacher, room)
    else:  # student rows within what the teacher's buffer leaves of the hard budget
        student_cap = (MAX_BUFFER_BYTES - teacher * teacher_row) // student_row
        student = max(teacher, min(MIN_STUDENT_ROWS, student_cap) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    student = max(1, min(student, num_tokens))
    if not write_grad and student * (student_row + teacher_row) <= MAX_BUFFER_BYTES:
        teacher = student
    return ChunkRows(student, min(teacher, student))


def vocab_parallel_shard_error(vocab_parallel: VocabParallel, student_weight, teacher_weight) -> ValueError | None:
    """The error in this rank's shards against its split, if any (host only: no collective)."""
    start, stop, vocab_student = vocab_parallel.start, vocab_parallel.stop, vocab_parallel.vocab_student
    student_rows = max(0, min(stop, vocab_student) - start)
    if not 0 <= start < stop:
        return ValueError(f"vocab_parallel needs 0 <= start < stop, got start={start}, stop={stop}")
    if teacher_weight.shape[0] != stop - start or student_weight.shape[0] != student_rows:
        return ValueError(
            f"vocab_parallel rows [{start}, {stop}) with vocab_student={vocab_student} need a teacher_weight shard "
            f"of {stop - start} rows and a student_weight shard of {student_rows} rows, got "
            f"{tuple(teacher_weight.shape)} and {tuple(student_weight.shape)}"
        )
    return None


def check_vocab_parallel(plan: Plan, num_tokens: int, dtype: torch.dtype, device: torch.device,
                         shard_error: ValueError | None) -> None:
    """One all-gather of what the host knows of the call, read at once, before its first GEMM: every rank raises
    unless the ranks' teacher rows tile [0, Vt) and they agree on the vocabularies, the options and all that sizes
    the collectives to come (tokens, rows per chunk, the soft term, dtype, gradients asked for), so that none
    waits in a collective the others skip. A rank whose shards are wrong (``shard_error``) raises its own error,
    the others name it. The hidden states and labels, which the host does not hold, follow (``queue_hash_check``)."""
    split, options = plan.vocab_parallel, plan.options
    values = [split.start, split.stop, shard_error is not None, split.vocab_student,
              -1 if split.vocab_teacher is None else split.vocab_teacher, num_tokens, plan.rows.student,
              LOSSES.index(options.loss), FLOAT_DTYPES.index(dtype), sum(bit << i for i, bit in enumerate(plan.needs_grad)),
              *(bits_of_float(-1.0 if value is None else float(value)) for value in dataclasses.astuple(options.scales))]
    ranks = split.all_gather(torch.tensor(values, dtype=torch.int64, device=device)).tolist()
    if shard_error is not None:
        raise shard_error
    _check_ranks_agree([dict(zip(RANK_COLUMNS, rank)) for rank in ranks], split.vocab_teacher)


RANK_COLUMNS = ("start", "stop", "wrong shards", "vocab_student", "vocab_teacher", "the number of tokens",
                "rows per chunk", "the soft term", "student dtype", "gradients asked for (input, weight, bias bits)",
                *(f"option {field.name}" for field in dataclasses.fields(RowStepScales)))
HASHED = ("student_input", "teacher_input", "true_labels")  # two lanes each


def queue_hash_check(split: VocabParallel, student_input, teacher_input, labels) -> Callable[[], None]:
    """Queues the hashes of the hidden states and labels (_fingerprint.py) and their all-gather, copied to the host
    without waiting; returns the check that reads them (``HashesReadFirst``): every rank raises unless all ranks saw
    the same. Any mismatch it finds has gone through collectives of the same sizes on every rank
    (``check_vocab_parallel``), so it can wait that long."""
    # the Triton kernel on a GPU whatever the call's impl: the torch spec's float64 products would cost more there
    fingerprint = backend_for("triton" if labels.is_cuda else "torch", labels.device).fingerprint
    hashes = torch.cat([fingerprint(tensor).to(torch.int64) for tensor in (student_input, teacher_input,
                                                                            labels.reshape(-1, 1))])
    gathered = HostCopy(split.all_gather(hashes))

    def check() -> None:
        lanes = gathered.get().tolist()
        for index, name in enumerate(HASHED):
            if len({tuple(rank[2 * index : 2 * index + 2]) for rank in lanes}) > 1:
                raise ValueError(f"vocab_parallel ranks must see the same {name}: its contents differ between ranks")

    return check


def _check_ranks_agree(ranks: list[dict], vocab_teacher: int | None) -> None:
    """Raise unless the gathered rows (RANK_COLUMNS) describe one split of one call."""
    wrong = [rank for rank, row in enumerate(ranks) if row["wrong shards"]]
    if wrong:
        raise ValueError(f"vocab_parallel: the shards of rank(s) {wrong} do not match their split (see their error)")
    for name in RANK_COLUMNS[3:]:
        values = [row[name] for row in ranks]
        if len(set(values)) > 1:
            shown = ([float_of_bits(value) for value in values] if name.startswith("option") else
                     [LOSSES[value] for value in values] if name == "the soft term" else
                     [str(FLOAT_DTYPES[value]) for value in values] if name == "student dtype" else values)
            raise ValueError(f"vocab_parallel ranks must agree on {name}, got {shown} (rank by rank)")
    shards = sorted((row["start"], row["stop"]) for row in ranks)
    tiled = shards[0][0] == 0 and all(left[1] == right[0] for left, right in zip(shards, shards[1:]))
    if not tiled or (vocab_teacher is not None and shards[-1][1] != vocab_teacher):
        covers = "[0, Vt)" if vocab_teacher is None else f"[0, {vocab_teacher})"
        raise ValueError(f"vocab_parallel shards must tile {covers} without gaps or overlaps, got rows {shards}")
    if ranks[0]["vocab_student"] > shards[-1][1]:
        raise ValueError(f"vocab_parallel vocab_student={ranks[0]['vocab_student']} exceeds the teacher's vocabulary "
                         f"{shards[-1][1]}, which the shards cover")


def bits_of_float(value: float) -> int:
    """The int64 with this float64's bits: options compared exactly."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def float_of_bits(bits: int) -> float:
    """The float64 whose bits are this int64."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class SplitCheckedFirst:
    """A vocabulary split that queues ``queue_check`` (queue_hash_check) just before its call's first collective,
    once the first chunk's GEMMs are queued, and runs the check it returns at ``finish``: the GPU computes while the
    host hashes and gathers (docs/design.md, Distributed)."""

    def __init__(self, split: VocabParallel, queue_check: Callable[[], Callable[[], None]]):
        self.split, self.queue_check, self.check = split, queue_check, None

    def _queued(self) -> None:
        if self.queue_check is not None:
            self.check, self.queue_check = self.queue_check(), None

    def finish(self) -> None:
        self._queued()
        check, self.check = self.check, None
        if check is not None:
            check()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._queued()
        return self.split.all_gather(tensor)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._queued()
        self.split.all_reduce(tensor)


@dataclasses.dataclass(frozen=True)
class HashesReadFirst:
    """A split call's normaliser (_chunk_loop.Normaliser), whose ``wait`` finishes the split's check before it reads
    the label count: the host waits there anyway (after the first chunk with gradients, at the end without), and
    ranks whose labels differ all raise that, where a rank with a label past the vocabulary would raise alone and
    leave the others in the next collective."""

    counts: LabelCounts
    split: SplitCheckedFirst

    def launch(self) -> None:
        self.counts.launch()

    def mean_losses(self, token_losses: torch.Tensor, poison: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        return self.counts.mean_losses(token_losses, poison)

    def wait(self) -> float:
        self.split.finish()
        return self.counts.wait()


def check_tensors(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
                  ignore_index, num_valid_tokens=None):
    """The call's tensors against each other and the options (shapes, dtypes, devices: no host read)."""
    if torch.is_tensor(num_valid_tokens):  # its value is read after the loss is queued (_labels.LabelCounts.wait)
        if not is_real_scalar_tensor(num_valid_tokens):
            raise TypeError(f"num_valid_tokens must be a number or a one-element real tensor, got a "
                            f"{num_valid_tokens.dtype} tensor of shape {tuple(num_valid_tokens.shape)}")
    elif num_valid_tokens is not None:
        check_finite_real("num_valid_tokens", num_valid_tokens)
        if not num_valid_tokens > 0:
            raise ValueError(f"num_valid_tokens must be > 0, got {num_valid_tokens}")
    named = dict(
        student_input=student_input, student_weight=student_weight, teacher_input=teacher_input,
        teacher_weight=teacher_weight, true_labels=true_labels, student_bias=student_bias, teacher_bias=teacher_bias,
    )
    for name, tensor in named.items():
        if name == "teacher_weight" and isinstance(tensor, _teacher_fp8.Fp8TeacherWeight):
            continue  # a head quantized once by the caller: read as its weight below
        if tensor is not None and not torch.is_tensor(tensor):
            also = " or a cosdistill.Fp8TeacherWeight" if name == "teacher_weight" else ""
            raise TypeError(f"{name} must be a torch.Tensor{also}, got {type(tensor).__name__}")
        if tensor is None and name not in ("student_bias", "teacher_bias"):
            raise TypeError(f"{name} is required, got None")
    devices = {name: t.device for name, t in named.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    for name in ("student_input", "student_weight", "teacher_input", "teacher_weight", "student_bias", "teacher_bias"):
        tensor = named[name]
        if tensor is not None and tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {tensor.dtype}")
    for prefix in ("student", "teacher"):
        hidden, weight = named[f"{prefix}_input"], named[f"{prefix}_weight"]
        if weight.dim() != 2:
            raise ValueError(f"{prefix}_weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
        if hidden.dim() not in (2, 3):
            raise ValueError(f"{prefix}_input must be [T, H] or [B, L, H], got shape {tuple(hidden.shape)}")
        if hidden.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"{prefix}_input hidden size {hidden.shape[-1]} does not match {prefix}_weight "
                f"shape {tuple(weight.shape)} (expected [vocab, {hidden.shape[-1]}])"
            )
        if hidden.dtype != weight.dtype:
            raise TypeError(f"{prefix}_input dtype {hidden.dtype} differs from {prefix}_weight dtype {weight.dtype}")
        bias = named[f"{prefix}_bias"]
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{prefix}_bias must have shape ({weight.shape[0]},) to match {prefix}_weight {tuple(weight.shape)}, "
                f"got {tuple(bias.shape)}"
            )
    if torch.is_grad_enabled() and teacher_input.requires_grad:
        raise ValueError(
            f"teacher_input {tuple(teacher_input.shape)} requires grad, but the teacher is frozen: no gradient would "
            "reach it. Pass teacher_input.detach(), or compute the teacher under torch.no_grad() (which also frees "
            "its activations)"
        )
    if teacher_input.shape[:-1] != student_input.shape[:-1]:
        raise ValueError(
            f"token shapes differ: student_input {tuple(student_input.shape)} vs teacher_input {tuple(teacher_input.shape)} "
            "(all but the hidden dimension must match)"
        )
    if true_labels.shape != student_input.shape[:-1]:
        raise ValueError(
            f"true_labels shape {tuple(true_labels.shape)} does not match student_input tokens {tuple(student_input.shape[:-1])}"
        )
    if true_labels.dtype.is_floating_point or true_labels.dtype.is_complex or true_labels.dtype == torch.bool:
        raise TypeError(f"true_labels must be an integer tensor, got {true_labels.dtype}")
    label_range = torch.iinfo(true_labels.dtype)
    if not label_range.min <= ignore_index <= label_range.max:  # the comparison with it would wrap around
        raise TypeError(f"true_labels of dtype {true_labels.dtype} cannot hold ignore_index={ignore_index}: "
                        f"pass int64 (or int32) labels")
    if teacher_weight.shape[0] < student_weight.shape[0]:
        raise ValueError(
            f"teacher vocab must be >= student vocab: teacher_weight {tuple(teacher_weight.shape)}, "
            f"student_weight {tuple(student_weight.shape)}"
        )
