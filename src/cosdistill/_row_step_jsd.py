"""The generalized Jensen-Shannon divergence's row step in plain torch: the executable spec of
``fused_linear_jsd`` (api.py) and of its gradient, and its CPU path.

For one chunk of tokens, student logits s [n, Vs] and teacher logits t [n, Vt] (Vt >= Vs: s is zero-padded
to Vt, as Liger-Kernel pads it), temperature T and mixing weight beta, each model's logits first times its
logit scale and then softcapped where the constants say so (as in _row_step.py, the gradient then carrying
those factors):

    a = log_softmax(s / T),  b = log_softmax(t / T),  p = exp(a),  q = exp(b)
    beta = 0:  soft = KL(q || p) = sum q (b - a)                       (forward KL)
    beta = 1:  soft = KL(p || q) = sum p (a - b)                       (reverse KL)
    else:      m = log((1 - beta) p + beta q), in log space: logaddexp(a + log(1 - beta), b + log(beta))
               soft = beta KL(q || M) + (1 - beta) KL(p || M)          (generalized JSD)
    hard = logsumexp(s) - s[label]                                     (s not divided by T, student vocabulary)

Ignored tokens (label == ignore_index, or outside [0, Vs)) get 0. These are TRL's
``GKDTrainer.generalized_jsd_loss`` and Liger-Kernel's ``LigerFusedLinearJSDLoss`` per token, without a factor
T^2. The row step writes the unnormalised per-token losses into ``token_losses`` [n, 2] (hard, soft) and, if
``write_grad``, overwrites s with d L / d s for L = weight_hard * sum hard + weight_soft * sum soft (1 / N is
the chunk loop's). Its gradient, for the student's own columns k:

    d hard / d s_k = softmax(s)_k - [k == label]
    d soft / d s_k = (1 / T) * p_k * (g_k - sum_j p_j g_j),  g = d soft / d p:
        beta = 0:  p_k - q_k  (the whole bracket, times 1 / T)
        beta = 1:  g = a - b  (+1, which cancels; per row, maybe less its value at a reference column k*)
        else:      g = (1 - beta) (a - m)  (the terms in d m / d p cancel, since M = (1 - beta) p + beta q)

Every term is formed from log-probabilities, and those from the logits' distances to their row's largest
(a - m and b - m each as one logaddexp of d = b - a), so peaked teachers (q underflowing to 0), temperatures far
from 1 and logits of any size stay finite and exact to float64's rounding of the distances. Reverse KL's
g = a - b grows as the logits' gaps over T; where p sits on one column, g there and sum_j p_j g_j are large and
nearly equal, and their difference is the whole gradient. Taken against k*, the student's largest column (the
teacher's largest logit among ties), g is 0 there and the row sum small; but where p is spread and the teacher's
logit at k* far from its others, g - g* is large everywhere and a - b small. Each row takes the form whose row sum
is the smaller in size (_reverse_kl_form), as the fast steps do in fp32. The spec computes in float64: in fp32 its
sums over a whole vocabulary lose about an ulp of log(V) per term, which shows against a small divergence
(docs/design.md, The generalized JSD, Precision).

Given ``grad_lifts`` [n] (the chunk loop does for fp16 logits), it writes each row's gradient times a power of
two and stores it there, as _row_step.py does (``lift_for``), from a bound on the row's largest entry: with
c = weight_soft / T, S = sum_j p_j g_j, and M the largest |p_k g_k| (|p_k - q_k| at beta = 0) and P the
largest p_k over the student's columns, |d L / d s_k| <= (|weight_hard| + |c| (M + P |S|)) times the
student's logit scale (the softcap's factor is at most 1). M and P come with the sums, so the ranks of a
vocabulary split agree on them.

It runs in three stages, so that a vocabulary split over ranks can combine each row's numbers between
them: ``jsd_shard_stats_torch`` (the log-sum-exps, the soft distributions' largest logits, the target logit,
the reference column's logits),
``jsd_shard_sums_torch`` (the divergence, the gradient's sum_j p_j g_j and M) and ``jsd_shard_grad_torch`` (the losses and the
gradient).
"""

import math

import torch

from ._row_step import RowStepConstants, RowStepImpl, as_the_loss_sees_them, hard_term_grad, label_columns, lift_for, through_head

SPEC_DTYPE = torch.float64
# Per-row statistics of the JSD's row step, along the last dimension of a [n, 8] float64 tensor; over a
# vocabulary split, each rank's are combined across ranks (combine_jsd_stats_torch) before the sums.
JSD_STATS = (
    "log_sum_exp",  # logsumexp of s over the student's columns (the hard term's; -inf over none)
    "target_logit",  # s[label] if the label falls in this shard, else 0
    # Each model's soft distribution as its largest logit and the logsumexp of the distances to it over T (s
    # zero-padded to the teacher's columns): log-probabilities formed from distances stay exact where the logits
    # over T are so large that their difference from a logsumexp of them would cancel.
    "student_max", "student_log_sum_exp", "teacher_max", "teacher_log_sum_exp",
    # Reverse KL's reference column, the student's largest over its own columns (-inf over none), and the teacher's
    # largest logit among those columns (-inf over none): the gradient's bracket is formed against it (jsd_terms).
    "student_top", "teacher_at_student_top",
)
LSE, TARGET, MAX_STUDENT, LSE_STUDENT, MAX_TEACHER, LSE_TEACHER, TOP_STUDENT, TEACHER_AT_TOP = range(len(JSD_STATS))


def _padded(s, vocab_teacher):
    """s zero-padded to the teacher's columns (the soft term's view of it)."""
    return torch.nn.functional.pad(s, (0, vocab_teacher - s.shape[1])) if vocab_teacher > s.shape[1] else s


def jsd_shard_stats_torch(student_logits, teacher_logits, labels, constants: RowStepConstants) -> torch.Tensor:
    """[n, len(JSD_STATS)] over this shard's columns."""
    rows, vocab_student = student_logits.shape
    _, in_shard, column = label_columns(labels, vocab_student, constants)
    s, t = as_the_loss_sees_them(student_logits, teacher_logits, constants, SPEC_DTYPE)
    stats = s.new_empty(rows, len(JSD_STATS))
    stats[:, LSE] = torch.logsumexp(s, dim=1) if vocab_student else float("-inf")
    target = s.gather(1, column[:, None])[:, 0] if vocab_student else s.new_zeros(rows)
    stats[:, TARGET] = torch.where(in_shard, target, 0.0)
    for largest_column, logits in ((MAX_STUDENT, _padded(s, t.shape[1])), (MAX_TEACHER, t)):
        largest = logits.amax(1)  # every shard holds teacher columns, and s is padded to them
        stats[:, largest_column] = largest
        stats[:, largest_column + 1] = torch.logsumexp(_distances(logits, largest, constants.temperature), dim=1)
    stats[:, TOP_STUDENT] = s.amax(1) if vocab_student else float("-inf")
    at_top = torch.where(s == stats[:, TOP_STUDENT, None], t[:, :vocab_student], float("-inf"))
    stats[:, TEACHER_AT_TOP] = at_top.amax(1) if vocab_student else float("-inf")
    return stats


def _distances(logits, largest, temperature):
    """(logits - largest) / T."""
    return (logits - largest[:, None]) / temperature


def combine_jsd_stats_torch(shard_stats: torch.Tensor, temperature: float) -> torch.Tensor:
    """The whole vocabulary's statistics from its shards', [shards, n, 8] -> [n, 8]."""
    stats = torch.empty_like(shard_stats[0])
    stats[:, LSE] = torch.logsumexp(shard_stats[..., LSE], dim=0)
    stats[:, TARGET] = shard_stats[..., TARGET].sum(0)
    for largest_column in (MAX_STUDENT, MAX_TEACHER):
        largest = stats[:, largest_column] = shard_stats[..., largest_column].amax(0)
        # each shard's sum of exponentials, moved from its own largest logit to the whole row's
        moved = shard_stats[..., largest_column + 1] + _distances(shard_stats[..., largest_column].T, largest,
                                                                   temperature).T
        stats[:, largest_column + 1] = torch.logsumexp(moved, dim=0)
    top = stats[:, TOP_STUDENT] = shard_stats[..., TOP_STUDENT].amax(0)
    holds_top = shard_stats[..., TOP_STUDENT] == top
    stats[:, TEACHER_AT_TOP] = torch.where(holds_top, shard_stats[..., TEACHER_AT_TOP], float("-inf")).amax(0)
    return stats


def _log_probs(s, t, stats, temperature):
    """(a, b): the student's and the teacher's log-probabilities at the temperature over this shard's columns
    (s zero-padded), each from its logits' distances to the row's largest."""
    a = _distances(_padded(s, t.shape[1]), stats[:, MAX_STUDENT], temperature) - stats[:, LSE_STUDENT, None]
    b = _distances(t, stats[:, MAX_TEACHER], temperature) - stats[:, LSE_TEACHER, None]
    return a, b


def _referenced_gaps(s, t, stats, temperature):
    """Reverse KL's g - g* = -(d - d*) over the given columns (s zero-padded), g* the row's g at its reference
    column (TOP_STUDENT), formed from the logits' distances to that column: 0 there, and nothing cancels where p
    sits on it."""
    teacher_distance = t - stats[:, TEACHER_AT_TOP, None]
    return ((_padded(s, t.shape[1]) - stats[:, TOP_STUDENT, None]) - teacher_distance) / temperature


def jsd_terms(a, b, beta):
    """(soft [n], student part [n], g [n, V]) over the given columns, from the student's and the teacher's
    log-probabilities a and b: soft the divergence's sum, g = d soft / d p up to a constant, and the student part
    sum_j p_j g_j, which the gradient subtracts (0 where it needs none: beta = 0). With d = b - a and the mixture
    m = log((1 - beta) e^a + beta e^b), a - m = -logaddexp(log(1 - beta), log(beta) + d) and
    b - m = -logaddexp(log(1 - beta) - d, log(beta)), each with no difference of large numbers. Reverse KL's
    student part is its soft term; its gradient may take g against the reference column instead (_reverse_kl_form)."""
    p, d = a.exp(), b - a
    if beta == 0.0:
        return (b.exp() * d).sum(1), torch.zeros_like(a[:, 0]), None
    if beta == 1.0:
        soft = -(p * d).sum(1)
        return soft, soft, -d
    log_keep, log_beta = math.log1p(-beta), math.log(beta)
    student_minus_mixture = -torch.logaddexp(d.new_tensor(log_keep), d + log_beta)
    teacher_minus_mixture = -torch.logaddexp(log_keep - d, d.new_tensor(log_beta))
    student_part = (p * student_minus_mixture).sum(1)
    soft = beta * (b.exp() * teacher_minus_mixture).sum(1) + (1.0 - beta) * student_part
    return soft, (1.0 - beta) * student_part, (1.0 - beta) * student_minus_mixture


def _soft_brackets(a, b, g, beta):
    """p_k g_k (p_k - q_k at beta = 0) over the given columns: the soft gradient's part that varies with k."""
    return a.exp() - b.exp() if beta == 0.0 else a.exp() * g


def _reverse_kl_form(s, t, stats, sums, g, temperature):
    """(g [n, V], row sum [n]) of reverse KL's gradient over the given columns, each row's in the form whose row sum
    is the smaller in size: g = a - b with its row sum, the soft term (sums[:, 0]), or g - g* (_referenced_gaps)
    with sums[:, 1]. A bracket g_k - sum_j p_j g_j formed in fp32 keeps the absolute precision of the larger of
    its terms: where p sits on one column, g there and its row sum are large and nearly equal and the referenced
    form is small; where p is spread and the teacher's logit at the student's largest is far from its others, g - g*
    is large everywhere and g small. The fast steps choose the same way (row_step_jsd_triton._row_reference); the
    choice, from the combined sums, is the same on every rank of a split."""
    referenced = sums[:, 1].abs() < sums[:, 0].abs()
    return (torch.where(referenced[:, None], _referenced_gaps(s, t, stats, temperature), g),
            torch.where(referenced, sums[:, 1], sums[:, 0]))


def jsd_shard_sums_torch(student_logits, teacher_logits, stats, constants: RowStepConstants, lift_terms=False) -> torch.Tensor:
    """[n, 2]: the soft term and the gradient's student part (jsd_terms; reverse KL's against its reference column,
    _reverse_kl_form) over this shard's columns; with ``lift_terms`` [n, 4], with the largest |_soft_brackets| and
    the largest p over its student columns (0 over none), which jsd_lift_bound needs. A vocabulary split adds up
    the first two across ranks and takes the largest of the others (combine_jsd_sums_torch)."""
    s, t = as_the_loss_sees_them(student_logits, teacher_logits, constants, SPEC_DTYPE)
    a, b = _log_probs(s, t, stats, constants.temperature)
    soft, student_part, g = jsd_terms(a, b, constants.beta)
    if constants.beta == 1.0:
        student_part = (a.exp() * _referenced_gaps(s, t, stats, constants.temperature)).sum(1)
    if not lift_terms:
        return torch.stack([soft, student_part], dim=1)
    vocab_student = s.shape[1]
    g = None if g is None else g[:, :vocab_student]
    brackets = _soft_brackets(a[:, :vocab_student], b[:, :vocab_student], g, constants.beta)
    largest, largest_p = torch.zeros_like(soft), torch.zeros_like(soft)
    if vocab_student:
        largest, largest_p = brackets.abs().amax(1), a[:, :vocab_student].amax(1).exp()
    return torch.stack([soft, student_part, largest, largest_p], dim=1)


def combine_jsd_sums_torch(shard_sums: torch.Tensor, summed: int = 2) -> torch.Tensor:
    """The whole vocabulary's sums from its shards', [shards, n, c] -> [n, c]: the first ``summed`` columns summed
    (2 here, 3 from the Triton stages), the rest (the largest terms of the fp16 bound) the shards' largest."""
    sums = shard_sums.sum(0)
    sums[:, summed:] = shard_sums[..., summed:].amax(0)
    return sums


def jsd_lift_bound(sums, constants: RowStepConstants) -> torch.Tensor:
    """[n]: a bound on each row's largest |d L / d s| from sums with their lift terms (the module's docstring
    says why it holds), in g's unreferenced form: reverse KL's row sum is then its soft term."""
    row_sum = sums[:, 0] if constants.beta == 1.0 else sums[:, 1]
    soft = sums[:, 2] + sums[:, 3] * row_sum.abs()
    return (abs(constants.weight_hard) + abs(constants.weight_soft) / constants.temperature * soft) * abs(
        constants.student_logit_scale)


def jsd_shard_grad_torch(student_logits, teacher_logits, labels, stats, sums, constants: RowStepConstants, token_losses,
                         write_grad, grad_lifts=None) -> None:
    """The losses from the (combined) statistics and sums and, if asked, d L / d s of this shard's columns
    (times the row's lift, given ``grad_lifts``; 1 for an ignored row)."""
    rows, vocab_student = student_logits.shape
    valid, in_shard, column = label_columns(labels, vocab_student, constants)
    token_losses[:, 0] = torch.where(valid, stats[:, LSE] - stats[:, TARGET], 0.0)
    token_losses[:, 1] = torch.where(valid, sums[:, 0], 0.0)
    if not write_grad:
        return
    s, t = as_the_loss_sees_them(student_logits, teacher_logits, constants, SPEC_DTYPE)
    # In SPEC_DTYPE: where softmax(s) is 1 (a one-column student) the exact gradient is the soft term's alone.
    grad = hard_term_grad(torch.exp(s - stats[:, LSE, None]), column, in_shard, constants.weight_hard)
    a, b = _log_probs(s, t, stats, constants.temperature)
    a, b = a[:, :vocab_student], b[:, :vocab_student]  # the student has no gradient past its own columns
    if constants.beta == 0.0:
        soft_grad = a.exp() - b.exp()
    else:  # the bracket before the product: where p sits on one column g and the row sum are nearly equal
        g, row_sum = jsd_terms(a, b, constants.beta)[2], sums[:, 1]
        if constants.beta == 1.0:
            g, row_sum = _reverse_kl_form(s[:, :vocab_student], t[:, :vocab_student], stats, sums, g,
                                          constants.temperature)
        soft_grad = a.exp() * (g - row_sum[:, None])
    grad += (constants.weight_soft / constants.temperature) * soft_grad
    through_head(grad, s, constants)
    if grad_lifts is not None:
        grad_lifts.copy_(torch.where(valid, lift_for(jsd_lift_bound(sums, constants).float()), 1.0))
        grad *= grad_lifts[:, None]
    student_logits.copy_(torch.where(valid[:, None], grad, 0.0))


def row_step_jsd_torch(student_logits, teacher_logits, labels, constants: RowStepConstants, token_losses, write_grad,
                       grad_lifts=None):
    stats = jsd_shard_stats_torch(student_logits, teacher_logits, labels, constants)
    sums = jsd_shard_sums_torch(student_logits, teacher_logits, stats, constants, lift_terms=grad_lifts is not None)
    jsd_shard_grad_torch(student_logits, teacher_logits, labels, stats, sums, constants, token_losses, write_grad, grad_lifts)


def split_jsd_row_step(all_gather):
    """The JSD's row step over a vocabulary split across ranks: two all-gathers of O(rows) per step, one of
    the statistics (the log-sum-exps need every column before any probability), one of the sums (the
    gradient needs the whole row's student part, fp16's lift the whole row's largest terms)."""

    def row_step(student_logits, teacher_logits, labels, constants, token_losses, write_grad, grad_lifts=None):
        stats = combine_jsd_stats_torch(
            all_gather(jsd_shard_stats_torch(student_logits, teacher_logits, labels, constants)), constants.temperature)
        sums = combine_jsd_sums_torch(all_gather(jsd_shard_sums_torch(student_logits, teacher_logits, stats, constants,
                                                                      lift_terms=grad_lifts is not None)))
        jsd_shard_grad_torch(student_logits, teacher_logits, labels, stats, sums, constants, token_losses, write_grad,
                             grad_lifts)  # every rank: the same sums, so the same lifts

    return row_step


JSD_TORCH_ROW_STEP = RowStepImpl(row_step_jsd_torch, None, None, split=split_jsd_row_step)
