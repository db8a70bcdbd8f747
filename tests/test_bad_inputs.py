"""Bad input files through the command line, as a user meets them: real files, real processes. Each must end in
one `pfedkit: error: ...` line naming the file or key, a non-zero exit, no --out folder and every file as it was;
a crafted CIFAR batch must not run its code. The processes run side by side (startup dominates their time)."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pfedkit.errors import PfedkitError
from pfedkit.report.plots import plot_seed_comparison, read_metrics, seed_band
from test_leaf import make_data, write_json
from test_sources import Payload, write_cifar10, write_idx, write_idx_set

BOUNDED = ["--algorithms", "fedavg", "--set", "rounds=1", "--set", "progress=false", "--set", "plots=false"]


def crafted_cifar(d: Path):
    folder = d / "data" / "cifar-10-batches-py"
    write_cifar10(folder)
    with open(folder / "data_batch_1", "wb") as fh:  # protocol 2, as the real batches
        pickle.dump({b"data": Payload(os.system, f"touch {d / 'pwned'}"), b"labels": [0]}, fh, protocol=2)
    args = ["run", "--set", "dataset.name=cifar10", "--set", f"dataset.root={d / 'data'}"]
    return args, [f"{folder / 'data_batch_1'}: refused to load: it asks for posix.system", "crafted"]


def cifar_float_data(d: Path):
    folder = d / "data" / "cifar-10-batches-py"
    write_cifar10(folder)
    with open(folder / "test_batch", "wb") as fh:
        pickle.dump({b"data": np.full((4, 3072), 0.5), b"labels": [0, 1, 2, 3]}, fh)
    args = ["run", "--set", "dataset.name=cifar10", "--set", f"dataset.root={d / 'data'}"]
    return args, [str(folder / "test_batch"), "float64", "uint8 array of shape (N, 3072)"]


def idx_sizes_differ(d: Path):
    write_idx_set(d / "mnist", gz=(False, False, False, False))
    write_idx(d / "mnist" / "t10k-images-idx3-ubyte", np.zeros((12, 32, 32)))
    args = ["run", "--set", "dataset.name=mnist", "--set", f"dataset.root={d / 'mnist'}"]
    return args, ["train-images-idx3-ubyte holds 28x28", "t10k-images-idx3-ubyte holds 32x32"]


def leaf_files(d: Path, edit) -> list[str]:
    train, test = make_data(8), make_data(9, empty_user=False)
    edit(test)
    tr, te = write_json(d / "train.json", train), write_json(d / "test.json", test)
    return ["run", "--set", "dataset.name=leaf", "--set", f"dataset.train_file={tr}", "--set",
            f"dataset.test_file={te}", "--set", "partition.scheme=natural", "--set", "model.name=mlr"]


def leaf_huge_label(d: Path):
    args = leaf_files(d, lambda data: data["user_data"]["f_00001"]["y"].__setitem__(0, 10 ** 9))
    return args, ["test.json: user 'f_00001' has label 1000000000", "distinct labels"]


def leaf_nan(d: Path):
    args = leaf_files(d, lambda data: data["user_data"]["f_00005"]["x"][0].__setitem__(1, float("nan")))
    return args, ["test.json: user 'f_00005' holds non-finite features (NaN/inf", "row 0"]


def nan_lr(d: Path):
    return ["run", "--set", "local.lr=nan"], ["config key 'local.lr': nan is not allowed; allowed: a finite number"]


def config_not_utf8(d: Path):
    (d / "exp.yaml").write_bytes(b"\xff\xfe rounds: 3\n")
    return ["run", str(d / "exp.yaml")], [f"config file {d / 'exp.yaml'} is not UTF-8"]


def config_yaml_error(d: Path):
    (d / "exp.yaml").write_text("rounds: 3\nlocal:\n  lr: 0.1\n    epochs: 2\n")
    return ["run", str(d / "exp.yaml")], [f"config file {d / 'exp.yaml'} is not valid YAML: line 4, column 11"]


def metrics_row(r: int) -> str:
    return json.dumps({"round": r, "personalized_acc": 0.5, "global_acc": 0.4, "train_loss": 1.0})


def metrics_truncated(d: Path):
    run = d / "exp" / "fedavg"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(metrics_row(1) + "\n" + metrics_row(2) + "\n" + metrics_row(3)[:25])
    return ["plot", str(d / "exp")], [f"{run / 'metrics.jsonl'}: line 3 is not valid JSON (truncated file?)",
                                      "--resume"]


def seed_metrics_garbage(d: Path):
    run = d / "exp" / "seed0" / "local"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(metrics_row(1) + "\nGARBAGE\n" + metrics_row(2) + "\n")
    (run / "summary.json").write_text("{}")
    return ["plot", str(d / "exp")], [f"{run / 'metrics.jsonl'}: line 2 is not valid JSON"]


CASES = {f.__name__: f for f in (crafted_cifar, cifar_float_data, idx_sizes_differ, leaf_huge_label, leaf_nan,
                                 nan_lr, config_not_utf8, config_yaml_error, metrics_truncated,
                                 seed_metrics_garbage)}
# Each process spends seconds importing torch: these go through a real process, every case through `main`.
IN_A_PROCESS = ("crafted_cifar", "leaf_huge_label", "nan_lr", "metrics_truncated")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def prepare(name: str, d: Path):
    args, needles = CASES[name](d)
    if args[0] == "run":
        args += [*BOUNDED, "--out", str(d / "out")]  # a missed check then fails fast, into an out folder
    return args, needles, snapshot(d)


def assert_refused(d: Path, needles: list[str], before: dict, returncode: int, stderr: str) -> None:
    lines = stderr.strip().splitlines()
    assert returncode != 0 and len(lines) == 1, stderr
    assert lines[0].startswith("pfedkit: error: "), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (d / "out").exists()
    assert snapshot(d) == before  # nothing written or changed, the crafted batch's marker included
    assert not (d / "pwned").exists()


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """The IN_A_PROCESS cases, started side by side: {case: (folder, needles, files before, returncode, stderr)}."""
    started = {}
    for name in IN_A_PROCESS:
        d = tmp_path_factory.mktemp(name)
        args, needles, before = prepare(name, d)
        proc = subprocess.Popen([sys.executable, "-m", "pfedkit", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started[name] = (d, needles, before, proc)
    out = {}
    for name, (d, needles, before, proc) in started.items():
        try:
            _, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        out[name] = (d, needles, before, proc.returncode, stderr)
    return out


@pytest.mark.parametrize("case", IN_A_PROCESS)
def test_a_bad_input_is_one_line_from_the_command_and_changes_nothing(processes, case):
    assert_refused(*processes[case])


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_one_line_from_main_and_changes_nothing(tmp_path, capsys, case):
    from pfedkit.cli import main
    args, needles, before = prepare(case, tmp_path)
    returncode = main(args)
    assert returncode == 2
    assert_refused(tmp_path, needles, before, returncode, capsys.readouterr().err)


# ---- plots: metrics files and the multi-seed band, in process ---------------------------------------------------

@pytest.mark.parametrize("text, line", [
    (metrics_row(1) + "\n" + metrics_row(2)[:-3], 2),  # a run killed mid-write
    ("\n" + metrics_row(1) + "\n{\"round\": 2, \"personalized_acc\"\n" + metrics_row(3) + "\n", 3),
    (metrics_row(1) + "\n\xff\xfe\n", 2),
], ids=["cut-last-line", "cut-middle-line", "not-utf8"])
def test_read_metrics_names_the_line_that_is_not_json(tmp_path, text, line):
    (tmp_path / "metrics.jsonl").write_bytes(text.encode("latin1"))
    with pytest.raises(PfedkitError) as err:
        read_metrics(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and f"{tmp_path / 'metrics.jsonl'}: line {line} is not valid JSON" in msg, msg


def test_read_metrics_refuses_a_line_that_is_not_a_row_and_reads_a_good_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(metrics_row(1) + "\n[1, 2]\n")
    with pytest.raises(PfedkitError, match=r"line 2 is not a metrics row"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(metrics_row(1) + "\n\n" + metrics_row(2) + "\n")
    assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2]


def test_the_seed_band_is_the_sample_std_and_zero_for_one_seed(tmp_path):
    acc = np.array([[0.5, 0.6], [0.7, 0.9], [0.6, 0.75]])  # 3 seeds x 2 rounds
    mean, std = seed_band(acc)
    np.testing.assert_allclose(mean, [0.6, 0.75])
    np.testing.assert_allclose(std, [0.1, 0.15])  # sqrt(sum of squared deviations / (3 - 1))
    mean, std = seed_band(acc[:1])
    np.testing.assert_array_equal(std, [0.0, 0.0])
    run = tmp_path / "seed0" / "fedavg"  # one seed still draws its figure
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(metrics_row(1) + "\n" + metrics_row(2) + "\n")
    (run / "summary.json").write_text("{}")
    assert plot_seed_comparison(tmp_path, [tmp_path / "seed0"], ["fedavg"]).is_file()
