"""One long-lived ClientApp process per SuperNode of a loopback deployment (`flower-supernode --isolation process`).

Flower runs a ClientApp in a new process for every message (its SuperExec starts `flwr-clientapp`, which serves one
message and exits): pfedkit's would import torch and pfedkit and build the client's data for each, about 3
CPU-seconds a message, most of a loopback round on 2 cores. This process serves every message of its SuperNode
instead, doing per message what flwr-clientapp does, with Flower's own functions: acquire the node's next task over
its Runtime API (AcquireTask, signed with the deployment's SuperExec secret, so that nothing else on the machine
takes the node's tasks), pull the message and the context, run pfedkit's ClientApp, push the reply and the context
back. The client's data and model stay loaded between messages (flower.client keeps them per process).

Only pfedkit's own Flower app is served: a task of any other app gets an error reply, and no code from a submitted
app (FAB) is loaded here.

    python -m pfedkit.flower.worker --runtime-api-address 127.0.0.1:PORT --secret-file FILE --node-pid PID"""
from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path

APP_ID = "pfedkit/pfedkit-app"  # publisher/name of pfedkit's Flower app (app/pyproject.toml)
# Seconds between AcquireTask calls (each ~4 ms of CPU, this process's and its SuperNode's): often while the run is
# exchanging messages with this node (its next message is seconds away), at Flower's SuperExec's pace when idle
POLL_BUSY_S, POLL_IDLE_S, BUSY_FOR_S = 0.1, 1.0, 15.0
ACQUIRE = "/flwr.proto.Runtime/AcquireTask"


def node_alive(pid: int) -> bool:
    """The SuperNode is running (a zombie, not yet reaped by whoever started it, has ended)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return data[data.rindex(b")") + 2:].split()[0] not in (b"Z", b"X")


def _runtime_client(address: str, interceptors: list):
    """A client of the SuperNode's Runtime API making one attempt a call (Flower's retrying invoker would retry a
    dead SuperNode forever and interrupt this process on a refused token): a failed call fails that task alone."""
    from flwr.supercore.runtime import RuntimeHttpClient
    return RuntimeHttpClient.from_server_address(address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors)


def _heartbeat_fn(client):
    """The task's heartbeat (the SuperNode expires a task that stops beating). Unlike flwr-clientapp's, a refused
    beat does not stop the process: a task of a stopped run is simply let go."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

    def beat() -> bool:
        try:
            client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.HTTPError:
            return False  # retried by HeartbeatSender with backoff until the task ends
        return True
    return beat


def serve_task(address: str, token: str, app) -> None:
    """One task, as flwr-clientapp serves it: the reply (an error reply if the ClientApp raised), then the task's
    status and context."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    client = _runtime_client(address, [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                                       RuntimeTokenHttpInterceptor(token)])
    heartbeat = HeartbeatSender(_heartbeat_fn(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        message, context, run, _fab = pull_task_input(client)
        if run.fab_id != APP_ID:
            raise PermissionError(f"this SuperNode serves pfedkit's app ({APP_ID}) only, not {run.fab_id!r}")
        reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # noqa: BLE001 - the ServerApp gets an error reply, as from flwr-clientapp
        traceback.print_exc()
        details = f"{type(exc)}:<'{exc}'>"
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        # a call that fails (e.g. the run was stopped meanwhile) loses this task alone: the next one is served
        if reply is not None and context is not None:
            _attempt(push_message, client, reply, context)
        _attempt(push_task_output, client=client, context=context, sub_status=status, details=details)
        heartbeat.stop()
        client.close()


def _attempt(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except Exception:  # noqa: BLE001 - logged; the process goes on serving
        traceback.print_exc()


def serve(address: str, secret: bytes, node_pid: int) -> None:
    """Every task of the SuperNode at `address`, one at a time, until that SuperNode has ended."""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor

    from .client import make_client_app

    app = make_client_app(one_partition=True)
    tasks = _runtime_client(address, [RuntimeVersionHttpInterceptor(component_name="SuperExec"),
                                      SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE})])
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    last_task = -BUSY_FOR_S
    while node_alive(node_pid):
        try:
            got = tasks.AcquireTask(request)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == httpx.codes.UNAUTHORIZED:
                raise SystemExit(f"the SuperNode at {address} refused this process's SuperExec secret") from None
            print(f"AcquireTask: {exc}", flush=True)
            time.sleep(POLL_IDLE_S)
            continue
        except httpx.TransportError:  # the SuperNode's Runtime API is not up yet, or going away
            time.sleep(0.5)
            continue
        if got.HasField("task") and got.token:
            serve_task(address, got.token, app)
            last_task = time.monotonic()
        else:
            time.sleep(POLL_BUSY_S if time.monotonic() - last_task < BUSY_FOR_S else POLL_IDLE_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, host:port")
    ap.add_argument("--secret-file", type=Path, required=True, help="the SuperExec secret the SuperNode was given")
    ap.add_argument("--node-pid", type=int, required=True, help="the SuperNode's process: this one ends with it")
    args = ap.parse_args()
    serve(args.runtime_api_address, args.secret_file.read_bytes(), args.node_pid)


if __name__ == "__main__":
    main()
