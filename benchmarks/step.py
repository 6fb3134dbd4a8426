"""One distillation training step of real-shaped models: what a user decides on, where the loss is one part.

A Llama-3.2-1B-shaped student and a Llama-3.1-8B-shaped teacher (random weights from their configs, no
downloads), bf16, AdamW, gradient checkpointing, rows of 4096 tokens. Per loss (the naive one from both
models' full logits, Liger-Kernel's fused cosine loss, ours): the step's time, tokens per second, peak
memory, and the share of the step that the loss takes (the loss alone, from the final hidden states to
their gradients and the head's, timed separately); then the most tokens per step that fit in memory.
Providers interleaved in rounds, medians of CUDA-event times after a warm-up.

    PYTHONPATH=src python benchmarks/step.py [--tokens 8192] [--rounds 3] [--max-tokens 131072]
        [--ledger benchmarks/results.csv] [--json out.json]
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/step.py --tiny --device cpu   (a smoke run)
"""

import argparse
import importlib.metadata
import importlib.util
import json
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F
import transformers

from cosdistill.hf import distill_loss, final_hidden_states, next_token_targets
from cosdistill.tools.bench import append_ledger_rows, call_ms, check_ledger_path, round_order

STUDENT = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True)  # Llama-3.2-1B
TEACHER = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False)  # Llama-3.1-8B
VOCAB = 128256
TINY_STUDENT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True)
TINY_TEACHER = dict(TINY_STUDENT, hidden_size=64, intermediate_size=128, tie_word_embeddings=False)
TINY_VOCAB = 512
OPTIONS = dict(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5)
PROVIDERS = ("naive", "liger", "ours")
START_LOSS_TOLERANCE = 2e-3  # relative, between the losses on one batch before any step (bf16 models)


def llama(shape, vocab, row_len, device, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**shape, vocab_size=vocab, max_position_embeddings=row_len, rope_theta=500000.0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)


# Each loss from both models' final hidden states (the student's with autograd on or off, the teacher's without).


def naive_loss(student, teacher, hidden, teacher_hidden, labels):
    """From both models' full logits, in fp32, as a Hugging Face user would write it."""
    targets = next_token_targets(labels)
    valid = targets != -100
    student_logits = student.lm_head(hidden)[valid].float()
    with torch.no_grad():
        teacher_logits = teacher.lm_head(teacher_hidden)[valid].float()
    hard = F.cross_entropy(student_logits, targets[valid])
    soft = OPTIONS["beta"] * (1 - F.cosine_similarity(student_logits, teacher_logits, dim=-1)).mean()
    return OPTIONS["weight_hard_loss"] * hard + OPTIONS["weight_soft_loss"] * soft


def liger_loss_function():
    from liger_kernel.chunked_loss import LigerFusedLinearCosineSimilarityLoss

    liger = LigerFusedLinearCosineSimilarityLoss(**OPTIONS)

    def loss(student, teacher, hidden, teacher_hidden, labels):
        flat = lambda h: h.reshape(-1, h.shape[-1])  # noqa: E731
        return liger(flat(hidden), student.lm_head.weight, flat(teacher_hidden), teacher.lm_head.weight,
                     next_token_targets(labels).flatten())

    return loss


def ours_loss(student, teacher, hidden, teacher_hidden, labels):
    return distill_loss(student, teacher, labels=labels, student_hidden=hidden, teacher_hidden=teacher_hidden, **OPTIONS)


def loss_functions(names):
    functions = {"naive": naive_loss, "ours": ours_loss}
    if "liger" in names:
        try:
            functions["liger"] = liger_loss_function()
        except ImportError as error:
            print(f"liger skipped: {error}")
    return {name: functions[name] for name in names if name in functions}


class Trainee:
    """The student, its AdamW and a step of one loss on a batch."""

    def __init__(self, student, teacher):
        self.student, self.teacher = student, teacher
        student.gradient_checkpointing_enable()
        student.train()
        self.optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5, fused=student.device.type == "cuda")

    def loss(self, loss_function, input_ids, labels) -> torch.Tensor:
        hidden = final_hidden_states(self.student, input_ids)
        with torch.no_grad():
            teacher_hidden = final_hidden_states(self.teacher, input_ids)
        return loss_function(self.student, self.teacher, hidden, teacher_hidden, labels)

    def step(self, loss_function, input_ids, labels) -> None:
        self.loss(loss_function, input_ids, labels).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def batch(tokens, row_len, vocab, device, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    rows = max(1, tokens // row_len)
    input_ids = torch.randint(3, vocab, (rows, min(row_len, tokens)), generator=generator).to(device)
    return input_ids, input_ids.clone()


def loss_alone(loss_function, trainee, input_ids, labels):
    """The loss's part of a step: from the final hidden states (given) to their gradients and the head's."""
    student, teacher = trainee.student, trainee.teacher
    with torch.no_grad():
        hidden = final_hidden_states(student, input_ids).detach().requires_grad_()
        teacher_hidden = final_hidden_states(teacher, input_ids)

    def call():
        loss_function(student, teacher, hidden, teacher_hidden, labels).backward()
        hidden.grad = None
        student.zero_grad(set_to_none=True)

    return call


def measure(trainee, functions, tokens, row_len, vocab, device, rounds, reps, warmup):
    """{provider: dict(step_ms, loss_ms, peak_gb, loss)} in interleaved rounds."""
    input_ids, labels = batch(tokens, row_len, vocab, device)
    times = {name: dict(step=[], loss=[]) for name in functions}
    peaks = {}
    for round_index in range(rounds):
        for name in round_order(list(functions), round_index):
            function = functions[name]
            step = lambda: trainee.step(function, input_ids, labels)  # noqa: E731
            if round_index == 0:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(warmup):
                    step()
                if device.type == "cuda":
                    peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            times[name]["step"].append(statistics.median(call_ms(step, device) for _ in range(reps)))
            alone = loss_alone(function, trainee, input_ids, labels)
            alone()
            times[name]["loss"].append(statistics.median(call_ms(alone, device) for _ in range(reps)))
    return {name: dict(step_ms=statistics.median(t["step"]), loss_ms=statistics.median(t["loss"]),
                       step_ms_by_round=t["step"], peak_gb=peaks.get(name))
            for name, t in times.items()}


def largest_tokens(trainee, function, row_len, vocab, device, start, limit):
    """The most tokens per step (doubling from start, up to limit) whose step runs without running out of memory."""
    fitted, tokens = None, start
    while tokens <= limit:
        input_ids, labels = batch(tokens, row_len, vocab, device)
        try:
            trainee.step(function, input_ids, labels)
            if device.type == "cuda":
                torch.cuda.synchronize()
            fitted = tokens
        except torch.OutOfMemoryError:
            trainee.optimizer.zero_grad(set_to_none=True)
            break
        finally:
            del input_ids, labels
            if device.type == "cuda":
                torch.cuda.empty_cache()
        tokens *= 2
    return fitted


def append_to_ledger(path, results, fits, tokens, device, rounds, command, tiny, vocab, row_len):
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    models = "tiny student, tiny teacher" if tiny else "Llama-3.2-1B-shaped student, Llama-3.1-8B-shaped teacher"
    workload = (f"step: {models}, V={vocab} bf16 AdamW checkpointing rows={row_len} rounds={rounds} "
                f"peak=whole process {release_versions()}")
    rows = []
    for name, result in results.items():
        peak = "" if result["peak_gb"] is None else f"{result['peak_gb']:.3f}"
        by_round = " ".join(f"{ms:.2f}" for ms in result["step_ms_by_round"])
        rows.append(("step", tokens, name, f"{result['step_ms']:.4f}", "", by_round, peak))
        rows.append(("loss-in-step", tokens, name, f"{result['loss_ms']:.4f}", "", "", ""))
    rows += [("max-tokens", fitted, name, "", "", "", "") for name, fitted in fits.items() if fitted is not None]
    append_ledger_rows(path, gpu, workload, rows, command)


def release_versions() -> str:
    """The releases compared beside ours, for the ledger's workload (its columns hold torch's and Triton's)."""
    names = ("transformers", "liger-kernel", "trl")
    return " ".join(f"{name}={importlib.metadata.version(name)}" for name in names
                    if importlib.util.find_spec(name.replace("-", "_")) is not None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (rows of --row-len)")
    parser.add_argument("--row-len", type=int, default=4096)
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, help="the largest step tried (0: skip the search; default 131072 on "
                        "CUDA, 0 elsewhere: a CPU's steps do not run out of memory)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--ledger")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.ledger:
        try:
            check_ledger_path(args.ledger, on_gpu=device.type == "cuda", rounds=args.rounds)
        except ValueError as error:
            parser.error(str(error))
    if args.max_tokens is None:
        args.max_tokens = 131072 if device.type == "cuda" else 0
    student_shape, teacher_shape, vocab = (TINY_STUDENT, TINY_TEACHER, TINY_VOCAB) if args.tiny else (STUDENT, TEACHER, VOCAB)
    student = llama(student_shape, vocab, args.row_len, device, seed=0)
    teacher = llama(teacher_shape, vocab, args.row_len, device, seed=1).eval().requires_grad_(False)
    trainee = Trainee(student, teacher)
    functions = loss_functions(args.providers.split(","))
    input_ids, labels = batch(args.tokens, args.row_len, vocab, device)
    with torch.no_grad():  # every loss on the same weights and batch, before any step: they must agree
        start_losses = {name: float(trainee.loss(function, input_ids, labels)) for name, function in functions.items()}
    results = measure(trainee, functions, args.tokens, args.row_len, vocab, device, args.rounds, args.reps, args.warmup)
    fits = {}
    if args.max_tokens:
        for name, function in functions.items():
            fits[name] = largest_tokens(trainee, function, args.row_len, vocab, device, args.tokens, args.max_tokens)
    print(f"{args.tokens} tokens per step ({args.tokens // args.row_len} x {args.row_len}), {device}; the losses on the "
          "first batch: " + ", ".join(f"{name} {loss:.5f}" for name, loss in start_losses.items()))
    print("| loss | step ms | tokens/s | peak GB | loss ms in the step | share | largest step fitted |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, result in results.items():
        peak = "-" if result["peak_gb"] is None else f"{result['peak_gb']:.1f}"
        print(f"| {name} | {result['step_ms']:.1f} | {1000 * args.tokens / result['step_ms']:.0f} | {peak} | "
              f"{result['loss_ms']:.1f} | {result['loss_ms'] / result['step_ms']:.0%} | {fits.get(name) or '-'} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(tokens=args.tokens, start_losses=start_losses, results=results, largest_tokens=fits), file,
                      indent=1)
    first_name, first_loss = next(iter(start_losses.items()))
    apart = [name for name, loss in start_losses.items() if abs(loss - first_loss) > START_LOSS_TOLERANCE * abs(first_loss)]
    if apart:  # then they time different work
        print(f"the losses of {apart} are more than {START_LOSS_TOLERANCE:g} from {first_name}'s: no ledger rows")
        return 1
    if args.ledger:
        command = "python benchmarks/step.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        append_to_ledger(args.ledger, results, fits, args.tokens, device, args.rounds, command, args.tiny, vocab,
                         args.row_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
