"""The CNNs' forward and training step on pfedkit's C kernels (runtime/native.py) wherever they cover them: what
every executor runs a nets.CNN with on a CPU, so that a client computes the same bits alone, one after another,
side by side or in a Flower ClientApp. The models themselves (models/nets.py) are plain PyTorch modules.

Why the kernels: a small CNN's step at batch 32 spends most of its time in passes PyTorch runs separately and
scalar on a CPU (max pooling in the standard layout, training-mode BatchNorm, a one-channel convolution);
benchmarks/bench_cnn_clients.py measures each way against a bare loop (figures: docs/performance.md).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models.nets import CNN
from . import native

# conv1 x conv2 output channels up to which the C training step was measured to pay (the CNN + BN's 16 x 32: its
# conv2 does five times LeNet-5's work, in vectors of 16 where oneDNN's kernel has more registers' worth)
STEP_MAX_CHANNELS = 512
# the builds on which the whole C step pays: its 64-byte vectors split in two on AVX2 and spill, and the step ran
# 4-10 times slower than the autograd step with the per-op kernels there (docs/performance.md, "The C kernels")
STEP_BUILDS = ("avx512",)


def forward_of(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward the runtime runs `module` with: a CNN's on the kernels (`cnn_forward`), any other model's own."""
    return partial(cnn_forward, module) if isinstance(module, CNN) else module


def cnn_forward(net: CNN, x: torch.Tensor) -> torch.Tensor:
    """net(x), each block through the kernels where they take it, PyTorch's ops where not (another device, layout
    or shape): the same function of x and the parameters, to rounding (BatchNorm's sums and the first convolution
    sum in another order; the pooling is exact)."""
    x = first_block(net, x)
    x = bn_relu_pool(net.bn2, net.conv2(x))
    x = torch.relu(net.fc1(x.flatten(1)))
    x = torch.relu(net.fc2(x))
    return net.fc3(x)


def first_block(net: CNN, x: torch.Tensor) -> torch.Tensor:
    """relu_pool(bn1(conv1(x))): a BN-free model's first convolution, ReLU and pooling as one kernel with a
    channels_last output (its second convolution then runs in channels_last, where oneDNN is faster); a BN model's
    convolution kernel in the standard layout (channels_last cost it 10 % a step: PyTorch's channels_last BatchNorm
    sums its gradients less exactly too), then BatchNorm fused with the pooling."""
    if isinstance(net.bn1, nn.Identity) and native.covers_first_conv_pool(x, net.conv1):
        return native.first_conv_relu_pool(x, net.conv1)
    return bn_relu_pool(net.bn1, native.first_conv(x, net.conv1))


def bn_relu_pool(bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """relu_pool(bn(x)), a training-mode BatchNorm fused into the kernels where they cover it (the statistics,
    normalization, ReLU and pooling in three passes over x, the gradient in two)."""
    if native.covers_batch_norm(x, bn):
        return native.batch_norm_relu_pool(x, bn)
    return relu_pool(bn(x))


def relu_pool(x: torch.Tensor) -> torch.Tensor:
    """F.max_pool2d(torch.relu(x), 2) with its gradient: the kernels where they cover x (CPU batches in the
    standard layout, several times faster than PyTorch's kernel there, or channels_last), PyTorch otherwise."""
    if native.covers(x):
        return native.relu_pool(x)
    return max_pool2x2(torch.relu(x))


def max_pool2x2(x: torch.Tensor) -> torch.Tensor:
    """F.max_pool2d(x, 2). Without autograd (evaluation) as the maximum of the four strided quarters of each 2x2
    window: the same values (a maximum is exact, and NaN propagates as in max_pool2d), and on a CPU several times
    faster than max_pool2d's kernel. With autograd max_pool2d itself: its backward is the fast part."""
    if torch.is_grad_enabled() and x.requires_grad:
        return F.max_pool2d(x, 2)
    top_left, top_right, bottom_left, bottom_right = quarters(x)
    return torch.maximum(torch.maximum(top_left, top_right), torch.maximum(bottom_left, bottom_right))


def quarters(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four strided views of x's 2x2 windows (top left, top right, bottom left, bottom right); an odd last row
    or column is dropped, as max_pool2d does."""
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    return x[..., 0:h:2, 0:w:2], x[..., 0:h:2, 1:w:2], x[..., 1:h:2, 0:w:2], x[..., 1:h:2, 1:w:2]


def training_step(module: nn.Module, x: torch.Tensor) -> native.CNNStep | None:
    """The whole training step (forward, loss, gradients, BatchNorm's running statistics) as one C call
    (native.CNNStep) for batches like x, where the kernels cover the model and it pays: the BatchNorm CNNs on 28x28
    images, with conv channel products up to STEP_MAX_CHANNELS, on the AVX512 build (benchmarks/bench_cnn_clients.py);
    None: the autograd step of `forward_of(module)`."""
    if not isinstance(module, CNN) or module.conv1.out_channels * module.conv2.out_channels > STEP_MAX_CHANNELS:
        return None
    if native.library() is None or native.variant not in STEP_BUILDS:
        return None
    return native.cnn_step(module, x)
