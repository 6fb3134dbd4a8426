"""Cosine distillation of Hugging Face causal LMs, from their final hidden states (needs ``transformers``).

``cosine_distill_loss`` is the loss of ``fused_linear_cosine_distill`` for a student and a teacher
causal LM and a batch (input_ids, attention_mask, labels), computed without the full logits of
either model; ``CosineDistillationTrainer`` is a ``transformers.Trainer`` that trains with it.
"""

import torch

try:
    from transformers import Trainer
except ImportError as error:
    raise ImportError("cosdistill.hf needs transformers: pip install 'cosdistill[hf]'") from error

from .api import fused_linear_cosine_distill


def lm_head(model, name="model"):
    """``model.get_output_embeddings()``, checked to be a torch.nn.Linear (tied or not, with or without bias)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"{name}.get_output_embeddings() must be a torch.nn.Linear, got {type(head).__name__}")
    return head


def final_hidden_states(model, input_ids, attention_mask=None, head=None):
    """The input of the model's LM head [B, L, H]: the final hidden states, after the final norm.

    For Llama, Gemma-2, Cohere, Qwen2 and GPT-2 this is the backbone's ``last_hidden_state``. It is
    taken from the model's own forward (so wrappers such as DDP and accelerate's autocast apply),
    with the head handed zero positions, so no logits are computed. ``head`` is the model's LM head,
    by default ``model.get_output_embeddings()``; pass it when ``model`` is a wrapper without that method.
    """
    head = lm_head(model) if head is None else head
    captured = []

    def keep_input_and_feed_nothing(_module, args):
        captured.append(args[0])
        return (args[0][..., :0, :],)

    handle = head.register_forward_pre_hook(keep_input_and_feed_nothing)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise ValueError(f"the model's forward called its LM head {len(captured)} times, expected once")
    return captured[0]


def next_token_targets(labels, attention_mask=None, ignore_index=-100):
    """Position i's target, shaped [B, L] like the hidden states so that these need no slicing.

    As in Hugging Face's causal LM loss, position i predicts labels[:, i + 1]; the last position gets
    ignore_index, and so does every position i where i or i + 1 is padding (attention_mask == 0).
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, length], got shape {tuple(labels.shape)}")
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], dim=1)
    if attention_mask is None:
        return targets
    if attention_mask.shape != labels.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match labels {tuple(labels.shape)}")
    real = attention_mask.bool()
    real_pair = real & torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    return targets.masked_fill(~real_pair, ignore_index)


def head_inputs(model, hidden, name="model"):
    """(hidden, weight, bias, softcap, logit_scale) for the fused loss, reproducing the model's logits.

    Cohere-style ``config.logit_scale`` (logits = scale * (h W^T + b)) and Gemma-2-style
    ``config.final_logit_softcapping`` are handed to the fused step, which applies both (scale, then
    softcap) with their gradients. Under autocast everything is cast to the autocast dtype, as the
    model's own LM head would be.
    """
    config, head = model.config.get_text_config(), lm_head(model, name)
    if getattr(config, "logits_scaling", None) not in (None, 1):
        raise ValueError(
            f"{name}.config.logits_scaling={config.logits_scaling} is not supported: model families apply it "
            "differently (Granite divides the logits by it, HyperCLOVA X multiplies, MiniCPM3 divides the hidden states)"
        )
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else head.weight.dtype
    hidden, weight = hidden.to(dtype), head.weight.to(dtype)
    bias = None if head.bias is None else head.bias.to(dtype)
    scale = getattr(config, "logit_scale", None)
    return hidden, weight, bias, getattr(config, "final_logit_softcapping", None), 1.0 if scale is None else scale


def cosine_distill_loss(
    student,
    teacher,
    input_ids=None,
    attention_mask=None,
    labels=None,
    *,
    student_hidden=None,
    teacher_hidden=None,
    weight_hard_loss=0.5,
    weight_soft_loss=0.5,
    beta=0.5,
    temperature=1.0,
    ignore_index=-100,
    num_valid_tokens=None,
    return_soft_hard_loss=False,
    **loss_options,
):
    """``fused_linear_cosine_distill`` between two causal LMs on a batch, never building their logits.

    student, teacher: causal LMs exposing their LM head through ``get_output_embeddings()``; the
    teacher runs under torch.no_grad and must have a vocabulary at least as large as the student's.
    input_ids, attention_mask, labels: [B, L], as for the models' forward;
    targets are the labels shifted by one (``next_token_targets``), padding and ignore_index skipped.
    student_hidden / teacher_hidden: precomputed ``final_hidden_states`` [B, L, H], used instead of
    running that model (input_ids is then not needed for it).
    Each model's logit scale and softcapping are applied as its config says (``head_inputs``), so the
    loss equals the one computed from ``model(...).logits``. ``num_valid_tokens`` (e.g. the count over
    all micro-batches of a gradient accumulation step) and ``**loss_options`` (chunk_size, impl,
    accum_dtype, teacher_precision, cosine_via) go to ``fused_linear_cosine_distill``.
    """
    if labels is None:
        raise TypeError("labels is required, got None")
    if input_ids is None and (student_hidden is None or teacher_hidden is None):
        raise TypeError("input_ids is required unless both student_hidden and teacher_hidden are given")
    targets = next_token_targets(labels, attention_mask, ignore_index)
    if student_hidden is None:
        student_hidden = final_hidden_states(student, input_ids, attention_mask, lm_head(student, "student"))
    with torch.no_grad():
        if teacher_hidden is None:
            teacher_hidden = final_hidden_states(teacher, input_ids, attention_mask, lm_head(teacher, "teacher"))
        teacher_args = head_inputs(teacher, teacher_hidden, "teacher")
    hidden, weight, bias, softcap, logit_scale = head_inputs(student, student_hidden, "student")
    with torch.autocast(hidden.device.type, enabled=False):  # the inputs are already in the autocast dtype
        return fused_linear_cosine_distill(
            hidden, weight, teacher_args[0], teacher_args[1], targets, bias, teacher_args[2],
            weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
            ignore_index=ignore_index, temperature=temperature, return_soft_hard_loss=return_soft_hard_loss,
            num_valid_tokens=num_valid_tokens, student_softcap=softcap, teacher_softcap=teacher_args[3],
            student_logit_scale=logit_scale, teacher_logit_scale=teacher_args[4],
            **loss_options,
        )


class CosineDistillationTrainer(Trainer):
    """A ``transformers.Trainer`` whose loss is ``cosine_distill_loss`` against a frozen teacher.

    ``teacher_model`` is put in eval mode, frozen and moved to the student's device. The loss is
    normalised by ``num_items_in_batch`` (the Trainer's count of labels != -100 over all micro-batches
    of a step, across processes), so gradient accumulation gives the gradient of one big batch; set
    the labels of padding to -100 (as Hugging Face's collators do) for that count to match ours.
    Training logs gain ``soft_loss`` and ``hard_loss`` next to ``loss``. The student's LM head must be
    whole on each process (single device or DDP; not FSDP or DeepSpeed ZeRO-3, which shard it, nor
    torch.nn.DataParallel). ``loss_options`` (chunk_size, impl, ...) go to ``fused_linear_cosine_distill``.
    """

    def __init__(
        self, *args, teacher_model, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=1.0,
        loss_options=None, **kwargs,
    ):
        super().__init__(*args, **kwargs)
        device = next(self.model.parameters()).device
        self.teacher_model = teacher_model.to(device).eval().requires_grad_(False)
        self.loss_options = dict(
            weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta, temperature=temperature,
            **(loss_options or {}),
        )
        # Makes the Trainer count num_items_in_batch and take our loss as already normalised over the step.
        self.model_accepts_loss_kwargs = True
        self._soft_hard_sums = None
        self._soft_hard_since_step = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        student = self.accelerator.unwrap_model(model)
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        if torch.is_tensor(num_items_in_batch):  # a step whose labels are all -100: loss 0, not an error
            num_items_in_batch = num_items_in_batch.clamp(min=1)
        elif num_items_in_batch is not None:
            num_items_in_batch = max(1, num_items_in_batch)
        with self.accelerator.autocast():
            hidden = final_hidden_states(model, input_ids, attention_mask, lm_head(student, "student"))
            loss, soft, hard = cosine_distill_loss(
                student, self.teacher_model, input_ids, attention_mask, inputs["labels"], student_hidden=hidden,
                num_valid_tokens=num_items_in_batch, return_soft_hard_loss=True, **self.loss_options,
            )
        if num_items_in_batch is not None and getattr(self.args, "average_tokens_across_devices", False):
            # num_items_in_batch counts all processes' tokens and DDP averages the gradients: undo the average.
            loss, soft, hard = (value * self.accelerator.num_processes for value in (loss, soft, hard))
        if model.training:
            sums = torch.stack([soft, hard]).detach()
            self._soft_hard_sums = sums if self._soft_hard_sums is None else self._soft_hard_sums + sums
        return (loss, {"soft_loss": soft, "hard_loss": hard}) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        """Adds the mean soft and hard loss per optimizer step since the last training log."""
        if "loss" in logs and self._soft_hard_sums is not None:
            steps = max(1, self.state.global_step - self._soft_hard_since_step)
            soft, hard = (self.accelerator.gather(self._soft_hard_sums[None]).mean(0) / steps).tolist()
            logs.update(soft_loss=soft, hard_loss=hard)
            self._soft_hard_sums, self._soft_hard_since_step = None, self.state.global_step
        super().log(logs, *args, **kwargs)
