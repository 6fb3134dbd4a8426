"""One training step of TRL's DistillationTrainer, or of its GKDTrainer (``--trainer gkd``), with TRL's own loss
and with ours (``cosdistill.trl``'s drop-ins): what a TRL user who changes the import gets, on real-shaped models.

A Llama-3.2-1B-shaped student and a Llama-3.1-8B-shaped teacher (random weights from their configs, no
downloads), bf16, AdamW, gradient checkpointing, beta 0.5 and temperature 1 (``--beta``, ``--temperature``; TRL's
DistillationConfig defaults to the reverse KL, beta 1). The step is the trainer's own: ``Trainer.training_step``
(both models' forwards, the loss, the backward through accelerate), the gradient's clipping, the optimizer's and
the learning rate's steps, on one batch of left-padded prompts and completions of varied lengths, padded after
their end. Generating that batch costs both trainers the same and is left out: each DistillationTrainer's
``_generate_and_score_completions`` returns it; the GKDTrainers take it as their collator lays a dataset's
conversations out (prompt and completion in one row, labels on the completion), with ``lmbda`` 0 (no on-policy
generation; TRL's GKD loss takes no temperature: its ``temperature`` is the sampling one). Per trainer: the step's
time, completion tokens per second, and the peak memory of a step after the warm-up above what the process holds
between steps. Trainers interleaved in rounds (their order alternating), medians of CUDA-event times after a
warm-up; before any step, both losses on the same weights and batch must agree.

    PYTHONPATH=src python benchmarks/trl_step.py [--trainer distillation|gkd] [--rows 4] [--prompt-len 512]
        [--completion-len 2048] [--rounds 3] [--ledger benchmarks/results.csv] [--json out.json]
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/trl_step.py --tiny --device cpu   (a smoke run)
"""

import argparse
import copy
import json
import shlex
import statistics
import sys
import tempfile
import warnings

import datasets
import tokenizers
import torch
import transformers
import trl
from step import (  # benchmarks/step.py
    STUDENT,
    TEACHER,
    TINY_STUDENT,
    TINY_TEACHER,
    TINY_VOCAB,
    VOCAB,
    llama,
    release_versions,
)

import cosdistill.trl
from cosdistill.testing import rel_err
from cosdistill.tools.bench import append_ledger_rows, call_ms, check_ledger_path

PAD = 0
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def trl_gkd():
    """TRL's GKD module, imported on first use: TRL warns on every import from trl.experimental."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental import gkd
    return gkd


def trainer_classes(kind):
    """{"trl": TRL's trainer, "ours": its drop-in} for ``kind``, "distillation" or "gkd"."""
    if kind == "distillation":
        return {"trl": trl.DistillationTrainer, "ours": cosdistill.trl.DistillationTrainer}
    return {"trl": trl_gkd().GKDTrainer, "ours": cosdistill.trl.DistillationGKDTrainer}


def word_tokenizer(vocab):
    """Words w0 .. w(vocab - 1), w0 padding and w1 the end: the trainers need a tokenizer, the step never reads text."""
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="w0", eos_token="w1",
                                                unk_token="w2", padding_side="left")


def completions_batch(rows, prompt_len, completion_len, vocab, device, seed=0):
    """What _generate_and_score_completions returns: prompts left-padded to prompt_len, completions of 1/2 to all
    of completion_len tokens padded after their end, and the completion tokens' count."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (rows, prompt_len), generator=generator)
    completion_ids = torch.randint(3, vocab, (rows, completion_len), generator=generator)
    prompt_lengths = torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=generator)
    completion_lengths = torch.randint(completion_len // 2, completion_len + 1, (rows,), generator=generator)
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - prompt_lengths[:, None]).long()
    completion_mask = (torch.arange(completion_len) < completion_lengths[:, None]).long()
    batch = dict(prompt_ids=prompt_ids.masked_fill(prompt_mask == 0, PAD), prompt_mask=prompt_mask,
                 completion_ids=completion_ids.masked_fill(completion_mask == 0, PAD), completion_mask=completion_mask,
                 num_items_in_batch=completion_mask.sum().float())
    return {key: value.to(device) for key, value in batch.items()}


def as_gkd_batch(batch):
    """The batch as GKD's collator lays out a conversation: prompt then completion in one row, labels (the targets,
    shifted by the loss) on the completion's tokens alone."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    trained = torch.cat([torch.zeros_like(batch["prompt_mask"]), batch["completion_mask"]], dim=1)
    return dict(input_ids=input_ids, attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
                labels=input_ids.masked_fill(trained == 0, -100), prompts=batch["prompt_ids"],
                prompt_attention_mask=batch["prompt_mask"])


def make_trainer(kind, trainer_class, student, teacher, batch, tokenizer, output_dir, device, beta, temperature):
    rows, completion_len = batch["completion_ids"].shape
    common = dict(output_dir=output_dir, report_to="none", save_strategy="no", disable_tqdm=True,
                  bf16=device.type == "cuda", use_cpu=device.type == "cpu", per_device_train_batch_size=rows,
                  learning_rate=1e-5, beta=beta, temperature=temperature)
    if kind == "distillation":
        config = trl.DistillationConfig(**common, max_completion_length=completion_len)
        dataset = datasets.Dataset.from_list([{"prompt": "w3 w4"}] * rows)
    else:
        config = trl_gkd().GKDConfig(**common, lmbda=0.0, max_new_tokens=completion_len)
        dataset = datasets.Dataset.from_list(
            [{"messages": [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5"}]}] * rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's notes on the tokenizer's chat template and generation settings
        trainer = trainer_class(model=student, teacher_model=teacher, args=config, train_dataset=dataset,
                                processing_class=tokenizer)
    if kind == "distillation":
        trainer._generate_and_score_completions = lambda inputs: dict(batch)
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    student.config.use_cache = False
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), read by TRL's training_step
    return trainer


def gkd_reference_loss(student, teacher, inputs, beta) -> torch.Tensor:
    """TRL's GKD loss (its generalized_jsd_loss) on both models' logits in fp32: TRL's trainer forms it in the logits'
    dtype, which in bf16 rounds a small divergence away."""
    with torch.no_grad():
        logits = [model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        use_cache=False).logits[:, :-1].float() for model in (student, teacher)]
    return trl_gkd().GKDTrainer.generalized_jsd_loss(*logits, labels=inputs["labels"][:, 1:], beta=beta)


def start_losses_against_their_reference(kind, trainers, loss_inputs, teacher, beta):
    """({trainer: its loss before any step}, the reference they are held to): TRL's own loss for the
    DistillationTrainer (fp32 tiles); for GKD, gkd_reference_loss on the batch's first row (the whole batch's fp32
    logits would not fit beside the models). Raises unless ours is within 1e-2 of it: the same loss, or the
    timing compares different work."""
    if kind == "gkd":
        loss_inputs = {key: value[:1] for key, value in loss_inputs.items()}
    losses = {}
    with torch.no_grad():
        for name, trainer in trainers.items():
            trainer.model.train()
            losses[name] = trainer.compute_loss(trainer.model, dict(loss_inputs)).float()
    model = next(iter(trainers.values())).model
    reference = (losses["trl"] if kind == "distillation" else
                 gkd_reference_loss(model, teacher, loss_inputs, beta))
    if "ours" in losses and not rel_err(losses["ours"], reference) < 1e-2:
        raise RuntimeError(f"the trainers' losses differ before any step: {losses}, reference {float(reference)}")
    return losses, reference


def step(trainer, inputs) -> None:
    """The trainer's step from the batch (already generated) to the updated weights, as Trainer.train runs it."""
    trainer.training_step(trainer.model, copy.copy(inputs), None)
    trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def measure(trainers, inputs, device, rounds, reps, warmup):
    """{trainer: dict(step_ms, step_ms_by_round, peak_gb)} in interleaved rounds; the peak is round 0's timed
    steps' above the memory allocated before them (the optimizer's state, made by the warm-up, held)."""
    times, peaks = {name: [] for name in trainers}, {}
    for round_index in range(rounds):
        names = list(trainers) if round_index % 2 == 0 else list(trainers)[::-1]
        for name in names:
            trainer = trainers[name]
            if round_index == 0:
                for _ in range(warmup):
                    step(trainer, inputs)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    resting = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
            times[name].append(statistics.median(call_ms(lambda: step(trainer, inputs), device) for _ in range(reps)))
            if round_index == 0 and device.type == "cuda":
                peaks[name] = (torch.cuda.max_memory_allocated() - resting) / 2**30
    return {name: dict(step_ms=statistics.median(by_round), step_ms_by_round=by_round, peak_gb=peaks.get(name))
            for name, by_round in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=("distillation", "gkd"), default="distillation",
                        help="TRL's DistillationTrainer or its GKDTrainer, each against ours")
    parser.add_argument("--rows", type=int, default=4, help="sequences per step")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--completion-len", type=int, default=2048)
    parser.add_argument("--beta", type=float, default=0.5, help="0: forward KL, 1: reverse KL")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--trainers", default="trl,ours", help="trl, ours or both (a DistillationTrainer run "
                        "needs trl: its loss is ours' reference)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1: it makes the optimizer's state)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--ledger")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step makes the optimizer's state")
    names = args.trainers.split(",")
    if not names or not set(names) <= {"trl", "ours"} or len(set(names)) != len(names):
        parser.error(f"--trainers takes trl, ours or both, got {args.trainers!r}")
    if args.trainer == "distillation" and "trl" not in names:
        parser.error("--trainer distillation needs trl in --trainers: TRL's loss is the reference ours is held to")
    device = torch.device(args.device)
    if args.ledger:
        try:
            check_ledger_path(args.ledger, on_gpu=device.type == "cuda", rounds=args.rounds)
        except ValueError as error:
            parser.error(str(error))
    student_shape, teacher_shape, vocab = (TINY_STUDENT, TINY_TEACHER, TINY_VOCAB) if args.tiny else (STUDENT, TEACHER, VOCAB)
    max_len = args.prompt_len + args.completion_len
    student = llama(student_shape, vocab, max_len, device, seed=0)
    teacher = llama(teacher_shape, vocab, max_len, device, seed=1).eval().requires_grad_(False)
    batch = completions_batch(args.rows, args.prompt_len, args.completion_len, vocab, device)
    tokenizer = word_tokenizer(vocab)
    if args.trainer == "gkd":
        tokenizer.chat_template = CHAT_TEMPLATE
    # what a step takes: a DistillationTrainer generates its batch (here returns it), a GKDTrainer is given it
    loss_inputs = batch if args.trainer == "distillation" else as_gkd_batch(batch)
    step_inputs = [{"prompt": "w3"}] if args.trainer == "distillation" else loss_inputs
    classes = trainer_classes(args.trainer)
    # the copies before any trainer is made: a trainer sets its model's forward to a wrapper of that very model's,
    # which a later copy would share
    students = [student] + [copy.deepcopy(student) for _ in names[1:]]
    with tempfile.TemporaryDirectory() as output_dir:
        trainers = {name: make_trainer(args.trainer, classes[name], copied, teacher, batch, tokenizer, output_dir,
                                       device, args.beta, args.temperature) for name, copied in zip(names, students)}
        start_losses, reference = start_losses_against_their_reference(args.trainer, trainers, loss_inputs, teacher,
                                                                       args.beta)
        results = measure(trainers, step_inputs, device, args.rounds, args.reps, args.warmup)
    tokens = int(batch["num_items_in_batch"])
    print(f"{args.rows} rows of {args.prompt_len} + {args.completion_len} tokens ({tokens} completion tokens), {device}; "
          f"the losses before any step ({'the first row' if args.trainer == 'gkd' else 'the batch'}): reference "
          f"{float(reference):.6f}, " + ", ".join(f"{name} {float(loss):.6f} ({rel_err(loss, reference):.1e} off)"
                                                  for name, loss in start_losses.items()))
    print("| trainer | step ms | completion tokens/s | peak GB above resting |")
    print("|---|---:|---:|---:|")
    for name, result in results.items():
        peak = "-" if result["peak_gb"] is None else f"{result['peak_gb']:.2f}"
        print(f"| {name} | {result['step_ms']:.1f} | {1000 * tokens / result['step_ms']:.0f} | {peak} |")
    if args.ledger:
        command = "python benchmarks/trl_step.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        models = "tiny student, tiny teacher" if args.tiny else "Llama-3.2-1B-shaped student, Llama-3.1-8B-shaped teacher"
        trained = "DistillationTrainer" if args.trainer == "distillation" else "GKDTrainer"
        workload = (f"trl-step: {trained}, {models}, V={vocab} bf16 AdamW checkpointing rows={args.rows} "
                    f"prompt={args.prompt_len} completion={args.completion_len} beta={args.beta} "
                    f"temperature={args.temperature} rounds={args.rounds} peak=above resting {release_versions()}")
        rows = [("trl-step", tokens, name, f"{result['step_ms']:.4f}", "",
                 " ".join(f"{ms:.2f}" for ms in result["step_ms_by_round"]),
                 "" if result["peak_gb"] is None else f"{result['peak_gb']:.3f}") for name, result in results.items()]
        append_ledger_rows(args.ledger, gpu, workload, rows, command)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(completion_tokens=tokens, start_losses={k: float(v) for k, v in start_losses.items()},
                           reference_loss=float(reference),
                           results=results), file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
