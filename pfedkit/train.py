"""Local training and evaluation primitives on a FlatModel, for one client or a cohort of clients over a leading
client axis: mini-batch SGD with one objective hook (cross-entropy plus optional proximal pull and frozen entries)
and momentum, per-client batch streams, and batched evaluation.

The hot loop does per step exactly what a bare PyTorch loop does (index the batch, forward, backward, step) with
the optimizer step and gradient reset each a single vector op on the flat parameter and gradient vectors; for the
BatchNorm CNNs the step, and for a plain objective the whole loop, is one C call (nets.CNN.training_step). On a
GPU the clients train in lockstep, each step one CUDA graph replay (cuda_graphs.py).
"""
from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from . import cuda_graphs, processes
from .config import LocalConfig, RuntimeConfig
from .data import ClientData, FederatedData
from .errors import DataError
from .models import FlatModel, native, shaped

T = TypeVar("T")


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator whose stream depends only on `key` (e.g. seed, round, client)."""
    seed = int(np.random.SeedSequence([abs(int(k)) for k in key]).generate_state(1, dtype=np.uint64)[0]) >> 1
    return torch.Generator().manual_seed(seed)


def batch_indices(n: int, hp: LocalConfig, gen: torch.Generator, device: torch.device) -> Iterator[torch.Tensor]:
    """Index batches over successive seeded permutations: `epochs` passes, or `steps` batches if steps > 0
    (the last batch of a pass may be smaller, as with a DataLoader that keeps it)."""
    b = hp.batch_size
    if hp.steps > 0:
        done = 0
        while done < hp.steps:
            perm = torch.randperm(n, generator=gen).to(device)
            for start in range(0, n, b):
                yield perm[start: start + b]
                done += 1
                if done == hp.steps:
                    return
        return
    for _ in range(hp.epochs):
        perm = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n, b):
            yield perm[start: start + b]


@dataclass
class Objective:
    """A local objective beyond the mean cross-entropy, for one client (vectors) or a cohort (rows): the proximal
    pull mu/2 ||theta - anchor||^2 (FedProx), and a 0/1 float `trainable` mask over the parameters whose zero entries
    stay frozen (a body or head held fixed). The same object serves the one-client and the lockstep path."""
    prox_anchor: torch.Tensor | None = None  # the anchor vector(s), (D,) or (C, D); only the parameter part is read
    prox_mu: float = 0.0
    trainable: torch.Tensor | None = None  # (P,) or (C, P)
    # > 0: the loss gradient is clipped to this total L2 norm before weight decay, prox and momentum, as
    # torch.nn.utils.clip_grad_norm_ does (pFedHN's inner loop); 0: off
    clip_norm: float = 0.0

    def row(self, i: int) -> "Objective":
        """Client i's part of a cohort's objective."""
        pick = lambda t: t[i] if t is not None and t.dim() == 2 else t  # noqa: E731
        return Objective(pick(self.prox_anchor), self.prox_mu, pick(self.trainable), self.clip_norm)

    def part(self, rows: list[int]) -> "Objective":
        """The part of a cohort's objective for its clients at positions `rows` (a cohort of their own)."""
        pick = lambda t: t[rows] if t is not None and t.dim() == 2 else t  # noqa: E731
        return Objective(pick(self.prox_anchor), self.prox_mu, pick(self.trainable), self.clip_norm)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


PLAIN = Objective()


def sgd(model: FlatModel, data: ClientData, hp: LocalConfig, gen: torch.Generator,
        objective: Objective = PLAIN, plan: LocalConfig | None = None) -> float:
    """Train the model's current vector in place on the client's train split; returns the mean batch loss.
    `plan` overrides epochs/steps/batch size only."""
    module, params, grad = model.module, model.vector[model.param_slice], model.grad
    velocity = torch.zeros_like(params) if hp.momentum > 0 else None
    anchor = objective.prox_anchor[model.param_slice] if objective.prox_anchor is not None else None
    trainable = objective.trainable
    module.train()
    # a whole step in one C call where the model has one for these batches (nets.CNN.training_step), and for a
    # plain objective all the steps in one call (no Python between them)
    fused = module.training_step(data.x_train[:1]) if hasattr(module, "training_step") else None
    if fused is not None and anchor is None and trainable is None and objective.clip_norm == 0:
        batches = list(batch_indices(data.num_train, plan or hp, gen, params.device))
        if not batches:
            return 0.0
        losses = fused.sgd(data.x_train, data.y_train, batches, params, grad, velocity, hp.lr, hp.momentum,
                           hp.weight_decay)
        return float(losses.sum()) / len(batches)
    loss_sum = torch.zeros((), device=params.device)
    steps = 0
    for idx in batch_indices(data.num_train, plan or hp, gen, params.device):
        # index_select: the same rows as x[idx], faster for a batch of images (no advanced-indexing setup)
        x, y = data.x_train.index_select(0, idx), data.y_train.index_select(0, idx)
        if fused is not None:
            loss = fused(x, y)  # the gradient written into `grad`
        else:
            grad.zero_()
            loss = F.cross_entropy(module(x), y)
            loss.backward()
            loss = loss.detach()
        if objective.clip_norm > 0:
            grad.mul_(clip_coefficient(grad.norm(), objective.clip_norm))
        if hp.weight_decay > 0:
            grad.add_(params, alpha=hp.weight_decay)
        if anchor is not None and objective.prox_mu > 0:
            grad.add_(params - anchor, alpha=objective.prox_mu)
        if trainable is not None:
            grad.mul_(trainable)
        if velocity is not None:
            velocity.mul_(hp.momentum).add_(grad)
            params.add_(velocity, alpha=-hp.lr)
        else:
            params.add_(grad, alpha=-hp.lr)
        loss_sum += loss
        steps += 1
    return float(loss_sum) / max(steps, 1)


def model_gradient(model: FlatModel, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Gradient of the mean cross-entropy on one batch at `params` (the parameter part of a vector; the model's
    buffers stay as they are, and BatchNorm updates them in train mode)."""
    model.vector[: len(params)].copy_(params)
    model.grad.zero_()
    model.module.train()
    loss = F.cross_entropy(model.module(x), y)
    loss.backward()
    return model.grad[: len(params)].clone(), float(loss.detach())


def two_head_gradient(model: FlatModel, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, second: torch.Tensor,
                      weight: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The gradient of CE(model(x), y) + weight * CE(second(f), y) at `params`, where f is the input of the model's
    last linear layer (its head) and `second` a second head's parameters laid out as the head's slice (weight, bias):
    FedTC's two classifiers on one extractor, with one forward and backward of the extractor. Returns the gradient
    of the parameters, of the second head, and the first head's cross-entropy."""
    (layer,) = model.head_layers
    head = model.module.get_submodule(layer.name)
    model.vector[: len(params)].copy_(params)
    model.grad.zero_()
    model.module.train()
    other = second.detach().clone().requires_grad_(True)
    features: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda module, inputs, output: features.append(inputs[0]))
    try:
        out = model.module(x)
    finally:
        handle.remove()
    k = head.weight.numel()
    loss = F.cross_entropy(out, y)
    second_logits = F.linear(features[0], other[:k].view_as(head.weight), other[k:])
    (loss + weight * F.cross_entropy(second_logits, y)).backward()
    return model.grad[: len(params)].clone(), other.grad, float(loss.detach())


PREDICT_CHUNK = 256  # samples per forward: faster than large chunks, which spill the caches


@torch.no_grad()
def predict(model: FlatModel, x: torch.Tensor, y: torch.Tensor,
            chunk: int = PREDICT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample 0/1 correctness and cross-entropy of the model's current vector (eval mode: BN uses running
    statistics). On a CPU the chunks run side by side, one per thread (an eval-mode forward only reads the
    module, so the threads share it), faster than one chunk at a time on all threads."""
    model.module.eval()

    def part(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = model.module(x[i: i + chunk])
        return out.argmax(1) == y[i: i + chunk], F.cross_entropy(out, y[i: i + chunk], reduction="none")
    starts = range(0, len(y), chunk)
    workers = torch.get_num_threads() if x.device.type == "cpu" else 1
    parts = in_threads(min(workers, len(starts)), [lambda i=i: part(i) for i in starts])
    if not parts:
        empty = torch.zeros(0, device=x.device)
        return empty.bool(), empty
    return torch.cat([c for c, _ in parts]), torch.cat([l for _, l in parts])


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
            helper = threading.Thread(target=work, daemon=True)
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
            _join(helper, errors)
        torch.set_num_threads(threads)
    if errors:
        raise errors[0]
    return results


def _join(thread: threading.Thread, errors: list[BaseException]) -> None:
    """Wait for a worker thread even through Ctrl-C (kept in `errors`, which stops the workers after their current
    task): a thread still inside a PyTorch op while the interpreter exits aborts the process ("terminate called
    without an active exception", exit -6 instead of Ctrl-C's 130)."""
    while thread.is_alive():
        try:
            thread.join()
        except BaseException as exc:  # noqa: BLE001 - re-raised by in_threads once every worker has stopped
            errors.append(exc)


# ---- many clients in lockstep (batched matrix products) ------------------------------------------------------------

def batch_plan(sizes: list[int], offsets: list[int], hp: LocalConfig | list[LocalConfig], gens: list[torch.Generator],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-client batch streams of `batch_indices` (one plan for all, or one per client), stacked for lockstep
    training: global sample indices (steps, clients, batch) and a 0/1 mask of the real entries (padding for short
    batches and finished clients)."""
    hps = hp if isinstance(hp, list) else [hp] * len(sizes)
    streams = [list(batch_indices(n, h, g, torch.device("cpu"))) for n, h, g in zip(sizes, hps, gens)]
    steps, b = max((len(s) for s in streams), default=0), max(h.batch_size for h in hps)
    idx = torch.zeros(steps, len(sizes), b, dtype=torch.long)
    mask = torch.zeros(steps, len(sizes), b)
    for c, (stream, offset) in enumerate(zip(streams, offsets)):
        for t, batch in enumerate(stream):
            idx[t, c, : len(batch)] = batch + offset
            mask[t, c, : len(batch)] = 1.0
    return idx.to(device), mask.to(device)


class BatchedLoss:
    """Per-client mean cross-entropy and its gradient for a stack of flat parameter vectors, all clients at once:
    `grads, losses = BatchedLoss(model)(params (C, P), x (C, B, ...), y (C, B), mask (C, B), buffers)`.

    The model's `forward_many` runs every client's model on its own batch (models/many.py: batched matrix products,
    grouped convolutions, per-client BatchNorm), and one autograd pass over the stack gives all the gradients: the
    clients are independent, so the gradient of the sum of their losses is each client's own. `buffers` (C, D - P),
    the clients' BatchNorm running statistics, are updated in place as training mode does; None: batch statistics
    only (a second pass over the same batch). (A `torch.func.vmap` of the forward does the same at several times the
    per-call cost for a few clients.)"""

    def __init__(self, model: FlatModel):
        if not hasattr(model.module, "forward_many"):
            raise ValueError("batched training needs a model with forward_many: use the per-client path")
        self.forward_many = model.module.forward_many
        self.param_size, self.channels_last = model.param_size, model.channels_last
        self.names = [(n, s, shape) for n, s, shape in model.names if s.start < model.param_size]
        self.buffer_names = [(n, slice(s.start - model.param_size, s.stop - model.param_size), shape)
                             for n, s, shape in model.names if s.start >= model.param_size]
        self.graphs: cuda_graphs.GraphCache | None = None  # the steps captured for this model (graphed_lockstep)

    def __call__(self, params, x, y, mask, buffers=None):
        c = len(params)
        with torch.enable_grad():
            leaf = params.detach().requires_grad_(True)
            views = {n: shaped(leaf[:, s], shape, self.channels_last) for n, s, shape in self.names}
            if self.buffer_names:
                stats = buffers if buffers is not None else params.new_zeros(c, self.buffer_names[-1][1].stop)
                views.update({n: stats[:, s].view(c, *shape) for n, s, shape in self.buffer_names})
            out = self.forward_many(views, x, mask, running=buffers is not None)
            per_sample = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(c, -1)
            losses = (per_sample * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            grads, = torch.autograd.grad(losses.sum(), leaf)
        return grads, losses.detach()


@dataclass
class LockstepState:
    """What lockstep SGD updates in place, all clients at once: `vectors` (C, D) (parameters, then BatchNorm
    running statistics), its `params` and `buffers` views, momentum `velocity`, and per client the summed batch
    loss and the number of steps taken."""
    vectors: torch.Tensor
    params: torch.Tensor
    buffers: torch.Tensor | None
    velocity: torch.Tensor | None
    loss_sum: torch.Tensor
    steps: torch.Tensor

    @classmethod
    def begin(cls, vectors: torch.Tensor, param_size: int, momentum: bool) -> "LockstepState":
        params, buffers = vectors[:, :param_size], vectors[:, param_size:]
        zeros = lambda: torch.zeros(len(vectors), dtype=vectors.dtype, device=vectors.device)  # noqa: E731
        return cls(vectors, params, buffers if buffers.shape[1] else None,
                   torch.zeros_like(params) if momentum else None, zeros(), zeros())


def lockstep_step(loss: BatchedLoss, s: LockstepState, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                  hp: LocalConfig, objective: Objective) -> None:
    """One SGD step of every client on its batch (x (C, B, ...), y and mask (C, B)), in place on `s`; a client
    without a real sample in it stays put. Every update is in place and nothing waits for the device, so the step
    can be captured as a CUDA graph (cuda_graphs.py)."""
    grads, losses = loss(s.params, x, y, mask, s.buffers)
    if objective.clip_norm > 0:  # each client's own norm
        grads = grads * clip_coefficient(grads.norm(dim=1, keepdim=True), objective.clip_norm)
    if hp.weight_decay > 0:
        grads = grads + hp.weight_decay * s.params
    if objective.prox_anchor is not None and objective.prox_mu > 0:
        grads = grads + objective.prox_mu * (s.params - objective.prox_anchor[..., : s.params.shape[-1]])
    if objective.trainable is not None:
        grads = grads * objective.trainable
    active = (mask.sum(1) > 0).to(s.params.dtype)[:, None]
    if s.velocity is not None:
        s.velocity.copy_(torch.where(active > 0, hp.momentum * s.velocity + grads, s.velocity))
        grads = s.velocity
    s.params -= hp.lr * active * grads
    s.loss_sum += active[:, 0] * losses
    s.steps += active[:, 0]


def batched_sgd(loss: BatchedLoss, params: torch.Tensor, x_all: torch.Tensor, y_all: torch.Tensor,
                idx: torch.Tensor, mask: torch.Tensor, hp: LocalConfig, objective: Objective = PLAIN,
                graphs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`sgd` for many clients at once (same steps, same batches); a client whose stream has ended stays put.
    params (C, D): the parameters and then the BatchNorm running statistics, updated as training mode does.
    On a GPU (`graphs`: `runtime.cuda_graphs`) each step is one replay of a captured CUDA graph. Returns (trained params
    (C, D), mean batch loss per client)."""
    s = LockstepState.begin(params.clone(), loss.param_size, hp.momentum > 0)
    if not (graphs and s.vectors.is_cuda and idx.shape[0] > 0
            and graphed_lockstep(loss, s, x_all, y_all, idx, mask, hp, objective)):
        for t in range(idx.shape[0]):
            lockstep_step(loss, s, x_all[idx[t]], y_all[idx[t]], mask[t], hp, objective)
    return s.vectors, s.loss_sum / s.steps.clamp_min(1.0)


def graphed_lockstep(loss: BatchedLoss, s: LockstepState, x_all: torch.Tensor, y_all: torch.Tensor,
                     idx: torch.Tensor, mask: torch.Tensor, hp: LocalConfig, objective: Objective) -> bool:
    """`batched_sgd`'s steps as replays of one captured step (cuda_graphs.py), kept on the model's BatchedLoss for
    the next calls of the same shapes and hyperparameters: each step's batches are gathered into the graph's static
    inputs, the start, the objective's tensors and the sums are copied in before the first replay and the results
    out after the last. The same kernels as the eager steps. False if the step could not be captured."""
    c, b = idx.shape[1:]
    shape = lambda t: None if t is None else tuple(t.shape)  # noqa: E731
    key = (tuple(s.vectors.shape), s.vectors.dtype, b, tuple(x_all.shape[1:]), x_all.dtype, y_all.dtype,
           s.buffers is not None, hp.lr, hp.momentum, hp.weight_decay, objective.prox_mu, objective.clip_norm,
           shape(objective.prox_anchor), shape(objective.trainable))

    def make() -> tuple:
        static = LockstepState.begin(s.vectors.clone(), loss.param_size, s.velocity is not None)
        x, y, m = x_all[idx[0]], y_all[idx[0]], mask[0].clone()
        copy_of = lambda t: None if t is None else t.clone()  # noqa: E731
        fixed = Objective(copy_of(objective.prox_anchor), objective.prox_mu, copy_of(objective.trainable),
                          objective.clip_norm)
        graph = cuda_graphs.capture(lambda: lockstep_step(loss, static, x, y, m, hp, fixed))
        return graph, static, x, y, m, fixed
    if loss.graphs is None:
        loss.graphs = cuda_graphs.GraphCache()
    entry = loss.graphs.get(key, make)
    if entry is None:
        return False
    graph, static, x, y, m, fixed = entry
    static.vectors.copy_(s.vectors)
    for mine, theirs in ((fixed.prox_anchor, objective.prox_anchor), (fixed.trainable, objective.trainable)):
        if mine is not None:
            mine.copy_(theirs)
    for t in (static.velocity, static.loss_sum, static.steps):
        if t is not None:
            t.zero_()
    for t in range(idx.shape[0]):
        rows = idx[t].flatten()
        torch.index_select(x_all, 0, rows, out=x.view(c * b, *x_all.shape[1:]))
        torch.index_select(y_all, 0, rows, out=y.view(c * b))
        m.copy_(mask[t])
        graph.replay()
    s.vectors.copy_(static.vectors)
    s.loss_sum.copy_(static.loss_sum)
    s.steps.copy_(static.steps)
    return True


def worker_count(model: FlatModel, runtime: RuntimeConfig, clients: int) -> int:
    """How many clients run side by side (`runtime.workers`; 0: as many as PyTorch's CPU threads). A small CNN's
    step at batch 32 runs about as fast on one core as on two, so two clients on one core each beat one client on
    two (benchmarks/bench_cnn_clients.py; the figures: docs/performance.md)."""
    n = runtime.workers or (torch.get_num_threads() if model.device.type == "cpu" else 1)
    return max(1, min(n, clients))


def side_by_side(models: list[FlatModel], count: int, fn: Callable[[FlatModel, int], None]) -> None:
    """fn(model, i) for i in range(count), one worker per model of `models` (replicas of one module: `in_threads`),
    each worker on a model of its own. A client's result depends neither on which worker ran it nor on the order:
    its batches come from its own generator and, on a CPU, its ops run on one thread even when it runs alone (with
    more threads a convolution splits its reductions differently: a Flower ClientApp's lone client would round
    otherwise than the same client beside others)."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    for own in models:
        free.put(own)

    def task(i: int) -> None:
        mine = free.get()
        try:
            on_one_thread(fn, mine, i) if mine.device.type == "cpu" else fn(mine, i)
        finally:
            free.put(mine)
    in_threads(len(models), [lambda i=i: task(i) for i in range(count)])


class ClientRunner:
    """How one run's clients train on this machine: the `runtime:` settings, and what the ways of running them keep
    between rounds for the run's model (its side-by-side replicas, its batched loss with the CUDA graphs captured
    for it, the measured choice between forked processes and threads). `describe` says the way chosen, once a run.
    The algorithms never see it, and a client computes the same bits whichever way it runs
    (tests/test_one_arithmetic.py)."""

    def __init__(self, model: FlatModel, config: RuntimeConfig | None = None):
        self.model, self.config = model, config or RuntimeConfig()
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
        return worker_count(self.model, self.config, clients)

    def replicas(self, n: int) -> list[FlatModel]:
        """n models for side-by-side workers: the run's own, then copies of its module made once and kept."""
        while len(self._replicas) < n - 1:
            self._replicas.append(FlatModel(copy.deepcopy(self.model.module)))
        return [self.model, *self._replicas[: n - 1]]

    def side_by_side(self, count: int, fn: Callable[[FlatModel, int], None]) -> None:
        """fn(model, i) for i in range(count), `workers(count)` of them at a time (`side_by_side`)."""
        side_by_side(self.replicas(self.workers(count)), count, fn)

    def may_fork(self, clients: int) -> bool:
        """Whether training calls may run side-by-side clients in forked processes (`runtime.workers_in`): on a
        Linux CPU, two or more at once; they do where that measures faster (`placement`). Each client runs on one
        thread either way, so the results are the same."""
        return (self.config.workers_in == "processes" and self.workers(clients) > 1
                and self.model.device.type == "cpu" and processes.available())

    def describe(self) -> str:
        """The way this run's clients train, in one line."""
        device, c = self.model.device, self.config
        if self.batched_form:
            if device.type == "cuda":
                steps = "each step one CUDA graph replay" if c.cuda_graphs else "eager steps (runtime.cuda_graphs)"
                return f"clients: on {device}, a round's clients in lockstep through the model's batched form, {steps}"
            return ("clients: on the CPU through the model's batched form, each client on one thread, a round's "
                    "clients in one lockstep where most of them are busy in most steps")
        n = worker_count(self.model, c, 1 << 20)
        how = ("one after another" if n == 1 else
               f"{n} side by side, in forked processes or threads, whichever measures faster" if self.may_fork(n) else
               f"{n} side by side in threads")
        kernels = ""
        if device.type == "cpu" and any(p.dim() == 4 for p in self.model.module.parameters()):
            kernels = "; pfedkit's C kernels" if native.library() is not None else "; PyTorch's own ops"
        return f"clients: on {device}, {how}, each on one thread{kernels}"


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
            in_threads(self.workers(), [lambda rows=rows: lockstep(rows) for rows in self.lockstep_parts(hp)])
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
