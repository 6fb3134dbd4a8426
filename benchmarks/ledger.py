"""Markdown tables and the README's plot from the measurement ledger (benchmarks/results.csv, appended by
``cosdistill bench --ledger``).

One table per run selected (rows that share commit, GPU, versions, workload, mode and command, until a
provider and T come again: the same command run twice is two runs): a row per provider, a column per T, each
cell the ratio to the floor timed in the same run, with the milliseconds and, where the run had
several rounds, the spread of the per-round ratios; a last column with the peak memory above the
inputs at each T. The training step's rows (benchmarks/step.py) have no floor: their cells are ms, their
peak the whole process's, and mode "max-tokens" marks the largest step that fitted.

    python benchmarks/ledger.py [--ledger benchmarks/results.csv] [--commit 5a0bf7b ...] [--mode full]
    python benchmarks/ledger.py --commit 5a0bf7b --providers ours,ours-fp8,liger,naive,floor --compact
    python benchmarks/ledger.py --commit c4e12e7 --workload "V=128256 " --compact
    python benchmarks/ledger.py --commit 1724d88 --loss cosine --compact
    python benchmarks/ledger.py --commit 65372b1 --loss jsd --gpu H200 --spread
    python benchmarks/ledger.py --commit 82b5f6d --loss cosine --providers ours,ours-fp8,liger,naive \\
        --workload "V=128256 " --plot docs/speed.png

``--spread`` prints every selected run's ratio side by side, for a bar that one run cannot call; ``--by-run
PROVIDER`` one provider's ratios, a row per run (its commit, GPU and date), for a shape measured again and again.

    python benchmarks/ledger.py --loss jsd --workload "V=32000 " --by-run ours

The plot (needs matplotlib) draws each provider's ratio to the floor against T, one line per provider,
from the selected rows; where a (provider, T) was measured in several runs, the last row counts.
"""

import argparse
import csv
import os
import re
import statistics
from collections import defaultdict
from pathlib import Path

LEDGER = Path(__file__).with_name("results.csv")


def read(path=LEDGER) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def cell(row: dict) -> str:
    """The ratio to the floor and the ms; where a run has no floor (the training step), the ms, and the
    per-round values are ms too; a row without ms (the largest step that fits) says so."""
    if not row["ms"]:
        return "fits"
    ratio, ms = row["ratio_to_floor"], float(row["ms"])
    text = f"{float(ratio):.3f}x ({ms:.2f} ms)" if ratio else f"{ms:.2f} ms"
    by_round = [float(value) for value in row["ratio_to_floor_by_round"].split()]
    if len(by_round) > 1:
        text += f" [{min(by_round):.2f}-{max(by_round):.2f}{'' if ratio else ' ms'}]"
    return text


def runs_of(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """(what the run's rows share, its rows) per run, in ledger order within each shared key."""
    runs = defaultdict(list)  # shared key -> its runs, each a list of rows
    for row in rows:
        key = (row["commit"], row["gpu"], row["torch"], row["triton"], row["workload"], row["mode"], row["command"])
        measured = (row["provider"], row["T"])
        if not runs[key] or any((other["provider"], other["T"]) == measured for other in runs[key][-1]):
            runs[key].append([])
        runs[key][-1].append(row)
    return [(key, run) for key, key_runs in runs.items() for run in key_runs]


def tables(rows: list[dict]) -> str:
    out = []
    for (commit, gpu, torch_version, triton_version, workload, mode, command), run in runs_of(rows):
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


def compact_table(rows: list[dict]) -> str:
    """One table over all the selected runs: a row per provider, a column per T, each cell the ratio to
    the floor (the last run's where several measured it), and the peak GB above the inputs."""
    last = {(row["provider"], int(row["T"])): row for row in rows}
    tokens = sorted({t for _, t in last})
    lines = ["| provider | " + " | ".join(f"T = {t}" for t in tokens) + " | peak GB above inputs |",
             "|---|" + "---:|" * len(tokens) + "---|"]
    for provider in dict.fromkeys(provider for provider, _ in last):
        measured = [last.get((provider, t)) for t in tokens]
        cells = ["-" if row is None else f"{float(row['ms']):.2f} ms" if provider == "floor" or not row["ratio_to_floor"]
                 else f"{float(row['ratio_to_floor']):.2f}x" for row in measured]
        peaks = [f"{float(row['peak_gb_above_inputs']):.2f}" for row in measured if row and row["peak_gb_above_inputs"]]
        lines.append(f"| {provider} | " + " | ".join(cells) + f" | {' / '.join(peaks) if provider != 'floor' else '-'} |")
    return "\n".join(lines) + "\n"


def spread_table(rows: list[dict]) -> str:
    """One table over all the selected runs: a row per provider, a column per T, each cell every run's ratio
    to the floor in ledger order (the floor: its ms), and their median."""
    measured = defaultdict(list)
    for row in rows:
        if row["ms"] and (row["ratio_to_floor"] or row["provider"] == "floor"):
            value = float(row["ms"] if row["provider"] == "floor" else row["ratio_to_floor"])
            measured[(row["provider"], int(row["T"]))].append(value)
    tokens = sorted({t for _, t in measured})
    lines = ["| provider | " + " | ".join(f"T = {t}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for provider in dict.fromkeys(provider for provider, _ in measured):
        cells = []
        for t in tokens:
            values = measured.get((provider, t), [])
            unit = " ms" if provider == "floor" else ""
            listed = " / ".join(f"{value:.{2 if unit else 3}f}" for value in values)
            cells.append(f"{listed}{unit} (median {statistics.median(values):.{2 if unit else 3}f})" if values else "-")
        lines.append(f"| {provider} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def by_run_table(rows: list[dict], provider: str) -> str:
    """One table over the selected runs: a row per run that timed ``provider`` (its commit, GPU and date), a column
    per T, each cell that run's ratio to the floor and, where it had several rounds, their range."""
    tokens = sorted({int(row["T"]) for row in rows if row["provider"] == provider and row["ratio_to_floor"]})
    lines = ["| commit | GPU | date | " + " | ".join(f"T = {t}" for t in tokens) + " |",
             "|---|---|---|" + "---:|" * len(tokens)]
    for (commit, gpu, *_), run in runs_of(rows):
        timed = {int(row["T"]): row for row in run if row["provider"] == provider and row["ratio_to_floor"]}
        if not timed:
            continue
        cells = []
        for t in tokens:
            row = timed.get(t)
            by_round = [float(value) for value in row["ratio_to_floor_by_round"].split()] if row else []
            spread = f" [{min(by_round):.2f}-{max(by_round):.2f}]" if len(by_round) > 1 else ""
            cells.append("-" if row is None else f"{float(row['ratio_to_floor']):.2f}x{spread}")
        gpu_name = gpu.removeprefix("NVIDIA ").split(" ")[0]
        lines.append(f"| {commit[:7]} | {gpu_name} | {run[0]['date']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def kinds_of_run(rows: list[dict]) -> set[tuple]:
    """What must be one for rows to share a table: GPU, versions, workload (rounds aside) and mode."""
    return {(row["gpu"], row["torch"], row["triton"], re.sub(r" rounds=\d+", "", row["workload"]), row["mode"])
            for row in rows}


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    last = {(row["provider"], int(row["T"])): row for row in rows if row["ratio_to_floor"]}
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for provider in dict.fromkeys(provider for provider, _ in last):
        tokens = sorted(t for name, t in last if name == provider)
        axes.plot(tokens, [float(last[(provider, t)]["ratio_to_floor"]) for t in tokens], marker="o", label=provider)
    axes.axhline(1.0, color="black", linewidth=0.8, label="floor: the four GEMMs alone")
    axes.set_xscale("log", base=2)
    all_tokens = sorted({t for _, t in last})
    axes.set_xticks(all_tokens, [str(t) for t in all_tokens])
    axes.set_xlabel("tokens per call (T)")
    axes.set_ylabel("time / floor's time, same run")
    first = next(iter(last.values()))
    shape = re.sub(r" rounds=\d+", "", first["workload"])  # the loss (" loss=jsd") stays in the title
    axes.set_title(f"{first['gpu']}, {shape}, forward + backward", fontsize=9)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=120)


def beta_of(workload: str) -> float | None:
    """A JSD row's beta: its workload's " beta=B", else fused_linear_jsd's default of 0.5; None for the cosine's."""
    if "loss=jsd" not in workload:
        return None
    named = re.search(r" beta=(\S+)", workload)
    return float(named.group(1)) if named else 0.5


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledger", default=LEDGER)
    parser.add_argument("--commit", nargs="*", help="only these commits, each a hash or its start (default: all)")
    parser.add_argument("--mode", help="only this mode (full, forward, or a script's: step, trl-step, ...)")
    parser.add_argument("--providers", help="only these providers, comma separated")
    parser.add_argument("--workload", help="only rows whose workload contains this text (e.g. 'V=128256 ', 'loss=jsd')")
    parser.add_argument("--loss", choices=("cosine", "jsd"), help="only this soft term's rows (jsd: 'loss=jsd' in the workload)")
    parser.add_argument("--beta", type=float, help="only the JSD's rows at this beta (those that name none: 0.5)")
    parser.add_argument("--gpu", help="only rows whose GPU contains this text (e.g. 'H200')")
    parser.add_argument("--compact", action="store_true", help="one table of ratios over the selected runs")
    parser.add_argument("--spread", action="store_true", help="one table with every selected run's ratios")
    parser.add_argument("--by-run", metavar="PROVIDER", help="one provider's ratios, a row per selected run")
    parser.add_argument("--plot", metavar="PATH.png", help="plot the selected rows (mode full) instead of printing tables")
    args = parser.parse_args()
    if not os.path.isfile(args.ledger):
        parser.error(f"--ledger {args.ledger}: no such file")
    providers = args.providers.split(",") if args.providers else None
    rows = [row for row in read(args.ledger) if (not args.commit or row["commit"].startswith(tuple(args.commit)))
            and (not args.mode or row["mode"] == args.mode) and (not providers or row["provider"] in providers)
            and (not args.workload or args.workload in row["workload"]) and (not args.gpu or args.gpu in row["gpu"])
            and (not args.loss or ("loss=jsd" in row["workload"]) == (args.loss == "jsd"))
            and (args.beta is None or beta_of(row["workload"]) == args.beta)]
    if args.plot:
        rows = [row for row in rows if row["mode"] == "full"]
    if not rows:  # a misspelt selection printed nothing and passed
        parser.exit(2, "ledger.py: no rows of the ledger match the selection\n")
    if (args.spread or args.by_run) and not any(row["ratio_to_floor"] for row in rows
                                                 if row["provider"] == (args.by_run or row["provider"])):
        parser.exit(2, "ledger.py: --spread and --by-run show ratios to the floor, which these rows (of a script "
                       "with no floor, or of another provider) do not hold\n")
    if args.by_run and len(kinds := {kind[3:] for kind in kinds_of_run(rows)}) != 1:  # GPUs and versions may differ
        shown = "; ".join(" ".join(kind) for kind in sorted(kinds)) or "no rows"
        parser.exit(2, f"ledger.py: --by-run takes runs of one workload and mode, these rows are of {len(kinds)} "
                       f"({shown}): narrow them with --workload, --loss, --beta or --mode\n")
    if (args.plot or args.spread or args.compact) and len(kinds := kinds_of_run(rows)) != 1:
        shown = "; ".join(" ".join(kind) for kind in sorted(kinds)) or "no rows"
        parser.exit(2, f"ledger.py: --compact, --spread and --plot take runs of one kind, these rows are of "
                       f"{len(kinds)} ({shown}): narrow them with --gpu, --workload, --beta, --mode or --commit\n")
    if args.plot:
        plot(rows, args.plot)
    elif args.by_run:
        print(by_run_table(rows, args.by_run), end="")
    elif args.spread:
        print(spread_table(rows), end="")
    elif args.compact:
        print(compact_table(rows), end="")
    else:
        print(tables(rows), end="")


if __name__ == "__main__":
    main()
