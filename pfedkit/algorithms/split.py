"""Shared and personal parts of a model: the one mechanism behind every algorithm that keeps some layers on the
client (FedBN: BatchNorm layers; FedRep, FedTC, pFedHN-PC: the classifier head; HeurpFedLA: each client's k layers
of highest self-weight).

A message carries the shared parts of a flat vector by name; a part absent from it stays as the client has it. So
what is personal never crosses the network (and never counts in the bytes), and a client rebuilds its model by
writing the received parts over its own vector (`fill`). The parts are the model's layers' parameters (named
after the layer) and their buffers (BatchNorm statistics, named `<layer>.stats`).
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..errors import ConfigError
from ..models import FlatModel

STATS = ".stats"  # suffix of a layer's buffer part


def model_parts(model: FlatModel) -> list[tuple[str, slice]]:
    """Every layer's parameters and (where it has them) buffers, as named slices of the flat vector."""
    parts = []
    for layer in model.layers:
        parts.append((layer.name, layer.params))
        if layer.buffers is not None:
            parts.append((layer.name + STATS, layer.buffers))
    return parts


def personal_layers(model: FlatModel, which: str) -> list[str]:
    """The layers that stay on the client: `none`, `head` (the model's classifier layers) or `bn` (every
    BatchNorm layer)."""
    if which == "none":
        return []
    if which == "head":
        return [layer.name for layer in model.head_layers]
    if which == "bn":
        return [layer.name for layer in model.layers if layer.kind.startswith("batchnorm")]
    raise ValueError(f"unknown personal part {which!r}")


def fill(own: torch.Tensor, message: dict[str, torch.Tensor], slices: dict[str, slice]) -> torch.Tensor:
    """A copy of the client's own vector(s) (D,) or (C, D) with the message's parts written in."""
    out = own.clone()
    for name, values in message.items():
        out[..., slices[name]] = values
    return out


class Split:
    """A fixed split of the model into shared parts (sent both ways, aggregated) and personal layers (kept).

    `buffers=False`: no buffer part is shared (BatchNorm statistics stay with each client, as pFedLA and pFedHN
    do: their servers produce parameters only)."""

    def __init__(self, model: FlatModel, personal: Iterable[str] = (), buffers: bool = True):
        personal = set(personal)
        unknown = personal - {layer.name for layer in model.layers}
        if unknown:
            raise ConfigError(f"no layer called {sorted(unknown)} in the model; its layers: "
                              f"{[layer.name for layer in model.layers]}")
        self.model = model
        self.personal = sorted(personal)
        self.parts = model_parts(model)
        self.slices = dict(self.parts)
        self.shared = [(name, s) for name, s in self.parts
                       if name.removesuffix(STATS) not in personal and (buffers or not name.endswith(STATS))]
        mask = torch.zeros(model.size, dtype=torch.bool)
        for _, s in self.shared:
            mask[s] = True
        self.shared_mask = mask  # over the flat vector: True where shared

    @property
    def shared_size(self) -> int:
        return int(self.shared_mask.sum())

    def message(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """The shared parts of a vector (D,) as a message (views: the message is read, not written)."""
        return {name: vector[s] for name, s in self.shared}

    def fill(self, own: torch.Tensor, message: dict[str, torch.Tensor]) -> torch.Tensor:
        return fill(own, message, self.slices)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """What an update carrying the shared parts holds (for `Algorithm.update_shapes`)."""
        return {name: (s.stop - s.start,) for name, s in self.shared}

    def average(self, vector: torch.Tensor, updates: dict[int, dict], weights: dict[int, float]) -> torch.Tensor:
        """`vector` with every shared part replaced by the weighted mean of the aggregating clients' parts (one
        product per part)."""
        cids = list(weights)
        w = torch.tensor([weights[c] for c in cids], dtype=vector.dtype, device=vector.device)
        out = vector.clone()
        for name, s in self.shared:
            out[s] = w @ torch.stack([updates[c][name] for c in cids])
        return out

    def param_mask(self, layers: Iterable[str]) -> torch.Tensor:
        """0/1 float mask over the parameters, 1 on the given layers' parameters: the `trainable` rows of a local
        objective that trains only those layers."""
        names = set(layers)
        mask = torch.zeros(self.model.param_size, dtype=self.model.vector.dtype, device=self.model.device)
        for layer in self.model.layers:
            if layer.name in names:
                mask[layer.params] = 1.0
        return mask
