"""The cohort: the clients one runtime trains at once, over a leading client axis, the one interface the algorithms
write their client math against (train, gradients along the clients' batch streams, evaluation). How the steps
run (one by one, side by side, in processes, in lockstep, CUDA graphs, C kernels) is the runtime's
(pfedkit/runtime/), chosen once a run by its ClientRunner; a client's arithmetic never depends on it. The local
objective and batch streams live in pfedkit/local.py; this module re-exports them for the algorithms.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import numpy as np
import torch

from .config import LocalConfig, RuntimeConfig
from .data import ClientData, FederatedData
from .errors import DataError
from .local import PLAIN, Objective, batch_indices, seeded_generator  # noqa: F401 (the algorithms' names)
from .models import FlatModel
from .runtime import processes
from .runtime.lockstep import BatchedLoss, batch_plan, batched_sgd
from .runtime.one_client import model_gradient, predict, sgd, two_head_gradient  # noqa: F401
from .runtime.runner import ClientRunner
from .runtime.threads import in_threads, on_one_thread  # noqa: F401

T = TypeVar("T")


# ---- a cohort: the clients one runtime trains at once ---------------------------------------------------------------

class Cohort:
    """The clients a runtime trains at once, over a leading client axis: all of a round's clients in the simulator,
    one client in a Flower ClientApp. Algorithms write their client math once against it; the cohort decides how
    the steps run, and a client's arithmetic never depends on which clients train beside it: a model with a
    batched form (`batchable`: the dense models, every model on a GPU) always trains through it, all clients in one
    lockstep where that pays, else each alone in it (one row of a batched product does not depend on the other
    rows: tests/test_one_arithmetic.py); the other models train one client after another with the shared model
    object (side by side in threads or processes). Each client keeps its own seeded batch stream."""

    def __init__(self, cids: list[int], rnd: int, data: FederatedData, model: FlatModel, hp: LocalConfig,
                 gens: list[torch.Generator], lockstep: bool | None = None,
                 runtime: RuntimeConfig | ClientRunner | None = None):
        self.cids, self.round, self.data, self.model, self.hp, self.gens = cids, rnd, data, model, hp, gens
        self.runner = runtime if isinstance(runtime, ClientRunner) else ClientRunner(model, runtime)
        self.force = lockstep  # None: decide by the measured heuristics below; True/False: always/never (tests)

    def __len__(self) -> int:
        return len(self.cids)

    @property
    def num_samples(self) -> list[int]:
        return [int(self.data.train_sizes[c]) for c in self.cids]

    def client(self, i: int) -> ClientData:
        return self.data.client(self.cids[i])

    def holdout(self, fraction: float) -> tuple["Cohort", list[tuple[torch.Tensor, torch.Tensor]]]:
        """Every client's train split cut in two: a validation part, every round(1/fraction)-th sample in stored
        order starting with the first, and the rest to fit on. It depends only on the client's own data, so it is
        the same in every round and on every runtime (a Flower ClientApp included), and it is stratified where a
        client's samples are stored by label. Returns (a cohort of the same clients, generators and schedule that
        trains on the fit parts only, [(x_val, y_val)] per client)."""
        stride = max(1, round(1 / fraction))
        fit_rows, val = [], []
        for i in range(len(self.cids)):
            client = self.client(i)
            rows = torch.arange(client.num_train, device=client.y_train.device)
            is_val = rows % stride == 0
            if is_val.all():  # also a client without any sample
                raise DataError(f"client at data position {self.cids[i]} has {client.num_train} training sample(s): "
                                f"too few to hold out a validation fraction of {fraction} and keep one to fit on; "
                                "give every client at least 2 (partition.samples_per_client) or lower the fraction")
            val.append((client.x_train[is_val], client.y_train[is_val]))
            fit_rows.append(rows[~is_val])
        fit = Cohort(list(range(len(self.cids))), self.round, self.data.train_rows(self.cids, fit_rows), self.model,
                     self.hp, self.gens, self.force, self.runner)
        return fit, val

    @property
    def batchable(self) -> bool:
        """Whether the clients train through the model's batched form (`ClientRunner.batched_form`: the model and
        the device decide, never the cohort's size); `lockstep=True` forces it where the model has one (tests)."""
        if not hasattr(self.model.module, "forward_many"):
            return False
        return self.force if self.force is not None else self.runner.batched_form

    def lockstep_pays(self, hp: LocalConfig | list[LocalConfig] | None = None) -> bool:
        """Whether a batchable cohort trains all its clients in one lockstep (else each alone in the batched form:
        the same results). Lockstep runs as many steps as the longest stream: worth it while most clients are busy in
        most steps (not for epochs over heavy-tailed client sizes, where one big client would keep the others
        waiting)."""
        if self.force is not None:
            return self.force
        if self.data.device.type == "cuda":  # a graphed step of ten clients costs less than one client's eager step
            return True  # (benchmarks/bench_gpu.py): it pays even where one stream is far the longest
        steps = self.planned_steps(hp)
        return steps.sum() >= 0.5 * len(steps) * steps.max()

    def planned_steps(self, hp: LocalConfig | list[LocalConfig] | None = None) -> np.ndarray:
        """Each client's number of SGD steps under hp."""
        hps = hp if isinstance(hp, list) else [hp or self.hp] * len(self.cids)
        sizes = self.data.train_sizes[self.cids]
        return np.array([h.steps if h.steps > 0 else h.epochs * -(-int(n) // h.batch_size) for h, n in zip(hps, sizes)])

    @property
    def loss(self) -> BatchedLoss:
        return self.runner.loss

    def plan(self, hp: LocalConfig | list[LocalConfig] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.data
        return batch_plan([int(d.train_sizes[c]) for c in self.cids], [int(d.train_offsets[c]) for c in self.cids],
                          hp or self.hp, self.gens, d.device)

    def train(self, starts: torch.Tensor, objective: Objective = PLAIN,
              hp: LocalConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Local SGD of every client from its row of `starts` (C, D): (trained (C, D), mean batch loss per client)."""
        hp = hp or self.hp
        if self.batchable:
            d = self.data
            trained, losses = torch.empty_like(starts), starts.new_empty(len(starts), dtype=torch.float64)

            def lockstep(rows: list[int]) -> None:
                vectors, loss = self.batched(lambda: batched_sgd(
                    self.loss, starts[rows], d.x_train, d.y_train, *self.part(rows).plan(hp), hp, objective.part(rows),
                    self.runner.config.cuda_graphs))
                trained[rows], losses[rows] = vectors, loss.double()
            self.runner.parallel([lambda rows=rows: lockstep(rows) for rows in self.lockstep_parts(hp)], self.workers())
            return trained, losses
        placement = self.runner.placement if self.runner.may_fork(len(self.cids)) else None
        forked = placement is not None and placement.fork()
        began = time.perf_counter()
        count = len(starts)
        trained, losses, gen_states = torch.empty_like(starts), starts.new_empty(count, dtype=torch.float64), None
        if forked:  # the children write into shared memory; a child advances its copies of the generators: their
            # states come back (FedRep trains twice on them)
            shared = processes.shared_empty
            trained, losses = shared(starts.shape, dtype=starts.dtype), shared((count,), dtype=torch.float64)
            gen_states = shared((count, self.gens[0].get_state().numel()), dtype=torch.uint8)

        def one(model: FlatModel, i: int) -> None:
            model.load(starts[i])
            losses[i] = sgd(model, self.client(i), hp, self.gens[i], objective.row(i))
            trained[i] = model.vector
            if gen_states is not None:
                gen_states[i] = self.gens[i].get_state()
        if forked:
            models = self.runner.replicas(self.workers())
            processes.in_processes(len(models), count, lambda worker, i: one(models[worker], i))
            for gen, state in zip(self.gens, gen_states):
                gen.set_state(state.clone())
        else:
            self.each_client(one)
        if placement is not None:
            placement.record(forked, time.perf_counter() - began, int(self.planned_steps(hp).sum()))
        return trained, losses

    def part(self, rows: list[int]) -> "Cohort":
        """The clients at positions `rows` as a cohort of their own (their generators shared: their streams go on)."""
        return Cohort([self.cids[i] for i in rows], self.round, self.data, self.model, self.hp,
                      [self.gens[i] for i in rows], self.force, self.runner)

    def lockstep_parts(self, hp: LocalConfig | list[LocalConfig] | None = None) -> list[list[int]]:
        """How a batchable cohort's clients split into locksteps, which decides only the time (a client computes the
        same in any part: `batched`): clients of similar step counts together, so that in each part most clients
        are busy in most steps (one part where the whole cohort's lockstep pays)."""
        if self.lockstep_pays(hp):
            return [list(range(len(self.cids)))]
        steps = self.planned_steps(hp)
        parts: list[list[int]] = []
        for i in np.argsort(-steps, kind="stable").tolist():  # longest first: a part's first client sets its length
            if parts and steps[parts[-1] + [i]].sum() >= 0.5 * (len(parts[-1]) + 1) * steps[parts[-1][0]]:
                parts[-1].append(i)
            else:
                parts.append([i])
        return [sorted(part) for part in parts]

    def batched(self, fn: Callable[[], T]) -> T:
        """fn(), a step of the batched form. On a CPU on one thread: a row of a batched product then does not depend
        on the other rows (with more threads a product of one row splits its own work among them, which changes its
        rounding), so a client computes the same alone (a Flower ClientApp) as beside any others."""
        return on_one_thread(fn) if self.data.device.type == "cpu" else fn()

    def workers(self) -> int:
        return self.runner.workers(len(self.cids))

    def each_client(self, fn: Callable[[FlatModel, int], None]) -> None:
        """fn(model, i) for every client i of the cohort, `workers()` of them side by side."""
        self.runner.side_by_side(len(self.cids), fn)

    def stream(self, hp: LocalConfig | list[LocalConfig], buffers: torch.Tensor | None = None) -> "GradientStream":
        """The clients' batch streams for a solver of its own (pFedMe, Per-FedAvg): gradients at given parameters,
        step by step; `buffers` (C, D - P) are the clients' BatchNorm statistics, updated as in training."""
        hps = hp if isinstance(hp, list) else [hp] * len(self.cids)
        return GradientStream(self, self.plan(hps), self.batchable, buffers)


class GradientStream:
    """Mini-batch gradients of a cohort's clients along their own batch streams: `gradient(params (C, P), t)` gives
    every client's gradient and loss on its t-th batch (zero for a client whose stream has ended)."""

    def __init__(self, cohort: Cohort, plan: tuple[torch.Tensor, torch.Tensor], lockstep: bool,
                 buffers: torch.Tensor | None):
        self.cohort, (self.idx, self.mask), self.lockstep = cohort, plan, lockstep
        self.buffers = buffers.clone() if buffers is not None else None

    @property
    def steps(self) -> int:
        return self.idx.shape[0]

    def active(self, t: int) -> torch.Tensor:
        """Which clients still have a t-th batch: (C,) bool."""
        return self.mask[t].sum(1) > 0

    def gradient(self, params: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        c, data = self.cohort, self.cohort.data
        idx, mask = self.idx[t], self.mask[t]
        if self.lockstep:
            grads, losses = c.batched(lambda: c.loss(params, data.x_train[idx], data.y_train[idx], mask, self.buffers))
            return grads, losses.double()
        P = params.shape[1]
        grads, losses = torch.zeros_like(params), torch.zeros(len(params), dtype=torch.float64, device=params.device)

        def one(model: FlatModel, i: int) -> None:
            real = idx[i][mask[i] > 0]
            if len(real) == 0:
                return
            if self.buffers is not None:
                model.vector[P:].copy_(self.buffers[i])
            grads[i], losses[i] = model_gradient(model, params[i], data.x_train[real], data.y_train[real])
            if self.buffers is not None:
                self.buffers[i] = model.vector[P:]
        c.each_client(one)
        return grads, losses

    def two_head_gradient(self, params: torch.Tensor, second: torch.Tensor, t: int,
                          weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every client's `two_head_gradient` on its t-th batch: (C, P), the second heads' (C, H), the first heads'
        losses. In lockstep as two batched passes, one per head, summed the same way."""
        c, data = self.cohort, self.cohort.data
        head = c.model.head_layers[0].params
        idx, mask = self.idx[t], self.mask[t]
        if self.lockstep:
            x, y = data.x_train[idx], data.y_train[idx]

            def both() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                g, losses = c.loss(params, x, y, mask, self.buffers)
                swapped = params.clone()
                swapped[:, head] = second
                g2, _ = c.loss(swapped, x, y, mask)  # BN statistics see the batch once
                g2 = weight * g2
                second_grad = g2[:, head].clone()
                g2[:, head] = 0.0
                return g + g2, second_grad, losses.double()
            return c.batched(both)
        P = params.shape[1]
        grads, second_grads = torch.zeros_like(params), torch.zeros_like(second)
        losses = torch.zeros(len(params), dtype=torch.float64, device=params.device)

        def one(model: FlatModel, i: int) -> None:
            real = idx[i][mask[i] > 0]
            if len(real) == 0:
                return
            if self.buffers is not None:
                model.vector[P:].copy_(self.buffers[i])
            grads[i], second_grads[i], losses[i] = two_head_gradient(
                model, params[i], data.x_train[real], data.y_train[real], second[i], weight)
            if self.buffers is not None:
                self.buffers[i] = model.vector[P:]
        c.each_client(one)
        return grads, second_grads, losses
