"""Per-FedAvg (Fallah et al., NeurIPS 2020; specs §6.3): MAML-style local steps, FedAvg on the server, and a
personalized model made by one (or more) step(s) of local SGD from the global model on the client's *train* data
(the pFedMe code adapts on test batches, a leak; here the evaluation cannot even reach them).

Each local step from theta0 uses fresh mini-batches from the client's stream:
    theta' = theta0 - alpha grad f(theta0; D1),  g = grad f(theta'; D2)
    FO: theta = theta0 - beta g
    HF: h = [grad f(theta0 + delta g; D3) - grad f(theta0 - delta g; D3)] / (2 delta),  theta = theta0 - beta (g - alpha h)
with alpha = local.lr. `local.steps` > 0 counts these meta-steps (pFedMe's code); with `local.epochs` the number of
steps is the epochs' batches / 2 (FO) or / 3 (HF), as FL-bench does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LocalConfig, at_least, choices
from ..train import batch_indices
from .base import ClientContext, Message, State, model_gradient
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
    lockstep = False  # meta-steps: the per-client path

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        p, model, data, alpha = self.params, ctx.model, ctx.data, ctx.hp.lr
        sent = payload["weights"]
        model.load(sent)
        P = model.param_size
        theta = sent[:P].clone()

        def grad(params, idx):
            return model_gradient(model, params, data.x_train[idx], data.y_train[idx])

        per_step = 2 if p.variant == "fo" else 3
        plan = ctx.hp
        if plan.steps > 0:  # local.steps counts meta-steps (pFedMe's code), each taking `per_step` batches
            plan = LocalConfig(epochs=0, steps=plan.steps * per_step, batch_size=plan.batch_size, lr=plan.lr)
        batches = list(batch_indices(data.num_train, plan, ctx.gen, sent.device))
        losses = []
        for s in range(len(batches) // per_step):
            b = batches[s * per_step: (s + 1) * per_step]
            g0, loss = grad(theta, b[0])
            g, _ = grad(theta - alpha * g0, b[1])
            if p.variant == "hf":
                h = (grad(theta + p.delta * g, b[2])[0] - grad(theta - p.delta * g, b[2])[0]) / (2 * p.delta)
                g = g - alpha * h
            theta = theta - p.beta * g
            losses.append(loss)
        weights = torch.cat([theta, model.vector[model.buffer_slice]])
        return {"weights": weights, "num_samples": data.num_train,
                "train_loss": sum(losses) / len(losses) if losses else None}, cstate

    def adapt(self, vector: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        """`adapt_steps` SGD steps (lr alpha) from the global model on the client's train batches."""
        plan = LocalConfig(epochs=0, steps=self.params.adapt_steps, batch_size=ctx.hp.batch_size, lr=ctx.hp.lr)
        P = ctx.model.param_size
        ctx.model.load(vector)
        theta = vector[:P].clone()
        for idx in batch_indices(ctx.data.num_train, plan, ctx.gen, vector.device):
            theta = theta - ctx.hp.lr * model_gradient(ctx.model, theta, ctx.data.x_train[idx], ctx.data.y_train[idx])[0]
        return torch.cat([theta, ctx.model.vector[ctx.model.buffer_slice]])
