"""benchmarks/diagnose.py's subcommands and benchmarks/soak.py in their tiny CPU modes (Triton in its interpreter, see
conftest), and the profiler-trace parsing on traces made up here, so that the tools keep working between GPU runs."""

import csv
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SRC = BENCHMARKS.parent / "src"
TINY = ["--device", "cpu", "--tokens", "16", "--vocab", "300", "--hidden", "32"]


def load(name, module_name=None):
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


diagnose, soak = load("diagnose"), load("soak")


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """torch on one thread: the tiny GEMMs here otherwise wait milliseconds on the thread pool of a small CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(argv, tmp_path):
    """The subcommand's report as written to --json (the same object main returns)."""
    path = tmp_path / "report.json"
    returned = diagnose.main(argv + ["--json", str(path)])
    written = json.loads(path.read_text())
    assert json.loads(json.dumps(returned)) == written
    return written


def test_help_names_every_subcommand_and_each_has_its_own():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "diagnose.py"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    subcommands = ("gaps", "kernels", "idle", "host", "row-step", "ab", "fp8-accuracy")
    assert all(name in result.stdout for name in subcommands)
    for name in subcommands:
        with pytest.raises(SystemExit) as exit_info:
            diagnose.build_parser().parse_args([name, "--help"])
        assert exit_info.value.code == 0


def test_the_script_runs_from_the_command_line(tmp_path):
    """As a script (its folder first on the path), with cProfile's report."""
    env = os.environ | {"PYTHONPATH": str(SRC), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(BENCHMARKS / "diagnose.py"), "host", *TINY, "--calls", "2",
                             "--cprofile-lines", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cProfile, whole calls" in result.stdout


def test_gaps_times_every_part_against_the_floor(tmp_path):
    report = run(["gaps", *TINY, "--chunks", "8", "--layouts", "8/8", "16/8", "--rounds", "2", "--reps", "2"], tmp_path)
    [entry] = report
    medians = entry["medians"]
    gemms = [f"{kind} chunk={chunk}" for chunk in ("all", "8") for kind in diagnose.GEMM_KINDS]
    layers = ["direct rows=8/8", "direct rows=16/8", "direct", "+grad_output", "+Function", "+autograd", "library",
              "direct no-grad", "library no-grad"]
    assert list(medians) == gemms + layers
    assert all(value > 0 for value in medians.values())
    assert all(len(entry["rounds"][label]) == 2 for label in medians)
    assert entry["floor_ms"] == pytest.approx(sum(medians[f"{kind} chunk=all"] for kind in diagnose.GEMM_KINDS))
    for label in ("library", "direct"):  # on the CPU the profile's work is torch's ops, the GEMMs among them
        assert "aten::mm" in entry["profiles"][label]
    assert entry["phases"] == {}  # CUDA only


def test_each_layer_of_gaps_computes_the_library_s_gradients():
    """The bare chunk loop and each layer give the library's gradients, so the parts time the same work."""
    tensors = diagnose.tensors_of(24, diagnose.CPU_WORKLOAD.resized(300, 32), torch.device("cpu"))
    parts = diagnose.layer_parts(tensors, dict(teacher_precision=None, impl="auto"), ["8/8", "16/8"])
    parts["library"]()
    want = tensors.student_input.grad.clone(), tensors.student_weight.grad.clone()
    for label in ("direct rows=8/8", "direct rows=16/8", "direct", "+grad_output", "+Function", "+autograd"):
        tensors.clear_grads()
        parts[label]()
        torch.testing.assert_close(tensors.student_input.grad, want[0], msg=label)
        torch.testing.assert_close(tensors.student_weight.grad, want[1], msg=label)


def gpu_event(name, ts, dur, correlation=None, cat="kernel"):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args={} if correlation is None else dict(correlation=correlation))


def cpu_op(name, ts, dur, tid=1):
    return dict(ph="X", cat="cpu_op", name=name, ts=ts, dur=dur, tid=tid, args={})


def test_device_work_is_the_gpu_activities_or_the_outermost_aten_ops():
    trace = [gpu_event("gemm", 50, 10), gpu_event("copy", 20, 5, cat="gpu_memcpy"), cpu_op("aten::mm", 0, 100)]
    assert [event["name"] for event in diagnose.device_work(trace, torch.device("cuda"))] == ["copy", "gemm"]
    trace = [cpu_op("autograd::engine::evaluate_function", 0, 100), cpu_op("aten::addmm", 10, 30),
             cpu_op("aten::resize_", 12, 2), cpu_op("aten::mul", 50, 10), cpu_op("aten::mul", 55, 10, tid=2),
             cpu_op("aten::empty", 52, 1)]
    assert [(event["name"], event["ts"]) for event in diagnose.device_work(trace, torch.device("cpu"))] == [
        ("aten::addmm", 10), ("aten::mul", 50), ("aten::mul", 55)]


def test_idle_timeline_finds_the_gaps_and_the_ops_that_launched_each_kernel():
    trace = [
        dict(ph="X", cat="user_annotation", name="step 2", ts=1000, dur=500, args={}),
        cpu_op("cosdistill::checks", 1000, 80),
        cpu_op("aten::mm", 1090, 20), dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=1100, dur=5,
                                           args=dict(correlation=7)),
        cpu_op("aten::addmm", 1300, 20), dict(ph="X", cat="cuda_driver", name="cuLaunchKernelEx", ts=1310, dur=5,
                                              args=dict(correlation=8)),
        gpu_event("gemm A", 1110, 100, correlation=7), gpu_event("gemm B", 1320, 50, correlation=8),
        gpu_event("an earlier step's", 900, 50, correlation=1),
    ]
    timeline = diagnose.idle_timeline(trace, "step 2", torch.device("cuda"), min_gap_us=5)
    assert timeline["host_ms"] == 0.5 and timeline["busy_ms"] == 0.15 and timeline["first_kernel_us"] == 110
    assert [(k["name"], k["launched_by"], k["idle_before_us"]) for k in timeline["work"]] == [
        ("gemm A", "aten::mm", 0.0), ("gemm B", "aten::addmm", 110.0)]
    assert [op["name"] for op in timeline["host_ops_before_first"]] == ["cosdistill::checks", "aten::mm"]


def test_idle_lists_one_call_s_work_in_time_order(tmp_path):
    [entry] = run(["idle", *TINY, "--impl", "triton"], tmp_path)
    starts = [kernel["start_us"] for kernel in entry["work"]]
    assert starts == sorted(starts) and len(starts) > 10
    assert {"aten::mm", "aten::addmm_"} <= {kernel["name"] for kernel in entry["work"]}
    assert 0 < entry["busy_ms"] < entry["host_ms"]  # the Triton interpreter's row step runs no aten op: idle here


def test_kernel_summary_takes_the_most_common_sequence():
    calls = [[("a", 10, 0), ("b", 20, 15)], [("a", 12, 0), ("b", 30, 20)], [("a", 1, 0)]]
    summary = diagnose.kernel_summary(calls)
    assert summary["kernels"] == [("a", 11), ("b", 25)]
    assert (summary["busy_us"], summary["span_us"], summary["calls_with_sequence"]) == (36, 42.5, 2)
    assert summary["idle_us"] == pytest.approx(6.5)


def test_kernels_profiles_the_step_and_the_floor(tmp_path):
    [entry] = run(["kernels", *TINY, "--steps", "2"], tmp_path)
    assert [name for name, _ in entry["floor"]["kernels"] if name != "aten::t"] == ["aten::mm"] * 4  # its four GEMMs
    ours = entry["ours"]
    assert "aten::mm" in [name for name, _ in ours["kernels"]]
    assert 0 < ours["busy_us"] <= ours["span_us"] and ours["idle_us"] == pytest.approx(ours["span_us"] - ours["busy_us"])


def test_host_stamps_the_call_and_profiles_it(tmp_path, capsys):
    [entry] = run(["host", *TINY, "--calls", "3", "--cprofile-lines", "5"], tmp_path)
    stamps = entry["host_us"]
    assert list(stamps) == list(diagnose.HOST_STAMPS) and all(value > 0 for value in stamps.values())
    before_first_gemm = [stamps[name] for name in diagnose.HOST_STAMPS[:4]]
    assert before_first_gemm == sorted(before_first_gemm) and stamps["call to first GEMM call"] < stamps["call to loss returned"]
    assert entry["leads"] == []  # CUDA only
    out = capsys.readouterr().out
    assert "cProfile, the Python before the first GEMM" in out and "cProfile, whole calls" in out
    assert "function calls" in out


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_the_host_leads_are_timed_for_the_loss_asked_for(loss, monkeypatch):
    """host --loss jsd times the JSD's providers from an idle and a busy GPU, not the cosine loss's."""
    from cosdistill.tools import bench

    called = []
    for name in ("fused_linear_jsd", "fused_linear_cosine_distill"):
        monkeypatch.setattr(bench, name, lambda *args, name=name, **kwargs: called.append(name) or torch.zeros(()))
    tensors = diagnose.tensors_of(16, diagnose.CPU_WORKLOAD.resized(300, 32), torch.device("cpu"))
    for provider in ("ours", "ours-unchecked"):
        diagnose.lead_providers(loss)[provider](tensors, "forward")()
    assert called == ["fused_linear_jsd" if loss == "jsd" else "fused_linear_cosine_distill"] * 2
    assert ("ours-gram" in diagnose.lead_providers(loss)) == (loss == "cosine")  # the JSD has no cosine_via


def test_row_step_sweeps_this_and_an_old_triton_kernel_against_the_spec(tmp_path):
    report = run(["row-step", "--device", "cpu", "--rows", "4", "--vocabs", "64", "--configs", "64:1", "--old", str(SRC)],
                 tmp_path)
    settings = [(r["impl"], r["write_grad"], r["block"]) for r in report["alone"]]
    assert settings == [(impl, write_grad, block) for write_grad in (True, False) for impl in ("this", "--old")
                        for block in (None, 64)]
    assert all(r["rel_err"] < 1e-2 and r["ms"] > 0 for r in report["alone"]) and report["checks"] == []


def test_the_spec_comparison_fails_a_wrong_row_step():
    from cosdistill.testing import row_step_triton

    student, teacher, labels = diagnose.row_inputs(4, 64, torch.device("cpu"))
    constants = diagnose.ROW_STEP_CONSTANTS
    assert diagnose.spec_error(row_step_triton, student, teacher, labels, constants, True) < 1e-2

    def scaled_losses(s, t, y, sc, losses, write_grad):
        row_step_triton(s, t, y, sc, losses, write_grad)
        losses.mul_(1.01)

    def no_gradient(s, t, y, sc, losses, write_grad):
        row_step_triton(s, t, y, sc, losses, False)

    def a_nan_loss(s, t, y, sc, losses, write_grad):
        row_step_triton(s, t, y, sc, losses, write_grad)
        losses[1, 0] = float("nan")

    assert diagnose.spec_error(scaled_losses, student, teacher, labels, constants, True) > 5e-3
    assert diagnose.spec_error(no_gradient, student, teacher, labels, constants, True) > 0.1
    assert diagnose.spec_error(a_nan_loss, student, teacher, labels, constants, True) == math.inf


def test_fp8_accuracy_reports_each_quantity(tmp_path):
    [entry] = run(["fp8-accuracy", "--device", "cpu", "--tokens", "64", "--vocab", "512", "--hidden", "64"], tmp_path)
    errors = entry["errors"]
    assert [row["quantity"] for row in errors] == list(diagnose.FP8_QUANTITIES)
    for row in errors:
        assert 0 < row["bf16_vs_float64"] < 2e-2, row  # bf16 inputs, fp32 accumulation: small but not exact
        assert row["fp8_vs_float64"] is None and row["fp8_vs_bf16"] is None  # no FP8 tensor cores on the CPU
        assert 0 <= row["quantized_float64_vs_float64"] < 0.1, row
    assert errors[1]["quantized_float64_vs_float64"] > 0  # the quantized teacher moves the soft term


def test_ab_runs_two_versions_side_by_side(tmp_path):
    """This src loaded a second time as the "old" version: both run, every call is timed and paired."""
    report = run(["ab", "--old", str(SRC), "--device", "cpu", "--tokens", "16", "--pairs", "3", "--vocab", "1000",
                  "--hidden", "64"], tmp_path)
    assert [(entry["tokens"], entry["vocab"], entry["mode"]) for entry in report] == [(16, 1000, "full"),
                                                                                        (16, 1000, "forward")]
    for entry in report:
        assert len(entry["new_calls"]) == len(entry["old_calls"]) == 3
        low, high = entry["interval_ms"]
        assert low <= entry["difference_ms"] <= high


def test_soak_tiny_cpu_run_passes_and_writes_its_outputs(tmp_path):
    assert soak.main(["--device", "cpu", "--tiny", "--impl", "triton", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["soak"]["calls"] == 3 and result["soak"]["passed_identical"] is True
    assert sum(result["soak"]["mismatches"].values()) == 0
    assert "SOAK PASSED" in (tmp_path / "soak.md").read_text()


def test_soak_peak_check_fails_past_grad_input_growth():
    small = dict(tokens=8192, peak_bytes_above_inputs=1_000_000_000, grad_input_bytes=8192 * 4096)
    grown = 131072 * 4096 - 8192 * 4096
    large = dict(tokens=131072, peak_bytes_above_inputs=1_000_000_000 + grown, grad_input_bytes=131072 * 4096)
    assert soak.peak_check(small, large)["passed"] is True
    large["peak_bytes_above_inputs"] += 2 * soak.PER_TOKEN_SLACK * (131072 - 8192)  # e.g. a [T, 16] fp32 buffer
    assert soak.peak_check(small, large)["passed"] is False


def test_the_training_step_benchmark_runs_every_loss_and_they_agree(tmp_path):
    step = load("step")
    path, ledger = tmp_path / "step.json", tmp_path / "ledger.csv"
    assert step.main(["--tiny", "--device", "cpu", "--tokens", "64", "--row-len", "32", "--rounds", "2", "--reps", "1",
                      "--warmup", "1", "--max-tokens", "128", "--json", str(path), "--ledger", str(ledger)]) == 0
    report = json.loads(path.read_text())
    losses = report["start_losses"]
    assert set(losses) == set(report["results"]) == set(report["largest_tokens"]) == {"naive", "liger", "ours"}
    for name in ("liger", "ours"):  # the same loss on the same weights and batch (bf16 models)
        assert abs(losses[name] - losses["naive"]) < 2e-3 * losses["naive"]
    for result in report["results"].values():
        assert 0 < result["loss_ms"] < result["step_ms"] and len(result["step_ms_by_round"]) == 2
    assert all(tokens == 128 for tokens in report["largest_tokens"].values())
    with open(ledger, newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 3 * 2 + 3
    # the workload it ran, with the releases compared (it said Llama-shaped, V=128256 and rows=4096 whatever ran)
    transformers_version = importlib.metadata.version("transformers")
    assert {row["workload"] for row in rows} == {
        f"step: tiny student, tiny teacher, V=512 bf16 AdamW checkpointing rows=32 rounds=2 peak=whole process "
        f"transformers={transformers_version} liger-kernel=0.8.5" + (" trl=1.16.0" if importlib.util.find_spec("trl") else "")}


def test_the_training_step_benchmark_records_nothing_where_the_losses_disagree(tmp_path, monkeypatch):
    step = load("step")
    ours = step.ours_loss
    monkeypatch.setattr(step, "ours_loss", lambda *args: ours(*args) * 1.01)
    ledger = tmp_path / "ledger.csv"
    assert step.main(["--tiny", "--device", "cpu", "--tokens", "64", "--row-len", "32", "--rounds", "2", "--reps", "1",
                      "--warmup", "1", "--max-tokens", "0", "--providers", "naive,ours", "--ledger", str(ledger)]) == 1
    assert not ledger.exists()


def load_beside_step(name, monkeypatch):
    """A script that imports step.py, as it does when run from the command line (its folder first on the path)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return load(name)


@pytest.mark.parametrize("kind, fused", [("distillation", "loss_of_hidden_states"), ("gkd", "distill_loss")])
def test_the_trl_trainer_step_benchmark_runs_both_trainers_and_they_agree(tmp_path, monkeypatch, kind, fused):
    """Each timed step moves its trainer's weights, ours through the fused loss, whose loss before any step is the
    reference's: TRL's own (DistillationTrainer), or TRL's GKD loss on fp32 logits (GKDTrainer), which TRL's
    trainer misses on these bf16 models."""
    pytest.importorskip("trl")
    trl_step = load_beside_step("trl_step", monkeypatch)
    path, ledger = tmp_path / "trl_step.json", tmp_path / "ledger.csv"
    fused_calls, moved = [], {}
    fused_loss = getattr(trl_step.cosdistill.trl, fused)
    monkeypatch.setattr(trl_step.cosdistill.trl, fused,
                        lambda *args, **kwargs: fused_calls.append(kwargs["loss"]) or fused_loss(*args, **kwargs))
    step = trl_step.step

    def step_moving_weights(trainer, inputs):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        step(trainer, inputs)
        changed = any(not torch.equal(old, new) for old, new in zip(before, trainer.model.parameters()))
        moved.setdefault(type(trainer).__module__.split(".")[0], []).append(changed)

    monkeypatch.setattr(trl_step, "step", step_moving_weights)
    assert trl_step.main(["--trainer", kind, "--tiny", "--device", "cpu", "--rows", "2", "--prompt-len", "8",
                          "--completion-len", "16", "--rounds", "2", "--reps", "1", "--warmup", "1",
                          "--json", str(path), "--ledger", str(ledger)]) == 0
    assert moved == {"trl": [True] * 3, "cosdistill": [True] * 3}  # a warm-up and a timed step per round
    assert fused_calls and set(fused_calls) == {"jsd"}
    report = json.loads(path.read_text())
    losses, reference = report["start_losses"], report["reference_loss"]
    assert set(losses) == set(report["results"]) == {"trl", "ours"}
    assert reference > 0 and abs(losses["ours"] - reference) < 1e-4 * reference
    assert 8 <= report["completion_tokens"] <= 2 * 16
    for result in report["results"].values():
        assert result["step_ms"] > 0 and len(result["step_ms_by_round"]) == 2
    rows = ledger.read_text().splitlines()
    assert rows[0].startswith("date,commit") and len(rows) == 1 + 2 and all(",trl-step," in row for row in rows[1:])
    assert all((kind == "gkd") == ("GKDTrainer" in row) for row in rows[1:])
    assert all(f"trl={importlib.metadata.version('trl')}" in row for row in rows[1:])  # the release compared


@pytest.mark.parametrize("kind, ours", [("distillation", "DistillationTrainer"), ("gkd", "DistillationGKDTrainer")])
def test_the_trl_trainer_step_benchmark_refuses_trainers_whose_losses_differ(monkeypatch, kind, ours):
    """The check before timing can fail: our loss made wrong by a tenth stops the run, and so do trainer lists
    without a reference."""
    pytest.importorskip("trl")
    trl_step = load_beside_step("trl_step", monkeypatch)
    trainer_class = getattr(trl_step.cosdistill.trl, ours)
    compute_loss = trainer_class.compute_loss
    monkeypatch.setattr(trainer_class, "compute_loss", lambda self, *args, **kwargs: 1.1 * compute_loss(self, *args, **kwargs))
    tiny = ["--trainer", kind, "--tiny", "--device", "cpu", "--rows", "2", "--prompt-len", "8", "--completion-len", "16",
            "--rounds", "1", "--reps", "1", "--warmup", "1"]
    with pytest.raises(RuntimeError, match="differ before any step"):
        trl_step.main(tiny)
    for trainers in ("ours" if kind == "distillation" else "ours,ours", "liger"):
        with pytest.raises(SystemExit):
            trl_step.main(tiny + ["--trainers", trainers])


def parity_rank(rank, folder, tolerance=None):
    """One gloo rank of fsdp2_parity.main, in a group made here (torchrun's store can abort at exit on the CPU); its
    exit status to the folder's code{rank}.txt. ``tolerance`` replaces the script's for fp32."""
    import contextlib
    import datetime
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    parity = load("fsdp2_parity")
    if tolerance is not None:
        parity.TOLERANCE = {torch.float32: tolerance}
    with open(os.path.join(folder, f"out{rank}.txt"), "w") as out, contextlib.redirect_stdout(out):
        code = parity.main(["--shape", "tiny", "--device", "cpu", "--tokens", "256", "--row-len", "32", "--ledger",
                            os.path.join(folder, "ledger.csv")])
    with open(os.path.join(folder, f"code{rank}.txt"), "w") as out:
        out.write(str(code))
    dist.barrier()  # a rank that exits while the other still writes its report can abort in gloo's teardown
    gc.collect()  # FSDP2's modules, in reference cycles, hold the group
    dist.destroy_process_group()


def test_the_fsdp2_parity_script_runs_its_loop_on_gloo(tmp_path):
    """The two-GPU script's hand-written fully_shard loop, on two CPU ranks: gradients equal one process's."""
    pytest.importorskip("transformers")
    torch.multiprocessing.spawn(parity_rank, args=(str(tmp_path),), nprocs=2)
    [line] = [line for line in (tmp_path / "out0.txt").read_text().splitlines() if line.startswith("fsdp2-loop:")]
    assert float(line.split("against one process ")[1].split(";")[0]) < 1e-5
    assert [(tmp_path / f"code{rank}.txt").read_text() for rank in (0, 1)] == ["0", "0"]
    assert len((tmp_path / "ledger.csv").read_text().splitlines()) == 2  # the header and the loop's row


def test_the_fsdp2_parity_script_fails_where_a_gradient_is_off(tmp_path):
    """The same run held to a tolerance under its fp32 rounding: each rank exits 1 and no row is recorded."""
    pytest.importorskip("transformers")
    torch.multiprocessing.spawn(parity_rank, args=(str(tmp_path), 1e-12), nprocs=2)
    assert [(tmp_path / f"code{rank}.txt").read_text() for rank in (0, 1)] == ["1", "1"]
    assert "check FAILED" in (tmp_path / "out0.txt").read_text()
    assert not (tmp_path / "ledger.csv").exists()


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_the_vocab_parallel_bench_runs_two_ranks_on_the_cpu(tmp_path, loss):
    """benchmarks/vocab_parallel_bench.py under torchrun, two ranks over gloo at a tiny size: each rank's split loss
    and gradients against the unsplit ones, then one timing, each provider after a settle (a split's on every rank
    for as many calls, or its collectives would hang)."""
    env = os.environ | {"PYTHONPATH": str(SRC), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(BENCHMARKS / "vocab_parallel_bench.py"), "--sizes", "520", "64", "32", "--tokens", "48",
                             "--check-tokens", "40", "--reps", "1", "--rounds", "2", "--settle-s", "0.2", "--out",
                             str(tmp_path), "--loss", loss,
                             "--ledger", str(tmp_path / "ledger.csv")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "vocab_parallel.json").read_text())
    assert report["loss"] == loss and report["ranks"] == 2 and len(report["timings"]) == 1
    with open(tmp_path / "ledger.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["provider"] for row in rows] == ["ours-unsplit", "floor-unsplit", "ours-split", "ours-split-unchecked",
                                                 "floor-shard"]
    assert all(row["workload"].endswith("vocab-parallel ranks=2") and row["T"] == "48" for row in rows)
    assert all(len(row["ratio_to_floor_by_round"].split()) == 2 and float(row["ms"]) > 0 for row in rows)
    assert float(rows[1]["ratio_to_floor"]) == 1.0
    for errors in report["errors"].values():  # bf16: the split sums grad_input's shares in another order
        assert max(errors["loss"], errors["soft"], errors["hard"]) < 1e-5
        assert max(errors["grad_input"], errors["grad_weight_shard"]) < 1e-2


def test_the_vocab_parallel_bench_fails_where_the_split_is_off(tmp_path):
    """The same run held to a gradient tolerance under bf16's rounding: every rank exits 1, no row is recorded."""
    wrapper = tmp_path / "held_to_zero.py"
    wrapper.write_text("import sys, torch\nimport vocab_parallel_bench as script\n"
                       "script.bench.TOLERANCE = {torch.bfloat16: 0.0}\nsys.exit(script.main())\n")
    env = os.environ | {"PYTHONPATH": f"{SRC}{os.pathsep}{BENCHMARKS}", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(wrapper), "--sizes", "520", "64", "32", "--tokens", "48", "--check-tokens", "40",
                             "--reps", "1", "--rounds", "2", "--settle-s", "0", "--out", str(tmp_path),
                             "--ledger", str(tmp_path / "ledger.csv")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0 and "check FAILED" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (tmp_path / "ledger.csv").exists()


@pytest.mark.parametrize("script, argv, message", [
    ("soak", ["--device", "cpu", "--tiny", "--calls", "0", "--out", "."], "argument --calls: must be > 0, got 0"),
    ("soak", ["--device", "cpu", "--tiny", "--tokens", "-2", "--out", "."], "argument --tokens: must be > 0, got -2"),
    ("diagnose", ["gaps", "--device", "cpu", "--tokens", "0"], "argument --tokens: must be > 0, got 0"),
    ("diagnose", ["gaps", "--device", "cpu", "--vocab", "0"], "argument --vocab: must be > 0, got 0"),
    ("step", ["--tiny", "--device", "cpu", "--rounds", "1", "--ledger", "x.csv"], "--ledger needs --rounds >= 2"),
])
def test_the_scripts_refuse_counts_that_ran_something_else(capsys, script, argv, message):
    """0 calls became 3 and -2 calls passed the soak; a vocabulary of 0 ran the seed's; one round went to the ledger."""
    module = {"soak": soak, "diagnose": diagnose}.get(script) or load(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
