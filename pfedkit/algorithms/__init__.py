"""The algorithms, registered on import in the order of the default comparison."""
from ..registry import ALGORITHMS, NoParams
# each module registers its algorithms on import
from . import fedavg, fedbn, fedfomo, fedrep, fedtc, local, perfedavg, pfedhn, pfedla, pfedme  # noqa: F401
from .base import Algorithm, build_algorithm, check_local

ORDER = ("local", "fedavg", "pfedla", "heurpfedla", "fedprox", "perfedavg", "pfedme", "pfedcs", "pfedhn", "fedbn",
         "fedrep", "fedfomo", "fedtc")
_ordered = {**{name: ALGORITHMS[name] for name in ORDER}, **ALGORITHMS}  # the default comparison's order
ALGORITHMS.clear()
ALGORITHMS.update(_ordered)

__all__ = ["ALGORITHMS", "Algorithm", "NoParams", "build_algorithm", "check_local"]
