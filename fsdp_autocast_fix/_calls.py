"""What identifies a forward call: every tensor it was given, held weakly.

A call's *leaves* are its tensor arguments in order: positional and keyword, nested in tuples, lists, dicts and
dataclasses, parameters aside (one parameter is passed to every call, so it tells no call from another), or,
for a call given only parameters (learned queries), those parameters. A
recompute gets the very leaves back (``torch.utils.checkpoint``) or ``detach()``es of them (reentrant-style
checkpoints), which share their memory, version, shape, stride, dtype and device.

Invariant of :class:`CallLog`: a recompute finds a recorded call exactly when its leaves are, one by one, that
call's leaves or ``detach()``es of them, in the same order; several calls are found only when they got the very
same leaves, or views of the same memory alike in shape, stride, dtype and device (which a ``detach()`` of
either cannot tell apart). Leaves that are not plain tensors (DTensor, other subclasses) match only themselves.
A record is a few scalars and plain weak references (no callback): once any of its leaves is freed it is dead,
found by no lookup, and replaced by the next record under its key or swept when the log has doubled since its last
sweep, so the log holds at most twice the most records alive at once (and :data:`SWEEP_FLOOR`). It costs the same
whether one call or a thousand are alive (both lookups are one dict access, plus the checks of the records that
share the key; a sweep visits each record once per doubling).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
#: Tensors whose ``data_ptr`` says where their data is (a parameter's ``detach()`` is a plain tensor).
_PLAIN = (_Tensor, _Parameter)


_ref = weakref.ref


def leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors a call was given, in order, parameters aside; for a call given only parameters (learned
    queries), those parameters (see the module docstring)."""
    if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:  # the common case, spelled out
        return [args[0]]
    found: list[torch.Tensor] = []
    parameters: list[torch.Tensor] = []
    _collect(args, found, parameters)
    _collect(kwargs, found, parameters)
    return found or parameters


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` (tuples, lists, dicts and dataclasses, as :func:`leaves` looks), parameters too."""
    found: list[torch.Tensor] = []
    _collect(tree, found, found)
    return found


def _collect(value: Any, found: list[torch.Tensor], parameters: list[torch.Tensor]) -> None:
    if isinstance(value, _Tensor):
        (parameters if isinstance(value, _Parameter) else found).append(value)
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
    return id(tensors[0]) if len(tensors) == 1 else tuple(map(id, tensors))


def _memory(tensors: list[torch.Tensor]) -> Any:
    """The detach key: where each leaf's data starts (equal for a tensor and its ``detach()``), or None if a leaf
    is not a plain tensor with data of its own (a tensor subclass such as DTensor, whose ``data_ptr`` tells
    nothing; an empty tensor): such a call only the very tensors match."""
    for t in tensors:
        if type(t) not in _PLAIN or not t.numel():
            return None
    try:
        if len(tensors) == 1:
            return tensors[0].data_ptr()
        return tuple(t.data_ptr() for t in tensors)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is ``a`` or a ``detach()`` of it: plain tensors viewing one memory alike (data start, shape,
    stride, dtype, device). A view of ``a`` alike in all these (``a[:]``) cannot be told from a ``detach()``."""
    return a is b or (type(a) in _PLAIN and type(b) in _PLAIN and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
                      and a.device == b.device)


# A record is a plain tuple (the hot path makes one per call): the call's leaves as weak references, their
# versions then, and the states it was called in, ``(state, stamp)`` each, latest last (see CallLog.record).
_REFS, _VERSIONS, _CALLS = 0, 1, 2
#: Not in the detach index yet (``CallLog.indexed``).
_UNINDEXED: Any = object()


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter; -1 for an inference tensor, which has none (and cannot be changed in place
    outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _alive(record: tuple[Any, ...]) -> bool:
    """Whether none of the record's leaves was freed."""
    return all(ref() is not None for ref in record[_REFS])


def _matches(record: tuple[Any, ...], tensors: Any, exact: bool) -> bool:
    """Whether ``tensors`` are the record's leaves (``exact``) or they and ``detach()``es of them."""
    refs = record[_REFS]
    if len(tensors) != len(refs):
        return False
    for ref, version, t in zip(refs, record[_VERSIONS], tensors):
        recorded = ref()
        if recorded is None or _version(t) != version:
            return False
        if recorded is not t and (exact or not _same_memory(recorded, t)):
            return False
    return True


#: The fewest records a log holds before it sweeps its dead ones (a leaf freed); then twice those alive after a sweep.
SWEEP_FLOOR = 64
#: The most states one record keeps; where more are merged in, the oldest go and the record's stamps no longer
#: tell its calls apart (:data:`LOST`).
MAX_CALLS = 16
#: The stamp of a record's oldest state once older ones were dropped: a recompute then replays the most recent
#: state, with a warning, as for calls that ran with grad.
LOST = -2


def _merged(calls: tuple[tuple[Any, int], ...], stamped: tuple[Any, int]) -> tuple[tuple[Any, int], ...]:
    """A record's states, oldest first, with the call ``stamped`` (``(state, stamp)``) added.

    Invariant: for every autograd node made before a stamped call (a reentrant-style checkpoint's own), the first
    stamp after it names the state of the first call after it, as in the full history: a call in the state of
    the latest entry replaces it (a run of one state keeps its latest stamp, which every node within the run
    precedes too); a call with grad (stamp -1; recomputes then replay the most recent state) keeps one entry per
    state; any other call is appended, at most :data:`MAX_CALLS` kept."""
    if calls[-1][0] == stamped[0]:
        return calls[:-1] + (stamped,)
    if stamped[1] == -1:
        calls = tuple(c for c in calls if c[0] != stamped[0] or c[1] != -1)
    calls += (stamped,)
    if len(calls) > MAX_CALLS:
        calls = ((calls[-MAX_CALLS][0], LOST),) + calls[-MAX_CALLS + 1:]
    return calls


class CallLog:
    """The recorded forward calls of one sharded module (see the module docstring for the invariant).

    ``by_key`` maps the leaves' identities to the record, in the order the records were made. The detach index
    (``by_memory``: detach key -> the keys of the records made on that memory; ``indexed``: key -> its detach key)
    is brought up to date at a lookup that needs it, from the end of ``by_key`` back to the first record indexed
    already: the records indexed are always the first ones of ``by_key`` (a record made again under a key is
    moved to the end, out of the index), so each record is indexed once and an ordinary call costs the same
    however many calls are alive. ``sweep_at``: the size of ``by_key`` at which the dead records are swept.

    ``unkeyed`` is the latest call with no leaves at all (only parameters, or no tensor): a recompute that finds
    no record replays it. ``last`` is the latest call's state, for the warning on a recompute that finds none.
    """

    __slots__ = ("by_key", "by_memory", "indexed", "unkeyed", "last", "sweep_at")

    def __init__(self) -> None:
        self.by_key: dict[Any, tuple[Any, ...]] = {}
        self.by_memory: dict[Any, dict[Any, None]] = {}
        self.indexed: dict[Any, Any] = {}
        self.unkeyed: Any = None
        self.last: Any = None
        self.sweep_at = SWEEP_FLOOR

    def __len__(self) -> int:
        """The records alive (none of their leaves freed)."""
        return sum(1 for record in list(self.by_key.values()) if _alive(record))

    # -- the hot path: one record per ordinary call -------------------------------------------------------

    def record(self, tensors: Any, call: Any, stamp: int) -> None:
        """Record ``call`` (its state) under the leaves ``tensors``; the same leaves again add their state to the
        record's (:func:`_merged`).

        ``stamp``: autograd's sequence number when a call runs without grad (reentrant-style checkpoints run
        their forward so), else -1; it tells a checkpoint's own call from an eval pass on the same leaves."""
        if len(tensors) == 1:
            self.record_one(tensors[0], call, stamp)
            return
        self.last = call
        by_key = self.by_key
        if tensors:
            key = tuple(map(id, tensors))
            seen = by_key.get(key)
            if seen is not None:
                if _matches(seen, tensors, exact=True):
                    self._again(key, seen, (call, stamp))
                    return
                self._drop(key)
            by_key[key] = (tuple(map(_ref, tensors)), tuple([_version(t) for t in tensors]), ((call, stamp),))
        else:
            self.unkeyed = call
            return
        if len(by_key) >= self.sweep_at:
            self.sweep()

    def record_one(self, x: torch.Tensor, call: Any, stamp: int) -> None:
        """:meth:`record` of a call whose one leaf is ``x``."""
        self.last = call
        by_key = self.by_key
        key = id(x)
        try:
            version = x._version
        except RuntimeError:  # an inference tensor
            version = -1
        seen = by_key.get(key)
        if seen is not None:  # the same leaf again; or a dead record under a reused id, or one changed in place
            if seen[_REFS][0]() is x and seen[_VERSIONS][0] == version:
                self._again(key, seen, (call, stamp))
                return
            if key in self.indexed:  # the old record goes (the new one to the end, out of the index)
                self._drop(key)
            else:
                del by_key[key]
        by_key[key] = ((_ref(x),), (version,), ((call, stamp),))
        if len(by_key) >= self.sweep_at:
            self.sweep()

    def _again(self, key: Any, seen: tuple[Any, ...], stamped: tuple[Any, int]) -> None:
        """The very leaves of a record called again: add ``stamped`` (see :func:`_merged`)."""
        calls = _merged(seen[_CALLS], stamped)
        memory = self.indexed.get(key)
        if memory is not None:  # index it again: its data may have moved (FSDP re-allocates the unsharded
            self._drop(key)  # parameters that a call given only parameters gets)
        self.by_key[key] = seen[:_CALLS] + (calls,)

    # -- recompute --------------------------------------------------------------------------------------

    def find(self, tensors: Any) -> tuple[tuple[Any, int], ...] | None:
        """``(state, stamp)`` of each call recorded under the leaves (or ``detach()``es of them) ``tensors``, oldest
        first, or None."""
        if not tensors:
            return None
        if len(tensors) == 1:  # the common case, spelled out: the very tensor recorded
            t = tensors[0]
            seen = self.by_key.get(id(t))
            if seen is not None and seen[_REFS][0]() is t:
                try:
                    version = t._version
                except RuntimeError:  # an inference tensor (_version)
                    version = -1
                if version == seen[_VERSIONS][0]:
                    return seen[_CALLS]  # type: ignore[no-any-return]
        else:
            seen = self.by_key.get(_key(tensors))
            if seen is not None and _matches(seen, tensors, exact=True):
                return seen[_CALLS]  # type: ignore[no-any-return]
        memory = _memory(tensors)
        if memory is None:
            return None
        self._index()
        found: tuple[Any, ...] = ()
        for key in list(self.by_memory.get(memory, ())):  # oldest first
            record = self.by_key.get(key)
            if record is not None and _matches(record, tensors, exact=False):
                found += tuple(c for c in record[_CALLS] if c not in found)
        return found or None

    def _index(self) -> None:
        """Put the records made since the last detach lookup into the detach index, oldest first, each marked
        indexed once it is in (see the class docstring: an interrupted pass leaves the indexed records a prefix).
        A record dropped meanwhile (by a record or sweep on another thread) is skipped; a dead one is indexed
        as a record no detach key names."""
        indexed, by_key = self.indexed, self.by_key
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
            alive = [ref() for ref in record[_REFS]]  # held while their memory is read
            memory = None if any(t is None for t in alive) else _memory(alive)
            if key not in by_key:  # dropped while its memory was read
                continue
            indexed[key] = memory
            if memory is not None:
                self.by_memory.setdefault(memory, {})[key] = None

    # -- lifetime ---------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Drop the dead records (a leaf freed), and their index entries; the next sweep comes when the log has
        doubled (at least :data:`SWEEP_FLOOR` records)."""
        by_key = self.by_key
        for key, record in list(by_key.items()):
            refs = record[_REFS]
            if refs[0]() is not None and (len(refs) == 1 or _alive(record)):
                continue
            if by_key.get(key) is record:  # not made again meanwhile on another thread
                try:  # (which can still happen right here: its new record then goes too, a replay lost, never
                    self._drop(key)  # a wrong one; or it is gone already)
                except KeyError:
                    pass
        self.sweep_at = max(SWEEP_FLOOR, 2 * len(self.by_key))

    def _drop(self, key: Any) -> None:
        """Forget the record under ``key``, and its place in the detach index."""
        del self.by_key[key]
        memory = self.indexed.pop(key, _UNINDEXED)
        if memory is not _UNINDEXED and memory is not None:
            bucket = self.by_memory[memory]
            del bucket[key]
            if not bucket:
                del self.by_memory[memory]

    def clear(self) -> None:
        """Forget every record."""
        self.by_key.clear()
        self.by_memory.clear()
        self.indexed.clear()
        self.unkeyed = self.last = None
        self.sweep_at = SWEEP_FLOOR
