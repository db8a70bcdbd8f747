"""FedTC (Liu et al., "FedTC: A Personalized Federated Learning Method with Two Classifiers", CMC 76(3) 2023,
doi 10.32604/cmc.2023.039452). Only the abstract and the pFedCS paper's remarks could be found; what
follows them is marked, the rest is inferred (docs/pfedcs.md, "FedTC").

From the abstract: the model is an extractor (every layer but the last) and a classifier (the last layer); the
client's own classifier C_i is always kept; on receipt of the global model the local extractor is overwritten by
the global one, and the global classifier C_g becomes a second classifier that guides local training. The pFedCS
paper adds that both classifiers are updated during local training.

Inferred: one phase of local SGD on CE(C_i(E(x)), y) + global_head_weight * CE(C_g(E(x)), y), the extractor taking
the sum of both gradients, each classifier its own; the client uploads E and its updated copy of C_g (never C_i);
the server averages them as FedAvg. Global model (GM): (E_g, C_g). Personalized model (PM): the latest global
extractor with the client's own classifier (E_g, C_i), what a client holds right after receiving the global model
(`personal_model: local_extractor` evaluates (E_i, C_i) as the client ended its last round instead).

Both losses see the same batch: each step is one forward and backward of the extractor with both classifiers on its
features (train.two_head_gradient; BatchNorm statistics see each batch once), in lockstep for the dense models. With MLR the extractor is empty: FedTC is then FedAvg's classifier beside a local one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import at_least, choices
from ..registry import register
from ..train import Cohort
from .base import Message, State, make_update
from .fedbn import FedBN
from .split import Split, personal_layers


@dataclass
class FedTCParams:
    global_head_weight: float = at_least(0.0, 1.0)  # weight of the global classifier's loss
    personal_model: str = choices("global_extractor", "local_extractor", default="global_extractor")


@register
class FedTC(FedBN):
    name = "fedtc"
    Params = FedTCParams
    has_global_model = True
    personal_part = "none"  # everything is shared: the extractor and the global classifier C_g
    unused_local = ("momentum", "weight_decay")  # plain SGD steps on the two-classifier loss

    def __init__(self, params, model, num_clients, seed=0):
        super().__init__(params, model, num_clients, seed)
        self.body = Split(model, personal_layers(model, "head"))  # the extractor's parts
        (head,) = model.head_layers  # the last linear layer: C_i, and C_g beside it
        self.head_slice = head.params

    def with_global_extractor(self, payloads: list[Message], cstates: list[State]) -> list[torch.Tensor]:
        """(E_g, C_i): each client's own weights with the extractor parts of the global model it received."""
        return [self.body.fill(s["weights"], {name: p[name] for name, _ in self.body.shared})
                for p, s in zip(payloads, cstates)]

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        P, lr, gw = self.model.param_size, cohort.hp.lr, self.params.global_head_weight
        own = torch.stack(self.with_global_extractor(payloads, cstates))
        glob = self.starts(payloads, cstates)  # (E_g, C_g)
        stream = cohort.stream(cohort.hp, own[:, P:] if own.shape[1] > P else None)
        personal, shared_head = own[:, :P].clone(), glob[:, self.head_slice].clone()  # (E, C_i) and C_g
        loss_sum, steps = torch.zeros(len(own), dtype=torch.float64, device=own.device), torch.zeros(len(own), device=own.device)
        for t in range(stream.steps):
            active = stream.active(t).to(own.dtype)[:, None]
            # E takes the sum of both classifiers' gradients, each classifier its own: one pass of E
            g, g_head, loss = stream.two_head_gradient(personal, shared_head, t, gw)
            personal -= lr * active * g
            shared_head -= lr * active * g_head
            loss_sum += active[:, 0].double() * loss  # the personal model's cross-entropy, as the others report
            steps += active[:, 0]
        shared = personal.clone()
        shared[:, self.head_slice] = shared_head  # (E, C_g), E the same
        if stream.buffers is not None:
            personal, shared = torch.cat([personal, stream.buffers], 1), torch.cat([shared, stream.buffers], 1)
        losses = loss_sum / steps.clamp_min(1).double()
        return [make_update(n, loss, **self.split.message(w)) for w, n, loss in
                zip(shared, cohort.num_samples, losses)], [{"weights": w.clone()} for w in personal]

    def evaluated_models(self, payloads, cstates, cohort):
        if self.params.personal_model == "local_extractor":
            return [s["weights"] for s in cstates]
        return self.with_global_extractor(payloads, cstates)
