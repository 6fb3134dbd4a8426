"""The generalized Jensen-Shannon divergence's row step in plain torch: the executable spec of
``fused_linear_jsd`` (api.py) and of its gradient, and its CPU path.

For one chunk of tokens, student logits s [n, Vs] and teacher logits t [n, Vt] (Vt >= Vs: s is zero-padded
to Vt, as Liger-Kernel pads it), temperature T and mixing weight beta:

    a = log_softmax(s / T),  b = log_softmax(t / T),  p = exp(a),  q = exp(b)
    beta = 0:  soft = KL(q || p) = sum q (b - a)                       (forward KL)
    beta = 1:  soft = KL(p || q) = sum p (a - b)                       (reverse KL)
    else:      m = log((1 - beta) p + beta q), in log space: logaddexp(a + log(1 - beta), b + log(beta))
               soft = beta KL(q || M) + (1 - beta) KL(p || M)          (generalized JSD)
    hard = logsumexp(s) - s[label]                                     (unscaled logits, student vocabulary)

Ignored tokens (label == ignore_index, or outside [0, Vs)) get 0. These are TRL's
``GKDTrainer.generalized_jsd_loss`` and Liger-Kernel's ``LigerFusedLinearJSDLoss`` per token, without a factor
T^2. The row step writes the unnormalised per-token losses into ``token_losses`` [n, 2] (hard, soft) and, if
``write_grad``, overwrites s with d L / d s for L = weight_hard * sum hard + weight_soft * sum soft (1 / N is
the chunk loop's). Its gradient, for the student's own columns k:

    d hard / d s_k = softmax(s)_k - [k == label]
    d soft / d s_k = (1 / T) * p_k * (g_k - sum_j p_j g_j),  g = d soft / d p:
        beta = 0:  p_k - q_k  (the whole bracket, times 1 / T)
        beta = 1:  g = a - b  (+1, which cancels)
        else:      g = (1 - beta) (a - m)  (the terms in d m / d p cancel, since M = (1 - beta) p + beta q)

Every term is formed from log-probabilities, so peaked teachers (q underflowing to 0) and temperatures far
from 1 stay finite.
"""

import math

import torch

from ._row_step import RowStepImpl, RowStepScales, label_columns


def _log_probs(student_logits, teacher_logits, temperature):
    """(a, b): the log-probabilities at the temperature, s zero-padded to t's vocabulary."""
    s = student_logits.float()
    vocab_teacher = teacher_logits.shape[1]
    if vocab_teacher > s.shape[1]:
        s = torch.nn.functional.pad(s, (0, vocab_teacher - s.shape[1]))
    return torch.log_softmax(s / temperature, dim=1), torch.log_softmax(teacher_logits.float() / temperature, dim=1)


def jsd_and_grad_factor(a, b, beta):
    """(soft [n], d soft / d (s / T) [n, V]) from the log-probabilities a (student) and b (teacher)."""
    p = a.exp()
    if beta == 0.0:
        q = b.exp()
        return (q * (b - a)).sum(1), p - q
    if beta == 1.0:
        soft = (p * (a - b)).sum(1)
        return soft, p * ((a - b) - soft[:, None])
    m = torch.logaddexp(a + math.log1p(-beta), b + math.log(beta))
    q = b.exp()
    student_kl = (p * (a - m)).sum(1)
    soft = beta * (q * (b - m)).sum(1) + (1.0 - beta) * student_kl
    return soft, (1.0 - beta) * p * ((a - m) - student_kl[:, None])


def row_step_jsd_torch(student_logits, teacher_logits, labels, scales: RowStepScales, token_losses, write_grad,
                       grad_lifts=None):
    if grad_lifts is not None:
        raise ValueError("the JSD row step has no fp16 lifts: pass bf16 or fp32 logits")
    rows, vocab_student = student_logits.shape
    valid, _, column = label_columns(labels, vocab_student, scales)
    s = student_logits.float()
    log_sum_exp = torch.logsumexp(s, dim=1) if vocab_student else s.new_full((rows,), float("-inf"))
    hard = torch.where(valid, log_sum_exp - s.gather(1, column[:, None])[:, 0], 0.0)
    a, b = _log_probs(student_logits, teacher_logits, scales.temperature)
    soft, soft_grad = jsd_and_grad_factor(a, b, scales.beta)
    token_losses[:, 0] = hard
    token_losses[:, 1] = torch.where(valid, soft, 0.0)
    if write_grad:
        grad = scales.weight_hard * torch.softmax(s, dim=1)
        grad.scatter_add_(1, column[:, None], torch.full((rows, 1), -scales.weight_hard, device=s.device))
        grad += (scales.weight_soft / scales.temperature) * soft_grad[:, :vocab_student]
        student_logits.copy_(torch.where(valid[:, None], grad, 0.0))


# No split into statistics and gradient yet: a vocabulary split over ranks is refused for it (_plan.py).
JSD_TORCH_ROW_STEP = RowStepImpl(row_step_jsd_torch, None, None)
