"""Never a silently wrong number from a cached teacher copy (_weight_cache.py): the Gram matrix and the FP8
copy against every way a user changes a weight, and "auto" with a teacher that changes every call.

Each mutation of the teacher weight must give what a call on a fresh copy of it gives, or raise
StaleWeightError. On the CPU the hash comparison is read at once; on a GPU it stays on the device, so
the changed call's loss and gradients are NaN and the next call raises: ``on_device_comparison`` runs
that path on the CPU.
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_problem
from cosdistill import StaleWeightError, api, fused_linear_cosine_distill, fused_linear_jsd
from cosdistill.testing import (
    TORCH,
    Options,
    compiled_distill,
    fingerprint_torch,
    weight_cache,
)
from cosdistill.testing import teacher_fp8 as fp8
from cosdistill.testing import teacher_gram as gram
from cosdistill.tools.check import TEACHER_MUTATIONS, check_teacher_caches

VOCAB, HIDDEN_STUDENT, HIDDEN_TEACHER, TOKENS = 97, 8, 12, 120  # the Gram path is cheaper at these sizes


def teacher_module(vocab=VOCAB, hidden=HIDDEN_TEACHER, generator=None):
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=generator) * 0.3)
    head.weight.requires_grad_(False)
    return head


# mutation -> whether it moves the weight's identity (the value is rebuilt) or only its contents (StaleWeightError)
OUTCOMES = {
    "weight.data = new": "rebuilt",
    "weight.data = new, another vocabulary": "rebuilt",
    "vector_to_parameters": "rebuilt",
    "load_state_dict": "rebuilt",
    "EMA on the parameter, no_grad": "rebuilt",
    "optimizer step": "rebuilt",
    "fused optimizer step": "stale",  # the CPU's fused AdamW does not move the version counter
    "weight.data.copy_": "stale",
    "EMA through .data": "stale",
    "one row through .data": "stale",
    "every sign through .data": "stale",
    "times 2 through .data": "stale",
    "two signs through .data": "stale",
}
assert set(OUTCOMES) == set(TEACHER_MUTATIONS)
copy_through_data = TEACHER_MUTATIONS["weight.data.copy_"]
ema_through_data = TEACHER_MUTATIONS["EMA through .data"]
ema_on_the_parameter = TEACHER_MUTATIONS["EMA on the parameter, no_grad"]


def student_and_labels(vocab=VOCAB, tokens=TOKENS, generator=None):
    student_weight = (torch.randn(vocab, HIDDEN_STUDENT, generator=generator) * 0.3).requires_grad_()
    student_input = torch.randn(tokens, HIDDEN_STUDENT, generator=generator).requires_grad_()
    teacher_input = torch.randn(tokens, HIDDEN_TEACHER, generator=generator)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::5] = -100
    return student_input, student_weight, teacher_input, labels


def call(teacher_weight, student, **options):
    """(loss, soft, hard, grad_input, grad_weight) of one call, the student's gradients reset first."""
    student_input, student_weight, teacher_input, labels = student
    student_input.grad = student_weight.grad = None
    loss, soft, hard = fused_linear_cosine_distill(student_input, student_weight[: teacher_weight.shape[0]],
                                                   teacher_input, teacher_weight, labels,
                                                   return_soft_hard_loss=True, **options)
    loss.backward()
    return loss.detach(), soft, hard, student_input.grad.clone(), student_weight.grad.clone()


def assert_same(got, want):
    """Equal up to the difference of the two paths "auto" may take in fp32 (a stale copy is off by far more)."""
    for got_part, want_part in zip(got, want):
        torch.testing.assert_close(got_part, want_part, rtol=1e-4, atol=1e-7)


def gram_calls(monkeypatch) -> list:
    """Records whether each call ran the Gram path."""
    calls, run = [], api.run
    monkeypatch.setattr(api, "run", lambda chosen, *a, **k: calls.append(chosen.teacher == "gram") or run(chosen, *a, **k))
    return calls


@pytest.fixture
def on_device_comparison(monkeypatch):
    monkeypatch.setattr(weight_cache, "compared_on_host", lambda weight: False)


@pytest.mark.parametrize("name, outcome", OUTCOMES.items())
@pytest.mark.parametrize("cosine_via", ["gram", "auto"])
def test_a_changed_teacher_gives_the_fresh_copy_s_answer_or_raises(name, outcome, cosine_via, monkeypatch):
    mutation = TEACHER_MUTATIONS[name]
    calls = gram_calls(monkeypatch)
    generator = torch.Generator().manual_seed(1)
    head, student = teacher_module(generator=generator), student_and_labels(generator=generator)
    call(head.weight, student, cosine_via=cosine_via)  # builds the cached Gram matrix
    mutation(head, generator)
    if outcome == "stale":
        with pytest.raises(StaleWeightError, match=r"teacher_weight \(97, 12\) changed .* version counter"):
            call(head.weight, student, cosine_via=cosine_via)
    else:
        assert_same(call(head.weight, student, cosine_via=cosine_via), call(head.weight.detach().clone(), student))
    # after the error, or the change, the call after gives the fresh copy's answer too
    assert_same(call(head.weight, student, cosine_via=cosine_via), call(head.weight.detach().clone(), student))
    assert calls[0] and calls[-2]  # the Gram path ran where the cache was used


@pytest.mark.parametrize("on_device", [False, True])
def test_cosdistill_check_passes_every_mutation_on_this_device(on_device, monkeypatch):
    monkeypatch.setattr(weight_cache, "compared_on_host", lambda weight: not on_device)
    results = check_teacher_caches(torch.device("cpu"), vocab=97, hidden_teacher=12, tokens=120)
    assert all(result.passed for result in results), [(r.name, r.failure) for r in results if not r.passed]
    assert {result.failure for result in results} == {"rebuilt", "NaN, then raised" if on_device else "raised"}


def test_a_weight_passed_as_data_says_so_when_a_change_on_the_parameter_is_found():
    """``parameter.data`` is a new tensor with a counter of its own at every call, so a change made on the parameter
    in place (which moves the parameter's counter) is found by the hash: the error named only writes through
    ``.data`` and told the user to change the parameter in place, which they had done."""
    generator = torch.Generator().manual_seed(3)
    head, student = teacher_module(generator=generator), student_and_labels(generator=generator)
    call(head.weight.data, student, cosine_via="gram")
    with torch.no_grad():
        head.weight.mul_(0.5)
    with pytest.raises(StaleWeightError, match=r"passing `weight.data` to the loss.* Pass the parameter itself"):
        call(head.weight.data, student, cosine_via="gram")
    call(head.weight, student, cosine_via="gram")
    with torch.no_grad():
        head.weight.mul_(0.5)  # the counter moves: rebuilt, no error
    assert_same(call(head.weight, student, cosine_via="gram"), call(head.weight.detach().clone(), student))


def test_on_a_gpu_the_stale_call_is_nan_and_the_next_one_raises(on_device_comparison):
    generator = torch.Generator().manual_seed(2)
    head, student = teacher_module(generator=generator), student_and_labels(generator=generator)
    first = call(head.weight, student, cosine_via="gram")
    assert all(torch.isfinite(part).all() for part in first)
    assert_same(call(head.weight, student, cosine_via="gram"), first)  # unchanged: reused, and not NaN
    ema_through_data(head, generator)
    stale = call(head.weight, student, cosine_via="gram")
    assert all(torch.isnan(part).all() for part in stale)  # loss, soft, hard and both gradients, every entry
    with pytest.raises(StaleWeightError, match="previous call with it"):
        call(head.weight, student, cosine_via="gram")
    assert_same(call(head.weight, student, cosine_via="gram"), call(head.weight.detach().clone(), student))


def test_on_a_gpu_a_stale_no_grad_call_and_the_compiled_op_are_nan_too(on_device_comparison):
    generator = torch.Generator().manual_seed(3)
    head, (student_input, student_weight, teacher_input, labels) = (teacher_module(generator=generator),
                                                                    student_and_labels(generator=generator))
    args = (student_input, student_weight, teacher_input, head.weight, labels)
    with torch.no_grad():
        fused_linear_cosine_distill(*args, cosine_via="gram")
        copy_through_data(head, generator)
        assert torch.isnan(fused_linear_cosine_distill(*args, cosine_via="gram"))
    with pytest.raises(StaleWeightError):
        fused_linear_cosine_distill(*args, cosine_via="gram")
    # a weight once found stale is built for each call since (kept_across_calls): the compiled op on another head
    head = teacher_module(generator=generator)
    args = (student_input, student_weight, teacher_input, head.weight, labels)
    compiled_distill(Options(cosine_via="gram"), *args).backward()  # cached, then changed behind the version counter
    copy_through_data(head, generator)
    student_input.grad = student_weight.grad = None
    loss = compiled_distill(Options(cosine_via="gram"), *args)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(student_input.grad).all() and torch.isnan(student_weight.grad).all()


def test_a_teacher_made_under_inference_mode_is_cached_and_checked():
    generator = torch.Generator().manual_seed(4)
    student = student_and_labels(generator=generator)
    with torch.inference_mode():
        weight = torch.randn(VOCAB, HIDDEN_TEACHER, generator=generator) * 0.3
    assert_same(call(weight, student, cosine_via="gram"), call(weight.clone(), student))
    assert_same(call(weight, student, cosine_via="gram"), call(weight.clone(), student))
    with torch.inference_mode():
        weight.mul_(2.0)
    with pytest.raises(StaleWeightError):
        call(weight, student, cosine_via="gram")


def test_detached_aliases_share_the_cached_value_and_its_checks():
    """Keyed on the storage: ``weight.detach()`` per call reuses the value, and is checked like the weight."""
    weight = teacher_module().weight
    first = gram.teacher_grams.get(weight.detach(), TORCH).value
    assert gram.teacher_grams.get(weight.detach(), TORCH).value is first
    weight.data.add_(1.0)
    with pytest.raises(StaleWeightError):
        gram.teacher_grams.get(weight.detach(), TORCH)


@pytest.mark.parametrize("name, outcome", OUTCOMES.items())
def test_the_fp8_copy_is_rebuilt_or_raises(name, outcome):
    """The FP8 cache (its GEMM needs a GPU; the cache and its quantization run here)."""
    mutation = TEACHER_MUTATIONS[name]
    generator = torch.Generator().manual_seed(5)
    head = teacher_module(generator=generator)
    fp8.quantized_weights.get(head.weight, TORCH)
    mutation(head, generator)
    if outcome == "stale":
        with pytest.raises(StaleWeightError, match="FP8 copy"):
            fp8.quantized_weights.get(head.weight, TORCH)
    got = fp8.quantized_weights.get(head.weight, TORCH).value
    want = fp8._quantize_weight(head.weight.detach().clone())
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(list(OUTCOMES)),
       vocab=st.integers(2, 130), on_device=st.booleans(), calls_between=st.integers(0, 2))
def test_property_any_mutation_between_calls_matches_a_fresh_copy(seed, name, vocab, on_device, calls_between,
                                                                  monkeypatch):
    """Random problems, a random mutation after 1-3 calls, on both caches: the fresh copy's answer, or
    the error (on the device path: NaN for the changed call, then the error)."""
    monkeypatch.setattr(weight_cache, "compared_on_host", lambda weight: not on_device)
    generator = torch.Generator().manual_seed(seed)
    head = teacher_module(vocab=vocab, generator=generator)
    student = student_and_labels(vocab=vocab, tokens=TOKENS, generator=generator)
    for _ in range(1 + calls_between):
        call(head.weight, student, cosine_via="gram")
        fp8.quantized_weights.get(head.weight, TORCH)
    TEACHER_MUTATIONS[name](head, generator)
    fresh = call(head.weight.detach().clone(), student, cosine_via="gram")
    fresh_fp8 = fp8._quantize_weight(head.weight.detach().clone())
    try:
        got = call(head.weight, student, cosine_via="gram")
    except StaleWeightError:
        assert not on_device
    else:
        if on_device and OUTCOMES[name] == "stale":
            assert all(torch.isnan(part).all() for part in got)
            with pytest.raises(StaleWeightError):
                call(head.weight, student, cosine_via="gram")
        else:
            assert_same(got, fresh)
    try:
        cached = fp8.quantized_weights.get(head.weight, TORCH)
    except StaleWeightError:
        assert not on_device
    else:
        if on_device and OUTCOMES[name] == "stale":
            assert torch.isnan(cached.poison)
            with pytest.raises(StaleWeightError):
                fp8.quantized_weights.get(head.weight, TORCH)
        else:
            assert cached.poison is None or cached.poison == 0
            assert torch.equal(cached.value[0].view(torch.uint8), fresh_fp8[0].view(torch.uint8))


def test_auto_counts_the_teacher_gram_matrix_where_the_teacher_changes_every_call(monkeypatch):
    """A teacher updated in place at every call (an EMA teacher) would pay W_t^T W_t at every call: "auto"
    counts it then and takes the logits path; once the teacher stops changing, the Gram path again."""
    tokens, vocab, hidden_teacher = 200, 300, 64
    assert gram.gram_is_cheaper(tokens, vocab, vocab, HIDDEN_STUDENT, hidden_teacher, write_grad_weight=True)
    assert not gram.gram_is_cheaper(tokens, vocab, vocab, HIDDEN_STUDENT, hidden_teacher, write_grad_weight=True,
                                    teacher_gram_cached=False)
    calls = gram_calls(monkeypatch)
    generator = torch.Generator().manual_seed(7)
    head = teacher_module(vocab=vocab, hidden=hidden_teacher, generator=generator)
    student_input, student_weight, _, labels = student_and_labels(vocab=vocab, tokens=tokens, generator=generator)
    teacher_input = torch.randn(tokens, hidden_teacher, generator=generator)

    def step():
        loss = fused_linear_cosine_distill(student_input, student_weight, teacher_input, head.weight, labels)
        loss.backward()

    for _ in range(3):
        step()
        ema_on_the_parameter(head, generator)
    step()  # changed since the last call: still the logits path, and the weight is now seen as it is
    step()
    step()
    assert calls == [True, False, False, False, True, True]


def test_auto_counts_the_teacher_gram_matrix_where_the_teacher_is_made_anew_for_every_call(monkeypatch):
    """A teacher head cast into a new tensor at every call (an fp32 head under bf16 autocast, as cosdistill.hf casts
    it; a gathered head) frees its Gram matrix unused: from its second call "auto" counts W_t^T W_t and takes the
    logits path. A head that then stays takes the logits path once (new to the cache), then the Gram path; a new
    head after it is taken as held again."""
    tokens, vocab, hidden_teacher = 200, 300, 64
    calls = gram_calls(monkeypatch)
    generator = torch.Generator().manual_seed(8)
    head = teacher_module(vocab=vocab, hidden=hidden_teacher, generator=generator)
    student_input, student_weight, _, labels = student_and_labels(vocab=vocab, tokens=tokens, generator=generator)
    teacher_input = torch.randn(tokens, hidden_teacher, generator=generator)

    def step(teacher_weight):
        loss = fused_linear_cosine_distill(student_input, student_weight, teacher_input, teacher_weight, labels)
        loss.backward()

    for _ in range(3):
        step(head.weight.clone())  # freed when the step ends, as a cast's copy is
    kept = head.weight.clone()
    for _ in range(3):
        step(kept)
    step(head.weight.clone())
    assert calls == [True, False, False, False, True, True, True]
    assert not gram.teacher_grams.values_outlive_calls  # that last head's Gram matrix, freed unused


def test_a_teacher_made_anew_for_every_call_is_seen_so_beside_a_kept_one(monkeypatch):
    """Multi-teacher distillation: a teacher cast anew at every call beside one that stays. Each lookup of the kept
    teacher told the cache that values outlive their calls, so the cast teacher counted as held at every call and
    "auto" paid its W_t^T W_t every time (its path then depended on the other teacher's calls)."""
    tokens, vocab, hidden_teacher = 200, 300, 64
    calls = gram_calls(monkeypatch)
    generator = torch.Generator().manual_seed(8)
    head, kept = (teacher_module(vocab=vocab, hidden=hidden_teacher, generator=generator) for _ in range(2))
    student_input, student_weight, _, labels = student_and_labels(vocab=vocab, tokens=tokens, generator=generator)
    teacher_input = torch.randn(tokens, hidden_teacher, generator=generator)
    for _ in range(4):
        for teacher_weight in (kept.weight, head.weight.clone()):
            fused_linear_cosine_distill(student_input, student_weight, teacher_input, teacher_weight, labels).backward()
    # the cast teacher's calls: as alone, but for its second, after the kept teacher's first reuse said once that
    # values outlive their calls
    assert calls[1::2] == [True, True, False, False]
    assert calls[0::2] == [True, True, True, True]


def test_mutual_distillation_through_detached_heads_keeps_no_copy(monkeypatch, on_device_comparison):
    """Two students, each the other's teacher through its detached head, under one fused optimizer: the teacher's
    Gram matrix was cached by the other call and stale at every later step (StaleWeightError on the CPU, a NaN step
    on a GPU). A head some call trains is never cached, nor one once found stale."""
    tokens, hidden, vocab = 256, 16, 512
    generator = torch.Generator().manual_seed(9)
    first, second = (torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator) * 0.3) for _ in range(2))
    batches = [(torch.randn(tokens, hidden, generator=generator), torch.randint(0, vocab, (tokens,), generator=generator))
               for _ in range(3)]

    def steps(cosine_via):
        heads = [first.detach().clone().requires_grad_(), second.detach().clone().requires_grad_()]
        optimizer = torch.optim.Adam(heads, lr=1e-2, fused=True)
        losses = []
        for hidden_states, labels in batches:
            loss = sum(fused_linear_cosine_distill(hidden_states, student, hidden_states, teacher.detach(), labels,
                                                   cosine_via=cosine_via)
                       for student, teacher in (heads, heads[::-1]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    assert steps("auto") == pytest.approx(steps("logits"), rel=1e-6)
    weight = torch.randn(vocab, hidden, generator=generator)
    gram.teacher_grams.get(weight, TORCH)
    weight.data.add_(1.0)  # behind the counter: a NaN call, an error, then the weight is built for each call
    student = torch.randn(vocab, hidden, generator=generator)
    assert gram.teacher_grams.get(weight, TORCH).poison.isnan()
    with pytest.raises(StaleWeightError):
        gram.teacher_grams.get(weight, TORCH)
    assert not weight_cache.kept_across_calls(weight, student)


@pytest.mark.parametrize("takes_hash", [True, False])
def test_a_row_step_that_takes_the_fp8_copy_s_hash_along_still_catches_a_stale_copy(takes_hash, monkeypatch,
                                                                                    on_device_comparison):
    """On a GPU the JSD's cluster step takes the FP8 copy's hash along (RowStepImpl.hashing_step); where it declines,
    the hash runs alone after it. Either way an unchanged copy gives the fresh copy's numbers, and one made stale
    behind the version counter gives NaN, then the error, then the rebuilt copy's numbers."""
    from cosdistill.testing import JSD_TORCH_ROW_STEP, as_words, backends

    monkeypatch.setattr(fp8, "check_supported", lambda *args: None)
    hashed = []

    def hashing_step(*args, words):
        hashed.append(tuple(words.shape))
        if not takes_hash:
            return None
        JSD_TORCH_ROW_STEP.step(*args)
        return fingerprint_torch(words).to(torch.int32)[None]  # one block's partial lanes: the whole hash

    monkeypatch.setattr(backends, "TORCH", dataclasses.replace(
        backends.TORCH, jsd_row_step=dataclasses.replace(JSD_TORCH_ROW_STEP, hashing_step=hashing_step)))
    problem = make_problem(tokens=30, bias=False, vocab_teacher=131, hidden_teacher=32, ignore_every=4)
    args = problem.args()[:5]

    def losses():
        return torch.stack(fused_linear_jsd(*args, teacher_precision="fp8", impl="torch", chunk_size=16,
                                            return_soft_hard_loss=True))

    fresh = losses()
    assert hashed == [] and torch.equal(losses(), fresh) and hashed == [tuple(as_words(problem.teacher_weight).shape)]
    problem.teacher_weight.data[7, 3] += 1.0  # behind the version counter
    assert losses().isnan().all() and len(hashed) == 2
    with pytest.raises(StaleWeightError, match="NaN"):
        losses()
    rebuilt = losses()
    fp8.quantized_weights.entries.clear()
    assert torch.equal(rebuilt, losses()) and not torch.equal(rebuilt, fresh)


def test_a_comparison_left_on_the_device_is_read_when_the_caller_asks():
    """``compare_later`` (a vocabulary split, which gathers every rank's poison before any raises): on the CPU too
    the reuse gives a NaN poison instead of raising, ``raise_if_stale`` then raises for this call and drops the
    copy, and the next get rebuilds it from the weight as it is."""
    generator = torch.Generator().manual_seed(5)
    head = teacher_module(generator=generator)
    cache = weight_cache.WeightCache("test copy", lambda weight: weight.sum())
    assert cache.get(head.weight, TORCH).poison is None  # built: nothing to compare
    fresh = cache.get(head.weight, TORCH, compare_later=True)
    assert fresh.poison.item() == 0
    cache.raise_if_stale(head.weight, "this call")  # read: fresh, no error
    ema_through_data(head, generator)
    stale = cache.get(head.weight, TORCH, compare_later=True)
    assert torch.isnan(stale.poison) and stale.value == fresh.value
    with pytest.raises(StaleWeightError, match="this call found that copy stale"):
        cache.raise_if_stale(head.weight, "this call")
    rebuilt = cache.get(head.weight, TORCH)
    assert rebuilt.poison is None and rebuilt.value == head.weight.sum()


def test_a_lazily_negated_teacher_is_hashed_by_its_values():
    """A weight with the negative bit set (``z.conj().imag``): the hash viewed its bits and raised torch's
    RuntimeError on the Gram path."""
    generator = torch.Generator().manual_seed(4)
    parts = torch.randn(2, VOCAB, HIDDEN_TEACHER, generator=generator) * 0.3
    weight = torch.complex(parts[0], parts[1]).conj().imag
    assert weight.is_neg()
    student = student_and_labels(generator=generator)
    assert_same(call(weight, student, cosine_via="gram"), call(weight.clone(), student, cosine_via="logits"))


def test_a_negated_view_of_the_same_storage_is_another_weight():
    """``z.imag`` and ``z.conj().imag`` share storage, offset, shape, strides, dtype and version: the second was
    taken for the first changed behind its counter, and raised StaleWeightError with nothing written."""
    generator = torch.Generator().manual_seed(5)
    parts = torch.randn(2, VOCAB, HIDDEN_TEACHER, generator=generator) * 0.3
    complex_weight = torch.complex(parts[0], parts[1])
    student = student_and_labels(generator=generator)
    for weight in (complex_weight.imag, complex_weight.conj().imag, complex_weight.imag):
        assert_same(call(weight, student, cosine_via="gram"), call(weight.clone(), student, cosine_via="logits"))


def test_a_weight_found_stale_on_the_cpu_is_built_for_each_call_since():
    """The error says so: after it the weight's value is built for each call, so later changes behind its version
    counter give fresh answers, not the error again."""
    generator = torch.Generator().manual_seed(7)
    head, student = teacher_module(generator=generator), student_and_labels(generator=generator)
    call(head.weight, student, cosine_via="gram")
    copy_through_data(head, generator)
    with pytest.raises(StaleWeightError, match="afresh at each call"):
        call(head.weight, student, cosine_via="gram")
    for _ in range(2):
        copy_through_data(head, generator)
        assert_same(call(head.weight, student, cosine_via="gram"),
                    call(head.weight.clone(), student, cosine_via="logits"))


def views_of_one_storage():
    """Pairs of weights alike in all but one part of the cache's identity: (what differs, the two weights)."""
    generator = torch.Generator().manual_seed(6)
    rows = torch.randn(2 * VOCAB, HIDDEN_TEACHER, generator=generator)
    square = torch.randn(HIDDEN_TEACHER, HIDDEN_TEACHER, generator=generator)
    bf16 = (torch.randn(VOCAB, HIDDEN_TEACHER, generator=generator) * 0.3).bfloat16()
    return [("offset", rows[:VOCAB], rows[VOCAB:]), ("strides", square, square.t()),
            ("dtype", bf16, bf16.view(torch.float16))]


@pytest.mark.parametrize("differs, first, second", views_of_one_storage(), ids=lambda value: value
                         if isinstance(value, str) else "")
def test_views_of_one_storage_that_differ_in_one_part_of_the_identity_each_get_their_own_value(differs, first, second):
    """Two row blocks of one tensor (the offset), a square head and its transpose (the strides), a bf16 head read as
    fp16 (the dtype, which alone told the two apart: the same bits, the same hash) each get the value built for
    them, in turn, with no StaleWeightError."""
    cache = weight_cache.WeightCache("copy", lambda weight: weight.clone())
    for weight in (first, second, first, second):
        got = cache.get(weight, TORCH).value
        assert got.dtype == weight.dtype and torch.equal(got, weight), differs


@pytest.mark.parametrize("backend, rounded", [(torch.backends.cuda, "tf32"), (torch.backends.mkldnn, "bf16")],
                         ids=["cuBLAS", "oneDNN"])
def test_an_fp32_heads_gram_matrix_is_rebuilt_when_the_fp32_precision_is_switched(backend, rounded):
    """cuBLAS may round an fp32 head to TF32 in W_t^T W_t, oneDNN (a CPU with bf16 units) to bf16: a matrix built
    under one setting is rebuilt under the other."""
    builds = []
    cache = weight_cache.WeightCache("sum", lambda weight: builds.append(1) or weight.sum(),
                                     built_under=gram._fp32_matmul_precision)
    head = teacher_module()
    bf16_head = head.weight.bfloat16()  # read as it is: one build under every setting
    saved = backend.matmul.fp32_precision
    try:
        for precision in ("ieee", "ieee", rounded, rounded, "ieee"):
            backend.matmul.fp32_precision = precision
            cache.get(head.weight, TORCH)
            cache.get(bf16_head, TORCH)
    finally:
        backend.matmul.fp32_precision = saved
    assert len(builds) == 3 + 1
    assert gram.teacher_grams.built_under is gram._fp32_matmul_precision


@pytest.mark.parametrize("teacher_precision, cosine_via", [(None, "gram"), (None, "auto"), ("fp8", "logits")])
@pytest.mark.parametrize("teacher_of", ["the parameter", "a detached alias"])
def test_a_teacher_head_trained_beside_the_student_is_never_cached(teacher_precision, cosine_via, teacher_of, monkeypatch,
                                                                 on_device_comparison):
    """Self-distillation through the student's own head under a fused optimizer, whose step moves no version
    counter: the cached Gram matrix or FP8 copy was stale at the next call (StaleWeightError on the CPU; on a GPU a
    NaN step the optimizer applied, then the error). Such a teacher is built afresh at every call: each step's
    numbers are those of a loss that keeps no copy (the logits path; an FP8 copy quantized for the call)."""
    monkeypatch.setattr(fp8, "check_supported", lambda *args: None)
    loss = fused_linear_jsd if teacher_precision else fused_linear_cosine_distill
    tokens, hidden, vocab = 300, 16, 1024  # where "auto" takes the Gram path
    generator = torch.Generator().manual_seed(3)
    student_input, teacher_input = (torch.randn(tokens, hidden, generator=generator) for _ in range(2))
    labels = torch.randint(0, vocab, (tokens,), generator=generator)

    def steps(uncached: bool) -> list[float]:
        head = torch.nn.Linear(hidden, vocab, bias=False)
        head.weight.data = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(4)) / 4
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2, fused=True)
        values = []
        for _ in range(3):
            teacher = head.weight if teacher_of == "the parameter" else head.weight.detach()
            if uncached:
                options = {"teacher_precision": None, "impl": "torch"}
                if teacher_precision:  # the same FP8 numbers, through a copy the caller quantizes for this call
                    teacher = fp8.quantize_teacher_weight(head.weight)
                else:
                    options["cosine_via"] = "logits"
            else:
                options = {"teacher_precision": teacher_precision, "impl": "torch"}
                if not teacher_precision:
                    options["cosine_via"] = cosine_via
            value = loss(student_input, head.weight, teacher_input, teacher, labels, **options)
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
            values.append(value.item())
        return values

    calls = gram_calls(monkeypatch)
    got, want = steps(uncached=False), steps(uncached=True)
    assert calls[:3] == [cosine_via != "logits"] * 3
    assert all(math.isfinite(value) for value in got)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_a_teacher_that_is_not_trained_stays_cached(monkeypatch):
    """The rule against trained teachers kept no copy for: a teacher left requiring grad (never frozen, as TRL leaves
    it; under torch.compile the op sees the parameter even where a detached alias was passed), a frozen student head
    shared with the teacher (a LoRA student whose base is the teacher), a head trained by an earlier stage and frozen
    since. Each built its Gram matrix at every call."""
    builds, build = [], gram.teacher_grams.build
    monkeypatch.setattr(gram.teacher_grams, "build", lambda weight: builds.append(1) or build(weight))
    tokens, hidden, vocab = 64, 16, 96
    generator = torch.Generator().manual_seed(10)
    student_input, teacher_input = (torch.randn(tokens, hidden, generator=generator) for _ in range(2))
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    student = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator) / 4)

    def calls(student_weight, teacher_weight, count=3):
        builds.clear()
        for _ in range(count):
            loss = fused_linear_cosine_distill(student_input, student_weight, teacher_input, teacher_weight, labels,
                                               cosine_via="gram")
            if loss.requires_grad:
                loss.backward()
        return len(builds)

    unfrozen = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator) / 4)
    assert calls(student, unfrozen) == 1
    shared = torch.randn(vocab, hidden, generator=generator) / 4
    assert calls(shared, shared) == 1  # frozen: nothing trains it
    earlier = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator) / 4)
    assert calls(earlier, unfrozen.detach(), count=1) == 0  # a stage that trains it
    assert calls(student, earlier.detach()) == 3  # trained, and still requiring grad: built for each call
    earlier.requires_grad_(False)
    assert calls(student, earlier) == 1  # frozen since: the next stage's teacher, cached


def test_a_value_read_on_another_stream_waits_for_its_build_once_per_stream(monkeypatch):
    """The stream ordering of a reuse (GPU tests run it for real): a stream other than the building one waits for
    the build's event and marks each tensor of the value and its hash as used by it, once; the building stream and
    a stream seen before do nothing. Streams are stand-ins here, the CPU having none."""
    class Stream:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_event(self, event):
            self.waited.append(event)

    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: recorded.append((tensor, stream)))
    builder, reader = Stream("builder"), Stream("reader")
    current = [builder]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    parts, largest, hash_ = (torch.ones(2), torch.ones(3)), torch.ones(()), torch.zeros(4)
    built = object()
    entry = weight_cache._Entry(identity=(), value=(parts, largest), hash=hash_, built=built, streams=[builder])
    entry.share_with_current_stream(torch.device("cpu"))
    assert builder.waited == [] and recorded == []
    current[0] = reader
    for _ in range(2):
        entry.share_with_current_stream(torch.device("cpu"))
    assert reader.waited == [built]
    assert [id(tensor) for tensor, _ in recorded] == [id(parts[0]), id(parts[1]), id(largest), id(hash_)]
    assert all(stream is reader for _, stream in recorded)
    assert entry.streams == [builder, reader]
    nothing_built = weight_cache._Entry(identity=(), value=(parts, largest), hash=hash_)  # a CPU weight's entry
    nothing_built.share_with_current_stream(torch.device("cpu"))
    assert reader.waited == [built] and len(recorded) == 4
