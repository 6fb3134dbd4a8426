"""The plan of one call, made from its checked options (_options.py): which backend (_backends.py), which teacher
side (its logits in the weight's dtype, its FP8 logits or the Gram matrices), how many rows per chunk (``chunk_rows``). The eager
function and module (api.py) and the torch.compile op (_compile.py) all build the plan here and run it with ``run``,
which makes the call's normaliser (_labels.py) and runs the chunk loop.
"""

import dataclasses
import functools

import torch

from . import _split_check, _teacher_fp8, _teacher_gram
from ._backends import TORCH, Backend, backend_for
from ._chunk_loop import ChunkResult, ChunkRows, chunked_loss_and_grads, start_student_logits
from ._labels import LabelCounts
from ._options import Options, check_accum_dtype, check_fp16_jsd_temperature, check_tensors, default_accum_dtype, is_transformed
from ._row_step import RowStepConstants, RowStepImpl
from ._split_check import VocabParallel
from ._teacher_logits import LogitsTeacher, SideStream, TeacherHead
from ._weight_cache import kept_across_calls, note_trained

# At least 1024 rows per chunk: each chunk's grad_weight GEMM reads and writes the whole grad_weight, and with
# fewer rows that traffic shows. More rows while the two logits buffers stay small (small vocabularies), and
# fewer than 1024 only past a hard budget (docs/design.md, Chunking and buffers).
MIN_PREFERRED_ROWS = 1024
SMALL_BUFFER_BYTES = 512 * 2**20  # grow the chunk up to this...
MAX_BUFFER_BYTES = 5 * 2**28  # ...and shrink it below MIN_PREFERRED_ROWS only past this (1.25 GiB)
CHUNK_MULTIPLE = 64
# The student's chunk (its logits GEMM and the two gradient GEMMs) this long where the hard budget
# allows, the teacher's logits computed in sub-chunks: the gradient GEMMs cost less per token at 2048
# rows (the grad_weight traffic per chunk halves), for a larger student buffer only. The
# teacher's sub-chunks shrink to MIN_TEACHER_ROWS first to make room (docs/design.md, Chunking and buffers).
MIN_STUDENT_ROWS = 2048
MIN_TEACHER_ROWS = 512


def _budget_rows(row_bytes: int) -> int:
    rows = max(MIN_PREFERRED_ROWS, SMALL_BUFFER_BYTES // row_bytes)
    return min(rows, max(CHUNK_MULTIPLE, MAX_BUFFER_BYTES // row_bytes)) // CHUNK_MULTIPLE * CHUNK_MULTIPLE


@functools.lru_cache(maxsize=256)  # a pure function of its arguments, called at every call
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one call runs, decided from the options and the tensors' shapes, dtypes and device (and, for
    "auto", whether the teacher's Gram matrix is cached), never from their values."""

    options: Options
    backend: Backend
    row_step: RowStepImpl  # the backend's for the loss
    constants: RowStepConstants  # the row step's constants (with the vocabulary split's, if any)
    teacher: str  # "logits", "fp8" or "gram"
    rows: ChunkRows
    needs_grad: tuple[bool, bool, bool]  # input, weight, bias
    accum_dtype: torch.dtype
    vocab_parallel: VocabParallel | None
    fall_back: bool  # on the Gram path: run on the logits path where its range check fails (else raise)
    side_stream: bool = False  # the row steps beside the teacher GEMMs (``row_step_beside_gemms``)
    grad_weight_in_forward: bool = False  # the last chunk's grad_weight GEMM in forward (``small_call``)


def checked_backend(options: Options, student_weight, needs_grad) -> Backend:
    """The row step's backend, after the options' rules that depend on the student head (make_plan's, and the
    compiled op's at trace time)."""
    check_accum_dtype(options.accum_dtype, student_weight.dtype)
    check_fp16_jsd_temperature(options, student_weight.dtype, any(needs_grad))
    return backend_for(options.impl, student_weight.device)


def make_plan(options: Options, student_weight, student_bias, teacher_weight, teacher_bias, num_tokens: int,
              needs_grad, vocab_parallel: VocabParallel | None = None, teacher_gram_cached: bool | None = None) -> Plan:
    """The plan for checked tensors. ``teacher_gram_cached``: see ``gram_applies``."""
    backend = checked_backend(options, student_weight, needs_grad)
    row_step = {"cosine": backend.cosine_row_step, "jsd": backend.jsd_row_step}[options.loss]
    quantized = isinstance(teacher_weight, _teacher_fp8.Fp8TeacherWeight)
    fp8 = options.teacher_precision == "fp8" or quantized
    if fp8:
        _teacher_fp8.check_supported(teacher_weight.device, "a teacher_weight from quantize_teacher_weight" if quantized
                                     else "teacher_precision='fp8'")
    teacher = "fp8" if fp8 else "logits"
    if gram_applies(options, student_weight, student_bias, teacher_weight, teacher_bias, num_tokens, needs_grad,
                    vocab_parallel, teacher_gram_cached):
        teacher = "gram"
    vocab_student, vocab_teacher, constants = student_weight.shape[0], teacher_weight.shape[0], options.constants
    if vocab_parallel is not None:  # the whole student vocabulary sizes the chunks: every rank runs as many
        vocab_student = vocab_teacher = vocab_parallel.vocab_student
        constants = dataclasses.replace(constants, vocab_start=vocab_parallel.start, vocab_student_total=vocab_student)
    rows = chunk_rows(options.chunk_size, num_tokens, vocab_student, 0 if teacher == "gram" else vocab_teacher,
                      student_weight.element_size(), write_grad=any(needs_grad))
    side_stream = row_step_beside_gemms(options.loss, backend, student_weight.device, teacher, rows, num_tokens,
                                        vocab_student, vocab_teacher, student_weight.element_size(), vocab_parallel)
    return Plan(options, backend, row_step, constants, teacher, rows, tuple(needs_grad),
                options.accum_dtype or default_accum_dtype(student_weight.dtype), vocab_parallel,
                fall_back=options.cosine_via == "auto", side_stream=side_stream,
                grad_weight_in_forward=small_call(rows, num_tokens, student_weight.shape, teacher_weight.shape))


# Plans of earlier calls by signature (``checked_plan``); when full, the oldest goes, so a process that keeps
# changing shapes holds a bounded number and the shapes it keeps using come back after one miss (clearing all at
# once made every shape miss after each burst of new ones).
_plans: dict[tuple, Plan] = {}
MAX_PLANS = 64


def checked_plan(options: Options, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                 student_bias=None, teacher_bias=None, num_valid_tokens=None, vocab_parallel=None) -> Plan:
    """``check_tensors`` then ``make_plan`` (then a vocabulary split's ``check_vocab_parallel``) for an eager call, skipped for
    a call whose signature, everything they read, matches an earlier call's: on an idle GPU their host time
    comes before the first GEMM (docs/design.md, Host latency). Where "auto" weighs the teacher's cached Gram
    matrix, its state is asked at every call and is part of the key."""
    tensors = (student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias)
    if vocab_parallel is not None and not isinstance(vocab_parallel, _split_check.VocabParallel):
        raise TypeError(f"vocab_parallel must be a cosdistill.distributed.VocabParallelOptions, got "
                        f"{type(vocab_parallel).__name__}")
    signature = _call_signature(options, tensors, num_valid_tokens, vocab_parallel)
    gram_cached = None
    if signature is not None and _weighs_gram_cache(options, student_weight, student_bias, teacher_weight,
                                                    teacher_bias, vocab_parallel):
        gram_cached = _teacher_gram_cached(teacher_weight, student_weight)
    key = None if signature is None else (*signature, gram_cached)
    plan = _plans.get(key) if key is not None else None
    if plan is not None:
        return plan
    if vocab_parallel is None:
        plan = _checked_new_plan(options, tensors, num_valid_tokens, None, gram_cached)
    else:  # every rank reaches the split's first gather, which tells the others what any rank raised
        plan, error = None, None
        try:
            plan = _checked_new_plan(options, tensors, num_valid_tokens, vocab_parallel, gram_cached)
            error = _split_check.vocab_parallel_shard_error(vocab_parallel, student_weight, teacher_weight)
            if plan.teacher == "fp8" and torch.is_tensor(teacher_weight):  # a check the last call left unread
                _teacher_fp8.quantized_weights.raise_if_stale(teacher_weight)
        except (TypeError, ValueError) as raised:
            error = raised
        _split_check.check_vocab_parallel(vocab_parallel, plan, true_labels.numel() if plan else 0,
                                          student_weight.dtype if plan else None, _split_check.gather_device(tensors),
                                          error, num_valid_tokens, (student_bias is not None, teacher_bias is not None))
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            del _plans[next(iter(_plans))]  # insertion order: the oldest
        _plans[key] = plan
    return plan


def _checked_new_plan(options: Options, tensors, num_valid_tokens, vocab_parallel, gram_cached) -> Plan:
    student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias = tensors
    check_tensors(*tensors, options.ignore_index, num_valid_tokens,
                  None if vocab_parallel is None else vocab_parallel.vocab_student)
    return make_plan(options, student_weight, student_bias, teacher_weight, teacher_bias, true_labels.numel(),
                     gradients_needed(student_input, student_weight, student_bias), vocab_parallel, gram_cached)


def gradients_needed(student_input, student_weight, student_bias) -> tuple[bool, bool, bool]:
    """Whether this call makes each of the student's gradients: grad mode on and the tensor requiring grad."""
    return tuple(torch.is_grad_enabled() and t is not None and t.requires_grad
                 for t in (student_input, student_weight, student_bias))


def _call_signature(options: Options, tensors, num_valid_tokens, vocab_parallel) -> tuple | None:
    """What check_tensors and make_plan read of a call: the options, whether gradients are on, whether
    num_valid_tokens passes, each tensor's type, layout, shape, dtype, device, requires_grad and whether a torch.func
    transform wraps it. None where they must run:
    a vocabulary split (an object the plan holds, which may change), options holding tensors (made for one call),
    an argument that is not a tensor. The
    options go in by identity, cheaper than hashing their fields: the plan holds them, so their id stays theirs
    while it is kept."""
    if vocab_parallel is not None or options.reads_tensors:
        return None
    if num_valid_tokens is None:
        count = None
    elif isinstance(num_valid_tokens, torch.Tensor):  # check_tensors reads its shape and dtype, not its value
        count = ("tensor", num_valid_tokens.shape, num_valid_tokens.dtype, num_valid_tokens.requires_grad)
    elif isinstance(num_valid_tokens, (int, float)) and not isinstance(num_valid_tokens, bool):
        count = num_valid_tokens  # not float(): an int past its range must reach check_tensors' ValueError
    else:
        return None
    signature = [id(options), torch.is_grad_enabled(), count]
    for tensor in tensors:
        if tensor is not None and not isinstance(tensor, (torch.Tensor, _teacher_fp8.Fp8TeacherWeight)):
            return None
        signature.append(None if tensor is None else
                         (type(tensor), getattr(tensor, "layout", None), tensor.shape, tensor.dtype, tensor.device,
                          tensor.requires_grad, torch.is_tensor(tensor) and is_transformed(tensor)))
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


# The four GEMMs of a call under this many FLOPs take about as long on the GPU (measured on the H200) as the host
# takes to queue the call, so from an idle GPU (a small model's training step, the bench) the GPU catches up with
# the host and would idle from forward's end until backward queued the deferred grad_weight GEMM (docs/design.md,
# Host latency).
SMALL_CALL_FLOPS = 10**12


def small_call(rows: ChunkRows, num_tokens: int, student_shape, teacher_shape) -> bool:
    """Whether the last chunk's grad_weight GEMM runs in forward: a call of one chunk, at least MIN_PREFERRED_ROWS
    tokens (so that grad_output's pass over grad_weight in backward, where it is not 1, costs well under the GEMM)
    and under SMALL_CALL_FLOPS."""
    (vocab_student, hidden_student), (vocab_teacher, hidden_teacher) = student_shape, teacher_shape
    flops = 2 * num_tokens * (3 * vocab_student * hidden_student + vocab_teacher * hidden_teacher)
    return MIN_PREFERRED_ROWS <= num_tokens <= rows.student and flops < SMALL_CALL_FLOPS


def run(plan: Plan, student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, labels,
        num_valid_tokens=None, metrics_out: tuple[float, torch.Tensor] | None = None) -> ChunkResult:
    """The loss and, for grad_output = 1, the gradients the plan asks for. 2-D inputs, 1-D labels.
    ``metrics_out`` (temperature, out [T, 2] float32): the student's metrics written into out
    (_student_metrics.py)."""
    # The GPU starts on the first chunk's student GEMM before the teacher side's set-up, whose host time
    # (and any cached teacher copy's check) it then covers.
    student_logits = start_student_logits(student_input, student_weight, student_bias, plan.rows)
    if plan.needs_grad[1]:
        note_trained(student_weight)
    backend, constants = plan.backend, plan.constants
    row_step, reduce_grad_input, split, fp8_head = plan.row_step.step, None, None, None
    if plan.teacher == "fp8":
        # The copy's content check rides on the first row step where it can take the weight's hash along; under a
        # split, on the split's hash check, which every rank reads.
        hashing_step = plan.row_step.hashing_step if plan.vocab_parallel is None else None
        fp8_head = _teacher_fp8.Fp8TeacherHead(teacher_weight, teacher_bias, plan.rows.student, backend,
                                               hash_later=hashing_step is not None,
                                               compare_later=plan.vocab_parallel is not None,
                                               keep=isinstance(teacher_weight, _teacher_fp8.Fp8TeacherWeight)
                                               or kept_across_calls(teacher_weight, student_weight))
    if plan.vocab_parallel is not None:
        split = _split_check.SplitCheckedFirst(plan.vocab_parallel, functools.partial(
            _split_check.queue_hash_check, plan.vocab_parallel, student_input, teacher_input, labels, fp8_head,
            num_valid_tokens))
        row_step, reduce_grad_input = plan.row_step.over_ranks(split.all_gather), split.all_reduce
    side = SideStream(student_input.device) if plan.side_stream else None
    if plan.teacher == "gram":
        teacher = _teacher_gram.GramTeacher(teacher_weight, student_weight, backend, constants,
                                            write_grad_weight=plan.needs_grad[1])
    elif plan.teacher == "fp8":
        teacher = LogitsTeacher(fp8_head, row_step, constants, plan.rows, side, hashing_step, backend.fingerprint)
    else:
        teacher = LogitsTeacher(TeacherHead(teacher_weight, teacher_bias), row_step, constants, plan.rows, side)
    normaliser = LabelCounts(labels, constants.ignore_index, constants.vocab_student_total or student_weight.shape[0],
                             num_valid_tokens, backend, constants.weight_hard, constants.weight_soft)
    if split is not None:
        normaliser = _split_check.HashesReadFirst(normaliser, split)
    metrics_into = None
    if metrics_out is not None:
        temperature, out = metrics_out

        def metrics_into(logits, chunk_labels, rows):
            backend.student_metrics(logits, chunk_labels, constants, temperature, out[rows])
    try:
        return chunked_loss_and_grads(
            student_input, student_weight, student_bias, teacher_input, teacher, labels, normaliser, plan.rows,
            plan.needs_grad, plan.accum_dtype, backend.scale_unless_one, reduce_grad_input, student_logits,
            plan.grad_weight_in_forward, metrics_into,
        )
    except _teacher_gram.GramOutOfRange:
        if not plan.fall_back:
            raise ValueError(
                "cosine_via='gram': this call's hidden states and heads are too large for the Gram path's fp32 "
                f"products, or not finite (their bound is not under {_teacher_gram.RANGE_LIMIT:.3g}); use "
                "cosine_via='logits' or 'auto'"
            ) from None
    # The logits path, after the except block: the failed attempt's buffers, held by the exception's frames and by
    # these names, are freed before it allocates its own.
    del student_logits, teacher, normaliser, split
    logits_plan = make_plan(dataclasses.replace(plan.options, cosine_via="logits"), student_weight, student_bias,
                            teacher_weight, teacher_bias, len(labels), plan.needs_grad, plan.vocab_parallel)
    return run(logits_plan, student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias,
               labels, num_valid_tokens, metrics_out)


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
        teacher_gram_cached = _teacher_gram_cached(teacher_weight, student_weight)
    return _teacher_gram.gram_is_cheaper(num_tokens, vocab_student, vocab_teacher, hidden_student, hidden_teacher,
                                         write_grad_weight=needs_grad[1], teacher_gram_cached=teacher_gram_cached)


def _teacher_gram_cached(teacher_weight, student_weight) -> bool:
    """Whether "auto" counts the teacher's Gram matrix as cached (``will_hold``). Under
    ``torch.use_deterministic_algorithms`` it counts as not: the cache's state depends on the process's earlier
    calls, and the two paths round differently, so the path must be a function of the call alone. Nor does a
    teacher weight trained beside the student (``kept_across_calls``)."""
    cached = _teacher_gram.teacher_grams.will_hold(teacher_weight)  # asked anyway: it raises for a stale last reuse
    return (cached and not torch.are_deterministic_algorithms_enabled()
            and kept_across_calls(teacher_weight, student_weight))


def _weighs_gram_cache(options: Options, student_weight, student_bias, teacher_weight, teacher_bias,
                       vocab_parallel) -> bool:
    """Whether ``gram_applies`` weighs the teacher's Gram cache: "auto" on the cosine loss where nothing blocks
    the Gram path. Asked before the checks: weights that are no dense tensors, or tensors of a torch.func transform
    (which have no storage to fingerprint), are left to them."""
    if not all(torch.is_tensor(weight) and weight.layout == torch.strided and not is_transformed(weight)
               for weight in (student_weight, teacher_weight)):
        return False
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
