"""The mechanism: capture each sharded module's forward-time state, replay it in the recompute.

Each covered module gets hooks of its own, next to FSDP's (which are not touched):

* a forward pre-hook, placed first. On an ordinary forward it reads the autocast state (per device
  type in use, and the cache flag) and keeps it; when nothing changed since the last call, that is
  all it does. On a recompute - FSDP state ``PRE_BACKWARD``, or any forward that runs inside
  backward, which is what reentrant-style checkpoints do - it enters the kept autocast state where
  the current one differs and, where this torch skips it, casts the inputs as FSDP's forward did
  (``param_dtype`` when ``cast_forward_inputs``) and moves them as FSDP's root did;
* a forward hook with ``always_call=True``, registered only while such a replay is in flight. It
  casts the output to ``output_dtype`` where this torch skips it and exits whatever the pre-hook
  entered, also when the forward raised, then takes itself off again.

Both are wrapped with ``torch._dynamo.disable``, as FSDP wraps its own, so torch.compile runs them
eagerly. Modules sharded later are covered by a wrapt wrapper around ``FSDPState.init``; modules
sharded earlier are found through torch's composable-state registry. The kept state holds no tensors.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
import threading
import weakref
from typing import Any

import torch
import wrapt

from . import _compat

logger = logging.getLogger("fsdp_autocast_fix")

_GLOBAL = "apply"
_LOCAL = "patched_fully_shard"

# Hot-path callables, bound once.
_any_autocast_enabled = torch._C._is_any_autocast_enabled
_graph_task_id = torch._C._current_graph_task_id
_is_autocast_enabled = torch.is_autocast_enabled
_get_autocast_dtype = torch.get_autocast_dtype
_is_autocast_cache_enabled = torch.is_autocast_cache_enabled

#: Captured when no autocast is enabled anywhere: the replay disables autocast.
_ALL_OFF = "all-off"
#: Device types whose forward root FSDP moves inputs to (``FSDPState._root_pre_forward``).
_MOVING_DEVICE_TYPES = frozenset({"cuda", "hpu", "xpu", "mtia", torch._C._get_privateuse1_backend_name()})

_lock = threading.RLock()
#: (id(state), id(module)) -> _Cover. A cover keeps its state (and so the module) alive,
#: and the module's hook dicts keep the cover alive, so the ids cannot be reused meanwhile.
_covers: weakref.WeakValueDictionary[tuple[int, int], _Cover] = weakref.WeakValueDictionary()
_applied = False
_force = False
_init_wrapper: Any = None


def _eager(hook: Any) -> Any:
    """``hook`` as FSDP registers its own: torch.compile runs it eagerly, outside any graph, never traces it."""
    return torch._dynamo.disable(hook, recursive=True)


def _capture(device_types: tuple[str, ...]) -> Any:
    """The autocast state now, as plain scalars: ``((enabled, dtype) per device type, cache)``."""
    if not _any_autocast_enabled():
        return _ALL_OFF
    return _capture_enabled(device_types)


def _capture_enabled(device_types: tuple[str, ...]) -> Any:
    per_device = tuple([(_is_autocast_enabled(d), _get_autocast_dtype(d)) for d in device_types])
    return per_device, _is_autocast_cache_enabled()


def _enter(captured: Any, device_types: tuple[str, ...]) -> contextlib.ExitStack:
    """Enter the autocast state ``captured`` for every device type; exit it by closing the stack."""
    if captured is _ALL_OFF:
        captured = tuple((False, _get_autocast_dtype(d)) for d in device_types), _is_autocast_cache_enabled()
    per_device, cache_enabled = captured
    stack = contextlib.ExitStack()
    try:
        for device_type, (enabled, dtype) in zip(device_types, per_device):
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
            )
    except BaseException:
        stack.close()
        raise
    return stack


class _Cover:
    """The capture/replay hooks of one module managed by one FSDP state.

    The pre-hook is always registered. The post-hook is registered only while a replay is in flight
    (when this torch's ``nn.Module.__call__`` allows removing it from inside, see
    :attr:`_compat.Internals.forward_hooks_snapshot`); otherwise it stays registered.
    """

    __slots__ = ("state", "pre_backward", "device_types", "may_move", "moved", "cast_in", "cast_out",
                 "captured", "others", "recomputed", "warned", "replays", "pre_handle", "post_handle", "owner",
                 "__weakref__")

    def __init__(self, state: Any, module: torch.nn.Module, owner: str) -> None:
        self.state = state
        self.pre_backward = _internals().pre_backward
        device_type = state._device.type
        self.device_types = ("cpu",) if device_type == "cpu" else ("cpu", device_type)
        self.may_move = device_type in _MOVING_DEVICE_TYPES
        self.moved = False  # whether FSDP moved this module's inputs to its device in the last forward
        # Whether FSDP's forward cast this module's inputs / output. Always, for a module sharded alone; for
        # fully_shard([a, b, ...]) only the first module's inputs and the last one's output (pre_forward_grouped).
        self.cast_in = self.cast_out = True
        self.captured: Any = None  # autocast state of the last ordinary forward; None before the first
        self.others: tuple[Any, ...] = ()  # other autocast states seen since the last recompute
        self.recomputed = False
        self.warned = False
        self.replays: list[tuple[contextlib.ExitStack | None, torch.dtype | None]] = []
        self.owner = owner
        grouped = len(_compat.modules_of(state)) > 1
        hook = self.pre_forward_grouped if grouped else self.pre_forward
        self.pre_handle = module.register_forward_pre_hook(_eager(hook), prepend=True, with_kwargs=True)
        self.post_handle: Any = None
        if not _internals().forward_hooks_snapshot:
            self._register_post(module)

    def pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        state = self.state
        if state._training_state is self.pre_backward:  # FSDP's recompute
            return self._replay(module, args, kwargs, True, None)
        now = _capture_enabled(self.device_types) if _any_autocast_enabled() else _ALL_OFF
        if self.may_move:  # FSDP's forward root moves the inputs to its device
            self.moved = state._state_ctx.iter_forward_root is None
        if now == self.captured and not self.recomputed:  # the hot path: nothing changed, nothing to do
            return None
        if _graph_task_id() != -1:  # a forward inside backward: a reentrant-style recompute
            return self._replay(module, args, kwargs, False, now)
        self._note(now)
        return None

    def pre_forward_grouped(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """For a module of ``fully_shard([a, b, ...])``: also note what FSDP casts for it in this forward.

        Before FSDP's group pre-hook runs, ``_modules_to_run_forward`` is empty for the module that starts
        the group's pass (FSDP runs ``_pre_forward``, with the input cast, for it alone) and holds just this
        module for the one that ends it (``_post_forward``, with the output cast, runs for it alone).
        """
        state = self.state
        if state._training_state is not self.pre_backward and _graph_task_id() == -1:
            to_run = state._modules_to_run_forward
            self.cast_in = not to_run
            self.cast_out = len(to_run) == 1 and module in to_run
        return self.pre_forward(module, args, kwargs)

    def _note(self, now: Any) -> None:
        """An ordinary forward whose autocast state differs from the last one, or the first after a recompute."""
        if self.recomputed:
            self.others, self.recomputed = (), False
        elif self.captured is not None and self.captured not in self.others:
            self.others += (self.captured,)
        self.captured = now

    def _replay(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], fsdp_recompute: bool,
                now: Any) -> Any:
        self.recomputed = True
        state = self.state
        if now is None:
            now = _capture(self.device_types)
        stack = None
        if self.captured is not None and now != self.captured and now not in self.others:
            if self.others and not self.warned:
                self.warned = True
                logger.warning("%s ran forward under %d different autocast states before this recompute; "
                               "replaying the most recent one", type(module).__name__, len(self.others) + 1)
            stack = _enter(self.captured, self.device_types)
        policy = state._mp_policy
        cast = fsdp_recompute and (_internals().needs_cast_replay or _force)
        output_dtype = policy.output_dtype if cast and self.cast_out else None
        if stack is not None or output_dtype is not None:
            self.replays.append((stack, output_dtype))
            if self.post_handle is None:
                self._register_post(module)
        if fsdp_recompute and self.moved:  # not replayed by any torch release yet
            args_tuple, kwargs_tuple = _internals().to_kwargs(args, kwargs, state._device, False)
            args, kwargs = args_tuple[0], kwargs_tuple[0]
        if cast and self.cast_in and policy.cast_forward_inputs and policy.param_dtype is not None:
            return _cast(policy.param_dtype, args), _cast(policy.param_dtype, kwargs)
        return args, kwargs

    def _register_post(self, module: torch.nn.Module) -> None:
        self.post_handle = module.register_forward_hook(_eager(self.post_forward), always_call=True)

    def post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not self.replays:  # a stale registration after an exception: drop it now
            self._unregister_post()
            return None
        stack, output_dtype = self.replays.pop()
        try:
            if output_dtype is not None:
                output = _cast(output_dtype, output)
        finally:
            if stack is not None:
                stack.close()
            if not self.replays:
                self._unregister_post()
        return output

    def _unregister_post(self) -> None:
        # nn.Module.__call__ runs forward hooks from a snapshot on its normal path, so the hook may remove
        # itself there. On its exception path (an error, or checkpoint's early stop) it iterates the dict
        # itself: then the removal waits for the end of the backward pass this recompute belongs to, or,
        # outside backward, for the module's next call.
        if self.post_handle is None or not _internals().forward_hooks_snapshot:
            return
        if sys.exc_info()[1] is None:
            self._drop_post()
        elif _graph_task_id() != -1:
            _internals().queue_backward_callback(self._drop_post)

    def _drop_post(self) -> None:
        if self.post_handle is not None and not self.replays:
            self.post_handle.remove()
            self.post_handle = None

    def remove(self) -> None:
        """Take both hooks off the module and drop any replay state."""
        self.pre_handle.remove()
        if self.post_handle is not None:
            self.post_handle.remove()
            self.post_handle = None
        self.replays.clear()


def _cast(dtype: torch.dtype, tree: Any) -> Any:
    internals = _internals()
    return internals.apply_to_tensors(functools.partial(internals.cast_fp_tensor, dtype), tree)


def _internals() -> _compat.Internals:
    return _compat.load()


def _cover_state(state: Any, owner: str) -> int:
    """Cover every module of ``state`` not covered yet; return how many were added."""
    added = 0
    for module in _compat.modules_of(state):
        key = (id(state), id(module))
        cover = _covers.get(key)
        if cover is not None:
            if owner == _LOCAL:
                cover.owner = _LOCAL  # patched_fully_shard's cover outlives remove()
            continue
        _covers[key] = _Cover(state, module, owner)
        added += 1
    return added


def _check_state(state: Any) -> None:
    for name in ("_training_state", "_mp_policy", "_device"):
        if not hasattr(state, name):
            raise _compat.UnsupportedTorchError(f"FSDPState.{name}", "missing on a sharded module's state")
    if state._device.type in _MOVING_DEVICE_TYPES and not hasattr(getattr(state, "_state_ctx", None),
                                                                  "iter_forward_root"):
        raise _compat.UnsupportedTorchError("FSDPState._state_ctx.iter_forward_root", "missing")
    if len(_compat.modules_of(state)) > 1 and not hasattr(state, "_modules_to_run_forward"):
        raise _compat.UnsupportedTorchError("FSDPState._modules_to_run_forward", "missing on a grouped state")


def _init_wrapper_fn(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    with _lock:
        if _applied:
            _cover_state(instance, _GLOBAL)
    return result


def apply(*, force: bool = False) -> bool:
    """Patch process-wide: every module sharded with ``fully_shard``, before or after this call.

    Idempotent. Returns True if it changed anything (first call, or a new ``force``).
    On a torch whose recompute already casts (2.13+), the cast replay is left to torch
    unless ``force=True`` (then every covered module replays the casts while the patch is in
    force, ``patched_fully_shard``'s too); the autocast replay is active on every torch.

    Raises:
        UnsupportedTorchError: an internal the patch relies on is missing or changed;
            nothing is patched.
    """
    global _applied, _force, _init_wrapper
    internals = _internals()
    with _lock:
        if _applied and force == _force:
            return False
        if _applied:
            _force = force
            logger.info("fsdp_autocast_fix: force=%s", force)
            return True
        states = internals.all_states()
        for state in states:
            _check_state(state)  # all checks before any change
        _force = force
        if _init_wrapper is None:
            _init_wrapper = wrapt.wrap_function_wrapper(internals.fsdp_state_cls, "init", _init_wrapper_fn)
        _applied = True
        retrofitted = sum(_cover_state(state, _GLOBAL) for state in states)
    if internals.needs_cast_replay or force:
        logger.info("fsdp_autocast_fix applied (torch %s): cast and autocast replay; %d already-sharded "
                    "modules retrofitted", _compat.torch_version(), retrofitted)
    else:
        logger.info("fsdp_autocast_fix applied (torch %s): this torch already casts in the recompute, so "
                    "the cast replay is left to torch (force=True to replay it anyway); autocast replay "
                    "active; %d already-sharded modules retrofitted", _compat.torch_version(), retrofitted)
    return True


def remove() -> None:
    """Undo everything :func:`apply` did, modules it retrofitted included.

    Modules sharded with :func:`patched_fully_shard` stay covered. A no-op when
    nothing is applied.
    """
    global _applied, _force, _init_wrapper
    with _lock:
        if not _applied:
            return
        _applied = False
        _force = False
        state_cls = _internals().fsdp_state_cls
        wrapper: Any = _init_wrapper
        if wrapper is not None and state_cls.__dict__.get("init") is wrapper:
            setattr(state_cls, "init", getattr(wrapper, "__wrapped__"))
            _init_wrapper = None
        else:  # someone wrapped on top of us: stay in place, inert while not applied
            logger.warning("FSDPState.init was wrapped again after apply(); leaving our inert wrapper in place")
        for key, cover in list(_covers.items()):
            if cover.owner == _GLOBAL:
                cover.remove()
                del _covers[key]
    logger.info("fsdp_autocast_fix removed")


def is_applied() -> bool:
    """Whether :func:`apply` is in force."""
    return _applied


def forced() -> bool:
    """Whether :func:`apply` was called with ``force=True``."""
    return _force


def covered_modules() -> int:
    """How many sharded modules have the capture/replay hooks now."""
    return len(_covers)


def patched_fully_shard(*args: Any, **kwargs: Any) -> Any:
    """``fully_shard`` that also covers the modules it shards; no global patch.

    Same signature, return value and errors as the installed ``fully_shard``.

    Raises:
        UnsupportedTorchError: before sharding, if an internal the patch relies on
            is missing or changed.
    """
    internals = _internals()
    result = internals.fully_shard(*args, **kwargs)
    target = args[0] if args else kwargs.get("module")
    modules = list(target) if isinstance(target, (list, tuple)) else [target]
    with _lock:
        for module in modules:
            state = internals.state_of(module)
            if state is not None:
                _check_state(state)
                _cover_state(state, _LOCAL)
    return result


def _adopt_fully_shard_signature() -> None:
    try:
        patched_fully_shard.__signature__ = inspect.signature(_compat.fsdp_package().fully_shard)  # type: ignore[attr-defined]
    except (_compat.UnsupportedTorchError, TypeError, ValueError):  # pragma: no cover - unsupported torch
        pass


_adopt_fully_shard_signature()
