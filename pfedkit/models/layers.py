"""A model whose parameters and buffers are views into one flat vector (FedLab-style).

Loading a client's model is one `copy_`, reading it back one `clone`, an SGD step one `add_`; server math
(averages, layer-wise mixtures) works on flat vectors or stacks of them. The vector holds the trainable
parameters first (`param_slice`) and then the float buffers (BatchNorm running statistics, `buffer_slice`).

Every tensor lies in the vector row-major in its own shape, in the module's order (`state_dict`'s order and
shapes): one layout for every model, whatever runs it. `layout` goes into checkpoints, so that a vector of another
layout (pfedkit 0.1 held a BN-free CNN's convolution weights channels_last) is refused instead of misread.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


STANDARD = "standard"  # the layout name checkpoints record: every tensor row-major in its own shape


def shaped(segment: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A vector segment (or a stack of them, (C, n)) as the tensor(s) of `shape`."""
    return segment.view(*segment.shape[:-1], *shape)


@dataclass(frozen=True)
class Layer:
    """One parameterized module (conv, linear, BN affine): its weight and bias together, plus its buffers."""
    name: str
    kind: str
    params: slice
    buffers: slice | None = None

    @property
    def num_params(self) -> int:
        return self.params.stop - self.params.start


class FlatModel:
    def __init__(self, module: nn.Module):
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.num_batches_tracked = None  # unused with a fixed momentum; keeps every buffer float
        self.module = module
        self.layout = STANDARD
        first = next(module.parameters())
        device, dtype = first.device, first.dtype
        params = list(module.named_parameters())
        buffers = [(n, b) for n, b in module.named_buffers() if b is not None]
        self.param_size = sum(p.numel() for _, p in params)
        self.size = self.param_size + sum(b.numel() for _, b in buffers)
        self.vector = torch.empty(self.size, device=device, dtype=dtype)
        self.grad = torch.zeros(self.param_size, device=device, dtype=dtype)
        self.names: list[tuple[str, slice, torch.Size]] = []
        offset = 0
        for name, p in params:
            view = shaped(self.vector[offset: offset + p.numel()], p.shape)
            view.copy_(p.detach())
            p.data = view
            p.grad = shaped(self.grad[offset: offset + p.numel()], p.shape)  # backward accumulates in place
            self.names.append((name, slice(offset, offset + p.numel()), p.shape))
            offset += p.numel()
        owners = dict(module.named_modules())
        for name, b in buffers:
            view = self.vector[offset: offset + b.numel()].view_as(b)
            view.copy_(b)
            mod_name, _, attr = name.rpartition(".")
            owners[mod_name]._buffers[attr] = view
            self.names.append((name, slice(offset, offset + b.numel()), b.shape))
            offset += b.numel()
        self.layers = self._layers(module)
        head = getattr(module, "head_layers", ())
        self.head_layers = [l for l in self.layers if l.name in head]
        self.body_layers = [l for l in self.layers if l.name not in head]

    def _layers(self, module: nn.Module) -> list[Layer]:
        spans = {name: s for name, s, _ in self.names}
        layers = []
        for mod_name, m in module.named_modules():
            own = [f"{mod_name}.{n}" if mod_name else n for n, p in m.named_parameters(recurse=False)]
            if not own:
                continue
            bufs = [f"{mod_name}.{n}" for n, b in m.named_buffers(recurse=False) if b is not None]
            buf_slice = slice(spans[bufs[0]].start, spans[bufs[-1]].stop) if bufs else None
            kind = type(m).__name__.lower()
            layers.append(Layer(mod_name, kind, slice(spans[own[0]].start, spans[own[-1]].stop), buf_slice))
        return layers

    @property
    def param_slice(self) -> slice:
        return slice(0, self.param_size)

    @property
    def buffer_slice(self) -> slice:
        return slice(self.param_size, self.size)

    @property
    def device(self) -> torch.device:
        return self.vector.device

    def load(self, vector: torch.Tensor) -> None:
        self.vector.copy_(vector)

    def state(self) -> torch.Tensor:
        return self.vector.detach().clone()

    def mask(self, layers: list[Layer], buffers: bool = True) -> torch.Tensor:
        """Boolean mask over the flat vector covering `layers` (and their buffers)."""
        m = torch.zeros(self.size, dtype=torch.bool, device=self.device)
        for layer in layers:
            m[layer.params] = True
            if buffers and layer.buffers is not None:
                m[layer.buffers] = True
        return m

    def state_dict(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of a flat vector, shaped like the module's state dict."""
        return {name: shaped(vector[s], shape) for name, s, shape in self.names}
