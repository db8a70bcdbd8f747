"""Observers a user adds around the loop (engine.Observer): called once per run in order, early stopping as one
small class (the run ends at the asked round as a finished run, its rows those of the uninterrupted run), and the
TensorBoard observer's real event files holding the metrics rows (accuracies in percent), a resume purging what
came after its checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pfedkit.cli import main
from pfedkit.config import load_config
from pfedkit.engine import Observer
from pfedkit.experiment import resume_experiment, run_experiment

DIGITS = ["dataset.name=digits", "model.name=mlr", "partition.num_clients=6", "rounds=6", "progress=false",
          "plots=false", "checkpoint_every=2"]
TIMINGS = ("wall_s", "server_s", "eval_s")


def rows_of(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


class Recorder(Observer):
    def __init__(self):
        self.calls = []

    def start(self, run, resumed):
        self.calls.append(("start", run.cfg.algorithm, resumed))

    def round_done(self, run, rnd, stats, row):
        self.calls.append(("round", rnd, row is not None))

    def close(self, run):
        self.calls.append(("close", run.cfg.algorithm))

    def finish(self, run, summary):
        self.calls.append(("finish", summary["algorithm"]))


def test_an_observer_sees_every_run_start_its_rounds_and_end_in_order(tmp_path):
    seen = Recorder()
    cfg = load_config(None, DIGITS + ["rounds=3", "eval_every=2"], "local,fedavg")
    run_experiment(cfg, tmp_path / "exp", log=lambda s: None, observers=[seen])
    per_run = [("round", 1, False), ("round", 2, True), ("round", 3, True)]
    assert seen.calls == [("start", "local", False), *per_run, ("close", "local"), ("finish", "local"),
                          ("start", "fedavg", False), *per_run, ("close", "fedavg"), ("finish", "fedavg")]


class StopAt(Observer):
    """Early stopping in a few lines: stop once the personalized accuracy reaches a target."""

    def __init__(self, target: float):
        self.target = target

    def round_done(self, run, rnd, stats, row):
        if row is not None and row["personalized_acc"] >= self.target:
            run.request_stop(f"personalized accuracy reached {self.target}")


def test_early_stopping_is_one_small_observer_and_ends_a_finished_run(tmp_path):
    cfg = load_config(None, DIGITS, "fedavg")
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    full = rows_of(tmp_path / "full" / "fedavg")
    target = full[2]["personalized_acc"]  # reached at round 3 (a rising curve: the first round at or above it)
    first = next(r["round"] for r in full if r["personalized_acc"] >= target)
    run_experiment(cfg, tmp_path / "early", log=lambda s: None, observers=[StopAt(target)])
    run = tmp_path / "early" / "fedavg"
    assert rows_of(run) == full[:first]  # the same arithmetic up to the stop
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_at"] == first and "reached" in summary["stop_reason"]
    assert summary["personalized_acc"] == full[first - 1]["personalized_acc"]
    assert (run / "checkpoint.pt").is_file()
    with pytest.raises(Exception, match="finished"):
        resume_experiment(run)
    # given more rounds, a run that stopped early stays stopped: its stop was the observer's decision
    config = tmp_path / "early" / "config.yaml"
    config.write_text(config.read_text().replace("\nrounds: 6\n", "\nrounds: 9\n"))
    assert "\nrounds: 9\n" in config.read_text()
    resume_experiment(tmp_path / "early", log=lambda s: None)
    assert rows_of(run) == full[:first] and json.loads((run / "summary.json").read_text())["stopped_at"] == first


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_tensorboard_log_holds_the_metrics_rows_in_percent_and_a_resume_continues_it(tmp_path):
    pytest.importorskip("tensorboard")
    from pfedkit.report.tensorboard import TensorBoard
    out = tmp_path / "exp"
    cfg = load_config(None, DIGITS, "fedavg,pfedla")
    # killed after round 3, its checkpoint at round 2: the resumed log drops the first one's round 3
    run_experiment(cfg, out, log=lambda s: None, stop_after=3, observers=[TensorBoard()])
    assert main(["run", "--resume", str(out), "--tensorboard"]) == 0
    for name in ("fedavg", "pfedla"):
        rows = rows_of(out / name)
        logged = scalars(out / name / "tensorboard")
        for key, tag, scale in (("personalized_acc", "personalized_acc %", 100), ("train_loss", "train_loss", 1),
                                ("bytes_up_total", "bytes_up_total", 1)):
            assert [step for step, _ in logged[tag]] == [1, 2, 3, 4, 5, 6], (name, tag)  # each round once
            assert [v for _, v in logged[tag]] == pytest.approx([scale * r[key] for r in rows], rel=1e-6)
    assert "global_acc %" in scalars(out / "fedavg" / "tensorboard")  # FedAvg has a global model, pFedLA none
    assert "global_acc %" not in scalars(out / "pfedla" / "tensorboard")
