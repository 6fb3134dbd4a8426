"""The hash of a cached teacher weight in Triton (kernels/fingerprint.py) against its torch spec
(_fingerprint.py), bit for bit, and the spec sees any one changed element."""

import pytest
import torch

from cosdistill.testing import fingerprint_torch, fingerprint_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (37, 19), (300, 48), (17, 1030)])
def test_the_triton_fingerprint_is_the_torch_spec_and_sees_any_one_changed_element(dtype, shape):
    weight = torch.randn(shape).to(dtype)
    want = fingerprint_torch(weight)
    assert torch.equal(fingerprint_triton(weight), want)
    assert torch.equal(fingerprint_triton(weight.t().contiguous().t()), fingerprint_torch(weight.t().contiguous().t()))
    for index in {0, weight.numel() // 2, weight.numel() - 1}:
        changed = weight.clone()
        bits = changed.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)
        bits[index] ^= 1  # one bit of one element
        assert not torch.equal(fingerprint_torch(changed), want)
        assert torch.equal(fingerprint_triton(changed), fingerprint_torch(changed))
    swapped = weight.clone()
    swapped[[0, -1]] = swapped[[-1, 0]]
    assert shape[0] == 1 or torch.equal(swapped, weight) or not torch.equal(fingerprint_torch(swapped), want)
