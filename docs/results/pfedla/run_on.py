"""Runs not flat at the end of their column, run on: the 10-client FMNIST runs from round 600 to 1,000 (the defaults;
docs/reproduce.md, "1,000 rounds") or the 100-client ones from 2,000 to 3,000 (`--at 2000 --to 3000 --last 500`; "to
3,000 rounds"). For every run under the record folders given, one markdown row (round AT, the levels over the 20
evaluations up to rounds AT and TO, round TO, the least-squares trend over the last LAST rounds with its standard
error, the round it is flat from, the lowest evaluation after round AT, the clients' training loss at AT and TO), and
with --figure a figure of every run's personalized accuracy over its rounds, one panel per method and table.

    python docs/results/pfedla/run_on.py [--at 600 --to 1000 --last 100] [--figure OUT.png] RECORDS_FOLDER...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import yaml

from pfedkit.report.plots import read_metrics

sys.path.insert(0, str(Path(__file__).parent))
from trend import trend  # noqa: E402

KEY = "personalized_acc"


def curve(run: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Evaluated rounds, accuracy in percent, and the training loss by round."""
    rows = [r for r in read_metrics(run) if r.get(KEY) is not None]
    return (np.array([r["round"] for r in rows]), np.array([100 * r[KEY] for r in rows]),
            {r["round"]: r.get("train_loss") for r in rows})


NAMES = {"perfedavg": "Per-FedAvg", "pfedhn": "pFedHN", "pfedme": "pFedMe", "fedavg": "FedAvg", "fedfomo": "FedFomo"}


def read_config(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def label(run: Path) -> str:
    """`<records>/table1_.../seed0/perfedavg` as the docs' row names it: Per-FedAvg, Table 1, seed 0."""
    return f"{NAMES.get(run.name, run.name)}, Table {run.parent.parent.name[5]}, seed {run.parent.name[4:]}"


def signed(v: float) -> str:
    return f"{v:+.2f}".replace("-", "−")


def row(run: Path, at: int = 600, to: int = 1000, last: int = 100) -> str:
    x, y, loss = curve(run)
    t = trend(run, last)
    # a level: the 20 evaluations up to the round, LAST / 20 rounds apart
    level = [y[(x > end - last) & (x <= end)].mean() for end in (at, to)]
    flat = "–" if t["flat_from"] is None else f"{t['flat_from']:,}"
    return (f"| {label(run)} | {y[x == at][0]:.2f} | {level[0]:.2f} → {level[1]:.2f} | {y[x == to][0]:.2f} | "
            f"{signed(t['trend'])} ± {t['trend_se']:.2f} | {flat} | {y[x > at].min():.2f} | "
            f"{loss[at]:.3g} → {loss[to]:.3g} |")


def figure(runs: list[Path], out: Path, at: int = 600, to: int = 1000) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict[str, list[Path]] = {}
    for run in runs:
        panels.setdefault(label(run).rsplit(", seed", 1)[0], []).append(run)
    cols = 3
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(4.2 * cols, 3.0 * -(-len(panels) // cols)),
                             squeeze=False, sharex=True)
    for ax, (title, members) in zip(axes.flat, panels.items()):
        for run in members:
            x, y, _ = curve(run)
            ax.plot(x, y, lw=0.8, label=run.parent.name)
        ax.axvline(at, color="grey", ls="--", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(max(60.0, ax.get_ylim()[0]), ax.get_ylim()[1])
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in list(axes.flat)[:len(panels)][-cols:]:  # each column's lowest panel, above an empty one or not
        ax.set_xlabel("round")
        ax.tick_params(labelbottom=True)
    for ax in axes[:, 0]:
        ax.set_ylabel("personalized accuracy %")
    clients = {read_config(run)["partition"]["num_clients"] for run in runs}
    fig.suptitle(f"FMNIST, {'/'.join(map(str, sorted(clients)))} clients: the runs not flat at round {at:,} (dashed), "
                 f"run on to {to:,}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", type=int, default=600, help="the round the column ends (its runs' shorter end)")
    parser.add_argument("--to", type=int, default=1000, help="the round the runs were run on to")
    parser.add_argument("--last", type=int, default=100, help="the rounds the trend and the levels span")
    parser.add_argument("--figure", type=Path, help="also draw the runs' curves into this .png")
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    runs = sorted(m.parent for folder in args.folders for m in folder.rglob("metrics.jsonl"))
    at, to = f"{args.at:,}", f"{args.to:,}"
    print(f"| run | round {at} % | level at {at} → {to} % | round {to} % | trend at {to}, points per {args.last:,} "
          f"rounds | flat from | lowest after {at} % | training loss {at} → {to} |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(row(run, args.at, args.to, args.last))
    if args.figure:
        figure(runs, args.figure, args.at, args.to)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
