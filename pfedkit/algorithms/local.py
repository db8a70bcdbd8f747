"""Local: every client trains only its own model, from the common initialization, with the same local schedule
as the federated runs (it trains in the rounds it is sampled); nothing crosses the network (specs §6.8)."""
from __future__ import annotations

import torch

from .base import Algorithm, ClientContext, Message, State


class Local(Algorithm):
    name = "local"
    has_global_model = False

    def init_server(self, init: torch.Tensor) -> State:
        return {}

    def payload(self, state: State, cid: int, rnd: int) -> Message:
        return {}

    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        weights, loss = ctx.train(cstate["weights"])
        # Only the statistics the engine logs go up (a few bytes); the model never leaves the client.
        return {"num_samples": ctx.data.num_train, "train_loss": loss}, {"weights": weights}

    def aggregate(self, state: State, updates: dict[int, Message], rnd: int) -> State:
        return state

    def personalized(self, state: State, cstate: State, cid: int) -> torch.Tensor:
        return cstate["weights"]
