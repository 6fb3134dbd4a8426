"""Hugging Face models whose LM heads are split along the vocabulary for tensor parallelism (two processes, gloo on
the CPU): transformers' ``tp_plan="auto"`` and torch's ``ColwiseParallel`` on the head alone. ``distill_loss`` runs
the loss over the heads' shards (``vocab_parallel``); the loss and every parameter's gradient, gathered, equal one
process's with the models whole. Teachers split the same way or whole on every rank, with a larger vocabulary.
With COSDISTILL_DISTRIBUTED_BACKEND=nccl each rank runs on its own GPU (benchmarks/two_gpus.sh)."""

import datetime
import gc
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module  # noqa: E402

from cosdistill.hf import distill_loss  # noqa: E402
from cosdistill.testing import rel_err  # noqa: E402

WORLD = 2
BACKEND = os.environ.get("COSDISTILL_DISTRIBUTED_BACKEND", "gloo")
VOCAB_STUDENT, VOCAB_TEACHER = 101, 117  # odd: the shards differ in size
OPTIONS = {"cosine": dict(weight_hard_loss=0.3, weight_soft_loss=1.7, beta=0.7),
           "jsd": dict(weight_hard_loss=0.3, weight_soft_loss=1.7, beta=0.3, temperature=0.8)}
# (how the student is split, the teacher's vocabulary, how the teacher is split)
CASES = [("tp_plan", VOCAB_STUDENT, "tp_plan"), ("tp_plan", VOCAB_STUDENT, "whole"), ("tp_plan", VOCAB_TEACHER, "whole"),
         ("colwise", VOCAB_STUDENT, "colwise"), ("colwise", VOCAB_TEACHER, "whole")]


def tiny_llama(vocab, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
                                      vocab_size=vocab, pad_token_id=0, tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def batch():
    """Right-padded rows of different lengths, one -100 label."""
    generator = torch.Generator().manual_seed(0)
    lengths = (9, 6, 3)
    input_ids = torch.randint(3, VOCAB_STUDENT, (len(lengths), max(lengths)), generator=generator)
    attention_mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[1, 2] = -100
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def device():
    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def _distributed_config_takes(field):
    config = getattr(getattr(transformers, "distributed", None), "DistributedConfig", None)
    return config is not None and field in config.__dataclass_fields__


def tensor_parallel():
    """from_pretrained's arguments for transformers' own plan, as the example passes them: a DistributedConfig where
    from_pretrained takes one (tp_plan= alone is deprecated there), tp_plan= before. Built per load: the config reads
    its size from WORLD_SIZE when made."""
    if _distributed_config_takes("tp_plan"):
        return dict(distributed_config=transformers.distributed.DistributedConfig(tp_plan="auto"))
    return dict(tp_plan="auto")


def split(folder, name, vocab, seed, how):
    """The model as this rank holds it: transformers' tensor parallelism, torch's ColwiseParallel on its head, or
    whole."""
    if how == "tp_plan":  # on the rank's GPU (LOCAL_RANK) where there is one
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, name), **tensor_parallel(),
                                                                  attn_implementation="eager")
        assert isinstance(model.lm_head.weight, DTensor), "transformers loaded the model whole"
        return model
    model = tiny_llama(vocab, seed).to(device())
    if how == "colwise":
        mesh = init_device_mesh(device().type, (WORLD,))
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def batch_on_device():
    return {key: value.to(device()) for key, value in batch().items()}


def gradients(model):
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu().clone()
            for name, p in model.named_parameters() if p.grad is not None}


def refusals(folder):
    """What each refused combination raises: heads split over ranks that disagree on the student's rows, a teacher
    split where the student is whole, and the Trainers given a student split otherwise than the Trainer's tensor
    parallelism (a head split by hand: the Trainer would count each rank's labels; tp_plan students:
    test_trainers_sharded.py)."""
    from cosdistill.hf import DistillationTrainer
    from cosdistill.trl import DistillationGKDTrainer
    from test_trl_gkd import chat_dataset, chat_tokenizer, gkd_config

    student = split(folder, "student", VOCAB_STUDENT, 0, "tp_plan")
    split_by_hand = split(folder, None, VOCAB_STUDENT, 0, "colwise")
    attempts = {
        "teacher split otherwise": lambda: distill_loss(
            student, split(folder, f"teacher{VOCAB_TEACHER}", VOCAB_TEACHER, 1, "tp_plan"), **batch_on_device()),
        "teacher split, student whole": lambda: distill_loss(
            tiny_llama(VOCAB_STUDENT, 0).to(device()),
            split(folder, f"teacher{VOCAB_STUDENT}", VOCAB_STUDENT, 1, "tp_plan"), **batch_on_device()),
        # one row over two ranks: torch.chunk gives the second none (rank 1 raised alone; rank 0 waited in the
        # loss's first collective until the timeout)
        "a rank without rows": lambda: distill_loss(
            split(folder, None, 1, 0, "colwise"), tiny_llama(1, 1).to(device()),
            input_ids=torch.zeros(2, 5, dtype=torch.long, device=device()),
            labels=torch.zeros(2, 5, dtype=torch.long, device=device())),
        "DistillationTrainer": lambda: DistillationTrainer(
            model=split_by_hand, teacher_model=tiny_llama(VOCAB_STUDENT, 1),
            args=transformers.TrainingArguments(output_dir=os.path.join(folder, "out"), use_cpu=True, report_to="none")),
        "DistillationGKDTrainer": lambda: DistillationGKDTrainer(
            model=split_by_hand, teacher_model=tiny_llama(VOCAB_STUDENT, 1), args=gkd_config(os.path.join(folder, "out")),
            train_dataset=chat_dataset(), processing_class=chat_tokenizer()),
    }
    from cosdistill.hf import check_tensor_parallel
    from cosdistill.trl import DistillationTrainer as TRLDistillationTrainer
    from test_trl_distillation import config, prompts, tokenizer

    def trainer_seen_by_the_check(processes, average_tokens_across_devices=True):
        return types.SimpleNamespace(
            get_tp_size=lambda: WORLD, args=types.SimpleNamespace(
                average_tokens_across_devices=average_tokens_across_devices),
            accelerator=types.SimpleNamespace(num_processes=processes))

    whole_teacher = tiny_llama(VOCAB_STUDENT, 1)
    # transformers' pipeline stages: the head on the last rank alone (every rank raises before any forward)
    if _distributed_config_takes("pp_size"):
        attempts["pipeline parallelism"] = lambda: distill_loss(
            transformers.AutoModelForCausalLM.from_pretrained(
                os.path.join(folder, "student"), distributed_config=transformers.distributed.DistributedConfig(
                    pp_size=WORLD), attn_implementation="eager"), whole_teacher.to(device()), **batch_on_device())
    attempts["tensor parallelism beside data parallelism"] = lambda: check_tensor_parallel(
        trainer_seen_by_the_check(2 * WORLD), student, whole_teacher)
    attempts["tokens counted per device"] = lambda: check_tensor_parallel(
        trainer_seen_by_the_check(WORLD, average_tokens_across_devices=False), student, whole_teacher)
    split_teacher = split(folder, f"teacher{VOCAB_STUDENT}", VOCAB_STUDENT, 1, "tp_plan")
    attempts["a split teacher beside a whole student"] = lambda: DistillationTrainer(
        model=tiny_llama(VOCAB_STUDENT, 0), teacher_model=split_teacher,
        args=transformers.TrainingArguments(output_dir=os.path.join(folder, "out"), use_cpu=True, report_to="none"))
    attempts["TRL's DistillationTrainer, a split teacher"] = lambda: TRLDistillationTrainer(
        model=tiny_llama(VOCAB_STUDENT, 0), teacher_model=split_teacher, args=config(os.path.join(folder, "out")),
        train_dataset=prompts(), processing_class=tokenizer())
    attempts["TRL's DistillationTrainer"] = lambda: TRLDistillationTrainer(
        model=student, teacher_model=tiny_llama(VOCAB_STUDENT, 1), args=config(os.path.join(folder, "out")),
        train_dataset=prompts(), processing_class=tokenizer())
    if BACKEND == "nccl":  # the Trainers' refusal comes before any device is used: the CPU run tests it
        for name in ("DistillationTrainer", "DistillationGKDTrainer", "TRL's DistillationTrainer",
                     "a split teacher beside a whole student", "TRL's DistillationTrainer, a split teacher"):
            del attempts[name]
    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = "nothing raised"
        except ValueError as error:
            errors[name] = str(error)
    return errors


def init_rank(rank, folder):
    """This rank's process group over a FileStore in ``folder`` and the environment transformers reads."""
    store = dist.FileStore(os.path.join(folder, "store"), WORLD)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    # transformers reads these; the process group (FileStore) is up already, so the address is never dialled
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    torch.set_num_threads(1)


def spawn_ranks(tmp_path_factory, measure_rank):
    """The folder in which the tiny student and teachers were saved and ``measure_rank(rank, folder)`` ran on every
    rank."""
    folder = tmp_path_factory.mktemp("ranks")
    tiny_llama(VOCAB_STUDENT, 0).save_pretrained(folder / "student")
    for vocab in (VOCAB_STUDENT, VOCAB_TEACHER):
        tiny_llama(vocab, 1).save_pretrained(folder / f"teacher{vocab}")
    mp.spawn(measure_rank, args=(str(folder),), nprocs=WORLD)
    return folder


def measure_rank(rank, folder):
    init_rank(rank, folder)
    results = {}
    for student_how, vocab_teacher, teacher_how in CASES:
        for loss, options in OPTIONS.items():
            student = split(folder, "student", VOCAB_STUDENT, 0, student_how)
            teacher = split(folder, f"teacher{vocab_teacher}", vocab_teacher, 1, teacher_how)
            value, soft, hard = distill_loss(student, teacher, **batch_on_device(), loss=loss,
                                             return_soft_hard_loss=True, **options)
            value.backward()
            results[student_how, vocab_teacher, teacher_how, loss] = (
                torch.stack([value, soft, hard]).detach().cpu(), gradients(student))
    results["errors"] = refusals(folder)
    if rank == 0:
        torch.save(results, os.path.join(folder, "results.pt"))
    # The torchrun example's teardown (examples/torchrun_ddp.py): the models, which hold the mesh's group, are freed
    # before the group is destroyed
    dist.barrier()
    del student, teacher, value, soft, hard
    gc.collect()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if BACKEND == "nccl" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"COSDISTILL_DISTRIBUTED_BACKEND=nccl needs {WORLD} CUDA GPUs")
    return torch.load(spawn_ranks(tmp_path_factory, measure_rank) / "results.pt")


@pytest.mark.parametrize("loss", OPTIONS)
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, case)) for case in CASES])
def test_split_heads_give_the_whole_models_loss_and_gradients(results, case, loss):
    values, grads = results[(*case, loss)]
    student = tiny_llama(VOCAB_STUDENT, 0)
    value, soft, hard = distill_loss(student, tiny_llama(case[1], 1), **batch(), loss=loss, return_soft_hard_loss=True,
                                     **OPTIONS[loss])
    value.backward()
    assert rel_err(values, torch.stack([value, soft, hard]).detach()) < 1e-5
    want = gradients(student)
    assert grads.keys() == want.keys()
    errors = {name: rel_err(grads[name], want[name]) for name in want}
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("case, message", [
    ("teacher split otherwise", r"the splits must agree on the student's vocabulary"),
    ("teacher split, student whole", r"the teacher's LM head is split over ranks \(tensor parallel\) and the student's is not"),
    ("a rank without rows", r"over 2 ranks as torch.chunk does, 1 rows each, which leaves the last rank none"),
    ("pipeline parallelism", r"student is loaded for pipeline parallelism \(transformers' DistributedConfig pp_size=2\)"),
    ("DistillationTrainer", r"DistillationTrainer: the student's LM head is split over 2 ranks for tensor parallelism but "
                            r"the Trainer's tensor-parallel size is 1"),
    ("DistillationGKDTrainer", r"DistillationGKDTrainer: the student's LM head is split over 2 ranks .* size is 1"),
    ("TRL's DistillationTrainer", r"DistillationTrainer does not support a student whose LM head is split for tensor"),
    ("tensor parallelism beside data parallelism", r"tensor parallelism over 2 of 4 processes \(data parallelism or FSDP"),
    ("tokens counted per device", r"needs average_tokens_across_devices=True: without it transformers still divides"),
    ("a split teacher beside a whole student", r"DistillationTrainer: the teacher's LM head is split over ranks"),
    ("TRL's DistillationTrainer, a split teacher", r"does not support a teacher whose LM head is split for tensor"),
])
def test_refused_splits_raise(results, case, message):
    if case not in results["errors"]:
        pytest.skip("the Trainers' refusal is tested on the CPU")
    assert re.search(message, results["errors"][case]), results["errors"][case]


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_torchrun_example(loss):
    """examples/tensor_parallel_hf.py: two ranks, the models loaded with tp_plan="auto", a few optimizer steps."""
    if BACKEND == "nccl":
        pytest.skip("the example picks its backend itself; the CPU run tests it")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo / "src"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
               "examples/tensor_parallel_hf.py", "--steps", "2", "--loss", loss]
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"step 1: loss \d+\.\d+", result.stdout), result.stdout
