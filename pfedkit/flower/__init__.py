"""pfedkit on Flower (the Message API, flwr >= 1.42): any registered algorithm with any sampler runs as a Flower
ServerApp + ClientApp. The ServerApp runs pfedkit's own Server and Run (the same round, checks, metrics, checkpoint
and run folder as the simulator) over a Flower Grid; each ClientApp holds one partition's data and that client's
state (`context.state`) and runs the algorithm's client half for a cohort of one.

Installed with `pip install -e '.[flower]'`; the core never imports this package."""
from __future__ import annotations

from ..errors import PfedkitError


def require_flower() -> None:
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise PfedkitError("the Flower runtime needs the flwr package: pip install -e '.[flower]'") from None
