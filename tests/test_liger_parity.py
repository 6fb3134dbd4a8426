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


@pytest.mark.parametrize("names", [("LigerFusedLinearCosineSimilarityLoss", "FusedLinearCosineDistillLoss"),
                                   ("LigerFusedLinearJSDLoss", "FusedLinearJSDLoss")], ids=["cosine", "jsd"])
def test_the_modules_keep_liger_s_constructor_arguments_as_attributes(names):
    """Code written for Liger's module that reads or sets an argument after construction runs unchanged."""
    import inspect

    import cosdistill

    liger_class, our_class = getattr(chunked_loss, names[0]), getattr(cosdistill, names[1])
    arguments = dict(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=0.6, ignore_index=-1, temperature=1.3,
                     compiled=False, chunk_size=8, return_soft_hard_loss=True)
    liger_names = list(inspect.signature(liger_class.__init__).parameters)[1:]
    assert set(liger_names) == set(arguments)
    assert list(inspect.signature(our_class.__init__).parameters)[1:len(liger_names) + 1] == liger_names
    liger, ours = liger_class(**arguments), our_class(**arguments)
    assert {name: getattr(ours, name) for name in arguments} == {name: getattr(liger, name) for name in arguments}
