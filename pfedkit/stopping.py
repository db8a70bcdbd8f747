"""Stopping a run when asked (in process, on Flower): SIGINT (Ctrl-C) and SIGTERM (`kill`, a service manager) end the run promptly,
its processes with it; its checkpoint stays as the last checkpointed round wrote it (checkpoints are written whole,
engine/files.atomic_write)."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator, TypeVar

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")


class Stopped(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM. A KeyboardInterrupt, so that what handles Ctrl-C handles it too (the
    CLI's one line and exit 130), and so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """What the handlers of `on_signals` saw: `event` is set at the first signal, `signum` is that signal."""

    def __init__(self):
        self.event = threading.Event()
        self.signum: int | None = None
        self.count = 0

    def raise_if_set(self) -> None:
        if self.event.is_set():
            raise Stopped(self.signum)


@contextlib.contextmanager
def on_signals(raise_at: int = 1) -> Iterator[StopRequest]:
    """SIGINT and SIGTERM for the block: each is noted in the StopRequest; the `raise_at`-th raises Stopped in the
    main thread. 1: the main thread waits on the run and stops it itself; 2: the main thread is inside a runtime
    that winds down on its own once the run (which polls the request) stops, and a second signal insists. Signals
    after the raise are only noted, so that the cleanup it starts runs to its end. The previous handlers come back
    after the block; outside the main thread (where Python cannot take signals) nothing is installed."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        request.count += 1
        if request.signum is None:
            request.signum = signum
            request.event.set()
        if request.count == raise_at:
            raise Stopped(request.signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def finish(cleanup: Callable[[], T]) -> T:
    """`cleanup()` run to its end even when Ctrl-C or a stop signal arrives meanwhile (it is started again, so it
    must be safe to repeat), the interrupt then raised: stopping a deployment half-way would leave processes."""
    interrupt: KeyboardInterrupt | None = None
    while True:
        try:
            result = cleanup()
            break
        except KeyboardInterrupt as exc:
            interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt
    return result


@contextlib.contextmanager
def held() -> Iterator[None]:
    """SIGINT and SIGTERM held for the block, then delivered to the handlers there were, as if they came right after
    it: for a file being written, which an interrupt half-way through would leave broken (PyTorch's zip writer, cut
    by Ctrl-C, raised its own error instead of the interrupt, or aborted the process at exit). Outside the main
    thread (which takes no signals) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: seen.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if seen:
            signal.raise_signal(seen[0])  # its handler runs now: Ctrl-C's KeyboardInterrupt, a Stopped, ...


@contextlib.contextmanager
def stop_on(*signals: int) -> Iterator[None]:
    """Each of `signals` raises Stopped in the main thread for the block (as Ctrl-C raises KeyboardInterrupt), the
    previous handlers back after it; outside the main thread, nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Stopped(signum)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
