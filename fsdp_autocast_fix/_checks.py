"""An opt-in, value-level recompute check for debugging.

``torch.utils.checkpoint`` compares only the shape, dtype and device of each tensor the recompute saves again, so a
recompute that computes other values (a block that begins with ``x.float()`` under a lost cast) passes unnoticed.
This check adds a checksum of each tensor's bits to that metadata, so torch's own comparison raises
``CheckpointError`` naming the tensor's position and what differed. It is off by default and costs two passes over
every saved tensor (forward and recompute).

Both ways to use it need non-reentrant ``torch.utils.checkpoint`` (the only kind with ``determinism_check``):

* ``with fsdp_autocast_fix.check_recompute(): ...`` makes it the default for checkpoints called in the block;
* ``checkpoint(fn, x, use_reentrant=False, determinism_check=fsdp_autocast_fix.register_value_check())`` for one
  call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import _compat

#: The ``determinism_check`` name this check is registered under.
VALUE_CHECK = "fsdp_autocast_fix.values"
_lock = threading.Lock()


def value_metadata(x: torch.Tensor) -> dict[str, Any]:
    """torch's default metadata plus a position-weighted checksum of the tensor's raw bits."""
    meta: dict[str, Any] = {"shape": x.shape, "dtype": x.dtype, "device": x.device}
    flat = x.detach().reshape(-1).contiguous()
    if flat.numel() == 0:
        meta["checksum"] = 0
        return meta
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int64) if raw.numel() % 8 == 0 else raw.to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
    meta["checksum"] = (int(words.sum().item()), int((words * weights).sum().item()))
    return meta


def register_value_check() -> str:
    """Register the check with ``torch.utils.checkpoint``; return its ``determinism_check`` name (:data:`VALUE_CHECK`).

    Raises ``RuntimeError`` where this torch has no ``determinism_check`` registry."""
    registry, _default = _compat.determinism_checks()
    with _lock:
        registry[VALUE_CHECK] = value_metadata
    return VALUE_CHECK


@contextlib.contextmanager
def check_recompute() -> Iterator[None]:
    """Within the block, non-reentrant checkpoints check recomputed values too, not only their metadata.

    Sets the default ``determinism_check`` of ``torch.utils.checkpoint`` process-wide for the block; each checkpoint
    compares with the check in force when its forward ran. Raises ``RuntimeError`` as :func:`register_value_check`.
    """
    register_value_check()
    registry, default = _compat.determinism_checks()
    with _lock:
        previous = registry[default]
        registry[default] = value_metadata
    try:
        yield
    finally:
        with _lock:
            registry[default] = previous
