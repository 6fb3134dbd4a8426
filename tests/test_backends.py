"""The backends (_backends.py): which kernels each ``impl`` runs on a device, and the torch backend's own pieces."""

import dataclasses

import pytest
import torch

from conftest import make_problem
from cosdistill import fused_linear_cosine_distill
from cosdistill.testing import TORCH, TRITON_ROW_STEP, backend_for, kernels, plan, quantize_rows_triton, scale_unless_one_torch
from cosdistill.testing import teacher_fp8 as fp8

row_step_cuda = kernels.row_step_cuda


def test_torch_scale():
    values = torch.randn(50)
    kept = values.clone()
    scale_unless_one_torch(values, torch.tensor(1.0))
    assert torch.equal(values, kept)
    scale_unless_one_torch(values, torch.tensor(0.5))
    assert torch.equal(values, kept * 0.5)


def test_not_available_on_the_cpu():
    assert not row_step_cuda.available(torch.device("cpu"))
    with pytest.raises(ValueError, match="thread block clusters"):
        backend_for("cuda", torch.device("cpu"))
    assert backend_for("auto", torch.device("cpu")) is TORCH


def test_auto_picks_the_cluster_step_where_available(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(row_step_cuda, "available", lambda device: True)
    assert backend_for("auto", cuda).row_step is row_step_cuda.CUDA_ROW_STEP
    assert backend_for("cuda", cuda).row_step is row_step_cuda.CUDA_ROW_STEP
    assert backend_for("triton", cuda).row_step is TRITON_ROW_STEP
    monkeypatch.setattr(row_step_cuda, "available", lambda device: False)  # before Hopper
    assert backend_for("auto", cuda).row_step is TRITON_ROW_STEP
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
        assert backend.row_step.stats is kernels.row_step_triton.row_stats_triton, impl
        assert backend.row_step.grad is kernels.row_step_triton.row_grad_triton, impl
    assert TORCH.jsd_row_step.split is not jsd.split_jsd_row_step_triton

def test_each_backend_quantizes_the_chunks_with_its_own_kernel(impl, monkeypatch):
    """impl="torch" quantizes with torch, "triton" with the Triton kernel: each chunk's rows once, through
    the backend the plan picked (the cached weight is quantized by torch's function, once)."""
    monkeypatch.setattr(fp8, "check_supported", lambda device: None)
    backend = backend_for(impl, torch.device("cpu"))
    assert backend.quantize_rows is (quantize_rows_triton if impl == "triton" else fp8.quantize_rows)
    calls = []
    recording = dataclasses.replace(backend, quantize_rows=lambda *args: calls.append(len(args[0])) or
                                    backend.quantize_rows(*args))
    monkeypatch.setattr(plan, "backend_for", lambda impl, device: recording)
    problem = make_problem(tokens=20)
    fused_linear_cosine_distill(*problem.args(), teacher_precision="fp8", impl=impl, chunk_size=8)
    assert calls == [8, 8, 4]
