"""cosdistill.trl.DistillationTrainer against TRL's DistillationTrainer (on-policy distillation, TRL's chunked
divergence): the same loss and gradients on the same generated batch, the same training step, evaluation, PEFT
students, softcapped and scaled heads, and the options it cannot honour."""

import copy
import pickle
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from cosdistill.testing import rel_err  # noqa: E402
from cosdistill.trl import DistillationTrainer  # noqa: E402
from test_hf import lora_student_and_its_base, tiny_model  # noqa: E402
from test_trl import SPECIAL, VOCAB, word_tokenizer  # noqa: E402

PROMPT_LENGTHS = (3, 5, 2, 4)


def prompts(lengths=PROMPT_LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([
        {"prompt": " ".join(f"w{int(i)}" for i in torch.randint(len(SPECIAL), VOCAB, (n,), generator=generator))}
        for n in lengths])


def tokenizer():
    """test_trl's word tokenizer, padding on the left as TRL's DistillationTrainer needs."""
    words = word_tokenizer()
    words.padding_side = "left"
    return words


def config(tmp_path, **options):
    defaults = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                    logging_steps=1, seed=0, per_device_train_batch_size=4, per_device_eval_batch_size=4, optim="sgd",
                    learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                    max_grad_norm=0.0, bf16=False, max_completion_length=6, max_steps=1)
    return trl.DistillationConfig(**{**defaults, **options})


def models(student_kind="llama", teacher_kind="llama"):
    """(student, teacher). A tenth of the words end a completion, so that a generated batch holds completions of
    different lengths, padded after their end."""
    student, teacher = tiny_model(student_kind), tiny_model(teacher_kind, seed=1)
    student.generation_config.eos_token_id = [2, *range(len(SPECIAL), VOCAB, 10)]
    return student, teacher


def make(trainer_class, tmp_path, student, teacher, peft_config=None, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notes on the tokenizer's chat template and generation settings
        return trainer_class(model=student, teacher_model=teacher, args=config(tmp_path, **options),
                             train_dataset=prompts(), processing_class=tokenizer(), peft_config=peft_config)


def generated_batch(trainer, seed=0):
    torch.manual_seed(seed)
    batch = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in range(len(PROMPT_LENGTHS))])
    lengths = batch["completion_mask"].sum(1)
    assert lengths.min() < lengths.max() and lengths.max() > 1  # padding after some completion's end
    return batch


def grads(model):
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def assert_loss_and_grads_are_trls(tmp_path, student, teacher, batch_change=None, training=True, generation_seed=0,
                                   **options):
    ours_student, trl_student = copy.deepcopy(student), copy.deepcopy(student)
    ours = make(DistillationTrainer, tmp_path, ours_student, teacher, **options)
    theirs = make(trl.DistillationTrainer, tmp_path, trl_student, teacher, **options)
    batch = generated_batch(theirs, generation_seed)
    if batch_change is not None:
        batch_change(batch)
    ours.model.train(training)
    theirs.model.train(training)
    got, want = ours.compute_loss(ours_student, dict(batch)), theirs.compute_loss(trl_student, dict(batch))
    assert want > 1e-3 and rel_err(got, want) < 1e-5, (options, got.item(), want.item())
    got.backward()
    want.backward()
    want_grads = grads(trl_student)
    got_grads = grads(ours_student)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in got_grads.items():
        assert rel_err(grad, want_grads[name]) < 1e-5, (options, name)
    mode = "train" if training else "eval"  # the student's entropy at the temperature, logged by each
    [got_entropy], [want_entropy] = ours._metrics[mode]["entropy"], theirs._metrics[mode]["entropy"]
    assert want_entropy > 0.1 and got_entropy == pytest.approx(want_entropy, rel=1e-5), options


@pytest.mark.parametrize("training", [True, False], ids=["training: the step's count", "evaluation: the batch's"])
def test_compute_loss_and_gradients_are_trls(tmp_path, training):
    """On a generated batch (left-padded prompts, completions padded after their end), for each beta and two
    temperatures (applied to both models' logits, as TRL applies them): in training divided by the step's
    generated tokens over the processes (here more than this batch's, as under gradient accumulation), in
    evaluation by the batch's."""
    def count_a_larger_step(batch):
        batch["num_items_in_batch"] = batch["num_items_in_batch"] + 7

    student, teacher = models()
    for beta in (0.0, 0.5, 1.0, 0.1):
        for temperature in (1.0, 0.7):
            assert_loss_and_grads_are_trls(tmp_path, student, teacher, batch_change=count_a_larger_step,
                                           training=training, beta=beta, temperature=temperature)


def test_tool_masked_tokens_are_left_out_as_trls(tmp_path):
    """Tool outputs inside a completion (tool_mask 0) are not trained on."""
    def mask_some_tools(batch):
        tool_mask = torch.ones_like(batch["completion_mask"])
        tool_mask[:, 1] = 0
        batch["tool_mask"] = tool_mask

    assert_loss_and_grads_are_trls(tmp_path, *models(), batch_change=mask_some_tools, beta=0.5)


@pytest.mark.parametrize("student_kind, teacher_kind, generation_seed", [
    ("gemma2", "cohere", 0),
    ("minicpm3", "granite", 3),  # seed 0's completions all run to the length limit (no padding)
    ("granite", "minicpm3", 3),
])
def test_softcapped_and_scaled_heads(tmp_path, student_kind, teacher_kind, generation_seed):
    """Gemma-2's final_logit_softcapping, Cohere's logit_scale and Granite's logits_scaling applied to each model's
    logits, and MiniCPM3's logits_scaling to the hidden states before its head (which the backbone's output TRL
    reads has not had)."""
    assert_loss_and_grads_are_trls(tmp_path, *models(student_kind, teacher_kind), generation_seed=generation_seed,
                                   beta=0.3, temperature=0.9)


def test_under_bf16_autocast_as_close_to_fp32_as_trls(tmp_path):
    """Under a caller's bf16 autocast (the models and both heads in bf16): the loss within bf16's rounding of the
    fp32 loss, the gradients (the whole tiny model's backward in bf16: ~5% off) no further from fp32's than TRL's own
    under the same autocast. (DistillationConfig's bf16=True: test_a_training_step_is_trls.)"""
    student, teacher = models()
    for beta in (0.0, 0.5, 1.0):
        ours_student, trl_student, fp32_student = (copy.deepcopy(student) for _ in range(3))
        ours = make(DistillationTrainer, tmp_path, ours_student, teacher, beta=beta)
        theirs = make(trl.DistillationTrainer, tmp_path, trl_student, teacher, beta=beta)
        batch = generated_batch(theirs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, bf16 = ours.compute_loss(ours_student, dict(batch)), theirs.compute_loss(trl_student, dict(batch))
        fp32 = theirs.compute_loss(fp32_student, dict(batch))
        for loss in (got, bf16, fp32):
            loss.backward()
        assert rel_err(got, fp32) < 5e-3 and rel_err(bf16, fp32) < 5e-3, (beta, got.item(), bf16.item(), fp32.item())
        want = grads(fp32_student)
        ours_error = max(rel_err(grad, want[name]) for name, grad in grads(ours_student).items())
        trl_error = max(rel_err(grad, want[name]) for name, grad in grads(trl_student).items())
        # both ways: a step that ran in fp32 (autocast left out) is 1e5 times closer to fp32's than TRL's
        assert 0.1 * trl_error < ours_error <= 1.25 * trl_error, (beta, ours_error, trl_error)


def test_a_batch_without_completion_tokens_gives_loss_0(tmp_path):
    def mask_everything(batch):
        batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])

    student, teacher = models()
    trainer = make(DistillationTrainer, tmp_path, student, teacher)
    batch = generated_batch(trainer)
    mask_everything(batch)
    loss = trainer.compute_loss(student, batch)
    loss.backward()
    assert loss.item() == 0.0 and all(float(grad.abs().max()) == 0.0 for grad in grads(student).values())


def train(trainer_class, tmp_path, student, teacher, **options):
    trainer = make(trainer_class, tmp_path, student, teacher, **options)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    step = [old - new.detach() for old, new in zip(before, trainer.model.parameters())]
    return trainer, step, trainer.state.log_history[0]


@pytest.mark.parametrize("bf16, compiled", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "bf16", "torch_compile"])
def test_a_training_step_is_trls(tmp_path, bf16, compiled):
    """train(): the same completions generated, then the same step and logged loss as TRL's trainer (two
    accumulated micro-batches), and the student's entropy TRL logs.

    With bf16=True (DistillationConfig's default) accelerate wraps each model's forward in bf16 autocast; ours runs
    the models through it (their backbones in bf16, as mixed precision asks), TRL's runs their backbones around it
    (in fp32): the loss agrees to bf16's rounding, the step (the tiny model's backward in bf16) to a few percent. The
    first call's check of the heads, whose probe runs through the wrapped forward, took the fp32 heads' bf16 logits
    for another head's and raised. With torch_compile the compiled student's head input is captured as eager's."""
    student, teacher = models()
    options = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, beta=0.5, bf16=bf16,
                   **(dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}))
    torch._dynamo.utils.counters.clear()
    _, ours, ours_log = train(DistillationTrainer, tmp_path, copy.deepcopy(student), teacher, **options)
    assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) == compiled
    _, theirs, trl_log = train(trl.DistillationTrainer, tmp_path, copy.deepcopy(student), teacher, **options)
    assert trl_log["loss"] > 1e-3 and ours_log["loss"] == pytest.approx(trl_log["loss"], rel=5e-3 if bf16 else 1e-5)
    assert trl_log["entropy"] > 0.1 and ours_log["entropy"] == pytest.approx(trl_log["entropy"],
                                                                              rel=5e-3 if bf16 else 1e-5)
    for got, want in zip(ours, theirs):
        assert rel_err(got, want) < (0.1 if bf16 else 1e-5)


def test_peft_lora_student(tmp_path):
    """A LoRA student (wrapped by the trainer from peft_config): TRL's step, the base model left as it was."""
    peft = pytest.importorskip("peft")
    student, teacher = models()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    ours, ours_step, ours_log = train(DistillationTrainer, tmp_path, copy.deepcopy(student), teacher,
                                      peft_config=lora, beta=0.5)
    theirs, trl_step, trl_log = train(trl.DistillationTrainer, tmp_path, copy.deepcopy(student), teacher,
                                      peft_config=lora, beta=0.5)
    assert isinstance(ours.model, peft.PeftModel)
    assert ours_log["loss"] == pytest.approx(trl_log["loss"], rel=1e-5)
    trained = [rel_err(got, want) for got, want in zip(ours_step, trl_step) if float(want.abs().max()) > 0]
    assert trained and max(trained) < 1e-5
    assert all(float(got.abs().max()) == 0 for got, want in zip(ours_step, trl_step) if float(want.abs().max()) == 0)


def test_a_teacher_that_is_the_lora_student_s_base_model_runs_without_its_adapters(tmp_path):
    """The LoRA student's base model as teacher runs through the student's LoRA layers: it runs under the student's
    disable_adapter(), so the loss is that against a copy of the base model (with the adapters on it was the
    student's, the divergence 0)."""
    student, reference_base = lora_student_and_its_base(models()[0])
    reference_student = copy.deepcopy(student)
    ours = make(DistillationTrainer, tmp_path, student, student.get_base_model())
    reference = make(DistillationTrainer, tmp_path, reference_student, reference_base)
    batch = generated_batch(reference)
    with torch.no_grad():
        got, want = ours.compute_loss(student, dict(batch)), reference.compute_loss(reference_student, dict(batch))
    assert want > 1e-3 and rel_err(got, want) < 1e-5, (got.item(), want.item())


def test_evaluate_is_trls(tmp_path):
    student, teacher = models()
    got = make(DistillationTrainer, tmp_path, copy.deepcopy(student), teacher, beta=0.2).evaluate(prompts(seed=3))
    want = make(trl.DistillationTrainer, tmp_path, copy.deepcopy(student), teacher, beta=0.2).evaluate(prompts(seed=3))
    assert want["eval_loss"] > 1e-3 and got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("option", ["loss_options beta", "loss_options chunks", "no teacher"])
def test_options_the_fused_loss_cannot_honour_raise(tmp_path, option):
    student, teacher = models()
    kwargs = {}
    if option == "no teacher":  # TRL allows it for a teacher served elsewhere, whose head the fused loss cannot read
        teacher, error, match = None, ValueError, "needs a teacher_model: the fused loss reads the teacher's LM head"
    elif option == "loss_options beta":
        kwargs, error, match = dict(loss_options=dict(beta=0.9)), ValueError, r"loss_options cannot set \['beta'\]"
    else:
        kwargs, error, match = dict(loss_options=dict(chunks=4)), TypeError, r"loss_options \['chunks'\] are not options"
    with pytest.raises(error, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DistillationTrainer(model=student, teacher_model=teacher, args=config(tmp_path), train_dataset=prompts(),
                            processing_class=tokenizer(), **kwargs)


def test_a_subclass_of_trls_picklable_by_its_name():
    """Defined on first use, as DistillationGKDTrainer (tests/test_trl_gkd.py::test_defined_on_first_use)."""
    import cosdistill.trl

    assert issubclass(DistillationTrainer, trl.DistillationTrainer) and cosdistill.trl.DistillationTrainer is DistillationTrainer
    assert pickle.loads(pickle.dumps(DistillationTrainer)) is DistillationTrainer


def test_a_training_step_that_counted_no_completion_token_gives_trls_loss_0(tmp_path):
    """In training TRL divides by the step's completion-token count clamped to at least 1
    (inputs["num_items_in_batch"].clamp(min=1.0) / num_processes): a step whose completions are all masked (tool
    outputs, or every completion empty) counts 0 and gets loss 0 / 1 = 0 with zero gradients, where an unclamped
    count would hand num_valid_tokens=0 to the fused loss. The count is set as TRL's generation sets it, from the
    masked tokens."""
    student, teacher = models()
    ours_student, trl_student = copy.deepcopy(student), copy.deepcopy(student)
    ours = make(DistillationTrainer, tmp_path, ours_student, teacher)
    theirs = make(trl.DistillationTrainer, tmp_path, trl_student, teacher)
    batch = generated_batch(theirs)
    batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])
    batch["num_items_in_batch"] = batch["completion_mask"].sum()  # TRL's gather of loss_mask.sum() on one process: 0
    ours.model.train()
    theirs.model.train()
    want = theirs.compute_loss(trl_student, dict(batch))
    got = ours.compute_loss(ours_student, dict(batch))
    assert want.item() == 0.0 and got.item() == 0.0
    got.backward()
    assert all(float(grad.abs().max()) == 0.0 for grad in grads(ours_student).values())
