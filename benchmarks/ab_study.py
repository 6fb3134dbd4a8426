"""Study: this code against another version of the library, call by call in one process (paired A/B).

The session A/Bs so far ran the bench once per code in turn, a minute apart; between such runs the
power limiter moves a 4 ms step by 0.1-0.3 ms, more than the levers now left.
Here both versions run in one process on the same tensors. After a common settle the calls
alternate (new, old, old, new, ...: the first of each pair swaps), each timed alone by CUDA events,
so that neighbouring calls share the GPU's clock. Reported per size and mode: each version's
median and the median of the paired differences (new - old) with a bootstrap 95% interval.

The other version is loaded from ``--old`` (a ``src`` folder, e.g. from ``git archive``) under the
name ``cosdistill_old``.

    PYTHONPATH=src python benchmarks/ab_study.py --old /tmp/old/src [--tokens 1024 2048] [--modes full forward]
        [--pairs 200] [--settle-s 3] [--fp8] [--vocab V --hidden H] [--json out.json]
"""

import argparse
import importlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import cosdistill
from cosdistill.tools.bench import CPU_WORKLOAD, CUDA_WORKLOAD, call_ms, make_tensors


def load_old(src: str):
    """The package under ``src``/cosdistill, imported as cosdistill_old (its imports are relative)."""
    folder = Path(tempfile.mkdtemp())
    shutil.copytree(Path(src) / "cosdistill", folder / "cosdistill_old")
    sys.path.insert(0, str(folder))
    return importlib.import_module("cosdistill_old")


def step(package, tensors, mode, options):
    def call():
        tensors.clear_grads()
        if mode == "forward":
            with torch.no_grad():
                package.fused_linear_cosine_distill(*tensors.args(), **options)
        else:
            package.fused_linear_cosine_distill(*tensors.args(), **options).backward()
    return call


def bootstrap_median_interval(values, resamples=2000, seed=0):
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def compare(new_call, old_call, device, pairs, settle_s):
    start, warm_pairs = time.perf_counter(), 0
    while warm_pairs < 3 or time.perf_counter() - start < settle_s:  # both versions warm up, alternating
        new_call(), old_call()
        warm_pairs += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    new_ms, old_ms = [], []
    for index in range(pairs):
        if index % 2:
            old_ms.append(call_ms(old_call, device))
            new_ms.append(call_ms(new_call, device))
        else:
            new_ms.append(call_ms(new_call, device))
            old_ms.append(call_ms(old_call, device))
    differences = [new - old for new, old in zip(new_ms, old_ms)]
    return dict(new_ms=statistics.median(new_ms), old_ms=statistics.median(old_ms),
                difference_ms=statistics.median(differences),
                interval_ms=bootstrap_median_interval(differences), new_calls=new_ms, old_calls=old_ms)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="a src folder holding the other version's cosdistill package")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--modes", nargs="+", choices=("full", "forward"), default=["full", "forward"])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--settle-s", type=float, help="alternating warm-up per size and mode (default: 3 on CUDA)")
    parser.add_argument("--fp8", action="store_true", help="both versions with teacher_precision='fp8'")
    parser.add_argument("--vocab", type=int, help="both heads' vocabulary (default: the seed's)")
    parser.add_argument("--hidden", type=int, help="the teacher's hidden size, the student's half (default: the seed's)")
    parser.add_argument("--device", default="cuda")  # cpu: a smoke run at a small size
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    workload = (CUDA_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD).resized(args.vocab, args.hidden)
    settle_s = args.settle_s if args.settle_s is not None else (3.0 if device.type == "cuda" else 0.0)
    old = load_old(args.old)
    options = dict(teacher_precision="fp8") if args.fp8 else {}
    report = []
    print(f"new: {Path(cosdistill.__file__).parent}, old: {args.old}; {args.pairs} pairs, settle {settle_s} s")
    for tokens in args.tokens:
        tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)
        for mode in args.modes:
            result = compare(step(cosdistill, tensors, mode, options), step(old, tensors, mode, options), device,
                             args.pairs, settle_s)
            low, high = result["interval_ms"]
            print(f"T={tokens} {mode:7s} new {result['new_ms']:8.3f} ms  old {result['old_ms']:8.3f} ms  "
                  f"new - old {result['difference_ms']:+7.3f} ms ({100 * result['difference_ms'] / result['old_ms']:+.2f}%), "
                  f"95% interval [{low:+.3f}, {high:+.3f}]")
            report.append(dict(tokens=tokens, vocab=workload.vocab, mode=mode, fp8=args.fp8, **result))
        del tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
