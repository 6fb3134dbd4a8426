"""``cosdistill check`` (tools/check.py) through the command line's entry point, and the rows it gives the CUDA
cluster row step."""

import os

import torch

from cosdistill.testing import RowStepImpl, kernels, row_step_torch
from cosdistill.tools import check as selfcheck
from cosdistill.tools.cli import main

row_step_cuda = kernels.row_step_cuda


def test_check_on_the_cpu_passes_and_prints_the_table(capsys):
    code = main(["check", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("cosdistill check on cpu")
    assert "| check | case | errors |" in out
    assert out.count("| loss torch vs float64 |") == len(selfcheck.LOSS_CASES)
    gram_cases = sum(case.gram_applies() for case in selfcheck.LOSS_CASES)
    assert gram_cases and out.count("| loss torch gram vs float64 |") == gram_cases
    if os.environ.get("TRITON_INTERPRET") == "1":  # set by conftest unless the environment says otherwise
        assert "paths checked: torch and triton (in Triton's interpreter" in out
        assert out.count("| loss triton vs float64 |") == len(selfcheck.LOSS_CASES)
        assert out.count("| loss triton gram vs float64 |") == gram_cases
        assert out.count("| row step triton vs torch |") == len(selfcheck.ROW_STEP_CASES)
        assert out.count("| row step triton vs torch, soft term alone |") == len(selfcheck.ROW_STEP_CASES)
        splittable = [case for case in selfcheck.ROW_STEP_CASES if case.vocab_teacher >= 2]
        assert out.count("| row step triton split in two vs torch |") == len(splittable)
        for beta in selfcheck.JSD_BETAS:
            assert out.count(f"| jsd triton beta={beta:g} vs float64 |") == len(selfcheck.LOSS_CASES)
    assert out.count("| loss torch vs float64, no_grad |") == len(selfcheck.LOSS_CASES)
    assert any(case.dtype == torch.float16 for case in selfcheck.LOSS_CASES)
    for beta in selfcheck.JSD_BETAS:
        assert out.count(f"| jsd torch beta={beta:g} vs float64 |") == len(selfcheck.LOSS_CASES)
    assert "FAIL" not in out and out.endswith("checks passed\n")


def test_check_without_the_interpreter_checks_the_torch_path_only(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code = main(["check", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "paths checked: torch only (set TRITON_INTERPRET=1" in out
    assert "triton vs" not in out


def test_check_of_one_soft_term_runs_that_terms_checks_alone(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["check", "--device", "cpu", "--loss", "jsd"]) == 0
    out = capsys.readouterr().out
    names = [line.split("|")[1].strip() for line in out.splitlines()[3:] if line.startswith("| ")]
    assert "soft terms jsd;" in out.splitlines()[0]
    assert names and all(name.startswith("jsd") for name in names)
    for beta in selfcheck.JSD_BETAS:
        assert names.count(f"jsd torch beta={beta:g} vs float64") == len(selfcheck.LOSS_CASES)
    assert main(["check", "--device", "cpu", "--loss", "cosine"]) == 0
    out = capsys.readouterr().out
    assert "| loss torch vs float64 |" in out and "| jsd " not in out


def test_failed_check_exits_1_and_marks_the_row(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(selfcheck, "LOSS_TOLERANCE", dict.fromkeys(selfcheck.LOSS_TOLERANCE, (-1.0, -1.0)))
    code = main(["check", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 1
    # each with gradients and under no_grad
    checks = 2 * (len(selfcheck.LOSS_CASES) + sum(case.gram_applies() for case in selfcheck.LOSS_CASES)
                  + len(selfcheck.LOSS_CASES) * len(selfcheck.JSD_BETAS))
    assert out.count("| FAIL |") == checks
    total = checks + len(selfcheck.TEACHER_MUTATIONS)  # the teacher cache checks compare with a fresh copy instead
    assert out.endswith(f"{checks} of {total} checks FAILED\n")


def test_selfcheck_runs_the_cluster_kernel_where_it_applies(monkeypatch):
    """The "row step cuda vs torch" rows (tests/gpu/test_gpu_check.py): the kernel gets plain scales and is
    called (its Triton fallback would pass vacuously); a case it does not apply to is left to the Triton rows."""
    calls = []

    def recording_step(student, teacher, labels, constants, losses, write_grad, *lifts):
        assert row_step_cuda.supported(student, teacher, labels, constants, write_grad, None)
        calls.append(student.shape)
        row_step_torch(student, teacher, labels, constants, losses, write_grad, *lifts)

    monkeypatch.setattr(row_step_cuda, "available", lambda device: True)
    monkeypatch.setattr(row_step_cuda, "COSINE_CUDA_ROW_STEP", RowStepImpl(recording_step, None, None))
    cases = (selfcheck.RowStepCase(4, 64, 64, torch.bfloat16), selfcheck.RowStepCase(3, 40, 41, torch.bfloat16))
    results = [result for result in selfcheck.check_row_step("cpu", cases) if "cuda" in result.name]
    # with both terms, and with the soft term alone
    assert [result.case for result in results] == [cases[0].describe()] * 2 and all(r.passed for r in results)
    assert calls == [(4, 64)] * 2
