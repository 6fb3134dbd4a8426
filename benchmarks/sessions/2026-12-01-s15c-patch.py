"""Session 15 call C's variant (NOTES item 68): patches row_step_cuda.py under the src folder given so that each
block issues its row slice's loads before it waits for the row's label (an ignored row then waits for its
copies before it writes its zeros over them)."""
import sys
from pathlib import Path
p = Path(sys.argv[1]) / "cosdistill/row_step_cuda.py"
s = p.read_text()
cut_start = s.index("  if (!valid) {  // an ignored token")
cut_end = s.index("  const uint4* student_src")
ignored = s[cut_start:cut_end]
s = s[:cut_start] + s[cut_end:]
target, ignored = ignored[ignored.index("  const float target"):], ignored[:ignored.index("  const float target")]
ignored = ignored.replace("  if (!valid) {  // an ignored token: no gradient, zero losses (the whole cluster leaves here)\n",
                          "  if (!valid) {  // an ignored token: no gradient, zero losses (the whole cluster leaves here)\n"
                          "    wait_copies(0);  // the zeros overwrite what this thread's copies read\n")
anchor = "\n  // Each thread reduces the vectors it copied itself"
assert s.count(anchor) == 1 and ignored.count("wait_copies(0)") == 1
s = s.replace(anchor, "\n" + ignored + target + anchor)
p.write_text(s)
