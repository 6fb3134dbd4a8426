"""The cosine loss's fused row step in plain torch: the executable spec of the loss and of its gradient
(_row_step_jsd.py is the generalized JSD's), and what every row step shares (``RowStepConstants``, ``RowStepImpl``).

For one chunk of tokens it takes the student logits s [n, Vs] and the teacher logits t [n, Vt]
(Vt >= Vs; s is treated as zero-padded to Vt; t is None on the Gram path, _teacher_gram.py, which supplies
s.t and |t|^2 through ``with_teacher_products`` and the gradient's t term itself), and

* with a logit scale (Cohere style), multiplies s by a_s and t by a_t; then, with softcapping
  (Gemma-2 style), replaces s by c_s * tanh(s / c_s) and t by c_t * tanh(t / c_t); both before
  anything below (the gradient then carries the factors a_s and 1 - tanh^2);
* writes each token's unnormalised hard and soft loss into ``token_losses`` [n, 2]:
      hard_i = logsumexp(s_i) - s_i[label_i]
      soft_i = beta * (1 - cos(s_i / T, t_i / T))
  with cos(a, b) = a.b / (max(|a|, eps) * max(|b|, eps)), eps = 1e-8, as in
  torch.nn.functional.cosine_similarity; ignored tokens get 0;
* if ``write_grad``, overwrites s in place with d L / d s, where L is the chunk's unnormalised loss
      L = weight_hard * sum_i hard_i + weight_soft * sum_i soft_i.
  The chunk loop applies 1 / N in the gradient GEMMs, so N need not be known here.
* if also given ``grad_lifts`` [n] (the chunk loop does for fp16 logits), writes each row's gradient
  times a power of two 2^k and stores 2^k there (lift_for): k in [1, MAX_LIFT_EXPONENT] brings a
  bound on the row's largest entry up towards (1/2, 1], since fp16's subnormals start at 6e-5 and
  the soft term's entries, of order weight_soft * beta / (|s| * sqrt(V)), fall below that at LLM
  vocabularies; k < 0 brings a bound above 2^14 down into (2^13, 2^14] (a student row of norm
  ~0 has entries ~1/eps = 1e8, past fp16's 65504). The chunk loop divides it out again
  (_fp16_lift.Unlift).

It does so in two stages, so that a vocabulary split over ranks (cosdistill.distributed) can add up
the per-row statistics of its shards in between:

1. ``row_stats_torch``: per row, the ROW_STATS below over this shard's columns;
2. ``row_grad_torch``: from the (combined) statistics, the losses and, if asked, the gradient.

The sums of squares and s.t are kept relative to per-row scales (max |s|, max |t|), so logits near
the dtype's largest value do not overflow |s|^2 in fp32; the Triton twin uses scale 1 and rescales
only the rows whose sums overflowed or fell below 2^-100 (tiny logits, whose squares fp32 loses).

Labels outside [0, Vs) that are not ignore_index are treated as ignored here (the API raises on them).
``kernels/row_step_triton.py`` and ``kernels/row_step_cuda.py`` are the same step in Triton and CUDA; tests hold
them equal to this one.
"""

from dataclasses import dataclass
from typing import Callable

import torch

COSINE_EPS = 1e-8
# At most 2^10: the chunk loop moves 1 / 2^k onto the row's hidden state for grad_weight, and that
# must not push typical hidden entries (order 1) into fp16's subnormals (below 6e-5) in turn.
MAX_LIFT_EXPONENT = 10
MAX_STORED_EXPONENT = 14  # rows whose bound passes 2^14 are scaled down below it

# Per-row statistics, in this order along the last dimension of a [n, NUM_STATS] fp32 tensor.
ROW_STATS = (
    "student_max",  # max of s over the shard's columns (-inf when the shard has none)
    "sum_exp",  # sum of exp(s - student_max)
    "target_logit",  # s[label] if the label falls in this shard, else 0
    "dot",  # sum of (s / student_scale) * (t / teacher_scale) over the shared columns
    "sum_sq_student",  # sum of (s / student_scale)^2
    "sum_sq_teacher",  # sum of (t / teacher_scale)^2
    "student_scale",
    "teacher_scale",
)
NUM_STATS = len(ROW_STATS)
MAX, SUM_EXP, TARGET, DOT, SUM_SQ_S, SUM_SQ_T, SCALE_S, SCALE_T = range(NUM_STATS)


@dataclass(frozen=True)
class RowStepConstants:
    """Per-call constants of the row step."""

    weight_hard: float
    weight_soft: float
    beta: float
    temperature: float
    ignore_index: int
    student_softcap: float | None = None  # logits -> c * tanh(logits / c)
    teacher_softcap: float | None = None
    student_logit_scale: float = 1.0  # logits -> a * logits, before the softcap
    teacher_logit_scale: float = 1.0
    vocab_start: int = 0  # global id of the shard's first column (vocabulary parallel)
    vocab_student_total: int | None = None  # labels must be below it; None: the shard's own Vs

    @property
    def norm_clamp(self) -> float:
        """The cosine's clamp of |s| and |t| on the unscaled logits: T cancels from the cosine but here."""
        return COSINE_EPS * self.temperature


@dataclass(frozen=True)
class RowStepImpl:
    """One implementation of the row step: whole (one process) and over a vocabulary split, in the cosine's two
    stages (stats, grad) or by a loss's own ``split``."""

    step: Callable[..., None]  # (s, t, labels, constants, token_losses, write_grad, grad_lifts=None)
    # The two stages, for a vocabulary split over ranks; None where the step has no split form
    stats: Callable[..., torch.Tensor] | None  # (s, t, labels, constants) -> [n, NUM_STATS]
    grad: Callable[..., None] | None  # (s, t, labels, stats, constants, token_losses, write_grad, grad_lifts=None)
    # The Gram path's step in one kernel where the implementation has one, else None (stats, then grad):
    # (s, labels, constants, token_losses, teacher_products [n, 2], teacher_coefs [n]) -> whether it ran
    gram_step: Callable[..., bool] | None = None
    # (all_gather) -> the step over a vocabulary split, for a loss whose split is not stats-then-grad
    split: Callable[..., Callable[..., None]] | None = None
    # The step that also takes a weight's hash along (_fingerprint.py; a cached teacher copy's check), where the
    # implementation has one: (step's arguments, words=as_words(weight)) -> the hash's partial lanes [n, 2] int32,
    # or None where it cannot for these arguments (the step did not run then)
    hashing_step: Callable[..., torch.Tensor | None] | None = None

    def over_ranks(self, all_gather: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., None]:
        """The step over a vocabulary split across ranks (``all_gather``: [ranks, *shape])."""
        return self.split(all_gather) if self.split is not None else split_row_step(self, all_gather)


def scale_and_softcap(logits: torch.Tensor, scale: float, cap: float | None) -> torch.Tensor:
    logits = logits * scale
    return logits if cap is None else cap * torch.tanh(logits / cap)


def label_columns(labels: torch.Tensor, vocab_student: int, constants: RowStepConstants):
    """(valid, in_shard, column): which tokens count, and where each label lies in this shard's columns."""
    total = vocab_student if constants.vocab_student_total is None else constants.vocab_student_total
    valid = (labels != constants.ignore_index) & (labels >= 0) & (labels < total)
    column = labels.long() - constants.vocab_start
    in_shard = valid & (column >= 0) & (column < vocab_student)
    return valid, in_shard, torch.where(in_shard, column, 0)


def hard_term_grad(softmax: torch.Tensor, column: torch.Tensor, in_shard: torch.Tensor, weight_hard: float):
    """weight_hard * (softmax - one_hot(label)): cross-entropy's gradient in the logits, without the one-hot where the
    label lies in another shard. The one-hot in the softmax's dtype, so that the two cancel where softmax is 1."""
    grad = weight_hard * softmax
    if softmax.shape[1]:  # a shard may hold none of the student's columns
        grad.scatter_add_(1, column[:, None], in_shard.to(grad.dtype)[:, None] * -weight_hard)
    return grad


def through_head(grad: torch.Tensor, s: torch.Tensor, constants: RowStepConstants) -> None:
    """d L / d s, s the logits the loss sees, into d L / d (the head's output), in place: back through the softcap
    and the logit scale."""
    if constants.student_softcap is not None:
        grad *= 1.0 - (s / constants.student_softcap) ** 2  # d(c tanh(z / c)) / dz
    grad *= constants.student_logit_scale


def as_the_loss_sees_them(student_logits, teacher_logits, constants: RowStepConstants, dtype=torch.float32):
    """s and t as the loss sees them, in ``dtype``: each times its logit scale, then softcapped; t is None without
    teacher logits (the Gram path, _teacher_gram.py)."""
    s = scale_and_softcap(student_logits.to(dtype), constants.student_logit_scale, constants.student_softcap)
    if teacher_logits is None:
        return s, None
    t = scale_and_softcap(teacher_logits.to(dtype), constants.teacher_logit_scale, constants.teacher_softcap)
    return s, t


def _abs_max_or_one(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 0:
        return x.new_ones(x.shape[0])
    abs_max = x.abs().amax(1)
    return torch.where(abs_max > 0, abs_max, 1.0)


def row_stats_torch(student_logits, teacher_logits, labels, constants: RowStepConstants) -> torch.Tensor:
    rows, vocab_student = student_logits.shape
    s, t = as_the_loss_sees_them(student_logits, teacher_logits, constants)
    _, in_shard, column = label_columns(labels, vocab_student, constants)
    stats = s.new_empty(rows, NUM_STATS)
    if vocab_student:
        stats[:, MAX] = s.amax(1)
        stats[:, SUM_EXP] = torch.exp(s - stats[:, MAX, None]).sum(1)
    else:
        stats[:, MAX], stats[:, SUM_EXP] = float("-inf"), 0.0
    stats[:, TARGET] = torch.where(in_shard, s.gather(1, column[:, None])[:, 0] if vocab_student else 0.0, 0.0)
    stats[:, SCALE_S] = _abs_max_or_one(s)
    s_unit = s / stats[:, SCALE_S, None]
    stats[:, SUM_SQ_S] = (s_unit * s_unit).sum(1)
    if t is None:  # no teacher logits: with_teacher_products fills the teacher's statistics in
        stats[:, DOT], stats[:, SUM_SQ_T], stats[:, SCALE_T] = 0.0, 0.0, 1.0
        return stats
    stats[:, SCALE_T] = _abs_max_or_one(t)
    t_unit = t / stats[:, SCALE_T, None]
    stats[:, DOT] = (s_unit * t_unit[:, :vocab_student]).sum(1)  # the student's zero padding adds nothing
    stats[:, SUM_SQ_T] = (t_unit * t_unit).sum(1)
    return stats


def with_teacher_products(stats: torch.Tensor, dot: torch.Tensor, sum_sq_teacher: torch.Tensor,
                          constants: RowStepConstants) -> torch.Tensor:
    """The statistics of a row step run without teacher logits (row_stats_torch(s, None, ...)), completed
    with each row's s.t and |t|^2 of the heads' raw logits (before the logit scales), which the Gram
    path computes from the weights' Gram matrices instead (_teacher_gram.py). In place; returns stats."""
    teacher_scale = constants.teacher_logit_scale
    stats[:, DOT] = dot * (constants.student_logit_scale * teacher_scale) / stats[:, SCALE_S]
    stats[:, SUM_SQ_T] = sum_sq_teacher * (teacher_scale * teacher_scale)
    stats[:, SCALE_T] = 1.0
    return stats


def teacher_grad_coefficient(stats: torch.Tensor, labels: torch.Tensor, vocab_student: int,
                             constants: RowStepConstants) -> torch.Tensor:
    """Per row, c such that d L / d s (of the raw student logits) = c * t (raw teacher logits) plus what
    the row step writes without teacher logits; 0 for ignored rows. No softcap (its derivative would
    multiply t entry by entry)."""
    valid, _, _ = label_columns(labels, vocab_student, constants)
    _, coef_teacher, _ = cosine_terms(stats, constants)
    coefficient = -constants.weight_soft * constants.beta * coef_teacher
    coefficient = coefficient * (constants.student_logit_scale * constants.teacher_logit_scale)
    return torch.where(valid, coefficient, 0.0)


def combine_row_stats(shard_stats: torch.Tensor) -> torch.Tensor:
    """The statistics of the whole vocabulary from those of its shards, [shards, n, NUM_STATS] -> [n, NUM_STATS].
    Combined in float64: each shard's sums may fit their dtype where their total does not (the Triton statistics
    stay unscaled until a row's own sums overflow), and such a row's units then move by a power of two."""
    dtype, shard_stats = shard_stats.dtype, shard_stats.double()
    stats = shard_stats.new_empty(shard_stats.shape[1:])
    stats[:, MAX] = shard_stats[..., MAX].amax(0)
    stats[:, SUM_EXP] = (shard_stats[..., SUM_EXP] * torch.exp(shard_stats[..., MAX] - stats[:, MAX])).sum(0)
    stats[:, TARGET] = shard_stats[..., TARGET].sum(0)
    stats[:, SCALE_S] = shard_stats[..., SCALE_S].amax(0)
    stats[:, SCALE_T] = shard_stats[..., SCALE_T].amax(0)
    student_ratio = shard_stats[..., SCALE_S] / stats[:, SCALE_S]
    teacher_ratio = shard_stats[..., SCALE_T] / stats[:, SCALE_T]
    stats[:, DOT] = (shard_stats[..., DOT] * student_ratio * teacher_ratio).sum(0)
    stats[:, SUM_SQ_S] = (shard_stats[..., SUM_SQ_S] * student_ratio * student_ratio).sum(0)
    stats[:, SUM_SQ_T] = (shard_stats[..., SUM_SQ_T] * teacher_ratio * teacher_ratio).sum(0)
    for sum_sq, scale in ((SUM_SQ_S, SCALE_S), (SUM_SQ_T, SCALE_T)):
        # |dot| <= the larger sum of squares, so these two moves bring it into range too
        past_range = stats[:, sum_sq] > torch.finfo(dtype).max
        factor = torch.where(past_range, torch.ldexp(torch.ones_like(stats[:, sum_sq]),
                                                     torch.frexp(stats[:, sum_sq]).exponent // 2), 1.0)
        stats[:, sum_sq] /= factor * factor
        stats[:, scale] *= factor
        stats[:, DOT] /= factor
    return stats.to(dtype)


def cosine_terms(stats: torch.Tensor, constants: RowStepConstants):
    """cos(s/T, t/T) and the two coefficients of its gradient, from the row statistics.

    d cos / d s = coef_teacher * t - coef_student * s (t and s as they are, not divided by their
    scales). The norms are clamped at eps like cosine_similarity, and where the student's clamp is
    active its norm is a constant, so its derivative term drops out. T cancels but in the clamp,
    max(|s| / T, eps) = max(|s|, eps T) / T: taken so, no sum is multiplied by 1 / T^2, which overflowed
    fp32 for rows whose |s| fits and |s| / T does not. With scale = max |x|, the unit-scaled norms are
    >= 1; a row of zeros divides by its clamp, eps T, and its coefficient of t (~1/(eps T)^2) passes fp32's range
    below T ~ 5e-12: such a coefficient is 0 where |t|^2 is, so that no inf meets t = 0. Not 0 wherever |t|^2 is:
    the Gram path's |t|^2, a plain fp32 product, is 0 for tiny t too, where a finite coefficient is right.
    """
    student_scale, teacher_scale = stats[:, SCALE_S], stats[:, SCALE_T]
    norm_student = torch.sqrt(stats[:, SUM_SQ_S])  # |s| / student_scale
    norm_teacher = torch.sqrt(stats[:, SUM_SQ_T])
    eps = constants.norm_clamp
    student_eps, teacher_eps = eps / student_scale, eps / teacher_scale
    clamped_student = torch.maximum(norm_student, student_eps)
    clamped_teacher = torch.maximum(norm_teacher, teacher_eps)
    cos = stats[:, DOT] / clamped_student / clamped_teacher
    coef_teacher = 1.0 / (clamped_student * clamped_teacher) / student_scale / teacher_scale
    coef_teacher = torch.where(torch.isinf(coef_teacher) & (stats[:, SUM_SQ_T] == 0), 0.0, coef_teacher)
    coef_student = cos / (clamped_student * clamped_student) / student_scale / student_scale
    coef_student = torch.where(norm_student >= student_eps, coef_student, 0.0)
    return cos, coef_teacher, coef_student


def row_lift_bound(stats: torch.Tensor, constants: RowStepConstants, coef_teacher, coef_student) -> torch.Tensor:
    """A bound on max_v |d L / d s_v| of each row: |p - onehot| <= 1, |t_v| <= |t| and |s_v| <= |s|;
    the softcap's derivative is <= 1."""
    soft = coef_teacher * stats[:, SCALE_T] * torch.sqrt(stats[:, SUM_SQ_T]) + (
        coef_student.abs() * stats[:, SCALE_S] * torch.sqrt(stats[:, SUM_SQ_S]))
    return (abs(constants.weight_hard) + abs(constants.weight_soft * constants.beta) * soft) * abs(constants.student_logit_scale)


def lift_for(bound: torch.Tensor) -> torch.Tensor:
    """2^k: with e = floor(-log2(bound)), k = min(e, MAX_LIFT_EXPONENT) for e > 0, e + MAX_STORED_EXPONENT
    for bounds above 2^MAX_STORED_EXPONENT, else 0; 1 for a bound that is NaN or infinite. A bound past fp32's
    range comes from its looser terms (fp16 at temperatures near 0), so it says nothing of the entries: stored
    as they are, one past fp16's range shows as inf, where a power of two from the bound could round them to 0."""
    exponent = torch.floor(-torch.log2(bound.clamp(min=torch.finfo(torch.float32).tiny)))
    exponent = torch.where(exponent > 0, exponent.clamp(max=MAX_LIFT_EXPONENT),
                           torch.where(exponent < -MAX_STORED_EXPONENT, exponent + MAX_STORED_EXPONENT, 0.0))
    exponent = torch.where(torch.isfinite(bound), exponent, 0.0)
    return torch.ldexp(torch.ones_like(bound), exponent.int())


def row_grad_torch(student_logits, teacher_logits, labels, stats, constants: RowStepConstants, token_losses, write_grad,
                   grad_lifts=None):
    vocab_student = student_logits.shape[1]
    valid, in_shard, column = label_columns(labels, vocab_student, constants)
    # logsumexp - target as (max - target) + log(sum_exp): with logits near 1e38 the log(sum_exp) part
    # would vanish in max + log(sum_exp) (fp32 spacing there is ~1e31); likewise in the softmax below.
    log_sum_exp = torch.log(stats[:, SUM_EXP])
    cos, coef_teacher, coef_student = cosine_terms(stats, constants)
    token_losses[:, 0] = torch.where(valid, (stats[:, MAX] - stats[:, TARGET]) + log_sum_exp, 0.0)
    token_losses[:, 1] = torch.where(valid, constants.beta * (1.0 - cos), 0.0)
    if not write_grad:
        return

    s, t = as_the_loss_sees_them(student_logits, teacher_logits, constants)
    softmax = torch.exp((s - stats[:, MAX, None]) - log_sum_exp[:, None])
    grad = hard_term_grad(softmax, column, in_shard, constants.weight_hard)
    soft_scale = constants.weight_soft * constants.beta
    grad += soft_scale * coef_student[:, None] * s
    if t is not None:
        grad -= soft_scale * coef_teacher[:, None] * t[:, :vocab_student]
    through_head(grad, s, constants)
    if grad_lifts is not None:
        grad_lifts.copy_(lift_for(row_lift_bound(stats, constants, coef_teacher, coef_student)))
        grad *= grad_lifts[:, None]
    grad = torch.where(valid[:, None], grad, 0.0)
    student_logits.copy_(grad)


def row_step_torch(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad,
                   grad_lifts=None) -> None:
    stats = row_stats_torch(student_logits, teacher_logits, labels, constants)
    row_grad_torch(student_logits, teacher_logits, labels, stats, constants, token_losses, write_grad, grad_lifts)


COSINE_TORCH_ROW_STEP = RowStepImpl(row_step_torch, row_stats_torch, row_grad_torch)


def split_row_step(impl: RowStepImpl, all_gather: Callable[[torch.Tensor], torch.Tensor]):
    """The row step over a vocabulary split across ranks: each rank's row statistics, combined across ranks
    (``all_gather``: [ranks, *shape]; O(rows) traffic, never the logits), then each rank's losses and the
    gradient of its own logits."""

    def row_step(student_logits, teacher_logits, labels, constants, token_losses, write_grad, grad_lifts=None):
        shard_stats = impl.stats(student_logits, teacher_logits, labels, constants)
        stats = combine_row_stats(all_gather(shard_stats))  # every rank: the same lifts
        impl.grad(student_logits, teacher_logits, labels, stats, constants, token_losses, write_grad, grad_lifts)

    return row_step
