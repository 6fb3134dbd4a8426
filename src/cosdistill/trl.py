"""TRL's ``SFTTrainer``, ``GKDTrainer`` and ``DistillationTrainer`` with the fused distillation losses (needs ``trl``:
``pip install 'cosdistill[trl]'``).

``DistillationSFTTrainer`` keeps everything ``SFTTrainer`` does with the data (chat templates,
completion-only and assistant-only labels, packing, padding-free batches, PEFT) and replaces its loss by
``cosdistill.hf.distill_loss`` (cosine or generalized JSD) against a frozen teacher. The change from an ``SFTTrainer`` script
is the class and a teacher::

    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=SFTConfig(...),
                                     train_dataset=dataset, weight_hard_loss=0.5, weight_soft_loss=0.5)

``DistillationGKDTrainer`` is TRL's ``GKDTrainer`` (on-policy distillation: student-generated, teacher-generated
or dataset sequences) whose generalized JSD is computed by ``fused_linear_jsd`` from the last hidden states,
never building either model's logits. The change from a ``GKDTrainer`` script is the class name::

    trainer = DistillationGKDTrainer(model=student, teacher_model=teacher, args=GKDConfig(...),
                                     train_dataset=dataset, processing_class=tokenizer)

``DistillationTrainer`` is TRL's ``DistillationTrainer`` (on-policy distillation, GKD's successor in TRL's stable
API) whose generalized JSD is likewise ``fused_linear_jsd``'s; the change is the import.

DistillationGKDTrainer and DistillationTrainer are defined on first use (``from cosdistill.trl import
DistillationGKDTrainer``): TRL keeps GKD in ``trl.experimental``, whose import warns, its DistillationTrainer's
module imports part of it, and SFT users need not load either.
"""

import contextlib
import inspect

import torch

try:
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from trl import SFTTrainer
except ImportError as error:
    raise ImportError("cosdistill.trl needs trl: pip install 'cosdistill[trl]'") from error

from ._student_metrics import StudentMetrics
from .hf import (
    UNSUPPORTED_ARGS,
    DistillationMixin,
    check_loss_values,
    check_sharding,
    check_tensor_parallel,
    check_unsupported_args,
    distill_loss,
    final_hidden_states,
    keep_head_hook,
    lm_head,
    loss_of_hidden_states,
    nonzero_count,
    split_head_rows,
    teacher_forward_model,
    tensor_parallel_size,
    without_student_adapters,
)

# DistillationGKDTrainer and DistillationTrainer are made on first use (__getattr__ below)
__all__ = ["CosineDistillationSFTTrainer", "DistillationGKDTrainer", "DistillationSFTTrainer",  # noqa: F822
           "DistillationTrainer"]

# SFTConfig options that change the loss in ways this loss does not follow.
UNSUPPORTED_SFT_ARGS = {
    **UNSUPPORTED_ARGS,
    "loss_type": ("nll", "the hard term is plain cross-entropy (loss_type='nll')"),
}


class DistillationSFTTrainer(DistillationMixin, SFTTrainer):
    """``SFTTrainer`` whose loss is ``distill_loss`` against ``teacher_model`` (``DistillationMixin`` says how:
    ``loss="cosine"`` or ``"jsd"``); the tokens trained on are the labels SFTTrainer's data handling leaves
    (completion-only, assistant-only, packed). It logs SFTTrainer's ``num_tokens``, ``entropy`` and
    ``mean_token_accuracy`` (the last two of the student's own distribution, at temperature 1, over the tokens with
    a target; not for a tensor-parallel student, whose loss holds a shard of each logits row)."""

    unsupported_args = UNSUPPORTED_SFT_ARGS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tokens_unlogged = None  # this process's tokens trained on since the last log, on the device
        self._evaluation_prefix = None  # the metrics' prefix while evaluate() runs
        # per mode, each loss call's [entropy sum, top-1 hits, tokens] on the device, read at the next log
        self._student_metric_sums = {"train": [], "eval": []}

    def _student_metrics_to_log(self):
        return StudentMetrics() if tensor_parallel_size(self) == 1 else None

    def _keep_student_metrics(self, metrics):
        sums = torch.stack([metrics.entropy.sum(), metrics.top1.sum(), metrics.counted.sum()]).float()
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and 0 < state.remainder <= self.accelerator.process_index:
            # SFTTrainer's gather_for_metrics keeps the first `remainder` processes' sums of a dataloader's last
            # batch, where the others hold rows accelerate repeated to even them out
            sums = torch.zeros_like(sums)
        self._student_metric_sums["train" if self.model.training else "eval"].append(sums)

    def _log_student_metrics(self, mode):
        """SFTTrainer's entropy and mean_token_accuracy of each loss call since the last log, all processes' tokens
        together, into its metrics (which its log averages): read here rather than at every step."""
        kept, self._student_metric_sums[mode] = self._student_metric_sums[mode], []
        if not kept:
            return
        calls = torch.stack(kept)
        # every process has run as many loss calls (the same steps; evaluation batches evened out by accelerate)
        entropy, hits, tokens = self.accelerator.gather(calls[None]).sum(0).T.tolist()
        for entropy_sum, hit_sum, token_sum in zip(entropy, hits, tokens):
            self._metrics[mode]["entropy"].append(entropy_sum / token_sum if token_sum > 0 else 0.0)
            self._metrics[mode]["mean_token_accuracy"].append(hit_sum / token_sum if token_sum > 0 else 0.0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        tokens = None
        if model.training:  # SFTTrainer's num_tokens, padding excluded, counted once the loss is (as SFTTrainer's)
            mask = inputs.get("attention_mask")
            tokens = mask.sum() if mask is not None else torch.tensor(inputs["input_ids"].numel())
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if tokens is not None:
            self._tokens_unlogged = tokens if self._tokens_unlogged is None else self._tokens_unlogged + tokens
        return result

    def log(self, logs, *args, **kwargs):
        """Adds SFTTrainer's ``num_tokens``, all processes' tokens trained on so far, read here once per log
        rather than at every step."""
        if self._tokens_unlogged is not None:  # every process logs: each takes part in the gather
            tokens = self._tokens_unlogged.to(self.args.device).reshape(1)
            # tensor-parallel ranks hold the same batch: counted once, as SFTTrainer counts it
            self._total_train_tokens += int(self.accelerator.gather(tokens).sum()) // tensor_parallel_size(self)
            self._tokens_unlogged = None
        # where SFTTrainer's own loss would have set it: a training step's log, an evaluation's
        evaluation = self._evaluation_prefix is not None and f"{self._evaluation_prefix}_loss" in logs
        if "loss" in logs or evaluation:
            self._metrics["eval" if evaluation else "train"]["num_tokens"] = [self._total_train_tokens]
        self._log_student_metrics("train" if self.model.training else "eval")  # the mode SFTTrainer.log reads
        super().log(logs, *args, **kwargs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        self._evaluation_prefix = metric_key_prefix  # which log is the evaluation's (log above)
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._evaluation_prefix = None


CosineDistillationSFTTrainer = DistillationSFTTrainer  # its name from before loss="jsd"


# GKDConfig's SFT loss fields, with the value that changes nothing: GKDTrainer's loss ignores them too, but a set
# one says the user expects an effect, so each raises here as it does for DistillationSFTTrainer.
UNSUPPORTED_GKD_CONFIG = {
    "loss_type": ("nll", "GKD's loss is the generalized JSD alone (loss_type='nll')"),
    "label_smoothing_factor": (0, "label smoothing is not part of GKD's generalized JSD"),
}

# GKDTrainer arguments that read the student's logits, which this trainer never computes.
UNSUPPORTED_GKD_ARGUMENTS = {
    "compute_metrics": "evaluation returns no logits (the fused loss never computes them); evaluation gives eval_loss",
    "preprocess_logits_for_metrics": "evaluation returns no logits (the fused loss never computes them)",
}


def check_heads(student, teacher) -> None:
    """Raise, at construction, unless both models' LM heads are what the fused JSD reads (``lm_head``: a
    torch.nn.Linear, no adapter on it); their configs' logit scales and softcaps are applied (``head_inputs``), and
    the first step checks that the models' logits are that (``check_head_reproduces_logits``)."""
    for role, model in (("student", student), ("teacher", teacher)):
        lm_head(model, role)


def unmark_a_teacher_inside_the_student(trainer) -> None:
    """TRL's GKDTrainer and DistillationTrainer prepare the teacher with ``accelerator.prepare_model(teacher,
    evaluation_mode=True)``, which marks it ``_is_accelerate_prepared``. A teacher that is the student or one of its
    modules (a PEFT student's own base model, whose attributes the PeftModel forwards) makes the student read as
    prepared too, and the Trainer's ``accelerator.prepare`` then hands it back as it is: under DDP not wrapped, so
    each process steps on its own gradients, never averaged (nor compiled, nor cast, where accelerate would). The
    mark is taken off such a teacher: evaluation_mode left it unwrapped, and the student is prepared at train()."""
    student, teacher = trainer.accelerator.unwrap_model(trainer.model), trainer.teacher_model
    if any(module is teacher for module in student.modules()):  # the student's own modules include itself
        vars(teacher).pop("_is_accelerate_prepared", None)


def check_jsd_alone_options(config_name, loss_options) -> None:
    """Raise for ``loss_options`` that a trainer whose loss is the generalized JSD alone sets itself (from its
    config), or that ``fused_linear_jsd`` does not take."""
    reserved = {"loss", "beta", "temperature", "weight_hard_loss", "weight_soft_loss", "num_valid_tokens",
                "ignore_index"} & set(loss_options)
    if reserved:
        raise ValueError(f"loss_options cannot set {sorted(reserved)}: {config_name} sets beta, and the loss is the "
                         "generalized JSD alone")
    # their values too, before TRL's __init__ touches the models (a peft_config's adapters go into the caller's
    # student); the config's beta and temperature are checked with them once it is read
    check_loss_values("jsd", loss_options, beta=0.5, weight_hard_loss=0.0, weight_soft_loss=1.0)


def _define_distillation_trainer():
    from trl import DistillationTrainer as TRLDistillationTrainer  # its module imports part of trl.experimental

    class DistillationTrainer(TRLDistillationTrainer):
        """TRL's ``DistillationTrainer`` (on-policy distillation: the student generates the completions, with vLLM or
        transformers, tools included) whose generalized JSD is ``fused_linear_jsd`` on the two models' last hidden
        states, instead of TRL's chunked divergence, which computes each logit tile twice or three times. The change
        from a TRL script is the import (``from cosdistill.trl import DistillationTrainer``). Not
        ``cosdistill.hf.DistillationTrainer``, a ``transformers.Trainer`` on the dataset's own completions.

        Everything but the loss is TRL's. The loss is TRL's to the token and the divisor (trl 1.16): on each completion
        token (``completion_mask`` times ``tool_mask``) the generalized JSD at ``beta`` (0: forward KL, 1: reverse KL)
        between the models' distributions at ``temperature`` (scaled and softcapped as their configs say; TRL checks
        that the two share one vocabulary), summed and divided by the step's completion tokens over the number of
        processes (in training), else by this batch's. Only the completion tokens' rows reach the LM heads.

        The student's ``entropy`` is logged as TRL logs it, at the temperature (``StudentMetrics``). Differences: under
        ``bf16=True`` (DistillationConfig's default) the models run through the forward
        accelerate wraps in autocast, their backbones in bf16 as mixed precision asks, where TRL's loss runs their
        backbones around it in fp32: the two losses agree to bf16's rounding, not to the digit. DeepSpeed ZeRO-3,
        FSDP1 and torch.nn.DataParallel raise at construction (FSDP2 works), as do tensor-parallel heads, a missing
        ``teacher_model`` (a teacher served elsewhere: the fused loss reads its head); at the first step, models whose
        logits the fused loss does not reproduce (``check_head_reproduces_logits``). ``loss_options`` (chunk_size,
        impl, accum_dtype, teacher_precision) go to ``fused_linear_jsd``.
        """

        def __init__(self, *args, loss_options=None, **kwargs):
            check_jsd_alone_options("DistillationConfig", loss_options or {})
            bound = inspect.signature(TRLDistillationTrainer.__init__).bind(self, *args, **kwargs).arguments
            self._refuse_split_heads(bound.get("model"), bound.get("teacher_model"))  # before accelerate prepares them
            super().__init__(*args, **kwargs)
            name = type(self).__name__
            if self.teacher_model is None:
                raise ValueError(f"{name} needs a teacher_model: the fused loss reads the teacher's LM head")
            unmark_a_teacher_inside_the_student(self)  # before train() prepares the student (DDP)
            student, teacher = (self.accelerator.unwrap_model(model) for model in (self.model, self.teacher_model))
            self._refuse_split_heads(student, teacher)  # models loaded here from their names
            check_loss_values("jsd", loss_options or {}, beta=self.beta, weight_hard_loss=0.0, weight_soft_loss=1.0,
                              temperature=self.temperature)
            check_sharding(self)
            check_heads(student, teacher)
            self.loss_options = dict(loss_options or {})
            # the batch fields TRL's _get_last_hidden_state hands the models beside the tokens (vision-language models)
            self.model_input_names = tuple(inspect.signature(self._get_last_hidden_state).parameters)[4:]

        def _refuse_split_heads(self, *models):
            for role, model in zip(("student", "teacher"), models):
                if isinstance(model, torch.nn.Module) and split_head_rows(model, role) is not None:
                    raise ValueError(f"{type(self).__name__} does not support a {role} whose LM head is split for "
                                     "tensor parallelism: not tested with TRL's DistillationTrainer")

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # TRL's: the generated completions' count (not the dataset's), over the processes, whose gradients DDP
            # averages; the loss runs inside the student's wrapper (DDP's and FSDP's hooks fire)
            if self.model.training and inputs.get("num_items_in_batch") is not None:
                num_items_in_batch = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            student = self.accelerator.unwrap_model(model)
            loss, entropy_sum, counted = self._forward_redirection(model, student, self._compute_loss, student, inputs,
                                                                   num_items_in_batch)
            # TRL's entropy log: the mean over all processes' completion tokens, gathered outside the wrapped forward
            mode = "train" if self.model.training else "eval"
            counted = self.accelerator.gather_for_metrics(counted).sum()
            entropy_sum = self.accelerator.gather_for_metrics(entropy_sum).sum()
            self._metrics[mode]["entropy"].append((entropy_sum / counted).item() if counted > 0 else 0.0)
            return (loss, None) if return_outputs else loss

        def _compute_loss(self, student, inputs, num_items_in_batch):
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
            completion_length = inputs["completion_ids"].shape[1]
            model_inputs = {key: inputs[key] for key in self.model_input_names if key in inputs}
            student_hidden = completion_hidden_states(student, input_ids, attention_mask, completion_length,
                                                      model_inputs)
            self.teacher_model.eval()
            teacher = self.accelerator.unwrap_model(self.teacher_model)
            with torch.no_grad(), without_student_adapters(student, teacher):
                if teacher_forward_model(student, teacher) is student:
                    # The student's own base model (or the student): through the student's root, whose FSDP2 hooks
                    # gather the embeddings and final norm that the base model's forward alone finds sharded (this
                    # runs inside the student's wrapper, its forward redirected here)
                    teacher_hidden = completion_hidden_states(student, input_ids, attention_mask, completion_length,
                                                              model_inputs)
                else:
                    teacher_hidden = self._forward_redirection(self.teacher_model, teacher, completion_hidden_states,
                                                               teacher, input_ids, attention_mask, completion_length,
                                                               model_inputs)
            # one device for the loss (a model split over devices may end its backbone on another than its head)
            device = lm_head(student, "student").weight.device
            trained = mask.bool().to(device)
            targets = inputs["completion_ids"].to(device)[trained]
            metrics = StudentMetrics(temperature=self.temperature)  # TRL's entropy: the student's at the temperature
            loss = loss_of_hidden_states(
                student, teacher, student_hidden.to(device)[trained], teacher_hidden.to(device)[trained], targets,
                loss="jsd", weight_hard_loss=0.0, weight_soft_loss=1.0, beta=self.beta, temperature=self.temperature,
                num_valid_tokens=num_items_in_batch, student_metrics=metrics, **self.loss_options,
            )
            return loss, metrics.entropy.sum(), metrics.counted.sum()

    DistillationTrainer.__qualname__ = "DistillationTrainer"  # as stored in this module (pickle)
    return DistillationTrainer


def completion_hidden_states(model, input_ids, attention_mask, completion_length, model_inputs):
    """The LM head's input at the positions that predict the completion's tokens (position i predicts completion
    token i), [B, completion_length, H]: TRL's _get_last_hidden_state's positions, but the head's input rather than
    the backbone's output, which the first call's head check holds to the model's logits (MiniCPM3 divides the
    backbone's output by its logits_scaling before the head)."""
    hidden = final_hidden_states(model, input_ids, attention_mask, **model_inputs)
    return hidden[:, -completion_length - 1 : -1]


def _define_gkd_trainer():
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:  # older trl kept it at the top level
        try:
            from trl import GKDTrainer
        except ImportError as error:
            raise ImportError("cosdistill.trl.DistillationGKDTrainer needs a trl with GKDTrainer "
                              "(trl.experimental.gkd, trl>=1.16)") from error

    class DistillationGKDTrainer(GKDTrainer):
        """TRL's ``GKDTrainer`` whose loss is ``cosdistill.fused_linear_jsd`` on the models' last hidden states
        and LM heads: the same number as ``GKDTrainer.compute_loss``, without either model's full logits.

        The same as ``GKDTrainer``: everything but ``compute_loss`` is inherited (and ``generate_on_policy_outputs``
        only turns the student's adapters off for a teacher that is its base model). The batches (the dataset's,
        through the data collator, ``DataCollatorForChatML`` by default; with probability ``lmbda`` the student's
        own completions, else with ``seq_kd`` the teacher's, sampled at ``temperature`` for up to
        ``max_new_tokens``), the teacher's loading and preparation, PEFT, dropout, logging.
        The loss is GKDTrainer's to the token and the divisor (trl 1.16):

        - tokens: position i of ``input_ids`` predicts ``labels[:, i + 1]`` (the plain causal shift, no slicing by
          prompt length); exactly the positions whose next label is not -100 count, whatever the attention mask
          (TRL's ``generalized_jsd_loss`` masks by the labels alone: the collator's and the generation's labels are
          -100 on the prompt and the padding);
        - per token the generalized JSD of ``generalized_jsd_loss`` summed over the vocabulary: ``beta = 0``
          forward KL(teacher || student), ``beta = 1`` reverse KL(student || teacher), between
          ``beta KL(teacher || M) + (1 - beta) KL(student || M)`` with ``M = (1 - beta) student + beta teacher``;
        - temperature: none in the loss. ``GKDConfig.temperature`` is the sampling temperature only, as in
          ``GKDTrainer.compute_loss``, which calls ``generalized_jsd_loss`` with its default temperature 1;
        - divisor: ``num_items_in_batch`` where the Trainer passes it (the count of ``labels[:, 1:] != -100`` of
          the step's dataset batches, across processes with ``average_tokens_across_devices``, counted before any
          generation replaced them, as TRL has it), else this batch's count of tokens (TRL's "batchmean"). Under
          data parallel that count is all processes' and, as in TRL, the loss is not multiplied back by the number
          of processes as ``Trainer.compute_loss`` does: the logged loss and the step are 1 / num_processes of one
          process's on the same rows (the DistillationTrainer's are not). Raise the learning rate with the number
          of processes to keep a single process's steps. The ranks of a student loaded with ``tp_plan="auto"``
          share their batches and transformers counts them once: there the step is one process's.

        Differences: no logits are computed, so evaluation and ``predict()`` return none (``eval_loss`` and
        ``test_loss`` are GKDTrainer's, the predictions None; ``compute_metrics`` and
        ``preprocess_logits_for_metrics`` raise a ValueError); LM heads carrying an adapter raise at construction
        (the configs' softcaps and logit multipliers are applied, with their gradients: ``hf.config_logit_scale``);
        so do
        DeepSpeed ZeRO-3, FSDP1 and torch.nn.DataParallel (``check_sharding``: the fused loss reads each head
        whole; FSDP2 works). Where ``num_items_in_batch`` is 0 the loss is 0, also for a generated batch with
        targets (TRL's 0 / 0 is NaN, x / 0 inf). Under mixed precision both heads run in the autocast dtype as
        the models' own heads do, with the JSD accumulated in float32 (TRL takes the log-softmax of the
        autocast-dtype logits after accelerate casts them to float32). ``loss_options`` (chunk_size, impl,
        accum_dtype, teacher_precision) go to ``fused_linear_jsd``. Under mixed precision an ``evaluate()`` before
        ``train()`` runs the student's head in the autocast dtype where GKDTrainer's student, not yet prepared by
        accelerate, runs in float32 (bf16: 7.5e-5 apart on a tiny model); from ``train()`` on they agree. A subclass
        that overrides ``generalized_jsd_loss`` but not ``compute_loss`` raises a TypeError (the fused loss never
        calls it).
        """

        def __init__(self, *args, loss_options=None, **kwargs):
            bound = inspect.signature(GKDTrainer.__init__).bind(self, *args, **kwargs).arguments
            for name, why in UNSUPPORTED_GKD_ARGUMENTS.items():
                if bound.get(name) is not None:
                    raise ValueError(f"{type(self).__name__} does not support {name}: {why}")
            check_jsd_alone_options("GKDConfig", loss_options or {})
            if (type(self).generalized_jsd_loss is not GKDTrainer.generalized_jsd_loss
                    and type(self).compute_loss is DistillationGKDTrainer.compute_loss):
                raise TypeError(f"{type(self).__name__} overrides generalized_jsd_loss, which the fused loss never "
                                "calls (it computes no logits): subclass trl's GKDTrainer for a loss of your own")
            super().__init__(*args, **kwargs)
            unmark_a_teacher_inside_the_student(self)  # before train() prepares the student (DDP)
            student, teacher = (self.accelerator.unwrap_model(model) for model in (self.model, self.teacher_model))
            if self.seq_kd and self.lmbda < 1 and teacher is student:
                raise ValueError(f"{type(self).__name__} with seq_kd cannot tell the teacher's generations from the "
                                 "student's where the teacher is the student itself: pass its base model "
                                 "(student.get_base_model()), whose generations run with the adapters off")
            check_loss_values("jsd", loss_options or {}, beta=self.beta, weight_hard_loss=0.0, weight_soft_loss=1.0,
                              temperature=1.0)  # GKDConfig's beta in [0, 1]
            check_unsupported_args(self, UNSUPPORTED_GKD_CONFIG)
            check_sharding(self)
            check_tensor_parallel(self, student, teacher)
            check_heads(student, teacher)
            # Before any call of a model accelerate may compile (torch_compile, or its dynamo plugin).
            keep_head_hook(self.model, lm_head(student, "student"))
            self.loss_options = dict(loss_options or {})

        def generate_on_policy_outputs(self, model, inputs, generation_config, *args, **kwargs):
            """GKDTrainer's, where a teacher that runs through the student's adapter layers (its own base model)
            generates seq_kd's completions with them off: with them on, it sampled the student's."""
            student = self.accelerator.unwrap_model(self.model)  # lmbda's generations: the student's, adapters on
            on_policy = self.accelerator.unwrap_model(model) is student
            adapters = contextlib.nullcontext() if on_policy else without_student_adapters(student, model)
            with adapters:
                return GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config, *args, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            student = self.accelerator.unwrap_model(model)
            teacher = self.accelerator.unwrap_model(self.teacher_model)
            input_ids, attention_mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
            # No item counted in the step's dataset batches: loss 0 (TRL's x / 0: NaN or inf), also where a
            # generated batch has targets. On the device: no host read.
            counted = None if num_items_in_batch is None else num_items_in_batch > 0
            num_items_in_batch = nonzero_count(num_items_in_batch)
            with self.accelerator.autocast():
                hidden = final_hidden_states(model, input_ids, attention_mask, lm_head(student, "student"))
                # GKDTrainer's, which stays: the next seq_kd generation samples without the teacher's dropout (and
                # modules shared with the student stay off until training_step's model.train(), as in GKDTrainer)
                self.teacher_model.eval()
                with torch.no_grad(), without_student_adapters(student, teacher):
                    teacher_hidden = final_hidden_states(teacher_forward_model(model, self.teacher_model), input_ids,
                                                         attention_mask, lm_head(teacher, "teacher"))
                # No attention mask: the targets are labels[:, 1:] as they are, masked by -100 alone (as TRL's).
                loss = distill_loss(
                    student, teacher, None, None, labels, loss="jsd", student_hidden=hidden,
                    teacher_hidden=teacher_hidden, weight_hard_loss=0.0, weight_soft_loss=1.0, beta=self.beta,
                    temperature=1.0, num_valid_tokens=num_items_in_batch, **self.loss_options,
                )
            if counted is not None:
                loss = loss * counted
            # SFTTrainer.prediction_step (predict(), or evaluate() with prediction_loss_only=False) reads
            # outputs.logits: there are none.
            return (loss, CausalLMOutputWithPast(loss=loss, logits=None)) if return_outputs else loss

    DistillationGKDTrainer.__qualname__ = "DistillationGKDTrainer"  # as stored in this module (pickle)
    return DistillationGKDTrainer


def __getattr__(name):
    define = {"DistillationGKDTrainer": _define_gkd_trainer, "DistillationTrainer": _define_distillation_trainer}.get(name)
    if define is not None:
        globals()[name] = define()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))  # the trainers made on first use too (dir, help, completion)
