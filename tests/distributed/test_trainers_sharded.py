"""The Trainers with a sharded student (two processes, gloo on the CPU): one optimizer step is one process's step on
the whole batch (DistillationTrainer, DistillationSFTTrainer), or DDP's and TRL's GKDTrainer's step
(DistillationGKDTrainer). Beside the FSDP2 cases, cosdistill.trl.DistillationTrainer under DDP and under FSDP2
takes TRL's DistillationTrainer's step.

- FSDP2 through accelerate (``fsdp_config={"fsdp_version": 2}``): accelerate shards the student with
  ``fully_shard`` (the teacher, prepared for evaluation, stays whole); the ranks hold different batches.
  accelerate takes FSDP on GPUs only (on the CPU it runs DDP instead), so these Trainers set the state accelerate
  sets on a GPU (``fsdp2_on_the_cpu``), and each run checks the student came out sharded.
- Tensor parallelism, a student loaded with ``tp_plan="auto"``: the ranks hold the same batches and each its shard
  of the LM head; transformers counts the step's labels once (``Trainer.get_tp_size``), so the loss is not
  multiplied by the number of processes. accelerate refuses tensor parallelism off GPUs
  (``ParallelismConfig._validate_accelerator``), so these ranks skip that check (``tensor_parallel_on_the_cpu``).

The rest is accelerate's and transformers' own path."""

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

from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from test_trainers_ddp import EVAL_ROWS, LOGGED, ROWS, SPLITS, free_port  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from cosdistill.hf import DistillationTrainer  # noqa: E402
from cosdistill.testing import rel_err  # noqa: E402
from cosdistill.trl import DistillationGKDTrainer, DistillationSFTTrainer  # noqa: E402
from cosdistill.trl import DistillationTrainer as TRLDistillationTrainer  # noqa: E402
from test_hf import dataset, make_trainer, tiny_model  # noqa: E402
from test_trl import make_sft_trainer  # noqa: E402
from test_trl_distillation import make as make_trl_distillation_trainer  # noqa: E402
from test_trl_distillation import models as trl_distillation_models  # noqa: E402
from test_trl_gkd import chat_dataset  # noqa: E402
from test_trl_gkd import make as make_gkd_trainer  # noqa: E402
from test_trl_gkd import models as gkd_models  # noqa: E402

WORLD = 2
ONE_STEP = dict(max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, max_grad_norm=0.0)  # the step is minus the gradient
GLOO = dict(ddp_backend="gloo", average_tokens_across_devices=True)
FSDP2 = dict(GLOO, fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
NO_RESHARD = dict(FSDP2, fsdp_config={**FSDP2["fsdp_config"], "reshard_after_forward": False})
# Every module of 4000 parameters or more a unit of its own, the LM head among them
HEAD_A_UNIT = dict(FSDP2, fsdp_config={"fsdp_version": 2, "min_num_params": 4000})
# (prompt, completion) words: rows of one length, so that no row's padding (left, GKD's collator) changes with the
# batch it is in (its attention's rounding would), and different completions, so that the ranks count differently
GKD_ROWS = ((5, 3), (2, 6), (4, 4), (1, 7))


def fsdp2_on_the_cpu(trainer_class):
    """``trainer_class`` whose accelerator is in the FSDP2 state accelerate gives it on a GPU."""

    class OnTheCPU(trainer_class):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            # both states, as accelerate sets them: a later AcceleratorState() takes the type from PartialState's
            state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

    OnTheCPU.__name__ = trainer_class.__name__
    return OnTheCPU


def tensor_parallel_on_the_cpu():
    ParallelismConfig._validate_accelerator = lambda self, accelerator: None


def split_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="eager")
    assert isinstance(model.lm_head.weight, DTensor) and model.tp_size == WORLD
    return model


def natively_sharded(path, **distributed):
    """The model as transformers' own distributed loading shards it (DistributedConfig: fsdp_size, ...)."""
    from transformers.distributed import DistributedConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(**distributed), attn_implementation="eager")
    assert isinstance(model.lm_head.weight, DTensor)
    return model


def whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_one_step(trainer):
    """The step each parameter took (whole), the first log, and whether accelerate sharded the student."""
    before = [whole(p).detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    step = [old - whole(new).detach() for old, new in zip(before, trainer.model.parameters())]
    return step, trainer.state.log_history[0], isinstance(trainer.model, FSDPModule)


def distillation_step(folder, loss, per_device, accumulation=1, student=None, teacher=None,
                      trainer_class=DistillationTrainer, **args):
    trainer = make_trainer(folder, student or tiny_model("llama"), teacher or tiny_model("llama", vocab=160, seed=1),
                           dataset(ROWS), loss=loss, trainer_class=trainer_class, per_device_train_batch_size=per_device,
                           gradient_accumulation_steps=accumulation, **ONE_STEP, **args)
    return train_one_step(trainer)


def sft_step(folder, loss, per_device, student=None, trainer_class=DistillationSFTTrainer, **args):
    trainer = make_sft_trainer(folder, student or tiny_model("llama"), tiny_model("llama", vocab=144, seed=1),
                               loss=loss, trainer_class=trainer_class, per_device_train_batch_size=per_device, **args)
    return train_one_step(trainer)


def gkd_step(folder, trainer_class, beta, per_device, student=None, **args):
    default_student, teacher = gkd_models()
    if student is not None:
        student.generation_config = default_student.generation_config
    trainer = make_gkd_trainer(trainer_class, folder, student or default_student, teacher,
                               dataset=chat_dataset(GKD_ROWS), beta=beta, per_device_train_batch_size=per_device,
                               **ONE_STEP, **args)
    return train_one_step(trainer)


def trl_distillation_step(folder, trainer_class, **args):
    student, teacher = trl_distillation_models()
    return train_one_step(make_trl_distillation_trainer(trainer_class, folder, student, teacher, beta=0.5,
                                                        per_device_train_batch_size=2, **args))


def evaluate(folder, student, trainer_class=DistillationTrainer, per_device=1, **args):
    trainer = make_trainer(folder, student, tiny_model("llama", vocab=160, seed=1), dataset(ROWS),
                           trainer_class=trainer_class, per_device_eval_batch_size=per_device, **args)
    return trainer.evaluate(dataset(EVAL_ROWS, seed=3)), isinstance(trainer.model, FSDPModule)


def evaluate_and_predict(folder, student, per_device, **args):
    """evaluate()'s metrics, and the rows of predict()'s label_ids."""
    trainer = make_trainer(folder, student, tiny_model("llama", vocab=160, seed=1), dataset(ROWS),
                           per_device_eval_batch_size=per_device, **args)
    return trainer.evaluate(dataset(EVAL_ROWS, seed=3)), len(trainer.predict(dataset(EVAL_ROWS, seed=3)).label_ids)


def fsdp2_results(out):
    results = {}
    for loss in ("cosine", "jsd"):
        for name, (per_device, accumulation) in SPLITS.items():
            results["step", loss, name] = distillation_step(out, loss, per_device, accumulation,
                                                            trainer_class=fsdp2_on_the_cpu(DistillationTrainer), **FSDP2)
        results["sft", loss] = sft_step(out, loss, 2, trainer_class=fsdp2_on_the_cpu(DistillationSFTTrainer), **FSDP2)
    results["tied head, not resharded"] = distillation_step(
        out, "jsd", 2, student=tiny_model("llama", tie=True), trainer_class=fsdp2_on_the_cpu(DistillationTrainer),
        **NO_RESHARD)
    results["head a unit"] = distillation_step(out, "jsd", 2, trainer_class=fsdp2_on_the_cpu(DistillationTrainer),
                                               **HEAD_A_UNIT)
    for beta in (0.0, 0.5, 1.0):
        results["gkd", beta] = [gkd_step(out, fsdp2_on_the_cpu(DistillationGKDTrainer), beta, 2, **FSDP2),
                                gkd_step(out, DistillationGKDTrainer, beta, 2, **GLOO)]  # DDP
    results["evaluate"] = evaluate(out, tiny_model("llama"), fsdp2_on_the_cpu(DistillationTrainer), **FSDP2)
    # TRL's DistillationTrainer and ours, under DDP and under FSDP2
    trainer_classes = (TRLDistillationTrainer, trl.DistillationTrainer)
    results["trl's DistillationTrainer under DDP"] = [trl_distillation_step(out, cls, **GLOO) for cls in trainer_classes]
    results["trl's DistillationTrainer under FSDP2"] = [trl_distillation_step(out, fsdp2_on_the_cpu(cls), **FSDP2)
                                                        for cls in trainer_classes]
    return results


def tensor_parallel_results(out, folder):
    tensor_parallel_on_the_cpu()
    student = os.path.join(folder, "student")
    results = {}
    for loss in ("cosine", "jsd"):
        for name, (per_device, accumulation) in SPLITS.items():  # the ranks share their batches: WORLD times as many
            results["step", loss, name] = distillation_step(out, loss, WORLD * per_device, accumulation,
                                                            split_model(student), **GLOO)
        results[f"split teacher {loss}"] = distillation_step(
            out, loss, 2 * WORLD, 1, split_model(student), split_model(os.path.join(folder, "teacher")), **GLOO)
        results["sft", loss] = sft_step(out, loss, 2 * WORLD, split_model(student), **GLOO)
    for beta in (0.0, 0.5, 1.0):
        results["gkd", beta] = [gkd_step(out, trainer_class, beta, 2 * WORLD,
                                         split_model(os.path.join(folder, "gkd student")), **GLOO)
                                for trainer_class in (DistillationGKDTrainer, gkd.GKDTrainer)]
    results["evaluate"] = evaluate(out, split_model(student), **GLOO)
    results["evaluate and predict, batches of 2"] = evaluate_and_predict(out, split_model(student), 2, **GLOO)
    # transformers' own FSDP2 (DistributedConfig(fsdp_size=...)): the head a Shard(0) DTensor from loading on, as
    # a split for tensor parallelism looks; the ranks hold different batches
    results["native fsdp2 student"] = distillation_step(
        out, "jsd", 2, 1, natively_sharded(student, fsdp_size=WORLD), **GLOO)
    results["native fsdp2 teacher"] = distillation_step(
        out, "jsd", 2, 1, teacher=natively_sharded(os.path.join(folder, "teacher160"), fsdp_size=WORLD), **GLOO)
    try:
        student, teacher = trl_distillation_models()
        saved = os.path.join(out, f"trl student {torch.distributed.get_rank()}")  # each rank its own: one would read
        student.save_pretrained(saved)  # the other's config.json half written
        make_trl_distillation_trainer(TRLDistillationTrainer, out, natively_sharded(saved, fsdp_size=WORLD), teacher,
                                      beta=0.5, **GLOO)
        results["trl's DistillationTrainer, native fsdp2 student"] = "built"
    except ValueError as error:
        results["trl's DistillationTrainer, native fsdp2 student"] = str(error)
    return results


def run_rank(rank, port, folder, sharding):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    out = os.path.join(folder, "out")
    results = fsdp2_results(out) if sharding == "fsdp2" else tensor_parallel_results(out, folder)
    if rank == 0:
        torch.save(results, os.path.join(folder, "results.pt"))
    gc.collect()  # the sharded modules, in reference cycles, hold the group: without this a rank may abort at exit
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def ranks_results(tmp_path_factory, sharding):
    folder = tmp_path_factory.mktemp("ranks")
    if sharding == "tensor parallel":
        tiny_model("llama").save_pretrained(folder / "student")
        tiny_model("llama", seed=1).save_pretrained(folder / "teacher")
        tiny_model("llama", vocab=160, seed=1).save_pretrained(folder / "teacher160")
        gkd_models()[0].save_pretrained(folder / "gkd student")
    mp.spawn(run_rank, args=(free_port(), str(folder), sharding), nprocs=WORLD)
    return torch.load(folder / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return ranks_results(tmp_path_factory, "fsdp2")


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    return ranks_results(tmp_path_factory, "tensor parallel")


@pytest.fixture(params=["fsdp2", "tensor parallel"])
def sharded(request):
    """(the sharding, its ranks' results)"""
    return request.param, request.getfixturevalue(request.param.replace(" ", "_"))


def assert_same_step(got, want, sharded):
    """Each matrix's change within fp32's 1e-5, and the step as a whole (every parameter as one vector); a layer
    norm's weight (1-D) within 1e-4: it sums its products over every token, whose cancellation turns the two
    losses' fp32 rounding (~1e-6 in their gradients) into 1.3e-5 of its own (ours against GKDTrainer under one
    split), where a wrong count or share is off by far more."""
    (got_step, got_log, fully_sharded), (want_step, want_log, _) = got, want
    assert fully_sharded == (sharded == "fsdp2")
    errors = [rel_err(a, b) for a, b in zip(got_step, want_step)]
    assert len(got_step) == len(want_step), errors
    assert all(error < (1e-4 if a.dim() == 1 else 1e-5) for error, a in zip(errors, got_step)), errors
    whole = rel_err(torch.cat([a.flatten() for a in got_step]), torch.cat([b.flatten() for b in want_step]))
    assert whole < 1e-5, (whole, errors)
    for key in LOGGED:
        if key in want_log:
            assert got_log[key] == pytest.approx(want_log[key], rel=1e-4), (key, got_log, want_log)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_a_step_is_one_processs_step_on_the_whole_batch(sharded, loss, split, tmp_path):
    """The teacher whole, with a larger vocabulary than the student's."""
    sharding, results = sharded
    per_device, accumulation = SPLITS[split]
    assert_same_step(results["step", loss, split], distillation_step(tmp_path, loss, WORLD * per_device, accumulation),
                     sharding)


@pytest.mark.parametrize("side", ["student", "teacher"])
def test_a_model_sharded_by_transformers_own_fsdp2(tensor_parallel, side, tmp_path):
    """A student or teacher loaded with DistributedConfig(fsdp_size=2), whose head the Trainer's construction sees as
    FSDP's shard rather than a split for tensor parallelism: the step is one process's on the whole batch; TRL's
    DistillationTrainer takes such a student too."""
    got = tensor_parallel[f"native fsdp2 {side}"]
    assert_same_step(got, distillation_step(tmp_path, "jsd", WORLD * 2, 1), "fsdp2" if side == "student" else "")
    assert tensor_parallel["trl's DistillationTrainer, native fsdp2 student"] == "built"


@pytest.mark.parametrize("case", ["tied head, not resharded", "head a unit"])
def test_fsdp2_layouts(fsdp2, case, tmp_path):
    """A tied head left unsharded after the forward; the head in a unit of its own."""
    student = tiny_model("llama", tie=case.startswith("tied"))
    assert_same_step(fsdp2[case], distillation_step(tmp_path, "jsd", 2 * WORLD, student=student), "fsdp2")


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_a_teacher_split_as_the_student_is(tensor_parallel, loss, tmp_path):
    want = distillation_step(tmp_path, loss, 2 * WORLD, teacher=tiny_model("llama", seed=1))
    assert_same_step(tensor_parallel[f"split teacher {loss}"], want, "tensor parallel")


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_an_sft_step_is_one_processs_step_on_the_whole_batch(sharded, loss, tmp_path):
    sharding, results = sharded
    want = sft_step(tmp_path, loss, 2 * WORLD)
    assert_same_step(results["sft", loss], want, sharding)
    # SFTTrainer's count of the tokens trained on: the batch tensor-parallel ranks share, counted once
    assert results["sft", loss][1]["num_tokens"] == want[1]["num_tokens"] > 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_gkd_step_is_ddps_or_gkdtrainers(sharded, beta, tmp_path):
    """The step under FSDP2 against DDP's, split against TRL's GKDTrainer's under the same split, and the loss
    against one process's: GKD's divisor is the step's count over all processes and, as in TRL, the loss is not
    multiplied back by their number as Trainer.compute_loss does (DistillationGKDTrainer's docstring), so under
    FSDP2 it is 1 / WORLD of one process's; tensor-parallel ranks count their shared batch once. The step is not
    held to one process's: the models' own gradients round otherwise at other batch sizes or split (8e-5 and 1.3e-5
    in a layer norm's, TRL's and ours alike); nor to TRL's under FSDP2, where ours and TRL's fp32 loss differ by
    as much (1.2e-5). (Ours against TRL's in one process: tests/test_trl_gkd.py.)"""
    sharding, results = sharded
    ours, theirs = results["gkd", beta]
    assert ours[1]["loss"] > 1e-3
    assert_same_step(ours, theirs, sharding)
    one_process_loss = gkd_step(tmp_path, DistillationGKDTrainer, beta, 2 * WORLD)[1]["loss"]
    sharing = WORLD if sharding == "fsdp2" else 1  # the processes that hold different batches
    assert sharing * ours[1]["loss"] == pytest.approx(one_process_loss, rel=1e-5)


def test_evaluate_logs_the_soft_and_hard_loss_that_make_eval_loss(sharded, tmp_path):
    """Each loss is one process's evaluation at the same per-device batch, split or fully sharded (where the ranks
    evaluate other rows, and accelerate repeats one to even out their last batches)."""
    sharding, results = sharded
    got, fully_sharded = results["evaluate"]
    assert fully_sharded == (sharding == "fsdp2")
    weights = make_trainer(tmp_path, tiny_model("llama"), tiny_model("llama"), dataset(ROWS)).loss_options
    total = weights["weight_hard_loss"] * got["eval_hard_loss"] + weights["weight_soft_loss"] * got["eval_soft_loss"]
    assert total == pytest.approx(got["eval_loss"], rel=1e-5), got
    want, _ = evaluate(tmp_path, tiny_model("llama"))
    for key in ("eval_loss", "eval_soft_loss", "eval_hard_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got, want)


def test_a_tensor_parallel_student_evaluates_batches_of_two_as_one_process(tensor_parallel, tmp_path):
    """The ranks of the split evaluate the same batches, and gather_for_metrics gathered them: each full batch
    counted once per rank and the last once (eval_loss and its terms 0.6-0.8% off one process's at 7 rows in
    batches of 2, transformers' own eval_loss too), and predict() returned every label row once per rank."""
    got, label_rows = tensor_parallel["evaluate and predict, batches of 2"]
    want, want_rows = evaluate_and_predict(tmp_path, tiny_model("llama"), 2)
    assert label_rows == want_rows == len(EVAL_ROWS)
    for key in ("eval_loss", "eval_soft_loss", "eval_hard_loss"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got, want)


@pytest.mark.parametrize("run", ["DDP", "FSDP2"])
def test_trls_distillation_trainer_steps_as_trls(fsdp2, run):
    """cosdistill.trl.DistillationTrainer on two processes (run beside the FSDP2 cases): TRL's step and logged loss
    under the same DDP or FSDP2 run."""
    (ours, ours_log, ours_sharded), (theirs, trl_log, trl_sharded) = fsdp2[f"trl's DistillationTrainer under {run}"]
    assert ours_sharded == trl_sharded == (run == "FSDP2")
    assert trl_log["loss"] > 1e-3 and ours_log["loss"] == pytest.approx(trl_log["loss"], rel=1e-5)
    assert max(rel_err(got, want) for got, want in zip(ours, theirs)) < 1e-5
