"""Row-wise FP8 quantization in Triton (kernels/fp8_quantize.py) against its torch spec
(_teacher_fp8.quantize_rows), bit for bit, through Triton's interpreter."""

import pytest
import torch

from cosdistill.testing import quantize_rows_triton
from cosdistill.testing import teacher_fp8 as fp8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [40, 1500])  # one column block, and a masked second one
def test_triton_quantization_is_quantize_rows_bit_for_bit(dtype, hidden):
    rows = (torch.randn(21, hidden) * torch.logspace(-3, 3, 21)[:, None]).to(dtype)
    rows[5] = 0.0
    # in row 7, under the scale 1: signed zeros, the top code, ties to even (168, 2^-8 * 2.5), values that
    # round up into the next binade (1.99, 125.4), subnormals
    special = [-0.0, 0.0, 448.0, -448.0, 168.0, -168.0, 1.99, 125.4, 2**-7, -(2**-7), 1.5 * 2**-9, 2.5 * 2**-9,
               -(2**-10), 1.01 * 2**-10, 3 * 2**-11, 0.01]
    rows[7] = 0.0
    rows[7, : len(special)] = torch.tensor(special).to(dtype)
    codes = {}
    for name, quantize in (("torch", fp8.quantize_rows), ("triton", quantize_rows_triton)):
        buffer = torch.full((32, hidden + 16), float("nan")).to(fp8.FP8)
        scales = torch.full((21, 1), float("nan"))
        quantize(rows, buffer[:21, :hidden], scales)
        codes[name] = buffer.view(torch.uint8), scales
    assert torch.equal(codes["triton"][1], codes["torch"][1])
    assert torch.equal(codes["triton"][0], codes["torch"][0])  # the poisoned margins included


def test_triton_quantization_of_non_finite_rows():
    """A NaN makes its row's scale and codes NaN, an infinity makes the scale infinite, as in torch's version."""
    rows = torch.randn(3, 1100)
    rows[1, 1050], rows[2, 3] = float("nan"), float("inf")
    codes = torch.empty(3, 1100, dtype=fp8.FP8)
    scales = torch.full((3, 1), -1.0)
    quantize_rows_triton(rows, codes, scales)
    assert scales[0].isfinite().all() and scales[1].isnan().all() and scales[2].isinf().all()
    assert not codes[0].float().isnan().any() and codes[1].float().isnan().all() and codes[2, 3].float().isnan()
