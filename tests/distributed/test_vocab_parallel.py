"""Vocabulary-parallel heads on gloo (CPU), 2 and 3 ranks: the loss and gradients of the unsplit heads, for the
cosine loss and the generalized JSD, and with each rank's teacher rows quantized once (Fp8TeacherWeight); every
rank raising where the ranks' set-ups or calls differ, or one rank raises on its own.

With COSDISTILL_DISTRIBUTED_BACKEND=nccl (and TRITON_INTERPRET=0) the tests that every rank raises run over NCCL,
a GPU per rank, the FP8 GEMMs for real (benchmarks/two_gpus.sh)."""

import dataclasses
import datetime
import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import make_problem, rel_err
from cosdistill import StaleWeightError, StudentMetrics, api, fused_linear_cosine_distill, quantize_teacher_weight
from cosdistill.distributed import VocabParallelOptions
from cosdistill.testing import FUSED_LOSSES, fingerprint_torch, plan, split_check, teacher_fp8, weight_cache

# (vocab_student, vocab_teacher, dtype): neither divisible by 2 or 3; with 3 ranks the last holds no
# student rows; fp16 takes the lifted gradient path (grad_input summed in fp32 before its rows are lifted)
CASES = {"equal vocabularies": (101, 101, torch.float32), "larger teacher vocabulary": (30, 50, torch.float32),
         "fp16": (101, 101, torch.float16)}
TOLERANCES = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 2e-3)}  # losses, gradients
IMPLS = ("torch", "triton")  # triton through the interpreter (conftest sets TRITON_INTERPRET=1)
OPTIONS = dict(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=0.8, temperature=1.5, chunk_size=8,
               return_soft_hard_loss=True)
GRAD_OUTPUT = 0.5
JSD_BETAS = (0.0, 0.8, 1.0)  # forward KL, the generalized JSD, reverse KL: three forms of the gradient
BACKEND = os.environ.get("COSDISTILL_DISTRIBUTED_BACKEND", "gloo")


def join_group(rank, world_size, folder, backend="gloo", timeout_s=60) -> torch.device:
    """This rank's process group and the device its tensors go to: a GPU per rank over NCCL, else the CPU, where
    the FP8 GEMMs run through torch's reference."""
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    teacher_fp8.check_supported = lambda *args: None
    return torch.device("cpu")


def write_rank_result(folder, name, rank, value) -> None:
    """What a spawned rank found, for the test to read once the ranks have exited (``rank_results``)."""
    with open(os.path.join(folder, f"{name}-{rank}.json"), "w") as file:
        json.dump(value, file)


def rank_results(folder, name, world_size) -> list:
    return [json.loads((Path(folder) / f"{name}-{rank}.json").read_text()) for rank in range(world_size)]


def on_backends_gpus():
    """Skips where BACKEND is NCCL and this host has fewer than two GPUs."""
    if BACKEND == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("COSDISTILL_DISTRIBUTED_BACKEND=nccl needs two CUDA GPUs")


def problem_on(device, **sizes):
    """make_problem's tensors (the same on every rank: seed 0), on ``device``."""
    torch.manual_seed(0)
    problem = make_problem(**sizes)
    return dataclasses.replace(problem, **{name: None if value is None else value.to(device)
                                           for name, value in vars(problem).items()})


def losses_and_grads(problem, student_weight, student_bias, teacher_weight, teacher_bias, loss="cosine", **kwargs):
    student_input = problem.student_input.detach().clone().requires_grad_()
    leaves = [student_input, student_weight.detach().clone().requires_grad_(),
              student_bias.detach().clone().requires_grad_()]
    loss, soft, hard = FUSED_LOSSES[loss](
        leaves[0], leaves[1], problem.teacher_input, teacher_weight, problem.labels, leaves[2], teacher_bias,
        **(OPTIONS | kwargs))
    (loss * GRAD_OUTPUT).backward()
    return [loss.detach(), soft, hard], [leaf.grad for leaf in leaves]


def measure_rank(rank, world_size, folder):
    """Each rank compares its sharded run with the unsplit loss on the same inputs; writes errors-<rank>.json."""
    join_group(rank, world_size, folder, timeout_s=120)
    try:
        errors = {}
        for case, (vocab_student, vocab_teacher, dtype) in CASES.items():
            torch.manual_seed(0)  # the same problem on every rank
            problem = make_problem(tokens=24, vocab_student=vocab_student, vocab_teacher=vocab_teacher,
                                   ignore_every=5, batch=3, dtype=dtype)
            problem.labels.view(-1)[1], problem.labels.view(-1)[2] = 0, vocab_student - 1
            whole = (problem.student_weight, problem.student_bias, problem.teacher_weight, problem.teacher_bias)
            options = VocabParallelOptions.even_split(vocab_teacher, vocab_student)
            shards = (options.student_rows(problem.student_weight), options.student_rows(problem.student_bias),
                      options.teacher_rows(problem.teacher_weight), options.teacher_rows(problem.teacher_bias))
            runs = {impl: dict(impl=impl) for impl in IMPLS} | {
                f"jsd beta={beta:g}, {impl}": dict(loss="jsd", beta=beta, impl=impl) for beta in JSD_BETAS for impl in IMPLS}
            for run, kwargs in runs.items():
                want_losses, want_grads = losses_and_grads(problem, *whole, **(kwargs | dict(impl="torch")))
                got_losses, got_grads = losses_and_grads(problem, *shards, **kwargs, vocab_parallel=options)
                want_grads[1:] = [options.student_rows(grad) for grad in want_grads[1:]]
                errors[f"{case}, {run}"] = {
                    "losses": [rel_err(got, want) for got, want in zip(got_losses, want_losses)],
                    "grads": [rel_err(got, want) for got, want in zip(got_grads, want_grads)],
                    "student rows": options.student_rows(problem.student_weight).shape[0],
                    "dtype": str(dtype),
                }
            if dtype == torch.float32:  # each rank's teacher rows quantized once by the caller: the FP8 teacher's numbers
                for loss in ("cosine", "jsd"):
                    want_losses, want_grads = losses_and_grads(problem, *whole, loss=loss, impl="torch",
                                                               teacher_precision="fp8")
                    got_losses, got_grads = losses_and_grads(
                        problem, shards[0], shards[1], quantize_teacher_weight(shards[2]), shards[3], loss=loss,
                        vocab_parallel=options)
                    want_grads[1:] = [options.student_rows(grad) for grad in want_grads[1:]]
                    errors[f"{case}, {loss}, Fp8TeacherWeight"] = {
                        "losses": [rel_err(got, want) for got, want in zip(got_losses, want_losses)],
                        "grads": [rel_err(got, want) for got, want in zip(got_grads, want_grads)],
                        "dtype": str(dtype),
                    }
        write_rank_result(folder, "errors", rank, errors)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world_size: f"{world_size} ranks")
def errors_per_rank(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    mp.spawn(measure_rank, args=(request.param, str(folder)), nprocs=request.param)
    return rank_results(folder, "errors", request.param)


def test_every_rank_gets_the_unsplit_loss_and_its_shard_of_the_gradients(errors_per_rank):
    for rank, errors in enumerate(errors_per_rank):
        for case, error in errors.items():
            loss_tol, grad_tol = TOLERANCES[getattr(torch, error["dtype"].removeprefix("torch."))]
            assert max(error["losses"]) < loss_tol, f"rank {rank}, {case}: {error}"
            assert max(error["grads"]) < grad_tol, f"rank {rank}, {case}: {error}"


def test_a_rank_may_hold_no_student_rows(errors_per_rank):
    rows = [errors["larger teacher vocabulary, torch"]["student rows"] for errors in errors_per_rank]
    assert sum(rows) == CASES["larger teacher vocabulary"][0]
    if len(errors_per_rank) == 3:
        assert rows[-1] == 0


class FakeSplit:
    """The VocabParallel protocol on one process without a process group, for the argument checks."""

    def __init__(self, start, stop, vocab_student, vocab_teacher=None):
        self.start, self.stop, self.vocab_student, self.vocab_teacher = start, stop, vocab_student, vocab_teacher

    def all_gather(self, tensor):
        return tensor[None]

    def all_reduce(self, tensor):
        pass


# Each a wrong set-up of two ranks: its VocabParallelOptions per rank (start, stop, vocab_student[, group,
# vocab_teacher]) and what rank 1 changes in its call; every rank must raise the error, none may hang.
SPLIT = [(0, 16, 23, None, 31), (16, 31, 23, None, 31)]  # a right split, of the problems' 31 teacher rows
WRONG_SETUPS = {
    "overlapping shards": ([(0, 20, 23), (10, 31, 23)], {}, r"must tile \[0, Vt\) without gaps or overlaps"),
    "a gap between shards": ([(0, 10, 23), (15, 31, 23)], {}, "without gaps or overlaps"),
    "both ranks hold every row": ([(0, 31, 23), (0, 31, 23)], {}, "without gaps or overlaps"),
    "the tail left out": ([(0, 12, 23, None, 31), (12, 25, 23, None, 31)], {}, r"must tile \[0, 31\)"),
    # without vocab_teacher the ranks cannot know that the teacher's rows 25..30 are left out
    "a teacher vocabulary past the student's, not named": ([(0, 12, 23), (12, 25, 23)], {},
                                                           r"cover \[0, 25\), past vocab_student=23: .*vocab_teacher"),
    "vocab_student past the teacher's rows": ([(0, 16, 23), (16, 20, 23)], {},
                                              "vocab_student=23 exceeds the teacher's vocabulary 20"),
    "ranks disagree on vocab_student": ([(0, 16, 23), (16, 31, 22)], {}, r"agree on vocab_student, got \[23, 22\]"),
    "other labels on one rank": (SPLIT, {"labels": "changed"}, "same true_labels"),
    "other teacher hidden states on one rank": (SPLIT, {"teacher_input": 1}, "same teacher_input"),
    "another temperature on one rank": (SPLIT, {"temperature": 2.0},
                                        r"agree on option temperature, got \[1.5, 2.0\]"),
    "fewer tokens on one rank": (SPLIT, {"tokens": 19}, "agree on the number of tokens"),
    "a wrong shard on one rank": (SPLIT, {"teacher_rows": 14},
                                  r"need a teacher_weight shard|rank\(s\) \[1\]"),
    # each of these sizes or skips a collective on one rank only: a hang, not a wrong loss, before the check
    "no gradients on one rank": (SPLIT, {"grad": False},
                                 r"agree on gradients asked for \(input, weight, bias bits\), got \[3, 0\]"),
    "another dtype on one rank": (SPLIT, {"dtype": torch.bfloat16},
                                  r"agree on student dtype, got \['torch.float32', 'torch.bfloat16'\]"),
    "another soft term on one rank": (SPLIT, {"losses": "reversed"},
                                      r"agree on the soft term, got \['cosine', 'jsd'\]"),
    # the JSD's statistics are float64 in the torch spec and fp32 in Triton's: a crash in the gather
    "another implementation on one rank": (SPLIT, {"impl": "not auto's"},
                                           r"agree on the JSD's statistics, got \['(torch spec|Triton stages)', "
                                           r"'(torch spec|Triton stages)'\]"),
    # a wrong loss on every rank: that rank's shard of the logits quantized, or with a bias the others leave out
    "the FP8 teacher on one rank": (SPLIT, {"teacher_precision": "fp8"},
                                    r"agree on the teacher's precision, got \['logits', 'fp8'\]"),
    "a student bias on one rank only": (SPLIT, {"bias": "student"},
                                        r"agree on biases \(student, teacher bits\), got \[0, 1\]"),
    "a teacher bias on one rank only": (SPLIT, {"bias": "teacher"},
                                        r"agree on biases \(student, teacher bits\), got \[0, 2\]"),
    "another grad_weight accumulator on one rank": (SPLIT, {"accum_dtype": torch.float32},
                                                    r"agree on accum_dtype, got \['torch.bfloat16', 'torch.float32'\]"),
    # that rank alone would raise at its label count, after the first statistics' collectives
    "a label past the vocabulary on one rank": (SPLIT, {"labels": "past the vocabulary"},
                                                "same true_labels"),
    # that rank alone would raise in its argument checks, before the first gather
    "labels of another shape on one rank": (SPLIT, {"labels": "one fewer"},
                                            r"true_labels shape \(19,\) does not match|rank\(s\) \[1\] raised"),
    "float labels on one rank": (SPLIT, {"labels": "float"},
                                 r"true_labels must be an integer tensor|rank\(s\) \[1\] raised"),
    "an invalid temperature on one rank": (SPLIT, {"temperature": -1.0},
                                           r"temperature must be > 0, got -1.0|rank\(s\) \[1\] raised"),
    "tensors on two devices on one rank": (SPLIT, {"labels": "on the meta device"},
                                           r"all tensors must be on one device|rank\(s\) \[1\] raised"),
    "the student's metrics asked for on one rank": (SPLIT, {"student_metrics": True},
                                                    r"student_metrics cannot be taken over a vocabulary split|"
                                                    r"rank\(s\) \[1\] raised"),
    # a normaliser per rank (rank 0's, rank 1's): each rank divided by its own, or one raised alone at its count
    "another num_valid_tokens on one rank": (SPLIT, {"num_valid_tokens": (10.0, 20.0)},
                                             r"agree on num_valid_tokens, got \[10.0, 20.0\]"),
    "a num_valid_tokens tensor on one rank only": (SPLIT, {"num_valid_tokens": (10.0, "10")},
                                                   r"agree on num_valid_tokens, got \[10.0, 'a tensor'\]"),
    "another num_valid_tokens tensor on one rank": (SPLIT, {"num_valid_tokens": ("10", "20")},
                                                    r"agree on num_valid_tokens, got \[10.0, 20.0\]"),
    "a zero num_valid_tokens tensor on one rank": (SPLIT, {"num_valid_tokens": ("10", "0")},
                                                   r"agree on num_valid_tokens, got \[10.0, 0.0\]"),
    # shared by the ranks, as data_parallel_num_valid_tokens hands it to all where one rank's labels were refused
    "a NaN num_valid_tokens tensor on every rank": (SPLIT, {"num_valid_tokens": ("nan", "nan")},
                                                    r"num_valid_tokens must be finite, got nan \(data_parallel"),
}


def run_wrong_setups(rank, folder):
    """Each rank runs every WRONG_SETUPS case and writes the error it raised (or "no error") to raised-<rank>.json."""
    device = join_group(rank, 2, folder, BACKEND)
    try:
        raised = {}
        for case, (splits, change, _) in WRONG_SETUPS.items():
            problem = problem_on(device, tokens=20, vocab_student=23, vocab_teacher=31)
            split = VocabParallelOptions(*splits[rank])
            teacher_input, labels = problem.teacher_input, problem.labels
            student_input, teacher_rows = problem.student_input, split.stop - split.start
            if rank == 1 and "labels" in change:
                labels = {"one fewer": labels[:-1], "float": labels.float(), "on the meta device": labels.to("meta")}.get(
                    change["labels"], labels.clone())
                if change["labels"] in ("past the vocabulary", "changed"):
                    labels[3] = 23 if change["labels"] == "past the vocabulary" else (labels[3] + 1) % 23
            if rank == 1 and "teacher_input" in change:
                teacher_input = teacher_input + 1e-3
            if rank == 1 and "tokens" in change:
                student_input, teacher_input, labels = (t[: change["tokens"]] for t in (student_input, teacher_input, labels))
            if rank == 1 and "teacher_rows" in change:
                teacher_rows = change["teacher_rows"]
            student_rows = max(0, min(split.stop, split.vocab_student) - split.start)
            temperature = change.get("temperature", 1.5) if rank == 1 else 1.5
            student_weight = problem.student_weight[split.start : split.start + student_rows]
            teacher_weight = problem.teacher_weight[split.start : split.start + teacher_rows]
            if (rank == 1 and "dtype" in change) or "accum_dtype" in change:  # bf16 weights have two accumulators
                student_input, student_weight, teacher_input, teacher_weight = (
                    t.to(change.get("dtype", torch.bfloat16)) for t in (student_input, student_weight, teacher_input,
                                                                        teacher_weight))
            options = {"teacher_precision": change.get("teacher_precision"),
                       "accum_dtype": change.get("accum_dtype")} if rank == 1 else {}
            biases = {"student_bias": None, "teacher_bias": None}
            if rank == 1 and "bias" in change:  # a frozen one: the gradients asked for stay the same
                biases[f"{change['bias']}_bias"] = torch.randn(len((student_weight, teacher_weight)[
                    change["bias"] == "teacher"]), device=device, dtype=student_weight.dtype)
            losses = list(FUSED_LOSSES.values())
            if rank == 1 and "losses" in change:
                losses.reverse()
            num_valid_tokens = change.get("num_valid_tokens", (None, None))[rank]
            if isinstance(num_valid_tokens, str):  # a tensor's
                num_valid_tokens = torch.tensor(float(num_valid_tokens), device=device)
            try:
                with torch.set_grad_enabled(change.get("grad", True) or rank == 0):
                    for loss in losses:
                        if rank == 1 and "student_metrics" in change:
                            options["student_metrics"] = StudentMetrics()
                        loss(student_input, student_weight, teacher_input, teacher_weight, labels, **biases,
                             temperature=temperature, vocab_parallel=split, num_valid_tokens=num_valid_tokens, **options,
                             impl=("torch" if device.type == "cuda" else "triton") if rank == 1 and "impl" in change
                             else "auto")
                raised[case] = "no error"
            except (TypeError, ValueError) as error:
                raised[case] = str(error)
        write_rank_result(folder, "raised", rank, raised)
    finally:
        dist.destroy_process_group()


def test_every_rank_refuses_a_split_or_call_the_ranks_do_not_share(tmp_path):
    """Shards that overlap, leave gaps or miss the teacher's tail, a student vocabulary past them, and ranks that see
    other labels, hidden states, options or token counts: each gave a wrong loss (the same on every rank) or a
    collective mismatch. Now every rank raises, from one all-gather before the loss."""
    on_backends_gpus()
    mp.spawn(run_wrong_setups, args=(str(tmp_path),), nprocs=2)
    for rank, raised in enumerate(rank_results(tmp_path, "raised", 2)):
        for case, (_, _, message) in WRONG_SETUPS.items():
            assert re.search(message, raised[case]), f"rank {rank}, {case}: {raised[case]}"


def run_stale_copy(rank, folder):
    """Both ranks call the JSD with cached FP8 copies of their teacher rows four times; between the first and second
    call rank 1 writes its rows through ``.data`` (which moves no version counter). Writes what each call gave."""
    device = join_group(rank, 2, folder, BACKEND)
    try:
        problem = problem_on(device, tokens=20, vocab_student=23, vocab_teacher=31)
        split = VocabParallelOptions.even_split(31, 23)
        student_weight, teacher_weight = split.student_rows(problem.student_weight), split.teacher_rows(problem.teacher_weight)
        calls = []
        for call in range(4):
            if call == 1 and rank == 1:
                teacher_weight.data[2] += 0.5
            try:
                loss = FUSED_LOSSES["jsd"](problem.student_input, student_weight, problem.teacher_input, teacher_weight,
                                           problem.labels, teacher_precision="fp8", vocab_parallel=split)
                quantized = FUSED_LOSSES["jsd"](problem.student_input, student_weight, problem.teacher_input,
                                                quantize_teacher_weight(teacher_weight), problem.labels,
                                                vocab_parallel=split)
                calls.append(["loss", loss.item(), quantized.item()])
            except ValueError as error:
                calls.append([type(error).__name__, str(error)])
        write_rank_result(folder, "calls", rank, calls)
    finally:
        dist.destroy_process_group()


def test_a_stale_cached_copy_on_one_rank_raises_on_every_rank_in_that_call(tmp_path):
    """A rank whose cached FP8 copy a call finds stale raised alone (on the CPU at once, on a GPU at its next call,
    its loss NaN before) and left the other rank waiting in a collective, or returning a loss built on the stale
    rows. Now the stale flag rides on the split's hash check: every rank raises in that call, and the next call
    rebuilds the copy and gives the numbers of a head quantized afresh."""
    on_backends_gpus()
    mp.spawn(run_stale_copy, args=(str(tmp_path),), nprocs=2)
    calls = rank_results(tmp_path, "calls", 2)
    for rank in range(2):
        first, stale, rebuilt, reused = calls[rank]
        assert first[0] == rebuilt[0] == reused[0] == "loss", calls[rank]
        assert first[1] == first[2] and rebuilt[1] == rebuilt[2] == reused[1], calls[rank]
        assert rebuilt[1] != first[1]  # rank 1's rows changed
    assert calls[1][1][0] == "StaleWeightError" and "this call found that copy stale" in calls[1][1][1], calls[1][1]
    assert calls[0][1][0] == "ValueError" and re.search(r"FP8 teacher copy of rank\(s\) \[1\] stale", calls[0][1][1])
    assert [call[1] for call in calls[0][2:]] == [call[1] for call in calls[1][2:]]  # one loss on both ranks


def run_layouts_and_a_foreign_group(rank, folder):
    """Rank 1 passes bf16 hidden states equal to rank 0's in other layouts (column-major; rows at an odd offset);
    then each rank builds a split over a group that holds rank 0 alone. Writes the losses and errors."""
    device = join_group(rank, 2, folder, BACKEND)
    try:
        problem = problem_on(device, tokens=20, vocab_student=23, vocab_teacher=31, dtype=torch.bfloat16)
        split = VocabParallelOptions.even_split(31, 23)
        student_input, teacher_input = problem.student_input, problem.teacher_input
        if rank == 1:
            teacher_input = teacher_input.t().contiguous().t()
            student_input = torch.cat([student_input.new_zeros(1), student_input.view(-1)])[1:].view_as(student_input)
            assert torch.equal(teacher_input, problem.teacher_input) and student_input.data_ptr() % 4 == 2
        loss = FUSED_LOSSES["jsd"](student_input, split.student_rows(problem.student_weight), teacher_input,
                                   split.teacher_rows(problem.teacher_weight), problem.labels, vocab_parallel=split)
        outcome = {"loss": loss.item(), "unsplit": FUSED_LOSSES["jsd"](*problem.args()[:5]).item()}
        alone = dist.new_group([0])
        for name, build in {"even_split": lambda: VocabParallelOptions.even_split(31, 23, alone),
                            "constructed": lambda: VocabParallelOptions(0, 31, 23, alone, 31)}.items():
            try:
                build()
                outcome[name] = "no error"
            except ValueError as error:
                outcome[name] = str(error)
        write_rank_result(folder, "outcome", rank, outcome)
    finally:
        dist.destroy_process_group()


def test_equal_hidden_states_in_other_layouts_pass_and_a_group_without_the_rank_is_named(tmp_path):
    """The split's hash read bf16 hidden states two elements to a word where their layout allows, one otherwise, so
    equal values in another layout on one rank raised "contents differ"; a split over a group that does not hold
    the rank raised a negative-dimension RuntimeError on it while the other rank waited."""
    on_backends_gpus()
    mp.spawn(run_layouts_and_a_foreign_group, args=(str(tmp_path),), nprocs=2)
    outcomes = rank_results(tmp_path, "outcome", 2)
    assert outcomes[0]["loss"] == outcomes[1]["loss"]
    assert rel_err(torch.tensor(outcomes[0]["loss"]), torch.tensor(outcomes[0]["unsplit"])) < 1e-2
    assert outcomes[0]["even_split"] == outcomes[0]["constructed"] == "no error"
    for name in ("even_split", "constructed"):
        assert "this rank (global rank 1) is not in the group it was given" in outcomes[1][name], outcomes[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_split_hashes_equal_16_bit_hidden_states_alike_in_any_layout(dtype):
    """The fingerprint reads 16-bit elements two to a word where the layout allows, one otherwise: the split's hash
    takes the hidden states through a copy where they are not read in pairs. One token cut from a wider row (a
    [1, H] view with an odd row stride, contiguous as torch counts it) was read one to a word."""
    torch.manual_seed(0)
    values = torch.randn(5, 16).to(dtype)
    wide = torch.cat([values.new_zeros(5, 3), values], 1)
    flat = torch.cat([values.new_zeros(1), values.view(-1)])
    layouts = {"contiguous": values, "column-major": values.t().contiguous().t(), "odd offset": flat[1:].view(5, 16),
               "odd row stride": wide[:, 3:]}
    want = fingerprint_torch(values)
    for name, layout in layouts.items():
        assert torch.equal(layout, values)
        assert torch.equal(fingerprint_torch(split_check._laid_out_in_pairs(layout)), want), name
        for row in range(len(values)):
            one_token = split_check._laid_out_in_pairs(layout[row : row + 1])
            assert torch.equal(fingerprint_torch(one_token), fingerprint_torch(values[row : row + 1].clone())), name


@pytest.mark.parametrize("loss", FUSED_LOSSES)
def test_one_byte_labels_hash_under_a_split(loss):
    """The split's check hashes the labels as int64: int8 labels (which the checks accept, -100 included) have no
    16-bit words to hash as they are, and raised inside the first chunk's collective."""
    problem = make_problem(tokens=19, vocab_student=23, ignore_every=4)
    problem.labels = problem.labels.to(torch.int8)
    want = FUSED_LOSSES[loss](*problem.args()[:5])
    got = FUSED_LOSSES[loss](*problem.args()[:5], vocab_parallel=FakeSplit(0, 23, 23))
    assert rel_err(got, want) < 1e-6


def test_labels_whose_dtype_cannot_hold_the_whole_vocabulary_raise_under_a_split():
    """A shard holds fewer rows than the vocabulary the labels index: the label dtype's check took the shard's (100)
    for the whole vocabulary (200), and int8 labels went on to an error naming valid labels as out of range."""
    problem = make_problem(tokens=19, vocab_student=200)
    args = list(problem.args()[:5])
    args[1], args[3] = args[1][:100], args[3][:100]
    args[4] = args[4].clamp(max=127).to(torch.int8)
    with pytest.raises(TypeError, match="true_labels of dtype torch.int8 cannot hold the student's vocabulary size 200"):
        fused_linear_cosine_distill(*args, vocab_parallel=FakeSplit(0, 100, 200))


def test_shards_that_do_not_match_the_split_are_refused():
    problem = make_problem(vocab_student=20, vocab_teacher=20)
    with pytest.raises(ValueError, match=r"need a teacher_weight shard of 10 rows and a student_weight shard of 10 rows"):
        fused_linear_cosine_distill(*problem.args()[:5], vocab_parallel=FakeSplit(0, 10, 20))
    with pytest.raises(ValueError, match="vocab_parallel needs 0 <= start < stop, got start=5, stop=5"):
        fused_linear_cosine_distill(*problem.args()[:5], vocab_parallel=FakeSplit(5, 5, 20))


def test_even_split_needs_a_process_group_and_sensible_sizes():
    with pytest.raises(ValueError, match="even_split needs 0 < vocab_student <= vocab_teacher, got vocab_student=11, "
                                         "vocab_teacher=10"):
        VocabParallelOptions.even_split(10, 11)


def test_a_split_checks_its_own_rows_and_the_heads_it_slices():
    with pytest.raises(ValueError, match="VocabParallelOptions needs 0 <= start < stop, got start=5, stop=5"):
        VocabParallelOptions(5, 5, 20)
    with pytest.raises(ValueError, match="vocab_student=50, vocab_teacher=41"):
        VocabParallelOptions(0, 20, 50, None, 41)
    with pytest.raises(ValueError, match="vocab_teacher=41, stop=45"):
        VocabParallelOptions(20, 45, 30, None, 41)
    split = VocabParallelOptions(10, 20, 15, None, 41)
    assert split.teacher_rows(torch.zeros(41, 3)).shape == (10, 3) and split.student_rows(torch.zeros(15)).shape == (5,)
    with pytest.raises(ValueError, match=r"teacher_rows needs the full teacher head \(41 rows\), got \(40, 3\)"):
        split.teacher_rows(torch.zeros(40, 3))
    with pytest.raises(ValueError, match=r"student_rows needs the full student head, 15 rows, got \(16,\)"):
        split.student_rows(torch.zeros(16))
    # No vocab_teacher: the teacher's vocabulary is the student's (a larger head's last rows were silently left out)
    split = VocabParallelOptions(0, 5, 10)
    assert split.teacher_rows(torch.zeros(10, 3)).shape == (5, 3)
    with pytest.raises(ValueError, match=r"teacher_rows needs the full teacher head \(10 rows\), got \(14, 3\): a "
                                         "teacher vocabulary larger than the student's needs vocab_teacher"):
        split.teacher_rows(torch.zeros(14, 3))


class RecordingSplit(FakeSplit):
    """A one-rank split that records its collectives, in order: ("gather", shape) or ("reduce", shape)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.collectives, self.gathered = [], []

    def all_gather(self, tensor):
        self.collectives.append(("gather", tuple(tensor.shape)))
        self.gathered.append(tensor.clone())
        return super().all_gather(tensor)

    def all_reduce(self, tensor):
        self.collectives.append(("reduce", tuple(tensor.shape)))


@pytest.mark.parametrize("loss", FUSED_LOSSES)
@pytest.mark.parametrize("impl", IMPLS)
def test_the_checks_gathers_come_first_and_the_hashes_behind_the_first_gemm(loss, impl, monkeypatch):
    """Every call gathers what the host knows before any GPU work, then the hashes of its hidden states and labels
    once the first chunk's student GEMM is queued (the GPU computes while the host hashes) and before the call's
    next collective: at the first chunk's statistics, at grad_input's sum on a rank without tokens, or after a call
    with neither (_split_check.SplitCheckedFirst). Every rank runs the same sequence, so the collectives pair up."""
    layout, hashes = ("gather", (len(split_check.RANK_COLUMNS),)), ("gather", (split_check.HASH_COLUMNS,))
    start_student_logits = plan.start_student_logits
    for tokens, grad in ((19, True), (19, False), (0, True), (0, False)):
        problem = make_problem(tokens=tokens, vocab_student=23)
        split = RecordingSplit(0, 23, 23)
        monkeypatch.setattr(plan, "start_student_logits",
                            lambda *args: split.collectives.append("student GEMM") or start_student_logits(*args))
        with torch.set_grad_enabled(grad):
            FUSED_LOSSES[loss](*problem.args(), chunk_size=8, impl=impl, vocab_parallel=split)
        assert split.collectives[:3] == [layout, "student GEMM", hashes], (tokens, grad, split.collectives)
        assert split.collectives.count(layout) == split.collectives.count(hashes) == 1, split.collectives
        summed = [("reduce", (tokens, 16))] if grad else []  # grad_input, over the ranks
        if tokens:  # the statistics, then grad_input
            assert split.collectives[3][0] == "gather" and split.collectives[len(split.collectives) - len(summed):] == summed
        else:
            assert split.collectives[3:] == summed, split.collectives


@pytest.mark.parametrize("loss", FUSED_LOSSES)
def test_a_modules_tensor_option_gone_bad_is_told_in_the_first_gather(loss):
    """A module's option held in a tensor is checked at every call; where an in-place update made it invalid, the
    rank raises through the split's first gather (which tells the other ranks), not before it (they would wait)."""
    module_class = api.FusedLinearJSDLoss if loss == "jsd" else api.FusedLinearCosineDistillLoss
    temperature = torch.tensor(1.5)
    module = module_class(temperature=temperature)
    problem = make_problem(tokens=19, vocab_student=23)
    module(*problem.args()[:5], vocab_parallel=FakeSplit(0, 23, 23))
    temperature.fill_(-1.0)
    split = RecordingSplit(0, 23, 23)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        module(*problem.args()[:5], vocab_parallel=split)
    assert split.collectives == [("gather", (len(split_check.RANK_COLUMNS),))]
    assert split.gathered[0][split_check.RANK_COLUMNS.index("raised")] == 1


def test_a_stale_copy_that_an_unsplit_call_left_unread_is_told_in_the_first_gather(monkeypatch):
    """On a GPU an unsplit call that finds the cached FP8 copy stale returns NaN and leaves the comparison for the next
    call to read. A split call that comes next reads it before its first gather and tells the other ranks there
    (its "raised" column), rather than raising alone after it, when the others are already in the next collective."""
    monkeypatch.setattr(teacher_fp8, "check_supported", lambda *args: None)
    monkeypatch.setattr(weight_cache, "compared_on_host", lambda weight: False)  # the GPU's path, on the CPU
    problem = make_problem(tokens=19, vocab_student=23)
    args = problem.args()
    FUSED_LOSSES["jsd"](*args, teacher_precision="fp8")  # builds the copy
    args[3].data[4] += 1.0
    assert FUSED_LOSSES["jsd"](*args, teacher_precision="fp8").isnan()  # stale: NaN, its comparison left unread
    split = RecordingSplit(0, 23, 23)
    with pytest.raises(StaleWeightError, match="previous call with it"):
        FUSED_LOSSES["jsd"](*args, teacher_precision="fp8", vocab_parallel=split)
    assert split.collectives == [("gather", (len(split_check.RANK_COLUMNS),))]
    assert split.gathered[0][split_check.RANK_COLUMNS.index("raised")] == 1
