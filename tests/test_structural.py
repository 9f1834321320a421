"""Checks that need no FSDP2 forward, so they run on every torch from 2.4 (where FSDP2 needs CUDA) up.

Also: how "needs the cast replay" is decided, independent of the version string.
"""

from __future__ import annotations

import inspect
from typing import Any
import types

import pytest
import torch
import torch.nn as nn

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat, _patch

pytestmark = pytest.mark.usefixtures("pg")


def test_finds_the_right_fully_shard() -> None:
    package = _compat.fsdp_package()
    import torch.distributed.fsdp as public

    if hasattr(public, "fully_shard"):  # 2.6+
        assert package is public
    else:  # 2.4, 2.5
        assert package.__name__ == "torch.distributed._composable.fsdp"
    assert _compat.load().fully_shard is package.fully_shard
    assert inspect.signature(fsdp_autocast_fix.patched_fully_shard) == inspect.signature(package.fully_shard)


def test_apply_remove_status_patched_cycle() -> None:
    state_cls = _compat.load().fsdp_state_cls
    original = state_cls.__dict__["init"]
    for _ in range(3):
        assert fsdp_autocast_fix.apply() is True
        assert fsdp_autocast_fix.status().patched_globally
        fsdp_autocast_fix.remove()
        assert state_cls.__dict__["init"] is original
    with fsdp_autocast_fix.patched():
        assert fsdp_autocast_fix.status().autocast_replay_active
    assert not fsdp_autocast_fix.status().autocast_replay_active


def test_patched_fully_shard_shards_and_covers_or_fails_like_fully_shard() -> None:
    """On CPU, torch 2.4's fully_shard raises at sharding time; later ones shard (2.5, 2.6 fail only in forward)."""
    fully_shard = _compat.load().fully_shard
    try:
        fully_shard(nn.Linear(4, 4))
    except Exception as stock:
        with pytest.raises(type(stock)):
            fsdp_autocast_fix.patched_fully_shard(nn.Linear(4, 4))
        assert fsdp_autocast_fix.status().covered_modules == 0
        return
    layer = nn.Linear(4, 4)
    assert fsdp_autocast_fix.patched_fully_shard(layer) is layer
    assert fsdp_autocast_fix.status().covered_modules == 1
    assert len(layer._forward_pre_hooks) == 1  # the patch in the place of FSDP's pre-hook
    assert len(layer._forward_hooks) == 1
    (entry,) = layer._forward_pre_hooks.values()
    assert entry != _compat.load().state_of(layer)._pre_forward


@pytest.mark.parametrize("fake", ["2.13.0.dev20260101", "2.12.1+cu130", "2.13.0+cpu", "2.4.0a0+git1234", "99.0"])
def test_detection_ignores_the_version_string(monkeypatch: pytest.MonkeyPatch, fake: str) -> None:
    truth = _compat.load().needs_cast_replay
    monkeypatch.setattr(torch, "__version__", fake)
    _compat.load.cache_clear()
    try:
        assert _compat.load().needs_cast_replay is truth
        assert fsdp_autocast_fix.status().torch_version == fake
    finally:
        monkeypatch.undo()
        _compat.load.cache_clear()


def test_detection_agrees_with_torchs_code() -> None:
    """Independent check: does the ``PRE_BACKWARD`` branch of ``_pre_forward`` return cast inputs?"""
    source = inspect.getsource(inspect.unwrap(_compat.load().fsdp_state_cls._pre_forward))
    branch = source[source.index("TrainingState.PRE_BACKWARD"):]
    returned = next(line for line in branch.splitlines() if line.strip().startswith("return"))
    assert _compat.load().needs_cast_replay is ("cast" not in returned)


def test_fsdps_dynamo_wrapper_is_recognised_and_only_it_is_bypassed() -> None:
    """The patch's entry calls FSDP's ``_pre_forward`` without FSDP's per-call ``torch._dynamo.disable`` wrapper
    (the patch's own hook has one, recursive) wherever FSDP wraps it; anything else is called as it is."""
    internals = _compat.load()
    state = internals.fsdp_state_cls()
    wrapped = getattr(internals.fsdp_state_cls._pre_forward, "__wrapped__", None)
    bare = internals.bare_hook(state._pre_forward, state)
    if wrapped is None:  # a torch whose FSDP does not wrap its hooks: nothing to bypass
        assert bare == state._pre_forward
    else:  # recognised, so the bypass is in effect on this torch
        assert bare.__self__ is state and bare.__func__ is wrapped
        assert bare.__func__.__code__ not in internals.fsdp_hook_wrappers

    other = internals.fsdp_state_cls()
    closure = lambda module, args, kwargs: state._pre_forward(module, args, kwargs)  # noqa: E731 - a group's entry
    for hook in (other._pre_forward, closure, bare):
        assert internals.bare_hook(hook, state) is hook


def test_the_replays_forward_hook_entry_calls_fsdps_post_forward_bare_and_gives_its_slot_back() -> None:
    """In a replay the patch's forward-hook entry takes FSDP's slot and calls FSDP's ``_post_forward`` without
    FSDP's per-call wrapper, as the pre-hook entry does; leaving the replay and removing the patch put FSDP's own
    entry (the wrapped bound method) back in the slot."""
    internals = _compat.load()
    layer = fsdp_autocast_fix.patched_fully_shard(nn.Linear(4, 4))
    state = internals.state_of(layer)
    placement = _patch._covers[id(state)].modules[0].placement
    fsdp_post = placement.fsdp_post
    assert fsdp_post == types.MethodType(type(state)._post_forward, state)  # FSDP's, not the state's attribute
    assert placement.slots.post_entry.get() is fsdp_post
    wrapped = getattr(internals.fsdp_state_cls._post_forward, "__wrapped__", None)
    if wrapped is None:  # a torch whose FSDP does not wrap its hooks: nothing to bypass
        assert placement.fsdp_post_call == fsdp_post
    else:
        assert placement.fsdp_post_call.__self__ is state and placement.fsdp_post_call.__func__ is wrapped
    placement.swap_post(True)
    assert placement.slots.post_entry.get() is placement.post_hook
    placement.swap_post(False)
    assert placement.slots.post_entry.get() is fsdp_post
    placement.swap_post(True)
    _patch._covers.pop(id(state)).remove()
    assert placement.slots.post_entry.get() is fsdp_post
    assert list(layer._forward_hooks.values()).count(fsdp_post) == 1


def test_torch_checkpoints_recompute_and_its_autocast_regions_are_recognised() -> None:
    """The cast-cache shortcut for ``torch.utils.checkpoint`` (``_cache._dies_with_region``) is in effect on this
    torch: inside its recompute, in either mode, ``torch_recompute_regions`` counts the autocast regions the
    recompute opened (autocast's nesting count, outside any other region); in a checkpoint's forward, in the
    backward the reentrant mode runs after its recompute and outside any checkpoint it is None (the hazard is then
    noted as ever)."""
    from torch.utils.checkpoint import checkpoint

    from fsdp_autocast_fix import _autocast

    seen: list[tuple[bool, Any, int]] = []

    def body(t: torch.Tensor) -> torch.Tensor:
        seen.append((torch._C._current_graph_task_id() != -1, _compat.torch_recompute_regions(), _autocast.nesting()))
        return t.sin()

    def in_the_reentrant_backward(grad: torch.Tensor) -> None:
        seen.append((True, _compat.torch_recompute_regions(), _autocast.nesting()))

    def reentrant_body(t: torch.Tensor) -> torch.Tensor:
        out = body(t)
        if torch.is_grad_enabled():  # the recompute: the hook runs in the checkpoint's own backward, after it
            out.register_hook(in_the_reentrant_backward)
        return out

    x = torch.ones(2, requires_grad=True)
    checkpoint(body, x, use_reentrant=False).sum().backward()
    checkpoint(reentrant_body, x, use_reentrant=True).sum().backward()
    assert seen == [(False, None, 0), (True, 2, 2), (False, None, 0), (True, 2, 2), (True, None, 0)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        checkpoint(body, x, use_reentrant=False).sum().backward()
    assert seen[-1] == (True, 2, 3)  # a region spans the backward: more open than the recompute's own
    assert _compat.torch_recompute_regions() is None
