"""benchmarks/sliced_row_step_study.py in Triton's interpreter: its two halves (statistics of each slice,
then the gradient from the combined statistics) against the torch row step."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosdistill.row_step import RowStepScales, row_step_torch
from conftest import rel_err

STUDY_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "sliced_row_step_study.py"
spec = importlib.util.spec_from_file_location("sliced_row_step_study", STUDY_PATH)
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


@pytest.mark.parametrize("vocab, slice_cols, block", [(300, 64, 32), (257, 128, 64), (64, 64, 32)])
def test_slices_give_the_torch_row_step(vocab, slice_cols, block):
    rows = 9
    student = torch.randn(rows, vocab) * 3
    teacher = torch.randn(rows, vocab) * 3
    labels = torch.randint(0, vocab, (rows,))
    labels[2] = -100  # ignored: zero gradient, zero losses
    labels[3] = vocab - 1  # the last column, in the last (partial) slice
    scales = RowStepScales(0.7, 0.4, 0.6, 1.0, -100)
    want_grad, want_losses = student.clone(), torch.empty(rows, 2)
    row_step_torch(want_grad, teacher, labels, scales, want_losses, True)
    got_grad, got_losses = student.clone(), torch.full((rows, 2), float("nan"))
    study.sliced_row_step(got_grad, teacher, labels, scales, got_losses, slice_cols=slice_cols, block_size=block,
                          num_warps=1, num_stages=1, sync=False)
    assert rel_err(got_losses, want_losses) < 1e-5
    assert rel_err(got_grad, want_grad) < 1e-5
    assert torch.count_nonzero(got_grad[2]) == 0 and torch.all(got_losses[2] == 0)


def test_bad_slicing_is_refused():
    logits = torch.randn(2, 100)
    labels = torch.zeros(2, dtype=torch.long)
    scales = RowStepScales(0.5, 0.5, 0.5, 1.0, -100)
    with pytest.raises(ValueError, match="multiple of block_size"):
        study.sliced_row_step(logits, logits.clone(), labels, scales, torch.empty(2, 2), slice_cols=48, block_size=32)
    with pytest.raises(ValueError, match="at most 64"):
        study.sliced_row_step(logits, logits.clone(), labels, scales, torch.empty(2, 2), slice_cols=1, block_size=1)
    with pytest.raises(ValueError, match="Vs = Vt"):
        study.sliced_row_step(logits, torch.randn(2, 101), labels, scales, torch.empty(2, 2))


def test_the_waiting_kernel_compiles_for_hopper():
    """The one-launch form (programs wait for their row) cannot run in the interpreter; it must compile,
    with its atomics and the prefetched loads, for sm_90."""
    code = (
        "import importlib.util, kernel_compile\n"
        f"spec = importlib.util.spec_from_file_location('study', {str(STUDY_PATH)!r})\n"
        "study = importlib.util.module_from_spec(spec); spec.loader.exec_module(study)\n"
        "compiled = kernel_compile.compile_for_hopper(study._sliced_kernel, '*bf16', dict(STUDENT_CAP=False, "
        "TEACHER_CAP=False, PHASE=study.BOTH.value, SLICE=8192, SLICES_POW2=16, BLOCK=2048, STAGES=6), aligned=True)\n"
        "ptx = compiled.asm['ptx']\n"
        "print('release' in ptx, 'acquire' in ptx, 'cp.async' in ptx)\n"
    )
    tests = Path(__file__).resolve().parent
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent / "src"), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True", "True"], result.stdout
