"""A loopback deployment's ClientApps at Flower's own speed: each SuperNode's messages are all served by one
long-lived ClientApp process of pfedkit's (pfedkit.flower.worker: no `flwr-clientapp` process per message that
imports torch and rebuilds the data), with the in-process engine's metrics bit for bit and its comparison table
printed at the end; that process runs pfedkit's app alone, takes only its own SuperNode's tasks, and stops the run
with one line if it dies.
Skipped only where the `flower` extra is not installed (.ci/run installs it)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="pip install -e '.[flower]'")

import httpx  # noqa: E402
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # noqa: E402
from flwr.supercore.constant import TaskType  # noqa: E402
from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor  # noqa: E402
from flwr.supercore.runtime import RuntimeHttpClient  # noqa: E402

from pfedkit.cli import main  # noqa: E402
from pfedkit.config import dump_config, load_config  # noqa: E402
from pfedkit.engine import TIMING_KEYS  # noqa: E402
from pfedkit.experiment import run_experiment  # noqa: E402
from pfedkit.flower.client import Loaded  # noqa: E402
from pfedkit.flower.loopback import Loopback  # noqa: E402

TAG = "PFEDKIT_TEST_WORKER"
SMALL = ["dataset.name=mnist5k", "partition.samples_per_client=60", "model.name=cnn", "local.epochs=1",
         "local.batch_size=20", "progress=false", "plots=false", "runtime.threads=1", "partition.num_clients=2", "rounds=2"]


class ProcessWatch:
    """The processes whose environment holds TAG=tag: `look()` returns the live ones (pid -> command line); as a
    context manager it looks every 0.1 s (a `flwr-clientapp` process lives a second at least: it imports Flower),
    and `seen` holds every one it saw."""

    def __init__(self, tag: str):
        self.entry, self.seen = f"{TAG}={tag}".encode(), {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def look(self) -> dict[int, bytes]:
        live = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_bytes()
                if stat[stat.rindex(b")") + 2:].split()[0] in (b"Z", b"X"):
                    continue
                if self.entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    live[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
        self.seen.update(live)
        return live

    def _watch(self) -> None:
        while not self.done.wait(0.1):
            self.look()

    def __enter__(self) -> "ProcessWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(10)


def metrics(folder: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_loopback_run_serves_each_supernode_from_one_clientapp_process_and_prints_the_table(tmp_path, monkeypatch,
                                                                                           capsys):
    """`pfedkit run --runtime loopback`, 2 clients, 2 rounds (8 train and evaluate messages): two ClientApp
    processes in all, one per SuperNode, and never a `flwr-clientapp` process (before: one per message, each
    importing torch and pfedkit and building the dataset); every metric but the timings equal to the in-process
    engine's, bit for bit; the comparison table and the folder printed at the end, as in process."""
    run_experiment(load_config(None, SMALL, "fedavg"), tmp_path / "inprocess", log=lambda s: None)
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)  # inherited by every process of the deployment
    out = tmp_path / "loopback"
    sets = [arg for item in SMALL for arg in ("--set", item)]
    with ProcessWatch(tag) as watch:
        assert main(["run", "--runtime", "loopback", "--algorithms", "fedavg", "--out", str(out), *sets]) == 0
    commands = list(watch.seen.values())
    assert sum(b"-m pfedkit.flower.worker" in cmd for cmd in commands) == 2, commands
    assert not any(b"flwr-clientapp" in cmd for cmd in commands), commands
    assert any(b"flwr-serverapp" in cmd for cmd in commands)  # the watch saw the run's processes
    assert metrics(out / "fedavg") == metrics(tmp_path / "inprocess" / "fedavg")
    printed = capsys.readouterr().out
    assert printed.endswith(f"{(out / 'comparison.md').read_text()}\nwrote {out}/\n"), printed[-2000:]
    assert "| fedavg |" in printed


FOREIGN_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "not-pfedkit"
version = "1.0.0"
dependencies = ["flwr==1.42.0"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "not_pfedkit:server_app"
clientapp = "not_pfedkit:client_app"

[tool.flwr.app.config]
marker = ""
out = ""
"""

FOREIGN_APP = '''import json
import time
from pathlib import Path

from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    while not list(grid.get_node_ids()):
        time.sleep(0.2)
    (node,) = grid.get_node_ids()
    msg = Message(RecordDict({"m": MetricRecord({"x": 1})}), dst_node_id=node, message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg], timeout=120)
    Path(str(context.run_config["out"])).write_text(json.dumps(reply.error.reason if reply.has_error() else "ran"))


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    Path(str(context.run_config["marker"])).write_text("the foreign ClientApp ran")
    return Message(RecordDict({"m": MetricRecord({"x": 2})}), reply_to=msg)
'''


def status_of_acquire(client: RuntimeHttpClient, timeout: float = 120.0) -> int:
    """The HTTP status of an AcquireTask call, once the SuperNode's Runtime API is up (it starts with the node)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
            return 200
        except httpx.HTTPStatusError as exc:
            return exc.response.status_code
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_clientapp_process_runs_pfedkits_app_alone_and_takes_only_its_own_supernodes_tasks(tmp_path):
    """A Flower app that is not pfedkit's, submitted to a loopback deployment: its ClientApp never runs on the
    SuperNode (its message gets an error reply naming pfedkit's app); and a process without the deployment's
    SuperExec secret is refused the SuperNode's tasks (HTTP 401), so nothing else on the machine takes them."""
    app = tmp_path / "app"
    (app / "not_pfedkit").mkdir(parents=True)
    (app / "pyproject.toml").write_text(FOREIGN_PYPROJECT)
    (app / "not_pfedkit" / "__init__.py").write_text(FOREIGN_APP)
    marker, out = tmp_path / "marker.txt", tmp_path / "reply.json"
    with Loopback(1, tmp_path / "flwr", log=lambda s: None) as dep:
        stranger = RuntimeHttpClient.from_server_address(dep.runtime_apis[0], insecure=True, root_certificates=None,
                                                         interceptors=[RuntimeVersionHttpInterceptor("SuperExec")])
        assert status_of_acquire(stranger) == 401
        run_id = dep.submit(app, marker=marker, out=out)
        assert "completed" in dep.wait(run_id, 300, poll=2.0), dep.log_of(run_id)[-2000:]
    assert not marker.exists()
    assert "serves pfedkit's app (pfedkit/pfedkit-app) only, not 'someone/not-pfedkit'" in json.loads(out.read_text())


def test_a_clientapp_process_keeps_one_experiments_data_by_its_config_text_not_its_path(tmp_path):
    """The same config path holding another experiment (a deployment reused): the partition is rebuilt from the
    new text, never served stale; a process serving one partition keeps that partition's data alone."""
    path = tmp_path / "config.yaml"
    loaded = Loaded()
    path.write_text(dump_config(load_config(None, ["dataset.name=digits", "partition.num_clients=4"])))
    four = loaded.runtime(str(path), 0, 1, keep_full=False)
    assert four.num_clients == 4 and loaded.full is None
    assert loaded.runtime(str(path), 0, 1, keep_full=False) is four  # kept between messages
    path.write_text(dump_config(load_config(None, ["dataset.name=digits", "partition.num_clients=3"])))
    three = loaded.runtime(str(path), 0, 1, keep_full=False)
    assert three is not four and three.num_clients == 3  # the dataset built again, for 3 clients
    assert three.data.num_clients == 1 and loaded.full is None


def test_a_clientapp_process_that_dies_stops_the_loopback_run_with_one_line_naming_its_log(tmp_path):
    """The ClientApp process of partition 1 killed mid-run: the run stops at once (not after the round timeout)
    with one line naming that process's log, which exists, and nothing of the deployment is left running."""
    tag = uuid.uuid4().hex
    sets = [arg for item in SMALL[:-1] + ["rounds=400"] for arg in ("--set", item)]
    run = subprocess.Popen([sys.executable, "-m", "pfedkit", "run", "--runtime", "loopback", "--algorithms", "fedavg",
                            "--out", str(tmp_path / "run"), *sets], env={**os.environ, TAG: tag},
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    watch = ProcessWatch(tag)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "run" / "fedavg" / "metrics.jsonl").is_file():  # past its first round
            assert run.poll() is None, run.stderr.read()
            assert time.monotonic() < deadline, "no round within 300 s"
            time.sleep(0.2)
        live = watch.look()
        (node,) = [pid for pid, cmd in live.items() if b"flower-supernode" in cmd and b"partition-id=1 " in cmd]
        (victim,) = [pid for pid, cmd in live.items() if cmd.endswith(f"--node-pid {node} ".encode())]
        os.kill(victim, signal.SIGKILL)
        _, stderr = run.communicate(timeout=120)
        left = watch.look()
    finally:  # whatever the outcome, nothing of the run outlives the test
        for pid in list(watch.look()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.kill()
        run.wait(30)
    assert run.returncode == 2, stderr
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith("pfedkit: error: the ClientApp process of partition 1 was killed by SIGKILL; read "), line
    log = Path(line.rsplit("read ", 1)[1])
    assert log.name == "clientapp1.log" and log.is_file() and (tmp_path / "run" / ".flower") in log.parents
    assert left == {}
