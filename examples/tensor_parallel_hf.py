"""Distil a Hugging Face student loaded for tensor parallelism (tp_plan "auto") from a teacher loaded alike.

    torchrun --nproc_per_node 2 examples/tensor_parallel_hf.py [--loss jsd] [--steps 5]

Needs transformers. On GPUs each rank uses the GPU of its LOCAL_RANK and NCCL; without GPUs, the CPU and gloo.
Each rank holds its shard of every layer and of both LM heads; cosdistill.hf.distill_loss runs the loss over
the heads' shards (vocabulary-parallel), never gathering either model's logits. Every rank sees the same batch
and prints the same loss; rank 0 prints it. Two tiny random models stand in for real checkpoints, which load the
same way: AutoModelForCausalLM.from_pretrained("org/name", **tensor_parallel()).
"""

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import transformers

from cosdistill.hf import distill_loss

VOCAB = 1000  # one tokenizer, so both heads split alike
SEQUENCES, SEQ_LEN = 4, 32


def save_tiny_llama(folder, hidden, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def tensor_parallel():
    """from_pretrained's arguments for transformers' own plan: a DistributedConfig where it takes one (from_pretrained's
    tp_plan= alone is deprecated there), tp_plan= before."""
    config = getattr(getattr(transformers, "distributed", None), "DistributedConfig", None)
    if config is not None and "tp_plan" in {field.name for field in dataclasses.fields(config)}:
        return dict(distributed_config=config(tp_plan="auto"))
    return dict(tp_plan="auto")


def batch(step, device):
    """The same padded batch on every rank (a tensor-parallel group shares its data)."""
    generator = torch.Generator().manual_seed(step)
    input_ids = torch.randint(0, VOCAB, (SEQUENCES, SEQ_LEN), generator=generator)
    lengths = torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (SEQUENCES,), generator=generator)
    attention_mask = (torch.arange(SEQ_LEN)[None] < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {key: value.to(device) for key, value in dict(input_ids=input_ids, attention_mask=attention_mask,
                                                          labels=labels).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss", choices=["cosine", "jsd"], default="cosine")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    on_gpus = torch.cuda.is_available()
    if on_gpus:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpus else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpus else torch.device("cpu")
    folders = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folders)  # rank 0 writes the checkpoints, every rank loads its shards of them
    student_folder, teacher_folder = (os.path.join(folders[0], name) for name in ("student", "teacher"))
    if dist.get_rank() == 0:
        save_tiny_llama(student_folder, hidden=64, seed=0)
        save_tiny_llama(teacher_folder, hidden=128, seed=1)
    dist.barrier()
    student = transformers.AutoModelForCausalLM.from_pretrained(student_folder, **tensor_parallel())
    teacher = transformers.AutoModelForCausalLM.from_pretrained(teacher_folder, **tensor_parallel()).eval()
    teacher.requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    options = dict(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5 if args.loss == "jsd" else 1.0)
    for step in range(args.steps):
        loss = distill_loss(student, teacher, **batch(step, device), loss=args.loss, **options)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folders[0])
    dist.destroy_process_group()
    # As examples/torchrun_ddp.py: skip the interpreter's teardown, in which a rank now and then aborted.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
