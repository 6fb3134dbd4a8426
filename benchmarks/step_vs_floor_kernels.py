"""Study: the library's full step and the four-GEMM floor, kernel by kernel, at the bench's settled clocks.

After a settle that alternates the two (as the bench's rounds do), profiles --steps calls of each, alternating,
and prints for each the median over calls of: every kernel's duration in launch order (GEMMs named by
cuBLAS's kernel name, so a different algorithm shows), the kernels' sum, the idle time between the first
kernel's start and the last one's end, and the span from the step's first to its last kernel. Kernel
durations come from the GPU's own timestamps, so the profiler's host cost does not enter them; the idle
does include it (read as an upper bound). What it answers: of the step's time over the floor, how much is
our GEMMs running slower than the floor's, how much the row step and the small kernels, how much idle.

    PYTHONPATH=src python benchmarks/step_vs_floor_kernels.py [--tokens 1024] [--steps 7] [--settle-s 3] [--fp8]
"""

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cosdistill.tools.bench import CUDA_WORKLOAD, FP8_SETTING, floor_provider, make_tensors, ours_provider, ours_settings

GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def profiled_kernels(step, tensors):
    """[(name, duration us, start us)] of one call's GPU activities, in start order."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tensors.clear_grads()
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace_file:
        prof.export_chrome_trace(trace_file.name)
        events = json.load(open(trace_file.name))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    return [(e["name"], e["dur"], e["ts"]) for e in gpu]


def summary(calls):
    """Median per kernel position (calls with the same kernel sequence), busy, idle and span."""
    sequences = {}
    for kernels in calls:
        sequences.setdefault(tuple(name for name, _, _ in kernels), []).append(kernels)
    names, runs = max(sequences.items(), key=lambda item: len(item[1]))
    lines = []
    for position, name in enumerate(names):
        duration = statistics.median(run[position][1] for run in runs)
        lines.append(f"    {duration:9.1f} us  {name[:90]}")
    busy = statistics.median(sum(d for _, d, _ in run) for run in runs)
    span = statistics.median(run[-1][2] + run[-1][1] - run[0][2] for run in runs)
    lines.append(f"    kernels {busy:.1f} us, span {span:.1f} us, idle inside {span - busy:.1f} us "
                 f"({len(runs)} of {len(calls)} calls with this sequence)")
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--fp8", action="store_true", help="ours with teacher_precision='fp8'")
    args = parser.parse_args()
    workload = CUDA_WORKLOAD
    tensors = make_tensors(args.tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype,
                           torch.device("cuda"))
    ours = ours_provider(FP8_SETTING if args.fp8 else ours_settings()[0])
    steps = {"ours-fp8" if args.fp8 else "ours": ours(tensors, "full"), "floor": floor_provider(tensors, "full")}
    start = time.perf_counter()
    while time.perf_counter() - start < args.settle_s:
        for step in steps.values():
            tensors.clear_grads()
            step()
            torch.cuda.synchronize()
    calls = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            calls[name].append(profiled_kernels(step, tensors))
    print(f"T={args.tokens}, full step, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in steps:
        print(f"{name}:")
        print("\n".join(summary(calls[name])))


if __name__ == "__main__":
    main()
