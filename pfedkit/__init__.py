"""pfedkit: personalized federated learning (pFedLA, HeurpFedLA, pFedCS and their baselines)."""
__version__ = "0.1.0"
