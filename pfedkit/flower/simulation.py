"""`pfedkit run CONFIG --runtime flower`: the experiment through Flower's simulation runtime (Ray): one virtual
SuperNode per partition, the ServerApp in this process writing the same run folder as the in-process engine."""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import warnings
from pathlib import Path
from typing import Iterator

from ..config import Config, dump_config
from ..errors import PfedkitError
from . import require_flower
from .process_tree import MARKER, stop_all
from ..stopping import finish, on_signals


def run_simulation(cfg: Config | None, out: Path, *, resume: bool = False, overwrite: bool = False,
                   timeout: float = 600.0, min_replies: int = 1, workers: int = 0, allow_version_change: bool = False,
                   log=print) -> None:
    """Run `cfg` (or, with `resume`, the folder's own config) on Flower's simulation runtime into `out`.
    `workers`: ClientApp processes (Ray actors) at once, default one per CPU core. SIGINT or SIGTERM stop the run
    at its next message, and Ray with it (stopping.Stopped is raised; a second signal insists)."""
    require_flower()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # Ray runs its workers at niceness 15, so that they yield to the driver; here they are the run (every client's
    # training), and beside any other work on the machine they were starved: a 28-second test run took 6 minutes
    # beside four training processes, and its SuperNodes did not register within 300 s beside six
    os.environ.setdefault("RAY_worker_niceness", "0")
    from flwr.simulation import run_simulation as flower_simulation

    from ..config import load_config
    from ..experiment import check_out
    from .client import make_client_app
    from .server import make_server_app

    out = Path(out)
    if resume:
        cfg = load_config(out / "config.yaml")
    else:
        check_out(out, overwrite)
    source = dump_config(cfg)
    errors: list = []
    cores = os.cpu_count() or 1
    workers = workers or cores
    init_args = {"num_cpus": cores, "include_dashboard": False, "logging_level": "error", "log_to_driver": False}
    # Ray first: ray.init replaces the SIGTERM handler with one that leaves the run going (the ServerApp thread)
    with _ray(init_args), on_signals(raise_at=2) as stop:
        server = make_server_app(source, str(out), resume=resume, overwrite=overwrite, timeout=timeout,
                                 min_replies=min_replies, errors=errors, stop=stop,
                                 allow_version_change=allow_version_change, log=log)
        flower_simulation(server_app=server, client_app=make_client_app(source),
                          num_supernodes=cfg.partition.num_clients,
                          backend_config={"client_resources": {"num_cpus": max(cores // workers, 1), "num_gpus": 0.0},
                                          "init_args": init_args})
        stop.raise_if_set()
    if errors:
        raise errors[0]
    if not resume and not (out / "comparison.md").is_file():
        raise PfedkitError(f"the Flower simulation ended without results in {out} (see the log above)")


@contextlib.contextmanager
def _ray(init_args: dict) -> Iterator[None]:
    """Ray started as Flower's simulation starts it (flwr's RayBackend.init_ray: the same arguments, the driver's
    sys.path for the workers), but here, with MARKER=token in the environment its processes inherit: at the end
    Ray is shut down (Flower does it as its runtime ends, not when it never got that far) and any of its processes
    left is stopped (its workers outlived the shutdown by up to 15 s, measured). Flower's warnings are quiet for
    the block, but for errors and the warnings pfedkit's user can act on."""
    try:
        import ray
    except ImportError:
        raise PfedkitError("the Flower simulation runtime needs Ray: pip install -e '.[flower]'") from None
    flwr_log, token = logging.getLogger("flwr"), secrets.token_hex(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flwr_log.setLevel(logging.WARNING)
        flwr_log.addFilter(_not_our_deprecation)
        try:
            if not ray.is_initialized():
                pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
                os.environ["PYTHONPATH"] = pythonpath
                os.environ[MARKER] = token
                try:
                    ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **init_args)
                finally:
                    del os.environ[MARKER]
            yield
        finally:
            flwr_log.removeFilter(_not_our_deprecation)
            finish(ray.shutdown)
            finish(lambda: stop_all(token, []))


def _not_our_deprecation(record: logging.LogRecord) -> bool:
    """Flower's warning that its run_simulation API is deprecated: six lines on stderr at every run, addressed to
    whoever called that API (pfedkit, not its user)."""
    return "`run_simulation` function is deprecated" not in record.getMessage()
