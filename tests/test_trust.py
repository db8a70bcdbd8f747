"""Results are never silently wrong, lost or mixed, and run folders never execute code: checkpoints, --out,
resume, small clients, ignored knobs, checks before anything is written, degenerate partitions, a full disk."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pfedkit.config import LocalConfig, PartitionConfig, load_config
from pfedkit.data import make_partition
from pfedkit.engine import Run, check_update
from pfedkit.engine.folder import LOCK
from pfedkit.errors import ConfigError, DataError, UpdateError
from pfedkit.experiment import prepare, run_experiment
from pfedkit.models import FlatModel, build_model
from pfedkit.train import batch_indices, seeded_generator

FAST = ["--set", "progress=false", "--set", "plots=false"]
DIGITS = ["dataset.name=digits", "model.name=mlr", "partition.num_clients=6", "partition.classes_per_client=3",
          "rounds=4", "local.batch_size=16", "local.lr=0.1", "progress=false", "plots=false", "checkpoint_every=2"]


def pfedkit(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pfedkit", *args], capture_output=True, text=True, timeout=timeout)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    return lines[0]


def interrupted_run(tmp_path: Path, *extra: str, algorithms: str = "fedavg") -> Path:
    """An experiment folder stopped after round 2 (its checkpoint is at round 2), as after a crash."""
    out = tmp_path / "exp"
    run_experiment(load_config(None, DIGITS + list(extra), algorithms), out, log=lambda s: None, stop_after=2)
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    """The folder's files and bytes, but for the lock file (it holds the pid of the last process that held it)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != LOCK}


# ---- checkpoints are data, never code -------------------------------------------------------------------------

class WritesAFile:
    """Unpickling this object calls open(marker, "w"): what a crafted checkpoint could do with any callable."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_malicious_checkpoint_is_refused_and_its_code_never_runs(tmp_path):
    out = interrupted_run(tmp_path)
    ckpt = out / "fedavg" / "checkpoint.pt"
    marker = tmp_path / "pwned"
    ck = torch.load(ckpt, weights_only=True)
    ck["totals"]["payload"] = WritesAFile(str(marker))
    torch.save(ck, ckpt)
    before = files_of(out)
    line = one_line(pfedkit("run", "--resume", str(out)))
    assert "checkpoint.pt" in line and "refused" in line
    assert not marker.exists()
    assert files_of(out) == before
    torch.load(ckpt, weights_only=False)  # the file really is malicious: a plain unpickling runs its code
    assert marker.exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "foreign list", "foreign dict", "text"])
def test_a_damaged_or_foreign_checkpoint_is_one_line_and_leaves_the_folder_intact(tmp_path, damage):
    out = interrupted_run(tmp_path)
    ckpt = out / "fedavg" / "checkpoint.pt"
    if damage == "empty":
        ckpt.write_bytes(b"")
    elif damage == "truncated":
        ckpt.write_bytes(ckpt.read_bytes()[:300])
    elif damage == "foreign list":
        torch.save([torch.zeros(3), 1, "x"], ckpt)
    elif damage == "foreign dict":
        torch.save({"model": torch.zeros(3)}, ckpt)
    else:
        ckpt.write_text("hello")
    before = files_of(out)
    line = one_line(pfedkit("run", "--resume", str(out)))
    assert str(ckpt) in line and "--overwrite" in line
    assert files_of(out) == before


@pytest.mark.parametrize("key, old, new", [("num_clients: 6", "partition.num_clients", "num_clients: 5"),
                                           ("name: mlr", "model.name", "name: dnn")])
def test_a_checkpoint_whose_config_changed_is_refused_naming_the_key(tmp_path, key, old, new):
    out = interrupted_run(tmp_path)
    for cfg_file in (out / "config.yaml", out / "fedavg" / "config.yaml"):
        text = cfg_file.read_text()
        assert key in text
        cfg_file.write_text(text.replace(key, new))
    line = one_line(pfedkit("run", "--resume", str(out / "fedavg")))
    assert old in line and "checkpoint.pt" in line


def test_a_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path):
    out = interrupted_run(tmp_path)
    ckpt = out / "fedavg" / "checkpoint.pt"
    ck = torch.load(ckpt, weights_only=True)
    ck["server"]["weights"] = torch.zeros(5)
    torch.save(ck, ckpt)
    line = one_line(pfedkit("run", "--resume", str(out)))
    assert "server.weights" in line and "(5,)" in line


def test_a_checkpoint_of_another_parameter_layout_is_refused_and_a_standard_one_still_resumes(tmp_path):
    """pfedkit 0.1 held a BN-free CNN's conv weights as (out, h, w, in) and recorded that layout ('conv-ohwi') in
    its checkpoints: such a vector would load without complaint into today's standard layout and train on scrambled
    filters, so it is refused in one line; a checkpoint in the standard layout, or from before the layout was
    recorded (standard then for every model that resumes now), resumes."""
    out = interrupted_run(tmp_path, "dataset.name=mnist5k", "model.name=cnn", "partition.samples_per_client=40",
                          "rounds=3", "checkpoint_every=1")
    ckpt = out / "fedavg" / "checkpoint.pt"
    ck = torch.load(ckpt, weights_only=True)
    assert ck["layout"] == "standard"
    torch.save({**ck, "layout": "conv-ohwi"}, ckpt)
    line = one_line(pfedkit("run", "--resume", str(out)))
    assert "parameter layout 'conv-ohwi'" in line and "'standard'" in line and "checkpoint.pt" in line
    del ck["layout"]
    torch.save(ck, ckpt)
    assert pfedkit("run", "--resume", str(out)).returncode == 0


def test_resuming_a_run_folder_without_a_checkpoint_does_not_nest_a_fresh_run(tmp_path):
    out = interrupted_run(tmp_path, "checkpoint_every=0")  # only the last round would have written one
    run_dir = out / "fedavg"
    assert not (run_dir / "checkpoint.pt").exists()
    before = files_of(out)
    line = one_line(pfedkit("run", "--resume", str(run_dir)))
    assert "no checkpoint.pt" in line and f"pfedkit run --resume {out}`" in line  # its experiment folder
    assert files_of(out) == before and not (run_dir / "fedavg").exists()


# ---- --out never loses or mixes results -----------------------------------------------------------------------

def test_out_onto_an_existing_run_is_refused_and_overwrite_replaces_it_whole(tmp_path):
    out = interrupted_run(tmp_path, algorithms="local,fedavg")
    before = files_of(out)
    line = one_line(pfedkit("run", "--algorithms", "fedavg", "--set", "dataset.name=digits", "--set",
                            "model.name=mlr", "--set", "rounds=2", *FAST, "--out", str(out)))
    assert "--resume" in line and "--overwrite" in line
    assert files_of(out) == before  # the interrupted run's checkpoint is still there
    done = pfedkit("run", "--algorithms", "fedavg", "--set", "dataset.name=digits", "--set", "model.name=mlr",
                   "--set", "rounds=2", *FAST, "--out", str(out), "--overwrite")
    assert done.returncode == 0, done.stderr
    assert not (out / "local").exists()  # no stale run of the other config beside the new one
    assert "algorithm: fedavg" in (out / "config.yaml").read_text()
    replot = pfedkit("plot", str(out))
    assert replot.returncode == 0 and "local" not in replot.stdout


def test_overwrite_with_a_bad_config_leaves_the_old_run_intact(tmp_path):
    out = interrupted_run(tmp_path)
    before = files_of(out)
    result = pfedkit("run", "--algorithms", "fedavg,heurpfedla@k=99", "--set", "dataset.name=digits", "--set",
                     "model.name=mlr", *FAST, "--out", str(out), "--overwrite")
    assert "heurpfedla.k" in one_line(result)
    assert files_of(out) == before


@pytest.mark.parametrize("where", ["file", "under a file", "other files"])
def test_out_that_is_a_file_or_a_foreign_folder_is_one_line(tmp_path, where):
    (tmp_path / "f").write_text("not a folder")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    out = {"file": tmp_path / "f", "under a file": tmp_path / "f" / "run", "other files": tmp_path / "mine"}[where]
    line = one_line(pfedkit("run", "--algorithms", "local", "--set", "dataset.name=digits", "--set",
                            "model.name=mlr", *FAST, "--out", str(out), "--overwrite"))
    assert str(out) in line
    assert (tmp_path / "f").read_text() == "not a folder" and (tmp_path / "mine" / "notes.txt").is_file()


# ---- every run of a comparison is checked before anything is written ------------------------------------------

@pytest.mark.parametrize("algorithms, sets, needle", [
    ("fedavg,heurpfedla@k=99", [], "heurpfedla.k"),
    ("fedavg,local", ["sampling=clustered_similarity", "clients_per_round=2"], "sampling"),
    ("fedavg,pfedme", ["local.momentum=0.9"], "local.momentum"),
    ("fedavg,perfedavg", ["local.weight_decay=0.01"], "local.weight_decay"),
    ("fedavg,pfedcs@local.lr=0.1", [], "local.lr"),
])
def test_a_bad_run_anywhere_in_a_comparison_stops_it_before_anything_is_written(tmp_path, algorithms, sets, needle):
    out = tmp_path / "out"
    args = [x for s in ["dataset.name=digits", "model.name=mlr", *sets] for x in ("--set", s)]
    line = one_line(pfedkit("run", "--algorithms", algorithms, *args, *FAST, "--out", str(out)))
    assert needle in line
    assert not out.exists()


def test_momentum_is_applied_where_the_solver_reads_it_and_refused_where_it_does_not():
    base = ["dataset.name=digits", "model.name=mlr", "local.momentum=0.9"]
    cfg = load_config(None, base, "fedavg,pfedme")
    data = prepare(cfg)
    Run(cfg.for_algorithm("fedavg"), data, Path("unused"))  # FedAvg's SGD uses it
    with pytest.raises(ConfigError, match="local.momentum"):
        Run(cfg.for_algorithm("pfedme"), data, Path("unused"))


# ---- the engine takes numbers, never None -----------------------------------------------------------------------

@pytest.mark.parametrize("update, needle", [
    ({"weights": torch.zeros(2), "num_samples": 3, "train_loss": None}, "train_loss"),
    ({"num_samples": None, "train_loss": 0.5}, "num_samples"),
    ({"num_samples": 3, "train_loss": "0.5"}, "train_loss"),
    ({"num_samples": -1, "train_loss": 0.5}, "num_samples"),
    ({"num_samples": 3, "train_loss": float("nan")}, "train_loss"),
])
def test_an_update_with_a_missing_or_non_numeric_metric_is_refused(update, needle):
    with pytest.raises(UpdateError, match=needle) as err:
        check_update(update, cid=4, rnd=7)
    assert "client 4" in str(err.value) and "round 7" in str(err.value)


SHAPES = {"weights": (3,)}


@pytest.mark.parametrize("update, needle", [
    ({"weights": torch.zeros(2), "num_samples": 3, "train_loss": 0.5}, r"'weights' of shape \(2,\), expected \(3,\)"),
    ({"not_weights": torch.zeros(3), "num_samples": 3, "train_loss": 0.5}, "unexpected tensor 'not_weights'"),
    ({"num_samples": 3, "train_loss": 0.5}, "sent no 'weights'"),
    ({"weights": torch.zeros(3, dtype=torch.long), "num_samples": 3, "train_loss": 0.5}, "expected floats"),
    ({"weights": torch.zeros(3), "num_samples": 3}, "sent no 'train_loss'"),
    ({"weights": torch.zeros(3), "num_samples": 3, "train_loss": 0.5, "extra": 1.0}, "unexpected number 'extra'"),
])
def test_a_reply_that_is_not_the_declared_update_is_refused(update, needle):
    """What a remote client may get wrong: the algorithm declares its update's tensors and shapes
    (`update_shapes`); anything else is refused with one line naming the client, the round and the key."""
    with pytest.raises(UpdateError, match=needle) as err:
        check_update(update, cid=2, rnd=5, shapes=SHAPES)
    assert "client 2" in str(err.value) and "round 5" in str(err.value) and "\n" not in str(err.value)
    check_update({"weights": torch.zeros(3), "num_samples": 3, "train_loss": 0.5}, cid=2, rnd=5, shapes=SHAPES)


# ---- Per-FedAvg's small clients train on what they have ----------------------------------------------------------

def perfedavg_by_hand(theta0, x, y, batches, alpha, beta):
    """The first-order Per-FedAvg steps (Fallah et al., NeurIPS 2020) on consecutive pairs of batches, plain autograd."""
    theta = theta0.clone()
    w_shape = (10, x.shape[1])

    def grad(params, idx):
        p = params.detach().requires_grad_(True)
        w, b = p[: 10 * x.shape[1]].view(w_shape), p[10 * x.shape[1]:]
        loss = F.cross_entropy(x[idx] @ w.T + b, y[idx])
        return torch.autograd.grad(loss, p)[0]

    for s in range(len(batches) // 2):
        b1, b2 = batches[2 * s], batches[2 * s + 1]
        g = grad(theta - alpha * grad(theta, b1), b2)
        theta = theta - beta * g
    return theta


@pytest.mark.parametrize("samples, num_train, batch, epochs, meta_steps", [
    (28, 27, 32, 1, 1),  # one batch, fewer than a meta-step needs: one step, its second batch from a new permutation
    (78, 71, 32, 1, 2),  # three batches: two steps, none left over
    (48, 44, 16, 2, 3),  # 2 epochs x 3 batches: three steps
])
def test_perfedavg_clients_with_few_batches_take_ceil_meta_steps_from_a_cycling_stream(samples, num_train, batch,
                                                                                        epochs, meta_steps):
    cfg = load_config(None, ["dataset.name=digits", "model.name=mlr", "partition.scheme=iid",
                             "partition.num_clients=1", f"partition.samples_per_client={samples}",
                             "partition.test_fraction=0.1", f"local.batch_size={batch}", f"local.epochs={epochs}",
                             "local.lr=0.05", "perfedavg.beta=0.3"], "perfedavg").for_algorithm("perfedavg")
    data = prepare(cfg)
    assert data.train_sizes[0] == num_train
    run = Run(cfg, data, Path("unused"))
    init = run.model.state()
    from pfedkit.train import Cohort
    (update,), _ = run.algo.client_update([{"weights": init}], [{}], Cohort([0], 1, data, run.model, cfg.local,
                                                                            [seeded_generator(cfg.seed, 1, 0)]))
    # ceil(epochs * ceil(n / b) / 2) meta-steps; their 2 batches each come from successive seeded permutations
    batches = list(batch_indices(num_train, LocalConfig(epochs=0, steps=2 * meta_steps, batch_size=batch),
                                 seeded_generator(cfg.seed, 1, 0), torch.device("cpu")))
    c = data.client(0)
    expected = perfedavg_by_hand(init, c.x_train.flatten(1), c.y_train, batches, 0.05, 0.3)
    assert torch.allclose(update["weights"], expected, atol=1e-6)
    assert isinstance(update["train_loss"], float) and np.isfinite(update["train_loss"])


def test_perfedavg_on_the_default_data_with_100_clients_runs(tmp_path):
    cfg = load_config(None, ["partition.num_clients=100", "model.name=mlr", "rounds=1", "progress=false",
                             "plots=false", "clients_per_round=10"], "perfedavg")
    summaries = run_experiment(cfg, tmp_path / "out", log=lambda s: None)
    assert np.isfinite(summaries[0]["train_loss"]) and summaries[0]["personalized_acc"] > 0.1


# ---- similarity sampling compares parameters, not BatchNorm statistics -------------------------------------------

def test_representative_gradients_of_a_batchnorm_model_hold_its_parameters_only(tmp_path):
    cfg = load_config(None, ["dataset.name=mnist5k", "model.name=cnn_bn", "partition.num_clients=4",
                             "partition.samples_per_client=60", "sampling=clustered_similarity",
                             "clients_per_round=2", "rounds=1", "progress=false", "plots=false"],
                      "fedavg").for_algorithm("fedavg")
    data = prepare(cfg)
    run = Run(cfg, data, tmp_path)
    run.run()
    P = run.model.param_size
    assert run.model.size > P  # the model has BatchNorm buffers
    grads = run.sampler_state["gradients"]
    assert grads.shape == (4, P)
    # the clients sampled in round 1 trained from the initial model: a trained client's row is its trained
    # parameters minus the sent ones; the others' rows are still zero
    init = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)).state()
    from pfedkit.train import Cohort
    trained = [c for c in range(4) if grads[c].abs().sum() > 0]
    assert 1 <= len(trained) <= 2
    for c in trained:
        (update,), _ = run.algo.client_update([{"weights": init}], [{}], Cohort(
            [c], 1, data, run.model, cfg.local, [seeded_generator(cfg.seed, 1, c)]))
        assert torch.allclose(grads[c], update["weights"][:P] - init[:P], atol=1e-6)


def test_centered_representative_gradients_subtract_the_importance_weighted_mean():
    from pfedkit.config import ClusteringConfig
    from pfedkit.sampling import Sampler, similarity_distributions
    sizes = np.array([10, 30, 20, 40])
    G = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]], dtype=torch.float64)
    for representative in ("update", "centered"):
        s = Sampler("clustered_similarity", sizes, 2, 0, ClusteringConfig(representative=representative))
        state = s.observe(s.init_state(2, torch.zeros(2, dtype=torch.float64)), dict(enumerate(G)))
        p = sizes / sizes.sum()
        mean = sum(p[i] * G[i].numpy() for i in range(4))  # grad F(w) = sum_i p_i grad F_i(w)
        want = G.numpy() - (mean if representative == "centered" else 0)
        expected = similarity_distributions(want, p, 2, rng=np.random.default_rng([0, 3, 0xC5]))
        np.testing.assert_allclose(s.distributions(state, 3), expected)


# ---- partitions that cannot give what was asked ------------------------------------------------------------------

def test_a_thousand_clients_on_mnist5k_is_refused_naming_the_numbers(tmp_path):
    out = tmp_path / "out"
    line = one_line(pfedkit("run", "--set", "partition.num_clients=1000", *FAST, "--out", str(out)))
    assert "1000 clients" in line and "4 samples" in line and "partition.num_clients" in line
    assert not out.exists()


def test_a_client_is_never_tested_on_a_class_it_does_not_train_on():
    # 3 samples per client, one of each class: no class can spare a test sample and still be trained on
    y = np.repeat(np.arange(3), 4)
    with pytest.raises(DataError, match="client 0"):
        make_partition(y, 3, PartitionConfig(scheme="classes", num_clients=4, classes_per_client=3), seed=0)
    # with 2 of each class the stratified split holds one of each out and trains on the other
    y = np.repeat(np.arange(3), 8)
    part = make_partition(y, 3, PartitionConfig(scheme="classes", num_clients=4, classes_per_client=3), seed=0)
    for tr, te in zip(part.train, part.test):
        assert set(y[te]) <= set(y[tr]) == {0, 1, 2}
    assert part.warnings == []


def test_a_partition_with_classes_too_small_to_test_says_so_in_one_line():
    y = np.r_[np.zeros(200, dtype=int), np.ones(3, dtype=int)]  # class 1: too rare to test for every client
    part = make_partition(y, 2, PartitionConfig(scheme="iid", num_clients=3, test_fraction=0.1), seed=0)
    assert len(part.warnings) == 1 and "\n" not in part.warnings[0] and "no test sample" in part.warnings[0]


# ---- a full disk during a checkpoint keeps the previous one -------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path):
    out = interrupted_run(tmp_path, "checkpoint_every=1")
    ckpt = out / "fedavg" / "checkpoint.pt"
    saved = ckpt.read_bytes()
    # the next checkpoint is written to checkpoint.pt.tmp first: make that file the kernel's always-full device
    (out / "fedavg" / "checkpoint.pt.tmp").symlink_to("/dev/full")
    line = one_line(pfedkit("run", "--resume", str(out)))
    assert "checkpoint.pt" in line and "intact" in line
    assert ckpt.read_bytes() == saved
    assert not (out / "fedavg" / "checkpoint.pt.tmp").exists()
    resumed = pfedkit("run", "--resume", str(out))  # the space is back: it continues from the kept checkpoint
    assert resumed.returncode == 0, resumed.stderr


# ---- Ctrl-C names what there is to resume ----------------------------------------------------------------------

def test_ctrl_c_before_anything_is_written_says_there_is_nothing_to_resume(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pfedkit", "run", "--set", "dataset.name=fmnist", *FAST,
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # interrupt it while it reads the 70,000 images (one of the dataset's files is open), past all its imports
    fds, deadline = Path(f"/proc/{proc.pid}/fd"), time.time() + 600

    def reading() -> bool:
        try:
            return any("fashion-mnist" in os.readlink(f) for f in fds.iterdir())
        except OSError:  # a descriptor closed while we looked
            return False
    while time.time() < deadline and proc.poll() is None and not reading():
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    if out.exists():
        pytest.skip("the run got past its checks before the signal")
    assert proc.returncode == 130, err
    assert err.strip() == "pfedkit: interrupted before anything was written; nothing to resume"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])  # Ctrl-C; `kill`
def test_ctrl_c_after_a_checkpoint_names_the_real_folder(tmp_path, sig, code):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pfedkit", "run", "--algorithms", "fedavg", "--set",
                             "dataset.name=digits", "--set", "model.name=mlr", "--set", "rounds=100000", "--set",
                             "checkpoint_every=5", *FAST, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})  # a crash prints every thread's stack
    deadline = time.time() + 600
    while not (out / "fedavg" / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err  # a SIGABRT (-6) here came from an early-returning join: test_threads.py
    assert err.strip() == f"pfedkit: interrupted; continue with `pfedkit run --resume {out}`"


# ---- a checkpoint streams to disk -------------------------------------------------------------------------------

STREAMED_CHECKPOINT = r"""
import resource, sys
import torch
from pfedkit.config import load_config
from pfedkit.engine import Run
from pfedkit.experiment import prepare
cfg = load_config(None, sys.argv[2].split(), "fedavg")
run = Run(cfg.for_algorithm("fedavg"), prepare(cfg), sys.argv[1])
run.run(stop_after=1)
run.server.state["ballast"] = torch.ones(50 << 20)  # 200 MB that torch.save must write
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far (the ballast is in it)
run.save_checkpoint()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


def test_a_checkpoint_streams_to_disk_instead_of_doubling_the_memory(tmp_path):
    """pFedLA's server state at N = 1,000 is 9 GB: a checkpoint first serialized in memory took as much again. The
    peak memory of the process must not rise by the checkpoint's size while it is written."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", STREAMED_CHECKPOINT, str(out), " ".join(DIGITS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rise_mb = int(done.stdout.split()[-1])
    assert (out / "checkpoint.pt").stat().st_size > 200e6
    assert rise_mb < 100, f"the peak memory rose by {rise_mb} MB while a 200 MB checkpoint was written"
    assert torch.load(out / "checkpoint.pt", weights_only=True)["server"]["ballast"].shape == (50 << 20,)
