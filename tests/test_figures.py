"""What a person sees in the figures: every method of a 13-method comparison in a colour of its own (no two alike:
the probe found Local/FedRep, FedAvg/FedFomo and pFedLA/FedTC sharing one), accuracy in percent as in the tables."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from pfedkit.algorithms import ALGORITHMS
from pfedkit.report import plots


def test_every_method_of_a_full_comparison_has_a_colour_no_other_resembles():
    looks = [plots.style(i) for i in range(len(ALGORITHMS))]
    assert len(ALGORITHMS) <= len(plots.PALETTE)
    for a, b in itertools.combinations(looks, 2):
        distance = np.linalg.norm(np.subtract(to_rgb(a["color"]), to_rgb(b["color"])))
        assert distance > 0.25, (a, b)  # tab10's closest pair (gray, olive) is 0.27 apart


def test_the_comparison_figure_draws_percent_with_one_legend_entry_a_run(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.setdefault("fig", fig) and path)
    runs = []
    for name in ("local", "fedavg"):
        run = tmp_path / name
        run.mkdir()
        rows = [{"round": r, "personalized_acc": 0.5 + 0.1 * r, "global_acc": 0.4 if name == "fedavg" else None,
                 "train_loss": 1.0 / r} for r in (1, 2, 3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        runs.append(run)
    plots.plot_comparison(tmp_path, runs)
    acc, loss = drawn["fig"].axes[:2]
    assert list(acc.lines[0].get_ydata()) == pytest.approx([60.0, 70.0, 80.0])  # percent
    legend = loss.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["local", "fedavg"]  # beside the curves, one entry a run
    assert acc.get_legend() is None
