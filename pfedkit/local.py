"""A client's local work as the algorithms state it, independent of how it runs: its seeded batch stream and its
objective (cross-entropy plus an optional proximal pull, frozen entries and gradient clipping). The runtime
(pfedkit/runtime/) runs it; the algorithms build it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .config import LocalConfig


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator whose stream depends only on `key` (e.g. seed, round, client)."""
    seed = int(np.random.SeedSequence([abs(int(k)) for k in key]).generate_state(1, dtype=np.uint64)[0]) >> 1
    return torch.Generator().manual_seed(seed)


def batch_indices(n: int, hp: LocalConfig, gen: torch.Generator, device: torch.device) -> Iterator[torch.Tensor]:
    """Index batches over successive seeded permutations: `epochs` passes, or `steps` batches if steps > 0
    (the last batch of a pass may be smaller, as with a DataLoader that keeps it)."""
    b = hp.batch_size
    if hp.steps > 0:
        done = 0
        while done < hp.steps:
            perm = torch.randperm(n, generator=gen).to(device)
            for start in range(0, n, b):
                yield perm[start: start + b]
                done += 1
                if done == hp.steps:
                    return
        return
    for _ in range(hp.epochs):
        perm = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n, b):
            yield perm[start: start + b]


@dataclass
class Objective:
    """A local objective beyond the mean cross-entropy, for one client (vectors) or a cohort (rows): the proximal
    pull mu/2 ||theta - anchor||^2 (FedProx), and a 0/1 float `trainable` mask over the parameters whose zero entries
    stay frozen (a body or head held fixed). The same object serves the one-client and the lockstep path."""
    prox_anchor: torch.Tensor | None = None  # the anchor vector(s), (D,) or (C, D); only the parameter part is read
    prox_mu: float = 0.0
    trainable: torch.Tensor | None = None  # (P,) or (C, P)
    # > 0: the loss gradient is clipped to this total L2 norm before weight decay, prox and momentum, as
    # torch.nn.utils.clip_grad_norm_ does (pFedHN's inner loop); 0: off
    clip_norm: float = 0.0

    def row(self, i: int) -> "Objective":
        """Client i's part of a cohort's objective."""
        pick = lambda t: t[i] if t is not None and t.dim() == 2 else t  # noqa: E731
        return Objective(pick(self.prox_anchor), self.prox_mu, pick(self.trainable), self.clip_norm)

    def part(self, rows: list[int]) -> "Objective":
        """The part of a cohort's objective for its clients at positions `rows` (a cohort of their own)."""
        pick = lambda t: t[rows] if t is not None and t.dim() == 2 else t  # noqa: E731
        return Objective(pick(self.prox_anchor), self.prox_mu, pick(self.trainable), self.clip_norm)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


PLAIN = Objective()


