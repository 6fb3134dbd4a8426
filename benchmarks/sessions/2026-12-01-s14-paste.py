"""Session 14's BENCHMARKS.md section, pasted from the result files (from the repository root; a second run
replaces the section it pasted)."""
import re
from pathlib import Path

R = Path("benchmarks/results")


def lines(path, pattern):
    return [line for line in (R / path).read_text().splitlines() if re.search(pattern, line)]


def block(*groups):
    return "```\n" + "\n".join(line for group in groups for line in group) + "\n```\n"


def main():
    ab = "`benchmarks/ab_study.py --old <that src>`"
    study = "`benchmarks/cluster_row_step_study.py`"
    rows = r"^(vocab=|in step)"
    section = f"""## 2026-12-01 session 14, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code

Change (NOTES item 65): the CUDA row step holds part of each block's row slice in registers where that
lets more blocks share an SM (`row_step_cuda.Layout.register_cols`, chosen by `launch_config`).
Scripts: `benchmarks/sessions/2026-12-01-s14a.sh` .. `-s14j.sh`; raw outputs:
`benchmarks/results/2026-12-01-s14{{a..j}}/`.

### Final bench, full step and no-grad forward on the same tensors, three settled rounds (s14g: `python3 -m cosdistill bench --device cuda --rounds 3 --mode full,forward --json .. --markdown .. --plot ..`)

{(R / '2026-12-01-s14g/bench.md').read_text()}
### Other shapes (s14f, the final code: `python3 -m cosdistill bench --device cuda --providers ours,liger,floor --tokens T --vocab V --hidden H`; V = 262144 with `--rounds 3`, the others one round)

{(R / '2026-12-01-s14f/v262144.md').read_text()}
{(R / '2026-12-01-s14f/v151936.md').read_text()}
{(R / '2026-12-01-s14f/v32000.md').read_text()}
{(R / '2026-12-01-s14f/t3000.md').read_text()}
### The change against the code before it, call by call ({ab}, settled)

Item 65 against 435ab5f (s14b: `--tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048`, then `--tokens 1024 2048 --modes full --pairs 100`):

{block(['V = 262144, H = 2048:'], lines('2026-12-01-s14b/ab_v262144.log', r'^T='), ['seed:'], lines('2026-12-01-s14b/ab_seed.log', r'^T='))}
A layout not adopted, (16, 224, 3) at V = 262144 (it spills 32 bytes), as "old" against the final code (s14h: `--old <this tree, launch_config giving (16, 224, 3) at V = 262144> --tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048`):

{block(lines('2026-12-01-s14h/ab_v262144_224.log', r'^T='))}
### The row step alone and right after a teacher-sized GEMM, 1024 rows ({study} `--in-step`; CLUSTER:THREADS:REGISTER_COLS layouts)

s14a, register layouts against 435ab5f's kernel (`--old`; launch_config's row is the new source without register vectors):

{block(lines('2026-12-01-s14a/study_v262144.log', rows), lines('2026-12-01-s14a/study_v128256.log', rows), lines('2026-12-01-s14a/study_v151936.log', rows))}
s14b, the adopted launch_config at nine vocabularies against 435ab5f (49152 then took a register vector; the final rule gives it none, i.e. 435ab5f's kernel):

{block(lines('2026-12-01-s14b/study.log', rows))}
s14c and s14d, more warps per SM and 8-block clusters at V = 262144 (and 200064):

{block(lines('2026-12-01-s14c/study.log', rows), lines('2026-12-01-s14d/study_v262144.log', rows), lines('2026-12-01-s14d/study_v200064.log', rows))}
s14e, a gradient loop that takes the label's entry first (fewer registers; slower, reverted), against 435ab5f:

{block(lines('2026-12-01-s14e/study_v262144.log', rows), lines('2026-12-01-s14e/study_v128256.log', rows), lines('2026-12-01-s14e/study_v151936.log', rows))}
s14j, a label fix-up that re-reads its two logits from the packed vectors (`benchmarks/sessions/2026-12-01-s14j-patch.py` applied to this tree, which runs as `--old`; not adopted):

{block(lines('2026-12-01-s14j/study_v262144.log', rows), lines('2026-12-01-s14j/study_v128256.log', rows))}
### Correctness on the H200 (`python3 benchmarks/gpu_check.py --seed-tokens 4096` in s14a and s14b; GPU fuzz s14b: `--seed 16 --cases 80`; the study's checks before each timing)

gpu_check's "row step cuda vs torch" rows run the CUDA kernel for the first time (NOTES item 64).

{block(['s14a (the new source, no register vectors yet):'], lines('2026-12-01-s14a/gpu_check.log', r'row step cuda|PASSED|FAILED|seed accum'),
       ['s14b (the adopted layouts):'], lines('2026-12-01-s14b/gpu_check.log', r'row step cuda|PASSED|FAILED'))}
{(R / '2026-12-01-s14b/fuzz/fuzz.md').read_text()}
### Tried and reverted: the CUDA row step with softcaps and logit scales compiled in (NOTES item 66; s14i, commit a916c42: {study} `--in-step --softcap 30 --logit-scale 0.5 --vocabs 256000 128256 262144`, "triton" is the step the library keeps there)

{block(lines('2026-12-01-s14i/study.log', rows))}
Its correctness on the H200 (s14i: the study's checks, then gpu_check and `benchmarks/gpu_fuzz.py --seed 17 --cases 60` on that commit):

{block(lines('2026-12-01-s14i/study.log', r'^(rows=|int32|overflow).* cuda:'),
       lines('2026-12-01-s14i/gpu_check.log', r'row step cuda|PASSED|FAILED'))}
{(R / '2026-12-01-s14i/fuzz/fuzz.md').read_text()}
"""
    path = Path("BENCHMARKS.md")
    text = path.read_text()
    marker = "## 2026-11-30 session 13, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code"
    pasted = "## 2026-12-01 session 14,"
    if pasted in text:  # a second run: drop the section pasted before
        before = marker.replace("current code", "before session 14")
        text = text[:text.index(pasted)] + marker + text[text.index(before) + len(before):]
    assert marker in text
    text = text.replace(marker, section + "\n" + marker.replace("current code", "before session 14"))
    path.write_text(text)


if __name__ == "__main__":
    main()
