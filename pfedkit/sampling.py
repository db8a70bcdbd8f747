"""Client sampling. The stream depends only on (seed, round, client count), so every algorithm of a comparison
sees the same clients in the same rounds, and a resumed run samples what an uninterrupted one would."""
from __future__ import annotations

import numpy as np
import torch


def uniform_sample(seed: int, rnd: int, num_clients: int, per_round: int) -> list[int]:
    """`per_round` distinct clients, uniformly without replacement (0 or >= num_clients: all of them)."""
    if per_round <= 0 or per_round >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, rnd, num_clients, 0x5A3])
    return sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False))


class Sampler:
    """Who aggregates each round and with what weight, for any algorithm (`sampling` in the config).

    - uniform: `per_round` distinct clients, weights proportional to their sample sizes (FedAvg's rule).
    - md: `per_round` draws from Categorical(p), p_i = n_i / n (Li et al.'s multinomial sampling).
    - clustered_size / clustered_similarity: one draw from each of `per_round` distributions built by
      Fraboni et al.'s Algorithm 1 (sample sizes) or 2 (similarity of the clients' representative gradients).
    For the drawn schemes a client's weight is its number of draws / m: the aggregate is unbiased because the
    mean of the distributions is p. The draws depend only on (seed, round, distributions).
    """

    def __init__(self, scheme: str, sizes: np.ndarray, per_round: int, seed: int, clustering=None):
        self.scheme, self.seed = scheme, seed
        self.n = len(sizes)
        self.sizes = np.asarray(sizes, dtype=np.float64)
        self.p = self.sizes / self.sizes.sum()
        self.m = per_round if 0 < per_round < self.n else self.n
        self.per_round = per_round
        self.clustering = clustering
        self._fixed = None
        if scheme == "md":
            self._fixed = md_distributions(self.p, self.m)
        elif scheme == "clustered_size":
            self._fixed = size_distributions(self.p, self.m)

    @property
    def needs_gradients(self) -> bool:
        return self.scheme == "clustered_similarity"

    def init_state(self, dim: int, like: "torch.Tensor") -> dict:
        """Representative gradients start at zero (specs §4.2)."""
        return {"gradients": like.new_zeros(self.n, dim)} if self.needs_gradients else {}

    def observe(self, state: dict, gradients: dict[int, "torch.Tensor"]) -> dict:
        """Refresh the representative gradients of the clients that trained."""
        if self.needs_gradients and gradients:
            cids = list(gradients)
            state["gradients"][cids] = torch.stack([gradients[c] for c in cids])
        return state

    def distributions(self, state: dict, rnd: int) -> np.ndarray | None:
        if self.scheme == "clustered_similarity":
            c = self.clustering
            G = state["gradients"].double().cpu().numpy()
            return similarity_distributions(G, self.p, self.m, distance=c.distance, linkage_input=c.linkage_input,
                                            clusters=c.clusters, rng=np.random.default_rng([self.seed, rnd, 0xC5]))
        return self._fixed

    def select(self, state: dict, rnd: int) -> dict[int, float]:
        """{client: aggregation weight} for this round (weights sum to 1)."""
        if self.scheme == "uniform":
            cids = uniform_sample(self.seed, rnd, self.n, self.per_round)
            total = self.sizes[cids].sum()
            return {c: float(self.sizes[c] / total) for c in cids}
        draws = draw_from_distributions(self.distributions(state, rnd),
                                        np.random.default_rng([self.seed, rnd, self.n, 0xD7]))
        weights: dict[int, float] = {}
        for c in sorted(draws):
            weights[c] = weights.get(c, 0.0) + 1.0 / len(draws)
        return weights
