"""The mechanism: record what each forward call of a sharded module saw, replay it in that call's recompute.

For every module it covers, the patch takes the place of FSDP's own forward pre-hook in the module's
hook dict (same key, so the same position among the user's hooks) and calls FSDP's hook from there:

* **Ordinary forward.** Before FSDP's hook runs, it records the call: the autocast state (enabled and
  dtype per device type in use, and the cache flag), whether FSDP's root moved the inputs to the device,
  and which of FSDP's casts the forward does (for ``fully_shard([a, b])`` only the group's first inputs and
  last output, in torch 2.5-2.12). The record is a few scalars, kept by the module with a weak reference
  to the call's first tensor argument (parameters aside) and that tensor's version counter. A recompute gets
  that tensor back (``torch.utils.checkpoint``) or a ``detach()`` of it (reentrant-style checkpoints), which
  shares its storage, offset, size and version, so it finds the record of the call it recomputes; a record
  goes when its tensor is freed.
* **Autocast's cast cache** (pytorch issue 158232): FSDP2 reuses its unsharded parameters, so a cast cached
  by a no-grad forward, or by an earlier forward pass of the same module in the same autocast region, would
  cut a later grad-enabled forward off from the parameters. The patch drops the cached casts before such a
  forward and before every recompute.
* **Recompute** (FSDP state ``PRE_BACKWARD``, or any forward inside backward, which is how reentrant-style
  checkpoints recompute). The outermost covered module of the recompute looks its call up, enters that
  call's autocast state where the current one differs (a checkpoint that restored it sees no change), and
  registers a forward hook (last, ``always_call``) that undoes this after the module's other hooks. Modules
  called inside it re-run as in the forward and need nothing; the next sharded calls of the same region
  (the same backward node) follow it while the region's own code leaves autocast as it was. In
  ``PRE_BACKWARD`` FSDP skips its root input move, and in torch 2.4-2.12 its casts: the patch does what the
  call's forward did right after FSDP's pre-hook and, for the output, in FSDP's forward-hook entry
  (swapped in for the recompute), so user hooks before and after FSDP's see what they saw in the forward.

If user pre-hooks run before FSDP's, a lead pre-hook of the patch is put first so that the record and
the replayed autocast state come before them too. The patch's hooks are wrapped with
``torch._dynamo.disable`` as FSDP's are, so torch.compile runs them eagerly where it ran FSDP's; inside the
entry, FSDP's pre-hook is called without FSDP's own wrapper (which makes a new ``disable`` object on every
call), made redundant by the patch's (``Internals.bare_hook``; the group closure as it is). Modules
sharded later are covered through a wrapt wrapper on ``FSDPState.init``, modules sharded earlier through
torch's composable-state registry.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import sys
import threading
import weakref
from typing import Any, Callable

import torch
import wrapt

from . import _compat

logger = logging.getLogger("fsdp_autocast_fix")

_GLOBAL = "apply"
_LOCAL = "patched_fully_shard"

# Hot-path callables, bound once.
_Tensor = torch.Tensor
_any_autocast_enabled = torch._C._is_any_autocast_enabled
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_is_autocast_enabled = torch.is_autocast_enabled
_get_autocast_dtype = torch.get_autocast_dtype
_is_autocast_cache_enabled = torch.is_autocast_cache_enabled
_is_grad_enabled = torch.is_grad_enabled
_clear_autocast_cache = torch.clear_autocast_cache

#: Captured when no autocast is enabled anywhere: the replay disables autocast.
_ALL_OFF = "all-off"
#: Device types whose forward root FSDP moves inputs to (``FSDPState._root_pre_forward``).
_MOVING_DEVICE_TYPES = frozenset({"cuda", "hpu", "xpu", "mtia", torch._C._get_privateuse1_backend_name()})

_lock = threading.RLock()
#: id(state) -> _Cover. A cover keeps its state (and so the modules) alive, and the modules' hook dicts,
#: which hold the patch's hooks, keep the cover alive: an entry goes when the model is freed, and the id
#: cannot be reused meanwhile.
_covers: weakref.WeakValueDictionary[int, _Cover] = weakref.WeakValueDictionary()
_applied = False
_force = False
_init_wrapper: Any = None
_tls = threading.local()


def _frames() -> list[_Frame]:
    """This thread's recomputes in flight, outermost first (autograd may recompute on its own threads)."""
    try:
        return _tls.frames  # type: ignore[no-any-return]
    except AttributeError:
        _tls.frames = []
        return _tls.frames  # type: ignore[no-any-return]


def _eager(hook: Any) -> Any:
    """``hook`` as torch.compile must see it, as FSDP's own: run eagerly where dynamo breaks the graph, never traced."""
    return torch._dynamo.disable(hook, recursive=True)


def _capture(device_types: tuple[str, ...]) -> Any:
    """The autocast state now, as plain scalars: ``((enabled, dtype) per device type, cache)``."""
    if not _any_autocast_enabled():
        return _ALL_OFF
    return _capture_enabled(device_types)


def _capture_enabled(device_types: tuple[str, ...]) -> Any:
    if len(device_types) == 1:  # CPU alone: the common case, spelled out
        return ((_is_autocast_enabled("cpu"), _get_autocast_dtype("cpu")),), _is_autocast_cache_enabled()
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


def _where(x: torch.Tensor) -> tuple[int, int, int, int]:
    """The memory ``x`` views, and its version: equal for a tensor and its ``detach()``."""
    return x.untyped_storage()._cdata, x.storage_offset(), x.numel(), x._version


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor a call is recorded under: its first positional tensor, else its first keyword tensor.

    Parameters are skipped: one is passed to every call, so it tells no call from another."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, _Tensor) and not isinstance(value, torch.nn.Parameter):
            return value
    return None


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a recorded input that knows its record's key."""

    __slots__ = ("key",)


class _Frame:
    """A recompute in flight on this thread: the outermost covered module being recomputed."""

    __slots__ = ("module", "graph_task")

    def __init__(self, module: torch.nn.Module, graph_task: int) -> None:
        self.module = module
        self.graph_task = graph_task


class _Replay:
    """One recompute of a module: what FSDP's forward did that this torch skips, and what to undo after."""

    __slots__ = ("frame", "stack", "thread", "cache_before", "moved", "cast_in", "cast_out", "pre_pending")

    def __init__(self, frame: _Frame | None, stack: contextlib.ExitStack | None, cache_before: bool, moved: bool,
                 cast_in: bool, cast_out: bool) -> None:
        self.frame, self.stack = frame, stack
        self.thread, self.cache_before = threading.get_ident(), cache_before
        self.moved, self.cast_in, self.cast_out = moved, cast_in, cast_out
        self.pre_pending = moved or cast_in  # done right after FSDP's pre-hook, by the entry


#: The autocast cache (pytorch issue 158232). A no-grad forward of a covered module under autocast caches casts
#: of FSDP's unsharded parameters without autograd history ("tainted"); a forward pass of a module that already
#: ran one in the same autocast region would reuse the casts of that pass's graph. In both cases the next
#: grad-enabled forward must cast anew, and so does every recompute. Other cached casts are left alone: a
#: parameter FSDP does not manage, used before and after a sharded module, keeps sharing one cast (and so the
#: gradient accumulation of plain PyTorch). ``_cache[0]`` counts clears, ``_cache[1]`` is the taint.
_cache = [0, False]


def _drop_cached_casts() -> None:
    _clear_autocast_cache()
    _cache[0] += 1
    _cache[1] = False


class _Module:
    """The patch's hooks on one module of a covered state."""

    __slots__ = ("cover", "state", "pre_backward", "device_types", "may_move", "grouped", "varies", "slots",
                 "fsdp_entry", "fsdp_call", "fsdp_post", "hook", "post_hook", "exit_hook", "lead", "calls", "forget",
                 "replays", "exit_handle", "last", "unkeyed", "warned", "pass_epoch", "__weakref__")

    def __init__(self, cover: _Cover, module: torch.nn.Module, slots: _compat.HookSlots) -> None:
        self.cover = cover
        self.state, self.pre_backward = cover.state, cover.pre_backward
        self.device_types, self.may_move = cover.device_types, cover.may_move
        self.grouped = len(cover.modules_of_state) > 1
        self.varies = self.grouped or self.may_move  # else a call without autocast is always recorded alike
        #: id(input) -> (weak reference to the input, its version, the calls recorded for it): a record lives as
        #: long as its input (while a checkpoint holds it for the recompute) and no longer.
        self.calls: dict[int, tuple[_Ref, int, tuple[Any, ...]]] = {}
        self.forget = self._forget
        self.slots = slots
        self.fsdp_entry = slots.entry.get()  # FSDP's pre-hook entry: its bound _pre_forward, or a group closure
        # What the entry calls: FSDP's _pre_forward without FSDP's per-call dynamo-disable wrapper, which is
        # redundant inside the patch's own (``self.hook``); the group closure as it is.
        self.fsdp_call = _internals().bare_hook(self.fsdp_entry, cover.state)
        self.fsdp_post = slots.post_entry.get()  # FSDP's forward-hook entry, likewise
        self.lead: Any = None  # handle of the lead pre-hook, while user pre-hooks run before FSDP's
        self.replays: list[_Replay] = []
        self.exit_handle: Any = None
        self.last: Any = None  # the state of the last recorded call, for the unidentified-recompute warning
        self.unkeyed: Any = None  # the last call with no tensor argument to record it under (parameters aside)
        self.warned = False
        self.pass_epoch = -1  # the autocast-cache epoch in which this module last started a forward pass
        self.hook = _eager(self.entry)  # as FSDP's own hooks: torch.compile runs it eagerly, never traces it
        self.post_hook = _eager(self.post_forward)
        self.exit_hook = _eager(self.exit)
        slots.entry.set(self.hook)
        self._place_lead(module)

    # -- the hot path ---------------------------------------------------------------------------------

    def entry(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """In the place of FSDP's pre-hook entry: record or replay (unless the lead did), then FSDP's pre-hook."""
        if self.lead is None:
            self.begin(module, args, kwargs)
        result = self.fsdp_call(module, args, kwargs)
        if self.replays and self.replays[-1].pre_pending:
            return self._pre_casts(args, kwargs, result)
        return result

    def begin(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Record an ordinary call or start the replay of a recompute: from the entry, or as the lead pre-hook
        while user pre-hooks run before FSDP's."""
        state = self.state
        if state._training_state is self.pre_backward or _graph_task_id() != -1:
            self._begin_recompute(module, args, kwargs)
        else:
            self._record(state, module, args, kwargs)

    def _record(self, state: Any, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An ordinary call: record what its recompute must replay (the hot path)."""
        if self.replays:  # left by an interrupted recompute (KeyboardInterrupt skips always_call hooks)
            self._drop_stale()
        autocast = _any_autocast_enabled()
        call = self._call(state, module, autocast) if self.varies or autocast else _PLAIN_CALL
        self.last = call
        x = args[0] if args and type(args[0]) is _Tensor else _first_tensor(args, kwargs)
        if x is None:  # nothing to key on: an unidentified recompute of a call like this replays the latest
            self.unkeyed = call
            return
        key = id(x)
        seen = self.calls.get(key)
        if seen is not None and seen[0]() is x and seen[1] == x._version:  # the same input again
            if seen[2][-1] != call:  # in another state: keep each state once, latest last
                self.calls[key] = (seen[0], seen[1], tuple(c for c in seen[2] if c != call) + (call,))
            return
        if _is_inference_mode_enabled():  # a call that is never recomputed
            return
        ref = _Ref(x, self.forget)
        ref.key = key
        self.calls[key] = (ref, x._version, (call,))

    def _call(self, state: Any, module: torch.nn.Module, autocast: bool) -> tuple[Any, ...]:
        """The record of a call under autocast, or of a module whose record depends on the call."""
        root = state._state_ctx.iter_forward_root is None  # this call starts a forward pass
        if autocast:
            now = _capture_enabled(self.device_types)
            if now[1]:  # the cast cache is on
                if not _is_grad_enabled():
                    _cache[1] = True
                else:
                    if _cache[1] or (root and self.pass_epoch == _cache[0]):
                        _drop_cached_casts()
                    if root:
                        self.pass_epoch = _cache[0]
        else:
            now = _ALL_OFF
        return (now, self.may_move and root) + (_group_casts(state, module) if self.grouped else _ALL_CAST)

    def _forget(self, ref: _Ref) -> None:
        """A recorded input was freed: its record goes with it."""
        seen = self.calls.get(ref.key)
        if seen is not None and seen[0] is ref:
            del self.calls[ref.key]

    # -- recompute ------------------------------------------------------------------------------------

    def _lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """The calls recorded for the forward call whose inputs these are, or None.

        The very input (``torch.utils.checkpoint`` passes it back), else a recorded input that shares its storage,
        offset, size and version (a ``detach()`` of it, as reentrant-style checkpoints pass)."""
        x = _first_tensor(args, kwargs)
        if x is None:
            return None
        seen = self.calls.get(id(x))
        if seen is not None and seen[0]() is x:
            return seen[2] if seen[1] == x._version else None
        try:
            where = _where(x)
            found: tuple[Any, ...] = ()
            for ref, version, calls in list(self.calls.values()):
                recorded = ref()
                if recorded is not None and version == recorded._version and _where(recorded) == where:
                    found += tuple(c for c in calls if c not in found)
            return found or None
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor without a storage of its own
            return None

    def _choose(self, module: torch.nn.Module, calls: tuple[Any, ...] | None, now: Any) -> Any:
        """The recorded call to replay, or None to leave the state as the checkpoint set it."""
        node = _current_node()  # the backward node whose execution runs this recompute
        here = (_graph_task_id(), node._sequence_nr() if node is not None else None)
        if calls is None:
            region = getattr(_tls, "region", None)
            # A later sharded call of the region whose first call was just replayed, unless the region's code
            # changed autocast itself since (then the state now is the region's own).
            if region is not None and region[0] == here and region[2] == now:
                return region[1][:1] + (False,) + _group_casts(self.cover.state, module)
            if self.unkeyed is not None:  # calls with only parameters as tensors: the latest such call
                _tls.region = (here, self.unkeyed, now)
                return self.unkeyed
            if self.last is not None and self.last[0] != now and not self.warned:
                self.warned = True
                logger.warning(
                    "%s: cannot tell which forward call this recompute replays (its first input tensor is not "
                    "one a recorded call received); leaving autocast as the checkpoint set it. If the checkpoint "
                    "does not restore autocast, wrap it with fsdp_autocast_fix.preserve_autocast",
                    type(module).__name__)
            return None
        chosen = self._pick(module, calls, now)
        _tls.region = (here, chosen, now)
        return chosen

    def _pick(self, module: torch.nn.Module, calls: tuple[Any, ...], now: Any) -> Any:
        if len(calls) == 1:
            return calls[0]
        # The same input under several states (an eval pass on the training batch, say). torch's checkpoint
        # restored the state of the call it recomputes: keep it. Other checkpoints: the most recent call.
        restored = _compat.in_torch_checkpoint() and next((c for c in calls if c[0] == now), None)
        chosen = restored or calls[-1]
        if not self.warned:
            self.warned = True
            logger.warning(
                "%s ran forward on the same input under %d autocast states before this recompute; replaying %s. "
                "Wrap the checkpoint with fsdp_autocast_fix.preserve_autocast to make it exact",
                type(module).__name__, len(calls),
                "the one torch's checkpoint restored" if restored else "the most recent")
        return chosen

    def _begin_recompute(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cover = self.cover
        state = cover.state
        graph_task = _graph_task_id()
        frames = _frames()
        if frames and frames[0].graph_task != graph_task:  # left by a recompute of an earlier backward
            frames.clear()
        frame = stack = None
        cache_before = _is_autocast_cache_enabled()
        if not frames:  # the outermost covered module of this recompute: the call it replays
            now = _capture(cover.device_types)
            chosen = self._choose(module, self._lookup(args, kwargs), now)
            if chosen is not None and chosen[0] != now:
                stack = _enter(chosen[0], cover.device_types)
            _drop_cached_casts()  # the recompute casts anew: cached casts may hold no path to FSDP's parameters
            frame = _Frame(module, graph_task)
            frames.append(frame)
        else:
            chosen = None  # inside a replayed module: it re-runs as in the forward
        if chosen is None:
            chosen = (None, False) + (_group_casts(state, module) if self.grouped else _ALL_CAST)
        _, moved, cast_in, cast_out = chosen
        if state._training_state is cover.pre_backward:  # FSDP skips its forward's root move, and on 2.4-2.12
            casts = cover.casts()  # its casts: do them in its place
            cast_in, cast_out = cast_in and casts, cast_out and casts
        else:
            moved = cast_in = cast_out = False
        if frame is None and not (moved or cast_in or cast_out):
            return
        self.replays.append(_Replay(frame, stack, cache_before, moved, cast_in, cast_out))
        if cast_out:
            self.slots.post_entry.set(self.post_hook)
        if self.exit_handle is None:
            self.exit_handle = module.register_forward_hook(self.exit_hook, always_call=True)

    def _pre_casts(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
        """Right after FSDP's pre-hook in a replay: the root move and input cast its forward did."""
        replay = self.replays[-1]
        replay.pre_pending = False
        if result is not None:
            args, kwargs = result
        state = self.cover.state
        if replay.moved:  # no torch release replays this
            args_tuple, kwargs_tuple = _internals().to_kwargs(args, kwargs, state._device, False)
            args, kwargs = args_tuple[0], kwargs_tuple[0]
        policy = state._mp_policy
        if replay.cast_in and policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = _cast(policy.param_dtype, args), _cast(policy.param_dtype, kwargs)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, input: Any, output: Any) -> Any:
        """In the place of FSDP's forward hook during a replay: FSDP's hook, then the output cast it did."""
        output = self.fsdp_post(module, input, output)
        dtype = self.cover.state._mp_policy.output_dtype
        return _cast(dtype, output) if dtype is not None else output

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Last forward hook while a replay is in flight: undo what :meth:`begin` changed, also on errors."""
        if not self.replays:  # a stale registration after an exception: drop it now
            self._unregister_exit()
            return
        replay = self.replays.pop()
        try:
            self._undo(replay)
        finally:
            if replay.stack is not None:
                replay.stack.close()
            if not self.replays:
                self._unregister_exit()

    def _undo(self, replay: _Replay) -> None:
        if replay.cast_out and not any(r.cast_out for r in self.replays) and self.slots.post_entry.get() is \
                self.post_hook:
            self.slots.post_entry.set(self.fsdp_post)
        if replay.frame is not None:
            frames = _frames()
            if replay.frame in frames:
                frames.remove(replay.frame)

    def _drop_stale(self) -> None:
        """Forget the replays an interrupt left behind (``KeyboardInterrupt`` skips ``always_call`` hooks).

        The autograd engine put the autocast state (enabled, dtype) back when the interrupted backward unwound;
        what it does not restore is repaired here: autocast's nesting count (so that the cast cache is still
        cleared when the outermost autocast region ends) and, outside any region, the cache flag.
        """
        while self.replays:
            replay = self.replays.pop()
            self._undo(replay)
            if replay.stack is None:
                continue
            if replay.thread != threading.get_ident():  # recomputed on an autograd worker thread: its counters
                continue
            nesting = -1
            for _ in range(len(self.cover.device_types)):
                nesting = torch.autocast_decrement_nesting()
            if nesting == 0:
                _clear_autocast_cache()
                torch.set_autocast_cache_enabled(replay.cache_before)
        if self.exit_handle is not None:
            self.exit_handle.remove()
            self.exit_handle = None

    def _unregister_exit(self) -> None:
        # nn.Module.__call__ runs forward hooks from a snapshot on its normal path, so the hook may remove
        # itself there. On its exception path (an error, or checkpoint's early stop) it iterates the dict
        # itself: then the removal waits for the end of the backward pass this recompute belongs to, or,
        # outside backward, for the module's next call.
        if self.exit_handle is None or not _internals().forward_hooks_snapshot:
            return
        if sys.exc_info()[1] is None:
            self._drop_exit()
        elif _graph_task_id() != -1:
            _internals().queue_backward_callback(self._drop_exit)

    def _drop_exit(self) -> None:
        if self.exit_handle is not None and not self.replays:
            self.exit_handle.remove()
            self.exit_handle = None

    # -- placement ------------------------------------------------------------------------------------

    def _place_lead(self, module: torch.nn.Module) -> None:
        """Keep the lead pre-hook first while other pre-hooks run before FSDP's; drop it otherwise.

        Called when the module is covered and whenever a pre-hook is registered with ``prepend=True`` on a
        covered module (see :func:`_register_forward_pre_hook`).
        """
        hooks = module._forward_pre_hooks
        entry_key = self.slots.entry.key
        lead_key = self.lead.id if self.lead is not None else None
        before = list(itertools.takewhile(lambda k: k != entry_key, hooks))
        if any(k != lead_key for k in before):
            if self.lead is None:
                self.lead = _nn_register_forward_pre_hook(module, _eager(self.begin), prepend=True,
                                                          with_kwargs=True)
            elif next(iter(hooks)) != lead_key:
                hooks.move_to_end(lead_key, last=False)
        elif self.lead is not None:
            self.lead.remove()
            self.lead = None

    def remove(self) -> None:
        """Put FSDP's entries back and take the patch's hooks off the module."""
        for slot, ours, theirs in ((self.slots.entry, self.hook, self.fsdp_entry),
                                   (self.slots.post_entry, self.post_hook, self.fsdp_post)):
            if slot.get() is ours:
                slot.set(theirs)
        if self.slots.entry.get() is not self.fsdp_entry:  # pragma: no cover - someone replaced it after us
            logger.warning("FSDP's pre-hook entry was replaced after fsdp_autocast_fix covered the module; "
                           "leaving it as it is")
        if self.lead is not None:
            self.lead.remove()
            self.lead = None
        for replay in self.replays:
            if replay.stack is not None:
                replay.stack.close()
        self.replays.clear()
        if self.exit_handle is not None:
            self.exit_handle.remove()
            self.exit_handle = None


#: The casts FSDP does for a module sharded alone: its inputs and its output, every call.
_ALL_CAST = (True, True)
#: The record of a call without autocast, of a module sharded alone on a device FSDP does not move inputs to.
_PLAIN_CALL = (_ALL_OFF, False) + _ALL_CAST


def _group_casts(state: Any, module: torch.nn.Module) -> tuple[bool, bool]:
    """Whether FSDP's forward casts this call's inputs / output, for a module of ``fully_shard([a, b, ...])``.

    In torch 2.5-2.12 the group's pre-hook runs ``_pre_forward`` (with the input cast) only for the module that
    starts the group's pass, and ``_post_forward`` (with the output cast) only for the one that ends it. Read
    before FSDP's hook runs: ``_modules_to_run_forward`` is empty for the first, holds just this module for the
    last. (2.13+ casts every module's inputs and output, in the recompute too.)
    """
    to_run = state._modules_to_run_forward
    return not to_run, len(to_run) == 1 and module in to_run


class _Cover:
    """The patch on one FSDP state: its modules' hooks, and FSDP's casts where this torch skips them."""

    __slots__ = ("state", "owner", "pre_backward", "device_types", "may_move", "modules_of_state", "modules",
                 "__weakref__")

    def __init__(self, state: Any, slots: list[tuple[torch.nn.Module, _compat.HookSlots]], owner: str) -> None:
        self.state = state
        self.owner = owner
        self.pre_backward = _internals().pre_backward
        device_type = state._device.type
        self.device_types = ("cpu",) if device_type == "cpu" else ("cpu", device_type)
        self.may_move = device_type in _MOVING_DEVICE_TYPES
        self.modules_of_state = [module for module, _ in slots]
        self.modules = [_Module(self, module, s) for module, s in slots]

    def casts(self) -> bool:
        """Whether the patch casts in FSDP's place in ``PRE_BACKWARD``."""
        return _internals().needs_cast_replay or _force

    def remove(self) -> None:
        """Take the patch off every module of the state; FSDP's hooks are as they were."""
        for module_cover in self.modules:
            module_cover.remove()


@functools.wraps(torch.nn.Module.register_forward_pre_hook)
def _register_forward_pre_hook(self: torch.nn.Module, hook: Any, *args: Any, **kwargs: Any) -> Any:
    # Installed on FSDPModule while modules are covered: a pre-hook registered with prepend=True runs
    # before FSDP's, so the patch's lead pre-hook must be placed before it, before the next call.
    handle = _nn_register_forward_pre_hook(self, hook, *args, **kwargs)
    if kwargs.get("prepend"):
        cover = _covers.get(id(_internals().state_of(self)))
        for module_cover in cover.modules if cover is not None else ():
            if module_cover.slots.entry.hooks is self._forward_pre_hooks:  # type: ignore[attr-defined]
                module_cover._place_lead(self)
    return handle


def _nn_register_forward_pre_hook(module: torch.nn.Module, hook: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's own ``register_forward_pre_hook`` (its class's, or ``nn.Module``'s), not the patch's."""
    return super(_internals().fsdp_module_cls, module).register_forward_pre_hook(hook, *args, **kwargs)


def _intercept_pre_hook_registration(on: bool) -> None:
    cls = _internals().fsdp_module_cls
    installed = cls.__dict__.get("register_forward_pre_hook") is _register_forward_pre_hook
    if on and not installed:
        if "register_forward_pre_hook" in cls.__dict__:
            raise _compat.UnsupportedTorchError("FSDPModule.register_forward_pre_hook", "defined by torch")
        cls.register_forward_pre_hook = _register_forward_pre_hook  # type: ignore[attr-defined]
    elif not on and installed:
        del cls.register_forward_pre_hook  # type: ignore[attr-defined]


def _cast(dtype: torch.dtype, tree: Any) -> Any:
    internals = _internals()
    return internals.apply_to_tensors(functools.partial(internals.cast_fp_tensor, dtype), tree)


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
    forward and in the recompute, and a recompute drops autocast's cached casts first (a cast cached by
    the forward, made without gradients, would cut the recompute off from the parameters).

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
        call_site = _capture(device_types)

        @functools.wraps(function)
        def run(*run_args: Any, **run_kwargs: Any) -> Any:
            if _graph_task_id() != -1:  # the recompute, inside backward
                _clear_autocast_cache()
            if _capture(device_types) == call_site:
                return function(*run_args, **run_kwargs)
            with _enter(call_site, device_types):
                return function(*run_args, **run_kwargs)

        return checkpoint_fn(run, *args, **kwargs)

    return checkpoint_with_autocast


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
            state = internals.state_of(module)
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
