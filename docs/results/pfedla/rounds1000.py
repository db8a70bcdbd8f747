"""The 10-client FMNIST runs not flat at round 600, run on to 1,000 (docs/reproduce.md, "1,000 rounds"): for every
run under the record folders given, one markdown row (round 600, the levels over the 20 evaluations up to rounds 600
and 1,000, round 1,000, the least-squares trend over the last 100 rounds with its standard error, the round it is
flat from, the lowest evaluation after round 600, the clients' training loss at 600 and 1,000), and with --figure a
figure of every run's personalized accuracy over the 1,000 rounds, one panel per method and table.

    python docs/results/pfedla/rounds1000.py [--figure OUT.png] RECORDS_FOLDER...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

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


def label(run: Path) -> str:
    """`<records>/table1_.../seed0/perfedavg` as the docs' row names it: Per-FedAvg, Table 1, seed 0."""
    return f"{NAMES.get(run.name, run.name)}, Table {run.parent.parent.name[5]}, seed {run.parent.name[4:]}"


def signed(v: float) -> str:
    return f"{v:+.2f}".replace("-", "−")


def row(run: Path) -> str:
    x, y, loss = curve(run)
    t = trend(run, 100)
    level = [y[(x > end - 100) & (x <= end)].mean() for end in (600, 1000)]
    flat = "–" if t["flat_from"] is None else f"{t['flat_from']:,}"
    return (f"| {label(run)} | {y[x == 600][0]:.2f} | {level[0]:.2f} → {level[1]:.2f} | {y[-1]:.2f} | "
            f"{signed(t['trend'])} ± {t['trend_se']:.2f} | {flat} | {y[x > 600].min():.2f} | "
            f"{loss[600]:.3g} → {loss[1000]:.3g} |")


def figure(runs: list[Path], out: Path) -> None:
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
        ax.axvline(600, color="grey", ls="--", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(max(60.0, ax.get_ylim()[0]), ax.get_ylim()[1])
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("round")
    for ax in axes[:, 0]:
        ax.set_ylabel("personalized accuracy %")
    fig.suptitle("FMNIST, 10 clients: the runs not flat at round 600 (dashed), run on to 1,000", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figure", type=Path, help="also draw the runs' curves into this .png")
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    runs = sorted(m.parent for folder in args.folders for m in folder.rglob("metrics.jsonl"))
    print("| run | round 600 % | level at 600 → 1,000 % | round 1,000 % | trend at 1,000, points per 100 rounds | "
          "flat from | lowest after 600 % | training loss 600 → 1,000 |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(row(run))
    if args.figure:
        figure(runs, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
