"""grad_output's in-place scale, skipped when it is 1 (kernels/grad_output.py), against plain torch, through
Triton's interpreter."""

import pytest
import torch

from cosdistill.testing import kernels, scale_unless_one_triton

BLOCK = kernels.grad_output.BLOCK
SIZES = (1, 37, 3 * BLOCK + 17)  # the last needs the grid-stride loop: the interpreter runs two programs


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_matches_torch(numel, dtype):
    values = torch.randn(numel).to(dtype)
    factor = torch.tensor(-2.7)
    expected = (values.float() * factor).to(dtype)
    scale_unless_one_triton(values, factor)
    if dtype == torch.bfloat16:  # the interpreter truncates to bf16 (the GPU rounds to nearest): one ulp
        assert ((values.float() - expected.float()).abs() <= expected.float().abs() * 2**-7).all()
    else:
        assert torch.equal(values, expected)


@pytest.mark.parametrize("numel", SIZES)
def test_factor_one_writes_nothing(numel):
    """Signalling NaNs: x * 1 rewrites their bits (quietened), so any store would show."""
    payloads = torch.randint(1, 2**22, (numel,), dtype=torch.int32)
    values = (payloads | 0x7F800000).view(torch.float32)  # exponent all ones, quiet bit clear
    before = values.clone()
    assert not torch.equal((values * 1.0).view(torch.int32), before.view(torch.int32))  # a store would show
    scale_unless_one_triton(values, torch.tensor(1.0))
    assert torch.equal(values.view(torch.int32), before.view(torch.int32))


def test_nan_factor_reaches_every_value():
    values = torch.randn(2 * BLOCK + 3)
    scale_unless_one_triton(values, torch.tensor(float("nan")))
    assert values.isnan().all()


def test_scale_needs_contiguous_values():
    with pytest.raises(ValueError, match="contiguous"):
        scale_unless_one_triton(torch.randn(8, 6)[:, ::2], torch.tensor(2.0))
