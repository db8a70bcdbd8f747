"""Tasks side by side in forked worker processes, their results in shared memory.

Why processes: clients trained side by side in threads share one GIL, and a small CNN's step holds it for a
good part of its time (the forward's Python, autograd's custom functions, argument parsing), so two processes
gain more over one than two threads do (benchmarks/bench_cnn_clients.py; figures in docs/performance.md). Forked children inherit the model, the data and the task as they are
in memory, so nothing is pickled; they write their results into tensors the parent mapped shared before the
fork. The parent works too, as one of the workers: one fork fewer, and its share of the work runs without copies
on write.

Only on Linux (fork is the platform's own way to start a process there; macOS's system libraries are not
fork-safe) and for CPU work: a child runs PyTorch on one thread and never touches an accelerator.
"""
from __future__ import annotations

import gc
import mmap
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from typing import Callable

import torch


def available() -> bool:
    """Forking is possible: on Linux, and not once this process has used CUDA (its driver state and autograd's
    device threads do not survive a fork: PyTorch refuses a backward in the child)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and not torch.cuda.is_initialized()


def shared_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in anonymous shared memory: a forked child's writes to it reach the parent."""
    count = 1
    for size in shape:
        count *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(count * itemsize, 1))  # MAP_SHARED | MAP_ANONYMOUS; the tensor keeps it alive
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(tuple(shape))


class Placement:
    """Whether forking pays for a recurring piece of work, measured as it runs. A fork costs time in proportion to
    the process's memory (page tables, then copies on write): cheap for a small run, a large
    share of the round for a process of many gigabytes (pFedLA at N = 1,000); what it saves grows with the work. So the first calls fork twice (the first carries the run's warm-up), then
    run threads twice; after that the way with the lower seconds per unit of work (the best of its last SAMPLES
    calls: one slow call on a noisy machine does not decide) is taken, and the other is tried again every RETRY
    calls: the work or the memory may have changed. Either way gives the same results, so the choice changes
    only the time."""
    RETRY = 16
    SAMPLES = 3

    def __init__(self) -> None:
        self.calls = 0
        self.seconds: dict[bool, list[float]] = {True: [], False: []}  # forked or not: s per unit, latest last

    def fork(self) -> bool:
        self.calls += 1
        if self.calls <= 4:
            return self.calls <= 2
        unmeasured = [way for way in (True, False) if not self.seconds[way]]  # its calls failed: try it again
        if unmeasured:
            return unmeasured[0]
        best = min(self.seconds, key=lambda way: min(self.seconds[way]))
        return best != (self.calls % self.RETRY == 0)

    def record(self, forked: bool, seconds: float, units: int) -> None:
        kept = self.seconds[forked]
        kept.append(seconds / max(units, 1))
        del kept[:-self.SAMPLES]


STALL_FLOOR_S = 60.0  # a worker that finishes no task for this long (or STALL_FACTOR x the longest task) stalled
STALL_FACTOR = 10.0


def in_processes(workers: int, count: int, task: Callable[[int, int], None]) -> None:
    """task(worker, i) for every i in range(count), `workers` at a time: worker 0 is this process, workers 1 ..
    workers - 1 forked children, each on one intra-op thread. A task returns nothing: it writes its results into
    `shared_empty` tensors, so running it again gives the same results. The next task goes to whichever worker is
    free (a shared counter under a lock), so one long task does not hold the others back. A task's exception is
    raised here once every worker has stopped (a failure stops the hand-out of tasks). A child that dies without
    one (killed) or stalls (forking a process that runs threads can leave a child spinning on a lock another
    thread held: once in ~35 runs, for 10 minutes) never holds the run: after `_stall_limit` seconds without a
    finished task it is killed, and whatever it left undone is done here, with one warning. No child outlives the
    call, also when this process is interrupted."""
    if count == 0:
        return
    workers = max(1, min(workers, count))
    handed_out = shared_empty((1,), torch.int64)  # the next task's index; >= count: no more
    handed_out.zero_()
    done = shared_empty((count,), torch.uint8)  # 1: task i finished (by whichever worker)
    done.zero_()
    lock = _PipeLock()
    longest = [0.0]  # this process's longest task: what a slow but healthy task may take

    def work(worker: int) -> None:
        while True:
            with lock:
                i = int(handed_out[0])
                handed_out[0] = i + 1
            if i >= count:
                return
            began = time.monotonic()
            try:
                task(worker, i)
            except BaseException:
                handed_out[0] = count  # the others stop after their current task
                raise
            done[i] = 1
            longest[0] = max(longest[0], time.monotonic() - began)

    error_read, error_write = os.pipe()
    children: list[int] = []
    threads = torch.get_num_threads()
    try:
        gc.freeze()  # the children's collections then leave the inherited objects' pages unwritten (copy on write)
        for worker in range(1, workers):
            with warnings.catch_warnings():  # Python >= 3.12 warns of forking a threaded process; see module doc
                warnings.simplefilter("ignore", DeprecationWarning)
                try:
                    pid = os.fork()
                except OSError:  # no process to be had (a process limit, memory): the workers there are do it all
                    break
            if pid == 0:
                _child(worker, work, error_read, error_write)
            children.append(pid)
        gc.unfreeze()
        os.close(error_write)
        error_write = -1
        torch.set_num_threads(1)
        try:
            work(0)
            lost = _wait(children, done, STALL_FACTOR * longest[0])
            report = _read_all(error_read)
            if report:
                raise _unpack(report)
            if lost:  # killed or stalled children: their tasks, done again here (the same results)
                undone = [i for i in range(count) if not done[i]]
                warnings.warn(f"{lost}; the {len(undone)} task(s) it left undone were run again in this process",
                              RuntimeWarning, stacklevel=2)
                for i in undone:
                    task(0, i)
        finally:
            torch.set_num_threads(threads)
    finally:
        gc.unfreeze()
        for pid in children:  # interrupted while forking or waiting: no child outlives the call
            _kill(pid)
        for fd in (error_read, error_write):
            if fd >= 0:
                os.close(fd)
        lock.close()


def _wait(children: list[int], done: torch.Tensor, slow_task_s: float) -> str:
    """Wait for the children (removed from the list as they end), never longer than the stall limit without a
    finished task; '' when all ended well, else what happened to the ones that did not."""
    limit = max(STALL_FLOOR_S, slow_task_s)
    finished, progress_at, pause = int(done.sum()), time.monotonic(), 0.0005
    problem = ""
    while children:
        for pid in list(children):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                children.remove(pid)
                code = os.waitstatus_to_exitcode(status)
                if code and not problem:
                    problem = (f"a worker process was killed by signal {-code}" if code < 0 else
                               f"a worker process exited with code {code}")
        now_finished = int(done.sum())
        if now_finished != finished:
            finished, progress_at = now_finished, time.monotonic()
        elif children and time.monotonic() - progress_at > limit:
            for pid in list(children):
                _kill(pid)
                children.remove(pid)
            return problem or f"a worker process finished no task in {limit:.0f} s (stalled) and was stopped"
        time.sleep(pause)
        pause = min(2 * pause, 0.02)  # a child's tasks take milliseconds to seconds: look soon, then now and then
    return problem


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


class _PipeLock:
    """A lock shared by forked processes: one byte in a pipe, taken by reading it, given back by writing it (no
    POSIX semaphore, so no /dev/shm needed)."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()
        os.write(self.write, b"\0")

    def __enter__(self) -> None:
        os.read(self.read, 1)

    def __exit__(self, *exc) -> None:
        os.write(self.write, b"\0")

    def close(self) -> None:
        os.close(self.read)
        os.close(self.write)


def _child(worker: int, work: Callable[[int], None], error_read: int, error_write: int) -> None:
    status = 1
    try:
        os.close(error_read)
        for sig in (signal.SIGINT, signal.SIGTERM):  # the parent reports an interrupt; the child just stops
            signal.signal(sig, signal.SIG_DFL)
        gc.unfreeze()
        torch.set_num_threads(1)
        work(worker)
        status = 0
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        try:
            os.write(error_write, _pack(exc))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(status)  # no atexit handlers, no flushing of the parent's buffers


def _pack(exc: BaseException) -> bytes:
    """The exception for the parent, in one write of at most PIPE_BUF bytes (atomic beside another child's)."""
    text = "".join(traceback.format_exception(exc))
    try:  # a forked copy of this program, so its pickle is no foreign input; too big or unpicklable: the text
        blob = pickle.dumps(exc)
        if len(blob) + 1 <= 4096:
            return b"P" + blob
    except Exception:  # noqa: BLE001
        pass
    return b"T" + text[-4000:].encode("utf-8", "replace")


def _unpack(report: bytes) -> BaseException:
    first = report[:1]
    if first == b"P":
        try:
            return pickle.loads(report[1:4097])
        except Exception:  # noqa: BLE001
            pass
    text = report[1:].decode("utf-8", "replace") if first in (b"P", b"T") else ""
    return RuntimeError(f"a worker process failed{': ' + text.strip().splitlines()[-1] if text.strip() else ''}")


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
