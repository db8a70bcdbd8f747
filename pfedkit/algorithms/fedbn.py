"""FedBN (Li et al., "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR 2021;
med-air/FedBN): every BatchNorm layer's parameters and running statistics stay on the client, never sent either way;
the rest is FedAvg (sample-size weights, as FL-bench; the official Digits code weighs clients equally, which is
what `sampling` weights give when the clients' sizes are equal). On a model without BatchNorm it is FedAvg.

The class is also the protocol of every "average the shared parts, keep the personal ones" method (FedRep, FedTC):
they change only which parts are personal and how a client trains (`local_training`)."""
from __future__ import annotations

import torch

from ..registry import register
from ..train import Cohort
from .base import Algorithm, Message, State, make_update
from .split import Split, personal_layers


@register
class FedBN(Algorithm):
    name = "fedbn"
    has_global_model = False  # no model without a client's own BatchNorm layers
    personal_part = "bn"  # which layers stay on the client (split.personal_layers)

    def __init__(self, params, model, num_clients, seed=0):
        super().__init__(params, model, num_clients, seed)
        self.split = Split(model, personal_layers(model, self.personal_part))

    def init_server(self, init: torch.Tensor) -> State:
        return {"weights": init.clone()}  # the shared parts are read from it; its personal entries stay the init

    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def payload(self, state: State, cid: int, rnd: int) -> Message:
        return self.split.message(state["weights"])

    def update_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.split.shapes()

    def starts(self, payloads: list[Message], cstates: list[State]) -> torch.Tensor:
        """Each client's own vector with the received shared parts written in: (C, D)."""
        return torch.stack([self.split.fill(s["weights"], p) for p, s in zip(payloads, cstates)])

    def local_training(self, starts: torch.Tensor, cohort: Cohort) -> tuple[torch.Tensor, torch.Tensor]:
        return cohort.train(starts)

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        trained, losses = self.local_training(self.starts(payloads, cstates), cohort)
        return [make_update(n, loss, **self.split.message(w)) for w, n, loss in
                zip(trained, cohort.num_samples, losses)], [{"weights": w.clone()} for w in trained]

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        return {**state, "weights": self.split.average(state["weights"], updates, weights)}

    def evaluated_models(self, payloads, cstates, cohort):
        """The latest shared parts over the client's own personal layers."""
        return list(self.starts(payloads, cstates))

    def describe(self) -> dict:
        return {"personal_layers": self.split.personal}
