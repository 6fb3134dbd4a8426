"""The on-chip row step study (benchmarks/cluster_row_step_study.py): its math under Triton's interpreter
against the torch row step, and its sm_90 compile as a cluster of CTAs with the real compiler."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_study():
    spec = importlib.util.spec_from_file_location("cluster_row_step_study", ROOT / "benchmarks/cluster_row_step_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel in Triton's interpreter")
@pytest.mark.parametrize("vocab", [1000, 1024, 77])
def test_on_chip_row_step_matches_the_torch_step(vocab):
    study = load_study()
    torch.manual_seed(vocab)
    student, teacher, labels = study.make_inputs(9, vocab, torch.device("cpu"), ignored_every=4)
    student[3] *= 1e30  # a row whose sums overflow fp32: NaN losses, logits kept (the library's RESCUE redoes it)
    want = student.clone()
    losses = torch.full((9, 2), float("nan"))
    study.row_step_on_chip(want, teacher, labels, losses)
    assert torch.isnan(losses[3]).all() and torch.equal(want[3], student[3])
    rows = [row for row in range(9) if row != 3]
    losses_err, grad_err = study.check(
        lambda grad, t, l, out: study.row_step_on_chip(grad, t, l, out), student[rows], teacher[rows], labels[rows])
    assert losses_err < 1e-6
    assert grad_err < 1e-2  # bf16 gradients: their rounding, as the library's own step against torch's
    assert (want[labels == -100] == 0).all()


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys_path = __import__("sys").path.insert(0, "benchmarks")
import cluster_row_step_study as study
kernel = study._row_step_on_chip_kernel
types = dict(student_ptr="*bf16", teacher_ptr="*bf16", labels_ptr="*i64", losses_ptr="*fp32", row_stride="i32",
             vocab="i32", ignore_index="i32", weight_hard="fp32", weight_soft="fp32", beta="fp32", inv_temp_sq="fp32",
             eps="fp32")
signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
constants = {(kernel.arg_names.index("VOCAB_PAD"),): 131072}
compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=16, num_ctas=8))
ptx = compiled.asm["ptx"]
print(compiled.metadata.num_ctas, ptx.count("barrier.cluster") > 0, ptx.count("mapa") > 0)
"""


def test_on_chip_row_step_compiles_as_a_cluster_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    result = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-3:] == ["8", "True", "True"]
