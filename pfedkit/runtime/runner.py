"""The chooser: how one run's clients train on this machine, decided once from the `runtime:` settings, the model and
the device, and said in one line (`describe`); it owns what the executors keep between rounds."""
from __future__ import annotations

import copy
from typing import Callable, TypeVar

import torch

from ..config import RuntimeConfig
from ..models import FlatModel
from . import native, processes
from .lockstep import BatchedLoss
from .threads import WorkerPool, in_threads, side_by_side, worker_count

T = TypeVar("T")


class ClientRunner:
    """How one run's clients train on this machine: the `runtime:` settings, and what the ways of running them keep
    between rounds for the run's model (its side-by-side replicas, its batched loss with the CUDA graphs captured
    for it, the measured choice between forked processes and threads). `describe` says the way chosen, once a run.
    The algorithms never see it, and a client computes the same bits whichever way it runs
    (tests/test_one_arithmetic.py)."""

    def __init__(self, model: FlatModel, config: RuntimeConfig | None = None):
        self.model, self.config = model, config or RuntimeConfig()
        self.cores = torch.get_num_threads()  # the run's own work goes on one thread (Run.run): counted here, before
        self.pool: WorkerPool | None = None  # a job's workers shared with the runs beside this one (batch_runs.py)
        self.placement = processes.Placement()  # forked or threads for the training calls, by their measured time
        self._replicas: list[FlatModel] = []
        self._loss: BatchedLoss | None = None

    @property
    def loss(self) -> BatchedLoss:
        if self._loss is None:
            self._loss = BatchedLoss(self.model)
        return self._loss

    @property
    def batched_form(self) -> bool:
        """Whether the clients train through the model's batched form (`forward_many`), decided by the model and
        the device alone, never by the cohort's size, so that a client computes the same alone (a Flower
        ClientApp's cohort of one) as beside others: the dense models (MLR, DNN), whose one-client step is too
        small to keep the cores busy, and on a GPU every model (one client's small kernels leave it idle:
        benchmarks/bench_gpu.py). The CNNs on a CPU train client by client: their lockstep form (grouped
        convolutions, models/many.py) measured no faster there (benchmarks/bench_cnn_clients.py)."""
        module = self.model.module
        if not hasattr(module, "forward_many"):
            return False
        return self.model.device.type == "cuda" or all(p.dim() <= 2 for p in module.parameters())

    def workers(self, clients: int) -> int:
        if self.pool is not None:
            return min(self.pool.workers, max(1, clients))
        return worker_count(self.model, self.config, clients, self.cores)

    def parallel(self, tasks: list[Callable[[], T]], workers: int | None = None) -> list[T]:
        """The tasks' results in order, on the job's workers or `workers` threads (default: `workers(len(tasks))`),
        each on one intra-op thread."""
        if self.pool is not None:
            return self.pool.map(tasks)
        return in_threads(self.workers(len(tasks)) if workers is None else workers, tasks)

    def replicas(self, n: int) -> list[FlatModel]:
        """n models for side-by-side workers: the run's own, then copies of its module made once and kept."""
        while len(self._replicas) < n - 1:
            self._replicas.append(FlatModel(copy.deepcopy(self.model.module)))
        return [self.model, *self._replicas[: n - 1]]

    def side_by_side(self, count: int, fn: Callable[[FlatModel, int], None]) -> None:
        """fn(model, i) for i in range(count), `workers(count)` of them at a time (`side_by_side`)."""
        models = self.replicas(self.workers(count))
        side_by_side(models, count, fn, lambda tasks: self.parallel(tasks, len(models)))

    def may_fork(self, clients: int) -> bool:
        """Whether training calls may run side-by-side clients in forked processes (`runtime.workers_in`): on a
        Linux CPU, two or more at once; they do where that measures faster (`placement`). Each client runs on one
        thread either way, so the results are the same."""
        return (self.config.workers_in == "processes" and self.pool is None and self.workers(clients) > 1
                and self.model.device.type == "cpu" and processes.available())

    def describe(self, shared: int = 0) -> str:
        """The way this run's clients train, in one line; `shared`: on that many workers of a job (batch_runs.py)."""
        device, c = self.model.device, self.config
        if self.batched_form:
            if device.type == "cuda":
                steps = "each step one CUDA graph replay" if c.cuda_graphs else "eager steps (runtime.cuda_graphs)"
                return f"clients: on {device}, a round's clients in lockstep through the model's batched form, {steps}"
            return ("clients: on the CPU through the model's batched form, each client on one thread, a round's "
                    "clients in one lockstep where most of them are busy in most steps"
                    + (f", the locksteps on {shared} workers shared by the runs" if shared else ""))
        n = worker_count(self.model, c, 1 << 20, self.cores)
        how = (f"{shared} workers shared by the runs" if shared else "one after another" if n == 1 else
               f"{n} side by side, in forked processes or threads, whichever measures faster" if self.may_fork(n) else
               f"{n} side by side in threads")
        kernels = ""
        if device.type == "cpu" and any(p.dim() == 4 for p in self.model.module.parameters()):
            kernels = (f"; pfedkit's C kernels ({native.variant} build)" if native.library() is not None
                       else f"; PyTorch's own ops (no C kernels: {native.why_not})")
        return f"clients: on {device}, {how}, each on one thread{kernels}"


