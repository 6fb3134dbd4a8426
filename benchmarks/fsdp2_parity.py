"""FSDP2 with the loss on two or more GPUs: after one step, the student's gradients equal those of one process
on the whole batch (relative error at bf16 level), in a hand-written ``fully_shard`` loop and under the
Trainer (accelerate's ``fsdp_version: 2``); and each GPU's peak memory.

    torchrun --nproc_per_node 2 benchmarks/fsdp2_parity.py [--shape 1b] [--tokens 8192] [--ledger benchmarks/results.csv]
    torchrun --nproc_per_node 2 benchmarks/fsdp2_parity.py --shape tiny --device cpu   (the loop on gloo; no Trainer;
        the tests call main() in processes whose group they made)

The student is Llama-3.2-1B-shaped (``--shape 1b``), the teacher a 4-layer Llama with the 8B's head (hidden 4096,
V = 128256): the heads are what the loss reads. Each rank also runs the whole batch unsharded for the reference.
A gradient further off it than the single-GPU bench's tolerance for the dtype fails the run: exit 1, no ledger rows.
"""

import argparse
import copy
import datetime
import gc
import os
import shlex
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from cosdistill.distributed import data_parallel_num_valid_tokens
from cosdistill.hf import DistillationTrainer, distill_loss, next_token_targets
from cosdistill.testing import rel_err
from cosdistill.tools.bench import TOLERANCE, append_ledger_rows, check_ledger_path

SHAPES = {  # (student, teacher, vocab)
    "1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=True),
           dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                num_key_value_heads=8, tie_word_embeddings=False), 128256),
    "tiny": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
             512),
}
OPTIONS = dict(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5)


def llama(shape, vocab, row_len, device, dtype, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**shape, vocab_size=vocab, max_position_embeddings=row_len, pad_token_id=0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)


def whole_batch(tokens, row_len, vocab, world):
    """Rows of different lengths (right padding, labels -100 there), two per rank at least."""
    generator = torch.Generator().manual_seed(0)
    rows = max(2 * world, tokens // row_len)
    lengths = [row_len - (97 * row) % (row_len // 2) for row in range(rows)]
    input_ids = torch.randint(3, vocab, (rows, row_len), generator=generator)
    attention_mask = (torch.arange(row_len)[None] < torch.tensor(lengths)[:, None]).long()
    return dict(input_ids=input_ids.masked_fill(attention_mask == 0, 0), attention_mask=attention_mask,
                labels=input_ids.masked_fill(attention_mask == 0, -100))


def gathered(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def worst_error(got_grads, reference):
    return max(rel_err(gathered(got).float(), want.grad.float()) for got, want in zip(got_grads, reference.parameters()))


def hand_written_loop(student, teacher, batch, mesh, rank, world, device):
    model = copy.deepcopy(student)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rows = len(batch["input_ids"]) // world
    share = {key: value[rank * rows: (rank + 1) * rows].to(device) for key, value in batch.items()}
    num_valid = data_parallel_num_valid_tokens(next_token_targets(share["labels"], share["attention_mask"]))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    distill_loss(model, teacher, **share, num_valid_tokens=num_valid, **OPTIONS).backward()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return [param.grad for param in model.parameters()], peak


def under_the_trainer(student, teacher, batch, folder, device):
    """One SGD step (lr 1) under accelerate's FSDP2: the parameters' change is the gradient."""
    model = copy.deepcopy(student)
    before = [param.detach().clone() for param in model.parameters()]
    rows = [dict(input_ids=ids[mask.bool()].tolist()) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]

    def collate(features):
        length = max(len(feature["input_ids"]) for feature in features)
        ids = torch.zeros(len(features), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, feature in enumerate(features):
            ids[i, : len(feature["input_ids"])], mask[i, : len(feature["input_ids"])] = torch.tensor(feature["input_ids"]), 1
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

    args = transformers.TrainingArguments(
        output_dir=folder, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
        max_steps=1, per_device_train_batch_size=len(rows) // dist.get_world_size(), optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, dataloader_num_workers=0,
        fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    trainer = DistillationTrainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                                        teacher_model=teacher, **OPTIONS)
    torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    return [old.to(device) - gathered(new.detach()) for old, new in zip(before, trainer.model.parameters())], peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--row-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ledger")
    args = parser.parse_args(argv)
    on_cuda = args.device == "cuda"
    if args.ledger:
        try:
            check_ledger_path(args.ledger, on_gpu=on_cuda)
        except ValueError as error:
            parser.error(str(error))
    owns_group = not dist.is_initialized()  # torchrun's environment; a caller may have made the group
    if owns_group:
        dist.init_process_group("nccl" if on_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if on_cuda else torch.float32
    student_shape, teacher_shape, vocab = SHAPES[args.shape]
    student = llama(student_shape, vocab, args.row_len, device, dtype, seed=0)
    teacher = llama(teacher_shape, vocab, args.row_len, device, dtype, seed=1).eval().requires_grad_(False)
    batch = whole_batch(args.tokens, args.row_len, vocab, world)
    reference = copy.deepcopy(student)
    distill_loss(reference, teacher, **{key: value.to(device) for key, value in batch.items()}, **OPTIONS).backward()
    mesh = init_device_mesh(device.type, (world,))
    results = {}
    grads, peak = hand_written_loop(student, teacher, batch, mesh, rank, world, device)
    results["fsdp2-loop"] = (worst_error(grads, reference), peak)
    if on_cuda:
        grads, peak = under_the_trainer(student, teacher, batch, f"/tmp/fsdp2_parity_{rank}", device)
        results["fsdp2-trainer"] = (worst_error(grads, reference), peak)
    peaks = {name: [None] * world for name in results}
    for name, (_, peak) in results.items():
        dist.all_gather_object(peaks[name], peak)
    tolerance = TOLERANCE[dtype]
    passed = torch.tensor(int(all(error <= tolerance for error, _ in results.values())), device=device)  # 0 for NaN
    dist.all_reduce(passed, dist.ReduceOp.MIN)  # every rank exits alike
    passed = bool(passed)
    if rank == 0:
        print(f"{world} ranks, {args.shape} student, {args.tokens} tokens, {dtype}")
        for name, (error, _) in results.items():
            per_gpu = " / ".join("-" if p is None else f"{p:.2f}" for p in peaks[name])
            print(f"{name}: worst relative error of a parameter's gradient against one process {error:.2e}; "
                  f"peak GB per GPU {per_gpu}")
        if not passed:
            print(f"check FAILED: a gradient is more than {tolerance:g} off one process's: no ledger rows")
        elif args.ledger:
            command = "torchrun benchmarks/fsdp2_parity.py " + shlex.join(argv if argv is not None else sys.argv[1:])
            gpu = f"{world} x {torch.cuda.get_device_name(device) if on_cuda else 'cpu'}"
            for name, (error, _) in results.items():  # one workload per check: its error is part of the record
                peak = max((p for p in peaks[name] if p is not None), default=None)
                workload = f"fsdp2 parity: {args.shape} student, worst grad rel err {error:.2e}, peak=per GPU"
                row = (name, args.tokens, "ours", "", "", "", "" if peak is None else f"{peak:.3f}")
                append_ledger_rows(args.ledger, gpu, workload, [row], command)
    if owns_group:
        dist.barrier()  # rank 0 may still be writing: a rank that leaves first can abort in gloo's teardown
        gc.collect()  # FSDP2's modules, in reference cycles, hold the group
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
