"""Waiting for worker threads through Ctrl-C. In Python 3.11 and 3.12 a Thread.join that Ctrl-C interrupts marks
the thread as stopped while it still runs (is_alive() says False): a wait built on it returned early, the process
exited with a worker inside a PyTorch op and aborted (SIGABRT, exit -6, instead of Ctrl-C's 130; seen in
tests/test_trust.py's Ctrl-C test). Each wait here must end only once the worker's task has returned."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from pfedkit.models import FlatModel
from pfedkit.runtime import batch_runs
from pfedkit.runtime.runner import ClientRunner
from pfedkit.runtime.threads import Worker, WorkerPool, in_threads

SLOW = 1.0  # seconds the worker's task runs; Ctrl-C comes at a third of it, while the main thread waits


def ctrl_c_soon() -> threading.Timer:
    timer = threading.Timer(SLOW / 3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture(autouse=True)
def python_ctrl_c():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_bare_join_is_what_fails():
    """The premise: without the Worker's own record, an interrupted join says a running thread has stopped (if a
    later Python fixes this, this test says so and the Worker can go)."""
    thread = threading.Thread(target=time.sleep, args=(SLOW,), daemon=True)
    thread.start()
    ctrl_c_soon()
    with pytest.raises(KeyboardInterrupt):
        thread.join()
    alive_said = thread.is_alive()
    time.sleep(SLOW)
    assert alive_said is False, "Thread.join survives Ctrl-C on this Python: Worker's own record is not needed"


def test_a_worker_is_waited_for_through_ctrl_c():
    ended, seen = [], []
    worker = Worker(lambda: (time.sleep(SLOW), ended.append(time.monotonic())))
    worker.start()
    ctrl_c_soon()
    worker.wait(seen.append)
    assert ended and len(seen) == 1 and isinstance(seen[0], KeyboardInterrupt)


def test_in_threads_raises_ctrl_c_only_after_its_helpers_finished():
    both = threading.Barrier(2)  # each thread takes one task: the main thread's ends at once, the helper's is slow
    ended = []

    def task():
        both.wait()
        if threading.current_thread() is not threading.main_thread():
            time.sleep(SLOW)
            ended.append(True)
    ctrl_c_soon()
    with pytest.raises(KeyboardInterrupt):
        in_threads(2, [task, task])
    assert ended == [True], "in_threads returned while its helper still ran"


def test_closing_a_pool_waits_for_its_running_task_through_ctrl_c():
    pool = WorkerPool(1)
    started, ended = threading.Event(), []

    def slow():
        started.set()
        time.sleep(SLOW)
        ended.append(True)
    caller = threading.Thread(target=pool.map, args=([slow],), daemon=True)
    caller.start()
    started.wait()
    ctrl_c_soon()
    with pytest.raises(KeyboardInterrupt):  # kept, not dropped: raised once the task has finished
        pool.close()
    assert ended == [True], "the pool closed while its worker still ran a task"
    caller.join()


def test_a_job_of_runs_raises_ctrl_c_only_after_every_run_ended():
    runners = [ClientRunner(FlatModel(torch.nn.Linear(2, 2))) for _ in range(2)]
    ended = []

    def run(i):  # the first run is slow, the second done at once: the wait interrupted is the first one's
        def loop():
            time.sleep(SLOW if i == 0 else 0)
            ended.append(i)
        return loop
    ctrl_c_soon()
    with pytest.raises(KeyboardInterrupt):
        batch_runs.together([run(0), run(1)], runners)
    assert sorted(ended) == [0, 1], "the job returned while a run's thread still ran"


EXIT_AT_CTRL_C = r"""
import os, signal, sys, threading, time, torch
from pfedkit.runtime.threads import in_threads
both = threading.Barrier(2)
def task():
    both.wait()
    if threading.current_thread() is not threading.main_thread():  # the helper: PyTorch ops for a second
        a, t = torch.randn(200, 200), time.monotonic()
        while time.monotonic() - t < 1:
            a = torch.tanh(a @ a)
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    in_threads(2, [task, task])
except KeyboardInterrupt:
    sys.exit(130)  # as the CLI does after its one line
"""


def test_a_process_that_exits_at_ctrl_c_exits_130_not_by_abort():
    """The symptom itself: the process exits right after the interrupt while the helper ran PyTorch ops. With the
    early return, every try aborted (exit -6: "terminate called without an active exception")."""
    done = subprocess.run([sys.executable, "-c", EXIT_AT_CTRL_C], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
