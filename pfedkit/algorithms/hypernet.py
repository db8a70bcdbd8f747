"""The server machinery pFedLA and pFedHN share, kept out of their files so that those read like the papers:

- `HypernetOptimizer`: torch.optim.SGD's and Adam's rules on the hypernetwork tensors of a server state, either
  whole (pFedHN: one hypernetwork) or on some rows of client-stacked tensors (pFedLA: one hypernetwork per client,
  each row with its own velocity, moments and step count);
- `blocks`, `clients_per_block`: a round's clients in blocks of bounded memory (pFedLA at N = 1,000);
- `PayloadCache`: what a round's payloads were computed from, for aggregate to reuse while the state is unchanged.

The optimizer's state sits in the server state under fixed keys (`hn_velocity` or pFedHN's `hn_momentum`,
`hn_adam_m`, `hn_adam_v`, `hn_steps`), so a checkpoint is plain tensors and a resumed run steps on exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults

Tensors = dict[str, torch.Tensor]


def rows_of(hn: Tensors, idx: torch.Tensor | slice, dtype: torch.dtype) -> Tensors:
    """Some clients' rows of client-stacked tensors in the compute dtype: for an index tensor a copy (what autograd
    and the optimizer work on), for a slice in the storage dtype a view (read only)."""
    return {k: v[idx].to(dtype) for k, v in hn.items()}


def gather(stored: torch.Tensor, idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """What a step updates in place: the stored tensor itself, or a copy of its rows idx in the compute dtype."""
    return stored if idx is None else stored.index_select(0, idx).to(dtype)


def store(stored: torch.Tensor, idx: torch.Tensor | None, rows: torch.Tensor) -> None:
    """Write updated rows back, rounded to the stored dtype (a whole tensor was updated in place already)."""
    if idx is not None:
        stored.index_copy_(0, idx, rows.to(stored.dtype))


@dataclass
class HypernetOptimizer:
    """One step of torch.optim.SGD (L2 weight decay, momentum buffer starting at the first gradient, no dampening)
    or torch.optim.Adam (L2 weight decay, bias-corrected moments) on `state["hn"]`, in place (pFedHN's head is the
    model's size x 100: every full-size temporary costs).

    `step(state, grads)` steps every tensor whole, with one step count (a scalar `hn_steps`), in torch's order of
    operations (SGD bit for bit). `step(state, grads, idx, rows)` steps the rows idx of client-stacked tensors only,
    each client with its own step count (`hn_steps[i]`: a client is stepped only when it trains, so its t counts its
    own rounds); `rows` are those rows in the compute dtype, where moments and parameters are computed, then stored
    rounded to the stored dtype (bfloat16 halves pFedLA's state at large N). This layout rounds the last operations
    in another order (per-row bias corrections; lr x step apart for SGD): the order pFedLA's results and checkpoints
    were made with. Both agree with torch.optim to the last bits (2e-16 in float64, tests/test_hypernet.py).
    """
    kind: str  # "sgd" or "adam"
    lr: float
    momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0
    lrs: dict[str, float] = field(default_factory=dict)  # per-tensor learning rates (pFedHN's embed_lr)
    velocity_key: str = "hn_velocity"  # where SGD's momentum buffers sit in the server state

    def init_state(self, hn: Tensors, steps: torch.Tensor) -> dict:
        """The optimizer's entries of a new server state; `steps` the zero step counts (one per client, or one)."""
        zeros = lambda: {k: torch.zeros_like(v) for k, v in hn.items()}  # noqa: E731
        if self.kind == "adam":
            return {"hn_adam_m": zeros(), "hn_adam_v": zeros(), "hn_steps": steps}
        return {self.velocity_key: zeros()} if self.momentum > 0 else {}

    def step(self, state: dict, grads: Tensors, idx: torch.Tensor | None = None, rows: Tensors | None = None) -> None:
        """One step on `grads` (consumed): of every tensor whole (idx None) or of the rows idx, which `rows` hold."""
        params = state["hn"] if rows is None else rows
        if self.weight_decay:
            grads = {k: g.add_(params[k], alpha=self.weight_decay) for k, g in grads.items()}
        (self.adam if self.kind == "adam" else self.sgd)(state, grads, idx, params)

    def sgd(self, state: dict, grads: Tensors, idx: torch.Tensor | None, params: Tensors) -> None:
        for k, stored in state["hn"].items():
            d, lr = grads[k], self.lrs.get(k, self.lr)
            if self.momentum > 0:  # a zero buffer makes the first step buf = d, as torch's
                velocity = state[self.velocity_key][k]
                d = gather(velocity, idx, d.dtype).mul_(self.momentum).add_(d)
                store(velocity, idx, d)
            if idx is None:
                stored.add_(d, alpha=-lr)
            else:
                store(stored, idx, params[k].sub_(lr * d))

    def adam(self, state: dict, grads: Tensors, idx: torch.Tensor | None, params: Tensors) -> None:
        (b1, b2), eps = ADAM_BETAS, ADAM_EPS
        steps = state["hn_steps"]
        if idx is None:
            steps += 1
            t = float(steps)
        else:
            t = steps[idx] + 1
            steps[idx] = t
        for k, stored in state["hn"].items():
            g, lr = grads[k], self.lrs.get(k, self.lr)
            # in place, each moment stored once: the one-expression form allocates six temporaries per tensor,
            # which dominated pFedLA's round at N = 1,000 (benchmarks/bench_pfedla_server.py)
            m = gather(state["hn_adam_m"][k], idx, g.dtype).mul_(b1).add_(g, alpha=1 - b1)
            v = gather(state["hn_adam_v"][k], idx, g.dtype).mul_(b2).addcmul_(g, g, value=1 - b2)
            store(state["hn_adam_m"][k], idx, m)
            store(state["hn_adam_v"][k], idx, v)
            if idx is None:  # lr m_hat / (sqrt(v_hat) + eps), as torch.optim.Adam orders it
                denom = v.sqrt().div_(math.sqrt(1 - b2 ** t)).add_(eps)
                stored.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
            else:  # the same with each row's own t, broadcast over the row
                shape = (-1,) + (1,) * (g.dim() - 1)
                denom = v.div_((1 - b2 ** t).view(shape)).sqrt_().add_(eps)
                store(stored, idx, params[k].sub_(m.div_((1 - b1 ** t).view(shape)).div_(denom), alpha=lr))


# -- memory ------------------------------------------------------------------------------------------------------
BLOCK_BYTES = 8 << 20


def clients_per_block(bytes_per_client: int) -> int:
    """Clients per block of the server's per-client work: a block's tensors (a few times BLOCK_BYTES) stay in the
    32 MB cache and below glibc's mmap threshold, so they are reused instead of page-faulted anew (at N = 1,000 a
    pFedLA client's heads are 2 MB, a round's 200 MB; benchmarks/bench_pfedla_server.py measures the round)."""
    return max(1, BLOCK_BYTES // bytes_per_client)


def blocks(cids: list[int], size: int, device: torch.device):
    """The given clients in blocks of `size`: (positions in cids, what reads their rows: a slice for a consecutive
    run, read in place, else an index tensor, whose rows are gathered)."""
    first = cids[0] if cids else 0
    consecutive = list(cids) == list(range(first, first + len(cids)))
    idx = torch.as_tensor(cids, dtype=torch.long, device=device)
    for a in range(0, len(cids), size):
        end = min(a + size, len(cids))
        yield slice(a, end), (slice(first + a, first + end) if consecutive else idx[a: end])


class Versions:
    """Tensors and how often each was changed in place: equal only to the same tensors (held, so that no new tensor
    can take their place) at the same versions."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.counts = [t._version for t in tensors]

    def __eq__(self, other) -> bool:
        return len(self.tensors) == len(other.tensors) and self.counts == other.counts and \
            all(a is b for a, b in zip(self.tensors, other.tensors))


class PayloadCache:
    """Per-client rows (one row per client of a round) that a round's payloads were computed from, kept for one
    look-up: pFedLA's aggregate needs its round's weights and mixture again, and computing them anew is a second
    forward and N x P mixture. They hold only while the tensors they came from, and they themselves (payloads may
    be views of them), were not changed in place since, which the tensors' version counters show. Never saved: a
    checkpoint has none."""

    def __init__(self):
        self.entry: tuple[list[int], tuple[torch.Tensor, ...], Versions] | None = None

    def put(self, cids: list[int], sources: list[torch.Tensor], *rows: torch.Tensor) -> None:
        self.entry = list(cids), rows, Versions([*sources, *rows])

    def take(self, cids: list[int], sources: list[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        """The kept rows of the given clients in their order, and let go; None where they were not kept or no
        longer hold."""
        entry, self.entry = self.entry, None
        if entry is None:
            return None
        kept, rows, versions = entry
        if versions != Versions([*sources, *rows]) or not set(cids) <= set(kept):
            return None
        if cids == kept:
            return rows
        at = {c: r for r, c in enumerate(kept)}
        index = torch.as_tensor([at[c] for c in cids], device=rows[0].device)
        return tuple(r[index] for r in rows)
