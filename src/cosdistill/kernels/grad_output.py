"""grad_output applied on the device, so that backward need not wait for the GPU to read it.

Backward gets grad_output as a 0-d tensor on the GPU. Reading it on the host (to skip the scaling
when it is 1) waits for the whole forward to finish, and the GPU then idles while the host launches
what follows (~0.07 ms a call). Here one small kernel reads it: when it
is 1 (a plain ``loss.backward()``), every program returns at once; otherwise they scale in place.
"""

import torch
import triton
import triton.language as tl

from . import TRITON_OPTIONS

BLOCK = 4096
PROGRAMS_PER_SM = 4  # a grid-stride loop: a fixed, small grid however large the tensor


@triton.jit
def _scale_unless_one_kernel(values_ptr, numel, factor_ptr, BLOCK: tl.constexpr):
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:  # NaN too: it must reach the gradients
        offsets = tl.arange(0, BLOCK)
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, tl.num_programs(0) * BLOCK):
            cols = start + offsets
            in_range = cols < numel
            values = tl.load(values_ptr + cols, mask=in_range)
            tl.store(values_ptr + cols, (values.to(tl.float32) * factor).to(values.dtype), mask=in_range)


def scale_unless_one_triton(values: torch.Tensor, factor: torch.Tensor) -> None:
    """values *= factor in place, in fp32 and rounded once to values' dtype; nothing written when factor == 1."""
    if not values.is_contiguous():
        raise ValueError(f"values must be contiguous, got strides {values.stride()} for shape {tuple(values.shape)}")
    if values.numel() == 0:
        return
    if values.is_cuda:
        programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(values.device).multi_processor_count
    else:  # Triton's interpreter (tests)
        programs = 2
    grid = (max(1, min(programs, triton.cdiv(values.numel(), BLOCK))),)
    _scale_unless_one_kernel[grid](values, values.numel(), factor, BLOCK=BLOCK, **TRITON_OPTIONS)
