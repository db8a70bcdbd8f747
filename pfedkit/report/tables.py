"""The comparison table (markdown) built from the run folders' summary.json files."""
from __future__ import annotations

import json
from pathlib import Path


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def comparison_markdown(summaries: list[dict], header: str = "") -> str:
    lines = [header, "",
             "| algorithm | personalized acc % (mean ± std over clients) | last-5 mean % | worst decile % "
             "| global acc % | MB up | MB down | seconds | server s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(
            f"| {s['algorithm']} | {_pct(s['personalized_acc'])} ± {_pct(s['personalized_acc_std'])} "
            f"| {_pct(s['final_last5'])} | {_pct(s['personalized_acc_p10'])} | {_pct(s['global_acc'])} "
            f"| {s['mb_up_total']:.2f} | {s['mb_down_total']:.2f} | {s['wall_s']:.1f} | {s['server_s_total']:.2f} |")
    if summaries:
        lines.append(f"| *majority label (reference)* | {_pct(summaries[0]['majority_label_acc'])} | | | | 0 | 0 | | |")
    lines += ["", "Personalized accuracy: each client's test accuracy with its personalized model, unweighted mean over "
              "all clients at the final round (± std over clients); last-5 mean: the mean of the last 5 evaluations; "
              "worst decile: 10th percentile over clients. Global: the global model on every client's test split. "
              "MB: tensors that crossed the wire, all rounds. Majority label: each client always predicts its most "
              "frequent training label.", ""]
    return "\n".join(lines)


def write_comparison(out_dir: Path, run_dirs: list[Path], header: str = "") -> Path:
    summaries = [json.loads((Path(d) / "summary.json").read_text()) for d in run_dirs
                 if (Path(d) / "summary.json").is_file()]
    path = Path(out_dir) / "comparison.md"
    path.write_text(comparison_markdown(summaries, header))
    return path
