"""Host-side overhead and the cost of grad_output != 1, at the seed workload.

* one step timed alone (synchronised before, CUDA events), grad_output 1 and 0.5;
* ten steps back to back between one pair of events (per step), grad_output 1;
* the kernels' own time from torch.profiler (sum of device time), for comparison;
* host time from the call to the first GEMM's launch (the GPU idles that long when it had no queue).

    PYTHONPATH=src python benchmarks/overhead.py [--tokens 1024,8192]
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cosdistill import chunked, fused_linear_cosine_distill
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


def host_time_to_first_gemm(tensors):
    """Seconds of Python between calling the loss and launching its first logits GEMM (median of 10)."""
    original = chunked.TeacherHead.logits_into
    launched = []

    def timed_logits_into(self, out, start, stop):
        launched.append(time.perf_counter())
        original(self, out, start, stop)

    chunked.TeacherHead.logits_into = timed_logits_into
    try:
        delays = []
        for _ in range(10):
            torch.cuda.synchronize()
            launched.clear()
            start = time.perf_counter()
            with torch.no_grad():
                fused_linear_cosine_distill(*tensors.args())
            # the student GEMM is launched just before the teacher's: this bounds it from above
            delays.append(launched[0] - start)
        return statistics.median(delays)
    finally:
        chunked.TeacherHead.logits_into = original


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
        first_gemm_ms = host_time_to_first_gemm(tensors) * 1e3
        print(f"T={tokens}: alone g=1 {alone[1.0]:.3f} ms, g=0.5 {alone[0.5]:.3f} ms; "
              f"back to back {back_to_back:.3f} ms/step; kernels {kernel_ms:.3f} ms; "
              f"host time to first GEMM {first_gemm_ms:.3f} ms")


if __name__ == "__main__":
    main()
