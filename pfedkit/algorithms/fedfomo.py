"""FedFomo (Zhang et al., "Personalized Federated Learning with First Order Model Optimization", ICLR 2021;
NVlabs/FedFomo; docs/baselines.md).

The server keeps every client's latest uploaded model (Theta, N x D), an affinity matrix P (N x N; P[i, j]: how
much client j's models have helped client i) and which clients have uploaded at least once. Each sampled client
downloads M peers' models, picked epsilon-greedily over its affinity row (eps_t = max(0, eps0 - decay (t - 1)) at
round t): for each pick, with probability eps_t a random not-yet-picked eligible peer, else the not-yet-picked
eligible peer of highest affinity (random tie-break). Eligible: uploaded at least once, not the client itself.

On the client, with b its current model and L the mean cross-entropy on its validation split (a fixed part of its
train split, `Cohort.holdout`; no test data is read):
    w_j = (L(b) - L(theta_j)) / ||theta_j - b||      (norm over the parameters; L2, or L1 as the official code)
keep the positive w_j, normalize them to sum 1, theta = b + sum_j w_j (theta_j - b) (b if none is positive), then
local training of theta on the rest of the train split. It uploads the trained model and its raw w_j (at the peer
ids, an N-vector) for the server to add into its affinity row. Down the wire go the M' <= M peer models and their
ids (counted from the payload tensors: M' (D + 1) float32 per client); nothing for evaluation (a client is scored
with its own model).

Differences from the references, on purpose:
- the base b is the client's current model (FL-bench); the official default 'first_model' is the model saved right
  after its previous federated update, i.e. before its last local training.
- candidates are the M downloaded peers only: the official code also offers the client's own latest model and
  the server's global/sub-federation models (off here, as the spec recommends).
- a peer at distance 0 from b is skipped (it equals b and brings nothing) instead of FL-bench's norm + 1e-5.
- BatchNorm running statistics (models with BN) are mixed with the same weights as the parameters (the official
  code mixes the whole state dict); the distance is over the parameters only.
- P starts at zeros (FL-bench: identity): a client is never its own candidate, so the diagonal never takes part in a
  choice, and zeros keep the logged matrix the plain sum of what the clients reported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import at_least, choices
from ..registry import register
from ..train import Cohort, predict, seeded_generator
from .base import Algorithm, Message, State, make_update, stacked

SELECTION_STREAM = 0xF0F0  # key of the server's peer-selection generator, with (seed, round)


@dataclass
class FedFomoParams:
    models: int = at_least(1, 5)  # M peers downloaded per round (FL-bench 5; official README 4 or 9)
    epsilon: float = at_least(0.0, 0.3, high=1.0)  # eps0 of the epsilon-greedy selection (official 0.3)
    epsilon_decay: float = at_least(0.0, 0.05)  # per round (official 0.05)
    # of each client's train split (every round(1/val_fraction)-th sample); at most 0.5 so at least half is fitted on
    val_fraction: float = at_least(0.0, 0.2, high=0.5, open_low=True)
    distance: str = choices("l2", "l1", default="l2")  # FL-bench: L2 of the flat parameters; official: l1
    affinity_update: str = choices("raw", "normalized", default="raw")  # FL-bench adds w; official w / |sum w|


@register
class FedFomo(Algorithm):
    name = "fedfomo"
    Params = FedFomoParams
    has_global_model = False

    # -- server -------------------------------------------------------------------------------------------------
    def init_server(self, init: torch.Tensor) -> State:
        n = self.num_clients
        return {"theta": init.repeat(n, 1), "affinity": init.new_zeros(n, n), "seen": init.new_zeros(n)}

    def epsilon(self, rnd: int) -> float:
        return max(0.0, self.params.epsilon - self.params.epsilon_decay * (rnd - 1))

    def select(self, state: State, cids: list[int], rnd: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sampled client's picks at once: (ids (C, M) long, valid (C, M) bool), pick by pick; a client with
        fewer than M eligible peers gets fewer (valid marks the real picks, in pick order)."""
        device = state["affinity"].device
        c, n, m = len(cids), self.num_clients, self.params.models
        rows, at = torch.as_tensor(cids, device=device), torch.arange(c, device=device)
        affinity = state["affinity"][rows]  # (C, N)
        eligible = (state["seen"] > 0)[None, :].expand(c, n).clone()
        eligible[at, rows] = False  # never oneself
        gen, eps = seeded_generator(self.seed, rnd, SELECTION_STREAM), self.epsilon(rnd)
        ids = torch.zeros(c, m, dtype=torch.long, device=device)
        valid = torch.zeros(c, m, dtype=torch.bool, device=device)
        for k in range(m):  # drawn in the same order every time: resumed runs pick the same peers
            explore = torch.rand(c, generator=gen).to(device) < eps
            noise = torch.rand(c, n, generator=gen).to(device)  # uniform choice among the candidates of a row
            best = affinity.masked_fill(~eligible, -torch.inf).amax(1, keepdim=True)
            candidates = eligible & (explore[:, None] | (affinity == best))  # explore: any; else the best (ties)
            pick = noise.masked_fill(~candidates, -1.0).argmax(1)
            valid[:, k] = eligible.any(1)
            ids[:, k] = pick
            eligible[at, pick] = False
        return ids, valid

    def payloads(self, state: State, cids: list[int], rnd: int) -> dict[int, Message]:
        ids, valid = self.select(state, cids, rnd)
        picked = ids[valid]
        peers = state["theta"][picked]  # one gather for the round, then cut per client
        counts = valid.sum(1).tolist()
        out, start = {}, 0
        for r, cid in enumerate(cids):
            end = start + counts[r]
            out[cid] = {"peers": peers[start:end], "peer_ids": picked[start:end].to(peers.dtype)}
            start = end
        return out

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        # every trained client stores its model and reports its weights; the sampler's weights play no part
        cids = list(updates)
        idx = torch.as_tensor(cids, device=state["theta"].device)
        rows = torch.stack([updates[c]["affinity"] for c in cids])
        if self.params.affinity_update == "normalized":
            total = rows.sum(1, keepdim=True).abs()
            rows = torch.where(total > 0, rows / total.clamp_min(1e-30), rows)
        state["affinity"].index_add_(0, idx, rows)
        state["theta"].index_copy_(0, idx, torch.stack([updates[c]["weights"] for c in cids]))
        state["seen"][idx] = 1.0
        return state

    def eval_payloads(self, state: State, cids: list[int]) -> dict[int, Message]:
        return {c: {} for c in cids}  # a client is scored with its own model: nothing to send

    def update_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weights": (self.model.size,), "affinity": (self.num_clients,)}

    def describe(self) -> dict:
        return {"affinity_axes": ["client", "peer"]}

    def observables(self, state: State) -> dict:
        return {"affinity": state["affinity"].float().cpu().numpy()}

    # -- client -------------------------------------------------------------------------------------------------
    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def val_loss(self, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.model.load(vector)
        return predict(self.model, x, y)[1].double().mean()

    def peer_weights(self, base: torch.Tensor, peers: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The raw w_j of the peers (M',): validation-loss gain over parameter distance; 0 for a peer equal to b."""
        p = self.model.param_size
        gain = self.val_loss(base, x, y) - torch.stack([self.val_loss(theta, x, y) for theta in peers])
        dist = torch.linalg.vector_norm((peers[:, :p] - base[:p]).double(), ord=1 if self.params.distance == "l1"
                                        else 2, dim=1)
        return torch.where(dist > 0, gain / dist.clamp_min(1e-30), 0.0).to(base.dtype)

    @staticmethod
    def mix(base: torch.Tensor, peers: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """b + sum_j w_j (theta_j - b) with the positive w_j normalized to sum 1; b if none is positive. The whole
        vector, BatchNorm statistics included, as the official code mixes the whole state dict."""
        positive = raw.clamp_min(0)
        if positive.sum() <= 0:
            return base.clone()
        return base + (positive / positive.sum()) @ (peers - base)

    def client_update(self, payloads: list[Message], cstates: list[State], cohort: Cohort):
        fit, val = cohort.holdout(self.params.val_fraction)
        bases = stacked(cstates)
        starts = bases.clone()
        rows = bases.new_zeros(len(bases), self.num_clients)
        for i, (payload, (x, y)) in enumerate(zip(payloads, val)):
            peers = payload["peers"]
            if len(peers) == 0:  # nobody to learn from yet (round 1): just train
                continue
            raw = self.peer_weights(bases[i], peers, x, y)
            rows[i, payload["peer_ids"].long()] = raw
            starts[i] = self.mix(bases[i], peers, raw)
        trained, losses = fit.train(starts)
        return [make_update(n, loss, weights=w, affinity=r)
                for w, r, n, loss in zip(trained, rows, fit.num_samples, losses)], \
            [{"weights": w.clone()} for w in trained]

    def evaluated_models(self, payloads, cstates, cohort):
        return [s["weights"] for s in cstates]
