"""Study: the host's time in one library call, stamped without a profiler, and where it goes (cProfile).

host_lead_study.py measures how much of a call's bench time the GPU spends waiting for the host; this
says where the host spends it. Each call runs behind a sleep kernel (so that the host never waits for
the GPU before the first row step) and is stamped by perf_counter: from the call to the first GEMM's
call (``chunked._logits_into``: the Python before the GPU gets any work), to the loss's return, and
through backward. Then cProfile over the same calls' Python before the first GEMM, and over whole calls.

    PYTHONPATH=src python benchmarks/host_path_study.py [--tokens 2048] [--fp8] [--calls 30]
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from cosdistill import _chunk_loop as chunked
from cosdistill import fused_linear_cosine_distill
from cosdistill.tools.bench import CUDA_WORKLOAD, make_tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    workload = CUDA_WORKLOAD
    tensors = make_tensors(args.tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype,
                           torch.device("cuda"))
    options = dict(teacher_precision="fp8") if args.fp8 else {}
    first_gemm = []
    logits_into = chunked._logits_into

    profilers = {}

    def stamped_logits_into(*call_args):
        first_gemm.append(time.perf_counter())
        if "before" in profilers and len(first_gemm) == 1:
            profilers["before"].disable()
        return logits_into(*call_args)

    chunked._logits_into = stamped_logits_into
    stamps = []

    def call():
        torch.cuda.synchronize()
        tensors.clear_grads()
        torch.cuda._sleep(5_000_000)  # a few ms: the GPU stays busy while the host runs
        first_gemm.clear()
        profiler = profilers.get("whole") or profilers.get("before")
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        loss = fused_linear_cosine_distill(*tensors.args(), **options)
        returned = time.perf_counter()
        loss.backward()
        done = time.perf_counter()
        if "whole" in profilers:
            profiler.disable()
        stamps.append((first_gemm[0] - start, returned - start, done - returned))

    for _ in range(5):
        call()
    stamps.clear()
    for _ in range(args.calls):
        call()
    names = ("call to first GEMM call", "call to loss returned", "backward")
    print(f"T={args.tokens}{' fp8' if args.fp8 else ''}, {torch.cuda.get_device_name()}, torch {torch.__version__}: "
          f"host us, median of {args.calls} calls behind a sleep kernel")
    for index, name in enumerate(names):
        print(f"  {name:26s} {1e6 * statistics.median(s[index] for s in stamps):9.1f} us")
    for part, lines in (("before", 40), ("whole", 25)):
        profilers.clear()
        profilers[part] = cProfile.Profile()
        for _ in range(args.calls):
            call()
        print(f"cProfile, {'the Python before the first GEMM' if part == 'before' else 'whole calls'}:")
        pstats.Stats(profilers[part]).sort_stats("tottime").print_stats(lines)


if __name__ == "__main__":
    main()
