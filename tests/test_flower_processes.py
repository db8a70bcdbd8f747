"""The Flower runtimes' processes end when asked and never hang, and a deployment writes only inside its run folder:
a real `python -m pfedkit run ... --runtime flower|loopback` process gets real signals (SIGINT to its process group,
as Ctrl-C at a terminal sends it; SIGTERM to its pid, as `kill` does), a real SuperNode is killed, a link is planted.
Every process a run starts inherits the test's own environment variable (TAG), so the test finds them all in /proc,
wherever they went (Flower's SuperExec starts in a session of its own, Ray's workers under Ray's daemons), without
asking the code under test; each test kills what is left of its run, even when it fails.
Skipped only where the `flower` extra is not installed (.ci/run installs it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="pip install -e '.[flower]'")

TAG = "PFEDKIT_TEST_RUN"
TINY = ["dataset.name=digits", "model.name=mlr", "partition.num_clients=2", "progress=false", "plots=false",
        "runtime.threads=1", "checkpoint_every=1"]
LONG = 400  # rounds: far more than any test waits for, so a run is always stopped mid-way


def _state_and_environ(pid: str) -> tuple[str, bytes]:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rindex(b")") + 2:].split()[0].decode(), Path(f"/proc/{pid}/environ").read_bytes()


class PfedkitRun:
    """`python -m pfedkit run` in a session of its own (its process group is the test's to signal), with TAG=<unique>
    in its environment, output to files beside its folder."""

    def __init__(self, tmp_path: Path, runtime: str, rounds: int, path: str | None, extra: list[str]):
        self.out, self.tag = tmp_path / "run", uuid.uuid4().hex
        env = {**os.environ, TAG: self.tag}
        if path is not None:
            env["PATH"] = path
        sets = [arg for item in TINY + [f"rounds={rounds}"] for arg in ("--set", item)]
        self.stderr_path = tmp_path / "stderr.txt"
        with open(tmp_path / "stdout.txt", "wb") as stdout, open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pfedkit", "run", "--runtime", runtime, "--algorithms", "fedavg",
                 "--out", str(self.out), *sets, *extra], env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                start_new_session=True, cwd=tmp_path)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process carrying this run's TAG (the run's own included)."""
        entry, found = f"{TAG}={self.tag}".encode(), {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                state, environ = _state_and_environ(pid)
                if state not in ("Z", "X") and entry in environ.split(b"\0"):
                    found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
        return found

    def wait_for(self, what: str, ready, timeout: float = 300.0):
        """Poll `ready()` until it returns something true (returned), the run ends, or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = ready()
            if found:
                return found
            assert self.process.poll() is None, f"the run ended before {what}: {self.stderr()}"
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout:.0f} s")

    def process_named(self, *words: str) -> int | None:
        return next((pid for pid, cmd in self.processes().items() if all(w in cmd for w in words)), None)

    def exit_code(self, timeout: float = 180.0) -> int:
        return self.process.wait(timeout)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def kill_all(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(30)


@pytest.fixture
def start(tmp_path):
    runs = []

    def start_run(runtime: str, rounds: int = LONG, path: str | None = None, extra: tuple = ()) -> PfedkitRun:
        runs.append(PfedkitRun(tmp_path, runtime, rounds, path, list(extra)))
        return runs[-1]
    yield start_run
    for run in runs:  # whatever the test's outcome
        run.kill_all()


def niceness(pid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except ProcessLookupError:  # gone since it was listed
        return None


def only_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def interrupted_line(out: Path) -> str:
    """The CLI's one line after an interrupt, by what the folder holds."""
    if any(out.rglob("checkpoint.pt")):
        return f"pfedkit: interrupted; continue with `pfedkit run --resume {out}`"
    if out.is_dir() and any(out.iterdir()):
        return (f"pfedkit: interrupted before the first checkpoint; nothing to resume in {out} (run it again "
                "with --overwrite)")
    return "pfedkit: interrupted before anything was written; nothing to resume"


def without_venv_bin() -> str:
    """PATH without this Python's bin folder (where Flower's console scripts are)."""
    here = str(Path(sys.executable).parent)
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != here) or "/usr/bin"


# ---- Flower's simulation runtime (Ray) --------------------------------------------------------------------------

@pytest.mark.parametrize("sig, to_group, code", [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_a_flower_simulation_run_and_ray_with_its_checkpoint_intact(start, sig, to_group, code):
    """Ctrl-C (SIGINT to the run's process group, Ray's processes included) or SIGTERM to the run after its first
    checkpoint: the run exits with the one interrupted line, no process of the run or of Ray is left, the checkpoint
    is readable and at a round whose metrics rows it holds. (Before: on Ctrl-C the run went on to the end, or hung
    until a second Ctrl-C; SIGTERM, caught by ray.init's own handler, ended it with SIGABRT and no line.)"""
    run = start("flower")
    checkpoint = run.out / "fedavg" / "checkpoint.pt"
    run.wait_for("first checkpoint", checkpoint.is_file)
    assert len(run.processes()) > 2  # the run, Ray's daemons and its ClientApp actors
    # its ClientApp actors at the run's own niceness, not Ray's 15 for its workers, at which any other work on the
    # machine starved them
    actors = [pid for pid, cmd in run.processes().items() if cmd.startswith("ray::")]
    assert actors and {niceness(pid) for pid in actors} <= {niceness(run.process.pid), None}, run.processes()
    (os.killpg if to_group else os.kill)(run.process.pid, sig)
    assert run.exit_code() == code, run.stderr()
    assert only_line(run.stderr()) == interrupted_line(run.out)
    assert run.processes() == {}
    saved = torch.load(checkpoint, weights_only=True)
    rows = (run.out / "fedavg" / "metrics.jsonl").read_text().splitlines()
    assert 1 <= saved["totals"]["round"] <= len(rows) < LONG
    assert len(saved["metrics"]) == saved["totals"]["round"]


# ---- a deployment on loopback -----------------------------------------------------------------------------------

def deployment_is_running(run: PfedkitRun):
    """The run is past its first round: the SuperLink, the SuperNodes, their long-lived ClientApp processes
    (pfedkit.flower.worker) and the ServerApp are up, and the ClientApps have answered messages."""
    return run.process_named("flwr-serverapp") and (run.out / "fedavg" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("sig, to_group, code", [(signal.SIGTERM, False, 143), (signal.SIGINT, True, 130)],
                         ids=["sigterm", "ctrl-c"])
def test_a_signal_stops_a_loopback_run_and_every_process_of_its_deployment(start, tmp_path, sig, to_group, code):
    """SIGTERM to the run (as `kill` sends it) or Ctrl-C (SIGINT to its process group) while its ClientApps run:
    every process of the deployment ends with the run (before: 9 of them finished the run in the background), which
    exits with one line; its deployment folder is gone."""
    run = start("loopback")
    run.wait_for("ClientApp process", lambda: deployment_is_running(run))
    kinds = {cmd.split()[1].rsplit("/", 1)[-1] for cmd in run.processes().values() if len(cmd.split()) > 1}
    assert {"flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp"} <= kinds
    assert run.process_named("-m pfedkit.flower.worker")  # a ClientApp process of pfedkit's
    (os.killpg if to_group else os.kill)(run.process.pid, sig)
    assert run.exit_code() == code, run.stderr()
    assert only_line(run.stderr()) == interrupted_line(run.out)
    assert run.processes() == {}
    assert not (run.out / ".flower").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "stderr.txt", "stdout.txt"]  # nothing beside out


def test_a_supernode_that_dies_stops_the_loopback_run_with_one_line_naming_its_log(start):
    """A SuperNode killed as the deployment starts: the run stops (bounded wait: before, it waited out the 300 s
    connect timeout, then printed source lines) with one line naming that SuperNode's log, which exists, and no
    process of the deployment is left."""
    run = start("loopback")
    victim = run.wait_for("SuperNode of partition 1", lambda: run.process_named("flower-supernode", "partition-id=1"))
    os.kill(victim, signal.SIGKILL)
    assert run.exit_code(timeout=120) == 2, run.stderr()
    line = only_line(run.stderr())
    assert line.startswith("pfedkit: error: the flower-supernode of partition 1 was killed by SIGKILL; read ")
    log = Path(line.rsplit("read ", 1)[1])
    assert log.name == "supernode1.log" and log.is_file() and (run.out / ".flower") in log.parents
    assert run.processes() == {}


def test_a_serverapp_that_fails_gives_its_own_one_line_error(start):
    """A round timeout no client can meet: the ServerApp's run fails as the in-process engine's would (failed.txt),
    and the CLI says so in that one line (before: the status and every log line holding "Error", source lines of
    the traceback among them); the deployment's folder is kept for its logs; nothing of it is left running."""
    run = start("loopback", rounds=2, extra=["--round-timeout", "0.01"])
    assert run.exit_code(timeout=600) == 2, run.stderr()
    failure = (run.out / "fedavg" / "failed.txt").read_text()
    assert failure.startswith("round 1: 0 of 2 clients sent a usable update")
    assert only_line(run.stderr()) == (f"pfedkit: error: 1 run(s) failed, e.g. fedavg: {failure}; the other results "
                                       f"are in {run.out}/comparison.md")
    assert [p.name for p in (run.out / ".flower").iterdir()][0].startswith("deployment-")
    assert run.processes() == {}


def test_a_loopback_run_writes_only_inside_its_folder_and_follows_no_planted_link(start, tmp_path):
    """Links planted where the deployment's files went before (beside --out: .run.config.yaml, .run.flower) are left
    alone by a whole run, which completes without the venv's bin folder on PATH (Flower's processes start each other
    by name: before, `flower-superexec` was not found); its deployment folder inside the run is removed at the end,
    and nothing of the deployment is left running."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    os.symlink(victim / "precious.txt", tmp_path / ".run.config.yaml")
    os.symlink(victim, tmp_path / ".run.flower")
    run = start("loopback", rounds=1, path=without_venv_bin())
    assert run.exit_code(timeout=600) == 0, run.stderr()
    assert (run.out / "fedavg" / "summary.json").is_file() and (run.out / "comparison.md").is_file()
    assert (victim / "precious.txt").read_text() == "mine" and os.listdir(victim) == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".run.config.yaml", ".run.flower", "run", "stderr.txt",
                                                                 "stdout.txt", "victim"])
    assert not (run.out / ".flower").exists()
    assert run.processes() == {}


def test_a_link_planted_as_the_deployment_folder_is_refused_before_anything_starts(start, tmp_path):
    """out/.flower planted as a link to another folder: one line naming it, exit 2, nothing written through it, no
    Flower process started."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "run").mkdir()
    os.symlink(victim, tmp_path / "run" / ".flower")
    run = start("loopback")
    assert run.exit_code(timeout=120) == 2, run.stderr()
    line = only_line(run.stderr())
    assert line.startswith(f"pfedkit: error: {tmp_path / 'run' / '.flower'} is not a folder"), line
    assert os.listdir(victim) == []
    assert run.processes() == {}
