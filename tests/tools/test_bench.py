"""``cosdistill bench`` (tools/bench.py): the providers' table, its check against float64, the rounds, the
ledger and the plot, on the CPU."""

import json
import math
import os
import sys
import time

import pytest
import torch

from cosdistill.tools.cli import EXIT_CHECK_FAILED, main

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
    assert "| x floor | x floor by round |" in out  # one round (and no floor here): "-" below it


def test_rounds_time_the_providers_in_turn_and_report_the_median_over_rounds(capsys, monkeypatch, tmp_path):
    from cosdistill.tools import bench

    calls, first_seen = [], []
    round_ms = {"ours": [5.0, 2.0, 3.0], "floor": [1.0, 7.0, 4.0]}

    def fake_median_ms(step, tensors, device, warmup, reps, settle_s):
        if step not in first_seen:
            first_seen.append(step)
        label = ("ours", "floor")[first_seen.index(step)]
        calls.append((label, warmup, settle_s))
        return round_ms[label][sum(call[0] == label for call in calls) - 1]

    monkeypatch.setattr(bench, "median_ms", fake_median_ms)
    json_path = tmp_path / "bench.json"
    code = main(TINY + ["--providers", "ours,floor", "--rounds", "3", "--warmup", "3", "--settle-s", "0.25",
                        "--json", str(json_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    # each round starts one provider later; the first warms up with --warmup calls, later ones with one;
    # every round settles for --settle-s
    assert calls == [("ours", 3, 0.25), ("floor", 3, 0.25), ("floor", 1, 0.25), ("ours", 1, 0.25),
                     ("ours", 1, 0.25), ("floor", 1, 0.25)]
    rows = {row["provider"]: row for row in json.loads(json_path.read_text())["rows"]}
    assert rows["ours"]["median_ms"] == 3.0 and rows["floor"]["median_ms"] == 4.0  # medians of (5, 2, 3), (1, 7, 4)
    assert rows["ours"]["ratio_to_floor"] == 0.75
    assert rows["ours"]["round_ms"] == [5.0, 2.0, 3.0] and rows["floor"]["round_ms"] == [1.0, 7.0, 4.0]
    # each round against the floor's same round: the spread a reader needs to judge the median
    assert rows["ours"]["ratio_to_floor_by_round"] == [5.0, 2.0 / 7.0, 0.75]
    assert rows["floor"]["ratio_to_floor_by_round"] == [1.0, 1.0, 1.0]
    assert "| ours | 32 | full | 3.00 | 0.75 | 5.00 / 0.29 / 0.75 |" in out
    assert "warm-up 3 and >= 0.25 s, median of 2 in each of 3 interleaved rounds (order rotated)" in out


def test_warm_up_lasts_at_least_settle_s():
    """The power limiter's settling time is wall time: a fast step gets more warm-up calls, a slow one --warmup
    (no tensors: the studies in benchmarks/ time bare GEMMs this way)."""
    from cosdistill.tools import bench

    calls = []

    def step():
        calls.append(time.perf_counter())
        time.sleep(0.01)

    bench.median_ms(step, None, torch.device("cpu"), warmup=1, reps=2, settle_s=0.08)
    warmup_calls = len(calls) - 2
    assert warmup_calls >= 8 and calls[warmup_calls] - calls[0] >= 0.08
    calls.clear()
    bench.median_ms(step, None, torch.device("cpu"), warmup=3, reps=2, settle_s=0.0)
    assert len(calls) == 5


@pytest.mark.parametrize("bad", [["--tokens", "12,x"], ["--vocab", "0"], ["--providers", "ours,bogus"], ["--dtype", "fp8"],
                                 ["--rounds", "0"], ["--mode", "backward"], ["--mode", "full,full"], ["--mode", ","],
                                 ["--settle-s", "-1"], ["--providers", ""],
                                 ["--providers", "floor", "--chunk-sizes", "16"],
                                 ["--providers", "ours-logits,floor", "--accum-dtypes", "fp32"], ["--beta", "0"],
                                 ["--loss", "jsd", "--beta", "1.5"]])
def test_bad_argument_exits_2_with_one_line(capsys, bad):
    """Settings of ours without ours among the providers were ignored; no provider at all crashed."""
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + bad)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("cosdistill: error: ")
    assert err.count("\n") == 1


def test_failed_check_prints_the_table_and_exits_1(capsys, monkeypatch):
    from cosdistill.tools import bench

    monkeypatch.setattr(bench, "TOLERANCE", dict.fromkeys(bench.TOLERANCE, -1.0))
    code = main(TINY + ["--providers", "ours"])
    out = capsys.readouterr().out
    assert code == 1
    assert "| ours | 32 | full |" in out and "check: FAILED" in out


def test_both_modes_in_one_run_each_against_its_own_floor(capsys, tmp_path, monkeypatch):
    """Each mode's rows also carry that mode's error (the forward rows showed the full mode's)."""
    from cosdistill.tools import bench

    errors_of = bench.bench_size_errors

    def errors_marked_by_mode(*args):
        errors = errors_of(*args)
        return {label: 2e-9 if args[4] else 3e-9 for label in errors}  # with_grads: full mode

    monkeypatch.setattr(bench, "bench_size_errors", errors_marked_by_mode)
    json_path, png_path = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(TINY + ["--tokens", "16,32", "--providers", "ours,floor", "--mode", "full,forward", "--json", str(json_path),
                        "--plot", str(png_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mode full, forward |" in out
    rows = json.loads(json_path.read_text())["rows"]
    assert [(row["T"], row["mode"], row["provider"]) for row in rows] == [
        (tokens, mode, provider) for tokens in (16, 32) for mode in ("full", "forward") for provider in ("ours", "floor")]
    for row in rows:
        floor = next(r for r in rows if (r["T"], r["mode"], r["provider"]) == (row["T"], row["mode"], "floor"))
        assert row["ratio_to_floor"] == row["median_ms"] / floor["median_ms"]
        if row["provider"] == "ours":
            assert row["loss_rel_err"] == {"full": 2e-9, "forward": 3e-9}[row["mode"]]
    assert png_path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_bench_plots_a_png(capsys, tmp_path):
    png_path = tmp_path / "bench.png"
    code = main(TINY + ["--providers", "ours,naive,floor", "--plot", str(png_path)])
    assert code == 0, capsys.readouterr().out
    assert png_path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_without_matplotlib_exits_2_before_the_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--plot", str(tmp_path / "bench.png")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "cosdistill: error: --plot needs matplotlib: pip install 'cosdistill[bench]'\n"


def test_fp8_is_skipped_with_a_note_on_the_cpu(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # and no progress bar without tqdm
    code = main(TINY + ["--providers", "ours,ours-fp8,floor"])
    captured = capsys.readouterr()
    assert code == 0, captured.out
    assert "| ours-fp8 |" not in captured.out and "check: passed" in captured.out
    assert "ours-fp8 skipped: teacher_precision='fp8' needs a CUDA GPU with FP8 tensor cores" in captured.out
    assert captured.err == ""


def test_fp8_loss_error_is_reported_not_checked(capsys, monkeypatch):
    """With the hardware check off, FP8 runs through torch's reference _scaled_mm on the CPU."""
    from cosdistill.tools import bench

    monkeypatch.setattr(bench.fp8, "check_supported", lambda *args: None)
    monkeypatch.setitem(bench.TOLERANCE, torch.float32, 2e-6)  # ours' errors are below 1e-6, FP8's above 1e-5
    code = main(TINY + ["--providers", "ours,ours-fp8,ours-fp8-quantized,floor", "--mode", "forward"])
    out = capsys.readouterr().out
    assert code == 0, out
    fp8_row = next(line for line in out.splitlines() if line.startswith("| ours-fp8 | 32 | forward |"))
    assert 2e-6 < float(fp8_row.split("|")[8]) < 1e-2  # the loss err column
    quantized_row = next(line for line in out.splitlines() if line.startswith("| ours-fp8-quantized | 32 | forward |"))
    assert quantized_row.split("|")[8] == fp8_row.split("|")[8]  # a head quantized once: the same numbers
    assert "check: passed" in out
    # with no provider of ours but the FP8 ones nothing is checked: said so, and the run does not pass
    code = main(TINY + ["--providers", "ours-fp8,floor", "--mode", "forward"])
    out = capsys.readouterr().out
    assert code == EXIT_CHECK_FAILED and "NOT CHECKED" in out, out


def test_a_provider_out_of_memory_gets_a_note_and_an_empty_row(capsys, monkeypatch, tmp_path):
    """Out of memory in a later round drops the provider from the table's timings, not the run."""
    from cosdistill.tools import bench

    real_median_ms, calls = bench.median_ms, []

    def median_ms_failing_naive(step, tensors, device, warmup, reps, settle_s):
        calls.append(step)
        if len(calls) == 4:  # round 2, naive (order: naive, floor, ours)
            raise torch.OutOfMemoryError("fake")
        return real_median_ms(step, tensors, device, warmup, reps, settle_s)

    monkeypatch.setattr(bench, "median_ms", median_ms_failing_naive)
    json_path = tmp_path / "bench.json"
    code = main(TINY + ["--providers", "ours,naive,floor", "--rounds", "2", "--json", str(json_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {row["provider"]: row for row in json.loads(json_path.read_text())["rows"]}
    assert rows["naive"]["median_ms"] is None and rows["naive"]["peak_gb_above_inputs"] is None
    assert rows["ours"]["median_ms"] > 0 and rows["floor"]["median_ms"] > 0
    assert "naive ran out of memory at T=32" in out


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_ours_settings_are_honoured_for_both_losses(loss, monkeypatch):
    """An unchecked setting skips the teacher caches' content check with either soft term; the JSD refuses a
    forced cosine_via instead of ignoring it."""
    from dataclasses import replace

    from cosdistill.testing import weight_cache
    from cosdistill.tools import bench

    checked = []
    for name in ("fused_linear_jsd", "fused_linear_cosine_distill"):
        monkeypatch.setattr(bench, name, lambda *args, **kwargs: checked.append(
            weight_cache.WeightCache.check_contents is original) or torch.zeros(()))
    original = weight_cache.WeightCache.check_contents
    tensors = bench.make_tensors(16, 300, 32, 16, torch.float32, torch.device("cpu"))
    for setting in (bench.ours_settings()[0], bench.FORCED_SETTINGS["unchecked"]):
        bench.ours_loss(replace(setting, loss=loss), tensors)
    assert checked == [True, False] and weight_cache.WeightCache.check_contents is original
    if loss == "jsd":
        with pytest.raises(ValueError, match="ours-gram: the JSD has no cosine_via"):
            bench.ours_loss(replace(bench.FORCED_SETTINGS["gram"], loss=loss), tensors)


def test_the_ledger_gets_one_row_per_timing_appended_and_renders_as_markdown(capsys, tmp_path, monkeypatch):
    """--ledger appends (its header once) a row per provider and T; benchmarks/ledger.py renders them."""
    import csv
    import subprocess
    from pathlib import Path

    from cosdistill.tools import bench

    monkeypatch.setenv("COSDISTILL_COMMIT", "abc1234")
    ledger = tmp_path / "results.csv"
    for _ in range(2):
        assert main(TINY + ["--providers", "ours,ours-unchecked,floor", "--rounds", "2", "--ledger", str(ledger)]) == 0
    capsys.readouterr()
    with open(ledger, newline="") as file:
        rows = list(csv.DictReader(file))
    assert tuple(rows[0]) == bench.LEDGER_COLUMNS
    assert [row["provider"] for row in rows] == ["ours", "ours-unchecked", "floor"] * 2
    assert {row["commit"] for row in rows} == {"abc1234"} and {row["T"] for row in rows} == {"32"}
    assert all(float(row["ms"]) > 0 and row["command"].startswith("cosdistill bench") for row in rows)
    assert [row["ratio_to_floor"] for row in rows if row["provider"] == "floor"] == ["1.0000", "1.0000"]
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ledger.py"

    def rendered(commit, *options):
        return subprocess.run([sys.executable, str(script), "--ledger", str(ledger), "--commit", commit, *options],
                              capture_output=True, text=True, check=True).stdout

    table = rendered("abc1234")
    assert "| provider | T = 32 | peak GB above inputs |" in table
    assert table.count("| ours-unchecked | ") == 2 and "| floor | 1.000x" in table  # the same command twice: two runs
    assert rendered("abc") == table  # a hash's start selects its rows
    for selection in (["--commit", "abd"], ["--gpu", "no such GPU"], ["--mode", "bogus"]):  # printed nothing, exit 0
        nothing = subprocess.run([sys.executable, str(script), "--ledger", str(ledger), *selection],
                                 capture_output=True, text=True)
        assert nothing.returncode == 2 and "no rows of the ledger match the selection" in nothing.stderr
    ratios = [float(row["ratio_to_floor"]) for row in rows if row["provider"] == "ours"]
    spread = rendered("abc", "--spread")  # both runs side by side, and their median
    assert f"| ours | {ratios[0]:.3f} / {ratios[1]:.3f} (median {sum(ratios) / 2:.3f}) |" in spread
    assert spread.count("| floor | ") == 1 and " ms (median " in spread
    assert rendered("abc", "--gpu", rows[0]["gpu"]) == table
    # one table over runs of other kinds (here a forward-mode run) mixed their ratios under one row: refused
    assert main(TINY + ["--providers", "ours,floor", "--mode", "forward", "--rounds", "2", "--ledger", str(ledger)]) == 0
    mixed = subprocess.run([sys.executable, str(script), "--ledger", str(ledger), "--commit", "abc", "--compact"],
                           capture_output=True, text=True)
    assert mixed.returncode == 2 and "runs of one kind, these rows are of 2" in mixed.stderr
    assert "| ours | " in rendered("abc", "--compact", "--mode", "forward")
    by_run = rendered("abc", "--by-run", "ours", "--mode", "full").splitlines()  # a row per run, in ledger order
    gpu = rows[0]["gpu"].removeprefix("NVIDIA ").split(" ")[0]
    by_round = [[float(ratio) for ratio in row["ratio_to_floor_by_round"].split()] for row in rows
                if row["provider"] == "ours"]
    assert by_run[2:] == [f"| abc1234 | {gpu} | {rows[0]['date']} | {ratio:.2f}x [{min(rounds):.2f}-{max(rounds):.2f}] |"
                          for ratio, rounds in zip(ratios, by_round)]
    refused = subprocess.run([sys.executable, str(script), "--ledger", str(ledger), "--by-run", "ours"],
                             capture_output=True, text=True)  # full and forward mode: one ratio would mean two things
    assert refused.returncode == 2 and "--by-run takes runs of one workload and mode" in refused.stderr


def test_bench_of_the_jsd_checks_ours_against_its_naive_version_and_liger(capsys, tmp_path):
    json_path, ledger = tmp_path / "bench.json", tmp_path / "ledger.csv"
    code = main(TINY + ["--loss", "jsd", "--providers", "ours,naive,liger,floor", "--json", str(json_path),
                        "--rounds", "2", "--ledger", str(ledger)])
    out = capsys.readouterr().out
    assert code == 0 and "check: passed" in out and "loss jsd" in out
    rows = {row["provider"]: row for row in json.loads(json_path.read_text())["rows"]}
    assert set(rows) == {"ours", "naive", "liger", "floor"}
    assert rows["ours"]["loss_rel_err"] < 1e-5 and rows["liger"]["loss_rel_err"] < 1e-4
    assert rows["ours"]["small_grad_weight_rel_err"] < 1e-4
    assert all("loss=jsd" in line for line in ledger.read_text().splitlines()[1:])
    with pytest.raises(SystemExit):
        main(TINY + ["--loss", "jsd", "--providers", "ours-gram"])


def test_bench_of_the_jsd_times_trls_divergence_and_checks_it_against_the_naive_soft_term(tmp_path, monkeypatch):
    """TRL's DistillationTrainer loss (ChunkedDivergenceFunction) beside ours: the JSD alone, so its error is taken
    against the naive soft term; refused with the cosine loss; another TRL release is skipped with a note."""
    pytest.importorskip("trl")
    from cosdistill.tools import bench

    json_path = tmp_path / "bench.json"
    assert main(TINY + ["--loss", "jsd", "--providers", "ours,trl,floor", "--json", str(json_path)]) == 0
    rows = {row["provider"]: row for row in json.loads(json_path.read_text())["rows"]}
    assert set(rows) == {"ours", "trl", "floor"} and rows["trl"]["median_ms"] > 0
    assert rows["trl"]["loss_rel_err"] < 1e-5 and rows["trl"]["ratio_to_floor"] > 0
    with pytest.raises(SystemExit):
        main(TINY + ["--providers", "ours,trl"])
    monkeypatch.setattr(bench.importlib.metadata, "version", lambda name: "9.0.0")
    assert bench.load_trl_divergence() == (None, "trl skipped: trl 9.0.0 is installed, the bench compares 1.16.0")


def test_bench_of_the_jsd_at_another_beta_runs_every_provider_at_it(capsys, tmp_path, monkeypatch):
    """--beta 1 (the reverse KL): ours, the naive version, Liger and TRL each run at it (each checked against the
    naive version at it, which is seen to take it), and the ledger's workload says so."""
    import subprocess
    from pathlib import Path

    pytest.importorskip("trl")
    from cosdistill.tools import bench

    seen = []
    naive_jsd = bench.NAIVE_LOSSES["jsd"]
    monkeypatch.setitem(bench.NAIVE_LOSSES, "jsd", lambda *args, **options: seen.append(options.get("beta")) or naive_jsd(
        *args, **options))
    json_path, ledger = tmp_path / "bench.json", tmp_path / "ledger.csv"
    code = main(TINY + ["--loss", "jsd", "--beta", "1", "--providers", "ours,naive,liger,trl,floor", "--json",
                        str(json_path), "--rounds", "2", "--ledger", str(ledger)])
    out = capsys.readouterr().out
    assert code == 0 and "check: passed" in out and "loss jsd, beta 1" in out
    assert seen and set(seen) == {1.0}
    rows = {row["provider"]: row for row in json.loads(json_path.read_text())["rows"]}
    assert rows["ours"]["loss_rel_err"] < 1e-5 and rows["liger"]["loss_rel_err"] < 1e-4
    assert rows["trl"]["loss_rel_err"] < 1e-5 and rows["ours"]["small_grad_weight_rel_err"] < 1e-4
    assert all("loss=jsd beta=1," in line for line in ledger.read_text().splitlines()[1:])
    # the default's rows name no beta, --beta 0.5 too; ledger.py --beta picks either kind out
    assert main(TINY + ["--loss", "jsd", "--beta", "0.5", "--providers", "ours,floor", "--rounds", "2", "--ledger",
                        str(ledger)]) == 0
    assert main(TINY + ["--loss", "jsd", "--providers", "ours,floor", "--rounds", "2", "--ledger", str(ledger)]) == 0
    assert sum("loss=jsd," in line for line in ledger.read_text().splitlines()) == 2 * 2  # ours, floor; one T
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ledger.py"
    for beta, runs in (("1", 1), ("0.5", 2)):
        by_run = subprocess.run([sys.executable, str(script), "--ledger", str(ledger), "--beta", beta, "--by-run",
                                 "ours"], capture_output=True, text=True)
        assert by_run.returncode == 0 and by_run.stdout.count("x [") == runs, by_run


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_ours_metrics_runs_the_loss_asked_for_with_student_metrics(capsys, tmp_path, monkeypatch, loss):
    """ours-metrics: the A/B of the student metrics' kernel, each call of the loss timed given a StudentMetrics."""
    from cosdistill.tools import bench

    given = []
    name = "fused_linear_jsd" if loss == "jsd" else "fused_linear_cosine_distill"
    fused = getattr(bench, name)
    monkeypatch.setattr(bench, name, lambda *args, **options: given.append(options["student_metrics"]) or fused(
        *args, **options))
    json_path = tmp_path / "bench.json"
    assert main(TINY + ["--loss", loss, "--providers", "ours,ours-metrics,floor", "--json", str(json_path)]) == 0
    assert "check: passed" in capsys.readouterr().out
    rows = {row["provider"]: row for row in json.loads(json_path.read_text())["rows"]}
    assert rows["ours-metrics"]["median_ms"] > 0 and rows["ours-metrics"]["loss_rel_err"] < 1e-5
    metrics = [value for value in given if value is not None]
    assert metrics and None in given and all(value.entropy is not None for value in metrics)


def test_bench_says_where_it_wrote_its_files(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    plot, table = tmp_path / "speed.png", tmp_path / "table.md"
    assert main(TINY + ["--providers", "ours,floor", "--plot", str(plot), "--markdown", str(table)]) == 0
    out = capsys.readouterr().out
    assert f"plot: {plot}" in out and f"table: {table}" in out and plot.stat().st_size > 0


@pytest.mark.parametrize("gradient", ["1% short", "NaN"])
def test_the_check_runs_the_timed_path_and_a_failed_check_appends_nothing(capsys, tmp_path, monkeypatch, gradient):
    """The check at each T ran under no_grad, so it took another plan than the timed full mode (the Gram path,
    longer teacher sub-chunks, no side stream) and never saw its gradients: a wrong grad_input on the timed path
    passed. Now the check runs with gradients, and a run that fails it appends no row to the ledger. A NaN gradient
    under a finite loss passed too (max() of the errors kept the loss's over the NaN)."""
    from cosdistill import api

    real_distill = api.distill

    def distill_with_wrong_gradients_at_the_bench_size(options, student_input, *args, **kwargs):
        if torch.is_grad_enabled() and student_input.shape[0] == 96:  # only the bench's size, not the small problem
            student_input = student_input.view_as(student_input)  # the same values, the gradient wrong
            student_input.register_hook(lambda grad: grad * (0.99 if gradient == "1% short" else math.nan))
        return real_distill(options, student_input, *args, **kwargs)

    monkeypatch.setattr(api, "distill", distill_with_wrong_gradients_at_the_bench_size)
    ledger = tmp_path / "results.csv"
    command = ["bench", "--device", "cpu", "--tokens", "96", "--vocab", "300", "--hidden", "32", "--reps", "2",
               "--warmup", "1", "--providers", "ours,floor", "--rounds", "2", "--ledger", str(ledger)]
    assert main(command) == EXIT_CHECK_FAILED
    out = capsys.readouterr().out
    assert "CHECK FAILED" in out and "nothing appended" in out
    assert not ledger.exists()


def test_a_repeated_token_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(TINY[:4] + ["32,32"] + TINY[5:])
    assert "must not repeat" in capsys.readouterr().err


def test_the_commit_recorded_is_head_and_dirty_where_the_repository_but_the_ledger_changed(tmp_path, monkeypatch):
    """git describe --dirty called a run dirty once the ledger it appends to (tracked) had changed, so every run after
    the first on one tree was recorded as '<commit>-dirty', and a tag turned the commit into 'v0.1-3-g<commit>'. Then
    only the package's changes counted, so a changed benchmark script (which measures and writes rows too) did not."""
    import shutil
    import subprocess
    from pathlib import Path

    from cosdistill.tools import bench

    monkeypatch.delenv("COSDISTILL_COMMIT", raising=False)
    repo = tmp_path / "repo"
    package = repo / "src" / "cosdistill"
    shutil.copytree(Path(bench.__file__).parents[1], package, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "results.csv").write_text("date\n")
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "step.py").write_text("# a script that measures\n")

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c", "--allow-empty")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    git("-c", "user.name=t", "-c", "user.email=t@t", "tag", "-a", "v0.1", "-m", "v0.1")
    head = git("rev-parse", "--short=7", "HEAD")
    monkeypatch.setattr(bench, "__file__", str(package / "tools" / "bench.py"))
    (repo / "results.csv").write_text("date\nrow\n")  # the ledger this run appends to changed
    monkeypatch.chdir(repo)
    assert bench.source_commit("results.csv") == head
    assert bench.source_commit() == head + "-dirty"  # no ledger named: any change counts
    (repo / "benchmarks" / "step.py").write_text("# a script that measures, changed\n")
    assert bench.source_commit("results.csv") == head + "-dirty"
    git("checkout", "-q", "--", "benchmarks")
    (package / "tools" / "new_module.py").write_text("\n")  # untracked source
    assert bench.source_commit(str(repo / "results.csv")) == head + "-dirty"


def test_another_liger_release_is_skipped_with_a_note(monkeypatch):
    """The ledger's liger rows are Liger-Kernel 0.8.5's; any installed release was timed, unrecorded."""
    from cosdistill.tools import bench

    monkeypatch.setattr(bench.importlib.metadata, "version", lambda name: "0.9.0")
    module, why_not = bench.load_liger(torch.device("cpu"))
    assert module is None and why_not == "liger skipped: liger-kernel 0.9.0 is installed, the bench compares 0.8.5"


def test_a_sweep_beside_a_forced_provider_is_refused(capsys):
    """--chunk-sizes and --accum-dtypes set 'ours' alone: ours-unchecked ran its automatic settings beside them, an
    A/B of two configurations that the table did not show."""
    with pytest.raises(SystemExit):
        main(TINY + ["--providers", "ours,ours-unchecked", "--chunk-sizes", "16"])
    assert "settings of provider 'ours' alone" in capsys.readouterr().err


def test_an_error_of_the_run_keeps_its_traceback(monkeypatch):
    """Every ValueError of a run was printed as a one-line usage error (exit 2): a StaleWeightError from the library
    in the middle of timing lost its traceback."""
    from cosdistill import StaleWeightError
    from cosdistill.tools import bench

    def stale(*args, **kwargs):
        raise StaleWeightError("stale in the middle of the run")

    monkeypatch.setattr(bench, "run_bench", stale)
    with pytest.raises(StaleWeightError):
        main(TINY + ["--providers", "ours"])


@pytest.mark.parametrize("arguments, message", [
    (["--chunk-sizes", "0"], "chunk_size must be > 0"),
    (["--accum-dtypes", "fp16"], "accum_dtype=torch.float16 is not taken"),
    (["--accum-dtypes", "bf16"], "accum_dtype must be None, torch.float32 or student_weight's dtype torch.float32"),
    (["--chunk-sizes", ""], "must name at least one value"),
    (["--markdown", "."], "it is a folder"),
    (["--ledger", "ledger.csv"], "--ledger needs --rounds >= 2, got 1"),
    (["--json", "/proc/bench.json"], "cannot write /proc/bench.json"),  # an existing folder not writable
    (["--providers", "ours,ours"], "providers must not repeat a name"),
    (["--chunk-sizes", "8,8"], "--chunk-sizes must not repeat a value, got [8, 8]"),
    (["--hidden", "1"], "--hidden must be at least 2 where --student-hidden is not given"),
    (["--dtype", "fp16", "--providers", "ours-gram"], "provider 'ours-gram' runs in bf16 or fp32, not fp16"),
])
def test_bad_sweeps_and_paths_are_usage_errors_before_the_run(capsys, arguments, message):
    """They raised inside the run (a traceback, exit 1: the failed check's status), an empty sweep ran the defaults,
    and a folder as an output path failed at its open() after the whole run."""
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--providers", "ours"] + arguments)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_the_error_at_each_size_runs_the_naive_version_in_row_blocks(loss, monkeypatch):
    """At V = 262144, T = 8192 the naive version's fp32 logits at once did not fit an 80 GB GPU and the bench died
    before timing: its error check now takes REFERENCE_ROWS tokens at a time, with the same errors."""
    from dataclasses import replace

    from cosdistill import reference, testing
    from cosdistill.tools import bench

    tensors = bench.make_tensors(40, 300, 32, 16, torch.float32, torch.device("cpu"))
    settings = [replace(bench.ours_settings()[0], loss=loss)]
    whole = bench.bench_size_errors(tensors, settings, None, loss)
    rows_seen = []
    naive = reference.NAIVE_LOSSES[loss]
    monkeypatch.setitem(reference.NAIVE_LOSSES, loss, lambda *args, **kwargs: rows_seen.append(
        args[0].shape[0]) or naive(*args, **kwargs))
    monkeypatch.setattr(testing, "REFERENCE_ROWS", 16)
    blocked = bench.bench_size_errors(tensors, settings, None, loss)
    assert rows_seen == [16, 16, 8]
    assert blocked.keys() == whole.keys(), (blocked, whole)
    assert all(blocked[key] < 1e-5 and whole[key] < 1e-5 for key in blocked), (blocked, whole)


def test_a_cpu_run_writes_no_rows_to_the_projects_ledger(capsys, tmp_path, monkeypatch):
    """The project's ledger holds GPU timings: a CPU run's rows went in beside them and into its tables."""
    from cosdistill.tools import bench

    project_ledger = tmp_path / "results.csv"
    project_ledger.write_text("date\n")
    monkeypatch.setattr(bench, "PROJECT_LEDGER", project_ledger)
    with pytest.raises(SystemExit) as exit_info:
        main(TINY + ["--providers", "ours,floor", "--rounds", "2", "--ledger", str(project_ledger)])
    assert exit_info.value.code == 2 and "the project's ledger of GPU timings" in capsys.readouterr().err
    with pytest.raises(ValueError, match="the project's ledger of GPU timings"):  # every script writes through it
        bench.append_ledger_rows(str(project_ledger), "2 x cpu", "workload", [("full",)], "command")
    assert project_ledger.read_text() == "date\n"
    other = tmp_path / "cpu.csv"
    bench.append_ledger_rows(str(other), "cpu", "workload", [("full",)], "command")
    assert len(other.read_text().splitlines()) == 2


def test_a_run_that_checks_nothing_says_so_and_records_nothing(capsys, tmp_path):
    """Without a provider of ours the check said FAILED (and blamed the FP8 providers that had not run)."""
    ledger = tmp_path / "ledger.csv"
    code = main(TINY + ["--providers", "naive,floor", "--rounds", "2", "--ledger", str(ledger)])
    out = capsys.readouterr().out
    assert code == EXIT_CHECK_FAILED and "check: NOT RUN" in out and "add provider 'ours'" in out, out
    assert "ledger: nothing appended (the check did not run)" in out and not ledger.exists()


def test_an_output_path_checked_before_the_run_is_left_as_it_was(tmp_path):
    from cosdistill.tools.cli import check_writable

    check_writable(str(tmp_path / "new.json"))
    assert not (tmp_path / "new.json").exists()
    (tmp_path / "old.csv").write_text("kept\n")
    check_writable(str(tmp_path / "old.csv"))
    assert (tmp_path / "old.csv").read_text() == "kept\n"
    (tmp_path / "link.json").symlink_to(tmp_path / "missing" / "results.json")  # dangling: the link was replaced
    with pytest.raises(ValueError, match="not a regular file"):
        check_writable(str(tmp_path / "link.json"))
    assert (tmp_path / "link.json").is_symlink() and not (tmp_path / "missing").exists()
    os.mkfifo(tmp_path / "fifo")  # opening it for writing waited for a reader forever
    with pytest.raises(ValueError, match="not a regular file"):
        check_writable(str(tmp_path / "fifo"))


def test_an_installed_package_records_its_version_not_the_commit_of_a_repository_around_it(tmp_path, monkeypatch):
    """Installed into a project's folder under git, the ledger recorded that project's commit as the one measured."""
    import importlib.metadata
    import shutil
    import subprocess
    from pathlib import Path

    from cosdistill.tools import bench

    monkeypatch.delenv("COSDISTILL_COMMIT", raising=False)
    package = tmp_path / "project" / "lib" / "cosdistill"
    shutil.copytree(Path(bench.__file__).parents[1], package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "-C", str(tmp_path / "project"), "init", "-q"], check=True)
    monkeypatch.setattr(bench, "__file__", str(package / "tools" / "bench.py"))
    assert bench.source_commit() == f"v{importlib.metadata.version('cosdistill')}"
