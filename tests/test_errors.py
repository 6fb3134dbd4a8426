"""Every bad-input rule: a ValueError or TypeError naming the argument and the shapes seen."""

import pytest
import torch

from conftest import make_problem
from cosdistill import fused_linear_cosine_distill


def call(problem, **kwargs):
    return fused_linear_cosine_distill(*problem.args(), **kwargs)


def test_mismatched_token_counts():
    problem = make_problem(tokens=10)
    problem.teacher_input = torch.randn(9, 24)
    with pytest.raises(ValueError, match=r"token counts.*\(10, 16\).*\(9, 24\)"):
        call(problem)


def test_labels_of_other_shape():
    problem = make_problem(tokens=10)
    problem.labels = torch.zeros(11, dtype=torch.long)
    with pytest.raises(ValueError, match=r"true_labels shape \(11,\)"):
        call(problem)


@pytest.mark.parametrize("prefix", ["student", "teacher"])
def test_hidden_size_mismatch(prefix):
    problem = make_problem()
    setattr(problem, f"{prefix}_weight", torch.randn(101, 7))
    with pytest.raises(ValueError, match=rf"{prefix}_input hidden size \d+ .*{prefix}_weight shape \(101, 7\)"):
        call(problem)


@pytest.mark.parametrize("prefix", ["student", "teacher"])
def test_bias_length(prefix):
    problem = make_problem()
    setattr(problem, f"{prefix}_bias", torch.randn(100))
    with pytest.raises(ValueError, match=rf"{prefix}_bias must have shape \(101,\).*got \(100,\)"):
        call(problem)


def test_teacher_vocab_smaller_than_student():
    problem = make_problem(vocab_student=101, bias=False)
    problem.teacher_weight = torch.randn(100, 24)
    with pytest.raises(ValueError, match=r"teacher vocab must be >= student vocab.*\(100, 24\).*\(101, 16\)"):
        call(problem)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_labels(dtype):
    problem = make_problem()
    problem.labels = problem.labels.to(dtype)
    with pytest.raises(TypeError, match="true_labels must be an integer tensor"):
        call(problem)


@pytest.mark.parametrize("name", ["student_weight", "teacher_weight"])
def test_weights_not_2d(name):
    problem = make_problem()
    setattr(problem, name, getattr(problem, name).detach()[None])
    with pytest.raises(ValueError, match=rf"{name} must be 2-D.*\(1, 101, \d+\)"):
        call(problem)


def test_tensors_on_different_devices():
    problem = make_problem()
    problem.teacher_weight = problem.teacher_weight.to("meta")
    with pytest.raises(ValueError, match="one device.*meta"):
        call(problem)


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        call(make_problem(), chunk_size=chunk_size)


@pytest.mark.parametrize("bad_label", [-1, 101, 10**6])
def test_label_out_of_range(bad_label):
    problem = make_problem()
    problem.labels[3] = bad_label
    with pytest.raises(ValueError, match=rf"outside \[0, 101\).*{bad_label}"):
        call(problem)


def test_input_dtype_differs_from_weight():
    problem = make_problem()
    problem.student_input = problem.student_input.detach().double()
    with pytest.raises(TypeError, match="student_input must be bfloat16, float16 or float32"):
        call(problem)
    problem = make_problem()
    problem.teacher_input = problem.teacher_input.half()
    with pytest.raises(TypeError, match="teacher_input dtype torch.float16 differs from teacher_weight"):
        call(problem)


def test_bad_scalars_and_options():
    problem = make_problem()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        call(problem, temperature=0.0)
    with pytest.raises(ValueError, match="student_softcap must be > 0 or None"):
        call(problem, student_softcap=0.0)
    with pytest.raises(ValueError, match="num_valid_tokens must be > 0"):
        call(problem, num_valid_tokens=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        call(problem, impl="fast")
    with pytest.raises(ValueError, match="impl='cuda' needs a CUDA GPU with thread block clusters"):
        call(problem, impl="cuda")
    with pytest.raises(TypeError, match="accum_dtype"):
        call(problem, accum_dtype=torch.float16)
    with pytest.raises(TypeError, match="student_input must be a torch.Tensor"):
        fused_linear_cosine_distill([1.0], *problem.args()[1:])


def test_backward_twice_is_refused():
    problem = make_problem()
    loss = call(problem)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward only once"):
        loss.backward()
