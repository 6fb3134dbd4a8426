"""TRL's ``SFTTrainer`` with the distillation loss (needs ``trl``: ``pip install 'cosdistill[trl]'``).

``DistillationSFTTrainer`` keeps everything ``SFTTrainer`` does with the data (chat templates,
completion-only and assistant-only labels, packing, padding-free batches, PEFT) and replaces its loss by
``cosdistill.hf.distill_loss`` (cosine or generalized JSD) against a frozen teacher. The change from an ``SFTTrainer`` script
is the class and a teacher::

    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=SFTConfig(...),
                                           train_dataset=dataset, weight_hard_loss=0.5, weight_soft_loss=0.5)
"""

try:
    from trl import SFTTrainer
except ImportError as error:
    raise ImportError("cosdistill.trl needs trl: pip install 'cosdistill[trl]'") from error

from .hf import UNSUPPORTED_ARGS, DistillationMixin

# SFTConfig options that change the loss in ways this loss does not follow.
UNSUPPORTED_SFT_ARGS = {
    **UNSUPPORTED_ARGS,
    "loss_type": ("nll", "the hard term is plain cross-entropy (loss_type='nll')"),
    "use_liger_kernel": (False, "Liger's patched forward skips the LM head whose input the loss reads"),
}


class DistillationSFTTrainer(DistillationMixin, SFTTrainer):
    """``SFTTrainer`` whose loss is ``distill_loss`` against ``teacher_model`` (``DistillationMixin`` says how:
    ``loss="cosine"`` or ``"jsd"``); the tokens trained on are the labels SFTTrainer's data handling leaves
    (completion-only, assistant-only, packed)."""

    unsupported_args = UNSUPPORTED_SFT_ARGS


CosineDistillationSFTTrainer = DistillationSFTTrainer  # its name from before loss="jsd"
