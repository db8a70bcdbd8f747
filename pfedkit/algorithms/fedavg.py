"""FedAvg (McMahan et al., 2017): local SGD from the global model, weighted average of the sampled clients
(specs §6.1); its personalized model is the global model itself. FedProx (Li et al., MLSys 2020; specs §6.2)
is FedAvg with the proximal term mu/2 ||theta - w||^2 in every local step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import at_least
from .base import Algorithm, ClientContext, Cohort, Message, State, weighted_average


class FedAvg(Algorithm):
    name = "fedavg"

    def local_terms(self, start: torch.Tensor) -> dict:
        """Extra terms of the local objective, given where training starts (one vector or a stack)."""
        return {}

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        weights, loss = ctx.train(payload["weights"], **self.local_terms(payload["weights"]))
        return {"weights": weights, "num_samples": ctx.data.num_train, "train_loss": loss}, cstate

    def client_update_many(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        if not (cohort.batchable and cohort.lockstep_pays()):
            return super().client_update_many(payloads, cstates, cohort)
        starts = torch.stack([p["weights"] for p in payloads])
        trained, losses = cohort.train(starts, **self.local_terms(starts))
        sizes = cohort.data.train_sizes
        return [{"weights": w, "num_samples": int(sizes[c]), "train_loss": float(l)}
                for w, c, l in zip(trained, cohort.cids, losses)], cstates

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        return {**state, "weights": weighted_average(updates, weights)}


@dataclass
class FedProxParams:
    mu: float = at_least(0.0, 0.01)  # the paper's grid: 0.001, 0.01, 0.1, 1


class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams

    def local_terms(self, start: torch.Tensor) -> dict:
        return {"prox_anchor": start, "prox_mu": self.params.mu}
