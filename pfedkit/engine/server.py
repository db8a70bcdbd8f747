"""The server side of a round, whatever carries the messages: sample, send, collect, check, aggregate; and the
evaluation of every client. The in-process simulator and the Flower ServerApp both run this class over a
transport (engine.clients.InProcessClients, flower.server.FlowerClients)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..algorithms import Algorithm
from ..errors import UpdateError
from ..sampling import Sampler
from .checks import check_update, representative_gradient, tensor_bytes

EVAL_CHUNK = 256  # clients whose eval payloads are built at once (bounds pFedLA's mixture memory)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RoundStats:
    clients: int = 0  # clients asked to train
    aggregated: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    server_s: float = 0.0
    losses: list = field(default_factory=list)  # (train_loss, num_samples) of the accepted updates
    missing: list = field(default_factory=list)  # clients that did not answer
    rejected: list = field(default_factory=list)  # (client, reason) of replies refused

    def train_loss(self) -> float | None:
        weight = sum(w for _, w in self.losses)
        return sum(l * w for l, w in self.losses) / weight if weight else None


class Server:
    """The algorithm's server state and the sampler's, stepped one round at a time over a transport.

    `strict`: a bad reply stops the run (in process, where it means diverged training or a bug); otherwise (a
    deployment) it is logged and left out, and only a round without any good reply stops the run."""

    def __init__(self, algo: Algorithm, sampler: Sampler, device: torch.device, *, strict: bool = True,
                 min_replies: int = 1, log: Callable[[str], None] = print):
        self.algo, self.sampler, self.device, self.strict, self.log = algo, sampler, device, strict, log
        self.min_replies = min_replies  # fewer usable updates in a round: the run stops
        self.shapes = algo.update_shapes()

    def reset(self, init: torch.Tensor) -> None:
        self.state = self.algo.init_server(init)
        # representative gradients over the parameters only: BatchNorm running statistics are no gradient (and
        # would carry most of the norm, making every client look alike)
        self.sampler_state = self.sampler.init_state(self.algo.model.param_size, init)

    def _timed(self, stats: RoundStats, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        _sync(self.device)
        stats.server_s += time.perf_counter() - t0
        return out

    def train_round(self, rnd: int, clients) -> RoundStats:
        """Sample, send, train, aggregate: one round. Synchronous by default (every client starts from the same
        server state); an algorithm may ask for its clients to be served one after another. Where every client
        trains (pFedMe's code), the sampler picks who aggregates after training, from fresh gradients."""
        algo, sampler = self.algo, self.sampler
        weights = None if algo.trains_all else sampler.select(self.sampler_state, rnd)
        cids = list(range(algo.num_clients)) if algo.trains_all else list(weights)
        stats = RoundStats(clients=len(cids))
        sent_global = algo.global_model(self.state) if sampler.needs_gradients else None
        sent_global = None if sent_global is None else sent_global[: algo.model.param_size].clone()
        updates: dict[int, dict] = {}
        for group in ([[c] for c in cids] if algo.sequential else [cids]):
            payloads = self._timed(stats, lambda: algo.payloads(self.state, group, rnd))
            replies = clients.fit(rnd, {c: payloads[c] for c in group})
            accepted = self._accept(rnd, group, replies, stats)
            stats.bytes_down += sum(tensor_bytes(payloads[c]) for c in group)
            stats.bytes_up += sum(tensor_bytes(replies[c]) for c in group if isinstance(replies.get(c), dict))
            updates.update(accepted)
            if algo.sequential and accepted:
                self._aggregate(accepted, {c: 1.0 for c in accepted}, rnd, stats)
        if len(updates) < min(self.min_replies, len(cids)) or not updates:
            raise UpdateError(f"round {rnd}: {len(updates)} of {len(cids)} clients sent a usable update (at least "
                              f"{self.min_replies} needed; {self._faults(stats)}); the run stops")
        if sent_global is not None:  # representative gradients: what each client's training did to the model
            self.sampler_state = sampler.observe(self.sampler_state, {
                c: representative_gradient(u, sent_global) for c, u in updates.items()})
        if algo.trains_all:
            weights = sampler.select(self.sampler_state, rnd)
        weights = self._present(weights, updates, rnd)
        if not algo.sequential:
            self._aggregate(updates, weights, rnd, stats)
        stats.aggregated = len(weights)
        return stats

    def _accept(self, rnd: int, group: list[int], replies: dict[int, dict], stats: RoundStats) -> dict[int, dict]:
        accepted = {}
        for cid in group:
            if cid not in replies:
                stats.missing.append(cid)
                continue
            try:
                if isinstance(replies[cid], UpdateError):  # the transport could not even read it as an update
                    raise replies[cid]
                check_update(replies[cid], cid, rnd, self.algo.divergence_hint, self.shapes)
            except UpdateError as exc:
                if self.strict:
                    raise
                stats.rejected.append((cid, str(exc)))
                self.log(f"rejected: {exc}")
                continue
            accepted[cid] = replies[cid]
            stats.losses.append((replies[cid]["train_loss"], replies[cid]["num_samples"]))
        if stats.missing:
            if self.strict:
                raise UpdateError(f"round {rnd}: clients {stats.missing} did not answer")
            self.log(f"round {rnd}: no reply from clients {stats.missing}; the round goes on without them")
        return accepted

    @staticmethod
    def _faults(stats: RoundStats) -> str:
        parts = [f"client {c}: {why.split(': ', 1)[-1]}" for c, why in stats.rejected[:3]]
        if stats.missing:
            parts.append(f"no reply from clients {stats.missing}")
        return "; ".join(parts) or "no replies"

    def _present(self, weights: dict[int, float], updates: dict[int, dict], rnd: int) -> dict[int, float]:
        """The sampler's weights over the clients whose updates arrived, renormalized to sum 1 (all of them, in
        process)."""
        kept = {c: w for c, w in weights.items() if c in updates}
        if len(kept) == len(weights):
            return weights
        lost = sorted(set(weights) - set(kept))
        self.log(f"round {rnd}: aggregating without clients {lost} (no usable update); the others' weights are "
                 "rescaled to sum 1")
        total = sum(kept.values())
        return {c: w / total for c, w in kept.items()} if total > 0 else {c: 1 / len(kept) for c in kept}

    def _aggregate(self, updates: dict, weights: dict, rnd: int, stats: RoundStats) -> None:
        self.state = self._timed(stats, lambda: self.algo.aggregate(self.state, updates, weights, rnd))

    def evaluate(self, rnd: int, clients, num_clients: int, train_loss: bool) -> dict[int, dict]:
        """Every client's scores (numbers: correct test predictions, summed train loss, and the global model's
        where one exists), chunk by chunk."""
        global_model = self.algo.global_model(self.state)
        scores: dict[int, dict] = {}
        for first in range(0, num_clients, EVAL_CHUNK):
            cids = list(range(first, min(first + EVAL_CHUNK, num_clients)))
            with torch.no_grad():
                payloads = self.algo.eval_payloads(self.state, cids)
            scores.update(clients.evaluate(rnd, payloads, global_model, train_loss))
        return scores


def metrics_row(scores: dict[int, dict], test_sizes: np.ndarray, train_sizes: np.ndarray, has_global: bool,
                train_loss: bool) -> tuple[dict, np.ndarray]:
    """The evaluation's metrics from every client's scores: personalized accuracy per client (mean, sample-weighted
    mean, std, 10th percentile), the global model's where one exists, the train losses if asked."""
    cids = sorted(scores)
    test = test_sizes[cids].astype(np.float64)
    train = train_sizes[cids].astype(np.float64)
    acc = np.array([scores[c]["correct"] for c in cids], dtype=np.float64) / test
    loss = np.array([scores[c]["train_loss_sum"] for c in cids], dtype=np.float64)
    g_correct = np.array([scores[c]["global_correct"] for c in cids], dtype=np.float64) if has_global else None
    g_loss = np.array([scores[c]["global_train_loss_sum"] for c in cids], dtype=np.float64) if has_global else None
    row = {
        "personalized_acc": float(acc.mean()),
        "personalized_acc_weighted": float((acc * test).sum() / test.sum()),
        "personalized_acc_std": float(acc.std()),
        "personalized_acc_p10": float(np.percentile(acc, 10)),
        "global_acc": float((g_correct / test).mean()) if has_global else None,
        "global_acc_weighted": float(g_correct.sum() / test.sum()) if has_global else None,
        "personalized_train_loss": float(loss.sum() / train.sum()) if train_loss else None,
        "global_train_loss": float(g_loss.sum() / train.sum()) if has_global and train_loss else None,
    }
    return row, acc
