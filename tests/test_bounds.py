"""Bad input gets one line before anything is sized: files and keys that would make pfedkit allocate (or work)
without bound, nesting and numbers its readers cannot take, and messages that gave wrong advice. Each case is a
crafted file or command through the command line: a non-zero exit, one `pfedkit: error: ...` line naming the file
or key (and the memory it would need), no --out folder, every file as it was. The cases that used gigabytes run
as real processes under an address-space limit, and their peak memory is measured."""
from __future__ import annotations

import gzip
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pfedkit.cli import main
from pfedkit.config import DatasetConfig, load_config
from pfedkit.experiment import run_experiment
from pfedkit.data.sources import load_source
from pfedkit.errors import DataError
from test_bad_inputs import BOUNDED, assert_refused, metrics_row, snapshot
from test_leaf import make_data, write_json
from test_sources import Payload, as_cifar_rows, standardized, write_cifar10, write_idx_set
from test_trust import files_of, interrupted_run

DIGITS = ["--set", "dataset.name=digits", "--set", "model.name=mlr"]
SYNTHETIC = ["--set", "dataset.name=synthetic", "--set", "partition.scheme=natural", "--set", "model.name=mlr"]
GB = 10 ** 9


# ---- crafted files and commands: each returns (args, needles) --------------------------------------------------

def idx_header(dims: tuple[int, ...]) -> bytes:
    return bytes([0, 0, 0x08, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)


def zeros_gzip(header: bytes, megabytes: int) -> bytes:
    """A gzip file of ~1 KB per MB it inflates to: one compressed MB of zeros repeated (gzip members concatenate)."""
    return gzip.compress(header) + gzip.compress(bytes(2 ** 20)) * megabytes


def mnist_args(d: Path) -> list[str]:
    return ["run", "--set", "dataset.name=mnist", "--set", f"dataset.root={d / 'mnist'}"]


def idx_declares_2m_images(d: Path):
    """1.5 MB of gzip holding 1.5 GB of zeros behind a header of 2,000,000 images (3.2 GB used before the refusal)."""
    write_idx_set(d / "mnist")  # 30 train labels
    path = d / "mnist" / "train-images-idx3-ubyte.gz"
    path.write_bytes(zeros_gzip(idx_header((2_000_000, 28, 28)), 1500))
    return mnist_args(d), [f"{path.name} has shape (2000000, 28, 28)", "train-labels-idx1-ubyte (30,)"]


def idx_inflates_past_its_header(d: Path):
    """A header of 30 images, then a gigabyte of data nobody declared."""
    write_idx_set(d / "mnist")
    path = d / "mnist" / "train-images-idx3-ubyte.gz"
    path.write_bytes(zeros_gzip(idx_header((30, 28, 28)), 1000))
    return mnist_args(d), [f"{path}: header says shape (30, 28, 28) but holds more than {30 * 784} bytes"]


def idx_dims_beyond_memory(d: Path):
    """Headers that agree on 2**31 images of 2**31 x 4 pixels (the product overflows int64): refused by the memory
    they declare, before any data is read."""
    write_idx_set(d / "mnist", gz=(False, False, False, False))
    (d / "mnist" / "train-images-idx3-ubyte").write_bytes(idx_header((2 ** 31, 2 ** 31, 4)))
    (d / "mnist" / "train-labels-idx1-ubyte").write_bytes(idx_header((2 ** 31,)))
    (d / "mnist" / "t10k-images-idx3-ubyte").write_bytes(idx_header((12, 2 ** 31, 4)))  # 12 test labels
    return mnist_args(d), ["train-images-idx3-ubyte and", "declare 2,147,483,660 images of 2147483648x4",
                           "of memory, more than"]


def idx_255_dimensions(d: Path):
    write_idx_set(d / "mnist", gz=(False, False, False, False))
    path = d / "mnist" / "train-images-idx3-ubyte"
    path.write_bytes(idx_header((1,) * 255) + b"\x00")
    return mnist_args(d), [f"{path}: its header declares 255 dimensions"]


def cifar_args(d: Path) -> list[str]:
    return ["run", "--set", "dataset.name=cifar10", "--set", f"dataset.root={d / 'data'}"]


def cifar_zero_strides(d: Path):
    """A few hundred bytes whose 'data' is one byte seen 20,000 x 3072 times (an ndarray with strides (0, 0))."""
    folder = d / "data" / "cifar-10-batches-py"
    write_cifar10(folder)
    data = Payload(np.ndarray, (20_000, 3072), np.dtype(np.uint8), b"\x07", 0, (0, 0))
    labels = Payload(np.ndarray, (20_000,), np.dtype(np.int64), bytes(8), 0, (0,))
    with open(folder / "data_batch_1", "wb") as fh:
        pickle.dump({b"data": data, b"labels": labels}, fh, protocol=2)
    assert (folder / "data_batch_1").stat().st_size < 400
    return cifar_args(d), [f"{folder / 'data_batch_1'} holds 'data' that stands for more values than the file's"]


def cifar_one_row_many_times(d: Path):
    """A list of 5,000 references to one row: pickle writes the row once."""
    folder = d / "data" / "cifar-10-batches-py"
    write_cifar10(folder)
    row = [7] * 3072
    with open(folder / "test_batch", "wb") as fh:
        pickle.dump({b"data": [row] * 5000, b"labels": [0, 1] * 2500}, fh, protocol=2)
    return cifar_args(d), [f"{folder / 'test_batch'} holds 'data' that stands for more values"]


def alias_bomb(d: Path):
    """Nine levels of nine aliases in a known key: 387 million values in 400 bytes (grew until killed, then an error
    line embedding an 800 KB repr)."""
    value = "&a0 [x, x, x, x, x, x, x, x, x]"
    for i in range(1, 9):
        value = f"&a{i} [{value}, " + ", ".join([f"*a{i - 1}"] * 8) + "]"
    (d / "exp.yaml").write_text(f"rounds: 2\nalgorithm: {value}\n")
    return ["run", str(d / "exp.yaml")], [f"config file {d / 'exp.yaml'} expands to more than 10,000 values",
                                          "alias"]


def alias_cycle(d: Path):
    (d / "exp.yaml").write_text("local:\n  lr: &loop [1, *loop]\n")
    return ["run", str(d / "exp.yaml")], [f"config file {d / 'exp.yaml'} expands to more than 10,000 values"]


def deep_yaml_file(d: Path):
    (d / "exp.yaml").write_text("local: " + "[" * 5000 + "]" * 5000 + "\n")
    return ["run", str(d / "exp.yaml")], [f"config file {d / 'exp.yaml'} nests lists or mappings too deeply"]


def deep_yaml_set(d: Path):
    return ["run", "--set", "local.lr=" + "[" * 5000 + "]" * 5000], ["--set local.lr=... nests", "too deeply"]


def deep_yaml_algorithms(d: Path):
    return ["run", "--algorithms", "fedavg@local.lr=" + "{a: " * 3000 + "1" + "}" * 3000], \
        ["config key 'algorithm': 'fedavg@local.lr=", "nests lists or mappings too deeply"]


def integer_of_5000_digits(d: Path):
    (d / "exp.yaml").write_text("rounds: " + "9" * 5000 + "\n")
    return ["run", str(d / "exp.yaml")], [f"config file {d / 'exp.yaml'} holds a number of more than 4,300 digits"]


def integer_of_100_digits(d: Path):
    return ["run", "--set", "eval_every='" + "9" * 100 + "'"], ["config key 'eval_every': '9999", "is out of range",
                                                               "<= 9223372036854775807 (64 bits)"]


def seed_above_2_63(d: Path):
    return ["run", "--set", f"seed={2 ** 63}"], [f"config key 'seed': {2 ** 63} is out of range; allowed: >= 0 and "
                                                 f"<= {2 ** 63 - 1}"]


def seeds_above_2_63(d: Path):
    return ["run", "--seeds", f"0,{2 ** 64}"], [f"config key 'seeds': '{2 ** 64}'", f"from 0 to {2 ** 63 - 1}"]


def seeds_repeated(d: Path):
    return ["run", "--seeds", "0,1,00"], ["config key 'seeds': '0,1,00' names seed 0 twice", "distinct"]


def threads_100000(d: Path):
    return ["run", "--set", "runtime.threads=100000"], ["config key 'runtime.threads': 100000 is out of range; allowed: >= 0 and "
                                                "<= 1024"]


def steps_10e9(d: Path):
    return ["run", "--set", "local.steps=1000000000"], ["config key 'local.steps': 1000000000 is out of range",
                                                        "<= 100000"]


def epochs_10e6(d: Path):
    return ["run", "--set", "local.epochs=1000000"], ["config key 'local.epochs': 1000000 is out of range", "<= 10000"]


def hidden_10e9(d: Path):
    return ["run", *DIGITS, "--set", "model.name=dnn", "--set", "model.hidden=1000000000"], \
        ["config key 'model.hidden': 1,000,000,000 makes a DNN of 75,000,000,010 parameters", "1,200.0 GB of memory"]


def batch_size_10e6(d: Path):
    """4.6 GB and exit 0 on a dataset of 1,797 samples: every batch slot of 10 clients padded to 10**6."""
    return ["run", *DIGITS, "--set", "local.batch_size=1000000"], \
        ["config keys local.batch_size=1,000,000 and local.epochs=1 (fedavg): 10 clients", "of memory, more than",
         "largest here: 124 samples"]


def batch_size_in_a_spec(d: Path):
    return ["run", *DIGITS, "--algorithms", "local,fedavg@local.batch_size=100000000"], \
        ["config keys local.batch_size=100,000,000 and local.epochs=1 (fedavg@local.batch_size=100000000)",
         "of memory"]


def num_clients_10e7(d: Path):
    """Refused after 396 s and 5.35 GB by the partition's own checks."""
    return ["run", *DIGITS, "--set", "partition.num_clients=10000000"], \
        ["partition.num_clients = 10,000,000 clients need at least 20,000,000 samples", "the data has 1,797",
         "up to 898"]


def synthetic_features_at_their_maximum(d: Path):
    return ["run", *SYNTHETIC, "--set", "dataset.synthetic.features=100000"], \
        ["dataset.synthetic.features=100000", "samples of 100000 features would need about", "of memory"]


def synthetic_users_10e7(d: Path):
    return ["run", *SYNTHETIC, "--set", "partition.num_clients=10000000"], \
        ["partition.num_clients=10000000 (Synthetic's users)", "2,500,000,000 or more samples", "of memory"]


def synthetic_size_factor_10e9(d: Path):
    return ["run", *SYNTHETIC, "--set", "dataset.synthetic.size_factor=1000000000"], \
        ["dataset.synthetic.size_factor=1000000000", "500,000,000,000 or more samples", "of memory"]


def leaf_args(d: Path, train: dict, test: dict) -> list[str]:
    tr, te = write_json(d / "train.json", train), write_json(d / "test.json", test)
    return ["run", "--set", "dataset.name=leaf", "--set", f"dataset.train_file={tr}", "--set",
            f"dataset.test_file={te}", "--set", "partition.scheme=natural", "--set", "model.name=mlr", "--set",
            "partition.num_clients=6"]


def leaf_deep_nesting(d: Path):
    args = leaf_args(d, make_data(8), make_data(9, empty_user=False))
    text = (d / "test.json").read_text()
    (d / "test.json").write_text('{"hierarchies": ' + "[" * 100_000 + "]" * 100_000 + ", " + text[1:])
    return args, [f"LEAF file {d / 'test.json'}: the value of 'hierarchies' at byte 16 nests lists or objects too "
                  "deeply"]


def leaf_user_without_train_data(d: Path):
    """User 2 has test samples only: lowering num_clients, the old advice, is refused for LEAF data."""
    args = leaf_args(d, make_data(8), make_data(9, empty_user=False))
    return args, ["gives user 2 of the train file (counting from 0) 0 train and", "remove the user from both files"]


def plot_args(d: Path, lines: list[str]) -> list[str]:
    run = d / "exp" / "fedavg"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return ["plot", str(d / "exp")]


def metrics_deep_nesting(d: Path):
    args = plot_args(d, [metrics_row(1), '{"round": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    return args, [f"{d / 'exp' / 'fedavg' / 'metrics.jsonl'}: line 2 nests lists or objects too deeply"]


def metrics_rows_that_are_lists(d: Path):
    return plot_args(d, ["[1, 0.5]", "[2, 0.6]"]), ["metrics.jsonl: line 1 is not a metrics row (a JSON object)"]


def metrics_strings(d: Path):
    row = json.loads(metrics_row(2))
    row["personalized_acc"] = "0.9"
    return plot_args(d, [metrics_row(1), json.dumps(row)]), \
        ["metrics.jsonl: line 2 is not a metrics row: its 'personalized_acc' is '0.9', not a number"]


def metrics_list_values(d: Path):
    row = json.loads(metrics_row(1))
    row["train_loss"] = [1.0, 2.0]
    return plot_args(d, [json.dumps(row)]), ["line 1 is not a metrics row: its 'train_loss' is [1.0, 2.0], not a"]


# real processes under an address-space limit: the cases that used gigabytes (or grew until killed)
IN_A_PROCESS = (idx_declares_2m_images, idx_inflates_past_its_header, cifar_zero_strides, alias_bomb,
                batch_size_10e6, synthetic_features_at_their_maximum, num_clients_10e7)
THROUGH_MAIN = (idx_dims_beyond_memory, idx_255_dimensions, cifar_one_row_many_times, alias_cycle, deep_yaml_file,
                deep_yaml_set, deep_yaml_algorithms, integer_of_5000_digits, integer_of_100_digits,
                seed_above_2_63, seeds_above_2_63, seeds_repeated, threads_100000, steps_10e9, epochs_10e6,
                hidden_10e9, batch_size_in_a_spec, synthetic_users_10e7, synthetic_size_factor_10e9,
                leaf_deep_nesting, leaf_user_without_train_data, metrics_deep_nesting, metrics_rows_that_are_lists,
                metrics_strings, metrics_list_values)


def prepare(case, d: Path):
    args, needles = case(d)
    if args[0] == "run":  # one short run (the case's own --algorithms kept), so that a missed check fails fast
        bounded = BOUNDED[2:] if "--algorithms" in args else BOUNDED
        args += [*bounded, "--out", str(d / "out")]
    return args, needles, snapshot(d)


# ---- the processes ----------------------------------------------------------------------------------------------

def virtual_size() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))


# This test process has imported what pfedkit imports: 2 GB of address space beyond it is room to run, but not for
# the gigabytes of the old behaviours (MemoryError, a traceback), and pfedkit's memory checks see that limit.
LIMIT = virtual_size() + 2 * GB
PEAK = GB  # the resident memory every refusal stays under (pfedkit's imports and digits: ~0.35 GB)


def start(args: list[str]):
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "pfedkit", *args], stdout=subprocess.DEVNULL, stderr=err,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT)))
    return proc, err


def finish(proc, err, timeout: float = 300) -> tuple[int, str, int]:
    """(exit code, stderr, peak resident bytes) of a process started by `start`, killed after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err.seek(0)
    return proc.returncode, err.read().decode(errors="replace"), usage.ru_maxrss * 1024


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """The IN_A_PROCESS cases, started side by side: {case: (folder, needles, files before, code, stderr, peak)}."""
    started = {}
    for case in IN_A_PROCESS:
        d = tmp_path_factory.mktemp(case.__name__)
        args, needles, before = prepare(case, d)
        started[case.__name__] = (d, needles, before, *start(args))
    return {name: (d, needles, before, *finish(proc, err)) for name, (d, needles, before, proc, err)
            in started.items()}


@pytest.mark.parametrize("case", [c.__name__ for c in IN_A_PROCESS])
def test_what_would_take_gigabytes_is_one_line_in_bounded_memory(processes, case):
    d, needles, before, code, stderr, peak = processes[case]
    assert_refused(d, needles, before, code, stderr)
    assert "Traceback" not in stderr and len(stderr) < 600, stderr[-2000:]
    assert peak < PEAK, f"{case}: peak resident memory {peak / GB:.2f} GB"


@pytest.mark.parametrize("case", THROUGH_MAIN, ids=[c.__name__ for c in THROUGH_MAIN])
def test_a_bad_input_is_one_line_from_main_before_anything_is_sized(tmp_path, capsys, case):
    args, needles, before = prepare(case, tmp_path)
    code = main(args)
    stderr = capsys.readouterr().err
    assert code == 2 and len(stderr) < 600, stderr[-2000:]
    assert_refused(tmp_path, needles, before, code, stderr)


# ---- what must still work -----------------------------------------------------------------------------------------

def test_anchors_and_aliases_of_a_real_config_still_load(tmp_path):
    (tmp_path / "exp.yaml").write_text("pfedla: &hn {hn_lr: 0.5, hn_optimizer: sgd}\nheurpfedla: *hn\nrounds: 3\n")
    cfg = load_config(tmp_path / "exp.yaml", ["seed=9223372036854775807"])
    assert cfg.params("heurpfedla").hn_lr == 0.5 and cfg.params("pfedla").hn_optimizer == "sgd"
    assert cfg.seed == 2 ** 63 - 1


@pytest.mark.parametrize("protocol", [0, 2])
def test_a_valid_cifar_batch_with_an_empty_bytes_value_loads(tmp_path, protocol):
    """Python 3's protocols 0-2 write b"" as a call of bytes(), which was refused as a crafted file."""
    folder = tmp_path / "cifar-10-batches-py"
    planes, labels = write_cifar10(folder)
    batch = {b"batch_label": b"", b"data": as_cifar_rows(planes[:4]), b"labels": labels[:4].tolist(),
             b"filenames": [b""] * 4}
    raw = pickle.dumps(batch, protocol=protocol)
    assert b"bytes" in raw  # the call this case is about
    (folder / "data_batch_1").write_bytes(raw)
    src = load_source(DatasetConfig(name="cifar10", root=str(tmp_path)), seed=0, num_clients=10)
    np.testing.assert_array_equal(src.y, labels)
    np.testing.assert_allclose(src.x, standardized(planes), atol=1e-4)


def test_bytes_with_an_argument_is_still_refused(tmp_path):
    """bytes(n) allocates n bytes: the call an empty value needs takes no argument."""
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": Payload(bytes, 10 ** 12), b"labels": []},
                                                       protocol=2))
    with pytest.raises(DataError, match=r"data_batch_2 is not a CIFAR python batch"):
        load_source(DatasetConfig(name="cifar10", root=str(tmp_path)), seed=0, num_clients=10)


def test_an_idx_gzip_file_of_its_declared_size_still_loads(tmp_path):
    xs, ys = write_idx_set(tmp_path, gz=(True, True, True, True))
    src = load_source(DatasetConfig(name="mnist", root=str(tmp_path)), seed=0, num_clients=10)
    np.testing.assert_array_equal(src.y, ys)
    np.testing.assert_allclose(src.x, standardized(xs[:, None]), atol=1e-4)


# ---- resuming: malformed checkpoint rows, and advice that works ---------------------------------------------------

@pytest.mark.parametrize("damage", ["rows that are lists", "a row without personalized_acc", "a string accuracy"])
def test_a_checkpoint_with_malformed_metrics_rows_is_one_line(tmp_path, capsys, damage):
    out = interrupted_run(tmp_path)
    ckpt = out / "fedavg" / "checkpoint.pt"
    ck = torch.load(ckpt, weights_only=True)
    if damage == "rows that are lists":
        ck["metrics"] = [list(row.values()) for row in ck["metrics"]]
    elif damage == "a row without personalized_acc":
        del ck["metrics"][-1]["personalized_acc"]
    else:
        ck["metrics"][0]["personalized_acc"] = "high"
    torch.save(ck, ckpt)
    before = files_of(out)
    assert main(["run", "--resume", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pfedkit: error: "), lines
    assert f"cannot resume from {ckpt}: its metrics or round counter are damaged" in lines[0]
    assert files_of(out) == before


def test_a_checkpoint_from_before_a_config_key_blames_the_version_not_config_yaml(tmp_path, capsys):
    """A pfedkit that added a key (here eval_train) finds it in neither the old checkpoint nor its config.yaml:
    no edit of config.yaml can restore it."""
    out = interrupted_run(tmp_path)
    ckpt = out / "fedavg" / "checkpoint.pt"
    ck = torch.load(ckpt, weights_only=True)
    del ck["config"]["eval_train"]
    torch.save(ck, ckpt)
    for path in (out / "config.yaml", out / "fedavg" / "config.yaml"):
        config = yaml.safe_load(path.read_text())
        del config["eval_train"]
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    before = files_of(out)
    assert main(["run", "--resume", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert (f"cannot resume from {ckpt}: it was written by a pfedkit without config key eval_train (this one's "
            "default: False); resume it with the pfedkit that wrote it, or start it afresh") in lines[0]
    assert "config.yaml says" not in lines[0]
    assert files_of(out) == before


def test_with_allow_version_change_a_key_added_since_is_taken_at_its_default_and_only_there(tmp_path, capsys):
    """A checkpoint from before a key was added (here eval_train, default False: no training loss, as before it
    existed) continues under --allow-version-change when the config leaves the key at its default, and its rows are
    the uninterrupted run's; set otherwise, the key would change what the earlier run computed: still refused."""
    from test_trust import DIGITS
    whole = tmp_path / "whole"
    run_experiment(load_config(None, DIGITS, "fedavg"), whole, log=lambda s: None)
    out = interrupted_run(tmp_path)
    ckpt = out / "fedavg" / "checkpoint.pt"
    ck = torch.load(ckpt, weights_only=True)
    del ck["config"]["eval_train"]
    torch.save(ck, ckpt)
    assert main(["run", "--resume", str(out)]) == 2
    assert "(or continue it with --allow-version-change, which takes a key added since at its default" in \
        capsys.readouterr().err
    config = out / "config.yaml"
    config.write_text(config.read_text().replace("eval_train: false", "eval_train: true"))
    assert main(["run", "--resume", str(out), "--allow-version-change"]) == 2
    line = capsys.readouterr().err.strip()
    assert ("without config key eval_train (this one's default: False; config.yaml sets True)" in line
            and "--allow-version-change" not in line)
    config.write_text(config.read_text().replace("eval_train: true", "eval_train: false"))
    assert main(["run", "--resume", str(out), "--allow-version-change"]) == 0
    rows = [[{k: v for k, v in json.loads(line).items() if k not in ("wall_s", "server_s", "eval_s")}
             for line in (folder / "fedavg" / "metrics.jsonl").read_text().splitlines()] for folder in (out, whole)]
    assert rows[0] == rows[1] and len(rows[0]) == 4


def test_the_advice_for_a_run_without_a_checkpoint_resumes_it_in_its_own_folder(tmp_path, capsys):
    out = interrupted_run(tmp_path, "checkpoint_every=0")  # stopped after round 2, before its only checkpoint
    assert main(["run", "--resume", str(out / "fedavg")]) == 2
    line = capsys.readouterr().err.strip()
    advice = f"`pfedkit run --resume {out}`"
    assert advice in line and "--out" not in line
    assert main(advice.strip("`").split()[1:]) == 0  # following it finishes the run where it belongs
    rows = [json.loads(r) for r in (out / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert not (out / "fedavg" / "fedavg").exists() and (out / "fedavg" / "summary.json").is_file()
