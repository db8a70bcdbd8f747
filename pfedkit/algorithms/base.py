"""The algorithm protocol (DESIGN.md): what the server sends, what a client does with it, how the server folds
the replies in. An algorithm never touches threads, files or progress bars; the engine (or a Flower app) runs it.

Payloads and updates are plain dicts of tensors and small scalars: exactly what would cross a network. Server and
client states are dicts of tensors too, so a checkpoint is a plain `torch.save`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..config import Config, LocalConfig, split_spec
from ..errors import ConfigError
from ..data import ClientData, FederatedData
from ..models import FlatModel
from ..train import BatchedLoss, batch_plan, batched_sgd, sgd

Message = dict[str, Any]  # named tensors plus small scalars
State = dict[str, Any]
LOCKSTEP_MIN_CLIENTS = 3  # below this the per-client path is as fast as lockstep (measured on MLR and DNN)


@dataclass
class NoParams:
    """This algorithm has no hyperparameters of its own."""


@dataclass
class ClientContext:
    """What a client has at hand while it runs `client_update`: its data, the shared model object, its
    seeded generator for this round, and the local training settings."""
    cid: int
    round: int
    data: ClientData
    model: FlatModel
    hp: LocalConfig
    gen: torch.Generator

    def train(self, start: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, float]:
        """Local SGD from `start` (see train.sgd for options); returns (trained vector, mean loss)."""
        self.model.load(start)
        loss = sgd(self.model, self.data, self.hp, self.gen, **kwargs)
        return self.model.state(), loss


@dataclass
class Cohort:
    """The clients a round trains, for algorithms that train them in lockstep (batched products) instead of one
    after another. Each client keeps its own seeded batch stream, so both paths see the same batches."""
    cids: list[int]
    round: int
    data: FederatedData
    model: FlatModel
    hp: LocalConfig
    gens: list[torch.Generator]

    def client(self, i: int) -> ClientContext:
        return ClientContext(self.cids[i], self.round, self.data.client(self.cids[i]), self.model, self.hp,
                             self.gens[i])

    @property
    def batchable(self) -> bool:
        """Lockstep training for small dense models (MLR, DNN: those with `forward_many`): there one client's step
        is too small to keep the cores busy, and batched products make it one step for all. Not for BatchNorm
        (running statistics are state) nor for convolutional models, which fill the cores on their own; not for
        fewer than LOCKSTEP_MIN_CLIENTS clients, where the per-client path is as fast (measured)."""
        return (hasattr(self.model.module, "forward_many") and self.model.size == self.model.param_size
                and len(self.cids) >= LOCKSTEP_MIN_CLIENTS)

    def lockstep_pays(self, hp: LocalConfig | None = None) -> bool:
        """Lockstep runs as many steps as the longest stream: worth it while most clients are busy in most steps
        (not for epochs over heavy-tailed client sizes, where one big client would keep the others waiting)."""
        hp = hp or self.hp
        sizes = self.data.train_sizes[self.cids]
        steps = np.full(len(sizes), hp.steps) if hp.steps > 0 else hp.epochs * -(-sizes // hp.batch_size)
        return steps.sum() >= 0.5 * len(steps) * steps.max()

    @property
    def loss(self) -> BatchedLoss:
        if getattr(self.model, "batched_loss", None) is None:  # one per model
            self.model.batched_loss = BatchedLoss(self.model)
        return self.model.batched_loss

    def plan(self, hp: LocalConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.data
        return batch_plan([int(d.train_sizes[c]) for c in self.cids], [int(d.train_offsets[c]) for c in self.cids],
                          hp or self.hp, self.gens, d.device)

    def train(self, starts: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`ClientContext.train` for every client at once: (trained (C, D), mean loss per client)."""
        idx, mask = self.plan()
        return batched_sgd(self.loss, starts, self.data.x_train, self.data.y_train, idx, mask, self.hp, **kwargs)


class Algorithm:
    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    has_global_model: ClassVar[bool] = True
    # True: the round's clients are served one after another (payload, training, aggregation per client), so a
    # later client already sees the earlier ones' updates (the pFedLA reference code's order).
    sequential: bool = False
    # True: every client trains every round and the sampler only picks who aggregates (pFedMe's code).
    trains_all: bool = False
    default_sampling: ClassVar[str] = "uniform"  # what `sampling: auto` means for this algorithm
    adapts: ClassVar[bool] = False  # True: `adapt` fine-tunes the model on the client's train data before evaluation
    divergence_hint: ClassVar[str] = "lower local.lr"  # what to change when a client's update is non-finite
    # `local.*` keys this algorithm's local solver does not read: setting one for its run, or turning on momentum or
    # weight decay (off by default), is refused rather than silently ignored
    unused_local: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: Any, model: FlatModel, num_clients: int, cfg: Config):
        self.params = params
        self.model = model  # the layout (names, layers, sizes); clients also train with it
        self.num_clients = num_clients
        self.cfg = cfg
        self.check_local(cfg)

    def check_local(self, cfg: Config) -> None:
        spec_local = [k.split(".", 1)[1] for k in split_spec(cfg.algorithm)[1] if k.startswith("local.")]
        for key in self.unused_local:
            if key in spec_local or (key in ("momentum", "weight_decay") and getattr(cfg.local, key) > 0):
                own = {"lr": " (its step sizes are its own keys)", "epochs": " (its own keys set the local work)",
                       "steps": " (its own keys set the local work)"}.get(key, "")
                raise ConfigError(f"config key 'local.{key}': {self.name}'s local solver does not use it{own}; "
                                  f"allowed for {self.name}: the default; set it for the other runs only, "
                                  f"e.g. --algorithms fedavg@local.{key}=...,{self.name}")

    # -- server -------------------------------------------------------------------------------------------------
    def init_server(self, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def payloads(self, state: State, cids: list[int], rnd: int) -> dict[int, Message]:
        """Messages for all sampled clients at once (override to batch the server math)."""
        return {cid: self.payload(state, cid, rnd) for cid in cids}

    def payload(self, state: State, cid: int, rnd: int) -> Message:
        return {"weights": state["weights"]}

    def aggregate(self, state: State, updates: dict[int, Message], weights: dict[int, float], rnd: int) -> State:
        """Fold in the round's updates. `weights` gives the aggregating clients (a subset of `updates` where all
        clients train) and their weights, summing to 1, as the sampler makes the aggregate unbiased: sample-size
        shares for uniform sampling, draw counts / m for MD and clustered sampling."""
        raise NotImplementedError

    def global_model(self, state: State) -> torch.Tensor | None:
        return state.get("weights") if self.has_global_model else None

    # -- client -------------------------------------------------------------------------------------------------
    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {}

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        raise NotImplementedError

    def client_update_many(self, payloads: list[Message], cstates: list[State],
                           cohort: Cohort) -> tuple[list[Message], list[State]]:
        """All of a round's clients (override to train them in lockstep); must equal `client_update` per client."""
        results = [self.client_update(p, s, cohort.client(i)) for i, (p, s) in enumerate(zip(payloads, cstates))]
        return [u for u, _ in results], [s for _, s in results]

    def adapt(self, vector: torch.Tensor, ctx: ClientContext) -> torch.Tensor:
        """The model a client is evaluated with, given its personalized vector (`adapts` algorithms fine-tune
        here; `ctx.data` then holds only the client's train split)."""
        return vector

    def adapt_many(self, vectors: list[torch.Tensor], cohort: Cohort) -> list[torch.Tensor]:
        """`adapt` for several clients (override to adapt them in lockstep); `cohort.data` holds no test splits."""
        return [self.adapt(v, cohort.client(i)) for i, v in enumerate(vectors)]

    def personalized(self, state: State, cstate: State, cid: int) -> torch.Tensor:
        """The vector client `cid` is evaluated with."""
        return state["weights"]

    def personalized_many(self, state: State, cstates: list[State], cids: list[int]) -> list[torch.Tensor]:
        """The vectors of several clients at once (override to batch the server math)."""
        return [self.personalized(state, cstates[cid], cid) for cid in cids]

    def describe(self) -> dict[str, Any]:
        """Static facts about this run's algorithm for algorithm.json (e.g. the layer names of pFedLA's weights)."""
        return {}

    def observables(self, state: State) -> dict[str, Any]:
        """Arrays to log at each evaluation (e.g. pFedLA's aggregation weights); {} for none."""
        return {}


def model_gradient(model: FlatModel, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Gradient of the mean cross-entropy on one batch at `params` (the parameter part of a vector; the model's
    buffers stay as they are, and BatchNorm updates them in train mode)."""
    model.vector[: len(params)].copy_(params)
    model.grad.zero_()
    model.module.train()
    loss = torch.nn.functional.cross_entropy(model.module(x), y)
    loss.backward()
    return model.grad[: len(params)].clone(), float(loss.detach())


def weighted_average(updates: dict[int, Message], weights: dict[int, float], key: str = "weights") -> torch.Tensor:
    """The weighted mean of the aggregating clients' vectors: one stacked matrix-vector product."""
    vectors = torch.stack([updates[c][key] for c in weights])
    w = torch.tensor([weights[c] for c in weights], dtype=vectors.dtype, device=vectors.device)
    return w @ vectors
