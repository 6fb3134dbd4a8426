"""The public function and module (api.py) against the float64 naive reference: losses and every student
gradient, the options, the autograd contract, and every bad-input rule (a ValueError or TypeError naming the
argument and the shapes seen)."""

import contextlib
import dataclasses
import inspect
import math
import weakref

import pytest
import torch

from conftest import TOLERANCE, assert_matches_reference, make_problem, reference, rel_err, run_fused
from cosdistill import FusedLinearCosineDistillLoss, api, fused_linear_cosine_distill, fused_linear_jsd, testing
from cosdistill.reference import NAIVE_LOSSES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("vocab_teacher", [101, 131])
def test_matches_reference(impl, dtype, bias, vocab_teacher):
    problem = make_problem(dtype=dtype, bias=bias, vocab_teacher=vocab_teacher, ignore_every=4)
    assert_matches_reference(problem, dtype, impl=impl, chunk_size=16)


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 16, 37, 1000])
def test_chunk_sizes(impl, chunk_size):
    problem = make_problem(tokens=37, ignore_every=3)
    assert_matches_reference(problem, torch.float32, impl=impl, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_options_and_3d_inputs(impl, dtype):
    problem = make_problem(tokens=36, batch=3, dtype=dtype, vocab_teacher=130, ignore_every=5)
    options = dict(weight_hard_loss=0.3, weight_soft_loss=1.7, beta=0.8, temperature=2.5)
    assert_matches_reference(problem, dtype, grad_output=-2.5, ref_kwargs=options, impl=impl, chunk_size=10, **options)


@pytest.mark.parametrize("chunk_size", [8, None])  # several chunks: on the last GEMM's alpha and beta; one: on its rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_output_scales_gradients(impl, chunk_size, dtype):
    problem = make_problem(dtype=dtype)
    assert_matches_reference(problem, dtype, grad_output=3.25, impl=impl, chunk_size=chunk_size)


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.bfloat16])
def test_fp32_and_bf16_grad_weight_accumulation(impl, accum_dtype):
    problem = make_problem(tokens=64, dtype=torch.bfloat16)
    assert_matches_reference(problem, torch.bfloat16, impl=impl, chunk_size=8, accum_dtype=accum_dtype)


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_an_fp16_grad_weight_accumulator_is_refused(loss):
    """Every chunk but the last adds into grad_weight before grad_output (a loss scale) is known: an fp16 accumulator
    held those partial sums in its subnormals, 2.9e-2 off float64 over 32 chunks under a scale of 65536, with no
    error. The function, the module (when made) and the compiled op refuse it; fp16 weights keep their fp32 default."""
    from cosdistill import FusedLinearCosineDistillLoss, FusedLinearJSDLoss
    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=16, dtype=torch.float16)
    function = FUSED_LOSSES[loss]
    module = {"cosine": FusedLinearCosineDistillLoss, "jsd": FusedLinearJSDLoss}[loss]
    message = r"accum_dtype=torch.float16 is not taken: grad_weight's partial sums are added up before grad_output"
    with pytest.raises(TypeError, match=message):
        function(*problem.args(), chunk_size=2, accum_dtype=torch.float16)
    with pytest.raises(TypeError, match=message):  # when made, as the module's other options
        module(chunk_size=2, accum_dtype=torch.float16)
    with pytest.raises(Exception, match=message):  # Dynamo wraps it; the message is the same
        torch.compile(function, backend="eager", fullgraph=True)(*problem.args(), chunk_size=2, accum_dtype=torch.float16)
    function(*problem.args(), chunk_size=2).backward()
    assert problem.student_weight.grad.dtype == torch.float16


def test_num_valid_tokens_overrides_normaliser(impl):
    problem = make_problem(ignore_every=2)
    assert_matches_reference(problem, torch.float32, ref_kwargs=dict(num_valid_tokens=50), impl=impl,
                             num_valid_tokens=torch.tensor(50))


def test_non_contiguous_inputs(impl):
    base = make_problem(tokens=40, hidden_student=32, hidden_teacher=48)
    problem = make_problem(tokens=20, hidden_student=16, hidden_teacher=24)
    with torch.no_grad():
        problem.student_input = base.student_input[::2, ::2].clone().requires_grad_()  # a strided leaf below
        problem.teacher_input = base.teacher_input[::2, ::2]
        problem.teacher_weight = torch.randn(24, problem.teacher_weight.shape[0]).t()
        problem.labels = torch.randint(0, 101, (40,))[::2]
    leaf = torch.randn(16, 101, requires_grad=True)  # student weight as a transposed view of a leaf
    problem.student_weight = leaf.t()
    assert not problem.student_weight.is_contiguous() and not problem.teacher_input.is_contiguous()
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl, chunk_size=6)
    loss.backward()
    ref_losses, ref_grads = reference(problem)
    assert rel_err(loss, ref_losses[0]) < 1e-5
    assert rel_err(problem.student_input.grad, ref_grads[0]) < 1e-5
    assert rel_err(leaf.grad.t(), ref_grads[1]) < 1e-5


@pytest.mark.parametrize("grad_output", [1.0, 2.5])
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_student_input_stored_transposed(impl, loss, grad_output):
    """A dense student_input in column-major order ([H, T] storage seen as [T, H]), one chunk: backward scales a
    copy of its rows, which must come out row-major for the scale kernel."""
    problem = make_problem(tokens=20)
    with torch.no_grad():
        problem.student_input = problem.student_input.t().contiguous().t().requires_grad_()
    assert problem.student_input.stride() == (1, 20)
    function = fused_linear_jsd if loss == "jsd" else fused_linear_cosine_distill
    (function(*problem.args(), impl=impl) * grad_output).backward()
    ref_losses, ref_grads = reference(problem, grad_output, loss=loss)
    for leaf, want in zip(problem.student_leaves(), ref_grads):
        assert rel_err(leaf.grad, want) < 1e-5


def test_liger_positional_order_and_module(impl):
    problem = make_problem(ignore_every=6)
    positional = fused_linear_cosine_distill(*problem.args(), 0.2, 0.8, 0.4, -100, 1.5, True, 5, True, impl=impl)
    module = FusedLinearCosineDistillLoss(0.2, 0.8, 0.4, -100, 1.5, True, 5, True, impl=impl)
    from_module = module(*problem.args())
    ref_losses, _ = reference(problem, weight_hard_loss=0.2, weight_soft_loss=0.8, beta=0.4, temperature=1.5)
    for got, again, want in zip(positional, from_module, ref_losses):
        assert torch.equal(got, again)
        assert rel_err(got, want) < 1e-5


def test_no_grad_does_no_gradient_work(impl, monkeypatch):
    problem = make_problem()
    calls = []
    original = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        loss = fused_linear_cosine_distill(*problem.args(), impl=impl)
    assert not loss.requires_grad and calls == []
    ref_losses, _ = reference(problem)
    assert rel_err(loss, ref_losses[0]) < 1e-5


def test_nothing_requires_grad_gives_plain_loss(impl, monkeypatch):
    """Also without the autograd Function, under no_grad or with frozen leaves alike."""
    problem = make_problem()
    with_grad = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True)
    monkeypatch.setattr(api._AttachGradients, "apply", None)  # a call would raise
    with torch.no_grad():
        no_grad = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True)
    for leaf in problem.student_leaves():
        leaf.requires_grad_(False)
    frozen = fused_linear_cosine_distill(*problem.args(), impl=impl, return_soft_hard_loss=True)
    for losses in (no_grad, frozen):
        assert not any(value.requires_grad for value in losses)
        torch.testing.assert_close(losses, tuple(value.detach() for value in with_grad), rtol=1e-6, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(no_grad, frozen))
    assert rel_err(frozen[0], reference(problem)[0][0]) < 1e-5


def test_only_weight_requires_grad(impl):
    problem = make_problem(bias=False)
    problem.student_input.requires_grad_(False)
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl, chunk_size=9)
    loss.backward()
    assert problem.student_input.grad is None
    assert rel_err(problem.student_weight.grad, reference(problem)[1][1]) < 1e-5


def test_soft_and_hard_are_logged_without_gradient(impl):
    problem = make_problem()
    loss, soft, hard = fused_linear_cosine_distill(*problem.args(), return_soft_hard_loss=True, impl=impl)
    assert loss.requires_grad and not soft.requires_grad and not hard.requires_grad
    torch.testing.assert_close(loss, 0.5 * soft + 0.5 * hard)


def test_the_loss_may_be_scaled_in_place_before_backward(impl):
    """The loss is a tensor of its own, not the chunk loop's passed on (autograd forbids modifying that
    in place): loss /= accumulation steps must scale the gradients."""
    problem = make_problem(ignore_every=4)
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl)
    loss /= 4
    loss.backward()
    ref_losses, ref_grads = reference(problem, 0.25)
    assert rel_err(loss, 0.25 * ref_losses[0]) < 1e-5
    for leaf, want in zip(problem.student_leaves(), ref_grads):
        assert rel_err(leaf.grad, want) < 1e-5


def test_same_inputs_give_bitwise_equal_outputs(impl):
    problem = make_problem(dtype=torch.bfloat16, ignore_every=3)
    first_losses, first_grads = run_fused(problem, impl=impl, chunk_size=8)
    first_grads = [g.clone() for g in first_grads]
    for leaf in problem.student_leaves():
        leaf.grad = None
    second_losses, second_grads = run_fused(problem, impl=impl, chunk_size=8)
    for a, b in zip(first_losses + first_grads, second_losses + second_grads):
        assert torch.equal(a, b)


def test_all_tokens_ignored_gives_zero_loss_and_gradients(impl):
    problem = make_problem()
    problem.labels.fill_(-100)
    losses, grads = run_fused(problem, impl=impl, chunk_size=8)
    assert all(loss.item() == 0.0 for loss in losses)
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_zero_tokens_gives_zero_loss(impl):
    problem = make_problem(tokens=0)
    losses, grads = run_fused(problem, impl=impl)
    assert all(loss.item() == 0.0 for loss in losses)
    assert grads[0].shape == (0, 16) and torch.count_nonzero(grads[1]) == 0


@pytest.mark.parametrize("where", ["student_input", "teacher_weight"])
def test_nan_input_gives_nan_loss(impl, where):
    problem = make_problem(bias=False)
    with torch.no_grad():
        getattr(problem, where).view(-1)[5] = float("nan")
    assert torch.isnan(fused_linear_cosine_distill(*problem.args(), impl=impl))


def test_ignored_tokens_get_zero_gradient_and_do_not_change_the_loss(impl):
    problem = make_problem(tokens=30, ignore_every=3)
    loss = fused_linear_cosine_distill(*problem.args(), impl=impl, chunk_size=7)
    loss.backward()
    ignored = problem.labels == -100
    assert torch.count_nonzero(problem.student_input.grad[ignored]) == 0
    assert torch.count_nonzero(problem.student_input.grad[~ignored]) > 0
    kept = make_problem(tokens=20)
    kept.student_input, kept.teacher_input = problem.student_input[~ignored], problem.teacher_input[~ignored]
    kept.student_weight, kept.teacher_weight = problem.student_weight, problem.teacher_weight
    kept.student_bias, kept.teacher_bias, kept.labels = problem.student_bias, problem.teacher_bias, problem.labels[~ignored]
    assert rel_err(loss, fused_linear_cosine_distill(*kept.args(), impl=impl)) < 1e-6


def test_fp16_gradients_do_not_underflow_at_many_tokens(impl):
    """dlogits are kept unnormalised (1/N goes into the GEMMs); p / N would sit in fp16's subnormals here."""
    problem = make_problem(tokens=1500, hidden_student=8, hidden_teacher=8, vocab_student=64, dtype=torch.float16)
    assert_matches_reference(problem, torch.float16, impl=impl, chunk_size=512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("caps", [(5.0, None), (None, 3.0), (2.5, 4.0)])
@pytest.mark.parametrize("logit_scales", [(1.0, 1.0), (0.5, 2.0)])
def test_logit_softcapping_and_scale(impl, dtype, caps, logit_scales):
    """Gemma-2 style c * tanh(logits / c) on each head, small caps so that tanh really bends, after a
    Cohere style logit scale."""
    options = dict(student_softcap=caps[0], teacher_softcap=caps[1], temperature=1.5,
                   student_logit_scale=logit_scales[0], teacher_logit_scale=logit_scales[1])
    problem = make_problem(dtype=dtype, vocab_teacher=120, ignore_every=4)
    assert_matches_reference(problem, dtype, ref_kwargs=options, impl=impl, chunk_size=10, **options)


@pytest.mark.parametrize("given", [40, 40.0, torch.tensor(40), torch.tensor(40.0), torch.tensor([40.0])],
                         ids=["int", "float", "int tensor", "0-d tensor", "1-element tensor"])
@pytest.mark.parametrize("grad", [True, False])
def test_num_valid_tokens_forms(given, grad):
    """N as a number or a one-element tensor divides the loss on the device and the gradients on the host alike."""
    problem = make_problem(tokens=37, ignore_every=4)
    with torch.set_grad_enabled(grad):
        losses = fused_linear_cosine_distill(*problem.args(), chunk_size=16, return_soft_hard_loss=True,
                                             num_valid_tokens=given)
    ref_losses, ref_grads = reference(problem, num_valid_tokens=40)
    for got, want in zip(losses, ref_losses):
        assert got.dtype == torch.float32 and got.shape == ()
        assert rel_err(got, want) < TOLERANCE[torch.float32][0]
    if grad:
        losses[0].backward()
        for leaf, want in zip(problem.student_leaves(), ref_grads):
            assert rel_err(leaf.grad, want) < TOLERANCE[torch.float32][1]


def copied_on_save():
    """Saved-tensor hooks that keep a copy (as save_on_cpu does for GPU tensors)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor.clone(), lambda tensor: tensor)


@pytest.mark.parametrize("hooks", [None, "allow_mutation_on_saved_tensors", "copied on save"])
@pytest.mark.parametrize("chunk_size", [None, 16])
@pytest.mark.parametrize("changed", ["student_input", "student_weight"])
@pytest.mark.parametrize("batched", [False, True])
def test_the_student_changed_in_place_before_backward_raises(changed, chunk_size, hooks, batched):
    """The last chunk's gradient GEMMs read the live student tensors in backward; as plain torch does, an
    in-place change after the forward raises instead of a gradient that mixes both versions. Under saved-tensor
    hooks autograd does not check (torch's own ops read what the hooks kept): the gradients mixed both versions
    (grad_weight 0.14-0.45 off), and then, for hidden states of shape (batch, length, H) (``batched``: the call
    flattens them to rows, a view no one else held), 2.0 off. A retry raises the same (it said the loss had run
    backward once already)."""
    problem = make_problem(tokens=40)
    args = list(problem.args())
    if batched:
        args[0], args[2], args[4] = args[0].view(4, 10, -1), args[2].view(4, 10, -1), args[4].view(4, 10)
    context = {None: contextlib.nullcontext, "copied on save": copied_on_save,
               "allow_mutation_on_saved_tensors": torch.autograd.graph.allow_mutation_on_saved_tensors}[hooks]
    with context():
        loss = fused_linear_cosine_distill(*args, chunk_size=chunk_size)
        del args
        with torch.no_grad():
            getattr(problem, changed).mul_(3.0)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="modified by an inplace operation" if hooks is None else
                               "modified in place after the loss's forward"):
                loss.backward()


def test_offloading_hooks_free_the_hidden_states_before_backward():
    """Hooks that keep their own copy (save_on_cpu) are there to free the device's: the check of an in-place change
    held the student's hidden states until backward where nothing else did (a frozen head)."""
    problem = make_problem(tokens=40)
    with copied_on_save():
        hidden = problem.student_input * 1.0
        loss = fused_linear_cosine_distill(hidden, problem.student_weight.detach(), *problem.args()[2:5])
        alive = weakref.ref(hidden.untyped_storage())
        del hidden
        assert alive() is None
        loss.backward()
    assert problem.student_input.grad is not None


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_under_saved_tensor_hooks_the_gradients_are_the_plain_ones(chunk_size):
    problem = make_problem(tokens=40)
    want = [grad.clone() for grad in run_fused(problem, chunk_size=chunk_size)[1]]
    for leaf in problem.student_leaves():
        leaf.grad = None
    with copied_on_save():
        got = run_fused(problem, chunk_size=chunk_size)[1]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_batched_grad_outputs_raise_and_leave_the_call_s_backward_to_run():
    """is_grads_batched raised torch's 'Batching rule not implemented for aten::detach' after taking the call's
    gradients, so that a backward after it raised 'backward only once'."""
    problem = make_problem(tokens=40)
    loss = fused_linear_cosine_distill(*problem.args())
    with pytest.raises(RuntimeError, match="one grad_output per backward, not a batch"):
        torch.autograd.grad(loss, problem.student_input, torch.ones(3), retain_graph=True, is_grads_batched=True)
    loss.backward()
    want = reference(problem)[1]
    assert all(rel_err(leaf.grad, grad) < TOLERANCE[torch.float32][1] for leaf, grad in zip(problem.student_leaves(), want))


def test_learned_loss_weights_take_one_call_per_term():
    """Loss weights that require grad raise, and the error's advice works: one call per term, weighted afterwards,
    gives the student the gradient of the weighted loss and each weight its term."""
    problem = make_problem(tokens=40)
    weights = torch.tensor([0.3, 0.7], requires_grad=True)
    with pytest.raises(TypeError, match="call the loss once per term"):
        fused_linear_cosine_distill(*problem.args(), weight_hard_loss=weights[0])
    hard = fused_linear_cosine_distill(*problem.args(), weight_hard_loss=1.0, weight_soft_loss=0.0)
    soft = fused_linear_cosine_distill(*problem.args(), weight_hard_loss=0.0, weight_soft_loss=1.0)
    (weights[0] * hard + weights[1] * soft).backward()
    got = [leaf.grad.clone() for leaf in problem.student_leaves()]
    ref_losses, ref_grads = reference(problem, weight_hard_loss=0.3, weight_soft_loss=0.7)
    assert all(rel_err(a, b) < TOLERANCE[torch.float32][1] for a, b in zip(got, ref_grads))
    _, ref_soft, ref_hard = ref_losses
    assert rel_err(weights.grad, torch.stack([ref_hard, ref_soft]).float()) < TOLERANCE[torch.float32][0]


def test_temperature_does_not_change_the_loss():
    """Cosine is scale-invariant and the hard term uses unscaled logits (as in Liger)."""
    problem = make_problem(tokens=30)
    want = fused_linear_cosine_distill(*problem.args(), return_soft_hard_loss=True)
    for temperature in (0.1, 3.0):
        got = fused_linear_cosine_distill(*problem.args(), temperature=temperature, return_soft_hard_loss=True)
        assert all(rel_err(got_part, want_part) < 1e-6 for got_part, want_part in zip(got, want))


# Bad inputs


def call(problem, **kwargs):
    return fused_linear_cosine_distill(*problem.args(), **kwargs)


def test_mismatched_token_shapes():
    problem = make_problem(tokens=10)
    problem.teacher_input = torch.randn(9, 24)
    with pytest.raises(ValueError, match=r"token shapes differ.*\(10, 16\).*\(9, 24\)"):
        call(problem)
    problem = make_problem(tokens=10, batch=2)  # as many tokens, laid out otherwise
    problem.teacher_input = torch.randn(5, 2, 24)
    with pytest.raises(ValueError, match=r"token shapes differ.*\(2, 5, 16\).*\(5, 2, 24\)"):
        call(problem)


def test_labels_of_other_shape():
    problem = make_problem(tokens=10)
    problem.labels = torch.zeros(11, dtype=torch.long)
    with pytest.raises(ValueError, match=r"true_labels shape \(11,\)"):
        call(problem)


@pytest.mark.parametrize("prefix", ["student", "teacher"])
def test_hidden_size_mismatch(prefix):
    problem = make_problem()
    setattr(problem, f"{prefix}_weight", torch.randn(101, 7))
    with pytest.raises(ValueError, match=rf"{prefix}_input hidden size \d+ .*{prefix}_weight shape \(101, 7\)"):
        call(problem)


@pytest.mark.parametrize("prefix", ["student", "teacher"])
def test_bias_length(prefix):
    problem = make_problem()
    setattr(problem, f"{prefix}_bias", torch.randn(100))
    with pytest.raises(ValueError, match=rf"{prefix}_bias must have shape \(101,\).*got \(100,\)"):
        call(problem)


def test_teacher_vocab_smaller_than_student():
    problem = make_problem(vocab_student=101, bias=False)
    problem.teacher_weight = torch.randn(100, 24)
    with pytest.raises(ValueError, match=r"teacher vocab must be >= student vocab.*\(100, 24\).*\(101, 16\)"):
        call(problem)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.uint16, torch.uint32, torch.uint64])
def test_non_integer_labels(dtype):
    """Also wide unsigned labels, which the torch path's comparisons have no kernel for."""
    problem = make_problem()
    problem.labels = problem.labels.to(dtype)
    with pytest.raises(TypeError, match=rf"true_labels must be an integer tensor \(int8 to int64, or uint8\), got {dtype}"):
        call(problem)


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("shape", ["no student hidden size", "no teacher hidden size", "no vocabulary"])
def test_empty_heads(loss, shape):
    """Each raised deep inside (the Gram path's amax over an empty matrix, the JSD spec's over no columns)."""
    problem = make_problem(bias=False)
    name, weight, message = {
        "no student hidden size": ("student", torch.randn(101, 0), r"student_weight must have a hidden size > 0"),
        "no teacher hidden size": ("teacher", torch.randn(101, 0), r"teacher_weight must have a hidden size > 0"),
        "no vocabulary": ("teacher", torch.randn(0, 24), r"teacher_weight must have at least one row"),
    }[shape]
    setattr(problem, f"{name}_weight", weight)
    if shape == "no vocabulary":
        problem.student_weight = torch.randn(0, 16)
    else:
        setattr(problem, f"{name}_input", torch.randn(*problem.labels.shape, 0))
    function = fused_linear_jsd if loss == "jsd" else fused_linear_cosine_distill
    with pytest.raises(ValueError, match=rf"{message}.* got shape \({weight.shape[0]}, {weight.shape[1]}\)"):
        function(*problem.args(), impl="torch")


@pytest.mark.parametrize("name", ["student_weight", "teacher_weight"])
def test_weights_not_2d(name):
    problem = make_problem()
    setattr(problem, name, getattr(problem, name).detach()[None])
    with pytest.raises(ValueError, match=rf"{name} must be 2-D.*\(1, 101, \d+\)"):
        call(problem)


def test_tensors_on_different_devices():
    problem = make_problem()
    problem.teacher_weight = problem.teacher_weight.to("meta")
    with pytest.raises(ValueError, match="one device.*meta"):
        call(problem)


@pytest.mark.parametrize("chunk_size, error, message", [(0, ValueError, "must be > 0, got 0"),
                                                   (-3, ValueError, "must be > 0, got -3"),
                                                   (2.5, TypeError, "must be an int or None, got float 2.5")])
def test_bad_chunk_size(chunk_size, error, message):
    with pytest.raises(error, match=f"chunk_size {message}"):
        call(make_problem(), chunk_size=chunk_size)


@pytest.mark.parametrize("bad_label", [-1, 101, 10**6])
def test_label_out_of_range(bad_label):
    problem = make_problem()
    problem.labels[3] = bad_label
    with pytest.raises(ValueError, match=rf"outside \[0, 101\).*{bad_label}"):
        call(problem)


def test_input_dtype_differs_from_weight():
    problem = make_problem()
    problem.student_input = problem.student_input.detach().double()
    with pytest.raises(TypeError, match="student_input must be bfloat16, float16 or float32"):
        call(problem)
    problem = make_problem()
    problem.teacher_input = problem.teacher_input.half()
    with pytest.raises(TypeError, match="teacher_input dtype torch.float16 differs from teacher_weight"):
        call(problem)
    # a bias in another dtype than its head failed inside the first GEMM (torch's RuntimeError), after it was queued
    for prefix in ("student", "teacher"):
        problem = make_problem(dtype=torch.bfloat16)
        setattr(problem, f"{prefix}_bias", getattr(problem, f"{prefix}_bias").detach().float())
        with pytest.raises(TypeError, match=f"{prefix}_bias dtype torch.float32 differs from {prefix}_weight dtype "
                                            "torch.bfloat16"):
            call(problem)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss, options", [("cosine", {}), ("cosine", {"cosine_via": "gram"}), ("jsd", {})],
                         ids=["cosine", "cosine via gram", "jsd"])
def test_autocast_leaves_the_loss_in_its_tensors_dtypes(loss, options, dtype):
    """Under torch.autocast the fused loss computes as outside it (docs/reference.md, mixed precision): its GEMMs
    write into its own buffers, which autocast does not cast, and the Gram path's fp32 products turn it off (they
    ran in bf16 under it, 89% off in the soft term, and the W_t^T W_t cached so served later calls too)."""
    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=19, ignore_every=4, dtype=dtype, bias="cosine_via" not in options)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # first: it builds the Gram path's cached matrix
        cast = FUSED_LOSSES[loss](*problem.args(), return_soft_hard_loss=True, **options)
    cast_grads = torch.autograd.grad(cast[0], problem.student_leaves())
    plain = FUSED_LOSSES[loss](*problem.args(), return_soft_hard_loss=True, **options)
    plain_grads = torch.autograd.grad(plain[0], problem.student_leaves())
    problem.teacher_weight = problem.teacher_weight.detach().clone()  # nothing cached for it
    fresh = FUSED_LOSSES[loss](*problem.args(), return_soft_hard_loss=True, **options)
    fresh_grads = torch.autograd.grad(fresh[0], problem.student_leaves())
    for got, plain_value, want in zip([*cast, *cast_grads], [*plain, *plain_grads], [*fresh, *fresh_grads]):
        assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(plain_value, want)


def test_bad_scalars_and_options():
    problem = make_problem()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        call(problem, temperature=0.0)
    with pytest.raises(ValueError, match="student_softcap must be > 0 or None"):
        call(problem, student_softcap=0.0)
    with pytest.raises(ValueError, match="num_valid_tokens must be > 0"):
        call(problem, num_valid_tokens=0)
    for infinite in (math.inf, -math.inf, math.nan):  # a tensor's value too (inf gave loss 0 and zero gradients)
        for given in (infinite, torch.tensor(infinite)):
            with pytest.raises(ValueError, match=f"num_valid_tokens must be finite, got {infinite}"):
                call(problem, num_valid_tokens=given)
    with pytest.raises(ValueError, match="impl must be one of"):
        call(problem, impl="fast")
    with pytest.raises(ValueError, match="impl='cuda' needs a CUDA GPU with thread block clusters"):
        call(problem, impl="cuda")
    with pytest.raises(TypeError, match="accum_dtype"):
        call(problem, accum_dtype=torch.float16)
    with pytest.raises(TypeError, match="student_input must be a torch.Tensor"):
        fused_linear_cosine_distill([1.0], *problem.args()[1:])
    with pytest.raises(TypeError, match="vocab_parallel must be a cosdistill.distributed.VocabParallelOptions, got int"):
        call(problem, vocab_parallel=1)  # an AttributeError before
    problem.student_weight = problem.student_weight.detach().to_sparse()
    with pytest.raises(TypeError, match="student_weight must be a dense"):
        call(problem)  # torch's RuntimeError inside the first GEMM before


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("name, value, error, message", [
    ("weight_hard_loss", "0.5", TypeError, "weight_hard_loss must be a real number, got str"),
    ("weight_soft_loss", float("nan"), ValueError, "weight_soft_loss must be finite, got nan"),
    ("beta", None, TypeError, "beta must be a real number, got NoneType"),
    ("beta", True, TypeError, "beta must be a real number, got bool"),
    ("temperature", float("inf"), ValueError, "temperature must be finite, got inf"),
    ("temperature", float("nan"), ValueError, "temperature must be finite, got nan"),
    ("student_softcap", float("inf"), ValueError, "student_softcap must be finite"),
    ("teacher_logit_scale", float("-inf"), ValueError, "teacher_logit_scale must be finite"),
    ("ignore_index", 1.5, TypeError, "ignore_index must be an int, got float"),
    ("ignore_index", True, TypeError, "ignore_index must be an int, got bool"),
    ("ignore_index", torch.tensor(True), TypeError, "ignore_index must be an int, got Tensor"),
    ("ignore_index", torch.tensor([True]), TypeError, "ignore_index must be an int, got Tensor"),
    ("num_valid_tokens", float("inf"), ValueError, "num_valid_tokens must be finite"),
    ("num_valid_tokens", "8", TypeError, "num_valid_tokens must be a real number, got str"),
    ("num_valid_tokens", torch.tensor([4, 4]), TypeError, r"one-element real tensor, got a torch.int64 tensor of shape \(2,\)"),
    ("num_valid_tokens", torch.tensor(True), TypeError, "one-element real tensor, got a torch.bool tensor"),
    ("weight_hard_loss", 10**400, ValueError, "weight_hard_loss must be finite, got 1000"),  # OverflowError before
    ("num_valid_tokens", 10**400, ValueError, "num_valid_tokens must be finite, got 1000"),  # the plan's key overflowed
    # a learnable weight or beta got no gradient, with only torch's warning
    ("weight_soft_loss", torch.tensor(0.5, requires_grad=True), TypeError, "weight_soft_loss is a tensor that requires grad"),
    ("beta", torch.tensor(0.5, requires_grad=True), TypeError, r"pass beta.detach\(\)"),
])
def test_scalar_options_must_be_finite_numbers(loss, name, value, error, message):
    """A string, bool, None, NaN or infinity is refused by name: cast to a number it would give a NaN or, for
    ignore_index=1.5 or True, silently ignore label 1. The module checks its options when built."""
    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=9)
    with pytest.raises(error, match=message):
        FUSED_LOSSES[loss](*problem.args(), **{name: value})
    if name != "num_valid_tokens":
        module = api.FusedLinearJSDLoss if loss == "jsd" else FusedLinearCosineDistillLoss
        with pytest.raises(error, match=message):
            module(**{name: value})


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("name", ["beta", "temperature", "weight_soft_loss"])
def test_an_option_with_a_forward_mode_tangent_is_refused(loss, name):
    """A forward-mode dual (torch.autograd.forward_ad) as an option was read as its primal: the loss came back with
    no tangent where the spec has d loss / d option, as a reverse-mode one would get no gradient."""
    import torch.autograd.forward_ad as forward_ad

    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=9)
    module_class = api.FusedLinearJSDLoss if loss == "jsd" else FusedLinearCosineDistillLoss
    with forward_ad.dual_level():
        value = forward_ad.make_dual(torch.tensor(0.7, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
        with pytest.raises(TypeError, match=f"{name} is a tensor that requires grad \\(or carries a forward-mode"):
            FUSED_LOSSES[loss](*problem.args(), **{name: value})
        with pytest.raises(TypeError, match="carries a forward-mode tangent"):
            module_class(**{name: value})


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_scalar_options_take_any_real_number_type(loss):
    """Ints, NumPy scalars and one-element tensors give the float's loss; chunk_size takes NumPy's ints too."""
    import numpy as np

    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=9, ignore_every=3)
    want = FUSED_LOSSES[loss](*problem.args(), temperature=2.0, beta=1.0, ignore_index=-100, num_valid_tokens=5,
                              chunk_size=4)
    for kinds in [(2, 1, np.int64(-100), 5, np.int64(4)), (np.float32(2.0), np.float64(1.0), torch.tensor(-100), 5.0, 4),
                  (torch.tensor(2.0), torch.tensor(1.0), -100, torch.tensor(5), np.int32(4))]:
        names = ["temperature", "beta", "ignore_index", "num_valid_tokens", "chunk_size"]
        got = FUSED_LOSSES[loss](*problem.args(), **dict(zip(names, kinds)))
        assert torch.equal(got, want), kinds


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_a_teacher_input_that_requires_grad_is_refused(loss):
    """The teacher is frozen: a teacher_input in the autograd graph would silently get no gradient (and keep the
    teacher's activations alive), so it raises. Detached, or under no_grad, it runs; a teacher weight that
    requires grad (a frozen model's parameter left trainable) is read as a constant and gets no gradient."""
    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=11)
    problem.teacher_input = problem.teacher_input.detach().requires_grad_()
    with pytest.raises(ValueError, match=r"teacher_input \(11, 24\) requires grad, but the teacher is frozen"):
        FUSED_LOSSES[loss](*problem.args())
    with torch.no_grad():
        FUSED_LOSSES[loss](*problem.args())
    problem.teacher_input = problem.teacher_input.detach()
    problem.teacher_weight = problem.teacher_weight.detach().requires_grad_()
    FUSED_LOSSES[loss](*problem.args()).backward()
    assert problem.teacher_weight.grad is None and problem.student_weight.grad is not None


@pytest.mark.parametrize("chunk_size", [16, None])
@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_create_graph_is_refused(loss, chunk_size):
    """The gradients come from forward's pass: differentiated again (a gradient penalty, a Hessian-vector product),
    the loss's share would silently be zero (a penalty's gradient came out 91-100% off)."""
    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem()
    value = FUSED_LOSSES[loss](*problem.args(), chunk_size=chunk_size) + (problem.student_input**2).sum()
    with pytest.raises(RuntimeError, match="differentiable once: backward with create_graph=True"):
        torch.autograd.grad(value, problem.student_input, create_graph=True)


def test_backward_twice_is_refused():
    problem = make_problem()
    loss = call(problem)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward only once"):
        loss.backward()


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
@pytest.mark.parametrize("tokens, batch, ignore_every", [(40, 2, 0), (40, 2, 3), (40, 2, 1), (0, None, 0), (0, 2, 0)])
def test_the_float64_reference_in_passes_equals_one_pass(monkeypatch, loss, tokens, batch, ignore_every):
    """The test oracle runs the naive version a few tokens at a time with the whole batch's N (so that the
    seed workload's fits an 80 GB GPU); its sums equal one pass over the whole batch, empty batches included."""
    problem = make_problem(tokens=tokens, batch=batch, ignore_every=ignore_every)
    options = dict(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=0.4, temperature=1.7)
    upcast = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in problem.args()]
    whole = NAIVE_LOSSES[loss](*upcast, **options)
    (whole[0] * 0.5).backward()
    monkeypatch.setattr(testing, "REFERENCE_ROWS", 7)
    losses, grads = testing.float64_reference(problem.args(), 0.5, loss, **options)
    for ours, expected in zip(losses, whole):
        assert rel_err(ours, expected) < 1e-12, (ours, expected)
    for ours, leaf in zip(grads, [upcast[0], upcast[1], upcast[5]]):
        assert ours.shape == leaf.shape and rel_err(ours, leaf.grad) < 1e-12


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_options_given_as_tensors_are_read_at_every_call(loss):
    """A one-element tensor option (a schedule kept in a tensor and updated in place) gives, at each call, the loss
    of its current value: checked options are reused across calls only where every value is a number."""
    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=9, ignore_every=3)
    function, module_class = FUSED_LOSSES[loss], api.FusedLinearJSDLoss if loss == "jsd" else FusedLinearCosineDistillLoss
    before = dict(weight_soft_loss=0.5, beta=0.5, temperature=2.0, ignore_index=-100)
    problem.labels[problem.labels == -100] = 7  # ignored once ignore_index becomes 7
    after = dict(weight_soft_loss=0.2, beta=0.9, temperature=3.0, ignore_index=7)
    want_before = function(*problem.args(), **before)
    for name in before:
        want_after = function(*problem.args(), **{**before, name: after[name]})
        assert (loss, name) == ("cosine", "temperature") or not torch.equal(want_before, want_after), name
        # float64: the option's value exactly (a float32 0.9 is another beta, whose loss differs in its last bit
        # for some problems)
        tensors = {name: torch.tensor(before[name], dtype=torch.float64 if isinstance(before[name], float) else None)}
        module = module_class(**{**before, **tensors})
        assert torch.equal(function(*problem.args(), **{**before, **tensors}), want_before), name
        assert torch.equal(module(*problem.args()), want_before), name
        tensors[name].fill_(after[name])
        assert torch.equal(function(*problem.args(), **{**before, **tensors}), want_after), name
        assert torch.equal(module(*problem.args()), want_after), name


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_module_options_assigned_after_construction_take_effect(loss):
    """As in Liger's modules, the options are attributes: one assigned between calls (a beta or weight schedule) is
    checked when assigned and used by the next call; a bad value raises, naming it, and leaves the module as it was."""
    from cosdistill.testing import FUSED_LOSSES

    problem = make_problem(tokens=9, ignore_every=3)
    module_class = api.FusedLinearJSDLoss if loss == "jsd" else FusedLinearCosineDistillLoss
    module = module_class(beta=0.5, weight_soft_loss=0.5)
    assert module.beta == 0.5 and module.options.beta == 0.5
    module.beta, module.weight_soft_loss, module.temperature = 1.0, 0.25, 3.0
    assert module.beta == 1.0 and module.options.beta == 1.0
    want = FUSED_LOSSES[loss](*problem.args(), beta=1.0, weight_soft_loss=0.25, temperature=3.0)
    assert torch.equal(module(*problem.args()), want)
    with pytest.raises(ValueError, match="temperature must be > 0, got -1"):
        module.temperature = -1.0
    with pytest.raises(TypeError, match="beta must be a real number, got str"):
        module.beta = "0.5"
    assert module.temperature == 3.0 and module.beta == 1.0
    assert torch.equal(module(*problem.args()), want)


@pytest.mark.parametrize("entry", [api.fused_linear_cosine_distill, api.fused_linear_jsd,
                                   api.FusedLinearCosineDistillLoss, api.FusedLinearJSDLoss])
def test_every_entry_point_takes_every_option_with_the_options_defaults(entry):
    """The options are written out in each public signature, as Liger's are: each takes every Options field but the
    loss's name (and the JSD the Gram path's switch), with Options' default, so that the copies cannot drift."""
    fields = {field.name: field.default for field in dataclasses.fields(testing.Options)}
    del fields["loss"]
    if "jsd" in entry.__name__.lower():
        del fields["cosine_via"]
    parameters = inspect.signature(entry).parameters
    assert {name: parameters[name].default for name in fields if name in parameters} == fields


@pytest.mark.parametrize("loss", [fused_linear_cosine_distill, fused_linear_jsd])
@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "grad, teacher weight made inside"])
def test_torch_func_transforms_are_a_clear_error(loss, transform):
    """The losses differentiate in reverse mode only; under torch.func the kernels and GEMMs into buffers raised
    internal errors that named no transform. Also after a plan was cached for the same shapes."""
    p = make_problem(tokens=6, hidden_student=8, hidden_teacher=16, vocab_student=11, vocab_teacher=13)
    args = (p.student_input, p.student_weight, p.teacher_input, p.teacher_weight, p.labels)
    loss(*args)

    def of_weight(weight):
        return loss(args[0], weight, *args[2:])

    def of_input_with_a_teacher_weight_made_inside(student_input):  # a cast, say: the Gram cache's choice asked it
        return loss(student_input, args[1], args[2], args[3] * 1.0, *args[4:])

    calls = {"grad": lambda: torch.func.grad(of_weight)(args[1]),
             "vmap": lambda: torch.func.vmap(lambda x: loss(x, *args[1:]))(args[0][None].expand(2, -1, -1)),
             "jvp": lambda: torch.func.jvp(of_weight, (args[1],), (torch.ones_like(args[1]),)),
             "grad, teacher weight made inside": lambda: torch.func.grad(of_input_with_a_teacher_weight_made_inside)(
                 args[0])}
    with pytest.raises(TypeError, match="is a tensor of a torch.func transform"):
        calls[transform]()


def test_a_num_valid_tokens_that_requires_grad_is_an_error():
    """The loss gives N no gradient (it is a count), as it gives its options none: a tensor N that requires grad raises
    rather than have its gradient silently dropped; detached, or with grad mode off, it runs."""
    p = make_problem(tokens=6, hidden_student=8, hidden_teacher=16, vocab_student=11, vocab_teacher=13)
    args = (p.student_input, p.student_weight, p.teacher_input, p.teacher_weight, p.labels)
    count = torch.tensor(4.0, requires_grad=True)
    fused_linear_jsd(*args, num_valid_tokens=count.detach())  # a plan cached for a tensor N first
    with pytest.raises(TypeError, match="num_valid_tokens is a tensor that requires grad"):
        fused_linear_jsd(*args, num_valid_tokens=count)
    with torch.no_grad():
        fused_linear_jsd(*args, num_valid_tokens=count)


@pytest.mark.parametrize("module_class", [FusedLinearCosineDistillLoss, api.FusedLinearJSDLoss])
def test_a_misspelled_option_on_a_module_raises(module_class):
    """An assigned name close to an option of the module, or another loss's option, would be kept as a plain attribute
    and change nothing: it raises, naming the closest option; a name far from every option is kept, as on any module
    (torch.ao's propagate_qconfig_ sets qconfig on every submodule, which raised). An option assigned as a Parameter
    without grad takes effect (nn.Module would have registered it, clashing with the option); one that requires grad
    raises as in the constructor."""
    module = module_class()
    with pytest.raises(AttributeError, match="has no option 'temprature' \\(did you mean 'temperature'\\?\\)"):
        module.temprature = 4.0
    with pytest.raises(AttributeError, match="has no option 'weight_hard'"):
        module.weight_hard = 0.0
    # the options of another loss were kept, ignored
    for other_loss_option in ("loss", "cosine_via") if module_class is api.FusedLinearJSDLoss else ("loss",):
        with pytest.raises(AttributeError, match=f"has no option '{other_loss_option}'"):
            setattr(module, other_loss_option, "gram")
    module.temperature = torch.nn.Parameter(torch.tensor(2.0), requires_grad=False)
    problem = make_problem(tokens=9)
    want = module_class(temperature=2.0)(*problem.args())
    assert torch.equal(module(*problem.args()), want)
    with pytest.raises(TypeError, match="temperature is a tensor that requires grad"):
        module.temperature = torch.nn.Parameter(torch.tensor(3.0))
    module.compiled, module.return_soft_hard_loss = True, True  # Liger's other attributes stay assignable
    module.qconfig = None  # a name far from every option, as passes over every submodule set (propagate_qconfig_)
    assert module.qconfig is None
    module.eval()
    assert len(module(*problem.args())) == 3


def test_a_modules_repr_shows_the_options_it_was_given_and_assigned():
    module = api.FusedLinearJSDLoss(beta=0.1, temperature=2.0)
    assert repr(module) == "FusedLinearJSDLoss(beta=0.1, temperature=2.0)"
    module.beta, module.return_soft_hard_loss = 0.5, True  # back at its default: not shown
    assert repr(module) == "FusedLinearJSDLoss(temperature=2.0, return_soft_hard_loss=True)"
    module = FusedLinearCosineDistillLoss(weight_hard_loss=torch.tensor(0.25), impl="torch")
    assert repr(module) == "FusedLinearCosineDistillLoss(weight_hard_loss=tensor(0.2500), impl='torch')"
