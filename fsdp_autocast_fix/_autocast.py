"""The autocast state as plain scalars: read it, enter it, leave it.

Invariant: :func:`capture` returns a value that holds no tensor and compares equal exactly when the autocast state
(enabled and dtype per device type given, and the cache flag) is the same; :class:`Entered` enters it as
``torch.autocast`` does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import _compat

#: Captured when no autocast is enabled anywhere: entering it disables autocast.
ALL_OFF = "all-off"


def capture(device_types: tuple[str, ...]) -> Any:
    """The autocast state now: :data:`ALL_OFF`, or ``((enabled, dtype) per device type, cache)``."""
    if not _compat.load().any_autocast_enabled():
        return ALL_OFF
    return capture_enabled(device_types)


def capture_enabled(device_types: tuple[str, ...]) -> Any:
    """:func:`capture` where some autocast is known to be enabled."""
    per_device = tuple([(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in device_types])
    return per_device, torch.is_autocast_cache_enabled()


def _write(state: Any, device_types: tuple[str, ...], current: Any = None) -> None:
    """Set the autocast state ``state``; where ``current`` (the state read just before) is given, only what
    differs from it."""
    now = current[0] if current is not None else [(None, None)] * len(device_types)
    for device_type, (enabled, dtype), (enabled_now, dtype_now) in zip(device_types, state[0], now):
        if enabled != enabled_now:
            torch.set_autocast_enabled(device_type, enabled)
        if dtype != dtype_now:
            torch.set_autocast_dtype(device_type, dtype)
    if current is None or state[1] != current[1]:
        torch.set_autocast_cache_enabled(state[1])


class Entered:
    """An autocast state entered as ``torch.autocast`` enters it, that can pause between the calls it covers.

    Invariant: from construction to :meth:`release`, autocast's nesting count on this thread is one higher per
    device type, so the casts cached under it survive a :meth:`pause` and are found again after :meth:`resume`.
    :meth:`release` puts the state from before back (``restore``) or leaves it (after an interrupt, autograd
    restored it); where the count returns to zero it drops the cached casts and restores the cache flag, as leaving
    ``torch.autocast`` does.
    """

    __slots__ = ("state", "before", "device_types", "thread", "active")

    def __init__(self, captured: Any, device_types: tuple[str, ...]) -> None:
        if captured is ALL_OFF:
            off = tuple((False, torch.get_autocast_dtype(d)) for d in device_types)
            captured = off, torch.is_autocast_cache_enabled()
        self.state, self.device_types = captured, device_types
        self.thread = threading.get_ident()
        self.before = capture_enabled(device_types)
        for _ in device_types:
            torch.autocast_increment_nesting()
        _write(captured, device_types, self.before)
        self.active = True

    def pause(self) -> None:
        """Put the state from before back, keeping the count (and the cached casts)."""
        if self.active:
            _write(self.before, self.device_types)
            self.active = False

    def resume(self) -> None:
        """Enter the state again over what is current now."""
        if not self.active:
            self.before = capture_enabled(self.device_types)
            _write(self.state, self.device_types, self.before)
            self.active = True

    def release(self, restore: bool = False) -> None:
        """Leave the state for good."""
        if restore and self.active:
            _write(self.before, self.device_types)
        self.active = False
        nesting = -1
        for _ in self.device_types:
            nesting = torch.autocast_decrement_nesting()
        if nesting == 0:
            torch.clear_autocast_cache()
            torch.set_autocast_cache_enabled(self.before[1])


def nesting() -> int:
    """Autocast's nesting count on this thread now (torch has no getter: up and down again)."""
    count = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return count


@contextlib.contextmanager
def entered(captured: Any, device_types: tuple[str, ...]) -> Iterator[None]:
    """Run the block under the autocast state ``captured`` (every device type given), then leave it."""
    state = Entered(captured, device_types)
    try:
        yield
    finally:
        state.release(restore=True)
