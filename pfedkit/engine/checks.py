"""What the server accepts from a client: an update holds exactly the tensors the algorithm declares
(`update_shapes`), with those shapes and finite values, and the protocol's scalars (`num_samples`, `train_loss`) as
finite numbers. A client may be remote and faulty, so nothing it sends is read before it passes here."""
from __future__ import annotations

import math
from typing import Any

import torch

from ..algorithms.base import GRADIENT_KEY, UPDATE_SCALARS
from ..errors import UpdateError


def tensor_bytes(message: dict[str, Any]) -> int:
    """Bytes of the tensors in a payload or update (scalars such as sample counts are not counted)."""
    return sum(v.numel() * v.element_size() for v in message.values() if isinstance(v, torch.Tensor))


def check_update(update: dict[str, Any], cid: int, rnd: int, hint: str = "lower local.lr",
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise UpdateError (one line naming the client, the round and the key) unless the update holds finite tensors
    and numbers only, the protocol's scalars among them, and, given `shapes`, exactly those tensors."""
    if not isinstance(update, dict):
        raise UpdateError(f"round {rnd}: client {cid} sent a {type(update).__name__}, not an update")
    for key, value in update.items():
        if isinstance(value, torch.Tensor):
            if shapes is not None and key not in shapes:
                raise UpdateError(f"round {rnd}: client {cid} sent an unexpected tensor '{key}'; expected "
                                  f"{', '.join(sorted(shapes)) or 'none'}")
            if shapes is not None and tuple(value.shape) != tuple(shapes[key]):
                raise UpdateError(f"round {rnd}: client {cid} sent '{key}' of shape {tuple(value.shape)}, expected "
                                  f"{tuple(shapes[key])}")
            if not value.is_floating_point():
                raise UpdateError(f"round {rnd}: client {cid} sent '{key}' as {value.dtype}, expected floats")
            if not torch.isfinite(value).all():
                raise UpdateError(f"round {rnd}: client {cid} sent non-finite values in '{key}' "
                                  f"(diverged training?); {hint}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UpdateError(f"round {rnd}: client {cid} sent '{key}' = {value!r}; an update holds tensors and "
                              "numbers only")
        elif not math.isfinite(value):
            raise UpdateError(f"round {rnd}: client {cid} reported a non-finite '{key}' (diverged training?); {hint}")
        elif key not in UPDATE_SCALARS:
            raise UpdateError(f"round {rnd}: client {cid} sent an unexpected number '{key}'; an update's numbers are "
                              f"{', '.join(UPDATE_SCALARS)}")
    missing = [k for k in [*UPDATE_SCALARS, *(shapes or {})] if k not in update]
    if missing:
        raise UpdateError(f"round {rnd}: client {cid} sent no '{missing[0]}'")
    if not (isinstance(update["num_samples"], int) and update["num_samples"] >= 0):
        raise UpdateError(f"round {rnd}: client {cid} sent num_samples = {update['num_samples']!r}; expected a "
                          "count >= 0")


def representative_gradient(update: dict[str, Any], sent: torch.Tensor) -> torch.Tensor:
    """What a client's training did to the model (the similarity sampler's input): its own `gradient` if it sends
    one, else its trained parameters minus the sent ones."""
    return update[GRADIENT_KEY] if GRADIENT_KEY in update else update["weights"][: len(sent)] - sent
