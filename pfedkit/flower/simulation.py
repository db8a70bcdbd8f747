"""`pfedkit run CONFIG --runtime flower`: the experiment through Flower's simulation runtime (Ray): one virtual
SuperNode per partition, the ServerApp in this process writing the same run folder as the in-process engine."""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from ..config import Config, dump_config
from ..errors import PfedkitError
from . import require_flower


def run_simulation(cfg: Config | None, out: Path, *, resume: bool = False, overwrite: bool = False,
                   timeout: float = 600.0, min_replies: int = 1, workers: int = 0, log=print) -> None:
    """Run `cfg` (or, with `resume`, the folder's own config) on Flower's simulation runtime into `out`.
    `workers`: ClientApp processes (Ray actors) at once, default one per CPU core."""
    require_flower()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
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
    server = make_server_app(source, str(out), resume=resume, overwrite=overwrite, timeout=timeout,
                             min_replies=min_replies, errors=errors, log=log)
    cores = os.cpu_count() or 1
    workers = workers or cores
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("flwr").setLevel(logging.WARNING)
        flower_simulation(server_app=server, client_app=make_client_app(source),
                          num_supernodes=cfg.partition.num_clients,
                          backend_config={"client_resources": {"num_cpus": max(cores // workers, 1), "num_gpus": 0.0},
                                          "init_args": {"num_cpus": cores, "include_dashboard": False,
                                                        "logging_level": "error", "log_to_driver": False}})
    if errors:
        raise errors[0]
    if not resume and not (out / "comparison.md").is_file():
        raise PfedkitError(f"the Flower simulation ended without results in {out} (see the log above)")
