"""The label count and the losses' sums divided by N (kernels/labels.py) against their torch spec
(_labels.py), through Triton's interpreter."""

import pytest
import torch

from cosdistill.testing import count_labels_torch, count_labels_triton, mean_losses_torch, mean_losses_triton


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


@pytest.mark.parametrize("given", [None, 29])
def test_mean_losses_add_the_poison(given):
    """A zero poison changes nothing; a NaN one makes all three NaN, as the torch twin's."""
    token_losses = torch.rand(37, 2) * 10 + 0.1
    counts = torch.tensor([31, 0], dtype=torch.int32)
    clean = mean_losses_torch(token_losses, counts, given, 0.3, 0.7)
    for mean_losses in (mean_losses_triton, mean_losses_torch):
        for got, want in zip(mean_losses(token_losses, counts, given, 0.3, 0.7, torch.tensor(0.0)), clean):
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
        assert all(torch.isnan(value) for value in mean_losses(token_losses, counts, given, 0.3, 0.7,
                                                               torch.tensor(float("nan"))))
