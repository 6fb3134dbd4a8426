"""torch.compile: the loss runs as the custom op cosdistill::fused_linear_distill (_compile.py),
with no graph break under fullgraph=True and the numbers of eager."""

import shutil
import warnings

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from conftest import make_problem, record_write_grad, rel_err
from cosdistill import fused_linear_cosine_distill, fused_linear_jsd
from cosdistill.testing import (
    REAL_OPTIONS,
    Options,
    compiled_distill,
    fused_linear_distill_op,
    plan,
    real_options_tensor,
)

TOL = 1e-5  # fp32, compiled against eager


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # every test starts with no cached graphs (and far from the recompile limit)
    yield
    torch._dynamo.reset()


def op_kwargs(needs_grad, **overrides):
    """The op's keywords: Options' fields as its schema takes them (the real ones in ``real_options``)."""
    fields = dict(ignore_index=-100, chunk_size=8, accum_dtype=None, impl="torch", teacher_precision=None,
                  student_softcap=None, teacher_softcap=None)
    reals = {name: overrides.pop(name) for name in REAL_OPTIONS if name in overrides}
    kwargs = dict(num_valid_count=None, real_options=real_options_tensor(Options(**fields, **reals)),
                  needs_grad=list(needs_grad), **fields)
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize(
    "dtype, bias, needs_grad, overrides",
    [
        (torch.float32, True, (True, True, True), {}),
        (torch.float32, False, (True, True, False), dict(chunk_size=None, accum_dtype=torch.float32)),
        (torch.float32, True, (False, True, False), dict(weight_hard_loss=0.2, weight_soft_loss=1.3, beta=0.7, temperature=2.0)),
        (torch.float32, True, (False, False, False), dict(num_valid_count=torch.tensor(50.0, dtype=torch.float64))),
        (torch.bfloat16, True, (True, True, True), dict(accum_dtype=torch.float32, student_softcap=3.0)),
        (torch.float32, False, (True, True, False), dict(cosine_via="gram", chunk_size=5)),
    ],
)
def test_opcheck(dtype, bias, needs_grad, overrides):
    """Schema, fake implementation, autograd registration and AOT dispatch (static and dynamic shapes)."""
    problem = make_problem(tokens=29, bias=bias, ignore_every=3, dtype=dtype)
    student = [None if t is None else t.detach().requires_grad_(need)
               for t, need in zip((problem.student_input, problem.student_weight, problem.student_bias), needs_grad)]
    args = (student[0], student[1], student[2], problem.teacher_input, problem.teacher_weight, problem.teacher_bias,
            problem.labels, None)
    torch.library.opcheck(fused_linear_distill_op, args, op_kwargs(needs_grad, **overrides))


@pytest.mark.parametrize("needs_grad", [(True, True, False), (False, False, False)])
def test_op_tells_chunk_rows_whether_gradients_are_wanted(needs_grad, monkeypatch):
    seen = record_write_grad(monkeypatch, plan)  # the op runs plan.loss_and_grads
    problem = make_problem(tokens=12, bias=False)
    args = (problem.student_input.detach(), problem.student_weight.detach(), None, problem.teacher_input,
            problem.teacher_weight, None, problem.labels, None)
    fused_linear_distill_op(*args, **op_kwargs(needs_grad))
    assert seen == [any(needs_grad)]


def test_opcheck_num_valid_tokens_tensor_and_no_tokens():
    problem = make_problem(tokens=12, bias=False)
    args = (problem.student_input.detach().requires_grad_(), problem.student_weight.detach().requires_grad_(), None,
            problem.teacher_input, problem.teacher_weight, None, problem.labels, torch.tensor(30))
    torch.library.opcheck(fused_linear_distill_op, args, op_kwargs((True, True, False)))
    empty = make_problem(tokens=0, bias=False)
    args = (empty.student_input.detach().requires_grad_(), empty.student_weight.detach().requires_grad_(), None,
            empty.teacher_input, empty.teacher_weight, None, empty.labels, None)
    torch.library.opcheck(fused_linear_distill_op, args, op_kwargs((True, True, False)))


class TinyStudent(torch.nn.Module):
    """A body (Linear + tanh) feeding the fused loss through its LM head."""

    def __init__(self, hidden, vocab, bias):
        super().__init__()
        self.body = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=bias)
        with torch.no_grad():
            self.head.weight.mul_(4.0)  # logits of a few units

    def forward(self, inputs, teacher_input, teacher_weight, labels, teacher_bias, **loss_options):
        hidden = torch.tanh(self.body(inputs))
        return fused_linear_cosine_distill(
            hidden, self.head.weight, teacher_input, teacher_weight, labels, self.head.bias, teacher_bias,
            return_soft_hard_loss=True, **loss_options,
        )


def make_step_problem(bias=True, batch=None, tokens=36, ignore_every=4, **kwargs):
    torch.manual_seed(0)
    problem = make_problem(tokens=tokens, bias=bias, batch=batch, ignore_every=ignore_every, **kwargs)
    student = TinyStudent(problem.student_weight.shape[1], problem.student_weight.shape[0], bias)
    student.to(problem.student_weight.dtype)
    inputs = problem.student_input.detach().clone().requires_grad_()
    data = (inputs, problem.teacher_input, problem.teacher_weight, problem.labels, problem.teacher_bias)
    return student, data


def run_step(forward, student, data, grad_output, **loss_options):
    """One training step: forward (possibly compiled), backward of grad_output * loss, the gradients."""
    student.zero_grad(set_to_none=True)
    data[0].grad = None
    losses = forward(student, *data, **loss_options)
    (losses[0] * grad_output).backward()
    grads = {name: param.grad.clone() for name, param in student.named_parameters()}
    grads["inputs"] = data[0].grad.clone()
    return [loss.detach() for loss in losses], grads


def assert_same(eager, compiled, tol=TOL):
    (eager_losses, eager_grads), (compiled_losses, compiled_grads) = eager, compiled
    for name, want, got in zip(("loss", "soft", "hard"), eager_losses, compiled_losses):
        assert got.dtype == torch.float32 and got.shape == ()
        assert rel_err(got, want) < tol, (name, got.item(), want.item())
    assert eager_grads.keys() == compiled_grads.keys()
    for name, want in eager_grads.items():
        got = compiled_grads[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


def compiled_forward(backend="aot_eager", **compile_options):
    return torch.compile(TinyStudent.__call__, fullgraph=True, backend=backend, **compile_options)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [None, 3])
def test_compiled_step_matches_eager(bias, batch):
    student, data = make_step_problem(bias=bias, batch=batch, vocab_teacher=131)
    options = dict(chunk_size=8, impl="torch")
    eager = run_step(TinyStudent.__call__, student, data, 0.3, **options)
    compiled = run_step(compiled_forward(), student, data, 0.3, **options)
    assert_same(eager, compiled)


def test_compiled_step_options():
    """Loss weights, beta, temperature, num_valid_tokens (a number and a tensor), softcaps, the Triton row step."""
    student, data = make_step_problem(batch=2, ignore_every=3)
    forward = compiled_forward()
    for options in (
        dict(weight_hard_loss=0.3, weight_soft_loss=1.7, beta=0.8, temperature=2.5, chunk_size=5),
        dict(num_valid_tokens=50, accum_dtype=torch.float32),
        dict(num_valid_tokens=torch.tensor(40.0), chunk_size=None),
        dict(student_softcap=3.0, teacher_softcap=5.0, chunk_size=7),
        dict(impl="triton", chunk_size=16),
    ):
        eager = run_step(TinyStudent.__call__, student, data, -1.5, **options)
        assert_same(eager, run_step(forward, student, data, -1.5, **options))


def test_compiled_gram_path_matches_eager():
    student, data = make_step_problem(bias=False, batch=3, vocab_teacher=131)
    for options in (dict(cosine_via="gram", chunk_size=8), dict(cosine_via="gram", impl="triton", temperature=2.0)):
        eager = run_step(TinyStudent.__call__, student, data, 0.7, **options)
        assert_same(eager, run_step(compiled_forward(), student, data, 0.7, **options))


def test_bf16():
    """Scaling by grad_output rounds as eager does (a bf16 ulp off on every element, ~4e-3, would fail),
    except a bf16 grad_weight accumulator: eager folds grad_output into its last GEMM, compiled
    rounds that GEMM's result to bf16 and then the product once more."""
    student, data = make_step_problem(batch=3, dtype=torch.bfloat16)
    forward = compiled_forward()
    for accum_dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 1e-2)):
        options = dict(chunk_size=8, accum_dtype=accum_dtype)
        eager = run_step(TinyStudent.__call__, student, data, 0.3, **options)
        assert_same(eager, run_step(forward, student, data, 0.3, **options), tol=tol)


def test_teacher_weight_that_requires_grad_gets_none():
    """The teacher is frozen in both paths, even when its weight is a Parameter that requires grad."""
    student, data = make_step_problem()
    data[2].requires_grad_()
    for forward in (TinyStudent.__call__, compiled_forward()):
        run_step(forward, student, data, 1.0, chunk_size=8)
        assert data[2].grad is None


def test_soft_and_hard_carry_no_grad():
    student, data = make_step_problem()
    loss, soft, hard = compiled_forward()(student, *data)
    assert loss.requires_grad and not soft.requires_grad and not hard.requires_grad


@pytest.mark.parametrize("grad_output, num_valid_tokens, zero_row", [(65536.0, 3e6, False), (1e-3, None, True)],
                         ids=["loss scale, small entries", "small grad_output, a zero student row"])
def test_compiled_fp16_gradients_are_eager_s(grad_output, num_valid_tokens, zero_row):
    """fp16 grad_input left the op rounded at grad_output = 1, where eager applies grad_output first: a loss
    scale's small entries were lost (18% off) and a small grad_output's large ones (a zero row's) stayed inf."""
    problem = make_problem(tokens=32, dtype=torch.float16, bias=not zero_row)  # a bias would make its logits nonzero
    if zero_row:
        with torch.no_grad():
            problem.student_input[3] = 0.0

    def step(*args):
        return fused_linear_cosine_distill(*args, num_valid_tokens=num_valid_tokens) * grad_output

    step(*problem.args()).backward()
    eager = [leaf.grad.clone() for leaf in problem.student_leaves()]
    for leaf in problem.student_leaves():
        leaf.grad = None
    torch.compile(step, backend="aot_eager", fullgraph=True)(*problem.args()).backward()
    for leaf, want in zip(problem.student_leaves(), eager):
        assert leaf.grad.dtype == want.dtype and torch.equal(leaf.grad, want)


def test_a_count_that_changes_every_call_compiles_the_step_once_more_not_each_time():
    """num_valid_tokens as a Python int that changes every step (a global token count): the op took it as a float
    of its schema, so each value compiled the step again, and fullgraph=True failed at Dynamo's recompile limit."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounter()
    problem = make_problem(tokens=16, bias=False)
    step = torch.compile(lambda *args, count: fused_linear_cosine_distill(*args, num_valid_tokens=count), backend=counter,
                         fullgraph=True)
    for count in range(10, 22):
        got = step(*problem.args(), count=count)
    assert counter.frame_count <= 2
    assert torch.equal(got, fused_linear_cosine_distill(*problem.args(), num_valid_tokens=21))
    for count in range(10, 22):  # a float (a global count over the world size): scalar_tensor specialized on it
        got = step(*problem.args(), count=count / 3)
    assert counter.frame_count <= 4
    assert torch.equal(got, fused_linear_cosine_distill(*problem.args(), num_valid_tokens=7.0))


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic dynamic", "dynamic"])
def test_ignore_index_as_an_argument_compiles_with_fullgraph(dynamic):
    """ignore_index passed to a compiled step: from its second value (or at once with dynamic=True) Dynamo takes it
    as a symbolic int, on which the options' bool check, getattr(ignore_index, "dtype"), was untraceable: fullgraph
    raised Unsupported. Each value's loss and gradients are eager's."""
    problem = make_problem(tokens=16, bias=False)
    step = torch.compile(lambda *args, ignore: fused_linear_jsd(*args, ignore_index=ignore), backend="aot_eager",
                         fullgraph=True, dynamic=dynamic)
    for ignore in (-100, 7, -1):
        labels = problem.labels.clone()
        labels[::3] = ignore
        args = (*problem.args()[:4], labels)
        got = step(*args, ignore=ignore)
        got_grads = torch.autograd.grad(got, problem.student_leaves())
        want = fused_linear_jsd(*args, ignore_index=ignore)
        want_grads = torch.autograd.grad(want, problem.student_leaves())
        assert rel_err(got, want) < TOL
        for got_grad, want_grad in zip(got_grads, want_grads):
            assert rel_err(got_grad, want_grad) < TOL


@pytest.mark.parametrize("loss", ["cosine", "jsd"])
def test_options_on_a_schedule_compile_the_step_once_more_not_each_time(loss):
    """Weights, beta, temperature and logit scales that change every step (a schedule): the op took them as floats
    of its schema, so each value compiled the step again, and fullgraph=True failed at Dynamo's recompile limit.
    The numbers stay eager's, and a bad value still raises the eager message once the floats are symbolic."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    problem = make_problem(tokens=16, bias=True, ignore_every=3)

    fused = fused_linear_jsd if loss == "jsd" else fused_linear_cosine_distill

    def step(*args, weight, beta, temperature, scale):
        return fused(*args, weight_hard_loss=1 - weight, weight_soft_loss=weight, beta=beta, temperature=temperature,
                     student_logit_scale=scale, teacher_logit_scale=2 - scale)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i in range(12):
        schedule = dict(weight=0.05 + 0.08 * i, beta=0.09 * i, temperature=0.5 + 0.25 * i, scale=1 + 0.01 * i)
        got = compiled(*problem.args(), **schedule)
        got_grads = torch.autograd.grad(got, problem.student_leaves())
        want = step(*problem.args(), **schedule)
        want_grads = torch.autograd.grad(want, problem.student_leaves())
        assert rel_err(got, want) < TOL
        assert all(rel_err(a, b) < TOL for a, b in zip(got_grads, want_grads))
    assert counter.frame_count <= 2
    with pytest.raises(Exception, match="temperature must be > 0, got -1.0"):
        compiled(*problem.args(), weight=0.5, beta=0.5, temperature=-1.0, scale=1.0)


def test_a_module_s_options_on_a_schedule_compile_once_per_option_whatever_their_type():
    """A loss module's options set between steps to a schedule's values, ints at its ends (``min(1, step / 4)``): each
    flip between int and float compiled the step again, so that eight changes of three options reached Dynamo's
    recompile limit (fullgraph=True raised; without it the model ran eagerly from then on). The module keeps ints as
    floats: one compile more per option changed."""
    import torch._dynamo.testing

    from cosdistill import FusedLinearJSDLoss

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    problem = make_problem(tokens=16, bias=True, ignore_every=3)
    module = FusedLinearJSDLoss()
    compiled = torch.compile(lambda *args: module(*args), backend=counter, fullgraph=True)
    schedule = [dict(beta=0.5), dict(beta=0), dict(beta=1), dict(beta=0.25), dict(weight_hard_loss=0, weight_soft_loss=1),
                dict(weight_hard_loss=1, weight_soft_loss=0), dict(weight_hard_loss=0.3, weight_soft_loss=0.7),
                dict(temperature=2), dict(temperature=0.5), dict(temperature=1), dict(beta=0)]
    for values in schedule:
        for name, value in values.items():
            setattr(module, name, value)
        got = compiled(*problem.args())
        want = module(*problem.args())
        assert rel_err(got, want) < TOL
        assert all(rel_err(a, b) < TOL for a, b in zip(torch.autograd.grad(got, problem.student_leaves()),
                                                      torch.autograd.grad(want, problem.student_leaves())))
    assert counter.frame_count <= 4  # the first, then beta, the weights, temperature
    assert module.beta == 0 and type(module.beta) is float


def test_a_compiled_loss_refuses_double_backward():
    """Differentiating the compiled loss's gradients again raises (torch's own refusal), as eager's create_graph
    does: their gradients would otherwise miss the loss's second-order part."""
    problem = make_problem()
    compiled = torch.compile(lambda *args: fused_linear_cosine_distill(*args) + (args[0] ** 2).sum(),
                             backend="aot_eager", fullgraph=True)
    (grad_input,) = torch.autograd.grad(compiled(*problem.args()), problem.student_input, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (grad_input**2).sum().backward()


def test_compiled_under_no_grad():
    student, data = make_step_problem(bias=False)
    with torch.no_grad():
        want = TinyStudent.__call__(student, *data, chunk_size=8)
        got = compiled_forward()(student, *data, chunk_size=8)
    for expected, actual in zip(want, got):
        assert not actual.requires_grad and rel_err(actual, expected) < TOL


def test_dynamic_shapes():
    forward = compiled_forward(dynamic=True)
    for tokens in (36, 21):
        student, data = make_step_problem(tokens=tokens)
        eager = run_step(TinyStudent.__call__, student, data, 0.7, chunk_size=8)
        assert_same(eager, run_step(forward, student, data, 0.7, chunk_size=8))


def test_no_graph_break():
    student, data = make_step_problem(batch=2)
    explanation = torch._dynamo.explain(TinyStudent.__call__)(student, *data, chunk_size=8)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    ops = [node.target for graph in explanation.graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.cosdistill.fused_linear_distill.default in ops


def _backward_traceable():
    """Whether Dynamo can trace Tensor.backward() inside a fullgraph region on this torch."""
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        return False
    weight = torch.ones(3, requires_grad=True)

    def probe():
        (weight * 2).sum().backward()

    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            torch.compile(probe, fullgraph=True, backend="eager")()
        return True
    except torch._dynamo.exc.Unsupported:
        return False
    finally:
        torch._dynamo.reset()


def test_whole_step_with_backward_in_one_graph():
    """forward, loss * grad_output and backward all in one fullgraph region (Dynamo's trace_autograd_ops)."""
    if not _backward_traceable():
        pytest.skip("this torch's Dynamo cannot trace Tensor.backward() (config.trace_autograd_ops)")
    student, data = make_step_problem(batch=3)

    def step(student, *data):
        loss, soft, hard = student(*data, chunk_size=8)
        (loss * 0.3).backward()
        return loss.detach(), soft, hard

    def run(step_fn):
        student.zero_grad(set_to_none=True)
        data[0].grad = None
        losses = step_fn(student, *data)
        grads = {name: param.grad.clone() for name, param in student.named_parameters()}
        grads["inputs"] = data[0].grad.clone()
        return list(losses), grads

    eager = run(step)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    assert_same(eager, compiled)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor():
    """One case with the default backend (slow on the CPU: about 40 s to compile on 2 cores). Its caches
    are off: their keys miss edits to the op's Python backward, so a stale graph could pass."""
    student, data = make_step_problem(batch=3, ignore_every=5)
    eager = run_step(TinyStudent.__call__, student, data, 0.3, chunk_size=8)
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled = run_step(compiled_forward("inductor"), student, data, 0.3, chunk_size=8)
    assert_same(eager, compiled)


def test_bad_labels_raise_inside_compiled_step():
    """The op's body runs eagerly at run time, so the label check raises the eager ValueError."""
    student, data = make_step_problem()
    forward = compiled_forward()
    forward(student, *data, chunk_size=8)  # compiles with good labels
    data[3][5] = 101
    with pytest.raises(ValueError, match=r"true_labels has 1 labels outside \[0, 101\).*\[101\]"):
        forward(student, *data, chunk_size=8)
    data[3][5] = -3
    with pytest.raises(ValueError, match=r"outside \[0, 101\).*\[-3\]"):
        forward(student, *data, chunk_size=8)
    data[3][5] = 0
    with pytest.raises(ValueError, match="num_valid_tokens must be > 0"):
        forward(student, *data, chunk_size=8, num_valid_tokens=torch.tensor(0))


def test_bad_options_raise_at_trace_time():
    """Shape/dtype/option checks run while tracing: fullgraph=True reports them through Dynamo's
    Unsupported('Observed exception') carrying the eager message; without fullgraph Dynamo falls
    back to eager, which raises the ValueError itself."""
    student, data = make_step_problem()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        torch.compile(TinyStudent.__call__, backend="aot_eager")(student, *data, temperature=0.0)
    with pytest.raises(ValueError, match="cosine_via must be one of"):
        torch.compile(TinyStudent.__call__, backend="aot_eager")(student, *data, cosine_via="gramm")
    with pytest.raises(ValueError, match="temperature must be finite"):
        torch.compile(TinyStudent.__call__, backend="aot_eager")(student, *data, temperature=float("nan"))
    with pytest.raises(ValueError, match="teacher_input .* requires grad, but the teacher is frozen"):
        torch.compile(TinyStudent.__call__, backend="aot_eager")(student, data[0], data[1].detach().requires_grad_(),
                                                                          *data[2:])
    torch._dynamo.reset()
    with pytest.raises((torch._dynamo.exc.Unsupported, ValueError)) as raised:
        compiled_forward()(student, *data, temperature=0.0)
    messages, error = [], raised.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("temperature must be > 0" in message for message in messages), messages


def test_the_compiled_op_returns_the_forward_time_gradient_of_a_student_changed_before_backward():
    """The op computes its gradients in forward (_compile.py): a later change of the student does not reach them."""
    problem = make_problem(tokens=40, bias=False)
    want = torch.autograd.grad(fused_linear_cosine_distill(*problem.args()), problem.student_leaves())
    loss = compiled_distill(Options(), *problem.args())
    with torch.no_grad():
        problem.student_input.mul_(3.0)
    got = torch.autograd.grad(loss, problem.student_leaves())
    for got_grad, want_grad in zip(got, want):
        torch.testing.assert_close(got_grad, want_grad)


def test_a_compiled_call_builds_its_options_without_the_eager_cache():
    """options_of's lru_cache is for eager calls: Dynamo traced through it and warned of "silent incorrectness" at
    a user's compile. Under compile the options are built once per trace anyway."""
    getattr(torch._dynamo.utils, "warn_once_cache", set()).clear()
    torch._dynamo.reset()
    student, data = make_step_problem(batch=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_step(compiled_forward(), student, data, 1.0, chunk_size=8)
    assert not [str(warning.message) for warning in caught if "lru_cache" in str(warning.message)]
