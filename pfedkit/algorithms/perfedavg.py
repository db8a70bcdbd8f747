"""Per-FedAvg (Fallah et al., NeurIPS 2020; docs/pfedcs.md): MAML-style local steps, FedAvg on the server, and a
personalized model made by one (or more) step(s) of local SGD from the global model on the client's *train* data
(the pFedMe code adapts on test batches, a leak; here the evaluation cannot even reach them).

Each local step from theta0 uses fresh mini-batches from the client's stream:
    theta' = theta0 - alpha grad f(theta0; D1),  g = grad f(theta'; D2)
    FO: theta = theta0 - beta g
    HF: h = [grad f(theta0 + delta g; D3) - grad f(theta0 - delta g; D3)] / (2 delta),  theta = theta0 - beta (g - alpha h)
with alpha = `perfedavg.alpha` (0: local.lr, as FL-bench and the pFedMe code take it). `local.steps` > 0 counts
these meta-steps (pFedMe's code); with `local.epochs` the number of steps is the epochs' batches / 2 (FO) or / 3
(HF), as FL-bench does, rounded up: the batch stream cycles through fresh permutations (as the reference code's
iterators restart), so no leftover batch is dropped and a client with fewer batches than one meta-step needs still
takes one step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import LocalConfig, at_least, choices
from ..registry import register
from ..train import Cohort
from .base import Message, State, make_update, stacked
from .fedavg import FedAvg


@dataclass
class PerFedAvgParams:
    variant: str = choices("fo", "hf", default="fo")  # first-order or Hessian-free
    # the inner (personalization) step, also the adaptation's lr; 0: local.lr. Its own key so that a preset can
    # give Per-FedAvg a smaller alpha than the other methods' local.lr (the meta-model's loss grows with alpha)
    alpha: float = at_least(0.0, 0.0)
    beta: float = at_least(0.0, 0.001, open_low=True)  # outer (meta) step
    delta: float = at_least(0.0, 0.001, open_low=True)  # HF finite-difference radius
    adapt_steps: int = at_least(1, 1)  # SGD steps on train batches before evaluation (the paper: one)
    # > 0: that many epochs of SGD instead of `adapt_steps` (FL-bench's evaluation forces fine-tuning >= 1 epoch)
    adapt_epochs: int = at_least(0, 0, high=10_000)


@register
class PerFedAvg(FedAvg):
    name = "perfedavg"
    Params = PerFedAvgParams
    unused_local = ("momentum", "weight_decay")  # the meta-steps are plain steps of alpha and beta
    # the meta-model's own loss grows over long runs until it overflows, the sooner the larger alpha and beta
    divergence_hint = "lower perfedavg.beta (the meta step) or perfedavg.alpha (the inner step)"

    @classmethod
    def unused_local_keys(cls, params: PerFedAvgParams) -> tuple[str, ...]:
        """Also local.lr under its own alpha."""
        return cls.unused_local + (("lr",) if params.alpha > 0 else ())

    def alpha(self, hp: LocalConfig) -> float:
        return self.params.alpha or hp.lr

    @property
    def batches_per_step(self) -> int:
        return 2 if self.params.variant == "fo" else 3

    def meta_steps(self, num_train: int, hp: LocalConfig) -> int:
        """`local.steps` (pFedMe's code), or enough to use every batch of `local.epochs` (the last step completed
        from the next permutation)."""
        if hp.steps > 0:
            return hp.steps
        batches = hp.epochs * -(-num_train // hp.batch_size)
        return -(-batches // self.batches_per_step)

    def plan(self, hp: LocalConfig, num_train: int = 0) -> LocalConfig:
        """The batch stream of the meta-steps, each taking `batches_per_step` batches."""
        steps = self.meta_steps(num_train, hp) * self.batches_per_step
        return LocalConfig(epochs=0, steps=steps, batch_size=hp.batch_size, lr=self.alpha(hp))

    def meta_step(self, theta: torch.Tensor, alpha: float, grad, batches: list) -> tuple[torch.Tensor, Any]:
        """One Per-FedAvg step from theta (a stack of clients' vectors); `grad(params, batch) -> (gradients,
        losses)`. Returns (new theta, losses at theta on the first batch)."""
        p = self.params
        g0, loss = grad(theta, batches[0])
        g, _ = grad(theta - alpha * g0, batches[1])
        if p.variant == "hf":
            h = (grad(theta + p.delta * g, batches[2])[0] - grad(theta - p.delta * g, batches[2])[0]) / (2 * p.delta)
            g = g - alpha * h
        return theta - p.beta * g, loss

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        P, k = self.model.param_size, self.batches_per_step
        sent = stacked(payloads)
        steps = [self.meta_steps(n, cohort.hp) for n in cohort.num_samples]
        stream = cohort.stream([self.plan(cohort.hp, n) for n in cohort.num_samples],
                               sent[:, P:] if sent.shape[1] > P else None)
        theta = sent[:, :P].clone()
        loss_sum = torch.zeros(len(sent), dtype=torch.float64, device=sent.device)
        for s in range(max(steps)):
            active = torch.tensor([s < n for n in steps], device=sent.device)
            new, losses = self.meta_step(theta, self.alpha(cohort.hp), stream.gradient, list(range(s * k, (s + 1) * k)))
            theta = torch.where(active[:, None], new, theta)  # a client whose steps are done stays put
            loss_sum += torch.where(active, losses, 0.0)
        if stream.buffers is not None:
            theta = torch.cat([theta, stream.buffers], 1)
        return [make_update(n, loss_sum[i] / steps[i], weights=theta[i])
                for i, n in enumerate(cohort.num_samples)], cstates

    def adapt_plan(self, hp: LocalConfig) -> LocalConfig:
        """`adapt_epochs` epochs, else `adapt_steps` steps, of plain SGD (lr alpha) on the client's train batches."""
        p = self.params
        return LocalConfig(epochs=p.adapt_epochs, steps=0 if p.adapt_epochs else p.adapt_steps,
                           batch_size=hp.batch_size, lr=self.alpha(hp))

    def evaluated_models(self, payloads: list[Message], cstates: list[State], cohort: Cohort) -> list[torch.Tensor]:
        """The global model after the adaptation plan's SGD steps on each client's train batches."""
        adapted, _ = cohort.train(stacked(payloads), hp=self.adapt_plan(cohort.hp))
        return list(adapted)
