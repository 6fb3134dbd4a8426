"""Study: where the seed step's time goes beyond the four-GEMM floor.

Splits the library's time (forward + backward) into parts, each timed in the same process:

* each of the four GEMM kinds alone, over the whole batch (the floor's parts) and chunk by chunk as
  the chunk loop runs it (``--chunks`` rows; grad_weight accumulated with beta = 1 after the first
  chunk): what chunking costs the GEMMs themselves;
* "direct": ``chunked_loss_and_grads`` plus ``Gradients.finish`` called straight, no argument checks,
  no autograd: the chunk loop's own cost, for each ``--layouts`` student/teacher rows;
* the library's forward alone (gradients computed, no backward), its full step, and its no-grad forward
  (against the two forward GEMMs);
* one profile of the library's full step: the summed time of every kernel by name, and the GPU's busy
  time against the call's wall time.

Prediction (written before the run, T = 8192): the row step is ~3.1 ms of the ~5.5 ms the library
spends beyond the floor (8 x 0.388 ms); the chunked grad_weight GEMM (K = 1024, reading and writing
the 0.5 GB grad_weight per chunk) costs ~1 ms more than the floor's single one, the other three chunked
GEMMs within ~2% of theirs; the library costs ~1 ms more than "direct", and the
profile shows the same kernels with the same sums, i.e. the difference is GPU idle time.

    PYTHONPATH=src python benchmarks/gap_study.py [--tokens 1024 8192] [--chunks 1024 2048] [--vocab V --hidden H]
        [--layouts 1024/1024 2048/2048 2048/1024] [--json out.json]
"""

import argparse
import collections
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from cosdistill import fused_linear_cosine_distill
from cosdistill._chunk_loop import ChunkRows, TeacherHead, chunk_rows, chunked_loss_and_grads
from cosdistill._labels import LabelCounts
from cosdistill._plan import pick_row_step, row_step_scales
from cosdistill.tools.bench import CPU_WORKLOAD, CUDA_WORKLOAD, make_tensors, median_ms

SCALES = row_step_scales(0.5, 0.5, 0.5, 1.0, -100, None, None, 1.0, 1.0)


def gemm_steps(tensors, chunk):
    """One step per GEMM kind, chunk by chunk (chunk None: the whole batch at once, as the floor)."""
    x_s, w_s = tensors.student_input.detach(), tensors.student_weight.detach()
    x_t, w_t = tensors.teacher_input, tensors.teacher_weight
    tokens = x_s.shape[0]
    chunk = chunk or tokens
    student_logits, teacher_logits = x_s.new_empty(chunk, w_s.shape[0]), x_t.new_empty(chunk, w_t.shape[0])
    grad_logits = torch.randn(chunk, w_s.shape[0], device=x_s.device).to(x_s.dtype)
    grad_input, grad_weight = torch.empty_like(x_s), torch.empty_like(w_s)
    starts = range(0, tokens, chunk)

    def rows(start):
        return slice(start, min(start + chunk, tokens)), min(start + chunk, tokens) - start

    def student():
        for start in starts:
            part, n = rows(start)
            torch.mm(x_s[part], w_s.t(), out=student_logits[:n])

    def teacher():
        for start in starts:
            part, n = rows(start)
            torch.mm(x_t[part], w_t.t(), out=teacher_logits[:n])

    def input_grad():
        for start in starts:
            part, n = rows(start)
            grad_input[part].addmm_(grad_logits[:n], w_s, beta=0.0)

    def weight_grad():
        for start in starts:
            part, n = rows(start)
            grad_weight.addmm_(grad_logits[:n].t(), x_s[part], beta=1.0 if start else 0.0)

    return dict(student_logits=student, teacher_logits=teacher, grad_input=input_grad, grad_weight=weight_grad)


def direct_step(tensors, rows: ChunkRows):
    """The chunk loop and finish() (grad_output 1), without api.py's checks and without autograd."""
    x_s, w_s = tensors.student_input.detach(), tensors.student_weight.detach()
    labels, vocab = tensors.labels, w_s.shape[0]
    row_step = pick_row_step("auto", x_s.device).step

    def step():
        result = chunked_loss_and_grads(
            x_s, w_s, None, tensors.teacher_input, TeacherHead(tensors.teacher_weight, None), labels, SCALES,
            LabelCounts(labels, -100, vocab, None), row_step, rows, (True, True, False), w_s.dtype,
        )
        grad_input, grad_weight, _ = result.gradients.finish()
        tensors.student_input.grad, tensors.student_weight.grad = grad_input, grad_weight  # held like backward's

    return step


def library_step(tensors, backward, grad=True):
    def step():
        with torch.set_grad_enabled(grad):
            loss = fused_linear_cosine_distill(*tensors.args())
        if backward:
            loss.backward()

    return step


def kernel_sums(step, tensors, calls=3):
    """Per kernel name: summed device time per call (ms); and the GPU's busy time per call."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            tensors.clear_grads()
            step()
        torch.cuda.synchronize()
    sums = collections.Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            sums[event.key[:90]] += event.self_device_time_total / 1e3 / calls
    return dict(sorted(sums.items(), key=lambda item: -item[1])), sum(sums.values())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048], help="rows per chunked GEMM")
    parser.add_argument("--layouts", nargs="+", default=["1024/1024", "2048/2048", "2048/1024"],
                        help="student/teacher rows of the direct chunk loop")
    parser.add_argument("--vocab", type=int, help="both heads' vocabulary (default: the seed's)")
    parser.add_argument("--hidden", type=int, help="the teacher's hidden size, the student's half (default: the seed's)")
    parser.add_argument("--device", default="cuda")  # cpu: a smoke run of the script at a small size
    parser.add_argument("--settle-s", type=float, help="warm-up seconds per part and round (default: 1 on CUDA, "
                        "where parts run back to back under the power limiter; 0 on the CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    workload = CUDA_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD
    settle_s = args.settle_s if args.settle_s is not None else (1.0 if device.type == "cuda" else 0.0)
    workload = workload.resized(args.vocab, args.hidden)
    report = []
    for tokens in args.tokens:
        tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)
        steps = {}
        for chunk in (None, *args.chunks):
            for kind, step in gemm_steps(tensors, chunk).items():
                steps[f"{kind} chunk={chunk or 'all'}"] = step
        for rows in (ChunkRows(*map(int, layout.split("/"))) for layout in args.layouts):
            steps[f"direct chunk={rows.student} teacher={rows.teacher}"] = direct_step(tensors, rows)
        steps["library forward (grads computed)"] = library_step(tensors, backward=False)
        steps["library full"] = library_step(tensors, backward=True)
        steps["library no-grad forward"] = library_step(tensors, backward=False, grad=False)
        times = {}
        for _ in range(3):  # rounds: clocks drift over a run; the median of each round's median
            for label, step in steps.items():
                times.setdefault(label, []).append(median_ms(step, tensors, device, warmup=3, reps=args.reps,
                                                                 settle_s=settle_s))
        medians = {label: statistics.median(values) for label, values in times.items()}
        floor = sum(medians[f"{kind} chunk=all"] for kind in ("student_logits", "teacher_logits", "grad_input", "grad_weight"))
        forward_floor = medians["student_logits chunk=all"] + medians["teacher_logits chunk=all"]
        print(f"\nT={tokens}: floor (sum of the four GEMMs alone) {floor:.3f} ms; the two forward GEMMs "
              f"{forward_floor:.3f} ms, the library's no-grad forward "
              f"{medians['library no-grad forward'] / forward_floor:.3f} x that")
        for label, value in medians.items():
            print(f"  {label:40s} {value:8.3f} ms  {value / floor:6.3f} x floor   rounds {[round(t, 3) for t in times[label]]}")
        profiles = {}
        library_rows = chunk_rows(None, tokens, workload.vocab, workload.vocab, tensors.student_weight.element_size())
        direct_label = f"direct chunk={library_rows.student} teacher={library_rows.teacher}"
        for label in ("library full", direct_label) if device.type == "cuda" and direct_label in steps else ():
            sums, busy = kernel_sums(steps[label], tensors)
            profiles[label] = dict(busy_ms=busy, kernels=sums)
            print(f"  profile {label}: GPU busy {busy:.3f} ms per call")
            for name, ms in list(sums.items())[:12]:
                print(f"    {ms:8.3f} ms  {name}")
        if len(profiles) == 2:  # what the library runs beyond the same chunk loop called straight
            library, direct = profiles["library full"]["kernels"], profiles[direct_label]["kernels"]
            differences = {name: library.get(name, 0.0) - direct.get(name, 0.0) for name in {*library, *direct}}
            print("  kernels, library full minus direct (ms per call):")
            for name, ms in sorted(differences.items(), key=lambda item: -abs(item[1]))[:8]:
                print(f"    {ms:+8.3f} ms  {name}")
        report.append(dict(tokens=tokens, floor_ms=floor, medians=medians, rounds=times, profiles=profiles))
        del tensors, steps
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
