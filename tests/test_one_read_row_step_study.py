"""The one-read row step study (benchmarks/one_read_row_step_study.py): both kernels' math under Triton's
interpreter against the torch row step, and their GPU forms compiled for sm_90 with the real compiler:
the held slices' ticket and sleeping wait, the cluster's reductions across CTAs."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_study():
    spec = importlib.util.spec_from_file_location("one_read_row_step_study",
                                                  ROOT / "benchmarks/one_read_row_step_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels in Triton's interpreter")
@pytest.mark.parametrize("kind, vocab, size", [("slices", 1000, 256), ("slices", 1024, 256), ("slices", 77, 64),
                                               ("slices", 300, 512), ("cluster", 1000, 8), ("cluster", 77, 4)])
def test_one_read_row_step_matches_the_torch_step(kind, vocab, size):
    study = load_study()
    step = dict(slices=study.row_step_held_slices, cluster=study.row_step_on_chip)[kind]
    torch.manual_seed(vocab)
    student, teacher, labels = study.make_inputs(9, vocab, torch.device("cpu"), ignored_every=4)
    labels[1] = vocab - 1  # the label in the last, partial slice
    labels[2] = 0
    student[3] *= 1e30  # a row whose sums overflow fp32: NaN losses, logits kept (the library's RESCUE redoes it)
    got = student.clone()
    losses = torch.full((9, 2), float("nan"))
    step(got, teacher, labels, losses, size, 4)
    assert torch.isnan(losses[3]).all() and torch.equal(got[3], student[3])
    rows = [row for row in range(9) if row != 3]
    losses_err, grad_err = study.check(lambda grad, t, l, out: step(grad, t, l, out, size, 4),
                                       student[rows], teacher[rows], labels[rows])
    assert losses_err < 1e-6
    assert grad_err < 1e-2  # bf16 gradients: their rounding, as the library's own step against torch's
    assert (got[labels == -100] == 0).all()


COMPILE = """
import sys
sys.path.insert(0, "benchmarks")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import one_read_row_step_study as study
types = dict(student_ptr="*bf16", teacher_ptr="*bf16", labels_ptr="*i64", losses_ptr="*fp32", partials_ptr="*fp32",
             counters_ptr="*i32", row_stride="i32", slices="i32", vocab="i32", ignore_index="i32", weight_hard="fp32",
             weight_soft="fp32", beta="fp32", inv_temp_sq="fp32", eps="fp32")


def ptx(kernel, constants, **options):
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    constants = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=options).asm["ptx"]


slices = dict(SLICE=4096, SLICES_POW2=32, WAIT=True, STATS=True, GRAD=True)
held = ptx(study._held_slice_row_step_kernel, dict(slices, SLEEP=True), num_warps=4)
spin = ptx(study._held_slice_row_step_kernel, dict(slices, SLEEP=False), num_warps=4)  # item 53's "spin"
cluster = ptx(study._row_step_on_chip_kernel, dict(VOCAB_PAD=131072), num_warps=16, num_ctas=8)
print("nanosleep" in held, "atom.global.gpu.acquire" in held, "atom.global.gpu.release" in held,
      "nanosleep" not in spin and "gpu.acquire" in spin, "barrier.cluster" in cluster, "mapa" in cluster)
"""


def test_one_read_row_steps_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    result = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-6:] == ["True"] * 6, result.stdout
