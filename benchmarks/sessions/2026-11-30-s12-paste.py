"""Session 12's BENCHMARKS.md section, pasted from the result files (run from the repository root; then
`--s12j` and `--s12k` add those calls' lines)."""
import re
from pathlib import Path

R = Path("benchmarks/results")


def lines(path, pattern):
    return [line for line in (R / path).read_text().splitlines() if re.search(pattern, line)]


def block(*groups):
    return "```\n" + "\n".join(line for group in groups for line in group) + "\n```\n"


def paste_main():
    """The section from s12a-s12i (the first paste)."""
    stages_block = block(lines('2026-11-30-s12e/persistent_stages.log', r'^(vocab=|in step)'))
    section = f"""## 2026-11-30 session 12, NVIDIA H200 (single; x2 for one check), torch 2.11.0+cu130, Triton 3.6.0 — current code

Changes: the row step reads each logit once, in a CUDA kernel compiled at run time by NVRTC through
torch (`row_step_cuda.py`, NOTES item 56): impl="auto" takes it on Hopper for bf16 logits of one
vocabulary size (a multiple of 8) with gradients, and the Triton kernels everywhere else (no-grad
forward, softcap, logit scale, fp16, fp32, vocabulary split). The persistent forms of the kernel were
slower and are not in the code (item 57). The chunk loop makes the inputs' device current (a process
that never called `torch.cuda.set_device` could not run the Triton kernels on a second GPU before).
Scripts: `benchmarks/sessions/2026-11-30-s12b.sh`, `-s12c.sh`, `-s12g.sh`, `-s12h.sh`; s12a, s12d-f and
s12i were single commands, named in their headings; raw outputs: `benchmarks/results/2026-11-30-s12{{a..i}}/`.

### Final bench, full step and no-grad forward on the same tensors, two settled rounds (s12g: `python3 -m cosdistill bench --device cuda --rounds 2 --mode full,forward --json .. --markdown .. --plot ..`)

{(R / '2026-11-30-s12g/bench.md').read_text()}
### Other shapes (s12h: `python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens T --vocab V --hidden H`; V = 262144 with `--rounds 2`, the others one round)

{(R / '2026-11-30-s12h/v262144.md').read_text()}
{(R / '2026-11-30-s12h/v151936.md').read_text()}
{(R / '2026-11-30-s12h/v32000.md').read_text()}
{(R / '2026-11-30-s12h/t3000.md').read_text()}
### The cluster row step in the step against the Triton row step (d4d75e5), call by call (NOTES item 56; s12c: `benchmarks/ab_study.py --old <d4d75e5's src> --tokens 1024 2048 4096 8192 --modes full --pairs 100`, then `--fp8 --tokens 2048 8192`, then `--tokens 4096 --vocab 262144 --hidden 2048 --pairs 60`)

{block(lines('2026-11-30-s12c/ab_seed.log', r'^T='), ['fp8:'], lines('2026-11-30-s12c/ab_fp8.log', r'^T='),
       ['V = 262144, H = 2048:'], lines('2026-11-30-s12c/ab_v262144.log', r'^T='))}
### The row step alone, 1024 rows (NOTES items 56-57; copy + step minus the copy; "in step": timed by events right after a teacher-sized GEMM)

s12b, the final kernel at `launch_config`'s settings (`benchmarks/cluster_row_step_study.py`):

{block(lines('2026-11-30-s12b/cluster_study.log', r'^vocab='))}
s12a, the first runs and the sweep of cluster size and threads (the study's flags of that time, `--threads 256 512 128`, then `--clusters 8 16 --threads 128 256`):

{block(lines('2026-11-30-s12a/cluster_sweep.log', r'^vocab='))}
s12d, the same kernel in step (`--clusters 8 16 --threads 128 192 256 --vocabs 128256 262144 --in-step`):

{block(lines('2026-11-30-s12d/cluster_in_step.log', r'^in step'))}
s12e, persistent clusters with prefetch stages (commit 77d0587, `--launches 16:128:1 16:128:3 16:256:2 8:256:2 16:256:1 8:128:2 --vocabs 128256 262144 32000 --in-step`; "launch_config" is 2 stages):

{stages_block}
s12f, persistent with per-vector refill (commit 77d0587's second form) against 11101e8's kernel (`--old`) in the same run (`--old <11101e8's src> --launches 16:256 8:128 8:256 --vocabs 128256 262144 32000 --in-step`):

{block(lines('2026-11-30-s12f/persistent_refill.log', r'^(vocab=|in step)'))}
### Correctness on the H200 (s12b and s12g: `python3 benchmarks/gpu_check.py`; s12i on the x2 machine: `python3 benchmarks/gpu_check.py --seed-tokens 2048`; s12b: `python3 benchmarks/gpu_fuzz.py --seed 12 --cases 120`)

{block(['s12b:'], lines('2026-11-30-s12b/gpu_check.log', r'row step cuda|loss cuda|PASSED|FAILED'),
       ['s12g:'], lines('2026-11-30-s12g/gpu_check.log', r'PASSED|FAILED|seed accum'),
       ['s12i:'], lines('2026-11-30-s12i/gpu_check_x2.log', r'cuda:1|PASSED|FAILED'))}
The seed study's tensors differ from s11d's (gpu_check draws its new cases first from the same seed),
so its loss error is not comparable across the two sessions; within one run the three paths agree
(the loss rows above).

{(R / '2026-11-30-s12b/fuzz/fuzz.md').read_text()}
"""

    path = Path("BENCHMARKS.md")
    text = path.read_text()
    marker = "## 2026-11-30 session 11, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code"
    assert marker in text and "session 12" not in text
    text = text.replace(marker, section + "\n" + marker.replace("current code", "before session 12"))
    path.write_text(text)


def paste_s12j():
    """The label count's A/B (s12j), added to the session-12 section after the first paste."""
    path = Path("BENCHMARKS.md")
    text = path.read_text()
    heading = ("### The label count behind the first student GEMM against d770e4f, call by call (NOTES item 59; s12j: "
               "`benchmarks/ab_study.py --old <d770e4f's src> --tokens 1024 2048 --modes full forward --pairs 150`)")
    assert heading not in text
    marker = "## 2026-11-30 session 11, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — before session 12"
    section = heading + "\n\n" + block(lines("2026-11-30-s12j/ab_count.log", r"^T=")) + "\n"
    path.write_text(text.replace(marker, section + marker))


def paste_s12k():
    """The final tip's checks (s12k), added after s12j's lines."""
    path = Path("BENCHMARKS.md")
    text = path.read_text()
    heading = ("### Correctness of the final tip (s12k: `python3 benchmarks/gpu_check.py --seed-tokens 4096`, "
               "`benchmarks/cluster_row_step_study.py --launches 8:256 --vocabs 128256`, "
               "`python3 benchmarks/gpu_fuzz.py --seed 13 --cases 80`)")
    assert heading not in text
    marker = "## 2026-11-30 session 11, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — before session 12"
    checks = block(lines("2026-11-30-s12k/gpu_check.log", r"row step cuda|loss cuda|PASSED|FAILED|seed accum"),
                   lines("2026-11-30-s12k/cluster_study.log", r"^vocab="))
    section = heading + "\n\n" + checks + "\n" + (R / "2026-11-30-s12k/fuzz/fuzz.md").read_text() + "\n"
    path.write_text(text.replace(marker, section + marker))


if __name__ == "__main__":
    import sys

    steps = {"--s12j": paste_s12j, "--s12k": paste_s12k}
    steps[sys.argv[1]]() if sys.argv[1:] else paste_main()
