"""``cosdistill demo`` (tools/demo.py): a small distillation run that writes its plot."""

import re
import sys

import pytest

from cosdistill.tools.cli import main

TINY_DEMO = ["demo", "--device", "cpu", "--vocab", "64", "--hidden", "32", "--batch-size", "16", "--seq-len", "24",
             "--teacher-steps", "60", "--steps", "60"]


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_demo_writes_the_png_and_the_student_comes_to_agree_with_the_teacher(capsys, tmp_path, loss):
    png_path = tmp_path / "demo.png"
    code = main(TINY_DEMO + ["--out", str(png_path), "--loss", loss])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith(f"cosdistill demo on cpu: {loss} loss,"), out
    assert png_path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    agreement = r"agreement with the teacher: ([\d.]+)% before, ([\d.]+)% after \(([\d.]+)% trained on the hard term alone\)"
    before, after, hard_only = map(float, re.search(agreement, out).groups())
    assert all(0 <= value / 100 <= 1 for value in (before, after, hard_only))
    assert hard_only > before + 20, out  # the baseline student learns too: it trains, from the same start
    assert hard_only != after, out  # and on another loss
    assert after > before + 20, out  # random student: a few %; after 60 steps: about 35-50 %


def test_demo_without_matplotlib_exits_2_before_the_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        main(TINY_DEMO + ["--out", str(tmp_path / "demo.png")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "cosdistill: error: demo needs matplotlib: pip install 'cosdistill[demo]'\n"
