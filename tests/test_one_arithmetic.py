"""One arithmetic per client, whatever runs it: a dense model's client trains through the model's batched form
whether it is alone (a Flower ClientApp's cohort of one), in one lockstep with a round's other clients, or, where
one lockstep does not pay (epochs over heavy-tailed client sizes), alone in the batched form beside the others; the
three give the same bits, because a row of a batched product does not depend on the other rows; the CNNs on a
CPU train client by client, each on one thread, alone or beside others. (The in-process
engine against Flower's runtimes, every algorithm, dense and CNN: tests/test_flower.py.)"""
from __future__ import annotations


import pytest
import torch

from pfedkit.config import RuntimeConfig, load_config
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Cohort, Objective, seeded_generator

# Synthetic's natural clients: heavy-tailed sizes (one lockstep of epochs would keep most clients waiting)
SETTINGS = {
    "mlr epochs": ["model.name=mlr", "local.epochs=2"],
    "dnn steps": ["model.name=dnn", "model.hidden=24", "local.steps=7", "local.momentum=0.9",
                  "local.weight_decay=0.001"],
}


def setup(extra: list[str]):
    cfg = load_config(None, ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=12",
                             "dataset.synthetic.size_factor=1", "local.batch_size=10", "progress=false", *extra],
                      "fedavg")
    data = prepare(cfg)
    return cfg, data, FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))


def cohort(cfg, data, model, cids, lockstep=None) -> Cohort:
    return Cohort(cids, 3, data, model, cfg.local, [seeded_generator(cfg.seed, 3, c) for c in cids], lockstep)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_dense_client_trains_the_same_bits_alone_in_lockstep_or_beside_the_others(setting):
    cfg, data, model = setup(SETTINGS[setting])
    cids = list(range(0, 12, 2))
    starts = torch.stack([model.state() + 0.01 * k for k in range(len(cids))])
    anchor = model.state().repeat(len(cids), 1)
    objective = Objective(prox_anchor=anchor, prox_mu=0.1)
    default = cohort(cfg, data, model, cids)
    assert default.batchable
    if setting == "mlr epochs":
        assert not default.lockstep_pays()  # so the cohort trains each client alone in the batched form
    trained, losses = default.train(starts, objective)
    together, together_losses = cohort(cfg, data, model, cids, lockstep=True).train(starts, objective)
    assert torch.equal(trained, together) and torch.equal(losses, together_losses)
    for k, c in enumerate(cids):
        alone, alone_loss = cohort(cfg, data, model, [c]).train(starts[k:k + 1], objective.part([k]))
        assert torch.equal(alone[0], together[k]) and torch.equal(alone_loss[0], together_losses[k]), c
    assert not torch.equal(trained, starts)  # training did something to compare


def test_a_dense_clients_gradient_stream_is_the_same_alone_and_beside_the_others():
    """pFedMe's and Per-FedAvg's solvers read gradients step by step: the same for a client alone."""
    cfg, data, model = setup(SETTINGS["mlr epochs"])
    cids = [1, 4, 7]
    P = model.param_size
    params = torch.stack([model.state()[:P] + 0.02 * k for k in range(len(cids))])
    stream = cohort(cfg, data, model, cids).stream(cfg.local)
    alone = [cohort(cfg, data, model, [c]).stream(cfg.local) for c in cids]
    for t in range(stream.steps):
        grads, losses = stream.gradient(params, t)
        for k, one in enumerate(alone):
            if t < one.steps:
                g, loss = one.gradient(params[k:k + 1], t)
                assert torch.equal(g[0], grads[k]) and torch.equal(loss[0], losses[k]), (t, k)
            else:  # its stream has ended: no gradient
                assert torch.equal(grads[k], torch.zeros_like(grads[k]))


def test_a_cnn_client_trains_the_same_bits_alone_one_by_one_or_side_by_side_at_any_thread_count():
    """The CNNs on a CPU train client by client: side by side in threads (`runtime.workers` 2, one intra-op thread
    each), one after another (`runtime.workers` 1), or alone (a Flower ClientApp), each client's ops on one thread,
    so the same bits whatever the process's thread count (a convolution on two threads reduces in another order)."""
    cfg = load_config(None, ["dataset.name=mnist5k", "partition.num_clients=8", "partition.samples_per_client=40",
                             "model.name=cnn", "local.epochs=1", "local.batch_size=16", "progress=false"], "fedavg")
    data = prepare(cfg)
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    cids = [0, 3, 5, 6]
    starts = torch.stack([model.state() + 0.01 * k for k in range(len(cids))])
    threads = torch.get_num_threads()
    results = {}
    try:
        for count in (2, 1):
            torch.set_num_threads(count)
            for workers in (2, 1):
                together = Cohort(cids, 3, data, model, cfg.local, [seeded_generator(cfg.seed, 3, c) for c in cids],
                                  runtime=RuntimeConfig(workers=workers, workers_in="threads"))
                assert not together.batchable
                results[count, workers] = together.train(starts)
            alone = [cohort(cfg, data, model, [c]).train(starts[k:k + 1]) for k, c in enumerate(cids)]
            results[count, "alone"] = (torch.cat([t for t, _ in alone]), torch.cat([l for _, l in alone]))
    finally:
        torch.set_num_threads(threads)
    (reference, reference_losses), *others = results.values()
    assert not torch.equal(reference, starts)
    for key, (trained, losses) in results.items():
        assert torch.equal(trained, reference) and torch.equal(losses, reference_losses), key
