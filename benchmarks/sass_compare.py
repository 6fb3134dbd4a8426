"""Whether two source trees' Triton kernels compile to the same sm_90 machine code, and what the CUDA
cluster kernels issue per logit (no GPU needed).

For each variant of this repository's tests/kernel_compile.py, compiled from the ``cosdistill`` on
PYTHONPATH, prints its name, a hash of its SASS (cuobjdump --dump-sass, addresses dropped) and its
instruction count. Run it once per tree and diff the outputs: a change that is pure code motion
leaves the hashes alone, so timings taken before it still describe the code after it. An older tree
must have the kernels (and fp8_quantize) that kernel_compile names.

    PYTHONPATH=<tree>/src python benchmarks/sass_compare.py > a.txt

With ``--cuda V``, for each CUDA cluster kernel at vocabulary V, in the first layout that ptxas compiles
without a spill (the one its _fitting_kernel picks), the instructions and MUFU operations (the SFU's exponentials
and logarithms) per logit pair of a thread, with the commonest opcodes. Unrolled whole, the kernel's
static count is what a thread issues, its per-row set-up and reductions spread over its pairs; against
the issue rate (four warp instructions per clock per SM) and the SFU's (16 per clock per SM) it says
which of the two a kernel's time is near (docs/design.md, the generalized JSD).

    python benchmarks/sass_compare.py --cuda 128256

cuobjdump and ptxas come from Triton's wheel (triton/backends/nvidia/bin), NVRTC from the test extra.
"""

import argparse
import collections
import hashlib
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def sass_instructions(cuobjdump: Path, cubin: Path) -> list[str]:
    """The instructions of a cubin's SASS, addresses dropped."""
    sass = subprocess.run([str(cuobjdump), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in sass.splitlines()
            if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]


def opcode(instruction: str) -> str:
    """FADD, MUFU.EX2, ...: the operation, its predicate and most modifiers dropped (MUFU keeps its function)."""
    name = instruction.split()[1] if instruction.startswith("@") else instruction.split()[0]
    return name if name.startswith("MUFU") else name.split(".")[0]


def cuda_counts(kernel_compile, cuobjdump: Path, vocab: int):
    """Per CUDA cluster kernel: its layout, and its static instructions and MUFU per logit pair of a thread."""
    from cosdistill.testing import kernels

    row_step_cuda = kernels.row_step_cuda
    with tempfile.TemporaryDirectory() as folder:
        for name, layouts, source in kernel_compile.cuda_variants(vocab):
            for layout in layouts:
                cubin, spilled = kernel_compile.ptxas(source(layout), Path(folder))
                if not spilled:
                    break
            ops = collections.Counter(opcode(line.rstrip(" ;")) for line in sass_instructions(cuobjdump, cubin))
            pairs = 8 * math.ceil(row_step_cuda._slice_vecs(vocab, layout.cluster) / layout.threads)
            mufu = sum(count for op, count in ops.items() if op.startswith("MUFU"))
            common = ", ".join(f"{op} {count / pairs:.1f}" for op, count in ops.most_common(8))
            print(f"{name:26s} {tuple(layout)}: {sum(ops.values()) / pairs:5.1f} instructions and {mufu / pairs:4.1f} "
                  f"MUFU per pair ({common})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", type=int, metavar="V", help="the CUDA cluster kernels' counts at vocabulary V")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import kernel_compile

    cuobjdump = kernel_compile.NVIDIA_BIN / "cuobjdump"
    if args.cuda:
        cuda_counts(kernel_compile, cuobjdump, args.cuda)
        return
    for name, logits_type, constants, compiled in kernel_compile.compiled_variants():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            instructions = sass_instructions(cuobjdump, Path(cubin.name))
        digest = hashlib.md5("\n".join(instructions).encode()).hexdigest()[:10]
        print(f"{name:20s} {logits_type} caps={constants['STUDENT_CAP']} {digest} {len(instructions)} instructions")


if __name__ == "__main__":
    main()
