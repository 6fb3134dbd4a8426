"""Markdown tables from the measurement ledger (benchmarks/results.csv, appended by ``cosdistill bench --ledger``).

One table per (commit, GPU, workload, mode, rounds) selected: a row per provider, a column per T, each
cell the ratio to the floor timed in the same run, with the milliseconds and, where the run had
several rounds, the spread of the per-round ratios; a last column with the peak memory above the
inputs at each T.

    python benchmarks/ledger.py [--ledger benchmarks/results.csv] [--commit 5a0bf7b ...] [--mode full]
"""

import argparse
import csv
from collections import defaultdict
from pathlib import Path

LEDGER = Path(__file__).with_name("results.csv")


def read(path=LEDGER) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def cell(row: dict) -> str:
    ratio, ms = row["ratio_to_floor"], float(row["ms"])
    text = f"{float(ratio):.3f}x ({ms:.2f} ms)" if ratio else f"{ms:.2f} ms"
    by_round = [float(value) for value in row["ratio_to_floor_by_round"].split()]
    if len(by_round) > 1:
        text += f" [{min(by_round):.2f}-{max(by_round):.2f}]"
    return text


def tables(rows: list[dict]) -> str:
    runs = defaultdict(list)
    for row in rows:
        key = (row["commit"], row["gpu"], row["torch"], row["triton"], row["workload"], row["mode"], row["command"])
        runs[key].append(row)
    out = []
    for (commit, gpu, torch_version, triton_version, workload, mode, command), run in runs.items():
        tokens = sorted({int(row["T"]) for row in run})
        providers = list(dict.fromkeys(row["provider"] for row in run))
        by_key = {(row["provider"], int(row["T"])): row for row in run}
        out += [f"{gpu}, torch {torch_version}, Triton {triton_version}, commit {commit}, {run[0]['date']}: "
                f"{workload}, mode {mode}", "", f"`{command}`", "",
                "| provider | " + " | ".join(f"T = {t}" for t in tokens) + " | peak GB above inputs |",
                "|---|" + "---|" * (len(tokens) + 1)]
        for provider in providers:
            cells = [cell(by_key[(provider, t)]) if (provider, t) in by_key else "-" for t in tokens]
            peaks = [by_key[(provider, t)]["peak_gb_above_inputs"] for t in tokens if (provider, t) in by_key]
            peaks = [float(peak) for peak in peaks if peak]
            peak = "-" if not peaks else " / ".join(f"{peak:.2f}" for peak in peaks)
            out.append(f"| {provider} | " + " | ".join(cells) + f" | {peak} |")
        out.append("")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", default=LEDGER)
    parser.add_argument("--commit", nargs="*", help="only these commits (default: all)")
    parser.add_argument("--mode", help="only this mode (full or forward)")
    args = parser.parse_args()
    rows = [row for row in read(args.ledger) if (not args.commit or row["commit"] in args.commit)
            and (not args.mode or row["mode"] == args.mode)]
    print(tables(rows), end="")


if __name__ == "__main__":
    main()
