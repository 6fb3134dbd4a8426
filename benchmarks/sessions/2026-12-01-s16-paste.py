"""Session 16's BENCHMARKS.md section, pasted from the result files (from the repository root; a second run
replaces the section it pasted)."""
import re
from pathlib import Path

R = Path("benchmarks/results")


def lines(path, pattern):
    return [line for line in (R / path).read_text().splitlines() if re.search(pattern, line)]


def block(*groups):
    return "```\n" + "\n".join(line for group in groups for line in group) + "\n```\n"


def main():
    shapes_a = "".join((R / f"2026-12-01-s16a/{name}.md").read_text() + "\n"
                       for name in ("v262144", "v151936", "v32000", "t3000"))
    shapes_c = "".join((R / f"2026-12-01-s16c/{name}.md").read_text() + "\n"
                       for name in ("v262144", "v151936", "v32000", "t3000"))
    section = f"""## 2026-12-01 session 16, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code

Changes (NOTES items 71, 72): the Gram path (`src/cosdistill/gram.py`, `cosine_via`): without biases or softcaps,
s.t, |t|^2 and the soft term's gradient come from the heads' Gram matrices instead of the teacher's logits
GEMM; `cosine_via="auto"` takes it where `gram_is_cheaper` says its FLOPs are below 0.9 of the teacher
GEMM's; then (item 72, after s16a-d) its row step in one launch of the cluster kernel compiled for the student
alone. Providers `ours-logits` / `ours-gram` force one path (`ours` is "auto"). Scripts:
`benchmarks/sessions/2026-12-01-s16a.sh` .. `-s16f.sh` (and session 15's prepared `-s15g.sh`, run first);
raw outputs: `benchmarks/results/2026-12-01-s16{{a..f}}/`, `benchmarks/results/2026-12-01-s15g/`.
s16a and s16b ran the code before the 0.9 margin (auto then took the Gram path at V = 151936 too); the
margin changes no other shape's path.

### Final bench, full step and no-grad forward on the same tensors, three settled rounds (s16b: `python3 -m cosdistill bench --device cuda --providers ours,ours-logits,ours-fp8,liger,floor --rounds 3 --mode full,forward --json .. --markdown .. --plot ..`)

naive left out to fit the call (session 15's tables have it).

{(R / '2026-12-01-s16b/bench.md').read_text()}
### Other shapes, both paths (s16c: `python3 -m cosdistill bench --device cuda --providers ours,ours-logits,liger,floor --tokens 4096 --vocab V --hidden H`; V = 262144 with `--rounds 3`; T = 3000 at the seed shape)

Tables in order V = 262144 / H = 2048, V = 151936 / H = 3584, V = 32000 / H = 4096, T = 3000. At V = 151936
`ours` is the Gram path (before the margin); the final code takes the logits path there (`ours-logits`).

{shapes_c}
### Both paths forced, every shape once (s16a: `--providers ours-logits,ours-gram,floor`, seed `--mode full,forward`; the crossover `gram_is_cheaper` is tested against)

{(R / '2026-12-01-s16a/seed.md').read_text()}
{shapes_a}
### Correctness on the H200 (s16c: `python3 benchmarks/gpu_check.py`; every bias-free loss case also with `cosine_via="gram"`; the seed accum study at T = 8192 runs the Gram path by "auto")

{block(lines('2026-12-01-s16c/gpu_check.log', r'gram vs float64|PASSED|FAILED|seed accum'))}
### T = 32768, the Gram path (s16d: `python3 -m cosdistill bench --device cuda --providers ours,ours-logits,liger,floor --tokens 32768 --reps 5`, one round)

{(R / '2026-12-01-s16d/t32768.md').read_text()}
### The logits path against session 15's code, call by call (s16d: `benchmarks/ab_study.py --old <0f40c7f's src> --tokens 1024 2048 --modes full --pairs 80`; "auto" keeps the logits path at both; the A/A bias is about +0.3%)

{block(lines('2026-12-01-s16d/ab_seed.log', r'^T='))}
### GPU fuzz (s16d: `benchmarks/gpu_fuzz.py --seed 19 --cases 80`; the Gram path where "auto" takes it)

{(R / '2026-12-01-s16d/fuzz/fuzz.md').read_text()}
### Item 72: the Gram path's row step in one launch of the one-model cluster kernel (s16e: `benchmarks/gpu_check.py --seed-tokens 4096`; `benchmarks/ab_study.py --old <a76eb68's src> --modes full`, V = 262144 `--tokens 4096 --pairs 40 --vocab 262144 --hidden 2048`, seed `--tokens 8192 --pairs 30`)

{block(lines('2026-12-01-s16e/gpu_check.log', r'cuda gram|PASSED|FAILED'), ['V = 262144, H = 2048:'],
       lines('2026-12-01-s16e/ab_v262144.log', r'^T='), ['seed:'], lines('2026-12-01-s16e/ab_seed.log', r'^T='))}
The bench after it, one round (s16f: `--providers ours,ours-logits,floor --tokens 4096,8192 --mode full,forward`, then `--providers ours,floor --tokens 4096 --vocab 262144 --hidden 2048`):

{(R / '2026-12-01-s16f/seed.md').read_text()}
{(R / '2026-12-01-s16f/v262144.md').read_text()}
### Session 15's prepared experiments (s15g.sh, run first this session; NOTES items 69, 70; neither adopted)

Item 70, the exchange pushed by st.async (`cluster_row_step_study.py --old src --in-step --rows 512 1024`,
"launched" the variant, `--old` this tree):

{block(*[lines(f'2026-12-01-s15g/study_v{vocab}.log', r'^in step') for vocab in (262144, 128256, 151936)])}
Item 69, 1536-row student chunks (`ab_study.py --old <MIN_STUDENT_ROWS = 1536> --tokens 4096 --pairs 40 --vocab 262144 --hidden 2048`; new = 2048):

{block(lines('2026-12-01-s15g/ab_v262144_chunks.log', r'^T='))}"""
    path = Path("BENCHMARKS.md")
    text = path.read_text()
    marker = "## 2026-12-01 session 15, NVIDIA H200 (single), torch 2.11.0+cu130, Triton 3.6.0 — current code"
    pasted = "## 2026-12-01 session 16,"
    if pasted in text:  # a second run: drop the section pasted before
        before = marker.replace("current code", "before session 16")
        text = text[:text.index(pasted)] + marker + text[text.index(before) + len(before):]
    assert marker in text
    text = text.replace(marker, section + "\n" + marker.replace("current code", "before session 16"))
    path.write_text(text)


if __name__ == "__main__":
    main()
