"""The client side of a round, in process: every client's state and data on this machine, a round's clients
trained as one cohort (lockstep where it pays). A Flower ClientApp runs the same functions for a cohort of one.

A transport answers two calls of the server: `fit(rnd, payloads)` -> updates and `evaluate(rnd, payloads,
global_model, train_loss)` -> per-client scores (numbers only), both keyed by client id."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..algorithms import Algorithm
from ..config import LocalConfig, RuntimeConfig
from ..data import ClientData, FederatedData
from ..models import FlatModel
from ..runtime import ClientRunner
from ..train import Cohort, predict, seeded_generator

EVAL_STREAM = 0xE7A1  # key of the generators an evaluation-time adaptation draws its batches from


def fit_clients(algo: Algorithm, data: FederatedData, model: FlatModel, hp: LocalConfig, seed: int, rnd: int,
                cids: list[int], payloads: list[dict], cstates: list[dict], positions: list[int] | None = None,
                runtime: RuntimeConfig | ClientRunner | None = None) -> tuple[list[dict], list[dict]]:
    """One round of local work for clients `cids` (their ids key their batch streams), found in `data` at
    `positions` (default: at their ids; a Flower ClientApp holds its own client only)."""
    cohort = Cohort(positions or cids, rnd, data, model, hp, [seeded_generator(seed, rnd, c) for c in cids],
                    runtime=runtime)
    return algo.client_update(payloads, cstates, cohort)


def eval_vectors(algo: Algorithm, train_only: FederatedData, model: FlatModel, hp: LocalConfig, seed: int, rnd: int,
                 cids: list[int], payloads: list[dict], cstates: list[dict], positions: list[int] | None = None,
                 runtime: RuntimeConfig | ClientRunner | None = None) -> list[torch.Tensor]:
    """The vectors the clients are scored with, built from what they may read: their train splits only (the test
    splits are not even in reach), each with a generator of its own for this evaluation."""
    cohort = Cohort(positions or cids, rnd, train_only, model, hp,
                    [seeded_generator(seed, rnd, c, EVAL_STREAM) for c in cids], runtime=runtime)
    return algo.evaluated_models(payloads, cstates, cohort)


def score(model: FlatModel, vector: torch.Tensor, client: ClientData, train_loss: bool) -> tuple[int, float]:
    """(correct test predictions, summed cross-entropy on the train split or 0.0) of one client's model."""
    model.load(vector)
    correct = int(predict(model, client.x_test, client.y_test)[0].sum())
    loss = float(predict(model, client.x_train, client.y_train)[1].sum().double()) if train_loss else 0.0
    return correct, loss


class InProcessClients:
    """All clients on this machine: their states in a list, their data in one FederatedData."""

    def __init__(self, algo: Algorithm, data: FederatedData, model: FlatModel, hp: LocalConfig, seed: int,
                 runtime: RuntimeConfig | None = None):
        self.algo, self.data, self.model, self.hp, self.seed = algo, data, model, hp, seed
        self.runner = ClientRunner(model, runtime)  # how the clients train: kept for the whole run
        self.train_only = data.train_only()  # what evaluation-time adaptation may read
        self._global: tuple[Any, Any, dict] | None = None  # (round, vector, scores) of the last pass

    def init_states(self, init: torch.Tensor) -> list[dict]:
        return [self.algo.init_client(cid, init) for cid in range(self.data.num_clients)]

    def reset(self, init: torch.Tensor) -> None:
        self.cstates = self.init_states(init)

    def fit(self, rnd: int, payloads: dict[int, dict]) -> dict[int, dict]:
        cids = list(payloads)
        updates, states = fit_clients(self.algo, self.data, self.model, self.hp, self.seed, rnd, cids,
                                      [payloads[c] for c in cids], [self.cstates[c] for c in cids],
                                      runtime=self.runner)
        for cid, state in zip(cids, states):
            self.cstates[cid] = state
        return dict(zip(cids, updates))

    def evaluate(self, rnd: int, payloads: dict[int, dict], global_model: torch.Tensor | None,
                 train_loss: bool) -> dict[int, dict]:
        cids = list(payloads)
        vectors = eval_vectors(self.algo, self.train_only, self.model, self.hp, self.seed, rnd, cids,
                               [payloads[c] for c in cids], [self.cstates[c] for c in cids], runtime=self.runner)
        glob = self._global_scores(rnd, global_model, train_loss)
        own = [j for j, vec in enumerate(vectors) if glob is None or vec is not global_model]
        scores: dict[int, tuple[int, float]] = {}

        def score_one(model: FlatModel, k: int) -> None:
            j = own[k]
            scores[j] = score(model, vectors[j], self.data.client(cids[j]), train_loss)
        self.runner.side_by_side(len(own), score_one)
        out = {}
        for j, cid in enumerate(cids):
            if j in scores:
                correct, loss = scores[j]
            else:  # the global model, scored once for all clients
                correct, loss = int(glob["correct"][cid]), float(glob["loss"][cid])
            out[cid] = {"correct": correct, "train_loss_sum": loss}
            if glob is not None:
                out[cid].update(global_correct=int(glob["correct"][cid]), global_train_loss_sum=float(glob["loss"][cid]))
        return out

    def _global_scores(self, rnd: int, vec: torch.Tensor | None, train_loss: bool) -> dict | None:
        """The global model on every client's test (and train) split in one pass, kept for the evaluation's chunks."""
        if vec is None:
            return None
        if self._global is not None and self._global[0] == (rnd, train_loss) and self._global[1] is vec:
            return self._global[2]
        d = self.data
        self.model.load(vec)

        def per_client(values: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
            cum = torch.cat([torch.zeros(1, device=values.device, dtype=torch.float64), values.double().cumsum(0)])
            off = torch.as_tensor(offsets, device=values.device)
            return (cum[off[1:]] - cum[off[:-1]]).cpu().numpy()

        chunks = self.runner.parallel  # the chunks side by side: the run's cores, or a job's workers
        correct = per_client(predict(self.model, d.x_test, d.y_test, parallel=chunks)[0], d.test_offsets)
        loss = per_client(predict(self.model, d.x_train, d.y_train, parallel=chunks)[1], d.train_offsets) \
            if train_loss else np.zeros(d.num_clients)
        self._global = ((rnd, train_loss), vec, {"correct": np.rint(correct).astype(np.int64), "loss": loss})
        return self._global[2]

    def state(self) -> list[dict]:
        return self.cstates

    def restore(self, cstates: list[dict]) -> None:
        self.cstates = cstates
