"""Study: split the SMs, GEMMs on most of them and the row step on a few, at the same time.

Item 11 (overlap_study.py) showed why two streams alone hide little: a cuBLAS CTA takes a whole SM,
so the row step only gets the GEMMs' last waves. Here the GEMMs are asked to leave k SMs free
(``torch._C._set_sm_carveout_experimental``: cuBLAS's SM count target) and the row step runs as a
persistent kernel of P programs (one row after another, 16-32 warps each: one program fills an SM)
on a side stream, so the two partition the machine.

Prediction (written before the first H200 run of this script)

* The GEMMs (compute bound) slow down by 132 / (132 - k) when k SMs are left out, if cuBLAS honours
  the target: +3% at k = 4, +6.5% at k = 8, +14% at k = 16.
* The row step on P SMs is bound by what one SM can keep in flight: ~50-150 GB/s per SM, so 1.3 GB
  per 1024 rows takes 1-3 ms on 8 SMs. Beside a chunk's four GEMMs (~3.5 ms per 1024 rows) it hides if
  P x (per-SM rate) >= ~0.4 TB/s.
* Net per 1024 rows: saves the row step's 0.386 ms on the main stream, costs the GEMMs' slow-down:
  k = 8 -> +0.23 ms, so about -0.15 ms (-4% of the floor) if 8 SMs suffice; nothing if they need 16.
* Risks: cuBLAS ignores the target for some kernels (then the persistent side kernel delays GEMM CTAs
  and the GEMM can take twice as long); HBM traffic of the side kernel lowers the GEMMs' clocks.

Outcome (H200, benchmarks/results/2026-11-30-s4b/carveout.log; NOTES item 22): the persistent row step
streams ~29 GB/s per SM, as the library kernel does on all 132, so it needs the whole machine for as
long wherever it runs; every "together" row was slower than serial, and cuBLAS's SM target did not act
consistently. Not adopted.

Measured rows, per 1024 rows of the seed workload (V = 128256, H = 4096 / 2048, bf16):
"gemms k=K": the chunk's four GEMMs alone with carveout K; "row step P=P w=W": the persistent row step
alone on P programs of W warps; "together k=K P=P w=W": both at once (GEMMs on the main stream, the
row step on a side stream, on separate buffers), against "serial" (GEMMs with k = 0, then the
library's row step).

    PYTHONPATH=src python3 benchmarks/carveout_study.py [--reps 20]
"""

import argparse
import statistics

import torch
import triton
import triton.language as tl

from cosdistill import row_step_triton as kernels
from cosdistill.row_step import COSINE_EPS, RowStepScales

VOCAB, HIDDEN_T, HIDDEN_S, ROWS = 128256, 4096, 2048, 1024


@triton.jit
def persistent_row_step(student_ptr, teacher_ptr, labels_ptr, losses_ptr, rows, vocab, ignore_index,
                        weight_hard, weight_soft, beta, inv_temp_sq, eps, BLOCK: tl.constexpr):
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):  # rows x vocab < 2^31: int32 offsets
        student_row, teacher_row, valid, in_shard, column = kernels._row_and_label(
            row, student_ptr, vocab, teacher_ptr, vocab, labels_ptr, ignore_index, 0, vocab, vocab)
        row_max, sum_exp, target, dot, sum_sq_s, sum_sq_t, unit_s, unit_t = kernels._row_stats(
            student_row, teacher_row, in_shard, column, vocab, vocab, 1.0, 1.0, 1.0, 1.0, False, False, False, BLOCK)
        kernels._row_losses_and_grad(
            student_row, teacher_row, losses_ptr + row * 2, valid, in_shard, column, vocab,
            row_max, sum_exp, target, dot, sum_sq_s, sum_sq_t, unit_s, unit_t,
            weight_hard, weight_soft, beta, inv_temp_sq, eps, 1.0, 1.0, 1.0, 1.0,
            True, losses_ptr, False, False, True, False, BLOCK)


def median_ms(fn, reps):
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device, dtype = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hidden_t = torch.randn(ROWS, HIDDEN_T, device=device, dtype=dtype)
    hidden_s = torch.randn(ROWS, HIDDEN_S, device=device, dtype=dtype)
    weight_t = torch.randn(VOCAB, HIDDEN_T, device=device, dtype=dtype) / 64
    weight_s = torch.randn(VOCAB, HIDDEN_S, device=device, dtype=dtype) / 45
    logits_s = torch.empty(ROWS, VOCAB, device=device, dtype=dtype)
    logits_t = torch.empty(ROWS, VOCAB, device=device, dtype=dtype)
    grad_input = torch.empty(ROWS, HIDDEN_S, device=device, dtype=dtype)
    grad_weight = torch.zeros(VOCAB, HIDDEN_S, device=device, dtype=dtype)
    # the side row step's own buffers, so that it never waits for the GEMMs
    side_s = torch.randn(ROWS, VOCAB, device=device, dtype=dtype) * 3
    side_s_copy = side_s.clone()
    side_t = torch.randn(ROWS, VOCAB, device=device, dtype=dtype) * 3
    labels = torch.randint(0, VOCAB, (ROWS,), device=device)
    losses = torch.empty(ROWS, 2, device=device)
    scales = RowStepScales(0.5, 0.5, 0.5, 1.0, -100)

    def gemms():
        torch.mm(hidden_s, weight_s.t(), out=logits_s)
        torch.mm(hidden_t, weight_t.t(), out=logits_t)
        torch.mm(logits_s, weight_s, out=grad_input)
        grad_weight.addmm_(logits_s.t(), hidden_s)

    def library_row_step():
        kernels.row_step_triton(side_s, side_t, labels, scales, losses, True)

    def side_row_step(programs, warps, block):
        persistent_row_step[(programs,)](side_s, side_t, labels, losses, ROWS, VOCAB, -100, 0.5, 0.5, 0.5, 1.0,
                                         COSINE_EPS, BLOCK=block, num_warps=warps)

    side_stream = torch.cuda.Stream()

    def together(programs, warps, block):
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            side_row_step(programs, warps, block)
        gemms()
        torch.cuda.current_stream().wait_stream(side_stream)

    def report(name, fn):
        ms = median_ms(lambda: (side_s.copy_(side_s_copy), fn()), args.reps)
        print(f"{name}: {ms - copy_ms:.3f} ms", flush=True)
        return ms - copy_ms

    copy_ms = median_ms(lambda: side_s.copy_(side_s_copy), args.reps)
    print(f"SMs {sms}; copy of one logits buffer {copy_ms:.3f} ms (subtracted below)")
    torch.cuda.synchronize()
    gemm_ms = report("gemms k=0", gemms)
    row_ms = report("library row step", library_row_step)
    print(f"serial (gemms k=0 + library row step): {gemm_ms + row_ms:.3f} ms")
    configs = [(programs, warps, block) for programs in (4, 8, 12, 16, 24, 32) for warps, block in
               ((16, 4096), (32, 8192))]
    for programs, warps, block in configs:
        report(f"row step P={programs} w={warps} block={block}", lambda: side_row_step(programs, warps, block))
    for backend in ("cublas", "cublaslt"):  # torch.mm goes through cuBLAS unless told to prefer cuBLASLt
        torch.backends.cuda.preferred_blas_library(backend)
        for carveout in (0, 4, 8, 12, 16, 24):
            torch._C._set_sm_carveout_experimental(carveout)
            report(f"{backend} gemms k={carveout}", gemms)
            for programs, warps, block in configs:
                if programs == carveout or (carveout == 0 and programs in (4, 8)):
                    report(f"{backend} together k={carveout} P={programs} w={warps} block={block}",
                           lambda: together(programs, warps, block))
        torch._C._set_sm_carveout_experimental(None)

if __name__ == "__main__":
    main()
