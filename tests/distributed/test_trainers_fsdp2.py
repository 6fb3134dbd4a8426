"""The Trainers under FSDP2 through accelerate (``fsdp_config={"fsdp_version": 2}``; two processes, gloo on the
CPU). accelerate shards the student with ``fully_shard`` (the teacher, prepared for evaluation, stays whole), and
one optimizer step over a batch the ranks share is one process's step on the whole batch (DistillationTrainer,
DistillationSFTTrainer), or DDP's step, whose loss is 1 / the number of processes of one process's
(DistillationGKDTrainer and TRL's GKDTrainer alike).

accelerate takes FSDP on GPUs only (on the CPU it runs DDP instead), so the Trainers here set the state that
accelerate sets on a GPU before it prepares the model (``fsdp2_on_the_cpu``); each run checks the student came out
sharded."""

import gc
import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
with warnings.catch_warnings():  # TRL warns on every import from trl.experimental
    warnings.simplefilter("ignore")
    gkd = pytest.importorskip("trl.experimental.gkd")

from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from test_trainers_ddp import EVAL_ROWS, LOGGED, ROWS, SPLITS, free_port  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from cosdistill.hf import DistillationTrainer  # noqa: E402
from cosdistill.testing import rel_err  # noqa: E402
from cosdistill.trl import DistillationGKDTrainer, DistillationSFTTrainer  # noqa: E402
from test_hf import dataset, make_trainer, tiny_model  # noqa: E402
from test_trl import make_sft_trainer  # noqa: E402
from test_trl_gkd import chat_dataset  # noqa: E402
from test_trl_gkd import make as make_gkd_trainer  # noqa: E402
from test_trl_gkd import models as gkd_models  # noqa: E402

WORLD = 2
ONE_STEP = dict(max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, max_grad_norm=0.0)  # the step is minus the gradient
FSDP2 = dict(ddp_backend="gloo", average_tokens_across_devices=True, fsdp=True,
             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
NO_RESHARD = dict(FSDP2, fsdp_config={**FSDP2["fsdp_config"], "reshard_after_forward": False})
# Every module of 4000 parameters or more a unit of its own, the LM head among them
HEAD_A_UNIT = dict(FSDP2, fsdp_config={"fsdp_version": 2, "min_num_params": 4000})


def fsdp2_on_the_cpu(trainer_class):
    """``trainer_class`` whose accelerator is in the FSDP2 state accelerate gives it on a GPU."""

    class OnTheCPU(trainer_class):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True

    OnTheCPU.__name__ = trainer_class.__name__
    return OnTheCPU


def train_one_step(trainer, sharded):
    """The step each parameter took (whole) and the first log."""
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert isinstance(trainer.model, FSDPModule) == sharded
    after = [p.full_tensor() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
    return [old - new.detach() for old, new in zip(before, after)], trainer.state.log_history[0]


def distillation_step(folder, loss, per_device, accumulation, sharded=False, tie=False, **args):
    trainer_class = fsdp2_on_the_cpu(DistillationTrainer) if sharded else DistillationTrainer
    trainer = make_trainer(folder, tiny_model("llama", tie=tie), tiny_model("llama", vocab=160, seed=1), dataset(ROWS),
                           loss=loss, trainer_class=trainer_class, per_device_train_batch_size=per_device,
                           gradient_accumulation_steps=accumulation, **ONE_STEP, **args)
    return train_one_step(trainer, sharded)


def sft_step(folder, loss, per_device, sharded=False, **args):
    trainer_class = fsdp2_on_the_cpu(DistillationSFTTrainer) if sharded else DistillationSFTTrainer
    trainer = make_sft_trainer(folder, tiny_model("llama"), tiny_model("llama", vocab=144, seed=1), loss=loss,
                               trainer_class=trainer_class, per_device_train_batch_size=per_device, **args)
    return train_one_step(trainer, sharded)


# (prompt, completion) words: rows of one length, so that no row's padding (left, GKD's collator) changes with the
# batch it is in (its attention's rounding would), and different completions, so that the ranks count differently
GKD_ROWS = ((5, 3), (2, 6), (4, 4), (1, 7))


def gkd_step(folder, trainer_class, beta, per_device, sharded=False, **args):
    student, teacher = gkd_models()
    trainer = make_gkd_trainer(fsdp2_on_the_cpu(trainer_class) if sharded else trainer_class, folder, student, teacher,
                               dataset=chat_dataset(GKD_ROWS), beta=beta, per_device_train_batch_size=per_device,
                               **ONE_STEP, **args)
    return train_one_step(trainer, sharded)


def run_rank(rank, port, folder):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    out = os.path.join(folder, "out")
    results = {}
    for loss in ("cosine", "jsd"):
        for name, (per_device, accumulation) in SPLITS.items():
            results["trainer", loss, name] = distillation_step(out, loss, per_device, accumulation, sharded=True,
                                                               **FSDP2)
        results["sft", loss] = sft_step(out, loss, 2, sharded=True, **FSDP2)
    results["tied head, not resharded"] = distillation_step(out, "jsd", 2, 1, sharded=True, tie=True, **NO_RESHARD)
    results["head a unit"] = distillation_step(out, "jsd", 2, 1, sharded=True, **HEAD_A_UNIT)
    for beta in (0.0, 0.5, 1.0):
        for trainer_class in (DistillationGKDTrainer, gkd.GKDTrainer):
            results["gkd", trainer_class.__name__, beta] = [gkd_step(out, trainer_class, beta, 2, sharded=True, **FSDP2),
                                                            gkd_step(out, trainer_class, beta, 2, ddp_backend="gloo")]
    trainer = make_trainer(out, tiny_model("llama"), tiny_model("llama", vocab=160, seed=1), dataset(ROWS),
                           trainer_class=fsdp2_on_the_cpu(DistillationTrainer), per_device_eval_batch_size=1, **FSDP2)
    results["evaluate"] = trainer.evaluate(dataset(EVAL_ROWS, seed=3))
    assert isinstance(trainer.model, FSDPModule)
    if rank == 0:
        torch.save(results, os.path.join(folder, "results.pt"))
    del trainer
    gc.collect()  # FSDP2's modules, in reference cycles, hold the group: without this a rank may abort at exit
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    mp.spawn(run_rank, args=(free_port(), str(folder)), nprocs=WORLD)
    return torch.load(folder / "results.pt", weights_only=False)


def assert_same_step(got, want, tolerance=1e-5):
    (got_step, got_log), (want_step, want_log) = got, want
    errors = [rel_err(a, b) for a, b in zip(got_step, want_step)]
    assert len(got_step) == len(want_step) and max(errors) < tolerance, errors
    for key in LOGGED:
        if key in want_log:
            assert got_log[key] == pytest.approx(want_log[key], rel=1e-4), (key, got_log, want_log)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_a_distillation_trainer_step_is_one_processs_step_on_the_whole_batch(results, loss, split, tmp_path):
    assert_same_step(results["trainer", loss, split], distillation_step(tmp_path, loss, WORLD * SPLITS[split][0]
                                                                        * SPLITS[split][1], 1))


def test_a_tied_head_left_unsharded_after_the_forward(results, tmp_path):
    assert_same_step(results["tied head, not resharded"], distillation_step(tmp_path, "jsd", 2 * WORLD, 1, tie=True))


def test_a_head_in_a_unit_of_its_own(results, tmp_path):
    assert_same_step(results["head a unit"], distillation_step(tmp_path, "jsd", 2 * WORLD, 1))


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_an_sft_step_is_one_processs_step_on_the_whole_batch(results, loss, tmp_path):
    assert_same_step(results["sft", loss], sft_step(tmp_path, loss, 2 * WORLD))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("trainer_class", [DistillationGKDTrainer, gkd.GKDTrainer], ids=["ours", "TRL's"])
def test_a_gkd_step_is_its_step_under_ddp_and_its_loss_one_processs_over_the_number_of_processes(results, trainer_class,
                                                                                                   beta, tmp_path):
    """GKD's divisor is the step's count over all processes, and TRL's loss is not multiplied back by their number
    as Trainer.compute_loss does (DistillationGKDTrainer's docstring): TRL's loss and ours are 1 / WORLD of theirs
    in one process on the whole batch. The step is compared with DDP's, not with one process's: at half the batch
    the models' own gradients round differently (8e-5 in a layer norm's, TRL's and ours alike). (Ours against
    TRL's on one batch: tests/test_trl_gkd.py.)"""
    (step, log), ddp = results["gkd", trainer_class.__name__, beta]
    assert log["loss"] > 1e-3
    assert_same_step((step, log), ddp, tolerance=1e-6)
    _, one_process_log = gkd_step(tmp_path, trainer_class, beta, 2 * WORLD)
    assert WORLD * log["loss"] == pytest.approx(one_process_log["loss"], rel=1e-5)


def test_evaluate_logs_the_soft_and_hard_loss_that_make_eval_loss(results, tmp_path):
    got = results["evaluate"]
    weights = make_trainer(tmp_path, tiny_model("llama"), tiny_model("llama"), dataset(ROWS)).loss_options
    total = weights["weight_hard_loss"] * got["eval_hard_loss"] + weights["weight_soft_loss"] * got["eval_soft_loss"]
    assert total == pytest.approx(got["eval_loss"], rel=1e-5), got
