"""The CUDA cluster row step (kernels/row_step_cuda.py) on the CPU: its source compiles for Hopper with NVRTC
(the pip wheel, as torch's CUDA build ships it) without local memory, and it is dispatched only where it
computes exactly the spec. Its results are checked on the H200 by the gpu tests (tests/gpu, pytest -m gpu)."""

import dataclasses

import pytest
import torch

from cosdistill.testing import RowStepConstants, kernels, row_step_torch
from kernel_compile import nvrtc_compile, spill_bytes

row_step_cuda = kernels.row_step_cuda

PLAIN = RowStepConstants(weight_hard=0.4, weight_soft=0.6, beta=0.9, temperature=1.5, ignore_index=-100)


@pytest.mark.parametrize("vocab", [8, 1000, 32000, 128256, 151936, 262144])
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32])
def test_source_compiles_for_hopper_without_local_memory(vocab, label_dtype):
    layout = row_step_cuda.candidate_layouts(vocab)[0]
    ptx = nvrtc_compile(row_step_cuda.source(vocab, label_dtype, layout))
    assert f".reqnctapercluster {layout.cluster}, 1, 1" in ptx
    assert ".local" not in ptx  # g[j] at a run-time index once put the gradient on the stack
    assert ptx.count("cp.async.cg.shared.global") >= 2 and "ld.shared::cluster" in ptx


@pytest.mark.parametrize("vocab, layout", [(262144, (16, 256, 2)), (262144, (16, 128, 5)), (128256, (16, 128, 1)),
                                           (32000, (8, 128, 3)), (8000, (8, 32, 3))])
def test_register_layouts_compile_without_local_memory(vocab, layout):
    """Vectors held in registers must stay there (a run-time index would put them on the stack)."""
    layout = row_step_cuda.Layout(*layout)
    ptx = nvrtc_compile(row_step_cuda.source(vocab, torch.int64, layout))
    assert ".local" not in ptx
    copies = row_step_cuda._slice_vecs(vocab, layout.cluster) > layout.register_cols * layout.threads
    assert ptx.count("ld.global.cg.v4") >= 2 * layout.register_cols and copies == ("cp.async.cg.shared.global" in ptx)
    assert f".maxntid {layout.threads}, 1, 1" in ptx and ".minnctapersm" in ptx


# candidate_layouts' first layout that this ptxas compiles without a spill, as _fitting_kernel picks on the GPU
LAUNCHED = {1000: (8, 128, 0), 32000: (8, 128, 0), 49152: (8, 128, 0), 65536: (8, 128, 2), 98304: (8, 192, 2),
            100352: (16, 128, 0), 128256: (16, 128, 2), 151936: (16, 160, 2), 200064: (16, 160, 3),
            256000: (16, 224, 3), 262144: (16, 224, 3), 400000: (16, 256, 3), 819200: (16, 256, 0)}


@pytest.mark.parametrize("vocab", LAUNCHED)
def test_launch_picks_the_first_layout_without_a_spill(vocab, tmp_path):
    layouts = row_step_cuda.candidate_layouts(vocab)
    assert layouts[-1].register_cols == 0  # no __launch_bounds__ minimum: ptxas picks its own registers
    spilled = [spill_bytes(row_step_cuda.source(vocab, torch.int64, layout), tmp_path) for layout in layouts]
    assert spilled[-1] == 0
    assert layouts[spilled.index(0)] == LAUNCHED[vocab], list(zip(layouts, spilled))


# The Gram path's one-model kernel (no teacher logits): candidate_layouts' first layout compiles without a spill
GRAM_LAUNCHED = {1000: (8, 128, 0), 32000: (8, 128, 0), 128256: (8, 160, 3), 151936: (8, 160, 4),
                 262144: (16, 128, 4)}


@pytest.mark.parametrize("vocab", GRAM_LAUNCHED)
def test_one_model_kernel_compiles_without_a_spill(vocab, tmp_path):
    layout = row_step_cuda.candidate_layouts(vocab, models=1)[0]
    assert layout == GRAM_LAUNCHED[vocab]
    source = row_step_cuda.source(vocab, torch.int32, layout, models=1)
    assert "#define TEACHER 0" in source
    ptx = nvrtc_compile(source)
    assert ".local" not in ptx and "ld.shared::cluster" in ptx
    assert ptx.count("ld.global.cg.v4") == layout.register_cols  # the student's register vectors only
    assert spill_bytes(source, tmp_path) == 0
    # the shared slice holds one model: half the two-model kernel's bytes
    assert row_step_cuda._shared_bytes(vocab, *layout, tiles=1) * 2 == row_step_cuda._shared_bytes(vocab, *layout)


def test_register_columns_shrink_the_shared_slice():
    # V = 262144 on 16 blocks: 2048 vectors per model per block; 2 of 8 per thread in registers at 256 threads
    assert row_step_cuda._shared_bytes(262144, 16) == 64 * 1024
    assert row_step_cuda._shared_bytes(262144, 16, 256, 2) == 48 * 1024
    assert row_step_cuda._blocks_per_sm(64 * 1024, 256) == 3 and row_step_cuda._blocks_per_sm(48 * 1024, 256) == 4
    assert row_step_cuda._blocks_per_sm(row_step_cuda._shared_bytes(128256, 16), 128) == 7  # 49 clusters
    with pytest.raises(ValueError, match="than the 16 of a vocab-1000 slice"):
        row_step_cuda.source(1000, torch.int64, row_step_cuda.Layout(8, 32, 1))


def test_launch_configs_follow_the_sweeps():
    # the H200 layout sweeps (docs/design.md): ~32 KB of shared memory per block; where that leaves fewer than
    # 8 blocks per SM, the layouts with the most blocks, then warps, using registers
    assert row_step_cuda.candidate_layouts(32000) == [(8, 128, 0)]
    assert row_step_cuda.candidate_layouts(49152) == [(8, 128, 0)]  # 9 blocks per SM without registers
    assert row_step_cuda.candidate_layouts(65536)[0] == (8, 128, 2)  # 6 -> 9 blocks per SM
    assert row_step_cuda.candidate_layouts(128256)[0] == (16, 128, 2)
    assert row_step_cuda.candidate_layouts(151936) == [(16, 160, 2), (16, 128, 3), (16, 224, 1), (16, 256, 0)]
    assert row_step_cuda.candidate_layouts(262144)[0] == (16, 224, 3)  # 5 blocks of 7 warps: 35 warps per SM
    for vocab in (8, 32000, 128256, 262144):
        for layout in row_step_cuda.candidate_layouts(vocab):
            # the slices cover the row
            assert 16 * 8 * layout.cluster * row_step_cuda._slice_vecs(vocab, layout.cluster) >= 2 * vocab
            assert row_step_cuda._shared_bytes(vocab, *layout) >= 0


def plain_case(rows=6, vocab=1024, dtype=torch.bfloat16):
    student = torch.randn(rows, vocab).to(dtype)
    teacher = torch.randn(rows, vocab).to(dtype)
    labels = torch.randint(0, vocab, (rows,))
    return student, teacher, labels


def unsupported(student, teacher, labels, plain):
    """The launches a cluster row step must turn down, by reason, for the (student, teacher, labels) of
    plain_case and its plain constants."""
    def scaled(**options):
        return dataclasses.replace(plain, **options)

    return {
        "fp16 lifts": (student, teacher, labels, plain, True, torch.ones(6)),
        "fp32": (student.float(), teacher.float(), labels, plain, True, None),
        "teacher vocabulary larger": (student, torch.randn(6, 1032).bfloat16(), labels, plain, True, None),
        "vocabulary not a multiple of 8": (student[:, :1020], teacher[:, :1020], labels % 1020, plain, True, None),
        "misaligned rows": (student[:, 1:1017], teacher[:, 1:1017], labels % 1016, plain, True, None),
        "student softcap": (student, teacher, labels, scaled(student_softcap=30.0), True, None),
        "logit scale": (student, teacher, labels, scaled(teacher_logit_scale=2.0), True, None),
        "vocabulary shard": (student, teacher, labels, scaled(vocab_start=1024, vocab_student_total=2048), True, None),
        "uint8 labels": (student, teacher, labels.to(torch.uint8), plain, True, None),
        "no rows": (student[:0], teacher[:0], labels[:0], plain, True, None),
        "row too long for shared memory": (torch.empty(1, 2**22, dtype=torch.bfloat16),
                                           torch.empty(1, 2**22, dtype=torch.bfloat16), labels[:1], plain, True, None),
    }


def test_supported_only_where_the_kernel_is_the_spec(monkeypatch):
    monkeypatch.setattr(row_step_cuda, "available", lambda device: True)  # as on an H200
    student, teacher, labels = plain_case()
    assert row_step_cuda.supported(student, teacher, labels, PLAIN, True, None)
    assert row_step_cuda.supported(student, teacher, labels.int(), PLAIN, True, None)
    rejected = unsupported(student, teacher, labels, PLAIN) | {
        "no gradient": (student, teacher, labels, PLAIN, False, None),
        "fp16": (student.half(), teacher.half(), labels, PLAIN, True, None),
    }
    for reason, args in rejected.items():
        assert not row_step_cuda.supported(*args), reason
    monkeypatch.setattr(row_step_cuda, "available", lambda device: False)
    assert not row_step_cuda.supported(student, teacher, labels, PLAIN, True, None)


def test_falls_back_to_triton_where_unsupported():
    """Off Hopper (here: the CPU, Triton in its interpreter) the step is the Triton step, equal to the spec."""
    student, teacher, labels = plain_case(rows=5, vocab=300)
    labels[1] = PLAIN.ignore_index
    want_grad, want_losses = student.clone(), torch.full((5, 2), float("nan"))
    row_step_torch(want_grad, teacher, labels, PLAIN, want_losses, True)
    got_grad, got_losses = student.clone(), torch.full((5, 2), float("nan"))
    row_step_cuda.COSINE_CUDA_ROW_STEP.step(got_grad, teacher, labels, PLAIN, got_losses, True)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2e-2, atol=1e-4)


def test_launch_walks_past_spilling_layouts_and_falls_back_to_8_blocks(monkeypatch):
    """_kernel is None where the kernel spills or no cluster fits (a GPU or MIG slice without 16 free SMs
    in a GPC): the next of candidate_layouts' layouts, then 8 blocks of 256 threads, else no kernel."""
    compiled = []

    def fake_kernel(vocab, label_dtype, device_index, layout, models=2):
        compiled.append(layout)
        fits = layout.cluster <= fits_up_to and layout not in spilling
        return f"kernel {tuple(layout)}" if fits else None

    monkeypatch.setattr(row_step_cuda, "_kernel", fake_kernel)
    launch = row_step_cuda._fitting_kernel.__wrapped__
    fits_up_to, spilling = 16, set()
    assert launch(262144, torch.int64, 0) == ("kernel (16, 224, 3)", (16, 224, 3))
    spilling = {(16, 224, 3), (16, 160, 4)}
    assert launch(262144, torch.int64, 0) == ("kernel (16, 128, 5)", (16, 128, 5))
    spilling = {(16, 224, 3), (16, 160, 4), (16, 128, 5)}
    assert launch(262144, torch.int64, 0) == ("kernel (16, 256, 0)", (16, 256, 0))
    fits_up_to = 8
    assert launch(128256, torch.int64, 0) == ("kernel (8, 256, 0)", (8, 256, 0))
    assert launch(32000, torch.int64, 0) == ("kernel (8, 128, 0)", (8, 128, 0))  # 8 blocks already
    fits_up_to = 4
    compiled.clear()
    assert launch(128256, torch.int64, 0) is None
    assert compiled == row_step_cuda.candidate_layouts(128256) + [(8, 256, 0)]
