"""A real Flower deployment on 127.0.0.1 with Flower's own processes: one `flower-superlink`, one
`flower-supernode` per partition (told its partition by `--node-config "partition-id=i"`), and `flwr run` of the
Flower app pfedkit ships (pfedkit/flower/app) against them. `pfedkit run CONFIG --runtime loopback` uses it; tests
and the benchmark too. Everything it starts binds to 127.0.0.1 and is stopped when it ends."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..errors import PfedkitError
from . import require_flower

APP_DIR = Path(__file__).with_name("app")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """Flower's console scripts, next to this Python (a venv's bin folder may not be on PATH)."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else name


class Loopback:
    """SuperLink + SuperNodes on loopback. `node_config` adds per-partition node config (e.g. {1: "fault='nan'"}),
    `tls` = (ca, cert, key) paths to run the SuperLink with TLS (self-signed certificates) instead of --insecure."""

    def __init__(self, num_nodes: int, home: Path, *, node_config: dict[int, str] | None = None,
                 tls: tuple[Path, Path, Path] | None = None, log=print):
        require_flower()
        self.num_nodes, self.home, self.node_config, self.tls, self.log = num_nodes, Path(home), node_config or {}, tls, log
        self.port = free_port()
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"}
        self.link: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}

    def _security(self, link: bool) -> list[str]:
        if self.tls is None:
            return ["--insecure"]
        ca, cert, key = map(str, self.tls)
        return ["--ssl-ca-certfile", ca, "--ssl-certfile", cert, "--ssl-keyfile", key] if link else \
            ["--root-certificates", ca]

    def __enter__(self) -> "Loopback":
        self.home.mkdir(parents=True, exist_ok=True)
        security = (f'root-certificates = "{self.tls[0]}"' if self.tls else "insecure = true")
        (self.home / "config.toml").write_text(f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
                                               f'address = "127.0.0.1:{self.port}"\n{security}\n')
        logs = self.home / "logs"
        logs.mkdir(exist_ok=True)
        try:
            self.link = subprocess.Popen(
                [_bin("flower-superlink"), *self._security(True), "--host", "127.0.0.1", "--port", str(self.port),
                 "--disable-runtime-dependency-installation"],
                env=self.env, stdout=open(logs / "superlink.log", "w"), stderr=subprocess.STDOUT)
            self._wait_healthy()
            for pid in range(self.num_nodes):
                self.start_node(pid)
        except BaseException:
            self.close()
            raise
        return self

    def _wait_healthy(self, timeout: float = 60.0) -> None:
        scheme = "https" if self.tls else "http"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.link.poll() is not None:
                raise PfedkitError(f"flower-superlink exited (see {self.home / 'logs' / 'superlink.log'})")
            try:
                import ssl
                ctx = ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None
                urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.port}/health", timeout=2, context=ctx)
                return
            except OSError:
                time.sleep(0.5)
        raise PfedkitError(f"flower-superlink on 127.0.0.1:{self.port} did not come up within {timeout:.0f} s")

    def start_node(self, pid: int) -> None:
        extra = f" {self.node_config[pid]}" if pid in self.node_config else ""
        self.nodes[pid] = subprocess.Popen(
            [_bin("flower-supernode"), *self._security(False), "--superlink", f"127.0.0.1:{self.port}",
             "--host", "127.0.0.1", "--port", str(free_port()),
             "--node-config", f"partition-id={pid} num-partitions={self.num_nodes}{extra}"],
            env=self.env, stdout=open(self.home / "logs" / f"supernode{pid}.log", "w"), stderr=subprocess.STDOUT)

    def kill_node(self, pid: int) -> None:
        """SIGKILL one SuperNode (and so its running ClientApp), as a machine that dies."""
        node = self.nodes.pop(pid)
        node.send_signal(signal.SIGKILL)
        node.wait()

    def flwr(self, *args: str, timeout: float = 120.0) -> str:
        done = subprocess.run([_bin("flwr"), *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=self.home)
        if done.returncode != 0:
            raise PfedkitError(f"flwr {args[0]} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        return done.stdout

    def submit(self, **run_config) -> int:
        """`flwr run` of pfedkit's app with this run config; returns the run id."""
        def value(v):
            return str(v).lower() if isinstance(v, bool) else (repr(str(v)) if isinstance(v, (str, Path)) else str(v))
        text = " ".join(f"{k}={value(v)}" for k, v in run_config.items())
        out = self.flwr("run", str(APP_DIR), "loopback", "--run-config", text, "--format", "json")
        try:
            return int(json.loads(out)["run-id"])
        except (ValueError, KeyError):
            raise PfedkitError(f"flwr run did not start a run: {out.strip()[-300:]}") from None

    def status(self, run_id: int) -> str:
        runs = json.loads(self.flwr("ls", "loopback", "--format", "json")).get("runs", [])
        return next((str(r.get("status", "")) for r in runs if str(r.get("run-id")) == str(run_id)), "")

    def wait(self, run_id: int, timeout: float, poll: float = 8.0) -> str:
        """The run's final status. Each `flwr ls` is a new CLI process (about a CPU-second of imports) competing with
        the ClientApp processes, so the polls space out from 1 s to `poll` seconds."""
        deadline, pause = time.monotonic() + timeout, 1.0
        while time.monotonic() < deadline:
            status = self.status(run_id)
            if any(s in status for s in ("finished", "completed", "failed", "stopped")):
                return status
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 1.5, poll)
        self.flwr("stop", str(run_id), "loopback")
        raise PfedkitError(f"the Flower run {run_id} did not finish within {timeout:.0f} s (stopped)")

    def log_of(self, run_id: int) -> str:
        try:
            return self.flwr("log", str(run_id), "loopback", "--show", timeout=60)
        except (PfedkitError, subprocess.TimeoutExpired):
            return ""

    def close(self) -> None:
        procs = [*self.nodes.values(), *([self.link] if self.link else [])]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.nodes.clear()

    def __exit__(self, *exc) -> None:
        self.close()


def run_loopback(config_path: Path, out: Path, num_nodes: int, *, resume: bool = False, overwrite: bool = False,
                 timeout: float = 600.0, min_replies: int = 1, run_timeout: float = 24 * 3600.0, log=print) -> None:
    """`pfedkit run CONFIG --runtime loopback`: the experiment on a deployment started here and stopped after."""
    out = Path(out).resolve()
    home = out.parent / f".{out.name}.flower"
    with Loopback(num_nodes, home, log=log) as dep:
        run_id = dep.submit(config=Path(config_path).resolve(), out=out, resume=resume, overwrite=overwrite,
                            timeout=timeout, **{"min-replies": min_replies})
        log(f"flower: run {run_id} on 127.0.0.1:{dep.port} with {num_nodes} SuperNodes (logs: {home / 'logs'})")
        status = dep.wait(run_id, run_timeout)
        if "completed" not in status and "finished:completed" not in status:
            tail = [line for line in dep.log_of(run_id).splitlines() if "Error" in line or "error" in line][-3:]
            raise PfedkitError(f"the Flower run {run_id} ended {status or 'without a status'}"
                               f"{': ' + ' | '.join(tail) if tail else ''}")
