"""The vocabulary split's per-call check: every rank raises unless the ranks run one split of one call, and where
one rank raises on its own the others raise too, so that none waits in a collective the others skip. Its first
half (``check_vocab_parallel``) gathers what the host knows, and whether the rank raised, before the first GEMM;
its second (``queue_hash_check``) hashes the hidden states and labels, with whether the rank's cached FP8 copy
was stale, behind the first chunk's GEMMs (``SplitCheckedFirst``) and is read where the call waits for its label
count (``HashesReadFirst``; docs/design.md, Distributed).
"""

import dataclasses
import math
import struct
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from ._backends import Backend, backend_for
from ._chunk_loop import ChunkRows
from ._device import HostCopy
from ._fingerprint import in_pairs
from ._labels import LabelCounts
from ._options import FLOAT_DTYPES, LOSSES, Options
from ._row_step import RowStepConstants


@runtime_checkable  # a call checks that its vocab_parallel has these members
class VocabParallel(Protocol):
    """Both LM heads split along the vocabulary over ranks: this rank holds the teacher's rows
    [start, stop) and the student's rows from start up to min(stop, vocab_student).
    ``cosdistill.distributed.VocabParallelOptions`` implements it with torch.distributed."""

    start: int
    stop: int
    vocab_student: int  # the student's whole vocabulary
    vocab_teacher: int | None  # the teacher's whole vocabulary, where known: the shards must cover it

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...  # [ranks, *tensor.shape]

    def all_reduce(self, tensor: torch.Tensor) -> None: ...  # sum, in place


class PlannedCall(Protocol):
    """What the first half reads of a call's plan (_plan.Plan)."""

    options: Options
    backend: Backend  # the JSD's split gathers statistics of its own (STATISTICS)
    rows: ChunkRows
    needs_grad: tuple[bool, bool, bool]  # input, weight, bias


def vocab_parallel_shard_error(vocab_parallel: VocabParallel, student_weight, teacher_weight) -> ValueError | None:
    """The error in this rank's shards against its split, if any (host only: no collective)."""
    start, stop, vocab_student = vocab_parallel.start, vocab_parallel.stop, vocab_parallel.vocab_student
    student_rows = max(0, min(stop, vocab_student) - start)
    if not 0 <= start < stop:
        return ValueError(f"vocab_parallel needs 0 <= start < stop, got start={start}, stop={stop}")
    if teacher_weight.shape[0] != stop - start or student_weight.shape[0] != student_rows:
        return ValueError(
            f"vocab_parallel rows [{start}, {stop}) with vocab_student={vocab_student} need a teacher_weight shard "
            f"of {stop - start} rows and a student_weight shard of {student_rows} rows, got "
            f"{tuple(teacher_weight.shape)} and {tuple(student_weight.shape)}"
        )
    return None


def gather_device(tensors) -> torch.device:
    """Where the check's first gather runs: the call's device, or, where this rank's tensors are not on one, a CUDA
    device among theirs (NCCL's collectives take no CPU tensor)."""
    devices = [tensor.device for tensor in tensors if torch.is_tensor(tensor)]
    return next((device for device in devices if device.type == "cuda"), devices[0] if devices else torch.device("cpu"))


def check_vocab_parallel(split: VocabParallel, plan: PlannedCall | None, num_tokens: int, dtype: torch.dtype,
                         device: torch.device, error: Exception | None, num_valid_tokens=None,
                         biases: tuple[bool, bool] = (False, False)) -> None:
    """One all-gather of what the host knows of the call, read at once, before its first GEMM: every rank raises
    unless the ranks' teacher rows tile [0, Vt) and they agree on the vocabularies, the options, which heads have
    a bias (``biases``: student, teacher), the teacher's precision, grad_weight's accumulator and all that sizes
    the collectives to come (tokens, rows per chunk, the soft term, dtype, gradients asked for), so that none
    waits in a collective the others skip. A rank that found an error of its own (``error``: its arguments, its
    shards, its stale FP8 copy; then ``plan`` may be None) raises it, the others name that rank. The hidden states
    and labels, which the host does not hold, follow (``queue_hash_check``), and so does a ``num_valid_tokens``
    given as a tensor; one given as a number is compared here."""
    if error is not None:
        values = [split.start, split.stop, 1] + [0] * (len(RANK_COLUMNS) - 3)
    else:
        options = plan.options
        values = [split.start, split.stop, 0, split.vocab_student,
                  -1 if split.vocab_teacher is None else split.vocab_teacher, num_tokens, plan.rows.student,
                  LOSSES.index(options.loss), _statistics_of(plan), FLOAT_DTYPES.index(dtype),
                  sum(bit << i for i, bit in enumerate(plan.needs_grad)), _normaliser_bits(num_valid_tokens),
                  sum(bit << i for i, bit in enumerate(biases)), TEACHER_SIDES.index(plan.teacher),
                  FLOAT_DTYPES.index(plan.accum_dtype),
                  *(bits_of_float(-1.0 if value is None else float(value))
                    for value in dataclasses.astuple(options.constants))]
    ranks = split.all_gather(torch.tensor(values, dtype=torch.int64, device=device)).tolist()
    if error is not None:
        raise error
    _check_ranks_agree([dict(zip(RANK_COLUMNS, rank)) for rank in ranks], split.vocab_teacher)


RANK_COLUMNS = ("start", "stop", "raised", "vocab_student", "vocab_teacher", "the number of tokens",
                "rows per chunk", "the soft term", "the JSD's statistics", "student dtype",
                "gradients asked for (input, weight, bias bits)", "num_valid_tokens",
                "biases (student, teacher bits)", "the teacher's precision", "accum_dtype",
                *(f"option {field.name}" for field in dataclasses.fields(RowStepConstants)))
HASHED = ("student_input", "teacher_input", "true_labels")  # two lanes each
# the lanes, then a num_valid_tokens tensor's value (its float64 bits; 0 where not a tensor), then whether this
# call found the rank's cached FP8 copy stale
HASH_COLUMNS = 2 * len(HASHED) + 2
NORMALISER_COUNTED, NORMALISER_TENSOR = -1.0, -2.0  # the first gather's num_valid_tokens: None, a tensor


# What the JSD's split gathers per row: the torch spec's float64 statistics, or the Triton stages' fp32 ones (the
# CUDA backend's split runs those too); ranks that differ gather tensors of other shapes. The cosine loss's
# split gathers the same from every backend.
STATISTICS = ("any (the cosine term)", "torch spec", "Triton stages")
TEACHER_SIDES = ("logits", "fp8")  # Plan.teacher (a split has no Gram path)


def _statistics_of(plan: PlannedCall) -> int:
    if plan.options.loss != "jsd":
        return 0
    return 1 if plan.backend.name == "torch" else 2


def _normaliser_bits(num_valid_tokens) -> int:
    """num_valid_tokens as the first gather compares it: a number's float64 bits, or which kind it is."""
    if num_valid_tokens is None:
        return bits_of_float(NORMALISER_COUNTED)
    return bits_of_float(NORMALISER_TENSOR if torch.is_tensor(num_valid_tokens) else float(num_valid_tokens))


class CachedCopy(Protocol):
    """A teacher side's cached copy of its weight, whose content check stays on the device (_teacher_fp8.Fp8TeacherHead
    with ``compare_later``)."""

    poison: torch.Tensor | None  # 0-d: NaN where this call found the copy stale; None: nothing was compared

    def raise_if_stale(self) -> None: ...  # StaleWeightError where it was (the comparison read on the host)


def queue_hash_check(split: VocabParallel, student_input, teacher_input, labels,
                     cached_copy: CachedCopy | None = None, num_valid_tokens=None) -> Callable[[], None]:
    """Queues the hashes of the hidden states and labels (_fingerprint.py), a ``num_valid_tokens`` tensor's value,
    whether the rank's cached teacher copy was stale, and their all-gather, copied to the host without waiting;
    returns the check that reads them (``HashesReadFirst``): every rank raises unless all ranks saw the same and
    every copy was fresh. Any mismatch it finds has gone through collectives of the same sizes on every rank
    (``check_vocab_parallel``), so it can wait that long."""
    # the Triton kernel on a GPU whatever the call's impl: the torch spec's float64 products would cost more there
    fingerprint = backend_for("triton" if labels.is_cuda else "torch", labels.device).fingerprint
    poison = None if cached_copy is None else cached_copy.poison
    stale = torch.zeros(1, dtype=torch.int64, device=labels.device) if poison is None else poison.isnan().view(1)
    normaliser = (num_valid_tokens.detach().to(device=labels.device, dtype=torch.float64).reshape(1).view(torch.int64)
                  if torch.is_tensor(num_valid_tokens) else torch.zeros(1, dtype=torch.int64, device=labels.device))
    # labels as int64: any integer dtype hashes (a 1-byte one has no 16-bit words), and equal labels alike
    hashed = (_laid_out_in_pairs(student_input), _laid_out_in_pairs(teacher_input), labels.reshape(-1, 1).to(torch.int64))
    hashes = torch.cat([fingerprint(tensor).to(torch.int64) for tensor in hashed] + [normaliser, stale.long()])
    gathered = HostCopy(split.all_gather(hashes))

    def check() -> None:
        lanes = gathered.get().tolist()
        stale_ranks = [rank for rank, row in enumerate(lanes) if row[-1]]
        if stale_ranks:
            if poison is not None:
                cached_copy.raise_if_stale()
            raise ValueError(f"vocab_parallel: this call found the cached FP8 teacher copy of rank(s) {stale_ranks} "
                             "stale (see their StaleWeightError)")
        for index, name in enumerate(HASHED):
            if len({tuple(rank[2 * index : 2 * index + 2]) for rank in lanes}) > 1:
                raise ValueError(f"vocab_parallel ranks must see the same {name}: its contents differ between ranks")
        normalisers = [float_of_bits(rank[-2]) for rank in lanes]
        # NaN on every rank is one value (data_parallel_num_valid_tokens' refusal), which the label count names
        if len(set(normalisers)) > 1 and not all(math.isnan(normaliser) for normaliser in normalisers):
            raise ValueError(f"vocab_parallel ranks must agree on num_valid_tokens, got {normalisers} (rank by rank)")

    return check


def _laid_out_in_pairs(hidden: torch.Tensor) -> torch.Tensor:
    """The hidden states laid out so that their 16-bit elements hash in pairs (``as_words``): equal values held in
    another layout on another rank (a transposed view, an odd offset) hash alike. A copy only where they are not."""
    if hidden.element_size() != 2 or hidden.shape[1] % 2 or in_pairs(hidden):
        return hidden
    return hidden.clone(memory_format=torch.contiguous_format)


def _check_ranks_agree(ranks: list[dict], vocab_teacher: int | None) -> None:
    """Raise unless the gathered rows (RANK_COLUMNS) describe one split of one call."""
    raised = [rank for rank, row in enumerate(ranks) if row["raised"]]
    if raised:
        raise ValueError(f"vocab_parallel: rank(s) {raised} raised an error of their own on this call's arguments, "
                         "shards or cached teacher copy (see theirs)")
    for name in RANK_COLUMNS[3:]:
        values = [row[name] for row in ranks]
        if len(set(values)) > 1:
            shown = ([float_of_bits(value) for value in values] if name.startswith("option") else
                     [_shown_normaliser(value) for value in values] if name == "num_valid_tokens" else
                     [LOSSES[value] for value in values] if name == "the soft term" else
                     [STATISTICS[value] for value in values] if name == "the JSD's statistics" else
                     [TEACHER_SIDES[value] for value in values] if name == "the teacher's precision" else
                     [str(FLOAT_DTYPES[value]) for value in values] if name in ("student dtype", "accum_dtype") else
                     values)
            raise ValueError(f"vocab_parallel ranks must agree on {name}, got {shown} (rank by rank)")
    shards = sorted((row["start"], row["stop"]) for row in ranks)
    tiled = shards[0][0] == 0 and all(left[1] == right[0] for left, right in zip(shards, shards[1:]))
    if not tiled or (vocab_teacher is not None and shards[-1][1] != vocab_teacher):
        covers = "[0, Vt)" if vocab_teacher is None else f"[0, {vocab_teacher})"
        raise ValueError(f"vocab_parallel shards must tile {covers} without gaps or overlaps, got rows {shards}")
    if vocab_teacher is None and shards[-1][1] > ranks[0]["vocab_student"]:
        raise ValueError(f"vocab_parallel shards cover [0, {shards[-1][1]}), past vocab_student="
                         f"{ranks[0]['vocab_student']}: a teacher vocabulary larger than the student's needs "
                         "VocabParallelOptions' vocab_teacher, without which no rank can tell a left-out tail")
    if ranks[0]["vocab_student"] > shards[-1][1]:
        raise ValueError(f"vocab_parallel vocab_student={ranks[0]['vocab_student']} exceeds the teacher's vocabulary "
                         f"{shards[-1][1]}, which the shards cover")


def _shown_normaliser(bits: int):
    value = float_of_bits(bits)
    return "counted" if value == NORMALISER_COUNTED else "a tensor" if value == NORMALISER_TENSOR else value


def bits_of_float(value: float) -> int:
    """The int64 with this float64's bits: options compared exactly."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def float_of_bits(bits: int) -> float:
    """The float64 whose bits are this int64."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class SplitCheckedFirst:
    """A vocabulary split that queues ``queue_check`` (queue_hash_check) just before its call's first collective,
    once the first chunk's GEMMs are queued, and runs the check it returns at ``finish``: the GPU computes while the
    host hashes and gathers (docs/design.md, Distributed)."""

    def __init__(self, split: VocabParallel, queue_check: Callable[[], Callable[[], None]]):
        self.split, self.queue_check, self.check = split, queue_check, None

    def _queue_check_once(self) -> None:
        if self.queue_check is not None:
            self.check, self.queue_check = self.queue_check(), None

    def finish(self) -> None:
        self._queue_check_once()
        check, self.check = self.check, None
        if check is not None:
            check()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._queue_check_once()
        return self.split.all_gather(tensor)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._queue_check_once()
        self.split.all_reduce(tensor)


@dataclasses.dataclass(frozen=True)
class HashesReadFirst:
    """A split call's normaliser (_chunk_loop.Normaliser), whose ``wait`` finishes the split's check before it reads
    the label count: the host waits there anyway (after the first chunk with gradients, at the end without), and
    ranks whose labels differ all raise that, where a rank with a label past the vocabulary would raise alone and
    leave the others in the next collective."""

    counts: LabelCounts
    split: SplitCheckedFirst

    def launch(self) -> None:
        self.counts.launch()

    def mean_losses(self, token_losses: torch.Tensor, poison: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        return self.counts.mean_losses(token_losses, poison)

    def wait(self) -> float:
        self.split.finish()
        return self.counts.wait()
