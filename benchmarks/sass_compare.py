"""Whether two source trees' Triton kernels compile to the same sm_90 machine code (no GPU needed).

For each variant of this repository's tests/kernel_compile.py, compiled from the ``cosdistill`` on
PYTHONPATH, prints its name, a hash of its SASS (cuobjdump --dump-sass, addresses dropped) and its
instruction count. Run it once per tree and diff the outputs: a change that is pure code motion
leaves the hashes alone, so timings taken before it still describe the code after it. An older tree
must have the kernels (and fp8_triton) that kernel_compile names.

    PYTHONPATH=<tree>/src python benchmarks/sass_compare.py > a.txt

cuobjdump comes from Triton's wheel (triton/backends/nvidia/bin).
"""

import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import kernel_compile

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for name, logits_type, constants, compiled in kernel_compile.compiled_variants():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            sass = subprocess.run([str(cuobjdump), "--dump-sass", cubin.name], capture_output=True, text=True,
                                  check=True).stdout
        instructions = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in sass.splitlines()
                        if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        digest = hashlib.md5("\n".join(instructions).encode()).hexdigest()[:10]
        print(f"{name:20s} {logits_type} caps={constants['STUDENT_CAP']} {digest} {len(instructions)} instructions")


if __name__ == "__main__":
    main()
