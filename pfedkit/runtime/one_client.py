"""A client alone: the reference arithmetic every executor reproduces. Mini-batch SGD on a FlatModel (per step what
a bare PyTorch loop does: index the batch, forward, backward, step, with the optimizer step and gradient reset one
vector op on the flat vectors), gradients at given parameters, and evaluation. A CNN runs on the C kernels where
they cover it (runtime/cnn.py), its whole local SGD as one C call where the model has that step."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..config import LocalConfig
from ..data import ClientData
from ..local import PLAIN, Objective, batch_indices, clip_coefficient
from ..models import FlatModel
from .cnn import forward_of, training_step
from .threads import in_threads


def sgd(model: FlatModel, data: ClientData, hp: LocalConfig, gen: torch.Generator,
        objective: Objective = PLAIN, plan: LocalConfig | None = None) -> float:
    """Train the model's current vector in place on the client's train split; returns the mean batch loss.
    `plan` overrides epochs/steps/batch size only."""
    module, params, grad = model.module, model.vector[model.param_slice], model.grad
    velocity = torch.zeros_like(params) if hp.momentum > 0 else None
    anchor = objective.prox_anchor[model.param_slice] if objective.prox_anchor is not None else None
    trainable = objective.trainable
    module.train()
    forward = forward_of(module)
    # a whole step in one C call where the runtime has one for this model and these batches (cnn.training_step),
    # and for a plain objective all the steps in one call (no Python between them)
    fused = training_step(module, data.x_train[:1])
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
            loss = F.cross_entropy(forward(x), y)
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
    loss = F.cross_entropy(forward_of(model.module)(x), y)
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
        out = forward_of(model.module)(x)
    finally:
        handle.remove()
    k = head.weight.numel()
    loss = F.cross_entropy(out, y)
    second_logits = F.linear(features[0], other[:k].view_as(head.weight), other[k:])
    (loss + weight * F.cross_entropy(second_logits, y)).backward()
    return model.grad[: len(params)].clone(), other.grad, float(loss.detach())


PREDICT_CHUNK = 256  # samples per forward: faster than large chunks, which spill the caches


@torch.no_grad()
def predict(model: FlatModel, x: torch.Tensor, y: torch.Tensor, chunk: int = PREDICT_CHUNK,
            parallel: Callable[[list], list] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample 0/1 correctness and cross-entropy of the model's current vector (eval mode: BN uses running
    statistics). On a CPU the chunks run side by side, one per thread (an eval-mode forward only reads the
    module, so the threads share it), faster than one chunk at a time on all threads; `parallel(tasks)` runs them
    (a ClientRunner's: the run's cores or a job's workers), else threads of PyTorch's count."""
    model.module.eval()
    forward = forward_of(model.module)

    def part(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = forward(x[i: i + chunk])
        return out.argmax(1) == y[i: i + chunk], F.cross_entropy(out, y[i: i + chunk], reduction="none")
    starts = range(0, len(y), chunk)
    tasks = [lambda i=i: part(i) for i in starts]
    if parallel is not None and x.device.type == "cpu":
        parts = parallel(tasks)
    else:
        parts = in_threads(min(torch.get_num_threads() if x.device.type == "cpu" else 1, len(starts)), tasks)
    if not parts:
        empty = torch.zeros(0, device=x.device)
        return empty.bool(), empty
    return torch.cat([c for c, _ in parts]), torch.cat([l for _, l in parts])


