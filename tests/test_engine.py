"""The round loop: FedAvg against plain SGD, bytes on the wire, determinism, checkpoint/resume, update checks."""
from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pfedkit.config import load_config
from pfedkit.engine import TIMING_KEYS, Run
from pfedkit.errors import FAILED_FILE, PfedkitError, UpdateError
from pfedkit.experiment import prepare, run_experiment
from pfedkit.runtime.cnn import cnn_forward
from pfedkit.models import build_model
from pfedkit.train import seeded_generator
from flat_layout import flat_state, load_params  # noqa: E402


def small_cfg(*extra: str, algorithms: str = "local,fedavg"):
    base = ["dataset.name=digits", "model.name=dnn", "model.hidden=32", "partition.num_clients=6",
            "partition.classes_per_client=3", "rounds=6", "local.epochs=1", "local.batch_size=16",
            "local.lr=0.1", "progress=false", "plots=false", "checkpoint_every=2"]
    return load_config(None, base + list(extra), algorithms)


def metric_rows(path, drop_timing=True):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (drop_timing and k in TIMING_KEYS)} for r in rows]


def test_fedavg_with_one_client_equals_plain_sgd(tmp_path):
    cfg = small_cfg("partition.scheme=iid", "partition.num_clients=1", "rounds=3", "local.epochs=2",
                    "model.name=cnn_bn", "dataset.name=mnist5k", "partition.samples_per_client=300",
                    algorithms="fedavg")
    data = prepare(cfg)
    run = Run(cfg.for_algorithm("fedavg"), data, tmp_path)
    run.run()

    # Plain PyTorch: the same initial model, torch.optim.SGD, the same seeded batch order, no federation; the
    # forward as the runtime computes it (runtime/cnn.py, held to PyTorch's ops in float64 by tests/test_native.py):
    # a BatchNorm CNN on 300 samples amplifies float32 rounding differences (the kernels' double sums against
    # PyTorch's float ones, even one thread against two) to 1e-2 within a few hundred steps.
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    forward = partial(cnn_forward, net)
    opt = torch.optim.SGD(net.parameters(), lr=cfg.local.lr)
    client = data.client(0)
    for rnd in range(1, cfg.rounds + 1):
        gen = seeded_generator(cfg.seed, rnd, 0)
        for _ in range(cfg.local.epochs):
            perm = torch.randperm(client.num_train, generator=gen)
            for start in range(0, client.num_train, cfg.local.batch_size):
                idx = perm[start: start + cfg.local.batch_size]
                opt.zero_grad()
                F.cross_entropy(forward(client.x_train[idx]), client.y_train[idx]).backward()
                opt.step()
    # the server state holds parameters then BN running statistics, in module order
    expected = flat_state(net)
    assert torch.allclose(run.state["weights"], expected, atol=1e-6)
    net.eval()
    with torch.no_grad():
        acc = (forward(client.x_test).argmax(1) == client.y_test).float().mean().item()
    assert metric_rows(tmp_path)[-1]["global_acc"] == pytest.approx(acc)


def test_bytes_are_the_tensor_sizes_sent(tmp_path):
    cfg = small_cfg("clients_per_round=4", "rounds=3")
    data = prepare(cfg)
    run_experiment(cfg, tmp_path, data=data, log=lambda s: None)
    num_params = sum(p.numel() for p in build_model(cfg.model, data.input_shape, 10, 0).parameters())
    for row in metric_rows(tmp_path / "fedavg"):
        assert row["bytes_down"] == row["bytes_up"] == 4 * num_params * 4  # 4 clients x float32 vector
    rows = metric_rows(tmp_path / "fedavg")
    assert rows[-1]["bytes_up_total"] == sum(r["bytes_up"] for r in rows)
    assert all(r["bytes_up"] == r["bytes_down"] == 0 for r in metric_rows(tmp_path / "local"))
    summary = json.loads((tmp_path / "fedavg" / "summary.json").read_text())
    assert summary["mb_down_total"] == pytest.approx(3 * 4 * num_params * 4 / 1e6)


def test_same_config_and_seed_give_identical_metrics(tmp_path):
    cfg = small_cfg("clients_per_round=3")
    run_experiment(cfg, tmp_path / "a", log=lambda s: None)
    run_experiment(cfg, tmp_path / "b", log=lambda s: None)
    for name in ("local", "fedavg"):
        assert metric_rows(tmp_path / "a" / name) == metric_rows(tmp_path / "b" / name)
    other = small_cfg("clients_per_round=3", "seed=1")
    run_experiment(other, tmp_path / "c", log=lambda s: None)
    assert metric_rows(tmp_path / "a" / "fedavg") != metric_rows(tmp_path / "c" / "fedavg")


def test_every_algorithm_sees_the_same_clients_each_round(tmp_path):
    """The uniform stream depends only on (seed, round, client count) (DESIGN.md, principle 4): round r trains the
    sorted draw of `per_round` distinct clients of numpy's Generator([seed, r, n, 0x5A3]), for every algorithm."""
    seed, n, m, rounds = 3, 6, 3, 4
    cfg = small_cfg(f"seed={seed}", f"clients_per_round={m}", f"rounds={rounds}", "checkpoint_every=0",
                    algorithms="fedavg,pfedla")
    data = prepare(cfg)
    expected = {r: sorted(int(c) for c in np.random.default_rng([seed, r, n, 0x5A3]).choice(n, m, replace=False))
                for r in range(1, rounds + 1)}
    assert len({tuple(v) for v in expected.values()}) > 1  # the draw changes over rounds
    for name in ("fedavg", "pfedla"):
        run = Run(cfg.for_algorithm(name), data, tmp_path / name)
        trained: dict[int, list[int]] = {}
        original = run.algo.client_update

        def record(payloads, cstates, cohort, original=original, trained=trained):
            trained.setdefault(cohort.round, []).extend(cohort.cids)
            return original(payloads, cstates, cohort)

        run.algo.client_update = record
        run.run()
        assert trained == expected, name
        assert all(r["clients"] == m and r["aggregated"] == m for r in run.metrics)


def test_resumed_run_equals_uninterrupted(tmp_path):
    cfg = small_cfg("clients_per_round=3", "rounds=7", "checkpoint_every=3")
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    # interrupted after round 4: the last checkpoint is from round 3, metrics.jsonl already holds round 4
    run_experiment(cfg, tmp_path / "cut", log=lambda s: None, stop_after=4)
    assert len(metric_rows(tmp_path / "cut" / "local")) == 4
    from pfedkit.experiment import resume_experiment
    resume_experiment(tmp_path / "cut", log=lambda s: None)
    for name in ("local", "fedavg"):
        assert metric_rows(tmp_path / "cut" / name) == metric_rows(tmp_path / "full" / name)
        a = torch.load(tmp_path / "cut" / name / "checkpoint.pt", weights_only=False)
        b = torch.load(tmp_path / "full" / name / "checkpoint.pt", weights_only=False)
        assert all(torch.equal(x["weights"], y["weights"]) for x, y in zip(a["clients"], b["clients"])
                   if "weights" in x)
    assert (tmp_path / "cut" / "comparison.md").is_file()


def test_non_finite_update_is_rejected_with_client_and_round(tmp_path):
    cfg = small_cfg("local.lr=1e30", algorithms="fedavg")
    with pytest.raises(UpdateError, match=r"round 1: client \d+ .*non-finite.*local.lr"):
        Run(cfg.for_algorithm("fedavg"), prepare(cfg), tmp_path).run()
    assert "non-finite" in (tmp_path / FAILED_FILE).read_text() and not (tmp_path / "summary.json").exists()
    # a fresh run into the same folder clears the record
    ok = small_cfg(algorithms="fedavg")
    Run(ok.for_algorithm("fedavg"), prepare(ok), tmp_path).run()
    assert not (tmp_path / FAILED_FILE).exists() and (tmp_path / "summary.json").is_file()


def test_local_never_communicates_and_keeps_its_own_model(tmp_path):
    cfg = small_cfg(algorithms="local")
    run = Run(cfg.for_algorithm("local"), prepare(cfg), tmp_path)
    run.run()
    vectors = [c["weights"] for c in run.cstates]
    assert not torch.equal(vectors[0], vectors[1])  # each client trained its own model
    assert run.state == {}


def test_metrics_rows_hold_the_contract_keys(tmp_path):
    cfg = small_cfg("eval_every=4", "rounds=6", algorithms="fedavg")
    Run(cfg.for_algorithm("fedavg"), prepare(cfg), tmp_path).run()
    rows = metric_rows(tmp_path, drop_timing=False)
    assert [r["round"] for r in rows] == [4, 6]  # every eval_every rounds and at the end
    keys = {"round", "personalized_acc", "personalized_acc_weighted", "personalized_acc_std",
            "personalized_acc_p10", "global_acc", "train_loss", "bytes_up", "bytes_down", "bytes_up_total",
            "bytes_down_total", "wall_s", "server_s"}
    assert keys <= set(rows[0])
    for r in rows:
        assert 0 <= r["personalized_acc"] <= 1 and 0 <= r["global_acc"] <= 1
        assert r["personalized_train_loss"] is None and r["global_train_loss"] is None  # eval_train is off
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_last5"] == pytest.approx(np.mean([r["personalized_acc"] for r in rows]))
    assert summary["personalized_acc"] == rows[-1]["personalized_acc"]
    per_client = np.array(summary["personalized_acc_per_client"])
    assert per_client.mean() == pytest.approx(rows[-1]["personalized_acc"])


def plain_scores(cfg, data, vector, cid):
    """(correct test predictions, summed train cross-entropy) of one flat parameter vector on client `cid`: a plain
    forward pass of a fresh copy of the model."""
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    load_params(vector, net)
    net.eval()
    c = data.client(cid)
    with torch.no_grad():
        correct = int((net(c.x_test).argmax(1) == c.y_test).sum())
        loss = float(F.cross_entropy(net(c.x_train), c.y_train, reduction="sum"))
    return correct, loss


def percentile_10(values) -> float:
    """The 10th percentile by linear interpolation between order statistics (position 0.1 (N - 1))."""
    v = sorted(values)
    pos = 0.1 * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


@pytest.mark.parametrize("name, chunk", [("fedavg", 256), ("pfedme", 256), ("pfedme", 4)])
def test_metrics_are_the_defined_statistics_of_the_clients_accuracies(tmp_path, monkeypatch, name, chunk):
    """DESIGN.md principle 3: personalized accuracy on every client's own test split, reported as the mean over
    clients, the test-size weighted mean, the population std and the 10th percentile; the global model's as the
    mean over clients and pooled (correct / test samples); train losses pooled over train samples. All recomputed
    here from the final models (plain forward passes) and partition.json's test counts. chunk = 4: the clients'
    models are built 4 at a time (6 clients: two chunks)."""
    monkeypatch.setattr("pfedkit.engine.EVAL_CHUNK", chunk)
    cfg = small_cfg("rounds=1", "eval_train=true", "checkpoint_every=0", "pfedme.local_rounds=2",
                    "pfedme.inner_steps=2", algorithms=name)
    data = prepare(cfg)
    run = Run(cfg.for_algorithm(name), data, tmp_path)
    run.run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    test_sizes = [sum(c) for c in json.loads((tmp_path / "partition.json").read_text())["test_counts"]]
    train_sizes = [data.client(c).num_train for c in range(data.num_clients)]
    assert len(set(test_sizes)) > 1 and len({a / b for a, b in zip(train_sizes, test_sizes)}) > 1

    personal = [s["personal"] for s in run.cstates] if name == "pfedme" else [run.state["weights"]] * 6
    scores = [plain_scores(cfg, data, personal[c], c) for c in range(6)]
    g_scores = [plain_scores(cfg, data, run.state["weights"], c) for c in range(6)]
    acc = [k / t for (k, _), t in zip(scores, test_sizes)]
    g_acc = [k / t for (k, _), t in zip(g_scores, test_sizes)]
    assert len(set(acc)) > 2 and len(set(g_acc)) > 2  # the statistics below tell the formulas apart
    assert summary["personalized_acc_per_client"] == pytest.approx(acc, abs=1e-12)

    mean = sum(acc) / 6
    expected = {
        "personalized_acc": mean,
        "personalized_acc_weighted": sum(k for k, _ in scores) / sum(test_sizes),
        "personalized_acc_std": (sum((a - mean) ** 2 for a in acc) / 6) ** 0.5,
        "personalized_acc_p10": percentile_10(acc),
        "global_acc": sum(g_acc) / 6,
        "global_acc_weighted": sum(k for k, _ in g_scores) / sum(test_sizes),
        "personalized_train_loss": sum(l for _, l in scores) / sum(train_sizes),
        "global_train_loss": sum(l for _, l in g_scores) / sum(train_sizes),
    }
    row = metric_rows(tmp_path)[-1]
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
        assert summary[key] == row[key], key


def test_a_comparison_holds_one_finished_runs_training_state_at_a_time(tmp_path, monkeypatch):
    """run_experiment builds every algorithm's Run up front (to check all keys before writing): once a run has
    written its summary its server state (pFedLA's: 6.8 GB at N = 1,000) and client states are let go, so the
    next run does not start beside it. The runs are watched through the real build_runs (a spy, nothing faked)."""
    import pfedkit.experiment as experiment
    built = []
    real_build = experiment.build_runs

    def spy(*args, **kwargs):
        runs = real_build(*args, **kwargs)
        built.extend(runs)
        return runs
    monkeypatch.setattr(experiment, "build_runs", spy)
    run_experiment(small_cfg("rounds=2", algorithms="fedavg,pfedla"), tmp_path, log=lambda s: None)
    assert len(built) == 2
    for run in built:
        assert run.totals["round"] == 2  # it trained (so it held a state) ...
        assert run.server.state is None and run.server.sampler_state is None and run.clients.cstates == []  # ... and let go
    assert (tmp_path / "fedavg" / "summary.json").is_file() and (tmp_path / "pfedla" / "summary.json").is_file()
    assert metric_rows(tmp_path / "pfedla")[-1]["personalized_acc"] > 0


def test_a_resumed_run_may_change_its_runtime_section_and_reads_the_keys_of_earlier_versions(tmp_path):
    """How the clients run is not what they compute: a CNN run cut after round 3 (its clients side by side in
    forked processes) and resumed one client after another on one thread, from a config.yaml in the earlier layout
    (`threads`, `local.workers`), gives the uninterrupted run's metrics; a change outside `runtime:` is refused."""
    from pfedkit.experiment import resume_experiment
    cfg = load_config(None, ["dataset.name=mnist5k", "model.name=cnn", "partition.num_clients=4",
                             "partition.samples_per_client=40", "rounds=5", "checkpoint_every=2", "local.batch_size=16",
                             "progress=false", "plots=false", "runtime.workers=2", "runtime.workers_in=processes"],
                      "fedavg")
    run_experiment(cfg, tmp_path / "full", log=lambda s: None)
    run_experiment(cfg, tmp_path / "cut", log=lambda s: None, stop_after=3)
    saved = tmp_path / "cut" / "config.yaml"
    text = saved.read_text()
    runtime = "runtime:\n  threads: 0\n  workers: 2\n  workers_in: processes\n  cuda_graphs: true\n  batch_runs: true\n"
    runtime += "  job_memory_gb: 0.0\n"
    assert runtime in text
    earlier = text.replace(runtime, "threads: 1\n").replace("local:\n", "local:\n  workers: 1\n  workers_in: threads\n")
    saved.write_text(earlier.replace("lr: 0.05", "lr: 0.06"))
    with pytest.raises(PfedkitError, match="local.lr"):
        resume_experiment(tmp_path / "cut", log=lambda s: None)
    saved.write_text(earlier)
    resumed = load_config(saved)
    assert (resumed.runtime.threads, resumed.runtime.workers, resumed.runtime.workers_in) == (1, 1, "threads")
    resume_experiment(tmp_path / "cut", log=lambda s: None)
    assert metric_rows(tmp_path / "cut" / "fedavg") == metric_rows(tmp_path / "full" / "fedavg")


def _summary(run_dir):
    return {k: v for k, v in json.loads((run_dir / "summary.json").read_text()).items()
            if k not in TIMING_KEYS and k not in ("wall_s_total", "server_s_total")}


def _raise_rounds(folder, old: int, new: int):
    path = folder / "config.yaml"
    path.write_text(path.read_text().replace(f"\nrounds: {old}\n", f"\nrounds: {new}\n"))


def test_a_finished_run_given_more_rounds_goes_on_as_the_longer_run(tmp_path):
    """`pfedkit run --resume DIR` after raising `rounds` in DIR/config.yaml: every run of every seed goes on from
    the checkpoint it finished with, and its metrics, summary and pFedLA's packed aggregation weights are those of a
    run started with the larger count. Per-FedAvg's evaluation fine-tunes (one epoch) and pFedLA's server keeps Adam
    moments: neither may drift across the old end."""
    from pfedkit.experiment import resume_experiment
    algos = "fedavg,pfedla,perfedavg"
    args = ("seeds=0,1", "clients_per_round=4", "eval_every=2", "checkpoint_every=0", "perfedavg.adapt_epochs=1")
    run_experiment(small_cfg(*args, "rounds=10", algorithms=algos), tmp_path / "long", log=lambda s: None)
    run_experiment(small_cfg(*args, "rounds=6", algorithms=algos), tmp_path / "short", log=lambda s: None)
    _raise_rounds(tmp_path / "short", 6, 10)
    # cut again at round 8: a run going on is unfinished (no summary.json) until it reaches its new end
    run_experiment(load_config(tmp_path / "short" / "config.yaml"), tmp_path / "short", resume=True, stop_after=8,
                   log=lambda s: None)
    cut = tmp_path / "short" / "seed0" / "fedavg"
    assert [r["round"] for r in metric_rows(cut)] == [2, 4, 6, 8] and not (cut / "summary.json").exists()
    resume_experiment(tmp_path / "short", log=lambda s: None)
    for seed in ("seed0", "seed1"):
        assert load_config(tmp_path / "short" / seed / "config.yaml").rounds == 10
        for name in algos.split(","):
            a, b = tmp_path / "short" / seed / name, tmp_path / "long" / seed / name
            assert [r["round"] for r in metric_rows(a)] == [2, 4, 6, 8, 10]
            assert metric_rows(a) == metric_rows(b)
            assert _summary(a) == _summary(b)
            assert load_config(a / "config.yaml").rounds == 10
        with np.load(tmp_path / "short" / seed / "pfedla" / "alpha.npz") as got, \
                np.load(tmp_path / "long" / seed / "pfedla" / "alpha.npz") as want:
            assert sorted(got.files) == sorted(want.files) == ["r00002", "r00004", "r00006", "r00008", "r00010"]
            assert all(np.array_equal(got[k], want[k]) for k in want.files)
    assert "10 rounds" in (tmp_path / "short" / "seed1" / "comparison.md").read_text()
    # resumed again at 10: nothing left to do, nothing rewritten
    before = (tmp_path / "short" / "seed0" / "fedavg" / "metrics.jsonl").stat().st_mtime_ns
    resume_experiment(tmp_path / "short", log=lambda s: None)
    assert (tmp_path / "short" / "seed0" / "fedavg" / "metrics.jsonl").stat().st_mtime_ns == before


def test_a_run_that_ended_off_its_evaluation_schedule_keeps_that_evaluation_and_nothing_else_moves(tmp_path):
    """Rounds 5 of eval_every 2: the run evaluated its last round, 5, as every run does; run on to 10 it keeps that
    row, and every other row is the 10-round run's (evaluating draws nothing from the training's generators)."""
    from pfedkit.experiment import resume_experiment
    args = ("clients_per_round=4", "eval_every=2", "checkpoint_every=0", "perfedavg.adapt_epochs=1")
    run_experiment(small_cfg(*args, "rounds=10", algorithms="perfedavg"), tmp_path / "long", log=lambda s: None)
    run_experiment(small_cfg(*args, "rounds=5", algorithms="perfedavg"), tmp_path / "short", log=lambda s: None)
    _raise_rounds(tmp_path / "short" / "perfedavg", 5, 10)  # one run's folder this time, with its own config.yaml
    resume_experiment(tmp_path / "short" / "perfedavg", log=lambda s: None)
    rows = metric_rows(tmp_path / "short" / "perfedavg")
    assert [r["round"] for r in rows] == [2, 4, 5, 6, 8, 10]
    assert [r for r in rows if r["round"] != 5] == metric_rows(tmp_path / "long" / "perfedavg")


def test_a_finished_run_is_not_cut_short_nor_run_on_without_its_checkpoint_nor_retried_after_a_failure(tmp_path):
    from pfedkit.experiment import resume_experiment
    run_experiment(small_cfg("checkpoint_every=0", algorithms="fedavg"), tmp_path / "a", log=lambda s: None)
    _raise_rounds(tmp_path / "a", 6, 4)
    with pytest.raises(PfedkitError, match=r"fedavg: it finished 6 rounds and its config asks for 4; a finished run "
                                           r"is not cut short"):
        resume_experiment(tmp_path / "a", log=lambda s: None)
    with pytest.raises(PfedkitError, match=r"has finished its 6 rounds \(summary.json\); to run it on, raise "):
        resume_experiment(tmp_path / "a" / "fedavg", log=lambda s: None)
    _raise_rounds(tmp_path / "a", 4, 8)
    (tmp_path / "a" / "fedavg" / "checkpoint.pt").unlink()
    with pytest.raises(PfedkitError, match=r"cannot run .*fedavg on to 8 rounds: the checkpoint.pt it finished 6 "
                                           r"rounds with is gone"):
        resume_experiment(tmp_path / "a", log=lambda s: None)
    assert len(metric_rows(tmp_path / "a" / "fedavg")) == 6  # left as it was
    (tmp_path / "a" / "fedavg" / "summary.json").write_text("{}")
    with pytest.raises(PfedkitError, match=r"fedavg: its summary.json is damaged \(no round count\)"):
        resume_experiment(tmp_path / "a", log=lambda s: None)
    # a failed run stays failed however many rounds its config asks for
    run_experiment(small_cfg(algorithms="local"), tmp_path / "b", log=lambda s: None)
    (tmp_path / "b" / "local" / FAILED_FILE).write_text("client 3 sent non-finite weights in round 6")
    (tmp_path / "b" / "local" / "summary.json").unlink()
    _raise_rounds(tmp_path / "b", 6, 8)
    with pytest.raises(UpdateError, match=r"1 run\(s\) failed, e.g. local: client 3 sent non-finite"):
        resume_experiment(tmp_path / "b", log=lambda s: None)
    assert len(metric_rows(tmp_path / "b" / "local")) == 6
    with pytest.raises(PfedkitError, match="the run failed"):
        resume_experiment(tmp_path / "b" / "local", log=lambda s: None)
