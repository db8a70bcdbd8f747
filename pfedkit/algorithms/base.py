"""The algorithm protocol (DESIGN.md): what the server sends, what a client does with it, how the server folds
the replies in, and what a client is evaluated with. An algorithm never touches threads, files, sockets or
progress bars; a runtime runs it: the in-process simulator (engine/) or a Flower ServerApp/ClientApp (flower/).

Server half: `init_server`, `payloads`, `aggregate`, `eval_payloads`, `global_model`, `observables`.
Client half: `init_client`, `client_update`, `evaluated_models`, each written once over a cohort (a leading client
axis: one client under Flower, a lockstep cohort in the simulator); the cohort (train.Cohort) decides how.

Payloads and updates are flat dicts of named tensors plus, in an update, the protocol's scalars (`num_samples`,
`train_loss`): exactly what crosses a network, so a Flower record holds them without pickling. Server and client
states are dicts of tensors too, so a checkpoint is plain data.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..config import Config, split_spec
from ..errors import ConfigError
from ..models import FlatModel
from ..registry import NoParams
from ..train import Cohort

Message = dict[str, Any]  # named tensors (payloads); plus the protocol's scalars (updates)
State = dict[str, Any]
# The scalars of every update, read by the engine: how much the client's data weighs and its mean training loss.
UPDATE_SCALARS: dict[str, type] = {"num_samples": int, "train_loss": float}
GRADIENT_KEY = "gradient"  # optional update tensor: the client's representative gradient for similarity sampling


def make_update(num_samples: int, train_loss: float, **tensors: torch.Tensor) -> Message:
    """An update: named tensors and the protocol's scalars."""
    return {**tensors, "num_samples": int(num_samples), "train_loss": float(train_loss)}


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
    divergence_hint: ClassVar[str] = "lower local.lr"  # what to change when a client's update is non-finite
    # `local.*` keys this algorithm's local solver does not read: setting one for its run, or turning on momentum or
    # weight decay (off by default), is refused rather than silently ignored (`check_local`)
    unused_local: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: Any, model: FlatModel, num_clients: int, seed: int = 0):
        self.params = params
        self.model = model  # the layout (names, layers, sizes); clients also train with it
        self.num_clients = num_clients
        self.seed = seed  # for the server's own random initialization (pFedLA's hypernetworks)

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

    def eval_payloads(self, state: State, cids: list[int]) -> dict[int, Message]:
        """What each client needs to build the model it is evaluated with (by default what it trains from)."""
        return self.payloads(state, cids, 0)

    def global_model(self, state: State) -> torch.Tensor | None:
        return state.get("weights") if self.has_global_model else None

    def update_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors a client's update must hold and their shapes: a reply from a (possibly remote, possibly
        faulty) client is checked against this before the server reads it."""
        return {"weights": (self.model.size,)}

    def describe(self) -> dict[str, Any]:
        """Static facts about this run's algorithm for algorithm.json (e.g. the layer names of pFedLA's weights)."""
        return {}

    def observables(self, state: State) -> dict[str, Any]:
        """Arrays to log at each evaluation (e.g. pFedLA's aggregation weights); {} for none."""
        return {}

    # -- client -------------------------------------------------------------------------------------------------
    def init_client(self, cid: int, init: torch.Tensor) -> State:
        return {}

    def client_update(self, payloads: list[Message], cstates: list[State],
                      cohort: Cohort) -> tuple[list[Message], list[State]]:
        """Train the cohort's clients from their payloads: (updates, new client states), one per client."""
        raise NotImplementedError

    @classmethod
    def unused_local_keys(cls, params: Any) -> tuple[str, ...]:
        """The `local.*` keys its solver ignores under these settings (`unused_local`, the ones it never uses)."""
        return cls.unused_local

    def evaluated_models(self, payloads: list[Message], cstates: list[State], cohort: Cohort) -> list[torch.Tensor]:
        """The vector each client is scored with, built on the client from its eval payload and state (an
        algorithm that fine-tunes before evaluation does it here; `cohort.data` then holds only train splits).
        A client scored with the global model returns the payload's tensor itself (the simulator then scores the
        global model once for all)."""
        return [p["weights"] for p in payloads]


def check_local(cls: type[Algorithm], cfg: Config) -> None:
    """Refuse `local.*` settings the algorithm's solver would silently ignore."""
    spec_local = [k.split(".", 1)[1] for k in split_spec(cfg.algorithm)[1] if k.startswith("local.")]
    for key in cls.unused_local_keys(cfg.params(cls.name)):
        if key in spec_local or (key in ("momentum", "weight_decay") and getattr(cfg.local, key) > 0):
            own = {"lr": " (its step sizes are its own keys)", "epochs": " (its own keys set the local work)",
                   "steps": " (its own keys set the local work)"}.get(key, "")
            raise ConfigError(f"config key 'local.{key}': {cls.name}'s local solver does not use it{own}; "
                              f"allowed for {cls.name}: the default; set it for the other runs only, "
                              f"e.g. --algorithms fedavg@local.{key}=...,{cls.name}")


def build_algorithm(cfg: Config, model: FlatModel, num_clients: int) -> Algorithm:
    """The algorithm of a one-run config (`cfg.algorithm` is one spec), its settings checked."""
    from ..registry import ALGORITHMS
    cls = ALGORITHMS[cfg.algorithm_name]
    check_local(cls, cfg)
    return cls(cfg.params(cls.name), model, num_clients, cfg.seed)


def stacked(payloads: list[Message], key: str = "weights") -> torch.Tensor:
    return torch.stack([p[key] for p in payloads])


def weighted_average(updates: dict[int, Message], weights: dict[int, float], key: str = "weights") -> torch.Tensor:
    """The weighted mean of the aggregating clients' vectors: one stacked matrix-vector product."""
    vectors = torch.stack([updates[c][key] for c in weights])
    w = torch.tensor([weights[c] for c in weights], dtype=vectors.dtype, device=vectors.device)
    return w @ vectors
