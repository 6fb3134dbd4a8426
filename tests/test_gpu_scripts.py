"""benchmarks/gpu_fuzz.py and benchmarks/soak.py in their tiny CPU modes (Triton in its interpreter, see
conftest), and the fuzz's comparison failing on a wrong result, so that the fuzz cannot pass vacuously;
benchmarks/ab_study.py's CPU smoke run."""

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_fuzz, soak, ab_study = load("gpu_fuzz"), load("soak"), load("ab_study")


def test_fuzz_tiny_cpu_run_passes_and_writes_its_outputs(tmp_path):
    assert gpu_fuzz.main(["--device", "cpu", "--tiny", "--cases", "6", "--seed", "3", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "fuzz.json").read_text())["records"]
    assert [record["status"] for record in records] == ["pass"] * 6
    assert set(records[0]["errors"]) == set(gpu_fuzz.COMPARISONS)
    assert "6 cases: 6 passed, 0 FAILED" in (tmp_path / "fuzz.md").read_text()


def test_fuzz_only_reruns_the_same_case(tmp_path):
    drawn = gpu_fuzz.draw_cases(3, 6, gpu_fuzz.TINY_LIMITS)
    assert gpu_fuzz.main(["--device", "cpu", "--tiny", "--seed", "3", "--only", "4", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "fuzz.json").read_text())["records"]
    assert [record["case"] for record in records] == [gpu_fuzz.asdict(drawn[4])]


def failed(results):
    return [name for name, result in results.items() if not result["passed"]]


def a_case_with_every_term():
    case = gpu_fuzz.draw_cases(0, 1, gpu_fuzz.TINY_LIMITS)[0]
    return replace(case, tokens=9, batch=None, vocab_student=37, vocab_teacher=41, dtype="fp32", student_bias=True,
                   ignore="some", weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, num_valid_tokens=None)


@pytest.mark.parametrize("wrong", ["loss", "soft", "hard", "grad_input", "grad_weight", "grad_bias"])
def test_fuzz_comparison_fails_a_perturbed_result(wrong):
    case = a_case_with_every_term()
    args = gpu_fuzz.build_problem(case, torch.device("cpu"))
    reference = gpu_fuzz.reference_result(args, case)
    got = gpu_fuzz.fused_result(args, case, "torch")
    assert not failed(gpu_fuzz.compare(got, reference, reference, "fp32", False, False))

    index = gpu_fuzz.QUANTITIES.index(wrong)
    perturbed = list(got)
    perturbed[index] = got[index] * (1 + 1e-3)  # 10x the fp32 gradient tolerance, 100x the loss tolerance
    assert failed(gpu_fuzz.compare(perturbed, reference, reference, "fp32", False, False)) == [wrong]
    nan = list(got)
    nan[index] = torch.full_like(got[index], float("nan"))
    assert failed(gpu_fuzz.compare(nan, got, reference, "fp32", False, False)) == [wrong]


def test_fuzz_comparison_requires_exact_zeros_by_construction():
    case = replace(a_case_with_every_term(), ignore="all")
    args = gpu_fuzz.build_problem(case, torch.device("cpu"))
    reference = gpu_fuzz.reference_result(args, case)
    got = gpu_fuzz.fused_result(args, case, "torch")
    assert not failed(gpu_fuzz.compare(got, reference, reference, "fp32", True, True))
    got[3] = got[3] + 1e-30
    result = gpu_fuzz.compare(got, reference, reference, "fp32", True, True)["grad_input"]
    assert result["kind"] == "exact zero" and not result["passed"]


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


def test_ab_study_runs_two_versions_side_by_side(tmp_path):
    """This src loaded a second time as the "old" version: both run, every call is timed and paired."""
    ab_study.main(["--old", str(BENCHMARKS.parent / "src"), "--device", "cpu", "--tokens", "16", "--pairs", "3",
                   "--vocab", "1000", "--hidden", "64", "--json", str(tmp_path / "ab.json")])
    report = json.loads((tmp_path / "ab.json").read_text())
    assert [(entry["tokens"], entry["vocab"], entry["mode"]) for entry in report] == [(16, 1000, "full"),
                                                                                        (16, 1000, "forward")]
    for entry in report:
        assert len(entry["new_calls"]) == len(entry["old_calls"]) == 3
        low, high = entry["interval_ms"]
        assert low <= entry["difference_ms"] <= high
