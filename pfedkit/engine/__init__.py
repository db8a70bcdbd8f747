"""The round as a step over a transport (server.py: sample, send, check, aggregate, evaluate; clients.py: the
in-process clients), and one run around it (run.py: wiring, loop, observers)."""
from .checks import check_update, tensor_bytes
from .clients import InProcessClients
from .files import ObservableLog, atomic_write
from .run import TIMING_KEYS, Observer, Run
from .server import EVAL_CHUNK, RoundStats, Server, metrics_row

__all__ = ["EVAL_CHUNK", "InProcessClients", "ObservableLog", "Observer", "RoundStats", "Run", "Server",
           "TIMING_KEYS", "atomic_write", "check_update", "metrics_row", "tensor_bytes"]
