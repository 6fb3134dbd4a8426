"""The naive versions: full logits and autograd. The test oracle (on float64 copies) and the benchmarks' baseline.

It states the loss the way a user would write it with torch.nn.functional, independently of the row
step's hand-written gradient, so agreement between the two checks that gradient.
"""

import math

import torch
import torch.nn.functional as F

__all__ = ["NAIVE_LOSSES", "cosine_soft_term", "generalized_jsd", "naive_cosine_distill", "naive_jsd"]


def cosine_soft_term(student_logits, teacher_logits, beta, temperature):
    """Each token's soft cosine term, beta * (1 - cos(s / T, t / T)), the student's logits padded with zeros to the
    teacher's vocabulary."""
    padded = F.pad(student_logits, (0, teacher_logits.shape[-1] - student_logits.shape[-1]))
    return beta * (1 - F.cosine_similarity(padded / temperature, teacher_logits / temperature, dim=-1, eps=1e-8))


def generalized_jsd(student_logits, teacher_logits, beta, temperature):
    """Each token's generalized JSD of GKD on the temperature-scaled softmaxes, as TRL and Liger write it (kl_div on
    log-probabilities; beta = 0: KL(teacher || student), beta = 1: KL(student || teacher)), the student's logits
    padded with zeros to the teacher's vocabulary."""
    a = F.log_softmax(F.pad(student_logits, (0, teacher_logits.shape[-1] - student_logits.shape[-1])) / temperature,
                      dim=-1)
    b = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(a, b, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(b, a, reduction="none", log_target=True).sum(-1)
    # logaddexp, not logsumexp: log1p keeps the small weight's share of the mixture where beta is near 0 or 1
    mixture = torch.logaddexp(a + math.log1p(-beta), b + math.log(beta))
    return (beta * F.kl_div(mixture, b, reduction="none", log_target=True)
            + (1 - beta) * F.kl_div(mixture, a, reduction="none", log_target=True)).sum(-1)


def _full_logits(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias,
                 teacher_bias, ignore_index, num_valid_tokens):
    """(student logits [T, Vs], teacher logits [T, Vt] without gradient, labels [T], which tokens count, N), the
    logits in fp32, or in float64 if the inputs are float64."""
    compute_dtype = torch.promote_types(student_input.dtype, torch.float32)
    labels = true_labels.reshape(-1)
    student = F.linear(student_input, student_weight, student_bias).reshape(
        labels.numel(), student_weight.shape[0]).to(compute_dtype)
    with torch.no_grad():
        teacher = F.linear(teacher_input, teacher_weight, teacher_bias).reshape(
            labels.numel(), teacher_weight.shape[0]).to(compute_dtype)
    valid = labels != ignore_index
    normaliser = max(1, int(valid.sum())) if num_valid_tokens is None else num_valid_tokens
    return student, teacher, labels, valid, normaliser


def _scaled_and_capped(student, teacher, student_softcap, teacher_softcap, student_logit_scale, teacher_logit_scale):
    """Each model's logits times its logit scale (Cohere), then softcapped (Gemma-2): c * tanh(logits / c)."""
    student, teacher = student * student_logit_scale, teacher * teacher_logit_scale
    if student_softcap is not None:
        student = student_softcap * torch.tanh(student / student_softcap)
    if teacher_softcap is not None:
        teacher = teacher_softcap * torch.tanh(teacher / teacher_softcap)
    return student, teacher


def naive_cosine_distill(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    true_labels,
    student_bias=None,
    teacher_bias=None,
    weight_hard_loss=0.5,
    weight_soft_loss=0.5,
    beta=0.5,
    ignore_index=-100,
    temperature=1.0,
    num_valid_tokens=None,
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
):
    """Returns (loss, soft, hard). Computes in fp32, or in float64 if the inputs are float64."""
    student, teacher, labels, valid, normaliser = _full_logits(
        student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
        ignore_index, num_valid_tokens)
    student, teacher = _scaled_and_capped(student, teacher, student_softcap, teacher_softcap, student_logit_scale,
                                          teacher_logit_scale)
    hard = F.cross_entropy(student, labels.long(), ignore_index=ignore_index, reduction="sum") / normaliser
    soft = torch.where(valid, cosine_soft_term(student, teacher, beta, temperature), 0.0).sum() / normaliser
    loss = weight_hard_loss * hard + weight_soft_loss * soft
    return loss, soft, hard


def naive_jsd(
    student_input,
    student_weight,
    teacher_input,
    teacher_weight,
    true_labels,
    student_bias=None,
    teacher_bias=None,
    weight_hard_loss=0.5,
    weight_soft_loss=0.5,
    beta=0.5,
    ignore_index=-100,
    temperature=1.0,
    num_valid_tokens=None,
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=1.0,
    teacher_logit_scale=1.0,
):
    """``fused_linear_jsd``'s loss from full logits: returns (loss, soft, hard), in fp32 or float64."""
    student, teacher, labels, valid, normaliser = _full_logits(
        student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
        ignore_index, num_valid_tokens)
    student, teacher = _scaled_and_capped(student, teacher, student_softcap, teacher_softcap, student_logit_scale,
                                          teacher_logit_scale)
    hard = F.cross_entropy(student, labels.long(), ignore_index=ignore_index, reduction="sum") / normaliser
    divergence = generalized_jsd(student, teacher, beta, temperature)
    soft = torch.where(valid, divergence, 0.0).sum() / normaliser
    return weight_hard_loss * hard + weight_soft_loss * soft, soft, hard


NAIVE_LOSSES = {"cosine": naive_cosine_distill, "jsd": naive_jsd}  # the naive version of each fused loss
