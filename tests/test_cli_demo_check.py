"""``cosdistill check`` and ``cosdistill demo`` through the command line's entry point."""

import os
import re
import sys

import pytest
import torch

from cosdistill.tools import check as selfcheck
from cosdistill.tools.cli import main

TINY_DEMO = ["demo", "--device", "cpu", "--vocab", "64", "--hidden", "32", "--batch-size", "16", "--seq-len", "24",
             "--teacher-steps", "40", "--steps", "40"]


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
        splittable = [case for case in selfcheck.ROW_STEP_CASES if case.vocab_teacher >= 2]
        assert out.count("| row step triton split in two vs torch |") == len(splittable)
    assert "FAIL" not in out and out.endswith("checks passed\n")


def test_check_without_the_interpreter_checks_the_torch_path_only(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code = main(["check", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "paths checked: torch only (set TRITON_INTERPRET=1" in out
    assert "triton vs" not in out


def test_failed_check_exits_1_and_marks_the_row(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(selfcheck, "LOSS_TOLERANCE", dict.fromkeys(selfcheck.LOSS_TOLERANCE, (-1.0, -1.0)))
    code = main(["check", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 1
    checks = len(selfcheck.LOSS_CASES) + sum(case.gram_applies() for case in selfcheck.LOSS_CASES)
    assert out.count("| FAIL |") == checks
    total = checks + len(selfcheck.TEACHER_MUTATIONS)  # the teacher cache checks compare with a fresh copy instead
    assert out.endswith(f"{checks} of {total} checks FAILED\n")


def test_demo_writes_the_png_and_the_student_comes_to_agree_with_the_teacher(capsys, tmp_path):
    png_path = tmp_path / "demo.png"
    code = main(TINY_DEMO + ["--out", str(png_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert png_path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    before, after = map(float, re.search(r"agreement with the teacher: ([\d.]+)% before, ([\d.]+)% after", out).groups())
    assert 0 <= before / 100 <= 1 and 0 <= after / 100 <= 1
    assert after > before + 20, out  # random student: a few %; after 40 steps: about 40-55 %


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("bad, message", [
    (["demo", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["demo", "--hidden", "1"], "--hidden must be >= 2, got 1"),
    (["demo", "--vocab", "many"], "argument --vocab: invalid int value: 'many'"),
    (["demo", "--out", "losses.jpg"], "--out must be a .png path, got losses.jpg"),
    (["demo", "--out", "/no/such/folder/demo.png"], "cannot write /no/such/folder/demo.png: its folder does not exist"),
    pytest.param(["demo", "--device", "cuda"], "--device cuda asked for, but torch sees no CUDA device", marks=NO_CUDA),
    (["check", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["distill"], "argument command: invalid choice: 'distill'"),
])
def test_bad_argument_exits_2_with_one_line(capsys, bad, message):
    with pytest.raises(SystemExit) as exit_info:
        main(bad)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cosdistill: error: {message}")
    assert err.count("\n") == 1


def test_demo_without_matplotlib_exits_2_before_the_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        main(TINY_DEMO + ["--out", str(tmp_path / "demo.png")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "cosdistill: error: demo needs matplotlib: pip install 'cosdistill[bench]'\n"
