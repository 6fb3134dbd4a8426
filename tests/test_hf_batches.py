"""The Trainer on the batches real training makes: left padding, packed sequences, every model input,
evaluation logs, and the Trainer options the loss cannot honour."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cosdistill.hf import (  # noqa: E402
    CosineDistillationTrainer,
    cosine_distill_loss,
    final_hidden_states,
    loss_labels,
    next_token_targets,
)
from cosdistill.testing import rel_err  # noqa: E402
from test_hf import OPTIONS, dataset, make_trainer, tiny_model  # noqa: E402


def collate_left(rows):
    """Left padding with attention mask 0 and label -100, as Hugging Face's collators pad for generation."""
    length = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, length - len(row):], attention_mask[i, length - len(row):] = torch.tensor(row), 1
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids.masked_fill(attention_mask == 0, -100))


def one_sgd_step(tmp_path, student, teacher, rows, collator, **args):
    """The loss logged and the gradient (lr 1, plain SGD) of one Trainer step."""
    before = [p.detach().clone() for p in student.parameters()]
    trainer = make_trainer(tmp_path, student, teacher, rows, max_steps=1, optim="sgd", learning_rate=1.0,
                           lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, **args)
    trainer.data_collator = collator
    trainer.train()
    return trainer.state.log_history[0], [old - new.detach() for old, new in zip(before, student.parameters())]


def direct_loss_and_grads(student, teacher, batch, **model_inputs):
    student = copy.deepcopy(student)
    losses = cosine_distill_loss(student, teacher, **batch, return_soft_hard_loss=True, model_inputs=model_inputs,
                                 **OPTIONS)
    losses[0].backward()
    return [loss.detach() for loss in losses], [p.grad for p in student.parameters()]


def test_loss_labels_leave_exactly_the_loss_targets():
    labels = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 3, 4, -100], [1, 2, 3, 4, 5]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2], [0, 1, 0, 1, 2]])  # row 2: two packed sequences
    got = loss_labels(labels, attention_mask, position_ids)
    assert got.tolist() == [[-100, 6, 7, 8, 9], [-100, -100, -100, 4, -100], [-100, 2, -100, 4, 5]]
    targets = next_token_targets(labels, attention_mask, position_ids=position_ids)
    assert targets.tolist() == [[6, 7, 8, 9, -100], [-100, -100, 4, -100, -100], [2, -100, 4, 5, -100]]
    assert next_token_targets(labels[2:], cu_seq_lens=torch.tensor([0, 2, 5], dtype=torch.int32)).tolist() == \
        [[2, -100, 4, 5, -100]]


def test_left_padding_the_trainer_counts_what_the_loss_counts(tmp_path):
    """With left padding the Trainer's own count takes each row's first real token as a target (its source
    position is padding): every update was scaled by the wrong N. Now the logged loss and the step's gradient
    are those of the loss on the whole batch."""
    student, teacher = tiny_model("llama"), tiny_model("llama", vocab=144, seed=1)
    rows = dataset([9, 4, 6, 2])
    batch = collate_left(rows)
    want_losses, want_grads = direct_loss_and_grads(student, teacher, batch)
    trainer = make_trainer(tmp_path, copy.deepcopy(student), teacher, rows)
    _, count = trainer.get_batch_samples(iter([collate_left(rows)]), 1, torch.device("cpu"))
    assert int(count) == int((next_token_targets(batch["labels"], batch["attention_mask"]) != -100).sum()) == 17
    log, step = one_sgd_step(tmp_path, student, teacher, rows, collate_left, per_device_train_batch_size=4)
    assert log["loss"] == pytest.approx(want_losses[0].item(), rel=1e-5)
    for got, want in zip(step, want_grads):
        assert rel_err(got, want) < 1e-5


def test_left_padding_gradient_accumulation_matches_one_big_batch(tmp_path):
    teacher, rows = tiny_model("llama", vocab=160, seed=1), dataset([14, 3, 9, 2])
    steps = {}
    for accumulation, batch_size in ((1, 4), (2, 2)):
        _, steps[accumulation] = one_sgd_step(tmp_path, tiny_model("llama"), teacher, rows, collate_left,
                                              per_device_train_batch_size=batch_size,
                                              gradient_accumulation_steps=accumulation)
    for one_batch, accumulated in zip(steps[1], steps[2]):
        assert rel_err(accumulated, one_batch) < 1e-5


def packed(rows, separators=True):
    """The rows as one packed row, as DataCollatorWithFlattening makes it (labels -100 at each sequence's first
    token when ``separators``), with position_ids restarting at each sequence."""
    batch = transformers.DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": row} for row in rows])
    if not separators:
        batch["labels"] = batch["input_ids"].clone()
    return batch


@pytest.mark.parametrize("separators", [True, False])
def test_a_packed_batch_is_each_sequence_on_its_own(separators):
    """Each packed sequence sees its own positions and no target crosses into the next sequence: the loss
    and gradients equal those of the sequences unpacked, one row each (same N)."""
    student, teacher = tiny_model("llama"), tiny_model("llama", vocab=144, seed=1)
    rows = dataset([7, 5, 9])
    batch = packed(rows, separators)
    position_ids = batch.pop("position_ids")
    got_losses, got_grads = direct_loss_and_grads(student, teacher, batch, position_ids=position_ids)
    unpacked = [dict(input_ids=torch.tensor([row]), labels=torch.tensor([row])) for row in rows]
    count = sum(len(row) - 1 for row in rows)
    parts = [direct_loss_and_grads(student, teacher, dict(part, num_valid_tokens=count)) for part in unpacked]
    want_losses = [sum(part[0][i] for part in parts) for i in range(3)]
    for got, want in zip(got_losses, want_losses):
        assert rel_err(got, want) < 1e-5
    for i, got in enumerate(got_grads):
        assert rel_err(got, sum(part[1][i] for part in parts)) < 1e-4
    without_positions, _ = direct_loss_and_grads(student, teacher, batch)
    assert rel_err(without_positions[0], want_losses[0]) > 1e-3  # the positions matter: the test can fail


def test_the_trainer_trains_on_packed_batches(tmp_path):
    student, teacher = tiny_model("llama"), tiny_model("llama", vocab=144, seed=1)
    rows = dataset([7, 5, 9, 4])
    batch = packed(rows)
    want_losses, want_grads = direct_loss_and_grads(student, teacher, {k: batch[k] for k in ("input_ids", "labels")},
                                                    position_ids=batch["position_ids"])
    log, step = one_sgd_step(tmp_path, student, teacher, rows, lambda rows: packed(rows), per_device_train_batch_size=4)
    assert log["loss"] == pytest.approx(want_losses[0].item(), rel=1e-5)
    for got, want in zip(step, want_grads):
        assert rel_err(got, want) < 1e-4


def test_every_model_input_of_the_batch_reaches_both_models(tmp_path):
    student, teacher = tiny_model("llama"), tiny_model("llama", vocab=144, seed=1)
    seen = {}
    for name, model in (("student", student), ("teacher", teacher)):
        model.register_forward_pre_hook(lambda module, args, kwargs, _n=name: seen.setdefault(_n, set(kwargs)) and None,
                                        with_kwargs=True)
    batch = packed(dataset([5, 6]))
    trainer = make_trainer(tmp_path, student, teacher, [])
    trainer.compute_loss(student, dict(batch, token_type_ids=torch.zeros_like(batch["input_ids"])))
    for name in ("student", "teacher"):
        assert {"input_ids", "position_ids", "token_type_ids"} <= seen[name] and "labels" not in seen[name]


def test_evaluate_logs_soft_and_hard(tmp_path):
    student, teacher = tiny_model("llama"), tiny_model("llama", vocab=144, seed=1)
    rows = dataset([9, 4, 6, 2, 7])
    trainer = make_trainer(tmp_path, student, teacher, rows, per_device_eval_batch_size=2)
    metrics = trainer.evaluate(eval_dataset=rows)
    weighted = OPTIONS["weight_hard_loss"] * metrics["eval_hard_loss"] + OPTIONS["weight_soft_loss"] * metrics["eval_soft_loss"]
    assert metrics["eval_loss"] == pytest.approx(weighted, rel=1e-5)
    assert metrics["eval_soft_loss"] > 0 and metrics["eval_hard_loss"] > 0
    test_metrics = trainer.evaluate(eval_dataset=rows[:2], metric_key_prefix="test")
    assert {"test_soft_loss", "test_hard_loss"} <= set(test_metrics)
    with torch.no_grad():
        batch = trainer.data_collator(rows[:2])
        _, soft, hard = cosine_distill_loss(student, teacher, **batch, return_soft_hard_loss=True, **OPTIONS)
    assert test_metrics["test_soft_loss"] == pytest.approx(soft.item(), rel=1e-5)


def test_options_the_loss_cannot_honour_raise(tmp_path):
    student, teacher = tiny_model("llama"), tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1"):
        make_trainer(tmp_path, student, teacher, [], label_smoothing_factor=0.1)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="compute_loss_func"):
        CosineDistillationTrainer(model=student, args=args, teacher_model=teacher, compute_loss_func=lambda *a, **k: 0)


def test_final_hidden_states_passes_model_inputs_on():
    model = tiny_model("llama")
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    restarted = final_hidden_states(model, input_ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    plain = final_hidden_states(model, input_ids)
    torch.testing.assert_close(restarted[:, :3], plain[:, :3])
    assert rel_err(restarted[:, 3:], plain[:, 3:]) > 1e-3


# PEFT students

peft = pytest.importorskip("peft")


def lora_student(targets=("q_proj", "v_proj")):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(tiny_model("llama"), config)


def test_a_lora_student_matches_the_naive_loss_and_skips_the_frozen_heads_gradient(monkeypatch):
    """Through PeftModel's wrappers the loss finds the head and the hidden states; the head is frozen, so no
    grad_weight is computed, and the adapters' gradients are the naive loss's."""
    from cosdistill import api
    from test_hf import make_batch, naive_loss

    plans, make_plan = [], api.make_plan
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: plans.append(make_plan(*a, **k)) or plans[-1])
    student, teacher, batch = lora_student(), tiny_model("llama", vocab=144, seed=1), make_batch(vocab=128)
    reference_student = copy.deepcopy(student)
    losses = cosine_distill_loss(student, teacher, **batch, return_soft_hard_loss=True, **OPTIONS)
    losses[0].backward()
    want = naive_loss(reference_student, teacher, **batch, **OPTIONS)
    want[0].backward()
    for got, expected in zip(losses, want):
        assert rel_err(got, expected) < 1e-5
    trained = [(name, p, q) for (name, p), q in zip(student.named_parameters(), reference_student.parameters())
               if p.requires_grad]
    assert trained and all("lora_" in name for name, _, _ in trained)
    for _, got, expected in trained:
        assert rel_err(got.grad, expected.grad) < 1e-5
    assert [plan.needs_grad for plan in plans] == [(True, False, False)]


def test_the_trainer_trains_a_lora_student(tmp_path):
    student, teacher = lora_student(), tiny_model("llama", vocab=144, seed=1)
    rows = dataset([9, 4, 6, 2])
    trainer_batch = make_trainer(tmp_path, student, teacher, rows).data_collator(rows)
    batch = {key: value.clone() for key, value in trainer_batch.items()}
    want_losses, want_grads = direct_loss_and_grads(student, teacher, batch)
    log, step = one_sgd_step(tmp_path, student, teacher, rows, lambda rows: trainer_batch, per_device_train_batch_size=4)
    assert log["loss"] == pytest.approx(want_losses[0].item(), rel=1e-5)
    trainable = [p.requires_grad for p in student.parameters()]
    for got, want, trains in zip(step, want_grads, trainable):
        assert (rel_err(got, want) < 1e-5) if trains else (want is None and not got.any())


def test_an_adapter_on_the_lm_head_is_a_clear_error():
    student, teacher, rows = lora_student(("q_proj", "lm_head")), tiny_model("llama", vocab=144, seed=1), dataset([5, 5])
    batch = dict(input_ids=torch.tensor(rows), labels=torch.tensor(rows))
    with pytest.raises(TypeError, match="LM head carries an adapter"):
        cosine_distill_loss(student, teacher, **batch)


@pytest.mark.parametrize("setting, message", [
    (dict(is_deepspeed_enabled=True, deepspeed_plugin=dict(zero_stage=3)), "DeepSpeed ZeRO-3"),
    (dict(is_fsdp_enabled=True, fsdp_plugin=dict(fsdp_version=1)), "FSDP1"),
    (dict(n_gpu=2), "DataParallel"),
])
def test_sharding_the_loss_cannot_read_raises(setting, message):
    from types import SimpleNamespace

    from cosdistill.hf import check_sharding

    state = SimpleNamespace(**{key: SimpleNamespace(**value) for key, value in setting.items() if key.endswith("plugin")})
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=state), args=SimpleNamespace(n_gpu=setting.get("n_gpu", 1)),
                              **{key: value for key, value in setting.items() if key.startswith("is_")})
    with pytest.raises(ValueError, match=message):
        check_sharding(trainer)
    fine = dict(setting, n_gpu=1, deepspeed_plugin=dict(zero_stage=2), fsdp_plugin=dict(fsdp_version=2))
    state = SimpleNamespace(**{key: SimpleNamespace(**value) for key, value in fine.items() if key.endswith("plugin")})
    check_sharding(SimpleNamespace(accelerator=SimpleNamespace(state=state), args=SimpleNamespace(n_gpu=1),
                                   **{key: value for key, value in fine.items() if key.startswith("is_")}))
