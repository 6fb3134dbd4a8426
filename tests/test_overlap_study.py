"""benchmarks/overlap_study.py on the CPU: its loop (one stream there) against the library, and its report."""

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cosdistill.bench import CPU_WORKLOAD, make_tensors

STUDY_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_study.py"
spec = importlib.util.spec_from_file_location("overlap_study", STUDY_PATH)
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)

# Small chunks so that T = 37 has five chunks, the last one partial, alternating between two buffer pairs.
TINY_VARIANTS = (
    study.Variant("serial", 8, two_streams=False),
    study.Variant("two streams", 8, two_streams=True),
    study.Variant("two streams, side first", 16, two_streams=True, side_priority=-1),
)


def tiny_tensors(tokens=37):
    tensors = make_tensors(tokens, vocab=101, hidden=24, student_hidden=16, dtype=torch.float32, device=torch.device("cpu"))
    tensors.labels[::5] = study.SCALES.ignore_index  # N is then not T
    return tensors


@pytest.mark.parametrize("variant", TINY_VARIANTS, ids=lambda variant: variant.label)
def test_loop_matches_the_library(variant, impl):
    errors = study.check_errors(variant, tiny_tensors(), impl)
    assert all(error <= 1e-6 for error in errors.values()), errors


def test_single_chunk_and_chunk_larger_than_tokens():
    errors = study.check_errors(study.Variant("two streams", 64, two_streams=True), tiny_tensors(tokens=5), "torch")
    assert all(error <= 1e-6 for error in errors.values()), errors


def test_streams_are_no_ops_off_cuda():
    streams = study.Streams(torch.device("cpu"), two_streams=True, side_priority=-1)
    assert streams.side is None and streams.record() is None
    with streams.on_side():
        streams.wait(None)
    streams.join()


def test_covered_us_counts_the_union_of_the_other_intervals_once():
    assert study.covered_us((10, 20), [(0, 12), (11, 14), (18, 30), (40, 50)]) == 6  # 10-14 and 18-20
    assert study.covered_us((10, 20), []) == 0


def test_report_has_every_row_and_passes_the_check(tmp_path):
    workload = replace(CPU_WORKLOAD, tokens=(40,), vocab=300, hidden=32, student_hidden=16, warmup=0, reps=2)
    result = study.run_study(workload, torch.device("cpu"), "torch", variants=TINY_VARIANTS)
    assert result["check_passed"]
    labels = [row["variant"] for row in result["rows"]]
    assert labels == ["floor", "library", "bound: library - row steps", *(variant.label for variant in TINY_VARIANTS)]
    assert all(row["median_ms"] > 0 and row["x_floor"] > 0 for row in result["rows"] if row["variant"] != labels[2])
    json.dumps(result)  # what main() writes
    table = study.markdown(result)
    assert "| two streams | 40 | 8 |" in table and "check: passed" in table
