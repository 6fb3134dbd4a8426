"""The labels (_labels.py): the count of valid labels that is N, its error on labels out of range, and labels
of narrow integer dtypes."""

import pytest
import torch

from conftest import make_problem
from cosdistill import fused_linear_cosine_distill
from cosdistill.testing import TORCH, LabelCounts


@pytest.mark.parametrize("dtype", [torch.uint8])
def test_labels_that_cannot_hold_ignore_index_raise(dtype):
    problem = make_problem(tokens=12)
    labels = problem.labels.clamp(max=200).to(dtype)
    with pytest.raises(TypeError, match=r"true_labels of dtype torch.uint8 cannot hold ignore_index=-100"):
        fused_linear_cosine_distill(*problem.args()[:4], labels)


@pytest.mark.parametrize("dtype, vocab", [(torch.int8, 128), (torch.uint8, 257), (torch.int16, 32768),
                                          (torch.int16, 32769)])
def test_labels_whose_dtype_cannot_hold_the_vocabulary_raise(dtype, vocab):
    """Labels cast to a dtype narrower than the vocabulary have wrapped around: 70000 read as 4464 in int16, a
    silently wrong target, and 65436 as -100, silently ignored. At V = the dtype's largest + 1 (Mistral's 32768 in
    int16) the labels' comparison with V wrapped on the torch path: every label read as out of range."""
    problem = make_problem(tokens=12, hidden_student=8, hidden_teacher=8, vocab_student=vocab)
    labels = problem.labels.clamp(max=torch.iinfo(dtype).max - 1).to(dtype)
    ignore_index = 255 if dtype == torch.uint8 else -100
    with pytest.raises(TypeError, match=f"true_labels of dtype {dtype} cannot hold the student's vocabulary size "
                                        f"{vocab}"):
        fused_linear_cosine_distill(*problem.args()[:4], labels, ignore_index=ignore_index, impl="torch")
    fused_linear_cosine_distill(*problem.args()[:4], labels.long(), ignore_index=ignore_index, impl="torch")


@pytest.mark.parametrize("dtype, ignore_index", [(torch.uint8, 255), (torch.int8, -100), (torch.int16, -100),
                                                 (torch.int32, -100)])
def test_narrow_labels_that_hold_ignore_index_give_the_int64_answer(dtype, ignore_index):
    problem = make_problem(tokens=30, vocab_student=97)
    labels = problem.labels.clone()
    labels[::3] = ignore_index
    labels[1] = 96
    args = problem.args()[:4]
    want = fused_linear_cosine_distill(*args, labels, ignore_index=ignore_index, return_soft_hard_loss=True)
    got = fused_linear_cosine_distill(*args, labels.to(dtype), ignore_index=ignore_index, return_soft_hard_loss=True)
    for got_part, want_part in zip(got, want):
        torch.testing.assert_close(got_part, want_part, rtol=1e-4, atol=1e-7)


def test_label_counts_normaliser_and_error():
    labels = torch.tensor([3, -100, 4, 4])
    counts = LabelCounts(labels, -100, 10, None, TORCH, 0.5, 0.5)
    counts.launch()
    assert counts.wait() == 3.0
    bad = LabelCounts(torch.tensor([3, 12, -100, -1]), -100, 10, None, TORCH, 0.5, 0.5)
    bad.launch()
    with pytest.raises(ValueError, match=r"2 labels outside \[0, 10\).*\[12, -1\]"):
        bad.wait()
