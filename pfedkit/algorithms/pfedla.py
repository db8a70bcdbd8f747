"""pFedLA and HeurpFedLA (Ma et al., "Layer-wised Model Aggregation for Personalized Federated Learning",
CVPR 2022).

The server keeps every client's latest vector (Theta, N x D) and one hypernetwork per client: embedding v_i
(dim 100) -> 3 x (Linear 100, ReLU) -> one head per layer with N outputs (weights U(0,1), bias 0) -> ReLU -> divided
by the sum over clients (one-hot self if the sum is 0). The hypernetworks are stored stacked (a leading client axis)
and run as one batch for a round's clients.

- `payloads`: client i's personalized layer l is sum_j alpha_i[l, j] theta_j[l]: for all sampled clients at once,
  A_l Theta_l, one matrix product per layer (DESIGN.md, "pFedLA on the server, as matrix products").
- `aggregate`: each trained client's hypernetwork takes one optimizer step (Adam per client by default, the
  reference code's plain SGD with `hn_optimizer: sgd`; hypernet.HypernetOptimizer) on the vector-Jacobian product
  of its personalized parameters with delta = theta_sent - theta_trained (the pFedHN convention, descent on the
  client loss; the unofficial reference code uses new - old, an ascent: `delta_sign: new_minus_old` reproduces
  it). The gradient with respect to A_l is Delta_l Theta_l^T, so autograd runs only through the small
  hypernetworks, never the N x P mixture. Theta's rows become the trained vectors.

HeurpFedLA (k > 0): per client, the k layers with the highest self-weight are kept local: not aggregated, not sent
down (the client fills them from its own copy), and their heads get no gradient. BatchNorm running statistics are
never aggregated: each client keeps its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import at_least, choices
from ..errors import ConfigError
from ..models import FlatModel
from ..registry import register
from ..train import Cohort
from .base import Algorithm, Message, State, make_update
from .hypernet import HypernetOptimizer, PayloadCache, blocks, clients_per_block, rows_of
from .split import fill

HN_KEYS = ("emb", "w1", "b1", "w2", "b2", "w3", "b3", "head_w", "head_b")


@dataclass
class PFedLAParams:
    # Adam per client by default: its step is invariant to the gradient's scale, which shrinks like 1/N^2 through the
    # normalization over N clients, so one learning rate works at every N (0.3: chosen on validation splits at 10 to
    # 1,000 clients). `hn_optimizer: sgd` with `hn_lr: 5e-3` is the reference code's plain SGD (docs/pfedla.md,
    # "The default hypernetwork step").
    hn_optimizer: str = choices("adam", "sgd", default="adam")
    hn_lr: float = at_least(0.0, 0.3, open_low=True)
    hn_momentum: float = at_least(0.0, 0.0, high=1.0)  # sgd only
    embedding_dim: int = at_least(1, 100)
    hidden_dim: int = at_least(1, 100)
    k: int = at_least(0, 0)  # HeurpFedLA: layers each client keeps local
    selfweight: str = choices("normalized", "raw", default="normalized")  # ranking of the k kept layers
    delta_sign: str = choices("old_minus_new", "new_minus_old", default="old_minus_new")
    sequential: bool = False  # the reference code's one-client-at-a-time round
    granularity: str = choices("module", "block", "tensor", default="module")
    save_alpha: bool = True  # log every client's weights at each evaluation (alpha.npz)
    # storage of the hypernetworks and their optimizer state (N x layers x N x hidden heads: 2 GB in float32 at
    # N = 1,000): bfloat16 halves it (float32's range, so Adam's second moments do not underflow); the sampled
    # clients' rows are computed in the model's dtype and rounded only when stored (docs/pfedla.md, "Memory")
    hn_dtype: str = choices("float32", "bfloat16", default="float32")


@dataclass
class HeurPFedLAParams(PFedLAParams):
    k: int = at_least(0, 1)


def layer_groups(model: FlatModel, granularity: str) -> list[tuple[str, slice]]:
    """The units that get one hypernetwork head each: a parameterized module (weight and bias together), a block
    (a conv/linear layer with the normalization layer after it), or every parameter tensor."""
    if granularity == "tensor":
        return [(name, s) for name, s, _ in model.names if s.stop <= model.param_size]
    groups: list[tuple[str, slice]] = []
    for layer in model.layers:
        if granularity == "block" and layer.kind.startswith("batchnorm") and groups:
            name, s = groups[-1]
            groups[-1] = (f"{name}+{layer.name}", slice(s.start, layer.params.stop))
        else:
            groups.append((layer.name, layer.params))
    return groups


@register
class PFedLA(Algorithm):
    name = "pfedla"
    Params = PFedLAParams
    has_global_model = False

    def __init__(self, params, model, num_clients, seed=0):
        super().__init__(params, model, num_clients, seed)
        self.groups = layer_groups(model, params.granularity)
        self.slices = dict(self.groups)
        if params.k > len(self.groups):
            raise ConfigError(f"config key '{self.name}.k': {params.k} is more than the model's "
                              f"{len(self.groups)} layers; allowed: 0 to {len(self.groups)}")
        if params.hn_optimizer != "sgd" and params.hn_momentum > 0:
            raise ConfigError(f"config key '{self.name}.hn_momentum': {params.hn_momentum} applies to "
                              f"hn_optimizer: sgd only; allowed with {params.hn_optimizer}: 0")
        if params.hn_dtype == "bfloat16" and params.hn_optimizer == "sgd":
            # plain SGD's steps shrink like 1/N^2: below bfloat16's half-ulp of the heads they would round away
            raise ConfigError(f"config key '{self.name}.hn_dtype': bfloat16 needs hn_optimizer: adam (plain SGD's "
                              f"small steps round away in bfloat16); allowed with sgd: float32")
        self.sequential = params.sequential
        self.sent = PayloadCache()  # a training round's raw weights and mixture, for its aggregate

    @property
    def optimizer(self) -> HypernetOptimizer:
        """The hypernetworks' optimizer, one row (and its state) per client."""
        return HypernetOptimizer(self.params.hn_optimizer, self.params.hn_lr, self.params.hn_momentum)

    # -- the hypernetworks -------------------------------------------------------------------------------------
    def init_hypernetworks(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        n, e, h, layers = self.num_clients, self.params.embedding_dim, self.params.hidden_dim, len(self.groups)
        gen = torch.Generator().manual_seed(self.seed + 7919)

        def uniform(shape, bound):  # PyTorch's default Linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            return (torch.rand(shape, generator=gen) * 2 - 1) * bound

        hn = {"emb": torch.randn(n, e, generator=gen)}
        for i, fan_in in ((1, e), (2, h), (3, h)):
            hn[f"w{i}"] = uniform((n, h, fan_in), 1 / math.sqrt(fan_in))
            hn[f"b{i}"] = uniform((n, h), 1 / math.sqrt(fan_in))
        # U(0, 1) heads: kaiming init can give all-negative outputs, i.e. all-zero weights after the ReLU
        hn["head_w"] = torch.rand(n, layers, n, h, generator=gen)
        hn["head_b"] = torch.zeros(n, layers, n)
        dtype = torch.bfloat16 if self.params.hn_dtype == "bfloat16" else like.dtype
        return {k: v.to(device=like.device, dtype=dtype) for k, v in hn.items()}

    @staticmethod
    def raw_weights(hn: dict[str, torch.Tensor]) -> torch.Tensor:
        """Batched forward of the given clients' hypernetworks: ReLU head outputs, (clients, layers, N)."""
        x = hn["emb"]
        for i in (1, 2, 3):
            x = torch.relu(torch.einsum("chk,ck->ch", hn[f"w{i}"], x) + hn[f"b{i}"])
        return torch.relu(torch.einsum("clnh,ch->cln", hn["head_w"], x) + hn["head_b"])

    def mixing_weights(self, raw: torch.Tensor, cids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """alpha (clients, layers, N): rows normalized to sum 1, one-hot self where a row is all zero and for the
        layers a client keeps local (HeurpFedLA); and the boolean (clients, layers) mask of those kept layers."""
        total = raw.sum(-1, keepdim=True)
        onehot = F.one_hot(cids, self.num_clients).to(raw.dtype)[:, None, :].expand_as(raw)
        alpha = torch.where(total > 0, raw / total.clamp_min(1e-30), onehot)
        retained = torch.zeros(raw.shape[:2], dtype=torch.bool, device=raw.device)
        if self.params.k > 0:
            ranked = alpha if self.params.selfweight == "normalized" else raw
            self_weight = ranked.detach().gather(2, cids[:, None, None].expand(-1, raw.shape[1], 1)).squeeze(2)
            retained.scatter_(1, self_weight.topk(self.params.k, dim=1).indices, True)
            alpha = torch.where(retained[..., None], onehot, alpha)
        return alpha, retained

    def mix(self, theta: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """Personalized parameters of the given clients, (clients, P): A_l Theta_l, one product per layer."""
        out = theta.new_empty(alpha.shape[0], self.model.param_size)
        for l, (_, s) in enumerate(self.groups):
            out[:, s] = alpha[:, l, :] @ theta[:, s]
        return out

    def block(self) -> int:
        """Clients per block of the server's hypernetwork work (a client's heads: layers x N x hidden floats)."""
        return clients_per_block(len(self.groups) * self.num_clients * self.params.hidden_dim * 4)

    def raw_of(self, state: State, cids: list[int]) -> torch.Tensor:
        """The given clients' raw head outputs (clients, layers, N), without autograd, read block by block:
        gathering all 1,000 clients' heads first would copy 2 GB (benchmarks/bench_pfedla_server.py)."""
        theta = state["theta"]
        with torch.no_grad():
            raw = [self.raw_weights(rows_of(state["hn"], part, theta.dtype))
                   for _, part in blocks(cids, self.block(), theta.device)]
        return torch.cat(raw) if raw else state["hn"]["head_b"][:0].to(theta.dtype)

    def _weights_of(self, state: State, cids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The given clients' index, alpha and kept-layer mask, without autograd."""
        idx = torch.as_tensor(cids, device=state["theta"].device)
        with torch.no_grad():
            alpha, retained = self.mixing_weights(self.raw_of(state, cids), idx)
        return idx, alpha, retained

    # -- protocol ----------------------------------------------------------------------------------------------
    def init_server(self, init: torch.Tensor) -> State:
        state = {"theta": init.repeat(self.num_clients, 1), "hn": self.init_hypernetworks(init)}
        steps = torch.zeros(self.num_clients, dtype=init.dtype, device=init.device)  # each client its own t
        return state | self.optimizer.init_state(state["hn"], steps)

    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def payloads(self, state: State, cids: list[int], rnd: int) -> dict[int, Message]:
        idx = torch.as_tensor(cids, device=state["theta"].device)
        raw = self.raw_of(state, cids)
        alpha, retained = self.mixing_weights(raw, idx)
        mixed = self.mix(state["theta"], alpha)
        if rnd > 0:  # a training round: aggregate's gradient needs these weights and this mixture again
            self.sent.put(cids, self.sources(state), raw, mixed)
        kept = retained.tolist()
        return {cid: {name: mixed[r, s] for l, (name, s) in enumerate(self.groups) if not kept[r][l]}
                for r, cid in enumerate(cids)}

    def starts(self, payloads: list[Message], cstates: list[State]) -> torch.Tensor:
        """Each client's own vector (kept layers, BN statistics) with the sent layers written in: (C, D)."""
        return torch.stack([fill(s["weights"], p, self.slices) for p, s in zip(payloads, cstates)])

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        trained, losses = cohort.train(self.starts(payloads, cstates))
        return [make_update(n, loss, weights=w) for w, n, loss in zip(trained, cohort.num_samples, losses)], \
            [{"weights": w.clone()} for w in trained]

    def evaluated_models(self, payloads, cstates, cohort):
        """The personalized layers over the client's own kept layers and BN statistics."""
        return list(self.starts(payloads, cstates))

    def sources(self, state: State) -> list[torch.Tensor]:
        """What the payloads are computed from: while none of it changes, aggregate reuses them."""
        return [state["theta"], *state["hn"].values()]

    def hn_gradients(self, state: State, cids: list[int], trained: torch.Tensor):
        """The vector-Jacobian product of the given clients' personalized parameters with delta, block by block:
        yields (positions in cids, the rows' gradients, the rows they were taken at: a copy in the compute dtype,
        for the optimizer to update). First through the normalization for all clients at once (small: clients x
        layers x N), then through each block's hypernetworks."""
        theta = state["theta"]
        idx = torch.as_tensor(cids, device=theta.device)
        raw, mixed = self.sent.take(cids, self.sources(state)) or (self.raw_of(state, cids), None)
        alpha, _ = self.mixing_weights(raw.requires_grad_(True), idx)
        with torch.no_grad():
            delta = (self.mix(theta, alpha) if mixed is None else mixed) - trained[:, : self.model.param_size]
            if self.params.delta_sign == "new_minus_old":  # (delta is old - new)
                delta.neg_()
            # d<delta, theta_bar>/d alpha_l = Delta_l Theta_l^T: (clients, P_l) x (P_l, N), one product per layer
            grad_alpha = torch.stack([delta[:, s] @ theta[:, s].T for _, s in self.groups], dim=1)
        alpha.backward(grad_alpha)  # kept layers are constants (one-hot): their heads get no gradient
        for at, _ in blocks(cids, self.block(), theta.device):
            sub = {k: v.requires_grad_(True) for k, v in rows_of(state["hn"], idx[at], theta.dtype).items()}
            self.raw_weights(sub).backward(raw.grad[at])
            yield at, {k: v.grad for k, v in sub.items()}, {k: v.detach() for k, v in sub.items()}

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        # every trained client updates its own hypernetwork; the sampler's weights play no part
        cids = list(updates)
        trained = torch.stack([updates[c]["weights"] for c in cids])
        idx = torch.as_tensor(cids, device=trained.device)
        for at, grads, rows in self.hn_gradients(state, cids, trained):
            with torch.no_grad():
                self.optimizer.step(state, grads, idx[at], rows)
        with torch.no_grad():
            state["theta"][idx] = trained
        return state

    def personalized(self, state: State, cids: list[int]) -> torch.Tensor:
        """The vectors the given clients are evaluated with, as the server sees them: the mixed parameters over each
        client's own BN statistics (its Theta row), (C, D)."""
        idx, alpha, _ = self._weights_of(state, cids)
        theta = state["theta"]
        with torch.no_grad():
            return torch.cat([self.mix(theta, alpha), theta[idx][:, self.model.param_size:]], dim=1)

    def describe(self) -> dict:
        return {"alpha_layers": [name for name, _ in self.groups],
                "alpha_axes": ["target client", "layer", "source client"]}

    def observables(self, state: State) -> dict[str, torch.Tensor]:
        if not self.params.save_alpha:
            return {}
        _, alpha, retained = self._weights_of(state, list(range(self.num_clients)))
        out = {"alpha": alpha.float().cpu().numpy()}
        if self.params.k > 0:
            out["alpha_retained"] = retained.cpu().numpy()
        return out


@register
class HeurPFedLA(PFedLA):
    """pFedLA with the k layers of highest self-weight kept local (k = 1 in the paper's Tables 1 and 2)."""
    name = "heurpfedla"
    Params = HeurPFedLAParams
