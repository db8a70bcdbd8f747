"""Local training and evaluation primitives on a FlatModel: epochs of mini-batch SGD with optional proximal term,
layer masks and momentum, and batched evaluation.

The hot loop does per step exactly what a bare PyTorch loop does (index the batch, forward, backward, step) with
the optimizer step and gradient reset each a single vector op on the flat parameter and gradient vectors.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .config import LocalConfig
from .data import ClientData
from .models import FlatModel


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator whose stream depends only on `key` (e.g. seed, round, client)."""
    seed = int(np.random.SeedSequence([abs(int(k)) for k in key]).generate_state(1, dtype=np.uint64)[0] >> 1)
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


def sgd(model: FlatModel, data: ClientData, hp: LocalConfig, gen: torch.Generator, *,
        prox_anchor: torch.Tensor | None = None, prox_mu: float = 0.0,
        trainable: torch.Tensor | None = None, lr: float | None = None,
        plan: LocalConfig | None = None) -> float:
    """Train the model's current vector in place on the client's train split; returns the mean batch loss.

    prox_anchor/prox_mu add mu * (theta - anchor) to the gradient (FedProx). `trainable` is a 0/1 float mask
    over the parameters (frozen entries keep their values). `plan` overrides epochs/steps/batch size only.
    """
    module, params, grad = model.module, model.vector[model.param_slice], model.grad
    lr = hp.lr if lr is None else lr
    velocity = torch.zeros_like(params) if hp.momentum > 0 else None
    anchor = prox_anchor[model.param_slice] if prox_anchor is not None else None
    module.train()
    loss_sum = torch.zeros((), device=params.device)
    steps = 0
    for idx in batch_indices(data.num_train, plan or hp, gen, params.device):
        grad.zero_()
        loss = F.cross_entropy(module(data.x_train[idx]), data.y_train[idx])
        loss.backward()
        if hp.weight_decay > 0:
            grad.add_(params, alpha=hp.weight_decay)
        if anchor is not None and prox_mu > 0:
            grad.add_(params - anchor, alpha=prox_mu)
        if trainable is not None:
            grad.mul_(trainable)
        if velocity is not None:
            velocity.mul_(hp.momentum).add_(grad)
            params.add_(velocity, alpha=-lr)
        else:
            params.add_(grad, alpha=-lr)
        loss_sum += loss.detach()
        steps += 1
    return float(loss_sum) / max(steps, 1)


@torch.no_grad()
def predict_correct(model: FlatModel, x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Per-sample 0/1 correctness of the model's current vector (eval mode: BN uses running statistics)."""
    model.module.eval()
    out = [model.module(x[i: i + chunk]).argmax(1) == y[i: i + chunk] for i in range(0, len(y), chunk)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=x.device)


def accuracy(model: FlatModel, data: ClientData) -> tuple[int, int]:
    """(correct, total) on the client's test split."""
    return int(predict_correct(model, data.x_test, data.y_test).sum()), len(data.y_test)
