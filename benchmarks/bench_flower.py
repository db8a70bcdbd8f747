"""The same config in process, on Flower's simulation runtime, and on a Flower deployment on loopback (Flower's
own flower-superlink / flower-supernode processes, flwr run), and beside them, in the same sitting, Flower's own
floor on that kind of deployment: a message-only Flower app (its ClientApp answers without importing torch, in a new
flwr-clientapp process per message, as Flower runs any ClientApp), seconds per round.

    python benchmarks/bench_flower.py [--clients 4] [--rounds 5] [--algorithm fedavg] [--dataset mnist5k]
                                      [--model cnn] [--runtimes inprocess,simulation,loopback]

A pfedkit round is two round trips to every client (train, then evaluate: eval_every 1); the floor is printed for
one round trip per round with Flower's own Grid.send_and_receive (its pulls 3 s apart), which the issue sets as the
bar, and for pfedkit's pattern (two round trips, pulls 0.2 s apart as pfedkit's ServerApp pulls). pfedkit's round
is the run's wall_s / rounds from metrics.jsonl (the same clock for all three runtimes), and the median round
without the first (which also loads the data); the startup (Ray, the SuperLink, the partition mapping) is apart."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pfedkit.config import dump_config, load_config
from pfedkit.engine import TIMING_KEYS
from pfedkit.experiment import run_experiment

FLOOR_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pfedkit-floor"
version = "0.1.0"
description = "a message-only Flower app: the floor of a round on a Flower deployment"
license = "MIT"
dependencies = ["flwr==1.42.0"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "pfedkit"

[tool.flwr.app.components]
serverapp = "pfedkit_floor:server_app"
clientapp = "pfedkit_floor:client_app"

[tool.flwr.app.config]
nodes = 4
rounds = 3
out = ""
"""

# Each round sends one small message to every SuperNode and waits for all replies. "stock": one round trip a round,
# Flower's own send_and_receive; "pfedkit": two round trips a round (train, evaluate), pulling every 0.2 s.
FLOOR_APP = '''"""A message-only Flower app: no torch, no data, one small record each way."""
import json
import time

from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server_app = ServerApp()
client_app = ClientApp()


def exchange(grid, nodes, kind, rnd, pull_s):
    msgs = [Message(RecordDict({"m": MetricRecord({"round": rnd})}), dst_node_id=n, message_type=kind,
                    group_id=str(rnd)) for n in nodes]
    if pull_s is None:
        replies = list(grid.send_and_receive(msgs))
    else:
        pending, replies = set(grid.push_messages(msgs)), []
        while pending:
            got = list(grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            time.sleep(pull_s if pending else 0)
    if len(replies) != len(nodes) or any(r.has_error() for r in replies):
        raise RuntimeError(f"round {rnd}: {len(replies)} replies of {len(nodes)}")


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    want, rounds = int(context.run_config["nodes"]), int(context.run_config["rounds"])
    while len(list(grid.get_node_ids())) < want:
        time.sleep(0.2)
    nodes = sorted(grid.get_node_ids())
    times = {"stock": [], "pfedkit": []}
    for pattern, kinds, pull_s in (("stock", [MessageType.TRAIN], None),
                                   ("pfedkit", [MessageType.TRAIN, MessageType.EVALUATE], 0.2)):
        exchange(grid, nodes, MessageType.TRAIN, 0, pull_s)  # every node awake and past its first message
        for rnd in range(1, rounds + 1):
            t0 = time.perf_counter()
            for kind in kinds:
                exchange(grid, nodes, kind, rnd, pull_s)
            times[pattern].append(time.perf_counter() - t0)
    with open(str(context.run_config["out"]), "w") as fh:
        json.dump(times, fh)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"m": MetricRecord({"round": msg.content["m"]["round"]})}), reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"m": MetricRecord({"round": msg.content["m"]["round"]})}), reply_to=msg)
'''


def round_times(folder: Path) -> list[float]:
    """Seconds of each round (the differences of metrics.jsonl's wall_s)."""
    walls = [json.loads(line)["wall_s"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [b - a for a, b in zip([0.0] + walls, walls)]


def same_metrics(a: Path, b: Path) -> bool:
    """Every metrics value but the timings equal, bit for bit."""
    def rows(folder: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
                for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows(a) == rows(b)


def wall_per_round(folder: Path) -> float:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["wall_s"] / rows[-1]["round"]


def measure_floor(clients: int, rounds: int, tmp: Path) -> dict[str, list[float]]:
    """The message-only app on a deployment of Flower's own (a flwr-clientapp process per message)."""
    from pfedkit.flower.loopback import Loopback
    app = tmp / "floor_app"
    (app / "pfedkit_floor").mkdir(parents=True)
    (app / "pyproject.toml").write_text(FLOOR_PYPROJECT)
    (app / "pfedkit_floor" / "__init__.py").write_text(FLOOR_APP)
    with Loopback(clients, tmp / "floor_flwr", workers=False, log=lambda s: None) as dep:
        run_id = dep.submit(app, nodes=clients, rounds=rounds, out=tmp / "floor.json")
        status = dep.wait(run_id, 3600, poll=2.0)
        if "completed" not in status:
            raise SystemExit(f"the floor app's run ended {status}: {dep.log_of(run_id)[-2000:]}")
    return json.loads((tmp / "floor.json").read_text())


def per_message(cfg, clients: int, tmp: Path) -> None:
    """pfedkit's app on a deployment of Flower's own: each message in a new flwr-clientapp process."""
    from pfedkit.flower.loopback import Loopback
    (tmp / "per_message.yaml").write_text(dump_config(cfg))
    with Loopback(clients, tmp / "per_message_flwr", workers=False, log=lambda s: None) as dep:
        run_id = dep.submit(config=tmp / "per_message.yaml", out=tmp / "per_message")
        status = dep.wait(run_id, 3600, poll=2.0)
        if "completed" not in status:
            raise SystemExit(f"the per-message run ended {status}: {dep.log_of(run_id)[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--dataset", default="mnist5k")
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--runtimes", default="inprocess,simulation,loopback",
                    help="comma list; loopback also measures Flower's floor beside it; per-message: pfedkit's app on "
                    "a deployment of Flower's own (a flwr-clientapp process per message, as before pfedkit's "
                    "long-lived ClientApp processes)")
    args = ap.parse_args()
    runtimes = args.runtimes.split(",")
    sets = [f"dataset.name={args.dataset}", f"partition.num_clients={args.clients}", f"model.name={args.model}",
            f"rounds={args.rounds}", "local.epochs=1", "progress=false", "plots=false", "checkpoint_every=0",
            "runtime.threads=1"]  # one thread a process (4 ClientApps on 2 cores), and the same reduction order everywhere
    if args.dataset == "mnist5k":
        sets.append("partition.samples_per_client=200")
    cfg = load_config(None, sets, args.algorithm)
    tmp = Path(tempfile.mkdtemp(prefix="bench_flower_"))
    results, floor = {}, None
    if "inprocess" in runtimes:
        t = time.perf_counter()
        run_experiment(cfg, tmp / "inprocess", log=lambda s: None)
        results["inprocess"] = (tmp / "inprocess", time.perf_counter() - t, None)
    if "simulation" in runtimes:
        from pfedkit.flower.simulation import run_simulation
        t = time.perf_counter()
        run_simulation(cfg, tmp / "simulation", log=lambda s: None)
        results["flower simulation"] = (tmp / "simulation", time.perf_counter() - t,
                                        json.loads((tmp / "simulation" / "flower.json").read_text()))
    if "loopback" in runtimes:
        from pfedkit.flower.loopback import run_loopback
        floor = measure_floor(args.clients, args.rounds, tmp)
        t = time.perf_counter()
        run_loopback(dump_config(cfg), tmp / "loopback", args.clients, log=lambda s: None)
        results["flower loopback"] = (tmp / "loopback", time.perf_counter() - t,
                                      json.loads((tmp / "loopback" / "flower.json").read_text()))
    if "per-message" in runtimes:
        t = time.perf_counter()
        per_message(cfg, args.clients, tmp)
        results["loopback per-message"] = (tmp / "per_message", time.perf_counter() - t,
                                           json.loads((tmp / "per_message" / "flower.json").read_text()))
    report(args, results, floor)


def report(args, results: dict, floor: dict | None) -> None:
    base = wall_per_round(results["inprocess"][0] / args.algorithm) if "inprocess" in results else None
    print(f"{args.algorithm}, {args.model}, {args.dataset}, {args.clients} clients, 1 local epoch, "
          f"{args.rounds} rounds, threads=1")
    print(f"{'runtime':<20} {'s/round':>8} {'median':>7} {'x in-process':>13} {'total s':>8} {'messages':>9} "
          f"{'wait s/msg':>11} {'npy bytes/msg over tensors':>27} {'metrics = in-process':>21}")
    for name, (folder, total, stats) in results.items():
        run = folder / args.algorithm
        per_round, steady = wall_per_round(run), statistics.median(round_times(run)[1:] or round_times(run))
        extra = ("", "", "") if stats is None else (
            stats["round_trips"], f"{stats['wait_s_per_round_trip']:.3f}",
            f"{stats['overhead_bytes_per_message']:.0f}")
        ratio = f"{per_round / base:.1f}" if base else ""
        same = "" if base is None or name == "inprocess" else \
            ("bit for bit" if same_metrics(run, results["inprocess"][0] / args.algorithm) else "NO")
        print(f"{name:<20} {per_round:>8.3f} {steady:>7.3f} {ratio:>13} {total:>8.1f} {extra[0]!s:>9} {extra[1]:>11} "
              f"{extra[2]:>27} {same:>21}")
    print("median: the median round but the first; messages: train and evaluate messages sent (each with its "
          "reply); wait s/msg: seconds the server waited per message, the client's work included.")
    if floor is None:
        return
    run = results["flower loopback"][0] / args.algorithm
    mean, steady = wall_per_round(run), statistics.median(round_times(run)[1:] or round_times(run))
    print(f"\nFlower's floor on the same deployment ({args.clients} SuperNodes, a message-only app, a flwr-clientapp "
          "process per message), seconds per round:")
    for pattern, label in (("stock", "1 round trip, Flower's send_and_receive (the bar)"),
                           ("pfedkit", "2 round trips, pulls 0.2 s apart (pfedkit's pattern)")):
        times = floor[pattern]
        print(f"  floor, {label:<52} mean {statistics.mean(times):6.2f}  median {statistics.median(times):6.2f}  "
              f"rounds {' '.join(f'{t:.1f}' for t in times)}")
    bar = statistics.mean(floor["stock"])
    print(f"  pfedkit loopback round: mean {mean:.2f} ({mean / bar:.2f}x the floor), median without the first "
          f"{steady:.2f} ({steady / statistics.median(floor['stock']):.2f}x the floor's median); rounds "
          f"{' '.join(f'{t:.1f}' for t in round_times(run))}")


if __name__ == "__main__":
    main()
