"""DDP and FSDP2 on gloo (CPU): with the data parallel normaliser, the gradients of one process on
the whole batch, also when ranks hold different numbers of ignored tokens."""

import datetime
import gc
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from cosdistill import FusedLinearCosineDistillLoss, FusedLinearJSDLoss, StudentMetrics
from cosdistill.distributed import DataParallelCosineDistillLoss, DataParallelJSDLoss, data_parallel_num_valid_tokens
from cosdistill.testing import rel_err

REPO = Path(__file__).resolve().parents[2]
FEATURES, HIDDEN_STUDENT, HIDDEN_TEACHER = 6, 8, 12
VOCAB_STUDENT, VOCAB_TEACHER = 37, 41  # neither divisible by 2 or 3
SEQUENCES_PER_RANK, SEQ_LEN = 2, 5
# Ignored tokens on ranks 0, 1, 2 (of SEQUENCES_PER_RANK * SEQ_LEN = 10); 2 ranks take the first two.
IGNORED_PER_RANK = {"uneven": (0, 3, 6), "one rank all ignored": (2, 10, 5)}
SAME, DIFFERENT = 1e-5, 1e-3  # relative errors (fp32 against fp32)
# Each loss: its module, its data parallel module, and options other than the defaults.
LOSSES = {
    "cosine": (FusedLinearCosineDistillLoss, DataParallelCosineDistillLoss, {}),
    "jsd": (FusedLinearJSDLoss, DataParallelJSDLoss, {"beta": 0.3, "temperature": 2.0}),
}


class Student(torch.nn.Module):
    """A Linear-Tanh body and an LM head with a bias; forward returns the loss, so that DDP and FSDP2
    see the head used inside forward."""

    def __init__(self, loss):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN_STUDENT), torch.nn.Tanh())
        self.head = torch.nn.Linear(HIDDEN_STUDENT, VOCAB_STUDENT)
        self.loss = loss

    def forward(self, features, teacher_hidden, teacher_weight, labels, num_valid_tokens=None):
        hidden = self.body(features)
        return self.loss(hidden, self.head.weight, teacher_hidden, teacher_weight, labels, self.head.bias,
                         num_valid_tokens=num_valid_tokens)


def make_student(loss):
    torch.manual_seed(1)  # the same initial student on every rank and in the single process
    return Student(loss)


def global_batch(world_size, ignored_per_rank):
    """(features, teacher_hidden, teacher_weight, labels); the labels of rank r's sequences start with
    ignored_per_rank[r] ignored ones."""
    generator = torch.Generator().manual_seed(0)
    sequences = SEQUENCES_PER_RANK * world_size
    features = torch.randn(sequences, SEQ_LEN, FEATURES, generator=generator)
    teacher_hidden = torch.randn(sequences, SEQ_LEN, HIDDEN_TEACHER, generator=generator)
    teacher_weight = torch.randn(VOCAB_TEACHER, HIDDEN_TEACHER, generator=generator) * 2 / HIDDEN_TEACHER**0.5
    labels = torch.randint(0, VOCAB_STUDENT, (sequences, SEQ_LEN), generator=generator)
    for rank, labels_of_rank in enumerate(labels.split(SEQUENCES_PER_RANK)):
        labels_of_rank.view(-1)[: ignored_per_rank[rank]] = -100
    return features, teacher_hidden, teacher_weight, labels


def rank_share(batch, rank):
    features, teacher_hidden, teacher_weight, labels = batch
    rows = slice(rank * SEQUENCES_PER_RANK, (rank + 1) * SEQUENCES_PER_RANK)
    return features[rows], teacher_hidden[rows], teacher_weight, labels[rows]


def loss_module(loss, data_parallel=False):
    module, data_parallel_module, options = LOSSES[loss]
    return (data_parallel_module if data_parallel else module)(impl="torch", **options)


def whole_batch_loss_and_grads(batch, loss):
    student = make_student(loss_module(loss))
    loss = student(*batch)
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in student.named_parameters()}


def ddp_loss_and_grads(batch, loss):
    student = DistributedDataParallel(make_student(loss))
    rank_loss = student(*rank_share(batch, dist.get_rank()))
    rank_loss.backward()
    return rank_loss.detach(), {name: param.grad for name, param in student.module.named_parameters()}


def fsdp2_loss_and_grads(batch, loss):
    student = make_student(loss_module(loss))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(student.body, mesh=mesh)
    fully_shard(student, mesh=mesh)
    share = rank_share(batch, dist.get_rank())
    rank_loss = student(*share, num_valid_tokens=data_parallel_num_valid_tokens(share[-1]))
    rank_loss.backward()
    return rank_loss.detach(), {name: param.grad.full_tensor() for name, param in student.named_parameters()}


RUNS = {
    "ddp": lambda batch, loss: ddp_loss_and_grads(batch, loss_module(loss, data_parallel=True)),
    "fsdp2": fsdp2_loss_and_grads,
    "ddp, local normaliser": lambda batch, loss: ddp_loss_and_grads(batch, loss_module(loss)),
}


def refused_labels_on_the_last_rank(world_size):
    """What this rank raises where the last rank's labels are floats: the last its TypeError after the all-reduce,
    the others their loss's refusal of the NaN count; none waits in the collective for the last."""
    last = dist.get_rank() == world_size - 1
    features, teacher_hidden, teacher_weight, labels = rank_share(global_batch(world_size, (0, 0, 0)), dist.get_rank())
    try:
        count = data_parallel_num_valid_tokens(labels.float() if last else labels)
        make_student(loss_module("jsd"))(features, teacher_hidden, teacher_weight, labels, num_valid_tokens=count)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def bad_option_on_the_last_rank(world_size):
    """What this rank raises where the last rank's module holds a tensor temperature changed in place to 0: the last
    the option's ValueError after the count's all-reduce, the others their refusal of the NaN count. The last raised
    before the all-reduce and the others waited in it for the collective's timeout."""
    features, teacher_hidden, teacher_weight, labels = rank_share(global_batch(world_size, (0, 0, 0)), dist.get_rank())
    temperature = torch.tensor(2.0)
    student = make_student(DataParallelJSDLoss(impl="torch", temperature=temperature))
    if dist.get_rank() == world_size - 1:
        temperature.zero_()
    try:
        student(features, teacher_hidden, teacher_weight, labels)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def rank_metrics_equal_the_local_modules(loss):
    """Whether the data parallel module fills in a StudentMetrics for this rank's tokens as the plain module does."""
    features, teacher_hidden, teacher_weight, labels = rank_share(global_batch(dist.get_world_size(), (0, 3, 6)),
                                                                  dist.get_rank())
    hidden = torch.randn(*features.shape[:-1], HIDDEN_STUDENT)
    head = torch.nn.Linear(HIDDEN_STUDENT, VOCAB_STUDENT)
    got, want = StudentMetrics(temperature=1.5), StudentMetrics(temperature=1.5)
    args = (hidden, head.weight, teacher_hidden, teacher_weight, labels, head.bias)
    loss_module(loss, data_parallel=True)(*args, student_metrics=got)
    loss_module(loss)(*args, student_metrics=want)
    return all(torch.equal(getattr(got, name), getattr(want, name)) for name in ("entropy", "top1", "counted")) and (
        got.entropy.shape == labels.shape)


def count_over_rank_0_alone():
    """The count over a group that holds rank 0 alone: its count there, the ValueError elsewhere. The other ranks
    raised torch's "Invalid process group specified", which names no argument."""
    alone = dist.new_group([0])  # a collective: every rank builds it
    try:
        return data_parallel_num_valid_tokens(torch.tensor([3, -100, 5, 7]), group=alone).item()
    except ValueError as error:
        return f"ValueError: {error}"


def measure_rank(rank, world_size, folder):
    """Per loss, run and ignore layout, the relative errors of the gradients and of the mean loss against one
    process; rank 0 writes them to folder/errors.json (the gradients are all-reduced: the same on all ranks)."""
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        errors = {loss: {run: {} for run in RUNS} for loss in LOSSES}
        for loss, (case, ignored_per_rank) in itertools.product(LOSSES, IGNORED_PER_RANK.items()):
            batch = global_batch(world_size, ignored_per_rank)
            expected_loss, expected_grads = whole_batch_loss_and_grads(batch, loss)
            for run, loss_and_grads in RUNS.items():
                rank_loss, grads = loss_and_grads(batch, loss)
                dist.all_reduce(rank_loss)  # the mean of the ranks' shares is the whole-batch loss
                errors[loss][run][case] = {
                    "grads": {name: rel_err(grads[name], expected_grads[name]) for name in expected_grads},
                    "loss": rel_err(rank_loss / world_size, expected_loss),
                }
        errors["all ignored"] = data_parallel_num_valid_tokens(torch.full((3, 4), -100)).item() * world_size
        errors["refused labels"] = [None] * world_size
        dist.all_gather_object(errors["refused labels"], refused_labels_on_the_last_rank(world_size))
        errors["bad option"] = [None] * world_size
        dist.all_gather_object(errors["bad option"], bad_option_on_the_last_rank(world_size))
        errors["metrics"] = {loss: [None] * world_size for loss in LOSSES}
        for loss in LOSSES:
            dist.all_gather_object(errors["metrics"][loss], rank_metrics_equal_the_local_modules(loss))
        errors["rank 0 alone"] = [None] * world_size
        dist.all_gather_object(errors["rank 0 alone"], count_over_rank_0_alone())
        if rank == 0:
            with open(os.path.join(folder, "errors.json"), "w") as file:
                json.dump(errors, file)
    finally:
        gc.collect()  # FSDP2's students, in reference cycles, hold the group: free them first (see the example)
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world_size: f"{world_size} ranks")
def errors(request, tmp_path_factory):
    """One spawn of the ranks per world size measures every run (a process start costs seconds)."""
    folder = tmp_path_factory.mktemp("ranks")
    mp.spawn(measure_rank, args=(request.param, str(folder)), nprocs=request.param)
    return json.loads((folder / "errors.json").read_text())


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("run", ["ddp", "fsdp2"])
def test_gradients_and_loss_equal_one_process(errors, run, loss):
    for case, error in errors[loss][run].items():
        assert max(error["grads"].values()) < SAME, f"{case}: {error}"
        assert error["loss"] < SAME, f"{case}: {error}"


@pytest.mark.parametrize("loss", LOSSES)
def test_local_normaliser_gives_other_gradients(errors, loss):
    for case, error in errors[loss]["ddp, local normaliser"].items():
        assert max(error["grads"].values()) > DIFFERENT, f"{case}: {error}"


def test_no_valid_token_anywhere_counts_as_one(errors):
    assert errors["all ignored"] == pytest.approx(1.0)


def test_refused_labels_on_one_rank_raise_on_every_rank(errors):
    *others, last = errors["refused labels"]
    assert last == "TypeError: labels must be an integer tensor, got torch.float32"
    for other in others:
        assert other.startswith("ValueError: num_valid_tokens must be finite, got nan"), other


def test_a_bad_option_on_one_rank_raises_on_every_rank(errors):
    *others, last = errors["bad option"]
    assert last == "ValueError: temperature must be > 0, got 0.0"
    for other in others:
        assert other.startswith("ValueError: num_valid_tokens must be finite, got nan"), other


@pytest.mark.parametrize("loss", LOSSES)
def test_student_metrics_are_each_ranks_own_tokens(errors, loss):
    assert errors["metrics"][loss] == [True] * len(errors["metrics"][loss])


def test_a_group_without_the_rank_is_named(errors):
    first, *others = errors["rank 0 alone"]
    assert first == 3.0
    for rank, other in enumerate(others, 1):
        assert other == (f"ValueError: data_parallel_num_valid_tokens (the data-parallel losses' count too): this rank "
                         f"(global rank {rank}) is not in the group it was given")


def test_needs_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        data_parallel_num_valid_tokens(torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("wrapper", [[], ["--fsdp2"], ["--fsdp2", "--loss", "jsd"]], ids=["ddp", "fsdp2", "fsdp2, jsd"])
def test_torchrun_example(wrapper):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "examples/torchrun_ddp.py", "--steps", "2", *wrapper]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 1: loss" in result.stdout
