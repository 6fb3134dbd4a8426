"""PEFT LoRA students whose LM heads are split along the vocabulary for tensor parallelism (two processes, gloo on the
CPU): adapters on the transformer layers of a student loaded with transformers' ``tp_plan="auto"`` or split by hand
(torch's ``ColwiseParallel`` on the head), and a head trained whole in ``modules_to_save`` beside a head split by
hand. ``distill_loss`` gives the loss and every trainable parameter's gradient, gathered, of one process with the
models whole; a LoRA adapter on a split head raises as on a whole one, without suggesting a merge (PEFT cannot merge
into a split head); ``modules_to_save`` on a tp_plan head (its shards cloned: PEFT's deep copy raises on ranks above
0 otherwise) raises, the copy running the original head's forward. Not covered, as PEFT fails first: LoRA on
tp_plan's rowwise layers (o_proj, down_proj), whose forward raises in PEFT."""

import gc
import os
import re
import zlib

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_tensor_parallel_hf import (  # noqa: E402  the same models, batch and splits as the whole-head tests
    OPTIONS,
    VOCAB_STUDENT,
    VOCAB_TEACHER,
    WORLD,
    batch,
    gradients,
    init_rank,
    spawn_ranks,
    split,
    tiny_llama,
)
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from cosdistill.hf import distill_loss  # noqa: E402
from cosdistill.testing import rel_err  # noqa: E402

COLWISE_LAYERS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]  # tp_plan's colwise projections
ALL_LAYERS = COLWISE_LAYERS + ["o_proj", "down_proj"]
# (how the student is split, its adapter, the teacher's vocabulary, how the teacher is split)
CASES = {
    "tp_plan-layers": ("tp_plan", dict(target_modules=COLWISE_LAYERS), VOCAB_STUDENT, "tp_plan"),
    "tp_plan-layers-whole_teacher": ("tp_plan", dict(target_modules=["q_proj", "v_proj"]), VOCAB_TEACHER, "whole"),
    "colwise-layers": ("colwise", dict(target_modules=ALL_LAYERS), VOCAB_STUDENT, "colwise"),
    "colwise-layers-whole_teacher": ("colwise", dict(target_modules=["q_proj", "v_proj"]), VOCAB_TEACHER, "whole"),
    "colwise-modules_to_save": ("colwise", dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
                                VOCAB_STUDENT, "colwise"),
    "colwise-modules_to_save-whole_teacher": (
        "colwise", dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]), VOCAB_TEACHER, "whole"),
}


def lora_student(folder, how, adapter):
    """The student with its adapter, every trainable parameter set from its name alone, whatever the split: the
    LoRA matrices to random values (lora_B is zero at init, which would leave lora_A without a gradient), the
    modules_to_save head moved away from the original's (the loss must read the copy)."""
    model = peft.get_peft_model(split(folder, "student", VOCAB_STUDENT, 0, how),
                                peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **adapter))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                values = 0.1 * torch.randn(tuple(parameter.shape), generator=generator)
                if isinstance(parameter, DTensor):
                    values = distribute_tensor(values, parameter.device_mesh, parameter.placements)
                if "lora_" in name:
                    parameter.copy_(values)
                else:
                    parameter.add_(values)
    return model


def measure_rank(rank, folder):
    init_rank(rank, folder)
    results = {}
    for case, (student_how, adapter, vocab_teacher, teacher_how) in CASES.items():
        for loss, options in OPTIONS.items():
            student = lora_student(folder, student_how, adapter)
            teacher = split(folder, f"teacher{vocab_teacher}", vocab_teacher, 1, teacher_how)
            value, soft, hard = distill_loss(student, teacher, **batch(), loss=loss, return_soft_hard_loss=True,
                                             **options)
            value.backward()
            results[case, loss] = (torch.stack([value, soft, hard]).detach(), gradients(student))
    errors = {}
    for how in ("tp_plan", "colwise"):  # all ranks raise before any collective
        try:
            distill_loss(lora_student(folder, how, dict(target_modules=["q_proj", "lm_head"])),
                         split(folder, f"teacher{VOCAB_STUDENT}", VOCAB_STUDENT, 1, how), **batch())
            errors[how] = "nothing raised"
        except TypeError as error:
            errors[how] = str(error)
    # modules_to_save on a tp_plan head, its shards cloned so that PEFT's deep copy runs: the copy keeps the
    # original's forward (transformers' closure over the original module)
    student = split(folder, "student", VOCAB_STUDENT, 0, "tp_plan")
    for parameter in student.parameters():
        parameter.data = parameter.data.clone()
    student = peft.get_peft_model(student, peft.LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    try:
        distill_loss(student, split(folder, f"teacher{VOCAB_STUDENT}", VOCAB_STUDENT, 1, "tp_plan"), **batch())
        errors["tp_plan-modules_to_save"] = "nothing raised"
    except ValueError as error:
        errors["tp_plan-modules_to_save"] = str(error)
    results["errors"] = errors
    torch.save(results, os.path.join(folder, f"results{rank}.pt"))
    dist.barrier()
    del student, teacher, value, soft, hard
    gc.collect()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = spawn_ranks(tmp_path_factory, measure_rank)
    return [torch.load(folder / f"results{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("loss", OPTIONS)
@pytest.mark.parametrize("case", CASES)
def test_lora_students_split_give_the_whole_models_loss_and_gradients(results, case, loss):
    _, adapter, vocab_teacher, _ = CASES[case]
    student = lora_student(None, "whole", adapter)
    value, soft, hard = distill_loss(student, tiny_llama(vocab_teacher, 1), **batch(), loss=loss,
                                     return_soft_hard_loss=True, **OPTIONS[loss])
    value.backward()
    want = gradients(student)
    assert want and all(name.count("lora_") or "modules_to_save" in name for name in want)
    for rank, rank_results in enumerate(results):  # each rank's replicated LoRA matrices too
        values, grads = rank_results[case, loss]
        assert rel_err(values, torch.stack([value, soft, hard]).detach()) < 1e-5, rank
        assert grads.keys() == want.keys(), rank
        errors = {name: rel_err(grads[name], want[name]) for name in want}
        assert max(errors.values()) < 1e-5, (rank, errors)


def test_modules_to_save_on_a_tp_plan_head_raises(results):
    """The copy would train while the model's own forward ran the original's weights."""
    for rank_results in results:
        message = rank_results["errors"]["tp_plan-modules_to_save"]
        assert "student's LM head runs another module's forward" in message, message


@pytest.mark.parametrize("how", ["tp_plan", "colwise"])
def test_lora_on_a_split_head_raises(results, how):
    for rank_results in results:  # without the way out that PEFT cannot take for a split head: merging
        message = rank_results["errors"][how]
        assert re.search(r"student's LM head carries an adapter \(peft\.tuners\.lora\.layer\.Linear\)", message), message
        assert "merge" not in message, message
