"""Every executor of the runtime (pfedkit/runtime/) gives a client the reference result, bit for bit: the client
trained as a cohort of one (what a Flower ClientApp runs), against one after another, side by side in threads, side
by side in forked processes, and a round's clients in lockstep, for every model, with a plain objective (a BatchNorm
CNN's whole local SGD one C call) and with a proximal pull and frozen entries (its steps through autograd). The CNNs'
lockstep form (grouped convolutions) is not a CPU executor: it is taken on a GPU only, where a cohort of one takes it
too (tests/test_lockstep_cnn.py holds it to a tolerance on the CPU; tests/test_cuda.py on the GPU)."""
from __future__ import annotations

import pytest
import torch

from pfedkit.config import RuntimeConfig, load_config
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.runtime import processes
from pfedkit.train import Cohort, Objective, seeded_generator

MODELS = ["mlr", "dnn", "cnn", "cnn_bn", "lenet5"]
EXECUTORS = {
    "one after another": dict(runtime=RuntimeConfig(workers=1)),
    "threads": dict(runtime=RuntimeConfig(workers=2, workers_in="threads")),
    "processes": dict(runtime=RuntimeConfig(workers=2, workers_in="processes")),
    "lockstep": dict(lockstep=True),
}


@pytest.fixture(scope="module", params=MODELS)
def setting(request):
    cfg = load_config(None, ["dataset.name=mnist5k", f"model.name={request.param}", "model.hidden=24",
                             "partition.num_clients=6", "partition.samples_per_client=40", "local.epochs=1",
                             "local.batch_size=16", "local.momentum=0.5", "progress=false"], "fedavg")
    data = prepare(cfg)
    return cfg, data, FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))


def objective(model: FlatModel, kind: str, starts: torch.Tensor) -> Objective:
    if kind == "plain":
        return Objective()
    trainable = torch.ones(len(starts), model.param_size)
    trainable[:, model.head_layers[0].params.stop - 10: model.head_layers[0].params.stop] = 0.0  # the head's bias
    return Objective(prox_anchor=starts * 0.5, prox_mu=0.1, trainable=trainable)


@pytest.mark.parametrize("kind", ["plain", "prox and frozen bias"])
@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_every_executor_gives_each_client_the_result_it_gets_alone(setting, executor, kind):
    cfg, data, model = setting
    dense = all(p.dim() <= 2 for p in model.module.parameters())
    if executor == "lockstep" and not dense:
        pytest.skip("the CNNs' lockstep form is the GPU's executor, not the CPU's")
    if executor == "processes" and not processes.available():
        pytest.skip("forked workers: Linux only")
    cids = [0, 2, 3, 5]
    starts = torch.stack([model.state() + 0.01 * k for k in range(len(cids))])
    goal = objective(model, kind, starts)
    gens = lambda: [seeded_generator(cfg.seed, 4, c) for c in cids]  # noqa: E731
    alone = [Cohort([c], 4, data, model, cfg.local, [gen]).train(starts[k:k + 1], goal.part([k]))
             for k, (c, gen) in enumerate(zip(cids, gens()))]
    reference = torch.cat([t for t, _ in alone]), torch.cat([l for _, l in alone])
    cohort = Cohort(cids, 4, data, model, cfg.local, gens(), **EXECUTORS[executor])
    if executor == "processes" and not dense:
        assert cohort.runner.may_fork(len(cids))
    trained, losses = cohort.train(starts, goal)
    assert torch.equal(trained, reference[0]) and torch.equal(losses, reference[1])
    assert not torch.equal(trained, starts)
