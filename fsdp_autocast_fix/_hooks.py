"""Where the patch sits in a sharded module's hook chain.

The patch takes the place of FSDP's forward pre-hook in the module's hook dict (same key, so the same place among
the user's hooks) and calls FSDP's hook from there. During a replay it also takes the place of FSDP's forward hook
(for the output cast) and adds an exit hook, last and ``always_call``, that undoes the replay after every other
hook. While user pre-hooks run before FSDP's, a lead pre-hook of the patch is kept first, so that the record and
the replayed autocast state come before them too.

The patch's hooks are wrapped with ``torch.compiler.disable`` (:func:`eager`) as FSDP's are, so inside them FSDP's
hooks are called without FSDP's own wrapper, which makes a new ``disable`` object on every call
(:meth:`~._compat.Internals.bare_hook`).

Invariant of :class:`Placement`: FSDP's hooks run exactly where and when they ran without the patch, each once
per call; :meth:`Placement.remove` puts FSDP's entries back and leaves no hook of the patch on the module.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
from typing import Any, Callable

import torch

from . import _compat

logger = logging.getLogger("fsdp_autocast_fix")


def eager(hook: Any) -> Any:
    """``hook`` as torch.compile must see it, as FSDP's own: run eagerly where dynamo breaks the graph, never traced."""
    return torch.compiler.disable(hook, recursive=True)


class Placement:
    """The patch's entries in one module's hook dicts (see the module docstring for the invariant)."""

    __slots__ = ("slots", "fsdp_entry", "fsdp_call", "fsdp_post", "fsdp_post_call", "hook", "post_hook",
                 "exit_hook", "lead_hook", "lead", "exit_handle", "exit_dicts", "exit_on", "snapshot", "__weakref__")

    def __init__(self, state: Any, slots: _compat.HookSlots) -> None:
        self.slots = slots
        self.fsdp_entry = slots.entry.get()  # FSDP's pre-hook entry: its bound _pre_forward, or a group closure
        #: What the patch's entry calls: FSDP's _pre_forward without FSDP's per-call dynamo-disable wrapper.
        self.fsdp_call = _compat.load().bare_hook(self.fsdp_entry, state)
        self.fsdp_post = slots.post_entry.get()  # FSDP's forward-hook entry, likewise
        #: What the patch's forward-hook entry calls in a replay: FSDP's _post_forward, likewise bare.
        self.fsdp_post_call = _compat.load().bare_hook(self.fsdp_post, state)
        #: Whether nn.Module.__call__ runs forward hooks from a snapshot (the exit hook may remove itself).
        self.snapshot = _compat.load().forward_hooks_snapshot
        self.hook: Any = None
        self.post_hook: Any = None
        self.exit_hook: Any = None
        self.lead_hook: Any = None
        self.lead: Any = None  # handle of the lead pre-hook, while user pre-hooks run before FSDP's
        self.exit_handle: Any = None  # the exit hook's registration: its key, reserved from then on
        self.exit_dicts: Any = None  # the module's forward hooks and their always_call flags
        self.exit_on = False

    def install(self, module: torch.nn.Module, entry: Callable[..., Any], post_forward: Callable[..., Any],
                exit_hook: Callable[..., Any], lead: Callable[..., Any]) -> None:
        """Take FSDP's pre-hook slot with ``entry``; keep the others ready for replays and user pre-hooks."""
        self.hook = eager(entry)
        self.post_hook = eager(post_forward)
        self.exit_hook = eager(exit_hook)
        self.lead_hook = eager(lead)
        self.slots.entry.set(self.hook)
        self.place_lead(module)

    # -- the lead pre-hook ----------------------------------------------------------------------------

    def place_lead(self, module: torch.nn.Module) -> None:
        """Keep the lead pre-hook first while other pre-hooks run before FSDP's; drop it otherwise.

        Called when the module is covered and whenever a pre-hook is registered on a covered module (see
        :func:`fsdp_autocast_fix._patch._pre_hook`).
        """
        hooks = module._forward_pre_hooks
        entry_key = self.slots.entry.key
        lead_key = self.lead.id if self.lead is not None else None
        before = list(itertools.takewhile(lambda k: k != entry_key, hooks))
        if any(k != lead_key for k in before):
            if self.lead is None:
                self.lead = nn_register_forward_pre_hook(module, self.lead_hook, prepend=True, with_kwargs=True)
            elif next(iter(hooks)) != lead_key:
                hooks.move_to_end(lead_key, last=False)  # type: ignore[attr-defined]
        elif self.lead is not None:
            self.lead.remove()
            self.lead = None

    # -- during a replay --------------------------------------------------------------------------------

    def swap_post(self, on: bool) -> None:
        """Put the patch's forward-hook entry in FSDP's place (``on``) or FSDP's back."""
        if on:
            self.slots.post_entry.set(self.post_hook)
        elif self.slots.post_entry.get() is self.post_hook:
            self.slots.post_entry.set(self.fsdp_post)

    def register_exit(self, module: torch.nn.Module) -> None:
        """Add the exit hook (last, ``always_call``) unless it is on. Registered once; later it goes back under its
        first key, which puts it after every hook registered since, as a new registration would."""
        if self.exit_on:
            return
        hooks, always_called = self.exit_dicts = module._forward_hooks, module._forward_hooks_always_called
        if self.exit_handle is None:
            self.exit_handle = module.register_forward_hook(self.exit_hook, always_call=True)
        else:
            hooks[self.exit_handle.id] = self.exit_hook
            always_called[self.exit_handle.id] = True
        self.exit_on = True

    def unregister_exit(self) -> bool:
        """Remove the exit hook now if that is safe; False where the caller must drop it later.

        nn.Module.__call__ runs forward hooks from a snapshot on its normal path, so the hook may remove itself
        there; on its exception path (an error, checkpoint's early stop) it iterates the dict itself. A torch
        without the snapshot keeps the hook on (an exit with nothing in flight does nothing)."""
        if not self.exit_on or not self.snapshot:
            return True
        if sys.exc_info()[1] is not None:
            return False
        self.drop_exit()
        return True

    def drop_exit(self) -> None:
        """Take the exit hook off now (its key stays reserved)."""
        if self.exit_on:
            hooks, always_called = self.exit_dicts
            key = self.exit_handle.id
            hooks.pop(key, None)
            always_called.pop(key, None)
            self.exit_on = False

    # -- undo ---------------------------------------------------------------------------------------------

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
        self.drop_exit()


@functools.wraps(torch.nn.Module.register_forward_pre_hook)  # wrapped by the patch: torch's name, signature, doc
def nn_register_forward_pre_hook(module: torch.nn.Module, hook: Any, *args: Any, **kwargs: Any) -> Any:
    # The module's own register_forward_pre_hook (its class's, or nn.Module's), not the patch's.
    cls: Any = _compat.load().fsdp_module_cls
    return super(cls, module).register_forward_pre_hook(hook, *args, **kwargs)
