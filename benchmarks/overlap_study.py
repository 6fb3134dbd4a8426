"""Study: overlap one chunk's row step with the next chunk's logits GEMMs (two CUDA streams, double buffers).

Prediction (written before the first H200 run of this script)

* What can move: only the row step, 0.356 ms per 1024-row chunk (NOTES run1), 9.3% of the floor's
  3.82 ms per 1024 tokens. The library runs 1.14-1.19x the floor, so the row step is about half to
  two thirds of its excess; hiding it entirely would give library - chunks x 0.356 ms, about
  1.05-1.10x (the "bound" row below, measured in the same run). Running chunk i's gradient GEMMs
  beside chunk i+1's logits GEMMs (GEMM beside GEMM) can win only their tails.
* Why far less than that: cuBLAS's Hopper bf16 kernels at these shapes use 128x256-class tiles, one
  CTA per SM holding nearly all its registers and ~200 KB of shared memory. A chunk's student logits
  GEMM is 8 x 501 = 4008 tiles, ~30 waves of 132 SMs (~24 us a wave; the teacher's ~48 us). A
  row-step CTA (4 warps) cannot sit beside a GEMM CTA: it gets an SM only when a GEMM CTA retires and
  the block scheduler picks it. At equal priority the scheduler drains the kernel that became ready
  first, so the row step mostly gets the GEMMs' last partial waves: ~half a wave of a full machine per
  GEMM, ~0.05 ms of the 0.356 ms per chunk. Against it: the row step streams 1.3 GB per chunk through
  the 50 MB L2 that the GEMMs reuse weight tiles from, and the H200 runs these GEMMs near its power
  limit, so extra HBM traffic can cost clock.
  -> B (two streams, 1024 rows): -1% of the floor (range -3% .. +1%).
* D (B with the side stream at high priority): row-step CTAs take each SM as GEMM CTAs retire, so the
  row step runs on most of the machine while the GEMM keeps the rest. The gain is the share of SMs
  the row step does not need to saturate HBM, roughly a third: ~0.356 / 3 = 0.12 ms per chunk.
  -> D: -2% of the floor (at best -3%).
* C (B with 512-row chunks, so buffer memory equals the library's): twice the chunks, and each
  chunk's grad_weight accumulation reads and writes the 0.53 GB grad_weight, ~+0.25 ms per 1024 tokens
  (~+6% of the floor; run1 measured +3..6% for 512- against 1024-row chunks), against at most ~3% won.
  -> C: +2..+5% of the floor, slower than the library.
* T = 1024 is a single 1024-row chunk: B and D have nothing to overlap and equal "serial" (within 1%).
* Memory: B and D hold a second pair of logits buffers, 2 x 1024 x 128256 x 2 B = +0.53 GB (~1.6 GB
  above inputs, Liger's 1.58-1.61 GB); C equals the library (1.06-1.09 GB).
* Verdict expected: not worth the library's complexity (it would need >= 3% of the floor at T >= 4096).

Outcome (H200, benchmarks/results/2026-11-30-s2b/overlap.md): B saves 1.3-1.9% of serial's time at
T >= 2048 (about 0.09 of the row step's ~0.39 ms per chunk hidden), inside the predicted range, for
+0.53 GB; D no better (slower at T = 8192); C +4..7%, worse than predicted. Not adopted: 2% for half a
gigabyte more than Liger's peak. The run also showed the library 0.3-1.3 ms slower than the same loop
without autograd ("serial"), a larger gap than this lever's, not yet explained.

Rows: "floor" (the four GEMMs alone on the whole T, ``cosdistill.bench.floor_provider``); "library"
(``fused_linear_cosine_distill(..., impl="triton")``, forward + backward, its own chunk size);
"bound" (library minus its chunk count x the row step's own time, measured here: full hiding);
then this file's loop: "serial" (one stream, one buffer pair: the library's loop re-written, the
control for the variants), B, C and D. The loop returns the loss and gradients directly (grad_output
= 1, no autograd); the "serial" row shows what that difference costs against the library.
Before timing, each variant's loss and gradients are compared with the library's at the same chunk
size (same GEMMs in the same order, so the errors should be 0). Timing: CUDA events around one call,
every row timed in turn in each round (median and IQR of --reps rounds, after 3 warm-up rounds), so
clock drift spreads over all rows alike. One more call per row under torch.profiler gives the row
step kernels' summed time and the share of it that ran beside another kernel: how much the two
streams actually overlapped.

    PYTHONPATH=src python3 benchmarks/overlap_study.py --out $OUT
"""

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cosdistill import fused_linear_cosine_distill
from cosdistill.bench import (
    CUDA_WORKLOAD, TOLERANCE, Tensors, environment_header, floor_provider, make_tensors, median_ms,
    peak_gb_above_inputs, rel_err,
)
from cosdistill.chunked import _grad_weight_gemm, _logits_into, chunk_rows
from cosdistill.labels import LabelCounts
from cosdistill.row_step import RowStepScales, row_step_torch

SCALES = RowStepScales(weight_hard=0.5, weight_soft=0.5, beta=0.5, temperature=1.0, ignore_index=-100)  # the API's defaults
ERROR_KEYS = ("loss_rel_err", "grad_input_rel_err", "grad_weight_rel_err")
CONCURRENCY_KEYS = ("row_step_kernel_ms", "row_step_beside_pct")  # profiled on CUDA with impl="triton"
ROW_STEP_REPEATS = 10  # back to back per timing: one launch alone would also time Triton's host-side launch


@dataclass(frozen=True)
class Variant:
    label: str
    chunk: int
    two_streams: bool  # False: one stream and one pair of logits buffers (the library's loop)
    side_priority: int = 0  # CUDA stream priority of the side stream; lower is higher


VARIANTS = (
    Variant("serial", 1024, two_streams=False),
    Variant("B: two streams", 1024, two_streams=True),
    Variant("C: two streams, 512 rows", 512, two_streams=True),
    Variant("D: two streams, side first", 1024, two_streams=True, side_priority=-1),
)


def pick_row_step(impl: str):
    if impl == "torch":
        return row_step_torch
    from cosdistill.row_step_triton import row_step_triton  # needs CUDA, or TRITON_INTERPRET=1 on the CPU

    return row_step_triton


class Streams:
    """Logits GEMMs on the current ("main") stream; row step and gradient GEMMs on a side stream.

    With one stream (off CUDA, or not overlapping) the side context is a null context and every event
    is None, so the same loop runs serially: the CPU tests run it that way.
    """

    def __init__(self, device: torch.device, two_streams: bool, side_priority: int):
        overlap = two_streams and device.type == "cuda"
        self.side = torch.cuda.Stream(device, priority=side_priority) if overlap else None

    def on_side(self):
        return contextlib.nullcontext() if self.side is None else torch.cuda.stream(self.side)

    def record(self):
        """An event at the current stream's position."""
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event):
        """The current stream waits for the event (None: nothing to wait for)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def join(self):
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)


def overlapped_loss_and_grads(student_input, student_weight, teacher_input, teacher_weight, labels,
                              variant: Variant, row_step):
    """(loss, grad_input, grad_weight) for grad_output = 1, no biases: the library's chunk loop, with chunk
    i's row step and gradient GEMMs on the side stream while the main stream computes chunk i+1's logits
    into the other buffer pair. grad_weight accumulates on the side stream alone, so in chunk order."""
    student_input, student_weight = student_input.detach(), student_weight.detach()
    num_tokens, vocab = labels.numel(), student_weight.shape[0]
    device = student_input.device
    streams = Streams(device, variant.two_streams, variant.side_priority)
    chunk = min(variant.chunk, num_tokens)
    # Allocated on the main stream and freed only after join(): the side stream's uses need no record_stream.
    buffers = [
        (student_input.new_empty(chunk, vocab), teacher_input.new_empty(chunk, teacher_weight.shape[0]))
        for _ in range(2 if variant.two_streams else 1)
    ]
    buffer_free = [None] * len(buffers)  # per pair: the side stream is done reading its gradient
    token_losses = torch.empty(num_tokens, 2, dtype=torch.float32, device=device)
    grad_input = torch.empty_like(student_input)
    grad_weight = torch.empty_like(student_weight)
    normaliser = LabelCounts(labels, SCALES.ignore_index, vocab, None)
    inv_normaliser = None
    for index, start in enumerate(range(0, num_tokens, chunk)):
        stop = min(start + chunk, num_tokens)
        pair = index % len(buffers)
        student_logits, teacher_logits = (buffer[: stop - start] for buffer in buffers[pair])
        hidden = student_input[start:stop]
        streams.wait(buffer_free[pair])
        _logits_into(student_logits, hidden, student_weight, None)
        _logits_into(teacher_logits, teacher_input[start:stop], teacher_weight, None)
        if inv_normaliser is None:  # as in the library: counted behind the first GEMMs, read after the first row step
            normaliser.launch()
        logits_ready = streams.record()
        with streams.on_side():
            streams.wait(logits_ready)
            row_step(student_logits, teacher_logits, labels[start:stop], SCALES, token_losses[start:stop], True)
            if inv_normaliser is None:
                inv_normaliser = 1.0 / normaliser.wait()
            grad_logits = student_logits  # overwritten in place by the row step
            grad_input[start:stop].addmm_(grad_logits, student_weight, beta=0.0, alpha=inv_normaliser)
            _grad_weight_gemm(grad_weight, grad_logits, hidden, alpha=inv_normaliser, beta=1.0 if start else 0.0)
            buffer_free[pair] = streams.record()
    streams.join()
    loss_sums = token_losses.sum(0) * inv_normaliser
    loss = SCALES.weight_hard * loss_sums[0] + SCALES.weight_soft * loss_sums[1]
    return loss, grad_input, grad_weight


def library_loss(tensors: Tensors, impl: str, chunk: int | None):
    return fused_linear_cosine_distill(*tensors.args(), chunk_size=chunk, impl=impl)


def check_errors(variant: Variant, tensors: Tensors, impl: str) -> dict:
    """Relative errors of the variant's loss and gradients against the library's at the same chunk size."""
    tensors.clear_grads()
    expected_loss = library_loss(tensors, impl, variant.chunk)
    expected_loss.backward()
    expected = (expected_loss.detach(), tensors.student_input.grad, tensors.student_weight.grad)
    tensors.clear_grads()
    row_step = pick_row_step(impl)
    actual = overlapped_loss_and_grads(*tensors.args(), variant, row_step)
    return {key: rel_err(a, e) for key, a, e in zip(ERROR_KEYS, actual, expected)}


def variant_step(variant: Variant, tensors: Tensors, impl: str):
    row_step = pick_row_step(impl)

    def step():
        _, grad_input, grad_weight = overlapped_loss_and_grads(*tensors.args(), variant, row_step)
        tensors.student_input.grad, tensors.student_weight.grad = grad_input, grad_weight  # held like backward's

    return step


def library_step(tensors: Tensors, impl: str):
    def step():
        library_loss(tensors, impl, None).backward()

    return step


def row_step_ms(tensors: Tensors, chunk: int, impl: str, workload) -> float:
    """The row step alone on one chunk of real logits (it overwrites them with its gradient each call: same bytes)."""
    x_s, w_s = tensors.student_input.detach()[:chunk], tensors.student_weight.detach()
    student_logits, teacher_logits = x_s @ w_s.t(), tensors.teacher_input[:chunk] @ tensors.teacher_weight.t()
    token_losses = torch.empty(chunk, 2, dtype=torch.float32, device=x_s.device)
    row_step = pick_row_step(impl)

    def step():
        for _ in range(ROW_STEP_REPEATS):
            row_step(student_logits, teacher_logits, tensors.labels[:chunk], SCALES, token_losses, True)

    return median_ms(step, tensors, x_s.device, workload.warmup, workload.reps) / ROW_STEP_REPEATS


def interleaved_times(steps: dict, tensors: Tensors, device, workload) -> dict:
    """Each step's call times (ms), each call timed alone as bench.median_ms does, but in rounds of one
    call per step, each round starting one step later: the GPU's clocks drift over a run, and depend on
    what ran just before, by more than the few percent compared here."""
    times = {label: [] for label in steps}
    for _ in range(workload.warmup):
        for step in steps.values():
            tensors.clear_grads()
            step()
    labels = list(steps)
    for round_index in range(workload.reps):
        first = round_index % len(labels)
        for label in labels[first:] + labels[:first]:
            times[label].append(median_ms(steps[label], tensors, device, warmup=0, reps=1))
    tensors.clear_grads()
    return times


def covered_us(interval, others) -> float:
    """How much of ``interval`` (start, end) lies inside the union of the ``others`` intervals."""
    start, end = interval
    covered, reach = 0.0, start
    for other_start, other_end in sorted(others):
        other_start, other_end = max(other_start, reach), min(other_end, end)
        if other_end > other_start:
            covered += other_end - other_start
            reach = other_end
    return covered


def row_step_concurrency(step, tensors: Tensors) -> dict:
    """From one profiled call: the row step kernels' total time, and the share of it during which some
    other kernel ran (on one GPU, a kernel overlapping another in time runs on another stream)."""
    tensors.clear_grads()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    tensors.clear_grads()
    kernels = [(event.name, event.time_range.start, event.time_range.end)
               for event in prof.events() if event.device_type == DeviceType.CUDA]
    row_steps = [(start, end) for name, start, end in kernels if "row_step" in name]
    others = [(start, end) for name, start, end in kernels if "row_step" not in name]
    row_step_us = sum(end - start for start, end in row_steps)
    if not row_step_us:
        return dict.fromkeys(CONCURRENCY_KEYS)
    beside_us = sum(covered_us(interval, others) for interval in row_steps)
    return dict(zip(CONCURRENCY_KEYS, (row_step_us / 1e3, 100 * beside_us / row_step_us)))


def run_study(workload, device: torch.device, impl: str, variants=VARIANTS) -> dict:
    tolerance = TOLERANCE[workload.dtype]
    rows, check_passed = [], True
    for tokens in workload.tokens:
        print(f"T={tokens}", file=sys.stderr, flush=True)
        tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)
        errors = {variant.label: check_errors(variant, tensors, impl) for variant in variants}
        check_passed &= all(error <= tolerance for per_variant in errors.values() for error in per_variant.values())
        library_rows = chunk_rows(None, tokens, workload.vocab, workload.vocab, tensors.student_weight.element_size())
        library_chunk = library_rows.student
        steps = {"floor": (None, floor_provider(tensors, "full")), "library": (library_chunk, library_step(tensors, impl))}
        steps.update({variant.label: (variant.chunk, variant_step(variant, tensors, impl)) for variant in variants})
        times = interleaved_times({label: step for label, (_, step) in steps.items()}, tensors, device, workload)
        profiled = device.type == "cuda" and impl == "triton"
        size_rows = []
        for label, (chunk, step) in steps.items():
            quartiles = statistics.quantiles(times[label], n=4)
            size_rows.append(dict(
                variant=label, T=tokens, chunk=chunk, median_ms=statistics.median(times[label]),
                iqr_ms=quartiles[2] - quartiles[0], peak_gb_above_inputs=peak_gb_above_inputs(step, tensors, device),
                **(row_step_concurrency(step, tensors) if profiled else dict.fromkeys(CONCURRENCY_KEYS)),
                **errors.get(label, dict.fromkeys(ERROR_KEYS)),
            ))
        tensors.clear_grads()
        floor_ms, library_ms = size_rows[0]["median_ms"], size_rows[1]["median_ms"]
        step_ms = row_step_ms(tensors, library_rows.teacher, impl, workload)  # the row step runs on teacher sub-chunks
        size_rows.insert(2, dict(
            variant="bound: library - row steps", T=tokens, chunk=library_chunk,
            median_ms=library_ms - -(-tokens // library_rows.teacher) * step_ms, row_step_ms_per_chunk=step_ms,
        ))
        for row in size_rows:
            row.update(x_floor=row["median_ms"] / floor_ms, x_library=row["median_ms"] / library_ms)
        rows += size_rows
        del tensors
    header = environment_header(device, workload, "full") + f" | impl {impl}"
    return dict(header=header, check_passed=check_passed, tolerance=tolerance, variants=[asdict(v) for v in variants], rows=rows)


TABLE_COLUMNS = (  # (row key, heading, format)
    ("variant", "variant", "{}"),
    ("T", "T", "{}"),
    ("chunk", "chunk", "{}"),
    ("median_ms", "median ms", "{:.2f}"),
    ("iqr_ms", "IQR ms", "{:.2f}"),
    ("x_floor", "x floor", "{:.3f}"),
    ("x_library", "x library", "{:.3f}"),
    ("peak_gb_above_inputs", "peak GB above inputs", "{:.2f}"),
    ("row_step_kernel_ms", "row step kernels ms", "{:.2f}"),
    ("row_step_beside_pct", "% of it beside other kernels", "{:.0f}"),
    ("loss_rel_err", "loss err", "{:.1e}"),
    ("grad_input_rel_err", "grad_input err", "{:.1e}"),
    ("grad_weight_rel_err", "grad_weight err", "{:.1e}"),
)


def markdown(result: dict) -> str:
    lines = [
        result["header"],
        "",
        "| " + " | ".join(heading for _, heading, _ in TABLE_COLUMNS) + " |",
        "|---|" + "---:|" * (len(TABLE_COLUMNS) - 1),
    ]
    for row in result["rows"]:
        cells = ("-" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in TABLE_COLUMNS)
        lines.append("| " + " | ".join(cells) + " |")
    step_ms = {row["T"]: row["row_step_ms_per_chunk"] for row in result["rows"] if "row_step_ms_per_chunk" in row}
    lines += [
        "",
        "row step alone per library chunk (ms): " + ", ".join(f"T={t}: {ms:.3f}" for t, ms in step_ms.items()),
        "row step kernels ms: their summed duration in one profiled call; % beside other kernels: the share of that "
        "time during which another kernel ran too (0 for the one-stream rows)",
        f"check: {'passed' if result['check_passed'] else 'FAILED'} (each variant's loss and gradients against the "
        f"library's at the same chunk size, tolerance {result['tolerance']:g})",
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for overlap.json and overlap.md")
    parser.add_argument("--tokens", default=",".join(map(str, CUDA_WORKLOAD.tokens)))
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--impl", default="triton", choices=("triton", "torch"))
    args = parser.parse_args()
    workload = replace(CUDA_WORKLOAD, tokens=tuple(map(int, args.tokens.split(","))), reps=args.reps)
    result = run_study(workload, torch.device("cuda"), args.impl)
    table = markdown(result)
    print(table)
    with open(f"{args.out}/overlap.json", "w") as file:
        json.dump(result, file, indent=2)
    with open(f"{args.out}/overlap.md", "w") as file:
        file.write(table)
    return 0 if result["check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
