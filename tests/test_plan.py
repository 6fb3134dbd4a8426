"""The plan of a call (_plan.py): the chunk sizes it picks and the order in which it sets the call up."""

import dataclasses

import pytest
import torch

from conftest import make_problem, record_write_grad, reference, rel_err
from cosdistill import api, fused_linear_cosine_distill
from cosdistill.testing import TORCH, ChunkRows, chunk_rows, plan


@pytest.mark.parametrize("grad_enabled, student_requires_grad, want_write_grad",
                         [(True, True, True), (False, True, False), (True, False, False)])
def test_chunk_rows_are_told_whether_gradients_are_wanted(grad_enabled, student_requires_grad, want_write_grad,
                                                          monkeypatch):
    """Without gradients the teacher's sub-chunks may be longer (chunk_rows' write_grad)."""
    seen = record_write_grad(monkeypatch, plan)
    problem = make_problem(tokens=9)
    for leaf in problem.student_leaves():
        leaf.requires_grad_(student_requires_grad)
    with torch.set_grad_enabled(grad_enabled):
        fused_linear_cosine_distill(*problem.args())
    assert seen == [want_write_grad]


def test_automatic_chunk_rows():
    """The automatic student chunk and teacher sub-chunk at LLM vocabularies, with and without gradients."""
    seed = dict(vocab_student=128256, vocab_teacher=128256, itemsize=2)
    assert chunk_rows(None, 8192, **seed) == ChunkRows(2048, 1024)  # 0.79 GB of logits buffers
    assert chunk_rows(None, 3000, **seed) == ChunkRows(2048, 1024)
    assert chunk_rows(None, 1024, **seed) == ChunkRows(1024, 1024)
    assert chunk_rows(None, 100, **seed) == ChunkRows(100, 100)
    assert chunk_rows(None, 8192, 32000, 32000, 2) == ChunkRows(4160, 4160)  # 512 MiB of buffers for both
    assert chunk_rows(None, 4096, 32000, 32000, 2) == ChunkRows(4096, 4096)
    assert chunk_rows(None, 8192, 50257, 50257, 2) == ChunkRows(2624, 2624)
    assert chunk_rows(None, 8192, 262144, 262144, 2) == ChunkRows(2048, 512)  # the teacher's rows shrink first
    assert chunk_rows(None, 8192, 151936, 151936, 2) == ChunkRows(2048, 1024)
    assert chunk_rows(None, 8192, 300000, 300000, 2) == ChunkRows(1152, 1024)  # 2048 / 512 would pass 1.25 GiB
    assert chunk_rows(None, 8192, 600000, 600000, 4) == ChunkRows(256, 256)  # past the 1.25 GiB budget: fewer
    assert chunk_rows(None, 0, **seed) == ChunkRows(1, 1)
    # without gradients the teacher's sub-chunks grow to the student's chunk where both fit 1.25 GiB
    assert chunk_rows(None, 8192, **seed, write_grad=False) == ChunkRows(2048, 2048)
    assert chunk_rows(None, 1024, **seed, write_grad=False) == ChunkRows(1024, 1024)
    assert chunk_rows(None, 8192, 262144, 262144, 2, write_grad=False) == ChunkRows(2048, 512)  # 2 GiB would not
    assert chunk_rows(512, 8192, **seed, write_grad=False) == ChunkRows(512, 512)
    assert chunk_rows(512, 8192, **seed) == ChunkRows(512, 512)  # a given chunk_size holds for both
    assert chunk_rows(512, 100, **seed) == ChunkRows(100, 100)


def test_where_the_row_steps_run_beside_the_teacher_gemms():
    """For the JSD on CUDA: teacher logits in more than one sub-chunk, the second teacher buffer within the hard
    budget, no vocabulary split."""
    fast = dataclasses.replace(TORCH, name="triton")  # a stand-in: only its identity counts

    def beside(tokens, vocab, loss="jsd", backend=fast, device="cuda", teacher="logits", vocab_parallel=None,
               write_grad=True):
        rows = chunk_rows(None, tokens, vocab, vocab, 2, write_grad=write_grad)
        return plan.row_step_beside_gemms(loss, backend, torch.device(device), teacher, rows, tokens, vocab, vocab, 2,
                                          vocab_parallel)

    assert beside(8192, 128256) and beside(2048, 128256) and beside(8192, 151936) and beside(8192, 32000)
    assert beside(8192, 128256, teacher="fp8")
    assert not beside(8192, 128256, loss="cosine")
    assert not beside(8192, 128256, backend=TORCH)  # the spec's temporaries would get a second stream's cache
    assert not beside(1024, 128256)  # one sub-chunk
    assert not beside(4096, 32000)  # one chunk of one sub-chunk
    assert not beside(8192, 262144)  # 2048 / 512 rows: a second 512-row buffer passes 1.25 GiB
    assert not beside(8192, 128256, write_grad=False)  # 2048-row sub-chunks: likewise
    assert not beside(8192, 128256, device="cpu")
    assert not beside(8192, 128256, teacher="gram")
    assert not beside(8192, 128256, vocab_parallel=object())


def test_the_first_gemm_is_queued_before_the_rest_of_the_set_up(monkeypatch):
    """The bench times a call from an idle GPU: the first student GEMM goes out as soon as the plan is made,
    before the teacher side, the label count and the autograd Function."""
    order = []
    for name in ("start_student_logits", "TeacherHead", "LabelCounts"):
        original = getattr(plan, name)
        monkeypatch.setattr(plan, name, lambda *a, _f=original, _n=name, **k: order.append(_n) or _f(*a, **k))
    original_apply = api._AttachGradients.apply
    monkeypatch.setattr(api._AttachGradients, "apply", lambda *a: order.append("apply") or original_apply(*a))
    problem = make_problem()
    fused_linear_cosine_distill(*problem.args()).backward()
    assert order == ["start_student_logits", "TeacherHead", "LabelCounts", "apply"]
    assert rel_err(problem.student_weight.grad, reference(problem)[1][1]) < 1e-5


def test_the_function_api_checks_each_set_of_options_once():
    """options_of hands back one checked Options per distinct set of values (the function is called with the same
    keywords at every step); an unhashable value still gets Options' own error, naming the argument."""
    first = plan.options_of(weight_hard_loss=0.3, beta=0.7)
    assert plan.options_of(weight_hard_loss=0.3, beta=0.7) is first
    assert plan.options_of(weight_hard_loss=0.3, beta=0.8) is not first
    assert first.scales is first.scales and first.scales.beta == 0.7
    with pytest.raises(ValueError, match="chunk_size must be a positive int or None, got \\[4\\]"):
        plan.options_of(chunk_size=[4])
