"""FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated Learning", ICML 2021;
lgcollins/FedRep): the body (representation) is shared and averaged, the head (the last linear layer) is each client's
own and never sent. A client first trains its head for `head_epochs` with the body frozen, then the body for
`body_epochs` with the head frozen (official CIFAR script: 10 + 1), on the run's local lr/momentum/batch size.
Its personalized model is the global body with its own head.

Frozen means no step at all (the gradient entries are masked before weight decay and momentum); BatchNorm running
statistics of the body still update in train mode during the head epochs, as in the official code."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import at_least
from ..registry import register
from ..train import Cohort, Objective
from .fedbn import FedBN


@dataclass
class FedRepParams:
    head_epochs: int = at_least(0, 10)
    body_epochs: int = at_least(0, 1)


@register
class FedRep(FedBN):
    name = "fedrep"
    Params = FedRepParams
    personal_part = "head"
    unused_local = ("epochs", "steps")  # its own keys set the local work

    def local_training(self, starts: torch.Tensor, cohort: Cohort) -> tuple[torch.Tensor, torch.Tensor]:
        p, head = self.params, self.split.param_mask(self.split.personal)
        trained, losses = starts, torch.zeros(len(starts), dtype=torch.float64, device=starts.device)
        for epochs, trainable in ((p.head_epochs, head), (p.body_epochs, 1.0 - head)):
            if epochs == 0:
                continue
            trained, phase_loss = cohort.train(trained, Objective(trainable=trainable),
                                               hp=replace(cohort.hp, epochs=epochs, steps=0))
            losses += phase_loss.double() * epochs / max(p.head_epochs + p.body_epochs, 1)
        return trained, losses
