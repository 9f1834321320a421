"""Make a checkpointed ``fully_shard`` (FSDP2) module recompute exactly what its forward computed.

In torch 2.4-2.12, FSDP2 skips its ``MixedPrecisionPolicy`` casts when a checkpointed module's forward is
recomputed in backward (pytorch issue 148831), and no torch restores autocast for checkpoints that do not restore
it themselves. This package records each sharded module's forward-time state and replays it in the recompute::

    import fsdp_autocast_fix
    fsdp_autocast_fix.apply()                      # process-wide, before or after sharding

    from fsdp_autocast_fix import patched_fully_shard
    patched_fully_shard(layer, mp_policy=policy)   # only the modules it shards
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

with warnings.catch_warnings():  # torch warns at import where numpy is absent; nothing here uses numpy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from . import _autoapply, _compat, _patch, _report
from ._checks import VALUE_CHECK, check_recompute, register_value_check
from ._compat import UnsupportedTorchError
from ._patch import apply, patched_fully_shard, remove
from ._preserve import preserve_autocast
from ._report import ModuleReport, Report

__all__ = [
    "VALUE_CHECK",
    "ModuleReport",
    "Report",
    "Status",
    "UnsupportedTorchError",
    "apply",
    "check_recompute",
    "patched",
    "patched_fully_shard",
    "preserve_autocast",
    "register_value_check",
    "remove",
    "report",
    "status",
]
__version__ = "0.1.0"


@dataclass(frozen=True)
class Status:
    """Where the patch stands in this process (see :func:`status`).

    Attributes:
        torch_version: ``torch.__version__``.
        needs_cast_replay: whether this torch skips FSDP's casts in the recompute (probed on torch's own code);
            None if this torch is not supported.
        needs_param_gather: whether this torch's recompute skips gathering parameters resharded since the
            forward, failing with "mixed torch.Tensor and DTensor" (probed likewise; the patch gathers them); None
            if this torch is not supported.
        cast_replay_active: whether covered modules get the cast replay.
        autocast_replay_active: whether any module is covered or :func:`apply` is in force.
        patched_globally: whether :func:`apply` is in force.
        covered_modules: how many sharded modules carry the patch's hooks.
        unsupported: why this torch is not supported, or None.
    """

    torch_version: str
    needs_cast_replay: bool | None
    cast_replay_active: bool
    autocast_replay_active: bool
    patched_globally: bool
    covered_modules: int
    unsupported: str | None = None
    needs_param_gather: bool | None = None


def status() -> Status:
    """Report the torch version, what it needs, and what is patched now. Never raises.

    First completes a pending auto-apply (``FSDP_AUTOCAST_FIX=1``) where no import of torch or of this package is
    under way.
    """
    _autoapply.settle()
    try:
        internals = _compat.load()
        needs: bool | None = internals.needs_cast_replay
        gather: bool | None = internals.needs_param_gather
        unsupported = None
    except UnsupportedTorchError as e:
        needs, gather, unsupported = None, None, str(e)
    covered = _patch.covered_modules()
    applied = _patch.is_applied()
    active = applied or covered > 0
    return Status(
        torch_version=_compat.torch_version(),
        needs_cast_replay=needs,
        cast_replay_active=active and bool(needs or _patch.forced()),
        autocast_replay_active=active,
        patched_globally=applied,
        covered_modules=covered,
        unsupported=unsupported,
        needs_param_gather=gather,
    )


@contextlib.contextmanager
def patched(*, force: bool = False) -> Iterator[None]:
    """Apply with ``force`` on enter, restore the previous state on exit; safe to nest.

    Only a ``patched()`` that applied the patch removes it on exit; inside an :func:`apply` the patch stays in force
    with its previous ``force``.
    """
    was_applied, was_forced = _patch.is_applied(), _patch.forced()
    apply(force=force)
    try:
        yield
    finally:
        if not was_applied:
            remove()
        elif was_forced != force:
            apply(force=was_forced)


def report(*, reset: bool = False) -> Report:
    """What the patch did in this process since the last :func:`apply` or ``report(reset=True)``. Never raises.

    Totals and counts per sharded module class (fields: :class:`Report`): recomputes seen, recomputes whose
    autocast state it changed, FSDP casts, root input moves and parameter gathers it replayed, cached casts it
    dropped or kept out (pytorch issue 158232), and recomputes it could not identify, with why. ``str()`` gives a
    table and one line of advice: what the patch fixed, or that it changed nothing (you may not need it here).
    ``reset=True`` zeroes the counts after reading them. ``FSDP_AUTOCAST_FIX_REPORT=1`` prints the report at
    interpreter exit on rank 0 (``=all``: every rank), also under the auto-apply.
    """
    return _report.snapshot(reset=reset)
