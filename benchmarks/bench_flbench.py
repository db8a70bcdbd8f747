"""pfedkit side by side with FL-bench's pFedLA benchmark setting: FMNIST, 100 clients, 10 a round, 1 local epoch,
batch 32, LeNet-5 (FL-bench's: conv 1->6, 5 + BN, conv 6->16, 5 + BN, fc 256->120->84->10).

FL-bench is not a dependency: its figures on this machine class (2 CPU threads, measured once with FL-bench's own
scripts) are the reference printed beside ours: 0.82 s/round for pFedLA (server 27 % of the round), 0.53 s/round
for FedAvg (training rounds; its evaluation of the 100 clients: 3.2 s). For each algorithm the script prints
s/round of the training rounds, the server's share of them, one evaluation of every client (seconds, and its share
of the time if evaluated every 10 rounds), the same clients' steps in a bare PyTorch loop (nn.Module,
torch.optim.SGD, the same batches) and the ratios.

    python benchmarks/bench_flbench.py [--rounds 10] [--algorithms fedavg,pfedla] [--clients 100] [--smoke]

`--clients 1000` (100 a round) gives the evaluation's share at N = 1,000 (FL-bench's figures are for N = 100).
`--model cnn` runs pFedHN's CNN instead (the model of the issue's first comparison); the last two columns put the
per-round ratio to FL-bench per unit of model cost, by parameters and by multiply-adds per sample against LeNet-5's
(counted by hand in `model_cost`).

Needs the full Fashion-MNIST (`apt-get install -y dataset-fashion-mnist`); `--smoke` runs 2 rounds on mnist5k
(for CI: it checks the script runs, it times nothing meaningful).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from bench_local_training import bare_fedavg  # the bare loop of the same steps (this folder)
from pfedkit.config import ModelConfig, load_config
from pfedkit.engine import Run
from pfedkit.experiment import prepare
from pfedkit.models import build_model

FLBENCH_S_PER_ROUND = {"pfedla": 0.82, "fedavg": 0.53}  # FL-bench, LeNet-5, 2 threads, this machine class
SETTING = ["dataset.name=fmnist", "partition.num_clients=100", "clients_per_round=10",
           "local.epochs=1", "local.batch_size=32", "progress=false", "plots=false",
           "checkpoint_every=0"]
SMOKE = ["dataset.name=mnist5k", "partition.num_clients=20", "clients_per_round=4"]


def model_cost(net: torch.nn.Module, side: int = 28) -> tuple[int, int]:
    """(parameters, multiply-adds of one forward per sample) of a CNN (conv 5x5 no padding, pool 2, then linear)."""
    params = sum(p.numel() for p in net.parameters())
    macs, s = 0, side
    for conv in (net.conv1, net.conv2):
        s -= conv.kernel_size[0] - 1
        macs += s * s * conv.out_channels * conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
        s //= 2
    macs += sum(fc.in_features * fc.out_features for fc in (net.fc1, net.fc2, net.fc3))
    return params, macs


def engine_round(cfg, data) -> dict:
    """Seconds of the training rounds and of the one evaluation of every client at the end."""
    with tempfile.TemporaryDirectory() as out:
        run = Run(cfg, data, out)
        summary = run.run()
        row = run.metrics[-1]
        train = row["wall_s"] - row["eval_s"]
        return {"s_round": train / cfg.rounds, "server": summary["server_s_total"] / train, "eval_s": row["eval_s"],
                "train_s_round": (train - summary["server_s_total"]) / cfg.rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--algorithms", default="fedavg,pfedla")
    ap.add_argument("--clients", type=int, default=100, help="N; a tenth of them train each round")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="lenet5", choices=["lenet5", "cnn", "cnn_bn"])
    args = ap.parse_args()
    rounds = 2 if args.smoke else args.rounds
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, {rounds} rounds, "
          f"{args.clients} clients")
    print(f"{'algorithm':>10} {'steps/rnd':>9} {'s/round':>8} {'server':>7} {'eval s':>7} {'eval/10 rnd':>12} {'client s/rnd':>13} "
          f"{'bare s/rnd':>11} {'client/bare':>12} {'FL-bench s/rnd':>15} {'x FL-bench':>11} {'x per param':>12} "
          f"{'x per MAC':>10} {'GPU GB':>7}")
    for name in args.algorithms.split(","):
        size = [] if args.smoke else [f"partition.num_clients={args.clients}",
                                      f"clients_per_round={max(1, args.clients // 10)}"]
        cfg = load_config(None, SETTING + (SMOKE if args.smoke else size) + [
            f"rounds={rounds}", f"eval_every={rounds}", f"device={args.device}", f"model.name={args.model}"], name)
        cfg = cfg.for_algorithm(name)
        data = prepare(cfg)
        engine_round(cfg, data)  # warm-up (allocator, kernels)
        cuda = data.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        got = engine_round(cfg, data)
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:7.2f}" if cuda else f"{'-':>7}"
        # the same clients' steps (every algorithm here trains 1 epoch each); the first call warms up
        bare_s, steps = min(bare_fedavg(cfg, data) for _ in range(2))
        bare = bare_s / rounds
        ref = FLBENCH_S_PER_ROUND.get(name) if args.clients == 100 else None
        eval_share = got["eval_s"] / (10 * got["s_round"] + got["eval_s"])
        (params, macs), (lenet_params, lenet_macs) = (
            model_cost(build_model(ModelConfig(m), data.input_shape, data.num_classes, 0)) for m in (args.model, "lenet5"))
        speedup = ref / got["s_round"] if ref else float("nan")
        print(f"{name:>10} {steps / rounds:>9.0f} {got['s_round']:>8.3f} {got['server']:>7.1%} {got['eval_s']:>7.2f} {eval_share:>12.0%} "
              f"{got['train_s_round']:>13.3f} {bare:>11.3f} {got['train_s_round'] / bare:>12.2f} "
              f"{ref if ref else '-':>15} {speedup:>11.2f} {speedup * params / lenet_params:>12.2f} "
              f"{speedup * macs / lenet_macs:>10.2f} {peak}")


if __name__ == "__main__":
    main()
