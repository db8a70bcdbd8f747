"""A round's CNN clients: every way of running them measured against a bare PyTorch loop, the losers kept.

One round of 10 clients (mnist5k, 4 classes each, batch 32, `--epochs` local epochs, SGD) on pFedHN's CNN with
and without BatchNorm and on FL-bench's LeNet-5 (BatchNorm, 6 and 16 channels). Every candidate trains the same
clients on the same seeded batches from the same start;
runs alternate and the best of `--repeats` is kept. Prints client-steps/s and the ratio to the bare loop.

    python benchmarks/bench_cnn_clients.py [--epochs 2] [--repeats 3] [--models cnn,cnn_bn,lenet5] [--compile] [--smoke]
        [--candidates engine,engine-1by1]

Candidates:
  bare            nn.Module + torch.optim.SGD, one client after another, PyTorch's threads (the reference; the model's
                  forward in plain PyTorch: bench_local_training.PlainCNN)
  bare-1thread    the same on one intra-op thread
  engine          pfedkit's Cohort as it runs by default: clients side by side, one per core, in forked processes
                  (runtime.workers=0, runtime.workers_in=processes: runtime/processes.py), the runtime's C kernels
                  (runtime/native.py: ReLU + pooling, BatchNorm fused with them, the first convolution)
  engine-threads  the same with the clients in threads of this process (runtime.workers_in=threads: one GIL)
  engine-autograd the engine with every step through autograd (a BN model with small convolutions, LeNet-5, takes
                  its whole step as one C call by default: runtime/cnn.training_step)
  engine-pytorch  the same on PyTorch's own kernels only (what the engine did before the C kernels)
  engine-1by1     the Cohort one client after another (runtime.workers=1, a Flower ClientApp's way)
  engine-lockstep the Cohort's lockstep path (Cohort(lockstep=True)): all clients at once as grouped convolutions
                  on channels_last activations and batched linear layers, each client's BatchNorm its own over its
                  real samples (models/many.py)
  channels_last   the bare loop with channels_last inputs and weights
  flush-denormal  the bare loop with denormals flushed to zero
  no-mkldnn       the bare loop on PyTorch's own convolutions (oneDNN off)
  engine-3workers the engine with 3 clients side by side on the 2 cores (oversubscribed)
  hand-pool       the bare loop with a hand-written training max pool: the maxima of the four strided quarters,
                  PyTorch's indices computed from them, max_pool2d's own backward
  hand-bn         the bare loop with BatchNorm as an autograd Function of plain ops (var_mean, addcmul; its
                  backward's sums by einsum; BatchNorm models only)
  grouped         all clients in lockstep as grouped convolutions + batched linear layers in the standard layout
                  (no BatchNorm only; what the engine's lockstep does, less channels_last)
  compiled        the bare loop with torch.compile'd forward (--compile: ~40 s to compile)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
import warnings

import torch
import torch.nn.functional as F

from pfedkit.runtime import cnn as runtime_cnn, native
from bench_local_training import PlainCNN, plain as plain_model  # the CNN with a plain PyTorch forward (this folder)
from pfedkit.config import RuntimeConfig, load_config
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Cohort, batch_indices, seeded_generator


def batches(cfg, data, cids=None):
    """The clients' (default: every client's) seeded batches of this round, as (x, y) lists on the data's device."""
    out = []
    for c in range(data.num_clients) if cids is None else cids:
        client = data.client(c)
        gen = seeded_generator(cfg.seed, 1, c)
        out.append([(client.x_train[i], client.y_train[i])
                    for i in batch_indices(client.num_train, cfg.local, gen, data.device)])
    return out


def bare(net, work, lr, memory_format=None, compiled=False):
    """One module, each client loading the round's start, as a plain PyTorch FedAvg client loop does."""
    model = copy.deepcopy(net)
    if memory_format is not None:
        model = model.to(memory_format=memory_format)
    start = copy.deepcopy(model.state_dict())
    forward = torch.compile(model) if compiled else model
    for client in work:
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for x, y in client:
            if memory_format is not None:
                x = x.contiguous(memory_format=memory_format)
            opt.zero_grad()
            F.cross_entropy(forward(x), y).backward()
            opt.step()


@contextlib.contextmanager
def threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def flush_denormal():
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class HandPool(torch.autograd.Function):
    """2x2 max pooling: the maxima of the quarters, and the flat in-plane index of each window's first maximum
    (max_pool2d's tie rule) so that max_pool2d's own backward can run."""

    @staticmethod
    def forward(ctx, x):
        a, b, c, d = runtime_cnn.quarters(x)
        top, bottom = torch.maximum(a, b), torch.maximum(c, d)
        lower, width = bottom > top, x.shape[-1]
        rows = torch.arange(x.shape[-2] // 2, device=x.device)[:, None] * 2 * width
        cols = torch.arange(x.shape[-1] // 2, device=x.device)[None, :] * 2
        ctx.save_for_backward(x, rows + cols + lower * width + torch.where(lower, d > c, b > a))
        return torch.maximum(top, bottom)

    @staticmethod
    def backward(ctx, g):
        x, idx = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)


class HandBatchNorm(torch.autograd.Function):
    """Training-mode BatchNorm2d of plain ops: y = x * scale + shift per channel; dx = dy * scale + x * coef + const."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, mean, var):
        invstd = (var + eps).rsqrt()
        scale = weight * invstd
        ctx.save_for_backward(x, mean, invstd, weight)
        return torch.addcmul((bias - mean * scale).view(1, -1, 1, 1), x, scale.view(1, -1, 1, 1))

    @staticmethod
    def backward(ctx, g):
        x, mean, invstd, weight = ctx.saved_tensors
        n = x.numel() // x.shape[1]
        sum_g, sum_gx = g.sum((0, 2, 3)), torch.einsum("nchw,nchw->c", g, x)
        sum_g_xhat = invstd * (sum_gx - mean * sum_g)
        scale = weight * invstd
        coef = -scale * invstd * sum_g_xhat / n
        const = -scale * sum_g / n - coef * mean
        dx = torch.addcmul(const.view(1, -1, 1, 1), g, scale.view(1, -1, 1, 1)).addcmul_(x, coef.view(1, -1, 1, 1))
        return dx, sum_g_xhat, sum_g, None, None, None  # mean and var: batch statistics, in the formula above


class HandBN(torch.nn.Module):
    def __init__(self, bn: torch.nn.BatchNorm2d):
        super().__init__()
        self.weight, self.bias, self.eps, self.momentum = bn.weight, bn.bias, bn.eps, bn.momentum
        self.register_buffer("running_mean", bn.running_mean.clone())
        self.register_buffer("running_var", bn.running_var.clone())

    def forward(self, x):
        with torch.no_grad():  # the batch statistics once, for the output and the running ones (unbiased variance)
            var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
            n = x.numel() // x.shape[1]
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        return HandBatchNorm.apply(x, self.weight, self.bias, self.eps, mean, var)


@contextlib.contextmanager
def autograd_steps():
    """No whole-step C call (runtime/cnn.training_step returns None): the autograd step, with its C kernels."""
    kept = runtime_cnn.STEP_MAX_CHANNELS
    runtime_cnn.STEP_MAX_CHANNELS = 0
    try:
        yield
    finally:
        runtime_cnn.STEP_MAX_CHANNELS = kept


@contextlib.contextmanager
def without_kernels():
    """pfedkit's runtime on PyTorch's own ops (none of runtime/native.py's kernels) while the candidate runs."""
    names = ("covers", "covers_batch_norm", "covers_first_conv", "covers_first_conv_pool", "covers_cnn_step")
    kept = [getattr(native, name) for name in names]
    for name in names:
        setattr(native, name, lambda *args: False)
    try:
        yield
    finally:
        for name, fn in zip(names, kept):
            setattr(native, name, fn)


def with_hand_bn(net):
    out = copy.deepcopy(net)
    out.bn1, out.bn2 = HandBN(out.bn1), HandBN(out.bn2)
    return out


def grouped(net, work, lr):
    """All clients at once: conv layers as one grouped convolution (client c's channels are group c), linear
    layers as one batched product; each client its own weights and batches (clients with a shorter stream stop)."""
    C = len(work)
    params = {n: p.detach().unsqueeze(0).repeat(C, *[1] * p.dim()).requires_grad_(True)
              for n, p in net.named_parameters()}
    steps = max(len(w) for w in work)
    for t in range(steps):
        live = [c for c in range(C) if t < len(work[c])]
        if len(set(len(work[c][t][1]) for c in live)) > 1 or len(live) < C:  # ragged step: one client at a time
            for c in live:
                one = {n: p[c] for n, p in params.items()}
                out = torch.func.functional_call(net, one, (work[c][t][0],))
                F.cross_entropy(out, work[c][t][1]).backward()
        else:
            x = torch.stack([work[c][t][0] for c in live])  # (C, B, 1, 28, 28)
            y = torch.stack([work[c][t][1] for c in live])
            B = x.shape[1]
            h = x.transpose(0, 1).reshape(B, C * x.shape[2], *x.shape[3:])
            for conv in ("conv1", "conv2"):
                w, b = params[f"{conv}.weight"], params[f"{conv}.bias"]
                h = F.conv2d(h, w.reshape(-1, *w.shape[2:]), b.reshape(-1), groups=C)
                h = F.max_pool2d(torch.relu(h), 2)
            h = h.reshape(B, C, -1).transpose(0, 1)  # (C, B, features)
            for fc in ("fc1", "fc2", "fc3"):
                h = torch.baddbmm(params[f"{fc}.bias"].unsqueeze(1), h, params[f"{fc}.weight"].transpose(1, 2))
                h = torch.relu(h) if fc != "fc3" else h
            # each client's mean loss: the sum over clients has each client's gradient in its own rows
            F.cross_entropy(h.flatten(0, 1), y.flatten(), reduction="none").view(C, B).mean(1).sum().backward()
        with torch.no_grad():
            for p in params.values():
                p -= lr * p.grad
                p.grad = None


def engine(cfg, data, workers, lockstep=None, cids=None, **runtime):
    """One round of the clients (default: all) through pfedkit's Cohort, `runtime` setting RuntimeConfig's keys."""
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed).to(data.device))
    cids = list(range(data.num_clients)) if cids is None else cids
    starts = model.state().repeat(len(cids), 1)
    return lambda: Cohort(cids, 1, data, model, cfg.local, [seeded_generator(cfg.seed, 1, c) for c in cids],
                          lockstep, RuntimeConfig(workers=workers, **runtime)).train(starts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="cnn,cnn_bn,lenet5")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--candidates", default="", help="comma-separated names to run (default: all; bare always)")
    ap.add_argument("--smoke", action="store_true", help="3 clients, 1 repeat (CI: runs, times nothing)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="TF32 acceleration")  # printed by the oneDNN switch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models.split(","):
        cfg = load_config(None, ["dataset.name=mnist5k", f"model.name={name}", "local.batch_size=32",
                                 f"partition.num_clients={3 if args.smoke else 10}", f"local.epochs={args.epochs}",
                                 f"partition.samples_per_client={64 if args.smoke else 0}",
                                 "local.lr=0.05", "progress=false", "plots=false"], "fedavg")
        data = prepare(cfg)
        net = plain_model(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
        work, lr = batches(cfg, data), cfg.local.lr
        steps = sum(len(w) for w in work)
        plain = lambda: bare(net, work, lr)  # noqa: E731
        candidates = {  # name: (the switch it runs under, the work)
            "bare": (None, plain),
            "bare-1thread": (lambda: threads(1), plain),
            "engine": (None, engine(cfg, data, 0)),
            "engine-threads": (None, engine(cfg, data, 0, workers_in="threads")),
            "engine-autograd": (autograd_steps, engine(cfg, data, 0)),
            "engine-1by1": (None, engine(cfg, data, 1)),
            "engine-lockstep": (None, engine(cfg, data, 0, lockstep=True)),
            "channels_last": (None, lambda: bare(net, work, lr, memory_format=torch.channels_last)),
            "flush-denormal": (flush_denormal, plain),
            "no-mkldnn": (lambda: torch.backends.mkldnn.flags(enabled=False), plain),
            "engine-3workers": (None, engine(cfg, data, 3)),
            "hand-pool": (None, lambda: bare(PlainCNN(net, pool=HandPool.apply), work, lr)),
            "engine-pytorch": (without_kernels, engine(cfg, data, 0)),
        }
        if name != "cnn":
            hand = with_hand_bn(net)
            candidates["hand-bn"] = (None, lambda: bare(hand, work, lr))
        if name == "cnn":
            candidates["grouped"] = (None, lambda: grouped(net, work, lr))
        if args.compile:
            bare(net, work[:1], lr, compiled=True)  # compile once (cached for the timed runs)
            candidates["compiled"] = (None, lambda: bare(net, work, lr, compiled=True))
        if args.candidates:
            keep = {"bare", *args.candidates.split(",")}
            candidates = {k: v for k, v in candidates.items() if k in keep}
        best = {k: float("inf") for k in candidates}
        for _ in range(1 if args.smoke else args.repeats):
            for key, (switch, fn) in candidates.items():
                with switch() if switch else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    fn()
                    best[key] = min(best[key], time.perf_counter() - t0)
        print(f"\n{name}: {data.num_clients} clients, {steps} client-steps per round")
        print(f"{'candidate':>15} {'steps/s':>9} {'x bare':>7}")
        for key, secs in best.items():
            print(f"{key:>15} {steps / secs:>9.0f} {best['bare'] / secs:>7.2f}")


if __name__ == "__main__":
    main()
