"""Clients trained side by side (`runtime.workers`): each worker thread runs a client's ops on one intra-op thread
with a model replica of its own, so every client's result is the one it gets alone on one thread, whatever worker
ran it and in whatever order, BatchNorm statistics included."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from pfedkit.config import ModelConfig, RuntimeConfig, load_config
from pfedkit.engine import TIMING_KEYS, Run
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import Cohort, in_threads, predict, seeded_generator
from flat_layout import flat_state, load_state  # noqa: E402


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cnn_bn_data(clients=5):
    cfg = load_config(None, ["dataset.name=mnist5k", "model.name=cnn_bn", f"partition.num_clients={clients}",
                             "partition.samples_per_client=60", "local.batch_size=16", "local.momentum=0.5",
                             "progress=false", "plots=false"], "fedavg")
    return cfg, prepare(cfg)


def cohort(cfg, data, model, workers, rnd=1):
    cids = list(range(data.num_clients))
    return Cohort(cids, rnd, data, model, cfg.local, [seeded_generator(cfg.seed, rnd, c) for c in cids],
                  runtime=RuntimeConfig(workers=workers))


def test_side_by_side_training_equals_plain_loop_per_client(one_thread):
    """In float64: in float32 these clients' training amplifies rounding (a pooling window's winner flips), and
    PyTorch's own float32 loop lands as far from float64 as pfedkit's C step does (up to 4e-2 on one client's
    parameters, both), so only float64 can tell a wrong formula from rounding."""
    cfg, data = cnn_bn_data()
    data.x_train = data.x_train.double()
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, 0).double())
    starts = torch.stack([model.state() + 0.01 * c for c in range(data.num_clients)])  # a different start each
    trained, losses = cohort(cfg, data, model, workers=3).train(starts)

    # reference: plain PyTorch per client (nn.Module, torch.optim.SGD with momentum, the same seeded batches)
    net = build_model(cfg.model, data.input_shape, data.num_classes, 0).double()
    for c in range(data.num_clients):
        ref = copy.deepcopy(net)
        load_state(starts[c], ref)
        opt = torch.optim.SGD(ref.parameters(), lr=cfg.local.lr, momentum=cfg.local.momentum)
        client, gen, batch_losses = data.client(c), seeded_generator(cfg.seed, 1, c), []
        perm = torch.randperm(client.num_train, generator=gen)
        for start in range(0, client.num_train, cfg.local.batch_size):
            idx = perm[start: start + cfg.local.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(ref(client.x_train[idx]), client.y_train[idx])
            loss.backward()
            opt.step()
            batch_losses.append(float(loss.detach()))
        expected = flat_state(ref)
        assert torch.allclose(trained[c], expected, atol=1e-10), c  # parameters and this client's BN statistics
        assert float(losses[c]) == pytest.approx(sum(batch_losses) / len(batch_losses), rel=1e-6)  # summed in float32
    # each client kept its own BN running statistics (they differ between clients)
    buffers = trained[:, model.param_size:]
    assert not torch.allclose(buffers[0], buffers[1])


def test_side_by_side_is_bitwise_the_one_at_a_time_result_on_one_thread(one_thread):
    cfg, data = cnn_bn_data()
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, 0))
    starts = model.state().repeat(data.num_clients, 1)
    alone = cohort(cfg, data, model, workers=1).train(starts)
    for workers in (2, 4):
        side = cohort(cfg, data, model, workers=workers).train(starts)
        assert torch.equal(alone[0], side[0]) and torch.equal(alone[1], side[1])
    assert torch.get_num_threads() == 1  # the caller's thread count is restored


def test_a_clients_error_reaches_the_caller_and_threads_are_restored():
    cfg, data = cnn_bn_data()
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, 0))
    before = torch.get_num_threads()

    def fail_on_third(m, i):
        if i == 2:
            raise ValueError("client 2 broke")
    with pytest.raises(ValueError, match="client 2 broke"):
        cohort(cfg, data, model, workers=2).each_client(fail_on_third)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("grad", [False, True])
def test_side_by_side_tasks_run_under_the_callers_grad_mode(grad):
    """Grad mode is thread-local: a worker thread starts with autograd on. Evaluation (predict's no_grad) must not
    build graphs in its side-by-side chunks (it did: 2.2x slower for LeNet-5, and its pooling took the training
    kernel); training must keep autograd."""
    with torch.set_grad_enabled(grad):
        seen = in_threads(2, [torch.is_grad_enabled for _ in range(4)])
    assert seen == [grad] * 4
    model = FlatModel(build_model(ModelConfig("lenet5"), (1, 28, 28), 10, 0))
    x = torch.randn(600, 1, 28, 28)  # three 256-sample chunks: side by side on 2 threads
    outputs: list[torch.Tensor] = []
    handle = model.module.fc3.register_forward_hook(lambda m, i, out: outputs.append(out))
    try:
        predict(model, x, torch.zeros(600, dtype=torch.long))
    finally:
        handle.remove()
    assert len(outputs) == 3 and not any(o.requires_grad for o in outputs)


def test_workers_auto_follows_the_cpu_threads_and_the_cohort_size():
    cfg, data = cnn_bn_data(clients=3)
    model = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, 0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cohort(cfg, data, model, workers=0).workers() == 2
        torch.set_num_threads(8)
        assert cohort(cfg, data, model, workers=0).workers() == 3  # never more than the clients
        assert cohort(cfg, data, model, workers=1).workers() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("algorithm", ["pfedme", "fedrep"])
def test_runs_with_workers_equal_one_at_a_time_end_to_end(tmp_path, one_thread, algorithm):
    """FedRep trains through Cohort.train and is scored per client, pFedMe through the gradient stream: both go
    side by side."""
    rows = {}
    for workers in (1, 2):
        cfg = load_config(None, ["dataset.name=mnist5k", "model.name=cnn_bn", "partition.num_clients=4",
                                 "partition.samples_per_client=32", "rounds=2", "local.batch_size=16",
                                 f"runtime.workers={workers}", "progress=false", "plots=false"], algorithm)
        run = Run(cfg.for_algorithm(algorithm), prepare(cfg), tmp_path / str(workers))
        run.run()
        rows[workers] = [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
                         for line in (tmp_path / str(workers) / "metrics.jsonl").read_text().splitlines()]
    assert rows[1] == rows[2]


@pytest.mark.parametrize("model, extra, way", [
    ("dnn", ["runtime.batch_runs=false"], "through the model's batched form, each client on one thread"),
    ("cnn", ["runtime.workers=1", "runtime.batch_runs=false"], "one after another, each on one thread"),
    ("cnn", ["runtime.workers=2", "runtime.workers_in=threads", "runtime.batch_runs=false"],
     "2 side by side in threads, each on one thread"),
    ("dnn", ["runtime.workers=2", "runtime.threads=2"], "one process (runtime.batch_runs); clients: on the CPU through the model's batched form, "
                                   "each client on one thread, a round's clients in one lockstep where most of them "
                                   "are busy in most steps, the locksteps on 2 workers shared by the runs"),
    ("cnn", ["runtime.workers=2", "runtime.threads=2"], "one process (runtime.batch_runs); clients: on cpu, 2 workers shared by the runs"),
])
def test_the_way_clients_train_is_said_once_an_experiment_and_its_caches_live_on_the_runs_runner(tmp_path, model,
                                                                                                extra, way):
    from pfedkit.experiment import run_experiment
    lines = []
    cfg = load_config(None, ["dataset.name=mnist5k", "partition.num_clients=4", "partition.samples_per_client=40",
                             f"model.name={model}", "model.hidden=16", "rounds=2", "local.batch_size=16",
                             "progress=false", "plots=false", *extra], "local,fedavg")
    run_experiment(cfg, tmp_path / "x", log=lines.append)
    said = [line for line in lines if line.startswith(("clients:", "runs:"))]
    assert len(said) == 1 and way in said[0], said
    one = cfg.for_algorithm("fedavg")
    run = Run(one, prepare(one), tmp_path / "y")
    run.run()
    runner = run.clients.runner  # what the ways of running keep between rounds: on the run, not on the model
    assert (runner._loss is not None) == (model == "dnn")
    assert not any(hasattr(run.model, name) for name in ("batched_loss", "fork_placement", "worker_replicas"))
