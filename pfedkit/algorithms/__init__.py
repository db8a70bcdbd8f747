"""Registry of algorithms by name (the order is the order of the default comparison)."""
from .base import Algorithm, ClientContext, NoParams
from .fedavg import FedAvg
from .local import Local
from .pfedla import HeurPFedLA, PFedLA

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (Local, FedAvg, PFedLA, HeurPFedLA)}

__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "NoParams"]
