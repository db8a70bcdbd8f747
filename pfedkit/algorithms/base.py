"""The algorithm protocol (DESIGN.md): what the server sends, what a client does with it, how the server folds
the replies in. An algorithm never touches threads, files or progress bars; the engine (or a Flower app) runs it.

Payloads and updates are plain dicts of tensors and small scalars: exactly what would cross a network. Server and
client states are dicts of tensors too, so a checkpoint is a plain `torch.save`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import Config, LocalConfig
from ..data import ClientData
from ..models import FlatModel
from ..train import sgd

Message = dict[str, Any]  # named tensors plus small scalars
State = dict[str, Any]


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


class Algorithm:
    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    has_global_model: ClassVar[bool] = True
    # True: the round's clients are served one after another (payload, training, aggregation per client), so a
    # later client already sees the earlier ones' updates (the pFedLA reference code's order).
    sequential: bool = False

    def __init__(self, params: Any, model: FlatModel, num_clients: int, cfg: Config):
        self.params = params
        self.model = model  # the layout (names, layers, sizes); clients also train with it
        self.num_clients = num_clients
        self.cfg = cfg

    # -- server -------------------------------------------------------------------------------------------------
    def init_server(self, init: torch.Tensor) -> State:
        return {"weights": init.clone()}

    def payloads(self, state: State, cids: list[int], rnd: int) -> dict[int, Message]:
        """Messages for all sampled clients at once (override to batch the server math)."""
        return {cid: self.payload(state, cid, rnd) for cid in cids}

    def payload(self, state: State, cid: int, rnd: int) -> Message:
        return {"weights": state["weights"]}

    def aggregate(self, state: State, updates: dict[int, Message], rnd: int) -> State:
        raise NotImplementedError

    def global_model(self, state: State) -> torch.Tensor | None:
        return state.get("weights") if self.has_global_model else None

    # -- client -------------------------------------------------------------------------------------------------
    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {}

    def client_update(self, payload: Message, cstate: State, ctx: ClientContext) -> tuple[Message, State]:
        raise NotImplementedError

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


def weighted_average(updates: dict[int, Message], key: str = "weights") -> torch.Tensor:
    """Sample-size weighted mean of the clients' vectors: one stacked matrix-vector product."""
    vectors = torch.stack([u[key] for u in updates.values()])
    sizes = torch.tensor([float(u["num_samples"]) for u in updates.values()], device=vectors.device)
    return (sizes / sizes.sum()) @ vectors
