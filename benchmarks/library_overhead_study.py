"""Study: what the library's call adds to the same chunk loop called straight, one layer at a time.

gap_study (s8a, settled) found the library's full step 0.16 ms (T = 1024), 0.18 ms (T = 2048) and
0.53 ms (T = 8192) slower than ``chunked_loss_and_grads`` + ``finish()`` called directly at the same
chunk layout. Each step below adds one layer to the one before it, on the same tensors:

* ``direct``: the chunk loop and ``finish()`` with grad_output None (no host read of it);
* ``+grad_output``: ``finish(ones)``, a 0-d grad_output made on the device as autograd makes it, so
  several chunks read it on the host (the last grad_weight GEMM's alpha and beta);
* ``+Function``: the autograd Function with prebuilt options, its backward called on this thread
  (``loss.grad_fn``);
* ``+autograd``: the same with ``loss.backward()``: autograd's engine, which runs CUDA backward on its
  own thread;
* ``library``: ``fused_linear_cosine_distill`` itself (argument checks, options) and backward;
* and the no-grad forward: ``direct no-grad`` (the loop without gradients) against ``library no-grad``.

Prediction (written before the run): at T = 8192 most of the 0.53 ms is the host read of
grad_output, since the GPU idles from the forward's end until the host has launched the last GEMM
(``+grad_output`` - ``direct`` ~0.2-0.4 ms); at T <= 2048 (one chunk, no host read) the layers add
~0.03-0.06 ms each (Python before the first GEMM, autograd's engine).

    PYTHONPATH=src python benchmarks/library_overhead_study.py [--tokens 1024 8192] [--vocab V --hidden H] [--rounds 3]
        [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch

from cosdistill import fused_linear_cosine_distill
from cosdistill._chunk_loop import TeacherHead, chunk_rows, chunked_loss_and_grads
from cosdistill._labels import LabelCounts
from cosdistill._plan import pick_row_step, row_step_scales
from cosdistill.api import _AttachGradients
from cosdistill.tools.bench import CPU_WORKLOAD, CUDA_WORKLOAD, make_tensors, median_ms

SCALES = row_step_scales(0.5, 0.5, 0.5, 1.0, -100, None, None, 1.0, 1.0)
LAYER_BELOW = {"+grad_output": "direct", "+Function": "+grad_output", "+autograd": "+Function", "library": "+autograd",
               "library no-grad": "direct no-grad"}


def steps(tensors):
    x_s, w_s = tensors.student_input, tensors.student_weight
    labels, vocab, device = tensors.labels, w_s.shape[0], x_s.device
    row_step = pick_row_step("auto", device).step
    rows = chunk_rows(None, len(labels), vocab, tensors.teacher_weight.shape[0], w_s.element_size())
    forward_rows = chunk_rows(None, len(labels), vocab, tensors.teacher_weight.shape[0], w_s.element_size(),
                              write_grad=False)

    def loop(needs_grad, layout):
        return chunked_loss_and_grads(
            x_s.detach(), w_s.detach(), None, tensors.teacher_input, TeacherHead(tensors.teacher_weight, None),
            labels, SCALES, LabelCounts(labels, -100, vocab, None), row_step, layout, needs_grad, w_s.dtype)

    def direct(grad_output):
        def step(mark=lambda: None):
            gradients = loop((True, True, False), rows).gradients
            mark()
            ones = torch.ones((), device=device) if grad_output else None
            x_s.grad, w_s.grad, _ = gradients.finish(ones)  # held like backward's
        return step

    def function(engine):
        def step(mark=lambda: None):
            result = loop((True, True, False), rows)
            loss = _AttachGradients.apply(result.loss, result.gradients, x_s, w_s, None)
            mark()
            if engine:
                loss.backward()
            else:  # the Function's backward called on this thread, the grads held as the engine would
                _, _, x_s.grad, w_s.grad, _ = loss.grad_fn.apply(torch.ones_like(loss))
        return step

    def library():
        fused_linear_cosine_distill(*tensors.args()).backward()

    def direct_no_grad():
        loop((False, False, False), forward_rows)

    def library_no_grad():
        with torch.no_grad():
            fused_linear_cosine_distill(*tensors.args())

    return {"direct": direct(False), "+grad_output": direct(True), "+Function": function(engine=False),
            "+autograd": function(engine=True), "library": library,
            "direct no-grad": direct_no_grad, "library no-grad": library_no_grad}


def phases(step, device, reps):
    """Median GPU ms of the forward part and of the backward part (CUDA events around and between them,
    each reached when the GPU has run what was queued before it) and host ms of each part."""
    gpu, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        clock = [time.perf_counter()]
        events[0].record()

        def mark():
            events[1].record()
            clock.append(time.perf_counter())

        step(mark)
        events[2].record()
        clock.append(time.perf_counter())
        torch.cuda.synchronize(device)
        gpu.append((events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])))
        host.append(((clock[1] - clock[0]) * 1e3, (clock[2] - clock[1]) * 1e3))
    return [statistics.median(part) for part in zip(*gpu)], [statistics.median(part) for part in zip(*host)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--settle-s", type=float, help="warm-up seconds per step and round (default: 1 on CUDA)")
    parser.add_argument("--vocab", type=int, help="both heads' vocabulary (default: the seed's)")
    parser.add_argument("--hidden", type=int, help="the teacher's hidden size, the student's half (default: the seed's)")
    parser.add_argument("--device", default="cuda")  # cpu: a smoke run at a small size
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    workload = (CUDA_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD).resized(args.vocab, args.hidden)
    settle_s = args.settle_s if args.settle_s is not None else (1.0 if device.type == "cuda" else 0.0)
    report = []
    for tokens in args.tokens:
        tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)
        timed = steps(tensors)
        times = {label: [] for label in timed}
        for round_index in range(args.rounds):  # each round starts one step later in the list
            labels = list(timed)
            labels = labels[round_index % len(labels):] + labels[:round_index % len(labels)]
            for label in labels:
                times[label].append(median_ms(timed[label], tensors, device, warmup=3, reps=args.reps,
                                              settle_s=settle_s))
        medians = {label: statistics.median(values) for label, values in times.items()}
        print(f"\nT={tokens} (median of {args.rounds} round medians; each layer against the one above it)")
        for label, value in medians.items():
            below = LAYER_BELOW.get(label)
            added = f"{value - medians[below]:+7.3f} ms" if below else ""
            print(f"  {label:16s} {value:8.3f} ms {added:>12s}   rounds {[round(t, 3) for t in times[label]]}")
        split = {}
        if device.type == "cuda":  # where the layers' time goes: the forward part or backward
            for label in ("+grad_output", "+Function", "+autograd"):
                median_ms(timed[label], tensors, device, warmup=3, reps=1, settle_s=settle_s)
                split[label] = phases(timed[label], device, args.reps)
                (gpu_forward, gpu_backward), (host_forward, host_backward) = split[label]
                print(f"  {label:16s} GPU forward {gpu_forward:7.3f} ms, backward {gpu_backward:6.3f} ms; "
                      f"host forward {host_forward:7.3f} ms, backward {host_backward:6.3f} ms")
        report.append(dict(tokens=tokens, medians=medians, rounds=times, phases=split))
        del tensors, timed
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
