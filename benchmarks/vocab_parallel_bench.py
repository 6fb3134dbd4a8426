"""Vocabulary-parallel heads on NCCL: correctness against the unsplit loss, and throughput vs one GPU.

    torchrun --nproc_per_node 2 benchmarks/vocab_parallel_bench.py --out DIR [--loss jsd] [--ledger CSV]

Seed workload (V = 128256, teacher H = 4096, student H = 2048, bf16). Every rank builds the same full tensors,
then (1) compares its vocabulary-split loss, grad_input and grad_weight shard with the unsplit loss on its own
GPU, and (2) times forward + backward in interleaved rounds (CUDA events, the median of each round's medians,
each provider after --settle-s seconds of its calls): the unsplit loss and its four GEMMs on one GPU (rank 0,
the others waiting), and on all ranks the split loss, the split loss with its per-call check skipped (the
check's cost), and each rank's shard's four GEMMs (a split's time is its slowest rank's). Scaling efficiency =
t(1 GPU) / (ranks * t(split)). Rank 0 writes vocab_parallel.json and .md to DIR and, with --ledger, appends the
rows (ratios to the unsplit floor) where the split matched the unsplit loss; where it did not, every rank exits 1
and nothing is appended. Without GPUs (a smoke run at small --sizes) the ranks run on the CPU over gloo.
"""

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import sys

import torch
import torch.distributed as dist

from cosdistill import fused_linear_cosine_distill, fused_linear_jsd
from cosdistill.distributed import VocabParallelOptions
from cosdistill.testing import rel_err, split_check
from cosdistill.tools import bench


def shard_tensors(tensors, options):
    """This rank's head shards (the student's a fresh leaf) beside the shared hidden states and labels."""
    return (tensors.student_input, options.student_rows(tensors.student_weight).detach().clone().requires_grad_(),
            tensors.teacher_input, options.teacher_rows(tensors.teacher_weight), tensors.labels)


LOSSES = {"cosine": fused_linear_cosine_distill, "jsd": fused_linear_jsd}
LOSS_TOLERANCE = 1e-5  # the split's loss differs from the unsplit one's by the order of its fp32 sums


def step(loss, args, **kwargs):
    def run():
        args[1].grad = None  # the shard is not among the harness' tensors, whose grads it clears
        loss(*args, **kwargs).backward()
    return run


@contextlib.contextmanager
def split_check_skipped():
    """The split without its per-call check (_split_check.check_vocab_parallel and queue_hash_check): an A/B of its
    cost."""
    check, queue = split_check.check_vocab_parallel, split_check.queue_hash_check
    split_check.check_vocab_parallel = lambda *args: None
    split_check.queue_hash_check = lambda *args: lambda: None
    try:
        yield
    finally:
        split_check.check_vocab_parallel, split_check.queue_hash_check = check, queue


def unchecked(run):
    def run_unchecked():
        with split_check_skipped():
            run()
    return run_unchecked


ON_ONE_GPU = ("ours-unsplit", "floor-unsplit")  # rank 0 alone, the whole heads; the others wait


def providers(loss, tensors, options):
    """label -> (step, the Tensors whose grads it clears); the floors' outputs allocated here."""
    shards = shard_tensors(tensors, options)
    shard_floor = bench.Tensors(*shards)
    split = step(loss, shards, vocab_parallel=options)
    return {"ours-unsplit": (step(loss, tensors.args()), tensors),
            "floor-unsplit": (bench.floor_provider(tensors, "full"), tensors),
            "ours-split": (split, tensors),
            "ours-split-unchecked": (unchecked(split), tensors),
            "floor-shard": (bench.floor_provider(shard_floor, "full"), shard_floor)}


def settle(run, tensors, device, seconds: float, together: bool) -> None:
    """At least ``seconds`` of calls, as the single-GPU bench's settle (bench.Workload.settle_s: the power limiter
    cuts the clock under load). A split's calls hold collectives, so with ``together`` every rank makes as many:
    the count that fills the time on the slowest rank."""
    if not seconds:
        return
    tensors.clear_grads()
    calls = torch.tensor([math.ceil(seconds * 1e3 / bench.call_ms(run, device))], device=device)
    if together:
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    for _ in range(int(calls.item())):
        tensors.clear_grads()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time is the GPU's, not the queue's


def time_rounds(steps, device, rounds, reps, rank, settle_s=0.0) -> dict:
    """label -> (each round's median ms, slowest rank's; peak GB above inputs, largest rank's). Each round times
    every label in turn, starting one later than the round before, each after ``settle_s`` seconds of its calls;
    ON_ONE_GPU labels run on rank 0 alone."""
    order = list(steps)
    times = {label: [] for label in order}
    peaks = {}
    for round_index in range(rounds):
        for label in bench.round_order(order, round_index):
            run, tensors = steps[label]
            ms, peak = 0.0, 0.0
            if rank == 0 or label not in ON_ONE_GPU:
                settle(run, tensors, device, settle_s, together=label not in ON_ONE_GPU)
                ms = bench.median_ms(run, tensors, device, 3 if round_index == 0 else 1, reps)
                if round_index == rounds - 1:
                    peak = bench.peak_gb_above_inputs(run, tensors, device) or 0.0
            slowest = torch.tensor([ms, peak], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[label].append(slowest[0].item())
            peaks[label] = slowest[1].item()
    return {label: (times[label], peaks[label]) for label in order}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--check-tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10, help="calls per provider and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle-s", type=float, help="seconds of each provider's calls before it is timed, in every "
                        "round (default: the single-GPU bench's on CUDA, 0 on the CPU)")
    parser.add_argument("--ledger", help="append the timings to this ledger CSV (benchmarks/results.csv)")
    parser.add_argument("--out", default="results")
    parser.add_argument("--sizes", type=int, nargs=3, default=[128256, 4096, 2048], help="V, H, student H")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="cosine",
                        help="the soft term (the JSD gathers two per-token tensors per chunk, the cosine one)")
    args = parser.parse_args()
    if args.ledger:
        try:
            bench.check_ledger_path(args.ledger, on_gpu=torch.cuda.is_available(), rounds=args.rounds)
        except ValueError as error:
            parser.error(str(error))
    loss = LOSSES[args.loss]

    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:  # a CPU smoke run: gloo
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    vocab, hidden, student_hidden = args.sizes
    options = VocabParallelOptions.even_split(vocab)
    report = {"loss": args.loss, "ranks": ranks, "vocab": vocab, "hidden": hidden, "student_hidden": student_hidden,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "errors": {}, "timings": []}

    tensors = bench.make_tensors(args.check_tokens, vocab, hidden, student_hidden, torch.bfloat16, device)
    want = loss(*tensors.args(), return_soft_hard_loss=True)
    want[0].backward()
    want_grads = (tensors.student_input.grad, options.student_rows(tensors.student_weight.grad))
    tensors.clear_grads()
    split_args = shard_tensors(tensors, options)
    got = loss(*split_args, return_soft_hard_loss=True, vocab_parallel=options)
    got[0].backward()
    errors = {name: rel_err(g, w) for name, g, w in zip(("loss", "soft", "hard"), got, want)}
    errors.update(grad_input=rel_err(tensors.student_input.grad, want_grads[0]),
                  grad_weight_shard=rel_err(split_args[1].grad, want_grads[1]))
    gathered = [None] * ranks
    dist.all_gather_object(gathered, errors)
    report["errors"] = {f"rank {r}": e for r, e in enumerate(gathered)}
    worst_loss = max(max(e["loss"], e["soft"], e["hard"]) for e in gathered)  # the same on every rank
    worst_grad = max(max(e["grad_input"], e["grad_weight_shard"]) for e in gathered)
    report["check_passed"] = worst_loss <= LOSS_TOLERANCE and worst_grad <= bench.TOLERANCE[torch.bfloat16]
    del tensors, split_args, want, got, want_grads

    ledger_rows = []
    settle_s = args.settle_s if args.settle_s is not None else bench.CUDA_WORKLOAD.settle_s if device.type == "cuda" else 0.0
    for tokens in args.tokens:
        tensors = bench.make_tensors(tokens, vocab, hidden, student_hidden, torch.bfloat16, device)
        timed = time_rounds(providers(loss, tensors, options), device, args.rounds, args.reps, rank, settle_s)
        floor_by_round = timed["floor-unsplit"][0]
        medians = {label: statistics.median(by_round) for label, (by_round, _) in timed.items()}
        report["timings"].append(dict(tokens=tokens, ms=medians, one_gpu_ms=medians["ours-unsplit"],
                                      split_ms=medians["ours-split"],
                                      efficiency=medians["ours-unsplit"] / (ranks * medians["ours-split"])))
        for label, (by_round, peak) in timed.items():
            ratios = [ms / floor for ms, floor in zip(by_round, floor_by_round)]
            ledger_rows.append(("full", tokens, label, f"{medians[label]:.4f}",
                                f"{medians[label] / medians['floor-unsplit']:.4f}",
                                " ".join(f"{ratio:.4f}" for ratio in ratios),
                                f"{peak:.3f}" if device.type == "cuda" else ""))
        del tensors, timed

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab_parallel.json"), "w") as file:
            json.dump(report, file, indent=1)
        lines = [f"{args.loss}: {ranks} x {report['gpu']}, torch {report['torch']}, V={vocab}, H={hidden}/{student_hidden}, "
                 f"bf16, {args.rounds} rounds", "",
                 "| T | 1 GPU ms | 1 GPU floor ms | split ms | split, check skipped ms | shard floor ms | scaling efficiency |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {t['tokens']} | " + " | ".join(f"{t['ms'][label]:.2f}" for label in (
            "ours-unsplit", "floor-unsplit", "ours-split", "ours-split-unchecked", "floor-shard")) +
            f" | {t['efficiency']:.2f} |" for t in report["timings"]]
        lines += ["", "Errors of the split against the unsplit loss (relative):"]
        lines += [f"- {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in e.items()) for name, e in report["errors"].items()]
        text = "\n".join(lines)
        print(text)
        with open(os.path.join(args.out, "vocab_parallel.md"), "w") as file:
            file.write(text + "\n")
        if not report["check_passed"]:
            print(f"check FAILED: the split's losses {worst_loss:.1e} (at most {LOSS_TOLERANCE:g}) or gradients "
                  f"{worst_grad:.1e} (at most {bench.TOLERANCE[torch.bfloat16]:g}) off the unsplit ones: no ledger rows")
        elif args.ledger:
            workload = (f"V={vocab} H={hidden} Hs={student_hidden} bf16 rounds={args.rounds}"
                        + ("" if args.loss == "cosine" else f" loss={args.loss}") + f" vocab-parallel ranks={ranks}")
            command = "torchrun --nproc_per_node " + str(ranks) + " " + shlex.join(
                ["benchmarks/vocab_parallel_bench.py", *sys.argv[1:]])
            bench.append_ledger_rows(args.ledger, report["gpu"], workload, ledger_rows, command)
    dist.destroy_process_group()
    return 0 if report["check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
