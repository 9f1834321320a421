"""The patch on the sharded modules it covers: where it sits and what it does on each call.

A covered FSDP state gets a :class:`Cover`; each of its modules gets a :class:`ModuleCover`, made of three parts,
each with its own invariant:

* :class:`~._hooks.Placement` - where the patch sits in the module's hook chain (for registered methods, the
  state's pre- and post-forward: :class:`Cover`);
* :class:`~._calls.CallLog` - what identifies a forward call (its tensor arguments, held weakly);
* :class:`~._replay.Replayer` - what a recompute replays, and how it is undone.

:mod:`._cache` decides when autocast's cached casts are kept out or dropped. On an ordinary forward the module's
entry records the call (a few scalars) under its leaves, then calls FSDP's pre-hook; on a recompute it hands over
to the replayer.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

import torch

from . import _autocast, _cache, _calls, _compat, _replay, _report
from ._calls import Call
from ._hooks import Placement, eager
from ._replay import ALL_CAST, Replayer


class ModuleCover:
    """The patch on one module of a covered state: it records each ordinary call (:class:`~._calls.Call`) and
    replays each recompute. The autocast state is read before FSDP's pre-hook and any user pre-hook after the lead.
    """

    __slots__ = ("cover", "cover_key", "state", "internals", "grouped", "cached", "name", "log", "placement",
                 "replayer", "__weakref__")

    def __init__(self, cover: Cover, module: torch.nn.Module, slots: _compat.HookSlots) -> None:
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
        """In FSDP's pre-hook slot: record or replay (unless the lead did), then call FSDP's pre-hook."""
        if self.placement.lead is None:
            self.begin(module, args, kwargs)
        return self._after_fsdp(args, kwargs, self.placement.fsdp_call(module, args, kwargs))

    def method_entry(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     caller: types.FrameType) -> Any:
        """In place of FSDP's pre-forward for a method registered with ``register_fsdp_forward_method`` (no hook
        runs for it): record or replay, then call FSDP's pre-forward. ``caller``: the method call's frame;
        :meth:`method_exit` of the same call undoes a replay started here."""
        self.begin(module, args, kwargs, caller)
        return self._after_fsdp(args, kwargs, self.cover.fsdp_pre_forward(module, args, kwargs), caller)

    def _after_fsdp(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
                    caller: types.FrameType | None = None) -> Any:
        """After FSDP's pre-forward gathered the parameters: shield a ``no_grad`` call, gather what this torch's
        recompute leaves sharded, and do the root move and input cast of a replay this call started."""
        if self.cached and not torch.is_grad_enabled():
            self.shield(caller)
        if self.cover.gathers and self.state._training_state is self.cover.pre_backward:
            self.replayer.gather()
        replays = self.replayer.replays
        if replays and replays[-1].caller is caller and replays[-1].pre_pending:
            return self.replayer.pre_casts(args, kwargs, result)
        return result

    def method_exit(self, module: torch.nn.Module, input: Any, output: Any, caller: types.FrameType) -> Any:
        """In place of FSDP's post-forward for a registered method: FSDP's, then the output cast and undo of a
        replay this method call started."""
        output = self.cover.fsdp_post_forward(module, input, output)
        if self.cached:
            _cache.end_of_method(self.cover_key, caller)
        replays = self.replayer.replays
        if replays and replays[-1].caller is caller:
            return self.replayer.method_exit(replays[-1], output)
        return output

    def shield(self, caller: types.FrameType | None = None) -> None:
        """Under autocast with the cache on, keep the casts of a ``no_grad`` call's gathered parameters out of the
        cache (:func:`._cache.shield`). ``caller``: a registered method's frame."""
        if self.internals.any_autocast_enabled() and torch.is_autocast_cache_enabled():
            _cache.shield(self.cover_key, self.cover, _compat.unsharded_parameters(self.state),
                          self.cover.device_types, caller)

    def begin(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              caller: types.FrameType | None = None) -> None:
        """Record an ordinary call, or start a recompute's replay. Called by the entry, by the lead pre-hook while
        user pre-hooks run before FSDP's, or by a registered method (``caller``: its frame)."""
        internals = self.internals
        if internals.graph_task_id() != -1:  # in a backward: a recompute (FSDP's PRE_BACKWARD would not do:
            tensors = _calls.leaves(args, kwargs)  # it outlives a backward that raised)
            self.replayer.start(module, tensors, caller)
            if not torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
                # a checkpoint's forward inside this recompute (per-layer checkpoints under a whole-stack one):
                # record it as it runs now, in the forward's state, for its own recompute later
                self.log.record(tensors, self.replayer.nested_call(module), internals.sequence_nr())
            return
        if self.replayer.replays:  # left by an interrupted recompute (KeyboardInterrupt skips always_call hooks)
            self.replayer.drop_stale()
        if _replay.held:  # a recompute region's entered state outlived its backward
            _replay.release_region()
        grad = torch.is_grad_enabled()
        call = self._call(module, grad, method=caller is not None)
        if torch.is_inference_mode_enabled():  # never recomputed, even under enable_grad; a record would merge
            return  # into the record of the training call on the same input
        self.log.record(_calls.leaves(args, kwargs), call, -1 if grad else internals.sequence_nr())

    def _call(self, module: torch.nn.Module, grad: bool, method: bool) -> Call:
        """The record of this call under grad mode ``grad`` (``method``: a registered method's, which FSDP's pre-
        and post-forward always cast). Under autocast with the cache on, first applies the cache decision
        (:func:`._cache.before_call`) where autocast can cache the parameters."""
        cover = self.cover
        if not self.internals.any_autocast_enabled():
            now = _autocast.ALL_OFF
        else:
            now = _autocast.capture_enabled(cover.device_types)
            if now[1] and self.cached:
                _cache.before_call(self.cover_key, -1, grad, cover.device_types, self.name, cover.trainable)
        moved = cover.may_move and self.state._state_ctx.iter_forward_root is None  # this call starts a forward pass
        cast_in, cast_out = _compat.group_casts(self.state, module) if self.grouped and not method else ALL_CAST
        return _calls.call(now, moved, cast_in, cast_out)

    def remove(self) -> None:
        """Take the patch off the module: FSDP's hooks as they were, no replay left in flight."""
        self.placement.remove()
        self.replayer.close()


class Cover:
    """The patch on one FSDP state: its modules' covers, its pre- and post-forward as registered methods call them,
    and FSDP's casts where this torch skips them.

    A method wrapped by ``register_fsdp_forward_method`` runs no module hook: it looks up the state's
    ``_pre_forward`` and ``_post_forward`` at each call. The patch sets its own as attributes of the state
    (:meth:`_method_pre_forward`, :meth:`_method_post_forward`); FSDP's hooks, bound at ``fully_shard`` time, are
    untouched. So methods registered before or after the patch are recorded and replayed as ``forward`` is."""

    __slots__ = ("state", "owner", "pre_backward", "torch_skips_casts", "gathers", "device_types", "may_move",
                 "caches_parameters", "modules_of_state", "modules", "fsdp_pre_forward", "fsdp_post_forward",
                 "method_hooks", "forced", "__weakref__")

    def __init__(self, state: Any, slots: list[tuple[torch.nn.Module, _compat.HookSlots]], owner: str,
                 forced: Callable[[], bool]) -> None:
        self.state = state
        self.owner = owner  # who covered it: apply(), or patched_fully_shard (outlives remove())
        self.forced = forced  # whether apply(force=True) is in force
        self.pre_backward = _compat.load().pre_backward
        self.torch_skips_casts = _compat.load().needs_cast_replay  # this torch's recompute skips FSDP's casts
        #: Whether the patch gathers resharded parameters in the recompute, in FSDP's place (torch before 2.11).
        self.gathers = _compat.load().needs_param_gather
        device_type = state._device.type
        self.device_types = ("cpu",) if device_type == "cpu" else ("cpu", device_type)
        self.may_move = device_type in _compat.load().moving_device_types
        self.modules_of_state = [module for module, _ in slots]
        #: Whether autocast can cache casts of the state's parameters (else its calls have no cache hazard).
        self.caches_parameters = _cache.caches_parameters(state._mp_policy.param_dtype, self.modules_of_state)
        self.modules = [ModuleCover(self, module, s) for module, s in slots]
        state_cls = type(state)  # FSDP's own, as its hooks call them (not the attributes set below)
        self.fsdp_pre_forward = types.MethodType(state_cls._pre_forward, state)
        self.fsdp_post_forward = types.MethodType(state_cls._post_forward, state)
        self.method_hooks = (eager(self._method_pre_forward), eager(self._method_post_forward))
        _compat.set_method_forwards(state, self.method_hooks)
        _report.arm_exit_report()  # a process that covers a module prints the report at exit, if asked

    def _module(self, module: torch.nn.Module) -> ModuleCover | None:
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
        return self.torch_skips_casts or self.forced()

    def remove(self) -> None:
        """Take the patch off every module of the state; FSDP's hooks and pre- and post-forward are as they were."""
        for module_cover in self.modules:
            module_cover.remove()
        _cache.unshield(id(self))
        _compat.clear_method_forwards(self.state, self.method_hooks)


def _method_frame() -> types.FrameType:
    """The frame of the registered method calling the state's pre- or post-forward: the first frame above the
    patch's and torch.compile's wrappers, so both calls of one method call find the same frame."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (frame.f_code.co_filename == __file__
                                        or frame.f_globals.get("__name__", "").startswith("torch._dynamo")):
        frame = frame.f_back
    return frame
