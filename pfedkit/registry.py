"""The algorithm registry: names to classes, in the default comparison's order. The config reads it (each
algorithm's `Params` is a YAML section) without importing any algorithm; the algorithms register themselves when
`pfedkit.algorithms` is imported, which `pfedkit/__init__.py` does first."""
from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS: dict[str, type] = {}


@dataclass
class NoParams:
    """This algorithm has no hyperparameters of its own."""


def register(cls: type) -> type:
    """Class decorator: make an algorithm available by its `name` (config, CLI, Flower apps)."""
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise ValueError(f"two algorithms are called {cls.name!r}")
    ALGORITHMS[cls.name] = cls
    return cls
