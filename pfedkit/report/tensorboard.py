"""A TensorBoard log of each run (`pfedkit run --tensorboard`, or `run_experiment(..., observers=[TensorBoard()])`):
every number of the metrics rows as a scalar at its round, accuracies in percent as in the tables, into
`<run folder>/tensorboard/`, so `tensorboard --logdir DIR` shows every algorithm (and seed) of an experiment.
Needs the `tensorboard` package: `pip install -e '.[tensorboard]'`."""
from __future__ import annotations

from ..engine import Observer
from ..errors import PfedkitError

FOLDER = "tensorboard"
SKIPPED = ("round",)  # the step itself


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise PfedkitError("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'") from None


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers as TensorBoard tags: accuracies (`*_acc*`) in percent, tagged `... %`."""
    out = {}
    for key, value in row.items():
        if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if "_acc" in key:
            out[f"{key} %"] = 100.0 * value
        else:
            out[key] = float(value)
    return out


class TensorBoard(Observer):
    """One event log per run, in the run's folder. A resumed run continues its log: the steps written after the
    checkpoint it resumes from are dropped (purged), as metrics.jsonl drops them."""

    side_by_side = True  # a writer per run

    def __init__(self) -> None:
        require_tensorboard()
        self.writers: dict[int, object] = {}

    def start(self, run, resumed):
        from torch.utils.tensorboard import SummaryWriter
        self.writers[id(run)] = SummaryWriter(str(run.out / FOLDER),
                                              purge_step=run.totals["round"] + 1 if resumed else None)

    def round_done(self, run, rnd, stats, row):
        if row is None:
            return
        for tag, value in scalars(row).items():
            self.writers[id(run)].add_scalar(tag, value, rnd)

    def close(self, run):
        writer = self.writers.pop(id(run), None)
        if writer is not None:
            writer.close()
