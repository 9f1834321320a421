"""What the patch did in this process: counts kept where it acts, never on the ordinary forward.

Invariant: every count is incremented on a path that runs only when the patch changes something or sees a
recompute (the replay, the cast-cache drop), so that a report costs an ordinary forward nothing; the counts
start at zero when the process starts, at :func:`fsdp_autocast_fix.apply` and at ``report(reset=True)``. Each
thread adds to a table of its own, without a lock (a replay pays no lock); a report sums every thread's table,
those of threads that have ended included, less the sums at the last reset.
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

_lock = threading.Lock()  # guards _tables, _ended, _baseline and _reasons
#: Each live thread's counts, (module class, field) -> count, with its thread; a thread adds to its own only.
_tables: list[tuple[threading.Thread, dict[tuple[str, str], int]]] = []
_ended: Counter[tuple[str, str]] = Counter()  # the counts of threads that have ended, folded in by a report
_baseline: dict[tuple[str, str], int] = {}  # the sums of the tables at the last reset
_reasons: dict[str, set[str]] = {}  # module class -> why its recomputes could not be identified
_armed = [False]


class _Table(threading.local):
    """This thread's counts (a plain dict, the cheapest to add to), listed in ``_tables`` when first used (so
    never first used under ``_lock``)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        with _lock:
            _tables.append((threading.current_thread(), self.counts))


_mine = _Table()


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
        """How many things the patch replayed that the recompute would have lost: autocast states, casts, moves."""
        return self.autocast_changed + self.input_casts + self.output_casts + self.root_moves + self.param_gathers


@dataclass(frozen=True)
class Report(ModuleReport):
    """What the patch did in this process since :func:`fsdp_autocast_fix.apply` (or ``report(reset=True)``).

    Attributes:
        recomputes: recomputes of covered modules it saw (each replayed call of a checkpointed region).
        autocast_changed: recomputes whose autocast state it changed to the one their forward call ran under
            (the checkpoint had not restored it).
        input_casts: FSDP ``MixedPrecisionPolicy`` input casts it replayed that torch skipped in the recompute.
        output_casts: FSDP ``output_dtype`` casts it replayed likewise.
        root_moves: FSDP root input moves to the device it replayed (no torch release replays them).
        param_gathers: recomputes in which it gathered parameters resharded since the forward, which torch
            before 2.11 leaves sharded ("mixed torch.Tensor and DTensor", pytorch issues 153354 and 187437).
        cache_drops: times it dropped autocast's cached casts before a grad-enabled call because a recompute (or
            a ``no_grad`` call through ``preserve_autocast``) cached casts since (pytorch issue 158232): where that
            call's autocast region was still open, its casts would have cost the parameter gradients; where the
            region had ended (backward outside autocast), the cache was already empty and the drop changed nothing.
        cache_shields: ``no_grad`` calls under autocast whose casts it kept out of autocast's cache, followed by
            a grad-enabled call of the same module (pytorch issue 158232): where both ran in one autocast region,
            the second would otherwise have reused the first's casts and lost its parameter gradients.
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
        """One line: whether the patch changed anything in this run, and what that means for keeping it."""
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


def count(cls: str, what: str, n: int = 1) -> None:
    """Add ``n`` to ``what`` (a :class:`ModuleReport` field) for module class ``cls``."""
    counts = _mine.counts
    key = cls, what
    counts[key] = counts.get(key, 0) + n


def count_recompute(cls: str, autocast_changed: bool) -> None:
    """A replayed recompute of a ``cls`` module (``autocast_changed``: the replay entered the call's state)."""
    counts = _mine.counts
    key = cls, "recomputes"
    counts[key] = counts.get(key, 0) + 1
    if autocast_changed:
        key = cls, "autocast_changed"
        counts[key] = counts.get(key, 0) + 1


def unidentified(cls: str, reason: str) -> None:
    """A recompute of a ``cls`` module whose call was not identified, and why."""
    counts = _mine.counts  # outside the lock (see _Table)
    key = cls, "unidentified"
    with _lock:  # the count and its reason together, on one side of a reset
        counts[key] = counts.get(key, 0) + 1
        _reasons.setdefault(cls, set()).add(reason)


def snapshot(reset: bool = False) -> Report:
    """The counts as a :class:`Report`; ``reset`` starts them again at zero (a count another thread adds
    meanwhile falls on one side of the reset)."""
    global _baseline
    with _lock:
        live = []
        for thread, table in _tables:
            if thread.is_alive():
                live.append((thread, table))
            else:  # it adds no more: folded in, so that threads come and go without the list growing
                _ended.update(table)
        _tables[:] = live
        sums = Counter(_ended)
        for _, table in live:
            sums.update(table.copy())  # one step under the GIL, whatever its thread adds meanwhile
        per: dict[str, Counter[str]] = {}
        for key, n in sums.items():
            n -= _baseline.get(key, 0)
            if n:
                per.setdefault(key[0], Counter())[key[1]] += n
        reasons = {cls: tuple(sorted(r)) for cls, r in _reasons.items()}
        if reset:
            _baseline = dict(sums)
            _reasons.clear()
    by_module = {cls: ModuleReport(**c) for cls, c in per.items()}
    totals = {f.name: sum(getattr(m, f.name) for m in by_module.values()) for f in fields(ModuleReport)}
    return Report(**totals, unidentified_reasons=MappingProxyType(reasons), by_module=MappingProxyType(by_module))


def reset() -> None:
    """Start every count again at zero."""
    snapshot(reset=True)


def arm_exit_report() -> None:
    """Print the report at interpreter exit where :data:`ENV` asks for it (once per process)."""
    wanted = os.environ.get(ENV, "").strip().lower()
    if wanted not in ("1", "all") or _armed[0]:
        return
    _armed[0] = True
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
