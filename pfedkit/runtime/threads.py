"""Clients side by side in threads of this process, each on one intra-op thread (PyTorch's ops release the GIL, so
the threads run on separate cores), and the rule that makes a client's arithmetic independent of its neighbours:
on a CPU every client's ops run on one thread, alone or not."""
from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from typing import Callable, TypeVar

import torch

from ..config import RuntimeConfig
from ..models import FlatModel

T = TypeVar("T")


def on_one_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) with PyTorch's intra-op work on this thread alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def in_threads(workers: int, tasks: list[Callable[[], T]]) -> list[T]:
    """The tasks' results in order, `workers` at a time (this thread one of them), each worker on one intra-op
    thread (the ops release the GIL, so the threads run on separate cores) and under the caller's grad mode; a
    task's error is re-raised here once the workers have stopped. Where no thread can be started (a thread limit,
    memory) the workers there are do it all: each task runs on one thread either way, so the results are the same.
    workers <= 1: in this thread."""
    if workers <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    grad_mode = torch.is_grad_enabled()  # thread-local: a new thread would run with autograd on
    results: list = [None] * len(tasks)
    errors: list[BaseException] = []
    order, lock = iter(range(len(tasks))), threading.Lock()

    def work() -> None:
        torch.set_num_threads(1)  # this worker thread's ops only
        with torch.set_grad_enabled(grad_mode):  # e.g. predict's no_grad: without it the chunks built graphs
            while not errors:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                try:
                    results[i] = tasks[i]()
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                    errors.append(exc)
    threads = torch.get_num_threads()
    started = []
    try:
        for _ in range(workers - 1):
            helper = Worker(work)
            started.append(helper)  # before start: a Ctrl-C inside start() leaves a running thread to join
            try:
                helper.start()
            except RuntimeError:  # "can't start new thread"
                started.pop()
                break
        work()
    except BaseException as exc:  # noqa: BLE001 - e.g. Ctrl-C between tasks: the helpers stop after their own
        errors.append(exc)
    finally:
        for helper in started:
            helper.wait(errors.append)
        torch.set_num_threads(threads)
    if errors:
        raise errors[0]
    return results


class Worker:
    """A daemon thread running `target()` whose end the thread itself records. Not Thread.join and is_alive: in
    Python 3.11 and 3.12 a join that Ctrl-C interrupts marks a thread that is still running as stopped (bpo-45274's
    handling releases the lock the running thread holds), is_alive() then says False, and a process that exits
    meanwhile aborts inside the thread's PyTorch op ("terminate called without an active exception", exit -6
    instead of Ctrl-C's 130: tests/test_threads.py)."""

    def __init__(self, target: Callable[[], None], name: str | None = None):
        self._done = threading.Event()

        def body() -> None:
            try:
                target()
            finally:
                self._done.set()
        self._thread = threading.Thread(target=body, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait(self, interrupted: Callable[[BaseException], None]) -> None:
        """Until target() has returned, even through Ctrl-C: each interrupt meanwhile goes to `interrupted`."""
        while not self._done.is_set():
            try:
                self._done.wait()
            except BaseException as exc:  # noqa: BLE001 - the caller decides (kept, re-raised once all stopped)
                interrupted(exc)


class WorkerPool:
    """Worker threads kept for a whole job, each on one intra-op thread, that run the tasks of several callers at
    once (runs side by side: runtime/batch_runs.py): `map(tasks)` queues the caller's tasks and returns their results
    in order once all have run, re-raising the first error. A free worker takes the next task of the caller whose
    tasks have had the least CPU time so far: a run that waits on many small steps (pFedMe's gradient streams) keeps
    its share beside runs that queue a few large ones, where first-come-first-served starved it. A task runs under
    its caller's grad mode; a task that maps tasks itself runs them in place (a worker never waits for the workers).
    It starts the workers it can (RuntimeError if none: a process out of threads)."""

    def __init__(self, workers: int):
        self._ready = threading.Condition()
        self._queued: dict[int, collections.deque] = {}  # caller thread -> its tasks not yet taken
        self._served: dict[int, float] = collections.defaultdict(float)  # caller thread -> its tasks' CPU seconds
        self._mine = threading.local()
        self._closed = False
        self._threads: list[Worker] = []
        for _ in range(max(1, workers)):
            thread = Worker(self._work, name="pfedkit-worker")
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread": the workers there are do it all
                break
            self._threads.append(thread)
        if not self._threads:
            raise RuntimeError("can't start new thread")
        self.workers = len(self._threads)

    def _take(self) -> tuple[int, tuple] | None:
        """The least-served caller's next task; None once closed and drained."""
        with self._ready:
            while not self._queued and not self._closed:
                self._ready.wait()
            if not self._queued:
                return None
            caller = min(self._queued, key=self._served.__getitem__)
            tasks = self._queued[caller]
            item = tasks.popleft()
            if not tasks:
                del self._queued[caller]
            return caller, item

    def _work(self) -> None:
        torch.set_num_threads(1)
        self._mine.worker = True
        while (taken := self._take()) is not None:
            caller, (task, grad_mode, future) = taken
            if self._closed:
                future.set_exception(RuntimeError("the job's workers stopped"))
                continue
            start = time.thread_time()
            try:
                with torch.set_grad_enabled(grad_mode):
                    future.set_result(task())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                future.set_exception(exc)
            with self._ready:
                self._served[caller] += time.thread_time() - start

    def map(self, tasks: list[Callable[[], T]]) -> list[T]:
        if getattr(self._mine, "worker", False) or not tasks:
            return [task() for task in tasks]
        futures = [concurrent.futures.Future() for _ in tasks]
        with self._ready:  # checked under the lock: workers leave only once closed with nothing queued
            if self._closed:
                raise RuntimeError("the job's workers stopped")
            self._queued.setdefault(threading.get_ident(), collections.deque()).extend(
                (task, torch.is_grad_enabled(), future) for task, future in zip(tasks, futures))
            self._ready.notify_all()
        concurrent.futures.wait(futures)  # all of them, also after an error: none may still hold a model after
        return [f.result() for f in futures]

    def close(self, interrupted: Callable[[BaseException], None] | None = None) -> None:
        """Stop: the queued tasks fail, the running ones finish, a later `map` raises RuntimeError. A Ctrl-C while
        it waits for the running tasks goes to `interrupted`, or without it is raised once they have finished."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        interrupts: list[BaseException] = []
        for thread in self._threads:
            thread.wait(interrupted or interrupts.append)
        if interrupts:
            raise interrupts[0]


def worker_count(model: FlatModel, runtime: RuntimeConfig, clients: int, cores: int | None = None) -> int:
    """How many clients run side by side (`runtime.workers`; 0: as many as PyTorch's CPU threads, `cores`). A small
    CNN's step at batch 32 runs about as fast on one core as on two, so two clients on one core each beat one client
    on two (benchmarks/bench_cnn_clients.py; the figures: docs/performance.md)."""
    n = runtime.workers or ((cores or torch.get_num_threads()) if model.device.type == "cpu" else 1)
    return max(1, min(n, clients))


def side_by_side(models: list[FlatModel], count: int, fn: Callable[[FlatModel, int], None],
                 parallel: Callable[[list], list] | None = None) -> None:
    """fn(model, i) for i in range(count), one worker per model of `models` (replicas of one module: `in_threads`),
    each worker on a model of its own. A client's result depends neither on which worker ran it nor on the order:
    its batches come from its own generator and, on a CPU, its ops run on one thread even when it runs alone (with
    more threads a convolution splits its reductions differently: a Flower ClientApp's lone client would round
    otherwise than the same client beside others). `parallel(tasks)` runs the tasks (a ClientRunner's: a job's
    shared workers, at most len(models) at once, one per model); default: len(models) threads of this call."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for own in models:
        free.put(own)

    def task(i: int) -> None:
        mine = free.get()
        try:
            on_one_thread(fn, mine, i) if mine.device.type == "cpu" else fn(mine, i)
        finally:
            free.put(mine)
    tasks = [lambda i=i: task(i) for i in range(count)]
    parallel(tasks) if parallel is not None else in_threads(len(models), tasks)


