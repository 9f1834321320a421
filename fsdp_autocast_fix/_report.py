"""What the patch did in this process: counts kept where it acts, never on the ordinary forward.

Invariant: counts are added only where the patch changes something or sees a recompute (the replay, the cast
cache's drop and shield), so the report costs an ordinary forward nothing. Counts start at zero at process start,
at :func:`fsdp_autocast_fix.apply` and at ``report(reset=True)``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Mapping

#: The environment variable that prints the report at interpreter exit: ``1`` on rank 0, ``all`` on every rank.
ENV = "FSDP_AUTOCAST_FIX_REPORT"

#: Guards _counts and _reasons (a count and its reason fall on the same side of a reset). Reentrant: a signal
#: handler or a finalizer that runs while its thread counts may call report().
_lock = threading.RLock()
_counts: Counter[tuple[str, str]] = Counter()  # (module class, field) -> count
_reasons: dict[str, set[str]] = {}  # module class -> why its recomputes could not be identified
_armed = False


@dataclass(frozen=True)
class ModuleReport:
    """What the patch did for the sharded modules of one class (see :class:`Report` for the fields)."""

    recomputes: int = 0
    autocast_changed: int = 0
    input_casts: int = 0
    output_casts: int = 0
    root_moves: int = 0
    param_gathers: int = 0
    cache_drops: int = 0
    cache_shields: int = 0
    unidentified: int = 0

    def replayed(self) -> int:
        """How many things the patch replayed that the recompute would have lost: autocast states, casts, root
        moves, parameter gathers."""
        return self.autocast_changed + self.input_casts + self.output_casts + self.root_moves + self.param_gathers


@dataclass(frozen=True)
class Report(ModuleReport):
    """What the patch did in this process since the last :func:`fsdp_autocast_fix.apply` or ``report(reset=True)``.

    Attributes:
        recomputes: recomputed calls of covered modules it saw (calls nested inside one are not counted).
        autocast_changed: recomputes it switched to the autocast state of their forward call (the checkpoint had
            not restored it).
        input_casts: FSDP ``MixedPrecisionPolicy`` input casts it replayed where torch skipped them in the recompute.
        output_casts: FSDP ``output_dtype`` casts it replayed likewise.
        root_moves: FSDP root input moves to the device it replayed (no torch release replays them).
        param_gathers: recomputes in which it gathered parameters resharded since the forward, which torch before
            2.11 leaves sharded ("mixed torch.Tensor and DTensor", pytorch issues 153354 and 187437).
        cache_drops: times it cleared autocast's cache before a grad-enabled call because casts made since by a
            recompute or an unshielded ``no_grad`` call were (or might be) still cached; reused, they would have
            cost that call's parameter gradients (pytorch issue 158232).
        cache_shields: ``no_grad`` calls under autocast whose casts it kept out of autocast's cache and that were
            followed, in the same autocast region, by a grad-enabled call of the same sharded module (or
            ``fully_shard`` group), which would otherwise have reused those casts and lost its parameter gradients
            (pytorch issue 158232).
        unidentified: recomputes whose forward call it could not identify (left as the checkpoint set them).
        unidentified_reasons: why, per module class.
        by_module: the counts per sharded module class.
    """

    unidentified_reasons: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    by_module: Mapping[str, ModuleReport] = field(default_factory=lambda: MappingProxyType({}))

    def __str__(self) -> str:
        names = [f.name for f in fields(ModuleReport)]
        rows = [["module"] + names]
        for cls, counts in sorted(self.by_module.items()):
            rows.append([cls] + [str(getattr(counts, n)) for n in names])
        rows.append(["total"] + [str(getattr(self, n)) for n in names])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["fsdp_autocast_fix report:"]
        lines += ["  " + "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in
                                 enumerate(zip(row, widths))) for row in rows]
        for cls, reasons in sorted(self.unidentified_reasons.items()):
            lines.append(f"  {cls}: not identified: {'; '.join(reasons)}")
        lines.append(self.advice())
        return "\n".join(lines)

    def advice(self) -> str:
        """One line: whether the patch changed anything in this run, and whether to keep it."""
        seen = f"{self.recomputes} recomputes seen" if self.recomputes else "no recompute seen"
        if self.replayed():
            fixed = [f"{n} {label}" for n, label in ((self.autocast_changed, "autocast states"),
                                                     (self.input_casts, "input casts"),
                                                     (self.output_casts, "output casts"),
                                                     (self.root_moves, "root input moves"),
                                                     (self.param_gathers, "parameter gathers")) if n]
            line = f"the patch fixed this run: it replayed {', '.join(fixed)} the recompute would have lost; keep it"
        elif self.cache_drops or self.cache_shields:
            line = (f"the patch replayed nothing ({seen}) but kept casts made under no_grad or in a recompute from "
                    f"training calls ({self.cache_shields} no_grad calls kept out of autocast's cast cache, "
                    f"{self.cache_drops} cache drops; pytorch issue 158232): needed where such a call ran in the "
                    "training's open autocast region (an eval pass, or a reentrant checkpoint with backward inside "
                    "autocast); keep it unless none does")
        elif self.unidentified:
            return (f"the patch replayed nothing ({seen}), but {self.unidentified} recomputes it could not identify "
                    "ran under the state their checkpoint set, which it could not check: wrap their checkpoint with "
                    "fsdp_autocast_fix.preserve_autocast; whether you need the patch cannot be told from this run")
        else:
            line = (f"the patch changed nothing in this run ({seen}): with this model, checkpoint, autocast "
                    "setup and torch you may not need it (check every configuration you train before unpinning)")
        if self.unidentified:
            line += (f"; {self.unidentified} recomputes not identified: wrap their checkpoint with "
                     "fsdp_autocast_fix.preserve_autocast")
        return line


def count(cls: str, what: str) -> None:
    """Add one to ``what`` (a :class:`ModuleReport` field) for module class ``cls``."""
    with _lock:
        _counts[cls, what] += 1


def unidentified(cls: str, reason: str) -> None:
    """Count a recompute of a ``cls`` module whose call was not identified, with ``reason``."""
    with _lock:
        _counts[cls, "unidentified"] += 1
        _reasons.setdefault(cls, set()).add(reason)


def snapshot(reset: bool = False) -> Report:
    """The counts as a :class:`Report`; ``reset`` zeroes them after reading."""
    with _lock:
        counts = dict(_counts)
        reasons = {cls: tuple(sorted(r)) for cls, r in _reasons.items()}
        if reset:
            _counts.clear()
            _reasons.clear()
    per: dict[str, dict[str, int]] = {}
    for (cls, what), n in counts.items():
        per.setdefault(cls, {})[what] = n
    by_module = {cls: ModuleReport(**c) for cls, c in per.items()}
    totals = {f.name: sum(getattr(m, f.name) for m in by_module.values()) for f in fields(ModuleReport)}
    return Report(**totals, unidentified_reasons=MappingProxyType(reasons), by_module=MappingProxyType(by_module))


def reset() -> None:
    """Zero every count."""
    snapshot(reset=True)


def arm_exit_report() -> None:
    """Print the report at interpreter exit where :data:`ENV` asks for it (once per process). Called when the
    process covers its first module, so a process that never uses the patch (a DataLoader worker) prints none."""
    global _armed
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted not in ("1", "all") or _armed:
        return
    _armed = True
    atexit.register(_print_at_exit, wanted == "all")


def _print_at_exit(every_rank: bool) -> None:
    rank = _rank()
    if every_rank or rank in (None, 0):
        prefix = f"[rank {rank}] " if every_rank and rank is not None else ""
        text = str(snapshot())
        print("\n".join(prefix + line for line in text.splitlines()), file=sys.stderr, flush=True)


def _rank() -> int | None:
    """This process's rank: torchrun's ``RANK``, else the default process group's if one is alive, else None."""
    if "RANK" in os.environ:
        try:
            return int(os.environ["RANK"])
        except ValueError:
            return None
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # pragma: no cover - a torch without distributed
        return None


def _new_lock_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # a fork while another thread held it would leave it held in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)
