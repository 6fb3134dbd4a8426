"""cosdistill.trl.DistillationGKDTrainer against TRL's GKDTrainer: the same loss and gradients on the same batch
(dataset, student-generated and teacher-generated), PEFT students, evaluation, and the options it cannot honour."""

import copy
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
with warnings.catch_warnings():  # TRL warns on every import from trl.experimental
    warnings.simplefilter("ignore")
    gkd = pytest.importorskip("trl.experimental.gkd")

from cosdistill.testing import rel_err  # noqa: E402
from cosdistill.trl import DistillationGKDTrainer  # noqa: E402
from test_hf import lora_student_and_its_base, tiny_model  # noqa: E402
from test_trl import SPECIAL, VOCAB, word_tokenizer  # noqa: E402

GKDTrainer = gkd.GKDTrainer


def chat_tokenizer():
    """test_trl's word tokenizer with a chat template: each turn's words, the assistant's closed by </s>."""
    tokenizer = word_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %} </s>"
                               "{% endif %} {% endfor %}")
    return tokenizer


def chat_dataset(lengths=((5, 3), (2, 6), (4, 4), (3, 2)), seed=0):
    """Conversations of a user turn (the prompt) and an assistant turn (the completion) of random words."""
    generator = torch.Generator().manual_seed(seed)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(len(SPECIAL), VOCAB, (n,), generator=generator))

    return datasets.Dataset.from_list([{"messages": [{"role": "user", "content": words(p)},
                                                     {"role": "assistant", "content": words(c)}]} for p, c in lengths])


def gkd_config(tmp_path, **config):
    defaults = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                    logging_steps=1, seed=0, per_device_train_batch_size=4, per_device_eval_batch_size=4, optim="sgd",
                    learning_rate=0.1, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                    max_grad_norm=0.0, bf16=False, max_new_tokens=4, lmbda=0.0)  # SFTConfig turns bf16 on by default
    return gkd.GKDConfig(**{**defaults, **config})


def make(trainer_class, tmp_path, student, teacher, dataset=None, **config):
    return trainer_class(model=student, teacher_model=teacher, args=gkd_config(tmp_path, **config),
                         train_dataset=chat_dataset() if dataset is None else dataset, processing_class=chat_tokenizer())


def models():
    """(student, teacher): GKD needs one vocabulary for both. A third of the words end a completion (GKDTrainer takes
    the student's eos_token_id for both models' generation), so that generated batches hold completions of different
    lengths, padded after their end."""
    student, teacher = tiny_model("llama"), tiny_model("llama", seed=1)
    student.generation_config.eos_token_id = [2, *range(len(SPECIAL), VOCAB, 3)]
    return student, teacher


def student_grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


# 0.5: transformers divides the count by the tensor-parallel size, so an almost empty step's can be under 1
@pytest.mark.parametrize("num_items_in_batch", [None, 37, 0.5], ids=["batchmean", "num_items", "num_items-under-1"])
@pytest.mark.parametrize("labels_on_padding", [False, True], ids=["collator", "labels-on-padding"])
def test_compute_loss_and_gradients_are_gkds(tmp_path, labels_on_padding, num_items_in_batch):
    """On the collator's batch (left padding, prompt labels -100) our compute_loss and its gradients are those of
    GKDTrainer.compute_loss (full logits, generalized_jsd_loss) for each beta, at any sampling temperature (TRL's
    loss takes none), normalised as TRL does: by num_items_in_batch when given, else by this batch's token count.
    With labels on padding positions, exactly TRL's tokens count: those whose next label is not -100."""
    student, teacher = models()
    for beta in (0.0, 0.5, 1.0):
        for temperature in (1.0, 0.7):
            ours_student, trl_student = copy.deepcopy(student), copy.deepcopy(student)
            ours = make(DistillationGKDTrainer, tmp_path, ours_student, teacher, beta=beta, temperature=temperature)
            theirs = make(GKDTrainer, tmp_path, trl_student, teacher, beta=beta, temperature=temperature)
            batch = ours.data_collator([ours.train_dataset[i] for i in range(len(ours.train_dataset))])
            padding = batch["attention_mask"] == 0
            assert padding.any() and (batch["labels"][:, 1:] != -100).any()
            assert (batch["labels"][~padding] == -100).any()  # prompt tokens
            if labels_on_padding:
                batch["labels"] = torch.where(padding, batch["input_ids"], batch["labels"])
            got = ours.compute_loss(ours_student, dict(batch), num_items_in_batch=num_items_in_batch)
            want = theirs.compute_loss(trl_student, dict(batch), num_items_in_batch=num_items_in_batch)
            assert want > 1e-3 and rel_err(got, want) < 1e-5, (beta, temperature, got.item(), want.item())
            got.backward()
            want.backward()
            want_grads = student_grads(trl_student)
            for name, grad in student_grads(ours_student).items():
                assert rel_err(grad, want_grads[name]) < 1e-5, (beta, temperature, name)


def test_bf16_models_get_trls_loss_of_their_logits_taken_in_float64(tmp_path):
    """With bf16 models TRL's GKDTrainer forms its loss in bf16, the logits' dtype (trl 1.16: 1e-4 for forward KL
    to 2e-2 for the JSD off its own formula on the same logits in float64, not asserted: TRL's to change); ours is
    that formula to fp32's rounding (~1e-8 here)."""
    student, teacher = (model.to(torch.bfloat16) for model in models())
    for beta in (0.0, 0.5, 1.0):
        ours = make(DistillationGKDTrainer, tmp_path, copy.deepcopy(student), teacher, beta=beta)
        batch = ours.data_collator([ours.train_dataset[i] for i in range(len(ours.train_dataset))])
        with torch.no_grad():
            logits = [model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
                      for model in (ours.model, teacher)]
            want = GKDTrainer.generalized_jsd_loss(*logits, labels=batch["labels"][:, 1:], beta=beta)
            got = ours.compute_loss(ours.model, dict(batch))
        assert want > 1e-2 and rel_err(got, want) < 1e-6, (beta, got.item(), want.item())


def test_a_step_that_counted_no_item_gives_loss_0(tmp_path):
    """num_items_in_batch counts the step's dataset labels before generation replaced them: where it is 0 the loss
    is 0 even if the batch trained on has targets (TRL: x / 0, inf; the clamp alone gave the undivided sum)."""
    student, teacher = models()
    trainer = make(DistillationGKDTrainer, tmp_path, student, teacher)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    assert (batch["labels"][:, 1:] != -100).any()
    for zero in (0, torch.tensor(0)):
        loss = trainer.compute_loss(student, dict(batch), num_items_in_batch=zero)
        loss.backward()
        assert loss.item() == 0 and all(not grad.any() for grad in student_grads(student).values())
        student.zero_grad()
    assert trainer.compute_loss(student, dict(batch), num_items_in_batch=torch.tensor(5)) > 0


def test_a_teacher_that_is_the_lora_student_s_base_model_runs_without_its_adapters(tmp_path):
    """The LoRA student's base model as teacher runs through the student's LoRA layers: it runs under the student's
    disable_adapter(), so the loss is that against a copy of the base model (with the adapters on it was the
    student's, the JSD 0; TRL's GKDTrainer gives that 0)."""
    student, reference_base = lora_student_and_its_base(models()[0])
    reference_student = copy.deepcopy(student)
    ours = make(DistillationGKDTrainer, tmp_path, student, student.get_base_model())
    reference = make(DistillationGKDTrainer, tmp_path, reference_student, reference_base)
    batch = ours.data_collator([ours.train_dataset[i] for i in range(len(ours.train_dataset))])
    with torch.no_grad():
        got = ours.compute_loss(student, dict(batch))
        want = reference.compute_loss(reference_student, dict(batch))
    assert want > 1e-3 and rel_err(got, want) < 1e-5, (got.item(), want.item())


def test_softcapped_and_scaled_heads_are_gkds(tmp_path):
    """A Gemma-2 student (final logit softcapping) against a Cohere teacher (a logit scale): the loss and gradients
    of GKDTrainer.compute_loss, which reads both models' own logits."""
    student, teacher = tiny_model("gemma2"), tiny_model("cohere", seed=1)
    ours_student, trl_student = copy.deepcopy(student), copy.deepcopy(student)
    ours = make(DistillationGKDTrainer, tmp_path, ours_student, teacher, beta=0.5)
    theirs = make(GKDTrainer, tmp_path, trl_student, teacher, beta=0.5)
    batch = ours.data_collator([ours.train_dataset[i] for i in range(len(ours.train_dataset))])
    got, want = ours.compute_loss(ours_student, dict(batch)), theirs.compute_loss(trl_student, dict(batch))
    assert want > 1e-3 and rel_err(got, want) < 1e-5, (got.item(), want.item())
    got.backward()
    want.backward()
    want_grads = student_grads(trl_student)
    for name, grad in student_grads(ours_student).items():
        assert rel_err(grad, want_grads[name]) < 1e-5, name


class GradientRecorder(transformers.TrainerCallback):
    """Each optimizer step's gradients of the trained parameters."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(student_grads(model))


def spy_on_training(trainer):
    """Records each generation (the model that generated, its output) and, for each compute_loss of a training step,
    the batch, our loss, and GKDTrainer.compute_loss's loss and student gradients on the same batch, student and
    num_items_in_batch. Returns (generations, steps, recorder of our gradients)."""
    generations, steps, recorder = [], [], GradientRecorder()
    generate, compute_loss = trainer.generate_on_policy_outputs, trainer.compute_loss

    def recording_generate(model, inputs, generation_config):
        output = generate(model, inputs, generation_config)
        generations.append((model, output))
        return output

    def recording_compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        # TRL's loss and gradients first, on the model itself (a copy would run the original's forward: accelerate
        # wraps it), then cleared for ours; gradient accumulation is off, so no step has gradients before this.
        assert all(p.grad is None for p in model.parameters())
        want = GKDTrainer.compute_loss(trainer, model, dict(inputs), num_items_in_batch=num_items_in_batch)
        want.backward()
        want_grads = student_grads(model)
        model.zero_grad(set_to_none=True)
        got = compute_loss(model, inputs, return_outputs, num_items_in_batch)
        steps.append(dict(batch=dict(inputs), got=got.detach().clone(), want=want.detach(), want_grads=want_grads))
        return got

    trainer.generate_on_policy_outputs = recording_generate
    trainer.compute_loss = recording_compute_loss
    trainer.add_callback(recorder)
    return generations, steps, recorder


def assert_trained_as_gkd(trainer, generations, steps, recorder, generator):
    """Each step trained on the batch ``generator`` generated, with GKDTrainer's loss and gradients on it; some
    completion ended early, so that its padding (attention mask 0, labels -100) is in a batch."""
    assert len(generations) == len(steps) == len(recorder.grads) == trainer.args.max_steps
    assert any((step["batch"]["attention_mask"][:, step["batch"]["prompts"].shape[1]:] == 0).any() for step in steps)
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == trainer.args.max_steps
    for (model, (input_ids, attention_mask, labels)), step, grads, logged in zip(generations, steps, recorder.grads,
                                                                                 losses):
        assert model is generator
        batch = step["batch"]
        assert torch.equal(batch["input_ids"], input_ids) and torch.equal(batch["labels"], labels)
        prompt_width = batch["prompts"].shape[1]
        assert input_ids.shape[1] > prompt_width and (labels[:, :prompt_width] == -100).all()
        assert (labels[:, prompt_width:] != -100).any()  # generated tokens are trained on
        assert torch.isfinite(step["got"]) and step["want"] > 1e-3
        assert rel_err(step["got"], step["want"]) < 1e-5
        assert logged == pytest.approx(step["want"].item(), rel=1e-5)
        assert grads.keys() == step["want_grads"].keys()
        for name, grad in grads.items():
            assert rel_err(grad, step["want_grads"][name]) < 1e-5, name


@pytest.mark.parametrize("mode", ["on-policy", "seq_kd"])
def test_generated_batches_train_with_gkds_loss(tmp_path, mode):
    """lmbda=1: the student generates every batch; seq_kd (lmbda=0): the teacher does. Two steps, each on the
    generated completions (prompt masked, padding after the end token masked), with GKDTrainer's loss and gradients
    on that batch."""
    student, teacher = models()
    config = dict(lmbda=1.0) if mode == "on-policy" else dict(lmbda=0.0, seq_kd=True)
    trainer = make(DistillationGKDTrainer, tmp_path, student, teacher, max_steps=2, per_device_train_batch_size=2,
                   temperature=0.7, beta=0.3, **config)
    generations, steps, recorder = spy_on_training(trainer)
    trainer.train()
    generator = student if mode == "on-policy" else trainer.accelerator.unwrap_model(trainer.teacher_model)
    assert_trained_as_gkd(trainer, generations, steps, recorder, generator)


def test_peft_lora_student(tmp_path):
    """A LoRA student (GKDTrainer wraps it from peft_config) takes an on-policy step with GKDTrainer's loss and
    gradients: the adapter trains, the base model stays."""
    peft = pytest.importorskip("peft")
    student, teacher = models()
    base = copy.deepcopy(student)
    trainer = DistillationGKDTrainer(
        model=student, teacher_model=teacher, args=gkd_config(tmp_path, max_steps=1, lmbda=1.0, beta=0.5),
        train_dataset=chat_dataset(), processing_class=chat_tokenizer(),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    assert isinstance(trainer.model, peft.PeftModel)
    generations, steps, recorder = spy_on_training(trainer)
    trainer.train()
    assert_trained_as_gkd(trainer, generations, steps, recorder, trainer.model)
    lora_b = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    assert lora_b and all(p.requires_grad for p in lora_b) and all(p.detach().abs().sum() > 0 for p in lora_b)  # from 0
    after = trainer.model.unload().state_dict()  # the base model, adapters removed unmerged
    assert after.keys() == base.state_dict().keys()
    for name, p in base.state_dict().items():
        assert torch.equal(after[name], p), name


@pytest.mark.parametrize("student_kind", ["tied head", "head bias", "LoRA, head in modules_to_save", "DoRA"])
def test_heads_and_adapters_are_gkds(tmp_path, student_kind):
    """A tied head, a head with a bias, a LoRA student whose head PEFT trains as a copy (modules_to_save) and a DoRA
    student: our compute_loss and its gradients are GKDTrainer's on the collator's batch, the same parameters
    trained."""
    peft = pytest.importorskip("peft")
    head = dict(tie=True) if student_kind == "tied head" else dict(head_bias=True) if student_kind == "head bias" else {}
    student, teacher = tiny_model("llama", **head), tiny_model("llama", seed=1, **head)
    adapter = {"LoRA, head in modules_to_save": dict(modules_to_save=["lm_head"]), "DoRA": dict(use_dora=True)}
    peft_config = (peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                   **adapter[student_kind]) if student_kind in adapter else None)
    grads, losses = [], []
    for trainer_class in (DistillationGKDTrainer, GKDTrainer):
        trainer = trainer_class(model=copy.deepcopy(student), teacher_model=teacher, args=gkd_config(tmp_path, beta=0.5),
                                train_dataset=chat_dataset(), processing_class=chat_tokenizer(), peft_config=peft_config)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
        trainer.model.train()
        losses.append(trainer.compute_loss(trainer.model, dict(batch)))
        losses[-1].backward()
        grads.append(student_grads(trainer.model))
    assert losses[1] > 1e-3 and rel_err(losses[0], losses[1]) < 1e-5, [loss.item() for loss in losses]
    assert grads[0].keys() == grads[1].keys()
    if peft_config is not None:
        assert any("lora_" in name for name in grads[0])
        assert any("modules_to_save" in name for name in grads[0]) == ("modules_to_save" in student_kind)
    for name, grad in grads[0].items():
        assert rel_err(grad, grads[1][name]) < 1e-5, name


def test_evaluation_and_prediction_losses_are_gkds(tmp_path):
    """evaluate() (the loss alone) and predict() (the loss and the outputs): the losses are GKDTrainer's (two batches,
    each normalised by its own token count); predict() returns no logits, there being none."""
    student, teacher = models()
    dataset = chat_dataset(lengths=((5, 3), (2, 6), (4, 4), (3, 2), (6, 1)), seed=3)
    ours = make(DistillationGKDTrainer, tmp_path, copy.deepcopy(student), teacher, beta=0.2)
    theirs = make(GKDTrainer, tmp_path, copy.deepcopy(student), teacher, beta=0.2)
    got, want = ours.evaluate(dataset)["eval_loss"], theirs.evaluate(dataset)["eval_loss"]
    assert want > 1e-3 and got == pytest.approx(want, rel=1e-5)
    got, want = ours.predict(dataset), theirs.predict(dataset)
    assert want.predictions is not None and got.predictions is None
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-5)


def test_the_teacher_is_left_in_eval_mode_as_gkds(tmp_path):
    """GKDTrainer.compute_loss leaves its teacher in eval mode, so that seq_kd's next generation samples without the
    teacher's dropout: a teacher handed over in train mode ends a step in eval mode in both (ours restored its
    train mode, and sampled with dropout from then on)."""
    student, teacher = models()
    for trainer_class in (DistillationGKDTrainer, GKDTrainer):
        trained_teacher = copy.deepcopy(teacher).train()
        trainer = make(trainer_class, tmp_path, copy.deepcopy(student), trained_teacher)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
        trainer.teacher_model.train()
        trainer.compute_loss(trainer.model, dict(batch))
        assert not any(module.training for module in trainer.teacher_model.modules()), trainer_class
        self_taught = copy.deepcopy(student).train()  # the teacher the student itself: its modules all shared
        trainer = make(trainer_class, tmp_path, self_taught, self_taught)
        trainer.compute_loss(trainer.model, dict(batch))
        assert not any(module.training for module in self_taught.modules()), trainer_class


def test_a_subclass_overriding_the_loss_it_never_calls_raises(tmp_path):
    """A GKDTrainer subclass's own generalized_jsd_loss changes GKDTrainer's loss; ours computes no logits and never
    calls it, so overriding it raises rather than being ignored, unless the subclass's own compute_loss may call it."""
    class WithItsOwnLoss(DistillationGKDTrainer):
        def generalized_jsd_loss(self, *args, **kwargs):
            return super().generalized_jsd_loss(*args, **kwargs)

    class WithItsOwnLossAndStep(WithItsOwnLoss):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    student, teacher = models()
    with pytest.raises(TypeError, match="WithItsOwnLoss overrides generalized_jsd_loss, which the fused loss never"):
        make(WithItsOwnLoss, tmp_path, student, teacher)
    make(WithItsOwnLossAndStep, tmp_path, student, teacher)


@pytest.mark.parametrize("option", ["compute_metrics", "preprocess_logits_for_metrics", "loss_options beta",
                                    "loss_options chunks", "loss_options value", "loss_type", "label_smoothing_factor"])
def test_options_the_fused_loss_cannot_honour_raise(tmp_path, option):
    student, teacher = models()
    kwargs, config = {}, {}
    if option in ("loss_type", "label_smoothing_factor"):  # each changes what the loss reads
        config = {option: {"loss_type": "dft", "label_smoothing_factor": 0.1}[option]}
        match = f"does not support {option}="
    elif option == "compute_metrics":
        kwargs, match = dict(compute_metrics=lambda prediction: {}), "does not support compute_metrics"
    elif option == "loss_options value":  # checked before GKDTrainer's construction put the adapters into the student
        import peft

        lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        kwargs, match = dict(loss_options=dict(chunk_size=0), peft_config=lora), "chunk_size must be > 0, got 0"
    elif option == "preprocess_logits_for_metrics":
        kwargs = dict(preprocess_logits_for_metrics=lambda logits, labels: logits)
        match = "does not support preprocess_logits_for_metrics"
    elif option == "loss_options chunks":  # checked before GKDTrainer's construction (raised at the first step)
        kwargs, match = dict(loss_options=dict(chunks=4)), r"loss_options \['chunks'\] are not options of"
    else:
        kwargs, match = dict(loss_options=dict(beta=0.9)), r"loss_options cannot set \['beta'\]"
    with pytest.raises(TypeError if option == "loss_options chunks" else ValueError, match=match):
        DistillationGKDTrainer(model=student, teacher_model=teacher, args=gkd_config(tmp_path, **config),
                               train_dataset=chat_dataset(), processing_class=chat_tokenizer(), **kwargs)
    assert not any("lora" in name for name, _ in student.named_modules())


def test_defined_on_first_use():
    """Importing cosdistill.trl leaves trl.experimental (whose import warns) alone until DistillationGKDTrainer is
    asked for; the class is then GKDTrainer's subclass, importable and picklable by its name."""
    script = """if True:
        import pickle, sys, warnings
        import cosdistill.trl as module
        assert "trl.experimental" not in sys.modules, "imported with cosdistill.trl"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from cosdistill.trl import DistillationGKDTrainer
        assert any("trl.experimental" in str(w.message) for w in caught), [str(w.message) for w in caught]
        from trl.experimental.gkd import GKDTrainer
        assert issubclass(DistillationGKDTrainer, GKDTrainer) and module.DistillationGKDTrainer is DistillationGKDTrainer
        assert pickle.loads(pickle.dumps(DistillationGKDTrainer)) is DistillationGKDTrainer
        try:
            module.NoSuchTrainer
        except AttributeError as error:
            assert "NoSuchTrainer" in str(error)
        else:
            raise AssertionError("module.NoSuchTrainer did not raise")
    """
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert pickle.loads(pickle.dumps(DistillationGKDTrainer)) is DistillationGKDTrainer


@pytest.mark.parametrize("beta", [1e-5, 1 - 1e-5])
def test_a_beta_near_0_or_1_is_gkds(tmp_path, beta):
    """GKDConfig's beta within 1e-4 of 0 or 1 (not at them) raised when the trainer was made; now its loss and
    gradients are GKD's, against TRL's loss taking the logits in float64 (on fp32 logits TRL's own loses the soft
    term's precision there: the soft term shrinks with beta or 1 - beta)."""
    student, teacher = models()
    ours_student, trl_student = copy.deepcopy(student), copy.deepcopy(student)
    ours = make(DistillationGKDTrainer, tmp_path, ours_student, teacher, beta=beta)
    theirs = make(GKDTrainer, tmp_path, trl_student, teacher, beta=beta)
    theirs.generalized_jsd_loss = lambda student_logits, teacher_logits, **kwargs: GKDTrainer.generalized_jsd_loss(
        student_logits.double(), teacher_logits.double(), **kwargs)
    batch = ours.data_collator([ours.train_dataset[i] for i in range(len(ours.train_dataset))])
    got = ours.compute_loss(ours_student, dict(batch))
    want = theirs.compute_loss(trl_student, dict(batch))
    assert 0 < want < 1e-3 and rel_err(got, want) < 1e-5, (got.item(), want.item())
    got.backward()
    want.backward()
    want_grads = student_grads(trl_student)
    for name, grad in student_grads(ours_student).items():
        assert rel_err(grad, want_grads[name]) < 1e-5, name


@pytest.mark.parametrize("lmbda", [0.0, 1.0], ids=["off-policy", "on-policy"])
def test_with_torch_compile_the_compiled_student_takes_the_eager_step(tmp_path, lmbda):
    """accelerate compiles the student when training starts; the head's hook kept from construction runs in the
    compiled model, and generation (on-policy) runs the model uncompiled with the hook idle."""
    student, teacher = models()
    steps = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = copy.deepcopy(student)
        before = [p.detach().clone() for p in model.parameters()]
        config = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
        make(DistillationGKDTrainer, tmp_path, model, teacher, max_steps=1, lmbda=lmbda, **config).train()
        steps.append([old - new.detach() for old, new in zip(before, model.parameters())])
        assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) == compiled
    assert any(step.any() for step in steps[0])
    for got, want in zip(steps[1], steps[0]):
        assert rel_err(got, want) < 1e-5


def test_with_torch_compile_it_builds_the_graphs_gkdtrainer_builds(tmp_path):
    """The first call checks each model's head on a probe of a few tokens, eagerly: traced, the probe's shape, hook
    and grad mode gave the compiled forward, which the student and teacher share, a graph more than GKDTrainer's,
    past dynamo's recompile limit, beyond which that forward ran uncompiled."""
    student, teacher = models()
    graphs = []
    for trainer_class in (GKDTrainer, DistillationGKDTrainer):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        make(trainer_class, tmp_path, copy.deepcopy(student), copy.deepcopy(teacher), max_steps=2,
             per_device_train_batch_size=2, torch_compile=True, torch_compile_backend="eager").train()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0], graphs
