"""Per-FedAvg (Fallah et al., NeurIPS 2020; specs §6.3): MAML-style local steps, FedAvg on the server, and a
personalized model made by one (or more) step(s) of local SGD from the global model on the client's *train* data
(the pFedMe code adapts on test batches, a leak; here the evaluation cannot even reach them).

Each local step from theta0 uses fresh mini-batches from the client's stream:
    theta' = theta0 - alpha grad f(theta0; D1),  g = grad f(theta'; D2)
    FO: theta = theta0 - beta g
    HF: h = [grad f(theta0 + delta g; D3) - grad f(theta0 - delta g; D3)] / (2 delta),  theta = theta0 - beta (g - alpha h)
with alpha = local.lr. `local.steps` > 0 counts these meta-steps (pFedMe's code); with `local.epochs` the number of
steps is the epochs' batches / 2 (FO) or / 3 (HF), as FL-bench does, rounded up: the batch stream cycles through
fresh permutations (as the reference code's iterators restart), so no leftover batch is dropped and a client with
fewer batches than one meta-step needs still takes one step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import LocalConfig, at_least, choices
from ..train import batch_indices, batched_sgd, sgd
from .base import Algorithm, ClientContext, Cohort, Message, State, model_gradient
from .fedavg import FedAvg


@dataclass
class PerFedAvgParams:
    variant: str = choices("fo", "hf", default="fo")  # first-order or Hessian-free
    beta: float = at_least(0.0, 0.001, open_low=True)  # outer (meta) step
    delta: float = at_least(0.0, 0.001, open_low=True)  # HF finite-difference radius
    adapt_steps: int = at_least(1, 1)  # SGD steps on train batches before evaluation


class PerFedAvg(FedAvg):
    name = "perfedavg"
    Params = PerFedAvgParams
    adapts = True
    unused_local = ("momentum", "weight_decay")  # the meta-steps are plain steps of alpha and beta

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
        return LocalConfig(epochs=0, steps=steps, batch_size=hp.batch_size, lr=hp.lr)

    def meta_step(self, theta: torch.Tensor, alpha: float, grad, batches: list) -> tuple[torch.Tensor, Any]:
        """One Per-FedAvg step from theta (one vector, or a stack of clients' vectors with a batched `grad`);
        `grad(params, batch) -> (gradient, loss)`. Returns (new theta, loss at theta on the first batch)."""
        p = self.params
        g0, loss = grad(theta, batches[0])
        g, _ = grad(theta - alpha * g0, batches[1])
        if p.variant == "hf":
            h = (grad(theta + p.delta * g, batches[2])[0] - grad(theta - p.delta * g, batches[2])[0]) / (2 * p.delta)
            g = g - alpha * h
        return theta - p.beta * g, loss

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        model, data = ctx.model, ctx.data
        sent = payload["weights"]
        model.load(sent)
        theta = sent[: model.param_size].clone()

        def grad(params, idx):
            return model_gradient(model, params, data.x_train[idx], data.y_train[idx])

        batches = list(batch_indices(data.num_train, self.plan(ctx.hp, data.num_train), ctx.gen, sent.device))
        k = self.batches_per_step
        losses = []
        for s in range(len(batches) // k):
            theta, loss = self.meta_step(theta, ctx.hp.lr, grad, batches[s * k: (s + 1) * k])
            losses.append(loss)
        weights = torch.cat([theta, model.vector[model.buffer_slice]])
        return {"weights": weights, "num_samples": data.num_train, "train_loss": sum(losses) / len(losses)}, cstate

    def client_update_many(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        """The same meta-steps for all clients in lockstep (with `local.steps`, where every client takes as many)."""
        if not (cohort.batchable and cohort.hp.steps > 0):
            return Algorithm.client_update_many(self, payloads, cstates, cohort)
        data, k = cohort.data, self.batches_per_step
        theta = torch.stack([m["weights"] for m in payloads])
        idx, mask = cohort.plan(self.plan(cohort.hp))

        def grad(params, t):
            return cohort.loss(params, data.x_train[idx[t]], data.y_train[idx[t]], mask[t])

        loss_sum = torch.zeros(len(theta), device=theta.device)
        for s in range(cohort.hp.steps):
            theta, losses = self.meta_step(theta, cohort.hp.lr, grad, list(range(s * k, (s + 1) * k)))
            loss_sum += losses
        sizes = data.train_sizes
        return [{"weights": theta[i], "num_samples": int(sizes[c]), "train_loss": float(loss_sum[i] / cohort.hp.steps)}
                for i, c in enumerate(cohort.cids)], cstates

    def adapt_plan(self, hp: LocalConfig) -> LocalConfig:
        """`adapt_steps` plain SGD steps (lr alpha) on the client's train batches."""
        return LocalConfig(epochs=0, steps=self.params.adapt_steps, batch_size=hp.batch_size, lr=hp.lr)

    def adapt(self, vector: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        """The global model after `adapt_steps` SGD steps on the client's train batches."""
        ctx.model.load(vector)
        sgd(ctx.model, ctx.data, self.adapt_plan(ctx.hp), ctx.gen)
        return ctx.model.state()

    def adapt_many(self, vectors: list[torch.Tensor], cohort: Cohort) -> list[torch.Tensor]:
        if not cohort.batchable:
            return super().adapt_many(vectors, cohort)
        plan = self.adapt_plan(cohort.hp)
        idx, mask = cohort.plan(plan)
        adapted, _ = batched_sgd(cohort.loss, torch.stack(vectors), cohort.data.x_train, cohort.data.y_train, idx,
                                 mask, plan)
        return list(adapted)
