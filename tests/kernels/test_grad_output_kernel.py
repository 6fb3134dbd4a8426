"""grad_output's in-place scale of a call's gradients in one launch, skipped when it is 1 (kernels/grad_output.py),
against plain torch, through Triton's interpreter."""

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
    scale_unless_one_triton((values,), factor)
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
    scale_unless_one_triton((values,), torch.tensor(1.0))
    assert torch.equal(values.view(torch.int32), before.view(torch.int32))


def test_nan_factor_reaches_every_value():
    values = torch.randn(2 * BLOCK + 3)
    others = torch.randn(5).bfloat16(), torch.randn(BLOCK + 1)
    scale_unless_one_triton((values, *others), torch.tensor(float("nan")))
    assert all(tensor.isnan().all() for tensor in (values, *others))


@pytest.mark.parametrize("factor", [None, 1.0, 0.5])
@pytest.mark.parametrize("poison", [0.0, -0.0, float("nan")])
def test_the_poison_goes_onto_the_factor(factor, poison):
    """factor + poison, in the kernel (None: a factor of 1): a poison of 0 writes nothing where the factor is 1 (or
    None), a NaN one reaches every value, whatever the factor."""
    values = torch.randn(2 * BLOCK + 3), torch.randn(5).bfloat16()
    before = tuple(tensor.clone() for tensor in values)
    scale_unless_one_triton(values, None if factor is None else torch.tensor(factor), torch.tensor(poison))
    for got, old in zip(values, before):
        if poison != poison:
            assert got.isnan().all()
        elif factor in (None, 1.0):
            assert torch.equal(got, old)
        else:
            assert torch.equal(got, (old.float() * factor).to(old.dtype))


def test_scale_needs_contiguous_values():
    with pytest.raises(ValueError, match="contiguous"):
        scale_unless_one_triton((torch.randn(3), torch.randn(8, 6)[:, ::2]), torch.tensor(2.0))


def test_scale_takes_one_to_three_tensors():
    for count in (0, 4):
        with pytest.raises(ValueError, match="1 to 3 tensors, got " + str(count)):
            scale_unless_one_triton((torch.randn(3),) * count, torch.tensor(2.0))


@pytest.mark.parametrize("numels", [(3 * BLOCK + 17, 37, 1), (5, 2 * BLOCK + 9), (0, 37), (37, 0, 2 * BLOCK)])
def test_every_tensor_of_one_launch_is_scaled(numels):
    """A call's gradients (grad_input, grad_weight, grad_bias) in one launch, of any sizes and dtypes: the grid is
    the largest's, and each program strides over every tensor."""
    dtypes = (torch.float32, torch.bfloat16, torch.float32)
    values = tuple(torch.randn(numel).to(dtype) for numel, dtype in zip(numels, dtypes))
    expected = tuple((tensor.float() * -2.7).to(tensor.dtype) for tensor in values)
    scale_unless_one_triton(values, torch.tensor(-2.7))
    for got, want in zip(values, expected):
        tolerance = 2**-7 if got.dtype == torch.bfloat16 else 0.0  # the interpreter truncates bf16: one ulp
        assert ((got.float() - want.float()).abs() <= want.float().abs() * tolerance).all()

