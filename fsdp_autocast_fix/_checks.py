"""An opt-in, value-level recompute check for debugging.

``torch.utils.checkpoint`` compares only the shape, dtype and device of each tensor the recompute saves
again, so a recompute that computes other values with the same metadata (a block that begins with
``x.float()`` under a lost cast) passes unnoticed. This check adds a checksum of each tensor's bits to
that metadata, so torch's own comparison raises ``CheckpointError`` naming the tensor's position and
showing what differed. It is off by default and costs a pass over every saved tensor, twice.

Two ways to use it, both for non-reentrant ``torch.utils.checkpoint`` (the only kind that has
``determinism_check``):

* ``with fsdp_autocast_fix.check_recompute(): ...`` makes the check the default for checkpoints
  called inside the block;
* ``checkpoint(fn, x, use_reentrant=False, determinism_check=fsdp_autocast_fix.register_value_check())``
  for one call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

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


def _registry() -> dict[str, Any]:
    registry = getattr(torch_checkpoint, "_allowed_determinism_checks_to_fns", None)
    if not isinstance(registry, dict):
        raise RuntimeError(
            f"torch {torch.__version__} has no determinism_check registry in torch.utils.checkpoint; "
            "the value-level recompute check needs one")
    return registry


def register_value_check() -> str:
    """Register the check with ``torch.utils.checkpoint``; return its ``determinism_check`` name."""
    with _lock:
        _registry()[VALUE_CHECK] = value_metadata
    return VALUE_CHECK


@contextlib.contextmanager
def check_recompute() -> Iterator[None]:
    """Within the block, non-reentrant checkpoints check recomputed values too (not only their metadata).

    Changes the default ``determinism_check`` of ``torch.utils.checkpoint`` process-wide for the
    block's duration; a checkpoint's comparison uses the check that was in force when it ran forward.
    """
    register_value_check()
    registry = _registry()
    default = getattr(torch_checkpoint, "_DEFAULT_DETERMINISM_MODE", "default")
    with _lock:
        previous = registry[default]
        registry[default] = value_metadata
    try:
        yield
    finally:
        with _lock:
            registry[default] = previous
