"""The papers' models: pFedHN's small CNN (with or without BatchNorm), FL-bench's LeNet-5 (the same layout with
6 and 16 channels and BatchNorm), MLR and a one-hidden-layer DNN.

Each names its last linear layer `head_layers`; everything before it is the body (FedRep, FedTC). They are plain
PyTorch modules: how the runtime runs them fast (C kernels, batched forms) lives in pfedkit/runtime/.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .many import batch_norm_many, conv_many, linear_many, stack_images, unstack_features


class CNN(nn.Module):
    """pFedHN's CNNTarget (Shamsian et al., 2021, official code): conv5-16, pool, conv5-32, pool, fc 120, fc 84, fc C; no padding.

    1x28x28 inputs give 32*4*4 = 512 features after the convs, 3x32x32 inputs 32*5*5 = 800. With
    `batch_norm`, a BatchNorm2d follows each conv (the pFedLA paper's CIFAR models). `channels=(6, 16)` with
    BatchNorm is FL-bench's LeNet5 (conv-BN-ReLU-pool twice, fc 256 (400 on 32x32) -> 120 -> 84 -> C, ReLU
    between), the model of its pFedLA benchmark."""

    head_layers = ("fc3",)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, batch_norm: bool = False,
                 channels: tuple[int, int] = (16, 32)):
        super().__init__()
        (c1, c2), size = channels, input_shape[-1]
        self.conv1 = nn.Conv2d(input_shape[0], c1, 5)
        self.bn1 = nn.BatchNorm2d(c1) if batch_norm else nn.Identity()
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.bn2 = nn.BatchNorm2d(c2) if batch_norm else nn.Identity()
        side = ((size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(c2 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)

    def forward_many(self, params: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor,
                     running: bool = True) -> torch.Tensor:
        """Many clients' models in training mode at once (models/many.py): params[name] is (C, *shape), BatchNorm's
        running statistics included (updated in place with `running`), x is (C, B, channels, H, W), mask (C, B)
        marks the real samples (BatchNorm's statistics skip the rest); gives (C, B, classes)."""
        clients = x.shape[0]
        h = stack_images(x)
        for conv, bn in (("conv1", self.bn1), ("conv2", self.bn2)):
            h = conv_many(params, conv, h)
            if isinstance(bn, nn.BatchNorm2d):
                h = batch_norm_many(params, "bn" + conv[-1], h, mask, bn.momentum, bn.eps, running)
            h = F.max_pool2d(torch.relu(h), 2)
        h = torch.relu(linear_many(params, "fc1", unstack_features(h, clients)))
        h = torch.relu(linear_many(params, "fc2", h))
        return linear_many(params, "fc3", h)


class MLR(nn.Module):
    """Multinomial logistic regression (pFedMe's `mclr`): flatten, one linear layer, softmax in the loss."""

    head_layers = ("fc",)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))

    def forward_many(self, params: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor | None = None,
                     running: bool = True) -> torch.Tensor:
        """Many clients' models at once: params[name] is (C, *shape), x is (C, B, ...); gives (C, B, classes)
        (mask and running: see CNN.forward_many; a model without BatchNorm needs neither)."""
        return linear_many(params, "fc", x.flatten(2))


class DNN(nn.Module):
    """pFedMe's `dnn`: flatten, Linear(in, hidden), ReLU, Linear(hidden, C)."""

    head_layers = ("fc2",)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 100):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    def forward_many(self, params: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor | None = None,
                     running: bool = True) -> torch.Tensor:
        """Many clients' models at once (see MLR.forward_many)."""
        return linear_many(params, "fc2", torch.relu(linear_many(params, "fc1", x.flatten(2))))


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Module:
    """The model with a seeded initialization that leaves the global RNG untouched."""
    if cfg.name in ("cnn", "cnn_bn", "lenet5"):
        if len(input_shape) != 3 or input_shape[1:] not in ((28, 28), (32, 32)):
            raise ConfigError(f"config key 'model.name': '{cfg.name}' needs 28x28 or 32x32 images, the data has "
                              f"inputs of shape {input_shape}; allowed here: mlr, dnn")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.name == "cnn":
            return CNN(input_shape, num_classes)
        if cfg.name == "cnn_bn":
            return CNN(input_shape, num_classes, batch_norm=True)
        if cfg.name == "lenet5":
            return CNN(input_shape, num_classes, batch_norm=True, channels=(6, 16))
        if cfg.name == "mlr":
            return MLR(input_shape, num_classes)
        return DNN(input_shape, num_classes, cfg.hidden)
