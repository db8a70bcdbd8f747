"""pfedkit: personalized federated learning (pFedLA, HeurpFedLA, pFedCS and their baselines)."""
__version__ = "0.1.0"

from pathlib import Path as _Path

PRESETS = _Path(__file__).with_name("configs")  # the YAML presets: default.yaml, pfedla/, pfedcs/ (package data)

from . import algorithms  # noqa: E402,F401  fills the registry the config reads
