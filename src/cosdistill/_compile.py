"""The loss as a registered custom op (torch.library), the form ``torch.compile`` sees.

The eager path (api.distill, api._AttachGradients) cannot be traced by Dynamo: its
forward reads label counts on the host, raises on bad labels and launches Triton kernels, and its backward
reads grad_output on the host to fold it into the last grad_weight GEMM. Each would break the graph.

So while compiling, ``api.distill`` hands over to ``compiled_distill`` here. It runs
the checks that need no host read at trace time (the same rules and messages as eager), flattens 3-D
inputs and calls ``cosdistill::fused_linear_distill``, an opaque op for both losses (its ``loss``
option picks the cosine term or the generalized JSD): the compiler sees only its
fake (meta) implementation, and at run time the real one runs eagerly as one call into the same chunk
loop as eager. The op returns the loss, soft, hard and the student gradients for grad_output = 1,
computed in the same single pass; its registered backward only multiplies them by grad_output.

What differs from eager:
* Bad labels (outside [0, Vs), not ignore_index) still raise the eager ValueError, but at run time
  from inside the op, when the compiled step executes it; a bad num_valid_tokens tensor likewise.
  Checks of shapes, dtypes and options raise at trace time, i.e. on the first call of the step.
* grad_output scales the gradients with a plain multiply in backward (an extra pass over each
  gradient; inductor fuses it with the cast) instead of riding on the last GEMM's alpha/beta. The
  roundings are eager's: grad_weight leaves the op in the accum dtype and grad_bias in fp32, and
  both are cast to their leaves' dtypes only after the multiply. Only a bf16 accumulator
  (accum_dtype = the weight's dtype, the default for bf16 weights) rounds grad_weight once more.
* the op's backward may run more than once (eager raises): the saved gradients are not consumed (torch.compile
  itself refuses a second backward where its donated buffers were freed, e.g. under dynamic=True). Neither runs with
  create_graph=True (their gradients have no gradient of their own): the op raises, torch.compile refuses the
  double backward itself.
* The op is tagged cudagraph_unsafe: inductor's CUDA graphs (mode="reduce-overhead") leave it out.
* Scalar options reach the op as Python numbers: one given as a tensor (a ``beta`` in a tensor) is read on the
  host, a graph break (docs/reference.md, torch.compile); num_valid_tokens may be a number or a tensor, as in
  eager. The real options (``REAL_OPTIONS``) and a num_valid_tokens number
  reach the op in CPU tensors, so that a schedule's new values keep the step's graph (symbolic after one
  recompile); their checks then run on symbolic floats, whose guards keep a bad value out of that graph.
Gradients not asked for come back from the op as empty tensors (custom ops cannot return None).
"""

import dataclasses

import torch
from torch import Tensor

from ._chunk_loop import check_not_creating_graph
from ._device import on_device_of
from ._options import REAL_OPTIONS, Options, check_tensors, default_accum_dtype
from ._plan import checked_backend, gradients_needed, make_plan, run
from ._teacher_fp8 import Fp8TeacherWeight

# The body reads label counts on the host, which a CUDA graph cannot capture ("reduce-overhead" mode).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _grad_input_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """fp16's grad_input leaves the op in fp32: rounded at grad_output = 1, a loss scale's small entries would be
    lost and a small grad_output's large ones inf, where eager applies grad_output first."""
    return torch.float32 if input_dtype == torch.float16 else input_dtype


@torch.library.custom_op("cosdistill::fused_linear_distill", mutates_args=(), tags=_TAGS)
def fused_linear_distill_op(
    student_input: Tensor,  # [T, Hs]
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_input: Tensor,  # [T, Ht]
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    labels: Tensor,  # [T]
    num_valid_tokens: Tensor | None,
    # The real options (REAL_OPTIONS' order) in a float64 CPU tensor: as floats of the schema, each new value (a
    # weight, beta or temperature on a schedule) would compile the step again
    real_options: Tensor,
    teacher_scales: Tensor | None = None,  # an Fp8TeacherWeight's: teacher_weight is then its codes
    # num_valid_tokens given as a number, held in a 0-d CPU tensor, for the same reason
    num_valid_count: Tensor | None = None,
    *,
    teacher_shape: list[int] | None = None,  # an Fp8TeacherWeight's (its codes are padded)
    needs_grad: list[bool],  # input, weight, bias
    # Options' other fields, as the op's schema takes them:
    ignore_index: int,
    chunk_size: int | None,
    accum_dtype: torch.dtype | None,
    impl: str,
    teacher_precision: str | None,
    student_softcap: float | None,
    teacher_softcap: float | None,
    cosine_via: str = "auto",
    loss: str = "cosine",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, soft, hard, grad_input, grad_weight, grad_bias) for grad_output = 1; runs eagerly.

    grad_weight comes in the accum dtype and grad_bias in fp32, cast to their leaves' dtypes in backward."""
    options = Options(
        **dict(zip(REAL_OPTIONS, real_options.tolist())), ignore_index=ignore_index, chunk_size=chunk_size,
        accum_dtype=accum_dtype, impl=impl, teacher_precision=teacher_precision, student_softcap=student_softcap,
        teacher_softcap=teacher_softcap, cosine_via=cosine_via, loss=loss,
    )
    if teacher_scales is not None:
        teacher_weight = Fp8TeacherWeight(teacher_weight, teacher_scales, torch.Size(teacher_shape), teacher_input.dtype)
    plan = make_plan(options, student_weight, student_bias, teacher_weight, teacher_bias, labels.numel(),
                     tuple(needs_grad))
    given = num_valid_tokens if num_valid_tokens is not None else None if num_valid_count is None else (
        num_valid_count.item())
    with on_device_of(student_input), torch.no_grad():
        result = run(plan, student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias,
                     labels, given)
        grads = (None, None, None) if result.gradients is None else result.gradients.finish(
            grad_input_dtype=_grad_input_dtype(student_input.dtype))
    grads = [student_weight.new_empty(0) if grad is None else grad for grad in grads]
    return result.loss, result.soft_loss, result.hard_loss, *grads


@fused_linear_distill_op.register_fake
def _(student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, labels,
      num_valid_tokens, real_options, teacher_scales=None, num_valid_count=None, *, accum_dtype, needs_grad, **options):
    scalars = [student_input.new_empty((), dtype=torch.float32) for _ in range(3)]
    grad_dtypes = (_grad_input_dtype(student_input.dtype), accum_dtype or default_accum_dtype(student_weight.dtype),
                   torch.float32)
    grads = [
        leaf.new_empty(leaf.shape, dtype=dtype) if need else student_weight.new_empty(0)
        for need, leaf, dtype in zip(needs_grad, (student_input, student_weight, student_bias), grad_dtypes)
    ]
    return (*scalars, *grads)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.needs_grad = keyword_only_inputs["needs_grad"]
    ctx.dtypes = [None if leaf is None else leaf.dtype for leaf in inputs[:3]]
    ctx.save_for_backward(*output[3:])


def _backward(ctx, grad_loss, _grad_soft, _grad_hard, *_grad_grads):
    check_not_creating_graph()
    grads = [
        # grad first: CPU's mul then scales a bf16/fp16 grad in fp32 instead of rounding grad_loss first
        (grad * grad_loss).to(dtype) if need else None  # scaled, then rounded to the leaf's dtype, as in eager
        for need, grad, dtype in zip(ctx.needs_grad, ctx.saved_tensors, ctx.dtypes)
    ]
    # teacher_input, teacher_weight, teacher_bias, labels, num_valid_tokens, real_options, teacher_scales,
    # num_valid_count
    return (*grads, None, None, None, None, None, None, None, None)


fused_linear_distill_op.register_autograd(_backward, setup_context=_setup_context)


def _op_options(options: Options) -> dict:
    """The options but the real ones (``real_options_tensor``) as the op's schema takes them: Python floats and ints
    (not NumPy or 0-d tensor scalars)."""
    values = {}
    for field in dataclasses.fields(options):
        if field.name in REAL_OPTIONS:
            continue
        value, kinds = getattr(options, field.name), (field.type, *getattr(field.type, "__args__", ()))
        values[field.name] = value if value is None else float(value) if float in kinds else int(value) if int in kinds else value
    return values


def real_options_tensor(options: Options) -> Tensor:
    """The real options, in REAL_OPTIONS' order, as the op's float64 CPU tensor."""
    reals = [getattr(options, name) for name in REAL_OPTIONS]
    return torch.stack([_cpu_float64(float(value) if torch.is_tensor(value) else value) for value in reals])


def _cpu_float64(value) -> Tensor:
    """A 0-d float64 CPU tensor holding the number ``value``: zeros + value, not scalar_tensor(value), which
    specializes a symbolic float on its value under torch.compile (sym_float: an int past int64's range, symbolic
    or not, as a float); on the CPU whatever the default device, so the op reads it without a wait."""
    return torch.zeros((), dtype=torch.float64, device="cpu") + torch.sym_float(value)


def compiled_distill(options: Options, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                     student_bias=None, teacher_bias=None, *, num_valid_tokens=None, vocab_parallel=None,
                     return_soft_hard_loss=False):
    """``api.distill`` through the custom op: traceable, no host reads."""
    if vocab_parallel is not None:
        raise ValueError("vocab_parallel is not supported under torch.compile: call the loss outside the compiled "
                         "region (torch.compiler.disable) or without vocab_parallel")
    check_tensors(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
                  teacher_bias, options.ignore_index, num_valid_tokens)
    needs_grad = list(gradients_needed(student_input, student_weight, student_bias))
    checked_backend(options, student_weight, needs_grad)  # make_plan's rules, at trace time
    given_tensor = torch.is_tensor(num_valid_tokens)
    count = None if given_tensor or num_valid_tokens is None else _cpu_float64(num_valid_tokens)
    quantized = isinstance(teacher_weight, Fp8TeacherWeight)
    loss, soft, hard, *_ = fused_linear_distill_op(
        student_input.reshape(-1, student_input.shape[-1]),
        student_weight,
        student_bias,
        teacher_input.reshape(-1, teacher_input.shape[-1]),
        teacher_weight.codes if quantized else teacher_weight,  # backward gives it None
        teacher_bias,
        true_labels.reshape(-1).contiguous(),
        num_valid_tokens if given_tensor else None,
        real_options_tensor(options),
        teacher_weight.scales if quantized else None,
        count,
        teacher_shape=list(teacher_weight.shape) if quantized else None,
        needs_grad=needs_grad,
        **_op_options(options),
    )
    soft, hard = soft.detach(), hard.detach()  # for logging, as in eager
    return (loss, soft, hard) if return_soft_hard_loss else loss
