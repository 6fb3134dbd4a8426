"""Where the time goes: one diagnostic tool, a subcommand per question (benchmarks/README.md says which question
each answers; ``--help`` lists them, ``SUBCOMMAND --help`` says what one measures and prints).

    PYTHONPATH=src python benchmarks/diagnose.py SUBCOMMAND [options] [--json FILE]

Every subcommand also runs on the CPU at tiny sizes (``--device cpu``, Triton under TRITON_INTERPRET=1), as the
tests run them (tests/test_benchmarks.py): there the device's work is torch's CPU ops, so only GPU numbers count.
"""

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import functools
import importlib
import itertools
import json
import math
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as torch_profile

import cosdistill
from cosdistill import testing
from cosdistill.reference import naive_cosine_distill
from cosdistill.testing import AttachGradients, ChunkRows, Options, RowStepConstants, rel_err, row_step_torch
from cosdistill.tools.bench import (
    CPU_WORKLOAD,
    CUDA_WORKLOAD,
    FORCED_SETTINGS,
    FP8_SETTING,
    call_ms,
    floor_provider,
    make_tensors,
    median_ms,
    ours_provider,
    ours_settings,
    round_order,
)
from cosdistill.tools.cli import positive_int

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # cuBLAS and Triton launch some kernels through the driver
GEMM_KINDS = ("student_logits", "teacher_logits", "grad_input", "grad_weight")


# --- shared helpers: devices, workloads, timing, profiler traces ---


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def workload_of(args):
    """The device and the bench's workload for it (the seed's on CUDA), resized by --vocab and --hidden."""
    device = torch.device(args.device)
    workload = CUDA_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD
    return device, workload.resized(args.vocab, args.hidden)


def tensors_of(tokens, workload, device):
    return make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)


def settle_seconds(args, on_cuda: float, device: torch.device) -> float:
    """--settle-s, else ``on_cuda`` seconds on CUDA (where the power limiter cuts the clock under load), 0 on the CPU."""
    if args.settle_s is not None:
        return args.settle_s
    return on_cuda if device.type == "cuda" else 0.0


def settle(steps, device, seconds: float, min_rounds: int = 1) -> None:
    """The steps called in turn for at least ``seconds`` and ``min_rounds`` rounds, so that all are timed at the settled clock."""
    start, rounds = time.perf_counter(), 0
    while rounds < min_rounds or time.perf_counter() - start < seconds:
        for step in steps:
            step()
        rounds += 1
        synchronize(device)


def library_options(args) -> dict:
    """The library's keyword options that --fp8, --impl and --loss ask for."""
    return dict(teacher_precision="fp8" if args.fp8 else None, impl=args.impl, loss=args.loss)


def loss_function(package, options: dict):
    """(``package``'s loss function for options' "loss", the other options); by name, so that an older version
    of the package without the JSD serves its cosine loss."""
    options = dict(options)
    name = "fused_linear_jsd" if options.pop("loss", "cosine") == "jsd" else "fused_linear_cosine_distill"
    return getattr(package, name), options


def loss_step(package, tensors, mode, options):
    """One call of ``package``'s loss (options' "loss": "cosine" or "jsd"): forward and backward ("full") or
    the no-grad forward ("forward")."""
    loss, options = loss_function(package, options)

    def call():
        tensors.clear_grads()
        if mode == "forward":
            with torch.no_grad():
                loss(*tensors.args(), **options)
        else:
            loss(*tensors.args(), **options).backward()
    return call


def kernel_ms(step, device: torch.device) -> float:
    """Median ms of a kernel alone: triton.testing.do_bench on CUDA (L2 flushed between calls), a few calls on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
    return median_ms(step, None, device, warmup=1, reps=3)


def profiled_trace(run_calls, device: torch.device, host_ops=False) -> list[dict]:
    """The complete events of a torch.profiler trace of ``run_calls()``: the device's work, and the host's ops where
    asked (always on the CPU, where they are the work)."""
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    if host_ops or device.type != "cuda":
        activities.append(ProfilerActivity.CPU)
    synchronize(device)
    with torch_profile(activities=activities) as prof:
        run_calls()
        synchronize(device)
    with tempfile.TemporaryDirectory() as folder:  # the trace has timestamps and launch correlations
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return [event for event in json.load(file)["traceEvents"] if event.get("ph") == "X"]


def device_work(trace: list[dict], device: torch.device) -> list[dict]:
    """The device's work in start order: kernels, copies and memsets on CUDA; on the CPU the outermost aten ops (each
    a call into torch's kernels, the ops it calls in turn inside it). Triton's interpreter runs no aten op."""
    if device.type == "cuda":
        return sorted((event for event in trace if event.get("cat") in GPU_CATEGORIES), key=lambda event: event["ts"])
    ops = sorted((event for event in trace if event.get("cat") == "cpu_op" and event["name"].startswith("aten::")),
                 key=lambda event: (event["tid"], event["ts"], -event["dur"]))
    outermost, ends = [], {}  # per thread, the end of its last outermost op: an op starting before it is inside it
    for op in ops:
        if op["ts"] >= ends.get(op["tid"], float("-inf")):
            outermost.append(op)
            ends[op["tid"]] = op["ts"] + op["dur"]
    return sorted(outermost, key=lambda event: event["ts"])


def call_work(step, tensors, device) -> list[tuple[str, float, float]]:
    """[(name, duration us, start us)] of one profiled call's device work, in start order."""
    def one_call():
        tensors.clear_grads()
        step()

    return [(event["name"], event["dur"], event["ts"]) for event in device_work(profiled_trace(one_call, device), device)]


# --- gaps ---


def gemm_parts(tensors, chunk):
    """One step per GEMM kind, chunk by chunk as the chunk loop runs it (chunk None: the whole batch at once, as
    the floor; grad_weight accumulated with beta = 1 after the first chunk)."""
    x_s, w_s = tensors.student_input.detach(), tensors.student_weight.detach()
    x_t, w_t = tensors.teacher_input, tensors.teacher_weight
    tokens = x_s.shape[0]
    chunk = chunk or tokens
    student_logits, teacher_logits = x_s.new_empty(chunk, w_s.shape[0]), x_t.new_empty(chunk, w_t.shape[0])
    grad_logits = torch.randn(chunk, w_s.shape[0], device=x_s.device).to(x_s.dtype)
    grad_input, grad_weight = torch.empty_like(x_s), torch.empty_like(w_s)
    chunks = [(slice(start, min(start + chunk, tokens)), min(start + chunk, tokens) - start)
              for start in range(0, tokens, chunk)]

    def student():
        for rows, n in chunks:
            torch.mm(x_s[rows], w_s.t(), out=student_logits[:n])

    def teacher():
        for rows, n in chunks:
            torch.mm(x_t[rows], w_t.t(), out=teacher_logits[:n])

    def input_grad():
        for rows, n in chunks:
            grad_input[rows].addmm_(grad_logits[:n], w_s, beta=0.0)

    def weight_grad():
        for index, (rows, n) in enumerate(chunks):
            grad_weight.addmm_(grad_logits[:n].t(), x_s[rows], beta=1.0 if index else 0.0)

    return dict(zip(GEMM_KINDS, (student, teacher, input_grad, weight_grad)))


def chunk_loop(tensors, options: Options, needs_grad, rows: ChunkRows | None = None):
    """The plan the library makes for these tensors (its rows replaced if given), run without api.py's checks
    and without autograd."""
    x_s, w_s = tensors.student_input.detach(), tensors.student_weight.detach()
    plan = testing.plan.make_plan(options, w_s, None, tensors.teacher_weight, None, len(tensors.labels), needs_grad)
    if rows is not None:
        plan = dataclasses.replace(plan, rows=rows)
    with torch.no_grad():
        return testing.plan.run(plan, x_s, w_s, None, tensors.teacher_input, tensors.teacher_weight, None, tensors.labels)


def no_mark():
    pass


# Each layer of the library's call, and the layer below it that it adds to.
LAYER_BELOW = {"+grad_output": "direct", "+Function": "+grad_output", "+autograd": "+Function", "library": "+autograd",
               "library no-grad": "direct no-grad"}


def layer_parts(tensors, library_kwargs: dict, layouts):
    """The bare chunk loop (at the library's rows, and at each student/teacher layout) and the library's layers on
    top of it, one at a time. The loop's steps take a ``mark``, called between their forward and backward parts."""
    x_s, w_s, options = tensors.student_input, tensors.student_weight, Options(**library_kwargs)
    grads = (True, True, False)

    def direct(grad_output, rows=None):
        def step(mark=no_mark):
            gradients = chunk_loop(tensors, options, grads, rows).gradients
            mark()
            # grad_output as autograd passes it, 0-d on the device, which finish() may read on the host; None: no read
            x_s.grad, w_s.grad, _ = gradients.finish(torch.ones((), device=x_s.device) if grad_output else None)
        return step

    def function(engine):
        def step(mark=no_mark):
            result = chunk_loop(tensors, options, grads)
            loss = AttachGradients.apply(result.loss, result.gradients, x_s, w_s, None)
            mark()
            if engine:  # autograd's engine runs a CUDA backward on its own thread
                loss.backward()
            else:  # the Function's backward on this thread, the gradients held as the engine would (in no_grad, as
                with torch.no_grad():  # the engine runs it without create_graph)
                    _, _, x_s.grad, w_s.grad, _ = loss.grad_fn.apply(torch.ones_like(loss))
        return step

    parts = {f"direct rows={layout}": direct(False, ChunkRows(*map(int, layout.split("/")))) for layout in layouts}
    return parts | {
        "direct": direct(False), "+grad_output": direct(True), "+Function": function(engine=False),
        "+autograd": function(engine=True), "library": loss_step(cosdistill, tensors, "full", library_kwargs),
        "direct no-grad": lambda: chunk_loop(tensors, options, (False, False, False)),
        "library no-grad": loss_step(cosdistill, tensors, "forward", library_kwargs),
    }


def time_in_rounds(parts, tensors, device, rounds, reps, settle_s):
    """Each part's median ms per round, the order rotated by one part each round (clocks drift over a run, and no
    part should always run first); and the median over rounds."""
    times = {label: [] for label in parts}
    for index in range(rounds):
        for label in round_order(list(parts), index):
            times[label].append(median_ms(parts[label], tensors, device, warmup=3, reps=reps, settle_s=settle_s))
    return {label: statistics.median(values) for label, values in times.items()}, times


def kernel_sums(step, tensors, device, calls=3) -> dict:
    """Per kernel name, its summed ms per call, largest first (a profile of ``calls`` calls after one more)."""
    step()

    def run_calls():
        for _ in range(calls):
            tensors.clear_grads()
            step()

    sums = collections.Counter()
    for event in device_work(profiled_trace(run_calls, device), device):
        sums[event["name"][:90]] += event["dur"] / 1e3 / calls
    return dict(sorted(sums.items(), key=lambda item: -item[1]))


def phases(step, device, reps):
    """CUDA only: median GPU ms of the forward part and of the backward part (events around and between them, each
    reached when the GPU has run what was queued before it), and the host's ms of each."""
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
    gpu_forward, gpu_backward = (statistics.median(part) for part in zip(*gpu))
    host_forward, host_backward = (statistics.median(part) for part in zip(*host))
    return dict(gpu_forward_ms=gpu_forward, gpu_backward_ms=gpu_backward, host_forward_ms=host_forward,
                host_backward_ms=host_backward)


def gaps(args):
    """Where the step's time over the four-GEMM floor goes, by part: each GEMM alone over the whole batch and chunk
    by chunk (--chunks); the bare chunk loop (the library's plan run straight, no checks, no autograd) at the
    library's layout and at --layouts; each layer the library adds on top of it; and a profile of the library's
    kernels against the bare loop's (the difference is what the library runs beyond it; time beyond that is idle).
    On CUDA also each layer's forward and backward parts, GPU and host."""
    device, workload = workload_of(args)
    settle_s, report = settle_seconds(args, 1.0, device), []
    for tokens in args.tokens:
        tensors = tensors_of(tokens, workload, device)
        parts = {}
        for chunk in (None, *args.chunks):
            parts |= {f"{kind} chunk={chunk or 'all'}": step for kind, step in gemm_parts(tensors, chunk).items()}
        parts |= layer_parts(tensors, library_options(args), args.layouts)
        medians, rounds = time_in_rounds(parts, tensors, device, args.rounds, args.reps, settle_s)
        floor = sum(medians[f"{kind} chunk=all"] for kind in GEMM_KINDS)
        forward_floor = medians["student_logits chunk=all"] + medians["teacher_logits chunk=all"]
        print(f"\nT={tokens}: floor (the four GEMMs alone) {floor:.3f} ms, its two forward GEMMs {forward_floor:.3f} ms; "
              f"median of {args.rounds} round medians, each layer against the one below it")
        for label, value in medians.items():
            below = LAYER_BELOW.get(label)
            added = f"{value - medians[below]:+8.3f} ms" if below else ""
            against = forward_floor if "no-grad" in label else floor
            print(f"  {label:32s} {value:9.3f} ms  {value / against:6.3f} x {'forward ' if 'no-grad' in label else ''}"
                  f"floor {added:>12s}   rounds {[round(t, 3) for t in rounds[label]]}")
        profiles = {label: kernel_sums(parts[label], tensors, device) for label in ("library", "direct")}
        for label, sums in profiles.items():
            print(f"  profile {label}: device busy {sum(sums.values()):.3f} ms per call")
            for name, ms in list(sums.items())[:12]:
                print(f"    {ms:8.3f} ms  {name}")
        library, direct = profiles["library"], profiles["direct"]
        differences = {name: library.get(name, 0.0) - direct.get(name, 0.0) for name in {*library, *direct}}
        print("  kernels, library minus direct (ms per call):")
        for name, ms in sorted(differences.items(), key=lambda item: -abs(item[1]))[:8]:
            print(f"    {ms:+8.3f} ms  {name}")
        split = {}
        if device.type == "cuda":  # where the layers' time goes: the forward part or the backward part
            for label in ("+grad_output", "+Function", "+autograd"):
                split[label] = phases(parts[label], device, args.reps)
                print(f"  {label:16s} GPU forward {split[label]['gpu_forward_ms']:7.3f} ms, backward "
                      f"{split[label]['gpu_backward_ms']:6.3f} ms; host forward {split[label]['host_forward_ms']:7.3f} ms, "
                      f"backward {split[label]['host_backward_ms']:6.3f} ms")
        report.append(dict(tokens=tokens, floor_ms=floor, forward_floor_ms=forward_floor, medians=medians, rounds=rounds,
                           profiles=profiles, phases=split))
        del tensors, parts
    return report


# --- kernels ---


def kernel_summary(calls) -> dict:
    """The median over the calls with the most common kernel sequence: each kernel's duration by position, the
    kernels' sum, the span from the first kernel's start to the last one's end, and the idle inside it (us)."""
    sequences = collections.defaultdict(list)
    for work in calls:
        sequences[tuple(name for name, _, _ in work)].append(work)
    names, runs = max(sequences.items(), key=lambda item: len(item[1]))
    busy = statistics.median(sum(duration for _, duration, _ in run) for run in runs)
    span = statistics.median(run[-1][2] + run[-1][1] - run[0][2] for run in runs)
    return dict(kernels=[(name, statistics.median(run[position][1] for run in runs)) for position, name in enumerate(names)],
                busy_us=busy, span_us=span, idle_us=span - busy, calls_with_sequence=len(runs), calls=len(calls))


def kernels(args):
    """The library's full step and the four-GEMM floor, kernel by kernel: after a settle that alternates them,
    --steps profiled calls of each, alternating; for each, every kernel's median duration in launch order (GEMMs
    by cuBLAS's kernel name, so a different algorithm shows), their sum, and the idle between the first kernel's
    start and the last one's end. Kernel durations are the GPU's own timestamps; the idle includes the profiler's
    host cost (an upper bound)."""
    device, workload = workload_of(args)
    report = []
    for tokens in args.tokens:
        tensors = tensors_of(tokens, workload, device)
        steps = {"ours-fp8" if args.fp8 else "ours": loss_step(cosdistill, tensors, "full", library_options(args)),
                 "floor": floor_provider(tensors, "full")}
        settle(steps.values(), device, settle_seconds(args, 3.0, device))
        calls = {name: [] for name in steps}
        for _ in range(args.steps):
            for name, step in steps.items():
                calls[name].append(call_work(step, tensors, device))
        summaries = {name: kernel_summary(work) for name, work in calls.items()}
        print(f"T={tokens}, full step, {device_name(device)}, torch {torch.__version__}")
        for name, summary in summaries.items():
            print(f"{name}:")
            for kernel, duration in summary["kernels"]:
                print(f"    {duration:9.1f} us  {kernel[:90]}")
            print(f"    kernels {summary['busy_us']:.1f} us, span {summary['span_us']:.1f} us, idle inside "
                  f"{summary['idle_us']:.1f} us ({summary['calls_with_sequence']} of {summary['calls']} calls "
                  "with this sequence)")
        report.append(dict(tokens=tokens, **summaries))
        del tensors, steps
    return report


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


# --- idle ---


def idle_timeline(trace, step_name, device, min_gap_us) -> dict:
    """The step marked ``step_name`` in a trace with host ops: its host time, the device's work in it in time order
    with the idle before each and the host op that launched it (the innermost op around its launch), and the host
    ops before the first launch."""
    step = next(event for event in trace if event["name"] == step_name and event.get("cat") == "user_annotation")
    start, stop = step["ts"], step["ts"] + step["dur"]
    launches = {event["args"]["correlation"]: event for event in trace
                if event.get("cat") in LAUNCH_CATEGORIES and "correlation" in event.get("args", {})}
    host_ops = [event for event in trace if event.get("cat") == "cpu_op" and start <= event["ts"] <= stop]
    work = [event for event in device_work(trace, device) if start <= event["ts"] <= stop + 100_000]

    def launch_of(kernel):  # on the CPU the work is the host op itself
        return launches.get(kernel.get("args", {}).get("correlation"), kernel)

    def launched_by(kernel):
        launch = launch_of(kernel)
        holders = [op for op in host_ops if op is not kernel and op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]]
        if holders:
            return min(holders, key=lambda op: op["dur"])["name"]
        return "?" if launch is kernel else launch["name"]

    timeline, previous_end = [], work[0]["ts"] if work else start
    for kernel in work:
        timeline.append(dict(start_us=kernel["ts"] - start, duration_us=kernel["dur"], name=kernel["name"],
                             launched_by=launched_by(kernel), idle_before_us=max(0.0, kernel["ts"] - previous_end)))
        previous_end = max(previous_end, kernel["ts"] + kernel["dur"])
    first_launch = launch_of(work[0])["ts"] if work else stop
    before = [dict(start_us=op["ts"] - start, duration_us=op["dur"], name=op["name"]) for op in host_ops
              if op["ts"] < first_launch and op["dur"] >= min_gap_us]
    return dict(host_ms=(stop - start) / 1e3, busy_ms=sum(kernel["dur"] for kernel in work) / 1e3,
                first_kernel_us=work[0]["ts"] - start if work else None, host_ops_before_first=before, work=timeline)


def idle(args):
    """Where the device idles inside one call (forward and backward, or with --no-grad the no-grad forward), and what
    the host launched next: three calls profiled with host ops after three more; for the last, every kernel in
    time order, marked where the device idled more than --min-gap-us before it, with the host op that launched it;
    the call's host time, the kernels' busy time, the time to the first kernel and the host ops before it. The
    profiler slows the host, so the gaps are upper bounds: their places count, not their sizes."""
    device, workload = workload_of(args)
    report = []
    for tokens in args.tokens:
        tensors = tensors_of(tokens, workload, device)
        step = loss_step(cosdistill, tensors, "forward" if args.no_grad else "full", library_options(args))
        settle([step], device, 0.0, min_rounds=3)  # warm-up

        def three_calls():
            for index in range(3):
                synchronize(device)
                with record_function(f"step {index}"):
                    step()
                synchronize(device)

        timeline = idle_timeline(profiled_trace(three_calls, device, host_ops=True), "step 2", device, args.min_gap_us)
        print(f"T={tokens}{' no-grad forward' if args.no_grad else ''}: call {timeline['host_ms']:.3f} ms on the host, "
              f"device busy {timeline['busy_ms']:.3f} ms, {len(timeline['work'])} kernels and copies")
        if timeline["work"]:
            print(f"  first kernel {timeline['first_kernel_us']:.0f} us after the call began; the host ops before its launch:")
            for op in timeline["host_ops_before_first"]:
                print(f"    {op['start_us']:7.0f} us {op['duration_us']:6.0f} us  {op['name'][:70]}")
        for kernel in timeline["work"]:
            gap = kernel["idle_before_us"]
            marker = f"  <- idle {gap:6.0f} us before it" if gap > args.min_gap_us else ""
            print(f"  {kernel['start_us']:9.0f} us {kernel['duration_us']:7.0f} us  {kernel['name'][:50]:50s} "
                  f"(from {kernel['launched_by'][:40]}){marker}")
        report.append(dict(tokens=tokens, no_grad=args.no_grad, **timeline))
        del tensors
    return report


# --- host ---


def lead_providers(loss: str = "cosine") -> dict:
    """The bench's providers that ``host`` times from an idle and from a busy GPU, ours with this soft term (the
    JSD without the settings that force a cosine_via)."""
    settings = [ours_settings()[0], FP8_SETTING, *FORCED_SETTINGS.values()]
    settings = [setting for setting in settings if loss == "cosine" or setting.cosine_via == "auto"]
    return {**{setting.label: ours_provider(dataclasses.replace(setting, loss=loss)) for setting in settings},
            "floor": floor_provider}


def sleep_cycles(milliseconds: float) -> int:
    """Cycles of torch.cuda._sleep that take about this long at the present clock."""
    cycles = 1_000_000
    for _ in range(3):  # the clock moves under load: measured at the running one
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        cycles = max(1, int(cycles * milliseconds / start.elapsed_time(end)))
    return cycles


def busy_start_ms(step, busy_cycles: int) -> float:
    """As bench.call_ms, but with a sleep kernel queued before the start event: the GPU busy meanwhile."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(busy_cycles)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def host_lead(step, calls, busy_ms) -> dict:
    """Median ms of the step from an idle GPU (as the bench times it) and from a busy one (the host's lead hidden),
    alternating call by call, the first of each pair swapping."""
    busy = sleep_cycles(busy_ms)
    idle_ms, queued_ms = [], []
    for index in range(calls):
        for busy_start in ((False, True) if index % 2 else (True, False)):
            if busy_start:
                queued_ms.append(busy_start_ms(step, busy))
            else:
                idle_ms.append(call_ms(step, torch.device("cuda")))
    return dict(idle_start_ms=statistics.median(idle_ms), busy_start_ms=statistics.median(queued_ms))


# Where the host's time before the first GEMM goes, stamped as each step of the eager call is entered (no profiler).
HOST_MARKS = (("call to the plan", "checked_plan"), ("call to run", "run"))
HOST_STAMPS = (*(name for name, _ in HOST_MARKS), "call to first GEMM call", "call to loss returned", "backward")


def host_path(tensors, options, device, calls, profiler=None, until_first_gemm=False) -> list[tuple]:
    """Per call, the host's seconds from the call to each of HOST_MARKS' steps of api.distill and to its first GEMM's
    call, to the loss's return, and through backward, stamped without a profiler; on CUDA each call behind a sleep
    kernel, so that the host never waits for the GPU. ``profiler`` (cProfile) runs over each whole call, or only
    until its first GEMM."""
    entered, stamps = {}, []
    loss_of, options = loss_function(cosdistill, options)

    def stamped(name, function):
        def call(*call_args, **call_kwargs):
            if name not in entered:
                entered[name] = time.perf_counter()
                if name == "first GEMM" and profiler and until_first_gemm:
                    profiler.disable()
            return function(*call_args, **call_kwargs)
        return call

    patches = [mock.patch.object(cosdistill.api, attribute, stamped(name, getattr(cosdistill.api, attribute)))
               for name, attribute in HOST_MARKS]
    patches.append(mock.patch.object(testing.chunk_loop, "logits_into",
                                     stamped("first GEMM", testing.chunk_loop.logits_into)))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        for _ in range(calls):
            synchronize(device)
            tensors.clear_grads()
            if device.type == "cuda":
                torch.cuda._sleep(5_000_000)  # a few ms: the GPU stays busy while the host runs
            entered.clear()
            if profiler:
                profiler.enable()
            start = time.perf_counter()
            loss = loss_of(*tensors.args(), **options)
            returned = time.perf_counter()
            loss.backward()
            done = time.perf_counter()
            if profiler:
                profiler.disable()
            marks = [entered[name] - start for name, _ in HOST_MARKS]
            stamps.append((*marks, entered["first GEMM"] - start, returned - start, done - returned))
    return stamps


def host(args):
    """The host's part of a call. On CUDA, the host's lead before the first kernel: each --providers timed from an idle
    GPU (as the bench times it, the lead counted in full) and from a busy one (a --busy-ms sleep kernel queued first,
    as in a training loop), alternating; lead = the difference; ours with --loss's soft term. Then the host's time to
    each step of the call before its first GEMM (HOST_STAMPS), to the first GEMM's call, to the loss's return and
    through backward (median of --calls), and cProfile's top --cprofile-lines functions over the Python before the
    first GEMM and over whole calls (0: none)."""
    device, workload = workload_of(args)
    options, report, providers = library_options(args), [], lead_providers(args.loss)
    if set(args.providers) - set(providers):
        raise ValueError(f"--providers {sorted(set(args.providers) - set(providers))} have no {args.loss} form")
    for tokens in args.tokens:
        tensors = tensors_of(tokens, workload, device)
        leads = []
        for mode in args.modes if device.type == "cuda" else ():  # the lead needs a GPU's queue
            for name in args.providers:
                step = providers[name](tensors, mode)

                def call(step=step, tensors=tensors):
                    tensors.clear_grads()
                    step()

                settle([call], device, settle_seconds(args, 3.0, device))
                lead = host_lead(call, args.calls, args.busy_ms)
                leads.append(dict(mode=mode, provider=name, **lead))
                idle_start, busy_start = lead["idle_start_ms"], lead["busy_start_ms"]
                print(f"T={tokens:6d} {mode:7s} {name:22s} idle start {idle_start:8.3f}  busy start {busy_start:8.3f}  "
                      f"lead {idle_start - busy_start:6.3f} ms ({(idle_start - busy_start) / idle_start:+.2%})")
        host_path(tensors, options, device, 5)  # warm-up
        stamps = host_path(tensors, options, device, args.calls)
        medians = {name: 1e6 * statistics.median(stamp[index] for stamp in stamps) for index, name in enumerate(HOST_STAMPS)}
        print(f"T={tokens}{' fp8' if args.fp8 else ''}, {device_name(device)}, torch {torch.__version__}: host us, "
              f"median of {args.calls} calls" + (" behind a sleep kernel" if device.type == "cuda" else ""))
        for name, value in medians.items():
            print(f"  {name:26s} {value:9.1f} us")
        for until_first_gemm in (True, False) if args.cprofile_lines else ():
            profiler = cProfile.Profile()
            host_path(tensors, options, device, args.calls, profiler, until_first_gemm)
            print(f"cProfile, {'the Python before the first GEMM' if until_first_gemm else 'whole calls'}:")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile_lines)
        report.append(dict(tokens=tokens, leads=leads, host_us=medians))
        del tensors
    return report


# --- row-step ---

ROW_STEP_CONSTANTS = RowStepConstants(weight_hard=0.3, weight_soft=0.7, beta=0.9, temperature=2.0, ignore_index=-100)
# (rows, vocab, padding columns) the cluster kernel is checked at: the seed's and other LLMs' vocabularies, odd ones
CLUSTER_CHECK_SHAPES = ((1024, 128256, 0), (256, 262144, 0), (300, 32000, 0), (100, 1000, 8), (33, 8, 0), (64, 151936, 0),
                        (200, 98304, 0), (64, 200064, 0), (300, 49152, 8))
TRITON_GRAD_CONFIGS = ((1024, 4), (2048, 2), (2048, 4), (4096, 4), (2048, 8), (4096, 8))  # (block, warps)
TRITON_LOSS_CONFIGS = ((2048, 4), (2048, 8), (4096, 8), (2048, 16), (4096, 16))


def row_inputs(rows, vocab, device, pad=0, label_dtype=torch.int64, seed=0, ignored=0.1):
    """bf16 student and teacher logits of a few units (rows padded by ``pad`` columns), labels with a fraction ignored."""
    generator = torch.Generator(device=device).manual_seed(seed)
    student = torch.randn(rows, vocab + pad, device=device, generator=generator).mul_(3).bfloat16()[:, :vocab]
    teacher = torch.randn(rows, vocab + pad, device=device, generator=generator).mul_(3).bfloat16()[:, :vocab]
    labels = torch.randint(0, vocab, (rows,), device=device, generator=generator)
    labels[torch.rand(rows, device=device, generator=generator) < ignored] = ROW_STEP_CONSTANTS.ignore_index
    return student, teacher, labels.to(label_dtype)


def spec_error(step, student, teacher, labels, constants, write_grad) -> float:
    """The larger relative error of a row step's losses and gradient against the torch spec's (the losses poisoned
    first); inf where its NaN losses are not the spec's."""
    want_grad, want_losses = student.clone(), torch.empty(len(student), 2, device=student.device)
    row_step_torch(want_grad, teacher, labels, constants, want_losses, write_grad)
    grad, losses = student.clone(), torch.full((len(student), 2), float("nan"), device=student.device)
    step(grad, teacher, labels, constants, losses, write_grad)
    finite = want_losses.isfinite()
    errors = [rel_err(losses[finite], want_losses[finite])]
    if write_grad:
        errors.append(rel_err(grad.float().nan_to_num(), want_grad.float().nan_to_num()))
    same_nans = bool((losses.isnan() == want_losses.isnan()).all())
    return max(errors) if same_nans and all(map(math.isfinite, errors)) else math.inf


def triton_sweep(impls, student, teacher, labels, constants, copy_ms, configs, stages) -> list[dict]:
    """Each Triton row step at each (block, warps) and --stages, with gradient (timed with a copy of the student
    buffer, which it overwrites, less the copy) and loss only; its error against the spec first."""
    records, scratch, losses = [], student.clone(), torch.empty(len(student), 2, device=student.device)
    one_pass = student.numel() * student.element_size()
    for write_grad, passes in ((True, 5), (False, 2)):
        for (name, row_step), (block, warps), stage in itertools.product(impls, configs[write_grad], stages):
            settings = dict(block_size=block, num_warps=warps) | ({} if stage is None else dict(num_stages=stage))
            step = functools.partial(row_step, **settings)
            error = spec_error(step, student, teacher, labels, constants, write_grad)
            if write_grad:
                ms = kernel_ms(lambda: (scratch.copy_(student), step(scratch, teacher, labels, constants, losses, True)),
                               student.device) - copy_ms
            else:
                ms = kernel_ms(lambda: step(student, teacher, labels, constants, losses, False), student.device)
            records.append(dict(impl=name, write_grad=write_grad, block=block, warps=warps, stages=stage, ms=ms,
                                tb_per_s=passes * one_pass / ms / 1e9 if ms > 0 else None, rel_err=error))
            setting = "defaults" if block is None else f"block={block:5d} warps={warps:2d}"
            print(f"  {'row step' if write_grad else 'loss only'} {name} {setting}"
                  f"{'' if stage is None else f' stages={stage}'}: {ms:.3f} ms, "
                  f"{records[-1]['tb_per_s'] or 0:.2f} TB/s of its {passes} passes, rel err {error:.1e}", flush=True)
    return records


def cluster_step(layout):
    """The cluster kernel at ``layout`` (None: _fitting_kernel's), then the Triton RESCUE launch, as row_step_cuda runs them."""
    from cosdistill.testing import row_step_triton

    row_step_cuda = testing.kernels.row_step_cuda

    def step(student, teacher, labels, constants, losses, write_grad=True):
        row_step_cuda.cluster_kernel(student, teacher, labels, constants, losses, layout)
        row_step_triton(student, teacher, labels, constants, losses, True, rescue_only=True)
    return step


def cluster_fits(vocab, layout) -> bool:
    """Whether the layout holds a vocab-sized row and compiles to a kernel that fits on the device without spilling."""
    row_step_cuda = testing.kernels.row_step_cuda

    if layout is None:
        return True
    if not 0 <= row_step_cuda._shared_bytes(vocab, *layout) <= row_step_cuda.MAX_SHARED_BYTES:
        return False
    if row_step_cuda._kernel(vocab, torch.int64, torch.cuda.current_device(), layout) is None:
        print(f"  vocab={vocab}: {layout} has no kernel (it spills, or no cluster fits)", flush=True)
        return False
    return True


def cluster_checks(layout, device) -> list[dict]:
    """The cluster kernel at ``layout`` against the torch spec at CLUSTER_CHECK_SHAPES, int32 labels, and rows that
    overflow fp32 (the RESCUE launch redoes them) or hold inf (NaN loss and gradient, as the spec)."""
    cases = [(f"rows={rows} vocab={vocab} pad={pad}", row_inputs(rows, vocab, device, pad))
             for rows, vocab, pad in CLUSTER_CHECK_SHAPES]
    cases.append(("int32 labels", row_inputs(64, 128256, device, label_dtype=torch.int32, seed=1)))
    student, teacher, labels = row_inputs(64, 128256, device, label_dtype=torch.int32, seed=1)
    student[3, :300], student[5, 7], labels[3] = 3e38, float("inf"), 11
    cases.append(("overflow rows", (student, teacher, labels)))
    records = []
    for name, (student, teacher, labels) in cases:
        if cluster_fits(student.shape[1], layout):
            error = spec_error(cluster_step(layout), student, teacher, labels, ROW_STEP_CONSTANTS, True)
            records.append(dict(layout=layout, case=name, rel_err=error))
            print(f"  {layout or 'launched'} {name}: rel err against the spec {error:.2e}", flush=True)
    return records


def cluster_alone(student, teacher, labels, layouts, copy_ms, old_step) -> list[dict]:
    """The cluster kernel (and --old's CUDA row step) alone on these rows, by layout, less the student buffer's copy."""
    row_step_cuda = testing.kernels.row_step_cuda

    vocab, records = student.shape[1], []
    scratch, losses = student.clone(), torch.empty(len(student), 2, device=student.device)
    steps = [("--old cuda", None, old_step)] if old_step else []
    steps += [(f"cuda {layout or 'launched'}", layout, cluster_step(layout)) for layout in layouts if cluster_fits(vocab, layout)]
    for name, layout, step in steps:
        ms = kernel_ms(lambda: (scratch.copy_(student), step(scratch, teacher, labels, ROW_STEP_CONSTANTS, losses, True)),
                       student.device) - copy_ms
        detail = ""
        if name.startswith("cuda"):
            layout = layout or row_step_cuda._fitting_kernel(vocab, labels.dtype, student.device.index)[1]
            kernel = row_step_cuda._kernel(vocab, labels.dtype, student.device.index, layout)
            clusters = row_step_cuda.max_active_clusters(kernel, layout, row_step_cuda._shared_bytes(vocab, *layout))
            detail = (f", {clusters} clusters at once, "
                      f"{row_step_cuda.kernel_attribute(kernel, row_step_cuda._NUM_REGS)} registers")
        records.append(dict(impl=name, ms=ms, tb_per_s=3 * student.numel() * 2 / ms / 1e9))
        print(f"  {name} {ms:.3f} ms, {records[-1]['tb_per_s']:.2f} TB/s of its 3 passes{detail}", flush=True)
    return records


def in_step_times(steps, rows, vocab, device, ignored, hidden=4096, calls=60) -> dict:
    """CUDA only: each step timed by CUDA events right after a teacher-sized logits GEMM into its teacher buffer, as
    in the chunk loop: at the clock and the L2 state the step meets there. Median ms over ``calls``."""
    student, teacher, labels = row_inputs(rows, vocab, device, ignored=0.0)
    labels[:int(rows * ignored)] = ROW_STEP_CONSTANTS.ignore_index  # a masked prompt, ignored rows first
    hidden_rows = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16) / hidden**0.5
    scratch, losses = student.clone(), torch.empty(rows, 2, device=device)
    times = {name: [] for name in steps}
    for call in range(calls + 5):
        for name, step in steps.items():
            scratch.copy_(student)
            torch.mm(hidden_rows, weight.T, out=teacher)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(scratch, teacher, labels, ROW_STEP_CONSTANTS, losses, True)
            stop.record()
            torch.cuda.synchronize()
            if call >= 5:
                times[name].append(start.elapsed_time(stop))
    return {name: statistics.median(values) for name, values in times.items()}


def old_row_steps(src):
    """--old's Triton and CUDA row steps (the kernels' module paths of this tree or of the flat older layout)."""
    old = load_old(src)
    found = {}
    for name in ("row_step_triton", "row_step_cuda"):
        for module in (f"{old.__name__}.kernels.{name}", f"{old.__name__}.{name}"):
            try:
                found[name] = getattr(importlib.import_module(module), name)
                break
            except ModuleNotFoundError:
                continue
    return found.get("row_step_triton"), found.get("row_step_cuda")


def row_step(args):
    """The row step alone, per --rows and --vocabs. The Triton kernel (and --old's) by block size and warps (a sweep,
    or --configs) and --stages: losses and gradient checked against the torch spec, then timed with the bytes it
    moves (two reads of each logits buffer and a write of the student's with the gradient, 5 passes; 2 without),
    beside a copy of one buffer. Where the CUDA cluster kernel runs (Hopper): checked against the spec at odd shapes
    for each layout (_fitting_kernel's and --launches), timed alone (3 passes), and with --in-step right after a teacher
    GEMM, the --ignored fraction of rows ignored."""
    from cosdistill.testing import row_step_triton

    row_step_cuda = testing.kernels.row_step_cuda

    device = torch.device(args.device)
    constants = dataclasses.replace(ROW_STEP_CONSTANTS, student_softcap=args.softcap, teacher_softcap=args.softcap)
    old_triton, old_cuda = old_row_steps(args.old) if args.old else (None, None)
    impls = [("this", row_step_triton)] + ([("--old", old_triton)] if old_triton else [])
    configs = {True: TRITON_GRAD_CONFIGS, False: TRITON_LOSS_CONFIGS}
    if args.configs:
        configs = dict.fromkeys((True, False), [tuple(int(part) for part in text.split(":")) for text in args.configs])
    configs = {write_grad: [(None, None), *listed] for write_grad, listed in configs.items()}
    cluster = row_step_cuda.available(device) and args.softcap is None
    layouts = [None] + [row_step_cuda.Layout(*map(int, text.split(":"))) for text in args.launches or []]
    print(f"{device_name(device)}, torch {torch.__version__}" + ("" if cluster else "; the CUDA cluster kernel does not "
          "run here (it needs a Hopper GPU, and no softcap): the Triton kernel only"), flush=True)
    report = dict(checks=[], alone=[], in_step=[])
    for layout in layouts if cluster else ():
        print(f"checks, {layout or 'launched'}:")
        report["checks"] += cluster_checks(layout, device)
    for rows in args.rows:
        for vocab in args.vocabs:
            student, teacher, labels = row_inputs(rows, vocab, device, ignored=0.0)  # every row counts, as in a dense batch
            scratch = student.clone()
            copy_ms = kernel_ms(lambda: scratch.copy_(student), device)
            print(f"rows={rows} vocab={vocab}: copy of one buffer {copy_ms:.3f} ms, "
                  f"{2 * student.numel() * 2 / copy_ms / 1e9:.2f} TB/s", flush=True)
            records = triton_sweep(impls, student, teacher, labels, constants, copy_ms, configs, args.stages)
            if cluster:
                records += cluster_alone(student, teacher, labels, layouts, copy_ms, old_cuda)
            report["alone"] += [dict(rows=rows, vocab=vocab, copy_ms=copy_ms, **record) for record in records]
            if args.in_step and device.type == "cuda":
                steps = {"triton": row_step_triton, **({"--old cuda": old_cuda} if old_cuda else {})}
                steps |= {f"cuda {layout or 'launched'}": cluster_step(layout) for layout in layouts
                          if cluster and cluster_fits(vocab, layout)}
                for name, ms in in_step_times(steps, rows, vocab, device, args.ignored).items():
                    report["in_step"].append(dict(rows=rows, vocab=vocab, ignored=args.ignored, impl=name, ms=ms))
                    print(f"  in step, ignored {args.ignored}: {name} {ms:.3f} ms", flush=True)
    return report


# --- ab ---


def load_old(src: str):
    """The package under ``src``/cosdistill, imported as cosdistill_old (its imports are relative)."""
    folder = Path(tempfile.mkdtemp())
    shutil.copytree(Path(src) / "cosdistill", folder / "cosdistill_old")
    sys.path.insert(0, str(folder))
    return importlib.import_module("cosdistill_old")


def bootstrap_median_interval(values, resamples=2000, seed=0):
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def compare(new_call, old_call, device, pairs, settle_s) -> dict:
    """After both versions warm up alternating, ``pairs`` pairs of calls, each timed alone, the first of each pair
    swapping (new, old, old, new, ...): neighbouring calls share the GPU's clock."""
    settle([new_call, old_call], device, settle_s, min_rounds=3)
    new_ms, old_ms = [], []
    for index in range(pairs):
        if index % 2:
            old_ms.append(call_ms(old_call, device))
            new_ms.append(call_ms(new_call, device))
        else:
            new_ms.append(call_ms(new_call, device))
            old_ms.append(call_ms(old_call, device))
    differences = [new - old for new, old in zip(new_ms, old_ms)]
    return dict(new_ms=statistics.median(new_ms), old_ms=statistics.median(old_ms),
                difference_ms=statistics.median(differences),
                interval_ms=bootstrap_median_interval(differences), new_calls=new_ms, old_calls=old_ms)


def ab(args):
    """This code against another version of the library (--old: a src folder, e.g. from git archive, loaded as
    cosdistill_old), in one process on the same tensors: after a common settle the calls alternate, each timed
    alone by CUDA events. Per size and mode: each version's median and the median of the paired differences
    (new - old) with a bootstrap 95% interval."""
    device, workload = workload_of(args)
    settle_s = settle_seconds(args, 3.0, device)
    old = load_old(args.old)
    options = dict(teacher_precision="fp8" if args.fp8 else None, loss=args.loss)
    if args.beta is not None:
        options["beta"] = args.beta
    report = []
    print(f"new: {Path(cosdistill.__file__).parent}, old: {args.old}; {args.pairs} pairs, settle {settle_s} s")
    for tokens in args.tokens:
        tensors = tensors_of(tokens, workload, device)
        for mode in args.modes:
            result = compare(loss_step(cosdistill, tensors, mode, options), loss_step(old, tensors, mode, options), device,
                             args.pairs, settle_s)
            low, high = result["interval_ms"]
            print(f"T={tokens} {mode:7s} new {result['new_ms']:8.3f} ms  old {result['old_ms']:8.3f} ms  "
                  f"new - old {result['difference_ms']:+7.3f} ms ({100 * result['difference_ms'] / result['old_ms']:+.2f}%), "
                  f"95% interval [{low:+.3f}, {high:+.3f}]")
            report.append(dict(tokens=tokens, vocab=workload.vocab, mode=mode, fp8=args.fp8, **result))
        del tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


# --- fp8-accuracy ---


def real_looking_problem(tokens, vocab, hidden, device, seed=0) -> dict:
    """LM-head rows with log-normal norms (frequent tokens have larger rows), hidden states with a few outlier
    channels 20x the rest (as LLM activations have), each pulled towards its label's row so that the logits are
    peaked; the student a weaker model of the same kind. bf16."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def lm_head(hidden_size):
        row_norms = torch.empty(vocab, 1, device=device).log_normal_(0.0, 0.5, generator=generator)
        return torch.randn(vocab, hidden_size, device=device, generator=generator) / hidden_size**0.5 * row_norms

    def hidden_states(weight, peak):
        states = torch.randn(tokens, weight.shape[1], device=device, generator=generator)
        states[:, :8] *= 20.0
        target_rows = weight[labels]
        return states + peak * target_rows / target_rows.norm(dim=1, keepdim=True) ** 2

    labels = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    teacher_weight, student_weight = lm_head(hidden), lm_head(hidden // 2)
    teacher_input, student_input = hidden_states(teacher_weight, 12.0), hidden_states(student_weight, 6.0)
    return dict(student_input=student_input.bfloat16().requires_grad_(),
                student_weight=student_weight.bfloat16().requires_grad_(), teacher_input=teacher_input.bfloat16(),
                teacher_weight=teacher_weight.bfloat16(), true_labels=labels)


def loss_and_grads(problem, **options) -> list[torch.Tensor]:
    """[loss, soft, hard, grad_input, grad_weight] of one library call."""
    for name in ("student_input", "student_weight"):
        problem[name].grad = None
    losses = cosdistill.fused_linear_cosine_distill(**problem, return_soft_hard_loss=True, **options)
    losses[0].backward()
    return [x.detach().clone() for x in losses] + [problem["student_input"].grad.clone(), problem["student_weight"].grad.clone()]


def float64_loss_and_grads(problem, teacher_input=None, teacher_weight=None) -> list[torch.Tensor]:
    """The same from the naive version in float64, on the given teacher (default: the problem's)."""
    upcast = {name: value.detach().double().requires_grad_(value.requires_grad) if value.is_floating_point() else value
              for name, value in problem.items()}
    if teacher_input is not None:
        upcast["teacher_input"], upcast["teacher_weight"] = teacher_input.double(), teacher_weight.double()
    losses = naive_cosine_distill(**upcast)
    losses[0].backward()
    return [x.detach() for x in losses] + [upcast["student_input"].grad, upcast["student_weight"].grad]


FP8_QUANTITIES = ("loss", "soft", "hard", "grad_input", "grad_weight")
FP8_COLUMNS = {"bf16_vs_float64": "bf16 path vs float64", "fp8_vs_float64": "FP8 teacher vs float64",
               "fp8_vs_bf16": "FP8 vs the bf16 path",
               "fp8_vs_float64_on_quantized_teacher": "FP8 vs float64 on the dequantized teacher",
               "quantized_float64_vs_float64": "float64 on the dequantized teacher vs float64"}


def fp8_accuracy(args):
    """The FP8 teacher's relative errors on real-looking data (real_looking_problem), per loss term and gradient:
    the bf16 path and the FP8 teacher against float64, the FP8 teacher against the bf16 path, and against float64
    fed the dequantized teacher (what the FP8 GEMM multiplies: our code's error without the quantization's); and
    float64 on the dequantized teacher against float64 (the quantization's own). On a device without FP8 tensor
    cores the FP8 columns are left empty."""
    device, workload = workload_of(args)
    report = []
    for tokens in args.tokens:
        problem = real_looking_problem(tokens, workload.vocab, workload.hidden, device)
        with torch.no_grad():
            logits = problem["teacher_input"][:256].float() @ problem["teacher_weight"].float().t()
            top = logits.topk(2, dim=1).values
            kurtosis = (((logits - logits.mean()) / logits.std()) ** 4).mean()
            print(f"teacher logits (first 256 tokens): std {logits.std():.2f}, max {logits.max():.1f}, top1 - top2 median "
                  f"{(top[:, 0] - top[:, 1]).median():.2f}, kurtosis {kurtosis:.1f}")
        exact, bf16 = float64_loss_and_grads(problem), loss_and_grads(problem)
        on_quantized = float64_loss_and_grads(problem, testing.teacher_fp8.fp8_rounded(problem["teacher_input"]),
                                              testing.teacher_fp8.fp8_rounded(problem["teacher_weight"]))
        try:
            testing.teacher_fp8.check_supported(device)
            with_fp8 = loss_and_grads(problem, teacher_precision="fp8")
        except ValueError as why:
            print(f"the FP8 columns are empty: {why}")
            with_fp8 = None
        rows = []
        for index, quantity in enumerate(FP8_QUANTITIES):
            def fp8_err(against, index=index):
                return None if with_fp8 is None else rel_err(with_fp8[index], against[index])

            rows.append(dict(quantity=quantity, bf16_vs_float64=rel_err(bf16[index], exact[index]),
                             fp8_vs_float64=fp8_err(exact), fp8_vs_bf16=fp8_err(bf16),
                             fp8_vs_float64_on_quantized_teacher=fp8_err(on_quantized),
                             quantized_float64_vs_float64=rel_err(on_quantized[index], exact[index])))
        print(f"T={tokens}, V={workload.vocab}, H={workload.hidden}/{workload.student_hidden}, bf16 inputs, real-looking "
              "data; relative errors:")
        print("| quantity | " + " | ".join(FP8_COLUMNS.values()) + " |\n|---|" + "---:|" * len(FP8_COLUMNS))
        for row in rows:
            cells = ("-" if row[key] is None else f"{row[key]:.2e}" for key in FP8_COLUMNS)
            print(f"| {row['quantity']} | " + " | ".join(cells) + " |")
        report.append(dict(tokens=tokens, vocab=workload.vocab, hidden=workload.hidden, errors=rows))
    return report


# --- the command line ---


def add_device_arguments(parser, device_help="cpu: a smoke run at small sizes"):
    parser.add_argument("--device", default="cuda", help=device_help)
    parser.add_argument("--json", help="write the report to this file")


def add_workload_arguments(parser, tokens):
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=tokens, help="tokens per call, one run each")
    parser.add_argument("--vocab", type=positive_int, help="both heads' vocabulary (default: the seed's on CUDA)")
    parser.add_argument("--hidden", type=positive_int, help="the teacher's hidden size, the student's half (default: the seed's)")
    add_device_arguments(parser)


def add_settle_argument(parser):
    parser.add_argument("--settle-s", type=float, help="seconds of warm-up calls before timing (default: 0 on the CPU; "
                        "on CUDA, where the power limiter cuts the clock under load, the subcommand's own)")


def add_library_arguments(parser):
    parser.add_argument("--fp8", action="store_true", help="the library with teacher_precision='fp8'")
    parser.add_argument("--impl", choices=testing.backends.IMPLS, default="auto", help="the library's impl")
    parser.add_argument("--loss", choices=("cosine", "jsd"), default="cosine", help="the library's soft term")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")

    def add(name, run_command, summary):
        sub = commands.add_parser(name, help=summary, description=run_command.__doc__)
        sub.set_defaults(run=run_command)
        return sub

    sub = add("gaps", gaps,
              "the step's time over the floor, by part: GEMMs alone and chunked, the bare loop, the library's layers")
    add_workload_arguments(sub, [1024, 8192])
    add_settle_argument(sub)
    add_library_arguments(sub)
    sub.add_argument("--chunks", type=positive_int, nargs="+", default=[1024, 2048], help="rows per chunked GEMM")
    sub.add_argument("--layouts", nargs="+", default=["1024/1024", "2048/2048", "2048/1024"],
                     help="student/teacher rows of the bare chunk loop, beside the library's own")
    sub.add_argument("--rounds", type=positive_int, default=3)
    sub.add_argument("--reps", type=positive_int, default=15)

    sub = add("kernels", kernels,
              "the library's full step and the floor, kernel by kernel")
    add_workload_arguments(sub, [1024])
    add_settle_argument(sub)
    add_library_arguments(sub)
    sub.add_argument("--steps", type=positive_int, default=7, help="profiled calls of each")

    sub = add("idle", idle,
              "where the device idles inside one call, and what the host launched next")
    add_workload_arguments(sub, [1024])
    add_library_arguments(sub)
    sub.add_argument("--min-gap-us", type=float, default=5.0)
    sub.add_argument("--no-grad", action="store_true", help="the no-grad forward instead of forward and backward")

    sub = add("host", host,
              "the host's lead before the first kernel, its time to the first GEMM, cProfile of it")
    add_workload_arguments(sub, [1024, 2048])
    add_settle_argument(sub)
    add_library_arguments(sub)
    sub.add_argument("--providers", nargs="+", choices=sorted(lead_providers()), default=["ours", "ours-fp8", "floor"],
                     help="the bench's providers whose lead is measured (CUDA)")
    sub.add_argument("--modes", nargs="+", choices=("full", "forward"), default=["full"])
    sub.add_argument("--calls", type=positive_int, default=40)
    sub.add_argument("--busy-ms", type=float, default=1.0, help="the sleep kernel queued before a busy start")
    sub.add_argument("--cprofile-lines", type=int, default=30, help="functions printed per cProfile (0: no cProfile)")

    sub = add("row-step", row_step,
              "the row step alone: Triton by block, warps, stages; the CUDA cluster kernel")
    add_device_arguments(sub, "cpu: the Triton kernel in its interpreter, at small sizes")
    sub.add_argument("--rows", type=positive_int, nargs="+", default=[1024])
    sub.add_argument("--vocabs", type=positive_int, nargs="+", default=[128256])
    sub.add_argument("--softcap", type=float, help="both heads' logit softcap, for the Triton kernel (Gemma-2: 30)")
    sub.add_argument("--configs", nargs="+", help="BLOCK:WARPS settings of the Triton kernel (default: a sweep)")
    sub.add_argument("--stages", type=int, nargs="+", default=[None], help="num_stages settings (default: the kernel's)")
    sub.add_argument("--launches", nargs="+", help="CLUSTER:THREADS[:REGISTER_COLS] cluster layouts beside _fitting_kernel's")
    sub.add_argument("--in-step", action="store_true", help="also time each step right after a teacher GEMM (CUDA)")
    sub.add_argument("--ignored", type=float, default=0.0, help="fraction of ignored rows in step")
    sub.add_argument("--old", help="a src folder whose Triton and CUDA row steps are timed beside these")

    sub = add("ab", ab,
              "an old source tree against this one, call by call, interleaved in one process")
    add_workload_arguments(sub, [1024, 2048])
    add_settle_argument(sub)
    sub.add_argument("--old", required=True, help="a src folder holding the other version's cosdistill package")
    sub.add_argument("--modes", nargs="+", choices=("full", "forward"), default=["full", "forward"])
    sub.add_argument("--pairs", type=positive_int, default=200)
    sub.add_argument("--fp8", action="store_true", help="both versions with teacher_precision='fp8'")
    sub.add_argument("--loss", choices=("cosine", "jsd"), default="cosine", help="both versions' soft term")
    sub.add_argument("--beta", type=float, help="the JSD's beta (default: fused_linear_jsd's)")

    sub = add("fp8-accuracy", fp8_accuracy,
              "the FP8 teacher's error on real-looking data against float64 and the bf16 path")
    add_workload_arguments(sub, [4096])
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    report = args.run(args)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return report


if __name__ == "__main__":
    main()
