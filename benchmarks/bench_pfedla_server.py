"""pFedLA's server step alone: payloads for the sampled clients, then the hypernetwork update and Theta refresh.

For N = 10, 100, 1000 clients (10 % sampled per round, all when N = 10) and an MLR-sized and a CNN-sized model,
prints seconds per round and memory: the server state (Theta, N x D, plus the hypernetworks, whose heads hold
N x layers x N x hidden weights by the paper's design, and Adam's two moments of them; `--hn-dtype bfloat16` stores
those in half the bytes) and the working memory of a round on top of it (peak RSS
minus RSS before the round). Each configuration runs in a fresh process so peaks do not mix.

With --engine it also runs the real engine on Fashion-MNIST with the paper's 100-client protocol (10 % per
round, 20 local epochs) and prints the server's share of the round's time (target: <= 5 %).

    python benchmarks/bench_pfedla_server.py [--clients 10,100,1000] [--rounds 3] [--hn-dtype float32,bfloat16]
        [--engine]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

SHAPES = {"mlr": ("mlr", (1, 28, 28)), "cnn": ("cnn", (1, 28, 28)), "lenet5": ("lenet5", (1, 28, 28))}


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 1e6


def tensors_mb(obj) -> float:
    """MB held by every tensor in a (nested) state."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() / 1e6
    if isinstance(obj, dict):
        return sum(tensors_mb(v) for v in obj.values())
    return 0.0


def one(model: str, n: int, rounds: int, hn_dtype: str = "float32") -> dict:
    import torch

    from pfedkit.algorithms.pfedla import PFedLA
    from pfedkit.config import load_config
    from pfedkit.models import FlatModel, build_model

    cfg = load_config(None, [f"model.name={SHAPES[model][0]}", f"partition.num_clients={n}",
                             f"pfedla.hn_dtype={hn_dtype}"])
    fm = FlatModel(build_model(cfg.model, SHAPES[model][1], 10, 0))
    algo = PFedLA(cfg.params("pfedla"), fm, n, cfg.seed)
    state = algo.init_server(fm.state())
    state_mb = tensors_mb(state)  # Theta, the hypernetworks and Adam's two moments
    per_round = n if n <= 10 else n // 10
    gen = torch.Generator().manual_seed(0)
    before = rss_mb()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    times = []
    for rnd in range(1, rounds + 1):
        cids = sorted(torch.randperm(n, generator=gen)[:per_round].tolist())
        t0 = time.perf_counter()
        payloads = algo.payloads(state, cids, rnd)
        t1 = time.perf_counter()
        # stand-in for local training: the client's model moves a little from what it received
        updates = {}
        for c in cids:
            vec = state["theta"][c].clone()
            for name, values in payloads[c].items():
                vec[algo.slices[name]] = values
            updates[c] = {"weights": vec + 0.01 * torch.randn(vec.shape, generator=gen)}
        t2 = time.perf_counter()
        state = algo.aggregate(state, updates, {}, rnd)
        times.append((t1 - t0) + (time.perf_counter() - t2))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
    return {"model": model, "clients": n, "sampled": per_round, "params": fm.param_size,
            "layers": len(algo.groups), "server_s": min(times), "state_mb": state_mb,
            "theta_mb": state["theta"].numel() * 4 / 1e6,
            "round_mb": max(peak, peak_before) - before}


def engine_share(rounds: int) -> None:
    from pfedkit.config import load_config
    from pfedkit.engine import Run
    from pfedkit.experiment import prepare

    cfg = load_config(None, ["dataset.name=fmnist", "partition.num_clients=100", "clients_per_round=10",
                             "local.epochs=20", "local.lr=0.005", f"rounds={rounds}", f"eval_every={rounds}",
                             "progress=false", "plots=false", "checkpoint_every=0"], "pfedla")
    data = prepare(cfg)
    with tempfile.TemporaryDirectory() as out:
        run = Run(cfg.for_algorithm("pfedla"), data, out)
        run.run()
        row = run.metrics[-1]
        train_s = row["wall_s"] - sum(r["eval_s"] for r in run.metrics)
        server = run.totals["server_s"]
    print(f"engine, FMNIST, 100 clients, 10/round, 20 local epochs, CNN: {rounds} rounds, "
          f"{train_s / rounds:.2f} s per round, server {server / rounds:.3f} s per round "
          f"= {100 * server / train_s:.2f} % of the round (target <= 5 %)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--models", default="mlr,cnn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hn-dtype", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--engine", action="store_true", help="also measure the server's share in the real engine")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        model, n, dtype = args.one.split(":")
        print(json.dumps(one(model, int(n), args.rounds, dtype)))
        return
    print(f"{'model':>5} {'heads':>8} {'N':>5} {'sampled':>7} {'params':>7} {'s/round':>8} {'Theta MB':>9} "
          f"{'state MB':>9} {'round MB':>9} {'round MB/N':>10}")
    for model in args.models.split(","):
        for n, dtype in [(n, d) for n in map(int, args.clients.split(",")) for d in args.hn_dtype.split(",")]:
            out = subprocess.run([sys.executable, __file__, "--one", f"{model}:{n}:{dtype}", "--rounds",
                                  str(args.rounds)], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{model:>5} {dtype:>8} {n:>5} {r['sampled']:>7} {r['params']:>7} {r['server_s']:>8.3f} "
                  f"{r['theta_mb']:>9.1f} {r['state_mb']:>9.1f} {r['round_mb']:>9.1f} "
                  f"{r['round_mb'] / n:>10.3f}")
    if args.engine:
        engine_share(args.rounds)


if __name__ == "__main__":
    main()
