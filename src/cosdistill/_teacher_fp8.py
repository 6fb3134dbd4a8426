"""The teacher's logits GEMM in FP8 (e4m3) with row-wise scales: opt in with teacher_precision="fp8", or
pass a head quantized once by the caller (``quantize_teacher_weight``) as the teacher weight.

With teacher_precision="fp8" the teacher weight is quantized once, one scale per vocabulary row, and the
result is kept across calls while the weight is unchanged (_weight_cache.py), its contents checked at
every reuse; a head the caller quantized is the caller's, so nothing is cached or checked. Each chunk's
teacher activations are quantized per token. ``torch._scaled_mm`` then computes
    logits[i, v] = (x_q[i] . w_q[v]) * scale_x[i] * scale_w[v]
on the FP8 tensor cores of Hopper-class GPUs, with fast accumulation (``FAST_ACCUMULATION``). Shapes
that the FP8 GEMM cannot take (a vocabulary or hidden size not divisible by 16) are zero-padded; the
row step reads only the first ``vocab`` logit columns, never the padded rows' (the JSD's softmax would
count them).
"""

from dataclasses import dataclass

import torch

from ._weight_cache import WeightCache

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
GEMM_MULTIPLE = 16  # _scaled_mm needs M, K and N divisible by 16
# The tensor cores' partial sums are not promoted to fp32 every few K steps: the GEMM runs faster and the
# soft loss and gradients on real-looking data moved no more than e4m3 rounding already moves them
# (docs/design.md, The FP8 teacher).
FAST_ACCUMULATION = True
WEIGHT_ROWS_PER_STEP = 8192  # quantize the weight in slices: bounded temporary memory


def check_supported(device: torch.device, asked_by: str = "teacher_precision='fp8'") -> None:
    """Raise ValueError saying why FP8 cannot run here; ``asked_by`` names what asked for it."""
    if device.type != "cuda":
        raise ValueError(f"{asked_by} needs a CUDA GPU with FP8 tensor cores; the tensors are on {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(
            f"{asked_by} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or newer); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def quantize_rows(rows: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """out[i] = rows[i] / scales[i] in FP8, scales[i] = max |rows[i]| / FP8_MAX (fp32, never 0).

    Two passes over the rows (the max norm, then the division in fp32 stored as FP8): no fp32 copy."""
    amax = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    torch.div(amax, FP8_MAX, out=scales)
    scales.clamp_(min=torch.finfo(torch.float32).tiny)
    torch.div(rows, scales, out=out)  # |rows / scale| <= FP8_MAX, so the cast never saturates


def fp8_rounded(rows: torch.Tensor) -> torch.Tensor:
    """fp32 rows as the FP8 GEMM sees them: each rounded to e4m3 under its own scale (for checks)."""
    out = torch.empty(rows.shape, dtype=FP8, device=rows.device)
    scales = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
    quantize_rows(rows.detach(), out, scales)
    return out.float() * scales


def _quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight [round16(V), round16(H)], fp32 row scales [1, round16(V)])."""
    vocab, hidden = weight.shape
    weight_fp8 = torch.zeros(_round_up(vocab, GEMM_MULTIPLE), _round_up(hidden, GEMM_MULTIPLE), dtype=FP8, device=weight.device)
    scales = torch.ones(weight_fp8.shape[0], 1, dtype=torch.float32, device=weight.device)
    for start in range(0, vocab, WEIGHT_ROWS_PER_STEP):
        stop = min(start + WEIGHT_ROWS_PER_STEP, vocab)
        quantize_rows(weight[start:stop].detach(), weight_fp8[start:stop, :hidden], scales[start:stop])
    return weight_fp8, scales.view(1, -1)  # _scaled_mm's row-wise scale_b is [1, N]


quantized_weights = WeightCache("FP8 copy", _quantize_weight)


@dataclass(frozen=True, eq=False, repr=False)
class Fp8TeacherWeight:
    """A teacher LM head quantized once, by ``quantize_teacher_weight``. Passed as ``teacher_weight``, the
    teacher's logits GEMM runs in FP8 from it, as with teacher_precision="fp8" and the same numbers, but
    nothing is cached, so no call reads the bf16 weight to check a copy (which can then be freed). It is a
    frozen teacher's form: if the weight changes, quantize it again. For the checks it reads as the
    head's weight would: ``shape`` (V, H), ``dtype`` (the head's, which teacher_input and the teacher
    logits take), ``device``."""

    codes: torch.Tensor  # [round16(V), round16(H)] e4m3, zero past (V, H)
    scales: torch.Tensor  # [1, round16(V)] fp32, _scaled_mm's row-wise scale_b
    shape: torch.Size
    dtype: torch.dtype
    requires_grad = False  # a frozen teacher's: no gradient reaches it

    def __post_init__(self):
        """Made by hand, its parts must be what quantize_teacher_weight makes."""
        if len(self.shape) != 2 or self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"Fp8TeacherWeight needs a 2-D shape and a bfloat16, float16 or float32 dtype, got shape "
                            f"{tuple(self.shape)} and dtype {self.dtype}")
        padded = tuple(_round_up(size, GEMM_MULTIPLE) for size in self.shape)
        if self.codes.dtype != FP8 or tuple(self.codes.shape) != padded:
            raise ValueError(f"Fp8TeacherWeight codes must be {FP8} of shape {padded} for shape {tuple(self.shape)}, "
                             f"got {self.codes.dtype} {tuple(self.codes.shape)}")
        if (self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (1, padded[0])
                or self.scales.device != self.codes.device):
            raise ValueError(f"Fp8TeacherWeight scales must be float32 of shape (1, {padded[0]}) on {self.codes.device}, "
                             f"got {self.scales.dtype} {tuple(self.scales.shape)} on {self.scales.device}")

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dim(self) -> int:
        return len(self.shape)

    def to(self, device) -> "Fp8TeacherWeight":
        """The same head on ``device`` (quantize where the weight is, then move the half-size codes)."""
        if isinstance(device, torch.dtype):
            raise TypeError(f"Fp8TeacherWeight.to takes a device, got the dtype {device}: its dtype is the head's, "
                            f"{self.dtype}; quantize the head in the dtype wanted instead")
        return Fp8TeacherWeight(self.codes.to(device), self.scales.to(device), self.shape, self.dtype)

    def __repr__(self):
        return f"Fp8TeacherWeight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def dequantized(self) -> torch.Tensor:
        """The fp32 [V, H] weight that the FP8 GEMM sees (for references and checks)."""
        vocab, hidden = self.shape
        return self.codes[:vocab, :hidden].float() * self.scales[0, :vocab, None]


def quantize_teacher_weight(weight: torch.Tensor) -> Fp8TeacherWeight:
    """The teacher head ``weight`` [V, H] in FP8 e4m3 with one scale per vocabulary row, as
    teacher_precision="fp8" quantizes it, to pass as ``teacher_weight`` (a vocabulary split: each rank its own
    rows). On any device; the loss then needs a GPU with FP8 tensor cores."""
    if not torch.is_tensor(weight) or weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float16,
                                                                                 torch.float32):
        shown = f"shape {tuple(weight.shape)} and dtype {weight.dtype}" if torch.is_tensor(weight) else type(weight).__name__
        raise TypeError(f"weight must be a 2-D bfloat16, float16 or float32 tensor [vocab, hidden], got {shown}")
    with torch.no_grad():
        codes, scales = _quantize_weight(weight)
    return Fp8TeacherWeight(codes, scales, torch.Size(weight.shape), weight.dtype)


class Fp8TeacherHead:
    """Teacher logits through the FP8 GEMM (a _teacher_logits.LogitsHead)."""

    def __init__(self, weight: torch.Tensor | Fp8TeacherWeight, bias: torch.Tensor | None, max_rows: int, backend,
                 hash_later: bool = False, compare_later: bool = False, keep: bool = True):
        """weight: the head's, quantized and cached here, or the caller's Fp8TeacherWeight. max_rows: the most
        rows a chunk has (``start_chunk``). backend: whose quantize_rows and hash (_backends.Backend).
        hash_later: the cached copy's content check left to the caller (``later``, _weight_cache.LaterCheck),
        which takes its hash with the row step. compare_later: its comparison kept on the device on the CPU too,
        read by ``raise_if_stale`` (a vocabulary split first shares every rank's ``poison``). keep: whether the
        copy is cached (_weight_cache.kept_across_calls), else quantized for this call alone."""
        self.quantize = backend.quantize_rows
        self.weight = weight
        if isinstance(weight, Fp8TeacherWeight):  # the caller's: nothing cached, nothing to check
            self.weight_fp8, self.weight_scales, self.poison, self.later = weight.codes, weight.scales, None, None
        else:
            cached = quantized_weights.get(weight, backend, hash_later, compare_later, keep)
            (self.weight_fp8, self.weight_scales), self.poison, self.later = cached.value, cached.poison, cached.later
        self.bias, self.logits_dtype = None if bias is None else bias.detach(), weight.dtype
        self.hidden = weight.shape[1]
        self.vocab = weight.shape[0]  # the logits the row step reads
        # The GEMM's output columns: the padded rows' logits are zeros, which the row step must not read (the JSD's
        # softmax would count them).
        self.buffer_columns = self.weight_fp8.shape[0]
        # A sub-chunk's GEMM reads its rows rounded up to GEMM_MULTIPLE from its start: at most this many.
        self.code_rows = max(1, max_rows) + GEMM_MULTIPLE - 1
        self.hidden_fp8 = self.hidden_scales = None  # allocated by the first chunk, after its student GEMM

    def raise_if_stale(self) -> None:
        """StaleWeightError where this call found the cached copy stale (its comparison, left on the device)."""
        if not isinstance(self.weight, Fp8TeacherWeight):
            quantized_weights.raise_if_stale(self.weight, "this call")

    def buffer_rows(self, rows: int) -> int:
        return _round_up(rows, GEMM_MULTIPLE)

    def start_chunk(self, hidden: torch.Tensor) -> None:
        """Quantize the chunk's teacher rows, all at once (one launch, not one per sub-chunk)."""
        if self.hidden_fp8 is None:
            # Unwritten rows only ever reach logits rows the row step never reads; padded columns must be
            # zero (garbage codes, NaN among them, times the weight's zero columns could give NaN).
            self.hidden_fp8 = torch.empty(self.code_rows, self.weight_fp8.shape[1], dtype=FP8, device=hidden.device)
            self.hidden_fp8[:, self.hidden :].zero_()
            self.hidden_scales = torch.empty(self.code_rows, 1, dtype=torch.float32, device=hidden.device)
        rows = hidden.shape[0]
        self.quantize(hidden, self.hidden_fp8[:rows, : self.hidden], self.hidden_scales[:rows])

    def logits_into(self, out: torch.Tensor, start: int, stop: int) -> None:
        """out[:n] = the chunk's rows start..stop @ weight.T (+ bias), n = stop - start; out has
        buffer_rows(n) rows."""
        padded = self.buffer_rows(stop - start)
        # Rows past stop hold the next sub-chunk's codes, or whatever an earlier, longer chunk left: their
        # logits land in buffer rows the row step never reads.
        rows = slice(start, start + padded)
        torch._scaled_mm(
            self.hidden_fp8[rows], self.weight_fp8.t(), scale_a=self.hidden_scales[rows], scale_b=self.weight_scales,
            out_dtype=self.logits_dtype, out=out[:padded], use_fast_accum=FAST_ACCUMULATION,
        )
        if self.bias is not None:
            out[: stop - start, : self.bias.shape[0]] += self.bias
