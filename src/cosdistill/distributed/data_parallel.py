"""Data parallel training (DDP, FSDP2): a normaliser over the whole global batch.

Each rank holds a slice of the global batch, and the slices can hold different numbers of ignored
tokens. Normalising each rank's loss by its own count then weights tokens unevenly: a token on a rank
with few valid tokens counts more. The normaliser here makes the gradients equal to those of one
process on the whole batch.
"""

import math

import torch
import torch.distributed as dist

from ..api import FusedLinearCosineDistillLoss, FusedLinearJSDLoss
from ._groups import check_member


def data_parallel_num_valid_tokens(labels, ignore_index=-100, group=None):
    """The ``num_valid_tokens`` that makes DDP or FSDP2 gradients equal the whole-batch gradients.

    Returns a 0-d float64 tensor: max(1, N_global) / world_size, where N_global is the number of
    labels != ignore_index summed over the ranks of ``group`` (default: the whole world) by an
    all-reduce, and world_size is the group's size.

    Why divide by world_size: DDP and FSDP2 average the gradients over ranks, that is they sum the
    ranks' gradients and divide by world_size. With rank r's loss normalised by N_global / world_size,
    the average is (sum over r of world_size * grad(sum_r)) / (world_size * N_global)
    = grad(sum over all valid tokens) / N_global: the gradient of the whole-batch loss.

    Every rank of ``group`` must call it (it is a collective). With gradient accumulation, call it once
    on the labels of all micro-batches of the step (e.g. ``torch.cat``) and pass the result to each
    micro-batch's loss, so that the step is normalised by the step's token count.

    A rank whose labels are refused (not an integer tensor) still takes part in the all-reduce, with NaN, and
    then raises; the others get NaN, which their loss refuses: no rank waits in the collective for it. The data
    parallel modules below do the same for a rank whose options are refused (a tensor option changed in place).
    """
    return _global_count(labels, ignore_index, group)


def _global_count(labels, ignore_index, group, refused: Exception | None = None):
    """data_parallel_num_valid_tokens; ``refused``: an error this rank found before the count (its loss's options),
    raised, as refused labels are, after it took part in the all-reduce with NaN."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("data_parallel_num_valid_tokens needs torch.distributed initialised (init_process_group)")
    check_member(group, "data_parallel_num_valid_tokens (the data-parallel losses' count too)")
    if refused is None and not torch.is_tensor(labels):
        refused = TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if refused is None and (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
        refused = TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    # Gloo all-reduces CPU tensors; NCCL (and the "cpu:gloo,cuda:nccl" pair) take the labels' (or current) device.
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    else:
        device = labels.device if torch.is_tensor(labels) else torch.device("cuda", torch.cuda.current_device())
    # float64 holds every count exactly (up to 2^53) and the refused rank's NaN.
    if refused is None:
        count = (labels != ignore_index).sum().to(device=device, dtype=torch.float64)
    else:
        count = torch.full((), math.nan, dtype=torch.float64, device=device)
    dist.all_reduce(count, group=group)
    if refused is not None:
        raise refused
    return count.clamp_min(1) / dist.get_world_size(group)


class _GlobalNormaliser:
    """The forward of a loss module with the global batch's normaliser (see ``DataParallelCosineDistillLoss``).

    Mixed in before the loss module, so that the loss's options and signature stay its own.
    """

    _attributes = (*FusedLinearCosineDistillLoss._attributes, "group")  # the loss modules' public attributes, and its own

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                teacher_bias=None, *, num_valid_tokens=None, student_metrics=None):
        if num_valid_tokens is None:
            try:
                ignore_index, refused = self.options.ignore_index, None  # a tensor option is checked again here
            except (TypeError, ValueError) as error:  # the other ranks must not wait in the count for this one
                ignore_index, refused = -100, error
            num_valid_tokens = _global_count(true_labels, ignore_index, self.group, refused)
        return super().forward(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
            num_valid_tokens=num_valid_tokens, student_metrics=student_metrics,
        )


class DataParallelCosineDistillLoss(_GlobalNormaliser, FusedLinearCosineDistillLoss):
    """``FusedLinearCosineDistillLoss`` for DDP and FSDP2: normalised over the global batch.

    Takes the parent's options plus ``group`` (the data parallel process group; None: the whole
    world). When forward gets no ``num_valid_tokens``, it uses
    ``data_parallel_num_valid_tokens(true_labels, ignore_index, group)`` (a collective: every rank of
    the group must call forward), so that the gradients DDP or FSDP2 average over ranks equal those of
    one process on the whole batch.

    The loss returned on each rank is that rank's share: its tokens' summed loss times
    world_size / N_global. The mean of the ranks' losses is the whole-batch loss; to log it::

        logged = loss.detach().clone()
        dist.all_reduce(logged, group=group)  # sum (gloo has no AVG)
        logged /= dist.get_world_size(group)

    The soft and hard terms of ``return_soft_hard_loss`` are shares in the same way; a ``student_metrics`` is filled
    in for this rank's tokens. Its forward takes no ``vocab_parallel``: a vocabulary split inside data parallel is not
    supported by these modules.
    """


class DataParallelJSDLoss(_GlobalNormaliser, FusedLinearJSDLoss):
    """``FusedLinearJSDLoss`` for DDP and FSDP2, normalised over the global batch as
    ``DataParallelCosineDistillLoss``: the parent's options plus ``group``; each rank's loss is its share."""
