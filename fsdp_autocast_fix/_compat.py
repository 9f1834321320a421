"""The one place that knows torch's FSDP2 internals and decides what this torch needs.

Every private name the patch reads is listed in :data:`PRIVATE_NAMES`, resolved and checked by :func:`load`, and
handed on as one :class:`Internals`. A missing or reshaped internal raises :class:`UnsupportedTorchError` naming
it, before anything is patched.

What this torch needs (the cast replay, the parameter gather) is decided by running torch's own recompute branch
on a bare state, not by the version string, so it is right for pre-releases, local builds and back-ports.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint

__all__ = ["CacheMarks", "HookSlots", "Internals", "Slot", "UnsupportedTorchError", "gather_parameters",
           "group_casts", "hook_slots", "in_torch_recompute", "load", "sharded_parameters", "torch_recompute_regions",
           "unsharded_parameters", "user_class_name"]

#: Import paths of composable FSDP, newest first (2.6+ public path, then 2.4/2.5).
_FSDP_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
#: Where ``FSDPState`` lives, in the same order.
_STATE_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_state",
    "torch.distributed._composable.fsdp._fsdp_state",
)


#: Stands for FSDP's state module in :data:`PRIVATE_NAMES` (one of :data:`_STATE_MODULES`, whichever this torch has).
STATE = "<FSDPState's module>"
#: Every private torch name the patch reads, as ``(module, attribute path)``: resolved by :func:`load` only, so a
#: torch without one still imports this package.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("torch._C", "_is_any_autocast_enabled"),
    ("torch._C", "_current_graph_task_id"),
    ("torch._C", "_current_autograd_node"),
    ("torch._C._autograd", "_get_sequence_nr"),
    ("torch._C", "_set_grad_enabled"),
    ("torch._C", "_is_torch_function_mode_enabled"),
    ("torch._C", "_len_torch_dispatch_stack"),
    ("torch._ops", "_len_torch_dispatch_stack_pre_dispatch"),
    ("torch._C._autograd", "_push_saved_tensors_default_hooks"),
    ("torch._C._autograd", "_pop_saved_tensors_default_hooks"),
    ("torch.utils._python_dispatch", "_disable_current_modes"),
    ("torch._C", "_get_privateuse1_backend_name"),
    ("torch.autograd.variable", "Variable._execution_engine"),
    ("torch.distributed.utils", "_to_kwargs"),
    ("torch.distributed._composable_state", "_module_state_mapping"),
    (STATE, "FSDPState._pre_forward"),
    (STATE, "FSDPState._post_forward"),
    (STATE, "TrainingState"),
    (STATE, "_cast_fp_tensor"),
    ("torch._C", "_add_cached_tensor"),  # autocast's cache marks (CacheMarks)
    ("torch._C", "_remove_cached_tensor"),
    ("torch._C", "_is_cached_tensor"),
    ("torch._C", "_set_cached_tensors_enabled"),
)


class UnsupportedTorchError(RuntimeError):
    """This torch lacks an internal the patch relies on, or has reshaped it.

    Raised by :func:`fsdp_autocast_fix.apply` and :func:`fsdp_autocast_fix.patched_fully_shard` before anything
    is changed. ``internal`` names the missing or changed piece.
    """

    def __init__(self, internal: str, detail: str = "") -> None:
        self.internal = internal
        message = f"fsdp_autocast_fix does not recognise torch {torch.__version__}: {internal}"
        super().__init__(f"{message} ({detail})" if detail else message)


@dataclass(frozen=True)
class Internals:
    """The torch internals the patch uses, resolved and checked once."""

    fully_shard: Callable[..., Any]
    fsdp_state_cls: type
    fsdp_module_cls: type  # FSDPModule, a base of every module fully_shard has sharded
    pre_backward: Any  # TrainingState.PRE_BACKWARD
    cast_fp_tensor: Callable[[torch.dtype, Any], Any]
    apply_to_tensors: Callable[[Callable[[Any], Any], Any], Any]
    module_state_mapping: Any  # dict or WeakKeyDictionary: module -> state (or weakref)
    to_kwargs: Callable[..., Any]  # torch.distributed.utils._to_kwargs, FSDP's root input move
    #: Whether nn.Module.__call__ runs forward hooks from a snapshot, so a hook may remove itself there.
    forward_hooks_snapshot: bool
    queue_backward_callback: Callable[[Callable[[], None]], None]  # run a callable when this backward ends
    needs_cast_replay: bool
    #: Whether this torch's recompute skips gathering parameters resharded since the forward (before torch 2.11).
    needs_param_gather: bool
    #: torch's marks that keep a tensor out of autocast's cast cache.
    cache_marks: CacheMarks
    #: The code of FSDP's dynamo-disable wrapper around its hooks, which makes a new ``torch._dynamo.disable``
    #: object on every call (``_dynamo_disable``; ``disable_if_config_true`` in 2.4-2.7).
    fsdp_hook_wrappers: frozenset[types.CodeType]
    #: Device types whose forward root FSDP moves inputs to (``FSDPState._root_pre_forward``).
    moving_device_types: frozenset[str]
    # torch's private calls the patch makes, each named for what it tells or does
    any_autocast_enabled: Callable[[], bool]
    graph_task_id: Callable[[], int]  # the running backward's, -1 outside backward
    current_node: Callable[[], Any]  # the autograd node running now, or None
    sequence_nr: Callable[[], int]  # autograd's sequence number, of the next node made
    set_grad_enabled: Callable[[bool], None]
    function_mode_enabled: Callable[[], bool]
    dispatch_modes: Callable[[], int]  # torch dispatch modes on the stack
    pre_dispatch_modes: Callable[[], int]
    push_saved_hooks: Callable[[Any, Any], None]  # saved-tensor hooks, as torch.autograd.graph uses them
    pop_saved_hooks: Callable[[], None]
    disable_current_modes: Callable[[], Any]  # a context without the dispatch modes

    def state_of(self, module: torch.nn.Module) -> Any | None:
        """The FSDP state that manages ``module``, or None."""
        entry = self.module_state_mapping.get(module)
        state = entry() if isinstance(entry, weakref.ref) else entry  # weakref from 2.5, the state in 2.4
        return state if isinstance(state, self.fsdp_state_cls) else None

    def bare_hook(self, hook: Any, state: Any) -> Any:
        """FSDP's hook ``hook`` (a method of ``state``) without FSDP's dynamo-disable wrapper, for calling from a
        frame torch.compile already skips; ``hook`` itself if it is not exactly that wrapper."""
        wrapper = getattr(hook, "__func__", None)
        if getattr(hook, "__self__", None) is not state or getattr(wrapper, "__code__", None) not in \
                self.fsdp_hook_wrappers:
            return hook
        closure: Any = getattr(wrapper, "__closure__", None)
        (cell,) = closure  # the wrapper's one free variable, ``func``: what it calls
        return types.MethodType(cell.cell_contents, state)

    def all_states(self) -> list[Any]:
        """Every live FSDP state, each once (a grouped state manages several modules)."""
        seen: dict[int, Any] = {}
        for module in list(self.module_state_mapping.keys()):
            state = self.state_of(module)
            if state is not None:
                seen.setdefault(id(state), state)
        return list(seen.values())


def modules_of(state: Any) -> tuple[torch.nn.Module, ...]:
    """The modules an FSDP state manages (``_modules`` from 2.5, ``_module`` in 2.4)."""
    modules = getattr(state, "_modules", None)
    if modules is None:
        modules = (state._module,)
    return tuple(modules)


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: ``_fsdp_param_groups`` in 2.12+, ``_fsdp_param_group`` (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups  # type: ignore[no-any-return]


def sharded_parameters(state: Any) -> list[torch.Tensor] | None:
    """The ``sharded_param`` of each ``FSDPParam`` of the state's parameter groups, or None where this torch has
    none."""
    try:
        return [fsdp_param.sharded_param for group in _param_groups(state) for fsdp_param in group.fsdp_params]
    except AttributeError:
        return None


def unsharded_parameters(state: Any) -> list[torch.Tensor]:
    """The ``unsharded_param`` of each ``FSDPParam`` of the state: what its modules hold during the forward, one
    tensor per parameter from its first all-gather on (its storage freed and refilled)."""
    found = []
    for group in _param_groups(state):
        for fsdp_param in getattr(group, "fsdp_params", ()):
            try:
                found.append(fsdp_param.unsharded_param)
            except AttributeError:  # not gathered yet
                pass
    return found


class CacheMarks:
    """torch's marks for tensors whose casts autocast neither reads from nor writes to its cache (``at::caching``,
    made for CUDA graph trees' static outputs). They count only while a process-wide flag is on, which has no
    getter: a tensor of the patch's own, marked once, tells (:meth:`flag_on`)."""

    __slots__ = ("add", "remove", "marked", "enable", "witness")

    def __init__(self, add: Callable[[torch.Tensor], None], remove: Callable[[torch.Tensor], None],
                 marked: Callable[[torch.Tensor], bool], enable: Callable[[bool], None]) -> None:
        self.add, self.remove, self.marked, self.enable = add, remove, marked, enable
        self.witness = torch.empty(0)
        try:
            self.add(self.witness)  # raises while the flag is off
        except RuntimeError:
            self.enable(True)
            self.add(self.witness)
            self.enable(False)

    def flag_on(self) -> bool:
        return self.marked(self.witness)


def _probe_cache_marks(add: Callable[[torch.Tensor], None], remove: Callable[[torch.Tensor], None],
                       marked: Callable[[torch.Tensor], bool], enable: Callable[[bool], None]) -> CacheMarks:
    """torch's cache marks, made of these calls, once autocast is seen to honour them; else
    :class:`UnsupportedTorchError` (without them a ``no_grad`` call's casts could only be dropped, which changes the
    bits of passes that share casts). One region casts a parameter-like tensor three times, the third time marked;
    the second cast must be the first's (cached) and the third a new one."""
    try:
        marks = CacheMarks(add, remove, marked, enable)
    except RuntimeError as e:
        raise UnsupportedTorchError("autocast's cache marks", repr(e)) from None
    w = torch.zeros(1, 1, requires_grad=True)
    saved: list[torch.Tensor] = []
    raised = not marks.flag_on()
    try:
        if raised:
            marks.enable(True)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                torch.mm(w, w)
                torch.mm(w, w)
                marks.add(w)
                torch.mm(w, w)
                marks.remove(w)
    except Exception as e:  # a build whose CPU autocast does not cast mm, say: the marks are not known to work
        raise UnsupportedTorchError("autocast's cache marks", f"the probe failed: {e!r}") from None
    finally:
        if raised:
            marks.enable(False)
    if not (len(saved) == 6 and saved[0] is saved[2] and saved[4] is not saved[0]):
        raise UnsupportedTorchError("autocast's cache marks", "this torch's autocast does not honour them")
    return marks


def label(module: str, path: str) -> str:
    """How :class:`UnsupportedTorchError` names a private name of :data:`PRIVATE_NAMES` (FSDP's without its
    module's path, which differs between releases)."""
    return path if module == STATE else f"{module}.{path}"


def resolve(module: str, path: str) -> Any:
    """``module``'s attribute ``path`` (dotted), or :class:`UnsupportedTorchError` naming it (:func:`label`)."""
    try:
        found = importlib.import_module(_import_first(_STATE_MODULES, "FSDPState module").__name__
                                        if module == STATE else module)
        for part in path.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as e:
        raise UnsupportedTorchError(label(module, path), repr(e)) from None
    return found


def set_method_forwards(state: Any, hooks: tuple[Any, Any]) -> None:
    """Put ``hooks`` where a method registered with ``register_fsdp_forward_method`` finds the state's pre- and
    post-forward (it looks ``_pre_forward`` / ``_post_forward`` up on the state at each call)."""
    state._pre_forward, state._post_forward = hooks


def clear_method_forwards(state: Any, hooks: tuple[Any, Any]) -> None:
    """Undo :func:`set_method_forwards` (where ``hooks`` are still there): the state's class's methods again."""
    attributes = vars(state)
    for name, ours in zip(("_pre_forward", "_post_forward"), hooks):
        if attributes.get(name) is ours:
            del attributes[name]


def _import_first(names: tuple[str, ...], what: str) -> Any:
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as e:  # pragma: no cover - depends on the torch build
            errors.append(f"{name}: {e}")
    raise UnsupportedTorchError(what, "; ".join(errors))


def _attr(obj: Any, name: str, label: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise UnsupportedTorchError(label, "missing") from None


def _check_params(fn: Any, expected: tuple[str, ...], label: str) -> None:
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise UnsupportedTorchError(label, f"no signature: {e}") from None
    if params[: len(expected)] != expected:
        raise UnsupportedTorchError(label, f"parameters {params}, expected {expected}")


def _probe_cast_replay(state_cls: type, pre_backward: Any, mp_policy_cls: type) -> bool:
    """Run torch's own recompute branch on a bare state; True if it skips the casts (pytorch issue 148831, cast
    from torch 2.13). A fresh ``FSDPState()`` has no parameter groups, so nothing but these arguments is touched."""
    state = state_cls()
    state._training_state = pre_backward
    state._mp_policy = mp_policy_cls(param_dtype=torch.bfloat16, output_dtype=torch.float16)
    x = torch.zeros(1)
    try:
        (args, _kwargs) = state._pre_forward(torch.nn.Module(), (x,), {})
        output = state._post_forward(torch.nn.Module(), (x,), x)
    except Exception as e:
        raise UnsupportedTorchError("FSDPState._pre_forward/_post_forward in PRE_BACKWARD", repr(e)) from None
    inputs_cast = args[0].dtype == torch.bfloat16
    output_cast = output.dtype == torch.float16
    return not (inputs_cast and output_cast)


class _GroupProbe:
    """A parameter group that is not gathered, and records whether it was asked to gather."""

    is_unsharded = False
    gathered = False

    def unshard(self, async_op: bool = False) -> None:
        self.gathered = True

    def wait_for_unshard(self) -> None:
        pass


def _probe_param_gather(state_cls: type, pre_backward: Any, mp_policy_cls: type) -> bool:
    """Run torch's own recompute branch on a bare state holding a parameter group that is not gathered; True if it
    leaves it so (pytorch issues 153354, 187437: "mixed torch.Tensor and DTensor"; gathered from torch 2.11)."""
    state = state_cls()
    state._training_state = pre_backward
    state._mp_policy = mp_policy_cls()  # no casts (2.13+ casts in this branch)
    group = _GroupProbe()
    if isinstance(getattr(state, "_fsdp_param_groups", None), list):  # 2.12+: a list, ``_fsdp_param_group`` reads it
        state._fsdp_param_groups = [group]
    else:
        state._fsdp_param_group = group
    try:
        state._pre_forward(torch.nn.Module(), (torch.zeros(1),), {})
    except Exception as e:
        raise UnsupportedTorchError("FSDPState._pre_forward in PRE_BACKWARD", repr(e)) from None
    if group.gathered:
        return False
    for name in ("unshard", "wait_for_unshard", "is_unsharded"):  # what the patch calls in torch's place
        if not hasattr(_param_group_cls(), name):
            raise UnsupportedTorchError(f"FSDPParamGroup.{name}", "missing")
    return True


def _param_group_cls() -> type:
    module = _import_first(("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                            "torch.distributed._composable.fsdp._fsdp_param_group"), "FSDPParamGroup module")
    return _attr(module, "FSDPParamGroup", "FSDPParamGroup")  # type: ignore[no-any-return]


def gather_parameters(state: Any) -> bool:
    """Gather (unshard, and wait for) the state's parameter groups that are not gathered, as torch 2.11+'s
    recompute does; True if one was not."""
    gathered = False
    for group in _param_groups(state):
        if not group.is_unsharded:
            group.unshard()
            group.wait_for_unshard()
            gathered = True
    return gathered


@functools.lru_cache(maxsize=None)
def load() -> Internals:
    """Resolve and check every internal; raise :class:`UnsupportedTorchError` on the first gap."""
    if not torch.distributed.is_available():
        raise UnsupportedTorchError("torch.distributed", "this torch was built without distributed support")
    required = {
        "torch.is_autocast_enabled(device_type)": lambda: torch.is_autocast_enabled("cpu"),
        "torch.get_autocast_dtype": lambda: torch.get_autocast_dtype("cpu"),
        "torch.is_autocast_cache_enabled": torch.is_autocast_cache_enabled,
        "torch.set_autocast_enabled(device_type, enabled)":
            lambda: torch.set_autocast_enabled("cpu", torch.is_autocast_enabled("cpu")),
        "torch.set_autocast_dtype(device_type, dtype)":
            lambda: torch.set_autocast_dtype("cpu", torch.get_autocast_dtype("cpu")),
        "torch.compiler.disable": lambda: torch.compiler.disable,
    }
    for label, call in required.items():
        try:
            call()
        except (AttributeError, TypeError) as e:
            raise UnsupportedTorchError(label, repr(e)) from None
    if "always_call" not in inspect.signature(torch.nn.Module.register_forward_hook).parameters:
        raise UnsupportedTorchError("nn.Module.register_forward_hook(always_call=...)", "missing")
    private = {path.rpartition(".")[2]: resolve(module, path) for module, path in PRIVATE_NAMES}

    package = fsdp_package()
    fully_shard = package.fully_shard
    mp_policy_cls = _attr(package, "MixedPrecisionPolicy", "MixedPrecisionPolicy")
    for field in ("param_dtype", "output_dtype", "cast_forward_inputs"):
        if field not in getattr(mp_policy_cls, "__dataclass_fields__", {}):
            raise UnsupportedTorchError(f"MixedPrecisionPolicy.{field}", "missing")

    state_module = _import_first(_STATE_MODULES, "FSDPState module")
    state_cls = _attr(state_module, "FSDPState", "FSDPState")
    _check_params(private["_pre_forward"], ("self", "module", "args", "kwargs"), "FSDPState._pre_forward")
    _check_params(private["_post_forward"], ("self", "module", "input", "output"), "FSDPState._post_forward")
    init = _attr(state_cls, "init", "FSDPState.init")
    _check_params(init, ("self",), "FSDPState.init")
    pre_backward = _attr(private["TrainingState"], "PRE_BACKWARD", "TrainingState.PRE_BACKWARD")
    # Traverse args exactly as this torch's FSDP does: _apply_to_tensors (2.5+) or tree_map (2.4).
    apply_to_tensors = getattr(state_module, "_apply_to_tensors", None)
    if apply_to_tensors is None:
        apply_to_tensors = _attr(state_module, "tree_map", "_apply_to_tensors / tree_map in FSDPState's module")
    engine = private["_execution_engine"]
    moving = frozenset({"cuda", "hpu", "xpu", "mtia", private["_get_privateuse1_backend_name"]()})

    return Internals(
        fully_shard=fully_shard,
        fsdp_state_cls=state_cls,
        fsdp_module_cls=_attr(package, "FSDPModule", "FSDPModule"),
        pre_backward=pre_backward,
        cast_fp_tensor=private["_cast_fp_tensor"],
        apply_to_tensors=apply_to_tensors,
        module_state_mapping=private["_module_state_mapping"],
        to_kwargs=private["_to_kwargs"],
        forward_hooks_snapshot=_forward_hooks_snapshot(),
        queue_backward_callback=_attr(engine, "queue_callback", "Variable._execution_engine.queue_callback"),
        needs_cast_replay=_probe_cast_replay(state_cls, pre_backward, mp_policy_cls),
        needs_param_gather=_probe_param_gather(state_cls, pre_backward, mp_policy_cls),
        cache_marks=_probe_cache_marks(private["_add_cached_tensor"], private["_remove_cached_tensor"],
                                       private["_is_cached_tensor"], private["_set_cached_tensors_enabled"]),
        fsdp_hook_wrappers=_hook_wrappers(state_module),
        moving_device_types=moving,
        any_autocast_enabled=private["_is_any_autocast_enabled"],
        graph_task_id=private["_current_graph_task_id"],
        current_node=private["_current_autograd_node"],
        sequence_nr=private["_get_sequence_nr"],
        set_grad_enabled=private["_set_grad_enabled"],
        function_mode_enabled=private["_is_torch_function_mode_enabled"],
        dispatch_modes=private["_len_torch_dispatch_stack"],
        pre_dispatch_modes=private["_len_torch_dispatch_stack_pre_dispatch"],
        push_saved_hooks=private["_push_saved_tensors_default_hooks"],
        pop_saved_hooks=private["_pop_saved_tensors_default_hooks"],
        disable_current_modes=private["_disable_current_modes"],
    )


#: All that FSDP's hook wrapper may use besides the function it wraps: ``torch._dynamo.disable`` (and, in
#: ``disable_if_config_true``, ``torch._dynamo.config.skip_fsdp_hooks``). A wrapper doing more is not skipped.
_WRAPPER_NAMES = frozenset({"torch", "_dynamo", "disable", "config", "skip_fsdp_hooks"})


def _hook_wrappers(state_module: Any) -> frozenset[types.CodeType]:
    def probe() -> None:  # pragma: no cover - never called: only wrapped, to read the wrapper's code
        return None

    codes = set()
    for name in ("_dynamo_disable", "disable_if_config_true"):
        decorator = getattr(state_module, name, None)
        code = getattr(decorator(probe), "__code__", None) if callable(decorator) else None
        if code is not None and code.co_freevars == ("func",) and set(code.co_names) <= _WRAPPER_NAMES:
            codes.add(code)
    return frozenset(codes)


def _forward_hooks_snapshot() -> bool:
    """Read ``nn.Module._call_impl``: does its normal path iterate ``(*self._forward_hooks.items(), ...)``?"""
    try:
        source = inspect.getsource(torch.nn.Module._call_impl)
    except (OSError, TypeError):  # pragma: no cover - no source shipped
        return False
    return "*self._forward_hooks.items()" in source


class Slot:
    """One of a module's hook-dict entries that FSDP registered: the patch puts its own callable there (same key,
    so the same place among the user's hooks) and later FSDP's back."""

    def __init__(self, hooks: dict[int, Any], key: int) -> None:
        self.hooks, self.key = hooks, key

    def get(self) -> Any:
        """The callable in this entry now (None once the hook was removed)."""
        return self.hooks.get(self.key)

    def set(self, value: Any) -> None:
        """Put ``value`` in this entry (never re-adds a hook that was removed meanwhile)."""
        if self.key in self.hooks:
            self.hooks[self.key] = value


@dataclass(frozen=True)
class HookSlots:
    """FSDP's two hook entries of one module: ``entry`` in its forward pre-hooks, ``post_entry`` in its forward
    hooks. For a module sharded alone they hold the state's bound ``_pre_forward`` / ``_post_forward``; for
    ``fully_shard([a, b, ...])`` group closures that call those (only for the module that starts / ends the
    group's pass, in torch 2.5-2.12)."""

    entry: Slot
    post_entry: Slot


def _calls(hook: Any, target: Any, depth: int = 3) -> bool:
    """Whether ``hook`` is the bound method ``target``, or a function whose closure (or a function in it) holds it."""
    if type(hook) is types.MethodType:
        return bool(hook == target)
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if (type(value) is types.MethodType and value == target) or (
                depth and inspect.isfunction(value) and _calls(value, target, depth - 1)):
            return True
    return False


def _find_hook(hooks: dict[int, Any], target: Any) -> Slot | None:
    for key, hook in hooks.items():
        if _calls(hook, target):
            return Slot(hooks, key)
    return None


def hook_slots(state: Any, module: torch.nn.Module) -> HookSlots:
    """Find FSDP's hook entries for ``module`` of ``state``; raise :class:`UnsupportedTorchError` if not there.
    FSDP's methods are taken from the state's class: the state's own attributes of those names may be the patch's
    (:func:`set_method_forwards`)."""
    state_cls = type(state)
    entry = _find_hook(module._forward_pre_hooks, types.MethodType(state_cls._pre_forward, state))
    post_entry = _find_hook(module._forward_hooks, types.MethodType(state_cls._post_forward, state))
    if entry is None or post_entry is None:
        raise UnsupportedTorchError(
            f"FSDP's forward {'pre-hook' if entry is None else 'hook'} on {type(module).__name__}",
            "not found where fully_shard registers it")
    return HookSlots(entry=entry, post_entry=post_entry)


def user_class_name(module: torch.nn.Module) -> str:
    """The name of the class ``module`` had before ``fully_shard`` (which makes a class ``FSDP<name>`` of it)."""
    fsdp_module_cls = load().fsdp_module_cls
    cls = next((c for c in type(module).__mro__ if not issubclass(c, fsdp_module_cls)), type(module))
    return cls.__name__


def group_casts(state: Any, module: torch.nn.Module) -> tuple[bool, bool]:
    """Whether FSDP's forward casts this call's inputs / output, for a module of ``fully_shard([a, b, ...])``.

    In torch 2.5-2.12 the group's hooks run ``_pre_forward`` (the input cast) only for the module that starts the
    group's pass, and ``_post_forward`` (the output cast) only for the one that ends it. Read before FSDP's hook
    runs: ``_modules_to_run_forward`` is empty for the first and holds just this module for the last. (torch
    2.13+ casts every module's inputs and output, in the recompute too.)
    """
    to_run = state._modules_to_run_forward
    return not to_run, len(to_run) == 1 and module in to_run


def _nested_code(function: Any, name: str) -> types.CodeType | None:
    """The code object of the function ``name`` defined inside ``function`` (None if there is none)."""
    code = getattr(function, "__code__", None)
    found = [c for c in (code.co_consts if code is not None else ()) if isinstance(c, types.CodeType)
             and c.co_name == name]
    return found[0] if len(found) == 1 else None


#: The code of the non-reentrant checkpoint's ``recompute_fn``, which ``checkpoint_wrapper``, the composable
#: ``checkpoint`` and selective checkpointing run on too (None where torch reshaped it: no shortcut then).
_RECOMPUTE_CODE = _nested_code(getattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", None),
                               "recompute_fn")
#: The code of the reentrant checkpoint's backward, which recomputes (likewise).
_REENTRANT_CODE = getattr(getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "backward", None),
                          "__code__", None)
_CHECKPOINT_FILE = next((c.co_filename for c in (_RECOMPUTE_CODE, _REENTRANT_CODE) if c is not None), None)
_CHECKPOINT_MODULE_FILE = torch.utils.checkpoint.__file__
#: How far up the stack :func:`torch_recompute_regions` looks: the covered module's call is a few frames below.
_RECOMPUTE_DEPTH = 32


def in_torch_recompute() -> bool:
    """Whether ``torch.utils.checkpoint`` (either mode) restored the forward's autocast state for the current call:
    the innermost of its recompute frames on this thread's stack is still recomputing (``recompute_fn``, or
    ``CheckpointFunction.backward`` before it has ``outputs``: after them it runs a backward of its own, outside
    its autocast blocks, where a nested checkpoint may recompute). Where torch reshaped both, any frame of its
    module counts. Off the hot path."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _RECOMPUTE_CODE:
            return True
        if code is _REENTRANT_CODE:
            return "outputs" not in frame.f_locals
        if _RECOMPUTE_CODE is None and _REENTRANT_CODE is None and code.co_filename == _CHECKPOINT_MODULE_FILE:
            return True
        frame = frame.f_back
    return False


def torch_recompute_regions() -> int | None:
    """How many autocast regions ``torch.utils.checkpoint``'s recompute has open around the current call (CPU's,
    and its device type's where autocast has one): both modes run the function inside those ``torch.autocast``
    blocks. None unless the innermost frame of ``torch.utils.checkpoint`` within :data:`_RECOMPUTE_DEPTH` frames is
    such a recompute (as :func:`in_torch_recompute` reads it); another of its frames met first is, say, a nested
    checkpoint's forward."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_RECOMPUTE_DEPTH):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_filename == _CHECKPOINT_FILE:
            if code is _RECOMPUTE_CODE:
                names = frame.f_locals
            elif code is _REENTRANT_CODE and "outputs" not in (names := frame.f_locals):
                pass
            else:
                return None
            return 1 + isinstance(names.get("device_autocast_ctx"), torch.autocast)
        frame = frame.f_back
    return None


def determinism_checks() -> tuple[dict[str, Any], str]:
    """``torch.utils.checkpoint``'s registry of ``determinism_check`` functions, and the name of the default one
    (what the value-level recompute check uses; the patch does not). ``RuntimeError`` where this torch has none."""
    registry = getattr(torch.utils.checkpoint, "_allowed_determinism_checks_to_fns", None)
    if not isinstance(registry, dict):
        raise RuntimeError(f"torch {torch.__version__} has no determinism_check registry in torch.utils.checkpoint; "
                           "the value-level recompute check needs one")
    return registry, getattr(torch.utils.checkpoint, "_DEFAULT_DETERMINISM_MODE", "default")


def fsdp_package() -> Any:
    """``torch.distributed.fsdp`` where it exports ``fully_shard`` (2.6+), else the 2.4/2.5 path."""
    for name in _FSDP_PACKAGES:
        try:
            package = importlib.import_module(name)
        except ImportError:  # pragma: no cover - depends on the torch build
            continue
        if hasattr(package, "fully_shard"):
            return package
    raise UnsupportedTorchError("fully_shard", f"not found in {' or '.join(_FSDP_PACKAGES)}")


def autocast_device_types() -> tuple[str, ...]:
    """Device types whose autocast state :func:`fsdp_autocast_fix.preserve_autocast` carries: CPU, and each
    accelerator this torch has a backend for."""
    names = ["cpu", "cuda", "xpu", "hpu", "mtia", "mps", torch._C._get_privateuse1_backend_name()]
    available = getattr(torch.amp, "is_autocast_available", None)
    found = []
    for name in dict.fromkeys(names):
        try:
            if (available is None or available(name)) and (name == "cpu" or _backend_available(name)):
                torch.is_autocast_enabled(name)
                found.append(name)
        except (RuntimeError, TypeError, ValueError, AttributeError):
            continue
    return tuple(found)


def _backend_available(device_type: str) -> bool:
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else False
    except Exception:  # pragma: no cover - a backend that fails to answer is not available
        return False


def torch_version() -> str:
    """The installed torch's version string, as torch reports it."""
    return str(torch.__version__)
