"""Every process a deployment started, found and stopped. Flower's processes start others: the SuperLink a
SuperExec in a session of its own (so outside any process group we made) and it the ServerApp processes, each
SuperNode in Flower's default isolation a SuperExec and it a ClientApp process per message (with pfedkit's
workers, one long-lived ClientApp process beside each SuperNode instead). All of them inherit the environment they
were started with, so a variable set only there (MARKER=token) finds them wherever they ended up; the process
groups of the processes started here find those of them that could not be read."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

MARKER = "PFEDKIT_DEPLOYMENT"
PROC = Path("/proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process, None if it is gone."""
    try:
        data = (PROC / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()  # after "pid (name) ": the name may hold spaces
    return fields[0].decode(), int(fields[2])


def _environment_holds(pid: int, entry: bytes) -> bool:
    try:
        return entry in (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def members(token: str, groups: set[int]) -> set[int]:
    """The live processes (zombies are dead: their parents reap them) whose environment holds MARKER=token or that
    are in one of `groups`. Without /proc (not Linux): none."""
    if not PROC.is_dir():
        return set()
    entry, me, found = f"{MARKER}={token}".encode(), os.getpid(), set()
    for name in os.listdir(PROC):
        if not name.isdigit() or int(name) == me:
            continue
        stat = _stat(int(name))
        if stat is None or stat[0] in ("Z", "X"):
            continue
        if stat[1] in groups or _environment_holds(int(name), entry):
            found.add(int(name))
    return found


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(token: str, started: list[subprocess.Popen], grace: float = 1.0, bound: float = 20.0) -> set[int]:
    """SIGTERM every process of the deployment (those in `started`, their process groups, and every process whose
    environment holds MARKER=token), SIGKILL what is left after `grace` seconds, and wait (at most `bound` seconds)
    until none is left; `started` are reaped. Processes started meanwhile are found by the next look. Returns what
    is still alive at the bound (nothing, but for a process that cannot be killed)."""
    groups = {p.pid for p in started}  # each was started in a session (so a process group) of its own
    deadline, hard = time.monotonic() + bound, time.monotonic() + grace
    termed: set[int] = set()
    while True:
        for p in started:
            p.poll()  # reaps those that ended: a zombie is not a member
        left = members(token, groups) | {p.pid for p in started if p.returncode is None}
        if not left or time.monotonic() > deadline:
            return left
        if time.monotonic() > hard:
            _signal(left, signal.SIGKILL)
        else:
            _signal(left - termed, signal.SIGTERM)
            termed |= left
        time.sleep(0.1)
