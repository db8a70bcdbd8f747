"""`pfedkit reproduce`: every method of a table on the same partitions, our mean ± std over seeds beside the paper's
number in each cell, recomputed here from the runs' own summary files; resumes instead of rerunning; refuses a
missing dataset with one line before anything runs."""
from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml

from pfedkit.cli import main
from pfedkit.engine import TIMING_KEYS

TINY = ["rounds=1", "eval_every=1", "partition.num_clients=4", "clients_per_round=2", "partition.samples_per_client=60",
        "fedrep.head_epochs=1", "pfedme.local_rounds=1", "pfedme.inner_steps=1", "fedfomo.models=1",
        "progress=false", "plots=false", "runtime.threads=2"]  # 2: a job, whatever thread count a test before left


def sets(items):
    return [arg for item in items for arg in ("--set", item)]


def cells(markdown: str, method: str) -> list[str]:
    row = next(line for line in markdown.splitlines() if line.startswith(f"| {method} |"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def ours(folder: Path, method: str, seeds, key="personalized_acc") -> str:
    values = [100 * json.loads((folder / f"seed{s}" / method / "summary.json").read_text())[key] for s in seeds]
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def run_rows(folder: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_table1_fmnist_writes_ours_beside_the_papers_numbers_and_resumes(tmp_path, capsys):
    out = tmp_path / "t1"
    assert main(["reproduce", "table1", "--dataset", "fmnist", "--seeds", "0,1", "--out", str(out), *sets(TINY)]) == 0
    text = (out / "table1.md").read_text()
    # both columns' runs (2 x 9 methods x 2 seeds) went as one job, with every run's bits and the table of the runs
    # one after another (runtime.batch_runs=false)
    assert "runs: 36 side by side in one process" in capsys.readouterr().out
    alone = tmp_path / "alone"
    assert main(["reproduce", "table1", "--dataset", "fmnist", "--seeds", "0,1", "--out", str(alone), *sets(TINY),
                 "--set", "runtime.batch_runs=false"]) == 0
    command = " ".join(["pfedkit reproduce table1 --dataset fmnist --scale reduced --seeds 0,1",
                        *(f"--set {s}" for s in TINY)])
    assert f"Command: `{command}`;" in text  # the table says how to write it again, every option given
    assert text.replace(str(out), "") == (alone / "table1.md").read_text().replace(str(alone), "").replace(
        " --set runtime.batch_runs=false`", "`")
    runs = sorted(p.parent.relative_to(out) for p in out.rglob("summary.json"))
    assert len(runs) == 36 and all(run_rows(out / run) == run_rows(alone / run) for run in runs)
    assert (out / "table1.png").is_file()
    header = next(line for line in text.splitlines() if line.startswith("| method |"))
    assert "FMNIST 10: ours | paper" in header and "FMNIST 100: ours | paper" in header
    for method, paper10, paper100 in (("pfedla", "94.34±0.29", "98.87±0.66"), ("fedrep", "93.17±0.26", "97.15±0.09"),
                                      ("pfedhn", "94.83±0.33", "98.80±0.92"), ("fedfomo", "86.17±0.34", "91.83±0.12"),
                                      ("local", "85.83±0.17", "89.27±0.21")):
        row = cells(text, method)
        assert row == [ours(out / "fmnist_10", method, (0, 1)), paper10, ours(out / "fmnist_100", method, (0, 1)),
                       paper100], method
    assert cells(text, "fedavg")[1] == "–"  # Table 1's FedAvg row is not legible in the paper
    assert not any(line.startswith("| fedbn |") for line in text.splitlines())  # no BN in the FMNIST CNN
    assert "unweighted mean over clients" in text
    majority = [json.loads((out / "fmnist_10" / f"seed{s}" / "local" / "summary.json").read_text())
                ["majority_label_acc"] for s in (0, 1)]
    assert cells(text, "*majority label (reference)*")[:2] == [
        f"{100 * statistics.mean(majority):.2f} ± {100 * statistics.stdev(majority):.2f}", "–"]
    assert cells(text, "*rank agreement with the paper*")[0].startswith("τ ")
    # the same command again finds every run done: nothing is retrained
    stamp = (out / "fmnist_10" / "seed0" / "pfedla" / "summary.json").stat().st_mtime_ns
    assert main(["reproduce", "table1", "--dataset", "fmnist", "--seeds", "0,1", "--out", str(out), *sets(TINY)]) == 0
    assert (out / "fmnist_10" / "seed0" / "pfedla" / "summary.json").stat().st_mtime_ns == stamp
    # another protocol into the same folder is refused (resuming would silently keep the first one's settings)
    changed = [*sets(TINY), "--set", "local.lr=0.02"]
    assert main(["reproduce", "table1", "--dataset", "fmnist", "--seeds", "0,1", "--out", str(out), *changed]) == 2
    assert (out / "fmnist_10" / "seed0" / "pfedla" / "summary.json").stat().st_mtime_ns == stamp
    # --table-only runs nothing: an unfinished run is pending, a failed one failed, the mean over the finished seeds
    (out / "fmnist_10" / "seed1" / "fedrep" / "summary.json").unlink()
    seed1 = out / "fmnist_10" / "seed1"
    (seed1 / "pfedhn" / "summary.json").rename(seed1 / "pfedhn" / "failed.txt")
    (out / "fmnist_10" / "seed0" / "pfedhn" / "summary.json").unlink()
    (seed1 / "fedfomo" / "summary.json").rename(seed1 / "fedfomo" / "failed.txt")  # a seed diverged, one finished
    assert main(["reproduce", "table1", "--dataset", "fmnist", "--seeds", "0,1", "--out", str(out), "--table-only",
                 *sets(TINY)]) == 0
    text = (out / "table1.md").read_text()
    seed0 = 100 * json.loads((out / "fmnist_10" / "seed0" / "fedrep" / "summary.json").read_text())["personalized_acc"]
    assert cells(text, "fedrep")[0] == f"{seed0:.2f} (1 of 2 seeds)"
    assert cells(text, "pfedhn")[0] == "failed"
    fomo = 100 * json.loads((out / "fmnist_10" / "seed0" / "fedfomo" / "summary.json").read_text())["personalized_acc"]
    assert cells(text, "fedfomo")[0] == f"{fomo:.2f} (1 of 2 seeds, 1 failed)"
    per_seed, flat = text.split("Per seed (personalized_acc)")[1].split("Converged? The mean")
    flat, level = flat.split("Last 20 evaluations")
    assert [line for line in per_seed.splitlines() if line.startswith("| FMNIST 10 | fedrep |")] == \
        [f"| FMNIST 10 | fedrep | {seed0:.2f} | pending |"]
    # one evaluation is too few to say whether a run is flat
    assert [line for line in flat.splitlines() if line.startswith("| FMNIST 10 | fedrep |")] == \
        ["| FMNIST 10 | fedrep | – | pending | – |"]
    assert [line for line in level.splitlines() if line.startswith("| FMNIST 10 | fedrep |")] == \
        ["| FMNIST 10 | fedrep | – | pending |"]
    assert not (out / "fmnist_10" / "seed1" / "fedrep" / "summary.json").exists()
    # a column folder that `pfedkit run` of the preset wrote with some of the table's methods: --table-only reads
    # it (the others pending); running into it is refused, as any other config is
    some, preset = tmp_path / "some", "pfedkit/configs/pfedla/table1_fmnist_10clients_reduced.yaml"
    assert main(["run", preset, "--algorithms", "local,pfedla", "--set", "seeds=0", *sets(TINY), "--out",
                 str(some / "fmnist_10")]) == 0
    again = ["reproduce", "table1", "--column", "fmnist_10", "--seeds", "0", "--out", str(some), *sets(TINY)]
    assert main([*again, "--table-only"]) == 0
    text = (some / "table1.md").read_text()
    for method in ("local", "pfedla"):
        summary = json.loads((some / "fmnist_10" / "seed0" / method / "summary.json").read_text())
        assert cells(text, method)[0] == f"{100 * summary['personalized_acc']:.2f}", method
    assert cells(text, "fedavg")[0] == "pending" and cells(text, "pfedhn")[0] == "pending"
    assert main(again) == 2
    # a column run in parts (seed 1's pFedLA and FedAvg in another folder, as on a second machine): --runs reads the
    # table from both folders, pFedLA's cell the mean ± sample std of its two seeds' summaries
    part = tmp_path / "part"
    assert main(["run", preset, "--algorithms", "fedavg,pfedla", "--set", "seeds=1", *sets(TINY), "--out",
                 str(part)]) == 0
    merged = ["reproduce", "table1", "--column", "fmnist_10", "--seeds", "0,1", "--out", str(tmp_path / "merged"),
              *sets(TINY), "--table-only", "--runs", str(some / "fmnist_10"), "--runs", str(part)]
    assert main(merged) == 0
    text = (tmp_path / "merged" / "table1.md").read_text()
    pfedla = [100 * json.loads((folder / f"seed{s}" / "pfedla" / "summary.json").read_text())["personalized_acc"]
              for folder, s in ((some / "fmnist_10", 0), (part, 1))]
    assert cells(text, "pfedla")[0] == f"{statistics.mean(pfedla):.2f} ± {statistics.stdev(pfedla):.2f}"
    local = [100 * json.loads((some / "fmnist_10" / "seed0" / "local" / "summary.json").read_text())
             ["personalized_acc"]]
    fedavg = 100 * json.loads((part / "seed1" / "fedavg" / "summary.json").read_text())["personalized_acc"]
    assert cells(text, "local")[0] == f"{local[0]:.2f} (1 of 2 seeds)"
    assert cells(text, "fedavg")[0] == f"{fedavg:.2f} (1 of 2 seeds)"
    assert cells(text, "fedrep")[0] == "pending"
    assert f"--table-only --runs {some / 'fmnist_10'} --runs {part}`" in text  # the command that wrote it
    # the same run in two folders, a folder of another protocol, --runs without --table-only: refused, nothing written
    twice = tmp_path / "twice"
    shutil.copytree(part, twice)  # seed 1's runs again (as copied between machines)
    (tmp_path / "merged" / "table1.md").unlink()
    capsys.readouterr()
    assert main([*merged, "--runs", str(twice)]) == 2
    assert "are the same run of the table" in capsys.readouterr().err
    other = tmp_path / "other"
    assert main(["run", preset, "--algorithms", "local", "--set", "seeds=1", *sets(TINY), "--set", "local.lr=0.02",
                 "--out", str(other)]) == 0
    assert main([*merged[:-4], "--runs", str(other)]) == 2
    assert "holds runs of another config (local.lr differ)" in capsys.readouterr().err
    # a setting of a method a folder did not run leaves its runs of the protocol (each method reads its own section:
    # a preset's later change to one method keeps the others' kept runs); of a method it ran, it does not
    for name, algorithms in (("elsewhere", "local"), ("changed", "pfedla")):
        assert main(["run", preset, "--algorithms", algorithms, "--set", "seeds=1", *sets(TINY), "--set",
                     "pfedla.hn_lr=0.05", "--out", str(tmp_path / name)]) == 0
    assert main([*merged, "--runs", str(tmp_path / "elsewhere")]) == 0
    local.append(100 * json.loads((tmp_path / "elsewhere" / "seed1" / "local" / "summary.json").read_text())
                 ["personalized_acc"])
    assert cells((tmp_path / "merged" / "table1.md").read_text(), "local")[0] == \
        f"{statistics.mean(local):.2f} ± {statistics.stdev(local):.2f}"
    (tmp_path / "merged" / "table1.md").unlink()
    capsys.readouterr()
    assert main([*merged[:-2], "--runs", str(tmp_path / "changed")]) == 2
    assert "holds runs of another config (pfedla.hn_lr differ)" in capsys.readouterr().err
    assert main([arg for arg in merged if arg != "--table-only"]) == 2
    assert "--runs goes with --table-only" in capsys.readouterr().err
    assert not (tmp_path / "merged" / "table1.md").exists()


def hand_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau for values without ties: (concordant - discordant) pairs over all pairs."""
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    signs = [(xs[i] - xs[j]) * (ys[i] - ys[j]) for i, j in pairs]
    return (sum(s > 0 for s in signs) - sum(s < 0 for s in signs)) / len(pairs)


def test_every_accuracy_table_says_how_far_its_ranking_agrees_with_the_papers():
    """The rank-agreement row: Kendall's tau over the methods both sides have, against a hand count of concordant
    and discordant pairs; methods without a paper number (or not run) are left out; under 3 methods: no tau."""
    from pfedkit.reproduce import TARGETS, accuracy_table, columns_of
    column = columns_of(TARGETS["table1"], "fmnist")[0]  # FMNIST 10

    def run(acc, majority=0.5):
        return {"personalized_acc": acc, "majority_label_acc": majority}
    ours = {"local": 0.80, "fedavg": 0.85, "pfedme": 0.70, "pfedhn": 0.90, "fedrep": 0.88, "pfedla": 0.86,
            "heurpfedla": 0.83}
    results = {column: {name: [run(acc), run(acc + 0.01, 0.6)] for name, acc in ours.items()}}
    text = accuracy_table(TARGETS["table1"], results, Path("."), "reduced", "0,1")
    paper = {"local": 85.83, "pfedme": 90.43, "pfedhn": 94.83, "fedrep": 93.17, "pfedla": 94.34, "heurpfedla": 95.47}
    both = list(paper)  # fedavg has no legible number in Table 1: left out
    tau = hand_tau([ours[m] for m in both], [paper[m] for m in both])
    assert cells(text, "*rank agreement with the paper*")[0].startswith(f"τ {tau:+.2f} (p ")
    assert cells(text, "*rank agreement with the paper*")[0].endswith(f", n {len(both)})")
    assert cells(text, "*majority label (reference)*")[0] == "55.00 ± 7.07"
    few = {column: {name: results[column][name] for name in ("local", "fedavg", "pfedme")}}
    assert cells(accuracy_table(TARGETS["table1"], few, Path("."), "reduced", "0,1"),
                 "*rank agreement with the paper*")[0] == "–"


def test_a_run_is_flat_when_its_last_five_evaluations_hold_the_level_of_the_five_before_and_do_not_climb(tmp_path):
    """The convergence row of every table: per seed the drift (mean of the last 5 evaluations minus the 5 before,
    points) and the trend (the least-squares line through the last 20 evaluations, its rise over the rounds they
    span), and "flat" only when both are within 0.5 points in every seed; too short a run says –, a diverged seed
    makes it "no", a pending one says over how many seeds it holds. Beside it, the level each seed ends at: the
    mean ± sample std of its last 20 evaluations."""
    from pfedkit.reproduce import TARGETS, accuracy_table, columns_of, drift, trend
    assert drift([0.1 * i for i in range(12)]) == pytest.approx(0.5)  # (7+...+11)/5 - (2+...+6)/5
    assert drift([0.8] * 9) is None
    # a line rising 0.1 an evaluation (every 5 rounds) rises 2.0 over 20 evaluations, whatever came before them
    assert trend([5 * i for i in range(30)], [7.0] * 10 + [0.1 * i for i in range(20)]) == pytest.approx(2.0)
    # swings that cancel about the line (+s, -s, -s, +s at evaluations symmetric about the middle) leave it
    swing = [0.3, -0.3, -0.3, 0.3] * 5
    assert trend(list(range(20)), [0.1 * i + s for i, s in enumerate(swing)]) == pytest.approx(2.0)
    # evaluations every 25 rounds: the rise per the 500 rounds 20 of them span; a flat run has none
    assert trend([25 * i for i in range(1, 21)], [0.01 * i for i in range(20)]) == pytest.approx(0.2)
    assert trend(list(range(20)), [0.9] * 20) == pytest.approx(0.0)
    assert trend(list(range(19)), [0.9] * 19) is None
    column = columns_of(TARGETS["table1"], "fmnist")[0]

    def run(acc_drift, acc_trend=None):
        return {"personalized_acc": 0.9, "majority_label_acc": 0.5, "personalized_acc_drift": acc_drift,
                "personalized_acc_trend": acc_trend}
    results = {column: {"local": [run(0.004, -0.005), run(-0.005, 0.001)], "fedavg": [run(0.002), run(0.0062)],
                        "pfedla": [run(None), None], "fedrep": [run(0.001), None],
                        "perfedavg": [run(0.001), "failed"], "pfedme": [run(0.001, 0.006), run(-0.001, 0.002)],
                        "pfedhn": [run(0.003, -0.0051), run(0.0, 0.0)]}}
    text = accuracy_table(TARGETS["table1"], results, Path("."), "converged", "0,1")
    flat = text.split("Converged? The mean")[1]
    assert "| FMNIST 10 | local | +0.40 / -0.50 | -0.50 / +0.10 | yes |" in flat
    assert "| FMNIST 10 | fedavg | +0.20 / – | +0.62 / – | no |" in flat
    assert "| FMNIST 10 | pfedla | – | pending | – |" in flat  # too short a run; not finished
    assert "| FMNIST 10 | fedrep | +0.10 / – | pending | yes (1 of 2 seeds) |" in flat
    assert "| FMNIST 10 | perfedavg | +0.10 / – | failed | no |" in flat
    # two windows level, the line through 20 evaluations still climbing (or falling) more than 0.5: not flat
    assert "| FMNIST 10 | pfedme | +0.10 / +0.60 | -0.10 / +0.20 | no |" in flat
    assert "| FMNIST 10 | pfedhn | +0.30 / -0.51 | +0.00 / +0.00 | no |" in flat
    # and the level each seed ends at with its swing (the last 20 evaluations' mean ± sample std): a final cell is
    # one draw from it
    from pfedkit.reproduce import finished
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"personalized_acc": 0.9}))
    curve = [0.5] * 5 + [0.9, 0.8] * 10  # the last 20: mean 0.85, sample std sqrt(20 * 0.05**2 / 19)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"round": 5 * i, "personalized_acc": a}) + "\n"
                                                   for i, a in enumerate(curve, 1)))
    ended = finished(run_dir)
    assert ended["personalized_acc_level"] == pytest.approx(0.85)
    assert ended["personalized_acc_swing"] == pytest.approx((20 * 0.05 ** 2 / 19) ** 0.5)
    results[column]["local"][1] = ended
    results[column]["fedavg"][0]["personalized_acc_level"] = None  # 19 evaluations or fewer
    level = accuracy_table(TARGETS["table1"], results, Path("."), "converged", "0,1").split("Last 20 evaluations")[1]
    assert "| FMNIST 10 | local | – | 85.00 ± 5.13 |" in level
    assert "| FMNIST 10 | fedrep | – | pending |" in level
    assert "| FMNIST 10 | perfedavg | – | failed |" in level


def test_pfedcs_synthetic_gives_pfedcs_gains_beside_the_papers(tmp_path):
    out = tmp_path / "cs"
    extra = ["rounds=10", "eval_every=1", "partition.num_clients=6", "clients_per_round=2", "local.steps=2",
             "pfedme.local_rounds=2", "pfedcs.local_rounds=2", "clustering.clusters=2", "progress=false",
             "plots=false"]
    assert main(["reproduce", "pfedcs-synthetic", "--seeds", "0,1", "--out", str(out), *sets(extra)]) == 0
    text = (out / "pfedcs-synthetic.md").read_text()
    mlr = text.split("## Synthetic MLR")[1].split("## Synthetic DNN")[0]
    row = cells(mlr, "fedtc")
    folder = out / "synthetic_mlr"

    def value(method, seed, key):
        return 100 * json.loads((folder / f"seed{seed}" / method / "summary.json").read_text())[key]

    gm = [value("pfedcs", s, "global_acc_weighted") - value("fedtc", s, "global_acc_weighted") for s in (0, 1)]
    assert row[0] == ours(folder, "fedtc", (0, 1), "global_acc_weighted")
    assert row[1] == ours(folder, "fedtc", (0, 1), "personalized_acc_weighted")
    assert row[2] == f"{statistics.mean(gm):+.2f} ± {statistics.stdev(gm):.2f}"
    assert row[3] == "+0.45" and row[5] == "+1.85"  # the paper's Synthetic/MLR gains over FedTC
    assert "pooled over all clients' test samples" in text
    pooled = [json.loads((folder / f"seed{s}" / "fedavg" / "summary.json").read_text())["majority_label_acc_weighted"]
              for s in (0, 1)]
    assert cells(mlr, "*majority label (reference)*")[1] == \
        f"{100 * statistics.mean(pooled):.2f} ± {100 * statistics.stdev(pooled):.2f}"
    assert "Rank agreement of the gains with the paper's: GM τ " in mlr
    # pooled and per client, last round and best round (as pFedMe's code reports), from the runs' own files
    def best(key):
        values = [max(100 * json.loads(line)[key] for line in
                      (folder / f"seed{s}" / "fedtc" / "metrics.jsonl").read_text().splitlines()) for s in (0, 1)]
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"
    detail = next(line for line in mlr.split("| method | GM % pooled: last round")[1].splitlines()
                  if line.startswith("| fedtc |"))
    assert [c.strip() for c in detail.strip("|").split("|")][1:] == [
        ours(folder, "fedtc", (0, 1), "global_acc_weighted"), best("global_acc_weighted"),
        ours(folder, "fedtc", (0, 1), "global_acc"), ours(folder, "fedtc", (0, 1), "personalized_acc_weighted"),
        best("personalized_acc_weighted"), ours(folder, "fedtc", (0, 1), "personalized_acc")]
    # converged? per seed the mean of the last 5 evaluations minus the 5 before, from the run's metrics.jsonl
    flat = text.split("Converged? The mean")[1]  # the GM section
    for seed in (0, 1):
        rows = [json.loads(line) for line in
                (folder / f"seed{seed}" / "fedtc" / "metrics.jsonl").read_text().splitlines()]
        gm = [100 * r["global_acc_weighted"] for r in rows]
        assert len(gm) == 10
        expected = statistics.mean(gm[5:]) - statistics.mean(gm[:5])
        row = next(line for line in flat.splitlines() if line.startswith("| Synthetic MLR | fedtc |"))
        assert [c.strip() for c in row.strip("|").split("|")][2 + seed] == f"{expected:+.2f} / –"  # 10 < 20


def test_a_missing_dataset_is_named_with_where_to_put_it_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "e"
    assert main(["reproduce", "table2", "--dataset", "emnist", "--out", str(out),
                 "--set", f"dataset.root={tmp_path / 'nowhere'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "emnist" in err[0] and "dataset.root" in err[0]
    assert not out.exists()


# The pFedLA paper's protocol (section 4.1-4.2), written out here from the paper, not from the presets
PAPER_LR = {"emnist": 0.005, "fmnist": 0.005, "cifar10": 0.01, "cifar100": 0.01}
PAPER_MODEL = {"emnist": "cnn", "fmnist": "cnn", "cifar10": "cnn_bn", "cifar100": "cnn_bn"}
PAPER_SETTING = {10: (10, 600, 10), 100: (10, 2500, 20)}  # clients -> (a round, rounds, local epochs)


def test_every_full_scale_column_is_the_papers_protocol_and_the_docs_table_says_so(capsys):
    """`reproduce --scale full --dry-run` resolves every column of Tables 1-3 (nothing runs); each is the pFedLA
    paper's protocol for every method (the baselines' local work is the table's epochs, their step sizes the
    table's lr or their own papers'), every client holds the same data at 10 and 100 clients, and each row of
    docs/reproduce.md's protocol table is what the preset resolves to."""
    doc = (Path(__file__).parent.parent / "docs" / "reproduce.md").read_text(encoding="utf-8")
    rows = {(r[0], r[1]): r for r in ([c.strip() for c in line.strip("|").split("|")]
                                      for line in doc.splitlines() if line.startswith("| table"))}
    share = {}
    checked = 0
    for target in ("table1", "table2", "table3"):
        assert main(["reproduce", target, "--scale", "full", "--dry-run"]) == 0
        for line in capsys.readouterr().out.splitlines():
            column = json.loads(line)
            cfg, name = column["config"], column["column"]
            dataset, part = cfg["dataset"]["name"], cfg["partition"]
            clients = part["num_clients"]
            a_round, rounds, epochs = PAPER_SETTING[clients]
            lr = PAPER_LR[dataset]
            assert (cfg["clients_per_round"] or clients, cfg["rounds"], cfg["local"]["epochs"]) == \
                (a_round, rounds, epochs), name
            assert (cfg["local"]["batch_size"], cfg["local"]["lr"], cfg["model"]["name"], part["test_fraction"]) == \
                (32, lr, PAPER_MODEL[dataset], 0.3), name
            if target == "table2":
                assert (part["scheme"], part["dominant_classes"]) == ("dominant", 6 if dataset == "cifar100" else 2)
            else:
                assert (part["scheme"], part["classes_per_client"]) == ("classes", 12 if dataset == "cifar100" else 4)
            assert share.setdefault(("table2" if target == "table2" else "table1", dataset),
                                    part["samples_per_client"]) == part["samples_per_client"] > 0, name
            pfedme, fedrep, pfedhn = cfg["pfedme"], cfg["fedrep"], cfg["pfedhn"]
            assert (pfedme["local_epochs"], pfedme["eta"], pfedme["train_all"]) == (epochs, lr, False), name
            assert fedrep["head_epochs"] + fedrep["body_epochs"] == epochs and fedrep["body_epochs"] == 1, name
            assert (pfedhn["inner_lr"], pfedhn["inner_momentum"], pfedhn["inner_weight_decay"],
                    pfedhn["inner_steps"]) == (0.005, 0.9, 5e-5, 0), name
            # the official trainer serves one client after another (the batched round oscillates at 100 clients)
            assert pfedhn["sequential"] or "pfedhn" not in cfg["algorithm"].split(","), name
            row = rows[(target, name)]
            assert row[2:9] == [str(clients), str(a_round), str(rounds), str(epochs), "32", str(lr),
                                str(part["samples_per_client"])], (target, name, row)
            assert row[10] == PAPER_MODEL[dataset] and row[12] == f"{epochs - 1} + 1", (target, name, row)
            checked += 1
    assert checked == 19 == len(rows)


def test_the_converged_scale_gives_every_client_the_papers_data_and_says_which_columns_have_it(capsys):
    """`--scale converged`: the paper's clients, participation and data per client (the full preset's), the reduced
    scale's local work, rounds enough for the flatness row's windows and trend and for every client to train as long as
    the 10-client column's methods needed to be flat; `--column` picks one column; a column without a converged
    preset is refused with the list of those that have one."""
    def config(target, column, *scale):
        assert main(["reproduce", target, "--column", column, *scale, "--dry-run"]) == 0
        (one,) = [json.loads(line)["config"] for line in capsys.readouterr().out.splitlines()]
        return one
    for target in ("table1", "table2"):
        for column in ("fmnist_10", "fmnist_100"):
            converged = config(target, column, "--scale", "converged")
            full, reduced = config(target, column, "--scale", "full"), config(target, column)
            assert converged["partition"] == full["partition"]  # 10 or 100 clients x 700 samples, the paper's split
            assert converged["clients_per_round"] == full["clients_per_round"]  # all of 10, 10 of 100
            assert converged["local"] == reduced["local"] and converged["algorithm"] == reduced["algorithm"]
            for method in ("fedrep", "fedfomo", "pfedla", "heurpfedla"):
                assert converged[method] == reduced[method], method
            # pFedMe at 10 clients: one epoch a round, the others' local work (the 100-client records: R = 5, as
            # reduced); the rest as reduced
            epochs = {"local_epochs": 1} if converged["partition"]["num_clients"] == 10 else {}
            assert converged["pfedme"] == {**reduced["pfedme"], **epochs}
            # pFedHN one client after another, as the official trainer (the batched round oscillates at 100 clients
            # and spikes past round 300 at 10); the rest as reduced
            assert converged["pfedhn"] == {**reduced["pfedhn"], "sequential": True}
            # Per-FedAvg's beta 0.05 (the reduced runs') diverges after ~170 rounds: a smaller one, and FL-bench's
            # epoch of fine-tuning before evaluation; FL-bench's alpha 0.01 below the others' lr (at 0.05 every beta
            # tried diverged before round 600 in a seed of Table 1 at 10 clients; at 100 it ends 2-4 points lower)
            per, per_reduced = converged["perfedavg"], reduced["perfedavg"]
            assert per["beta"] <= 0.02 < per_reduced["beta"]
            assert (per["adapt_epochs"], per_reduced["adapt_epochs"]) == (1, 0)
            assert per["alpha"] == 0.01 < converged["local"]["lr"] and per_reduced["alpha"] == 0.0  # 0: local.lr
            assert {**per, "alpha": 0.0, "beta": per_reduced["beta"], "adapt_epochs": 0} == per_reduced
            assert converged["rounds"] % converged["eval_every"] == 0
            assert converged["rounds"] >= 20 * converged["eval_every"]  # the flatness row's windows and trend
            clients = converged["partition"]["num_clients"]
            share = (converged["clients_per_round"] or clients) / clients
            assert converged["rounds"] * share >= 170  # epochs a client: Local and pFedLA flat from 170 at 10 clients
    assert main(["reproduce", "table1", "--column", "emnist_10", "--scale", "converged", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "EMNIST 10 has no --scale converged preset" in err and "table1_fmnist_100clients_converged.yaml" in err
    assert main(["reproduce", "table1", "--dataset", "fmnist", "--column", "mnist_10", "--dry-run"]) == 2
    assert "no column 'mnist_10'; allowed: fmnist_10, fmnist_100" in capsys.readouterr().err


RECORDS = Path(__file__).resolve().parents[1] / "docs" / "results" / "pfedla" / "records"


def results_script(name: str):
    """An analysis script kept beside the records (docs/results/pfedla/NAME.py), loaded as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, RECORDS.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_100(table: int, method: str, seed: int) -> Path:
    """The kept 100-client run of a method, table and seed that the tables read (not the superseded variants)."""
    runs = [p.parent for p in RECORDS.glob(f"table{table}_fmnist100_seed{seed}_*/seed{seed}/{method}/metrics.jsonl")
            if not p.parts[-4].endswith(("_batched", "_beta0.005", "_alpha0.05", "_3000rounds"))]
    assert len(runs) == 1, (table, method, seed, runs)
    return runs[0]


def table_command(text: str) -> list[str]:
    """The `pfedkit ...` command a table written by `pfedkit reproduce` names in its Command: line, as argv."""
    return text.split("Command: `pfedkit ")[1].split("`;")[0].split()


KEPT = {".pfedkit-run", "config.yaml", "summary.json", "metrics.jsonl", "failed.txt"}  # no checkpoint, no observables


def test_a_table_written_from_kept_records_is_written_again_from_them(tmp_path, monkeypatch):
    """docs/results/*/records/ keep ended runs' records (what a table reads of a run, a few KB: the converged
    100-client runs took CPU-hours; a diverged one's failed.txt); each docs table whose command reads them
    (--runs docs/results/...) is the text that command writes again, and every per-seed cell of each metric is the
    records' own summary, every Converged? cell the records' metrics read by a plain mean and least-squares fit, and
    every Last 20 evaluations cell their mean ± sample std."""
    monkeypatch.chdir(RECORDS.parents[3])  # the tables name the records by their path in the repository
    results = RECORDS.parents[1]
    for records in results.glob("*/records"):
        assert {p.name for p in records.rglob("*") if p.is_file()} <= KEPT, records
    tables = [p for p in results.glob("*/*.md") if "--runs docs/results/" in p.read_text()]
    assert {t.parent.name for t in tables} >= {"pfedla", "pfedcs"}
    for table in tables:
        text = table.read_text()
        command = table_command(text)
        out = tmp_path / table.stem
        assert main([*command, "--out", str(out)]) == 0
        assert (out / f"{command[1]}.md").read_text() == text, table.name
        folders = [Path(command[i + 1]) for i, arg in enumerate(command) if arg == "--runs"]
        seeds = command[command.index("--seeds") + 1].split(",")
        blocks = {"Per seed (": {}, "Converged? ": {}, "Last 20 evaluations (": {}}  # heading -> metric -> block
        for block in re.split(r"\n(?=Per seed \(|Converged\? |Last 20 evaluations \()", text):  # heading, table
            for heading, found in blocks.items():
                if block.startswith(heading):
                    found[re.search(r"\((\w+)[,)]", block).group(1)] = block
        per_seed, converged, levels = blocks.values()
        assert per_seed and per_seed.keys() == converged.keys() == levels.keys(), table.name

        def cell(block: str, method: str, seed: str) -> str:
            row = next(line for line in block.splitlines() if f"| {method} |" in line)
            return [c.strip() for c in row.strip("|").split("|")][2 + seeds.index(seed)]

        checked = 0
        for ended in (f for folder in folders for name in ("summary.json", "failed.txt")
                      for f in folder.glob(f"seed*/*/{name}")):  # failed.txt: a run that diverged
            method, seed = ended.parent.name, ended.parent.parent.name.removeprefix("seed")
            summary = json.loads(ended.read_text()) if ended.name == "summary.json" else None
            rows = [json.loads(line) for line in (ended.parent / "metrics.jsonl").read_text().splitlines()] \
                if summary else []
            for key in per_seed:
                expected = "failed" if summary is None else f"{100 * summary[key]:.2f}"
                assert cell(per_seed[key], method, seed) == expected, (table.name, ended, key)
                checked += 1
                if summary:  # the Converged? cell: the two windows' drift, the last 20's line
                    x, y = np.array([(r["round"], r[key]) for r in rows if r.get(key) is not None][-20:]).T
                    rise = np.polyfit(x, y, 1)[0] * (x[-1] - x[0]) * 20 / 19  # the rounds 20 evaluations span
                    rise = 0.0 if abs(rise) < 1e-12 else rise  # a constant curve: the fits' rounding, either sign
                    assert cell(converged[key], method, seed) == \
                        f"{100 * (y[-5:].mean() - y[-10:-5].mean()):+.2f} / {100 * rise:+.2f}", (table.name, ended)
                    level, swing = statistics.mean(100 * y), statistics.stdev(100 * y)  # the last 20, n - 1
                    shown = [float(v) for v in cell(levels[key], method, seed).split(" ± ")]  # to the printed digit
                    assert np.allclose(shown, [level, swing], rtol=0, atol=0.005 + 1e-9), (table.name, ended, shown)
        assert checked, table.name


def test_the_round_probe_tells_the_clients_a_round_trained_from_the_others(tmp_path, capsys):
    """docs/results/pfedla/probe_rounds.py (the evidence of docs/reproduce.md, 'pFedHN at 100 clients') resumes a
    finished run and says how much each round moved the trained and the other clients' accuracies. With pFedHN's
    shared hypernetwork frozen (an lr of 1e-30, no momentum, no weight decay) and only the embeddings learning, a
    round can move the models of the clients it trained only: the others' change is exactly zero, theirs is not."""
    probe_rounds = results_script("probe_rounds")
    out = tmp_path / "hn"
    assert main(["run", "--algorithms", "pfedhn", "--set", "dataset.name=digits", "--set", "model.name=mlr",
                 "--set", "partition.num_clients=8", "--set", "clients_per_round=3", "--set", "rounds=2",
                 "--set", "local.epochs=1", "--out", str(out)]) == 0
    rows = probe_rounds.probe(out / "pfedhn", 6, {"hn_lr": 1e-30, "hn_momentum": 0.0, "hn_weight_decay": 0.0,
                                                  "embed_lr": 5.0}, log=lambda line: None)
    assert [r["round"] for r in rows] == [3, 4, 5, 6, 7, 8]
    assert all(r["others_abs"] == 0.0 for r in rows)
    assert sum(r["trained_abs"] for r in rows) > 0
    again = probe_rounds.probe(out / "pfedhn", 2, {"embed_lr": 5.0}, log=lambda line: None)  # all of it learns
    assert sum(r["others_abs"] for r in again) > 0


def test_the_trend_script_reads_a_slow_climb_and_the_swings_around_it(tmp_path, capsys):
    """docs/results/pfedla/trend.py (the evidence of docs/reproduce.md, 'How still is flat?') reads the last 500
    rounds of each run under a folder. A run climbing 1.6 points per 500 rounds, evaluated every 25 rounds: flat
    by the drift at each of its last 20 evaluations (+0.4 points a 125-round window), its trend is the climb. With
    ±1-point swings on top: its mean, std, trend, the trend's standard error and the drift's verdicts are the plain
    formulas' over those 20 evaluations. The round a run is flat from, by the whole criterion, is a plain loop's."""
    trend = results_script("trend")

    def write(folder: Path, points: dict[int, float]) -> Path:
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "personalized_acc": p / 100}) + "\n"
                                                      for r, p in points.items()))
        return folder

    rounds = list(range(25, 2001, 25))
    climb = {r: 80 + 0.0032 * r for r in rounds}
    swings = {r: 80 + 0.0032 * r + (1 if (r // 25) % 2 == 0 else -1) for r in rounds}
    straight = trend.trend(write(tmp_path / "a" / "seed0" / "local", climb))
    assert straight["evaluations"] == 20 and abs(straight["trend"] - 1.6) < 1e-9 and straight["trend_se"] < 1e-6
    assert straight["flat_at"] == 20  # a climb of 0.4 points a window passes the criterion every time
    got = trend.trend(write(tmp_path / "a" / "seed1" / "local", swings))
    x = [r for r in rounds if r > 1500]
    y = [swings[r] for r in x]
    xm, ym = statistics.mean(x), statistics.mean(y)
    slope = sum((a - xm) * (b - ym) for a, b in zip(x, y)) / sum((a - xm) ** 2 for a in x)
    intercept = ym - slope * xm
    se = (sum((b - slope * a - intercept) ** 2 for a, b in zip(x, y)) / 18 / sum((a - xm) ** 2 for a in x)) ** 0.5
    curve = [swings[r] for r in rounds]
    held = sum(abs(statistics.mean(curve[i - 4:i + 1]) - statistics.mean(curve[i - 9:i - 4])) <= 0.5
               for i, r in enumerate(rounds) if r > 1500)
    assert held == 10  # the swings add ±0.4 to the climb's +0.4 a window: 0.8, 0.0, 0.8, ...
    assert abs(got["mean"] - ym) < 1e-9 and abs(got["std"] - statistics.pstdev(y)) < 1e-9
    assert abs(got["trend"] - 500 * slope) < 1e-9 and abs(got["trend_se"] - 500 * se) < 1e-9
    assert got["flat_at"] == held and abs(got["final"] - swings[2000]) < 1e-9
    assert trend.main([str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[2].startswith(f"| {tmp_path / 'a' / 'seed0' / 'local'} | 20 | ")
    assert f"| {500 * slope:+.2f} ± {500 * se:.2f} | 10 of 20 | {swings[2000]:.2f} | not flat |" in out[3]
    # flat from: the first evaluated round from which the drift and the trend of the last 20 evaluations (points per
    # the 500 rounds they span) stay within 0.5 at every later evaluation; a run that climbs to the end never is
    assert straight["flat_from"] is None and got["flat_from"] is None
    plateau = {r: 80 + 0.01 * min(r, 1000) for r in rounds}  # 0.25 points an evaluation, level from round 1,000
    curve = [plateau[r] for r in rounds]

    def line_rise(x: list[int], y: list[float]) -> float:
        xm, ym = statistics.mean(x), statistics.mean(y)
        return sum((a - xm) * (b - ym) for a, b in zip(x, y)) / sum((a - xm) ** 2 for a in x) * 500
    holds = [i >= 19 and abs(statistics.mean(curve[i - 4:i + 1]) - statistics.mean(curve[i - 9:i - 4])) <= 0.5
             and abs(line_rise(rounds[i - 19:i + 1], curve[i - 19:i + 1])) <= 0.5 for i in range(len(rounds))]
    expected = rounds[next(i for i in range(len(holds)) if all(holds[i:]))]
    assert 1000 < expected <= 1475  # level for 20 evaluations by round 1,475: both measures are 0 from there
    assert trend.trend(write(tmp_path / "b" / "seed0" / "local", plateau))["flat_from"] == expected
    # --metric reads another curve of the same runs (pFedCS's global model): here the climb, not the plateau
    both = tmp_path / "c" / "seed0" / "pfedcs"
    both.mkdir(parents=True)
    (both / "metrics.jsonl").write_text("".join(json.dumps(
        {"round": r, "personalized_acc": plateau[r] / 100, "global_acc_weighted": climb[r] / 100}) + "\n"
        for r in rounds))
    assert trend.trend(both)["flat_from"] == expected
    assert abs(trend.trend(both, key="global_acc_weighted")["trend"] - 1.6) < 1e-9
    assert trend.main(["--last", "500", "--metric", "global_acc_weighted", str(tmp_path / "c")]) == 0
    assert "| +1.60 ± 0.00 | 20 of 20 |" in capsys.readouterr().out


def test_the_100_client_summary_reads_from_the_kept_records():
    """docs/reproduce.md's 100-client summary (per method and table: the round each seed is flat from, by trend.py,
    and the mean ± std the table written from the records gives) is what the records say, cell by cell."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("### Tables 1 and 2, FMNIST 100, converged")
    summary = doc[start:].split("\n\n| method |")[1].split("\n\n")[0]
    rows = {line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("|").split("|")]
            for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| *")}
    assert len(rows) == 9, rows
    for table, (flat_cell, ours_cell) in ((1, (1, 2)), (2, (4, 5))):
        written = (RECORDS.parent / f"converged_table{table}_fmnist100_3seeds.md").read_text()
        for method, cells in rows.items():
            flat_from = [trend.trend(record_100(table, method, seed))["flat_from"] for seed in (0, 1, 2)]
            flat_from = ["–" if found is None else f"{found:,}" for found in flat_from]
            assert cells[flat_cell] == " / ".join(flat_from), (method, table, cells)
            ours = next(line for line in written.splitlines() if line.startswith(f"| {method} |")).split(" | ")[1]
            assert cells[ours_cell].strip("*") == ours, (method, table, cells)


def test_how_still_is_flat_reads_from_the_kept_records():
    """docs/reproduce.md's 'How still is flat?' table (trend per 500 rounds and how often the criterion held, per
    method, table and seed) is what trend.py computes from the 100-client records, cell by cell."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**How still is flat?")
    section = doc[start:doc.index("\n## ", start)]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ")}

    def cells(table: int, method: str) -> tuple[str, str]:
        found = [trend.trend(record_100(table, method, seed)) for seed in (0, 1, 2)]
        return (" / ".join(f"{t['trend']:+.2f}".replace("-", "−") for t in found),
                " / ".join(str(t["flat_at"]) for t in found))

    for method in ("local", "fedavg", "pfedla", "heurpfedla", "fedrep", "fedfomo", "pfedme", "pfedhn", "perfedavg"):
        row = rows[method]
        for table in (1, 2):
            shown, held = cells(table, method)
            assert f"| {shown} (" in row and f") | {held} |" in row, (method, table, row)


def curve(folder: Path, key: str) -> tuple[np.ndarray, np.ndarray]:
    """A run's evaluated rounds and a metric in percent, from its metrics.jsonl."""
    return np.array([(r["round"], 100 * r[key]) for r in run_rows(folder) if r.get(key) is not None]).T


def level(run: Path, end: int, rounds: int = 100) -> float:
    """A run's level at a round: the mean personalized accuracy % of its evaluations in the `rounds` rounds up to it."""
    x, y = curve(run, "personalized_acc")
    return float(y[(x > end - rounds) & (x <= end)].mean())


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def runs_on(run: Path, shorter: Path, rounds: int) -> bool:
    """A run asked for `rounds` rounds whose first rounds are the shorter run's, every row (timings aside)."""
    first = [r for r in run_rows(run) if r["round"] <= run_rows(shorter)[-1]["round"]]
    return first == run_rows(shorter) and yaml.safe_load((run / "config.yaml").read_text())["rounds"] == rounds


def signed(v: float, digits: int = 2) -> str:
    """A signed number as the docs print it, with a true minus sign."""
    return f"{v:+.{digits}f}".replace("-", "−")


def test_the_pfedcs_1200_round_probe_reads_from_its_records():
    """docs/reproduce.md's pFedCS Synthetic probe at 1,200 rounds: its first 600 rounds are the tables' runs, every
    evaluation; each cell (the GM and PM levels over rounds 501-600 and 1,101-1,200, the trend over the last 100
    rounds, the GM gain of pFedCS) is a plain mean or least-squares line over the kept records' metrics."""
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**1,200 rounds: the global models still climb.**")
    rows = [line for line in doc[start:].split("\n\n")[1].splitlines() if line.startswith("| MLR") or
            line.startswith("| DNN")]
    assert len(rows) == 3, rows
    records = RECORDS.parents[1] / "pfedcs" / "records"

    def level(x, y, last: int) -> float:
        return float(y[(x > last - 100) & (x <= last)].mean())

    for row in rows:
        column, seed = re.match(r"\| (MLR|DNN), seed (\d) \|", row).groups()
        probe = records / f"probe_1200rounds_synthetic_{column.lower()}" / f"seed{seed}"
        gm, pm = {}, {}
        for method in ("pfedcs", "fedavg"):
            table_run = records / f"full_synthetic_{column.lower()}_3seeds" / f"seed{seed}" / method
            for key, store in (("global_acc_weighted", gm), ("personalized_acc_weighted", pm)):
                x, y = curve(probe / method, key)
                x0, y0 = curve(table_run, key)
                assert x[-1] == 1200 and np.array_equal(x[x <= 600], x0) and np.array_equal(y[x <= 600], y0)
                rise = np.polyfit(x[-20:], y[-20:], 1)[0] * 100  # points per 100 rounds
                store[method] = (level(x, y, 600), level(x, y, 1200), rise)
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells[0] == f"{gm['pfedcs'][0]:.2f} → {gm['pfedcs'][1]:.2f}", row
        assert cells[1] == f"{gm['fedavg'][0]:.2f} → {gm['fedavg'][1]:.2f}", row
        assert cells[2] == f"{signed(gm['pfedcs'][2])} / {signed(gm['fedavg'][2])}", row
        assert cells[3] == " → ".join(signed(gm["pfedcs"][i] - gm["fedavg"][i]) for i in (0, 1)), row
        assert cells[4] == f"{pm['pfedcs'][0]:.2f} → {pm['pfedcs'][1]:.2f}", row


def test_pfedme_at_600_rounds_reads_from_its_records():
    """docs/reproduce.md, 'pFedMe with one epoch a round', run on to 600 rounds at 10 clients: its first 300 rounds
    are the tables' runs, every evaluation; each cell (round 300, the 100-round means, the trend over the last 100
    rounds with its standard error, flat from, round 600) is read from the kept records by a plain mean and fit
    (trend.py for the standard error and the round the whole criterion holds from)."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**pFedMe to 600 rounds.**")
    rows = [line for line in doc[start:].split("\n\n")[1].splitlines() if line.startswith("| Table")]
    assert len(rows) == 6, rows
    for row in rows:
        table, seed = re.match(r"\| Table (\d), seed (\d) \|", row).groups()
        run = RECORDS / f"table{table}_fmnist10_600rounds_pfedme_e1" / f"seed{seed}" / "pfedme"
        first = RECORDS / f"table{table}_fmnist10_3seeds_pfedme" / f"seed{seed}" / "pfedme"
        (x, y), (x0, y0) = (np.array([(r["round"], 100 * r["personalized_acc"]) for r in run_rows(folder)
                                      if r.get("personalized_acc") is not None]).T for folder in (run, first))
        assert x[-1] == 600 and np.array_equal(x[x <= 300], x0) and np.array_equal(y[x <= 300], y0)
        found = trend.trend(run, 100)
        rise = np.polyfit(x[-20:], y[-20:], 1)[0] * 100
        flat = "–" if found["flat_from"] is None else str(found["flat_from"])
        means = [f"{y[(x > a) & (x <= a + 100)].mean():.2f}" for a in (200, 300, 400, 500)]
        expected = [f"{y[x == 300][0]:.2f}", *means,
                    f"{rise:+.2f} ± {found['trend_se']:.2f}".replace("-", "−"), flat, f"{y[-1]:.2f}"]
        assert [c.strip() for c in row.strip("|").split("|")][1:] == expected, row


def test_the_10_client_summaries_read_from_the_kept_records():
    """docs/reproduce.md's 10-client summaries at 600 rounds (per method: the round each seed is flat from, by
    trend.py; the final cell of the table written from the records; the level, the mean over seeds of each seed's
    last 20 evaluations; the cell of the 300-round column before it; the paper's number; the worst decile and the
    downlink, means over seeds of the records' summaries; a diverged seed left out of the means) are what the records
    say, cell by cell."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()

    def ours(table_file: Path) -> dict[str, list[str]]:  # method -> [ours, paper] of a table written by reproduce
        rows = (line.strip("|").split("|") for line in table_file.read_text().split("\n\n")[2].splitlines()[2:])
        return {cells[0].strip(): [c.strip().replace("±", " ± ").replace("  ", " ") for c in cells[1:]]
                for cells in rows}

    for table, heading in ((1, "## A converged scale"), (2, "### Table 2 (non-IID 2), FMNIST 10, converged")):
        start = doc.index(heading)
        summary = doc[start:].split("\n\n| method |")[1].split("\n\n")[0]
        rows = {line.split(" | ")[0].strip("| "): [c.strip() for c in line.strip("|").split("|")]
                for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| *")}
        assert len(rows) == 9, rows
        written = RECORDS.parent / f"converged_table{table}_fmnist10_3seeds.md"
        assert "--seeds 0,1,2 " in written.read_text()
        earlier = RECORDS.parent / f"converged_table{table}_fmnist10_300rounds_3seeds.md"
        final, before = ours(written), ours(earlier)

        def run_of(table_file: Path, method: str, seed: int) -> Path:
            command = table_command(table_file.read_text())
            found = [RECORDS.parents[3] / command[i + 1] / f"seed{seed}" / method
                     for i, arg in enumerate(command) if arg == "--runs"]
            found = [f for f in found if f.is_dir()]
            assert len(found) == 1, (table_file, method, seed, found)
            return found[0]

        for method, cells in rows.items():
            runs = [run_of(written, method, seed) for seed in (0, 1, 2)]
            # the 300-round column's runs, every evaluation (but Per-FedAvg: alpha 0.01 at 600 rounds, local.lr 0.05
            # at 300; and pFedHN: one client after another at 600 rounds, the batched round at 300)
            if method not in ("perfedavg", "pfedhn"):
                for seed, run in enumerate(runs):
                    first = run_rows(run_of(earlier, method, seed))
                    assert [r for r in run_rows(run) if r["round"] <= 300] == first, (table, method, seed)
            ended = [run for run in runs if (run / "summary.json").is_file()]  # the others diverged: failed.txt
            assert all((run / "failed.txt").is_file() for run in runs if run not in ended), (table, method)
            summaries = [json.loads((run / "summary.json").read_text()) for run in ended]
            assert summaries and all(s["rounds"] == s["round"] == 600 for s in summaries), (table, method)
            flat = ["failed" if run not in ended else trend.trend(run)["flat_from"] for run in runs]
            levels = [statistics.mean(100 * r["personalized_acc"] for r in [r for r in run_rows(run)
                                      if r.get("personalized_acc") is not None][-20:]) for run in ended]
            expected = [" / ".join("–" if f is None else f if isinstance(f, str) else f"{f:,}" for f in flat),
                        final[method][0],
                        f"{statistics.mean(levels):.2f}", before[method][0], final[method][1],
                        f"{statistics.mean(100 * s['personalized_acc_p10'] for s in summaries):.1f}",
                        f"{statistics.mean(s['mb_down_total'] for s in summaries):,.0f}"]
            assert [c.strip("*") for c in cells[1:]] == expected, (table, method, cells)


def test_the_pfedhn_spikes_read_from_their_records():
    """docs/reproduce.md, 'pFedHN over 600 rounds': per table and variant (batched, one client after another, and with
    a third of the hypernetwork step) the lowest evaluation and the highest training loss after round 300, the round
    each seed is flat from (trend.py), the level (mean over seeds of the last 20 evaluations) and the final cells,
    read from the kept records by plain min / max / mean; the batched runs' first 300 rounds are the 300-round
    column's, every evaluation."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**pFedHN over 600 rounds: spikes.**")
    section = doc[start:doc.index("**Per-FedAvg over long runs.**")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if re.match(r"\| [12] \|", line)]
    folders = {"batched": "_batched", "one client after another": "", "one after another, hn_lr 0.003": "_hn_lr0.003"}
    assert [(r[0], r[1]) for r in rows] == [("1", v) for v in folders] + [("2", v) for v in list(folders)[:2]]
    gaps = {}
    for table, variant, *cells in rows:
        runs = [RECORDS / f"table{table}_fmnist10_600rounds_pfedhn{folders[variant]}" / f"seed{s}" / "pfedhn"
                for s in (0, 1, 2)]
        evaluated = [[r for r in run_rows(run) if r.get("personalized_acc") is not None] for run in runs]
        assert all(e[-1]["round"] == 600 for e in evaluated)
        for run in runs:  # the variant the row names is the one the run's own config ran
            pfedhn = yaml.safe_load((run / "config.yaml").read_text())["pfedhn"]
            assert (pfedhn["sequential"], pfedhn["hn_lr"]) == (variant != "batched", 0.003 if "hn_lr" in variant else
                                                                0.01), (run, pfedhn)
        late = [[r for r in e if r["round"] > 300] for e in evaluated]
        lowest = [min(100 * r["personalized_acc"] for r in rs) for rs in late]
        loss = [max(r["train_loss"] for r in rs) for rs in late]
        levels = [statistics.mean(100 * r["personalized_acc"] for r in e[-20:]) for e in evaluated]
        final = [100 * e[-1]["personalized_acc"] for e in evaluated]
        flat = [trend.trend(run)["flat_from"] for run in runs]
        assert cells == [" / ".join(f"{v:.1f}" for v in lowest), " / ".join(f"{v:.3f}" for v in loss),
                         " / ".join("–" if f is None else str(f) for f in flat), f"{statistics.mean(levels):.2f}",
                         f"{statistics.mean(final):.2f} ± {statistics.stdev(final):.2f}"], (table, variant, cells)
        if variant != "one after another, hn_lr 0.003":
            gaps.setdefault(variant, []).extend(lv - lo for lv, lo in zip(levels, lowest))
        if variant == "batched":
            earlier = RECORDS / f"table{table}_fmnist10_3seeds"
            for seed, run in enumerate(runs):
                assert ([r for r in run_rows(run) if r["round"] <= 300]
                        == run_rows(earlier / f"seed{seed}" / "pfedhn")), (table, seed)
    one, batched = gaps["one client after another"], gaps["batched"]
    assert (f"lowest evaluation after round 300 {min(one):.1f}–{max(one):.1f} points below the run's level, where the "
            f"batched round's lie {min(batched):.0f}–{max(batched):.0f} below") in " ".join(section.split())


def test_perfedavg_at_100_clients_with_alpha_001_reads_from_its_records():
    """docs/reproduce.md, 'Per-FedAvg at 100 clients with the inner step α 0.01': per table the three runs are the
    preset's (alpha 0.01 now; beta, clients and rounds the preset's) and the runs the tables read, and every number of
    the paragraph is read from their records and from the superseded runs at alpha 0.05 (local.lr): finals, their mean
    and sample std, the paired gain, the first evaluation at or above the alpha-0.05 run's final, the meta-model's loss
    at round 2,000, and the least-squares trend over the last 500 rounds with its standard error (the criterion's)."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**Per-FedAvg at 100 clients with the inner step α 0.01.**")
    text = " ".join(doc[start:doc.index("\n\n", start)].split())
    gains = {}
    for table, clause in ((1, "On Table 1, at its β 0.0025"), (2, "On Table 2, at its β 0.02")):
        part = text[text.index(clause):] if table == 2 else text[text.index(clause):text.index("On Table 2")]
        preset = yaml.safe_load((RECORDS.parents[3] / "pfedkit" / "configs" / "pfedla" /
                                 f"table{table}_fmnist_100clients_converged.yaml").read_text())
        assert preset["perfedavg"]["alpha"] == 0.01 and f"β {preset['perfedavg']['beta']}" in clause
        new = [RECORDS / f"table{table}_fmnist100_seed{s}_perfedavg_alpha0.01" / f"seed{s}" / "perfedavg"
               for s in (0, 1, 2)]
        old = [RECORDS / f"table{table}_fmnist100_seed{s}_perfedavg_alpha0.05" / f"seed{s}" / "perfedavg"
               for s in (0, 1, 2)]
        assert new == [record_100(table, "perfedavg", s) for s in (0, 1, 2)]  # the runs the table reads
        for run in new:
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            assert cfg["perfedavg"]["alpha"] == 0.01 and cfg["perfedavg"]["beta"] == preset["perfedavg"]["beta"]
            assert (cfg["rounds"], cfg["partition"]["num_clients"], cfg["clients_per_round"]) == (2000, 100, 10)
        assert all(yaml.safe_load((r / "config.yaml").read_text())["perfedavg"].get("alpha", 0) == 0 for r in old)
        finals = [[100 * summary(r)["personalized_acc"] for r in runs] for runs in (new, old)]
        assert (" / ".join(f"{v:.2f}" for v in finals[0]) + f" % ({statistics.mean(finals[0]):.2f} ± "
                f"{statistics.stdev(finals[0]):.2f}, where α 0.05 ends at {statistics.mean(finals[1]):.2f} ± "
                f"{statistics.stdev(finals[1]):.2f})") in part, table
        assert "(" + " / ".join(f"{a - b:+.2f}" for a, b in zip(*finals)) + " points)" in part and min(
            a - b for a, b in zip(*finals)) > 0
        gains[table] = statistics.mean(finals[0]) - statistics.mean(finals[1])
        passed = [next(r["round"] for r in run_rows(run) if r.get("personalized_acc") is not None
                       and 100 * r["personalized_acc"] >= final) for run, final in zip(new, finals[1])]
        assert f"passes by round {' / '.join(f'{r:,}' for r in passed)};" in part
        losses = [" / ".join(f"{summary(r)['train_loss']:.3g}" for r in runs) for runs in (new, old)]
        assert f"({losses[0]} at round 2,000; α 0.05: {losses[1]})" in part
        trends = [trend.trend(r) for r in new]
        ratios = [t["trend"] / t["trend_se"] for t in trends]
        shown = " / ".join(f"{t['trend']:+.2f}" for t in trends)
        assert f"({shown} points per 500 rounds, {int(min(ratios))}–{int(max(ratios)) + 1} standard errors)" in part
        flat = [t["flat_from"] for t in trends]
        if table == 1:
            assert flat == [None] * 3 and "not flat in any seed" in part
        else:
            assert flat == [2000, None, None] and "flat by the criterion only at round 2,000 in seed 0" in part
    assert f"lifts Per-FedAvg by {gains[1]:.0f} points on Table 1 and {gains[2]:.0f} on Table 2" in text


@pytest.mark.parametrize("table", [1, 2])
def test_perfedavg_at_100_clients_to_3000_rounds_reads_from_its_records(table):
    """docs/reproduce.md, 'Per-FedAvg at 100 clients to 3,000 rounds': each table's three runs at alpha 0.01 ran on
    from their round-2,000 checkpoints; their first 2,000 rounds are the runs the table reads, every evaluation, and
    each number (the level, the mean of the 20 evaluations up to round 2,000 and 3,000; the last evaluation; the
    trend over the last 500 rounds with the round flat from, by trend.py; the meta-model's loss at 2,000 and 3,000)
    is read from the kept records."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index(f"**Per-FedAvg at 100 clients to 3,000 rounds (Table {table}).**")
    text = " ".join(doc[start:doc.index("\n\n", start)].split())
    runs = [RECORDS / f"table{table}_fmnist100_seed{s}_perfedavg_alpha0.01_3000rounds" / f"seed{s}" / "perfedavg"
            for s in (0, 1, 2)]
    for seed, run in enumerate(runs):
        assert runs_on(run, record_100(table, "perfedavg", seed), 3000)
        assert summary(run)["round"] == 3000
    curves = [curve(run, "personalized_acc") for run in runs]
    levels = [[level(run, end, 500) for run in runs] for end in (2000, 3000)]  # 20 evaluations, one every 25
    assert (f"{' / '.join(f'{v:.2f}' for v in levels[0])} at round 2,000 and "
            f"{' / '.join(f'{v:.2f}' for v in levels[1])} at 3,000 (mean {statistics.mean(levels[0]):.2f} → "
            f"{statistics.mean(levels[1]):.2f})") in text
    assert f"its last evaluation {' / '.join(f'{y[-1]:.2f}' for x, y in curves)} %" in text
    found = [trend.trend(run) for run in runs]
    assert (f"trend over the last 500 rounds {' / '.join(signed(t['trend']) for t in found)} "
            f"(± {min(t['trend_se'] for t in found):.2f}–{max(t['trend_se'] for t in found):.2f})") in text
    loss = [{r["round"]: r["train_loss"] for r in run_rows(run)} for run in runs]
    assert f"loss {' / '.join(f'{l[2000]:.3g} → {l[3000]:.3g}' for l in loss)}" in text
    gain = statistics.mean(levels[1]) - statistics.mean(levels[0])
    final = statistics.mean(y[-1] for x, y in curves)
    if table == 1:
        assert all(t["flat_from"] is None for t in found) and "not flat by the criterion in any seed" in text
        fedavg = statistics.mean(100 * summary(record_100(1, "fedavg", s))["personalized_acc"] for s in (0, 1, 2))
        assert (f"lift Per-FedAvg by {gain:.1f} points, its last evaluations' mean ({final:.2f}) still "
                f"{fedavg - final:.1f} below FedAvg's cell ({fedavg:.2f})") in text
        assert round(loss[1][3000] / loss[1][2000]) == 9 and "seed 1's loss grows ninefold" in text
    else:
        flat = [t["flat_from"] for t in found]
        assert None not in flat
        assert f"flat by the criterion in every seed from round {' / '.join(f'{r:,}' for r in flat)}" in text
        pfedhn = statistics.mean(100 * summary(record_100(2, "pfedhn", s))["personalized_acc"] for s in (0, 1, 2))
        assert (f"lift Per-FedAvg by {gain:.1f} points and settle it: its last evaluations' mean ({final:.2f}) is "
                f"{final - pfedhn:.1f} above pFedHN's cell ({pfedhn:.2f}), the top of Table 2") in text
        assert round(loss[1][3000] / loss[1][2000]) == 6 and "seed 1's sixfold" in text


def test_the_other_100_client_runs_to_3000_rounds_read_from_their_records():
    """docs/reproduce.md, 'The others not flat at round 2,000, to 3,000 rounds': one seed of pFedMe and FedFomo
    (Table 2), FedAvg (Table 1) and pFedHN (both) ran again with 3,000 rounds; their first 2,000 rounds are the runs
    the tables read, every evaluation, and each row (the level over the 20 evaluations up to round 2,000 and 3,000,
    the evaluation at those rounds, the trend over the last 500 rounds by trend.py and the round flat from) and each
    number of the paragraph after it is read from the records."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**The others not flat at round 2,000, to 3,000 rounds.**")
    rows = [line for line in doc[start:].split("\n\n")[1].splitlines() if line.startswith("| Table")]
    expected = [(2, "pfedme", "pFedMe"), (2, "fedfomo", "FedFomo"), (2, "pfedhn", "pFedHN"), (1, "fedavg", "FedAvg"),
                (1, "pfedhn", "pFedHN")]
    assert len(rows) == len(expected)
    for row, (table, method, name) in zip(rows, expected):
        run = RECORDS / f"table{table}_fmnist100_seed0_{method}_3000rounds" / "seed0" / method
        assert runs_on(run, record_100(table, method, 0), 3000)
        x, y = curve(run, "personalized_acc")
        before, found = trend.trend(record_100(table, method, 0)), trend.trend(run)
        flat = f"{found['flat_from']:,}" if found["flat_from"] else "–"
        assert row == (f"| Table {table}, {name} | {signed(before['trend'])} → {signed(found['trend'])} ± "
                       f"{found['trend_se']:.2f} | {level(run, 2000, 500):.2f} → {level(run, 3000, 500):.2f} | "
                       f"{y[x == 2000][0]:.2f} → {y[-1]:.2f} | {flat} |"), row
    text = " ".join(doc[start:].split("\n\n")[2].split())
    t2 = {m: RECORDS / f"table2_fmnist100_seed0_{m}_3000rounds" / "seed0" / m for m in ("pfedme", "fedfomo")}
    gain = {m: level(run, 3000, 500) - level(run, 2000, 500) for m, run in t2.items()}
    x, y = curve(t2["fedfomo"], "personalized_acc")
    assert trend.trend(t2["fedfomo"])["flat_from"] is None and trend.trend(record_100(2, "pfedla", 0))["flat_from"]
    assert (f"pFedMe gains {gain['pfedme']:.1f} points and levels off (flat by the criterion at round "
            f"{trend.trend(t2['pfedme'])['flat_from']:,}), still "
            f"below pFedHN's seed 0 (level {level(record_100(2, 'pfedhn', 0), 2000, 500):.2f} at round 2,000)") in text
    assert level(t2["pfedme"], 3000, 500) < level(record_100(2, "pfedhn", 0), 2000, 500)
    assert (f"FedFomo gains {gain['fedfomo']:.1f} in level and still swings ({y[x > 2000].min():.2f}–"
            f"{y[x > 2000].max():.2f} after round 2,000, not flat): its level at 3,000 passes pFedLA's seed 0 "
            f"({level(record_100(2, 'pfedla', 0), 2000, 500):.2f}, flat at 2,000) and meets HeurpFedLA's "
            f"({level(record_100(2, 'heurpfedla', 0), 2000, 500):.2f})") in text
    cells = sorted(statistics.mean(100 * summary(record_100(2, m, s))["personalized_acc"] for s in (0, 1, 2))
                   for m in ("fedfomo", "pfedla", "heurpfedla"))
    assert f"those three, within {cells[2] - cells[0]:.2f} points of one another" in text
    # pFedHN: flat on Table 2 by 3,000, between Per-FedAvg's and pFedMe's 3,000-round runs; on Table 1 still swinging,
    # between FedRep's and pFedMe's seed 0 (both flat at 2,000)
    hn = {t: RECORDS / f"table{t}_fmnist100_seed0_pfedhn_3000rounds" / "seed0" / "pfedhn" for t in (1, 2)}
    pfa = RECORDS / "table2_fmnist100_seed0_perfedavg_alpha0.01_3000rounds" / "seed0" / "perfedavg"
    x, y = curve(hn[1], "personalized_acc")
    last_drift = statistics.mean(y[-5:]) - statistics.mean(y[-10:-5])  # the criterion's drift: 5 evaluations each
    assert trend.trend(hn[1])["flat_from"] is None and abs(last_drift) > 0.5
    assert all(trend.trend(record_100(1, m, 0))["flat_from"] for m in ("fedrep", "pfedme"))
    table1 = {m: level(record_100(1, m, 0), 2000, 500) for m in ("fedrep", "pfedme")}  # seed 0, flat at 2,000
    assert level(pfa, 3000, 500) > level(hn[2], 3000, 500) > level(t2["pfedme"], 3000, 500)
    assert table1["fedrep"] > level(hn[1], 3000, 500) > table1["pfedme"]
    gain_hn = level(hn[2], 3000, 500) - level(hn[2], 2000, 500)
    assert (f"pFedHN, which on Table 2 swung about its level rather than climbing, flattens there by round "
            f"{trend.trend(hn[2])['flat_from']:,}, {gain_hn:.2f} points above its level at 2,000, below Per-FedAvg's "
            f"seed 0 run on to 3,000 (level {level(pfa, 3000, 500):.2f}) and "
            f"above pFedMe's ({level(t2['pfedme'], 3000, 500):.2f}): at 3,000 rounds Table 2's top three read "
            f"Per-FedAvg, pFedHN, pFedMe (seed 0)") in text
    assert (f"On Table 1 pFedHN gains {level(hn[1], 3000, 500) - level(hn[1], 2000, 500):.2f} in level and still "
            f"swings ({y[x > 2000].min():.2f}–{y[x > 2000].max():.2f} after round 2,000; the drift of its last "
            f"evaluation, {signed(last_drift)}, keeps it off the criterion), below FedRep's seed 0 (level "
            f"{table1['fedrep']:.2f}, flat at 2,000) and above pFedMe's ({table1['pfedme']:.2f}): its place in Table 1 "
            "stands") in text
    whole = " ".join(doc.split())
    assert (f"its seed 0 level {level(pfa, 3000, 500) - level(hn[2], 3000, 500):.2f} above pFedHN's seed 0 run on as "
            "well") in whole


def test_the_runs_on_script_draws_both_figures_the_docs_name(tmp_path, capsys):
    """run_on.py, the script behind docs/reproduce.md's 1,000- and 3,000-round figures: run as the docs say, it
    prints the 1,000-round table's rows as the docs have them (each cell of which the test above reads from the
    records) and, at --at 2000 --to 3000 --last 500, a row a 3,000-round record whose round-2,000 and -3,000
    evaluations and levels are the records' own; each figure a PNG, one panel per method and table."""
    rounds = results_script("run_on")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**1,000 rounds: the 10-client runs not flat at round 600.**")
    documented = [line for line in doc[start:].split("\n\n")[1].splitlines() if line.startswith("|")]
    assert rounds.main(["--figure", str(tmp_path / "a.png"), *map(str, sorted(RECORDS.glob(
        "table*_fmnist10_1000rounds_*")))]) == 0
    assert capsys.readouterr().out.splitlines() == documented
    commands = " ".join(doc.split())
    assert "run_on.py --figure OUT.png docs/results/pfedla/records/table*_fmnist10_1000rounds_*" in commands
    assert ("run_on.py --at 2000 --to 3000 --last 500 --figure OUT.png "
            "docs/results/pfedla/records/table*_fmnist100_seed*_3000rounds") in commands
    folders = sorted(RECORDS.glob("table*_fmnist100_seed*_3000rounds"))
    assert rounds.main(["--at", "2000", "--to", "3000", "--last", "500", "--figure", str(tmp_path / "b.png"),
                        *map(str, folders)]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    runs = sorted(m.parent for folder in folders for m in folder.rglob("metrics.jsonl"))
    assert len(rows) == len(runs) == 11
    trend = results_script("trend")
    for row, run in zip(rows, runs):
        x, y = curve(run, "personalized_acc")
        found = trend.trend(run, 500)
        loss = {r["round"]: r["train_loss"] for r in run_rows(run) if r["round"] in (2000, 3000)}
        assert row[1:] == [f"{y[x == 2000][0]:.2f}", f"{level(run, 2000, 500):.2f} → {level(run, 3000, 500):.2f}",
                           f"{y[x == 3000][0]:.2f}", f"{signed(found['trend'])} ± {found['trend_se']:.2f}",
                           f"{found['flat_from']:,}" if found["flat_from"] else "–", f"{y[x > 2000].min():.2f}",
                           f"{loss[2000]:.3g} → {loss[3000]:.3g} |"], (run, row)
    for png in ("a.png", "b.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table1_perfedavg_at_beta_0005_reads_from_its_records():
    """docs/reproduce.md, 'Per-FedAvg over long runs': beta 0.005 at 10 clients diverges in seed 1 (the round its
    failed.txt names, the meta-model's last logged loss), and seeds 0 and 2 end where the records say (final and
    level over the last 20 evaluations; the meta-model's loss at round 600)."""
    doc = " ".join((RECORDS.parents[2] / "reproduce.md").read_text().split())
    folder = RECORDS / "table1_fmnist10_600rounds_perfedavg_beta0.005"
    runs = [folder / f"seed{s}" / "perfedavg" for s in (0, 1, 2)]
    assert all(yaml.safe_load((r / "config.yaml").read_text())["perfedavg"]["beta"] == 0.005 for r in runs)
    failed = re.match(r"round (\d+): ", (runs[1] / "failed.txt").read_text()).group(1)
    losses = [r for r in run_rows(runs[1]) if r.get("train_loss") is not None]
    assert not (runs[1] / "summary.json").exists()
    assert (f"diverges in seed 1 at round {failed} (loss {losses[-1]['train_loss']:.0f} at round "
            f"{losses[-1]['round']})") in doc
    ended = [[r for r in run_rows(run) if r.get("personalized_acc") is not None] for run in (runs[0], runs[2])]
    final = [100 * e[-1]["personalized_acc"] for e in ended]
    levels = [statistics.mean(100 * r["personalized_acc"] for r in e[-20:]) for e in ended]
    loss = [e[-1]["train_loss"] for e in ended]
    assert all(e[-1]["round"] == 600 for e in ended)
    assert (f"seeds 0 and 2 end at {final[0]:.2f} and {final[1]:.2f} (levels {levels[0]:.2f} and {levels[1]:.2f}, "
            f"their meta-models' loss {loss[0]:.0f} and {loss[1]:.0f} at round 600)") in doc


def test_perfedavg_inner_step_reads_from_its_records():
    """docs/reproduce.md, "Per-FedAvg's inner step": FL-bench's alpha 0.01 and beta 0.001 (seed 0) and the presets'
    alpha 0.01 with beta 0.01 (3 seeds a table) against alpha 0.05 (local.lr), each number read from the kept
    records; `perfedavg.alpha` is alpha as local.lr was (the local.lr run equals the preset's, every evaluation)."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**Per-FedAvg's inner step.**")
    text = " ".join(doc[start:].split("\n\n")[0].split())

    def runs(folder: str, seeds=(0, 1, 2)) -> list[Path]:
        return [RECORDS / folder / f"seed{s}" / "perfedavg" for s in seeds]

    def settings(run: Path) -> tuple[float, float]:  # (alpha, beta) as the run took them
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        return cfg["perfedavg"].get("alpha", 0.0) or cfg["local"]["lr"], cfg["perfedavg"]["beta"]

    def loss_at(run: Path, rnd: int) -> float:
        return next(r["train_loss"] for r in run_rows(run) if r["round"] == rnd)

    def accuracies(run: Path) -> list[float]:  # the personalized accuracy of every evaluation, in percent
        return [100 * r["personalized_acc"] for r in run_rows(run) if r.get("personalized_acc") is not None]

    def level(run: Path) -> float:  # the mean of the last 20 evaluations
        return statistics.mean(accuracies(run)[-20:])

    (flbench,) = runs("table1_fmnist10_600rounds_perfedavg_lr0.01_beta0.001", (0,))
    assert settings(flbench) == (0.01, 0.001)
    final = accuracies(flbench)[-1]
    assert run_rows(flbench)[-1]["round"] == 600
    assert (f"({loss_at(flbench, 50):.2f} at round 50, {loss_at(flbench, 600):.2f} at round 600)" in text
            and f"{final:.2f} at round 600 (level {level(flbench):.2f})" in text)
    assert trend.trend(flbench, 100)["trend"] > 0.5  # still climbing

    (by_lr,) = runs("table1_fmnist10_600rounds_perfedavg_lr0.01_beta0.01", (0,))
    preset = {t: runs(f"table{t}_fmnist10_600rounds_perfedavg_alpha0.01") for t in (1, 2)}
    assert settings(by_lr) == settings(preset[1][0]) == (0.01, 0.01)
    assert yaml.safe_load((by_lr / "config.yaml").read_text())["local"]["lr"] == 0.01
    assert yaml.safe_load((preset[1][0] / "config.yaml").read_text())["local"]["lr"] == 0.05
    assert run_rows(by_lr) == run_rows(preset[1][0])

    before = {1: runs("table1_fmnist10_600rounds_perfedavg_beta0.01"), 2: runs("table2_fmnist10_600rounds_perfedavg")}
    assert [settings(r) for r in before[1] + before[2]] == [(0.05, 0.01)] * 3 + [(0.05, 0.02)] * 3
    for t in (1, 2):
        assert all(settings(r) == (0.01, 0.01) and (r / "summary.json").is_file() for r in preset[t])
        now = sorted(loss_at(r, 600) for r in preset[t])
        then = sorted(loss_at(r, 600) for r in before[t] if (r / "summary.json").is_file())
        assert f"{now[0]:.2f}–{now[-1]:.2f} on Table {t} ({' and '.join(f'{v:.0f}' for v in then)} at α 0.05" in text \
            or f"{now[0]:.2f}–{now[-1]:.2f} on Table {t} ({then[0]:.2f}–{then[-1]:.2f} at α 0.05" in text, t
        finals = [accuracies(run)[-1] for run in preset[t]]
        assert (f"{statistics.mean(finals):.2f} ± {statistics.stdev(finals):.2f} on Table {t} (level "
                f"{statistics.mean(level(r) for r in preset[t]):.2f};") in text, t
    faster = runs("table1_fmnist10_600rounds_perfedavg_alpha0.01_beta0.02")  # a larger meta step at alpha 0.01
    assert all(settings(r) == (0.01, 0.02) and (r / "summary.json").is_file() for r in faster)
    finals = [accuracies(run)[-1] for run in faster]
    losses = sorted(loss_at(r, 600) for r in faster)
    assert (f"ends Table 1 at {statistics.mean(finals):.2f} ± {statistics.stdev(finals):.2f} (level "
            f"{statistics.mean(level(r) for r in faster):.2f}) with its meta-model's loss at round 600 "
            f"{losses[0]:.0f}–{losses[-1]:.0f}") in text
    peak = max(r["train_loss"] for r in run_rows(faster[2]) if r.get("train_loss") is not None)
    assert f"(seed 2's loss peaked at {peak:.0f})" in text
    rises = [trend.trend(r, 100)["trend"] for t in (1, 2) for r in preset[t]]
    flat = [trend.trend(r, 100)["flat_from"] for t in (1, 2) for r in preset[t]]
    assert f"trend over the last 100 rounds {signed(min(rises))} to {signed(max(rises))}" in text
    assert f"flat by round 600 in {sum(f is not None for f in flat)} of the 6 runs" in text
    # Table 2 at beta 0.02: the loss does not grow there, so its preset takes it (Table 1's keeps 0.01)
    wider = runs("table2_fmnist10_600rounds_perfedavg_alpha0.01_beta0.02")
    assert all(settings(r) == (0.01, 0.02) and (r / "summary.json").is_file() for r in wider)
    finals = [accuracies(run)[-1] for run in wider]
    losses = sorted(loss_at(r, 600) for r in wider)
    peak = max(r["train_loss"] for run in wider for r in run_rows(run) if r.get("train_loss") is not None)
    gain = statistics.mean(level(r) for r in wider) - statistics.mean(level(r) for r in preset[2])
    assert (f"ends at {statistics.mean(finals):.2f} ± {statistics.stdev(finals):.2f} (level "
            f"{statistics.mean(level(r) for r in wider):.2f}, {gain:.2f} points above β 0.01's) with its meta-model's "
            f"loss at round 600 {losses[0]:.2f}–{losses[-1]:.2f} (at most {peak:.2f} over the run)") in text
    presets = Path(__file__).resolve().parents[1] / "pfedkit" / "configs" / "pfedla"
    betas = [yaml.safe_load((presets / f"table{t}_fmnist_10clients_converged.yaml").read_text())["perfedavg"]["beta"]
             for t in (1, 2)]
    assert betas == [0.01, 0.02]


def test_the_pfedcs_3600_round_probe_reads_from_its_records():
    """docs/reproduce.md's pFedCS Synthetic DNN probe at 3,600 rounds: its first 2,400 rounds are the 2,400-round
    probe's, every evaluation but the timings; each cell (the GM levels over the 100 rounds up to rounds 2,400, 3,000
    and 3,600, the least-squares trend over the last 100 rounds, flat-from by trend.py, the GM gain at 2,400 and
    3,600, pFedCS's PM level) and the paragraph's ranges are read from the kept records."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**3,600 rounds: the DNN's climb stops short of FedAvg's.**")
    rows = [line for line in doc[start:].split("\n\n")[1].splitlines() if line.startswith("| DNN")]
    records = RECORDS.parents[1] / "pfedcs" / "records"
    assert [re.match(r"\| DNN, seed (\d) \|", row).group(1) for row in rows] == ["0", "1", "2"]
    gains, rises, late, gaps = {"pfedcs": [], "fedavg": []}, [], [], []
    for seed, row in enumerate(rows):
        found = list(records.glob(f"probe_3600rounds_synthetic_dnn*/seed{seed}"))
        assert len(found) == 1, (row, found)
        probe = found[0]
        shorter = next(records.glob(f"probe_2400rounds_synthetic_dnn*/seed{seed}"))
        levels, rise, flat = {}, {}, {}
        for method in ("pfedcs", "fedavg"):
            assert [r for r in run_rows(probe / method) if r["round"] <= 2400] == run_rows(shorter / method)
            x, y = curve(probe / method, "global_acc_weighted")
            assert x[-1] == 3600
            levels[method] = [float(y[(x > last - 100) & (x <= last)].mean()) for last in (2400, 3000, 3600)]
            rise[method] = np.polyfit(x[-20:], y[-20:], 1)[0] * 100
            t = trend.trend(probe / method, 100, "global_acc_weighted")
            flat[method] = t["flat_from"]
            gains[method].append(levels[method][2] - levels[method][0])
            if method == "pfedcs":
                late.append(abs(t["trend"]) / t["trend_se"])
        rises.append(rise["pfedcs"])
        gap = [signed(levels["pfedcs"][i] - levels["fedavg"][i]) for i in (0, 2)]
        gaps.append(" → ".join(gap))
        xp, yp = curve(probe / "pfedcs", "personalized_acc_weighted")
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells == [" → ".join(f"{v:.2f}" for v in levels["pfedcs"]),
                         " → ".join(f"{v:.2f}" for v in levels["fedavg"]),
                         f"{signed(rise['pfedcs'])} / {signed(rise['fedavg'])}",
                         f"{flat['pfedcs']:,} / {flat['fedavg']:,}", " → ".join(gap),
                         f"{yp[xp > 3500].mean():.2f}"], row
    text = " ".join(doc[start:].split("\n\n")[2].split())  # the paragraph under the table
    pfedcs, fedavg = ([f"{f(g):.1f}" for f in (min, max)] for g in (gains["pfedcs"], gains["fedavg"]))
    assert f"its GM gains {pfedcs[0]}–{pfedcs[1]} points over the 1,200 rounds more" in text
    assert f"FedAvg's GM gains {fedavg[0]}–{fedavg[1]} points too" in text
    assert max(rises) < 0 and f"is {signed(max(rises))} to {signed(min(rises))} points per 100 rounds" in text
    assert f"(within {max(late):.1f} standard errors of zero)" in text
    assert f"({', '.join(gaps)})" in text


def test_the_pfedcs_2400_round_probe_reads_from_its_records():
    """docs/reproduce.md's pFedCS Synthetic probe at 2,400 rounds, 3 seeds a column: its first 600 rounds are the
    tables' runs and its first 1,200 the 1,200-round probe's (where that ran the seed), every evaluation but the
    timings; each cell (the GM levels of pFedCS and FedAvg over the 100 rounds up to rounds
    600, 1,200, 1,800 and 2,400, the least-squares trend over the last 100 rounds, the round the GM is flat from by
    trend.py, the GM gain at 600 and 2,400, pFedCS's PM level) is read from the kept records."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**2,400 rounds: the global models level off below FedAvg's.**")
    rows = [line for line in doc[start:].split("\n\n")[1].splitlines() if line.startswith(("| MLR", "| DNN"))]
    records = RECORDS.parents[1] / "pfedcs" / "records"
    assert [re.match(r"\| (MLR|DNN), seed (\d) \|", row).groups() for row in rows] == [
        (column, str(seed)) for column in ("MLR", "DNN") for seed in (0, 1, 2)]

    def earlier(probe: Path, folder: str, method: str, rounds: int, kept: bool = True) -> None:  # a shorter run
        run = records / folder / probe.name / method
        assert run.is_dir() or not kept, run
        if run.is_dir():
            assert [r for r in run_rows(probe / method) if r["round"] <= rounds] == run_rows(run), (probe, method)

    gains, flat_from = {}, []
    for row in rows:
        column, seed = re.match(r"\| (MLR|DNN), seed (\d) \|", row).groups()
        found = list(records.glob(f"probe_2400rounds_synthetic_{column.lower()}*/seed{seed}"))
        assert len(found) == 1, (row, found)
        probe = found[0]
        levels, rises, flat = {}, {}, {}
        for method in ("pfedcs", "fedavg"):
            earlier(probe, f"full_synthetic_{column.lower()}_3seeds", method, 600)
            earlier(probe, f"probe_1200rounds_synthetic_{column.lower()}", method, 1200, kept=False)
            x, y = curve(probe / method, "global_acc_weighted")
            assert x[-1] == 2400
            levels[method] = [float(y[(x > last - 100) & (x <= last)].mean()) for last in (600, 1200, 1800, 2400)]
            rises[method] = np.polyfit(x[-20:], y[-20:], 1)[0] * 100
            flat[method] = trend.trend(probe / method, 100, "global_acc_weighted")["flat_from"]
        xp, yp = curve(probe / "pfedcs", "personalized_acc_weighted")
        gains.setdefault(column, []).append(levels["pfedcs"][3] - levels["fedavg"][3])
        flat_from += list(flat.values())
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells == [" → ".join(f"{v:.2f}" for v in levels["pfedcs"]),
                         " → ".join(f"{v:.2f}" for v in levels["fedavg"]),
                         f"{signed(rises['pfedcs'])} / {signed(rises['fedavg'])}",
                         f"{flat['pfedcs']:,} / {flat['fedavg']:,}",
                         " → ".join(signed(levels["pfedcs"][i] - levels["fedavg"][i]) for i in (0, 3)),
                         f"{yp[xp > 2300].mean():.2f}"], row
    text = " ".join(doc[start:].split("\n\n")[2].split())  # the paragraph under the table
    assert f"flat by the whole criterion (from rounds {min(flat_from):,}–{max(flat_from):,})" in text
    assert max(gains["MLR"] + gains["DNN"]) < 0
    one = {k: [signed(v, 1).lstrip("+") for v in (max(g), min(g))] for k, g in gains.items()}
    assert f"to {' to '.join(one['MLR'])} with MLR and {' to '.join(one['DNN'])} with the DNN" in text


def test_the_1000_round_runs_read_from_their_records():
    """docs/reproduce.md, '1,000 rounds': every run of the two 10-client FMNIST tables not flat at round 600 (by
    trend.py over the table's own records) ran on to 1,000, as a finished run given more rounds continues; each run's
    first 600 rounds are its 600-round record's, every evaluation but the timings (FedAvg's and FedFomo's, run afresh,
    too), and each cell (round 600, the levels over the 20 evaluations up to rounds 600 and 1,000, round 1,000, the
    least-squares trend over the last 100 rounds, flat from by trend.py, the lowest evaluation past round 600, the
    clients' training loss at 600 and 1,000) is read from the kept records."""
    trend = results_script("trend")
    doc = (RECORDS.parents[2] / "reproduce.md").read_text()
    start = doc.index("**1,000 rounds: the 10-client runs not flat at round 600.**")
    rows = [line for line in doc[start:].split("\n\n")[1].splitlines()
            if line.startswith("| ") and not line.startswith("| run |")]
    methods = {"Per-FedAvg": "perfedavg", "pFedHN": "pfedhn", "pFedMe": "pfedme", "FedAvg": "fedavg",
               "FedFomo": "fedfomo"}
    shown = set()
    for row in rows:
        name, table, seed = re.match(r"\| ([\w-]+), Table (\d), seed (\d) \|", row).groups()
        method = methods[name]
        shown.add((method, int(table), int(seed)))
        run = RECORDS / f"table{table}_fmnist10_1000rounds_{method}" / f"seed{seed}" / method
        column = RECORDS.parent / f"converged_table{table}_fmnist10_3seeds.md"
        command = table_command(column.read_text())
        shorter = [RECORDS.parents[3] / command[i + 1] / f"seed{seed}" / method
                   for i, arg in enumerate(command) if arg == "--runs"]
        (shorter,) = [f for f in shorter if f.is_dir()]
        assert runs_on(run, shorter, 1000), row
        x, y = curve(run, "personalized_acc")
        assert x[-1] == 1000
        levels = [level(run, end) for end in (600, 1000)]
        rise = np.polyfit(x[-20:], y[-20:], 1)[0] * 100  # points per 100 rounds
        t = trend.trend(run, 100)
        loss = {r["round"]: r["train_loss"] for r in run_rows(run)}
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells == [f"{y[x == 600][0]:.2f}", f"{levels[0]:.2f} → {levels[1]:.2f}", f"{y[-1]:.2f}",
                         f"{signed(rise)} ± {t['trend_se']:.2f}", "–" if t["flat_from"] is None else f"{t['flat_from']:,}",
                         f"{y[x > 600].min():.2f}", f"{loss[600]:.3g} → {loss[1000]:.3g}"], row
    # the paragraph under the table, each number from the records
    text = " ".join(doc[start:].split("\n\n")[2].split())

    def of(method: str, table: int) -> list[Path]:
        return sorted((RECORDS / f"table{table}_fmnist10_1000rounds_{method}").glob(f"seed*/{method}"))

    def span(values, digits: int = 1) -> str:
        return f"{min(values):.{digits}f}–{max(values):.{digits}f}"

    def lowest(run: Path) -> float:
        x, y = curve(run, "personalized_acc")
        return float(y[x > 600].min())

    def loss_at(run: Path, rnd: int) -> float:
        return next(r["train_loss"] for r in run_rows(run) if r["round"] == rnd)

    def flat(method: str, table: int) -> list:
        return [trend.trend(run, 100)["flat_from"] for run in of(method, table)]

    for table in (1, 2):
        runs = of("perfedavg", table)
        gains = [level(r, 1000) - level(r, 600) for r in runs]
        means = [statistics.mean(level(r, end) for r in runs) for end in (600, 1000)]
        assert f"{span(gains)}{' points' if table == 1 else ''} on Table {table} ({'mean ' if table == 1 else ''}" \
               f"{means[0]:.2f} → {means[1]:.2f})" in text, table
        assert None not in flat("perfedavg", table)
        assert f"{min(flat('perfedavg', table)):,}–{max(flat('perfedavg', table)):,} on Table {table}" in text
    growth = ", ".join(f"{loss_at(r, 600):.3g} → {loss_at(r, 1000):.3g}" for r in of("perfedavg", 1))
    assert f"goes on growing on Table 1 ({growth}) and not on Table 2 " \
           f"({span([loss_at(r, 1000) for r in of('perfedavg', 2)], 2)} at round 1,000)" in text
    below = [level(r, 600) - lowest(r) for t in (1, 2) for r in of("pfedhn", t)]
    assert (f"is {' / '.join(f'{lowest(r):.1f}' for r in of('pfedhn', 1))} on Table 1 and "
            f"{' / '.join(f'{lowest(r):.1f}' for r in of('pfedhn', 2))} on Table 2, {span(below)} points below") in text
    hn = [[statistics.mean(level(r, end) for r in of("pfedhn", t)) for end in (600, 1000)] for t in (1, 2)]
    assert (f"its level at 1,000 is {hn[0][1]:.2f} on Table 1 and {hn[1][1]:.2f} on Table 2 (at 600: {hn[0][0]:.2f} and "
            f"{hn[1][0]:.2f}); it is flat at round 1,000 in "
            f"{sum(f is not None for t in (1, 2) for f in flat('pfedhn', t))} of the 6 runs") in text
    falls = [level(r, 600) - level(r, 1000) for r in of("pfedhn", 2)]
    falling = [trend.trend(r, 100) for r in of("pfedhn", 2)]
    assert (f"on Table 2 its level falls by {span(falls, 2)} points, two of them ending in a dip (trend over the last "
            f"100 rounds {' and '.join(signed(t['trend']) for t in falling if t['flat_from'] is None)})") in text
    # a third of the official hypernetwork step (Table 1), run on the same way from its 600-round runs
    small = sorted((RECORDS / "table1_fmnist10_hn_lr0.003_1000rounds_pfedhn").glob("seed*/pfedhn"))
    assert len(small) == 3
    for run in small:
        assert yaml.safe_load((run / "config.yaml").read_text())["pfedhn"]["hn_lr"] == 0.003
        shorter = RECORDS / "table1_fmnist10_600rounds_pfedhn_hn_lr0.003" / run.parent.name / "pfedhn"
        assert [r for r in run_rows(run) if r["round"] <= 600] == run_rows(shorter)
        assert run_rows(run)[-1]["round"] == 1000
    below = [level(r, 600) - lowest(r) for r in small]
    levels = [statistics.mean(level(r, end) for r in small) for end in (600, 1000)]
    assert (f"its lowest evaluation after round 600 is {' / '.join(f'{lowest(r):.1f}' for r in small)}, "
            f"{span(below)} points below its level at round 600, its level at 1,000 {levels[1]:.2f} (at 600: "
            f"{levels[0]:.2f}), flat at round 1,000 in {sum(trend.trend(r, 100)['flat_from'] is not None for r in small)} "
            f"of the 3 runs") in text
    # and Table 2's, run from the start to 1,000 rounds (no 600-round record to continue)
    small = sorted((RECORDS / "table2_fmnist10_hn_lr0.003_1000rounds_pfedhn").glob("seed*/pfedhn"))
    assert [r.parent.name for r in small] == ["seed0", "seed1", "seed2"]
    for run in small:
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert (config["pfedhn"]["hn_lr"], config["rounds"], config["pfedhn"]["sequential"]) == (0.003, 1000, True)
        assert config["seed"] == int(run.parent.name[4:]) and run_rows(run)[-1]["round"] == 1000
    below = [level(r, 600) - lowest(r) for r in small]
    levels = [statistics.mean(level(r, end) for r in small) for end in (600, 1000)]
    starts = [trend.trend(r, 100)["flat_from"] for r in small]
    assert None not in starts and (
        f"its lowest evaluation after round 600 is {' / '.join(f'{lowest(r):.1f}' for r in small)}, {span(below)} points "
        f"below its level at round 600, its level at 1,000 {levels[1]:.2f} (at 600: {levels[0]:.2f}), flat at round "
        f"1,000 in 3 of the 3 runs (from rounds {min(starts):,}–{max(starts):,}), where the official step falls from "
        f"{hn[1][0]:.2f} to {hn[1][1]:.2f}") in text
    # the presets keep the official step: at round 600 it is level with the smaller one or above it
    first = statistics.mean(level(r, 600) for r in (RECORDS / "table1_fmnist10_hn_lr0.003_1000rounds_pfedhn").glob(
        "seed*/pfedhn"))
    assert hn[0][0] >= first - 0.5 and hn[1][0] >= levels[0] - 0.5
    assert (f"({hn[0][0]:.2f} against {first:.2f} on Table 1, {hn[1][0]:.2f} against {levels[0]:.2f} on Table 2)"
            in text)
    (me1,), (me2,) = of("pfedme", 1), of("pfedme", 2)
    climbing = trend.trend(me2, 100)
    assert climbing["flat_from"] is None and (
        f"pFedMe's two runs gain {level(me1, 1000) - level(me1, 600):.2f} and {level(me2, 1000) - level(me2, 600):.2f} "
        f"points, Table 1's flat from round {trend.trend(me1, 100)['flat_from']}, Table 2's still climbing (trend "
        f"{signed(climbing['trend'])} ± {climbing['trend_se']:.2f})") in text
    (fedavg,), (fedfomo,) = of("fedavg", 1), of("fedfomo", 2)
    t = trend.trend(fedavg, 100)
    assert t["flat_from"] is None and (
        f"swings about a level {level(fedavg, 1000) - level(fedavg, 600):.2f} points higher ({level(fedavg, 1000):.2f}), "
        f"not flat by the criterion (trend {signed(t['trend'])} ± {t['trend_se']:.2f})") in text
    assert (f"is flat from round {trend.trend(fedfomo, 100)['flat_from']} at the level it had ({level(fedfomo, 600):.2f} "
            f"→ {level(fedfomo, 1000):.2f})") in text
    for table in (1, 2):  # every run the table's records leave not flat at round 600 is among them
        command = table_command((RECORDS.parent / f"converged_table{table}_fmnist10_3seeds.md").read_text())
        folders = [RECORDS.parents[3] / command[i + 1] for i, arg in enumerate(command) if arg == "--runs"]
        for folder in folders:
            for metrics in folder.glob("seed*/*/metrics.jsonl"):
                if (metrics.parent / "summary.json").is_file() and trend.trend(metrics.parent, 100)["flat_from"] is None:
                    key = (metrics.parent.name, table, int(metrics.parent.parent.name[4:]))
                    assert key in shown, key
