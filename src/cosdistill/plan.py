"""Options checked and turned into the set-up of the chunk loop, once: which row-step implementation,
which teacher side (bf16 logits, FP8 logits or the Gram matrices), how many rows per chunk, the
normaliser. The eager call (api.py) and the torch.compile op (ops.py) both run ``loss_and_grads``.
"""

import dataclasses
import os

import torch

from . import fp8, gram
from .chunked import (
    ChunkResult,
    GramOutOfRange,
    TeacherHead,
    VocabParallel,
    chunk_rows,
    chunked_loss_and_grads,
    split_row_step,
    start_student_logits,
)
from .labels import LabelCounts
from .row_step import TORCH_ROW_STEP, RowStepImpl, RowStepScales

IMPLS = ("auto", "torch", "triton", "cuda")
COSINE_VIA = ("auto", "logits", "gram")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def loss_and_grads(student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, labels,
                   needs_grad, *, weight_hard_loss, weight_soft_loss, beta, ignore_index, temperature, chunk_size,
                   num_valid_tokens, accum_dtype, impl, teacher_precision, student_softcap, teacher_softcap,
                   student_logit_scale, teacher_logit_scale, vocab_parallel, cosine_via) -> ChunkResult:
    """The set-up of the chunk loop from checked options, and the loop: the loss and, for grad_output = 1,
    the gradients asked for (needs_grad: input, weight, bias). 2-D inputs, 1-D labels; eager and the
    torch.compile op (ops.py) alike."""
    num_tokens = labels.numel()
    row_step_impl = pick_row_step(impl, student_input.device)
    vocab_student, vocab_teacher = student_weight.shape[0], teacher_weight.shape[0]
    if vocab_parallel is not None:  # the whole student vocabulary sizes the chunks: every rank runs as many
        vocab_student = vocab_teacher = vocab_parallel.vocab_student
    gram_teacher = pick_gram_teacher(
        cosine_via, student_weight, teacher_weight, num_tokens, needs_grad, row_step_impl,
        biases=(student_bias, teacher_bias), softcaps=(student_softcap, teacher_softcap),
        teacher_precision=teacher_precision, vocab_parallel=vocab_parallel)

    def run(gram_teacher):
        rows = chunk_rows(chunk_size, num_tokens, vocab_student, 0 if gram_teacher else vocab_teacher,
                          student_weight.element_size(), write_grad=any(needs_grad))
        # The GPU starts on the first chunk's student GEMM here, before the rest of the set-up; the autograd
        # Function comes after the chunk loop, whose GEMMs then cover its host time.
        student_logits = start_student_logits(student_input, student_weight, student_bias, rows)
        scales = row_step_scales(weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, student_softcap,
                                 teacher_softcap, student_logit_scale, teacher_logit_scale)
        row_step, reduce_grad_input = row_step_impl.step, None
        if vocab_parallel is not None:
            scales = dataclasses.replace(scales, vocab_start=vocab_parallel.start, vocab_student_total=vocab_student)
            row_step, reduce_grad_input = split_row_step(row_step_impl, vocab_parallel), vocab_parallel.all_reduce
        teacher = None if gram_teacher else teacher_head(teacher_weight, teacher_bias, teacher_precision,
                                                         max_rows=rows.student, row_step_impl=row_step_impl)
        return chunked_loss_and_grads(
            student_input, student_weight, student_bias, teacher_input, teacher, labels, scales,
            LabelCounts(labels, ignore_index, vocab_student, num_valid_tokens), row_step, rows, needs_grad,
            accum_dtype or default_accum_dtype(student_weight.dtype), reduce_grad_input, gram_teacher,
            student_logits=student_logits,
        )

    try:
        return run(gram_teacher)
    except GramOutOfRange:
        if cosine_via == "gram":
            raise ValueError(
                "cosine_via='gram': this call's hidden states and heads are too large for the Gram path's fp32 "
                f"products (their bound passes {gram.RANGE_LIMIT:.3g}); use cosine_via='logits' or 'auto'"
            ) from None
        return run(None)


def default_accum_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """grad_weight's accumulator when accum_dtype is None: the weight's dtype, except fp16, whose
    partial sums (d loss / d logits times hidden, over N, before grad_output -- a loss scale -- can
    lift them) fall into its subnormals; bf16 has fp32's exponent range."""
    return torch.float32 if weight_dtype == torch.float16 else weight_dtype


def check_options(student_weight, temperature, student_softcap, teacher_softcap, chunk_size, accum_dtype,
                  teacher_precision, num_valid_tokens, cosine_via="auto"):
    """The option rules that need no host read (shared with the torch.compile path, ops.py)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if cap is not None and not cap > 0:
            raise ValueError(f"{name} must be > 0 or None, got {cap}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if accum_dtype not in (None, torch.float32, student_weight.dtype):
        raise TypeError(f"accum_dtype must be None, torch.float32 or student_weight's dtype {student_weight.dtype}, "
                        f"got {accum_dtype}")
    if teacher_precision not in (None, "fp8"):
        raise ValueError(f"teacher_precision must be None or 'fp8', got {teacher_precision!r}")
    if num_valid_tokens is not None and not torch.is_tensor(num_valid_tokens) and not num_valid_tokens > 0:
        raise ValueError(f"num_valid_tokens must be > 0, got {num_valid_tokens}")
    if cosine_via not in COSINE_VIA:
        raise ValueError(f"cosine_via must be one of {COSINE_VIA}, got {cosine_via!r}")


def pick_gram_teacher(cosine_via, student_weight, teacher_weight, num_tokens, needs_grad, row_step_impl, *, biases,
                      softcaps, teacher_precision, vocab_parallel) -> gram.GramTeacher | None:
    """The Gram path's teacher where cosine_via asks for it (or "auto" finds it applies and cheaper), else None.
    biases, softcaps: (student's, teacher's), each None where the head has none."""
    if cosine_via == "logits":
        return None
    blockers = {
        "a student_bias or teacher_bias": any(bias is not None for bias in biases),
        "a softcap": any(cap is not None for cap in softcaps),
        "teacher_precision='fp8'": teacher_precision is not None,
        "vocab_parallel": vocab_parallel is not None,
        f"{student_weight.dtype} and {teacher_weight.dtype} weights (bf16 or fp32, both alike)": (
            student_weight.dtype == torch.float16 or teacher_weight.dtype != student_weight.dtype),
    }
    blocked = [name for name, present in blockers.items() if present]
    if blocked and cosine_via == "gram":
        raise ValueError(f"cosine_via='gram' cannot run with {' and '.join(blocked)}: use cosine_via='logits' or 'auto'")
    if blocked:
        return None
    (vocab_student, hidden_student), (vocab_teacher, hidden_teacher) = student_weight.shape, teacher_weight.shape
    if cosine_via == "auto" and not gram.gram_is_cheaper(
            num_tokens, vocab_student, vocab_teacher, hidden_student, hidden_teacher, write_grad_weight=needs_grad[1],
            teacher_gram_cached=gram.teacher_grams.will_hold(teacher_weight)):
        return None
    return gram.GramTeacher(teacher_weight, student_weight, row_step_impl, write_grad_weight=needs_grad[1])


def row_step_scales(weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, student_softcap,
                    teacher_softcap, student_logit_scale, teacher_logit_scale) -> RowStepScales:
    optional = lambda value: None if value is None else float(value)  # noqa: E731
    return RowStepScales(
        float(weight_hard_loss), float(weight_soft_loss), float(beta), float(temperature), int(ignore_index),
        student_softcap=optional(student_softcap), teacher_softcap=optional(teacher_softcap),
        student_logit_scale=float(student_logit_scale), teacher_logit_scale=float(teacher_logit_scale),
    )


def teacher_head(teacher_weight, teacher_bias, teacher_precision, max_rows, row_step_impl) -> TeacherHead:
    teacher_bias = None if teacher_bias is None else teacher_bias.detach()
    if teacher_precision == "fp8":
        fp8.check_supported(teacher_weight.device)
        quantize = fp8.quantize_rows
        if row_step_impl is not TORCH_ROW_STEP:  # the Triton kernels: the quantization's twin too
            from .fp8_triton import quantize_rows_triton as quantize
        return fp8.Fp8TeacherHead(teacher_weight, teacher_bias, max_rows=max_rows, quantize=quantize)
    return TeacherHead(teacher_weight.detach(), teacher_bias)


def pick_row_step(impl: str, device: torch.device) -> RowStepImpl:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return TORCH_ROW_STEP
    from . import row_step_cuda

    clusters = row_step_cuda.available(device)
    if impl == "cuda" and not clusters:
        raise ValueError(f"impl='cuda' needs a CUDA GPU with thread block clusters (compute capability 9.0 or "
                         f"newer) and torch.cuda._compile_kernel (NVRTC); tensors are on {device}")
    if impl in ("cuda", "auto") and clusters:
        return row_step_cuda.CUDA_ROW_STEP
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU); tensors are on {device}")
    from .row_step_triton import TRITON_ROW_STEP

    return TRITON_ROW_STEP


def check_vocab_parallel(vocab_parallel: VocabParallel, student_weight, teacher_weight) -> None:
    """The local weight shards against the split."""
    start, stop, vocab_student = vocab_parallel.start, vocab_parallel.stop, vocab_parallel.vocab_student
    if not 0 <= start < stop:
        raise ValueError(f"vocab_parallel needs 0 <= start < stop, got start={start}, stop={stop}")
    student_rows = max(0, min(stop, vocab_student) - start)
    if teacher_weight.shape[0] != stop - start or student_weight.shape[0] != student_rows:
        raise ValueError(
            f"vocab_parallel rows [{start}, {stop}) with vocab_student={vocab_student} need a teacher_weight shard "
            f"of {stop - start} rows and a student_weight shard of {student_rows} rows, got "
            f"{tuple(teacher_weight.shape)} and {tuple(student_weight.shape)}"
        )


def check_tensors(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
                   ignore_index):
    named = dict(
        student_input=student_input, student_weight=student_weight, teacher_input=teacher_input,
        teacher_weight=teacher_weight, true_labels=true_labels, student_bias=student_bias, teacher_bias=teacher_bias,
    )
    for name, tensor in named.items():
        if tensor is not None and not torch.is_tensor(tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
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
    if teacher_input.shape[:-1] != student_input.shape[:-1]:
        raise ValueError(
            f"token counts differ: student_input {tuple(student_input.shape)} vs teacher_input {tuple(teacher_input.shape)}"
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
