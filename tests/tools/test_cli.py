"""The command line (tools/cli.py): a bad argument exits 2 with one line saying what is wrong."""

import pytest
import torch

from cosdistill.tools.cli import main

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("bad, message", [
    (["demo", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["demo", "--hidden", "1"], "--hidden must be >= 2, got 1"),
    (["demo", "--vocab", "many"], "argument --vocab: invalid int value: 'many'"),
    (["demo", "--out", "losses.jpg"], "--out must be a .png path, got losses.jpg"),
    (["demo", "--out", "/no/such/folder/demo.png"], "cannot write /no/such/folder/demo.png: its folder does not exist"),
    # the loss's options, before the teacher trains (they raised after it, with a traceback and exit 1)
    (["demo", "--loss", "jsd", "--beta", "2"], "beta must be in [0, 1] for the generalized JSD, got 2.0"),
    (["demo", "--weight-soft", "nan"], "weight_soft_loss must be finite, got nan"),
    pytest.param(["demo", "--device", "cuda"], "--device cuda asked for, but torch sees no CUDA device", marks=NO_CUDA),
    (["demo", "--beta", "-1"], "--beta must be >= 0 in the demo"),  # the plot's log scale dropped the curve
    (["demo", "--weight-hard", "-1", "--weight-soft", "-0.5"], "--weight-hard, --weight-soft must be >= 0 in the demo"),
    (["check", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["check", "--loss", "kl"], "argument --loss: invalid choice: 'kl'"),
    (["distill"], "argument command: invalid choice: 'distill'"),
])
def test_bad_argument_exits_2_with_one_line(capsys, bad, message):
    with pytest.raises(SystemExit) as exit_info:
        main(bad)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cosdistill: error: {message}")
    assert err.count("\n") == 1


def test_an_error_of_the_run_itself_keeps_its_traceback(monkeypatch):
    """Only what the arguments make is a one-line usage error: an error of the run, a kernel's or an out-of-memory
    error, propagates with its traceback."""
    from cosdistill.tools import demo

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(demo, "run_demo", fail)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        main(["demo", "--steps", "1"])
