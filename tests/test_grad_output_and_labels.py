"""The small device kernels around the chunk loop: grad_output's in-place scale, skipped when it is 1
(grad_output.py), the label count and the losses' sums divided by N (labels.py), each against plain
torch, through Triton's interpreter."""

import pytest
import torch

from cosdistill._backends import TORCH, scale_unless_one_torch
from cosdistill._labels import LabelCounts, count_labels_torch, mean_losses_torch
from cosdistill.kernels.grad_output import BLOCK, scale_unless_one_triton
from cosdistill.kernels.labels import count_labels_triton, mean_losses_triton

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


def test_torch_scale():
    values = torch.randn(50)
    kept = values.clone()
    scale_unless_one_torch(values, torch.tensor(1.0))
    assert torch.equal(values, kept)
    scale_unless_one_torch(values, torch.tensor(0.5))
    assert torch.equal(values, kept * 0.5)


@pytest.mark.parametrize("num_tokens", [1, 37, 3 * 1024 + 5])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_label_count_matches_torch(num_tokens, dtype, ignore_index):
    vocab = 50
    labels = torch.randint(-3, vocab + 3, (num_tokens,), dtype=dtype)  # some below 0 and some past the vocab
    labels[torch.rand(num_tokens) < 0.3] = ignore_index
    labels[0] = vocab  # at least one out of range, past the last block's start too
    labels[-1] = -1 if num_tokens > 1 else vocab
    got = count_labels_triton(labels, ignore_index, vocab)
    want = count_labels_torch(labels, ignore_index, vocab)
    assert got.tolist() == want.tolist()


def test_label_counts_normaliser_and_error():
    labels = torch.tensor([3, -100, 4, 4])
    counts = LabelCounts(labels, -100, 10, None, TORCH, 0.5, 0.5)
    counts.launch()
    assert counts.wait() == 3.0
    bad = LabelCounts(torch.tensor([3, 12, -100, -1]), -100, 10, None, TORCH, 0.5, 0.5)
    bad.launch()
    with pytest.raises(ValueError, match=r"2 labels outside \[0, 10\).*\[12, -1\]"):
        bad.wait()


@pytest.mark.parametrize("num_tokens", [0, 1, 37, 3 * 1024 + 5])
@pytest.mark.parametrize("given", [None, 29, 0.5, torch.tensor(29), torch.tensor([29.0])],
                         ids=["counted", "int", "float", "int tensor", "1-element tensor"])
def test_mean_losses_match_torch(num_tokens, given):
    token_losses = torch.rand(num_tokens, 2) * 10 + 0.1
    for counted in (0, 3):  # the count is at least 1
        counts = torch.tensor([counted, 0], dtype=torch.int32)
        got = mean_losses_triton(token_losses, counts, given, 0.3, 0.7)
        want = mean_losses_torch(token_losses, counts, given, 0.3, 0.7)
        for got_value, want_value in zip(got, want):
            assert got_value.shape == () and got_value.dtype == torch.float32
            torch.testing.assert_close(got_value, want_value, rtol=2e-6, atol=1e-7)
    assert len({value.data_ptr() for value in got}) == 3  # three tensors, none a view of another


def test_mean_losses_divide_before_summing():
    """Per-token losses near fp32's max sum to a finite mean, as the torch twin's."""
    token_losses = torch.full((4, 2), 3e38)
    counts = torch.tensor([4, 0], dtype=torch.int32)
    loss, soft, hard = mean_losses_triton(token_losses, counts, None, 0.5, 0.5)
    assert torch.isfinite(loss) and torch.isfinite(soft) and torch.isfinite(hard)
    torch.testing.assert_close(hard, torch.tensor(3e38), rtol=1e-6, atol=0)
