"""When autocast's cached casts are kept out, or dropped (pytorch issue 158232).

Autocast caches the low-precision cast of each parameter it casts until its outermost region ends, and FSDP2
runs every forward on the same unsharded parameter tensors. A cast cached by one pass and reused by a later
pass whose backward runs on its own loses that pass's parameter gradients: before torch 2.12 a cast made under
``no_grad`` has no autograd history at all, and in any torch the reused cast's backward node is older than
FSDP's post-backward hook of the pass that reuses it, so its gradient reaches the parameter after FSDP has
reduced the gradients. Autocast caches a cast only of a float32 leaf that requires grad, so only such
parameters are at stake (:func:`caches_parameters` for the policy's dtype, :func:`trainable_casts` for
``requires_grad`` at the call). Two kinds of pass make such casts, and the patch sees both:

* a covered module's call under ``no_grad`` (an eval pass, a reentrant checkpoint's forward) is **shielded**
  (:func:`shield`): its gathered parameters carry torch's own mark for tensors whose casts autocast must neither
  read from nor write to its cache, so it caches nothing, and casts a grad-enabled pass cached before it stay
  there for the passes after it, exactly as without the eval;
* a covered module's recompute in one backward (graph task): its casts are a hazard for the module's calls
  outside that backward (a second backward with ``retain_graph``, the next forward in the same region), unless
  they are dropped before this thread runs anything outside it: a recompute run by ``torch.utils.checkpoint``
  (either mode) inside its own autocast regions and no other (autocast's nesting count is theirs alone) loses
  its casts when the checkpoint leaves them, so nothing is noted there (:func:`_dies_with_region`), unless the
  end of that backward finds the nesting count above zero on the thread (a region the recompute left open):
  then they are noted (:func:`_verify`). A function checkpointed through
  :func:`fsdp_autocast_fix.preserve_autocast` whose forward runs under ``no_grad`` notes a hazard for every
  state (its casts may be of parameters no covered call gathers).

Invariant: the patch drops the cache before a grad-enabled call of a covered module under autocast (ordinary or
recomputed, or a function checkpointed through :func:`fsdp_autocast_fix.preserve_autocast`) exactly when such
a hazard was noted for that module's FSDP state and the cache still holds what it held then; nowhere else. So
the sharded calls of one forward, of one checkpointed region and of its recompute, the forward passes of one
region, and modules other than the one with the hazard (a frozen teacher run under ``no_grad``, a reference
model) share their casts as plain autocast shares them. Whether the cache still holds what it held is told by a
sentinel: an empty (zero-element, so allocation-free) cast of the patch's own, cached beside the casts of the first
hazard and held by a weak reference; it is alive exactly as long as autocast's cache holds it, so it dies with
the region end that clears the cache (a backward outside autocast ends the forward's region: nothing is at stake
then, and nothing is dropped). A hazard
noted at the end of a backward (:func:`_verify`) gets no sentinel where autocast is off then: the cache is
assumed to hold its casts, and the next call it applies to drops it.

Two forward passes of one module in one autocast region backwarded separately without a checkpoint are left
to torch: no pass of the patch's runs between them, and whether they will be backwarded together (then sharing
is exact) is not known at the second forward.

Autocast's cache is the process's (a region's end on any thread empties it) and its nesting count the thread's;
this bookkeeping is the thread's, so a hazard noted on one thread is not seen by another thread's calls (where
autograd recomputes on a device thread of its own: see docs/how-it-works.md).
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
    """This thread's hazards since the last drop: FSDP state key -> the graph task that made the casts (-1: a
    ``no_grad`` call, a hazard for every later grad-enabled call); the sentinel cast of the cache's lifetime then
    (``lifetime``); and the recomputes whose hazards were not noted because their casts die with the checkpoint's
    regions (state key -> graph task and device types), until the end of their backward tells (:func:`_verify`;
    after a backward that raised, the end of the next one that skips)."""

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
    """Whether autocast's cache can hold casts of the unsharded parameters of an FSDP state with the policy's
    ``param_dtype`` over ``modules``: autocast caches only the casts of float32 leaves that require grad, so a
    state whose parameters are all-gathered in another dtype (bf16 parameters, say) never has a cast cached and
    never a hazard (its calls neither note nor drop: dropping the cache for it would only take other modules'
    shared casts). Without a ``param_dtype``, the modules' own parameters tell (those of nested sharded modules
    included: at worst a hazard too many, never one too few). Parameters FSDP does not manage
    (``ignored_params``) are left to autocast, as any unsharded module's are."""
    if param_dtype is not None:
        return param_dtype == torch.float32  # type: ignore[no-any-return]
    return any(p.dtype == torch.float32 for module in modules for p in module.parameters())


def trainable_casts(param_dtype: Any, parameters: list[torch.Tensor] | None) -> bool:
    """Whether autocast may cache a cast of one of an FSDP state's parameters now: one that requires grad and
    is float32 once all-gathered (``param_dtype``, where the policy sets one, for floating-point parameters; else
    its own dtype). ``parameters``: the state's sharded parameters, or None where this torch does not say (then
    yes: at worst a hazard too many)."""
    if parameters is None:
        return True
    return any(p.requires_grad and (param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype)
               == torch.float32 for p in parameters)


def before_call(state: Any, task: int, grad: bool, device_types: tuple[str, ...], owner: str,
                trainable: Any) -> None:
    """The cast-cache decision for a covered call of ``state`` under autocast with the cache on (see the module
    docstring), before FSDP's pre-forward: in graph task ``task`` (-1 outside backward), with grad enabled or
    not; ``trainable()`` tells whether the state has parameters autocast caches now (:func:`trainable_casts`),
    asked only where it matters.

    A ``no_grad`` call is shielded after FSDP's pre-forward (:func:`shield`; where this torch's autocast does not
    honour the marks, it notes a hazard instead); a grad-enabled call first takes its state's shield off, drops
    the cache where a hazard applies, then, in a recompute, notes its casts."""
    if not grad:
        if _compat.load().cache_marks is None and trainable():
            note(state, -1, device_types)
        return
    if _shielded:
        unshield(state, owner)
    if active:
        check(state, task, owner)
    if task != -1 and trainable():
        note(state, task, device_types)


# -- the shield: a no_grad call's casts stay out of the cache -----------------------------------------


class _Marks:
    """The marks :func:`shield` put on one FSDP state's gathered parameters: weak references to them, and to the
    state's cover (``owner``: its key, an ``id``, may be another cover's once it is freed); the registered method
    call that put them (``caller``: its frame, whose post-forward takes them off; None for a forward call); and
    the sentinel of the cache's lifetime then (``lifetime``, see :func:`_sentinel_cast`: for the report, which
    counts a shield only where a grad-enabled call came in the same lifetime)."""

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
    """A covered call of ``state`` (``owner``: its cover, on ``device_types``; ``caller``: the frame of a
    registered method's call) under ``no_grad``, autocast on with the cache, right after FSDP's pre-forward
    gathered ``parameters``: mark those autocast would cache (float32 leaves that require grad) with torch's own
    mark for tensors whose casts must not be cached (:class:`~._compat.CacheMarks`), so that the call neither
    caches a cast without grad (which a later grad-enabled call would reuse, cut off from the parameter, or
    backward after FSDP's post-backward hook) nor reads one (it makes its own, as plain autocast would where
    nothing was cached). Casts a grad-enabled pass cached stay in the cache untouched, for the passes after.

    Invariant: a state's parameters are marked from its ``no_grad`` call to the end of that call where it is a
    registered method's (:func:`end_of_method`), else to the state's next covered grad-enabled call under
    autocast with the cache on, which takes the marks off before it casts anything (:func:`unshield`), or to the
    patch's removal; never otherwise. torch's process-wide flag for the marks is turned on with the first and left
    on: CUDA graph trees rely on it too, and with nothing marked it changes no result."""
    marked = _shielded.get(state)
    if marked is not None:
        if marked.owner() is owner:
            return
        unshield(state)  # a freed cover's, whose id this one has now
    marks = _compat.load().cache_marks
    chosen = [p for p in parameters if p.requires_grad and p.dtype == torch.float32 and p.is_leaf]
    if marks is None or not chosen:
        return
    forget_freed()
    marks.enable(True)  # and left on (see the invariant)
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
    """Take the marks :func:`shield` put on ``state``'s parameters off (a parameter freed since left its mark on
    an object torch keeps only weakly, at no address a new tensor can take); ``owner``: the module class whose
    grad-enabled call does so, for the report."""
    marked = _shielded.pop(state, None)
    if marked is None:
        return
    marks = _compat.load().cache_marks
    assert marks is not None
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
    """A covered call of ``state`` under autocast with the cache on made casts that are a hazard: under
    ``no_grad`` (``task`` -1: a function checkpointed through ``preserve_autocast``, or a call where the shield is
    not available), or in the recompute of graph task ``task`` (``shortcut``: unless they die with
    the checkpoint's regions)."""
    global active
    hazards = _hazards()
    by_state = hazards.by_state
    _alive(hazards)  # a cleared cache: the hazards noted before are gone
    if by_state.get(state) == -1:  # a no_grad hazard for this state, still cached: it outranks any other,
        return  # so nothing changes (an eval pass notes on every call: this is its path)
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
    """Whether the casts a recompute makes now will be dropped before this thread runs anything outside its
    backward (checked at its end by :func:`_verify`).

    True where ``torch.utils.checkpoint``'s recompute (either mode) runs the call inside its own autocast regions
    and no other region is open: leaving its outermost one takes autocast's nesting count to zero, which drops the
    cache (``torch.autocast``'s exit), and the recompute's code runs inside those regions. (Where a region spans
    the backward, the count is higher and the hazard is noted: the casts outlive the backward.)"""
    depth = _autocast.nesting()
    return depth <= 2 and _compat.torch_recompute_regions() == depth


def _skip(hazards: _Hazards, state: Any, task: int, device_types: tuple[str, ...]) -> None:
    """Leave a recompute's hazard unnoted (:func:`_dies_with_region`), to be verified at the end of its backward."""
    hazards.skipped[state] = (task, device_types)
    if hazards.verifying != task:
        hazards.verifying = task
        _compat.load().queue_backward_callback(functools.partial(_verify, hazards, threading.get_ident()))


def _verify(hazards: _Hazards, thread: int) -> None:
    """The end of a backward whose recomputes' hazards were skipped: where autocast's nesting count is not back at
    zero on their thread, a region opened in a recompute was left open (an early stop skipping the hook that
    leaves it, say), so the cache was not emptied by it and may still hold their casts: note them now. (On
    another thread the count cannot be read; the skip stands.)"""
    skipped = dict(hazards.skipped)
    hazards.skipped.clear()
    hazards.verifying = None
    if threading.get_ident() != thread or _autocast.nesting() == 0:
        return
    for state, (task, device_types) in skipped.items():
        note(state, task, device_types, shortcut=False)


def check(state: Any, task: int, owner: str) -> None:
    """A grad-enabled covered call of ``state`` (in graph task ``task``; -1 outside backward) under autocast with
    the cache on: drop the cache if a hazard for this state applies and its casts are still cached."""
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
    """A weak reference to a cast of the patch's own empty parameter-like tensor (no memory allocated), made now through
    autocast's cache (so cached beside the hazard's casts: it lives exactly as long as they are cached), or None
    where it cannot be made (then the cache is assumed to hold them)."""
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
    # The op's saved inputs are the cast autocast took from (or put in) its cache; a saved-tensor hook of the
    # patch's own takes them, so that what watches the region's ops does not see the sentinel's op (a
    # checkpoint's saved-tensor hooks, selective checkpointing's dispatch mode would count it as the region's).
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
    """Whether autocast's cache still holds what it held when the first hazard was noted (no sentinel: assume
    it does). The cache holds the only reference to the sentinel's cast; a region end or a drop frees it."""
    return hazards.lifetime is None or hazards.lifetime() is not None
