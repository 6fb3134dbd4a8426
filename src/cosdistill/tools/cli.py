"""The ``cosdistill`` command line: ``bench``, ``demo`` and ``check``; ``cosdistill COMMAND --help`` lists each one's options."""

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import shlex
import sys

import torch

from .._options import options_of
from ..api import FUSED_LOSSES
from . import bench, check, demo

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument as one line, ``cosdistill: error: ...``, and exits 2."""

    def error(self, message):
        raise_usage_error(message)


class UsageError(Exception):
    """What the arguments make, raised before a run starts: printed as one line, exit status EXIT_USAGE. Errors
    from the run itself (the library's, a kernel's, out of memory) keep their tracebacks."""


@contextlib.contextmanager
def arguments_checked():
    try:
        yield
    except (ValueError, TypeError, OSError) as error:
        raise UsageError(str(error).splitlines()[0] if str(error) else type(error).__name__) from error


def raise_usage_error(message):
    print(f"cosdistill: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def comma_list(parse_item):
    def parse(text):
        try:
            return [parse_item(item.strip()) for item in text.split(",") if item.strip()]
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise argparse.ArgumentTypeError(f"cannot read {text!r}: {error}") from None

    return parse


def positive_int(text):
    """An argparse type: an int above 0 (0 tokens, or a count of -2 calls, silently ran something else); the
    benchmark scripts' (benchmarks/diagnose.py, soak.py), whose commands share this module's conventions."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def chunk_size(text):
    return None if text == "auto" else int(text)


def dtype(name):
    if name not in bench.DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}, choose from {', '.join(bench.DTYPES)}")
    return bench.DTYPES[name]


def build_parser():
    parser = OneLineErrorParser(prog="cosdistill", description=__doc__.replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True)
    bench_parser = commands.add_parser(
        "bench",
        help="time the fused loss (also with an FP8 teacher) against naive, Liger-Kernel and a GEMM floor",
        description=(
            "Time the fused loss (also with an FP8 teacher GEMM, where the GPU has FP8 tensor cores) against the "
            "naive version, Liger-Kernel and the bare GEMMs, after checking its loss and gradients. "
            "Defaults: on CUDA V=128256, H=4096, bf16, T=1024,2048,4096,8192, warm-up 3, "
            "10 reps; on CPU a small fp32 workload (V=8192, H=512, T=256,512, warm-up 1, 5 reps). "
            "Exit status 1 if the check fails or checks nothing, 2 on a usage error."
        ),
    )
    bench_parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    bench_parser.add_argument("--tokens", type=comma_list(int), help="token counts T, comma separated")
    bench_parser.add_argument("--vocab", type=int, help="vocabulary size V of both heads")
    bench_parser.add_argument("--hidden", type=int, help="teacher hidden size H")
    bench_parser.add_argument("--student-hidden", type=int, help="student hidden size (default H//2)")
    bench_parser.add_argument("--dtype", type=dtype, help=f"one of {', '.join(bench.DTYPES)}")
    bench_parser.add_argument("--providers", type=comma_list(str), default=list(bench.DEFAULT_PROVIDERS),
                              help=f"comma list of {', '.join(bench.PROVIDERS)} (default "
                                   f"{', '.join(bench.DEFAULT_PROVIDERS)})")
    bench_parser.add_argument("--mode", type=comma_list(str), default=["full"],
                              help="full: forward + backward; forward: no_grad forward; full,forward: both, on the same tensors")
    bench_parser.add_argument("--chunk-sizes", type=comma_list(chunk_size), help="run ours once per chunk size (ints or auto)")
    bench_parser.add_argument("--accum-dtypes", type=comma_list(dtype), help="run ours once per grad_weight accumulator dtype")
    bench_parser.add_argument("--warmup", type=int, help="untimed calls before timing")
    bench_parser.add_argument("--reps", type=int, help="timed calls; the median is reported")
    bench_parser.add_argument("--settle-s", type=float, metavar="SECONDS",
                              help="warm up each provider for at least this long (CUDA default 3: the GPU's "
                                   "power limiter settles)")
    bench_parser.add_argument("--rounds", type=int, default=1,
                              help="time the providers in turn this many times and report the median over rounds "
                                   "(clock drift then spreads over all providers alike), and each round's ratio "
                                   "to the floor's same round")
    bench_parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    bench_parser.add_argument("--ledger", metavar="PATH.csv",
                              help="also append the rows to this CSV ledger (benchmarks/results.csv holds the project's; "
                                   "needs --rounds >= 2)")
    bench_parser.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    bench_parser.add_argument("--plot", metavar="PATH",
                              help="also plot time and %% of the floor vs T as a PNG (needs matplotlib)")
    bench_parser.add_argument("--loss", choices=bench.LOSSES, default="cosine",
                              help="the soft term: cosine similarity or the generalized JSD (providers: "
                                   f"{', '.join(bench.JSD_PROVIDERS)}); default %(default)s")
    bench_parser.add_argument("--beta", type=float,
                              help="with --loss jsd, every provider's beta: 0 the forward KL, 1 the reverse KL "
                                   "(default: fused_linear_jsd's, 0.5)")
    bench_parser.set_defaults(run=run_bench_command)

    defaults = demo.DemoConfig()
    demo_parser = commands.add_parser(
        "demo",
        help="distill a small teacher language model into a half-width student and plot the losses",
        description=(
            "Train a tiny GRU language model (the teacher, randomly initialised) with cross-entropy on sequences "
            "from a random sparse Markov chain, then distill it into a student of half its width with the fused "
            "loss; print the student's top-1 agreement with the teacher before and after, and write a PNG of the "
            "hard, soft and total loss curves. Needs matplotlib and tqdm. Exit status 2 on a usage error."
        ),
    )
    demo_parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    demo_parser.add_argument("--steps", type=int, default=defaults.steps, help="distillation steps (default %(default)s)")
    demo_parser.add_argument("--teacher-steps", type=int, default=defaults.teacher_steps,
                             help="cross-entropy steps that train the teacher first (default %(default)s)")
    demo_parser.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary size (default %(default)s)")
    demo_parser.add_argument("--hidden", type=int, default=defaults.hidden,
                             help="teacher hidden size; the student's is half (default %(default)s)")
    demo_parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                             help="sequences per step (default %(default)s)")
    demo_parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence (default %(default)s)")
    demo_parser.add_argument("--weight-hard", type=float, default=defaults.weight_hard,
                             help="weight_hard_loss (default %(default)s)")
    demo_parser.add_argument("--weight-soft", type=float, default=defaults.weight_soft,
                             help="weight_soft_loss (default %(default)s)")
    demo_parser.add_argument("--beta", type=float, help="beta of the soft term (default: 1 for cosine, 0.5 for jsd)")
    demo_parser.add_argument("--loss", choices=tuple(FUSED_LOSSES), default="cosine",
                             help="the soft term: cosine similarity or the generalized JSD (default %(default)s)")
    demo_parser.add_argument("--seed", type=int, default=defaults.seed,
                             help="seed of the data and the models (default %(default)s)")
    demo_parser.add_argument("--out", metavar="PATH.png", default="cosdistill-demo.png", help="the plot (default %(default)s)")
    demo_parser.set_defaults(run=run_demo_command)

    check_parser = commands.add_parser(
        "check",
        help="the correctness self-test on this machine's device",
        description=(
            "Check the whole loss against the naive version in float64 at small odd shapes (fp32 and bf16, biases, "
            "Vt > Vs, ignored tokens, chunks not dividing T) for each row-step path, and the Triton row step "
            "against the torch one. On the CPU the Triton path runs only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment. Exit status 1 if a check fails, 2 on a usage error."
        ),
    )
    check_parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    check_parser.add_argument("--loss", choices=bench.LOSSES, help="check this soft term only (default: both)")
    check_parser.set_defaults(run=run_check_command)
    return parser


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def check_writable(path):
    """Fail before a long run, not after it. An existing path must be a regular file one may write; a new one is
    made once, exclusively, and removed (nothing else is created, followed through a link, or truncated)."""
    if os.path.isdir(path):
        raise ValueError(f"cannot write {path}: it is a folder")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"cannot write {path}: its folder does not exist")
    if os.path.lexists(path):
        if not os.path.isfile(path) or not os.access(path, os.W_OK):
            raise ValueError(f"cannot write {path}: not a regular file this process may write")
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror}") from None
    os.remove(path)


def run_bench_command(args):
    with arguments_checked():
        for path in (args.json, args.markdown, args.plot, args.ledger):
            if path:
                check_writable(path)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'cosdistill[bench]'")
        device = resolve_device(args.device)
        if args.ledger:
            bench.check_ledger_path(args.ledger, on_gpu=device.type == "cuda", rounds=args.rounds)
        default = bench.CUDA_WORKLOAD if device.type == "cuda" else bench.CPU_WORKLOAD
        hidden = args.hidden if args.hidden is not None else default.hidden
        if args.student_hidden is None and hidden < 2:
            raise ValueError(f"--hidden must be at least 2 where --student-hidden is not given (the student's is "
                             f"half the teacher's), got {hidden}")
        workload = dataclasses.replace(
            default,
            tokens=tuple(args.tokens) if args.tokens is not None else default.tokens,
            vocab=args.vocab if args.vocab is not None else default.vocab,
            hidden=hidden,
            student_hidden=args.student_hidden if args.student_hidden is not None else hidden // 2,
            dtype=args.dtype or default.dtype,
            warmup=args.warmup if args.warmup is not None else default.warmup,
            reps=args.reps if args.reps is not None else default.reps,
            rounds=args.rounds,
            settle_s=args.settle_s if args.settle_s is not None else default.settle_s,
            loss=args.loss,
            beta=args.beta,
        )
        if [] in (args.chunk_sizes, args.accum_dtypes):  # "--chunk-sizes ''" ran the defaults
            raise ValueError("--chunk-sizes and --accum-dtypes, where given, must name at least one value")
        for name, values in (("--chunk-sizes", args.chunk_sizes), ("--accum-dtypes", args.accum_dtypes)):
            if values and len(set(values)) < len(values):
                raise ValueError(f"{name} must not repeat a value, got {values}")
        settings = bench.ours_settings(args.chunk_sizes, args.accum_dtypes) if args.chunk_sizes or args.accum_dtypes else None
        bench.check_arguments(workload, args.providers, args.mode, settings)
    result = bench.run_bench(workload, device, providers=args.providers, modes=args.mode, settings=settings)
    table = bench.markdown_table(result)
    print(table, end="")
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(table)
    if args.json:
        bench.write_json(result, args.json)
    if args.ledger and result.check_passed:  # a run whose numbers are wrong, or unchecked, has no time to record
        bench.append_to_ledger(result, workload, device, args.ledger, args.command_line)
    elif args.ledger:
        print(f"ledger: nothing appended (the check {'did not pass' if result.check_passed is False else 'did not run'})")
    if args.plot:
        bench.write_plot(result, args.plot)
    ledger = args.ledger if result.check_passed else None
    for what, path in (("table", args.markdown), ("results", args.json), ("ledger rows", ledger), ("plot", args.plot)):
        if path:
            print(f"{what}: {os.path.abspath(path)}")
    return 0 if result.check_passed else EXIT_CHECK_FAILED


def run_demo_command(args):
    with arguments_checked():
        if not args.out.endswith(".png"):
            raise ValueError(f"--out must be a .png path, got {args.out}")
        check_writable(args.out)
        missing = [name for name in ("matplotlib", "tqdm") if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(f"demo needs {' and '.join(missing)}: pip install 'cosdistill[demo]'")
        config = demo.DemoConfig(
            steps=args.steps, teacher_steps=args.teacher_steps, vocab=args.vocab, hidden=args.hidden,
            batch_size=args.batch_size, seq_len=args.seq_len, weight_hard=args.weight_hard,
            weight_soft=args.weight_soft, beta=args.beta, seed=args.seed, loss=args.loss,
        )
        negative = [name for name, value in (("--weight-hard", args.weight_hard), ("--weight-soft", args.weight_soft),
                                             ("--beta", args.beta)) if value is not None and value < 0]
        if negative:  # the plot's log scale drops a curve that goes below 0
            raise ValueError(f"{', '.join(negative)} must be >= 0 in the demo")
        # the loss's options, checked before the teacher trains (a bad beta raised only after it)
        device = resolve_device(args.device)
        options_of(loss=config.loss, weight_hard_loss=config.weight_hard, weight_soft_loss=config.weight_soft,
                   beta=config.soft_beta)
    result = demo.run_demo(config, device)
    demo.write_plot(result, config, args.out)
    print(demo.summary(result, config, args.out), end="")
    return 0


def run_check_command(args):
    with arguments_checked():
        device = resolve_device(args.device)
    header, results = check.run_selfcheck(device, (args.loss,) if args.loss else bench.LOSSES)
    print(header)
    print(check.results_table(results), end="")
    return 0 if all(result.passed for result in results) else EXIT_CHECK_FAILED


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = "cosdistill " + shlex.join(argv)  # for the ledger
    try:
        return args.run(args)
    except UsageError as error:
        raise_usage_error(str(error))


if __name__ == "__main__":
    sys.exit(main())
