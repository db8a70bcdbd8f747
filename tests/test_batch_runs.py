"""Runs side by side as one job (runtime/batch_runs.py, `runtime.batch_runs`): every algorithm's run in a job gives
the bits it gives alone (one after another, `runtime.batch_runs=false`), a job killed midway resumes to the runs'
uninterrupted metrics, a run's numbers do not depend on the process's thread count, and observers that cannot be
called side by side keep the runs one after another."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from pfedkit.config import load_config
from pfedkit.engine import TIMING_KEYS, Observer
from pfedkit.experiment import run_experiment
from pfedkit.registry import ALGORITHMS
from pfedkit.runtime.threads import WorkerPool

ALL = sorted(ALGORITHMS)
CNN = ["dataset.name=mnist5k", "model.name=cnn_bn", "partition.num_clients=5", "partition.samples_per_client=60",
       "partition.classes_per_client=3", "local.batch_size=16", "local.lr=0.05", "clients_per_round=3",
       "pfedme.local_rounds=2", "pfedhn.inner_steps=2"]
DENSE = ["dataset.name=synthetic", "model.name=mlr", "partition.scheme=natural", "partition.num_clients=8",
         "clustering.clusters=3", "local.batch_size=16", "local.lr=0.05", "clients_per_round=3",
         "pfedme.local_rounds=2", "pfedhn.inner_steps=2"]
COMMON = ["pfedme.personal_lr=0.01", "pfedcs.personal_lr=0.01", "rounds=3", "local.epochs=1", "progress=false",
          "plots=false", "checkpoint_every=1", "seeds=0,1", "runtime.threads=2"]  # 2: a job, whatever ran before


def run_rows(folder):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


def run_summary(folder):
    return {k: v for k, v in json.loads((folder / "summary.json").read_text()).items()
            if k not in TIMING_KEYS and not k.endswith("_s_total")}


def checkpoint_tensors(folder):
    ck = torch.load(folder / "checkpoint.pt", weights_only=True)
    flat = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            flat.append(x)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk([ck["server"], ck["clients"], ck["sampler"]])
    return flat


@pytest.mark.parametrize("setting", ["cnn", "dense"])
def test_every_algorithm_gives_its_bits_alone_in_a_job(tmp_path, setting):
    """All algorithms x 2 seeds as one job and one after another: each run's metrics, summary and final server,
    client and sampler state are identical (torch.equal), and the job said it ran them side by side."""
    sets = (CNN + COMMON + ["rounds=2"]) if setting == "cnn" else DENSE + COMMON
    ways = {"job": [], "alone": ["runtime.batch_runs=false"]}
    if setting == "dense":  # a memory budget below one seed's need: each seed's runs one job, one after the other
        ways["steps"] = ["runtime.job_memory_gb=1e-9"]
    said: dict[str, list[str]] = {how: [] for how in ways}
    for how, extra in ways.items():
        cfg = load_config(None, sets + extra, ",".join(ALL))
        run_experiment(cfg, tmp_path / how, log=said[how].append)
    assert any(line.startswith(f"runs: {2 * len(ALL)} side by side") for line in said["job"])
    assert not any(line.startswith("runs:") for line in said["alone"])
    if "steps" in said:
        assert sum(line.startswith(f"runs: {2 * len(ALL)} in 2 steps to fit memory") for line in said["steps"]) == 1
        assert sum(line.startswith(f"runs: {len(ALL)} side by side") for line in said["steps"]) == 2
    for seed in (0, 1):
        for name in ALL:
            alone = tmp_path / "alone" / f"seed{seed}" / name
            for job in [tmp_path / how / f"seed{seed}" / name for how in ways if how != "alone"]:
                assert run_rows(job) == run_rows(alone), (seed, name)
                assert run_summary(job) == run_summary(alone), (seed, name)
                a, b = checkpoint_tensors(job), checkpoint_tensors(alone)
                assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b)), (seed, name)
    for how in ("job", "alone"):  # the per-seed and the over-seeds comparisons are written either way
        assert (tmp_path / how / "comparison.md").is_file() and (tmp_path / how / "seed1" / "comparison.md").is_file()


def test_a_runs_numbers_do_not_depend_on_the_process_thread_count(tmp_path):
    """The server's own work (pFedLA's and pFedHN's hypernetworks, their sums over the clients) runs on one thread:
    the same bits with runtime.threads 1 and 2 (on the process's two threads all three differed, checked)."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            cfg = load_config(None, CNN + COMMON + [  # ten clients a round: sums over them long enough to split
                "model.name=cnn", "partition.num_clients=10", "clients_per_round=0", "seeds=0",
                f"runtime.threads={n}", "runtime.workers=2", "runtime.batch_runs=false"], "pfedla,heurpfedla,pfedhn")
            run_experiment(cfg, tmp_path / f"t{n}", log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    for name in ("pfedla", "heurpfedla", "pfedhn"):
        one, two = tmp_path / "t1" / "seed0" / name, tmp_path / "t2" / "seed0" / name
        assert run_rows(one) == run_rows(two), name
        assert all(torch.equal(a, b) for a, b in zip(checkpoint_tensors(one), checkpoint_tensors(two))), name


class Recorder(Observer):
    """An observer that keeps one run's state at a time (side_by_side stays False)."""

    def __init__(self):
        self.calls, self.current = [], None

    def start(self, run, resumed):
        assert self.current is None, "two runs at once"
        self.current = run
        self.calls.append(("start", run.cfg.algorithm))

    def close(self, run):
        assert self.current is run
        self.current = None
        self.calls.append(("close", run.cfg.algorithm))


def test_an_observer_that_cannot_be_shared_keeps_the_runs_one_after_another(tmp_path):
    said = []
    rec = Recorder()
    cfg = load_config(None, DENSE + COMMON + ["seeds=0"], "local,fedavg,pfedme")
    run_experiment(cfg, tmp_path / "out", log=said.append, observers=[rec])
    assert not any(line.startswith("runs:") for line in said)
    assert rec.calls == [(what, name) for name in ("local", "fedavg", "pfedme") for what in ("start", "close")]


KILL_NAMES, KILL_SEEDS = ("fedavg", "pfedla", "pfedme"), (0, 1)
KILL_ARGS = ["--algorithms", ",".join(KILL_NAMES), "--seeds", "0,1", "--set", "dataset.name=digits", "--set",
             "model.name=mlr", "--set", "rounds=100", "--set", "checkpoint_every=10", "--set", "clients_per_round=4",
             "--set", "progress=false", "--set", "plots=false", "--set", "pfedme.local_rounds=2"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def runs_alone(tmp_path_factory):
    out = tmp_path_factory.mktemp("alone") / "alone"
    done = subprocess.run([sys.executable, "-m", "pfedkit", "run", *KILL_ARGS, "--set", "runtime.batch_runs=false",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_a_job_stopped_midway_resumes_to_the_uninterrupted_runs(tmp_path, runs_alone, how):
    """`pfedkit run` of 3 algorithms x 2 seeds as one job, killed (SIGKILL) or interrupted (Ctrl-C: exit 130, the
    runs' checkpoints kept) once checkpoints are on disk and before the end, resumed with `pfedkit run --resume`:
    every run's metrics equal those of the runs one after another."""
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "pfedkit", "run", *KILL_ARGS, "--out", str(cut)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    checkpoints = [cut / f"seed{s}" / n / "checkpoint.pt" for s in KILL_SEEDS for n in KILL_NAMES]
    deadline = time.time() + 600
    while not all(c.exists() for c in checkpoints) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, how)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    if all((cut / f"seed{s}" / n / "summary.json").exists() for s in KILL_SEEDS for n in KILL_NAMES):
        pytest.skip("the job finished before it could be stopped")
    assert proc.returncode == (-how if how == signal.SIGKILL else 128 + how), "".join(lines)[-2000:]
    assert any(line.startswith("runs: 6 side by side") for line in lines), "".join(lines)[-2000:]
    resumed = subprocess.run([sys.executable, "-m", "pfedkit", "run", "--resume", str(cut)], capture_output=True,
                             text=True, timeout=600, env=ENV)
    assert resumed.returncode == 0, resumed.stderr
    for s in KILL_SEEDS:
        for n in KILL_NAMES:
            assert len(run_rows(cut / f"seed{s}" / n)) == 100
            assert run_rows(cut / f"seed{s}" / n) == run_rows(runs_alone / f"seed{s}" / n), (s, n)


def test_a_pool_runs_every_callers_tasks_in_order_under_its_grad_mode_and_reraises_after_all():
    pool = WorkerPool(2)
    try:
        done = []

        def slow(i):
            time.sleep(0.01)
            done.append(i)
            return i * i

        results = {}

        def caller(k):
            with torch.no_grad():
                results[k] = (pool.map([lambda i=i: slow(i) for i in range(5)]),
                              pool.map([torch.is_grad_enabled for _ in range(3)]))
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(results[k] == ([0, 1, 4, 9, 16], [False] * 3) for k in range(3))
        assert pool.map([torch.get_num_threads for _ in range(4)]) == [1] * 4  # a worker's ops on one thread
        assert pool.map([lambda: pool.map([lambda: 7, lambda: 8])]) == [[7, 8]]  # a task's tasks run in place
        empty = threading.Thread(target=pool.map, args=([],))  # a caller with nothing to do (and no CPU served)
        empty.start()
        empty.join()
        assert pool.map([lambda: 5]) == [5]  # leaves nothing queued for a worker to take
        done.clear()

        def fails():
            raise ValueError("client 3")
        with pytest.raises(ValueError, match="client 3"):
            pool.map([fails] + [lambda i=i: slow(i) for i in range(4)])
        assert sorted(done) == [0, 1, 2, 3]  # the others ran to their end before the error came back
    finally:
        pool.close()
    with pytest.raises(RuntimeError):
        pool.map([lambda: 1])


def test_runs_alone_and_in_a_job_write_the_same_files(tmp_path):
    """The same files in every run folder whichever way the runs went (their contents compared above)."""
    for how, extra in (("job", []), ("alone", ["runtime.batch_runs=false"])):
        cfg = load_config(None, DENSE + COMMON + ["seeds=0", "plots=true"] + extra, "fedavg,pfedla")
        run_experiment(cfg, tmp_path / how, log=lambda _: None)
    for name in ("fedavg", "pfedla"):
        files = [sorted(p.name for p in (tmp_path / how / "seed0" / name).iterdir()) for how in ("job", "alone")]
        assert files[0] == files[1] and "accuracy.png" in files[0]
        a = np.load(tmp_path / "job" / "seed0" / name / "alpha.npz") if name == "pfedla" else None
        if a is not None:
            b = np.load(tmp_path / "alone" / "seed0" / name / "alpha.npz")
            assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)



def test_a_free_worker_takes_the_task_of_the_caller_served_least():
    """Fair shares: a caller of many small tasks is not queued behind a caller of large ones. One worker, held by a
    blocker while caller A (three tasks of ~50 ms CPU each) and then caller B (three tiny tasks) queue: A's first
    task runs, then B's three (B has had no CPU yet), then A's others; first come first served would run A, A, A."""
    pool = WorkerPool(1)
    order, hold = [], threading.Event()

    def busy(name):
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        order.append(name)

    try:
        blocker = threading.Thread(target=pool.map, args=([hold.wait],))
        blocker.start()
        while not any(t.is_alive() for t in threading.enumerate() if t.name == "pfedkit-worker"):
            time.sleep(0.01)
        time.sleep(0.1)  # the worker has taken the blocker
        a = threading.Thread(target=pool.map, args=([lambda i=i: busy(f"A{i}") for i in range(3)],))
        a.start()
        time.sleep(0.1)  # A queued first
        b = threading.Thread(target=pool.map, args=([lambda i=i: order.append(f"B{i}") for i in range(3)],))
        b.start()
        time.sleep(0.1)
        hold.set()
        for t in (blocker, a, b):
            t.join()
        assert order == ["A0", "B0", "B1", "B2", "A1", "A2"]
    finally:
        hold.set()
        pool.close()
    with pytest.raises(RuntimeError, match="stopped"):
        pool.map([lambda: 1])


def test_a_job_goes_in_steps_of_consecutive_seeds_that_fit_its_memory():
    from pfedkit.runtime.batch_runs import free_memory, steps
    assert steps([3, 3, 3, 3], 7) == [[0, 1], [2, 3]]
    assert steps([5, 1, 1, 9, 2], 7) == [[0, 1, 2], [3], [4]]  # 9 > 7 goes alone
    assert steps([5, 5, 5], 0) == [[0, 1, 2]]  # no budget: one job
    assert steps([], 10) == []
    assert free_memory() > 0  # Linux: MemAvailable
