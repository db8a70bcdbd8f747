"""pFedMe (T. Dinh et al., "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020;
CharlieDinh/pFedMe) and pFedCS (pFedMe's local objective + similarity-based clustered sampling + a beta-mixed
global update; the pFedCS paper, docs/pfedcs.md).

Local solver, as the official code: theta and the local copy w_loc start at the global w; for each of R local
rounds take one mini-batch and K steps on it of
    theta <- theta - plr * (grad f(theta) + lambda (theta - w_loc) + mu theta)
(mu = 0.001 is the official optimizer's hidden L2 term, an explicit option here), then
    w_loc <- w_loc - eta * lambda * (w_loc - theta),   eta = pfedme.eta.
The client keeps theta as its personal model (evaluated as the personalized model) and uploads w_loc. The server
mixes w <- (1 - beta) w + beta * sum_i weight_i w_loc_i over the clients the sampler picked: sample-size shares of
a uniform sample (pFedMe's code) or draws / m under clustered sampling (pFedCS: the mean of the sampled local
models). All clients train every round by default (the official code); the sampler then picks who aggregates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import LocalConfig, at_least, choices
from ..registry import register
from ..train import Cohort
from .base import GRADIENT_KEY, Algorithm, Message, State, make_update, stacked, weighted_average


@dataclass
class PFedMeParams:
    # Defaults: the pFedMe README's MNIST/MLR setting (eta 0.005, plr 0.1, lambda 15, R 20, K 5)
    local_rounds: int = at_least(1, 20)  # R: mini-batches per round (pFedMe's --local_epochs)
    # > 0: R covers this many passes over the client's data instead (the pFedLA tables' local epochs)
    local_epochs: int = at_least(0, 0, high=10_000)
    inner_steps: int = at_least(1, 5)  # K: steps on each mini-batch
    eta: float = at_least(0.0, 0.005, open_low=True)  # the local copy's step (pFedMe's --learning_rate)
    personal_lr: float = at_least(0.0, 0.1, open_low=True)  # plr (pFedMe: 0.1/0.09 MNIST, 0.01 Synthetic)
    lamda: float = at_least(0.0, 15.0)  # lambda: pull of the personal model towards the local copy
    mu: float = at_least(0.0, 0.001)  # the official optimizer's hidden L2 term on theta
    beta: float = at_least(0.0, 1.0, open_low=True)  # server mixing; 1 = plain weighted average
    train_all: bool = True  # every client trains every round (the official code); false: only the sampled


@dataclass
class PFedCSParams(PFedMeParams):
    beta: float = at_least(0.0, 1.0, open_low=True)
    gradient: str = choices("local", "personal", default="local")  # representative gradient: w_loc - w or theta - w


@register
class PFedMe(Algorithm):
    name = "pfedme"
    Params = PFedMeParams
    # each inner step keeps 1 - personal_lr (lamda + mu) of theta: beyond -1 (personal_lr * lamda > ~2) it diverges
    divergence_hint = "lower personal_lr or lamda (personal_lr * lamda must stay below 2) or eta"
    # the solver draws R = local_rounds batches of local.batch_size and steps with personal_lr and eta
    unused_local = ("epochs", "steps", "lr", "momentum", "weight_decay")

    def __init__(self, params, model, num_clients, seed=0):
        super().__init__(params, model, num_clients, seed)
        self.trains_all = params.train_all

    @property
    def sends_gradient(self) -> bool:
        return getattr(self.params, "gradient", "local") == "personal"

    def plan(self, hp: LocalConfig) -> LocalConfig:
        """R mini-batches per round (or `local_epochs` passes), drawn like any local stream (seeded permutations,
        cycling)."""
        p = self.params
        return LocalConfig(epochs=p.local_epochs, steps=0 if p.local_epochs else p.local_rounds,
                           batch_size=hp.batch_size, lr=p.eta)

    def update_shapes(self) -> dict:
        shapes = {"weights": (self.model.size,)}
        if self.sends_gradient:  # parameters only: BatchNorm statistics say nothing of the data's gradient
            shapes[GRADIENT_KEY] = (self.model.param_size,)
        return shapes

    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"personal": init.clone()}

    def personal_steps(self, theta: torch.Tensor, w_loc: torch.Tensor, gradient) -> tuple[torch.Tensor, torch.Tensor]:
        """K steps towards the proximal point argmin_theta f(theta) + lambda/2 ||theta - w_loc||^2 (+ mu/2 ||theta||^2)
        on one mini-batch, for a stack of clients; `gradient(theta) -> (grads, losses)`. Returns (theta, summed
        losses of the K steps). Each product is its own rounding (no fused multiply-add), so a client's result does
        not depend on where its row sits in the stack."""
        p = self.params
        keep, pull = 1 - p.personal_lr * (p.lamda + p.mu), p.personal_lr * p.lamda
        theta = theta.clone()
        loss_sum = 0.0
        for _ in range(p.inner_steps):
            grad, loss = gradient(theta)
            # theta - plr (grad + lambda (theta - w_loc) + mu theta) = keep theta + pull w_loc - plr grad
            theta.mul_(keep).add_(w_loc * pull).sub_(grad * p.personal_lr)
            loss_sum = loss_sum + loss
        return theta, loss_sum

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        P = self.model.param_size
        sent = stacked(payloads)
        theta, w_loc = sent[:, :P].clone(), sent[:, :P].clone()
        # buffers (BatchNorm statistics), if any, evolve per client during local training
        stream = cohort.stream(self.plan(cohort.hp), sent[:, P:] if sent.shape[1] > P else None)
        loss_sum = torch.zeros(len(sent), dtype=torch.float64, device=sent.device)
        step = self.params.eta * self.params.lamda
        for t in range(stream.steps):  # R mini-batches; every client's stream has R of them (steps plan)
            theta, losses = self.personal_steps(theta, w_loc, lambda th: stream.gradient(th, t))
            w_loc = w_loc - step * (w_loc - theta)
            loss_sum += losses
        if stream.buffers is not None:
            theta, w_loc = torch.cat([theta, stream.buffers], 1), torch.cat([w_loc, stream.buffers], 1)
        mean_loss = loss_sum / max(stream.steps * self.params.inner_steps, 1)
        updates = []
        for i, n in enumerate(cohort.num_samples):
            extra = {GRADIENT_KEY: theta[i, :P] - sent[i, :P]} if self.sends_gradient else {}  # the personal model's move
            updates.append(make_update(n, mean_loss[i], weights=w_loc[i], **extra))
        return updates, [{"personal": theta[i].clone()} for i in range(len(sent))]

    def eval_payloads(self, state: State, cids: list[int]) -> dict[int, Message]:
        return {cid: {} for cid in cids}  # a client is scored with its own personal model

    def evaluated_models(self, payloads, cstates, cohort):
        return [s["personal"] for s in cstates]

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        beta = self.params.beta
        return {**state, "weights": (1 - beta) * state["weights"] + beta * weighted_average(updates, weights)}


@register
class PFedCS(PFedMe):
    """pFedMe's local objective, clients sampled by the similarity of their representative gradients
    (Fraboni et al.'s Algorithm 2, `sampling: auto`), w <- (1 - beta) w + beta * mean of the sampled w_loc."""
    name = "pfedcs"
    Params = PFedCSParams
    default_sampling = "clustered_similarity"
