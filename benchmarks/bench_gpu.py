"""A round's CNN clients on a GPU, every way of running them against a bare PyTorch loop, with the GPU's
utilization: FL-bench's setting (FMNIST, 100 clients, 1 local epoch, batch 32, SGD), one round of `--cohort`
clients (10: FL-bench's clients per round), for LeNet-5, pFedHN's CNN and the CNN with BatchNorm.

    python benchmarks/bench_gpu.py [--models lenet5,cnn,cnn_bn] [--cohorts 10,100] [--seconds 2] [--smoke]

Candidates (each trains the same clients on the same seeded batches from the same start):
  bare             nn.Module + torch.optim.SGD, one client after another (the FL-bench users' loop)
  bare-graph       the same with each full batch's step (forward, backward, SGD) replayed as one captured CUDA
                   graph (PyTorch's whole-network capture recipe), the short last batch eager
  engine-1by1      pfedkit's Cohort one client after another (Cohort(lockstep=False))
  engine-lockstep  the Cohort's lockstep path, eager (runtime.cuda_graphs=false): all clients' steps as grouped
                   convolutions and batched linear layers, dozens of kernel launches a step for all clients
  engine           the Cohort as it runs by default on a GPU: lockstep, each step one CUDA graph replay

Columns: s per round (the cohort once), client-steps/s, ratio to bare, and the GPU's utilization as NVML reports
it (nvidia-smi's "GPU-Util": the share of time some kernel ran, sampled every 20 ms over the timed runs). (A
kernel-busy share from torch.profiler's device events agreed with it for the eager rows but summed to 110-200 % of
the wall time for graph replays, so it is not printed.) Each candidate repeats its round for at least `--seconds`;
the mean is printed. `--smoke` runs on whatever device
there is (CPU in CI) with 3 small clients, to check the script runs; it times nothing meaningful.
"""
from __future__ import annotations

import argparse
import copy
import threading
import time

import torch
import torch.nn.functional as F

from bench_cnn_clients import batches, engine  # the clients' batches, a Cohort's round (this folder)
from bench_local_training import plain as plain_model  # the CNN with a plain PyTorch forward (this folder)
from pfedkit.config import load_config
from pfedkit.experiment import prepare
from pfedkit.models import build_model


def bare(net, work, lr):
    model = copy.deepcopy(net)
    start = copy.deepcopy(model.state_dict())
    model.train()

    def run():
        for client in work:
            model.load_state_dict(start)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            for x, y in client:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    return run


def bare_graph(net, work, lr):
    """bare with each full batch's step captured once and replayed (torch.cuda.graphs' whole-network recipe)."""
    model = copy.deepcopy(net)
    start = copy.deepcopy(model.state_dict())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x0, y0 = work[0][0]
    static_x, static_y = x0.clone(), y0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(static_x), static_y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        F.cross_entropy(model(static_x), static_y).backward()
        opt.step()

    def run():
        for client in work:
            model.load_state_dict(start)
            for x, y in client:
                if len(y) == len(static_y):
                    static_x.copy_(x)
                    static_y.copy_(y)
                    graph.replay()
                else:  # the short last batch: eager, into the graph's gradient tensors
                    for p in model.parameters():
                        p.grad.zero_()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
    return run


class Utilization:
    """NVML's GPU utilization sampled in a thread while the block runs (None without a GPU or nvidia-ml-py)."""

    def __init__(self):
        self.samples: list[int] = []
        try:
            import pynvml
            pynvml.nvmlInit()
            self.handle, self.read = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetUtilizationRates
        except Exception:  # no NVML here: the column stays empty
            self.handle = None

    def __enter__(self):
        self.stop = threading.Event()
        if self.handle is not None:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.02):
            self.samples.append(self.read(self.handle).gpu)

    def __exit__(self, *exc):
        self.stop.set()
        if self.handle is not None:
            self.thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device, seconds: float) -> tuple[float, float | None]:
    """(mean s per run, mean NVML utilization %) of fn repeated for at least `seconds`."""
    fn()  # warm-up: allocations, cuDNN's handles, graph capture
    sync(device)
    runs = 0
    with Utilization() as util:
        t0 = time.perf_counter()
        while runs == 0 or time.perf_counter() - t0 < seconds:
            fn()
            runs += 1
        sync(device)
        wall = (time.perf_counter() - t0) / runs
    return wall, util.mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet5,cnn,cnn_bn")
    ap.add_argument("--cohorts", default="10,100", help="clients trained at once; bare rows for the first only")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--root", default=None, help="dataset.root of the FMNIST files (default: the Debian package's)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {name}")
    setting = (["dataset.name=mnist5k", "partition.num_clients=3", "partition.samples_per_client=64"] if args.smoke
               else ["dataset.name=fmnist", "partition.num_clients=100"]
               + ([f"dataset.root={args.root}"] if args.root else []))
    cohorts = [3] if args.smoke else [int(c) for c in args.cohorts.split(",")]
    for model_name in args.models.split(","):
        cfg = load_config(None, [*setting, f"model.name={model_name}", "local.epochs=1", "local.batch_size=32",
                                 "local.lr=0.05", f"device={device.type}", "progress=false", "plots=false"], "fedavg")
        data = prepare(cfg)
        net = plain_model(build_model(cfg.model, data.input_shape, data.num_classes, cfg.seed)).to(device)
        for k, count in enumerate(cohorts):
            cids = list(range(count))
            work = batches(cfg, data, cids)
            steps = sum(len(w) for w in work)
            candidates = {}
            if k == 0:
                candidates["bare"] = bare(net, work, cfg.local.lr)
                if device.type == "cuda":
                    candidates["bare-graph"] = bare_graph(net, work, cfg.local.lr)
                candidates["engine-1by1"] = engine(cfg, data, 1, lockstep=False, cids=cids)
            candidates["engine-lockstep"] = engine(cfg, data, 1, lockstep=True, cids=cids, cuda_graphs=False)
            if device.type == "cuda":
                candidates["engine"] = engine(cfg, data, 1, cids=cids)
            print(f"\n{model_name}: {count} clients at once, {steps} client-steps a round")
            print(f"{'candidate':>16} {'s/round':>9} {'steps/s':>9} {'x bare':>7} {'GPU-Util':>9}")
            first = None
            for key, fn in candidates.items():
                wall, util = measure(fn, device, 0.0 if args.smoke else args.seconds)
                first = first or (wall if key == "bare" else None)
                ratio = f"{first / wall:7.2f}" if first else f"{'':>7}"
                u = f"{util:8.0f}%" if util is not None else f"{'-':>9}"
                print(f"{key:>16} {wall:9.4f} {steps / wall:9.0f} {ratio} {u}", flush=True)


if __name__ == "__main__":
    main()
