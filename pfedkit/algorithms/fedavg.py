"""FedAvg (McMahan et al., AISTATS 2017): local SGD from the global model, weighted average of the sampled
clients; its personalized model is the global model itself. FedProx (Li et al., MLSys 2020) is FedAvg with the
proximal term mu/2 ||theta - w||^2 in every local step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import at_least
from ..registry import register
from ..train import PLAIN, Cohort, Objective
from .base import Algorithm, Message, State, make_update, stacked, weighted_average


@register
class FedAvg(Algorithm):
    name = "fedavg"

    def objective(self, starts: torch.Tensor) -> Objective:
        """The local objective beyond cross-entropy, given where the clients start (C, D)."""
        return PLAIN

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        starts = stacked(payloads)
        trained, losses = cohort.train(starts, self.objective(starts))
        return [make_update(n, loss, weights=w) for w, n, loss in zip(trained, cohort.num_samples, losses)], cstates

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        return {**state, "weights": weighted_average(updates, weights)}


@dataclass
class FedProxParams:
    mu: float = at_least(0.0, 0.01)  # the paper's grid: 0.001, 0.01, 0.1, 1


@register
class FedProx(FedAvg):
    name = "fedprox"
    Params = FedProxParams

    def objective(self, starts: torch.Tensor) -> Objective:
        return Objective(prox_anchor=starts, prox_mu=self.params.mu)
