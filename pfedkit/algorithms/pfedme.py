"""pFedMe (T. Dinh et al., "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020; specs §3) and
pFedCS (pFedMe's local objective + similarity-based clustered sampling + a beta-mixed global update; specs §5).

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
from ..train import batch_indices
from .base import Algorithm, ClientContext, Cohort, Message, State, model_gradient, weighted_average


@dataclass
class PFedMeParams:
    # Defaults: the pFedMe README's MNIST/MLR setting (eta 0.005, plr 0.1, lambda 15, R 20, K 5; specs §3.7)
    local_rounds: int = at_least(1, 20)  # R: mini-batches per round (pFedMe's --local_epochs)
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


class PFedMe(Algorithm):
    name = "pfedme"
    Params = PFedMeParams
    # each inner step keeps 1 - personal_lr (lamda + mu) of theta: beyond -1 (personal_lr * lamda > ~2) it diverges
    divergence_hint = "lower personal_lr or lamda (personal_lr * lamda must stay below 2) or eta"
    # the solver draws R = local_rounds batches of local.batch_size and steps with personal_lr and eta
    unused_local = ("epochs", "steps", "lr", "momentum", "weight_decay")

    def __init__(self, params, model, num_clients, cfg):
        super().__init__(params, model, num_clients, cfg)
        self.trains_all = params.train_all

    def plan(self, hp: LocalConfig) -> LocalConfig:
        """R mini-batches per round, drawn like any local stream (seeded permutations, cycling)."""
        return LocalConfig(epochs=0, steps=self.params.local_rounds, batch_size=hp.batch_size, lr=self.params.eta)

    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"personal": init.clone()}

    def _message(self, w_loc: torch.Tensor, theta: torch.Tensor, sent: torch.Tensor, num: int, loss: float):
        msg = {"weights": w_loc, "num_samples": num, "train_loss": loss}
        if getattr(self.params, "gradient", "local") == "personal":
            P = self.model.param_size  # parameters only: BatchNorm statistics say nothing of the data's gradient
            msg["gradient"] = theta[:P] - sent[:P]  # the personal model's move, for the similarity sampler
        return msg

    def personal_steps(self, theta: torch.Tensor, w_loc: torch.Tensor, gradient) -> tuple[torch.Tensor, torch.Tensor]:
        """K steps towards the proximal point argmin_theta f(theta) + lambda/2 ||theta - w_loc||^2 (+ mu/2 ||theta||^2)
        on one mini-batch; `gradient(theta) -> (grad, loss)`. Returns (theta, summed loss of the K steps)."""
        p = self.params
        keep, pull = 1 - p.personal_lr * (p.lamda + p.mu), p.personal_lr * p.lamda
        theta = theta.clone()
        loss_sum = 0.0
        for _ in range(p.inner_steps):
            grad, loss = gradient(theta)
            # theta - plr (grad + lambda (theta - w_loc) + mu theta), in place: three passes, no temporaries
            theta.mul_(keep).add_(w_loc, alpha=pull).sub_(grad, alpha=p.personal_lr)
            loss_sum = loss_sum + loss
        return theta, loss_sum

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        model, data, P = ctx.model, ctx.data, ctx.model.param_size
        sent = payload["weights"]
        model.load(sent)  # buffers (BatchNorm statistics), if any, evolve in the model during local training
        theta, w_loc = sent[:P].clone(), sent[:P].clone()
        loss_sum, steps = 0.0, 0
        for idx in batch_indices(data.num_train, self.plan(ctx.hp), ctx.gen, sent.device):
            x, y = data.x_train[idx], data.y_train[idx]
            theta, loss = self.personal_steps(theta, w_loc, lambda th: model_gradient(model, th, x, y))
            w_loc = w_loc - self.params.eta * self.params.lamda * (w_loc - theta)
            loss_sum, steps = loss_sum + loss, steps + self.params.inner_steps
        buffers = model.vector[model.buffer_slice]
        personal, local = torch.cat([theta, buffers]), torch.cat([w_loc, buffers])
        return self._message(local, personal, sent, data.num_train, loss_sum / max(steps, 1)), {"personal": personal}

    def client_update_many(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        """The same solver for all clients in lockstep: one batched gradient per inner step."""
        if not cohort.batchable:
            return super().client_update_many(payloads, cstates, cohort)
        data = cohort.data
        sent = torch.stack([m["weights"] for m in payloads])
        theta, w_loc = sent.clone(), sent.clone()
        idx, mask = cohort.plan(self.plan(cohort.hp))
        loss_sum = torch.zeros(len(sent), device=sent.device)
        steps = torch.zeros(len(sent), device=sent.device)
        step = self.params.eta * self.params.lamda
        for t in range(idx.shape[0]):  # R mini-batches; every client's stream has R of them (steps plan)
            x, y, m = data.x_train[idx[t]], data.y_train[idx[t]], mask[t]
            theta, losses = self.personal_steps(theta, w_loc, lambda th: cohort.loss(th, x, y, m))
            w_loc.mul_(1 - step).add_(theta, alpha=step)  # w_loc - eta lambda (w_loc - theta)
            loss_sum += losses
            steps += self.params.inner_steps
        sizes = data.train_sizes
        updates = [self._message(w_loc[i], theta[i], sent[i], int(sizes[c]), float(loss_sum[i] / steps[i].clamp_min(1)))
                   for i, c in enumerate(cohort.cids)]
        return updates, [{"personal": theta[i].clone()} for i in range(len(cohort.cids))]

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        beta = self.params.beta
        return {**state, "weights": (1 - beta) * state["weights"] + beta * weighted_average(updates, weights)}

    def personalized(self, state: State, cstate: State, cid: int) -> torch.Tensor:
        return cstate["personal"]


class PFedCS(PFedMe):
    """pFedMe's local objective, clients sampled by the similarity of their representative gradients
    (Fraboni et al.'s Algorithm 2, `sampling: auto`), w <- (1 - beta) w + beta * mean of the sampled w_loc."""
    name = "pfedcs"
    Params = PFedCSParams
    default_sampling = "clustered_similarity"
