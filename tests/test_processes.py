"""Side-by-side clients in forked worker processes (pfedkit/processes.py, `runtime.workers_in=processes`): the same
results as in threads, generator states carried back, every task run once, an error raised in the caller and no
child left behind."""
from __future__ import annotations

import os
import time

import pytest
import torch

from pfedkit.runtime import processes
from pfedkit.config import RuntimeConfig, load_config
from pfedkit.errors import DataError
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Cohort, Objective, seeded_generator

pytestmark = pytest.mark.skipif(not processes.available(), reason="forked workers: Linux only")


def no_children_left() -> bool:
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def setup(model_name: str, clients: int = 5):
    cfg = load_config(None, ["dataset.name=mnist5k", f"model.name={model_name}", f"partition.num_clients={clients}",
                             "partition.samples_per_client=50", "local.batch_size=16", "local.momentum=0.5",
                             "progress=false", "plots=false"], "fedavg")
    data = prepare(cfg)
    return cfg, data, FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, 0))


def cohort(cfg, data, model, workers_in: str, workers: int = 2) -> Cohort:
    cids = list(range(data.num_clients))
    return Cohort(cids, 1, data, model, cfg.local, [seeded_generator(cfg.seed, 1, c) for c in cids],
                  runtime=RuntimeConfig(workers=workers, workers_in=workers_in))


@pytest.mark.parametrize("model_name", ["cnn", "cnn_bn"])
def test_processes_train_exactly_as_threads_and_hand_back_the_generators(model_name):
    cfg, data, model = setup(model_name)
    starts = torch.stack([model.state() + 0.01 * c for c in range(data.num_clients)])
    runs = {}
    for kind in ("threads", "processes"):
        c = cohort(cfg, data, model, kind)
        assert c.runner.may_fork(len(c)) == (kind == "processes")
        first = c.train(starts)
        second = c.train(first[0])  # continues each client's batch stream (FedRep's two phases do)
        runs[kind] = (first, second, [int(torch.randint(1 << 30, (1,), generator=g)) for g in c.gens])
    (t1, t2, t_next), (p1, p2, p_next) = runs["threads"], runs["processes"]
    for a, b in ((t1, p1), (t2, p2)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert t_next == p_next  # the generators ended in the same states
    assert not torch.equal(t1[0], t2[0])  # the second call trained on


def test_processes_run_every_task_once_and_share_them_out():
    count = 3000
    seen = processes.shared_empty((count,), torch.int64)
    seen.zero_()
    worker_of = processes.shared_empty((count,), torch.int64)

    def task(worker: int, i: int) -> None:
        seen[i] += 1
        worker_of[i] = worker
        time.sleep(0.0002)
    processes.in_processes(3, count, task)
    assert torch.equal(seen, torch.ones(count, dtype=torch.int64))
    assert set(worker_of.tolist()) == {0, 1, 2}  # each worker, this process included, took tasks
    assert no_children_left()


@pytest.mark.parametrize("failing_worker", [0, 1])  # this process, a forked child
def test_an_exception_is_raised_here_with_its_type_and_message_and_stops_the_work(failing_worker):
    started = processes.shared_empty((200,), torch.int64)
    started.zero_()
    failed = processes.shared_empty((1,), torch.int64)
    failed.zero_()

    def task(worker: int, i: int) -> None:
        started[i] = 1
        if worker == failing_worker:
            failed[0] = 1
            raise DataError(f"client {i} is broken")
        # the other worker's task lasts until the failure (at most 10 s): however late a loaded machine starts the
        # failing worker, work is left to hand out after the failure
        deadline = time.monotonic() + 10
        while not int(failed[0]) and time.monotonic() < deadline:
            time.sleep(0.001)
    with pytest.raises(DataError, match="client [0-9]+ is broken"):
        processes.in_processes(2, 200, task)
    assert no_children_left()
    assert int(started.sum()) < 200  # no task was handed out after the failure but the ones under way


def finish_every_task(count: int, fail_in_child) -> torch.Tensor:
    """in_processes(2, count) of tasks that write i + 1 at i, where `fail_in_child(i)` runs first in a child."""
    out = processes.shared_empty((count,), torch.int64)
    out.zero_()
    parent = os.getpid()

    def task(worker: int, i: int) -> None:
        if os.getpid() != parent:
            fail_in_child(i)
        time.sleep(0.01)
        out[i] = i + 1
    processes.in_processes(2, count, task)
    return out


def test_a_child_that_dies_leaves_its_work_to_this_process_with_a_warning():
    with pytest.warns(RuntimeWarning, match="killed by signal 9; the 1 task"):
        out = finish_every_task(10, lambda i: os.kill(os.getpid(), 9))  # e.g. the OOM killer: no exception to send
    assert out.tolist() == list(range(1, 11))
    assert no_children_left()


def test_a_child_that_stalls_is_stopped_and_its_work_redone_here(monkeypatch):
    """A forked child spinning on a lock (10.5 minutes once): stopped after the stall limit, not waited for."""
    monkeypatch.setattr(processes, "STALL_FLOOR_S", 1.0)
    began = time.monotonic()
    with pytest.warns(RuntimeWarning, match="finished no task in 1 s"):
        out = finish_every_task(20, lambda i: time.sleep(3600) if i >= 5 else None)
    assert out.tolist() == list(range(1, 21))
    assert time.monotonic() - began < 600  # bounded (the child alone would have slept an hour)
    assert no_children_left()


def test_a_training_error_in_a_child_reaches_the_caller():
    cfg, data, model = setup("cnn", clients=3)
    starts = model.state().repeat(data.num_clients, 1)
    bad = Objective(trainable=torch.ones(data.num_clients, model.param_size + 1))  # one entry too many
    with pytest.raises(RuntimeError, match="size of tensor"):
        cohort(cfg, data, model, "processes").train(starts, bad)
    assert no_children_left()


def test_one_worker_and_the_threads_setting_stay_in_this_process():
    cfg, data, model = setup("cnn", clients=3)
    assert not cohort(cfg, data, model, "processes", workers=1).runner.may_fork(3)
    assert not cohort(cfg, data, model, "threads", workers=2).runner.may_fork(3)
    with pytest.raises(Exception, match="workers_in"):
        load_config(None, ["runtime.workers_in=forks"], "fedavg")


def test_when_no_process_can_be_forked_the_work_is_done_here(monkeypatch):
    """A fork refused (EAGAIN under a process limit, ENOMEM: not to be provoked as root, which CI runs as, so
    os.fork is made to refuse): every task still runs, here."""
    def refuse():
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(os, "fork", refuse)
    done = processes.shared_empty((50,), torch.int64)
    done.zero_()

    def task(worker: int, i: int) -> None:
        done[i] += 1 + worker
    processes.in_processes(2, 50, task)
    assert torch.equal(done, torch.ones(50, dtype=torch.int64))  # all by worker 0


def test_the_placement_forks_only_while_forking_measures_faster():
    """Calls 1-2 fork, 3-4 run threads; then the way with the best of its last 3 times per unit of work, the other
    retried every RETRY-th call: a retry that measures faster takes over, one slow call does not."""
    p = processes.Placement()
    picks = []

    def call(seconds_if_forked: float, seconds_in_threads: float, units: int = 10) -> None:
        forked = p.fork()
        picks.append(forked)
        p.record(forked, seconds_if_forked if forked else seconds_in_threads, units)
    call(9.0, 1.0)  # the warm-up
    call(3.0, 1.0)
    call(3.0, 1.0)
    call(3.0, 1.5)
    assert picks == [True, True, False, False] and p.seconds == {True: [0.9, 0.3], False: [0.1, 0.15]}
    retry = processes.Placement.RETRY
    for _ in range(retry - 5):  # calls 5 .. RETRY - 1: threads, the faster
        call(3.0, 1.0)
    assert picks[4:] == [False] * (retry - 5) and p.seconds[False] == [0.1, 0.1, 0.1]  # the last 3 kept
    call(0.5, 1.0)  # call RETRY retries the fork: faster now, it stays
    call(0.5, 9.0)
    assert picks[-2:] == [True, True]
    call(20.0, 1.0)  # one slow forked call: its best of 3 is still 0.05 a unit
    assert picks[-1] is True
    call(0.5, 1.0, units=1)  # per unit of work: 0.5 s for 1 step is slow
    call(0.5, 1.0, units=1)  # (both forked: 0.05 a unit was still among the last 3)
    call(0.5, 1.0)  # the forked way's last 3 are 2.0, 0.5, 0.5 a unit; threads' best 0.1
    assert picks[-3:] == [True, True, False]


def test_a_way_whose_calls_all_failed_is_tried_again():
    p = processes.Placement()
    for _ in range(4):
        forked = p.fork()
        if forked:
            p.record(True, 1.0, 10)  # the threads' calls raised: nothing recorded for them
    assert p.fork() is False and p.seconds[False] == []
