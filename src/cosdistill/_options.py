"""The loss's options, checked once into ``Options`` (``options_of``: one object per distinct set of values), and a
call's tensors checked against each other and the options (``check_tensors``): shapes, dtypes and devices, before
the plan (_plan.py) is made. What depends on the plan (the FP8 GEMMs' device, the Gram path's blockers) is checked
there; labels past the vocabulary where the count is read (_labels.py).
"""

import dataclasses
import functools
import math
import numbers
import operator
import sys

import torch
from torch.autograd import forward_ad

from . import _teacher_fp8
from ._backends import IMPLS
from ._row_step import RowStepConstants

COSINE_VIA = ("auto", "logits", "gram")
LOSSES = ("cosine", "jsd")  # the soft term: cosine similarity (_row_step.py) or generalized JSD (_row_step_jsd.py)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REAL_OPTIONS = ("weight_hard_loss", "weight_soft_loss", "beta", "temperature", "student_logit_scale",
                "teacher_logit_scale")
SOFTCAPS = ("student_softcap", "teacher_softcap")  # real numbers, or None


def is_real_scalar_tensor(value) -> bool:
    """A one-element tensor of a real dtype (not bool, not complex): read on the host, a number."""
    return torch.is_tensor(value) and value.numel() == 1 and not (value.dtype.is_complex or value.dtype == torch.bool)


def has_forward_tangent(tensor) -> bool:
    """Whether the tensor is a forward-mode AD dual (``torch.autograd.forward_ad``); not asked while torch.compile
    traces."""
    return not torch.compiler.is_compiling() and forward_ad.unpack_dual(tensor).tangent is not None


def check_finite_real(name: str, value) -> None:
    """TypeError unless ``value`` is a real number (a one-element real tensor counts, read on the host), ValueError
    unless finite: a string or a NaN would otherwise reach the row step's constants as a number."""
    is_tensor = torch.is_tensor(value)
    if isinstance(value, bool) or not (is_real_scalar_tensor(value) or (not is_tensor and isinstance(value, numbers.Real))):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if is_tensor and (value.requires_grad or has_forward_tangent(value)):
        raise TypeError(f"{name} is a tensor that requires grad (or carries a forward-mode tangent), and the loss "
                        f"gives its options no gradient: pass "
                        f"{name}.detach(); for learned loss weights, call the loss once per term (weight_hard_loss=1, "
                        "weight_soft_loss=0, then the reverse) and weight the two losses, whose gradients are each "
                        "term's (the soft and hard terms return_soft_hard_loss gives are for logging: no gradient)")
    number = float(value) if is_tensor else value  # not float() of a number: torch.compile would specialize on it
    if isinstance(number, int) and not -sys.float_info.max <= number <= sys.float_info.max:
        raise ValueError(f"{name} must be finite, got {number}")  # an int past float's range
    if not -math.inf < number < math.inf:  # comparisons, not math.isfinite: torch.compile traces them
        raise ValueError(f"{name} must be finite, got {float(number)}")  # float(): a symbolic float's value

# Below it the fast JSD row steps' fp32 products of beta and the teacher's probabilities underflow (and a beta under
# fp32's smallest normal number reads as 0): 0 < beta < this raises but with impl="torch" (docs/reference.md).
SMALLEST_FAST_JSD_BETA = 1e-30


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
        # Whether an option is a one-element tensor, whose value these options read: they serve one call (a tensor
        # updated in place between calls must not meet an earlier call's checked options or plan). An attribute,
        # not a field (the custom op's schema is the fields) nor a cached property (torch.compile cannot trace its lock).
        object.__setattr__(self, "reads_tensors", any(
            torch.is_tensor(getattr(self, field.name)) for field in dataclasses.fields(self)))
        for name in REAL_OPTIONS:
            check_finite_real(name, getattr(self, name))
        if (isinstance(self.ignore_index, bool) or (torch.is_tensor(self.ignore_index) and self.ignore_index.dtype == torch.bool)
                or not _is_integer(self.ignore_index)):  # a bool would ignore label 1
            raise TypeError(f"ignore_index must be an int, got {type(self.ignore_index).__name__} {self.ignore_index!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {float(self.temperature)}")
        for name in SOFTCAPS:
            cap = getattr(self, name)
            if cap is not None:
                check_finite_real(name, cap)
                if not cap > 0:
                    raise ValueError(f"{name} must be > 0 or None, got {float(cap)}")
        if self.chunk_size is not None:
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, numbers.Integral):
                raise TypeError(f"chunk_size must be an int or None, got {type(self.chunk_size).__name__} "
                                f"{self.chunk_size!r}")
            object.__setattr__(self, "chunk_size", int(self.chunk_size))  # NumPy's too, as a Python int
            if self.chunk_size <= 0:
                raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")
        if self.accum_dtype not in (None, *FLOAT_DTYPES):
            raise TypeError(f"accum_dtype must be None, torch.float32 or the student weight's dtype, got {self.accum_dtype}")
        if self.accum_dtype == torch.float16:  # every chunk but the last adds into it before grad_output is known
            raise TypeError("accum_dtype=torch.float16 is not taken: grad_weight's partial sums are added up before "
                            "grad_output (a loss scale) is known, and in fp16 they sink into its subnormals. Pass None "
                            "(fp32 for fp16 weights) or torch.float32")
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
                raise ValueError(f"beta must be in [0, 1] for the generalized JSD, got {float(self.beta)}")
            if self.cosine_via == "gram":
                raise ValueError("loss='jsd' does not take cosine_via='gram': the divergence needs the teacher's logits")
            if 0.0 < self.beta < SMALLEST_FAST_JSD_BETA and self.impl != "torch":
                raise ValueError(
                    f"beta={float(self.beta)!r} is below {SMALLEST_FAST_JSD_BETA:g} but not 0: the fast JSD row steps "
                    f"(impl={self.impl!r}; 'auto' runs them on a GPU) compute in fp32, where the soft term, about beta "
                    "times a KL divergence, underflows. Pass beta=0.0 (the forward KL), or impl='torch' (the float64 "
                    "spec, slower)"
                )

    @functools.cached_property  # read at every call; a frozen dataclass's __dict__ can still hold it
    def constants(self) -> RowStepConstants:
        """The row step's constants."""
        optional = lambda value: None if value is None else float(value)  # noqa: E731
        return RowStepConstants(
            float(self.weight_hard_loss), float(self.weight_soft_loss), float(self.beta), float(self.temperature),
            int(self.ignore_index), student_softcap=optional(self.student_softcap),
            teacher_softcap=optional(self.teacher_softcap), student_logit_scale=float(self.student_logit_scale),
            teacher_logit_scale=float(self.teacher_logit_scale),
        )


OPTION_NAMES = frozenset(field.name for field in dataclasses.fields(Options))


def _is_negative_zero(value) -> bool:
    return isinstance(value, numbers.Real) and value == 0 and math.copysign(1.0, value) < 0


def _is_integer(value) -> bool:
    try:
        operator.index(value)  # ints, NumPy's and one-element integer tensors; not floats
    except TypeError:
        return False
    return True


# The JSD's gradient with fp16 heads at low temperatures (docs/design.md, The generalized JSD, Precision): below it
# the lift's bound, which grows as the teacher's gap over T^2, scales the rows' smaller entries into fp16's
# subnormals (the spec's too).
SMALLEST_FP16_JSD_TEMPERATURE = 1e-3


def check_fp16_jsd_temperature(options: Options, weight_dtype: torch.dtype, write_grad: bool) -> None:
    """ValueError for the JSD's gradient with an fp16 student head below the temperature above; the loss alone runs
    at any temperature."""
    if options.loss != "jsd" or not write_grad:
        return
    temperature = options.temperature  # not float(): torch.compile would specialize on it
    if weight_dtype == torch.float16 and temperature < SMALLEST_FP16_JSD_TEMPERATURE:
        raise ValueError(
            f"temperature={float(temperature)} is below {SMALLEST_FP16_JSD_TEMPERATURE:g} with a float16 student_weight: "
            "the JSD's gradient, stored in float16 rows scaled by a bound that grows as 1 / temperature^2, loses its "
            f"small entries there. Pass float32 weights, or a temperature of at least {SMALLEST_FP16_JSD_TEMPERATURE:g}")


def check_accum_dtype(accum_dtype, weight_dtype: torch.dtype) -> None:
    """The accumulator against the student weight's dtype (the options alone check the rest, fp16 among it)."""
    if accum_dtype not in (None, torch.float32, weight_dtype):
        allowed = ("None or torch.float32" if weight_dtype == torch.float16 else
                   f"None, torch.float32 or student_weight's dtype {weight_dtype}")
        raise TypeError(f"accum_dtype must be {allowed}, got {accum_dtype}")


def default_accum_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """grad_weight's accumulator when accum_dtype is None: the weight's dtype, except fp16, whose
    partial sums (d loss / d logits times hidden, over N, before grad_output -- a loss scale -- can
    lift them) fall into its subnormals (check_accum_dtype refuses it); bf16 has fp32's exponent range."""
    return torch.float32 if weight_dtype == torch.float16 else weight_dtype


@functools.lru_cache(maxsize=64, typed=True)  # typed: 1024.0 == 1024, but only the int is a chunk_size
def _checked(negative_zeros: tuple, **fields) -> Options:
    """``negative_zeros``: the fields that are -0.0, which equals 0.0 with one hash but reaches the losses' sign."""
    return Options(**fields)


def options_of(**fields) -> Options:
    """``Options(**fields)``, one object per distinct set of values: the loss function, called with the same
    keywords at every step, checks them and builds the row step's constants once. Not under torch.compile, which
    builds them once per trace and would trace through the cache (and warn), nor where a value is a tensor."""
    # A tensor hashes by its identity, and its value may change in place between calls: never cached.
    if torch.compiler.is_compiling() or any(torch.is_tensor(value) for value in fields.values()):
        return Options(**fields)
    try:
        hash(tuple(fields.values()))
    except TypeError:  # an unhashable value: Options names the argument
        return Options(**fields)
    negative_zeros = () if 0 not in fields.values() else tuple(  # a scan in C first: zeros are rare
        name for name, value in fields.items() if _is_negative_zero(value))
    return _checked(negative_zeros, **fields)


def is_transformed(tensor: torch.Tensor) -> bool:
    """Whether a torch.func transform wraps the tensor (its kernels and GEMMs into buffers have no rule for them). Not
    asked while torch.compile traces, which cannot trace the question (the custom op then has no rule either)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(tensor)


LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_tensors(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
                  ignore_index, num_valid_tokens=None, vocab_student=None):
    """The call's tensors against each other and the options (shapes, dtypes, devices: no host read).
    ``vocab_student``: the student's whole vocabulary where ``student_weight`` is a vocabulary split's shard."""
    if torch.is_tensor(num_valid_tokens):  # its value is read after the loss is queued (_labels.LabelCounts.wait)
        if not is_real_scalar_tensor(num_valid_tokens):
            raise TypeError(f"num_valid_tokens must be a number or a one-element real tensor, got a "
                            f"{num_valid_tokens.dtype} tensor of shape {tuple(num_valid_tokens.shape)}")
        if num_valid_tokens.requires_grad and torch.is_grad_enabled():
            raise TypeError("num_valid_tokens is a tensor that requires grad, and the loss gives it no gradient: pass "
                            "num_valid_tokens.detach()")
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
    for name, tensor in named.items():
        if torch.is_tensor(tensor) and tensor.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
        if torch.is_tensor(tensor) and is_transformed(tensor):
            raise TypeError(f"{name} is a tensor of a torch.func transform (grad, vjp, jacrev, vmap, jvp): the fused "
                            "losses take only reverse mode, through backward() or torch.autograd.grad")
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
        if weight.shape[1] == 0:
            raise ValueError(f"{prefix}_weight must have a hidden size > 0, got shape {tuple(weight.shape)}")
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
        if bias is not None and bias.dtype != weight.dtype:
            raise TypeError(f"{prefix}_bias dtype {bias.dtype} differs from {prefix}_weight dtype {weight.dtype}")
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
    if true_labels.dtype not in LABEL_DTYPES:  # torch has no comparisons of uint16 to uint64 on the CPU
        raise TypeError(f"true_labels must be an integer tensor (int8 to int64, or uint8), got {true_labels.dtype}")
    label_range = torch.iinfo(true_labels.dtype)
    if not label_range.min <= ignore_index <= label_range.max:  # the comparison with it would wrap around
        raise TypeError(f"true_labels of dtype {true_labels.dtype} cannot hold ignore_index={ignore_index}: "
                        f"pass int64 (or int32) labels")
    vocab_student = student_weight.shape[0] if vocab_student is None else vocab_student
    # labels cast to it from a larger vocabulary have wrapped around; V itself too: the labels are compared with it
    if label_range.max < vocab_student:
        raise TypeError(f"true_labels of dtype {true_labels.dtype} cannot hold the student's vocabulary size "
                        f"{vocab_student}: pass int64 (or int32) labels")
    if teacher_weight.shape[0] == 0:  # a vocabulary split's shard holds at least one teacher row too
        raise ValueError(f"teacher_weight must have at least one row (vocabulary entry), got shape "
                         f"{tuple(teacher_weight.shape)}")
    if teacher_weight.shape[0] < student_weight.shape[0]:
        raise ValueError(
            f"teacher vocab must be >= student vocab: teacher_weight {tuple(teacher_weight.shape)}, "
            f"student_weight {tuple(student_weight.shape)}"
        )
