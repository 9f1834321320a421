"""When autocast's cached casts are kept out, or dropped (pytorch issue 158232).

Autocast caches the cast of each float32 leaf that requires grad until its outermost region ends, and FSDP2 runs
every forward on the same unsharded parameters. A cast cached by one pass and reused by a later pass whose
backward runs on its own loses that pass's parameter gradients: before torch 2.12 a cast made under ``no_grad``
has no autograd history, and in any torch the reused cast's backward runs after FSDP's post-backward hook of that
pass reduced the gradients. Two kinds of covered call make such casts:

* A call under ``no_grad`` (an eval pass, a reentrant checkpoint's forward) is *shielded* (:func:`shield`): its
  gathered parameters carry torch's mark that keeps a tensor's casts out of autocast's cache
  (:class:`~._compat.CacheMarks`), so it neither caches a cast nor reuses one.
* A recompute in a backward notes a *hazard* for its FSDP state: its casts must not reach the state's calls outside
  that backward (a second backward with ``retain_graph``, the next forward in the same region). Unless
  ``torch.utils.checkpoint`` runs it inside its own autocast regions and no other: leaving them clears the cache
  (:func:`_dies_with_region`, checked at the backward's end by :func:`_verify`).

A function checkpointed through :func:`fsdp_autocast_fix.preserve_autocast` whose forward runs under ``no_grad``
notes a hazard for every state (its casts may be of parameters no covered call gathers).

Invariants:

* A state's parameters are marked from its ``no_grad`` call until the state's next covered grad-enabled call under
  autocast with the cache on (before it casts anything), the end of the registered method's call that marked
  them, or the patch's removal. So casts a grad-enabled pass cached before an eval stay for the passes after it.
  The process-wide flag that makes marks count is turned on with the first mark and left on: CUDA graph trees use
  it too, and with nothing marked it changes no result.
* The cache is dropped before a grad-enabled call under autocast (covered, or checkpointed through
  ``preserve_autocast``) exactly when a hazard for its FSDP state (or every state) was noted under ``no_grad`` or
  in another backward, and the cache still holds what it held then; nowhere else. So the calls of one forward,
  of one region and its recompute, and other modules (a frozen teacher) share casts as plain autocast does. A
  *sentinel* tells whether the cache still holds it: an empty cast of the patch's own, cached beside the first
  hazard's casts and held by a weak reference, dies with the region end that clears the cache.

A state whose parameters are all-gathered in another dtype has no cached casts, so no hazard
(:func:`caches_parameters`, :func:`trainable_casts`). Two forward passes of one module in one region, backwarded
separately without a checkpoint, are left to torch: whether they will be backwarded together (then sharing is
exact) is not known at the second forward. This bookkeeping is per thread while autocast's cache is the process's:
a hazard noted on one thread is not seen on another (docs/how-it-works.md).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch

from . import _autocast, _compat, _report

_tls = threading.local()
#: How many threads hold hazards: the one thing an ordinary grad-enabled call reads when none does.
active = 0
#: A hazard's scope: the FSDP state whose parameters' casts it concerns, or every state.
EVERY_STATE: Any = object()
_sentinels: dict[str, torch.Tensor] = {}


def _same(t: Any) -> Any:
    return t  # pragma: no cover - the sentinel's op is never backwarded


class _Hazards:
    """This thread's hazards since the last drop.

    ``by_state``: FSDP state key -> the graph task that made the casts (-1: under ``no_grad``); ``lifetime``: the
    sentinel of the cache's lifetime then; ``skipped``: recomputes left unnoted by :func:`_dies_with_region` (state
    key -> graph task and device types), until :func:`_verify` at the end of their backward (after a backward that
    raised, at the end of the next one that skips)."""

    __slots__ = ("by_state", "lifetime", "skipped", "verifying")

    def __init__(self) -> None:
        self.by_state: dict[Any, int] = {}
        self.lifetime: Any = None
        self.skipped: dict[Any, tuple[int, tuple[str, ...]]] = {}
        self.verifying: int | None = None  # the graph task whose end verifies ``skipped``


def _hazards() -> _Hazards:
    try:
        return _tls.hazards  # type: ignore[no-any-return]
    except AttributeError:
        _tls.hazards = _Hazards()
        return _tls.hazards  # type: ignore[no-any-return]


def caches_parameters(param_dtype: Any, modules: list[torch.nn.Module]) -> bool:
    """Whether autocast can cache casts of the unsharded parameters of an FSDP state with this ``param_dtype``
    over ``modules``: they are float32 once all-gathered. If not, the state's calls neither note nor drop (a drop
    would only take other modules' shared casts). Without a ``param_dtype`` the modules' parameters tell, nested
    sharded modules' included (at worst a hazard too many). Parameters FSDP does not manage (``ignored_params``)
    are left to autocast."""
    if param_dtype is not None:
        return param_dtype == torch.float32  # type: ignore[no-any-return]
    return any(p.dtype == torch.float32 for module in modules for p in module.parameters())


def trainable_casts(param_dtype: Any, parameters: list[torch.Tensor] | None) -> bool:
    """Whether autocast may cache a cast of one of an FSDP state's sharded ``parameters`` now: one requires grad and
    is float32 once all-gathered. True where ``parameters`` is None (this torch does not say)."""
    if parameters is None:
        return True
    return any(p.requires_grad and (param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype)
               == torch.float32 for p in parameters)


def before_call(state: Any, task: int, grad: bool, device_types: tuple[str, ...], owner: str,
                trainable: Any) -> None:
    """The cache decision for a covered call of ``state`` under autocast with the cache on, before FSDP's
    pre-forward. ``task``: its graph task (-1 outside backward); ``trainable()``: :func:`trainable_casts` for the
    state, asked only where it matters.

    A ``no_grad`` call is left to :func:`shield`, after FSDP's pre-forward. A grad-enabled call takes its state's
    marks off, drops the cache where a hazard applies (:func:`check`), then, in a recompute, notes its own casts."""
    if not grad:
        return
    if _shielded:
        unshield(state, owner)
    if active:
        check(state, task, owner)
    if task != -1 and trainable():
        note(state, task, device_types)


# -- the shield: a no_grad call's casts stay out of the cache -----------------------------------------


class _Marks:
    """The marks :func:`shield` put on one FSDP state's gathered parameters (weak references).

    ``owner``: a weak reference to the state's cover (the state key is its ``id``, which another cover may take
    once it is freed); ``caller``: the registered method's frame, None for a forward call; ``lifetime``: the
    sentinel then (:func:`_sentinel_cast`), as the report counts a shield only where a grad-enabled call came in the
    same lifetime."""

    __slots__ = ("owner", "parameters", "caller", "lifetime")

    def __init__(self, owner: Any, parameters: list[torch.Tensor], caller: Any, lifetime: Any) -> None:
        self.owner = weakref.ref(owner)
        self.parameters = [weakref.ref(p) for p in parameters]
        self.caller = caller
        self.lifetime = lifetime


#: FSDP state key -> the marks on its gathered parameters (see :func:`shield`).
_shielded: dict[Any, _Marks] = {}


def shield(state: Any, owner: Any, parameters: list[torch.Tensor], device_types: tuple[str, ...],
           caller: Any = None) -> None:
    """Mark the ``parameters`` FSDP's pre-forward just gathered for a ``no_grad`` call of ``state`` under autocast
    with the cache on: those autocast would cache (float32 leaves that require grad). ``owner``: the state's cover;
    ``caller``: a registered method's frame, whose post-forward takes the marks off (:func:`end_of_method`)."""
    marked = _shielded.get(state)
    if marked is not None:
        if marked.owner() is owner:
            return
        unshield(state)  # a freed cover's, whose id this one has now
    marks = _compat.load().cache_marks
    chosen = [p for p in parameters if p.requires_grad and p.dtype == torch.float32 and p.is_leaf]
    if not chosen:
        return
    forget_freed()
    marks.enable(True)  # and left on (see the module docstring)
    mine = [p for p in chosen if not marks.marked(p)]
    for parameter in mine:
        marks.add(parameter)
    _shielded[state] = _Marks(owner, mine, caller, _sentinel_cast(device_types) if mine else None)


def end_of_method(state: Any, caller: Any) -> None:
    """A registered method's call ends (its post-forward): take off the marks it put, if it did."""
    marked = _shielded.get(state)
    if marked is not None and marked.caller is caller:
        unshield(state)


def unshield(state: Any, owner: str | None = None) -> None:
    """Take :func:`shield`'s marks off ``state``'s parameters. A parameter freed since leaves its mark on an object
    torch holds weakly, at no address a new tensor can take. ``owner``: the module class whose call does so, for
    the report."""
    marked = _shielded.pop(state, None)
    if marked is None:
        return
    marks = _compat.load().cache_marks
    marks.enable(True)  # another user may have turned it off since: removing a mark needs it on
    for ref in marked.parameters:
        parameter = ref()
        if parameter is not None:
            marks.remove(parameter)
    if owner is not None and marked.parameters and (marked.lifetime is None or marked.lifetime() is not None):
        _report.count(owner, "cache_shields")


def forget_freed() -> None:
    """Take off the marks of covers freed since they were put (their model was freed)."""
    for state in [state for state, marked in _shielded.items() if marked.owner() is None]:
        unshield(state)


def _alive(hazards: _Hazards) -> Any:
    """The sentinel of the cache's lifetime, or None; a dead one (the cache was cleared since) takes the
    lifetime's hazards with it."""
    lifetime = hazards.lifetime
    if lifetime is not None and lifetime() is None:
        _reset(hazards)
        return None
    return lifetime


def note(state: Any, task: int, device_types: tuple[str, ...], shortcut: bool = True) -> None:
    """Note a hazard for ``state``: casts made under ``no_grad`` (``task`` -1: a ``preserve_autocast`` function) or
    in the recompute of graph task ``task``. ``shortcut``: skip a recompute whose casts die with the checkpoint's
    regions (:func:`_dies_with_region`)."""
    global active
    hazards = _hazards()
    by_state = hazards.by_state
    _alive(hazards)  # a cleared cache: the hazards noted before are gone
    if by_state.get(state) == -1:  # a no_grad hazard outranks any other (an eval pass notes one per call)
        return
    if not by_state:
        if shortcut and task != -1 and _dies_with_region():
            _skip(hazards, state, task, device_types)
            return
        active += 1
        if hazards.lifetime is None:
            hazards.lifetime = _sentinel_cast(device_types)
    if task == -1 or by_state.get(state) != -1:  # a no_grad hazard outranks a recompute's
        by_state[state] = task


def _dies_with_region() -> bool:
    """Whether the casts a recompute makes now are dropped before this thread runs anything outside its backward:
    ``torch.utils.checkpoint``'s recompute (either mode) runs the call inside its own autocast regions and no other
    region is open, so leaving them takes autocast's nesting count to zero, which clears the cache. A region
    spanning the backward raises the count: then the casts outlive the backward."""
    depth = _autocast.nesting()
    return depth <= 2 and _compat.torch_recompute_regions() == depth


def _skip(hazards: _Hazards, state: Any, task: int, device_types: tuple[str, ...]) -> None:
    """Leave a recompute's hazard unnoted (:func:`_dies_with_region`), to be verified at the end of its backward."""
    hazards.skipped[state] = (task, device_types)
    if hazards.verifying != task:
        hazards.verifying = task
        _compat.load().queue_backward_callback(functools.partial(_verify, hazards, threading.get_ident()))


def _verify(hazards: _Hazards, thread: int) -> None:
    """At the end of a backward whose recomputes' hazards were skipped: where autocast's nesting count is not back
    at zero on their thread, a region a recompute opened was left open (an early stop skipped the hook that leaves
    it), so the cache may still hold their casts: note them now. On another thread the count cannot be read, and
    the skip stands."""
    skipped = dict(hazards.skipped)
    hazards.skipped.clear()
    hazards.verifying = None
    if threading.get_ident() != thread or _autocast.nesting() == 0:
        return
    for state, (task, device_types) in skipped.items():
        note(state, task, device_types, shortcut=False)


def check(state: Any, task: int, owner: str) -> None:
    """Before a grad-enabled call of ``state`` in graph task ``task`` under autocast with the cache on: drop the
    cache if a hazard for this state applies and its casts are still cached."""
    hazards = _hazards()
    made_in = hazards.by_state.get(state, hazards.by_state.get(EVERY_STATE))
    if made_in is None or (made_in != -1 and made_in == task):
        return  # no hazard here, or casts of this very backward (a region's sharded calls share them)
    if _still_cached(hazards):
        torch.clear_autocast_cache()
        _report.count(owner, "cache_drops")
    _reset(hazards)


def _reset(hazards: _Hazards) -> None:
    """Forget the hazards of the cache's lifetime (the cache was dropped or cleared)."""
    global active
    if hazards.by_state:
        active -= 1
    hazards.by_state.clear()
    hazards.lifetime = None


def _sentinel_cast(device_types: tuple[str, ...]) -> Any:
    """A weak reference to the sentinel: a cast, made now through autocast's cache, of the patch's own empty
    parameter-like tensor. None where it cannot be made (then the cache is assumed to hold the hazard's casts)."""
    internals = _compat.load()
    if torch.is_inference_mode_enabled() or internals.function_mode_enabled():
        return None  # a function mode would see the sentinel's op
    for device_type in device_types:
        if torch.is_autocast_enabled(device_type):
            break
    else:
        return None
    source = _sentinels.get(device_type)
    if source is None:
        try:
            source = _sentinels[device_type] = torch.empty(0, 0, device=device_type, requires_grad=True)
        except Exception:  # pragma: no cover - a device type torch cannot allocate on here
            return None
    # The op saves the cached cast; our own saved-tensor hook catches it, so that a checkpoint's saved-tensor hooks
    # (and, with the modes disabled, selective checkpointing's dispatch mode) do not count the op as the region's.
    saved: list[torch.Tensor] = []
    grad = torch.is_grad_enabled()
    try:
        internals.push_saved_hooks(saved.append, _same)  # raises where saved-tensor hooks are disabled
    except RuntimeError:
        return None
    try:
        internals.set_grad_enabled(True)
        if internals.dispatch_modes() or internals.pre_dispatch_modes():
            with internals.disable_current_modes():
                torch.mm(source, source)
        else:
            torch.mm(source, source)
    except Exception:  # a backend whose autocast does not cast mm, say: no sentinel
        return None
    finally:
        internals.set_grad_enabled(grad)
        internals.pop_saved_hooks()
    return weakref.ref(saved[0]) if saved else None


def _still_cached(hazards: _Hazards) -> bool:
    """Whether autocast's cache still holds what it held when the first hazard was noted (no sentinel: assume it
    does). The cache holds the only reference to the sentinel; a region end or a drop frees it."""
    return hazards.lifetime is None or hazards.lifetime() is not None
