"""Registry of algorithms by name (the order is the order of the default comparison)."""
from .base import Algorithm, ClientContext, Cohort, NoParams
from .fedavg import FedAvg, FedProx
from .local import Local
from .perfedavg import PerFedAvg
from .pfedla import HeurPFedLA, PFedLA
from .pfedme import PFedCS, PFedMe

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (
    Local, FedAvg, PFedLA, HeurPFedLA, FedProx, PerFedAvg, PFedMe, PFedCS)}

__all__ = ["ALGORITHMS", "Algorithm", "ClientContext", "Cohort", "NoParams"]
