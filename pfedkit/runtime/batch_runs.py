"""Runs side by side as one job (`runtime.batch_runs`): the runs of an experiment (its seeds x algorithms, a
reproduction's column) in one process, each run's round loop in a thread of its own and every run's client work
(training, solvers' gradients, evaluation) queued on one pool of workers shared by all. While one run's server
aggregates or its evaluation waits, the workers train the other runs' clients, so the cores stay busy to the end of
the job rather than idling through every run's serial parts and its last clients' tail.

Nothing a run computes depends on the job: its own work runs on one intra-op thread (Run.run) and each client task
on one thread of a worker, with the client's own seeded generators, as alone; its files, checkpoints and resume are
its own (tests/test_batch_runs.py holds every algorithm to its metrics alone, and a job killed midway to the
uninterrupted runs). A job that would not fit the memory goes in steps of consecutive seeds (`steps`, sized by
experiment._memory_steps under `runtime.job_memory_gb`). On a GPU the runs go one after another: several threads
launching kernels and capturing CUDA graphs on one device was never measured (docs/performance.md)."""
from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

from .runner import ClientRunner
from .threads import Worker, WorkerPool

T = TypeVar("T")


def pays(runners: list[ClientRunner]) -> bool:
    """Whether runs with these runners gain from running side by side: two or more of them, on a CPU with two or
    more cores (one core: nothing to overlap)."""
    return len(runners) > 1 and all(r.model.device.type == "cpu" for r in runners) and runners[0].cores > 1


def describe(runs: int, runners: list[ClientRunner]) -> str:
    """The job's way, in one line: the runs side by side, and how their clients train (ClientRunner.describe)."""
    clients = runners[0].describe(shared=workers(runners)).removeprefix("clients: ")
    return f"runs: {runs} side by side in one process (runtime.batch_runs); clients: {clients}"


def free_memory() -> int:
    """Bytes the machine has free now (Linux's MemAvailable; elsewhere free pages), 0 where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0


def steps(sizes: list[int], budget: int) -> list[list[int]]:
    """Groups of consecutive items (a seed's runs and data: their bytes in `sizes`) that each fit `budget` bytes,
    in order; an item larger than the budget goes alone. budget 0: all in one."""
    groups: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not groups or (budget and used + size > budget):
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


def workers(runners: list[ClientRunner]) -> int:
    first = runners[0]
    return first.config.workers or first.cores


def together(jobs: list[Callable[[], T]], runners: list[ClientRunner],
             began: Callable[[], None] = lambda: None) -> list[T | BaseException] | None:
    """Every job (a run's whole loop) in a thread of its own, their runners' client work on one WorkerPool; the
    results in order, a job's error in its place. None where not even the pool's first worker can start (a process
    out of threads: the caller runs the jobs one after another), else `began()` is called before the first job; a job
    whose thread cannot start runs in this one.
    Ctrl-C stops the pool: each run's next client work raises, its loop closes as an interrupted run does (its last
    checkpoint kept), and KeyboardInterrupt is raised here."""
    try:
        pool = WorkerPool(workers(runners))
    except RuntimeError:
        return None
    began()
    for runner in runners:
        runner.pool = pool
    results: list = [None] * len(jobs)

    def one(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - returned in the job's place
            results[i] = exc
    started: list[Worker] = []
    interrupts: list[BaseException] = []

    def interrupted(exc: BaseException) -> None:  # Ctrl-C, pfedkit's SIGTERM (stopping.Stopped): raised as it came
        interrupts.append(exc)
        pool.close(interrupts.append)  # every run's next map raises: the loops end, their threads with them
    try:
        for i in range(len(jobs)):
            thread = Worker(functools.partial(one, i), name=f"pfedkit-run-{i}")
            try:
                thread.start()
            except RuntimeError:  # out of threads: this one runs here, after those started
                one(i)
                continue
            started.append(thread)
        for thread in started:
            thread.wait(interrupted)
    finally:
        pool.close(interrupts.append)  # a Ctrl-C while it waits is raised below, after every run ended
        for runner in runners:
            runner.pool = None
    interrupt = next(iter(interrupts), None) or next((r for r in results if isinstance(r, KeyboardInterrupt)), None)
    if interrupt is not None:
        raise interrupt
    return results
