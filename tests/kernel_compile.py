"""Compile every Triton kernel variant for Hopper (sm_90) with Triton's real compiler, and the CUDA cluster
kernels with NVRTC and Triton's ptxas: no GPU needed.

Triton's interpreter, which runs the kernels in the other tests, skips the compiler's front end, so it
misses errors only a GPU run would show (e.g. a plain Python global read inside @triton.jit). Run as
a script without TRITON_INTERPRET (kernels/test_compile_for_hopper.py does), it prints one line per variant.
"""

import ctypes
import itertools
import re
import subprocess
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cosdistill.testing import kernels

fingerprint, fp8_quantize, grad_output = kernels.fingerprint, kernels.fp8_quantize, kernels.grad_output
row_step_cuda, row_step_jsd_cuda = kernels.row_step_cuda, kernels.row_step_jsd_cuda
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # ptxas, cuobjdump
labels, row_step = kernels.labels, kernels.row_step_triton  # row_step: the Triton row step

HOPPER = GPUTarget("cuda", 90, 32)
INTS = ("student_row_stride", "teacher_row_stride", "vocab_student", "vocab_teacher", "ignore_index",
        "vocab_start", "vocab_student_total")
FLOATS = ("student_cap", "teacher_cap", "student_scale", "teacher_scale", "weight_hard", "weight_soft", "beta",
          "norm_clamp")


ALIGNED = ("student_ptr", "teacher_ptr", "labels_ptr", "stats_ptr", "losses_ptr", "lifts_ptr", "student_row_stride",
           "teacher_row_stride", "vocab_student", "vocab_teacher")


def nvrtc_compile(source: str) -> str:
    """PTX for sm_90; raises with NVRTC's log on an error or a warning."""
    import nvidia.cuda_nvrtc

    lib = ctypes.CDLL(str(Path(list(nvidia.cuda_nvrtc.__path__)[0]) / "lib" / "libnvrtc.so.12"))
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"row_step.cu", 0, None, None) == 0
    options = [b"--gpu-architecture=sm_90", b"-std=c++17"]
    result = lib.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, log)
    if result != 0 or log.value.strip():
        raise AssertionError(f"NVRTC result {result}:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(program, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(program, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(program))
    return ptx.value.decode()


def ptxas(source: str, folder: Path) -> tuple[Path, int]:
    """The sm_90 cubin of a CUDA source (NVRTC, then Triton's ptxas) and the bytes of registers it spills
    within the kernel's __launch_bounds__."""
    (folder / "kernel.ptx").write_text(nvrtc_compile(source))
    result = subprocess.run([str(NVIDIA_BIN / "ptxas"), "-arch=sm_90", "-v", str(folder / "kernel.ptx"), "-o",
                             str(folder / "kernel.cubin")], capture_output=True, text=True, check=True)
    return folder / "kernel.cubin", int(re.search(r"(\d+) bytes spill stores", result.stderr).group(1))


def spill_bytes(source: str, folder: Path) -> int:
    return ptxas(source, folder)[1]


def cuda_variants(vocab: int):
    """(name, layouts, source of a layout) of the CUDA cluster kernels: the cosine step and the JSD's forms
    (MODE, SHARED: T == 1), each with the layouts its _fitting_kernel tries in turn."""
    yield "cosine", row_step_cuda.candidate_layouts(vocab), lambda layout: row_step_cuda.source(vocab, torch.int64, layout)
    for (mode, name), shared in itertools.product(((0, "forward KL"), (1, "reverse KL"), (2, "mixed")), (True, False)):
        yield (f"jsd {name}, T {'=' if shared else '!='} 1", row_step_jsd_cuda.candidate_layouts(vocab, mode),
               lambda layout, mode=mode, shared=shared: row_step_jsd_cuda.source(vocab, torch.int64, layout, mode, shared))


def compile_for_hopper(kernel, logits_type, constants, aligned=False, num_warps=row_step.DEFAULT_WARPS):
    """With ``aligned``, as Triton specialises a launch whose pointers, strides and vocabularies are
    multiples of 16 (e.g. V = 128256): vectorised loads, and the STAGES prefetch through shared memory."""
    types = dict(student_ptr=logits_type, teacher_ptr=logits_type, labels_ptr="*i64", stats_ptr="*fp32",
                 losses_ptr="*fp32", lifts_ptr="*fp32",
                 **{name: "i32" for name in INTS}, **{name: "fp32" for name in FLOATS})
    signature = {name: "constexpr" if name in constants else types.get(name, "constexpr") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ALIGNED if aligned and name in kernel.arg_names and name not in constants}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER,
                          options=dict(num_warps=num_warps, **kernels.TRITON_OPTIONS))


def variants():
    """(name, kernel, logits type, constants): the launches' settings; "aligned" as at V = 128256."""
    for logits_type, caps in itertools.product(("*bf16", "*fp16", "*fp32"), ((False, False), (True, True))):
        common = dict(STUDENT_CAP=caps[0], TEACHER_CAP=caps[1], BLOCK=row_step.DEFAULT_BLOCK, STAGES=row_step.DEFAULT_STAGES)
        lift = logits_type == "*fp16"  # the chunk loop lifts fp16 gradients only
        for name in ("row step", "row step aligned"):  # aligned: vector loads prefetched through shared memory
            yield name, row_step._row_step_kernel, logits_type, dict(common, WRITE_GRAD=True, LIFT=lift, RESCUE=False)
        if logits_type != "*fp32":
            yield "rescue", row_step._row_step_kernel, logits_type, dict(common, WRITE_GRAD=True, LIFT=lift, RESCUE=True)
            yield "gradient", row_step._row_grad_kernel, logits_type, dict(common, WRITE_GRAD=True, LIFT=lift, NUM_STATS=8)
        if logits_type == "*bf16":
            yield "loss only aligned", row_step._row_step_kernel, logits_type, dict(
                common, BLOCK=row_step.LOSS_ONLY_BLOCK, STAGES=row_step.LOSS_ONLY_STAGES, WRITE_GRAD=False, LIFT=False,
                RESCUE=False)
            yield "statistics", row_step._row_stats_kernel, logits_type, dict(common, NUM_STATS=8)
        if logits_type in ("*bf16", "*fp32") and not any(caps):  # the Gram path: no teacher logits (gram.py)
            yield "gram statistics", row_step._row_stats_kernel, logits_type, dict(common, NUM_STATS=8, teacher_ptr=None)
            yield "gram gradient", row_step._row_grad_kernel, logits_type, dict(
                common, WRITE_GRAD=True, LIFT=False, NUM_STATS=8, teacher_ptr=None)


def compile_fp8_quantization(rows_type):
    kernel = fp8_quantize._quantize_rows_kernel
    types = dict(rows=rows_type, out="*fp8e4nv", scales="*fp32", row_stride="i32", out_stride="i32",
                 scale_stride="i32", hidden="i32")
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index("BLOCK"),): fp8_quantize.BLOCK}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER,
                          options=dict(num_warps=fp8_quantize.WARPS, **kernels.TRITON_OPTIONS))


def compile_small_kernels():
    """(name, compiled) for the one-program kernels around the chunk loop (labels.py, grad_output.py)."""
    def compile_one(kernel, types, constants):
        signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
        constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
        return triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER,
                              options=dict(num_warps=4, **kernels.TRITON_OPTIONS))

    yield "label count", compile_one(labels._count_labels_kernel, dict(
        labels_ptr="*i64", num_tokens="i32", ignore_index="i32", vocab_student="i32", counts_ptr="*i32"),
        dict(BLOCK=labels.BLOCK))
    yield "scale unless one", compile_one(grad_output._scale_unless_one_kernel, dict(
        first_ptr="*bf16", first_numel="i32", second_ptr="*bf16", second_numel="i32", third_ptr="*fp32",
        third_numel="i32", factor_ptr="*fp32", poison_ptr="*fp32"), dict(BLOCK=grad_output.BLOCK))
    yield "fingerprint", compile_one(fingerprint._fingerprint_kernel, dict(
        words_ptr="*i16", rows="i32", cols="i32", stride_row="i32", stride_col="i32", partials_ptr="*i32"),
        dict(KEYS_0=fingerprint.LANE_KEYS[0], KEYS_1=fingerprint.LANE_KEYS[1], MIX=fingerprint.MIX,
             BLOCK_ROWS=fingerprint.BLOCK_ROWS, BLOCK_COLS=fingerprint.BLOCK_COLS))
    yield "stale check", compile_one(fingerprint._stale_check_kernel, dict(
        partials_ptr="*i32", count="i32", expected_ptr="*i64", changed_ptr="*i32", poison_ptr="*fp32"),
        dict(BLOCK=fingerprint.STALE_CHECK_BLOCK))
    for n_from, normaliser_type, poisoned in ((labels.N_COUNTED, "*i32", False), (labels.N_GIVEN_TENSOR, "*i64", False),
                                              (labels.N_GIVEN_NUMBER, "*i32", False), (labels.N_COUNTED, "*i32", True)):
        yield f"mean losses N_FROM={n_from} POISONED={poisoned}", compile_one(labels._mean_losses_kernel, dict(
            token_losses_ptr="*fp32", num_tokens="i32", normaliser_ptr=normaliser_type, normaliser="fp32",
            weight_hard="fp32", weight_soft="fp32", poison_ptr="*fp32", loss_ptr="*fp32", soft_ptr="*fp32",
            hard_ptr="*fp32"), dict(N_FROM=n_from, POISONED=poisoned, BLOCK=labels.BLOCK))
    for logits_type, cap, scaled in itertools.product(("*bf16", "*fp16", "*fp32"), (False, True), (False, True)):
        if cap == scaled:  # neither, and both: the scale None (1) or a number, the softcap off or on
            yield f"student metrics {logits_type} caps={cap}", compile_one(
                kernels.student_metrics._student_metrics_kernel, dict(
                    student_ptr=logits_type, student_row_stride="i32", labels_ptr="*i64", out_ptr="*fp32",
                    vocab_student="i32", ignore_index="i32", x_scale="fp32", cap="fp32",
                    logit_scale="fp32" if scaled else "constexpr"),
                dict(CAP=cap, BLOCK=kernels.student_metrics.BLOCK, **({} if scaled else {"logit_scale": None})))


def compiled_variants():
    """(name, logits type, constants, compiled kernel) for each of ``variants``, with its launch's warps."""
    for name, kernel, logits_type, constants in variants():
        warps = row_step.LOSS_ONLY_WARPS if name.startswith("loss only") else row_step.DEFAULT_WARPS
        compiled = compile_for_hopper(kernel, logits_type, constants, aligned="aligned" in name, num_warps=warps)
        yield name, logits_type, constants, compiled


def main():
    for name, logits_type, constants, compiled in compiled_variants():
        print(f"{name} {logits_type} caps={constants['STUDENT_CAP']}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")
    for rows_type in ("*bf16", "*fp16", "*fp32"):
        compiled = compile_fp8_quantization(rows_type)
        print(f"fp8 quantization {rows_type}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")
    for name, compiled in compile_small_kernels():
        print(f"{name}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")


if __name__ == "__main__":
    main()
