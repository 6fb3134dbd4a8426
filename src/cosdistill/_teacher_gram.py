"""The soft term without teacher logits: through the heads' Gram matrices (``cosine_via="gram"``).

Without biases or softcaps, the teacher's logits enter the loss only linearly. With s = h_s W_s^T and
t = h_t W_t^T (W_t cut to the student's Vs rows where only those meet s):

    s . t     = h_s . (h_t W_t^T W_s)                     the cross Gram matrix  C = W_t[:Vs]^T W_s  [Ht, Hs]
    |t|^2     = h_t . (h_t W_t^T W_t)                     the teacher's Gram matrix  G = W_t^T W_t  [Ht, Ht]

and the soft term's gradient is c_i * t_i per row (_row_step.teacher_grad_coefficient), whose share of
the gradient GEMMs is

    grad_input_i  += c_i * (h_t,i C)                      (h_t C: the same product as s . t's)
    grad_weight   += W_t[:Vs] @ A,   A = sum_i c_i h_t,i^T h_s,i   [Ht, Hs]

So a step costs, instead of the teacher's logits GEMM (2 T Vt Ht FLOPs) and its logits' bytes: C
(2 Vs Ht Hs, every call: W_s changes every step), W_t A (as much again, with grad_weight), G (cached
while the teacher weight is unchanged, like the FP8 weight) and per-token products of size H^2. That
wins once T passes about 2 Hs (``gram_is_cheaper``), and the logits it never forms are also never
rounded to bf16: s . t and |t|^2 come out in fp32 from the exact products.

The row step then reads and writes only the student logits (the row step with teacher_logits None).
bf16 products with an fp32 Gram matrix are taken as two bf16 GEMMs, hi + lo parts of the matrix,
each into fp32: the matrix's rounding stays at ~2^-16 instead of bf16's 2^-9.

Range: the Gram matrices and the products above are plain fp32 sums, which overflow for logits past
~1e19 where the logits path (whose row step rescales such rows) still gives the answer. So each call
bounds them from the largest entries of the hidden states and Gram matrices (``RANGE_LIMIT``, read on
the host with N, after the first chunk is queued): past it, "auto" runs the call again on the logits
path and "gram" raises. No LM head comes near it. Nor does the one-model cluster kernel's own limit (a student
logit past 16384 in size, kernels/row_step_cuda.py), where a row gets NaN losses and gradient.

The teacher's Gram matrix is kept across calls while the teacher weight is unchanged (_weight_cache.py).
"""

import torch

from ._device import HostCopy, addmm_into
from ._row_step import RowStepConstants, teacher_grad_coefficient, with_teacher_products
from ._weight_cache import WeightCache, kept_across_calls

# The largest bound on the Gram path's fp32 products (s.t and |t|^2, after the logit scales) times 1/T^2 for which it
# runs: far below fp32's 3.4e38, far above any LM head's. The temperature cancels from the cosine but in its clamp,
# where a token whose logits are near zero has coefficients ~1/(eps T)^2, past fp32's range at tiny T: the factor
# keeps such calls off this path, a margin now that such a coefficient meeting t = 0 is taken as 0 (docs/design.md).
RANGE_LIMIT = 2.0**80


def _mm_fp32(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left @ right in fp32, from operands of one dtype (cuBLAS reads bf16 and writes fp32 directly). Never under
    autocast, which would run fp32 products in bf16 (and cache W_t^T W_t so)."""
    with torch.autocast(left.device.type, enabled=False):
        if left.is_cuda and left.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(left, right, out_dtype=torch.float32)
        return left.float() @ right.float()


def _split(matrix: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """An fp32 matrix as parts in the operands' dtype whose sum is it to ~2^-16 (one part for fp32)."""
    if dtype == torch.float32:
        return (matrix,)
    high = matrix.to(dtype)
    return high, (matrix - high.float()).to(dtype)


def _times(rows: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """rows @ (sum of parts), in fp32."""
    product = _mm_fp32(rows, parts[0])
    for part in parts[1:]:
        product += _mm_fp32(rows, part)
    return product


def _build_teacher_gram(teacher_weight: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(W_t^T W_t in parts (``_split``), its largest entry)."""
    weight = teacher_weight.detach()
    matrix = _mm_fp32(weight.t(), weight)
    return _split(matrix, weight.dtype), matrix.abs().amax()


def _fp32_matmul_precision(teacher_weight: torch.Tensor) -> tuple[str, str] | None:
    """For an fp32 head, the fp32 precision of cuBLAS's and oneDNN's matmuls ("tf32" or "bf16" round the head in its
    Gram matrix): a matrix built under one setting is not what a call under another builds (a change of the other
    device's setting rebuilds it too). Not the legacy ``allow_tf32``, which raises where a program set both it and
    this."""
    if teacher_weight.dtype != torch.float32:
        return None
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision


teacher_grams = WeightCache("Gram matrix W_t^T W_t", _build_teacher_gram, built_under=_fp32_matmul_precision)


# The Gram path must cost at most this share of the teacher GEMM's FLOPs: near parity its gain is within the
# runs' spread (docs/design.md, The Gram path).
GRAM_MARGIN = 0.9


def gram_is_cheaper(num_tokens: int, vocab_student: int, vocab_teacher: int, hidden_student: int,
                    hidden_teacher: int, write_grad_weight: bool, teacher_gram_cached: bool = True) -> bool:
    """Whether the Gram path's GEMM FLOPs are below GRAM_MARGIN times those of the teacher's logits GEMM
    it replaces (the teacher's Gram matrix counted only where it will not be reused from the cache; the
    row step's saved teacher bytes not counted)."""
    fixed = 2 * vocab_student * hidden_teacher * hidden_student * (2 if write_grad_weight else 1)
    if not teacher_gram_cached:
        fixed += 2 * vocab_teacher * hidden_teacher * hidden_teacher
    per_token = 4 * hidden_teacher * (hidden_student + hidden_teacher) + 2 * hidden_teacher * hidden_student
    return fixed + num_tokens * per_token < GRAM_MARGIN * 2 * num_tokens * vocab_teacher * hidden_teacher


class GramOutOfRange(Exception):
    """This call's inputs could overflow the Gram path's fp32 products (``GramTeacher.check_range``): the
    caller runs it on the logits path instead, or raises."""


class GramTeacher:
    """_chunk_loop.TeacherSide through the Gram matrices: per chunk, the row step without teacher logits and
    the soft term's share of grad_input; after the loop, its share of grad_weight."""

    adds_grad_input_share = True

    def __init__(self, teacher_weight: torch.Tensor, student_weight: torch.Tensor, backend, constants: RowStepConstants,
                 write_grad_weight: bool):
        self.full_teacher_weight, self.student_weight = teacher_weight, student_weight
        self.teacher_weight = teacher_weight.detach()[: student_weight.shape[0]]
        self.backend, self.impl, self.constants = backend, backend.cosine_row_step, constants
        self.write_grad_weight = write_grad_weight
        self.cross_rows = None  # the last chunk's h_t C [n, Hs] and coefficients c [n]
        self.coefficients = None
        self.in_range = None

    def start(self, student_input: torch.Tensor, teacher_input: torch.Tensor) -> None:
        """The Gram matrices (the teacher's from the cache), A's buffer, and the range bound, queued once the
        first student GEMM is."""
        cached = teacher_grams.get(self.full_teacher_weight, self.backend,
                                   keep=kept_across_calls(self.full_teacher_weight, self.student_weight))
        (self.teacher_gram, self.teacher_gram_max), self.poison = cached.value, cached.poison
        with torch.no_grad():
            cross_gram = _mm_fp32(self.teacher_weight.t(), self.student_weight.detach())
            self.cross_gram, self.cross_gram_max = _split(cross_gram, self.student_weight.dtype), cross_gram.abs().amax()
        self.outer = None  # A [Ht, Hs] in fp32, summed over chunks
        if self.write_grad_weight:
            self.outer = torch.zeros(self.teacher_weight.shape[1], self.student_weight.shape[1], dtype=torch.float32,
                                     device=self.student_weight.device)
        self._bound_range(student_input, teacher_input)

    def _bound_range(self, student_input: torch.Tensor, teacher_input: torch.Tensor) -> None:
        """Queue the bound on this call's products (s.t and |t|^2 after the logit scales, times 1/T^2) and its copy
        to the host, for ``check_range``. |x_i . y_i| <= H max|x| max|y| for each product taken."""
        constants = self.constants
        hidden_teacher, hidden_student = self.cross_gram[0].shape
        if student_input.numel() == 0 or teacher_input.numel() == 0:  # no products to bound
            return
        with torch.no_grad():
            teacher_max, student_max = (torch.linalg.vector_norm(hidden, float("inf"), dtype=torch.float32)
                                        for hidden in (teacher_input, student_input))  # max |x|, no |x| copy
            dot = (hidden_teacher * hidden_student * abs(constants.student_logit_scale * constants.teacher_logit_scale)
                   * teacher_max * self.cross_gram_max * student_max)
            square = hidden_teacher * hidden_teacher * constants.teacher_logit_scale**2 * teacher_max**2 * self.teacher_gram_max
            bound = torch.maximum(dot, square) * max(1.0, constants.temperature**-2)
            self.in_range = HostCopy(bound < RANGE_LIMIT)  # False for inf and NaN too

    def check_range(self) -> None:
        """Raise GramOutOfRange where the bound passed RANGE_LIMIT (waits for its copy to the host)."""
        if self.in_range is not None and not self.in_range.get().item():
            raise GramOutOfRange

    def row_step(self, student_logits, student_hidden, teacher_hidden, labels, token_losses, write_grad, grad_lifts=None):
        """The row step of one chunk: the statistics of the student logits, completed with s . t and
        |t|^2, then the losses and (write_grad) the gradient without its teacher term, in place. No fp16 lifts:
        the Gram path declines fp16 heads (``_gram_blockers``)."""
        if grad_lifts is not None:
            raise ValueError("the Gram path's row step takes no grad_lifts (fp16 heads take the logits path)")
        constants = self.constants
        self.cross_rows = _times(teacher_hidden, self.cross_gram)
        dot = (self.cross_rows * student_hidden).sum(1)
        sum_sq_teacher = (_times(teacher_hidden, self.teacher_gram) * teacher_hidden).sum(1)
        if write_grad and self.impl.gram_step is not None:  # one kernel (row_step_cuda), where it applies
            products, coefficients = torch.stack((dot, sum_sq_teacher), 1), torch.empty_like(dot)
            if self.impl.gram_step(student_logits, labels, constants, token_losses, products, coefficients):
                self.coefficients = coefficients
                return
        stats = self.impl.stats(student_logits, None, labels, constants)
        with_teacher_products(stats, dot, sum_sq_teacher, constants)
        self.impl.grad(student_logits, None, labels, stats, constants, token_losses, write_grad)
        self.coefficients = teacher_grad_coefficient(stats, labels, student_logits.shape[1], constants)

    def grad_input_share_into(self, grad_input_rows: torch.Tensor, inv_normaliser: float) -> bool:
        """grad_input_rows = c_i * h_t,i C / N for the current chunk (the GEMM of d L / d s adds the rest)."""
        grad_input_rows.copy_(self.cross_rows.mul_((self.coefficients * inv_normaliser)[:, None]))
        return True

    def accumulate(self, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor) -> None:
        """A += sum over the current chunk's rows of c_i h_t,i^T h_s,i (with grad_weight)."""
        if self.outer is not None:
            scaled = (teacher_hidden.float() * self.coefficients[:, None]).to(teacher_hidden.dtype)
            addmm_into(self.outer, scaled.t(), student_hidden, alpha=1.0, beta=1.0)

    def grad_weight_share_into(self, grad_weight: torch.Tensor, alpha: float, beta: float) -> bool:
        """grad_weight = beta * grad_weight + alpha * W_t[:Vs] @ A."""
        addmm_into(grad_weight, self.teacher_weight, self.outer.to(self.teacher_weight.dtype), alpha=alpha, beta=beta)
        return True
