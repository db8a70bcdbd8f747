"""The comparison table (markdown) built from the run folders' summary.json files."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..engine.files import atomic_write
from ..errors import FAILED_FILE


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def comparison_markdown(summaries: list[dict], header: str = "") -> str:
    lines = [header, "",
             "| algorithm | personalized acc % (mean ± std over clients) | last-5 mean % | worst decile % "
             "| global acc % | global micro % | MB up | MB down | seconds | server s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if "failed" in s:
            lines.append(f"| {s['algorithm']} | failed: {s['failed']} | | | | | | | | |")
            continue
        lines.append(
            f"| {s['algorithm']} | {_pct(s['personalized_acc'])} ± {_pct(s['personalized_acc_std'])} "
            f"| {_pct(s['final_last5'])} | {_pct(s['personalized_acc_p10'])} | {_pct(s['global_acc'])} "
            f"| {_pct(s['global_acc_weighted'])} | {s['mb_up_total']:.2f} | {s['mb_down_total']:.2f} | {s['wall_s']:.1f} | {s['server_s_total']:.2f} |")
    done = [s for s in summaries if "failed" not in s]
    if done:
        lines.append(f"| *majority label (reference)* | {_pct(done[0]['majority_label_acc'])} | | | | | 0 | 0 | | |")
    lines += ["", "Personalized accuracy: each client's test accuracy with its personalized model, unweighted mean over "
              "all clients at the final round (± std over clients); last-5 mean: the mean of the last 5 evaluations; "
              "worst decile: 10th percentile over clients. Global: the global model on every client's test split (mean over "
              "clients; micro: all test samples pooled, as pFedMe's code reports). "
              "MB: tensors that crossed the wire, all rounds. Seconds: the run's wall time (runs side by side, "
              "runtime.batch_runs, overlap: their sum is not the job's). Majority label: each client always predicts "
              "its most frequent training label.", ""]
    return "\n".join(lines)


def write_comparison(out_dir: Path, run_dirs: list[Path], header: str = "") -> Path:
    summaries = []
    for d in map(Path, run_dirs):
        if (d / "summary.json").is_file():
            summaries.append(json.loads((d / "summary.json").read_text()))
        elif (d / FAILED_FILE).is_file():
            summaries.append({"algorithm": d.name, "failed": (d / FAILED_FILE).read_text()})
    path = Path(out_dir) / "comparison.md"
    atomic_write(path, comparison_markdown(summaries, header).encode())
    return path


def _mean_std(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:  # one seed: no spread to show
        return f"{100 * vals[0]:.2f}"
    return f"{100 * np.mean(vals):.2f} ± {100 * np.std(vals, ddof=1):.2f}"  # the sample std over seeds


def write_seed_comparison(out_dir: Path, seed_dirs: list[Path], algorithms: list[str], header: str = "") -> Path:
    """Mean ± std over seeds of each algorithm's final values (each seed: its own partition, init, sampling)."""
    lines = [header, "",
             "| algorithm | personalized acc % | last-5 mean % | worst decile % | global acc % | global micro % "
             "| MB up | MB down | seconds | seeds |", "|---|---|---|---|---|---|---|---|---|---|"]
    majority = []
    for name in algorithms:
        runs = [json.loads((d / name / "summary.json").read_text()) for d in seed_dirs
                if (d / name / "summary.json").is_file()]
        failed = sum((d / name / FAILED_FILE).is_file() for d in seed_dirs)
        if failed and not runs:
            lines.append(f"| {name} | failed in every seed | | | | | | | | 0 |")
        if not runs:
            continue
        majority = [r["majority_label_acc"] for r in runs]
        lines.append(
            f"| {name} | {_mean_std([r['personalized_acc'] for r in runs])} "
            f"| {_mean_std([r['final_last5'] for r in runs])} | {_mean_std([r['personalized_acc_p10'] for r in runs])} "
            f"| {_mean_std([r['global_acc'] for r in runs])} | {_mean_std([r['global_acc_weighted'] for r in runs])} "
            f"| {np.mean([r['mb_up_total'] for r in runs]):.2f} "
            f"| {np.mean([r['mb_down_total'] for r in runs]):.2f} | {np.mean([r['wall_s'] for r in runs]):.1f} "
            f"| {len(runs)}{f' ({failed} failed)' if failed else ''} |")
    if majority:
        lines.append(f"| *majority label (reference)* | {_mean_std(majority)} | | | | | 0 | 0 | | |")
    lines += ["", "Mean ± sample std (n − 1) over seeds of the final evaluation (each seed draws its own partition, initialization, "
              "client sampling and batches). Accuracies are unweighted means over all clients; see each seed's "
              "comparison.md for the spread over clients.", ""]
    path = Path(out_dir) / "comparison.md"
    atomic_write(path, "\n".join(lines).encode())
    return path
