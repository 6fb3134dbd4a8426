"""Public API: each loss as a function and a module (cosine: ``fused_linear_cosine_distill``; generalized JSD:
``fused_linear_jsd``), and the autograd wrapper that hands the chunk loop's gradients to autograd. Both check their
options into one ``_options.Options`` and run the plan of ``_plan.checked_plan``; under torch.compile the call goes
to the custom op of _compile.py. The other names here are the package's own (hf.py, distributed/, the tests)."""

import difflib
import inspect
import sys
import weakref

import torch

from ._chunk_loop import check_not_creating_graph
from ._device import as_rows, on_device_of
from ._options import OPTION_NAMES, REAL_OPTIONS, Options, is_transformed, options_of
from ._plan import checked_plan, run
from ._split_check import check_vocab_parallel, gather_device
from ._student_metrics import StudentMetrics

__all__ = ["FusedLinearCosineDistillLoss", "FusedLinearJSDLoss", "fused_linear_cosine_distill", "fused_linear_jsd"]


def fused_linear_cosine_distill(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    true_labels,
    student_bias=None,
    teacher_bias=None,
    weight_hard_loss=0.5,
    weight_soft_loss=0.5,
    beta=0.5,
    ignore_index=-100,
    temperature=1.0,
    compiled=True,
    chunk_size=None,
    return_soft_hard_loss=False,
    *,
    num_valid_tokens=None,
    accum_dtype=None,
    impl="auto",
    teacher_precision=None,
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
    vocab_parallel=None,
    cosine_via="auto",
    student_metrics=None,
):
    """Hard cross-entropy plus soft cosine distillation loss through two LM heads, never holding all logits.

    The positional order is that of Liger-Kernel's ``LigerFusedLinearCosineSimilarityFunction.apply``.

    With s_i = student_input_i @ student_weight.T (+ student_bias), zero-padded to Vt in the soft term if Vt > Vs
    (the hard term's CE is over the student's own columns), t_i = teacher_input_i @ teacher_weight.T (+ teacher_bias),
    valid_i = (label_i != ignore_index) and N = num_valid_tokens if given, else max(1, number of valid tokens):

        hard = sum over valid i of CE(s_i, label_i) / N
        soft = sum over valid i of beta * (1 - cos(s_i / temperature, t_i / temperature)) / N
        loss = weight_hard_loss * hard + weight_soft_loss * soft

    cos is torch.nn.functional.cosine_similarity's (eps = 1e-8). Ignored tokens add to neither term and
    get zero gradient. Returns the fp32 scalar loss, or (loss, soft, hard) with return_soft_hard_loss;
    soft and hard are for logging and carry no gradient. Gradients reach student_input, student_weight
    and student_bias in their own dtypes; the teacher is frozen (its logits count as detached, even where its head
    is the student's own).

    Extra keywords: ``num_valid_tokens`` (a positive number or one-element tensor, e.g. a count all-reduced
    across ranks), ``accum_dtype`` (dtype of the grad_weight accumulator: None for the weight's dtype, fp32 for fp16
    weights; torch.float32; or the weight's own dtype unless fp16), ``impl`` ("auto": on Hopper or
    newer the CUDA cluster row step (kernels/row_step_cuda.py) where it applies and Triton elsewhere, Triton
    on older GPUs, torch on the CPU; "torch"; "triton": the Triton kernels only; "cuda": as "auto",
    but an error where clusters are unavailable),
    ``teacher_precision`` (None: the teacher GEMM in the teacher's dtype; "fp8": in FP8 e4m3 with
    row-wise scales, on GPUs with FP8 tensor cores; the quantized weight is cached while unchanged),
    ``student_softcap`` / ``teacher_softcap`` (Gemma-2 style final logit softcapping c: each head's
    logits, bias included, become c * tanh(logits / c) before everything above; None: none),
    ``student_logit_scale`` / ``teacher_logit_scale`` (Cohere style: each head's logits, bias
    included, are multiplied by it, before the softcap; applied inside the fused step),
    ``vocab_parallel`` (both heads split along the vocabulary over ranks: pass the local weight shards
    and a ``cosdistill.distributed.VocabParallelOptions``; see that module),
    ``cosine_via`` ("logits": the teacher's logits GEMM, chunk by chunk; "gram": no teacher logits at
    all, s.t and |t|^2 and the soft term's gradient through the heads' Gram matrices (_teacher_gram.py), for
    heads without biases or softcaps, not vocabulary-parallel, not with the FP8 teacher, in bf16 or
    fp32, and for inputs whose products stay in fp32's range; "auto": "gram" where it applies and
    costs fewer FLOPs, about T > 2 * student hidden size, counting the teacher's Gram matrix where the
    teacher changed since the last call, and the logits path for inputs out of the Gram path's range).
    ``temperature`` changes neither term (cosine is scale-invariant, the hard term uses unscaled logits) but
    through the eps clamp of norms of the logits over it below 1e-8; it is kept for compatibility with Liger.
    ``compiled`` is accepted for compatibility with Liger and changes nothing.
    ``student_metrics`` (a ``cosdistill.StudentMetrics``): the call also fills it in with each token's student
    entropy and whether its label is the student's top logit (TRL's logged ``entropy`` and ``mean_token_accuracy``),
    read from each chunk's logits before its gradient overwrites them; not with ``vocab_parallel``. Under
    torch.compile such a call runs eagerly (a graph break; fullgraph=True raises).
    The teacher's Gram matrix and FP8 copy are cached while the teacher weight is unchanged: a call gives what a
    call on a fresh copy of the weight gives on the same path, or raises ``StaleWeightError`` (_weight_cache.py; on
    a GPU the stale call's loss and gradients are NaN and the next call with that weight raises).
    ``chunk_size`` is the number of tokens per chunk; None sizes it from a memory budget (on the seed
    workload, 2048 tokens per chunk with the teacher's logits in halves of 1024).
    """
    options = call_options(
        (student_input, student_weight, teacher_input, teacher_weight, true_labels), vocab_parallel,
        weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta, ignore_index=ignore_index,
        temperature=temperature, chunk_size=chunk_size, accum_dtype=accum_dtype, impl=impl,
        teacher_precision=teacher_precision, student_softcap=student_softcap, teacher_softcap=teacher_softcap,
        student_logit_scale=student_logit_scale, teacher_logit_scale=teacher_logit_scale, cosine_via=cosine_via,
    )
    return distill(options, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
                   teacher_bias, num_valid_tokens=num_valid_tokens, vocab_parallel=vocab_parallel,
                   return_soft_hard_loss=return_soft_hard_loss, student_metrics=student_metrics)


def call_options(tensors, vocab_parallel, **fields) -> Options:
    """``options_of(**fields)`` for a call. Under a vocabulary split a rank whose options are wrong tells the other
    ranks in the split's first gather (_split_check.check_vocab_parallel), where they wait for it, and every rank
    raises."""
    try:
        return options_of(**fields)
    except (TypeError, ValueError) as error:
        if vocab_parallel is None:
            raise
        check_vocab_parallel(vocab_parallel, None, 0, None, gather_device(tensors), error)
        raise  # check_vocab_parallel raised it already


def distill(options: Options, student_input, student_weight, teacher_input, teacher_weight, true_labels,
            student_bias=None, teacher_bias=None, *, num_valid_tokens=None, vocab_parallel=None,
            return_soft_hard_loss=False, student_metrics=None):
    """The loss for checked options: the function's and the module's body."""
    if torch.compiler.is_compiling() and student_metrics is not None:  # checked there, eagerly
        # A graph break: the compiled op returns the losses alone. Wrapped here, not at import, where
        # torch.compiler.disable would import torch._dynamo, and Triton with it, with the package.
        eager_for_student_metrics = torch.compiler.disable(
            distill, reason="cosdistill's student_metrics: the compiled op returns the losses alone, so this call runs eagerly")
        return eager_for_student_metrics(
            options, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
            teacher_bias, num_valid_tokens=num_valid_tokens, vocab_parallel=vocab_parallel,
            return_soft_hard_loss=return_soft_hard_loss, student_metrics=student_metrics,
        )
    if student_metrics is not None:
        check_student_metrics(student_metrics, vocab_parallel,
                              (student_input, student_weight, teacher_input, teacher_weight, true_labels))
    if torch.compiler.is_compiling():  # torch.compile: the registered custom op, see _compile.py
        # Imported here: registering the op at import would clash with a second copy of the package
        # loaded side by side (the A/B timing of an old tree against this one).
        from . import _compile

        return _compile.compiled_distill(
            options, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
            teacher_bias, num_valid_tokens=num_valid_tokens, vocab_parallel=vocab_parallel,
            return_soft_hard_loss=return_soft_hard_loss,
        )
    plan = checked_plan(options, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                        student_bias, teacher_bias, num_valid_tokens, vocab_parallel)
    labels = true_labels if true_labels.dim() == 1 and true_labels.is_contiguous() else true_labels.reshape(-1).contiguous()
    flat_input = as_rows(student_input)
    metrics_out = None
    if student_metrics is not None:
        metrics_out = (student_metrics.temperature,
                       torch.empty(len(labels), 2, dtype=torch.float32, device=student_input.device))
    # The loop computes the gradients itself (set_grad_enabled costs less host time than no_grad before the first GEMM).
    with on_device_of(student_input), torch.set_grad_enabled(False):
        result = run(plan, flat_input, student_weight, student_bias, as_rows(teacher_input), teacher_weight,
                     teacher_bias, labels, num_valid_tokens, metrics_out)
    if student_metrics is not None:
        per_token = metrics_out[1].reshape(*true_labels.shape, 2)
        student_metrics.entropy, student_metrics.top1 = per_token[..., 0], per_token[..., 1] != 0
        student_metrics.counted = true_labels != options.ignore_index
    loss = result.loss
    if result.gradients is not None:
        loss = _AttachGradients.apply(loss, result.gradients, flat_input, student_weight, student_bias)
    return (loss, result.soft_loss, result.hard_loss) if return_soft_hard_loss else loss


def check_student_metrics(student_metrics, vocab_parallel, tensors) -> None:
    """Raise for a ``student_metrics`` that is not a StudentMetrics, or that a call cannot fill in; under a
    vocabulary split every rank raises (the others wait in the split's first gather, as in ``call_options``)."""
    try:
        if not isinstance(student_metrics, StudentMetrics):
            raise TypeError(f"student_metrics must be a cosdistill.StudentMetrics, got {type(student_metrics).__name__}")
        student_metrics.check()  # its temperature may have changed since it was made
        if vocab_parallel is not None:
            raise ValueError("student_metrics cannot be taken over a vocabulary split (each rank holds a shard of the "
                             "student's logits): leave it out with vocab_parallel")
    except (TypeError, ValueError) as error:
        if vocab_parallel is not None:
            check_vocab_parallel(vocab_parallel, None, 0, None, gather_device(tensors), error)
        raise


class _LossModule(torch.nn.Module):
    """The modules' options are attributes, as Liger's modules keep theirs: one assigned between calls (a schedule of
    beta or of the weights) is checked when assigned and used from the next call; one given as a tensor is read at
    every call."""

    def __init__(self, return_soft_hard_loss, compiled, **given):
        super().__init__()
        self.return_soft_hard_loss = return_soft_hard_loss
        self.compiled = compiled  # Liger's attribute, kept for code that reads it; it changes nothing here
        given = _ints_as_floats(given)
        self._options = Options(**given)  # a bad value raises here, when the module is built
        self._given = given  # from here on a new public name outside _attributes is refused (__setattr__)

    _attributes = ("return_soft_hard_loss", "compiled")  # its public attributes other than the options

    def __setattr__(self, name, value):
        # An option of this module goes to its property even as a Parameter (nn.Module would register it, clashing
        # with the property). A new public name that is another loss's option or close to one of this module's is
        # refused: a misspelled option would be kept, ignored. Other names are kept, as on any module (the ones
        # torch's and other tools' passes set on every submodule, e.g. qconfig).
        if isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
            return
        if ("_given" in self.__dict__ and not name.startswith("_") and name not in self._attributes
                and not hasattr(self, name)):
            close = difflib.get_close_matches(name, [option for option in OPTION_NAMES if hasattr(self, option)], 1)
            if close or name in OPTION_NAMES:
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise AttributeError(f"{type(self).__name__} has no option {name!r}{hint}: its options are its "
                                     "constructor's arguments")
        super().__setattr__(name, value)

    def extra_repr(self):
        """The options given away from the constructor's defaults, e.g. ``FusedLinearJSDLoss(beta=0.1)``."""
        defaults = {name: parameter.default for cls in reversed(type(self).__mro__) if issubclass(cls, _LossModule)
                    for name, parameter in inspect.signature(cls.__init__).parameters.items()}
        values = {**self._given, "return_soft_hard_loss": self.return_soft_hard_loss}
        return ", ".join(f"{name}={value!r}" for name, value in values.items()
                         if name in defaults and (torch.is_tensor(value) or value != defaults[name]))

    @property
    def options(self) -> Options:
        """The checked options of the next call."""
        return options_of(**self._given) if self._options.reads_tensors else self._options

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                teacher_bias=None, *, num_valid_tokens=None, vocab_parallel=None, student_metrics=None):
        options = self._options
        if options.reads_tensors:  # read and checked at every call; under a split an error reaches every rank
            options = call_options((student_input, student_weight, teacher_input, teacher_weight, true_labels),
                                   vocab_parallel, **self._given)
        return distill(options, student_input, student_weight, teacher_input, teacher_weight, true_labels,
                       student_bias, teacher_bias, num_valid_tokens=num_valid_tokens, vocab_parallel=vocab_parallel,
                       return_soft_hard_loss=self.return_soft_hard_loss, student_metrics=student_metrics)


def _option_attribute(name: str) -> property:
    def read(module):
        return module._given[name]

    def assign(module, value):
        given = _ints_as_floats({**module._given, name: value})
        module._options = Options(**given)  # checked before the module changes
        module._given = given

    return property(read, assign, doc=f"The loss's {name}: assigning it checks it, and the next call uses it.")


def _ints_as_floats(given: dict) -> dict:
    """The real options given as Python ints, as floats: under torch.compile an attribute that turns from one type to
    the other (a schedule's ``min(1, step / 4)``) compiles the step again, and Dynamo's recompile limit is near."""
    return {name: float(value) if name in REAL_OPTIONS and type(value) is int and abs(value) <= sys.float_info.max
            else value for name, value in given.items()}  # an int past float's range is left to Options' error


def _options_as_attributes(module_class):
    """Each option its constructor takes becomes an attribute (_option_attribute)."""
    for name in inspect.signature(module_class.__init__).parameters:
        if name in OPTION_NAMES:
            setattr(module_class, name, _option_attribute(name))
    return module_class


@_options_as_attributes
class FusedLinearCosineDistillLoss(_LossModule):
    """nn.Module form of ``fused_linear_cosine_distill``; a drop-in for LigerFusedLinearCosineSimilarityLoss."""

    def __init__(
        self,
        weight_hard_loss=0.5,
        weight_soft_loss=0.5,
        beta=0.5,
        ignore_index=-100,
        temperature=1.0,
        compiled=True,
        chunk_size=None,
        return_soft_hard_loss=False,
        *,
        accum_dtype=None,
        impl="auto",
        teacher_precision=None,
        student_softcap=None,
        teacher_softcap=None,
        student_logit_scale=1.0,
        teacher_logit_scale=1.0,
        cosine_via="auto",
    ):
        super().__init__(
            return_soft_hard_loss, compiled, weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss,
            beta=beta, ignore_index=ignore_index, temperature=temperature, chunk_size=chunk_size,
            accum_dtype=accum_dtype, impl=impl, teacher_precision=teacher_precision, student_softcap=student_softcap,
            teacher_softcap=teacher_softcap, student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale, cosine_via=cosine_via,
        )


def fused_linear_jsd(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    true_labels,
    student_bias=None,
    teacher_bias=None,
    weight_hard_loss=0.5,
    weight_soft_loss=0.5,
    beta=0.5,
    ignore_index=-100,
    temperature=1.0,
    compiled=True,
    chunk_size=None,
    return_soft_hard_loss=False,
    *,
    num_valid_tokens=None,
    accum_dtype=None,
    impl="auto",
    teacher_precision=None,
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
    vocab_parallel=None,
    student_metrics=None,
):
    """Hard cross-entropy plus the generalized Jensen-Shannon divergence through two LM heads, never holding
    all logits. The positional order is that of Liger-Kernel's ``LigerFusedLinearJSDFunction.apply``.

    With s_i, t_i, valid_i and N as in ``fused_linear_cosine_distill`` (s zero-padded to Vt in the soft term if
    Vt > Vs),
    p_i = softmax(s_i / temperature), q_i = softmax(t_i / temperature) and M_i = (1 - beta) p_i + beta q_i:

        hard = sum over valid i of CE(s_i, label_i) / N
        soft = sum over valid i of JSD_beta(p_i, q_i) / N,  JSD_beta = beta KL(q || M) + (1 - beta) KL(p || M),
               with KL(q || p) at beta = 0 (forward KL) and KL(p || q) at beta = 1 (reverse KL)
        loss = weight_hard_loss * hard + weight_soft_loss * soft

    as TRL's ``GKDTrainer.generalized_jsd_loss`` and Liger-Kernel 0.8.5's ``LigerFusedLinearJSDLoss`` (no factor
    temperature^2). The row step is _row_step_jsd.py's torch spec on the CPU and ``impl="torch"``, on Hopper its
    cluster kernel (kernels/row_step_jsd_cuda.py) where it applies, else its Triton twin; the GEMMs, the
    chunking, the FP8 teacher (``teacher_precision="fp8"``) and the other keywords are the cosine loss's. The
    softcaps and logit scales are ``fused_linear_cosine_distill``'s: each model's logits times its scale, then
    softcapped, before both terms. With ``vocab_parallel`` each row step (one per teacher sub-chunk) all-gathers two
    small per-token tensors (the log-sum-exps, then the divergence's sums) where the cosine loss gathers one, besides
    the call's two
    gathers that check the split (cosdistill.distributed.vocab_parallel). ``compiled`` is accepted
    for compatibility with Liger and changes nothing. fp16 weights take the cosine loss's lifted fp16 gradient
    (the Triton step's on a GPU: the cluster kernel takes bf16 only).
    """
    options = call_options(
        (student_input, student_weight, teacher_input, teacher_weight, true_labels), vocab_parallel,
        weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta, ignore_index=ignore_index,
        temperature=temperature, chunk_size=chunk_size, accum_dtype=accum_dtype, impl=impl,
        teacher_precision=teacher_precision, cosine_via="logits", loss="jsd", student_softcap=student_softcap,
        teacher_softcap=teacher_softcap, student_logit_scale=student_logit_scale,
        teacher_logit_scale=teacher_logit_scale,
    )
    return distill(options, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
                   teacher_bias, num_valid_tokens=num_valid_tokens, vocab_parallel=vocab_parallel,
                   return_soft_hard_loss=return_soft_hard_loss, student_metrics=student_metrics)


FUSED_LOSSES = {"cosine": fused_linear_cosine_distill, "jsd": fused_linear_jsd}  # the loss function of each Options.loss


@_options_as_attributes
class FusedLinearJSDLoss(_LossModule):
    """nn.Module form of ``fused_linear_jsd``; a drop-in for Liger-Kernel's LigerFusedLinearJSDLoss."""

    def __init__(self, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100, temperature=1.0,
                 compiled=True, chunk_size=None, return_soft_hard_loss=False, *, accum_dtype=None, impl="auto",
                 teacher_precision=None, student_softcap=None, teacher_softcap=None, student_logit_scale=1.0,
                 teacher_logit_scale=1.0):
        super().__init__(
            return_soft_hard_loss, compiled, weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss,
            beta=beta, ignore_index=ignore_index, temperature=temperature, chunk_size=chunk_size,
            accum_dtype=accum_dtype, impl=impl, teacher_precision=teacher_precision, cosine_via="logits", loss="jsd",
            student_softcap=student_softcap, teacher_softcap=teacher_softcap, student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale,
        )


class _AttachGradients(torch.autograd.Function):
    """Hands the chunk loop's gradients (computed in its one pass over the logits, for grad_output = 1) to
    autograd: forward passes the loss on, backward applies grad_output."""

    @staticmethod
    def forward(ctx, loss, gradients, student_input, student_weight, student_bias):
        ctx.gradients = gradients
        # The last chunk's gradient GEMMs read both in backward: autograd raises if either was modified in place, but
        # not where saved-tensor hooks (save_on_cpu, allow_mutation_on_saved_tensors) hand it back what it saved, so
        # their version counters are read here too, through the tensor a view was made of (the input is often a view
        # made in the call, gone by backward), held weakly: offloading hooks are there to free the device's copy.
        ctx.save_for_backward(student_input, student_weight)
        ctx.versions = [(weakref.ref(t if t._base is None else t._base), t._version)
                        for t in (student_input, student_weight) if not t.is_inference()]
        ctx.set_materialize_grads(False)
        ctx.grad_dtypes = tuple(None if t is None else t.dtype for t in (student_input, student_weight, student_bias))
        return loss.clone()  # a new tensor: the caller may modify it in place, which an input passed on forbids

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.gradients is None:
            raise RuntimeError("cosdistill computes gradients in forward and can run backward only once per call")
        check_not_creating_graph()
        # before the gradients are taken, so that a retry works; is_grads_batched runs torch's legacy vmap
        if grad_loss is not None and (is_transformed(grad_loss) or torch._C._functorch.is_legacy_batchedtensor(grad_loss)):
            raise RuntimeError("cosdistill's losses take one grad_output per backward, not a batch of them "
                               "(torch.autograd.grad's is_grads_batched, a vectorized jacobian): loop over them")
        # before the gradients are taken too, so that a retry raises the same
        ctx.saved_tensors  # noqa: B018 -- raises if the student's input or weight changed since forward
        if any(tensor() is not None and tensor()._version != version for tensor, version in ctx.versions):
            raise RuntimeError("the student's input or head weight was modified in place after the loss's forward, and "
                               "its backward reads them (autograd's own check does not run under saved-tensor hooks): "
                               "modify them after backward, or a clone of them before")
        gradients, ctx.gradients, ctx.versions = ctx.gradients, None, None
        if grad_loss is None:  # not materialized: no gradient reached the loss
            return None, None, None, None, None
        with on_device_of(grad_loss):
            grads = gradients.finish(grad_loss.detach())
        cast = [None if grad is None else grad.to(dtype) for grad, dtype in zip(grads, ctx.grad_dtypes)]
        return (None, None, *cast)
