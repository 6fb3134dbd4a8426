"""Where the GPU idles inside one library call (forward + backward), and what the host launched next.

Profiles a few full steps with torch.profiler (CPU and CUDA activities) after warm-up, then for the
last step lists its kernels in time order and every gap of more than --min-gap-us microseconds
between one kernel's end and the next one's start, naming the host op that launched the next kernel
(the profiler's correlation). The profiler slows the host, so gaps read as upper bounds; their
places, not their exact sizes, are the point. Also prints the step's wall time, the kernels' busy
time and the time from the step's start to its first kernel.

    PYTHONPATH=src python benchmarks/idle_timeline.py [--tokens 1024] [--min-gap-us 5]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cosdistill import fused_linear_cosine_distill
from cosdistill.bench import CUDA_WORKLOAD, make_tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    args = parser.parse_args()
    workload = CUDA_WORKLOAD
    tensors = make_tensors(args.tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype,
                           torch.device("cuda"))

    def step():
        tensors.clear_grads()
        fused_linear_cosine_distill(*tensors.args()).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for index in range(3):
            torch.cuda.synchronize()
            with record_function(f"step {index}"):
                step()
            torch.cuda.synchronize()
    events = prof.events()
    last = next(e for e in events if e.name == "step 2")
    start, stop = last.time_range.start, last.time_range.end
    kernels = sorted((k for e in events for k in e.kernels if start <= k.time_range.start <= stop + 10_000),
                     key=lambda k: k.time_range.start)
    launcher = {}  # kernel -> the innermost CPU op whose range holds its launch
    for event in events:
        if start <= event.time_range.start <= stop:
            for kernel in event.kernels:
                launcher[id(kernel)] = event.name
    busy = sum(k.time_range.elapsed_us() for k in kernels)
    print(f"T={args.tokens}: step wall {(stop - start) / 1e3:.3f} ms (host), kernels busy {busy / 1e3:.3f} ms, "
          f"{len(kernels)} kernels; first kernel {(kernels[0].time_range.start - start):.0f} us after the step began")
    previous_end = kernels[0].time_range.start
    for kernel in kernels:
        gap = kernel.time_range.start - previous_end
        marker = f"  <- GPU idle {gap:7.0f} us before it" if gap > args.min_gap_us else ""
        print(f"  {kernel.time_range.start - start:9.0f} us  {kernel.time_range.elapsed_us():8.0f} us  "
              f"{kernel.name[:60]:60s} (from {launcher.get(id(kernel), '?')[:40]}){marker}")
        previous_end = max(previous_end, kernel.time_range.end)


if __name__ == "__main__":
    main()
