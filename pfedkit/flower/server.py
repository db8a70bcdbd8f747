"""The ServerApp side: a transport that carries pfedkit's payloads to SuperNodes as Flower messages (one per
client) and brings back their replies, and the ServerApp that runs a pfedkit experiment over it.

Client identity: Flower's node ids are random per run, so at the start every node is asked which partition it
serves; clients are then sampled over partition ids with pfedkit's own seeded stream, and each message goes to
the node of its partition: a Flower run sees the same clients in the same rounds as the in-process run."""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from ..config import Config
from ..engine.checks import tensor_bytes
from ..errors import PfedkitError, UpdateError
from .client import GLOBAL_KEY, config_from
from .records import CONFIG, METRICS, message_content, read_update
from ..stopping import Stopped, StopRequest


def _stop_if_asked(stop: StopRequest | None) -> None:
    """The run ends here (stopping.Stopped) once the process running it was asked to stop: the simulation's ServerApp
    runs in a thread of that process, which cannot take the signal itself (stopping.on_signals)."""
    if stop is not None:
        stop.raise_if_set()


class FlowerStats:
    """What the Flower transport adds to the wire, per experiment (flower.json): training messages and replies, the
    bytes of the tensors in them and of their serialized arrays (the .npy framing Flower adds), and the seconds the
    server waited for replies (clients' work included) per round trip (train and evaluate)."""

    def __init__(self):
        self.round_trips = 0  # messages sent that expect a reply (train and evaluate)
        self.messages = 0
        self.tensor_bytes = 0
        self.array_bytes = 0
        self.wait_s = 0.0

    def count(self, content: RecordDict, tensors: int) -> None:
        self.messages += 1
        self.tensor_bytes += tensors
        self.array_bytes += sum(len(a.data) for rec in content.array_records.values() for a in rec.values())

    def to_dict(self) -> dict:
        return {"round_trips": self.round_trips, "wait_s_per_round_trip": self.wait_s / max(self.round_trips, 1),
                "messages": self.messages, "tensor_bytes": self.tensor_bytes, "serialized_array_bytes":
                self.array_bytes, "overhead_bytes_per_message": (self.array_bytes - self.tensor_bytes) /
                max(self.messages, 1), "wait_s": self.wait_s}


def map_partitions(grid: Grid, num_clients: int, timeout: float, log: Callable[[str], None],
                   stop: StopRequest | None = None, seed: int | None = None) -> dict[int, int]:
    """partition id -> node id, asking each node once which partition it serves (its reply may take a while: a
    ClientApp starting up), until every partition has a node. With `seed` (the experiment's first), a node
    prepares its client's data before it answers, as the in-process engine does before its first round."""
    node_of: dict[int, int] = {}
    pending: dict[str, int] = {}  # message id -> node asked
    asked: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(node_of) < num_clients:
        _stop_if_asked(stop)
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            ask = {"ask": "partition"} if seed is None else {"ask": "partition", "seed": seed}
            msgs = [Message(RecordDict({CONFIG: ConfigRecord(ask)}), dst_node_id=n,
                            message_type=MessageType.QUERY) for n in new]
            pending.update(zip(grid.push_messages(msgs), new))
            asked.update(new)
        for reply in grid.pull_messages(list(pending)) if pending else []:
            node = pending.pop(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            if reply.has_error() or METRICS not in reply.content:
                asked.discard(node)  # ask again
                continue
            pid = int(reply.content[METRICS]["partition"])
            if pid in node_of and node_of[pid] != node:
                raise PfedkitError(f"two SuperNodes serve partition {pid}; give each its own --node-config "
                                   "\"partition-id=...\"")
            if not 0 <= pid < num_clients:
                raise PfedkitError(f"a SuperNode serves partition {pid}, but the config has "
                                   f"partition.num_clients = {num_clients} (0..{num_clients - 1})")
            node_of[pid] = node
        if len(node_of) < num_clients:
            if time.monotonic() > deadline:
                missing = sorted(set(range(num_clients)) - set(node_of))
                raise PfedkitError(f"only {len(node_of)} of {num_clients} partitions have a SuperNode after "
                                   f"{timeout:.0f} s (missing: {missing[:10]}{'...' if len(missing) > 10 else ''}); "
                                   "start one flower-supernode per partition")
            time.sleep(0.2)
    return node_of


DEPLOYMENT_PULL_S = 0.2  # seconds between pulls of replies from a SuperLink


class FlowerClients:
    """The transport of engine.Server over a Flower Grid. Client states live on the clients (`context.state`)."""

    def __init__(self, grid: Grid, cfg: Config, node_of: dict[int, int], timeout: float,
                 log: Callable[[str], None], stats: FlowerStats, stop: StopRequest | None = None):
        self.grid, self.cfg, self.node_of, self.timeout, self.log, self.stats = grid, cfg, node_of, timeout, log, stats
        self.stop = stop
        self.cid_of = {n: c for c, n in node_of.items()}
        self.checkpointed = 0  # the run's last checkpointed round: clients keep the states a resume can need
        self.state_dir = ""  # where the clients keep their states on disk unless their node config says otherwise

    # client state is not the server's to hold or checkpoint
    def init_states(self, init: torch.Tensor) -> list:
        return []

    def reset(self, init: torch.Tensor) -> None: ...

    def state(self) -> list:
        return []

    def restore(self, cstates: list) -> None: ...

    def bind_run(self, out: Path, checkpointed: int) -> None:
        # beside the run folders (which then hold the same files as an in-process run's)
        self.state_dir, self.checkpointed = str(Path(out).resolve().parent / ".client_states"), checkpointed

    def _send(self, kind: str, rnd: int, contents: dict[int, RecordDict]) -> dict[int, Any]:
        msgs = [Message(content, dst_node_id=self.node_of[cid], message_type=kind, group_id=f"{self.cfg.algorithm}/{rnd}")
                for cid, content in contents.items()]
        t0 = time.perf_counter()
        self.stats.round_trips += len(msgs)
        replies = self._send_and_receive(msgs)
        self.stats.wait_s += time.perf_counter() - t0
        out: dict[int, Any] = {}
        for reply in replies:
            cid = self.cid_of.get(reply.metadata.src_node_id)
            if cid is None or cid not in contents:
                continue
            if reply.has_error():
                self.log(f"round {rnd}: client {cid} failed ({reply.error.reason}); left out of the round")
                continue
            out[cid] = reply.content
        return out

    def _send_and_receive(self, msgs: list[Message]) -> list[Message]:
        """Grid.send_and_receive, but stopping when asked to (its wait would outlast the run: up to the round
        timeout, in a thread that nothing else can end). Pulls at the simulation's in-memory grid's own pace (its
        pull_interval), and from a SuperLink every DEPLOYMENT_PULL_S (Flower's own send_and_receive waits 3 s
        between pulls, up to 3 s added to every train and evaluate round trip; a pull costs milliseconds)."""
        pending = set(self.grid.push_messages(msgs))
        pause = float(getattr(self.grid, "pull_interval", DEPLOYMENT_PULL_S))
        deadline, replies = time.monotonic() + self.timeout, []
        while pending:
            _stop_if_asked(self.stop)
            got = list(self.grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        return replies

    def _config(self, rnd: int, cid: int, **extra) -> dict:
        return {"round": rnd, "spec": self.cfg.algorithm, "seed": self.cfg.seed, "partition": cid,
                "checkpointed": self.checkpointed, "state_dir": self.state_dir, **extra}

    def fit(self, rnd: int, payloads: dict[int, dict]) -> dict[int, Any]:
        contents = {}
        for cid, payload in payloads.items():
            contents[cid] = message_content(payload, config=self._config(rnd, cid))
            self.stats.count(contents[cid], tensor_bytes(payload))
        replies = {}
        for cid, content in self._send(MessageType.TRAIN, rnd, contents).items():
            try:
                replies[cid] = read_update(content)
            except UpdateError as exc:  # the server judges it (engine.server.Server._accept)
                replies[cid] = UpdateError(f"round {rnd}: client {cid} sent a malformed reply: {exc}")
            if isinstance(replies[cid], dict):
                self.stats.count(content, tensor_bytes(replies[cid]))
        return replies

    def evaluate(self, rnd: int, payloads: dict[int, dict], global_model: torch.Tensor | None,
                 train_loss: bool) -> dict[int, dict]:
        contents = {}
        for cid, payload in payloads.items():
            tensors, extra = dict(payload), {"train_loss": train_loss}
            if global_model is not None:
                same = next((k for k, v in payload.items() if v is global_model), None)
                if same is not None:
                    extra["global_key"] = same  # sent once
                else:
                    tensors[GLOBAL_KEY] = global_model
            contents[cid] = message_content(tensors, config=self._config(rnd, cid, **extra))
        scores = {}
        for cid, content in self._send(MessageType.EVALUATE, rnd, contents).items():
            problem = self._check_scores(content, cid, global_model is not None)
            if problem:
                self.log(f"round {rnd}: client {cid} sent bad evaluation scores ({problem}); left out of the metrics")
                continue
            scores[cid] = dict(content[METRICS])
        if len(scores) < len(payloads):
            missing = sorted(set(payloads) - set(scores))
            self.log(f"round {rnd}: metrics over {len(scores)} of {len(payloads)} clients (none from {missing[:10]})")
        return scores

    def _check_scores(self, content: RecordDict, cid: int, with_global: bool) -> str | None:
        if METRICS not in content:
            return "no metrics"
        m = content[METRICS]
        keys = ["correct", "train_loss_sum"] + (["global_correct", "global_train_loss_sum"] if with_global else [])
        tests = int(self._test_sizes[cid])
        for k in keys:
            v = m.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                return f"'{k}' = {v!r}"
            if k.endswith("correct") and (not isinstance(v, int) or v > tests):
                return f"'{k}' = {v!r} of {tests} test samples"
        return None

    def bind_sizes(self, test_sizes: np.ndarray) -> "FlowerClients":
        self._test_sizes = test_sizes
        return self


def _record_error(path: str, problem: PfedkitError, unexpected: bool) -> None:
    """The ServerApp's error, for whoever started the deployment (loopback.run_loopback reads it): its first line,
    in a new file (never through a link; that folder is the deployment's own)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # the error still reaches Flower's log
    with os.fdopen(fd, "w") as fh:
        json.dump({"message": str(problem).splitlines()[0] if str(problem) else "", "unexpected": unexpected}, fh)


def make_server_app(config_source: str | None = None, out: str | None = None, *, resume: bool = False,
                    overwrite: bool = False, timeout: float = 600.0, min_replies: int = 1,
                    connect_timeout: float = 300.0, allow_version_change: bool = False, errors: list | None = None, stop: StopRequest | None = None,
                    log: Callable[[str], None] = print) -> ServerApp:
    """A ServerApp running one pfedkit experiment (every algorithm of the config, each into out/<algorithm>/).
    Settings come from here (simulation) or from the run config (deployment: config, out, resume, timeout,
    min-replies, connect-timeout, error-file, allow-version-change). An error is appended to `errors` (the ServerApp runs in a thread of
    Flower's), and written to the run config's `error-file` if it has one. `stop`: the run ends at its next message
    once it is set (stopping.Stopped, appended to `errors`)."""
    from ..engine.files import atomic_write
    from ..experiment import resume_experiment, run_experiment

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        rc = context.run_config
        try:
            source = config_source or str(rc.get("config", ""))
            folder = Path(out or str(rc.get("out", "")))
            if not source or not str(folder):
                raise PfedkitError("the pfedkit ServerApp needs run config keys 'config' (a YAML file) and 'out'")
            again = resume or bool(rc.get("resume", False))
            wait = float(rc.get("timeout", timeout))
            least = int(rc.get("min-replies", min_replies))
            if again:
                from ..config import load_config
                cfg = load_config(folder / "config.yaml")
            else:
                cfg = config_from(source)
            node_of = map_partitions(grid, cfg.partition.num_clients, float(rc.get("connect-timeout", connect_timeout)),
                                     log, stop, seed=(cfg.seed_list() or [cfg.seed])[0])
            log(f"flower: {len(node_of)} SuperNodes, one per partition")
            stats = FlowerStats()

            def clients_for(one: Config, data) -> FlowerClients:
                return FlowerClients(grid, one, node_of, wait, log, stats, stop).bind_sizes(data.test_sizes)

            runtime = {"clients_for": clients_for, "min_replies": least}
            if again:
                allowed = allow_version_change or bool(rc.get("allow-version-change", False))
                resume_experiment(folder, log=log, runtime=runtime, allow_version_change=allowed)
            else:
                run_experiment(cfg, folder, overwrite=overwrite or bool(rc.get("overwrite", False)), log=log,
                               runtime=runtime)
            atomic_write(folder / "flower.json", json.dumps(stats.to_dict(), indent=1).encode())
        except Stopped as exc:  # the process was asked to stop: nothing failed
            if errors is None:
                raise
            errors.append(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which prints one line
            unexpected = not isinstance(exc, PfedkitError)
            problem = PfedkitError(f"the Flower ServerApp failed: {exc.__class__.__name__}: {exc}\n"
                                   f"{traceback.format_exc()}") if unexpected else exc
            if rc.get("error-file"):
                _record_error(str(rc["error-file"]), problem, unexpected)
            if errors is None:
                raise
            errors.append(problem)

    return app
