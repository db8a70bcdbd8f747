"""pfedkit: personalized federated learning (pFedLA, HeurpFedLA, pFedCS and their baselines)."""
__version__ = "0.1.0"

from . import algorithms  # noqa: E402,F401  fills the registry the config reads
