"""The backends (_backends.py): which kernels each ``impl`` runs on a device, and the torch backend's own pieces."""

import dataclasses

import pytest
import torch

from conftest import make_problem
from cosdistill import fused_linear_cosine_distill
from cosdistill.testing import (
    COSINE_TRITON_ROW_STEP,
    TORCH,
    backend_for,
    kernels,
    plan,
    quantize_rows_triton,
    scale_unless_one_torch,
)
from cosdistill.testing import teacher_fp8 as fp8

row_step_cuda = kernels.row_step_cuda


def test_torch_scale():
    values = torch.randn(50)
    kept = values.clone()
    scale_unless_one_torch((values,), torch.tensor(1.0))
    assert torch.equal(values, kept)
    other = torch.randn(7)
    other_kept = other.clone()
    scale_unless_one_torch((values, other), torch.tensor(0.5))
    assert torch.equal(values, kept * 0.5) and torch.equal(other, other_kept * 0.5)
    scale_unless_one_torch((values,), None, torch.tensor(0.0))
    assert torch.equal(values, kept * 0.5)
    scale_unless_one_torch((values, other), None, torch.tensor(float("nan")))
    assert values.isnan().all() and other.isnan().all()


def test_not_available_on_the_cpu():
    assert not row_step_cuda.available(torch.device("cpu"))
    with pytest.raises(ValueError, match="thread block clusters"):
        backend_for("cuda", torch.device("cpu"))
    assert backend_for("auto", torch.device("cpu")) is TORCH


def test_the_cluster_step_needs_a_torch_whose_nvrtc_kernels_take_large_shared_memory(monkeypatch):
    """A torch with _compile_kernel but no set_shared_memory_config (before it came) chose the cluster step on a
    Hopper GPU and raised AttributeError at its first compile; such a torch runs the Triton step."""
    hopper = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *args, **kwargs: None, raising=False)
    assert row_step_cuda.available.__wrapped__(hopper)
    monkeypatch.setattr(torch.cuda._utils, "_CudaKernel", type("OlderKernel", (), {}))
    assert not row_step_cuda.available.__wrapped__(hopper)


def test_auto_picks_the_cluster_step_where_available(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(row_step_cuda, "available", lambda device: True)
    assert backend_for("auto", cuda).cosine_row_step is row_step_cuda.COSINE_CUDA_ROW_STEP
    assert backend_for("cuda", cuda).cosine_row_step is row_step_cuda.COSINE_CUDA_ROW_STEP
    assert backend_for("triton", cuda).cosine_row_step is COSINE_TRITON_ROW_STEP
    monkeypatch.setattr(row_step_cuda, "available", lambda device: False)  # before Hopper
    assert backend_for("auto", cuda).cosine_row_step is COSINE_TRITON_ROW_STEP
    with pytest.raises(ValueError, match="thread block clusters"):
        backend_for("cuda", cuda)



def test_a_vocabulary_split_on_a_gpu_runs_kernels_not_the_spec(monkeypatch):
    """Each GPU backend's row steps split over ranks through its own kernels (the JSD's three Triton stages, the
    cosine's statistics and gradient kernels): the float64 spec's stages took ten times the unsplit loss there."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(row_step_cuda, "available", lambda device: True)
    jsd = kernels.row_step_jsd_triton
    for impl in ("triton", "cuda"):
        backend = backend_for(impl, cuda)
        assert backend.jsd_row_step.split is jsd.split_jsd_row_step_triton, impl
        assert backend.cosine_row_step.stats is kernels.row_step_triton.row_stats_triton, impl
        assert backend.cosine_row_step.grad is kernels.row_step_triton.row_grad_triton, impl
    assert TORCH.jsd_row_step.split is not jsd.split_jsd_row_step_triton

def test_each_backend_quantizes_the_chunks_with_its_own_kernel(impl, monkeypatch):
    """impl="torch" quantizes with torch, "triton" with the Triton kernel: each chunk's rows once, through
    the backend the plan picked (the cached weight is quantized by torch's function, once)."""
    monkeypatch.setattr(fp8, "check_supported", lambda *args: None)
    backend = backend_for(impl, torch.device("cpu"))
    assert backend.quantize_rows is (quantize_rows_triton if impl == "triton" else fp8.quantize_rows)
    calls = []
    recording = dataclasses.replace(backend, quantize_rows=lambda *args: calls.append(len(args[0])) or
                                    backend.quantize_rows(*args))
    monkeypatch.setattr(plan, "backend_for", lambda impl, device: recording)
    problem = make_problem(tokens=20)
    fused_linear_cosine_distill(*problem.args(), teacher_precision="fp8", impl=impl, chunk_size=8)
    assert calls == [8, 8, 4]


def test_every_triton_launch_pins_fma_contraction(monkeypatch):
    """Each Triton kernel is launched with kernels.TRITON_OPTIONS (FMA contraction on: Triton 3.10 turns its default
    off, which would change the kernels' code under an upgrade): every kernel of the Triton modules, each called
    once through its wrapper, records the option."""
    from triton.runtime.interpreter import InterpretedFunction

    from conftest import random_chunk, run_jsd_split_stages
    from cosdistill.testing import RowStepConstants
    from cosdistill.tools.check import split_in_two

    launched = {}
    run = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        launched[self.__name__] = kwargs.get("enable_fp_fusion")
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    modules = [kernels.row_step_triton, kernels.row_step_jsd_triton, kernels.labels, kernels.grad_output,
               kernels.fp8_quantize, kernels.fingerprint]
    every_kernel = {name for module in modules for name, value in vars(module).items()
                    if isinstance(value, InterpretedFunction) and name.endswith("_kernel")}
    student, teacher, labels = random_chunk(6, 40, 45, torch.float32)
    constants = RowStepConstants(0.4, 0.6, 0.5, 1.5, -7)
    losses = torch.empty(6, 2)
    kernels.row_step_triton.row_step_triton(student.clone(), teacher, labels, constants, losses, True)
    split_in_two(COSINE_TRITON_ROW_STEP, student.clone(), teacher, labels, constants, losses, True)  # statistics, gradient
    kernels.row_step_jsd_triton.row_step_jsd_triton(student.clone(), teacher, labels, constants, losses, True)
    run_jsd_split_stages(student, teacher, labels, constants, [(0, 20), (20, 45)], True)
    counts = kernels.labels.count_labels_triton(labels, -7, 40)
    kernels.labels.mean_losses_triton(losses, counts, None, 0.4, 0.6)
    kernels.grad_output.scale_unless_one_triton((torch.randn(50),), torch.tensor(0.5))
    quantize_rows_triton(teacher, torch.empty(6, 45, dtype=fp8.FP8), torch.empty(6, 1))
    partials = kernels.fingerprint.fingerprint_triton(teacher)
    kernels.fingerprint.stale_check_triton(partials, partials)
    assert every_kernel and set(launched) == every_kernel, every_kernel ^ set(launched)
    assert all(launched.values()), launched
