"""cosdistill.trl: SFTTrainer's data handling (completion-only labels, packing) with the cosine loss."""

import copy
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from cosdistill.hf import distill_loss  # noqa: E402
from cosdistill.testing import rel_err  # noqa: E402
from cosdistill.trl import CosineDistillationSFTTrainer, DistillationSFTTrainer  # noqa: E402
from test_hf import OPTIONS, tiny_model  # noqa: E402

VOCAB = 128


SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")


def word_tokenizer():
    """A whitespace tokenizer over four special tokens and the words w4 .. w127, built without downloads."""
    vocab = {**{token: i for i, token in enumerate(SPECIAL)}, **{f"w{i}": i for i in range(len(SPECIAL), VOCAB)}}
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


def prompt_completion_dataset(lengths=((5, 3), (2, 6), (4, 4), (3, 2)), seed=0):
    generator = torch.Generator().manual_seed(seed)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(len(SPECIAL), VOCAB, (n,), generator=generator))

    return datasets.Dataset.from_list([{"prompt": words(p), "completion": " " + words(c)} for p, c in lengths])


def text_dataset(lengths=(8, 8, 8, 6), seed=0):
    """Language modelling rows: every token a target, so a packed example's first token is one too."""
    generator = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([
        {"text": " ".join(f"w{int(i)}" for i in torch.randint(len(SPECIAL), VOCAB, (n,), generator=generator))}
        for n in lengths])


COMPILED = dict(torch_compile=True, torch_compile_backend="aot_eager")


def make_sft_trainer(tmp_path, student, teacher, loss="cosine", train_dataset=None, eval_dataset=None,
                     trainer_class=DistillationSFTTrainer, **config):
    config = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                  logging_steps=1, seed=0, max_steps=1, per_device_train_batch_size=4, optim="sgd", learning_rate=1.0,
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                  bf16=False) | config  # SFTConfig turns bf16 on by default
    args = trl.SFTConfig(**config)
    assert CosineDistillationSFTTrainer is DistillationSFTTrainer
    return trainer_class(model=student, teacher_model=teacher, args=args,
                                  train_dataset=train_dataset or prompt_completion_dataset(), eval_dataset=eval_dataset,
                                  processing_class=word_tokenizer(), loss=loss, **OPTIONS)


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("config", [{}, dict(packing=True, padding_free=True), COMPILED],
                         ids=["completion-only", "packed", "compiled"])
def test_one_step_is_the_distillation_loss_on_sfts_batch(tmp_path, config, loss):
    """The loss logged and the step taken are the cosine loss's on the batch SFTTrainer builds: prompt tokens
    carry no target, and a packed batch keeps each sequence to itself. With torch_compile, accelerate compiles the
    student and the step is the same."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    student, teacher = tiny_model("llama"), tiny_model("llama", vocab=144, seed=1)
    before = copy.deepcopy(student)
    trainer = make_sft_trainer(tmp_path, student, teacher, loss=loss, **config)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    labels, data = batch["labels"], prompt_completion_dataset()
    completions = sum(len(completion.split()) + 1 for completion in data["completion"])  # each with its end token
    assert (labels != -100).sum() == completions  # no prompt token is a label
    model_inputs = {key: value for key, value in batch.items() if key not in ("input_ids", "attention_mask", "labels")}
    assert ("position_ids" in model_inputs) == ("packing" in config)
    reference = copy.deepcopy(before)
    want = distill_loss(reference, teacher, batch["input_ids"], batch.get("attention_mask"), labels,
                        model_inputs=model_inputs, loss=loss, **OPTIONS)
    want.backward()
    trainer.train()
    assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) == (config is COMPILED)
    assert trainer.state.log_history[0]["loss"] == pytest.approx(want.item(), rel=1e-5)
    for old, new, ref in zip(before.parameters(), student.parameters(), reference.parameters()):
        assert rel_err(old.detach() - new.detach(), ref.grad) < 1e-4


@pytest.mark.parametrize("rows", [prompt_completion_dataset, text_dataset], ids=["prompt-completion", "text"])
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_a_packed_step_is_each_example_on_its_own(tmp_path, loss, rows):
    """A packed, padding-free step equals the loss of each example run alone, one row each, over the whole
    step's count: no attention and no target crosses from one example into the next (in text rows the next
    example's first token would be a target; TRL's collator and loss_labels both take it out)."""
    student, teacher = tiny_model("llama"), tiny_model("llama", vocab=144, seed=1)
    before = copy.deepcopy(student)
    unpacked = make_sft_trainer(tmp_path, copy.deepcopy(student), teacher, loss=loss, train_dataset=rows())
    examples = [unpacked.data_collator([example]) for example in unpacked.train_dataset]
    count = sum(int((example["labels"][:, 1:] != -100).sum()) for example in examples)
    reference = copy.deepcopy(before)
    want = sum(distill_loss(reference, teacher, example["input_ids"], example["attention_mask"], example["labels"],
                            num_valid_tokens=count, loss=loss, **OPTIONS) for example in examples)
    want.backward()
    trainer = make_sft_trainer(tmp_path, student, teacher, loss=loss, train_dataset=rows(), packing=True,
                               padding_free=True)
    assert len(trainer.train_dataset) < len(examples)  # the examples were packed
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(want.item(), rel=1e-5)
    for old, new, ref in zip(before.parameters(), student.parameters(), reference.parameters()):
        assert rel_err(old.detach() - new.detach(), ref.grad) < 1e-4


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_a_copy_made_after_sfttrainer_patched_the_model_raises_not_a_wrong_loss(tmp_path, loss):
    """TRL's SFTTrainer replaces its model's forward by one that calls the original model's: a deep copy made after
    it runs the original's layers. The loss sees its head never called and raises, saying so, rather than train
    one model on another's hidden states (it raised an IndexError before the first call's head check)."""
    student, teacher = tiny_model("llama"), tiny_model("llama", seed=1)
    trl.SFTTrainer(model=student, args=trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                                     bf16=False),
                   train_dataset=text_dataset(), processing_class=word_tokenizer())
    copied = copy.deepcopy(student)
    input_ids = torch.randint(len(SPECIAL), VOCAB, (2, 6))
    with pytest.raises(ValueError, match="called its LM head 0 times.*copy the model before a trainer is built"):
        distill_loss(copied, teacher, input_ids, labels=input_ids, loss=loss)
    distill_loss(copy.deepcopy(tiny_model("llama")), teacher, input_ids, labels=input_ids, loss=loss)  # a fresh copy


@pytest.mark.parametrize("option", [dict(loss_type="dft"), dict(use_liger_kernel=True), dict(label_smoothing_factor=0.1)])
def test_sft_options_the_loss_cannot_honour_raise(tmp_path, option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"does not support {name}="):
        make_sft_trainer(tmp_path, tiny_model("llama"), tiny_model("llama", seed=1), **option)


def tiny_mixtral(seed=0):
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, vocab_size=128, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def test_a_moe_students_router_loss_is_refused_not_dropped(tmp_path):
    """SFTTrainer adds a Mixture-of-Experts student's router load-balancing loss by default (the config's
    coefficient); the distillation loss replaces the model's loss, so it raises until that is turned off (left out,
    the step was 16% off SFTTrainer's at router_aux_loss_coef=0.5)."""
    for config in ({}, dict(router_aux_loss_coef=0.5)):
        with pytest.raises(ValueError, match="does not add the student's router auxiliary loss"):
            make_sft_trainer(tmp_path, tiny_mixtral(), tiny_model("llama", seed=1), **config)
    make_sft_trainer(tmp_path, tiny_mixtral(), tiny_model("llama", seed=1), router_aux_loss_coef=0.0).train()


def test_a_moe_student_whose_config_has_no_coefficient_is_refused_too(tmp_path):
    """Families whose config has output_router_logits but no router_aux_loss_coef (sarvam_moe): SFTTrainer adds the
    router loss by its own switch (aux_loss_enabled) and leaves the config as it was, so the check of the config
    passed and the term was dropped (14.87 against 4.87 at router_aux_loss_coef=5)."""
    if "sarvam_moe" not in transformers.CONFIG_MAPPING:
        pytest.skip("a transformers release without sarvam_moe")
    torch.manual_seed(0)
    config = transformers.CONFIG_MAPPING["sarvam_moe"](
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    student = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert not hasattr(config, "router_aux_loss_coef")
    with pytest.raises(ValueError, match=r"does not add the student's router auxiliary loss .*router_aux_loss_coef=5.0"):
        make_sft_trainer(tmp_path, copy.deepcopy(student), tiny_model("llama", seed=1), router_aux_loss_coef=5.0)
    make_sft_trainer(tmp_path, student, tiny_model("llama", seed=1), router_aux_loss_coef=0.0)


def test_sft_predict_and_evaluate_give_the_loss_without_logits(tmp_path):
    """SFTTrainer's prediction step reads outputs.logits: the loss's outputs carry none (predict crashed on a dict)."""
    trainer = make_sft_trainer(tmp_path, tiny_model("llama"), tiny_model("llama", vocab=144, seed=1))
    dataset = trainer.train_dataset
    output = trainer.predict(dataset)
    assert output.metrics["test_loss"] == pytest.approx(trainer.evaluate(eval_dataset=dataset)["eval_loss"], rel=1e-6)
    assert output.metrics["test_loss"] > 0


@pytest.mark.parametrize("config", [{}, dict(packing=True, padding_free=True)], ids=["padded", "packed"])
def test_num_tokens_is_logged_as_sfttrainer_logs_it(tmp_path, config):
    """SFTTrainer logs num_tokens, the tokens trained on so far (padding left out); it went missing with the
    distillation loss. Read once per log, it matches SFTTrainer's own count at every log, training and evaluation."""
    logged = {}
    for name in ("ours", "sft"):
        student = tiny_model("llama")
        if name == "ours":
            trainer = make_sft_trainer(tmp_path, student, tiny_model("llama", vocab=144, seed=1), max_steps=5,
                                       per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                       logging_steps=2, eval_strategy="steps", eval_steps=3,
                                       eval_dataset=prompt_completion_dataset(), **config)
        else:
            args = copy.deepcopy(trainer.args)
            trainer = trl.SFTTrainer(model=student, args=args, train_dataset=prompt_completion_dataset(),
                                     eval_dataset=prompt_completion_dataset(), processing_class=word_tokenizer())
        trainer.train()
        trainer.evaluate(eval_dataset=prompt_completion_dataset())
        logged[name] = [{key: value for key, value in entry.items() if key.endswith("num_tokens")}
                        for entry in trainer.state.log_history]
    assert logged["ours"] == logged["sft"]
    # steps 2 and 4 log, 3 and 5 evaluate; the run's summary (none, as SFTTrainer's) and the evaluation after it
    assert [sorted(entry) for entry in logged["ours"]] == [["num_tokens"], ["eval_num_tokens"]] * 2 + [
        [], ["eval_num_tokens"]]


def two_word_dataset(lengths=(3, 6, 4, 5)):
    """Prompts of three words, completions of w5 and w6 alone (``guessing_student`` guesses between those two)."""
    generator = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list([
        {"prompt": "w9 w10 w11", "completion": " " + " ".join(f"w{int(i)}" for i in torch.randint(5, 7, (n,),
                                                                                           generator=generator))}
        for n in lengths])


def guessing_student():
    """A tiny Llama whose head picks w5 or w6 by the sign of one direction: on ``two_word_dataset`` about half its
    top-1 guesses hit."""
    student = tiny_model("llama")
    with torch.no_grad():
        head = student.get_output_embeddings().weight
        direction = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(1))
        head.zero_()
        head[5], head[6] = 3 * direction, -3 * direction
    return student


@pytest.mark.parametrize("config", [{}, dict(packing=True, padding_free=True), COMPILED],
                         ids=["completion-only", "packed", "compiled"])
def test_entropy_and_mean_token_accuracy_are_logged_as_sfttrainer_logs_them(tmp_path, config):
    """SFTTrainer logs the student's mean entropy and top-1 accuracy over the tokens with a target, from its logits;
    they went missing with the distillation loss. With a learning rate of 0 both trainers see the same student at
    every step: the same numbers at every log, training and evaluation, each the mean of its loss calls'."""
    logged = {}
    dataset = two_word_dataset()
    for name in ("ours", "sft"):
        student = guessing_student()
        if name == "ours":
            trainer = make_sft_trainer(tmp_path, student, tiny_model("llama", vocab=144, seed=1), max_steps=5,
                                       per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                       logging_steps=2, eval_strategy="steps", eval_steps=3, learning_rate=0.0,
                                       train_dataset=dataset, eval_dataset=dataset, **config)
        else:
            args = copy.deepcopy(trainer.args)
            trainer = trl.SFTTrainer(model=student, args=args, train_dataset=dataset, eval_dataset=dataset,
                                     processing_class=word_tokenizer())
        trainer.train()
        trainer.evaluate(eval_dataset=dataset.select([1, 2, 3]))
        logged[name] = [{key: value for key, value in entry.items() if key.endswith(("entropy", "mean_token_accuracy"))}
                        for entry in trainer.state.log_history]
    assert [sorted(entry) for entry in logged["ours"]] == [sorted(entry) for entry in logged["sft"]]
    assert sum(len(entry) for entry in logged["ours"]) >= 10
    for ours, sft in zip(logged["ours"], logged["sft"]):
        for key, value in sft.items():
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    accuracies = [value for entry in logged["sft"] for key, value in entry.items() if "accuracy" in key]
    assert len(accuracies) >= 5 and all(0.2 < value < 0.8 for value in accuracies), accuracies


def test_a_step_that_raised_counts_no_tokens(tmp_path):
    """auto_find_batch_size retries a step whose forward ran out of memory with a smaller batch: the failed step's
    tokens were counted before its loss ran, and num_tokens logged 57 where SFTTrainer logs 24."""
    logged = {}
    for name in ("ours", "sft"):
        student, raised = tiny_model("llama"), []

        def out_of_memory_once(module, args, kwargs):
            if module.training and not raised:
                raised.append(True)
                raise RuntimeError("CUDA out of memory. (a test's)")

        student.model.register_forward_pre_hook(out_of_memory_once, with_kwargs=True)
        if name == "ours":
            trainer = make_sft_trainer(tmp_path, student, tiny_model("llama", vocab=144, seed=1),
                                       auto_find_batch_size=True)
        else:
            trainer = trl.SFTTrainer(model=student, args=copy.deepcopy(trainer.args),
                                     train_dataset=prompt_completion_dataset(), processing_class=word_tokenizer())
        trainer.train()
        assert raised and trainer._train_batch_size < 4
        logged[name] = [entry["num_tokens"] for entry in trainer.state.log_history if "num_tokens" in entry]
    assert logged["ours"] == logged["sft"] and logged["ours"][0] > 0


@pytest.mark.parametrize("values, message", [
    (dict(loss="jsd", temperature=-1.0), "temperature must be > 0, got -1.0"),
    (dict(loss="jsd", beta=1.5), "beta must be in [0, 1] for the generalized JSD, got 1.5"),
    (dict(weight_soft_loss=float("nan")), "weight_soft_loss must be finite, got nan"),
])
def test_bad_loss_values_raise_at_construction(tmp_path, values, message):
    """They raised at the first step, after the models were prepared and the data was tokenized."""
    loss = values.pop("loss", "cosine")
    with pytest.raises(ValueError, match=re.escape(message)):
        DistillationSFTTrainer(model=tiny_model("llama"), teacher_model=tiny_model("llama", seed=1),
                               args=trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False),
                               train_dataset=prompt_completion_dataset(), processing_class=word_tokenizer(), loss=loss,
                               **values)


def test_dir_lists_the_trainers_made_on_first_use():
    """DistillationTrainer and DistillationGKDTrainer are made at their first use (module __getattr__); dir() and
    help() list them before it, so completion and help(cosdistill.trl) find them (a fresh process: this one may
    have made them already)."""
    code = "import cosdistill.trl as t; print(sorted(set(t.__all__) - set(dir(t))))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
