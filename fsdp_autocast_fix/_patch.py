"""Switching the patch on and off: which FSDP states it covers (:mod:`._cover`), and the public calls that do it.

Invariant: while :func:`apply` is in force, every FSDP state is covered: states made later through the wrapt
wrapper on ``FSDPState.init`` (:mod:`._init_hook`), earlier ones through torch's composable-state registry. While
any module is covered, ``FSDPModule.register_forward_pre_hook`` is wrapped (:func:`_pre_hook`). After
:func:`remove` only the modules of :func:`patched_fully_shard` stay covered, and torch is otherwise as it was.
Each call checks everything before it changes anything.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from typing import Any

import torch
import wrapt

from . import _autoapply, _cache, _compat, _init_hook, _report
from ._cover import Cover
from ._hooks import nn_register_forward_pre_hook

logger = logging.getLogger("fsdp_autocast_fix")

_GLOBAL = "apply"
_LOCAL = "patched_fully_shard"

_lock = threading.RLock()
#: id(state) -> Cover. The cover and the model keep each other alive (the modules' hook dicts hold the patch's
#: hooks), so an entry goes only when the model is freed, and its id cannot be reused before.
_covers: weakref.WeakValueDictionary[int, Cover] = weakref.WeakValueDictionary()


class _Switch:
    """The patch's global state: whether :func:`apply` is in force and with which ``force``, and the wrapt wrapper
    on ``FSDPModule.register_forward_pre_hook`` (set while any module is covered)."""

    applied = False
    force = False
    pre_hook_wrapper: Any = None


_switch = _Switch()


def _pre_hook(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # A pre-hook registered ahead of FSDP's (prepend=True, maybe by the module's own override) needs the patch's
    # lead pre-hook placed ahead of it before the next call.
    handle = wrapped(*args, **kwargs)
    cover = _covers.get(id(_internals().state_of(instance)))
    for module_cover in cover.modules if cover is not None else ():
        if module_cover.placement.slots.entry.hooks is instance._forward_pre_hooks:
            module_cover.placement.place_lead(instance)
    return handle


def _wrap_pre_hook_registration(on: bool) -> None:
    """Wrap ``FSDPModule.register_forward_pre_hook`` (``on``), or unwrap it. If someone wrapped it on top of ours
    since, ours stays, inert without covered modules. Raises before any change if the class already defines it."""
    cls = _internals().fsdp_module_cls
    current = cls.__dict__.get("register_forward_pre_hook")
    if not _init_hook.in_chain(current, _switch.pre_hook_wrapper):  # never made, or someone took it off
        _switch.pre_hook_wrapper = None
    if on and _switch.pre_hook_wrapper is None:
        if current is not None:
            raise _compat.UnsupportedTorchError("FSDPModule.register_forward_pre_hook",
                                                "already defined on the class (by torch or another library)")
        # FSDPModule is a mixin: the wrapped method is the one next in each module's MRO (nn.Module's, or its own)
        _switch.pre_hook_wrapper = wrapt.FunctionWrapper(nn_register_forward_pre_hook, _pre_hook,
                                                         enabled=lambda: bool(_covers))
        setattr(cls, "register_forward_pre_hook", _switch.pre_hook_wrapper)
    elif not on and current is not None and current is _switch.pre_hook_wrapper:
        del cls.register_forward_pre_hook  # type: ignore[attr-defined]
        _switch.pre_hook_wrapper = None


def _internals() -> _compat.Internals:
    return _compat.load()


def _slots_of(state: Any) -> list[tuple[torch.nn.Module, _compat.HookSlots]]:
    """Check ``state`` and return FSDP's hook slots for each of its modules; raises before anything is changed."""
    for name in ("_training_state", "_mp_policy", "_device", "_state_ctx"):
        if not hasattr(state, name):
            raise _compat.UnsupportedTorchError(f"FSDPState.{name}", "missing on a sharded module's state")
    if not hasattr(state._state_ctx, "iter_forward_root"):
        raise _compat.UnsupportedTorchError("FSDPState._state_ctx.iter_forward_root", "missing")
    if len(_compat.modules_of(state)) > 1 and not hasattr(state, "_modules_to_run_forward"):
        raise _compat.UnsupportedTorchError("FSDPState._modules_to_run_forward", "missing on a grouped state")
    return [(module, _compat.hook_slots(state, module)) for module in _compat.modules_of(state)]


def _cover_state(state: Any, owner: str) -> int:
    """Cover ``state``'s modules unless already covered; return how many modules were added."""
    cover = _covers.get(id(state))
    if cover is not None:
        if owner == _LOCAL:
            cover.owner = _LOCAL  # patched_fully_shard's cover outlives remove()
        return 0
    slots = _slots_of(state)
    _wrap_pre_hook_registration(True)
    cover = Cover(state, slots, owner, forced)
    _covers[id(state)] = cover
    return len(cover.modules)


def _cover_new_state(state: Any) -> None:
    """Cover ``state`` right after FSDP's init in ``fully_shard``, if :func:`apply` is in force."""
    with _lock:
        if _switch.applied:
            try:
                _cover_state(state, _GLOBAL)
            except _compat.UnsupportedTorchError as e:  # FSDP's init has run: let fully_shard finish, stock
                logger.warning("fsdp_autocast_fix cannot cover %s, which runs without the patch: %s",
                               ", ".join(type(m).__name__ for m in _compat.modules_of(state)), e)


def apply(*, force: bool = False) -> bool:
    """Patch process-wide: every module sharded with ``fully_shard``, before or after this call.

    Idempotent; returns True if it changed anything (the first call, or a new ``force``). A pending auto-apply
    (``FSDP_AUTOCAST_FIX=1``) is dropped: this call's ``force`` holds.

    The autocast replay and the autocast cache fix work on every torch. On a torch whose recompute already casts
    (2.13+), FSDP's casts are left to torch unless ``force=True``: then every covered module replays them while the
    patch is in force, :func:`patched_fully_shard`'s too.

    Raises:
        UnsupportedTorchError: an internal the patch relies on is missing or changed; nothing is patched.
    """
    internals = _internals()
    _autoapply.cancel()  # the user's own call settles a pending auto-apply
    with _lock:
        if _switch.applied and force == _switch.force:
            return False
        if _switch.applied:
            _switch.force = force
            logger.info("fsdp_autocast_fix: force=%s", force)
            return True
        states = [s for s in internals.all_states() if id(s) not in _covers]
        found = [(state, _slots_of(state)) for state in states]  # all checks before any change
        _wrap_pre_hook_registration(True)  # the last check (it raises before it changes anything)
        _switch.force = force
        _report.reset()  # the report counts from here
        _init_hook.hold(internals.fsdp_state_cls, _GLOBAL, _cover_new_state)
        _switch.applied = True
        retrofitted = 0
        for state, slots in found:
            _covers[id(state)] = cover = Cover(state, slots, _GLOBAL, forced)
            retrofitted += len(cover.modules)
    if internals.needs_cast_replay or force:
        logger.info("fsdp_autocast_fix applied (torch %s): cast and autocast replay; %d already-sharded "
                    "modules retrofitted", _compat.torch_version(), retrofitted)
    else:
        logger.info("fsdp_autocast_fix applied (torch %s): this torch already casts in the recompute, so "
                    "the cast replay is left to torch (force=True to replay it anyway); autocast replay "
                    "active; %d already-sharded modules retrofitted", _compat.torch_version(), retrofitted)
    return True


def remove() -> None:
    """Undo everything :func:`apply` did, including the modules it retrofitted.

    Modules sharded with :func:`patched_fully_shard` stay covered. When nothing is applied, it only drops a pending
    auto-apply.
    """
    _autoapply.cancel()  # the user's own call settles a pending auto-apply
    with _lock:
        if not _switch.applied:
            return
        _switch.applied = False
        _switch.force = False
        _init_hook.release(_GLOBAL)
        for key, cover in list(_covers.items()):
            if cover.owner == _GLOBAL:
                cover.remove()
                del _covers[key]
        _cache.forget_freed()
        if not _covers:
            _wrap_pre_hook_registration(False)
    logger.info("fsdp_autocast_fix removed")


def is_applied() -> bool:
    """Whether :func:`apply` is in force."""
    return _switch.applied


def forced() -> bool:
    """Whether :func:`apply` was called with ``force=True``."""
    return _switch.force


def covered_modules() -> int:
    """How many sharded modules have the patch's hooks now."""
    return sum(len(cover.modules) for cover in list(_covers.values()))


def patched_fully_shard(*args: Any, **kwargs: Any) -> Any:
    """``fully_shard`` that also covers the modules it shards; no global patch.

    Same signature, return value and errors as the installed ``fully_shard``.

    Raises:
        UnsupportedTorchError: before sharding, if an internal the patch relies on is missing or changed; after
            sharding, if FSDP's hooks are not where ``fully_shard`` registers them (say someone replaced
            ``FSDPState._pre_forward``): the modules are then sharded but not covered, and the error says so.
    """
    internals = _internals()
    result = internals.fully_shard(*args, **kwargs)
    target = args[0] if args else kwargs.get("module")
    modules = list(target) if isinstance(target, (list, tuple)) else [target]
    with _lock:
        for module in modules:
            state = internals.state_of(module) if isinstance(module, torch.nn.Module) else None
            if state is not None:
                try:
                    _cover_state(state, _LOCAL)
                except _compat.UnsupportedTorchError as e:
                    e.add_note(f"{type(module).__name__} is sharded by fully_shard but not covered by the patch")
                    raise
    return result


def _adopt_fully_shard_signature() -> None:
    try:
        patched_fully_shard.__signature__ = inspect.signature(_compat.fsdp_package().fully_shard)  # type: ignore[attr-defined]
    except (_compat.UnsupportedTorchError, TypeError, ValueError):  # pragma: no cover - unsupported torch
        pass


_adopt_fully_shard_signature()
