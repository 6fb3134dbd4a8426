"""What the tests, the benchmarks and ``cosdistill check`` share: the float64 reference of the loss and its
gradients, the relative error between two results, the tests' and the check's random problem (the benchmarks draw
theirs in ``tools.bench.make_tensors``), and the error floors that the design's roundings alone bring (which the
tests' tolerances add to).

Below them, in a section of its own, the internal pieces that the tests hold against their specs (no
stable API): code outside the package reaches the private modules through here and nowhere else.
"""

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ._options import default_accum_dtype
from ._plan import chunk_rows
from .reference import NAIVE_LOSSES


def rel_err(actual, expected) -> float:
    """|actual - expected| / |expected| in float64 (Frobenius norms); |actual - expected| where expected is 0."""
    actual, expected = actual.detach().double(), expected.detach().double()
    denominator = expected.norm()
    difference = (actual - expected).norm()
    return (difference if denominator == 0 else difference / denominator).item()


def random_student_teacher(labels, hidden_student, hidden_teacher, vocab_student, vocab_teacher, dtype, *,
                           with_student_bias: bool, with_teacher_bias: bool, generator=None) -> list:
    """[student_input, student_weight, teacher_input, teacher_weight, labels, student_bias, teacher_bias]
    for these labels, on their device: random normal hidden states, weights scaled by 2 / sqrt(H) (logits
    of a few units, like a trained head's), drawn in that order from ``generator`` (default: torch's); a
    bias is None unless asked for."""
    def randn(*shape, scale=1.0, requires_grad=False):
        values = torch.randn(*shape, generator=generator, device=labels.device) * scale
        return values.to(dtype).requires_grad_(requires_grad)

    lead = tuple(labels.shape)
    return [
        randn(*lead, hidden_student, requires_grad=True),
        randn(vocab_student, hidden_student, scale=2 / hidden_student**0.5, requires_grad=True),
        randn(*lead, hidden_teacher),
        randn(vocab_teacher, hidden_teacher, scale=2 / hidden_teacher**0.5),
        labels,
        randn(vocab_student, requires_grad=True) if with_student_bias else None,
        randn(vocab_teacher) if with_teacher_bias else None,
    ]


REFERENCE_ROWS = 1024  # tokens per reference pass: the seed workload's float64 logits at once outgrow an 80 GB GPU


def float64_reference(args, grad_output=1.0, loss="cosine", **options):
    """``naive_in_row_blocks(args, torch.float64, grad_output, loss, **options)``: the tests' oracle."""
    return naive_in_row_blocks(args, torch.float64, grad_output, loss, **options)


def naive_in_row_blocks(args, dtype, grad_output=1.0, loss="cosine", **options):
    """(loss, soft, hard) and the gradients of the student's input, weight and bias (where given; None
    where it does not require grad), from the naive version (``loss``: "cosine" or "jsd") on ``dtype`` copies
    of args (the seven of random_student_teacher), for this grad_output. The naive version runs on
    REFERENCE_ROWS tokens at a time with the whole batch's N, the passes' losses and gradients summed, so that
    its logits fit in memory at any number of tokens."""
    upcast = [t if t is None or not t.is_floating_point() else t.detach().to(dtype).requires_grad_(t.requires_grad)
              for t in args]
    student_input, student_weight, teacher_input, teacher_weight, labels, student_bias, teacher_bias = upcast
    if options.get("num_valid_tokens") is None:
        options = {**options, "num_valid_tokens": max(1, int((labels != options.get("ignore_index", -100)).sum()))}
    rows = labels.numel()
    totals = None
    for start in range(0, max(rows, 1), REFERENCE_ROWS):
        part = slice(start, start + REFERENCE_ROWS)
        losses = NAIVE_LOSSES[loss](student_input.reshape(rows, student_weight.shape[1])[part], student_weight,
                                    teacher_input.reshape(rows, teacher_weight.shape[1])[part], teacher_weight,
                                    labels.reshape(-1)[part],
                                    student_bias, teacher_bias, **options)
        if losses[0].requires_grad:
            (losses[0] * grad_output).backward()
        losses = [value.detach() for value in losses]
        totals = losses if totals is None else [total + value for total, value in zip(totals, losses)]
    grads = [upcast[i].grad for i in (0, 1, 5) if upcast[i] is not None]
    return totals, grads


def ignore_some_labels(labels, pattern: str, ignore_index: int, generator=None) -> None:
    """Sets labels to ignore_index in place: "none", "some" (30% at random), "alternating" or "all"."""
    if pattern not in ("none", "some", "alternating", "all"):
        raise ValueError(f"pattern must be 'none', 'some', 'alternating' or 'all', got {pattern!r}")
    flat = labels.view(-1)
    if pattern == "some":
        flat[torch.rand(flat.numel(), generator=generator, device=labels.device) < 0.3] = ignore_index
    elif pattern == "alternating":
        flat[::2] = ignore_index
    elif pattern == "all":
        flat.fill_(ignore_index)


# Error floors: what the design's roundings alone bring, which the tests' tolerances add to.


class _LogitsInDtype(TorchFunctionMode):
    """Rounds each F.linear output of the naive version to ``dtype`` (None: leaves them), as the GEMMs that
    write the logits do, passing gradients straight through; keeps the first (the student logits) with its
    gradient."""

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype, self.logits = dtype, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear:
            if self.dtype is not None:
                out = out + (out.to(self.dtype).to(out.dtype) - out).detach()
            if self.logits is None:
                out.retain_grad()
                self.logits = out
        return out


def _grad_student_logits(upcast, dtype, grad_output, loss, options) -> torch.Tensor:
    """d loss / d student logits of the naive version on float64 ``upcast``, its logits held in ``dtype``."""
    keeper = _LogitsInDtype(dtype)
    with keeper:
        losses = NAIVE_LOSSES[loss](*upcast, **options)
    (losses[0] * grad_output).backward()
    return keeper.logits.grad.reshape(-1, upcast[1].shape[0])


def logits_rounding_floors(args, dtype: torch.dtype, grad_output=1.0, loss="cosine", **options) -> list[float]:
    """[grad_input, grad_weight, grad_bias] floors: the relative error that holding the logits in their
    dtype brings by itself (the design: the GEMMs write the logits in it, and the row step overwrites
    them with d loss / d logits). The float64 gradients recomputed from d loss / d logits taken at the
    logits rounded to ``dtype`` and stored rounded to it as the chunk loop stores it (unnormalised,
    before grad_output), against the float64 gradients. A low temperature or a large logit scale
    magnifies the logits' rounding; cancellation in the sums over tokens or vocabulary magnifies the
    stored one (grad_bias of a soft term alone in bf16). ``args`` as fused_linear_cosine_distill's first
    seven; ``loss``: "cosine" or "jsd"; ``options`` its loss keywords."""
    def upcast():
        return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in args]

    exact = _grad_student_logits(upcast(), None, grad_output, loss, options)
    in_dtype = _grad_student_logits(upcast(), dtype, grad_output, loss, options)
    given = options.get("num_valid_tokens")
    normaliser = float(given) if given is not None else max(1, int((args[4] != options.get("ignore_index", -100)).sum()))
    stored = in_dtype * (normaliser / grad_output)
    rounded = stored.to(dtype).double() * (grad_output / normaliser)
    hidden, weight = args[0].detach().double().reshape(-1, args[0].shape[-1]), args[1].detach().double()
    return [rel_err(rounded @ weight, exact @ weight), rel_err(rounded.t() @ hidden, exact.t() @ hidden),
            rel_err(rounded.sum(0), exact.sum(0))]


def accumulation_floor(dtype: torch.dtype, accum_dtype: torch.dtype | None, chunk_size: int | None, tokens: int,
                       vocab_student: int, vocab_teacher: int) -> float:
    """The relative error that summing grad_weight chunk by chunk in a bf16 accumulator brings
    beyond the final rounding, for a call with these arguments (the library's accumulator and chunks):
    one rounding (unit roundoff u) of the growing partial sum per further chunk, a random walk,
    ~u * sqrt((chunks - 1) / 6); 0 in fp32. A property test found it; docs/reference.md, accum_dtype, says
    when it applies."""
    accum_dtype = accum_dtype or default_accum_dtype(dtype)
    if accum_dtype == torch.float32 or tokens == 0:
        return 0.0
    rows = chunk_rows(chunk_size, tokens, vocab_student, vocab_teacher, dtype.itemsize).student
    return torch.finfo(accum_dtype).eps / 2 * math.sqrt((-(-tokens // rows) - 1) / 6)


# ---------------------------------------------------------------------------------------------------------
# Internals the tests hold against their specs. Not a stable API: they change with the package.
#
# Modules, where a test replaces a name that the module looks up when it runs
# (``monkeypatch.setattr(plan, "chunk_rows", ...)``: a re-exported function could not be replaced so):
from . import _backends as backends  # noqa: E402
from . import _chunk_loop as chunk_loop  # noqa: E402
from . import _plan as plan  # noqa: E402
from . import _split_check as split_check  # noqa: E402
from . import _teacher_fp8 as teacher_fp8  # noqa: E402
from . import _teacher_gram as teacher_gram  # noqa: E402
from . import _weight_cache as weight_cache  # noqa: E402

# The torch specs and the pieces of the chunk loop, by name:
from ._backends import TORCH, backend_for, scale_unless_one_torch  # noqa: E402
from ._chunk_loop import ChunkRows, chunked_loss_and_grads  # noqa: E402
from ._fingerprint import as_words, fingerprint_torch, lanes_of, stale_check_torch  # noqa: E402
from ._labels import LabelCounts, count_labels_torch, mean_losses_torch  # noqa: E402
from ._options import REAL_OPTIONS, SMALLEST_FP16_JSD_TEMPERATURE, Options, options_of  # noqa: E402
from ._row_step import (  # noqa: E402
    COSINE_TORCH_ROW_STEP,
    RowStepConstants,
    RowStepImpl,
    combine_row_stats,
    row_step_torch,
    scale_and_softcap,
    teacher_grad_coefficient,
    with_teacher_products,
)
from ._row_step_jsd import (  # noqa: E402
    JSD_TORCH_ROW_STEP,
    combine_jsd_stats_torch,
    combine_jsd_sums_torch,
    jsd_lift_bound,
    jsd_shard_grad_torch,
    jsd_shard_stats_torch,
    jsd_shard_sums_torch,
    row_step_jsd_torch,
)
from ._student_metrics import student_metrics_torch  # noqa: E402
from ._teacher_logits import LogitsTeacher, TeacherHead  # noqa: E402
from .api import FUSED_LOSSES  # noqa: E402
from .api import _AttachGradients as AttachGradients  # noqa: E402

# Imported on first use (see __getattr__): the kernels import triton, which reads TRITON_INTERPRET once, and
# importing _compile registers the torch.compile op (a second copy of the package loaded beside this one must
# not register it twice).
_KERNEL_NAMES = {  # name -> the kernels module that defines it
    "COSINE_TRITON_ROW_STEP": "row_step_triton", "row_step_triton": "row_step_triton", "row_stats_triton": "row_step_triton",
    "row_grad_triton": "row_step_triton", "count_labels_triton": "labels", "mean_losses_triton": "labels",
    "scale_unless_one_triton": "grad_output", "quantize_rows_triton": "fp8_quantize",
    "fingerprint_triton": "fingerprint", "stale_check_triton": "fingerprint",
    "row_step_jsd_triton": "row_step_jsd_triton", "student_metrics_triton": "student_metrics",
}
_COMPILE_NAMES = ("compiled_distill", "fused_linear_distill_op", "real_options_tensor")


def _kernels():
    """The package cosdistill.kernels with every kernel module imported (its attributes)."""
    from . import kernels
    from .kernels import (  # noqa: F401
        fingerprint,
        fp8_quantize,
        grad_output,
        labels,
        row_step_cuda,
        row_step_jsd_cuda,
        row_step_jsd_triton,
        row_step_triton,
        student_metrics,
    )

    return kernels


def __getattr__(name):
    if name == "kernels":  # every kernel module, e.g. kernels.row_step_cuda (the CUDA twin), kernels.labels.BLOCK
        return _kernels()
    if name in _KERNEL_NAMES:
        return getattr(getattr(_kernels(), _KERNEL_NAMES[name]), name)
    if name in _COMPILE_NAMES:
        from . import _compile

        return getattr(_compile, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # shared by the tests, the benchmarks and cosdistill check
    "float64_reference", "naive_in_row_blocks", "random_student_teacher", "rel_err",
    # the error floors the tests' tolerances add to
    "accumulation_floor", "ignore_some_labels", "logits_rounding_floors",
    # internals: modules
    "backends", "chunk_loop", "kernels", "plan", "split_check", "teacher_fp8", "teacher_gram", "weight_cache",  # noqa: F822 (kernels: __getattr__)
    # internals: the torch specs and the chunk loop's pieces
    "TORCH", "backend_for", "scale_unless_one_torch", "ChunkRows", "chunked_loss_and_grads", "fingerprint_torch",
    "as_words", "lanes_of", "stale_check_torch", "LabelCounts", "count_labels_torch", "mean_losses_torch", "Options",
    "REAL_OPTIONS", "SMALLEST_FP16_JSD_TEMPERATURE", "options_of", "chunk_rows", "COSINE_TORCH_ROW_STEP", "RowStepImpl",
    "RowStepConstants", "combine_row_stats", "row_step_torch", "scale_and_softcap", "teacher_grad_coefficient",
    "with_teacher_products", "LogitsTeacher", "TeacherHead", "AttachGradients", "FUSED_LOSSES",
    "JSD_TORCH_ROW_STEP", "combine_jsd_stats_torch", "combine_jsd_sums_torch", "jsd_lift_bound", "jsd_shard_grad_torch",
    "jsd_shard_stats_torch", "jsd_shard_sums_torch", "row_step_jsd_torch", "student_metrics_torch",
    # internals imported on first use: the Triton twins and the torch.compile op
    *_KERNEL_NAMES, *_COMPILE_NAMES,
]
