"""Local: every client trains only its own model, from the common initialization, with the same local schedule
as the federated runs (it trains in the rounds it is sampled); nothing crosses the network."""
from __future__ import annotations

import torch

from ..registry import register
from ..train import Cohort
from .base import Algorithm, Message, State, make_update, stacked


@register
class Local(Algorithm):
    name = "local"
    has_global_model = False

    def init_server(self, init: torch.Tensor) -> State:
        return {}

    def payload(self, state: State, cid: int, rnd: int) -> Message:
        return {}

    def update_shapes(self) -> dict:
        return {}  # only the statistics the engine logs go up (a few bytes); the model never leaves the client

    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        trained, losses = cohort.train(stacked(cstates))
        return [make_update(n, loss) for n, loss in zip(cohort.num_samples, losses)], \
            [{"weights": w.clone()} for w in trained]

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        return state

    def evaluated_models(self, payloads, cstates, cohort):
        return [s["weights"] for s in cstates]
