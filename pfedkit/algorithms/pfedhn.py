"""pFedHN (Shamsian et al., "Personalized Federated Learning using Hypernetworks", ICML 2021), as the
official trainer does it (AvivSham/pFedHN `experiments/pfedhn/{models,trainer}.py`), on pfedkit's round protocol.

One hypernetwork on the server generates every client's whole model: client i's embedding v_i (dim
int(1 + N/4) by default) -> Linear(e, 100) -> n_hidden x [ReLU, Linear(100, 100)] -> one linear head per target
tensor. The heads are stored concatenated as one Linear(100, P_gen): the same function and the same
default init (every head's fan-in is the hidden width), but one product generates all tensors. Init: PyTorch's
default Linear init (U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases), N(0, 1) embeddings.

A round (batched over the round's C clients):
- `payloads`: one batched forward (C, e) -> (C, P_gen); each client gets its generated parameters by layer.
- client: writes them over its own vector, trains them with SGD (`inner_lr`, official 5e-3, momentum
  `inner_momentum`, weight decay `inner_weight_decay`, the loss gradient clipped to `inner_clip` as
  clip_grad_norm_) for `inner_steps` batches (0: the run's local schedule, so it does the same local work as the
  other methods of a comparison; the official trainer: 50, each a freshly shuffled batch, where pfedkit draws
  batches from successive permutations), and uploads delta = sent - trained (old minus new, the official sign).
- `aggregate`: every client that sent an update contributes (the sampler's weights play no part). Client c's
  hypernetwork gradient is the vector-Jacobian product g_c = J_c^T delta_c, clipped to total norm `hn_clip` as
  the official trainer clips each one-client step: scaled by s_c = min(1, hn_clip / (||g_c|| + 1e-6)). The round's
  hypernetwork takes one optimizer step per client, as the official trainer steps once for each client it serves
  (so momentum and weight decay act once per client), each with that client's s_c g_c taken at the round's
  hypernetwork, the one its model came from (the official trainer serves the clients one after another, each
  from the hypernetwork the earlier ones moved: `sequential: true` does so). The rule is torch.optim.SGD's with
  momentum and weight decay (the embedding table with `embed_lr`) or Adam's (`hn_optimizer: adam`; the official
  Adam option has no weight decay: set hn_weight_decay=0 for it): hypernet.HypernetOptimizer on the whole
  hypernetwork. As in PyTorch, a client's embedding gradient is nonzero only on its own row, but weight decay and
  momentum move every row.
  The gradient is backpropagated by hand, batched: the head's gradient is (s delta)^T F (F the clients' features,
  C x 100), and the MLP's (small) per-client backward signals give both the per-client norms, which are analytic
  (an outer product's norm is the product of the norms: ||delta_c||^2 (||f_c||^2 + 1) for the head and likewise
  per MLP layer), and the summed gradients; the (P_gen x 100) head is touched by two products only.
- evaluation: the generated model itself, no fine-tuning.

The client's BatchNorm statistics (`model.name=cnn_bn`) and, with `personal_head` (pFedHN-PC), its classifier head
stay in the client's own state and never cross the network (split.Split): the hypernetwork generates only the
shared parameters.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..config import at_least, choices
from ..registry import register
from ..train import Cohort, Objective
from .base import Algorithm, Message, State, make_update
from .hypernet import HypernetOptimizer
from .split import Split, personal_layers


@dataclass
class PFedHNParams:
    embedding_dim: int = at_least(0, 0)  # 0: int(1 + N/4), the official trainer's -1
    hidden_dim: int = at_least(1, 100)
    n_hidden: int = at_least(0, 3)
    hn_optimizer: str = choices("sgd", "adam", default="sgd")
    hn_lr: float = at_least(0.0, 1e-2, open_low=True)
    embed_lr: float = at_least(0.0, 0.0)  # 0: hn_lr
    hn_momentum: float = at_least(0.0, 0.9, high=1.0)  # sgd only
    hn_weight_decay: float = at_least(0.0, 1e-3)
    hn_clip: float = at_least(0.0, 50.0)  # 0: no clipping of a client's hypernetwork gradient
    inner_momentum: float = at_least(0.0, 0.9, high=1.0)
    inner_weight_decay: float = at_least(0.0, 5e-5)
    inner_clip: float = at_least(0.0, 50.0)  # 0: off
    inner_steps: int = at_least(0, 0)  # 0: the run's local.epochs / local.steps
    inner_lr: float = at_least(0.0, 5e-3)  # the official --inner-lr; 0: the run's local.lr
    personal_head: bool = False  # pFedHN-PC: each client keeps its own classifier head
    sequential: bool = False  # the official trainer's one-client-at-a-time steps


@register
class PFedHN(Algorithm):
    name = "pfedhn"
    Params = PFedHNParams
    has_global_model = False
    unused_local = ("momentum", "weight_decay")  # inner_momentum / inner_weight_decay set them

    @classmethod
    def unused_local_keys(cls, params: PFedHNParams) -> tuple[str, ...]:
        """Also local.lr under its own inner_lr, and local.epochs / steps under its own inner_steps."""
        return (cls.unused_local + (("lr",) if params.inner_lr > 0 else ())
                + (("epochs", "steps") if params.inner_steps > 0 else ()))

    def __init__(self, params, model, num_clients, seed=0):
        super().__init__(params, model, num_clients, seed)
        self.sequential = params.sequential
        self.split = Split(model, personal_layers(model, "head") if params.personal_head else [], buffers=False)
        # where each shared part sits in a generated row (the shared parameters, in the model's order)
        self.parts: list[tuple[str, slice, slice]] = []
        offset = 0
        for name, s in self.split.shared:
            self.parts.append((name, s, slice(offset, offset + s.stop - s.start)))
            offset += s.stop - s.start
        self.generated_size = offset
        self.embedding_dim = params.embedding_dim or int(1 + num_clients / 4)
        self.linear_keys = [(f"w{i}", f"b{i}") for i in range(params.n_hidden + 1)]

    @property
    def optimizer(self) -> HypernetOptimizer:
        """The hypernetwork's optimizer (one step count for the whole network; the embedding table's own lr)."""
        p = self.params
        return HypernetOptimizer(p.hn_optimizer, p.hn_lr, p.hn_momentum, p.hn_weight_decay,
                                 {"emb": p.embed_lr} if p.embed_lr else {}, velocity_key="hn_momentum")

    # -- the hypernetwork --------------------------------------------------------------------------------------
    def init_hypernetwork(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        e, h = self.embedding_dim, self.params.hidden_dim
        gen = torch.Generator().manual_seed(self.seed + 7919)

        def uniform(shape, fan_in):  # PyTorch's default Linear init
            return (torch.rand(shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)

        hn = {"emb": torch.randn(self.num_clients, e, generator=gen)}
        for i, (w, b) in enumerate(self.linear_keys):
            fan_in = e if i == 0 else h
            hn[w], hn[b] = uniform((h, fan_in), fan_in), uniform((h,), fan_in)
        hn["head_w"], hn["head_b"] = uniform((self.generated_size, h), h), uniform((self.generated_size,), h)
        return {k: v.to(device=like.device, dtype=like.dtype) for k, v in hn.items()}

    def features(self, hn: dict[str, torch.Tensor], idx: torch.Tensor) -> tuple[torch.Tensor, list, list]:
        """The MLP for the given clients: features (C, hidden), and each linear layer's inputs and outputs."""
        x, inputs, outputs = hn["emb"][idx], [], []
        for i, (w, b) in enumerate(self.linear_keys):
            if i > 0:
                x = torch.relu(x)
            inputs.append(x)
            x = torch.addmm(hn[b], x, hn[w].T)
            outputs.append(x)
        return x, inputs, outputs

    def generate(self, state: State, cids: list[int]) -> torch.Tensor:
        """The generated shared parameters of the given clients, (C, P_gen): one batched forward."""
        hn = state["hn"]
        idx = torch.as_tensor(cids, device=hn["emb"].device)
        with torch.no_grad():
            feats, _, _ = self.features(hn, idx)
            return torch.addmm(hn["head_b"], feats, hn["head_w"].T)

    def hn_gradient(self, hn: dict[str, torch.Tensor], idx: torch.Tensor,
                    delta: torch.Tensor) -> dict[str, torch.Tensor]:
        """sum_c s_c J_c^T delta_c over the given clients (delta: (C, P_gen)), s_c clipping client c's own
        gradient to norm hn_clip; backpropagated by hand, batched over the clients."""
        feats, inputs, outputs = self.features(hn, idx)
        # per-client backward signals at each linear layer's output, last layer first
        signal = delta @ hn["head_w"]  # d<generated, delta>/d features, (C, hidden)
        signals = [None] * len(self.linear_keys)
        for i in reversed(range(len(self.linear_keys))):
            signals[i] = signal
            signal = signal @ hn[self.linear_keys[i][0]]  # to the layer's input
            if i > 0:
                signal = signal * (outputs[i - 1] > 0)  # through the ReLU (derivative 0 at 0, as autograd)
        emb_signal = signal
        sq = lambda t: (t * t).sum(1)  # noqa: E731  per-client squared norms
        norm2 = sq(delta) * (sq(feats) + 1) + sq(emb_signal)
        for x, g in zip(inputs, signals):
            norm2 = norm2 + sq(g) * (sq(x) + 1)
        if self.params.hn_clip > 0:
            scale = (self.params.hn_clip / (norm2.sqrt() + 1e-6)).clamp(max=1.0)[:, None]
        else:
            scale = torch.ones_like(norm2)[:, None]
        scaled = scale * delta
        grads = {"head_w": scaled.T @ feats, "head_b": scaled.sum(0)}
        for (w, b), x, g in zip(self.linear_keys, inputs, signals):
            grads[w], grads[b] = (scale * g).T @ x, (scale * g).sum(0)
        grads["emb"] = torch.zeros_like(hn["emb"])
        grads["emb"][idx] = scale * emb_signal  # a round's clients are distinct
        return grads

    # -- protocol ----------------------------------------------------------------------------------------------
    def init_server(self, init: torch.Tensor) -> State:
        state = {"hn": self.init_hypernetwork(init)}
        steps = torch.zeros((), dtype=torch.float64, device=init.device)  # one hypernetwork: one step count
        return state | self.optimizer.init_state(state["hn"], steps)

    def payloads(self, state: State, cids: list[int], rnd: int) -> dict[int, Message]:
        generated = self.generate(state, cids)
        return {cid: {name: generated[r, g] for name, _, g in self.parts} for r, cid in enumerate(cids)}

    def eval_payloads(self, state: State, cids: list[int]) -> dict[int, Message]:
        return self.payloads(state, cids, 0)

    def update_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.split.shapes()

    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def starts(self, payloads: list[Message], cstates: list[State]) -> torch.Tensor:
        """Each client's own vector (head with pFedHN-PC, BN statistics) with the generated parts written in."""
        return torch.stack([self.split.fill(s["weights"], m) for m, s in zip(payloads, cstates)])

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        p = self.params
        hp = dataclasses.replace(cohort.hp, momentum=p.inner_momentum, weight_decay=p.inner_weight_decay,
                                 steps=p.inner_steps or cohort.hp.steps, lr=p.inner_lr or cohort.hp.lr)
        starts = self.starts(payloads, cstates)
        trained, losses = cohort.train(starts, Objective(clip_norm=p.inner_clip), hp)
        delta = starts - trained  # old - new
        updates = [make_update(n, loss, **{name: d[s].clone() for name, s, _ in self.parts})
                   for d, n, loss in zip(delta, cohort.num_samples, losses)]
        return updates, [{"weights": w.clone()} for w in trained]

    def evaluated_models(self, payloads, cstates, cohort):
        return list(self.starts(payloads, cstates))

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        cids = list(updates)
        delta = torch.cat([updates[c][name] for c in cids for name, _, _ in self.parts]).view(len(cids), -1)
        idx = torch.as_tensor(cids, device=delta.device)
        with torch.no_grad():
            start = {k: v.clone() for k, v in state["hn"].items()} if len(cids) > 1 else state["hn"]
            for k in range(len(cids)):  # one step per client, each gradient at the round's hypernetwork
                self.optimizer.step(state, self.hn_gradient(start, idx[k: k + 1], delta[k: k + 1]))
        return state

    def describe(self) -> dict:
        h, e = self.params.hidden_dim, self.embedding_dim
        size = self.num_clients * e + (e + 1) * h + self.params.n_hidden * (h + 1) * h + self.generated_size * (h + 1)
        return {"hypernetwork_params": size, "generated_params": self.generated_size, "embedding_dim": e,
                "generated_parts": [name for name, _, _ in self.parts]}
