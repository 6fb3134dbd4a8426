"""Compile every Triton kernel variant for Hopper (sm_90) with Triton's real compiler: no GPU needed.

Triton's interpreter, which runs the kernels in the other tests, skips the compiler's front end, so it
misses errors only a GPU run would show (e.g. a plain Python global read inside @triton.jit). Run as
a script without TRITON_INTERPRET (test_kernels_compile.py does), it prints one line per variant.
"""

import itertools

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cosdistill import row_step_triton as kernels

HOPPER = GPUTarget("cuda", 90, 32)
INTS = ("student_row_stride", "teacher_row_stride", "vocab_student", "vocab_teacher", "ignore_index",
        "vocab_start", "vocab_student_total", "num_slices")
FLOATS = ("student_cap", "teacher_cap", "student_scale", "teacher_scale", "weight_hard", "weight_soft", "beta",
          "inv_temp_sq", "eps")


def compile_for_hopper(kernel, logits_type, constants):
    types = dict(student_ptr=logits_type, teacher_ptr=logits_type, labels_ptr="*i64", stats_ptr="*fp32",
                 losses_ptr="*fp32", lifts_ptr="*fp32",
                 partials_ptr="*fp32", counters_ptr="*i32", **{name: "i32" for name in INTS}, **{name: "fp32" for name in FLOATS})
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    return triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER)


def variants():
    for logits_type, caps in itertools.product(("*bf16", "*fp16", "*fp32"), ((False, False), (True, True))):
        common = dict(STUDENT_CAP=caps[0], TEACHER_CAP=caps[1])
        lift = logits_type == "*fp16"  # the chunk loop lifts fp16 gradients only
        sliced = dict(common, SLICE=kernels.DEFAULT_SLICE, MAX_SLICES=32, BLOCK=kernels.DEFAULT_BLOCK)
        yield "row step", kernels._sliced_row_step_kernel, logits_type, dict(
            sliced, WRITE_GRAD=True, LIFT=lift, PUBLISH=True, WAIT=True, FINISH=True)
        per_row = dict(common, BLOCK=kernels.DEFAULT_BLOCK)
        yield "rescue", kernels._rescue_kernel, logits_type, dict(per_row, WRITE_GRAD=True, LIFT=lift)
        if logits_type != "*fp32":
            yield "gradient", kernels._row_grad_kernel, logits_type, dict(per_row, WRITE_GRAD=True, LIFT=lift, NUM_STATS=8)
        if logits_type == "*bf16":
            yield "loss only", kernels._sliced_row_step_kernel, logits_type, dict(
                sliced, SLICE=kernels.LOSS_ONLY_SLICE, WRITE_GRAD=False, LIFT=False, PUBLISH=True, WAIT=False,
                FINISH=True)
            for phase in (dict(PUBLISH=True, FINISH=False), dict(PUBLISH=False, FINISH=True)):
                yield "two launches", kernels._sliced_row_step_kernel, logits_type, dict(
                    sliced, WRITE_GRAD=True, LIFT=False, WAIT=False, **phase)
            yield "statistics", kernels._row_stats_kernel, logits_type, dict(per_row, NUM_STATS=8)


def main():
    for name, kernel, logits_type, constants in variants():
        compiled = compile_for_hopper(kernel, logits_type, constants)
        print(f"{name} {logits_type} caps={constants['STUDENT_CAP']}: {len(compiled.asm['cubin'])} bytes of sm_90 cubin")


if __name__ == "__main__":
    main()
