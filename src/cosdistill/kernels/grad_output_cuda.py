"""grad_output.py's scale as a CUDA kernel (``grad_output.cu``) compiled by NVRTC and launched through the driver
(cuda_launch.py), for the cuda backend: the scale runs in backward, where at small vocabularies the GPU has
finished forward and waits for the host, and its Triton launch costs several times this one's host time
(docs/design.md, Host latency). Bit for bit the Triton kernel's numbers."""

import ctypes
import functools
import importlib.resources

import torch

from . import cuda_launch
from .grad_output import MAX_TENSORS, PROGRAMS_PER_SM, check_values, scale_unless_one_triton

THREADS = 256
VECTOR_BYTES = 16
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # grad_output.cu's KIND_*
_SOURCE = (importlib.resources.files(__package__) / "grad_output.cu").read_text()


def source(dtypes: tuple[torch.dtype, ...]) -> str:
    """The kernel's CUDA C for one launch's element types, one per slot."""
    slots = ("FIRST", "SECOND", "THIRD")
    return "".join(f"#define {slot}_KIND {_KINDS[dtype]}\n" for slot, dtype in zip(slots, dtypes)) + _SOURCE


@functools.lru_cache(maxsize=None)
def _kernel(dtypes: tuple[torch.dtype, ...], device_index: int):
    return cuda_launch.compile_kernel(source(dtypes), "scale_unless_one", device_index)  # first in backward, mostly


@functools.lru_cache(maxsize=None)
def _programs(device_index: int) -> int:
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def _slot_args(tensor: torch.Tensor) -> list:
    """A tensor's three arguments: pointer, elements, whole 16-byte vectors (none where it is not aligned)."""
    aligned = tensor.data_ptr() % VECTOR_BYTES == 0
    vectors = tensor.numel() * tensor.element_size() // VECTOR_BYTES if aligned else 0
    return [tensor, ctypes.c_longlong(tensor.numel()), ctypes.c_longlong(vectors)]


def scale_unless_one_cuda(values: tuple[torch.Tensor, ...], factor: torch.Tensor) -> None:
    """scale_unless_one_triton's contract, for CUDA tensors; factors other than fp32 and dtypes other than fp32,
    bf16 and fp16 go to the Triton kernel."""
    check_values(values)
    device = values[0].device
    if (factor.dtype != torch.float32 or any(tensor.dtype not in _KINDS or tensor.device != device for tensor in values)
            or factor.device != device):
        scale_unless_one_triton(values, factor)
        return
    largest = max(tensor.numel() for tensor in values)
    if largest == 0:
        return
    unused = MAX_TENSORS - len(values)  # slots with no elements
    dtypes = tuple(tensor.dtype for tensor in values) + (values[0].dtype,) * unused
    args = [arg for tensor in values for arg in _slot_args(tensor)]
    args += [values[0], ctypes.c_longlong(0), ctypes.c_longlong(0)] * unused + [factor]
    blocks = max(1, min(_programs(device.index), -(-largest // THREADS)))
    cuda_launch.launch(_kernel(dtypes, device.index).func, blocks, THREADS, 0, device, args)
