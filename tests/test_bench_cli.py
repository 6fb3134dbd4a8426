import json

import pytest

from cosdistill.cli import main

TINY = ["bench", "--device", "cpu", "--tokens", "32", "--vocab", "300", "--hidden", "32", "--reps", "2", "--warmup", "1"]


def test_bench_prints_a_row_per_provider_and_passes_the_check(capsys, tmp_path):
    json_path = tmp_path / "bench.json"
    code = main(TINY + ["--providers", "ours,naive,floor", "--json", str(json_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    for provider in ("ours", "naive", "floor"):
        assert f"| {provider} | 32 | full |" in out
    assert "check: passed" in out
    result = json.loads(json_path.read_text())
    assert result["check_passed"] is True
    assert [row["provider"] for row in result["rows"]] == ["ours", "naive", "floor"]
    assert all(row["median_ms"] > 0 for row in result["rows"])


def test_bench_sweeps_ours_settings(capsys):
    code = main(TINY + ["--providers", "ours", "--mode", "forward", "--chunk-sizes", "auto,16", "--accum-dtypes", "fp32"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| ours[c=auto,acc=fp32] | 32 | forward |" in out
    assert "| ours[c=16,acc=fp32] | 32 | forward |" in out


@pytest.mark.parametrize("bad", [["--tokens", "12,x"], ["--vocab", "0"], ["--providers", "ours,bogus"], ["--dtype", "fp8"]])
def test_bad_argument_exits_2_with_one_line(capsys, bad):
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + bad)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("cosdistill: error: ")
    assert err.count("\n") == 1


def test_failed_check_prints_the_table_and_exits_1(capsys, monkeypatch):
    from cosdistill import bench

    monkeypatch.setattr(bench, "TOLERANCE", dict.fromkeys(bench.TOLERANCE, -1.0))
    code = main(TINY + ["--providers", "ours"])
    out = capsys.readouterr().out
    assert code == 1
    assert "| ours | 32 | full |" in out and "check: FAILED" in out
