"""Distil a small student from a frozen teacher with DDP or FSDP2 and the data parallel normaliser.

    torchrun --nproc_per_node 2 examples/torchrun_ddp.py [--fsdp2] [--loss jsd] [--steps 5]

On GPUs each rank uses the GPU of its LOCAL_RANK and NCCL; without GPUs, the CPU and gloo. Each rank
draws its own batch with its own amount of padding (ignored labels), and rank 0 prints the loss of
the whole global batch at each step.
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from cosdistill.distributed import DataParallelCosineDistillLoss, DataParallelJSDLoss

VOCAB_STUDENT, VOCAB_TEACHER = 1000, 1024  # the teacher's vocabulary extends the student's
HIDDEN_STUDENT, HIDDEN_TEACHER = 64, 128
SEQUENCES_PER_RANK, SEQ_LEN = 4, 32


class Student(torch.nn.Module):
    """Embedding, one MLP block and an LM head. forward returns the loss: under FSDP2 the head's
    weight is whole only inside the forward of the module that was sharded."""

    def __init__(self, loss):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB_STUDENT, HIDDEN_STUDENT)
        self.block = torch.nn.Sequential(torch.nn.Linear(HIDDEN_STUDENT, HIDDEN_STUDENT), torch.nn.GELU())
        self.head = torch.nn.Linear(HIDDEN_STUDENT, VOCAB_STUDENT)
        self.loss = loss

    def forward(self, tokens, teacher_hidden, teacher_weight, labels):
        hidden = self.embedding(tokens)
        hidden = hidden + self.block(hidden)
        return self.loss(hidden, self.head.weight, teacher_hidden, teacher_weight, labels, self.head.bias)


class Teacher(torch.nn.Module):
    """A frozen random stand-in for a larger model: hidden states and an LM head weight."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB_STUDENT, HIDDEN_TEACHER)
        self.head = torch.nn.Linear(HIDDEN_TEACHER, VOCAB_TEACHER, bias=False)
        self.requires_grad_(False)


def rank_batch(step, rank, device):
    """Random tokens, next-token labels, and random padding at the end of each sequence."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB_STUDENT, (SEQUENCES_PER_RANK, SEQ_LEN + 1), generator=generator)
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    lengths = torch.randint(0, SEQ_LEN + 1, (SEQUENCES_PER_RANK, 1), generator=generator)
    labels[torch.arange(SEQ_LEN) >= lengths] = -100
    return inputs.to(device), labels.to(device)


def init_distributed():
    """The device of this rank: its GPU and NCCL, or the CPU and gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


LOSSES = {  # the cosine loss, and the generalized JSD of GKD (beta = 0: forward KL, 1: reverse KL)
    "cosine": lambda: DataParallelCosineDistillLoss(weight_hard_loss=0.5, weight_soft_loss=0.5),
    "jsd": lambda: DataParallelJSDLoss(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=2.0),
}


def train(steps, fsdp2, loss, device):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial student and teacher on every rank
    student, teacher = Student(LOSSES[loss]()).to(device), Teacher().to(device)
    if fsdp2:
        mesh = init_device_mesh(device.type, (world_size,))
        fully_shard(student.block, mesh=mesh)
        fully_shard(student, mesh=mesh)
    else:
        student = DistributedDataParallel(student, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)

    for step in range(steps):
        tokens, labels = rank_batch(step, rank, device)
        teacher_hidden = teacher.embedding(tokens)
        loss = student(tokens, teacher_hidden, teacher.head.weight, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # Each rank's loss is its share; their mean is the loss of the global batch.
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        if rank == 0:
            valid = (labels != -100).sum().item()
            print(f"step {step}: loss {global_loss.item() / world_size:.4f} (rank 0 held {valid} valid tokens)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fsdp2", action="store_true", help="shard the student with fully_shard instead of DDP")
    parser.add_argument("--loss", choices=LOSSES, default="cosine")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    train(args.steps, args.fsdp2, args.loss, init_distributed())
    # Tear down in order; a gloo group torn down otherwise now and then aborted the process at exit
    # ("terminate called without an active exception") or hung it (torch 2.13, once in CI with FSDP2).
    # The barrier waits until neither rank has a collective left on gloo's worker threads (whose work
    # objects hold tensors); then the models, which hold the group and outlive train in
    # FSDP2's reference cycles, are freed; then the group is destroyed while Python is fully alive.
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    # Even so rank 0 aborted once in CI in the interpreter's own teardown after all of this ("terminate called
    # without an active exception", with FSDP2): with nothing left to do, skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
