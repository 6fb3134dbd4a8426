"""The stats-epilogue GEMMs of benchmarks/epilogue_study.py on the CPU (Triton interpreter, tiny blocks)."""

import importlib.util
from pathlib import Path

import pytest
import torch

STUDY_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "epilogue_study.py"
spec = importlib.util.spec_from_file_location("epilogue_study", STUDY_PATH)
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)

# No dimension a multiple of its block; TMA needs 16-byte row strides, so K and N are multiples of 8 there.
# fp16, not the study's bf16: Triton 3.9's interpreter multiplies bf16 tiles as their raw uint16 bits.
DTYPE = torch.float16
SHAPES = {"pointer": (37, 203, 37), "tma": (37, 200, 40)}  # M, N, K


@pytest.mark.parametrize("config", [
    study.GemmConfig(loads, persistent, block_m=16, block_n=32, block_k=16, num_warps=4)
    for loads in ("pointer", "tma") for persistent in (False, True)
], ids=lambda config: config.name)
def test_logits_and_stats_match_torch(config):
    torch.manual_seed(0)
    rows, vocab, depth = SHAPES[config.loads]
    student_hidden = torch.randn(rows, depth).to(DTYPE)
    teacher_hidden = torch.randn(rows, depth).to(DTYPE)
    student_weight = (torch.randn(vocab, depth) * 2 / depth**0.5).to(DTYPE)
    teacher_weight = (torch.randn(vocab, depth) * 2 / depth**0.5).to(DTYPE)
    plain, s, t = (torch.empty(rows, vocab, dtype=DTYPE) for _ in range(3))
    student_partials = study.new_partials(rows, vocab, config, "student", "cpu")
    teacher_partials = study.new_partials(rows, vocab, config, "teacher", "cpu")

    programs = 3  # persistent: fewer programs than tiles, so each loops over several
    study.logits_gemm(student_hidden, student_weight, plain, config, max_programs=programs)
    study.logits_gemm(student_hidden, student_weight, s, config, "student", student_partials, max_programs=programs)
    study.logits_gemm(teacher_hidden, teacher_weight, t, config, "teacher", teacher_partials, student_logits=s,
                      max_programs=programs)

    for got, hidden, weight in ((plain, student_hidden, student_weight), (s, student_hidden, student_weight),
                                (t, teacher_hidden, teacher_weight)):
        expected = hidden.float() @ weight.float().t()
        torch.testing.assert_close(got.float(), expected, rtol=2e-3, atol=2e-3)  # fp16 rounding of the output
    got = study.combine_partials(student_partials, teacher_partials)
    for name, err in study.stats_errors(got, study.reference_stats(s, t)).items():
        assert err < 1e-5, f"{name}: {err}"  # fp32 sums of the same fp16 logits


def test_partials_of_the_wrong_shape_are_refused():
    config = study.GemmConfig("pointer", persistent=False, block_m=16, block_n=32, block_k=16)
    hidden, weight, out = torch.zeros(4, 8, dtype=DTYPE), torch.zeros(40, 8, dtype=DTYPE), torch.empty(4, 40, dtype=DTYPE)
    with pytest.raises(ValueError, match="partials"):
        study.logits_gemm(hidden, weight, out, config, "student", study.new_partials(4, 40, config, "teacher", "cpu"))
