"""Layers that run many clients' models at once, each client with its own weights and its own batch, for lockstep
training (train.BatchedLoss): linear layers as one batched matrix product, convolutions as one grouped
convolution with the clients side by side along the channels, and a BatchNorm whose statistics are each client's
own (a channel of the stacked activations belongs to one client) and skip the padding of short batches.

The stacked activations of a convolutional model are (batch, clients x channels, height, width) in channels_last
memory: oneDNN's grouped convolutions on a CPU are faster on it than on the standard layout, where they are no faster
than one client after another (benchmarks/bench_cnn_clients.py).
"""
from __future__ import annotations

import torch


def linear_many(params: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """Each client's linear layer on its own batch: one batched matrix product for all clients; x is (C, B, in)."""
    return torch.baddbmm(params[f"{name}.bias"].unsqueeze(1), x, params[f"{name}.weight"].transpose(1, 2))


def stack_images(x: torch.Tensor) -> torch.Tensor:
    """(C, B, channels, H, W) client batches as one (B, C x channels, H, W) channels_last tensor, client-major."""
    c, b, ch, h, w = x.shape
    return x.permute(1, 3, 4, 0, 2).reshape(b, h, w, c * ch).contiguous().permute(0, 3, 1, 2)  # a copy, also
    # where reshape could give a view (one input channel): a view would not be channels_last


def unstack_features(x: torch.Tensor, clients: int) -> torch.Tensor:
    """(B, C x channels, H, W) stacked activations as (C, B, channels x H x W), each sample flattened in the order
    a one-client model's `flatten(1)` gives."""
    b, cc, h, w = x.shape
    return x.reshape(b, clients, cc // clients, h, w).transpose(0, 1).flatten(2)


def conv_many(params: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """Each client's convolution (stride 1, no padding) on its own channels of the stacked x: one grouped conv."""
    weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
    # the weight in x's layout (channels_last): with one layout the convolution runs in it, without converting
    stacked = weight.flatten(0, 1).contiguous(memory_format=torch.channels_last)
    return torch.nn.functional.conv2d(x, stacked, bias.flatten(), groups=weight.shape[0])


def batch_norm_many(params: dict[str, torch.Tensor], name: str, x: torch.Tensor, mask: torch.Tensor,
                    momentum: float, eps: float, running: bool) -> torch.Tensor:
    """Each client's BatchNorm2d in training mode on the stacked x (B, C x channels, H, W): normalized with the
    statistics of the client's real samples (mask (C, B), 0 for padding), and with `running` its running mean and
    (unbiased) variance updated in place as BatchNorm2d does, for the clients with at least one real sample."""
    clients = mask.shape[0]
    b, channels = mask.shape[1], x.shape[1] // clients
    per_channel = mask.t().unsqueeze(2).expand(b, clients, channels).reshape(b, -1)  # (B, C x channels); not
    # repeat_interleave, whose output size may be read back from the device (no CUDA graph capture then)
    out, mean, var, n = StackedBatchNorm.apply(x, params[f"{name}.weight"].flatten(), params[f"{name}.bias"].flatten(),
                                               per_channel, eps)
    if running:
        with torch.no_grad():
            mean_buf, var_buf = params[f"{name}.running_mean"], params[f"{name}.running_var"]  # views, (C, channels)
            seen = (n > 0).view_as(mean_buf)
            unbiased = var * n / (n - 1).clamp_min(1.0)
            mean_buf.copy_(torch.where(seen, torch.lerp(mean_buf, mean.view_as(mean_buf), momentum), mean_buf))
            var_buf.copy_(torch.where(seen, torch.lerp(var_buf, unbiased.view_as(var_buf), momentum), var_buf))
    return out


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """A channels_last (B, K, H, W) tensor as its (B, H x W, K) view (a copy if x is in another layout)."""
    b, k, h, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(b, h * w, k)


class StackedBatchNorm(torch.autograd.Function):
    """Training-mode batch normalization per channel over the real samples of a channels_last (B, K, H, W) tensor:
    `mask` (B, K) is 1 where sample b is real for channel k's client. Its own backward (the closed form of the
    normalization's gradient), with every sum a float32 reduction over a contiguous (B, H x W, K) view: as exact as
    PyTorch's standard-layout BatchNorm, which accumulates in float64, where PyTorch's channels_last BatchNorm
    accumulates naively in float32; and faster than the same math left to autograd. Padded samples pass no
    gradient on.
    Returns (normalized x, batch mean (K,), biased batch variance (K,), real elements per channel (K,))."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, eps):
        b, k, h, w = x.shape
        rows = as_rows(x)
        n = mask.sum(0) * (h * w)
        count = n.clamp_min(1.0)  # a client without samples: zero statistics, no NaN
        mean = (rows.sum(1) * mask).sum(0) / count
        centered = rows - mean
        var = ((centered * centered).sum(1) * mask).sum(0) / count
        invstd = torch.rsqrt(var + eps)
        normalized = centered.mul_(invstd)
        out = torch.addcmul(bias, normalized, weight)
        ctx.save_for_backward(normalized, weight, invstd, mask, count)
        ctx.mark_non_differentiable(mean, var, n)
        return out.view(b, h, w, k).permute(0, 3, 1, 2), mean, var, n

    @staticmethod
    def backward(ctx, grad_out, _mean, _var, _n):
        normalized, weight, invstd, mask, count = ctx.saved_tensors
        b, k, h, w = grad_out.shape
        dy = as_rows(grad_out)  # zero on padded samples already: nothing downstream reads them (the loss and the
        # next BatchNorm mask them)
        grad_bias = dy.sum((0, 1))
        grad_weight = (dy * normalized).sum((0, 1))
        dx = torch.addcmul(dy - grad_bias / count, normalized, grad_weight / count, value=-1.0)
        dx.mul_(weight * invstd).mul_(mask[:, None, :])
        return dx.view(b, h, w, k).permute(0, 3, 1, 2), grad_weight, grad_bias, None, None
