"""pFedMe/pFedCS local solver speed on Synthetic(0.4, 0.6), 100 clients, MLR and DNN: client-steps/s of
- a bare PyTorch loop written like the official pFedMe code (nn.Module per client step, its optimizer rule),
- pfedkit's per-client path (the one a Flower client runs), and
- pfedkit's lockstep path (all clients at once, one batched gradient per inner step; the simulator's).
All three do R = 20 mini-batches x K = 5 steps on |D| = 20 per client from the same start; the lockstep and
per-client results are checked equal. Runs alternate and the best of each is kept.

    python benchmarks/bench_pfedme_solver.py [--clients 100] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pfedkit.algorithms import ALGORITHMS
from pfedkit.train import Cohort
from pfedkit.config import load_config
from pfedkit.experiment import prepare
from pfedkit.models import FlatModel, build_model
from pfedkit.train import batch_indices, seeded_generator


def setup(model: str, clients: int):
    cfg = load_config(None, ["dataset.name=synthetic", "partition.scheme=natural", f"partition.num_clients={clients}",
                             f"model.name={model}", "model.hidden=20", "local.batch_size=20", "local.lr=0.005",
                             "pfedme.personal_lr=0.01", "pfedme.lamda=20"], "pfedme").for_algorithm("pfedme")
    data = prepare(cfg)
    fm = FlatModel(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed))
    return cfg, data, fm, ALGORITHMS["pfedme"](cfg.params("pfedme"), fm, data.num_clients, cfg.seed)


def cohort(cfg, data, fm, lockstep=None):
    cids = list(range(data.num_clients))
    return Cohort(cids, 1, data, fm, cfg.local, [seeded_generator(cfg.seed, 1, c) for c in cids], lockstep)


def bare_loop(cfg, data) -> float:
    """The official code's shape: per client, set params to w, then R batches x K optimizer steps."""
    p = cfg.params("pfedme")
    net = build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)
    w = [t.detach().clone() for t in net.parameters()]
    plan = ALGORITHMS["pfedme"](p, FlatModel(build_model(cfg.model, data.input_shape, 10, 0)), 1, cfg).plan(cfg.local)
    t0 = time.perf_counter()
    for c in range(data.num_clients):
        client = data.client(c)
        with torch.no_grad():
            for q, v in zip(net.parameters(), w):
                q.copy_(v)
        local = [v.clone() for v in w]
        for idx in batch_indices(client.num_train, plan, seeded_generator(cfg.seed, 1, c), torch.device("cpu")):
            x, y = client.x_train[idx], client.y_train[idx]
            for _ in range(p.inner_steps):
                net.zero_grad()
                F.cross_entropy(net(x), y).backward()
                with torch.no_grad():
                    for q, l in zip(net.parameters(), local):
                        q.sub_(p.personal_lr * (q.grad + p.lamda * (q - l) + p.mu * q))
            with torch.no_grad():
                for q, l in zip(net.parameters(), local):
                    l.sub_(cfg.local.lr * p.lamda * (l - q))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; pFedMe solver, Synthetic(0.4, 0.6), "
          f"{args.clients} clients, R=20 x K=5 steps on |D|=20")
    print(f"{'model':>5} {'bare steps/s':>13} {'per-client steps/s':>19} {'lockstep steps/s':>17} "
          f"{'lockstep/bare':>14}")
    for model in ("mlr", "dnn"):
        cfg, data, fm, algo = setup(model, args.clients)
        init = fm.state()
        payloads = [{"weights": init}] * data.num_clients
        cstates = [algo.init_client(c, init) for c in range(data.num_clients)]
        steps = data.num_clients * algo.params.local_rounds * algo.params.inner_steps
        best = {"bare": float("inf"), "loop": float("inf"), "lockstep": float("inf")}
        algo.client_update(payloads, cstates, cohort(cfg, data, fm))  # warm-up
        for _ in range(args.repeats):
            best["bare"] = min(best["bare"], bare_loop(cfg, data))
            t0 = time.perf_counter()
            loop, _ = algo.client_update(payloads, cstates, cohort(cfg, data, fm, lockstep=False))  # one by one
            best["loop"] = min(best["loop"], time.perf_counter() - t0)
            t0 = time.perf_counter()
            lock, _ = algo.client_update(payloads, cstates, cohort(cfg, data, fm))
            best["lockstep"] = min(best["lockstep"], time.perf_counter() - t0)
        worst = max(float((a["weights"] - b["weights"]).abs().max()) for a, b in zip(loop, lock))
        assert worst < 1e-4, f"lockstep and per-client results differ by {worst}"
        print(f"{model:>5} {steps / best['bare']:>13.0f} {steps / best['loop']:>19.0f} "
              f"{steps / best['lockstep']:>17.0f} {best['bare'] / best['lockstep']:>14.1f}")


if __name__ == "__main__":
    main()
