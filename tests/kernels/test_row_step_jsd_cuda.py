"""The generalized JSD's CUDA cluster row step (kernels/row_step_jsd_cuda.py) on the CPU: each of its forms
compiles for Hopper with NVRTC without local memory, some layout of every vocabulary compiles without a spill,
and it is dispatched only where it computes exactly the spec. Its results are checked on the H200 by the gpu
tests (tests/gpu/test_gpu_check.py, pytest -m gpu)."""

import dataclasses
import itertools

import pytest
import torch
from test_row_step_cuda import plain_case, unsupported

from cosdistill.testing import RowStepConstants, kernels, row_step_jsd_torch
from kernel_compile import nvrtc_compile, spill_bytes

jsd_cuda, row_step_cuda = kernels.row_step_jsd_cuda, kernels.row_step_cuda

PLAIN = RowStepConstants(weight_hard=0.4, weight_soft=0.6, beta=0.5, temperature=1.5, ignore_index=-100)
FORMS = list(itertools.product((0, 1, 2), (True, False)))  # MODE (FORWARD, REVERSE, MIXED), SHARED (T == 1)


@pytest.mark.parametrize("mode, shared", FORMS)
def test_every_form_compiles_for_hopper_without_local_memory(mode, shared):
    layout = jsd_cuda.candidate_layouts(128256, mode)[-1]  # no register vectors, so no register cap
    ptx = nvrtc_compile(jsd_cuda.source(128256, torch.int64, layout, mode, shared))
    assert f".reqnctapercluster {layout.cluster}, 1, 1" in ptx and ".local" not in ptx
    assert ptx.count("cp.async.cg.shared.global") >= 2 and ptx.count("ld.shared::cluster") >= 2  # two exchanges
    assert "st.global.v4" in ptx  # the gradient, eight logits a store
    # the unrolled passes' logarithms: MIXED keeps the mixture's from its sums' pass for the gradient's
    vecs_per_thread = -(-row_step_cuda._slice_vecs(128256, layout.cluster) // layout.threads)
    pairs_per_thread = 8 * vecs_per_thread
    assert ptx.count("lg2.approx") == (pairs_per_thread if mode == 2 else 0)
    # and their exponentials: per pair, one per statistics' stream (the student's at T and, unless T = 1, at 1; the
    # teacher's), then the sums' and the gradient's own; per merge of two streams' sums, one each (the sum at the
    # larger maximum stays): one per vector of pass 1 and per level of the three five-level shuffle reductions
    streams = 2 if shared else 3
    sums = {0: 3 - shared, 1: 1, 2: 2}[mode]  # forward KL writes its gradient here
    grad = 0 if mode == 0 else 2 - shared
    assert ptx.count("ex2.approx") == pairs_per_thread * (streams + sums + grad) + (vecs_per_thread + 15) * streams


def test_launch_configs_follow_the_sweeps():
    """FORWARD and REVERSE: clusters of 8, longer slices with more threads, register vectors from 3 down to none.
    MIXED: 16 blocks where 8 would leave one per SM, and register vectors only where they add blocks per SM."""
    assert jsd_cuda.candidate_layouts(32000, 0) == [(8, 128, 3), (8, 128, 2), (8, 128, 1), (8, 128, 0)]
    assert jsd_cuda.candidate_layouts(128256, 1) == [(8, 256, 3), (8, 256, 2), (8, 256, 1), (8, 256, 0)]
    assert jsd_cuda.candidate_layouts(262144, 0)[0] == (8, 512, 3)
    assert jsd_cuda.candidate_layouts(128256, 2) == [(8, 256, 2), (8, 256, 0)]  # 3 blocks per SM, else 2
    assert jsd_cuda.candidate_layouts(151936, 2)[-1] == (8, 512, 0)
    assert jsd_cuda.candidate_layouts(262144, 2) == [(16, 256, 2), (16, 256, 0)]
    for mode in (0, 1, 2):
        assert jsd_cuda.candidate_layouts(8, mode) == [(8, 128, 0)]  # one vector per block at most
        assert jsd_cuda.candidate_layouts(2**19, mode)[0].cluster == 16  # 8 blocks cannot hold the row
        for vocab in (8, 1000, 32000, 128256, 262144, 2**19):
            for layout in jsd_cuda.candidate_layouts(vocab, mode):  # the slices cover the row, within shared memory
                assert 8 * layout.cluster * row_step_cuda._slice_vecs(vocab, layout.cluster) >= vocab
                assert 0 <= row_step_cuda._shared_bytes(vocab, *layout, jsd_cuda._tiles(mode)) <= row_step_cuda.MAX_SHARED_BYTES


@pytest.mark.parametrize("vocab", [1000, 32000, 65536, 128256, 151936, 262144])
@pytest.mark.parametrize("mode", [1, 2])
def test_some_layout_of_every_vocabulary_compiles_without_a_spill(vocab, mode, tmp_path):
    """_fitting_kernel walks candidate_layouts' layouts to the first without a spill; the widest forms (REVERSE and MIXED,
    T != 1) must find one among them (the last has no register vectors, so no register cap)."""
    layouts = jsd_cuda.candidate_layouts(vocab, mode)
    spilled = [spill_bytes(jsd_cuda.source(vocab, torch.int32, layout, mode, False), tmp_path) for layout in layouts]
    assert 0 in spilled, list(zip(layouts, spilled))


def test_supported_only_where_the_kernel_is_the_spec(monkeypatch):
    monkeypatch.setattr(row_step_cuda, "available", lambda device: True)  # as on an H200
    student, teacher, labels = plain_case()
    assert jsd_cuda.supported(student, teacher, labels, PLAIN, True, None)
    assert jsd_cuda.supported(student, teacher, labels.int(), PLAIN, True, None)
    rejected = unsupported(student, teacher, labels, PLAIN) | {
        "no gradient (the Triton step is as fast)": (student, teacher, labels, PLAIN, False, None),
        "no teacher logits": (student, None, labels, PLAIN, True, None),
        **{f"beta = {beta:g} (MIXED_PRECISE: the Triton step's)": (student, teacher, labels,
                                                                dataclasses.replace(PLAIN, beta=beta), True, None)
           for beta in (1e-5, 1 - 1e-5)},
    }
    for reason, args in rejected.items():
        assert not jsd_cuda.supported(*args), reason
    monkeypatch.setattr(row_step_cuda, "available", lambda device: False)
    assert not jsd_cuda.supported(student, teacher, labels, PLAIN, True, None)


@pytest.mark.parametrize("beta, write_grad", [(0.0, True), (0.5, True), (1.0, False)])
def test_falls_back_to_triton_where_unsupported(beta, write_grad):
    """Off Hopper (here: the CPU, Triton in its interpreter) the step is the Triton step, equal to the spec."""
    student, teacher, labels = plain_case(rows=5, vocab=300)
    labels[1] = PLAIN.ignore_index
    constants = RowStepConstants(0.4, 0.6, beta, 1.5, -100)
    want_grad, want_losses = student.clone(), torch.full((5, 2), float("nan"))
    row_step_jsd_torch(want_grad, teacher, labels, constants, want_losses, write_grad)
    got_grad, got_losses = student.clone(), torch.full((5, 2), float("nan"))
    jsd_cuda.JSD_CUDA_ROW_STEP.step(got_grad, teacher, labels, constants, got_losses, write_grad)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2e-2, atol=1e-4)


def test_the_mode_follows_beta_and_the_logits_dtype():
    """MIXED (2) only for bf16 logits away from beta's edges; MIXED_PRECISE (3) elsewhere between 0 and 1."""
    betas = (0.0, 1.0, 0.5, 0.05, 0.95, 0.0499, 0.9501, 1e-9, 1 - 1e-9)
    assert [jsd_cuda.mode_of(beta, torch.bfloat16) for beta in betas] == [0, 1, 2, 2, 2, 3, 3, 3, 3]
    for dtype in (torch.float32, torch.float16):
        assert [jsd_cuda.mode_of(beta, dtype) for beta in betas] == [0, 1, 3, 3, 3, 3, 3, 3, 3]
    layout = jsd_cuda.candidate_layouts(128256, 2)[-1]
    with pytest.raises(ValueError, match="the cluster step has no MIXED_PRECISE form"):  # it would read REVERSE's gaps
        jsd_cuda.source(128256, torch.int64, layout, 3, True)


@pytest.mark.parametrize("mode, shared", FORMS)
def test_the_form_that_hashes_a_weight_compiles_to_the_same_layouts(mode, shared, tmp_path):
    """The variant that takes a cached teacher copy's hash along (row_step_jsd_cuda_hashing) streams the weight's
    rows in 16-byte loads beside the step, without local memory, and spills no more than the plain form at the
    layout the seed's vocabulary launches: _fitting_kernel picks the same layout for both."""
    layout = jsd_cuda.candidate_layouts(128256, mode)[0]
    hashing = jsd_cuda.source(128256, torch.int64, layout, mode, shared, hash_row_vecs=512)
    ptx = nvrtc_compile(hashing)
    assert ".local" not in ptx and "ld.global.cs.v4" in ptx
    assert ptx.count("ld.global.cs") == 7  # four rows in flight per thread, then the one to three left
    assert spill_bytes(hashing, tmp_path) <= spill_bytes(jsd_cuda.source(128256, torch.int64, layout, mode, shared),
                                                         tmp_path)


def test_the_hashing_step_declines_without_running_where_it_cannot_take_the_hash():
    """On the CPU (no cluster kernel), and for words the kernel cannot stream, it returns None with nothing written:
    the caller then runs the step and the hash apart."""
    student, teacher, labels = plain_case()
    losses = torch.full((student.shape[0], 2), float("nan"))
    for words in (torch.zeros(64, 8, dtype=torch.int32), torch.zeros(64, 6, dtype=torch.int32),
                  torch.zeros(64, 8, dtype=torch.int16)):
        assert jsd_cuda.row_step_jsd_cuda_hashing(student.clone(), teacher, labels, PLAIN, losses, True,
                                                  words=words) is None
    assert torch.isnan(losses).all()
