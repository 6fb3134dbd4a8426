"""Soak and long-sequence memory: repeated calls neither leak nor drift, and peak memory grows with T by grad_input only.

(a) Soak: --calls consecutive forward + backward calls on the seed workload (bench.CUDA_WORKLOAD: V = 128256,
    teacher H = 4096, student H = 2048, bf16) at T = --tokens, on the same inputs. After each call the
    gradients are dropped and torch.cuda.memory_allocated() recorded: it must not change after the first
    call. Each call's loss, soft, hard, grad_input and grad_weight must equal the first call's bitwise
    (torch.equal); mismatches are counted, with the largest absolute difference.
(b) Peak memory above the inputs (bench.peak_gb_above_inputs: the inputs and weights allocated, .grad
    cleared, one warm-up call first) for forward + backward at the two --peak-tokens, small then large.
    The only buffer of the fused loss that grows with T is grad_input (the logits buffers are sized by
    the chunk), besides a few scalars per token (fp32 losses, label masks), so the check is

        peak(large) - peak(small) <= grad_input(large) - grad_input(small) + PER_TOKEN_SLACK * (large - small)

    with PER_TOKEN_SLACK = 64 B, 1.6% of grad_input's 4096 B per token at student H = 2048: any other
    buffer of [T, H] (2048 B per token at least) or [T, V] fails it.

    PYTHONPATH=src python benchmarks/soak.py --out DIR [--calls 1000] [--tokens 4096] [--peak-tokens 8192,131072]
    PYTHONPATH=src TRITON_INTERPRET=1 python benchmarks/soak.py --device cpu --tiny --out DIR

--tiny: small shapes and 3 calls, for the CPU, where the memory checks are skipped (no CUDA allocator).
Writes DIR/soak.json and DIR/soak.md; exit code 1 if a check fails.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from cosdistill import fused_linear_cosine_distill
from cosdistill.tools.bench import CUDA_WORKLOAD, DTYPE_NAMES, Workload, make_tensors, peak_gb_above_inputs
from cosdistill.tools.cli import positive_int

PER_TOKEN_SLACK = 64  # bytes per token beside grad_input, for per-token scalars: fp32 losses (8 B), label masks
RESULT_NAMES = ("loss", "soft", "hard", "grad_input", "grad_weight")
TINY_WORKLOAD = replace(CUDA_WORKLOAD, vocab=300, hidden=32, student_hidden=16)


def allocated(device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def tensors_for(tokens: int, workload: Workload, device):
    return make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)


def forward_backward(tensors, impl: str) -> list[torch.Tensor]:
    """[loss, soft, hard, grad_input, grad_weight] of one call."""
    tensors.clear_grads()
    losses = fused_linear_cosine_distill(*tensors.args(), return_soft_hard_loss=True, impl=impl)
    losses[0].backward()
    return [loss.detach() for loss in losses] + [tensors.student_input.grad, tensors.student_weight.grad]


def count_mismatches(result, first, mismatches: dict, max_abs_diff: dict):
    """Adds up where result differs from first bitwise; a function, so that no reference to result outlives it."""
    for name, got, want in zip(RESULT_NAMES, result, first):
        if not torch.equal(got, want):
            mismatches[name] += 1
            max_abs_diff[name] = max(max_abs_diff[name], (got.double() - want.double()).abs().max().item())


def soak(tokens: int, calls: int, workload: Workload, impl: str, device) -> dict:
    tensors = tensors_for(tokens, workload, device)
    before = allocated(device)
    start = time.perf_counter()
    first = [t.clone() for t in forward_backward(tensors, impl)]  # kept for the bitwise comparison
    tensors.clear_grads()
    after_call = [allocated(device)]
    mismatches = dict.fromkeys(RESULT_NAMES, 0)
    max_abs_diff = dict.fromkeys(RESULT_NAMES, 0.0)
    for _ in range(calls - 1):
        count_mismatches(forward_backward(tensors, impl), first, mismatches, max_abs_diff)
        tensors.clear_grads()
        after_call.append(allocated(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    memory_checked = device.type == "cuda"
    growth = max(after_call) - after_call[0] if memory_checked else None
    identical = not any(mismatches.values())
    return dict(
        tokens=tokens, calls=calls, seconds=round(seconds, 2), ms_per_call=round(1e3 * seconds / calls, 2),
        allocated_before_first_call=before, stored_first_result_bytes=sum(t.numel() * t.element_size() for t in first),
        allocated_after_call=after_call, growth_after_first_call_bytes=growth,
        distinct_allocated_values=len(set(after_call)),
        mismatches=mismatches, max_abs_diff=max_abs_diff,
        passed_memory=len(set(after_call)) == 1 if memory_checked else None, passed_identical=identical,
    )


def peak_above_inputs(tokens: int, workload: Workload, impl: str, device) -> dict:
    tensors = tensors_for(tokens, workload, device)

    def step():
        fused_linear_cosine_distill(*tensors.args(), impl=impl).backward()

    step()  # warm-up: kernels compiled, cuBLAS workspace allocated before the base is taken
    peak_gb = peak_gb_above_inputs(step, tensors, device)
    grad_input_bytes = tokens * workload.student_hidden * tensors.student_input.element_size()
    return dict(tokens=tokens, peak_bytes_above_inputs=None if peak_gb is None else round(peak_gb * 1e9),
                grad_input_bytes=grad_input_bytes)


def peak_check(small: dict, large: dict) -> dict:
    """The criterion of the module docstring, with its terms."""
    if small["peak_bytes_above_inputs"] is None:
        return dict(passed=None, criterion="skipped: peak memory is measured on CUDA only")
    growth = large["peak_bytes_above_inputs"] - small["peak_bytes_above_inputs"]
    grad_input_growth = large["grad_input_bytes"] - small["grad_input_bytes"]
    slack = PER_TOKEN_SLACK * (large["tokens"] - small["tokens"])
    beyond = (growth - grad_input_growth) / (large["tokens"] - small["tokens"])
    criterion = (f"peak({large['tokens']}) - peak({small['tokens']}) = {growth / 1e6:.2f} MB <= grad_input growth "
                 f"{grad_input_growth / 1e6:.2f} MB + {PER_TOKEN_SLACK} B/token slack {slack / 1e6:.2f} MB "
                 f"(measured beyond grad_input: {beyond:.1f} B/token)")
    return dict(passed=growth <= grad_input_growth + slack, criterion=criterion, peak_growth_bytes=growth,
                grad_input_growth_bytes=grad_input_growth, slack_bytes=slack,
                growth_beyond_grad_input_bytes=growth - grad_input_growth)


def gigabytes(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1e9:.3f}"


def report(result: dict) -> str:
    soaked, small, large, check = result["soak"], *result["peak"], result["peak_check"]
    mark = lambda passed: "skipped" if passed is None else "passed" if passed else "FAILED"  # noqa: E731
    after = soaked["allocated_after_call"]
    memory = ("not measured (CPU)" if after[0] is None else
              f"after call 1: {after[0]} B (before it: {soaked['allocated_before_first_call']} B; the stored first "
              f"results: {soaked['stored_first_result_bytes']} B; so call 1 kept "
              f"{after[0] - soaked['allocated_before_first_call'] - soaked['stored_first_result_bytes']} B more, once, "
              f"e.g. library workspaces); after calls 2..{soaked['calls']}: min {min(after)} B, max {max(after)} B; "
              f"{soaked['distinct_allocated_values']} distinct value(s) in all")
    mismatched = ", ".join(f"{name} {count} (max abs diff {soaked['max_abs_diff'][name]:.3g})"
                           for name, count in soaked["mismatches"].items() if count) or "none"
    lines = [
        result["header"], "",
        f"## (a) {soaked['calls']} consecutive forward + backward calls, T = {soaked['tokens']}, same inputs", "",
        f"- {soaked['ms_per_call']} ms per call including the comparisons ({soaked['seconds']} s in all)",
        f"- memory_allocated() with gradients dropped, {memory}: {mark(soaked['passed_memory'])} (constant from call 1 on)",
        f"- results bitwise equal to call 1's (loss, soft, hard, grad_input, grad_weight): mismatches {mismatched}: "
        f"{mark(soaked['passed_identical'])}", "",
        "## (b) Peak memory above the inputs, forward + backward", "",
        "| T | peak GB above inputs | grad_input GB |", "|---:|---:|---:|",
        *(f"| {row['tokens']} | {gigabytes(row['peak_bytes_above_inputs'])} | {gigabytes(row['grad_input_bytes'])} |"
          for row in (small, large)), "",
        check["criterion"] if check["passed"] is None else f"{check['criterion']}: {mark(check['passed'])}", "",
        f"SOAK {'PASSED' if result['passed'] else 'FAILED'}",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--impl", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--tiny", action="store_true", help="small shapes and 3 calls, for the CPU")
    parser.add_argument("--calls", type=positive_int, help="default 1000 (3 with --tiny)")
    parser.add_argument("--tokens", type=positive_int, help="soak T; default 4096 (24 with --tiny)")
    parser.add_argument("--peak-tokens", help="small,large; default 8192,131072 (16,64 with --tiny)")
    parser.add_argument("--out", required=True, help="folder for soak.json and soak.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and args.impl == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on the CPU only in the interpreter
    workload = TINY_WORKLOAD if args.tiny else CUDA_WORKLOAD
    calls = args.calls if args.calls is not None else 3 if args.tiny else 1000
    tokens = args.tokens if args.tokens is not None else 24 if args.tiny else 4096
    small, large = map(int, (args.peak_tokens or ("16,64" if args.tiny else "8192,131072")).split(","))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (f"cosdistill soak on {name}, torch {torch.__version__}, impl={args.impl}; V={workload.vocab} (student "
              f"and teacher), teacher H={workload.hidden}, student H={workload.student_hidden}, "
              f"{DTYPE_NAMES[workload.dtype]}, labels uniform (none ignored), seed as bench")
    print(header, flush=True)
    soaked = soak(tokens, calls, workload, args.impl, device)
    print(f"soak: {soaked['ms_per_call']} ms/call, mismatches {soaked['mismatches']}, "
          f"memory growth after call 1 (bytes): {soaked['growth_after_first_call_bytes']}", flush=True)
    peaks = [peak_above_inputs(t, workload, args.impl, device) for t in (small, large)]
    check = peak_check(*peaks)
    passed = soaked["passed_identical"] and soaked["passed_memory"] is not False and check["passed"] is not False
    shape = dict(vocab=workload.vocab, hidden=workload.hidden, student_hidden=workload.student_hidden,
                 dtype=DTYPE_NAMES[workload.dtype])
    result = dict(header=header, workload=shape, soak=soaked, peak=peaks, peak_check=check, passed=passed)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    (out / "soak.md").write_text(report(result))
    print(report(result), end="")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
