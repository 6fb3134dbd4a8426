"""Accuracy of the FP8 teacher on real-looking data, against float64 and against the bf16 path.

Real-looking: LM-head rows with log-normal norms (frequent tokens have larger rows), hidden states
with a few outlier channels 20x the rest (as LLM activations have), and each token's hidden state
pulled towards its label's row, so logits are peaked (the label stands ~10 above a heavy-tailed
bulk). The student is a weaker, differently initialised model of the same kind.

Also checks the FP8 path against the float64 reference fed the *dequantized* teacher (what the FP8
GEMM multiplies): that isolates our code from the quantization error.

With ``--both-accumulations`` the FP8 GEMM also runs with the accumulation the library does not use
(``fp8.FAST_ACCUMULATION`` flipped: fast accumulation skips the periodic promotion of the tensor
cores' partial sums to fp32): its errors get a line, and both FP8 settings are timed on the full step.

    PYTHONPATH=src python benchmarks/fp8_study.py [--tokens 4096] [--both-accumulations] [--json out.json]
"""

import argparse
import contextlib
import json

import torch

from cosdistill import _teacher_fp8 as fp8
from cosdistill import fused_linear_cosine_distill
from cosdistill.reference import naive_cosine_distill
from cosdistill.testing import rel_err
from cosdistill.tools.bench import median_ms


def lm_head(vocab, hidden, generator):
    row_norms = torch.empty(vocab, 1, device="cuda").log_normal_(0.0, 0.5, generator=generator)
    return torch.randn(vocab, hidden, device="cuda", generator=generator) / hidden**0.5 * row_norms


def hidden_states(weight, labels, peak, generator):
    tokens, hidden = labels.numel(), weight.shape[1]
    states = torch.randn(tokens, hidden, device="cuda", generator=generator)
    states[:, :8] *= 20.0  # outlier channels
    target_rows = weight[labels]
    states += peak * target_rows / target_rows.norm(dim=1, keepdim=True) ** 2
    return states


def real_looking_problem(tokens, vocab=128256, hidden=4096, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=generator)
    teacher_weight = lm_head(vocab, hidden, generator)
    student_weight = lm_head(vocab, hidden // 2, generator)
    teacher_input = hidden_states(teacher_weight, labels, peak=12.0, generator=generator)
    student_input = hidden_states(student_weight, labels, peak=6.0, generator=generator)
    as_bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731
    return dict(
        student_input=as_bf16(student_input).requires_grad_(), student_weight=as_bf16(student_weight).requires_grad_(),
        teacher_input=as_bf16(teacher_input), teacher_weight=as_bf16(teacher_weight), true_labels=labels,
    )


def run(problem, **kwargs):
    for name in ("student_input", "student_weight"):
        problem[name].grad = None
    losses = fused_linear_cosine_distill(**problem, return_soft_hard_loss=True, **kwargs)
    losses[0].backward()
    return [x.detach().clone() for x in losses] + [problem["student_input"].grad.clone(), problem["student_weight"].grad.clone()]


@contextlib.contextmanager
def other_accumulation():
    """The FP8 GEMM with the accumulation setting the library does not use, while inside."""
    fp8.FAST_ACCUMULATION = not fp8.FAST_ACCUMULATION
    try:
        yield
    finally:
        fp8.FAST_ACCUMULATION = not fp8.FAST_ACCUMULATION


def step_ms(problem, reps=10, **kwargs):
    """Median ms of the full step (CUDA events), after three warm-up calls."""
    return median_ms(lambda: run(problem, **kwargs), None, torch.device("cuda"), warmup=3, reps=reps)


def float64_reference(problem, teacher_input=None, teacher_weight=None):
    upcast = {k: v.detach().double().requires_grad_(v.requires_grad) if v.is_floating_point() else v for k, v in problem.items()}
    if teacher_input is not None:
        upcast["teacher_input"], upcast["teacher_weight"] = teacher_input.double(), teacher_weight.double()
    losses = naive_cosine_distill(**upcast)
    losses[0].backward()
    return [x.detach() for x in losses] + [upcast["student_input"].grad, upcast["student_weight"].grad]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json")
    parser.add_argument("--both-accumulations", action="store_true",
                        help="also run the FP8 GEMM with the accumulation setting the library does not use")
    args = parser.parse_args()
    problem = real_looking_problem(args.tokens)
    with torch.no_grad():
        logits = problem["teacher_input"][:256].float() @ problem["teacher_weight"].float().t()
        top = logits.topk(2, dim=1).values
        print(f"teacher logits (first 256 tokens): std {logits.std():.2f}, max {logits.max():.1f}, "
              f"top1 - top2 median {(top[:, 0] - top[:, 1]).median():.2f}, kurtosis "
              f"{(((logits - logits.mean()) / logits.std()) ** 4).mean():.1f}")
    names = ("loss", "soft", "hard", "grad_input", "grad_weight")
    exact = float64_reference(problem)
    bf16 = run(problem)
    fp8_out = run(problem, teacher_precision="fp8")
    on_quantized = float64_reference(problem, fp8.dequantized(problem["teacher_input"]),
                                     fp8.dequantized(problem["teacher_weight"]))
    rows = []
    for i, name in enumerate(names):
        row = dict(quantity=name, bf16_vs_float64=rel_err(bf16[i], exact[i]), fp8_vs_float64=rel_err(fp8_out[i], exact[i]),
                   fp8_vs_bf16=rel_err(fp8_out[i], bf16[i]),
                   fp8_vs_float64_on_quantized_teacher=rel_err(fp8_out[i], on_quantized[i]))
        rows.append(row)
    other = "precise" if fp8.FAST_ACCUMULATION else "fast"
    if args.both_accumulations:
        with other_accumulation():
            other_out = run(problem, teacher_precision="fp8")
        for i, row in enumerate(rows):
            row[f"fp8_{other}_accumulation_vs_float64"] = rel_err(other_out[i], exact[i])
            row[f"fp8_{other}_accumulation_vs_bf16"] = rel_err(other_out[i], bf16[i])
        for _ in range(2):  # rounds: clocks drift
            with other_accumulation():
                other_ms = step_ms(problem, teacher_precision="fp8")
            print(f"full step ms: bf16 {step_ms(problem):.3f}, fp8 {step_ms(problem, teacher_precision='fp8'):.3f}, "
                  f"fp8 with {other} accumulation {other_ms:.3f}")
    print(f"T={args.tokens}, V=128256, H=4096/2048, bf16 inputs, real-looking data; relative errors:")
    print("| quantity | bf16 path vs float64 | fp8 teacher vs float64 | fp8 vs bf16 path "
          "| fp8 vs float64 on the dequantized teacher |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['quantity']} | {row['bf16_vs_float64']:.2e} | {row['fp8_vs_float64']:.2e} | {row['fp8_vs_bf16']:.2e} | "
              f"{row['fp8_vs_float64_on_quantized_teacher']:.2e} |")
    if args.both_accumulations:
        for against in ("float64", "bf16"):
            print(f"fp8 with {other} accumulation vs {against}: "
                  + ", ".join(f"{row['quantity']} {row[f'fp8_{other}_accumulation_vs_{against}']:.2e}" for row in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
