"""Session 15's BENCHMARKS.md section, pasted from the result files (from the repository root; a second run
replaces the section it pasted)."""
import re
from pathlib import Path

R = Path("benchmarks/results")


def lines(path, pattern):
    return [line for line in (R / path).read_text().splitlines() if re.search(pattern, line)]


def block(*groups):
    return "```\n" + "\n".join(line for group in groups for line in group) + "\n```\n"


def main():
    ab = "`benchmarks/ab_study.py --old <0d578a8's src>`"
    study = "`benchmarks/cluster_row_step_study.py`"
    rows = r"^(vocab=\d+: (copy|triton|--old|cuda)|in step)"
    studies_a = [lines(f"2026-12-01-s15a/study_v{vocab}.log", rows)
                 for vocab in (262144, 256000, 151936, 98304, 128256, 65536, 49152, 32000)]
    section = f"""## 2026-12-01 session 15, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code

Change (NOTES item 67): the CUDA row step's layout is the first of `row_step_cuda.launch_configs(vocab)`
(threads 128-256 in steps of 32; most blocks per SM, then most warps, then fewest register vectors) whose
kernel this NVRTC compiles without a spill; the label's fix-up re-reads its two logits from the packed
vectors (session 14's s14j variant). Scripts: `benchmarks/sessions/2026-12-01-s15a.sh` .. `-s15e.sh`; raw
outputs: `benchmarks/results/2026-12-01-s15{{a..e}}/`.

### Final bench, full step and no-grad forward on the same tensors, three settled rounds (s15e: `python3 -m cosdistill bench --device cuda --rounds 3 --mode full,forward --json .. --markdown .. --plot ..`)

{(R / '2026-12-01-s15e/bench.md').read_text()}
### Other shapes (s15d, the final code: `python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens 4096 --vocab V --hidden H`; V = 262144 with `--rounds 3`, V = 151936 one round)

The seed bench of the same call ran past its 400 s limit (119 of 120 timings) and left no table; s15e
is its rerun. V = 32000 and T = 3000 keep their layouts (s14f's figures stand).

{(R / '2026-12-01-s15d/v262144.md').read_text()}
{(R / '2026-12-01-s15d/v151936.md').read_text()}
### The change against the code before it, call by call ({ab}, settled; s15b)

`--tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048`, `--pairs 40 --vocab 151936 --hidden 3584`, then the seed's `--tokens 1024 2048 --modes full --pairs 100`:

{block(['V = 262144, H = 2048:'], lines('2026-12-01-s15b/ab_v262144.log', r'^T='), ['V = 151936, H = 3584:'],
       lines('2026-12-01-s15b/ab_v151936.log', r'^T='), ['seed:'], lines('2026-12-01-s15b/ab_seed.log', r'^T='))}
### The layout each vocabulary gets on the H200 (s15b: `row_step_cuda._launch`, then the kernel's registers and the occupancy query)

{block(lines('2026-12-01-s15b/picks.log', r'clusters at once'))}
### The row step alone and right after a teacher-sized GEMM, 1024 rows ({study} `--old <0d578a8's src> --in-step --launches ...`; CLUSTER:THREADS:REGISTER_COLS layouts)

s15a, the sweep (the source with the label fix-up; the "launch_config" rows are 0d578a8's rule on the new source):

{block(*studies_a)}
s15b, the new rule's picks at the two vocabularies s15a did not time:

{block(lines('2026-12-01-s15b/study_v200064.log', rows), lines('2026-12-01-s15b/study_v98304.log', rows))}
s15c, each block's loads issued before it waits for the label (NOTES item 68, `benchmarks/sessions/2026-12-01-s15c-patch.py`;
"launched" is the variant, `--old` this tree; `--rows 512 1024`, then `--ignored 0.5`; not adopted):

{block(lines('2026-12-01-s15c/study_dense.log', r'^in step'), lines('2026-12-01-s15c/study_half_ignored.log', r'^in step'))}
### Correctness on the H200 (s15b: `python3 benchmarks/gpu_check.py --seed-tokens 4096`, `benchmarks/gpu_fuzz.py --seed 18 --cases 80`; the study's checks before each timing)

{block(lines('2026-12-01-s15b/gpu_check.log', r'row step cuda|PASSED|FAILED|seed accum'))}
{(R / '2026-12-01-s15b/fuzz/fuzz.md').read_text()}
"""
    path = Path("BENCHMARKS.md")
    text = path.read_text()
    marker = "## 2026-12-01 session 14, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code"
    pasted = "## 2026-12-01 session 15,"
    if pasted in text:  # a second run: drop the section pasted before
        before = marker.replace("current code", "before session 15")
        text = text[:text.index(pasted)] + marker + text[text.index(before) + len(before):]
    assert marker in text
    text = text.replace(marker, section + "\n" + marker.replace("current code", "before session 15"))
    path.write_text(text)


if __name__ == "__main__":
    main()
