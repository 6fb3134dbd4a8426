"""The kernels a call runs, chosen once from ``impl`` and the device: every kernel of one kind, so that
``impl="torch"`` runs torch alone and ``impl="triton"`` Triton alone (but for a vocabulary split's hash check,
which runs Triton's fingerprint on a GPU whatever ``impl``: ``_split_check.queue_hash_check``).

- torch: the plain-torch specs, the CPU path (and any device, slowly).
- triton: the Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1).
- cuda: Triton's, with the row steps of kernels/row_step_cuda.py and kernels/row_step_jsd_cuda.py (Hopper
  clusters) where they apply.
"""

import dataclasses
import functools
import os
from typing import Callable

import torch

from . import _fingerprint, _labels, _row_step, _row_step_jsd, _student_metrics, _teacher_fp8

IMPLS = ("auto", "torch", "triton", "cuda")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    cosine_row_step: _row_step.RowStepImpl
    jsd_row_step: _row_step.RowStepImpl
    count_labels: Callable  # (labels, ignore_index, vocab_student) -> [counted, out of range]
    mean_losses: Callable  # (token_losses, counts, given, weight_hard, weight_soft, poison) -> (loss, soft, hard)
    # (values, factor, poison): each of values (a tuple) *= factor + poison in place unless that is 1 (0-d; None: 1, 0)
    scale_unless_one: Callable
    quantize_rows: Callable  # (rows, out, scales): row-wise FP8
    fingerprint: Callable  # (weight) -> its hash, [2] int64 (the cached teacher copies' check)
    stale_check: Callable  # (partial lanes, kept hash) -> (changed, poison): that check's comparison on the device
    student_metrics: Callable  # (student_logits, labels, constants, temperature, out): _student_metrics.py


def scale_unless_one_torch(values: tuple[torch.Tensor, ...], factor: torch.Tensor | None,
                           poison: torch.Tensor | None = None) -> None:
    """Each of values *= factor + poison in place (0-d tensors; None: 1 and 0), in fp32 and rounded once; on the CPU
    not where that is 1 (read on the host: on a GPU the read would wait for it, so there it is applied unread)."""
    if factor is None:
        factor = torch.ones((), dtype=torch.float32, device=values[0].device)
    if poison is not None:
        factor = factor + poison
    if factor.is_cuda or factor.item() != 1.0:
        for tensor in values:
            tensor.mul_(factor)


TORCH = Backend("torch", _row_step.COSINE_TORCH_ROW_STEP, _row_step_jsd.JSD_TORCH_ROW_STEP, _labels.count_labels_torch,
                _labels.mean_losses_torch, scale_unless_one_torch, _teacher_fp8.quantize_rows, _fingerprint.fingerprint_torch,
                _fingerprint.stale_check_torch, _student_metrics.student_metrics_torch)


@functools.lru_cache(maxsize=None)
def _triton() -> Backend:
    from .kernels import fingerprint, fp8_quantize, grad_output, labels, row_step_jsd_triton, row_step_triton, student_metrics

    return Backend("triton", row_step_triton.COSINE_TRITON_ROW_STEP, row_step_jsd_triton.JSD_TRITON_ROW_STEP,
                   labels.count_labels_triton, labels.mean_losses_triton,
                   grad_output.scale_unless_one_triton, fp8_quantize.quantize_rows_triton,
                   fingerprint.fingerprint_triton, fingerprint.stale_check_triton,
                   student_metrics.student_metrics_triton)


def backend_for(impl: str, device: torch.device) -> Backend:
    """The backend ``impl`` names on this device ("auto": cuda on Hopper or newer, triton on other GPUs, torch
    on the CPU); ``impl`` is one of IMPLS (Options checked it)."""
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return TORCH
    from .kernels import row_step_cuda

    clusters = row_step_cuda.available(device)
    if impl == "cuda" and not clusters:
        raise ValueError(f"impl='cuda' needs a CUDA GPU with thread block clusters (compute capability 9.0 or "
                         f"newer) and torch.cuda._compile_kernel (NVRTC); tensors are on {device}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU); tensors are on {device}")
    return _cuda() if impl in ("cuda", "auto") and clusters else _triton()


@functools.lru_cache(maxsize=None)
def _cuda() -> Backend:
    from .kernels import row_step_cuda, row_step_jsd_cuda

    return dataclasses.replace(_triton(), name="cuda", cosine_row_step=row_step_cuda.COSINE_CUDA_ROW_STEP,
                               jsd_row_step=row_step_jsd_cuda.JSD_CUDA_ROW_STEP)
