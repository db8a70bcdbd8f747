"""The flat vector's layout written out independently of pfedkit, for the tests' plain-PyTorch reference loops:
parameters in the module's order, each row-major in its own shape, then its float buffers
(pfedkit/models/layers.py)."""
from __future__ import annotations

import torch
from torch import nn


def flat_params(net: nn.Module, grads: bool = False) -> torch.Tensor:
    """The module's parameters (or their gradients) as the flat parameter vector."""
    return torch.cat([(p.grad if grads else p).detach().flatten() for p in net.parameters()])


def flat_state(net: nn.Module) -> torch.Tensor:
    """Parameters then float buffers (BatchNorm running statistics; num_batches_tracked is not kept)."""
    return torch.cat([flat_params(net)] + [b.flatten() for n, b in net.named_buffers() if "num_batches" not in n])


def load_params(vector: torch.Tensor, net: nn.Module) -> None:
    """The inverse of flat_params: the vector's leading entries into the module's parameters."""
    at = 0
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(vector[at: at + p.numel()].view_as(p))
            at += p.numel()


def load_state(vector: torch.Tensor, net: nn.Module) -> None:
    """The inverse of flat_state: parameters, then the float buffers (BatchNorm running statistics)."""
    load_params(vector, net)
    at = sum(p.numel() for p in net.parameters())
    with torch.no_grad():
        for n, b in net.named_buffers():
            if "num_batches" not in n:
                b.copy_(vector[at: at + b.numel()].view_as(b))
                at += b.numel()
