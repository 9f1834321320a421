"""What a recompute replays, and how it is undone.

A recompute (a covered module's forward inside a backward) is replayed by the module's :class:`Replayer`:

* The outermost covered module of the recompute finds its call in its :class:`~._calls.CallLog` and enters that
  call's autocast state where the current one differs. Under a checkpoint that restores autocast itself
  (``torch.utils.checkpoint`` and what runs on it, :func:`fsdp_autocast_fix.preserve_autocast`) the state is never
  changed. Modules called inside it re-run as in the forward and need nothing. Later sharded calls of the same
  region follow its first call (:class:`Region`).
* In ``PRE_BACKWARD`` FSDP skips its root input move, in torch 2.4-2.12 its casts, and before torch 2.11 the
  gather of parameters resharded since the forward. The replay does what the call's forward did, in FSDP's
  place: right after FSDP's pre-hook (:meth:`Replayer.gather`, :meth:`Replayer.pre_casts`) and in FSDP's
  forward-hook entry (:meth:`Replayer.post_forward`), so user hooks see what they saw in the forward. A method
  registered with ``register_fsdp_forward_method`` runs no hook: its calls of FSDP's pre- and post-forward do it.

Invariant: every replay :meth:`Replayer.start` begins is undone exactly once: by :meth:`Replayer.exit` (the
module's last forward hook, ``always_call``, so also on errors and checkpoint's early stop); by a registered
method's post-forward (:meth:`Replayer.method_exit`), or, where the method unwound without it,
:meth:`Replayer.abandon` at the thread's next recompute or the backward's end; or, after a ``KeyboardInterrupt``
skipped the hooks, :meth:`Replayer.drop_stale` at the module's next ordinary call. Nothing else changes autocast.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import _autocast, _cache, _calls, _compat, _report
from ._calls import Call, Stamped

if TYPE_CHECKING:
    from ._calls import CallLog
    from ._hooks import Placement

logger = logging.getLogger("fsdp_autocast_fix")


class _Thread(threading.local):
    """This thread's replay state: its outermost recomputes in flight (``frames``), its current :class:`Region`,
    the backward whose end releases its hold (``ending``), how many :func:`restored` blocks it is in, and the
    registered methods' replays in flight (``methods``), with the backward whose end sweeps those left behind
    (``sweeping``)."""

    def __init__(self) -> None:
        self.frames: list[Replay] = []
        self.region: Region | None = None
        self.ending: int | None = None
        self.restored = 0
        self.methods: list[Replay] = []
        self.sweeping: int | None = None


_tls = _Thread()

#: The casts FSDP does for a module sharded alone: its inputs and its output, every call.
ALL_CAST = (True, True)


class Region:
    """The recompute region whose first sharded call was replayed last on this thread.

    Its later sharded calls (same graph task and backward node; their inputs are computed in the region, so no
    record names them) follow that call's state, unless the region's code changed autocast since. Where the replay
    entered a state, the region holds it, paused between its calls, so that they share autocast's cached casts as
    in the forward. The hold ends when a backward first reaches the output of a replayed call
    (:func:`_end_when_backwarded`), when another region starts on this thread, when the backward ends, or at the
    next ordinary forward.
    """

    __slots__ = ("where", "call", "now", "entered", "depth")

    def __init__(self, where: tuple[int, Any], call: Call, now: Any, entered: _autocast.Entered | None,
                 depth: int) -> None:
        self.where, self.call, self.now, self.entered = where, call, now, entered
        #: autocast's nesting count between the region's calls: at its start, plus what the hold keeps
        self.depth = depth + (len(entered.device_types) if entered is not None else 0)

    def let_go(self) -> None:
        """End the hold, not the region: its later calls (if any) enter the state again (:meth:`enter_again`)."""
        global held
        entered = self.entered
        if entered is not None:
            held -= 1
            self.depth -= len(entered.device_types)
            self.entered = None
            entered.release(restore=True)

    def enter_again(self, device_types: tuple[str, ...]) -> None:
        """A later call of a region whose hold was let go: hold the call's state again."""
        self.entered = _autocast.Entered(self.call.autocast, device_types)
        self.depth += len(device_types)
        self.start()

    def follows(self, here: tuple[int, Any], now: Any) -> bool:
        """Whether a sharded call at ``here`` under ``now`` is a later call of this region whose code left
        autocast alone: same backward node, same state, and no autocast context of the region's own open."""
        return self.where == here and self.now == now and _autocast.nesting() == self.depth

    @staticmethod
    def current() -> Region | None:
        """This thread's current region, if it has one."""
        return _tls.region

    def start(self) -> None:
        """Make this the thread's current region (the one before was released). A hold in a backward queues
        :func:`_end_of_backward`, once per backward and thread, to release whichever region holds at its end."""
        global held
        _tls.region = self
        if self.entered is not None:
            held += 1
            graph_task = self.where[0]
            if graph_task != -1 and _tls.ending != graph_task:
                _tls.ending = graph_task
                _compat.load().queue_backward_callback(functools.partial(_end_of_backward, graph_task))


@contextlib.contextmanager
def restored() -> Iterator[None]:
    """A block whose autocast state is the forward's, restored by the checkpoint (``preserve_autocast``'s)."""
    _tls.restored += 1
    try:
        yield
    finally:
        _tls.restored -= 1


def _state_restored() -> bool:
    """Whether the checkpoint running this recompute restored the forward's autocast state itself: inside
    :func:`restored`, or in ``torch.utils.checkpoint``'s recompute (:func:`~._compat.in_torch_recompute`)."""
    return bool(_tls.restored) or _compat.in_torch_recompute()


#: How many regions hold an entered state, on any thread (ordinary forwards check it).
held = 0


def release_region(restore: bool = False) -> None:
    """End this thread's current region and its hold. ``restore``: put the state from before an active hold back;
    otherwise the state is left as it is (a paused hold's exit put it back; after an interrupt, autograd did)."""
    region = _tls.region
    if region is not None:
        _end(region, restore)


def _end(region: Region, restore: bool = False) -> None:
    """:func:`release_region` of ``region``, this thread's current region."""
    global held
    _tls.region = None
    if region.entered is not None:
        held -= 1
        region.entered.release(restore)


def _end_of_backward(graph_task: int) -> None:
    """At the end of backward ``graph_task``: release this thread's region if it belongs to that backward. The
    pending mark is cleared first, so a hold started later in the same backward (a final callback's forward)
    queues its own release."""
    if _tls.ending == graph_task:
        _tls.ending = None
    region = _tls.region
    if region is not None and region.where[0] == graph_task and (
            region.entered is None or region.entered.thread == threading.get_ident()):
        release_region()  # (a region whose hold was let go ends here too)


def _end_when_backwarded(output: Any, entered: _autocast.Entered) -> None:
    """End the hold of ``entered`` (:meth:`Region.let_go`) when a backward first reaches a tensor of ``output``.
    The checkpoint backwards the recomputed graph once its function returned, so the held casts go then, not at
    the end of the whole backward: no more than one region's casts are alive at once, as without the patch. A
    backward inside the region (a gradient penalty's) lets go early; a later call enters the state again."""
    def end(_grads: Any) -> None:
        region = _tls.region
        if region is not None and region.entered is entered and entered.thread == threading.get_ident():
            region.let_go()

    for tensor in _calls.tensors(output):
        node = tensor.grad_fn
        if node is not None:
            node.register_prehook(end)


def _drop_unwound() -> None:
    """Undo this thread's registered-method replays whose method call is no longer on the stack: it raised (as
    checkpoint's early stop does) before its post-forward."""
    live = set()
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        live.add(id(frame))  # each replay's caller is held by the replay: its id is not reused meanwhile
        frame = frame.f_back
    for replay in [r for r in _tls.methods if id(r.caller) not in live]:
        replay.owner.abandon(replay)  # type: ignore[union-attr]


def _sweep_methods(graph_task: int) -> None:
    """The end of backward ``graph_task``: drop the registered methods' replays it left behind."""
    if _tls.sweeping == graph_task:
        _tls.sweeping = None
    if _tls.methods:
        _drop_unwound()


class Replay:
    """One recompute of a module: what FSDP's forward did that this torch skips, and what to undo after.

    ``graph_task``: the backward it runs in, for the outermost covered module of the recompute (then the replay is
    on this thread's ``frames`` until undone), else None. ``moved``, ``cast_in``, ``cast_out``: what the patch does
    in FSDP's place. ``caller``: a registered method's frame, held until its post-forward undoes the replay, else
    None. ``owner``: the :class:`Replayer` whose replay it is."""

    __slots__ = ("graph_task", "entered", "moved", "cast_in", "cast_out", "pre_pending", "caller", "owner")

    def __init__(self, graph_task: int | None, entered: _autocast.Entered | None, moved: bool, cast_in: bool,
                 cast_out: bool) -> None:
        self.graph_task, self.entered = graph_task, entered
        self.moved, self.cast_in, self.cast_out = moved, cast_in, cast_out
        self.pre_pending = moved or cast_in  # done right after FSDP's pre-hook, by the entry
        self.caller: Any = None
        self.owner: Replayer | None = None


class _Undo:
    """The replays in flight of one covered module, and their undo (the module docstring's invariant)."""

    __slots__ = ("cover", "key", "log", "placement", "grouped", "name", "replays", "warned", "__weakref__")

    def __init__(self, cover: Any, log: CallLog, placement: Placement, grouped: bool, name: str) -> None:
        self.cover, self.log, self.placement, self.grouped = cover, log, placement, grouped
        self.key = id(cover)  # the cast-cache hazards are kept per FSDP state
        self.name = name  # the module's class, as the report names it
        self.replays: list[Replay] = []
        self.warned = False

    def _track(self, replay: Replay, module: torch.nn.Module, caller: Any) -> None:
        """Put ``replay`` in flight: install the exit hook (and the output cast in FSDP's forward-hook entry), or,
        for a registered method (``caller``: its frame), leave the undo to its post-forward."""
        if replay.graph_task is not None:
            _tls.frames.append(replay)
        self.replays.append(replay)
        if caller is not None:
            replay.caller = caller
            _tls.methods.append(replay)
            graph_task = _compat.load().graph_task_id()
            if _tls.sweeping != graph_task:
                _tls.sweeping = graph_task
                _compat.load().queue_backward_callback(functools.partial(_sweep_methods, graph_task))
            return
        if replay.cast_out:
            self.placement.swap_post(True)
        self.placement.register_exit(module)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Last forward hook while a replay is in flight: undo what :meth:`start` changed, also on errors."""
        if _tls.methods:  # a registered method called in this forward may have unwound without its post-forward
            _drop_unwound()
        if not self.replays:  # a stale registration after an exception: drop it now
            self._let_exit_go()
            return
        replay = self.replays.pop()
        try:
            self._finish(replay, output)
        finally:
            if not self.replays:
                self._let_exit_go()

    def _let_exit_go(self) -> None:
        """Take the exit hook off once no replay is in flight: now, or, where the module's call is unwinding, at the
        end of the backward (outside backward, at the module's next call)."""
        if not self.placement.unregister_exit() and _compat.load().graph_task_id() != -1:
            _compat.load().queue_backward_callback(self._drop_exit_if_idle)

    def _drop_exit_if_idle(self) -> None:
        if not self.replays:
            self.placement.drop_exit()

    def method_exit(self, replay: Replay, output: Any) -> Any:
        """A registered method's post-forward, after FSDP's, in a replay it started: the output cast, then the
        undo."""
        if replay.cast_out:
            _report.count(self.name, "output_casts")
            output = _cast(self.cover.state._mp_policy.output_dtype, output)
        self.replays.remove(replay)
        self._finish(replay, output)
        return output

    def abandon(self, replay: Replay) -> None:
        """Undo a registered method's replay whose call unwound without its post-forward (an error, or
        checkpoint's early stop)."""
        if replay in self.replays:
            self.replays.remove(replay)
        self._finish(replay, None)

    def _finish(self, replay: Replay, output: Any) -> None:
        """Undo ``replay`` (taken off the replays in flight); its entered state paused, its region's hold to end
        when a backward reaches ``output``."""
        try:
            self._undo(replay)
        finally:
            if replay.entered is not None:
                replay.entered.pause()
                _end_when_backwarded(output, replay.entered)

    def _undo(self, replay: Replay) -> None:
        if replay.cast_out and not any(r.cast_out for r in self.replays):
            self.placement.swap_post(False)
        if replay.graph_task is not None:
            stack_of_frames = _tls.frames
            if replay in stack_of_frames:
                stack_of_frames.remove(replay)
        if replay.caller is not None:  # a registered method's: its frame is let go
            if replay in _tls.methods:
                _tls.methods.remove(replay)
            replay.caller = None

    def drop_stale(self) -> None:
        """Forget the replays a ``KeyboardInterrupt`` left behind (it skips ``always_call`` hooks). Autograd put the
        autocast state back as the backward unwound; releasing the region's hold without restoring repairs the rest
        (autocast's nesting count, and outside any region the cache flag)."""
        while self.replays:
            replay = self.replays.pop()
            self._undo(replay)
            region = Region.current()
            if replay.entered is not None and region is not None and region.entered is replay.entered:
                release_region()  # on this thread; a worker thread's counters are its own
        self.placement.drop_exit()

    def close(self) -> None:
        """Leave every replay in flight (the patch is being removed), and its region's hold on this thread."""
        region = Region.current()
        if region is not None and any(r.entered is region.entered for r in self.replays if r.entered is not None):
            release_region(restore=True)
        self.replays.clear()


class _InFsdpsPlace(_Undo):
    """What a replay does in FSDP's place (the module docstring's second point)."""

    __slots__ = ()

    def _casts_of(self, module: torch.nn.Module) -> tuple[bool, bool]:
        """FSDP's casts for a recompute of ``module`` that no record names: all of them for a module sharded alone;
        for one of ``fully_shard([a, b])``, those of its latest ordinary call (they depend on its place in the
        group's pass, which a recompute, run in reverse order, cannot read off FSDP's state)."""
        if not self.grouped:
            return ALL_CAST
        last = self.log.last
        return (last.cast_in, last.cast_out) if last is not None else _compat.group_casts(self.cover.state, module)

    def _in_fsdps_place(self, call: Call, graph_task: int | None, entered: _autocast.Entered | None) -> Replay | None:
        """The replay of ``call``: the root move and casts its forward did, where FSDP skips them and the policy
        makes them (a cast to no dtype is none); None where an inner module (``graph_task`` None) has nothing to
        do."""
        cover = self.cover
        state = cover.state
        moved, cast_in, cast_out = call.moved, call.cast_in, call.cast_out
        if state._training_state is cover.pre_backward:
            casts = cover.casts()
            policy = state._mp_policy
            cast_in = cast_in and casts and policy.cast_forward_inputs and policy.param_dtype is not None
            cast_out = cast_out and casts and policy.output_dtype is not None
        else:
            moved = cast_in = cast_out = False
        if graph_task is None and not (moved or cast_in or cast_out):
            return None
        replay = Replay(graph_task, entered, moved, cast_in, cast_out)
        replay.owner = self
        return replay

    def gather(self) -> None:
        """In ``PRE_BACKWARD``, right after FSDP's pre-forward: gather the state's parameters resharded since the
        forward (a module run twice before one backward), as torch 2.11+ does."""
        if _compat.gather_parameters(self.cover.state):
            _report.count(self.name, "param_gathers")

    def pre_casts(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
        """Right after FSDP's pre-hook in a replay: the root move and input cast its forward did."""
        replay = self.replays[-1]
        replay.pre_pending = False
        if result is not None:
            args, kwargs = result
        state = self.cover.state
        if replay.moved:  # no torch release replays this
            args_tuple, kwargs_tuple = _compat.load().to_kwargs(args, kwargs, state._device, False)
            args, kwargs = args_tuple[0], kwargs_tuple[0]
            _report.count(self.name, "root_moves")
        if replay.cast_in:  # the policy casts inputs (see _in_fsdps_place)
            dtype = state._mp_policy.param_dtype
            args, kwargs = _cast(dtype, args), _cast(dtype, kwargs)
            _report.count(self.name, "input_casts")
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, input: Any, output: Any) -> Any:
        """In the place of FSDP's forward hook during a replay: FSDP's hook, then the output cast it did."""
        output = self.placement.fsdp_post_call(module, input, output)
        _report.count(self.name, "output_casts")  # swapped in only where the policy has an output dtype
        return _cast(self.cover.state._mp_policy.output_dtype, output)


class Replayer(_InFsdpsPlace):
    """The replays of one covered module: which recorded call a recompute replays, the state it enters, and what
    it does in FSDP's place."""

    __slots__ = ()

    def nested_call(self, module: torch.nn.Module) -> Call:
        """The record of a forward call inside a recompute, as it runs now (after :meth:`start`): the autocast
        state, no root move (it is not a forward pass's first call), FSDP's casts as for a call no record names."""
        return Call(_autocast.capture(self.cover.device_types), False, *self._casts_of(module))

    def start(self, module: torch.nn.Module, tensors: list[torch.Tensor], caller: Any = None) -> None:
        """A recompute of ``module`` begins (``tensors``: its leaves): enter its call's state if needed and set up
        what this torch skips. ``caller``: a registered method's frame, whose post-forward undoes the replay."""
        cover, internals = self.cover, _compat.load()
        graph_task = internals.graph_task_id()
        if _tls.frames and _tls.frames[0].graph_task != graph_task:  # left by an earlier backward
            _tls.frames.clear()
        if _tls.methods:
            _drop_unwound()
        outermost = not _tls.frames
        call, entered = None, None
        if outermost:  # the outermost covered module of this recompute: the call it replays
            call, entered = self._choose(module, tensors, _autocast.capture(cover.device_types), graph_task)
            _report.count(self.name, "recomputes")
            if entered is not None:
                _report.count(self.name, "autocast_changed")
        # (inside a replayed module, a module re-runs as in the forward)
        if cover.caches_parameters and internals.any_autocast_enabled() and torch.is_autocast_cache_enabled():
            _cache.before_call(self.key, graph_task, torch.is_grad_enabled(), cover.device_types, self.name,
                               cover.trainable)
        replay = self._in_fsdps_place(call or Call(None, False, *self._casts_of(module)),
                                      graph_task if outermost else None, entered)
        if replay is not None:
            self._track(replay, module, caller)

    def _choose(self, module: torch.nn.Module, tensors: list[torch.Tensor], now: Any,
                graph_task: int) -> tuple[Call | None, _autocast.Entered | None]:
        """The recorded call to replay (None: leave the state as the checkpoint set it), and the entered state it
        runs under (its region's) where that differs from the current one. The thread's region before is released
        unless the call follows it. Where the checkpoint restored autocast (:func:`_state_restored`), the current
        state is kept."""
        node = _compat.load().current_node()  # where: the backward and the node that runs the recompute
        here = graph_task, node._sequence_nr() if node is not None else None
        region = _tls.region
        calls = self.log.find(tensors)
        if region is not None:
            if calls is None and region.follows(here, now):
                if region.entered is not None:
                    region.entered.resume()
                elif region.call.autocast != now:  # its hold was let go (a backward inside the region)
                    region.enter_again(self.cover.device_types)
                return Call(region.call.autocast, False, *self._casts_of(module)), region.entered
            _end(region)
        if calls is not None:
            chosen = self._pick(module, calls, node)
        elif not tensors and self.log.unkeyed is not None:  # no tensor arguments: the latest such call
            chosen = self.log.unkeyed
        else:
            self._unidentified(module, now)
            return None, None
        if chosen.autocast != now and _state_restored():
            chosen = chosen._replace(autocast=now)
        depth = _autocast.nesting()  # before the state is entered (the region's count adds the hold's)
        entered = _autocast.Entered(chosen.autocast, self.cover.device_types) if chosen.autocast != now else None
        Region(here, chosen, now, entered, depth).start()
        return chosen, entered

    def _pick(self, module: torch.nn.Module, calls: tuple[Stamped, ...], node: Any) -> Call:
        """The call a recompute replays among those recorded under its leaves (oldest first), run by the autograd
        node ``node``."""
        if len(calls) == 1:
            return calls[0].call  # type: ignore[no-any-return]
        # The same leaves under several states (an eval pass on the training batch, say). A reentrant-style
        # checkpoint recomputes in the backward of its own node, made right before its no_grad forward: the call
        # stamped first after that node is its own. Where a call ran with grad (no stamp): the most recent, warned.
        if node is not None and all(c.stamp >= 0 for c in calls):
            made = node._sequence_nr()
            after = [c for c in calls if c.stamp > made]
            if after:
                return min(after, key=lambda c: c.stamp).call  # type: ignore[no-any-return]
        if not self.warned:
            self.warned = True
            logger.warning(
                "%s ran forward on the same input under %d autocast states before this recompute; replaying the "
                "most recent. Wrap the checkpoint with fsdp_autocast_fix.preserve_autocast to make it exact",
                type(module).__name__, len({c.call for c in calls}))
        return calls[-1].call  # type: ignore[no-any-return]

    def _unidentified(self, module: torch.nn.Module, now: Any) -> None:
        """A recompute that no record names: counted and warned about (once) where the latest call ran under another
        autocast state and the checkpoint did not restore it."""
        last = self.log.last
        if last is None or last.autocast == now or _state_restored():
            return
        _report.unidentified(self.name, "no recorded call got its tensor arguments (computed in the region, or "
                                        "copied by the checkpoint)")
        if not self.warned:
            self.warned = True
            logger.warning(
                "%s: cannot tell which forward call this recompute replays (its tensor arguments are not the ones a "
                "recorded call received); leaving autocast as the checkpoint set it. If the checkpoint does not "
                "restore autocast, wrap it with fsdp_autocast_fix.preserve_autocast", type(module).__name__)


def _cast(dtype: torch.dtype, tree: Any) -> Any:
    internals = _compat.load()
    return internals.apply_to_tensors(functools.partial(internals.cast_fp_tensor, dtype), tree)
