"""The one wrapt wrapper on ``FSDPState.init``, shared by :func:`~fsdp_autocast_fix.apply` and the auto-apply.

After FSDP's own ``init`` (inside ``fully_shard``), the wrapper hands the new state to each holder: the auto-apply
settles a pending apply, :func:`~fsdp_autocast_fix.apply` covers the state, before ``fully_shard`` returns.

Invariant: at most one wrapper of ours is on the class, active while anyone holds it and inert (wrapt's
``enabled=``) while no one does. When the last holder lets go it is taken off, unless someone wrapped ``init`` on
top of it since: then it stays, inert, for the next holder (one someone else took off is made anew). This module
imports nothing of torch: the auto-apply holds it from inside torch's own import.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable

import wrapt

logger = logging.getLogger("fsdp_autocast_fix")

_lock = threading.Lock()
#: Who holds the wrapper, and what each does with a state after FSDP's init (in the order they took hold).
_holders: dict[str, Callable[[Any], None]] = {}
_wrapper: Any = None  # our FunctionWrapper while it is on the class (maybe under someone else's)
_state_cls: type | None = None


def _held() -> bool:
    return bool(_holders)


def in_chain(found: Any, wrapper: Any) -> bool:
    """Whether ``wrapper`` is ``found`` or among what it wraps (someone may have put back what they found)."""
    return found is not None and inspect.unwrap(found, stop=lambda f: f is wrapper) is wrapper


def _in_chain() -> bool:
    return _state_cls is not None and in_chain(vars(_state_cls).get("init"), _wrapper)


def _after_init(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    for on_init in list(_holders.values()):  # a holder may let go, or another take hold, meanwhile
        on_init(instance)
    return result


def hold(state_cls: type, holder: str, on_init: Callable[[Any], None]) -> None:
    """Have ``on_init(state)`` called after each ``FSDPState.init`` until :func:`release` (idempotent per holder)."""
    global _wrapper, _state_cls
    with _lock:
        _holders[holder] = on_init
        if _wrapper is None or not _in_chain():
            _wrapper = wrapt.FunctionWrapper(vars(state_cls)["init"], _after_init, enabled=_held)
            _state_cls = state_cls
            setattr(state_cls, "init", _wrapper)


def release(holder: str) -> None:
    """Let go of the wrapper; the last holder takes it off the class (where nothing wrapped it since)."""
    global _wrapper, _state_cls
    with _lock:
        if _holders.pop(holder, None) is None or _holders or _wrapper is None:
            return
        if vars(_state_cls).get("init") is _wrapper:
            setattr(_state_cls, "init", _wrapper.__wrapped__)
            _wrapper = _state_cls = None
        elif not _in_chain():  # someone took it off already
            _wrapper = _state_cls = None
        else:  # someone wrapped on top of us: stay in place, inert until held again
            logger.warning("FSDPState.init was wrapped again after fsdp_autocast_fix wrapped it; leaving its "
                           "inert wrapper in place")
