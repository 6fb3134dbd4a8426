"""The ``cosdistill`` command line. ``cosdistill bench --help`` lists the benchmark's options."""

import argparse
import dataclasses
import importlib.util
import os
import sys

import torch

from . import bench

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument as one line, ``cosdistill: error: ...``, and exits 2."""

    def error(self, message):
        raise_usage_error(message)


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


def chunk_size(text):
    return None if text == "auto" else int(text)


def dtype(name):
    if name not in bench.DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}, choose from {', '.join(bench.DTYPES)}")
    return bench.DTYPES[name]


def build_parser():
    parser = OneLineErrorParser(prog="cosdistill", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "bench",
        help="time the fused loss (also with an FP8 teacher) against naive, Liger-Kernel and a GEMM floor",
        description=(
            "Time the fused loss (also with an FP8 teacher GEMM, where the GPU has FP8 tensor cores) against the "
            "naive version, Liger-Kernel and the bare GEMMs, after checking its loss and gradients. "
            "Defaults: on CUDA V=128256, H=4096, bf16, T=1024,2048,4096,8192, warm-up 3, "
            "10 reps; on CPU a small fp32 workload (V=8192, H=512, T=256,512, warm-up 1, 5 reps). "
            "Exit status 1 if the check fails, 2 on a usage error."
        ),
    )
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available")
    run.add_argument("--tokens", type=comma_list(int), help="token counts T, comma separated")
    run.add_argument("--vocab", type=int, help="vocabulary size V of both heads")
    run.add_argument("--hidden", type=int, help="teacher hidden size H")
    run.add_argument("--student-hidden", type=int, help="student hidden size (default H//2)")
    run.add_argument("--dtype", type=dtype, help=f"one of {', '.join(bench.DTYPES)}")
    run.add_argument("--providers", type=comma_list(str), default=list(bench.PROVIDERS),
                     help=f"comma list of {', '.join(bench.PROVIDERS)} (default all)")
    run.add_argument("--mode", choices=bench.MODES, default="full", help="full: forward + backward; forward: no_grad forward")
    run.add_argument("--chunk-sizes", type=comma_list(chunk_size), help="run ours once per chunk size (ints or auto)")
    run.add_argument("--accum-dtypes", type=comma_list(dtype), help="run ours once per grad_weight accumulator dtype")
    run.add_argument("--warmup", type=int, help="untimed calls before timing")
    run.add_argument("--reps", type=int, help="timed calls; the median is reported")
    run.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    run.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    run.add_argument("--plot", metavar="PATH", help="also plot time and %% of the floor vs T as a PNG (needs matplotlib)")
    return parser


def resolve_device(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def run_bench_command(args):
    for path in (args.json, args.markdown, args.plot):  # fail before a long run, not after it
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"cannot write {path}: its folder does not exist")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'cosdistill[bench]'")
    device = resolve_device(args.device)
    default = bench.CUDA_WORKLOAD if device.type == "cuda" else bench.CPU_WORKLOAD
    hidden = args.hidden if args.hidden is not None else default.hidden
    workload = dataclasses.replace(
        default,
        tokens=tuple(args.tokens) if args.tokens is not None else default.tokens,
        vocab=args.vocab if args.vocab is not None else default.vocab,
        hidden=hidden,
        student_hidden=args.student_hidden if args.student_hidden is not None else hidden // 2,
        dtype=args.dtype or default.dtype,
        warmup=args.warmup if args.warmup is not None else default.warmup,
        reps=args.reps if args.reps is not None else default.reps,
    )
    settings = bench.ours_settings(args.chunk_sizes, args.accum_dtypes)
    result = bench.run_bench(workload, device, providers=args.providers, mode=args.mode, settings=settings)
    table = bench.markdown_table(result)
    print(table, end="")
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(table)
    if args.json:
        bench.write_json(result, args.json)
    if args.plot:
        bench.write_plot(result, args.plot)
    return 0 if result.check_passed else EXIT_CHECK_FAILED


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return run_bench_command(args)
    except (ValueError, TypeError, RuntimeError, OSError) as error:
        raise_usage_error(str(error).splitlines()[0] if str(error) else type(error).__name__)


if __name__ == "__main__":
    sys.exit(main())
