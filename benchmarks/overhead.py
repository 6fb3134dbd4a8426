"""Host-side overhead and the cost of grad_output != 1, at the seed workload.

* one step timed alone (synchronised before, CUDA events), grad_output 1 and 0.5;
* ten steps back to back between one pair of events (per step), grad_output 1;
* the kernels' own time from torch.profiler (sum of device time), for comparison.

    PYTHONPATH=src python benchmarks/overhead.py [--tokens 1024,8192]
"""

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from cosdistill import fused_linear_cosine_distill
from cosdistill.bench import make_tensors


def step(tensors, grad_output):
    tensors.clear_grads()
    loss = fused_linear_cosine_distill(*tensors.args())
    loss.backward(torch.full_like(loss, grad_output))


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1024,8192")
    args = parser.parse_args()
    for tokens in map(int, args.tokens.split(",")):
        tensors = make_tensors(tokens, 128256, 4096, 2048, torch.bfloat16, torch.device("cuda"))
        for _ in range(3):
            step(tensors, 1.0)
        alone = {g: timed(lambda: step(tensors, g), 10) for g in (1.0, 0.5)}
        back_to_back = timed(lambda: [step(tensors, 1.0) for _ in range(10)], 3) / 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(tensors, 1.0)
            torch.cuda.synchronize()
        kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        print(f"T={tokens}: alone g=1 {alone[1.0]:.3f} ms, g=0.5 {alone[0.5]:.3f} ms; "
              f"back to back {back_to_back:.3f} ms/step; kernels {kernel_ms:.3f} ms")


if __name__ == "__main__":
    main()
