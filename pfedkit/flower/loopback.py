"""A real Flower deployment on 127.0.0.1 with Flower's own processes: one `flower-superlink`, one
`flower-supernode` per partition (told its partition by `--node-config "partition-id=i"`), each beside one
long-lived ClientApp process of pfedkit's that serves all its messages (flower.worker: Flower's default starts a
process per message), and `flwr run` of the Flower app pfedkit ships (pfedkit/flower/app) against them.
`pfedkit run CONFIG --runtime loopback` uses it; tests and the benchmark too. Everything it starts binds to 127.0.0.1 and is stopped when it ends, however it ends: each
process in a session of its own (a Ctrl-C at the terminal reaches this process alone, which stops the others), and
every process they start in turn found and stopped too (process_tree)."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from ..errors import PfedkitError
from . import require_flower
from .process_tree import MARKER, stop_all
from ..stopping import finish, on_signals

APP_DIR = Path(__file__).with_name("app")
DEPLOYMENTS = ".flower"  # in the run folder: the folder of every deployment `--runtime loopback` starts for it
ERROR_FILE = "serverapp-error.json"  # in a deployment's folder: the ServerApp's error, one line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """Flower's console scripts, next to this Python (a venv's bin folder may not be on PATH)."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else name


def _create(path: Path, *, append: bool = False) -> int:
    """A file of this user's only, opened for writing: new (exclusive), or with `append` new or this deployment's
    own earlier one; never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_EXCL)
    return os.open(path, flags, 0o600)


def write_new(path: Path, text: str) -> None:
    fd = _create(path)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _private_folder(path: Path) -> None:
    """`path` is a folder of this user's (not a link), and only this user's (mode 700)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PfedkitError(f"{path} is not a folder ({exc.strerror}: a link or a file?); remove it") from None
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise PfedkitError(f"{path} belongs to another user; remove it")
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def new_home(out: Path) -> Path:
    """A fresh folder for one deployment inside the run folder: out/.flower/deployment-XXXXXXXX (mkdtemp: a new
    name, mode 700), so that nothing planted there is followed or reused, and nothing is written beside `out`."""
    out.mkdir(parents=True, exist_ok=True)
    folder = out / DEPLOYMENTS
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass  # an earlier deployment's: checked below
    _private_folder(folder)
    return Path(tempfile.mkdtemp(prefix="deployment-", dir=folder))


def _ended(process: subprocess.Popen) -> str:
    code = process.returncode
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class Loopback:
    """SuperLink + SuperNodes on loopback, with Flower's home `home` (made here: it must be new or empty).
    `node_config` adds per-partition node config (e.g. {1: "fault='nan'"}), `tls` = (ca, cert, key) paths to run the
    SuperLink with TLS (self-signed certificates) instead of --insecure.
    `workers`: each SuperNode runs with `--isolation process` beside one long-lived ClientApp process of pfedkit's
    (flower.worker, log clientapp<i>.log) that serves all its messages, keeping the client's data and model loaded;
    without, Flower's own way: a new `flwr-clientapp` process per message (any Flower app; the benchmark's floor)."""

    def __init__(self, num_nodes: int, home: Path, *, node_config: dict[int, str] | None = None,
                 tls: tuple[Path, Path, Path] | None = None, workers: bool = True, log=print):
        require_flower()
        self.num_nodes, self.home, self.node_config, self.tls, self.log = num_nodes, Path(home), node_config or {}, tls, log
        self.workers = workers
        self.logs = self.home / "logs"
        self.secret = self.home / "superexec.secret"  # signs the workers' AcquireTask calls to their SuperNodes
        self.port = free_port()
        self.token = secrets.token_hex(16)  # in every process of this deployment's environment (process_tree)
        bin_dir = str(Path(sys.executable).parent)
        # Flower's processes start others by name (flower-superexec, flwr-serverapp, flwr-clientapp): this Python's
        # own, whether or not its bin folder is on the caller's PATH
        path = os.pathsep.join([bin_dir, os.environ["PATH"]]) if os.environ.get("PATH") else bin_dir
        # TMPDIR: Flower's temporary files (a FAB unpacked by flwr-clientapp) are the deployment's too
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1", "PATH": path, MARKER: self.token,
                    "TMPDIR": str(self.home / "tmp")}
        self.link: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}
        self.clientapps: dict[int, subprocess.Popen] = {}  # partition -> its worker (with `workers`)
        self.runtime_apis: dict[int, str] = {}  # partition -> its SuperNode's Runtime API, host:port
        self.started: list[subprocess.Popen] = []

    def _security(self, link: bool) -> list[str]:
        if self.tls is None:
            return ["--insecure"]
        ca, cert, key = map(str, self.tls)
        return ["--ssl-ca-certfile", ca, "--ssl-certfile", cert, "--ssl-keyfile", key] if link else \
            ["--root-certificates", ca]

    def _start(self, command: list[str], log_name: str) -> subprocess.Popen:
        """A process of the deployment, in a session of its own, its output appended to logs/<log_name>."""
        fd = _create(self.logs / log_name, append=True)
        try:
            process = subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL, stdout=fd,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            os.close(fd)
        self.started.append(process)
        return process

    def __enter__(self) -> "Loopback":
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        _private_folder(self.home)
        security = (f'root-certificates = "{self.tls[0]}"' if self.tls else "insecure = true")
        try:
            write_new(self.home / "config.toml", f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
                                                 f'address = "127.0.0.1:{self.port}"\n{security}\n')
            os.mkdir(self.logs, 0o700)
            os.mkdir(self.home / "tmp", 0o700)
            if self.workers:
                write_new(self.secret, secrets.token_hex(32))
        except FileExistsError as exc:
            raise PfedkitError(f"{self.home} already holds a deployment ({exc.filename}); give each its own "
                               "folder") from None
        try:
            self.link = self._start(
                [_bin("flower-superlink"), *self._security(True), "--host", "127.0.0.1", "--port", str(self.port),
                 "--disable-runtime-dependency-installation"], "superlink.log")
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
            self.check_alive()
            try:
                import ssl
                ctx = ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else None
                urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.port}/health", timeout=2, context=ctx)
                return
            except OSError:
                time.sleep(0.5)
        raise PfedkitError(f"flower-superlink on 127.0.0.1:{self.port} did not come up within {timeout:.0f} s "
                           f"(read {self.logs / 'superlink.log'})")

    def node_log(self, pid: int) -> Path:
        return self.logs / f"supernode{pid}.log"

    def clientapp_log(self, pid: int) -> Path:
        return self.logs / f"clientapp{pid}.log"

    def start_node(self, pid: int) -> None:
        extra = f" {self.node_config[pid]}" if pid in self.node_config else ""
        runtime_api = self.runtime_apis[pid] = f"127.0.0.1:{free_port()}"  # what its ClientApps call
        isolation = ["--isolation", "process", "--superexec-auth-secret-file", str(self.secret)] if self.workers else []
        self.nodes[pid] = self._start(
            [_bin("flower-supernode"), *self._security(False), "--superlink", f"127.0.0.1:{self.port}",
             "--host", "127.0.0.1", "--port", runtime_api.split(":")[1], *isolation,
             "--node-config", f"partition-id={pid} num-partitions={self.num_nodes}{extra}"], self.node_log(pid).name)
        if self.workers:
            self.clientapps[pid] = self._start(
                [sys.executable, "-m", "pfedkit.flower.worker", "--runtime-api-address", runtime_api,
                 "--secret-file", str(self.secret), "--node-pid", str(self.nodes[pid].pid)],
                self.clientapp_log(pid).name)

    def kill_node(self, pid: int) -> None:
        """SIGKILL one SuperNode and its ClientApp process, as a machine that dies."""
        for process in (self.nodes.pop(pid), self.clientapps.pop(pid, None)):
            if process is not None:
                process.send_signal(signal.SIGKILL)
                process.wait()

    def check_alive(self) -> None:
        """One line naming the log of the SuperLink or a SuperNode that has ended (nothing here restarts them;
        `kill_node` lets go of its node first)."""
        if self.link is not None and self.link.poll() is not None:
            raise PfedkitError(f"flower-superlink {_ended(self.link)}; read {self.logs / 'superlink.log'}")
        for pid, node in sorted(self.nodes.items()):
            if node.poll() is not None:
                raise PfedkitError(f"the flower-supernode of partition {pid} {_ended(node)}; read {self.node_log(pid)}")
        for pid, clientapp in sorted(self.clientapps.items()):
            if clientapp.poll() is not None:
                raise PfedkitError(f"the ClientApp process of partition {pid} {_ended(clientapp)}; read "
                                   f"{self.clientapp_log(pid)}")

    def flwr(self, *args: str, timeout: float = 120.0) -> str:
        done = subprocess.run([_bin("flwr"), *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=self.home, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            self.check_alive()  # a dead SuperLink is the likelier story, and names its log
            raise PfedkitError(f"flwr {args[0]} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        return done.stdout

    def submit(self, app: Path = APP_DIR, **run_config) -> int:
        """`flwr run` of pfedkit's app (or another Flower app's folder, without `workers`) with this run config;
        returns the run id."""
        def value(v):
            return str(v).lower() if isinstance(v, bool) else (repr(str(v)) if isinstance(v, (str, Path)) else str(v))
        text = " ".join(f"{k}={value(v)}" for k, v in run_config.items())
        out = self.flwr("run", str(app), "loopback", "--run-config", text, "--format", "json")
        try:
            return int(json.loads(out)["run-id"])
        except (ValueError, KeyError):
            raise PfedkitError(f"flwr run did not start a run: {out.strip()[-300:]}") from None

    def status(self, run_id: int) -> str:
        runs = json.loads(self.flwr("ls", "loopback", "--format", "json")).get("runs", [])
        return next((str(r.get("status", "")) for r in runs if str(r.get("run-id")) == str(run_id)), "")

    def wait(self, run_id: int, timeout: float, poll: float = 8.0, ending: Callable[[], bool] | None = None) -> str:
        """The run's final status. The SuperLink and SuperNodes are watched every half second (one that ends stops
        the wait with one line naming its log). Each `flwr ls` is a new CLI process (about a CPU-second of imports)
        competing with the ClientApp processes, so the status polls space out from 1 s to `poll` seconds; once
        `ending()` is true (the run wrote its last file) they start again from 1 s."""
        deadline, pause = time.monotonic() + timeout, 1.0
        ask, ended = time.monotonic(), False
        while True:
            self.check_alive()
            if not ended and ending is not None and ending():
                ended, ask, pause = True, time.monotonic(), 1.0
            if time.monotonic() >= ask:
                status = self.status(run_id)
                if any(s in status for s in ("finished", "completed", "failed", "stopped")):
                    return status
                ask, pause = time.monotonic() + pause, min(pause * 1.5, poll)
            if time.monotonic() > deadline:
                self.flwr("stop", str(run_id), "loopback")
                raise PfedkitError(f"the Flower run {run_id} did not finish within {timeout:.0f} s (stopped)")
            time.sleep(0.5)

    def log_of(self, run_id: int) -> str:
        try:
            return self.flwr("log", str(run_id), "loopback", "--show", timeout=60)
        except (PfedkitError, subprocess.TimeoutExpired):
            return ""

    def failure(self, run_id: int, status: str) -> str:
        """One line on a run that did not complete: the ServerApp's own error (ERROR_FILE), else its status; the
        ServerApp's log is saved to logs/serverapp.log and named where it has more to say (a traceback)."""
        saved = self.logs / "serverapp.log"
        with os.fdopen(_create(saved, append=True), "w") as fh:
            fh.write(self.log_of(run_id))
        try:
            with open(self.home / ERROR_FILE, "rb") as fh:
                error = json.loads(fh.read(65536))
            message, unexpected = str(error["message"]), bool(error.get("unexpected", True))
        except (OSError, ValueError, KeyError, TypeError):
            message, unexpected = f"the Flower run {run_id} ended {status or 'without a status'}", True
        return f"{message}; read {saved}" if unexpected else message

    def close(self) -> None:
        left = finish(lambda: stop_all(self.token, self.started))
        if left:
            self.log(f"warning: processes {sorted(left)} of the Flower deployment in {self.home} did not end")
        self.nodes.clear()
        self.clientapps.clear()
        self.link = None

    def __exit__(self, *exc) -> None:
        self.close()


def run_loopback(config_text: str, out: Path, num_nodes: int, *, resume: bool = False, overwrite: bool = False,
                 timeout: float = 600.0, min_replies: int = 1, run_timeout: float = 24 * 3600.0,
                 allow_version_change: bool = False, log=print) -> None:
    """`pfedkit run CONFIG --runtime loopback`: the experiment (`config_text`, YAML) on a deployment started here and
    stopped after. Everything of the deployment (the config every process reads, Flower's home, the logs) is in a
    fresh folder inside the run folder, out/.flower/deployment-*, removed at the end unless the run failed (then the
    one-line error names a log in it). SIGINT and SIGTERM stop the run and every process of the deployment
    (stopping.Stopped is raised); a SuperLink or SuperNode that ends stops it with one line naming its log."""
    out = Path(out).resolve()
    failed = True
    with on_signals() as request:
        home = new_home(out)
        try:
            with Loopback(num_nodes, home, log=log) as dep:
                config = home / "config.yaml"
                write_new(config, config_text)
                submitted = time.time()
                run_id = dep.submit(config=config, out=out, resume=resume, overwrite=overwrite, timeout=timeout,
                                    **{"min-replies": min_replies, "error-file": home / ERROR_FILE,
                                       "allow-version-change": allow_version_change})
                log(f"flower: run {run_id} on 127.0.0.1:{dep.port} with {num_nodes} SuperNodes (logs: {dep.logs})")
                last_files = (out / "flower.json", home / ERROR_FILE)  # the ServerApp's last act: success, failure
                status = dep.wait(run_id, run_timeout,
                                  ending=lambda: any(_written_since(f, submitted) for f in last_files))
                if "completed" not in status:
                    raise PfedkitError(dep.failure(run_id, status))
            failed = False
        finally:
            if not failed or request.event.is_set():  # a run asked to stop leaves nothing to read either
                shutil.rmtree(home, ignore_errors=True)
                try:
                    home.parent.rmdir()  # .flower, when no other deployment's folder is kept there
                except OSError:
                    pass
    _print_results(out, log)


def _written_since(path: Path, since: float) -> bool:
    """`path` was written at `since` or later (a second's slack for coarse file times), without following a link."""
    try:
        return os.stat(path, follow_symlinks=False).st_mtime >= since - 1.0
    except OSError:
        return False


def _print_results(out: Path, log) -> None:
    """What `pfedkit run` prints at the end in process: the comparison table (the ServerApp wrote it, its own
    output went to Flower's log) and the folder."""
    table = out / "comparison.md"
    if table.is_file() and not table.is_symlink():
        log(table.read_text())
    log(f"wrote {out}/")
