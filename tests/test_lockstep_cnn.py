"""The CNNs' lockstep path (models/many.py: grouped convolutions on channels_last activations, each client's own
BatchNorm over its real samples) against a plain PyTorch loop per client, in float64 so that rounding cannot hide
a wrong formula: clients of different sizes (short last batches padded, streams that end early), momentum, each
client's BatchNorm running statistics. And in float32 near that float64 loop."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pfedkit.config import RuntimeConfig, load_config
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Cohort, seeded_generator
from flat_layout import flat_params, flat_state, load_state  # noqa: E402

SIZES = [60, 37, 20, 45]  # batch 16: 4, 3, 2 and 3 steps an epoch, each with a short last batch


def setup(name: str, dtype: torch.dtype):
    cfg = load_config(None, ["dataset.name=mnist5k", f"model.name={name}", f"partition.num_clients={len(SIZES)}",
                             "partition.samples_per_client=100", "local.batch_size=16", "local.momentum=0.5",
                             "local.epochs=2", "local.lr=0.05", "progress=false", "plots=false"], "fedavg")
    full = prepare(cfg)
    cids = list(range(len(SIZES)))
    data = full.train_rows(cids, [torch.arange(n) for n in SIZES])
    data.x_train = data.x_train.to(dtype)
    net = build_model(cfg.model, data.input_shape, data.num_classes, 0).to(dtype)
    return cfg, data, net


def cohort(cfg, data, model, lockstep, cuda_graphs=True, **local):
    """The test clients as one Cohort (`local` overrides cfg.local's keys), one after another; lockstep None: the
    device's default."""
    cids = list(range(len(SIZES)))
    hp = dataclasses.replace(cfg.local, **local)
    return Cohort(cids, 1, data, model, hp, [seeded_generator(cfg.seed, 1, c) for c in cids], lockstep,
                  RuntimeConfig(workers=1, cuda_graphs=cuda_graphs))


def module_at(net: torch.nn.Module, vector: torch.Tensor) -> torch.nn.Module:
    """A copy of net holding a flat vector: parameters, then the running statistics."""
    ref = copy.deepcopy(net)
    load_state(vector, ref)
    return ref


def plain_loop(cfg, data, net, start: torch.Tensor, c: int) -> torch.Tensor:
    """One client in plain PyTorch: nn.Module in train mode, torch.optim.SGD with momentum, the same batches."""
    ref = module_at(net, start)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.local.lr, momentum=cfg.local.momentum)
    client, gen = data.client(c), seeded_generator(cfg.seed, 1, c)
    ref.train()
    for _ in range(cfg.local.epochs):
        perm = torch.randperm(client.num_train, generator=gen)
        for s in range(0, client.num_train, cfg.local.batch_size):
            idx = perm[s: s + cfg.local.batch_size]
            opt.zero_grad()
            F.cross_entropy(ref(client.x_train[idx]), client.y_train[idx]).backward()
            opt.step()
    return flat_state(ref)


@pytest.mark.parametrize("name", ["lenet5", "cnn_bn", "cnn"])
def test_lockstep_cnn_training_equals_a_plain_loop_per_client_in_float64(name):
    cfg, data, net = setup(name, torch.float64)
    model = FlatModel(copy.deepcopy(net))
    starts = torch.stack([model.state() + 0.01 * c for c in range(len(SIZES))])
    trained, _ = cohort(cfg, data, model, lockstep=True).train(starts)
    for c in range(len(SIZES)):
        expected = plain_loop(cfg, data, net, starts[c], c)
        assert torch.allclose(trained[c], expected, atol=1e-10, rtol=1e-10), (name, c, (trained[c] - expected).abs().max())
        assert not torch.allclose(trained[c], starts[c], atol=1e-3)  # training moved it
    if trained.shape[1] > model.param_size:  # each client kept its own BatchNorm statistics
        buffers = trained[:, model.param_size:]
        assert not torch.allclose(buffers[0], buffers[1])


@pytest.mark.parametrize("name", ["lenet5", "cnn_bn", "cnn"])
def test_lockstep_cnn_training_in_float32_stays_near_the_float64_loop(name):
    """Float32 rounding, amplified by 6-8 steps of BatchNorm training from these starts (measured: lockstep 1e-7 to
    4e-4 from float64, the per-client path 3e-7 to 2e-2; the lockstep BatchNorm sums as exactly as PyTorch's
    standard-layout kernel)."""
    cfg, data, net = setup(name, torch.float32)
    model = FlatModel(copy.deepcopy(net))
    starts = torch.stack([model.state() + 0.01 * c for c in range(len(SIZES))])
    lock, _ = cohort(cfg, data, model, lockstep=True).train(starts)
    _, exact_data, exact_net = setup(name, torch.float64)
    for c in range(len(SIZES)):
        expected = plain_loop(cfg, exact_data, exact_net, starts[c].double(), c)
        assert ((lock[c].double() - expected).abs() / (expected.abs() + 1)).max() < 2e-3, (name, c)


def test_lockstep_gradient_stream_updates_each_clients_batchnorm_statistics():
    """pFedMe's and Per-FedAvg's solver path: one batch's gradients and running statistics in lockstep equal a
    plain module's, client by client (float64)."""
    cfg, data, net = setup("lenet5", torch.float64)
    model = FlatModel(copy.deepcopy(net))
    P = model.param_size
    starts = torch.stack([model.state() + 0.01 * c for c in range(len(SIZES))])
    stream = cohort(cfg, data, model, lockstep=True).stream(cfg.local, starts[:, P:])
    assert stream.lockstep
    grads, _ = stream.gradient(starts[:, :P], 0)
    for c in range(len(SIZES)):
        ref = module_at(net, starts[c])
        ref.train()
        real = stream.idx[0][c]
        F.cross_entropy(ref(data.x_train[real]), data.y_train[real]).backward()
        assert torch.allclose(grads[c], flat_params(ref, grads=True), atol=1e-10), c
        assert torch.allclose(stream.buffers[c], flat_state(ref)[P:], atol=1e-12), c
    ended = ~stream.active(stream.steps - 1)  # the smaller clients' streams have ended by the last step
    assert ended.any()
    grads, _ = stream.gradient(starts[:, :P], stream.steps - 1)
    assert torch.equal(grads[ended], torch.zeros_like(grads[ended]))


def test_cnns_train_side_by_side_unless_lockstep_is_forced():
    """On a CPU the CNNs' clients side by side measured faster than lockstep (bench_cnn_clients.py); dense models
    train through their batched form whatever the cohort (Cohort.batchable)."""
    cfg, data, net = setup("lenet5", torch.float32)
    model = FlatModel(net)
    assert not cohort(cfg, data, model, lockstep=None).batchable
    assert cohort(cfg, data, model, lockstep=True).batchable


def test_lockstep_two_head_gradient_equals_the_per_client_path_with_batchnorm():
    """FedTC's two classifiers in lockstep on a BatchNorm model (float64): the gradients and the first head's loss
    of the per-client path (one extractor pass), and the running statistics updated once per batch."""
    cfg, data, net = setup("lenet5", torch.float64)
    model = FlatModel(copy.deepcopy(net))
    P, head = model.param_size, model.head_layers[0].params
    starts = torch.stack([model.state() + 0.01 * c for c in range(len(SIZES))])
    second = starts[:, head] * 0.5 + 0.01
    lock = cohort(cfg, data, model, lockstep=True).stream(cfg.local, starts[:, P:])
    alone = cohort(cfg, data, model, lockstep=False).stream(cfg.local, starts[:, P:])
    for t in (0, 1):
        got = lock.two_head_gradient(starts[:, :P], second, t, 0.7)
        want = alone.two_head_gradient(starts[:, :P], second, t, 0.7)
        for g, w in zip(got, want):
            assert torch.allclose(g.double(), w.double(), atol=1e-10), t
        assert torch.allclose(lock.buffers, alone.buffers, atol=1e-12, rtol=1e-12), t
    assert not torch.allclose(lock.buffers, starts[:, P:])
