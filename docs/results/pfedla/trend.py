"""What the flatness criterion's drift does not see: a slow climb (or fall) over the end of a run, and how far its
last value lies from the rest of its plateau; the evidence behind docs/reproduce.md, 'How still is flat?'. For every
run under the folders given (each folder holding a metrics.jsonl is one run), over its evaluations in the last LAST
rounds: the mean and (population) std of the metric (the personalized accuracy unless --metric names another), its
least-squares trend in points per LAST rounds with the trend's standard error, at how many of those evaluations the
drift held (pfedkit.reproduce's drift within FLAT_POINTS) and the final value; then the round the run is flat from
(the first evaluated round from which the whole criterion, drift and trend, holds at every later evaluation), one
markdown row a run.

    python docs/results/pfedla/trend.py [--last 500] [--metric global_acc_weighted] FOLDER...
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from pfedkit.report.plots import read_metrics
from pfedkit.reproduce import FLAT_POINTS, drift, fit_line, steady, trend as criterion_trend

KEY = "personalized_acc"


def trend(run_dir: Path, last: int = 500, key: str = KEY) -> dict:
    rows = [r for r in read_metrics(run_dir) if r.get(key) is not None]
    rounds = np.array([r["round"] for r in rows], dtype=float)
    points = np.array([100 * r[key] for r in rows])
    late = rounds > rounds[-1] - last
    x, y = rounds[late], points[late]
    slope, se = fit_line(x, y)  # the slope's standard error: is the trend more than the swings?
    drifts = [drift(list(points[:i + 1])) for i in np.flatnonzero(late)]  # in points, as FLAT_POINTS
    flat = [steady(drift(list(points[:i])), criterion_trend(list(rounds[:i]), list(points[:i])))
            for i in range(1, len(points) + 1)]
    since = next((i for i in range(len(flat)) if all(flat[i:])), None)
    return {"run": str(run_dir), "evaluations": len(x), "mean": float(y.mean()), "std": float(y.std()),
            "trend": float(slope * last), "trend_se": float(se * last), "final": float(points[-1]),
            "flat_at": sum(d is not None and abs(d) <= FLAT_POINTS for d in drifts),
            "flat_from": None if since is None else int(rounds[since])}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--last", type=int, default=500, help="the end of a run to read, in rounds")
    parser.add_argument("--metric", default=KEY, help="a metric of metrics.jsonl (global_acc_weighted: pFedCS's GM)")
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print(f"| run | evaluations | mean % | std | trend, points per {args.last} rounds (± se) | drift held | "
          "final % | flat from |")
    print("|---|---|---|---|---|---|---|---|")
    for folder in args.folders:
        for metrics in sorted(folder.rglob("metrics.jsonl")):
            t = trend(metrics.parent, args.last, args.metric)
            print(f"| {t['run']} | {t['evaluations']} | {t['mean']:.2f} | {t['std']:.2f} | {t['trend']:+.2f} ± "
                  f"{t['trend_se']:.2f} | {t['flat_at']} of {t['evaluations']} | {t['final']:.2f} | "
                  f"{'not flat' if t['flat_from'] is None else t['flat_from']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
