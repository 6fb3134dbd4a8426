"""The teacher's logits GEMM alone: bf16 against the FP8 settings torch._scaled_mm offers on Hopper.

The FP8 teacher (issue 3's goal: the whole step at <= 0.90x the bf16 four-GEMM floor) ran 0.94-0.98x
at T >= 2048 because its row-wise FP8 GEMM gained ~1.6x over bf16, not 2x (NOTES item 8). This times,
at the teacher's sub-chunk shapes (M rows x K = hidden, N = vocab), CUDA events, median of 20 after
5 warm-ups:
  bf16            torch.mm
  rowwise         _scaled_mm, fp32 scale per row of A and per column of B (what the library runs)
  rowwise-fast    the same with use_fast_accum=True (no periodic promotion of partial sums to fp32)
  tensorwise      one fp32 scale per operand (cuBLASLt), with and without fast accumulation
Prediction: rowwise 1.5-1.7x bf16 (item 8's whole-step figure); fast accumulation +10-25% on top;
tensorwise about as fast as rowwise-fast. Speed only: the errors are fp8_study.py's. Then the
activations' quantization, torch's four kernels against the one Triton kernel (NOTES item 44).

    PYTHONPATH=src python benchmarks/fp8_gemm_study.py [--rows 512,1024,2048] [--vocab 128256] [--hidden 4096]
"""

import argparse

import torch

from cosdistill import fp8
from cosdistill.bench import median_ms
from cosdistill.fp8_triton import quantize_rows_triton


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="512,1024,2048")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    vocab, hidden, device = args.vocab, args.hidden, torch.device("cuda")
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    weight_fp8, weight_scales = fp8.quantized_weights.get(weight).value
    one = torch.ones((), device="cuda")
    print(f"N = {vocab}, K = {hidden}; ms (TFLOP/s), speed-up over bf16")
    for rows in (int(r) for r in args.rows.split(",")):
        hidden_states = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        hidden_fp8 = torch.empty(rows, hidden, device="cuda", dtype=fp8.FP8)
        hidden_scales = torch.empty(rows, 1, device="cuda")
        fp8.quantize_rows(hidden_states, hidden_fp8, hidden_scales)
        out = torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)
        variants = {
            "bf16": lambda: torch.mm(hidden_states, weight.t(), out=out),
        }
        for name, scale_a, scale_b in (("rowwise", hidden_scales, weight_scales), ("tensorwise", one, one)):
            for fast in (False, True):
                variants[name + ("-fast" if fast else "")] = (
                    lambda a=scale_a, b=scale_b, f=fast: torch._scaled_mm(
                        hidden_fp8, weight_fp8.t(), scale_a=a, scale_b=b, out_dtype=torch.bfloat16, out=out,
                        use_fast_accum=f))
        bf16_ms = None
        for name, fn in variants.items():
            try:
                ms = median_ms(fn, None, device, warmup=5, reps=20)
            except RuntimeError as error:
                print(f"M = {rows:5d} {name:22s} failed: {str(error).splitlines()[0]}")
                continue
            bf16_ms = bf16_ms or ms
            tflops = 2 * rows * vocab * hidden / ms / 1e9
            print(f"M = {rows:5d} {name:22s} {ms:7.3f} ms ({tflops:6.0f}) {bf16_ms / ms:5.2f}x")
        # The activations' quantization: one call from an idle GPU (launches included), and per call
        # when 20 are queued back to back (the GPU's time, as inside the chunk loop)
        for name, quantize in (("quantize torch", fp8.quantize_rows), ("quantize Triton", quantize_rows_triton)):
            alone = median_ms(lambda q=quantize: q(hidden_states, hidden_fp8, hidden_scales), None, device, warmup=5, reps=20)
            queued = median_ms(lambda q=quantize: [q(hidden_states, hidden_fp8, hidden_scales) for _ in range(20)], None,
                               device, warmup=5, reps=20) / 20
            print(f"M = {rows:5d} {name:22s} {alone:7.3f} ms alone, {queued:7.4f} ms per call queued")


if __name__ == "__main__":
    main()
