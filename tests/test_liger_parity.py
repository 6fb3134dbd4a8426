"""Where no token is ignored, our numbers equal Liger-Kernel 0.8.5's (installed by the test extra)."""

import pytest

from conftest import make_problem, rel_err
from cosdistill import fused_linear_cosine_distill

chunked_loss = pytest.importorskip("liger_kernel.chunked_loss")


@pytest.mark.parametrize("ignore_every", [0, 4])
@pytest.mark.parametrize("vocab_teacher", [101, 120])
def test_equals_liger(impl, ignore_every, vocab_teacher):
    problem = make_problem(tokens=40, vocab_teacher=vocab_teacher, ignore_every=ignore_every)
    options = (0.3, 0.7, 0.6, -100, 1.3)  # weight_hard_loss, weight_soft_loss, beta, ignore_index, temperature
    liger = chunked_loss.LigerFusedLinearCosineSimilarityLoss(*options, compiled=False, chunk_size=8,
                                                              return_soft_hard_loss=True)
    theirs = liger(*problem.args())
    theirs[0].backward()
    their_grads = [leaf.grad.clone() for leaf in problem.student_leaves()]
    for leaf in problem.student_leaves():
        leaf.grad = None
    ours = fused_linear_cosine_distill(*problem.args(), *options, True, 8, True, impl=impl)
    ours[0].backward()
    for a, b in zip(ours, theirs):
        assert rel_err(a, b) < 1e-5
    for leaf, theirs_grad in zip(problem.student_leaves(), their_grads):
        assert rel_err(leaf.grad, theirs_grad) < 1e-5
