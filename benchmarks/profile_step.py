"""Where one forward+backward of the fused loss spends GPU time: torch.profiler's kernel table.

    PYTHONPATH=src python benchmarks/profile_step.py [--tokens 1024] [--chunk-size 1024]
"""

import argparse
import json
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from cosdistill import fused_linear_cosine_distill
from cosdistill.bench import make_tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int)
    parser.add_argument("--accum-dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    accum = torch.float32 if args.accum_dtype == "fp32" else None
    tensors = make_tensors(args.tokens, 128256, 4096, 2048, torch.bfloat16, torch.device("cuda"))

    def step():
        tensors.clear_grads()
        fused_linear_cosine_distill(*tensors.args(), chunk_size=args.chunk_size, accum_dtype=accum).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    print(f"T={args.tokens} chunk={args.chunk_size} accum={args.accum_dtype}: step {start.elapsed_time(end):.3f} ms (events)")
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=10, max_name_column_width=60))
    with tempfile.NamedTemporaryFile(suffix=".json") as trace_file:  # a trace can be exported once
        prof.export_chrome_trace(trace_file.name)
        events = json.load(open(trace_file.name))["traceEvents"]
    print_gpu_timeline(events)
    print_runtime_calls(events)


def print_runtime_calls(events, min_us=20.0):
    """CUDA runtime calls of the step that took at least min_us on the host (allocations, syncs, launches
    that blocked), with their start relative to the first one: where the host, not the GPU, spent time."""
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    if not runtime:
        return
    origin = runtime[0]["ts"]
    print(f"CUDA runtime calls >= {min_us} us on the host ({len(runtime)} calls in all):")
    for event in runtime:
        if event["dur"] >= min_us:
            print(f"  +{event['ts'] - origin:9.1f} us  {event['dur']:8.1f} us  {event['name'][:60]}")


def print_gpu_timeline(events):
    """Each GPU kernel/memset/memcpy with its start, duration and the idle gap before it, in microseconds."""
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    if not gpu:
        return
    origin, busy_until, idle = gpu[0]["ts"], gpu[0]["ts"], 0.0
    for event in gpu:
        gap = max(0.0, event["ts"] - busy_until)
        idle += gap
        busy_until = max(busy_until, event["ts"] + event["dur"])
        print(f"  +{event['ts'] - origin:9.1f} us  {event['dur']:8.1f} us  gap {gap:7.1f}  {event['name'][:60]}")
    print(f"  GPU span {busy_until - origin:.1f} us, idle inside it {idle:.1f} us")


if __name__ == "__main__":
    main()
