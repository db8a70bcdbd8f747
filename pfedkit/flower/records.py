"""pfedkit messages <-> Flower records, without pickling: tensors travel in an ArrayRecord (each array as .npy
bytes, read back with allow_pickle=False by Flower), numbers in a MetricRecord, the round's facts in a
ConfigRecord. Whatever arrives is data: its structure is checked here, its values by engine.checks."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..errors import UpdateError

ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"


def to_arrays(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def from_arrays(record: Any, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """An ArrayRecord as torch tensors (copies); anything else, or an array of a non-numeric dtype, is refused."""
    if not isinstance(record, ArrayRecord):
        raise UpdateError(f"expected an ArrayRecord of tensors, got {type(record).__name__}")
    out = {}
    for key, array in record.items():
        value = array.numpy()
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiub":
            raise UpdateError(f"'{key}' is not a numeric array ({getattr(value, 'dtype', type(value).__name__)})")
        out[key] = torch.from_numpy(np.array(value)).to(device)
    return out


def message_content(tensors: dict[str, torch.Tensor], numbers: dict[str, int | float] | None = None,
                    config: dict[str, Any] | None = None) -> RecordDict:
    content = {ARRAYS: to_arrays(tensors)}
    if numbers:
        content[METRICS] = MetricRecord(dict(numbers))
    if config:
        content[CONFIG] = ConfigRecord(dict(config))
    return RecordDict(content)


def read_update(content: RecordDict, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A client's reply as an update (tensors and numbers), for engine.checks.check_update to judge."""
    if ARRAYS not in content or METRICS not in content:
        raise UpdateError(f"the reply holds {sorted(content.keys())}, expected '{ARRAYS}' and '{METRICS}'")
    update: dict[str, Any] = from_arrays(content[ARRAYS], device)
    metrics = content[METRICS]
    if not isinstance(metrics, MetricRecord):
        raise UpdateError(f"'{METRICS}' is a {type(metrics).__name__}, expected a MetricRecord")
    for key, value in metrics.items():
        if key in update:
            raise UpdateError(f"'{key}' is both a tensor and a number")
        update[key] = value
    return update


def config_of(content: RecordDict) -> dict[str, Any]:
    record = content[CONFIG] if CONFIG in content else ConfigRecord({})
    return dict(record)
