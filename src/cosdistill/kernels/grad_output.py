"""grad_output applied on the device, so that backward need not wait for the GPU to read it.

Backward gets grad_output as a 0-d tensor on the GPU. Reading it on the host (to skip the scaling
when it is 1) waits for the whole forward to finish, and the GPU then idles while the host launches
what follows (docs/design.md, Host latency). Here one small kernel reads it: when it
is 1 (a plain ``loss.backward()``), every program returns at once; otherwise they scale in place. It also adds the
call's poison (0, or NaN where the loss is not finite) to the factor, so that poisoning the gradients costs no launch.
All of a call's gradients go through one launch, since each launch's host time is what backward costs
where the GPU has finished forward.
"""

import functools

import torch
import triton
import triton.language as tl

from . import TRITON_OPTIONS

BLOCK = 4096
PROGRAMS_PER_SM = 4  # a grid-stride loop: a fixed, small grid however large the tensor
MAX_TENSORS = 3  # grad_input, grad_weight, grad_bias


@triton.jit
def _scale(values_ptr, numel, factor, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        cols = start + offsets
        in_range = cols < numel
        values = tl.load(values_ptr + cols, mask=in_range)
        tl.store(values_ptr + cols, (values.to(tl.float32) * factor).to(values.dtype), mask=in_range)


@triton.jit
def _scale_unless_one_kernel(first_ptr, first_numel, second_ptr, second_numel, third_ptr, third_numel, factor_ptr,
                             poison_ptr, BLOCK: tl.constexpr):
    if factor_ptr is None:
        factor = 1.0
    else:
        factor = tl.load(factor_ptr).to(tl.float32)
    if poison_ptr is not None:
        factor += tl.load(poison_ptr)
    if factor != 1.0:  # NaN too: it must reach the gradients
        _scale(first_ptr, first_numel, factor, BLOCK)
        _scale(second_ptr, second_numel, factor, BLOCK)
        _scale(third_ptr, third_numel, factor, BLOCK)


@functools.cache  # backward's host time is the cost here, and a device's SM count never changes
def _programs(device_index: int) -> int:
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def scale_unless_one_triton(values: tuple[torch.Tensor, ...], factor: torch.Tensor | None,
                            poison: torch.Tensor | None = None) -> None:
    """Each of ``values`` *= factor + poison in place (0-d tensors; None: 1 and 0), in fp32 and rounded once to its
    dtype; nothing written when that is 1."""
    if not 1 <= len(values) <= MAX_TENSORS:
        raise ValueError(f"values must hold 1 to {MAX_TENSORS} tensors, got {len(values)}")
    for tensor in values:
        if not tensor.is_contiguous():
            raise ValueError(f"values must be contiguous, got strides {tensor.stride()} for shape {tuple(tensor.shape)}")
    largest = max(tensor.numel() for tensor in values)
    if largest == 0:
        return
    programs = _programs(values[0].device.index) if values[0].is_cuda else 2  # 2: Triton's interpreter (tests)
    slots = [(tensor, tensor.numel()) for tensor in values] + [(values[0], 0)] * (MAX_TENSORS - len(values))
    grid = (max(1, min(programs, triton.cdiv(largest, BLOCK))),)
    _scale_unless_one_kernel[grid](*(arg for slot in slots for arg in slot), factor, poison, BLOCK=BLOCK,
                                   **TRITON_OPTIONS)
