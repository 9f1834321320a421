"""What identifies a forward call: every tensor it was given, held weakly.

A call's *leaves* are its tensor arguments in order (positional and keyword, nested in tuples, lists, dicts and
dataclasses), parameters aside, since a parameter is passed to every call; for a call given only parameters
(learned queries), those parameters. A recompute gets the very leaves back (``torch.utils.checkpoint``) or
``detach()``es of them (reentrant-style checkpoints), which share their memory, version, shape, stride, dtype and
device.

Invariant of :class:`CallLog`: a recompute finds a recorded call exactly when its leaves are, one by one, that
call's leaves or ``detach()``es of them. Several calls are found only when they got the very same leaves, or views
of the same memory alike in shape, stride, dtype and device (which a ``detach()`` cannot tell apart). Leaves that
are not plain tensors (DTensor, other subclasses) match only themselves. A record holds a few scalars and plain weak
references (no callback): once a leaf is freed, no lookup finds it; the next record under its key replaces it, or
a sweep drops it when the log has doubled, so the log holds at most twice the most records alive at once (at
least :data:`SWEEP_FLOOR`). Records and lookups cost the same however many calls are alive.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, NamedTuple

import torch

#: Tensors whose ``data_ptr`` says where their data is (a parameter's ``detach()`` is a plain tensor).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Call(NamedTuple):
    """What a recompute replays of one forward call: its autocast state (:func:`~._autocast.capture`; None: leave
    the state as the checkpoint set it), whether FSDP's root moved its inputs to the device, and which of FSDP's
    casts its forward did."""

    autocast: Any
    moved: bool
    cast_in: bool
    cast_out: bool


@functools.lru_cache(maxsize=1024)
def call(autocast: Any, moved: bool, cast_in: bool, cast_out: bool) -> Call:
    """The :class:`Call` of these values, one object per distinct call (records of alike calls share it)."""
    return Call(autocast, moved, cast_in, cast_out)


class Stamped(NamedTuple):
    """A call in a record, with its stamp: autograd's sequence number when it ran without grad, else -1."""

    call: Any
    stamp: int


class Record(NamedTuple):
    """The calls recorded under one set of leaves: weak references to the leaves, their versions then, and the
    calls (:class:`Stamped`, oldest first; see :meth:`CallLog.record`)."""

    refs: tuple[weakref.ref[torch.Tensor], ...]
    versions: tuple[int, ...]
    calls: tuple[Stamped, ...]


def leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The call's leaves (see the module docstring)."""
    found: list[torch.Tensor] = []
    parameters: list[torch.Tensor] = []
    _collect(args, found, parameters)
    if kwargs:
        _collect(kwargs, found, parameters)
    return found or parameters


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` (tuples, lists, dicts and dataclasses, as :func:`leaves` looks), parameters too."""
    found: list[torch.Tensor] = []
    _collect(tree, found, found)
    return found


def _collect(value: Any, found: list[torch.Tensor], parameters: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):  # (Parameter's isinstance is Python code: a plain tensor skips it)
        parameter = type(value) is not torch.Tensor and isinstance(value, torch.nn.Parameter)
        (parameters if parameter else found).append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found, parameters)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found, parameters)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name), found, parameters)


def _key(tensors: list[torch.Tensor]) -> Any:
    """The exact key: the leaves' identities."""
    return tuple(map(id, tensors))


def _memory(tensors: list[torch.Tensor]) -> Any:
    """The detach key: where each leaf's data starts (equal for a tensor and its ``detach()``). None if a leaf is
    a tensor subclass (DTensor's ``data_ptr`` tells nothing) or empty: then only the very tensors match."""
    for t in tensors:
        if type(t) not in _PLAIN or not t.numel():
            return None
    try:
        return tuple(t.data_ptr() for t in tensors)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is ``a`` or a ``detach()`` of it: plain tensors viewing one memory alike (data start, shape,
    stride, dtype, device); a view alike in all these (``a[:]``) passes too."""
    return a is b or (type(a) in _PLAIN and type(b) in _PLAIN and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
                      and a.device == b.device)


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter; -1 for an inference tensor, which has none (nor changes in place outside
    inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _alive(record: Record) -> bool:
    """Whether none of the record's leaves was freed."""
    return all(ref() is not None for ref in record.refs)


def _matches(record: Record, tensors: Any, exact: bool) -> bool:
    """Whether ``tensors`` are the record's leaves (``exact``) or they and ``detach()``es of them."""
    if len(tensors) != len(record.refs):
        return False
    for ref, version, t in zip(record.refs, record.versions, tensors):
        recorded = ref()
        if recorded is None or _version(t) != version:
            return False
        if recorded is not t and (exact or not _same_memory(recorded, t)):
            return False
    return True


#: The fewest records a log holds before it sweeps its dead ones; after a sweep, twice those alive.
SWEEP_FLOOR = 64
#: The most states one record keeps; beyond it the oldest go, marked :data:`LOST`.
MAX_CALLS = 16
#: The stamp of a record's oldest state once older ones were dropped: the stamps no longer tell the calls apart,
#: so a recompute replays the most recent, with a warning, as for calls that ran with grad.
LOST = -2


def _merged(calls: tuple[Stamped, ...], stamped: Stamped) -> tuple[Stamped, ...]:
    """A record's calls, oldest first, with ``stamped`` added, kept so that for every autograd node made before a
    stamped call (a reentrant-style checkpoint's own), the first stamp after the node names the state of the
    first call after it, as in the full history. A call in the latest entry's state replaces it (every node within
    a run of one state precedes its latest stamp too); a call with grad (stamp -1) keeps one entry per state; any
    other is appended, at most :data:`MAX_CALLS` kept."""
    if calls[-1].call == stamped.call:
        return calls[:-1] + (stamped,)
    if stamped.stamp == -1:
        calls = tuple(c for c in calls if c.call != stamped.call or c.stamp != -1)
    calls += (stamped,)
    if len(calls) > MAX_CALLS:
        calls = (Stamped(calls[-MAX_CALLS].call, LOST),) + calls[-MAX_CALLS + 1:]
    return calls


class DetachIndex:
    """Where a recompute given ``detach()``es of a call's leaves finds its record: detach key -> the keys of the
    records on that memory (``by_memory``), and key -> detach key for each record indexed (``indexed``).

    The records indexed are always the first ones of the log (a record made again under a key moves to the end,
    out of the index), so :meth:`catch_up` indexes from the end back to the first indexed already: each record is
    indexed once, and an ordinary call never indexes."""

    __slots__ = ("by_memory", "indexed")

    def __init__(self) -> None:
        self.by_memory: dict[Any, dict[Any, None]] = {}
        self.indexed: dict[Any, Any] = {}

    def catch_up(self, by_key: dict[Any, Record]) -> None:
        """Index the records made since the last detach lookup, oldest first (an interrupted pass leaves the
        indexed records a prefix). One dropped meanwhile by another thread is skipped; a dead one is indexed under
        no detach key."""
        indexed = self.indexed
        while True:
            fresh = []
            try:
                for key in reversed(by_key):  # newest back to the first indexed already
                    if key in indexed:
                        break
                    fresh.append(key)
                break
            except RuntimeError:  # another thread dropped a record meanwhile: walk again
                continue
        for key in reversed(fresh):
            record = by_key.get(key)
            if record is None:
                continue
            alive = [ref() for ref in record.refs]  # held while their memory is read
            memory = None if any(t is None for t in alive) else _memory(alive)
            if key not in by_key:  # dropped while its memory was read
                continue
            indexed[key] = memory
            if memory is not None:
                self.by_memory.setdefault(memory, {})[key] = None

    def drop(self, key: Any) -> None:
        """Forget the record under ``key`` here, if it was indexed."""
        memory = self.indexed.pop(key, None)
        if memory is not None:
            bucket = self.by_memory[memory]
            del bucket[key]
            if not bucket:
                del self.by_memory[memory]

    def clear(self) -> None:
        self.by_memory.clear()
        self.indexed.clear()


class CallLog:
    """The recorded forward calls of one sharded module (the module docstring's invariant).

    ``by_key``: the leaves' identities -> the record, in the order made; ``index`` finds records by their leaves'
    memory (:class:`DetachIndex`); ``sweep_at``: the size of ``by_key`` at which dead records are swept.
    ``unkeyed``: the latest call with no leaves, replayed by a recompute with none. ``last``: the latest call, for
    the warning on a recompute that finds none.
    """

    __slots__ = ("by_key", "index", "unkeyed", "last", "sweep_at")

    def __init__(self) -> None:
        self.by_key: dict[Any, Record] = {}
        self.index = DetachIndex()
        self.unkeyed: Any = None
        self.last: Any = None
        self.sweep_at = SWEEP_FLOOR

    def __len__(self) -> int:
        """The records alive (none of their leaves freed)."""
        return sum(1 for record in list(self.by_key.values()) if _alive(record))

    def record(self, tensors: Any, call: Any, stamp: int) -> None:
        """Record ``call`` under the leaves ``tensors``; the same leaves again add it to the record's calls
        (:func:`_merged`). The hot path: one per ordinary call. ``stamp``: autograd's sequence number for a call
        without grad (as a reentrant-style checkpoint's forward runs), else -1."""
        self.last = call
        if not tensors:
            self.unkeyed = call
            return
        key = _key(tensors)
        seen = self.by_key.get(key)
        if seen is not None:  # the same leaves again, or a dead record under a reused id, or one changed in place
            if _matches(seen, tensors, exact=True):
                if self.index.indexed.get(key) is not None:  # its data may have moved: FSDP re-allocates the
                    self._drop(key)  # unsharded parameters a call given only parameters gets
                self.by_key[key] = seen._replace(calls=_merged(seen.calls, Stamped(call, stamp)))
                return
            self._drop(key)  # the new record goes to the end, out of the detach index
        self.by_key[key] = Record(tuple([weakref.ref(t) for t in tensors]), tuple([_version(t) for t in tensors]),
                                  (Stamped(call, stamp),))
        if len(self.by_key) >= self.sweep_at:
            self.sweep()

    def find(self, tensors: Any) -> tuple[Stamped, ...] | None:
        """Each call recorded under the leaves (or ``detach()``es of them) ``tensors``, oldest first, or None."""
        if not tensors:
            return None
        seen = self.by_key.get(_key(tensors))
        if seen is not None and _matches(seen, tensors, exact=True):
            return seen.calls
        memory = _memory(tensors)
        if memory is None:
            return None
        self.index.catch_up(self.by_key)
        found: tuple[Stamped, ...] = ()
        for key in list(self.index.by_memory.get(memory, ())):  # oldest first
            record = self.by_key.get(key)
            if record is not None and _matches(record, tensors, exact=False):
                found += tuple(c for c in record.calls if c not in found)
        return found or None

    def sweep(self) -> None:
        """Drop the dead records and their index entries; the next sweep comes when the log has doubled."""
        by_key = self.by_key
        for key, record in list(by_key.items()):
            if _alive(record):
                continue
            if by_key.get(key) is record:  # not made again meanwhile on another thread
                try:  # (if that happens right here, its new record goes too: a replay lost, never a wrong one)
                    self._drop(key)
                except KeyError:  # gone already
                    pass
        self.sweep_at = max(SWEEP_FLOOR, 2 * len(self.by_key))

    def _drop(self, key: Any) -> None:
        """Forget the record under ``key``, and its place in the detach index."""
        del self.by_key[key]
        self.index.drop(key)

    def clear(self) -> None:
        """Forget every record."""
        self.by_key.clear()
        self.index.clear()
        self.unkeyed = self.last = None
        self.sweep_at = SWEEP_FLOOR
