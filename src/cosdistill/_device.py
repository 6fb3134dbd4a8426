"""Small helpers for work queued on a device, shared by the chunk loop and the teacher sides."""

import contextlib

import torch


class HostCopy:
    """A device tensor's copy to the host, queued now behind the work already queued, and read later
    (``get`` waits for that copy alone), so that the stream never waits for the host in between."""

    def __init__(self, tensor: torch.Tensor):
        self.host = tensor.to("cpu", non_blocking=True)
        self.copied = torch.cuda.Event() if tensor.is_cuda else None
        if self.copied is not None:
            self.copied.record()

    def get(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host


def leading_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """tensor[:rows]; the tensor itself where that is all of it (a view costs microseconds of host time, which an
    idle GPU waits for before the first GEMM)."""
    return tensor if tensor.shape[0] == rows else tensor[:rows]


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as 2-D rows of its last dimension; itself where it is 2-D already."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, tensor.shape[-1])


def logits_into(out, hidden, weight, bias):
    """out = hidden @ weight.T (+ bias), into out."""
    if bias is None:
        torch.mm(hidden, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden, weight.t(), out=out)


def addmm_into(out, left, right, alpha, beta):
    """out = beta * out + alpha * left @ right, in out's dtype (fp32 out of bf16/fp16 operands too)."""
    if out.dtype == left.dtype:
        out.addmm_(left, right, beta=beta, alpha=alpha)
    elif out.is_cuda and out.dtype == torch.float32:
        # cuBLAS reads the bf16/fp16 operands and accumulates into the fp32 buffer directly.
        torch.addmm(out, left, right, out_dtype=out.dtype, beta=beta, alpha=alpha, out=out)
    else:
        out.addmm_(left.to(out.dtype), right.to(out.dtype), beta=beta, alpha=alpha)


def on_device_of(tensor: torch.Tensor):
    """The tensor's CUDA device made current where it is not: Triton's kernels and the CUDA row step launch on
    the current device, which a process that never called torch.cuda.set_device may not have set to its
    tensors'. Nothing where it is current already (the switch costs host time before the first GEMM)."""
    if tensor.is_cuda and tensor.get_device() != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()
