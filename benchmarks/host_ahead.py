"""How much of a call's time is the host's: each step timed as the bench times it, and again with the
host given a head start (a GPU sleep queued before it, its own time subtracted), so that every
launch is queued before the GPU gets there, as in a training step whose model keeps the GPU busy.

The difference is the host time the GPU waits for: Python and launches before the first kernel, and
what follows the step's host reads (the label count). The floor pays its own (its first launch).

    PYTHONPATH=src python benchmarks/host_ahead.py [--tokens 1024 2048 8192] [--sleep-ms 5]
"""

import argparse
import statistics

import torch

from cosdistill.bench import CUDA_WORKLOAD, floor_provider, make_tensors, ours_provider, ours_settings

CYCLES_PER_MS = 1.98e6  # torch.cuda._sleep spins this many clock cycles per ms at the H200's boost clock


def timed(step, tensors, head_start_cycles: int, reps: int) -> float:
    """Median ms between two events around ``step``, with a GPU sleep of head_start_cycles before it."""
    times = []
    for _ in range(reps):
        tensors.clear_grads()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if head_start_cycles:
            torch.cuda._sleep(head_start_cycles)
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192])
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    workload = CUDA_WORKLOAD
    cycles = int(args.sleep_ms * CYCLES_PER_MS)
    for tokens in args.tokens:
        tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype,
                               torch.device("cuda"))
        sleep_alone = timed(lambda: None, tensors, cycles, args.reps)
        for mode in ("full", "forward"):
            steps = dict(ours=ours_provider(ours_settings()[0])(tensors, mode), floor=floor_provider(tensors, mode))
            if mode == "forward":
                steps = {name: torch.no_grad()(step) for name, step in steps.items()}
            for step in steps.values():  # warm-up (Triton compiles, cuBLAS picks its kernels)
                for _ in range(3):
                    timed(step, tensors, 0, 1)
            for round_index in range(2):
                line = []
                for name, step in steps.items():
                    plain = timed(step, tensors, 0, args.reps)
                    ahead = timed(step, tensors, cycles, args.reps) - sleep_alone
                    line.append(f"{name} {plain:7.3f} ms, host ahead {ahead:7.3f} ms (host {plain - ahead:+.3f})")
                print(f"T={tokens} {mode:7s} round {round_index}: " + "; ".join(line), flush=True)
        print(f"T={tokens}: the sleep alone {sleep_alone:.3f} ms", flush=True)
        del tensors
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
