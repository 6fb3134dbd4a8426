"""What accumulating grad_weight over chunks costs: the grad_weight GEMM alone, with and without beta.

grad_weight [V, Hs] += grad_logits[K rows, V]^T @ hidden[K rows, Hs] runs once per chunk of K rows. The
first chunk writes (beta = 0); every later one reads grad_weight back (beta = 1), 0.53 GB in bf16 at
the seed shape (1.05 GB in fp32), where the floor's one GEMM over all T rows writes it once. Timed
alone, CUDA events, median of 20 after a 2 s warm-up per setting (the power limiter settled, NOTES
item 35), at K = 1024, 2048, 4096, 8192 rows.
Prediction: in bf16, beta = 1 adds the read of C unless the epilogue overlaps the next tile's main
loop: +0.10..+0.15 ms per GEMM at K = 2048 (+7..+10% on ~1.5 ms); fp32 C +0.3..+0.5 ms. At T = 8192
with 2048-row chunks (three accumulating GEMMs), the bf16 figure times three is what larger chunks
could save at most.

    PYTHONPATH=src python benchmarks/grad_weight_gemm_study.py [--vocab 128256] [--hidden 2048]
"""

import argparse

import torch

from cosdistill.bench import median_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    vocab, hidden = args.vocab, args.hidden
    print(f"grad_weight [{vocab}, {hidden}] (+)= grad_logits[K, V]^T @ hidden[K, H]; ms, and per 1024 rows")
    for rows in (1024, 2048, 4096, 8192):
        grad_logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
        states = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        out_bf16 = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
        out_fp32 = torch.randn(vocab, hidden, device="cuda")
        settings = {
            "bf16 beta=0": lambda: out_bf16.addmm_(grad_logits.t(), states, beta=0.0),
            "bf16 beta=1": lambda: out_bf16.addmm_(grad_logits.t(), states, beta=1.0),
            "fp32 beta=0": lambda: torch.addmm(out_fp32, grad_logits.t(), states, beta=0.0, out_dtype=torch.float32, out=out_fp32),
            "fp32 beta=1": lambda: torch.addmm(out_fp32, grad_logits.t(), states, beta=1.0, out_dtype=torch.float32, out=out_fp32),
        }
        for name, fn in settings.items():
            ms = median_ms(fn, None, torch.device("cuda"), warmup=1, reps=20, settle_s=2.0)
            print(f"K = {rows:5d} {name}: {ms:7.3f} ms, {ms * 1024 / rows:6.3f} ms per 1024 rows")


if __name__ == "__main__":
    main()
