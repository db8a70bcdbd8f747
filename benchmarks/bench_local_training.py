"""Engine overhead: FedAvg through pfedkit's engine vs a bare PyTorch FedAvg loop doing the same steps.

Both run the same model, the same initial weights, the same clients and the same seeded mini-batches; the bare
loop uses an ordinary nn.Module, torch.optim.SGD and state_dict averaging. Runs alternate (bare, engine, ...) and
the best of each is kept, so machine noise hits both alike. Prints client-steps/s and the ratio
engine / bare (target >= 0.9 for the CNN on mnist5k).

    python benchmarks/bench_local_training.py [--rounds 4] [--repeats 3] [--models cnn,mlr,dnn,mlr-steps,dnn-steps]

cnn/mlr/dnn: epochs over the clients' data (per-client path; Synthetic's heavy-tailed client sizes make lockstep
not pay there); mlr-steps/dnn-steps: 20 mini-batch steps for each of 100 clients, and mlr-s5/dnn-s5 for 5 of them
per round (the engine trains a round's clients in lockstep: batched products, one autograd pass per step).
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch
import torch.nn.functional as F

from pfedkit.config import load_config
from pfedkit.engine import Run
from pfedkit.experiment import prepare
from pfedkit.models import build_model
from pfedkit.models.nets import CNN
from pfedkit.sampling import uniform_sample
from pfedkit.train import batch_indices, seeded_generator

SETTINGS = {
    "cnn": ["dataset.name=mnist5k", "model.name=cnn", "partition.num_clients=10", "local.batch_size=32"],
    "mlr": ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=20", "model.name=mlr",
            "local.batch_size=20"],
    "dnn": ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=20", "model.name=dnn",
            "model.hidden=20", "local.batch_size=20"],
    # pFedMe-style local work: 20 mini-batch steps per client and round, all 100 clients (lockstep in the engine)
    "mlr-steps": ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=100",
                  "model.name=mlr", "local.batch_size=20", "local.steps=20"],
    "dnn-steps": ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=100",
                  "model.name=dnn", "model.hidden=20", "local.batch_size=20", "local.steps=20"],
    # the pFedCS paper's baselines: 5 of the 100 clients per round, 20 steps each (lockstep for 5 clients)
    "mlr-s5": ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=100",
               "model.name=mlr", "local.batch_size=20", "local.steps=20", "clients_per_round=5", "rounds=40"],
    "dnn-s5": ["dataset.name=synthetic", "partition.scheme=natural", "partition.num_clients=100",
               "model.name=dnn", "model.hidden=20", "local.batch_size=20", "local.steps=20", "clients_per_round=5",
               "rounds=40"],
}


class PlainCNN(torch.nn.Module):
    """pfedkit's CNN (the same modules and state dict) with its plain PyTorch forward, the pooling replaceable (the
    engine runs it through the C kernels instead: runtime/cnn.py)."""

    def __init__(self, cnn: CNN, pool=None):
        super().__init__()
        self.pool = pool or (lambda x: F.max_pool2d(x, 2))
        self.conv1, self.bn1, self.conv2, self.bn2 = cnn.conv1, cnn.bn1, cnn.conv2, cnn.bn2
        self.fc1, self.fc2, self.fc3 = cnn.fc1, cnn.fc2, cnn.fc3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


def plain(net: torch.nn.Module) -> torch.nn.Module:
    """The model as a bare PyTorch loop would have it (PlainCNN for the CNNs)."""
    return PlainCNN(net) if isinstance(net, CNN) else net


def bare_fedavg(cfg, data) -> tuple[float, int]:
    """Plain PyTorch FedAvg: load the global state dict, SGD over the seeded batches, average state dicts."""
    net = plain(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)).to(data.device)
    global_state = copy.deepcopy(net.state_dict())
    steps = 0
    t0 = time.perf_counter()
    for rnd in range(1, cfg.rounds + 1):
        states, sizes = [], []
        for cid in uniform_sample(cfg.seed, rnd, data.num_clients, cfg.clients_per_round):
            client = data.client(cid)
            net.load_state_dict(global_state)
            opt = torch.optim.SGD(net.parameters(), lr=cfg.local.lr)
            gen = seeded_generator(cfg.seed, rnd, cid)
            net.train()
            for idx in batch_indices(client.num_train, cfg.local, gen, torch.device("cpu")):  # the same batches
                opt.zero_grad()
                F.cross_entropy(net(client.x_train[idx]), client.y_train[idx]).backward()
                opt.step()
                steps += 1
            states.append({k: v.clone() for k, v in net.state_dict().items()})
            sizes.append(client.num_train)
        total = sum(sizes)
        global_state = {k: sum(s[k].float() * (n / total) for s, n in zip(states, sizes)).to(states[0][k].dtype)
                        for k in states[0]}
    return time.perf_counter() - t0, steps


def engine_fedavg(cfg, data) -> float:
    with tempfile.TemporaryDirectory() as out:
        run = Run(cfg.for_algorithm("fedavg"), data, out)
        run.run()
        row = run.metrics[-1]
        return row["wall_s"] - row["eval_s"]  # the final evaluation is not training


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="cnn,mlr,dnn,mlr-steps,dnn-steps,mlr-s5,dnn-s5")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    print(f"{'model':>9} {'steps':>7} {'bare steps/s':>13} {'engine steps/s':>15} {'ratio':>7}")
    for name in args.models.split(","):
        cfg = load_config(None, [  # a setting may set its own rounds
            f"rounds={args.rounds}", f"local.epochs={args.epochs}", "progress=false", "plots=false",
            "eval_every=1000", "checkpoint_every=0", f"device={args.device}"] + SETTINGS[name], "fedavg")
        data = prepare(cfg)
        bare_best, engine_best, steps = float("inf"), float("inf"), 0
        bare_fedavg(cfg, data)  # warm-up (allocator, kernels)
        for _ in range(args.repeats):
            t, steps = bare_fedavg(cfg, data)
            bare_best = min(bare_best, t)
            engine_best = min(engine_best, engine_fedavg(cfg, data))
        print(f"{name:>9} {steps:>7} {steps / bare_best:>13.0f} {steps / engine_best:>15.0f} "
              f"{bare_best / engine_best:>7.2f}")


if __name__ == "__main__":
    main()
