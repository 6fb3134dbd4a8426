"""cosdistill.trl's DistillationGKDTrainer and DistillationTrainer with a LoRA student whose teacher is its own base
model, inside TRL's trainers, which prepare the teacher themselves (``accelerator.prepare_model(teacher,
evaluation_mode=True)``): in one process the loss and gradients are TRL's generalized JSD of the full logits, the
teacher's taken through the student under ``disable_adapter()``; on two processes (gloo, CPU) the step under DDP and
under FSDP2 is TRL's own trainer's with a copy of the base model as the teacher.

(tests/distributed/: the one-process tests sit here beside the two-process ones they explain.)"""

import copy
import gc
import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
with warnings.catch_warnings():  # TRL warns on every import from trl.experimental
    warnings.simplefilter("ignore")
    gkd = pytest.importorskip("trl.experimental.gkd")

from test_trainers_ddp import free_port  # noqa: E402
from test_trainers_sharded import FSDP2, GKD_ROWS, GLOO, ONE_STEP, fsdp2_on_the_cpu, whole  # noqa: E402

from cosdistill.testing import rel_err  # noqa: E402
from cosdistill.trl import DistillationGKDTrainer  # noqa: E402
from cosdistill.trl import DistillationTrainer as FusedDistillationTrainer  # noqa: E402
from test_hf import lora_student_and_its_base  # noqa: E402
from test_trl_distillation import generated_batch, grads  # noqa: E402
from test_trl_distillation import make as make_distillation_trainer  # noqa: E402
from test_trl_distillation import models as distillation_models  # noqa: E402
from test_trl_gkd import chat_dataset, chat_tokenizer, gkd_config, spy_on_training  # noqa: E402
from test_trl_gkd import make as make_gkd_trainer  # noqa: E402
from test_trl_gkd import models as gkd_models  # noqa: E402

WORLD = 2
LORA = dict(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)


def clean_copy(model):
    """A deep copy whose modules run their class's forward (SFTTrainer binds a forward of its own to the model it
    trains: a plain copy would run the original's)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        vars(module).pop("forward", None)
    return model


def record_adapter_states(student):
    """Whether the adapters were off at each call of the student's own forward (its root, where FSDP2 gathers the
    embeddings and final norm)."""
    states = []

    def record(module, args):
        states.append(all(layer.disable_adapters for layer in module.modules()
                          if isinstance(layer, peft.tuners.tuners_utils.BaseTunerLayer)))

    student.register_forward_pre_hook(record)
    return states


def gkd_loss_of_logits(student, batch, beta):
    """TRL's generalized_jsd_loss on full logits, the teacher's the student's under disable_adapter()."""
    logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with torch.no_grad(), student.disable_adapter():
        teacher_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return gkd.GKDTrainer.generalized_jsd_loss(logits[:, :-1], teacher_logits[:, :-1], labels=batch["labels"][:, 1:],
                                               beta=beta)


def assert_same_loss_and_grads(got, want, student, reference_student):
    assert want > 1e-3 and rel_err(got, want) < 1e-5, (got.item(), want.item())
    got.backward()
    want.backward()
    got_grads, want_grads = grads(student), grads(reference_student)
    assert got_grads and got_grads.keys() == want_grads.keys() and all("lora_" in name for name in got_grads)
    for name, grad in got_grads.items():
        assert rel_err(grad, want_grads[name]) < 1e-5, name


@pytest.mark.parametrize("given", ["a PeftModel and its base model", "the base model twice and a peft_config"])
def test_gkd_against_the_students_base_model_is_gkds_loss_of_the_base_models_logits(tmp_path, given):
    """The teacher's forward runs through the student (its root's forward) with the adapters off; the student is
    left for train() to prepare (TRL's prepare_model of the teacher marked the base model, and through PEFT's
    attribute forwarding the student, as prepared: under DDP it was never wrapped, each process stepping alone)."""
    for beta in (0.0, 0.5, 1.0):
        if given == "a PeftModel and its base model":
            student, _ = lora_student_and_its_base(gkd_models()[0])
            reference_student = copy.deepcopy(student)
            trainer = make_gkd_trainer(DistillationGKDTrainer, tmp_path, student, student.get_base_model(), beta=beta)
        else:
            base = gkd_models()[0]
            trainer = DistillationGKDTrainer(model=base, teacher_model=base, args=gkd_config(tmp_path, beta=beta),
                                             train_dataset=chat_dataset(), processing_class=chat_tokenizer(),
                                             peft_config=peft.LoraConfig(**LORA))
            student = trainer.model
            assert isinstance(student, peft.PeftModel) and student.get_base_model() is base
            reference_student = clean_copy(student)
        assert not getattr(student, "_is_accelerate_prepared", False)
        adapters_off = record_adapter_states(student)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
        got = trainer.compute_loss(student, dict(batch))
        assert True in adapters_off and False in adapters_off, adapters_off
        assert_same_loss_and_grads(got, gkd_loss_of_logits(reference_student, batch, beta), student, reference_student)


def test_seq_kd_against_the_students_base_model_samples_the_base_models_completions(tmp_path):
    """seq_kd (lmbda 0: the teacher generates every batch) with the student's own base model as the teacher: the
    teacher's generations run with the adapters off, so each step's completions are those a copy of the base model
    samples from the same seed (with the adapters on they were the student's), and the losses those of GKD with the
    copy (TRL's own loss runs such a teacher with the adapters on: no oracle here)."""
    completions, losses = {}, {}
    for teacher_is in ("a copy", "its own base model"):
        student, base_copy = lora_student_and_its_base(gkd_models()[0])
        teacher = student.get_base_model() if teacher_is == "its own base model" else base_copy
        trainer = make_gkd_trainer(DistillationGKDTrainer, tmp_path / teacher_is, student, teacher, max_steps=2,
                                   per_device_train_batch_size=2, temperature=0.7, beta=0.3, lmbda=0.0, seq_kd=True)
        generations, steps, _ = spy_on_training(trainer)
        trainer.train()
        completions[teacher_is] = [input_ids for _, (input_ids, _, _) in generations]
        losses[teacher_is] = [step["got"] for step in steps]
        if teacher_is == "a copy":
            assert all(rel_err(step["got"], step["want"]) < 1e-5 for step in steps)
    assert len(completions["a copy"]) == len(losses["a copy"]) == 2
    for ours, theirs in zip(completions["its own base model"], completions["a copy"]):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(losses["its own base model"], losses["a copy"]):
        assert rel_err(ours, theirs) < 1e-5


def test_seq_kd_with_the_student_itself_as_the_teacher_raises(tmp_path):
    """The student itself as the teacher: GKDTrainer generates with the same model object for lmbda and seq_kd, so
    the teacher's generations cannot be run with the adapters off alone."""
    student, _ = lora_student_and_its_base(gkd_models()[0])
    with pytest.raises(ValueError, match="with seq_kd cannot tell the teacher's generations from the student's"):
        make_gkd_trainer(DistillationGKDTrainer, tmp_path, student, student, lmbda=0.5, seq_kd=True)


def test_distillation_trainer_against_the_students_base_model_is_trls_against_a_copy(tmp_path):
    """cosdistill.trl.DistillationTrainer: TRL's DistillationTrainer's loss and gradients with a copy of the base
    model as the teacher; the teacher's forward through the student with the adapters off."""
    student, reference_base = lora_student_and_its_base(distillation_models()[0])
    reference_student = copy.deepcopy(student)
    ours = make_distillation_trainer(FusedDistillationTrainer, tmp_path, student, student.get_base_model(), beta=0.5)
    theirs = make_distillation_trainer(trl.DistillationTrainer, tmp_path, reference_student, reference_base, beta=0.5)
    assert not getattr(student, "_is_accelerate_prepared", False)
    adapters_off = record_adapter_states(student)
    batch = generated_batch(theirs)
    got = ours.compute_loss(student, dict(batch))
    assert True in adapters_off and False in adapters_off, adapters_off
    assert_same_loss_and_grads(got, theirs.compute_loss(reference_student, dict(batch)), student, reference_student)


# --- Two processes: a step under DDP and under FSDP2 is TRL's with a copy of the base model as the teacher.


def root_holds_the_ends(accelerator, model):
    """accelerate's fsdp2_prepare_model as tests/distributed/test_fsdp2_hf.py shards: each decoder layer a unit, the
    root holding the embeddings, final norm and head, each unit resharded after its forward. (accelerate 1.16
    makes the embeddings a unit of their own and keeps the root's and the tail's parameters gathered after the
    forward, where the base model's forward alone would also find them gathered.)"""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, transformers.models.llama.modeling_llama.LlamaDecoderLayer):
            fully_shard(module, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


def one_step(trainer):
    """This rank's step of each trained parameter (whole), the first log, and the student's wrapper's type."""
    trained = {name: param for name, param in trainer.model.named_parameters() if param.requires_grad}
    before = {name: whole(param).detach().clone() for name, param in trained.items()}
    trainer.train()
    step = {name: before[name] - whole(param).detach() for name, param in trainer.model.named_parameters()
            if name in before}
    return step, trainer.state.log_history[0], type(trainer.model_wrapped).__name__


def or_its_error(step, *args):
    """step(*args), or the error it raised (as text: each case fails on its own)."""
    try:
        return step(*args)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


def rank_results(out):
    import accelerate.accelerator

    def gkd_step(trainer_class, own_base, sharding):
        student, reference_base = lora_student_and_its_base(gkd_models()[0])
        trainer_class = fsdp2_on_the_cpu(trainer_class) if sharding.get("fsdp") else trainer_class
        return one_step(make_gkd_trainer(trainer_class, out, student,
                                         student.get_base_model() if own_base else reference_base,
                                         dataset=chat_dataset(GKD_ROWS), beta=0.5, per_device_train_batch_size=2,
                                         **ONE_STEP, **sharding))

    def distillation_step(trainer_class, own_base, sharding):
        student, reference_base = lora_student_and_its_base(distillation_models()[0])
        trainer_class = fsdp2_on_the_cpu(trainer_class) if sharding.get("fsdp") else trainer_class
        return one_step(make_distillation_trainer(trainer_class, out, student,
                                                  student.get_base_model() if own_base else reference_base,
                                                  beta=0.5, per_device_train_batch_size=2, **sharding))

    # TRL's, under DDP: its FSDP2 step is the same (GKD's loss divided by the step's count over all processes, the
    # DistillationTrainer's multiplied back; test_trainers_sharded.py holds ours under FSDP2 to DDP's within 1e-5)
    results = {("gkd", "trl"): gkd_step(gkd.GKDTrainer, False, GLOO),
               ("distillation", "trl"): distillation_step(trl.DistillationTrainer, False, GLOO)}
    for run, sharding in (("DDP", GLOO), ("FSDP2", FSDP2), ("FSDP2, the root holding the ends", FSDP2)):
        if run == "FSDP2, the root holding the ends":
            accelerate.accelerator.fsdp2_prepare_model = root_holds_the_ends  # this process's last runs
        results["gkd", run] = or_its_error(gkd_step, DistillationGKDTrainer, True, sharding)
        results["distillation", run] = or_its_error(distillation_step, FusedDistillationTrainer, True, sharding)
    return results


def run_rank(rank, port, folder):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.save(rank_results(os.path.join(folder, "out")), os.path.join(folder, f"results{rank}.pt"))
    gc.collect()  # the sharded modules, in reference cycles, hold the group: without this a rank may abort at exit
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    mp.spawn(run_rank, args=(free_port(), str(folder)), nprocs=WORLD)
    return [torch.load(folder / f"results{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("run", ["DDP", "FSDP2", "FSDP2, the root holding the ends"])
@pytest.mark.parametrize("trainer", ["gkd", "distillation"])
def test_a_step_against_the_students_base_model_is_trls_against_a_copy(ranks, trainer, run):
    """Every rank takes the step of TRL's trainer under DDP (which averaged the gradients: the student was wrapped),
    and logs its loss; under FSDP2 whichever layout, also where the root holds the embeddings and final norm and
    reshards them after the forward, which the teacher's forward through the base model alone finds sharded."""
    for results in ranks:
        assert not isinstance(results[trainer, run], str), results[trainer, run]
        (ours, ours_log, ours_wrapper), (theirs, trl_log, trl_wrapper) = results[trainer, run], results[trainer, "trl"]
        assert trl_wrapper == "DistributedDataParallel"
        assert ours_wrapper == ("DistributedDataParallel" if run == "DDP" else "FSDPPeftModel")
        assert ours.keys() == theirs.keys() and all("lora_" in name for name in ours)
        errors = {name: rel_err(step, theirs[name]) for name, step in ours.items()}
        assert max(errors.values()) < 1e-5, errors
        assert trl_log["loss"] > 1e-3 and ours_log["loss"] == pytest.approx(trl_log["loss"], rel=1e-5)
