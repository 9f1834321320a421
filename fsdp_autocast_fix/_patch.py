"""The patch: which sharded modules it covers, and the public calls that put it on and take it off.

Each covered module gets a :class:`_Module`, made of three parts, each with its own invariant:

* :class:`~._hooks.Placement` - where the patch sits in the module's hook chain (FSDP's slots, the lead pre-hook,
  the exit hook);
* :class:`~._calls.CallLog` - what identifies a forward call (all its tensor arguments, held weakly);
* :class:`~._replay.Replayer` - what a recompute replays (the call's autocast state, FSDP's casts) and undoes;

and :mod:`._cache` decides when autocast's cached casts are dropped. On every ordinary forward the module's entry
records the call (a few scalars) under its leaves, then calls FSDP's pre-hook; on a recompute it hands over to the
replayer. Modules sharded later are covered through a wrapt wrapper on ``FSDPState.init``, modules sharded earlier
through torch's composable-state registry.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import types
import weakref
from typing import Any, Callable

import torch
import wrapt

from . import _autocast, _cache, _calls, _compat, _replay, _report
from ._calls import Call
from ._hooks import Placement, eager, nn_register_forward_pre_hook
from ._replay import ALL_CAST, Replayer, restored

logger = logging.getLogger("fsdp_autocast_fix")

_GLOBAL = "apply"
_LOCAL = "patched_fully_shard"

_lock = threading.RLock()
#: id(state) -> _Cover. A cover keeps its state (and so the modules) alive, and the modules' hook dicts,
#: which hold the patch's hooks, keep the cover alive: an entry goes when the model is freed, and the id
#: cannot be reused meanwhile.
_covers: weakref.WeakValueDictionary[int, _Cover] = weakref.WeakValueDictionary()
_applied = False
_force = False
_init_wrapper: Any = None


class _Module:
    """The patch on one module of a covered state: record each ordinary call (:class:`~._calls.Call`: the autocast
    state captured before FSDP's hook and any user pre-hook after the lead, whether FSDP's root moved the inputs
    to the device, and which of FSDP's casts the forward does: for ``fully_shard([a, b])`` only the group's first
    inputs and last output, in torch 2.5-2.12), replay each recompute.
    """

    __slots__ = ("cover", "cover_key", "state", "internals", "grouped", "cached", "name", "log", "placement",
                 "replayer", "__weakref__")

    def __init__(self, cover: _Cover, module: torch.nn.Module, slots: _compat.HookSlots) -> None:
        self.cover, self.cover_key = cover, id(cover)  # the cast-cache hazards are kept per FSDP state
        self.state = cover.state
        self.internals = _compat.load()
        self.grouped = len(cover.modules_of_state) > 1
        self.cached = cover.caches_parameters  # whether its calls can leave a cast-cache hazard (see _cache)
        self.name = _compat.user_class_name(module)
        self.log = _calls.CallLog()
        self.placement = Placement(cover.state, slots)
        self.replayer = Replayer(cover, self.log, self.placement, self.grouped, self.name)
        self.placement.install(module, self.entry, self.replayer.post_forward, self.replayer.exit, self.begin)

    def entry(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """In the place of FSDP's pre-hook entry: record or replay (unless the lead did), then FSDP's pre-hook."""
        placement = self.placement
        if placement.lead is None:
            self.begin(module, args, kwargs)
        result = placement.fsdp_call(module, args, kwargs)
        if self.cached and not torch.is_grad_enabled():
            self.shield()
        if self.cover.gathers and self.state._training_state is self.cover.pre_backward:
            self.replayer.gather()  # this torch's recompute leaves resharded parameters so
        replays = self.replayer.replays
        if replays and replays[-1].pre_pending:
            return self.replayer.pre_casts(args, kwargs, result)
        return result

    def method_entry(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     caller: types.FrameType) -> Any:
        """In the place of FSDP's pre-forward for a method registered with ``register_fsdp_forward_method`` (it
        calls the state's ``_pre_forward`` itself, no hook runs): record or replay, then FSDP's pre-forward; a
        replay started here is undone by :meth:`method_exit` in the same method call (``caller``, its frame)."""
        self.begin(module, args, kwargs, caller)
        result = self.cover.fsdp_pre_forward(module, args, kwargs)
        if self.cached and not torch.is_grad_enabled():
            self.shield()
        if self.cover.gathers and self.state._training_state is self.cover.pre_backward:
            self.replayer.gather()
        replays = self.replayer.replays  # the replay this call started, if any, is the one it is the caller of
        if replays and replays[-1].caller is caller and replays[-1].pre_pending:
            return self.replayer.pre_casts(args, kwargs, result)
        return result

    def method_exit(self, module: torch.nn.Module, input: Any, output: Any, caller: types.FrameType) -> Any:
        """In the place of FSDP's post-forward for a registered method: FSDP's, then the output cast and the undo of
        the replay this method call started, if it did."""
        output = self.cover.fsdp_post_forward(module, input, output)
        replays = self.replayer.replays
        if replays and replays[-1].caller is caller:
            return self.replayer.method_exit(replays[-1], output)
        return output

    def shield(self) -> None:
        """A ``no_grad`` call, after FSDP's pre-forward gathered the parameters: under autocast with the cache on,
        keep their casts out of the cache (see :func:`._cache.shield`)."""
        if self.internals.any_autocast_enabled() and torch.is_autocast_cache_enabled():
            _cache.shield(self.cover_key, self.cover, _compat.unsharded_parameters(self.state),
                          self.cover.device_types)

    def begin(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              caller: types.FrameType | None = None) -> None:
        """Record an ordinary call or start the replay of a recompute: from the entry, as the lead pre-hook
        while user pre-hooks run before FSDP's, or from a registered method (``caller``: its frame)."""
        internals = self.internals
        if internals.graph_task_id() != -1:  # a recompute: only a backward runs one (FSDP stays in PRE_BACKWARD
            tensors = _calls.leaves(args, kwargs)  # after a backward that raised)
            self.replayer.start(module, tensors, caller)
            if not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
                # a checkpoint's forward inside this recompute (a per-layer checkpoint under a checkpoint of the
                # whole stack): recorded in the state it runs in now, the forward's, for its own recompute later
                self.log.record(tensors, self.replayer.nested_call(module), internals.sequence_nr())
            return
        if self.replayer.replays:  # left by an interrupted recompute (KeyboardInterrupt skips always_call hooks)
            self.replayer.drop_stale()
        if _replay.held:  # a recompute region's entered state outlived its backward
            _replay.release_region()
        grad = torch.is_grad_enabled()
        call = self._call(module, grad, method=caller is not None)
        if torch.is_inference_mode_enabled():  # an inference-mode call is never recomputed, even under enable_grad
            return  # (recorded, its state would be merged into the record of the training call on its input)
        self.log.record(_calls.leaves(args, kwargs), call, -1 if grad else internals.sequence_nr())

    def _call(self, module: torch.nn.Module, grad: bool, method: bool) -> Call:
        """The record of this call, with grad mode ``grad`` (``method``: of a registered method, which FSDP's pre-
        and post-forward always cast); first, under autocast with the cast cache on and parameters autocast can
        cache, the cache's hazards (see :mod:`._cache`)."""
        cover = self.cover
        if not self.internals.any_autocast_enabled():
            now = _autocast.ALL_OFF
        else:
            now = _autocast.capture_enabled(cover.device_types)
            if now[1] and self.cached:
                _cache.before_call(self.cover_key, -1, grad, cover.device_types, self.name, cover.trainable)
        moved = cover.may_move and self.state._state_ctx.iter_forward_root is None  # this call starts a forward pass
        cast_in, cast_out = _compat.group_casts(self.state, module) if self.grouped and not method else ALL_CAST
        return Call(now, moved, cast_in, cast_out)

    def remove(self) -> None:
        """Take the patch off the module: FSDP's hooks as they were, no replay left in flight."""
        self.placement.remove()
        self.replayer.close()


class _Cover:
    """The patch on one FSDP state: its modules' hooks, its pre- and post-forward as registered methods call them,
    and FSDP's casts where this torch skips them.

    ``register_fsdp_forward_method`` wraps a method so that it calls the state's ``_pre_forward`` and
    ``_post_forward`` itself, looked up on the state at each call (no module hook runs): the patch puts its own
    there as attributes of the state (:meth:`_method_pre_forward`, :meth:`_method_post_forward`), which leave
    FSDP's hooks, bound at ``fully_shard`` time, as they are. So methods registered before and after the patch
    are recorded and replayed as ``forward`` is."""

    __slots__ = ("state", "owner", "pre_backward", "torch_skips_casts", "gathers", "device_types", "may_move",
                 "caches_parameters", "modules_of_state", "modules", "fsdp_pre_forward", "fsdp_post_forward",
                 "method_hooks", "__weakref__")

    def __init__(self, state: Any, slots: list[tuple[torch.nn.Module, _compat.HookSlots]], owner: str) -> None:
        self.state = state
        self.owner = owner
        self.pre_backward = _internals().pre_backward
        self.torch_skips_casts = _internals().needs_cast_replay  # this torch's recompute skips FSDP's casts
        #: Whether the patch gathers resharded parameters in the recompute, in FSDP's place (torch before 2.11).
        self.gathers = _internals().needs_param_gather
        device_type = state._device.type
        self.device_types = ("cpu",) if device_type == "cpu" else ("cpu", device_type)
        self.may_move = device_type in _internals().moving_device_types
        self.modules_of_state = [module for module, _ in slots]
        #: Whether autocast can cache casts of the state's parameters (else its calls have no cache hazard).
        self.caches_parameters = _cache.caches_parameters(state._mp_policy.param_dtype, self.modules_of_state)
        self.modules = [_Module(self, module, s) for module, s in slots]
        state_cls = type(state)  # FSDP's own, as its hooks call them (not the attributes set below)
        self.fsdp_pre_forward = types.MethodType(state_cls._pre_forward, state)
        self.fsdp_post_forward = types.MethodType(state_cls._post_forward, state)
        self.method_hooks = (eager(self._method_pre_forward), eager(self._method_post_forward))
        state._pre_forward, state._post_forward = self.method_hooks

    def _module(self, module: torch.nn.Module) -> _Module | None:
        return next((m for m, of in zip(self.modules, self.modules_of_state) if of is module), None)

    def _method_pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        covered = self._module(module)
        if covered is None:
            return self.fsdp_pre_forward(module, args, kwargs)
        return covered.method_entry(module, args, kwargs, _method_frame())

    def _method_post_forward(self, module: torch.nn.Module, input: Any, output: Any) -> Any:
        covered = self._module(module)
        if covered is None:
            return self.fsdp_post_forward(module, input, output)
        return covered.method_exit(module, input, output, _method_frame())

    def trainable(self) -> bool:
        """Whether autocast may cache a cast of one of the state's parameters now (see :mod:`._cache`)."""
        return _cache.trainable_casts(self.state._mp_policy.param_dtype, _compat.sharded_parameters(self.state))

    def casts(self) -> bool:
        """Whether the patch casts in FSDP's place in ``PRE_BACKWARD``."""
        return self.torch_skips_casts or _force

    def remove(self) -> None:
        """Take the patch off every module of the state; FSDP's hooks and pre- and post-forward are as they were."""
        for module_cover in self.modules:
            module_cover.remove()
        _cache.unshield(id(self))
        attributes = vars(self.state)
        for name, ours in zip(("_pre_forward", "_post_forward"), self.method_hooks):
            if attributes.get(name) is ours:
                del attributes[name]


def _method_frame() -> types.FrameType:
    """The frame of the registered method that called the state's pre- or post-forward: the first frame above the
    patch's and torch.compile's wrapper's (both calls of one method call find the same)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (frame.f_code.co_filename == __file__
                                        or frame.f_globals.get("__name__", "").startswith("torch._dynamo")):
        frame = frame.f_back
    return frame


@functools.wraps(torch.nn.Module.register_forward_pre_hook)
def _register_forward_pre_hook(self: torch.nn.Module, hook: Any, *args: Any, **kwargs: Any) -> Any:
    # Installed on FSDPModule while modules are covered: a pre-hook registered with prepend=True runs
    # before FSDP's, so the patch's lead pre-hook must be placed before it, before the next call.
    handle = nn_register_forward_pre_hook(self, hook, *args, **kwargs)
    if kwargs.get("prepend"):
        cover = _covers.get(id(_internals().state_of(self)))
        for module_cover in cover.modules if cover is not None else ():
            if module_cover.placement.slots.entry.hooks is self._forward_pre_hooks:  # type: ignore[attr-defined]
                module_cover.placement.place_lead(self)
    return handle


def _intercept_pre_hook_registration(on: bool) -> None:
    cls = _internals().fsdp_module_cls
    installed = cls.__dict__.get("register_forward_pre_hook") is _register_forward_pre_hook
    if on and not installed:
        if "register_forward_pre_hook" in cls.__dict__:
            raise _compat.UnsupportedTorchError("FSDPModule.register_forward_pre_hook", "defined by torch")
        cls.register_forward_pre_hook = _register_forward_pre_hook  # type: ignore[attr-defined]
    elif not on and installed:
        del cls.register_forward_pre_hook  # type: ignore[attr-defined]


def _internals() -> _compat.Internals:
    return _compat.load()


def _slots_of(state: Any) -> list[tuple[torch.nn.Module, _compat.HookSlots]]:
    """Check ``state`` and find FSDP's hooks for each of its modules (raises before anything is changed)."""
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
    _intercept_pre_hook_registration(True)
    cover = _Cover(state, slots, owner)
    _covers[id(state)] = cover
    return len(cover.modules)


def _init_wrapper_fn(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    with _lock:
        if _applied:
            try:
                _cover_state(instance, _GLOBAL)
            except _compat.UnsupportedTorchError as e:  # FSDP's init has run: let fully_shard finish, stock
                logger.warning("fsdp_autocast_fix cannot cover %s, which runs without the patch: %s",
                               ", ".join(type(m).__name__ for m in _compat.modules_of(instance)), e)
    return result


def apply(*, force: bool = False) -> bool:
    """Patch process-wide: every module sharded with ``fully_shard``, before or after this call.

    Idempotent. Returns True if it changed anything (first call, or a new ``force``).
    On a torch whose recompute already casts (2.13+), the cast replay is left to torch
    unless ``force=True`` (then every covered module replays the casts while the patch is in
    force, ``patched_fully_shard``'s too); the per-call autocast replay and the autocast
    cache fix are active on every torch.

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
        states = [s for s in internals.all_states() if id(s) not in _covers]
        found = [(state, _slots_of(state)) for state in states]  # all checks before any change
        _force = force
        _report.reset()  # the report counts from here
        if _init_wrapper is None:
            _init_wrapper = wrapt.wrap_function_wrapper(internals.fsdp_state_cls, "init", _init_wrapper_fn)
        _applied = True
        _intercept_pre_hook_registration(True)
        retrofitted = 0
        for state, slots in found:
            _covers[id(state)] = cover = _Cover(state, slots, _GLOBAL)
            retrofitted += len(cover.modules)
    if internals.needs_cast_replay or force:
        logger.info("fsdp_autocast_fix applied (torch %s): cast and autocast replay; %d already-sharded "
                    "modules retrofitted", _compat.torch_version(), retrofitted)
    else:
        logger.info("fsdp_autocast_fix applied (torch %s): this torch already casts in the recompute, so "
                    "the cast replay is left to torch (force=True to replay it anyway); autocast replay "
                    "active; %d already-sharded modules retrofitted", _compat.torch_version(), retrofitted)
    if internals.cache_marks is None:
        logger.warning("fsdp_autocast_fix: this torch's autocast does not honour its cache marks, so a no_grad call "
                       "of fp32 parameters under autocast drops the cast cache before their next training call")
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
        if not _covers:
            _intercept_pre_hook_registration(False)
    logger.info("fsdp_autocast_fix removed")


def is_applied() -> bool:
    """Whether :func:`apply` is in force."""
    return _applied


def forced() -> bool:
    """Whether :func:`apply` was called with ``force=True``."""
    return _force


def covered_modules() -> int:
    """How many sharded modules have the patch's hooks now."""
    return sum(len(cover.modules) for cover in list(_covers.values()))


def preserve_autocast(checkpoint_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``checkpoint_fn`` made to run the checkpointed function under the autocast state of its call site.

    For any checkpoint called as ``checkpoint_fn(function, *args, **kwargs)``: torch's
    ``torch.utils.checkpoint.checkpoint`` (either mode), DeepSpeed's ``checkpoint`` and
    ``non_reentrant_checkpoint``, or a hand-written ``autograd.Function``. The result has the same
    signature, arguments, return value and errors; ``function`` then runs under the autocast state
    (per device type, and the cache flag) that was current when the checkpoint was called, in the
    forward and in the recompute, and a recompute drops autocast's cached casts first where its forward
    ran under ``no_grad`` (a cast cached there would cut the recompute off from the parameters).

    This is what :func:`apply` cannot do for a checkpoint whose region does not start at a sharded
    module's call (a sharded block whose ``forward`` checkpoints part of itself): nothing sharded is
    called again at the start of its recompute.

    Raises:
        TypeError: ``checkpoint_fn`` is not callable (or, when called, ``function`` is not).
    """
    if not callable(checkpoint_fn):
        raise TypeError(f"preserve_autocast expects a checkpoint function, got {type(checkpoint_fn).__name__}")
    device_types = _compat.autocast_device_types()

    @functools.wraps(checkpoint_fn)
    def checkpoint_with_autocast(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not callable(function):
            raise TypeError(f"the checkpointed function must be callable, got {type(function).__name__}")
        call_site = _autocast.capture(device_types)

        @functools.wraps(function)
        def run(*run_args: Any, **run_kwargs: Any) -> Any:
            if _autocast.capture(device_types) == call_site:
                return _checkpointed(function, run_args, run_kwargs)
            with _autocast.entered(call_site, device_types):
                return _checkpointed(function, run_args, run_kwargs)

        return checkpoint_fn(run, *args, **kwargs)

    return checkpoint_with_autocast


def _checkpointed(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a checkpointed function under the autocast state it must see, with the cache policy of :mod:`._cache`;
    in its recompute the covered modules keep that state (``_replay.restored``)."""
    internals = _internals()
    if internals.any_autocast_enabled() and torch.is_autocast_cache_enabled():
        if not torch.is_grad_enabled():
            _cache.note(_cache.EVERY_STATE, -1, _compat.autocast_device_types())
        elif _cache.active:
            _cache.check(_cache.EVERY_STATE, internals.graph_task_id(), "preserve_autocast")
    if internals.graph_task_id() == -1:
        return function(*args, **kwargs)
    with restored():
        return function(*args, **kwargs)


def patched_fully_shard(*args: Any, **kwargs: Any) -> Any:
    """``fully_shard`` that also covers the modules it shards; no global patch.

    Same signature, return value and errors as the installed ``fully_shard``.

    Raises:
        UnsupportedTorchError: before sharding, if an internal the patch relies on
            is missing or changed; after sharding, if FSDP's hooks are not where
            ``fully_shard`` registers them (someone replaced ``FSDPState._pre_forward``,
            say): the modules are then sharded but not covered, and the error says so.
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
