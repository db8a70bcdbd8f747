"""The engine on a GPU: lockstep CNN training in float64 against a plain PyTorch loop per client on the CPU, the
CUDA-graph replays against the eager steps, and every algorithm's run on the GPU against its run on the CPU.
Those need CUDA and are skipped without it (CI has no GPU; benchmarks/gpu_check.sh runs them on a lent device);
the graph cache's bookkeeping runs everywhere."""
from __future__ import annotations

import copy

import pytest
import torch

from pfedkit.config import load_config
from pfedkit.runtime.cuda_graphs import GraphCache
from pfedkit.experiment import prepare, run_experiment
from pfedkit.models import FlatModel
from pfedkit.registry import ALGORITHMS
from pfedkit.train import Objective
from test_lockstep_cnn import SIZES, cohort, plain_loop, setup

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def on_cuda(data):
    """The test cohort's data (train_rows of the CPU data) moved to the GPU."""
    data = copy.copy(data)
    data.x_train, data.y_train = data.x_train.to(CUDA), data.y_train.to(CUDA)
    data.device = CUDA
    return data


@needs_cuda
@pytest.mark.parametrize("name", ["lenet5", "cnn_bn", "cnn"])
def test_gpu_lockstep_with_graphs_equals_a_plain_cpu_loop_per_client_in_float64(name):
    cfg, data, net = setup(name, torch.float64)
    model = FlatModel(copy.deepcopy(net).to(CUDA))
    starts = torch.stack([model.state() + 0.01 * c for c in range(len(SIZES))])
    clients = cohort(cfg, on_cuda(data), model, None)
    assert clients.batchable and clients.lockstep_pays()  # the GPU default
    trained, _ = clients.train(starts)
    assert len(model.batched_loss.graphs.entries) == 1 and None not in model.batched_loss.graphs.entries.values()
    for c in range(len(SIZES)):
        expected = plain_loop(cfg, data, net, starts[c].cpu(), c)
        assert torch.allclose(trained[c].cpu(), expected, atol=1e-9, rtol=1e-9), (name, c)


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic convolutions: its default weight-gradient kernels sum in a varying order, so two eager
    runs of 12 BatchNorm-CNN steps already differ by 4e-4 (seen on an H200)."""
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


@needs_cuda
@pytest.mark.parametrize("name", ["lenet5", "cnn_bn"])
def test_graph_replays_equal_the_eager_steps_and_the_graph_is_reused(name, deterministic_cudnn):
    """Momentum, weight decay, a proximal anchor and a frozen head, over two calls from different starts: the
    second call replays the first call's graph with the new start and anchor copied in. The same kernels on the
    same inputs: the same bits."""
    cfg, data, net = setup(name, torch.float32)
    data = on_cuda(data)
    model = FlatModel(copy.deepcopy(net).to(CUDA))
    base = torch.stack([model.state() + 0.01 * c for c in range(len(SIZES))])
    trainable = torch.ones(model.param_size, device=CUDA)
    trainable[model.head_layers[0].params] = 0.0
    for call, starts in enumerate((base, base.flip(0) * 0.9)):
        objective = Objective(prox_anchor=starts * (1.0 + 0.1 * call), prox_mu=0.1, trainable=trainable)
        graphed, g_loss = cohort(cfg, data, model, None, weight_decay=1e-3).train(starts, objective)
        eager, e_loss = cohort(cfg, data, model, None, weight_decay=1e-3, cuda_graphs=False).train(starts, objective)
        assert torch.equal(graphed, eager), (call, (graphed - eager).abs().max())
        assert torch.equal(g_loss, e_loss), call
        head = model.head_layers[0].params
        assert torch.equal(graphed[:, head], starts[:, head])  # frozen
        assert not torch.allclose(graphed, starts, atol=1e-3)
    assert len(model.batched_loss.graphs.entries) == 1  # captured once, replayed in both calls


@needs_cuda
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_runs_on_the_gpu_near_its_cpu_run(algorithm, tmp_path):
    """Three rounds on mnist5k with the CNN: the GPU run's final personalized accuracy within 5 points of the CPU
    run's (other kernels round differently, so not equal)."""
    accuracy = {}
    for device in ("cuda", "cpu"):  # the CPU run after CUDA is in use: no forked workers then (processes.py)
        cfg = load_config(None, ["dataset.name=mnist5k", "model.name=cnn", "partition.num_clients=10",
                                 "partition.samples_per_client=100", "clients_per_round=5", "rounds=3",
                                 "eval_every=1", f"device={device}", "progress=false", "plots=false"], algorithm)
        (summary,) = run_experiment(cfg, tmp_path / device, data=prepare(cfg), log=lambda _: None)
        accuracy[device] = summary["personalized_acc"]
    assert abs(accuracy["cuda"] - accuracy["cpu"]) < 0.05, accuracy


def test_graph_cache_keeps_the_last_entries_and_remembers_a_failed_capture():
    made = []

    def make(key):
        def build():
            made.append(key)
            if key == "bad":
                raise RuntimeError("operation not permitted when stream is capturing")
            return f"graph {key}"
        return build
    cache = GraphCache(size=2)
    assert cache.get("a", make("a")) == "graph a"
    assert cache.get("b", make("b")) == "graph b"
    assert cache.get("a", make("a")) == "graph a"  # a hit: not made again, and now the most recent
    assert cache.get("c", make("c")) == "graph c"  # evicts b, the least recently used
    assert list(cache.entries) == ["a", "c"]
    assert cache.get("b", make("b")) == "graph b"  # made again
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert cache.get("bad", make("bad")) is None
    assert cache.get("bad", make("bad")) is None  # eager from then on: no second try
    assert made == ["a", "b", "c", "b", "bad"]
