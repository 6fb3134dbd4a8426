"""Session 17's BENCHMARKS.md section, pasted from the result files (from the repository root; a second run
replaces the section it pasted)."""
import re
from pathlib import Path

R = Path("benchmarks/results")
KERNEL_LINES = r"^\s+(\d|kernels)|^ours|^floor"  # each kernel's line, the sums, the two providers' names


def lines(path, pattern):
    return [line for line in (R / path).read_text().splitlines() if re.search(pattern, line)]


def block(*groups):
    return "```\n" + "\n".join(line for group in groups for line in group) + "\n```\n"


def main():
    shapes = "".join((R / f"2026-12-01-s17e/{name}.md").read_text() + "\n"
                     for name in ("v262144", "v151936", "v32000", "t3000"))
    section = f"""## 2026-12-01 session 17, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code

Changes (NOTES items 73, 74): the FP8 teacher quantizes each chunk's rows in one launch and allocates its
buffers after the first GEMM (item 73); the API queues the first student GEMM as soon as the chunk rows are
known and hands the gradients to autograd after the chunk loop, so that ~160 us less of Python runs before the
GPU gets work (item 74). The bench times each call from an idle GPU, so this host time counted in full; in a
training loop it hides behind the model's forward. Scripts: `benchmarks/sessions/2026-12-01-s17a.sh` ..
`-s17e.sh`; raw outputs: `benchmarks/results/2026-12-01-s17{{a..e}}/`.

### Final bench, full step and no-grad forward on the same tensors, three settled rounds (s17d: `python3 -m cosdistill bench --device cuda --rounds 3 --mode full,forward --json .. --markdown .. --plot ..`)

{(R / '2026-12-01-s17d/bench.md').read_text()}
### Other shapes (s17e: `python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens 4096 --vocab V --hidden H`, one round; T = 3000 at the seed shape)

Tables in order V = 262144 / H = 2048 (the Gram path), V = 151936 / H = 3584, V = 32000 / H = 4096 (the logits
path), T = 3000.

{shapes}
### T = 32768 (s17e: `python3 -m cosdistill bench --device cuda --providers ours,ours-fp8,liger,floor --tokens 32768 --reps 5`, one round)

{(R / '2026-12-01-s17e/t32768.md').read_text()}
### The host's lead: each call timed from an idle GPU (as the bench) and behind a 1 ms sleep kernel (`benchmarks/host_lead_study.py --tokens 1024 2048 --providers ours ours-fp8 floor --calls 30`), before item 74 (s17a) and after it (s17c)

{block(lines('2026-12-01-s17a/host_lead.log', r'^T='), ['after item 74:'], lines('2026-12-01-s17c/host_lead.log', r'^T='))}
The Python from the call to the first GEMM's call, stamped behind a sleep kernel (`benchmarks/host_path_study.py --tokens 2048 --fp8`): before item 74 (s17b), after it (s17c):

{block(lines('2026-12-01-s17b/host_path_fp8.log', r'call to|backward'), ['after item 74:'], lines('2026-12-01-s17c/host_path_fp8.log', r'call to|backward'))}
### Items 73 and 74 call by call (`benchmarks/ab_study.py --old <previous tip's src> --pairs 40`, FP8 with `--fp8`): item 73 against 2d3753d (s17a), item 74 against 3c5c7f1 (s17c)

{block(['item 73, FP8:'], lines('2026-12-01-s17a/ab_fp8.log', r'^T='), ['item 73, bf16:'], lines('2026-12-01-s17a/ab_bf16.log', r'^T='),
       ['item 74, bf16:'], lines('2026-12-01-s17c/ab_bf16.log', r'^T='), ['item 74, FP8 (30 pairs):'], lines('2026-12-01-s17c/ab_fp8.log', r'^T='))}
### The FP8 step's kernels against the floor's at T = 2048 (s17a: `benchmarks/step_vs_floor_kernels.py --fp8 --tokens 2048 --steps 5`; profiled, so clocks above the bench's)

{block(lines('2026-12-01-s17a/kernels_fp8.log', KERNEL_LINES))}
The FP8 GEMM alone by M (s17a: `benchmarks/fp8_gemm_study.py --rows 512,1024,2048`):

{block(lines('2026-12-01-s17a/fp8_gemm.log', r'^M =|^N ='))}
### Correctness on the H200 (s17a, s17c, s17f and s17g on the final tip: `python3 benchmarks/gpu_check.py`; the FP8 cases against float64 on the dequantized teacher)

{block(lines('2026-12-01-s17a/gpu_check.log', r'fp8|PASSED|FAILED'), ['after item 74:'], lines('2026-12-01-s17c/gpu_check.log', r'loss fp8|PASSED|FAILED'),
       ['after the first review commit (s17f):'], lines('2026-12-01-s17f/gpu_check.log', r'PASSED|FAILED'),
       ['final tip (s17g, b192fe4):'], lines('2026-12-01-s17g/gpu_check.log', r'PASSED|FAILED'))}
### GPU fuzz (s17e: `benchmarks/gpu_fuzz.py --seed 20 --cases 80`, after item 74)

{(R / '2026-12-01-s17e/fuzz/fuzz.md').read_text()}"""
    path = Path("BENCHMARKS.md")
    text = path.read_text()
    marker = "## 2026-12-01 session 16, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code"
    pasted = "## 2026-12-01 session 17,"
    if pasted in text:  # a second run: drop the section pasted before
        before = marker.replace("current code", "before session 17")
        text = text[:text.index(pasted)] + marker + text[text.index(before) + len(before):]
    assert marker in text
    text = text.replace(marker, section + "\n" + marker.replace("current code", "before session 17"))
    path.write_text(text)


if __name__ == "__main__":
    main()
