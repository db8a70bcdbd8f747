"""Client sampling. The stream depends only on (seed, round, client count), so every algorithm of a comparison
sees the same clients in the same rounds, and a resumed run samples what an uninterrupted one would."""
from __future__ import annotations

import numpy as np


def uniform_sample(seed: int, rnd: int, num_clients: int, per_round: int) -> list[int]:
    """`per_round` distinct clients, uniformly without replacement (0 or >= num_clients: all of them)."""
    if per_round <= 0 or per_round >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, rnd, num_clients, 0x5A3])
    return sorted(int(c) for c in rng.choice(num_clients, per_round, replace=False))
