"""The CUDA cluster row step (``row_step_cuda.py``) against the Triton row step: checked
against the torch spec, then timed alone per chunk.

Prediction: it moves 3 bytes per logit pair per row instead of 5, so at the copy rate 0.19 ms
per 1024 rows at the seed vocab against the Triton kernel's 0.32 (range 0.19-0.30: each block idles
between its copy, the cluster's exchange and its writes; 3 blocks share an SM to cover it); V = 262144
0.40 against 0.64 (range 0.40-0.60: 128 KB of shared memory per block leaves one block per SM).

    PYTHONPATH=src python benchmarks/cluster_row_step_study.py [--launches 16:256 8:128 ...] [--vocabs V ...] [--in-step]
        [--old SRC] [--stagger VOCAB:ROWS:NS ...]
        [--rows 512 1024] [--ignored 0.5]

``--stagger`` times a variant whose first ROWS rows (one wave of clusters) sleep row * NS
nanoseconds before they start, so that the blocks sharing an SM stop moving through their phases
together; later clusters take the freed slots and keep the offsets.
"""

import argparse
import importlib
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
import triton.testing

from cosdistill._row_step import RowStepScales, row_step_torch
from cosdistill.kernels import row_step_cuda
from cosdistill.kernels.row_step_triton import row_step_triton
from cosdistill.testing import rel_err

OLD_STEP = None  # --old
STAGGERS = {}  # --stagger: vocab -> (rows, ns)
SCALES = RowStepScales(weight_hard=0.3, weight_soft=0.7, beta=0.9, temperature=2.0, ignore_index=-100)


def inputs(rows, vocab, pad=0, label_dtype=torch.int64, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    student = torch.randn(rows, vocab + pad, device="cuda", generator=generator).mul_(3).bfloat16()[:, :vocab]
    teacher = torch.randn(rows, vocab + pad, device="cuda", generator=generator).mul_(3).bfloat16()[:, :vocab]
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    labels[torch.rand(rows, device="cuda", generator=generator) < 0.1] = SCALES.ignore_index
    return student, teacher, labels.to(label_dtype)


def launched_layout(vocab):
    return row_step_cuda._launch(vocab, torch.int64, torch.cuda.current_device())[1]


def fits(vocab, launch):
    """Whether the layout holds a vocab-sized row and compiles to a kernel that fits without spilling."""
    if launch is None:
        return True
    if not 0 <= row_step_cuda._shared_bytes(vocab, *launch) <= row_step_cuda.MAX_SHARED_BYTES:
        return False
    if row_step_cuda._kernel(vocab, torch.int64, torch.cuda.current_device(), launch) is None:
        print(f"vocab={vocab}: {launch} has no kernel (it spills, or no cluster fits)", flush=True)
        return False
    return True


def cuda_step(launch):
    """The kernel at launch, a row_step_cuda.Layout (None: _launch's), and the Triton RESCUE launch."""
    def step(student, teacher, labels, scales, losses, write_grad=True):
        row_step_cuda.cluster_kernel(student, teacher, labels, scales, losses, launch)
        row_step_triton(student, teacher, labels, scales, losses, True, rescue_only=True)
    return step


def staggered_step(vocab):
    """_launch's kernel with a sleep for the first wave, and the Triton RESCUE launch."""
    rows, ns = STAGGERS[vocab]
    layout = launched_layout(vocab)
    sleep = f"\n  if (row < {rows}) __nanosleep((unsigned)row * {ns}u);"
    source = row_step_cuda._SOURCE.replace("const int tid = threadIdx.x;", "const int tid = threadIdx.x;" + sleep, 1)
    with mock.patch.object(row_step_cuda, "_SOURCE", source):
        kernel = row_step_cuda._kernel.__wrapped__(vocab, torch.int64, torch.cuda.current_device(), layout)

    def step(student, teacher, labels, scales, losses, write_grad=True):
        row_step_cuda.launch(kernel, layout, student, teacher, labels, scales, losses)
        row_step_triton(student, teacher, labels, scales, losses, True, rescue_only=True)
    return step


def check(name, student, teacher, labels, launch):
    """The CUDA step at ``launch`` and Triton against the torch spec (fp32 math), losses poisoned first."""
    assert row_step_cuda.supported(student, teacher, labels, SCALES, True, None), name
    if not fits(student.shape[1], launch):
        return
    step = cuda_step(launch)
    want_grad, want_losses = student.clone(), torch.empty(len(student), 2, device="cuda")
    row_step_torch(want_grad, teacher, labels, SCALES, want_losses, True)
    results = {}
    for impl, impl_step in (("cuda", step), ("triton", row_step_triton)):
        grad, losses = student.clone(), torch.full((len(student), 2), float("nan"), device="cuda")
        impl_step(grad, teacher, labels, SCALES, losses, True)
        results[impl] = grad
        finite = want_losses.isfinite()
        same_nan = bool((losses.isnan() == want_losses.isnan()).all())
        print(f"{name} {impl}: loss rel err {rel_err(losses[finite], want_losses[finite]):.2e}, grad rel err "
              f"{rel_err(grad.float().nan_to_num(), want_grad.float().nan_to_num()):.2e}, NaN rows as spec {same_nan}",
              flush=True)
    print(f"{name}: cuda vs triton grad "
          f"{rel_err(results['cuda'].float().nan_to_num(), results['triton'].float().nan_to_num()):.2e}")


def correctness(launch):
    for rows, vocab, pad in ((1024, 128256, 0), (256, 262144, 0), (300, 32000, 0), (100, 1000, 8), (33, 8, 0),
                             (64, 151936, 0), (200, 98304, 0), (64, 200064, 0), (300, 49152, 8)):
        check(f"rows={rows} vocab={vocab} pad={pad}", *inputs(rows, vocab, pad), launch)
    student, teacher, labels = inputs(64, 128256, label_dtype=torch.int32, seed=1)
    check("int32 labels", student, teacher, labels, launch)
    student[3, :300] = 3e38  # overflows |s|^2 in fp32: the RESCUE launch redoes the row
    student[5, 7] = float("inf")  # NaN loss and gradient, as the spec
    labels[3] = 11
    check("overflow rows", student, teacher, labels, launch)


def timing(vocabs, configs):
    for vocab in vocabs:
        student, teacher, labels = inputs(1024, vocab)
        labels[labels == SCALES.ignore_index] = 5  # every row counts, as in a dense batch
        scratch, losses = student.clone(), torch.empty(1024, 2, device="cuda")

        def timed(fn):
            return triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median")

        copy_ms = timed(lambda: scratch.copy_(student))
        one_pass = student.numel() * 2
        print(f"vocab={vocab}: copy {copy_ms:.3f} ms ({2 * one_pass / copy_ms / 1e9:.2f} TB/s); launched "
              f"{launched_layout(vocab)} of {row_step_cuda.launch_configs(vocab)}", flush=True)
        ms = timed(lambda: (scratch.copy_(student), row_step_triton(scratch, teacher, labels, SCALES, losses, True))) - copy_ms
        print(f"vocab={vocab}: triton {ms:.3f} ms, {5 * one_pass / ms / 1e9:.2f} TB/s of its 5 passes", flush=True)
        if OLD_STEP:
            ms = timed(lambda: (scratch.copy_(student), OLD_STEP(scratch, teacher, labels, SCALES, losses, True))) - copy_ms
            print(f"vocab={vocab}: --old cuda step {ms:.3f} ms, {3 * one_pass / ms / 1e9:.2f} TB/s of its 3 passes")
        if vocab in STAGGERS:
            step = staggered_step(vocab)
            grad, plain_grad = student.clone(), student.clone()
            step(grad, teacher, labels, SCALES, losses)
            cuda_step(None)(plain_grad, teacher, labels, SCALES, losses)
            ms = timed(lambda: (scratch.copy_(student), step(scratch, teacher, labels, SCALES, losses))) - copy_ms
            print(f"vocab={vocab}: cuda step staggered {STAGGERS[vocab]} {ms:.3f} ms (grad as unstaggered: "
                  f"{bool(torch.equal(grad, plain_grad))})", flush=True)
        for launch in filter(lambda launch: fits(vocab, launch), configs):
            step = cuda_step(launch)
            ms = timed(lambda: (scratch.copy_(student), step(scratch, teacher, labels, SCALES, losses))) - copy_ms
            layout = launch or launched_layout(vocab)
            kernel = row_step_cuda._kernel(vocab, labels.dtype, torch.cuda.current_device(), layout)
            clusters = row_step_cuda.max_active_clusters(kernel, layout, row_step_cuda._shared_bytes(vocab, *layout))
            print(f"vocab={vocab}: cuda step {launch or 'launched'} {ms:.3f} ms, "
                  f"{3 * one_pass / ms / 1e9:.2f} TB/s of its 3 passes, {clusters} clusters at once, "
                  f"{row_step_cuda.kernel_attribute(kernel, row_step_cuda._NUM_REGS)} registers", flush=True)


def in_step_timing(vocabs, configs, rows=1024, ignored=0.0, hidden=4096, calls=60):
    """Each step timed by CUDA events right after a teacher-sized logits GEMM into its teacher buffer, as in
    the chunk loop: the GPU at the clocks and the L2 state the step meets there (the power cap)."""
    for vocab in vocabs:
        student, teacher, labels = inputs(rows, vocab)
        labels[labels == SCALES.ignore_index] = 5
        labels[:int(rows * ignored)] = SCALES.ignore_index  # a masked prompt, ignored rows first
        hidden_rows = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        scratch, losses = student.clone(), torch.empty(rows, 2, device="cuda")
        steps = [("triton", lambda: row_step_triton(scratch, teacher, labels, SCALES, losses, True))]
        if OLD_STEP:
            steps.append(("--old cuda", lambda: OLD_STEP(scratch, teacher, labels, SCALES, losses, True)))
        for launch in filter(lambda launch: fits(vocab, launch), configs):
            steps.append((f"cuda {launch or 'launched'}",
                          lambda step=cuda_step(launch): step(scratch, teacher, labels, SCALES, losses)))
        if vocab in STAGGERS:
            steps.append((f"cuda staggered {STAGGERS[vocab]}",
                          lambda step=staggered_step(vocab): step(scratch, teacher, labels, SCALES, losses)))
        times = {name: [] for name, _ in steps}
        for call in range(calls + 5):
            for name, step in steps:
                scratch.copy_(student)
                torch.mm(hidden_rows, weight.T, out=teacher)  # the teacher GEMM before the step, as in the loop
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                stop.record()
                torch.cuda.synchronize()
                if call >= 5:
                    times[name].append(start.elapsed_time(stop))
        for name, values in times.items():
            print(f"in step, vocab={vocab}, rows={rows}, ignored={ignored}: {name} {statistics.median(values):.3f} ms "
                  f"(median of {calls})", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", nargs="+",
                        help="CLUSTER:THREADS[:REGISTER_COLS] layouts timed beside the one _launch picks")
    parser.add_argument("--in-step", action="store_true", help="also time each step right after a logits GEMM")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[128256, 262144, 151936, 32000])
    parser.add_argument("--rows", type=int, nargs="+", default=[1024], help="rows per step timed in step")
    parser.add_argument("--ignored", type=float, default=0.0, help="fraction of ignored rows timed in step")
    parser.add_argument("--old", help="a src folder whose cosdistill.row_step_cuda is timed beside this one")
    parser.add_argument("--stagger", nargs="+", default=[], help="VOCAB:ROWS:NS variants to time")
    args = parser.parse_args()
    for text in args.stagger:
        vocab, rows, ns = map(int, text.split(":"))
        STAGGERS[vocab] = rows, ns
    if args.old:
        global OLD_STEP
        sys.path.insert(0, str(Path(__file__).parent))
        from ab_study import load_old
        load_old(args.old)
        OLD_STEP = importlib.import_module("cosdistill_old.row_step_cuda").row_step_cuda
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), flush=True)
    configs = [None] + [row_step_cuda.Layout(*map(int, text.split(":"))) for text in args.launches or []]
    for launch in configs:
        print(f"correctness, {launch or 'launched'}")
        correctness(launch)
    timing(args.vocabs, configs)
    if args.in_step:
        for rows in args.rows:
            in_step_timing(args.vocabs, configs, rows, args.ignored)


if __name__ == "__main__":
    main()
