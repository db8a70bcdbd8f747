"""The ClientApp: one SuperNode serves one partition (`partition-id` in its node config, as Flower's simulation
sets it and `flower-supernode --node-config "partition-id=3"` does). It holds only that client's data, keeps the
client's state in `context.state` (one ArrayRecord per algorithm run), and runs the algorithm's client half for a
cohort of one: the same functions the simulator runs for its cohorts (engine.clients)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..algorithms import build_algorithm
from ..config import Config, from_dict, load_config
from ..data import FederatedData, build_federated
from ..models import FlatModel, build_model
from ..engine.clients import eval_vectors, fit_clients, score
from ..runtime import ClientRunner
from .records import ARRAYS, METRICS, config_of, from_arrays, message_content

STATE_PREFIX = "pfedkit:"  # context.state keys: one ArrayRecord of client state per algorithm run
GLOBAL_KEY = "__global__"  # an eval message's extra tensor: the global model, to score it on this client's data


def config_from(source: str) -> Config:
    """A config from YAML text (what the simulator hands its ClientApps) or from a YAML file's path (a deployment's
    run config: `--run-config "config='/path/config.yaml'"`)."""
    if "\n" in source or ":" in source.split("/")[-1]:
        return from_dict(yaml.safe_load(source) or {})
    return load_config(source)


class ClientRuntime:
    """One partition's data, and per algorithm run its model object and algorithm (client half), built afresh for
    each Flower run (a resumed experiment is a new run: its clients start from their saved states, as in process)."""

    def __init__(self, cfg: Config, pid: int, full: FederatedData):
        if not 0 <= pid < cfg.partition.num_clients:
            raise ValueError(f"partition-id {pid} is outside 0..{cfg.partition.num_clients - 1}")
        self.cfg, self.pid = cfg, pid
        self.num_clients = full.num_clients
        self.data = full.only([pid])  # the rest of the dataset is let go
        self.train_only = self.data.train_only()
        self.runs: dict[str, tuple[Config, FlatModel, Any, torch.Tensor]] = {}
        self.flower_run: int | None = None

    def run(self, spec: str, flower_run: int = 0):
        if flower_run != self.flower_run:
            self.runs.clear()
            self.flower_run = flower_run
        if spec not in self.runs:
            one = self.cfg.for_algorithm(spec)
            model = FlatModel(build_model(one.model, self.data.input_shape, self.data.num_classes, one.seed)
                              .to(self.data.device))
            self.runs[spec] = (one, model, build_algorithm(one, model, self.num_clients), model.state(),
                               ClientRunner(model, one.runtime))
        return self.runs[spec]


def config_text(source: str) -> str:
    """The experiment's YAML: `source` itself, or the file it names (see config_from)."""
    if "\n" in source or ":" in source.split("/")[-1]:
        return source
    return Path(source).read_text(encoding="utf-8")


class Loaded:
    """What a ClientApp process keeps between messages: one experiment's config (by its YAML text, so that another
    experiment in the same deployment is never served stale data) and seed, the federated dataset (until every
    partition this process serves has its runtime, when `keep_full` is off), and each partition's runtime.
    A simulation worker (Ray actor) serves many partitions' messages, a deployment's ClientApp process (or pfedkit's
    long-lived worker, flower.worker) one partition's."""

    def __init__(self):
        self.key: tuple[str, int] | None = None
        self.cfg: Config | None = None
        self.full: FederatedData | None = None
        self.runtimes: dict[int, ClientRuntime] = {}

    def runtime(self, source: str, seed: int, pid: int, keep_full: bool = True) -> ClientRuntime:
        key = (config_text(source), seed)
        if key != self.key:  # one experiment (and seed) at a time
            self.key, self.cfg, self.full, self.runtimes = None, None, None, {}
            cfg = config_from(source)
            self.cfg = cfg.with_seed(seed) if cfg.seeds else cfg
            self.key = key
        if pid not in self.runtimes:
            self.runtimes[pid] = ClientRuntime(self.cfg, pid, self._build() if self.full is None else self.full)
            if not keep_full:
                self.full = None  # this process serves this partition alone: the rest of the dataset is let go
        return self.runtimes[pid]

    def _build(self) -> FederatedData:
        cfg = self.cfg
        if cfg.runtime.threads:  # else the runtime's default (Ray gives each simulation worker its share of cores)
            torch.set_num_threads(cfg.runtime.threads)
        cuda = cfg.device in ('cuda', 'auto') and torch.cuda.is_available()  # the node's own GPU, if any
        self.full = build_federated(cfg, 'cuda' if cuda else 'cpu')
        return self.full


_LOADED = Loaded()


def runtime(source: str, seed: int, pid: int, keep_full: bool = True) -> ClientRuntime:
    return _LOADED.runtime(source, seed, pid, keep_full)


class ClientState:
    """A client's state for one algorithm run: in `context.state` (the working copy, with the round it is from),
    and, where a state folder is known, also on this node's disk after every training round, so that a ServerApp
    restarted with resume (a new Flower run: fresh `context.state`) finds the state the client had at the
    checkpointed round. Files are .npz of tensors, read with allow_pickle=False."""

    def __init__(self, context: Context, spec: str, pid: int, folder: str):
        self.context, self.key, self.pid = context, STATE_PREFIX + spec, pid
        safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in spec)
        self.dir = Path(folder) / safe / f"client{pid}" if folder else None

    def _round_of_memory(self) -> int | None:
        meta = self.key + ":round"
        return int(self.context.state[meta]["round"]) if meta in self.context.state else None

    def load(self, before: int, algo, init: torch.Tensor) -> dict:
        """The state after the client's last training round < `before` (its fresh state if none)."""
        held = self._round_of_memory()
        if held is not None and held < before:
            return from_arrays(self.context.state[self.key], init.device)
        if self.dir is not None and self.dir.is_dir():
            rounds = sorted(int(f.stem[1:]) for f in self.dir.glob("r*.npz") if f.stem[1:].isdigit())
            usable = [r for r in rounds if r < before]
            if usable:
                with np.load(self.dir / f"r{usable[-1]}.npz", allow_pickle=False) as z:
                    return {k: torch.from_numpy(z[k].copy()).to(init.device) for k in z.files}
        return algo.init_client(self.pid, init)

    def save(self, rnd: int, state: dict, checkpointed: int) -> None:
        self.context.state[self.key] = ArrayRecord({k: v.contiguous() for k, v in state.items()})
        self.context.state[self.key + ":round"] = MetricRecord({"round": rnd})
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"r{rnd}.tmp.npz"
        np.savez(tmp, **{k: v.detach().cpu().numpy() for k, v in state.items()})
        os.replace(tmp, self.dir / f"r{rnd}.npz")
        # keep what a resume from the last checkpoint can need: the newest state at or before it, and every later one
        rounds = sorted(int(f.stem[1:]) for f in self.dir.glob("r*.npz") if f.stem[1:].isdigit())
        keep_from = max([r for r in rounds if r <= checkpointed], default=0)
        for r in rounds:
            if r < keep_from:
                (self.dir / f"r{r}.npz").unlink(missing_ok=True)


def _corrupt(tensors: dict, numbers: dict, fault: str) -> tuple[dict, dict]:
    """Fault injection for tests of the server's reply checks (`--node-config "fault='nan'"`): never set it in a
    real deployment."""
    key = next(iter(tensors), None)
    if fault == "nan" and key:
        tensors = {**tensors, key: tensors[key] * float("nan")}
    elif fault == "shape" and key:
        tensors = {**tensors, key: tensors[key][:-1]}
    elif fault == "keys":
        tensors = {f"not_{k}": v for k, v in tensors.items()}
    return tensors, numbers


def make_client_app(config_source: str | None = None, one_partition: bool = False) -> ClientApp:
    """A ClientApp for the config given here (simulation), or in the run config's `config` key (deployment).
    `one_partition`: the process serves one partition only (flower.worker), so it keeps that partition's data alone."""
    app = ClientApp()

    def setup(msg: Message, context: Context):
        source = config_source or str(context.run_config.get("config", ""))
        info = config_of(msg.content)
        pid = int(context.node_config["partition-id"])
        if int(info.get("partition", pid)) != pid:
            raise ValueError(f"a message for partition {info.get('partition')} reached the node of partition {pid}")
        rt = runtime(source, int(info.get("seed", 0)), pid, keep_full=not one_partition)
        spec = str(info.get("spec", ""))
        # where this node keeps its clients' states on disk: its own node config, else the server's suggestion
        folder = str(context.node_config.get("state-dir", info.get("state_dir", "")))
        return rt, pid, int(info.get("round", 0)), spec, ClientState(context, spec, pid, folder), info

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """Which partition this node serves; with a seed, its client's data prepared first."""
        pid = int(context.node_config["partition-id"])
        info = config_of(msg.content)
        if "seed" in info:
            try:
                runtime(config_source or str(context.run_config.get("config", "")), int(info["seed"]), pid,
                        keep_full=not one_partition)
            except Exception:  # noqa: BLE001 - the answer still goes: the first train message reports the problem
                pass
        return Message(RecordDict({METRICS: MetricRecord({"partition": pid})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        rt, pid, rnd, spec, states, info = setup(msg, context)
        one, model, algo, init, runner = rt.run(spec, context.run_id)
        payload = from_arrays(msg.content[ARRAYS], rt.data.device)
        cstate = states.load(rnd, algo, init)
        (update,), (state,) = fit_clients(algo, rt.data, model, one.local, one.seed, rnd, [pid], [payload], [cstate],
                                          positions=[0], runtime=runner)
        states.save(rnd, state, int(info.get("checkpointed", 0)))
        tensors = {k: v for k, v in update.items() if isinstance(v, torch.Tensor)}
        numbers = {k: v for k, v in update.items() if not isinstance(v, torch.Tensor)}
        fault = str(context.node_config.get("fault", ""))
        if fault:
            tensors, numbers = _corrupt(tensors, numbers, fault)
        return Message(message_content(tensors, numbers), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        rt, pid, rnd, spec, states, info = setup(msg, context)
        one, model, algo, init, runner = rt.run(spec, context.run_id)
        payload = from_arrays(msg.content[ARRAYS], rt.data.device)
        glob = payload.pop(GLOBAL_KEY, None)
        if info.get("global_key"):  # the payload's own tensor is the global model (sent once)
            glob = payload[str(info["global_key"])]
        train_loss = bool(info.get("train_loss", False))
        (vector,) = eval_vectors(algo, rt.train_only, model, one.local, one.seed, rnd, [pid], [payload],
                                 [states.load(rnd + 1, algo, init)], positions=[0], runtime=runner)
        client = rt.data.client(0)
        correct, loss = score(model, vector, client, train_loss)
        numbers = {"correct": correct, "train_loss_sum": loss}
        if glob is not None:
            g_correct, g_loss = (correct, loss) if vector is glob else score(model, glob, client, train_loss)
            numbers.update(global_correct=g_correct, global_train_loss_sum=g_loss)
        return Message(RecordDict({METRICS: MetricRecord(numbers), "config": ConfigRecord({"spec": spec})}),
                       reply_to=msg)

    return app
