"""FedAvg (McMahan et al., 2017): local SGD from the global model, sample-size weighted average (specs §6.1).
Its personalized model is the global model itself."""
from __future__ import annotations

from .base import Algorithm, ClientContext, Message, State, weighted_average


class FedAvg(Algorithm):
    name = "fedavg"

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        weights, loss = ctx.train(payload["weights"])
        return {"weights": weights, "num_samples": ctx.data.num_train, "train_loss": loss}, cstate

    def aggregate(self, state: State, updates: dict[int, Message], rnd: int) -> State:
        return {**state, "weights": weighted_average(updates)}
