"""Where the GPU idles inside one library call (forward + backward), and what the host launched next.

Profiles a few full steps with torch.profiler (CPU and CUDA activities) after warm-up, then for the
last step lists its kernels in time order and every gap of more than --min-gap-us microseconds
between one kernel's end and the next one's start, naming the host op that launched the next kernel
(the profiler's correlation). The profiler slows the host, so gaps read as upper bounds; their
places, not their exact sizes, are the point. Also prints the step's wall time, the kernels' busy
time, the time from the step's start to its first kernel and the host ops (>= --min-gap-us) before it.

    PYTHONPATH=src python benchmarks/idle_timeline.py [--tokens 1024] [--min-gap-us 5] [--no-grad]

``--no-grad`` profiles the no-grad forward (the call under torch.no_grad(), no backward) instead.
"""

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cosdistill import fused_linear_cosine_distill
from cosdistill.tools.bench import CUDA_WORKLOAD, make_tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--no-grad", action="store_true", help="the no-grad forward instead of forward + backward")
    args = parser.parse_args()
    workload = CUDA_WORKLOAD
    tensors = make_tensors(args.tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype,
                           torch.device("cuda"))

    def step():
        tensors.clear_grads()
        if args.no_grad:
            with torch.no_grad():
                fused_linear_cosine_distill(*tensors.args())
        else:
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
    with tempfile.TemporaryDirectory() as folder:  # the trace has timestamps and launch correlations
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            trace = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    step = next(e for e in trace if e["name"] == "step 2")
    start, stop = step["ts"], step["ts"] + step["dur"]
    launches = {e["args"]["correlation"]: e for e in trace
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    host_ops = [e for e in trace if e.get("cat") == "cpu_op" and start <= e["ts"] <= stop]
    kernels = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                      and start <= e["ts"] <= stop + 100_000), key=lambda e: e["ts"])

    def launched_by(kernel):
        launch = launches.get(kernel["args"].get("correlation"))
        if launch is None:
            return "?"
        holders = [op for op in host_ops if op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]]
        return min(holders, key=lambda op: op["dur"])["name"] if holders else launch["name"]

    busy = sum(k["dur"] for k in kernels)
    print(f"T={args.tokens}{' no-grad forward' if args.no_grad else ''}: step {(stop - start) / 1e3:.3f} ms on the host, "
          f"kernels busy {busy / 1e3:.3f} ms, {len(kernels)} kernels and copies")
    if not kernels:
        return
    print(f"  first kernel {kernels[0]['ts'] - start:.0f} us after the step began; the host ops before its launch:")
    first_launch = launches.get(kernels[0]["args"].get("correlation"), kernels[0])["ts"]
    for op in host_ops:
        if op["ts"] < first_launch and op["dur"] >= args.min_gap_us:
            print(f"    {op['ts'] - start:7.0f} us {op['dur']:6.0f} us  {op['name'][:70]}")
    previous_end = kernels[0]["ts"]
    for kernel in kernels:
        gap = kernel["ts"] - previous_end
        marker = f"  <- GPU idle {gap:6.0f} us before it" if gap > args.min_gap_us else ""
        print(f"  {kernel['ts'] - start:9.0f} us {kernel['dur']:7.0f} us  {kernel['name'][:50]:50s} "
              f"(from {launched_by(kernel)[:40]}){marker}")
        previous_end = max(previous_end, kernel["ts"] + kernel["dur"])

if __name__ == "__main__":
    main()
