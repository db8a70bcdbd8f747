"""Many clients in lockstep: each step one batched forward and backward of every client's model on its own batch
(the model's `forward_many`: batched matrix products, grouped convolutions, per-client BatchNorm), on a GPU each
step one replay of a captured CUDA graph (cuda_graphs.py). A row of a batched product does not depend on the other
rows on one thread, so a client computes the same in any lockstep, and alone (tests/test_one_arithmetic.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import LocalConfig
from ..local import PLAIN, Objective, batch_indices, clip_coefficient
from ..models import FlatModel, shaped
from . import cuda_graphs


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
        self.param_size = model.param_size
        self.names = [(n, s, shape) for n, s, shape in model.names if s.start < model.param_size]
        self.buffer_names = [(n, slice(s.start - model.param_size, s.stop - model.param_size), shape)
                             for n, s, shape in model.names if s.start >= model.param_size]
        self.graphs: cuda_graphs.GraphCache | None = None  # the steps captured for this model (graphed_lockstep)

    def __call__(self, params, x, y, mask, buffers=None):
        c = len(params)
        with torch.enable_grad():
            leaf = params.detach().requires_grad_(True)
            views = {n: shaped(leaf[:, s], shape) for n, s, shape in self.names}
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


