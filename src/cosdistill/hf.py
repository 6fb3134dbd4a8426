"""Distillation of Hugging Face causal LMs (cosine or generalized JSD), from their final hidden states (needs
``transformers``).

``distill_loss`` is the loss of ``fused_linear_cosine_distill`` (or ``fused_linear_jsd``) for a student and a
teacher causal LM and a batch (input_ids, attention_mask, labels), computed without the full logits of
either model; ``DistillationTrainer`` is a ``transformers.Trainer`` that trains with it.
"""

import collections.abc
import contextlib
import inspect
import math
import numbers
import sys
import weakref

import torch

try:
    from transformers import Trainer, TrainerCallback
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as error:
    raise ImportError("cosdistill.hf needs transformers: pip install 'cosdistill[hf]'") from error

from ._options import OPTION_NAMES, options_of
from ._row_step import scale_and_softcap
from ._weight_cache import note_trained
from .api import FUSED_LOSSES

# The public names; the others are internal, and trl.py builds its trainers from some of them (lm_head, the check_*
# functions, loss_of_hidden_states's pieces).
__all__ = ["CosineDistillationTrainer", "DistillationMixin", "DistillationTrainer", "cosine_distill_loss", "distill_loss",
           "final_hidden_states", "head_inputs", "keep_head_hook", "loss_labels", "loss_of_hidden_states",
           "next_token_targets", "tensor_parallel_rows"]


# --- The model's LM head, and the hidden states its forward hands it.


def lm_head(model, name="model"):
    """The torch.nn.Linear that ``model.get_output_embeddings()`` runs (tied or not, with or without bias): under a
    PEFT ``modules_to_save`` wrapper the active adapter's copy (the original where none is active), under a merged
    adapter its base layer."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):  # BART's makes decoder inputs of input_ids: a number, but no loss
        raise ValueError(f"{name} is an encoder-decoder model ({type(model).__name__}); the fused loss is for causal "
                         "LMs, whose position i predicts input_ids[i + 1]")
    stages = getattr(getattr(config, "distributed_config", None), "pp_size", None) or 1
    if stages > 1:  # checked on every rank: a rank holding the head would wait in the first forward for the others
        raise ValueError(f"{name} is loaded for pipeline parallelism (transformers' DistributedConfig pp_size={stages}), "
                         "which the fused loss does not support: its LM head is on the last stage alone")
    head = model.get_output_embeddings()
    wrapper = type(head).__name__
    if wrapper == "ModulesToSaveWrapper":
        active = [adapter for adapter in head.active_adapters if adapter in head.modules_to_save]
        head = head.original_module if head.disable_adapters or not active else head.modules_to_save[active[0]]
    elif wrapper == "TrainableTokensWrapper":
        raise TypeError(
            f"{name}'s LM head trains some of its rows apart ({wrapper}, PEFT's trainable_token_indices); the fused "
            "loss needs the head as one weight matrix: put the head (or the tied embeddings) in modules_to_save instead"
        )
    elif hasattr(head, "base_layer"):  # a PEFT adapter (LoRA, ...) around the head
        if getattr(head, "merged", False) and not getattr(head, "disable_adapters", False):
            return lm_head_linear(head.get_base_layer(), name)
        # PEFT cannot merge an adapter into a head split for tensor parallelism: there, only the first way out works
        merge = ("" if is_dtensor(getattr(head.get_base_layer(), "weight", None))
                 else ", or merge the adapter into it (merge_adapter() or merge_and_unload())")
        raise TypeError(
            f"{name}'s LM head carries an adapter ({type(head).__module__}.{wrapper}); the fused loss needs the head "
            f"as one weight matrix: leave the LM head out of the adapter's target_modules{merge}"
        )
    return lm_head_linear(head, name)


def check_teacher_head_is_not_a_trained_copy(student, teacher) -> None:
    """Refuses a teacher whose LM head is the student's under PEFT's ``modules_to_save`` with an adapter active
    (self-distillation through ``disable_adapter()``): the teacher's logits would come from the student's trained
    copy of the head, whichever way its hidden states were taken."""
    head = student.get_output_embeddings()
    if (type(head).__name__ == "ModulesToSaveWrapper" and head is teacher.get_output_embeddings()
            and lm_head(student) is not head.original_module):
        raise ValueError(
            "the teacher's LM head is the student's, which PEFT's modules_to_save trains as a copy: the teacher's "
            "logits would come from the student's trained copy, not the original head. Use a teacher model of its "
            "own, or keep the head out of modules_to_save"
        )


def wrapped_model(model):
    """The model a DistributedDataParallel-style wrapper holds (``.module``), the model itself otherwise: its head and
    config are read there, while its forward runs through the wrapper (DDP's gradient sync)."""
    if isinstance(model, torch.nn.DataParallel):  # its replicas would each call the head hook
        raise TypeError("torch.nn.DataParallel is not supported: run one process per GPU under "
                        "DistributedDataParallel (torchrun, accelerate launch)")
    return unwrapped(model)


def unwrapped(model):
    """The model inside any ``.module`` wrappers: the first that has a head of its own."""
    while not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def lm_head_linear(head, name):
    """The head, checked to be a torch.nn.Linear whose forward is its own and Linear's; under torch.compile (as
    accelerate's regional compilation compiles each block and the head) the module compiled."""
    if isinstance(getattr(head, "_orig_mod", None), torch.nn.Module):
        head = head._orig_mod
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"{name}.get_output_embeddings() must be a torch.nn.Linear, got {type(head).__name__}")
    if type(head).forward is not torch.nn.Linear.forward:  # a learned scale, a quantized weight: not h W^T + b
        raise ValueError(
            f"{name}'s LM head {type(head).__module__}.{type(head).__name__} has a forward of its own, which the fused "
            "loss, reading the head's weight and bias, would leave out (e.g. a learned logit scale, which would then "
            "never train)"
        )
    if runs_another_modules_forward(head):
        raise ValueError(
            f"{name}'s LM head runs another module's forward (set on it as an attribute): the model's logits come from "
            "that module's weights, not the head's the fused loss reads. A deep copy of a head whose forward was replaced "
            "does this, e.g. PEFT's modules_to_save on a head split by transformers' tp_plan: keep the head out of "
            "modules_to_save there"
        )
    return head


def runs_another_modules_forward(module) -> bool:
    """Whether ``module.forward`` is an attribute that runs another module: a method bound to it, or a closure or
    partial holding it (transformers' tensor-parallel forward holds its module; a deep copy keeps the original's).
    The fused loss reads this module's weight, the model's own logits (evaluation, generation) would be the other's."""
    forward = vars(module).get("forward")
    if forward is None:
        return False
    held = [forward.__self__] if inspect.ismethod(forward) else list(getattr(forward, "args", ()))
    for cell in getattr(forward, "__closure__", None) or ():
        value = cell.cell_contents
        held.append(value.__self__ if inspect.ismethod(value) else value)
    return any(isinstance(value, torch.nn.Module) and value is not module for value in held)


def head_calls_error(calls: int) -> ValueError:
    return ValueError(f"the model's forward called its LM head {calls} times, expected once (a model compiled by "
                      "torch.compile whose first call ran without hooks skips them: call keep_head_hook(model) before "
                      "that call; a copy of a model whose forward TRL or accelerate had replaced runs the original's "
                      "forward: copy the model before a trainer is built on it)")


def final_hidden_states(model, input_ids, attention_mask=None, head=None, **model_inputs):
    """The input of the model's LM head [B, L, H]: the final hidden states, after the final norm.

    For Llama, Gemma-2, Cohere, Qwen2 and GPT-2 this is the backbone's ``last_hidden_state`` (MiniCPM3's is it
    divided by ``config.logits_scaling``). It is
    taken from the model's own forward (so wrappers such as DDP and accelerate's autocast apply),
    with the head handed zero positions, so no logits are computed. ``head`` is the model's LM head,
    by default ``model.get_output_embeddings()``; pass it when ``model`` is a wrapper without that method.
    ``model_inputs``: the batch's other forward inputs (position_ids and the flash-attention sequence
    boundaries of packed batches, token_type_ids, ...), passed on as they are. The virtual tokens a PEFT
    prompt-learning adapter puts before the input's are left out (the last of them predicts the input's first token,
    which PEFT's own loss trains on and the fused loss cannot: no teacher position predicts it). The head's hook
    (``HeadInputHook``) is the one ``keep_head_hook`` left on it, else one added for this call.
    """
    head = lm_head(model) if head is None else head
    kept = _kept_hooks.get(head)
    hook = kept or HeadInputHook()
    handle = None if kept else head.register_forward_pre_hook(hook)
    hook.capturing = True
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_inputs)
    finally:
        hook.capturing = False
        captured = list(hook.captured)
        hook.captured.clear()  # in place: a compiled model's graph appends to this very list
        if handle is not None:
            handle.remove()
    if len(captured) != 1:
        raise head_calls_error(len(captured))
    # torch's ColwiseParallel hands the head a replicated DTensor: its local tensor is the whole hidden states.
    hidden = local_of(captured[0])
    extra = hidden.shape[-2] - input_ids.shape[-1]
    if extra:
        if extra != virtual_tokens(model):
            raise ValueError(f"the model's LM head saw {hidden.shape[-2]} positions for input_ids of shape "
                             f"{tuple(input_ids.shape)}: the fused loss needs one per input token")
        packing = sorted(PACKING_INPUTS & set(model_inputs))
        if packing:  # PEFT's prompt learning drops position_ids: the packed sequences would attend to each other
            raise ValueError(f"a prompt-learning adapter's model cannot take a packed batch ({', '.join(packing)}): "
                             "PEFT drops its position_ids, so each sequence would attend to the ones before it")
        hidden = hidden[..., extra:, :]  # a prompt-learning adapter's virtual tokens, before the input's
    return hidden


@contextlib.contextmanager
def in_eval_mode(model):
    """The model in eval mode (no dropout), each module's own mode restored afterwards: a teacher that shares modules
    with the student (a PEFT student's base model) neither runs with the student's dropout nor leaves it off."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def without_student_adapters(student, teacher):
    """A context for the teacher's forward: where it would run through PEFT adapter layers (LoRA, DoRA, IA3, ...)
    that it shares with the student, with their adapters on (the teacher is the PEFT student's base model, or the
    student itself), or where it is a prompt-learning student itself, the student's ``disable_adapter()``, so that
    the teacher is the base model and not the student (whose soft loss against itself is 0); otherwise nothing.
    Raises where shared adapter layers cannot be turned off that way (a student that is not a ``PeftModel``, or a
    prompt-learning one)."""
    student, teacher = unwrapped(student), unwrapped(teacher)
    config = getattr(student, "active_peft_config", None)
    if teacher is student and config is not None and config.is_prompt_learning:
        return student.disable_adapter()  # its base model's forward: no virtual tokens
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # no PEFT imported: no adapter layers
    if tuners is None:
        return contextlib.nullcontext()
    adapters_on = {id(module) for module in student.modules()
                   if isinstance(module, tuners.BaseTunerLayer) and not module.disable_adapters}
    if not any(id(module) in adapters_on for module in teacher.modules()):
        return contextlib.nullcontext()
    if not hasattr(student, "disable_adapter") or config is None or config.is_prompt_learning:
        raise ValueError(
            f"the teacher runs through the student's PEFT adapter layers with their adapters on, so it would be the "
            f"student ({type(student).__name__} cannot turn them off for the teacher's forward): pass a teacher model "
            "of its own, or the PeftModel student, whose disable_adapter() the teacher's forward then runs under"
        )
    return student.disable_adapter()


def teacher_forward_model(student, teacher):
    """The model whose forward gives the teacher's hidden states: the student as passed (wrappers included) where
    the teacher is the PEFT student's own base model or the student itself, else the teacher. Through the student,
    the forward runs the hooks on the student's root: FSDP2's ``fully_shard`` of the PeftModel gathers the
    embeddings and the final norm there, which a forward of the base model alone finds sharded. The adapters are
    turned off around it by ``without_student_adapters``; the head and config are the student's, its check too. A
    prompt-learning student's base model runs as itself: through the student it would see the virtual tokens."""
    inner, teacher_inner = unwrapped(student), unwrapped(teacher)
    config = getattr(inner, "active_peft_config", None)  # PEFT's PeftModel
    if teacher_inner is inner or (config is not None and not config.is_prompt_learning
                                  and teacher_inner is inner.get_base_model()):
        return student
    return teacher


# The model inputs that mark a packed batch's sequence boundaries.
PACKING_INPUTS = frozenset({"position_ids", "cu_seq_lens_q", "cu_seq_lens_k"})


class HeadInputHook:
    """The forward pre-hook through which ``final_hidden_states`` reads an LM head's input: while ``capturing``, it
    keeps that input and hands the head zero positions, so no logits are computed (one position where the head is
    a tensor-parallel DTensor, whose ops cannot take zero: a [B, 1, V] product); otherwise it does nothing."""

    def __init__(self):
        self.capturing = False
        self.captured = []

    def __call__(self, module, args):
        if self.capturing:
            self.captured.append(args[0])
            return (args[0][..., : int(is_dtensor(module.weight)), :],)
        return None


_kept_hooks = weakref.WeakKeyDictionary()  # LM head -> the HeadInputHook kept on it


def keep_head_hook(model, head=None) -> None:
    """Keeps ``final_hidden_states``' hook on the model's LM head for the model's life, idle but while it captures, so
    that a compiled model runs it: graphs traced from a call without any hook on a module skip hooks added later
    (with one, they guard on whether it captures). The Trainers call it when made. Idempotent."""
    head = lm_head(model) if head is None else head
    if head not in _kept_hooks:
        hook = _kept_hooks[head] = HeadInputHook()
        head.register_forward_pre_hook(hook)


def virtual_tokens(model) -> int:
    """The num_virtual_tokens of a PEFT prompt-learning adapter, 0 for other models: prompt tuning and P-tuning
    put that many positions before the input's (prefix tuning adds keys and values, no position)."""
    config = getattr(unwrapped(model), "active_peft_config", None)
    return config.num_virtual_tokens if getattr(config, "is_prompt_learning", False) else 0


# --- The loss's targets: which labels a batch leaves without one.


def loss_labels(labels, attention_mask=None, *, position_ids=None, ignore_index=-100, cu_seq_lens=None):
    """labels with ignore_index wherever the loss has no target, so that any count of labels !=
    ignore_index (the Trainer's num_items_in_batch, shifted or not) is the loss's own count.

    Label j is the target of position j - 1: none for j = 0, for a padding position j or j - 1
    (attention_mask == 0; left padding too), or for the first token of a packed sequence (where
    position_ids does not increase, or at a boundary of ``cu_seq_lens``, the flash-attention
    cumulative lengths of a one-row packed batch): labels never cross a sequence boundary. position_ids of
    one row ([1, L]) serve every row, as the models broadcast them.
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, length], got shape {tuple(labels.shape)}")
    no_target = torch.zeros_like(labels, dtype=torch.bool)
    no_target[:, 0] = True
    if attention_mask is not None:
        if attention_mask.shape != labels.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match labels "
                             f"{tuple(labels.shape)}")
        padding = ~attention_mask.bool()
        no_target |= padding
        no_target[:, 1:] |= padding[:, :-1]
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, labels.shape[0]) or (
                position_ids.shape[1] != labels.shape[1]):
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} does not match labels "
                             f"{tuple(labels.shape)} (nor one row of them)")
        no_target[:, 1:] |= position_ids[:, 1:] <= position_ids[:, :-1]
    if cu_seq_lens is not None:
        starts = cu_seq_lens.flatten().long()
        no_target[:, starts[(starts > 0) & (starts < labels.shape[1])]] = True
    return labels.masked_fill(no_target, ignore_index)


def next_token_targets(labels, attention_mask=None, *, position_ids=None, ignore_index=-100, cu_seq_lens=None):
    """Position i's target, shaped [B, L] like the hidden states so that these need no slicing.

    As in Hugging Face's causal LM loss, position i predicts labels[:, i + 1]; the last position gets
    ignore_index, and so does every position whose next label ``loss_labels`` leaves without a target
    (padding at i or i + 1, a packed sequence starting at i + 1).
    """
    targets = loss_labels(labels, attention_mask, position_ids=position_ids, ignore_index=ignore_index,
                          cu_seq_lens=cu_seq_lens)
    return torch.cat([targets[:, 1:], targets.new_full((targets.shape[0], 1), ignore_index)], dim=1)


# --- Heads split for tensor parallelism, and the vocabulary split the loss takes from them.


def is_dtensor(tensor) -> bool:
    return type(tensor).__name__ == "DTensor"  # DTensor only exists where torch.distributed does


def local_of(tensor):
    """This rank's part of a DTensor (the whole of a replicated one), its gradient flowing back; other tensors as
    they are."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def whole_head_weight(model, head):
    """The head's weight, whole, or split along the vocabulary for tensor parallelism (``tensor_parallel_rows``).
    Under FSDP2 (``fully_shard``) the forward may have sharded it again
    (``reshard_after_forward``, or the head in a unit of its own), and with it the root's parameters that
    the hidden states' backward reads (the final norm): the loss's graph starts at the hidden states, not at
    the model's outputs, so FSDP's pre-backward hooks would not gather them. Each FSDP module that holds the
    head gathers its parameters again (``unshard``); their gradients go through FSDP's reduction as usual."""
    if not is_dtensor(head.weight):
        return head.weight
    for module in fsdp_modules_holding(model, head):  # outermost first
        module.unshard()
    if is_dtensor(head.weight) and tensor_parallel_rows(head.weight) is None:
        raise TypeError(f"the LM head's weight is a sharded DTensor that no FSDP2 module above it gathers "
                        f"({type(head).__name__}, placements {head.weight.placements}); the fused loss needs it whole "
                        "or split along the vocabulary over one mesh dimension")
    return head.weight


def fsdp_modules_holding(model, head) -> list:
    """The FSDP2 (``fully_shard``) modules of the model that hold the head, outermost first: between forwards its
    weight is their shard, a DTensor that is not a split for tensor parallelism."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules()
            if isinstance(module, FSDPModule) and any(sub is head for sub in module.modules())]


def split_head_rows(model, role):
    """``tensor_parallel_rows`` of the model's LM head, None where FSDP2 holds it (transformers' own FSDP shards a
    head at loading, as one split for tensor parallelism looks, and gathers it whole for the loss)."""
    head = lm_head(model, role)
    rows = tensor_parallel_rows(head.weight)
    return None if rows is None or fsdp_modules_holding(model, head) else rows


def tensor_parallel_rows(weight):
    """(start, stop, group): this rank's rows of a tensor-parallel LM head and its mesh's process group, for a
    DTensor weight split along the vocabulary (``Shard(0)``) over a 1-D mesh, as transformers' ``tp_plan`` and
    torch's ``ColwiseParallel`` split a head; None for any other weight."""
    if not is_dtensor(weight):
        return None
    from torch.distributed.tensor import Shard

    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        return None
    vocab, mesh = weight.shape[0], weight.device_mesh
    per_rank = -(-vocab // mesh.size())  # Shard(0) splits as torch.chunk does
    start = min(mesh.get_local_rank() * per_rank, vocab)
    stop = min(start + per_rank, vocab)
    if weight.to_local().shape[0] != stop - start:
        raise ValueError(f"the LM head's local shard has {weight.to_local().shape[0]} rows where Shard(0) of "
                         f"{tuple(weight.shape)} over {mesh.size()} ranks gives rank {mesh.get_local_rank()} "
                         f"rows [{start}, {stop})")
    return start, stop, mesh.get_group()


def vocab_split(student_head, teacher_head):
    """The ``VocabParallelOptions`` of a tensor-parallel student head (None for a whole one): each rank takes the
    student's rows that its shard holds and the same rows of the teacher, whose own split must then agree, or
    which is whole on every rank (its rows past the student's vocabulary go to the student's last rank)."""
    student_rows = tensor_parallel_rows(student_head.weight)
    teacher_rows = tensor_parallel_rows(teacher_head.weight)
    if student_rows is None:
        if teacher_rows is not None:
            raise ValueError("the teacher's LM head is split over ranks (tensor parallel) and the student's is not: "
                             "split both the same way, or load the teacher whole on every rank")
        return None
    from .distributed import VocabParallelOptions

    start, stop, group = student_rows
    vocab_student, vocab_teacher = student_head.weight.shape[0], teacher_head.weight.shape[0]
    ranks = student_head.weight.device_mesh.size()
    per_rank = -(-vocab_student // ranks)
    if per_rank * (ranks - 1) >= vocab_student:  # every rank finds it: all raise, none waits in a collective
        raise ValueError(f"Shard(0) splits the student's LM head ({vocab_student} rows) over {ranks} ranks as "
                         f"torch.chunk does, {per_rank} rows each, which leaves the last rank none: the loss needs "
                         "rows on every rank")
    if teacher_rows is None:
        return VocabParallelOptions(start, vocab_teacher if stop == vocab_student else stop, vocab_student, group,
                                    vocab_teacher)
    teacher_start, teacher_stop, teacher_group = teacher_rows
    ranks_of = torch.distributed.get_process_group_ranks
    if ranks_of(teacher_group) != ranks_of(group):
        raise ValueError("the student's and teacher's LM heads are split over different process groups")
    if (start, stop) != (teacher_start, min(teacher_stop, vocab_student)):
        raise ValueError(
            f"this rank holds rows [{start}, {stop}) of the student's LM head ({vocab_student} rows) and "
            f"[{teacher_start}, {teacher_stop}) of the teacher's ({vocab_teacher}): the splits must agree on the "
            "student's vocabulary (equal vocabularies do); load the teacher whole on every rank instead")
    return VocabParallelOptions(teacher_start, teacher_stop, vocab_student, group, vocab_teacher)


# --- What the fused loss takes from a head (weight, bias, softcap, logit scale), and the first call's check that
# the model's logits are that head's output and nothing more.


def head_inputs(model, hidden, name="model"):
    """(hidden, weight, bias, softcap, logit_scale) for the fused loss, reproducing the model's logits.

    The config's logit multiplier (``config_logit_scale``: logits = scale * (h W^T + b)) and Gemma-2-style
    ``config.final_logit_softcapping`` are handed to the fused step, which applies both (scale, then
    softcap) with their gradients. Under autocast everything is cast to the autocast dtype, as the
    model's own LM head would be. A tensor-parallel head gives this rank's rows of its weight and bias
    (``tensor_parallel_rows``).
    """
    config, head = model.config.get_text_config(), lm_head(model, name)
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else head.weight.dtype
    hidden, weight = hidden.to(dtype), whole_head_weight(model, head).to(dtype)
    bias = None if head.bias is None else head.bias.to(dtype)
    # a tensor-parallel head: this rank's rows (their gradients reach the DTensor's shard)
    weight, bias = local_of(weight), None if bias is None else local_of(bias)
    return hidden, weight, bias, config_softcap(config), config_logit_scale(config)


SOFTCAP_NAMES = ("final_logit_softcapping", "output_logit_soft_cap", "logits_soft_cap")  # config_softcap's
MULTIPLIER_NAMES = ("logit_scale", "output_multiplier", "lm_head_multiplier")  # config_logit_scale's, in its order


def config_softcap(config) -> float | None:
    """The softcap c of logits = c tanh(logits / c): Gemma-2's ``final_logit_softcapping``, xLSTM's
    ``output_logit_soft_cap``, RecurrentGemma's ``logits_soft_cap``; None where none is set."""
    return first_set(config, SOFTCAP_NAMES)


def first_set(config, names):
    """The value of the first of ``names`` the config sets (not None), else None."""
    return next((getattr(config, name) for name in names if getattr(config, name, None) is not None), None)


def config_logit_scale(config) -> float:
    """The factor a model's forward applies to its head's output, read as TRL's DistillationTrainer reads it:
    Cohere's ``logit_scale``, else ``output_multiplier``, else Falcon-H1's ``lm_head_multiplier``, else
    ``logits_scaling``, by which HyperCLOVA X multiplies and the others (Granite) divide, but MiniCPM3, which divides
    the hidden states by it before the head, where they are captured; 1 where none is set. The first call's check
    (check_head_reproduces_logits) holds each model's own logits to it: a family that applies one of these otherwise
    raises there."""
    multiplier = first_set(config, MULTIPLIER_NAMES)
    if multiplier is not None:
        return multiplier
    scaling = getattr(config, "logits_scaling", None)
    if scaling is None or config.model_type == "minicpm3":
        return 1.0
    return scaling if config.model_type == "hyperclovax" else 1.0 / scaling


# The names under which a family keeps its own copy of a logit scale or softcap on the model (Cohere's logit_scale,
# Falcon-H1's lm_head_multiplier), as its config names them.
MODEL_COPY_NAMES = (*MULTIPLIER_NAMES, "logits_scaling", *SOFTCAP_NAMES)


def head_check_key(model, head) -> tuple:
    """What ``check_head_reproduces_logits`` holds for a model: its config's softcap and scale, the model's own copies
    of them (``MODEL_COPY_NAMES``) and the hooks on its head; a change to any runs the check again."""
    config = model.config.get_text_config()
    copies = tuple(value if isinstance(value := getattr(model, name, None), numbers.Real) else None
                   for name in MODEL_COPY_NAMES)
    return config_softcap(config), config_logit_scale(config), copies, tuple(head._forward_pre_hooks), \
        tuple(head._forward_hooks)


HEAD_CHECK_TOKENS = 8  # the probe's length: enough positions to compare, too few to cost anything
# Relative, of the logits, by the dtype the head runs in: a few times its rounding (fp32's: TF32's, where one of the
# two products might take it), far under a rescaling. 16-bit heads cannot see a multiplier within 2% of 1.
HEAD_CHECK_TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 2e-2}
_heads_checked = weakref.WeakKeyDictionary()  # model -> the (softcap, scale) of its config its check held


def _forked_rngs(device):
    """torch.random.fork_rng of the CPU's generator and ``device``'s (where torch has a module for its type)."""
    try:
        accelerator = device.type != "cpu" and torch.get_device_module(device.type) is not None
    except RuntimeError:  # a device type torch has no module for
        accelerator = False
    return torch.random.fork_rng([device] if accelerator else [], device_type=device.type if accelerator else "cpu")


def check_head_reproduces_logits(model, name="model") -> None:
    """Raise unless ``head_inputs`` reproduces the model's own logits: on a probe of a few token ids, once per
    model, the head's output scaled and softcapped as its config says must equal ``model(...).logits``. A family
    that treats its logits otherwise (a multiplier under another config name, logits cut to an unpadded
    vocabulary, ...) would otherwise get a wrong loss without a word. Checked again where what it held has changed
    since (``head_check_key``: the config's scale or softcap, the model's own copy of them, a hook put on the head)."""
    head = lm_head(model, name)
    read = head_check_key(model, head)
    if _heads_checked.get(model) == read:
        return
    captured = []  # the head's input, and the dtype the head ran in under autocast (accelerate's wrapped forward)

    def capture(_module, args):
        device = args[0].device.type
        captured.append((args[0], torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None))

    handle = head.register_forward_pre_hook(capture)
    vocab = head.weight.shape[0]
    probe = (torch.arange(HEAD_CHECK_TOKENS, device=head.weight.device) * 7919 % vocab)[None]
    try:  # a forward that needs more than token ids (BLIP-2's pixel_values)
        inspect.signature(model.forward).bind(input_ids=probe, use_cache=False)
    except TypeError as error:
        handle.remove()
        raise ValueError(f"{name} ({type(model).__name__}) cannot run on token ids alone ({error}), which the first "
                         "call's check of its LM head needs: not supported") from error
    # The probe's dropout (NEFTune's noise) draws random numbers: forked, the training run draws as without it. A
    # compiled model runs it eagerly: traced, its shape, hook and grad mode would each cost the model's forward a graph
    # (a stance cannot be set while dynamo traces this very code).
    eager = contextlib.nullcontext() if torch.compiler.is_compiling() else torch.compiler.set_stance("force_eager")
    with torch.no_grad(), _forked_rngs(probe.device), eager:
        try:
            logits = model(input_ids=probe, use_cache=False).logits
        finally:
            handle.remove()
        if not captured:
            raise head_calls_error(0)
        head_input, autocast_dtype = captured[-1]
        hidden, weight, bias, softcap, scale = head_inputs(model, local_of(head_input), name)
        rows = tensor_parallel_rows(head.weight)
        if rows is not None and logits.shape[-1] == vocab:  # gathered logits: this rank's rows' columns of them
            logits = logits[..., rows[0] : rows[1]]
        # the product in the dtype the head ran in (autocast's, as in accelerate's wrapped forward; else fp32)
        dtype = autocast_dtype or torch.float32
        product = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        ours = scale_and_softcap(product.float(), scale, softcap)
    if logits.shape != ours.shape:
        raise ValueError(f"{name}'s logits {tuple(logits.shape)} are not its LM head's output {tuple(ours.shape)}: "
                         "the model reshapes them (e.g. cuts a padded vocabulary), which the fused loss does not")
    difference = ((ours - logits.float()).norm() / logits.float().norm().clamp(min=1e-30)).item()
    # the product is the model's own; a scale or softcap the model applies in the autocast dtype rounds once more
    rounded_after = autocast_dtype is not None and (scale != 1 or softcap is not None)
    if not difference <= HEAD_CHECK_TOLERANCE.get(autocast_dtype if rounded_after else hidden.dtype, 2e-2):
        assumed = f"scale {scale:g}, " + ("no softcap" if softcap is None else f"softcap {softcap:g}")
        raise ValueError(
            f"{name}'s logits differ from its LM head's output scaled and softcapped as its config says ({assumed}; "
            f"relative difference {difference:.1e}): the model applies something to them that the fused loss does "
            "not know (e.g. a logit multiplier under another config name), or does not apply what its config sets"
        )
    _heads_checked[model] = read


def check_heads_reproduce_logits(student, teacher) -> None:
    """``check_head_reproduces_logits`` of both models; a teacher that is the student's own base model has the
    student's head and config, checked with the student (its own forward could not run alone under FSDP2)."""
    check_head_reproduces_logits(student, "student")
    if teacher_forward_model(student, teacher) is teacher:
        check_head_reproduces_logits(teacher, "teacher")


# --- The loss of two models and a batch.


def distill_loss(
    student,
    teacher,
    input_ids=None,
    attention_mask=None,
    labels=None,
    *,
    loss="cosine",
    student_hidden=None,
    teacher_hidden=None,
    weight_hard_loss=0.5,
    weight_soft_loss=0.5,
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    num_valid_tokens=None,
    return_soft_hard_loss=False,
    model_inputs=None,
    student_metrics=None,
    **loss_options,
):
    """The fused distillation loss between two causal LMs on a batch, never building their logits:
    ``fused_linear_cosine_distill`` (``loss="cosine"``) or ``fused_linear_jsd`` (``loss="jsd"``, the
    generalized JSD; ``beta`` is then its mixing weight).

    student, teacher: causal LMs exposing their LM head through ``get_output_embeddings()``, or such a model
    wrapped by DistributedDataParallel (``accelerator.prepare``: its forward runs through the wrapper, which syncs
    the gradients; the unwrapped model's would not); the teacher runs under torch.no_grad and must have a vocabulary
    at least as large as the student's.
    input_ids, attention_mask, labels: [B, L], as for the models' forward;
    targets are the labels shifted by one (``next_token_targets``), padding and ignore_index skipped: only the
    positions with a target reach the fused loss (``trained_rows``).
    student_hidden / teacher_hidden: precomputed ``final_hidden_states`` [B, L, H], used instead of
    running that model (input_ids is then not needed for it).
    model_inputs: the batch's other forward inputs, for both models (a packed batch's position_ids or
    ``cu_seq_lens_q``: they also keep each target within its sequence).
    Each model's logit scale and softcapping are applied as its config says (``head_inputs``), so the
    loss equals the one computed from ``model(...).logits``; the first call with a model checks that on a
    probe of a few tokens (``check_head_reproduces_logits``) and raises where it does not hold.
    ``num_valid_tokens`` (e.g. the count over all micro-batches of a gradient accumulation step) and
    ``**loss_options`` (chunk_size, impl, accum_dtype, teacher_precision; cosine_via for the cosine loss) go to
    the fused function of ``loss``. A student whose LM head is split for tensor parallelism (``tp_plan``,
    ``ColwiseParallel``) runs the loss vocabulary-parallel over its mesh (``vocab_split``).
    ``student_metrics`` (a ``cosdistill.StudentMetrics``): filled in per target, the positions that have one in
    order, [n] (not with a tensor-parallel student).
    """
    check_loss_options(loss, loss_options)
    if labels is None:
        raise TypeError("labels is required, got None")
    if input_ids is None and (student_hidden is None or teacher_hidden is None):
        raise TypeError("input_ids is required unless both student_hidden and teacher_hidden are given")
    # A DDP-wrapped model runs its forward through the wrapper (its gradient sync) and is read inside it.
    student_model, teacher_model = wrapped_model(student), wrapped_model(teacher)
    check_heads_reproduce_logits(student_model, teacher_model)  # before the models run (once per model)
    teacher_runner = teacher_forward_model(student, teacher)
    model_inputs = model_inputs or {}
    targets = next_token_targets(labels, attention_mask, position_ids=model_inputs.get("position_ids"),
                                 ignore_index=ignore_index, cu_seq_lens=model_inputs.get("cu_seq_lens_q"))
    if student_hidden is None:
        student_hidden = final_hidden_states(student, input_ids, attention_mask, lm_head(student_model, "student"),
                                             **model_inputs)
    if teacher_hidden is None:
        with torch.no_grad(), in_eval_mode(teacher_runner), without_student_adapters(student_model, teacher_model):
            teacher_hidden = final_hidden_states(teacher_runner, input_ids, attention_mask,
                                                 lm_head(teacher_model, "teacher"), **model_inputs)
    student_hidden, teacher_hidden, targets = trained_rows(student_hidden, teacher_hidden, targets, ignore_index)
    return loss_of_hidden_states(
        student_model, teacher_model, student_hidden, teacher_hidden, targets, loss=loss,
        weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta, temperature=temperature,
        ignore_index=ignore_index, num_valid_tokens=num_valid_tokens, return_soft_hard_loss=return_soft_hard_loss,
        student_metrics=student_metrics, **loss_options,
    )


def trained_rows(student_hidden, teacher_hidden, targets, ignore_index):
    """([n, H], [n, H], [n]): the positions that have a target (not ``ignore_index``), the others dropped before the
    fused loss, whose GEMMs and row steps would run on them for nothing (a GKD or completion-only batch is mostly
    prompt; a row step costs an ignored row little, its four GEMMs the whole); the loss's count is theirs either way.
    One host read (their number), as a boolean index takes."""
    if not student_hidden.shape[:-1] == teacher_hidden.shape[:-1] == targets.shape:
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} and teacher_hidden {tuple(teacher_hidden.shape)} "
                         f"must be [B, L, H] for labels {tuple(targets.shape)} (each model's final hidden states of "
                         "the batch)")
    trained = targets != ignore_index
    return (student_hidden[trained.to(student_hidden.device)], teacher_hidden[trained.to(teacher_hidden.device)],
            targets[trained])


def loss_of_hidden_states(student, teacher, student_hidden, teacher_hidden, targets, loss="cosine",
                          weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=1.0, ignore_index=-100,
                          num_valid_tokens=None, return_soft_hard_loss=False, student_metrics=None, **loss_options):
    """``distill_loss`` on final hidden states already aligned with their targets: position i of ``student_hidden``
    and ``teacher_hidden`` [..., H] predicts ``targets[..., i]`` (``ignore_index``: no target). The models give
    their LM heads, logit scales and softcaps (``head_inputs``) and a tensor-parallel student's split
    (``vocab_split``); the other arguments are ``distill_loss``'s."""
    check_loss_options(loss, loss_options)
    check_teacher_head_is_not_a_trained_copy(student, teacher)
    check_heads_reproduce_logits(student, teacher)  # once per model
    # The student's own base model: its head read through the student, whose FSDP2 root gathers it
    teacher = teacher_forward_model(student, teacher)
    with torch.no_grad():
        teacher_args = head_inputs(teacher, teacher_hidden, "teacher")
    hidden, weight, bias, softcap, logit_scale = head_inputs(student, student_hidden, "student")
    split = vocab_split(lm_head(student, "student"), lm_head(teacher, "teacher"))
    if split is not None:
        if "vocab_parallel" in loss_options:
            raise ValueError("vocab_parallel is set by the student's tensor-parallel LM head: leave it out of the options")
        loss_options = dict(loss_options, vocab_parallel=split)
        if not is_dtensor(lm_head(teacher).weight):  # a whole teacher: this rank's rows of it
            rows = [split.teacher_rows(part) if part is not None else None for part in teacher_args[1:3]]
            teacher_args = (teacher_args[0], *rows, *teacher_args[3:])
    fused = FUSED_LOSSES[loss]
    head_options = dict(student_softcap=softcap, teacher_softcap=teacher_args[3], student_logit_scale=logit_scale,
                        teacher_logit_scale=teacher_args[4])
    with torch.autocast(hidden.device.type, enabled=False):  # the inputs are already in the autocast dtype
        return fused(
            hidden, weight, teacher_args[0], teacher_args[1], targets, bias, teacher_args[2],
            weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
            ignore_index=ignore_index, temperature=temperature, return_soft_hard_loss=return_soft_hard_loss,
            num_valid_tokens=num_valid_tokens, student_metrics=student_metrics, **head_options, **loss_options,
        )


cosine_distill_loss = distill_loss  # its name from before loss="jsd"


# --- The checks of the loss's options and of a Trainer's arguments, at construction.


_FUSED_OPTIONS = {loss: frozenset(inspect.signature(fused).parameters) for loss, fused in FUSED_LOSSES.items()}
# The fused functions' arguments that distill_loss takes from the models (their heads and configs) and the batch.
_FROM_THE_MODELS = frozenset({"student_input", "student_weight", "teacher_input", "teacher_weight", "true_labels",
                              "student_bias", "teacher_bias", "student_softcap", "teacher_softcap",
                              "student_logit_scale", "teacher_logit_scale"})


def check_loss_options(loss: str, loss_options: dict) -> None:
    """Raises for an unknown ``loss``, an option its fused function does not take, one that distill_loss takes
    from the models or sets per call, or Liger's ``compiled``, which changes nothing here, before any model runs."""
    if loss not in FUSED_LOSSES:
        raise ValueError(f"loss must be one of {tuple(FUSED_LOSSES)}, got {loss!r}")
    unknown = sorted(set(loss_options) - _FUSED_OPTIONS[loss])
    if unknown:
        raise TypeError(f"loss_options {unknown} are not options of {FUSED_LOSSES[loss].__name__} (loss={loss!r})")
    from_the_models = sorted(set(loss_options) & _FROM_THE_MODELS)
    if from_the_models:
        raise TypeError(f"loss_options {from_the_models} cannot be given: distill_loss takes them from the models "
                        "(their LM heads and configs) and the batch")
    per_call = sorted(set(loss_options) & {"num_valid_tokens", "return_soft_hard_loss", "student_metrics"})
    if per_call:
        raise TypeError(f"loss_options {per_call} cannot be given: they are distill_loss's own arguments, which the "
                        "trainers set at each step")
    if "compiled" in loss_options:
        raise TypeError("loss_options 'compiled' is Liger-Kernel's flag, kept in the fused functions' signatures for "
                        "drop-in calls and without effect: leave it out")


def check_loss_values(loss: str, loss_options: dict, **values) -> None:
    """Raises, when a Trainer is made, for a bad value among its loss options and ``values`` (weights, beta,
    temperature), which its first step would raise (distill_loss's own call checks them once per call); not the
    JSD's low-temperature refusal, which needs the student head's dtype."""
    check_loss_options(loss, loss_options)
    options_of(loss=loss, **{name: value for name, value in {**loss_options, **values}.items() if name in OPTION_NAMES})


# Trainer options that change the loss in ways this loss does not follow: each raises at construction.
UNSUPPORTED_ARGS = {
    "label_smoothing_factor": (0, "label smoothing is not part of this loss (its hard term is plain cross-entropy)"),
    "use_liger_kernel": (False, "Liger's patched forward skips the LM head whose input the loss reads"),
}


# Batch entries that are not the models' inputs: the labels, and masks that data collators add for a loss.
NOT_MODEL_INPUTS = frozenset({"input_ids", "attention_mask", "labels", "completion_mask", "assistant_masks"})


def check_unsupported_args(trainer, unsupported: dict) -> None:
    """Raise for each of the trainer's args set away from the value that changes nothing (``unsupported``: name ->
    (that value, why the loss cannot follow another))."""
    for name, (default, why) in unsupported.items():
        value = getattr(trainer.args, name, default)
        if value != default:
            raise ValueError(f"{type(trainer).__name__} does not support {name}={value!r}: {why}")


def check_sharding(trainer) -> None:
    """Raise for the ways of spreading the student over devices that the loss cannot read the head whole
    from: DeepSpeed ZeRO-3 and FSDP1 (FSDP2 works, ``whole_head_weight``), and torch.nn.DataParallel; and for
    context or sequence parallelism, which split each sequence whose next tokens the loss reads."""
    state = trainer.accelerator.state
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if getattr(trainer, "is_deepspeed_enabled", False) and getattr(deepspeed, "zero_stage", 0) == 3:
        raise ValueError("DeepSpeed ZeRO-3 shards the student's LM head, which the fused loss reads whole: use FSDP2 "
                         "(fsdp_config={'fsdp_version': 2}) or ZeRO stage 1 or 2")
    fsdp = getattr(state, "fsdp_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) and getattr(fsdp, "fsdp_version", 1) != 2:
        raise ValueError("FSDP1 flattens the student's parameters, so the fused loss cannot read the LM head: use FSDP2 "
                         "(fsdp_config={'fsdp_version': 2})")
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    for kind in ("cp", "sp"):  # each device holds a slice of every sequence, which the loss's targets cross
        if getattr(parallelism, f"{kind}_enabled", False):
            raise ValueError(f"{'context' if kind == 'cp' else 'sequence'} parallelism splits each sequence over "
                             "devices, and the loss reads each token's next one: train without it")
    if trainer.args.n_gpu > 1:
        raise ValueError(f"torch.nn.DataParallel over {trainer.args.n_gpu} GPUs is not supported: launch one process "
                         "per GPU (torchrun, accelerate launch)")


def tensor_parallel_size(trainer) -> int:
    """The Trainer's tensor-parallel degree (``Trainer.get_tp_size``; 1 where transformers has none): its ranks share
    each batch, so transformers divides the step's count of labels by it and multiplies the loss by the number of
    processes over it."""
    return trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1


def check_tensor_parallel(trainer, student, teacher) -> None:
    """Raise, at construction, for the tensor-parallel heads the Trainers' loss is not right or not tested with: a
    student split over other ranks than the Trainer's tensor-parallel ones (a model split by hand, or a transformers
    without ``Trainer.get_tp_size``: the count of labels would be off by their ratio), or without
    ``average_tokens_across_devices`` (transformers divides the count by the tensor-parallel size even then); more
    processes than the tensor-parallel ones (data parallelism or FSDP beside them: not tested); a split teacher
    beside a whole student (the ranks hold other batches: its collectives would not match)."""
    name = type(trainer).__name__
    rows = split_head_rows(student, "student")
    if rows is None:
        if split_head_rows(teacher, "teacher") is not None:
            raise ValueError(f"{name}: the teacher's LM head is split over ranks (tensor parallel) and the student's "
                             "is not: split both the same way (tp_plan='auto'), or load the teacher whole on every rank")
        return
    split, tp_size = torch.distributed.get_world_size(rows[2]), tensor_parallel_size(trainer)
    if split != tp_size:
        raise ValueError(f"{name}: the student's LM head is split over {split} ranks for tensor parallelism but the "
                         f"Trainer's tensor-parallel size is {tp_size}, so it would count the step's labels wrongly: "
                         "load the student with tp_plan='auto' (transformers >= 5), or call "
                         "cosdistill.hf.distill_loss in a training loop of your own")
    if not getattr(trainer.args, "average_tokens_across_devices", False):
        raise ValueError(f"{name}: a tensor-parallel student needs average_tokens_across_devices=True: without it "
                         f"transformers still divides the step's count of labels by the tensor-parallel size "
                         f"({tp_size}), and the loss would be that many times too large")
    if trainer.accelerator.num_processes != tp_size:
        raise ValueError(f"{name}: tensor parallelism over {tp_size} of {trainer.accelerator.num_processes} processes "
                         "(data parallelism or FSDP beside it) is not tested with the fused loss: run every process "
                         "in the tensor-parallel group, or call cosdistill.hf.distill_loss in a loop of your own")


def extra_loss_terms(config) -> list[str]:
    """The terms, as "name=coefficient", that a model adds to its own loss beside the cross-entropy and the fused loss
    would leave out: a Mixture-of-Experts router's load-balancing loss where ``output_router_logits`` is on (its
    coefficient under Mixtral's, JetMoe's or DBRX's name; TRL's SFTTrainer turns it on by default), and Bamba's
    z-loss on the logits."""
    coefficients = {"z_loss_coefficient": getattr(config, "z_loss_coefficient", 0.0)}
    if getattr(config, "output_router_logits", False):
        coefficients |= {"router_aux_loss_coef": getattr(config, "router_aux_loss_coef", 0.0),
                         "aux_loss_coef": getattr(config, "aux_loss_coef", 0.0),
                         "ffn_config.moe_loss_weight": getattr(getattr(config, "ffn_config", None), "moe_loss_weight", 0.0)}
    return [f"{name}={value}" for name, value in coefficients.items() if value]


def check_no_extra_loss_terms(trainer, student) -> None:
    """Raise for a student whose own loss adds terms this loss replaces (``extra_loss_terms``), which would silently
    be left out."""
    terms = extra_loss_terms(student.config.get_text_config())
    if not terms and getattr(trainer, "aux_loss_enabled", False):  # TRL's SFTTrainer's own switch, which it keeps
        # off the config of families without a coefficient of their own (sarvam_moe, zaya)
        terms = [f"router_aux_loss_coef={getattr(trainer, 'router_aux_loss_coef', '?')}"]
    if terms:
        raise ValueError(
            f"{type(trainer).__name__} does not add the student's router auxiliary loss or other terms of its own loss "
            f"({', '.join(terms)}): train without them, e.g. with router_aux_loss_coef=0.0 (SFTConfig) or "
            "output_router_logits=False (the model's config)"
        )


# --- The Trainer.


def nonzero_count(count):
    """A step's item count with 0 made 1, so that a step whose labels are all ignored gives loss 0 rather than 0 / 0;
    None stays None. Any other count is kept as given: the Trainer divides it by the tensor-parallel size, so an
    almost empty step's may be under 1. A tensor stays on its device: no host read."""
    if torch.is_tensor(count):
        return torch.where(count == 0, torch.ones_like(count), count)
    return None if count is None else (count or 1)


def _loss_option(name: str) -> property:
    """A Trainer's loss option as its attribute: read from and written to its ``loss_options``, checked when set."""

    def get(self):
        return self.loss_options[name]

    def set(self, value):
        options = {**self.loss_options, name: value}  # checked beside the others, as at construction
        check_loss_values(options.pop("loss"), {}, **options)
        self.loss_options[name] = value

    return property(get, set)


class DistillationMixin:
    """``distill_loss`` against a frozen teacher as the loss of a ``transformers.Trainer`` subclass
    (``DistillationTrainer`` here, ``cosdistill.trl.DistillationSFTTrainer`` for TRL): ``loss="cosine"`` (the
    default) or ``"jsd"``, with ``beta`` and ``temperature`` as ``distill_loss`` takes them.

    ``teacher_model`` is put in eval mode, frozen (but for the parameters it shares with the student, which the
    student still trains) and moved to the student's device. The loss is
    normalised by ``num_items_in_batch``, the Trainer's count of labels over all micro-batches of a step
    (across processes), so gradient accumulation gives the gradient of one big batch; each batch's labels
    are first set to -100 where the loss has no target (``loss_labels``: left or right padding, the first
    token of each packed sequence), so that the count is exactly the loss's. Every model input the batch
    holds (position_ids and flash-attention boundaries of packed batches, ...) reaches both models.
    Training logs gain ``soft_loss`` and ``hard_loss`` next to ``loss`` (``train_soft_loss`` and ``train_hard_loss``
    next to train()'s ``train_loss``), evaluation and predict() ``eval_soft_loss`` and ``eval_hard_loss`` (with
    their prefix). The student may be on one device, under DDP or under FSDP2 (the head's weight is
    gathered whole for the loss, ``whole_head_weight``), or split for tensor parallelism (``tp_plan="auto"``: each
    rank runs the loss on its shard of the head, ``check_tensor_parallel``); DeepSpeed ZeRO-3, FSDP1 and
    torch.nn.DataParallel raise at construction (``check_sharding``). ``loss_options`` (chunk_size, impl, ...)
    go to the fused function of ``loss``, checked at construction (but for the JSD's low-temperature refusal, which
    depends on the student head's dtype: at the first step). Trainer options the loss cannot honour
    (``UNSUPPORTED_ARGS``, a ``compute_loss_func``, ``compute_metrics`` and ``preprocess_logits_for_metrics``: there
    are no logits) raise a ValueError. With ``loss="cosine"`` ``temperature`` changes nothing, as in Liger's.
    """

    unsupported_args = UNSUPPORTED_ARGS
    # The loss's weights, beta and temperature as attributes too, read at each step (a schedule's callback may set
    # trainer.beta, as TRL's trainers take it), checked where set; kept in ``loss_options``.
    weight_hard_loss = _loss_option("weight_hard_loss")
    weight_soft_loss = _loss_option("weight_soft_loss")
    beta = _loss_option("beta")
    temperature = _loss_option("temperature")

    def __init__(
        self, *args, teacher_model, loss="cosine", weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5,
        temperature=1.0, loss_options=None, **kwargs,
    ):
        check_loss_values(loss, loss_options or {}, weight_hard_loss=weight_hard_loss,
                          weight_soft_loss=weight_soft_loss, beta=beta, temperature=temperature)
        if (loss_options or {}).get("ignore_index", -100) != -100:
            raise ValueError(f"{type(self).__name__} does not support loss_options ignore_index="
                             f"{loss_options['ignore_index']!r}: the Trainer counts the labels that are not -100 "
                             "(num_items_in_batch), so the loss must ignore -100; set such labels to -100 instead")
        super().__init__(*args, **kwargs)
        self._refuse_functions_of_logits()  # given by name or by position; set afterwards, at the next loss
        self._check_student(self.accelerator.unwrap_model(self.model), teacher_model)
        device = next(self.model.parameters()).device
        self.teacher_model = teacher_model.to(device).eval()
        # Frozen but for the parameters it shares with the student (tied or reused modules, a PEFT student's base
        # model), which the student still trains: the teacher runs under no_grad whatever they say. Such a parameter,
        # as the teacher's head, must not be cached (a fused optimizer changes it behind its version counter).
        student_parameters = {id(parameter) for parameter in self.model.parameters()}
        for parameter in teacher_model.parameters():
            if id(parameter) in student_parameters:
                note_trained(parameter)
            else:
                parameter.requires_grad_(False)
        self.loss_options = dict(
            loss=loss, weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
            temperature=temperature, **(loss_options or {}),
        )
        # Makes the Trainer count num_items_in_batch and take our loss as already normalised over the step.
        self.model_accepts_loss_kwargs = True
        self.add_callback(_SoftHardLogsPerRun(self))
        self._soft_hard_sums = None  # training: soft and hard summed since the last log
        self._soft_hard_since_step = None  # the optimizer step at the first of those (a resumed run's too)
        self._soft_hard_run_sums, self._soft_hard_run_first_step = [0.0, 0.0], 0  # since train() began (the callback)
        self._predicting = False  # inside prediction_step: compute_loss evaluates
        self._eval_sums = None  # evaluation: soft and hard times rows, and the rows (all, then those of finite losses)

    def _check_student(self, student, teacher):
        """The checks of a student against the Trainer's arguments: at construction, and on each model that train()
        or a hyperparameter search's trial makes again from ``model_init``."""
        check_sharding(self)
        check_tensor_parallel(self, student, teacher)
        check_no_extra_loss_terms(self, student)
        check_unsupported_args(self, self.unsupported_args)
        # Before any call of a model accelerate may compile (torch_compile, or its dynamo plugin from the environment).
        keep_head_hook(student, lm_head(student, "student"))

    def _refuse_functions_of_logits(self):
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError(f"{type(self).__name__} computes its own loss: compute_loss_func cannot be used with it")
        for name in ("compute_metrics", "preprocess_logits_for_metrics"):
            if getattr(self, name, None) is not None:
                raise ValueError(f"{type(self).__name__} does not support {name}: evaluation has no logits (the fused "
                                 "loss never computes them); it reports eval_loss, eval_soft_loss and eval_hard_loss")

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if hasattr(self, "teacher_model"):  # not the call within Trainer.__init__, whose model __init__ checks
            self._check_student(model, self.teacher_model)
        return model

    @staticmethod
    def _with_loss_labels(batch):
        """The batch with its labels set to -100 where the loss has no target (in place: the collator's tensors)."""
        # a Mapping, not a dict: transformers' collators return BatchEncoding
        if (isinstance(batch, collections.abc.MutableMapping) and torch.is_tensor(batch.get("labels"))
                and batch["labels"].dim() == 2):
            batch["labels"] = loss_labels(batch["labels"], batch.get("attention_mask"),
                                          position_ids=batch.get("position_ids"), cu_seq_lens=batch.get("cu_seq_lens_q"))
        return batch

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        """The Trainer's, on batches whose labels are the loss's targets, so that it counts exactly those."""
        return super().get_batch_samples(map(self._with_loss_labels, epoch_iterator), num_batches, *args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        """The Trainer's, on a copy of the batch whose labels are the loss's targets; the labels it returns (predict's
        label_ids) are the batch's own, its predictions None where the loss ran (no logits: the Trainer's empty
        tuple would pass its ``is not None`` tests)."""
        self._predicting = True  # compute_loss's evaluation, told by this rather than by the model's mode
        try:
            loss, logits, labels = super().prediction_step(model, self._with_loss_labels(dict(inputs)), *args, **kwargs)
        finally:
            self._predicting = False
        given = inputs.get("labels")
        return (loss, None if isinstance(logits, tuple) and not logits else logits,
                given.detach() if labels is not None and torch.is_tensor(given) else labels)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "shift_labels" in inputs:  # the Trainer counts them and the model's own loss trains on them
            raise ValueError(f"{type(self).__name__} takes its targets from labels, shifted as the model shifts them: "
                             "a batch with shift_labels (a collator's own targets) is not supported")
        if "labels" not in inputs:
            raise ValueError(f"{type(self).__name__} needs labels in each batch (a causal LM collator's), got the keys "
                             f"{sorted(inputs)}")
        self._refuse_functions_of_logits()
        student = self.accelerator.unwrap_model(model)
        model_inputs = {key: value for key, value in inputs.items() if key not in NOT_MODEL_INPUTS}
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        # Told by prediction_step, not by the model's mode: a training step may run the student in eval mode
        evaluating = self._predicting
        if evaluating:
            # Each batch's own mean, as one process's evaluation. The Trainer's count there is over all
            # processes' batches, the rows accelerate repeats to even out the last ones among them, whose losses
            # gather_for_metrics then drops: the batch that kept its row was divided by targets not its own.
            num_items_in_batch = None
        num_items_in_batch = nonzero_count(num_items_in_batch)
        metrics = self._student_metrics_to_log()
        with self.accelerator.autocast():
            hidden = final_hidden_states(model, input_ids, attention_mask, lm_head(student, "student"), **model_inputs)
            loss, soft, hard = distill_loss(
                student, self.teacher_model, input_ids, attention_mask, inputs["labels"], student_hidden=hidden,
                num_valid_tokens=num_items_in_batch, return_soft_hard_loss=True, model_inputs=model_inputs,
                student_metrics=metrics, **self.loss_options,
            )
        if metrics is not None:
            self._keep_student_metrics(metrics)
        if evaluating:  # a batch without a target is 0 / 0, as the Trainer's own loss: not finite, so that
            # logging_nan_inf_filter leaves it out of eval_loss rather than count a 0
            has_target = (next_token_targets(inputs["labels"], attention_mask, position_ids=model_inputs.get("position_ids"),
                                             cu_seq_lens=model_inputs.get("cu_seq_lens_q")) != -100).any()
            loss, soft, hard = (torch.where(has_target, value, torch.nan) for value in (loss, soft, hard))
        if num_items_in_batch is not None and getattr(self.args, "average_tokens_across_devices", False):
            # num_items_in_batch counts all processes' tokens and DDP averages the gradients: undo the average, over
            # the processes that hold different batches (as Trainer.compute_loss does)
            data_parallel = self.accelerator.num_processes // tensor_parallel_size(self)
            loss, soft, hard = (value * data_parallel for value in (loss, soft, hard))
        sums = torch.stack([soft, hard]).detach()
        finite = torch.isfinite(loss.detach())
        if not evaluating:
            if self._soft_hard_sums is None:
                self._soft_hard_sums, self._soft_hard_since_step = torch.zeros_like(sums), self.state.global_step
            if self.args.logging_nan_inf_filter:  # the Trainer's rule for its loss: a step whose loss is not finite
                # counts as the mean of those since the last log (a tensor test: no host read)
                mean = self._soft_hard_sums / (1 + self.state.global_step - self._soft_hard_since_step)
                sums = torch.where(finite, sums, mean)
            self._soft_hard_sums = self._soft_hard_sums + sums
        else:  # evaluation: weighted as the Trainer's eval_loss weights each batch's loss (eval_batch_size times,
            # also for a packed batch of one row), gathered per batch as it gathers its losses, which drops the
            # examples past the dataset's end and those accelerate repeats to even out the processes' last batches
            rows = torch.stack([*sums, finite.to(sums.dtype)]).expand(self.args.eval_batch_size, 3).contiguous()
            soft_hard, finite_rows = self._gather_for_metrics(rows).split([2, 1], dim=1)
            # the sums and count over all rows, and over the rows of finite losses (those logging_nan_inf_filter keeps)
            sums = torch.cat([soft_hard.sum(0), soft_hard.new_full((1,), soft_hard.shape[0]),
                              torch.where(finite_rows.bool(), soft_hard, 0).sum(0), finite_rows.sum(0)])
            self._eval_sums = sums if self._eval_sums is None else self._eval_sums + sums
        # No logits: the fused loss never computes them (soft and hard reach the logs through log below).
        return (loss, CausalLMOutputWithPast(loss=loss, logits=None)) if return_outputs else loss

    def _student_metrics_to_log(self):
        """A ``StudentMetrics`` for the next loss where the Trainer logs them, else None (the Trainer logs none)."""
        return None

    def _keep_student_metrics(self, metrics):
        """Keeps a loss call's filled-in ``StudentMetrics`` for the logs (the trainers that ask for them)."""
        raise NotImplementedError(f"{type(self).__name__} asks for the student's metrics and keeps none")

    def _gather_for_metrics(self, tensors):
        """accelerate's gather_for_metrics, but for a tensor-parallel student, whose processes are all ranks of the
        split (``check_tensor_parallel``) and evaluate the same batches: gathered, each batch would count once per
        rank. Not gathered then, the last batch's (its loss repeated eval_batch_size times) cut to the remainder."""
        if tensor_parallel_size(self) == 1:
            return self.accelerator.gather_for_metrics(tensors)
        state = self.accelerator.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return tensors
        from accelerate.utils import recursively_apply  # the Trainer's dependency: predictions may be nested

        return recursively_apply(lambda tensor: tensor[: state.remainder], tensors)

    def log(self, logs, *args, **kwargs):
        """Adds the mean soft and hard loss per optimizer step to a training log (since the last one: ``soft_loss``,
        ``hard_loss``) and to train()'s summary (over the steps it ran: ``train_soft_loss``, ``train_hard_loss``)."""
        if ("loss" in logs or "train_loss" in logs) and self._soft_hard_sums is not None:
            # every process logs: each takes part in the gather (the Trainer's loss is the processes' mean too)
            window = self.accelerator.gather(self._soft_hard_sums[None]).mean(0).tolist()
            self._soft_hard_run_sums = [run + new for run, new in zip(self._soft_hard_run_sums, window)]
            if "loss" in logs:
                steps = max(1, self.state.global_step - self._soft_hard_since_step)
                logs.update(soft_loss=window[0] / steps, hard_loss=window[1] / steps)
            self._soft_hard_sums = None
        if "train_loss" in logs:  # as the Trainer's train_loss, per step of this train() call
            steps = max(self.state.global_step - self._soft_hard_run_first_step, 0.001)
            logs.update(train_soft_loss=self._soft_hard_run_sums[0] / steps,
                        train_hard_loss=self._soft_hard_run_sums[1] / steps)
        super().log(logs, *args, **kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """The Trainer's (evaluate()'s and predict()'s), whose metrics gain the mean soft and hard loss per row as
        its loss (``eval_soft_loss``, ``eval_hard_loss``, with the prefix given)."""
        self._eval_sums = None
        if tensor_parallel_size(self) > 1:  # the Trainer's loss, labels and predictions too (it resets this after)
            self.gather_function = self._gather_for_metrics
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if f"{metric_key_prefix}_loss" in output.metrics:  # all processes' rows, gathered batch by batch
            sums = self._eval_sums.tolist() if self._eval_sums is not None else [0.0] * 6
            # as the Trainer's loss: the rows of finite losses alone where it is finite, so it left the others out
            # (logging_nan_inf_filter, which transformers applies to evaluation from 5.23 on, to training steps before)
            finite = math.isfinite(output.metrics[f"{metric_key_prefix}_loss"])
            soft, hard, rows = sums[3:] if finite and sums[5] > 0 else sums[:3]
            output.metrics.update({f"{metric_key_prefix}_soft_loss": soft / max(1.0, rows),
                                   f"{metric_key_prefix}_hard_loss": hard / max(1.0, rows)})
        self._eval_sums = None
        return output


class _SoftHardLogsPerRun(TrainerCallback):
    """Starts each run's soft and hard sums afresh (a second ``train()``, a hyperparameter search's trial,
    auto_find_batch_size's retry), so that what one left unlogged never reaches the next's logs."""

    def __init__(self, trainer):
        self.trainer = weakref.proxy(trainer)  # the trainer holds this callback

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._soft_hard_sums = None
        self.trainer._soft_hard_run_sums, self.trainer._soft_hard_run_first_step = [0.0, 0.0], state.global_step


class DistillationTrainer(DistillationMixin, Trainer):
    """A ``transformers.Trainer`` whose loss is ``distill_loss`` against a frozen teacher (``DistillationMixin``
    says how), on the dataset's own completions. Not TRL's on-policy trainer of the same name: that one, with the
    fused loss, is ``cosdistill.trl.DistillationTrainer``."""


CosineDistillationTrainer = DistillationTrainer  # its name from before loss="jsd"
