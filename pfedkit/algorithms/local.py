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

    def client_update_many(self, payloads, cstates, cohort):
        if not (cohort.batchable and cohort.lockstep_pays()):
            return super().client_update_many(payloads, cstates, cohort)
        trained, losses = cohort.train(torch.stack([s["weights"] for s in cstates]))
        sizes = cohort.data.train_sizes
        return [{"num_samples": int(sizes[c]), "train_loss": float(l)} for c, l in zip(cohort.cids, losses)], \
            [{"weights": w.clone()} for w in trained]

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        return state

    def personalized(self, state: State, cstate: State, cid: int) -> torch.Tensor:
        return cstate["weights"]
