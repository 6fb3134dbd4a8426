"""Vocabulary-parallel heads on NCCL: correctness against the unsplit loss, and throughput vs one GPU.

    torchrun --nproc_per_node 2 benchmarks/vocab_parallel_bench.py --out DIR [--loss jsd]

Seed workload (V = 128256, teacher H = 4096, student H = 2048, bf16). Every rank builds the same full
tensors, then (1) compares its vocabulary-split loss, grad_input and grad_weight shard with the unsplit
loss on its own GPU, and (2) times forward + backward: the unsplit loss on one GPU (rank 0, the others
waiting) and the split loss on all ranks (median of per-rank CUDA-event times, the slowest rank).
Scaling efficiency = t(1 GPU) / (ranks * t(split)). Rank 0 writes vocab_parallel.json and .md to DIR. Without
GPUs (a smoke run at small --sizes) the ranks run on the CPU over gloo.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from cosdistill import fused_linear_cosine_distill, fused_linear_jsd
from cosdistill.distributed import VocabParallelOptions
from cosdistill.testing import rel_err
from cosdistill.tools.bench import make_tensors, median_ms


def shard_tensors(tensors, options):
    """This rank's head shards (the student's a fresh leaf) beside the shared hidden states and labels."""
    return (tensors.student_input, options.student_rows(tensors.student_weight).detach().clone().requires_grad_(),
            tensors.teacher_input, options.teacher_rows(tensors.teacher_weight), tensors.labels)


LOSSES = {"cosine": fused_linear_cosine_distill, "jsd": fused_linear_jsd}


def step(loss, args, **kwargs):
    def run():
        args[1].grad = None  # the shard is not among the harness' tensors, whose grads it clears
        loss(*args, **kwargs).backward()
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--check-tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="results")
    parser.add_argument("--sizes", type=int, nargs=3, default=[128256, 4096, 2048], help="V, H, student H")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="cosine",
                        help="the soft term (the JSD gathers two per-token tensors per chunk, the cosine one)")
    args = parser.parse_args()
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

    tensors = make_tensors(args.check_tokens, vocab, hidden, student_hidden, torch.bfloat16, device)
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
    del tensors, split_args, want, got, want_grads

    for tokens in args.tokens:
        tensors = make_tensors(tokens, vocab, hidden, student_hidden, torch.bfloat16, device)
        one_gpu_ms = median_ms(step(loss, tensors.args()), tensors, device, 3, args.reps) if rank == 0 else 0.0
        dist.barrier()
        split_step = step(loss, shard_tensors(tensors, options), vocab_parallel=options)
        split_ms = torch.tensor(median_ms(split_step, tensors, device, 3, args.reps), device=device)
        dist.all_reduce(split_ms, op=dist.ReduceOp.MAX)
        one_gpu = torch.tensor(one_gpu_ms, device=device)
        dist.broadcast(one_gpu, 0)
        report["timings"].append(dict(tokens=tokens, one_gpu_ms=one_gpu.item(), split_ms=split_ms.item(),
                                      efficiency=one_gpu.item() / (ranks * split_ms.item())))
        del tensors, split_step

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab_parallel.json"), "w") as file:
            json.dump(report, file, indent=1)
        lines = [f"{args.loss}: {ranks} x {report['gpu']}, torch {report['torch']}, V={vocab}, H={hidden}/{student_hidden}, "
                 "bf16",
                 "", "| T | 1 GPU ms | split ms | scaling efficiency |", "|---|---|---|---|"]
        lines += [f"| {t['tokens']} | {t['one_gpu_ms']:.2f} | {t['split_ms']:.2f} | {t['efficiency']:.2f} |"
                  for t in report["timings"]]
        lines += ["", "Errors of the split against the unsplit loss (relative):"]
        lines += [f"- {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in e.items()) for name, e in report["errors"].items()]
        text = "\n".join(lines)
        print(text)
        with open(os.path.join(args.out, "vocab_parallel.md"), "w") as file:
            file.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
