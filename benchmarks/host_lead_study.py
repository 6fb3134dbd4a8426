"""Study: how much of a call's bench time is the host's lead before the GPU's first kernel.

The bench times each call from an idle GPU (``bench.call_ms``), so the host's work before the first
kernel (checks, set-up, launches) counts in full. In a training loop the loss is queued behind the
model's forward and that lead hides. This times each provider both ways, alternating call by call after
a settle: from an idle GPU, as the bench does, and from a busy one (a sleep kernel of ``--busy-ms``
queued ahead of the start event, so that the host has queued the step's first kernels before the GPU
reaches them). lead = median idle-start time - median busy-start time; what the GPU idles later in the
call (waiting for the host) stays in both.

    PYTHONPATH=src python benchmarks/host_lead_study.py [--tokens 1024 2048] [--providers ours ours-fp8 floor]
        [--calls 40] [--settle-s 3] [--busy-ms 1] [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch

from cosdistill.tools.bench import (
    CUDA_WORKLOAD,
    FORCED_SETTINGS,
    FP8_SETTING,
    call_ms,
    floor_provider,
    make_tensors,
    ours_provider,
    ours_settings,
)

BUILDERS = {
    "ours": ours_provider(ours_settings()[0]),
    "ours-fp8": ours_provider(FP8_SETTING),
    **{setting.label: ours_provider(setting) for setting in FORCED_SETTINGS.values()},
    "floor": floor_provider,
}


def busy_start_ms(step, busy_cycles: int) -> float:
    """As bench.call_ms, but with a sleep kernel queued before the start event: the GPU busy meanwhile."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(busy_cycles)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def sleep_cycles(milliseconds: float) -> int:
    """Cycles of torch.cuda._sleep that take about this long at the present clock."""
    cycles = 1_000_000
    for _ in range(3):  # the clock moves under load: measure at the running one
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        cycles = max(1, int(cycles * milliseconds / start.elapsed_time(end)))
    return cycles


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--providers", nargs="+", choices=sorted(BUILDERS), default=["ours", "ours-fp8", "floor"])
    parser.add_argument("--modes", nargs="+", choices=("full", "forward"), default=["full"])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--busy-ms", type=float, default=1.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    workload, report = CUDA_WORKLOAD, []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms, median of {args.calls} calls each way")
    for tokens in args.tokens:
        tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype,
                               torch.device("cuda"))
        for mode in args.modes:
            for name in args.providers:
                step = BUILDERS[name](tensors, mode)

                def call(step=step, tensors=tensors):
                    tensors.clear_grads()
                    step()

                start = time.perf_counter()
                while time.perf_counter() - start < args.settle_s:
                    call()
                    torch.cuda.synchronize()
                busy = sleep_cycles(args.busy_ms)
                idle_ms, busy_ms = [], []
                for index in range(args.calls):  # alternate, the first of each pair swapping
                    for busy_start in ((False, True) if index % 2 else (True, False)):
                        if busy_start:
                            busy_ms.append(busy_start_ms(call, busy))
                        else:
                            idle_ms.append(call_ms(call, torch.device("cuda")))
                idle, queued = statistics.median(idle_ms), statistics.median(busy_ms)
                print(f"T={tokens:6d} {mode:7s} {name:12s} idle start {idle:8.3f}  busy start {queued:8.3f}  "
                      f"lead {idle - queued:6.3f} ms ({(idle - queued) / idle:+.2%})")
                report.append(dict(tokens=tokens, mode=mode, provider=name, idle_ms=idle, busy_ms=queued))
        del tensors
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
