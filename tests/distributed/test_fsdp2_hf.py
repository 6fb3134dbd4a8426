"""A Hugging Face student under FSDP2 (``fully_shard``, gloo on the CPU), in a hand-written loop: the
loss reads the head's weight whole whatever FSDP resharded after the forward, and the gradients after two
accumulated steps equal one process's on the whole batch."""

import copy
import datetime
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from cosdistill.distributed import data_parallel_num_valid_tokens  # noqa: E402
from cosdistill.hf import distill_loss, next_token_targets  # noqa: E402
from cosdistill.testing import rel_err  # noqa: E402

WORLD = 2
# (reshard_after_forward of every unit, whether the LM head is a unit of its own)
LAYOUTS = [(None, False), (None, True), (True, False), (True, True), (False, False), (False, True)]


def tiny_llama(vocab, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
                                      vocab_size=vocab, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def batch_of(world):
    """Right-padded rows of different lengths, one -100 label: each rank's share holds a different count."""
    generator = torch.Generator().manual_seed(0)
    lengths = (9, 6, 3, 8)[: 2 * world]
    input_ids = torch.randint(3, 128, (len(lengths), max(lengths)), generator=generator)
    attention_mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[1, 2] = -100
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def two_accumulated_steps(model, teacher, batch, rank, options):
    """This rank's share of the batch, twice, over the global count: twice the whole-batch gradient."""
    share = {key: value[2 * rank: 2 * rank + 2] for key, value in batch.items()}
    num_valid = data_parallel_num_valid_tokens(next_token_targets(share["labels"], share["attention_mask"]))
    for _ in range(2):
        distill_loss(model, teacher, **share, num_valid_tokens=num_valid, **options).backward()


def write_and_tear_down(rank, folder, results):
    if rank == 0:
        with open(os.path.join(folder, "errors.json"), "w") as file:
            json.dump(results, file)
    # The example's teardown (examples/torchrun_ddp.py): without it a rank now and then aborted at exit (SIGABRT)
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def measure_rank(rank, folder):
    store = dist.FileStore(os.path.join(folder, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    options = dict(weight_hard_loss=0.3, weight_soft_loss=1.7, beta=0.7)
    student, teacher, batch = tiny_llama(128, 0), tiny_llama(144, 1), batch_of(WORLD)
    whole = copy.deepcopy(student)
    distill_loss(whole, teacher, **batch, **options).backward()
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for reshard, head_unit in LAYOUTS:
        model = copy.deepcopy(student)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        if head_unit:
            fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        two_accumulated_steps(model, teacher, batch, rank, options)
        grads = [param.grad.full_tensor() for param in model.parameters()]
        results[f"{reshard} {head_unit}"] = max(rel_err(got, 2 * want.grad) for got, want in zip(grads, whole.parameters()))
    del model, whole
    write_and_tear_down(rank, folder, results)


def measure_lora_rank(rank, folder):
    """A LoRA student under fully_shard whose teacher is its own base model: the teacher's forward runs through the
    student's root (its FSDP2 hooks gather the embeddings and norm) with the adapters off."""
    peft = pytest.importorskip("peft")
    store = dist.FileStore(os.path.join(folder, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    options = dict(weight_hard_loss=0.3, weight_soft_loss=1.7, beta=0.7, loss="jsd")
    base, batch = tiny_llama(128, 0), batch_of(WORLD)
    reference_base = copy.deepcopy(base)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
    student = peft.get_peft_model(base, config)
    whole = copy.deepcopy(student)
    distill_loss(whole, reference_base, **batch, **options).backward()
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for reshard in (None, True, False):
        model = copy.deepcopy(student)
        for layer in model.get_base_model().model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        two_accumulated_steps(model, model.get_base_model(), batch, rank, options)
        trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
        wants = [param.grad for param in whole.parameters() if param.requires_grad]
        assert trained and all("lora_" in name for name, _ in trained)
        results[str(reshard)] = max(rel_err(param.grad.full_tensor(), 2 * want) for (_, param), want in zip(trained, wants))
    del model, whole
    write_and_tear_down(rank, folder, results)


def test_a_lora_student_whose_teacher_is_its_own_base_model(tmp_path):
    pytest.importorskip("peft")
    mp.spawn(measure_lora_rank, args=(str(tmp_path),), nprocs=WORLD)
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert set(errors) == {"None", "True", "False"}
    for reshard, error in errors.items():
        assert error < 1e-5, (reshard, error)


def test_gradients_under_fully_shard_equal_one_process_on_the_whole_batch(tmp_path):
    mp.spawn(measure_rank, args=(str(tmp_path),), nprocs=WORLD)
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert set(errors) == {f"{reshard} {head_unit}" for reshard, head_unit in LAYOUTS}
    for layout, error in errors.items():
        assert error < 1e-5, (layout, error)
