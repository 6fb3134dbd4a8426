"""Where the host spends the time before the first GEMM: cProfile over no-grad calls of the loss.

    PYTHONPATH=src python benchmarks/host_profile.py [--tokens 1024]
"""

import argparse
import cProfile
import pstats

import torch

from cosdistill import fused_linear_cosine_distill
from cosdistill.bench import make_tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    tensors = make_tensors(args.tokens, 128256, 4096, 2048, torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        for _ in range(3):
            fused_linear_cosine_distill(*tensors.args())
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        for _ in range(20):
            torch.cuda.synchronize()
            profiler.enable()
            fused_linear_cosine_distill(*tensors.args())
            profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
