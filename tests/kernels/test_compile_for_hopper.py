"""The Triton kernels compile for the H200 (sm_90) with Triton's real compiler, on this CPU machine
(tests/kernel_compile.py, which benchmarks/sass_compare.py reuses)."""

import math
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def compiler_env():
    """The environment for a script that compiles with Triton's real compiler: no interpreter, this src."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), env.get("PYTHONPATH", "")])
    return env


def test_every_kernel_variant_compiles_for_hopper():
    result = subprocess.run([sys.executable, str(TESTS / "kernel_compile.py")], env=compiler_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # 2 softcap settings x 12 row-step variants, the Gram path's 2 kernels for bf16 and fp32, the FP8
    # quantization for 3 input types, and the label count, grad_output's scale, the weight fingerprint, its
    # stale check, the mean losses for 3 sources of N and poisoned, and the student metrics for 3 logits types with
    # and without a softcap and scale
    assert result.stdout.count("bytes of sm_90 cubin") == 45, result.stdout
    assert result.stdout.count("gram ") == 4, result.stdout


def test_sass_compare_hashes_every_variant():
    """benchmarks/sass_compare.py (the check that two trees' kernels are the same machine code): one line
    per row-step variant with a SASS hash; the prefetching (aligned) variants differ from the plain ones."""
    result = subprocess.run([sys.executable, str(TESTS.parent / "benchmarks" / "sass_compare.py")], env=compiler_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    assert len(lines) == 28 and all(line[-1] == "instructions" and int(line[-2]) > 100 for line in lines), result.stdout
    hashes = {" ".join(line[:-3]): line[-3] for line in lines}
    assert hashes["row step *bf16 caps=False"] != hashes["row step aligned *bf16 caps=False"], result.stdout


def test_sass_compare_counts_what_each_cuda_kernel_issues_per_logit():
    """sass_compare.py --cuda: one line per CUDA cluster kernel with its instructions and SFU operations per
    logit pair. The mixed JSD's two logarithms per pair show, and its count is past the 4096 instructions that
    four-digit SASS addresses hold (those past them once went uncounted)."""
    result = subprocess.run([sys.executable, str(TESTS.parent / "benchmarks" / "sass_compare.py"), "--cuda", "128256"],
                            env=compiler_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = {}
    for line in result.stdout.splitlines():
        name, figures = line.split(" (", 1)
        words = figures.split(": ", 1)[1].split()
        counts[name.strip()] = float(words[0]), float(words[3])
    assert len(counts) == 7 and counts["cosine"][0] > 0, result.stdout
    instructions, mufu = counts["jsd mixed, T = 1"]
    assert mufu >= counts["jsd forward KL, T = 1"][1] + 2, result.stdout
    assert 8 * math.ceil(128256 / 64 / 256) * instructions > 4096, result.stdout
