"""The command line as a user meets it: real processes, real files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FAST = ["--set", "progress=false"]


def pfedkit(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pfedkit", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


@pytest.mark.parametrize("override, needle", [
    ("local.lr=-1", "local.lr"),
    ("partition.scheme=shards", "partition.scheme"),
    ("colour=red", "'colour'"),
    ("model.name=resnet", "model.name"),
    ("rounds=ten", "rounds"),
])
def test_bad_config_is_one_line_naming_the_key_and_writes_nothing(tmp_path, override, needle):
    out = tmp_path / "out"
    result = pfedkit("run", "--set", override, "--out", str(out))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and ("allowed" in lines[0] or "expected" in lines[0])
    assert not out.exists()


def test_unknown_algorithm_lists_the_allowed_ones(tmp_path):
    result = pfedkit("run", "--algorithms", "fedavg,nope", "--out", str(tmp_path / "o"))
    assert result.returncode != 0 and "'nope'" in result.stderr and "fedavg" in result.stderr
    assert not (tmp_path / "o").exists()


def test_missing_dataset_says_where_it_looked_and_how_to_get_it(tmp_path):
    out = tmp_path / "out"
    result = pfedkit("run", "--set", "dataset.name=cifar10", "--set", f"dataset.root={tmp_path / 'nowhere'}",
                     "--out", str(out))
    assert result.returncode != 0
    line = result.stderr.strip()
    assert "\n" not in line and "nowhere" in line and "cifar" in line.lower() and "dataset.root" in line
    assert not out.exists()


def test_end_to_end_on_mnist5k_writes_the_output_contract(tmp_path):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("rounds: 4\nlocal:\n  epochs: 1\ncheckpoint_every: 2\n")
    out = tmp_path / "run"
    result = pfedkit("run", str(cfg), "--algorithms", "local,fedavg", "--set", "eval_every=2", *FAST,
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "| local |" in result.stdout and "majority label" in result.stdout
    for name in ("local", "fedavg"):
        d = out / name
        for f in ("config.yaml", "metrics.jsonl", "summary.json", "accuracy.png", "partition.png", "checkpoint.pt"):
            assert (d / f).is_file(), f
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [2, 4]
        summary = json.loads((d / "summary.json").read_text())
        # four classes per client: learning must beat always answering the client's majority label
        margin = 0.3 if name == "local" else 0.05  # FedAvg's single model lags on non-IID data after 4 rounds
        assert summary["personalized_acc"] > summary["majority_label_acc"] + margin
        assert "algorithm: " + name in (d / "config.yaml").read_text()
    assert (out / "comparison.md").is_file() and (out / "comparison.png").is_file()
    assert json.loads((out / "fedavg" / "summary.json").read_text())["global_acc"] is not None
    assert json.loads((out / "local" / "summary.json").read_text())["global_acc"] is None
    # plots can be redrawn from the files alone
    (out / "comparison.png").unlink()
    replot = pfedkit("plot", str(out))
    assert replot.returncode == 0 and (out / "comparison.png").is_file()


def test_killed_run_resumes_to_the_uninterrupted_metrics(tmp_path):
    args = ["--algorithms", "fedavg", "--set", "dataset.name=digits", "--set", "model.name=mlr",
            "--set", "rounds=400", "--set", "checkpoint_every=25", "--set", "clients_per_round=4", *FAST]
    full = pfedkit("run", *args, "--out", str(tmp_path / "full"))
    assert full.returncode == 0, full.stderr
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "pfedkit", "run", *args, "--out", str(cut)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = cut / "fedavg" / "checkpoint.pt"
    deadline = time.time() + 600
    while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if (cut / "fedavg" / "summary.json").exists():
        pytest.skip("the run finished before it could be killed")
    assert proc.returncode == -signal.SIGKILL
    resumed = pfedkit("run", "--resume", str(cut))
    assert resumed.returncode == 0, resumed.stderr

    def rows(d):
        return [{k: v for k, v in json.loads(x).items() if k not in ("wall_s", "server_s", "eval_s")}
                for x in (d / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows(cut)) == 400
    assert rows(cut) == rows(tmp_path / "full")


def test_resume_of_a_folder_that_is_not_a_run_fails_clearly(tmp_path):
    result = pfedkit("run", "--resume", str(tmp_path))
    assert result.returncode != 0 and "config.yaml" in result.stderr


def test_list_names_the_algorithms():
    result = pfedkit("list")
    assert result.returncode == 0 and "fedavg" in result.stdout and "mnist5k" in result.stdout


def test_seeds_give_one_folder_each_and_a_mean_std_comparison_that_plot_redraws(tmp_path):
    out = tmp_path / "exp"
    result = pfedkit("run", "--algorithms", "local,fedavg", "--seeds", "0,1", "--set", "dataset.name=digits",
                     "--set", "model.name=mlr", "--set", "rounds=3", *FAST, "--out", str(out))
    assert result.returncode == 0, result.stderr
    finals = {}
    for seed in (0, 1):
        for name in ("local", "fedavg"):
            summary = json.loads((out / f"seed{seed}" / name / "summary.json").read_text())
            assert summary["seed"] == seed
            finals.setdefault(name, []).append(summary["personalized_acc"])
        assert (out / f"seed{seed}" / "comparison.md").is_file()
    # each seed draws its own partition: the clients' class histograms differ
    parts = [json.loads((out / f"seed{s}" / "fedavg" / "partition.json").read_text())["train_counts"] for s in (0, 1)]
    assert parts[0] != parts[1]
    table = (out / "comparison.md").read_text()
    for name, accs in finals.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.split("|")]
        mean, std = (float(x) for x in cells[2].split("±"))
        assert mean == pytest.approx(100 * sum(accs) / 2, abs=0.006)
        # the sample std of two values a, b: sqrt(((a - m)^2 + (b - m)^2) / (2 - 1)) = |a - b| / sqrt(2)
        assert std == pytest.approx(100 * abs(accs[0] - accs[1]) / 2 ** 0.5, abs=0.006)
        assert cells[-2] == "2"
    (out / "comparison.png").unlink()
    replot = pfedkit("plot", str(out))
    assert replot.returncode == 0, replot.stderr
    assert (out / "comparison.png").is_file() and (out / "seed1" / "comparison.png").is_file()


def test_a_diverging_variant_is_recorded_and_the_others_still_run(tmp_path):
    # a hyperparameter study whose largest step diverges (the pFedCS paper: "too large a lambda diverges")
    out = tmp_path / "study"
    result = pfedkit("run", "--algorithms", "fedavg@local.lr=1e30,perfedavg@beta=1e30,fedavg", "--set",
                     "dataset.name=digits", "--set", "model.name=dnn", "--set", "rounds=3", *FAST, "--out", str(out))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "2 run(s) failed" in last and "fedavg@local.lr=1e30" in last and "non-finite" in last
    # each says what to lower: the step that diverged (Per-FedAvg's meta step)
    assert "non-finite" in (out / "fedavg@local.lr=1e30" / "failed.txt").read_text()
    assert "lower local.lr" in (out / "fedavg@local.lr=1e30" / "failed.txt").read_text()
    assert "lower perfedavg.beta (the meta step) or perfedavg.alpha" in (out / "perfedavg@beta=1e30" / "failed.txt").read_text()
    assert not (out / "fedavg@local.lr=1e30" / "summary.json").exists()
    assert (out / "fedavg" / "summary.json").is_file()
    table = (out / "comparison.md").read_text()
    assert "| fedavg@local.lr=1e30 | failed: round 1:" in table
    assert any(line.startswith("| fedavg | ") and "failed" not in line for line in table.splitlines())
    # a resumed experiment does not retry the failed run (it would fail the same way) and still says so
    resumed = pfedkit("run", "--resume", str(out))
    assert resumed.returncode != 0 and "2 run(s) failed" in resumed.stderr
