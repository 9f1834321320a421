"""apply / remove / patched / patched_fully_shard / status, failure modes, autocast hygiene."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
from typing import Any

import pytest
import scenarios as S
import torch
import torch.nn as nn
import wrapt

import fsdp_autocast_fix
from fsdp_autocast_fix import UnsupportedTorchError, _compat, _patch

pytestmark = pytest.mark.usefixtures("pg")


def _state_cls() -> type:
    return _compat.load().fsdp_state_cls


def _sharded(patched: bool = False) -> nn.Module:
    fully_shard, policy_cls = S._fsdp()
    if patched:
        fully_shard = fsdp_autocast_fix.patched_fully_shard
    layer = S.GeluLinear()
    fully_shard(layer, mp_policy=policy_cls(param_dtype=S.BF16))
    return layer


def _hook_count(module: nn.Module) -> tuple[int, int]:
    return len(module._forward_pre_hooks), len(module._forward_hooks)


def _added_hooks() -> tuple[int, int]:
    """What covering adds while no replay is in flight: nothing (the patch takes the place of FSDP's pre-hook)."""
    return 0, 0


def _covered(module: nn.Module) -> bool:
    """Whether the patch sits in the place of FSDP's pre-hook entry of ``module``."""
    cover = _patch._covers.get(id(_compat.load().state_of(module)))
    return cover is not None and any(m.placement.slots.entry.get() is m.placement.hook for m in cover.modules)


def _fsdp_hooks(module: nn.Module) -> tuple[list[object], list[object]]:
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


def _no_replays() -> bool:
    return all(not m.replayer.replays for cover in list(_patch._covers.values()) for m in cover.modules)


def test_apply_is_idempotent_and_remove_restores_stock() -> None:
    original = _state_cls().__dict__["init"]
    before = _sharded()
    stock_hooks = _hook_count(before)
    stock_entries = _fsdp_hooks(before)
    stock_keys = list(before._forward_pre_hooks)
    assert fsdp_autocast_fix.apply() is True
    assert fsdp_autocast_fix.apply() is False
    assert isinstance(_state_cls().__dict__["init"], wrapt.FunctionWrapper)
    assert _state_cls().init.__name__ == "init"
    assert inspect.signature(_state_cls().init) == inspect.signature(original)
    after = _sharded()
    added = _added_hooks()
    assert _hook_count(before) == _hook_count(after) == (stock_hooks[0] + added[0], stock_hooks[1] + added[1])
    assert _covered(before) and _covered(after)
    assert list(before._forward_pre_hooks) == stock_keys  # in FSDP's own place
    fsdp_autocast_fix.remove()
    assert _state_cls().__dict__["init"] is original
    assert _hook_count(before) == _hook_count(after) == stock_hooks
    assert _fsdp_hooks(before) == stock_entries  # FSDP's own bound methods back in their places
    assert not _covered(before) and not _covered(after)
    fsdp_autocast_fix.remove()  # no-op
    assert fsdp_autocast_fix.status().covered_modules == 0


def test_one_init_wrapper_shared_by_its_holders_and_left_inert_under_a_later_wrapper(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The auto-apply and apply() share one wrapt wrapper on FSDPState.init (_init_hook): on while anyone holds it,
    off when the last lets go, inert and used again where someone wrapped on top of it meanwhile."""
    from fsdp_autocast_fix import _init_hook

    for name, value in (("_holders", {}), ("_wrapper", None), ("_state_cls", None)):  # a class of its own
        monkeypatch.setattr(_init_hook, name, value)

    class State:
        def init(self, x: int) -> int:
            return x

    original, seen = State.__dict__["init"], []
    _init_hook.hold(State, "a", lambda state: seen.append("a"))
    wrapper = State.__dict__["init"]
    _init_hook.hold(State, "b", lambda state: seen.append("b"))
    assert State.__dict__["init"] is wrapper and State().init(3) == 3 and seen == ["a", "b"]
    _init_hook.release("a")
    assert State.__dict__["init"] is wrapper and State().init(4) == 4 and seen == ["a", "b", "b"]
    _init_hook.release("b")
    assert State.__dict__["init"] is original
    _init_hook.hold(State, "a", lambda state: seen.append("a"))
    wrapt.wrap_function_wrapper(State, "init", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs) + 1)
    on_top = State.__dict__["init"]
    _init_hook.release("a")
    assert State.__dict__["init"] is on_top and State().init(5) == 6 and seen == ["a", "b", "b"]  # ours inert
    _init_hook.hold(State, "b", lambda state: seen.append("b"))
    assert State.__dict__["init"] is on_top and State().init(5) == 6 and seen == ["a", "b", "b", "b"]
    _init_hook.release("b")


def test_wrappers_left_under_another_wrapper_stay_inert_and_apply_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone wraps FSDPState.init and FSDPModule.register_forward_pre_hook on top of the patch's: remove() leaves
    the patch's in place, inert (a module sharded then is not covered); apply() again covers through them."""
    module_cls = _compat.load().fsdp_module_cls
    fsdp_autocast_fix.apply()
    _sharded()
    def passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)
    monkeypatch.setattr(_state_cls(), "init", wrapt.FunctionWrapper(_state_cls().__dict__["init"], passthrough))
    monkeypatch.setattr(module_cls, "register_forward_pre_hook",
                        wrapt.FunctionWrapper(module_cls.__dict__["register_forward_pre_hook"], passthrough))
    fsdp_autocast_fix.remove()
    assert fsdp_autocast_fix.status().covered_modules == 0
    layer = _sharded()
    assert not _covered(layer)
    layer.register_forward_pre_hook(lambda m, a: None, prepend=True)
    fsdp_autocast_fix.apply()
    assert _covered(layer) and _covered(_sharded())
    layer.register_forward_pre_hook(lambda m, a: None, prepend=True)  # the lead goes before it, as without
    cover = _patch._covers[id(_compat.load().state_of(layer))]
    assert next(iter(layer._forward_pre_hooks)) == cover.modules[0].placement.lead.id
    fsdp_autocast_fix.remove()
    monkeypatch.undo()  # the other wrappers gone, ours are taken off at the next remove()
    fsdp_autocast_fix.apply()
    fsdp_autocast_fix.remove()
    assert not isinstance(_state_cls().__dict__["init"], wrapt.FunctionWrapper)
    assert "register_forward_pre_hook" not in module_cls.__dict__


def test_apply_that_raises_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Something already defines FSDPModule.register_forward_pre_hook: apply() raises, and leaves nothing on (no
    init wrapper, not applied), so the next apply() raises too instead of claiming the patch is in force."""
    module_cls = _compat.load().fsdp_module_cls
    monkeypatch.setattr(module_cls, "register_forward_pre_hook", nn.Module.register_forward_pre_hook, raising=False)
    for _ in range(2):
        with pytest.raises(UnsupportedTorchError, match="register_forward_pre_hook"):
            fsdp_autocast_fix.apply()
        assert not fsdp_autocast_fix.status().patched_globally
        assert not isinstance(_state_cls().__dict__["init"], wrapt.FunctionWrapper)


def test_a_pending_auto_apply_yields_to_the_users_own_calls() -> None:
    """FSDP_AUTOCAST_FIX=1 left an apply pending (until the first FSDPState.init): the user's apply(force=True)
    settles it (the first fully_shard keeps force=True), and so does remove() (nothing applied after it)."""
    from fsdp_autocast_fix import _autoapply

    for user_call in ("apply_forced", "remove"):
        _autoapply._pending = True
        _autoapply._wait_for_init()
        if user_call == "apply_forced":
            fsdp_autocast_fix.apply(force=True)
        else:
            fsdp_autocast_fix.remove()
        layer = _sharded()
        assert not _autoapply._pending
        assert _patch.forced() is (user_call == "apply_forced")
        assert _covered(layer) is (user_call == "apply_forced")
        fsdp_autocast_fix.remove()
        assert not isinstance(_state_cls().__dict__["init"], wrapt.FunctionWrapper)


def test_init_wrapper_taken_off_by_someone_else_is_made_anew() -> None:
    """A tool that puts back the init it found (mock.patch.object around apply()) takes the patch's wrapper off, and
    someone deletes its pre-hook registration wrapper: the next apply() makes both anew, and covers what is sharded
    after it, the lead pre-hook kept first."""
    from unittest import mock

    raw = _state_cls().__dict__["init"]
    module_cls = _compat.load().fsdp_module_cls
    with mock.patch.object(_state_cls(), "init", lambda self, *a, **k: raw(self, *a, **k)):
        fsdp_autocast_fix.apply()  # our init wrapper goes under mock's, and with it when mock puts init back
        _sharded()
    del module_cls.register_forward_pre_hook  # and someone takes the pre-hook wrapper off too
    fsdp_autocast_fix.remove()
    fsdp_autocast_fix.apply()
    layer = _sharded()
    assert _covered(layer)
    layer.register_forward_pre_hook(lambda module, args: None, prepend=True)
    lead = _patch._covers[id(_compat.load().state_of(layer))].modules[0].placement.lead
    assert lead is not None and next(iter(layer._forward_pre_hooks)) == lead.id
    fsdp_autocast_fix.remove()
    assert _state_cls().__dict__["init"] is raw and "register_forward_pre_hook" not in module_cls.__dict__


def test_pre_hook_registration_looks_like_torchs_and_keeps_the_lead_first() -> None:
    """While modules are covered, FSDPModule.register_forward_pre_hook keeps torch's name and signature, calls a
    module class's own override, and puts the lead pre-hook first wherever the new hook landed before FSDP's
    (prepend=True given by the caller, or added by the override)."""
    fully_shard, policy_cls = S._fsdp()
    stock = _sharded().register_forward_pre_hook

    class Prepending(S.GeluLinear):
        def register_forward_pre_hook(self, hook: Any, **kwargs: Any) -> Any:
            return super().register_forward_pre_hook(hook, **{**kwargs, "prepend": True})

    fsdp_autocast_fix.apply()
    for layer, kwargs in ((_sharded(), {"prepend": True}), (Prepending(), {})):
        if isinstance(layer, Prepending):
            fully_shard(layer, mp_policy=policy_cls(param_dtype=S.BF16))
        registered = layer.register_forward_pre_hook
        assert registered.__name__ == stock.__name__
        assert inspect.signature(registered) == inspect.signature(stock)
        registered(lambda module, args: None, **kwargs)
        lead = _patch._covers[id(_compat.load().state_of(layer))].modules[0].placement.lead
        assert lead is not None and next(iter(layer._forward_pre_hooks)) == lead.id
    fsdp_autocast_fix.remove()


def test_force_changes_the_cast_replay() -> None:
    needs = _compat.load().needs_cast_replay
    assert fsdp_autocast_fix.apply() is True
    assert fsdp_autocast_fix.status().cast_replay_active is needs
    assert fsdp_autocast_fix.apply(force=True) is True
    assert fsdp_autocast_fix.status().cast_replay_active is True
    assert fsdp_autocast_fix.apply(force=True) is False


def test_patched_is_nesting_safe() -> None:
    with fsdp_autocast_fix.patched():
        with fsdp_autocast_fix.patched():
            assert fsdp_autocast_fix.status().patched_globally
        assert fsdp_autocast_fix.status().patched_globally
    assert not fsdp_autocast_fix.status().patched_globally
    fsdp_autocast_fix.apply()
    with fsdp_autocast_fix.patched(force=True):
        assert _patch.forced()
    assert fsdp_autocast_fix.status().patched_globally and not _patch.forced()


def test_patched_restores_on_exception() -> None:
    with pytest.raises(ZeroDivisionError), fsdp_autocast_fix.patched():
        1 / 0
    assert not fsdp_autocast_fix.status().patched_globally


def test_patched_fully_shard_covers_only_its_modules_and_survives_remove() -> None:
    plain = _sharded()
    covered = _sharded(patched=True)
    assert fsdp_autocast_fix.status().covered_modules == 1
    assert not fsdp_autocast_fix.status().patched_globally
    fsdp_autocast_fix.apply()
    assert fsdp_autocast_fix.status().covered_modules == 2
    fsdp_autocast_fix.remove()
    assert fsdp_autocast_fix.status().covered_modules == 1
    del plain, covered


def test_patched_fully_shard_has_fully_shards_signature_and_return() -> None:
    fully_shard, policy_cls = S._fsdp()
    layer = S.GeluLinear()
    assert fsdp_autocast_fix.patched_fully_shard(layer, mp_policy=policy_cls()) is layer
    assert type(layer).__name__ == f"FSDP{S.GeluLinear.__name__}"
    assert inspect.signature(fsdp_autocast_fix.patched_fully_shard) == inspect.signature(fully_shard)


@pytest.mark.parametrize("bad", [
    lambda: ("not a module",),
    lambda: (S.GeluLinear(), "positional-garbage-mesh"),
])
def test_patched_fully_shard_rejects_what_fully_shard_rejects(bad) -> None:
    fully_shard, _ = S._fsdp()
    with pytest.raises(Exception) as stock:
        fully_shard(*bad())
    with pytest.raises(type(stock.value)):
        fsdp_autocast_fix.patched_fully_shard(*bad())
    assert fsdp_autocast_fix.status().covered_modules == 0


def test_patched_fully_shard_rejects_unknown_keyword() -> None:
    fully_shard, _ = S._fsdp()
    with pytest.raises(TypeError):
        fully_shard(S.GeluLinear(), no_such_option=True)
    with pytest.raises(TypeError):
        fsdp_autocast_fix.patched_fully_shard(S.GeluLinear(), no_such_option=True)


def test_status() -> None:
    s = fsdp_autocast_fix.status()
    assert s.torch_version == torch.__version__
    assert s.needs_cast_replay is _compat.load().needs_cast_replay
    assert (s.patched_globally, s.autocast_replay_active, s.covered_modules, s.unsupported) == (False, False, 0, None)
    layer = _sharded()
    fsdp_autocast_fix.apply()
    s = fsdp_autocast_fix.status()
    assert (s.patched_globally, s.autocast_replay_active, s.covered_modules) == (True, True, 1)
    with pytest.raises(AttributeError):
        s.covered_modules = 3  # type: ignore[misc]
    del layer


def test_apply_logs_what_it_does(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fsdp_autocast_fix"):
        fsdp_autocast_fix.apply()
    text = caplog.text
    if _compat.load().needs_cast_replay:
        assert "cast and autocast replay" in text
    else:
        assert "left to torch" in text


@pytest.mark.parametrize("missing", ["init", "_pre_forward"])
def test_missing_internal_raises_typed_error_and_patches_nothing(
        monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    layer = _sharded()
    hooks = _hook_count(layer)
    original_init = _state_cls().__dict__["init"]
    monkeypatch.delattr(_state_cls(), missing)
    _compat.load.cache_clear()
    try:
        with pytest.raises(UnsupportedTorchError, match=f"FSDPState.{missing}") as err:
            fsdp_autocast_fix.apply()
        assert isinstance(err.value, RuntimeError) and err.value.internal == f"FSDPState.{missing}"
        with pytest.raises(UnsupportedTorchError):
            fsdp_autocast_fix.patched_fully_shard(S.GeluLinear())
        assert fsdp_autocast_fix.status().unsupported is not None
    finally:
        monkeypatch.undo()
        _compat.load.cache_clear()
    assert _state_cls().__dict__["init"] is original_init
    assert _hook_count(layer) == hooks
    assert not fsdp_autocast_fix.status().patched_globally


def test_fsdp_hooks_not_found_at_sharding_log_and_leave_the_module_sharded_stock(
        caplog: pytest.LogCaptureFixture) -> None:
    """FSDP's pre-hook is not found where fully_shard registers it (``_pre_forward`` wrapped by someone else):
    under apply() fully_shard still finishes (never half-sharded) and one warning says the module runs stock;
    patched_fully_shard raises, saying the module is sharded but not covered."""
    state_cls = _state_cls()
    original = state_cls.__dict__["_pre_forward"]
    wrapt.wrap_function_wrapper(state_cls, "_pre_forward", lambda wrapped, instance, args, kwargs: wrapped(*args,
                                                                                                            **kwargs))
    layer = err = None
    try:
        fsdp_autocast_fix.apply()
        before = fsdp_autocast_fix.status().covered_modules
        layer = S.GeluLinear()
        with caplog.at_level(logging.WARNING, logger="fsdp_autocast_fix"):
            _compat.load().fully_shard(layer)
        assert isinstance(layer, _compat.load().fsdp_module_cls)
        assert all(hasattr(p, "placements") for p in layer.parameters())  # sharded: DTensor parameters
        assert fsdp_autocast_fix.status().covered_modules == before
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            f"fsdp_autocast_fix cannot cover GeluLinear, which runs without the patch: {_uncovered_error()}"]
        fsdp_autocast_fix.remove()
        with pytest.raises(UnsupportedTorchError) as err:
            fsdp_autocast_fix.patched_fully_shard(S.GeluLinear())
        assert err.value.__notes__ == ["FSDPGeluLinear is sharded by fully_shard but not covered by the patch"]
    finally:
        fsdp_autocast_fix.remove()
        setattr(state_cls, "_pre_forward", original)
        layer = err = None  # the modules sharded here, whose hooks no apply() could find, must go now
        gc.collect()


def _uncovered_error() -> str:
    return str(UnsupportedTorchError("FSDP's forward pre-hook on GeluLinear",  # at init: class not yet swapped
                                     "not found where fully_shard registers it"))


def _autocast_state() -> tuple[object, ...]:
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())


class Boom(Exception):
    pass


class RaisesInRecompute(S.GeluLinear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if torch.is_autocast_enabled("cpu") and torch._C._current_graph_task_id() != -1:
            raise Boom("only in the recompute")
        return super().forward(x)


def test_exception_in_recompute_leaves_autocast_as_it_was() -> None:
    """The custom checkpoint recomputes with autocast off; the replay turns it on, then the forward raises."""
    fully_shard, policy_cls = S._fsdp()
    fsdp_autocast_fix.apply()
    layer = RaisesInRecompute()
    fully_shard(layer, mp_policy=policy_cls())
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        out = S.RecomputeWithoutAutocast.apply(layer, x)
    before = _autocast_state()
    with pytest.raises(Boom):
        out.float().sum().backward()
    assert _autocast_state() == before
    assert not torch.is_autocast_enabled("cpu")
    assert _no_replays()


def test_public_names_have_docstrings() -> None:
    for name in fsdp_autocast_fix.__all__:
        assert getattr(fsdp_autocast_fix, name).__doc__, name


def test_post_hook_only_while_a_replay_is_in_flight() -> None:
    """Registered in the recompute (here: to cast the output to ``output_dtype``), removed after it."""
    _, policy_cls = S._fsdp()
    layer = S.GeluLinear()
    fsdp_autocast_fix.patched_fully_shard(layer, mp_policy=policy_cls(param_dtype=S.BF16, output_dtype=torch.float32))
    stock_post = 1  # FSDP's own
    seen: list[int] = []
    layer.register_forward_pre_hook(lambda m, a: seen.append(len(m._forward_hooks)))
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        checkpoint_out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    checkpoint_out.float().sum().backward()
    if _compat.load().forward_hooks_snapshot:
        assert seen == [stock_post, stock_post + 1]  # the patch's exit hook only in the recompute
    assert len(layer._forward_hooks) == stock_post + (0 if _compat.load().forward_hooks_snapshot else 1)
    assert _no_replays()


@pytest.mark.parametrize("output_dtype", [None, torch.float32])
@pytest.mark.parametrize("force", [False, True])
def test_fsdps_post_hook_is_swapped_in_a_replay_only_to_cast_the_output(output_dtype: Any, force: bool) -> None:
    """In a recompute the patch's forward-hook entry takes FSDP's slot only where it casts the output in FSDP's
    place: the policy has an ``output_dtype`` and this torch skips the cast (or ``force``). Either way the bits
    are those of the run without checkpointing."""
    _, policy_cls = S._fsdp()
    fsdp_autocast_fix.apply(force=force)
    policy = policy_cls(param_dtype=S.BF16, output_dtype=output_dtype)
    slot_in_recompute: list[bool] = []

    def run(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = S.GeluLinear()
        S._fsdp()[0](layer, mp_policy=policy)
        placement = _patch._covers[id(_compat.load().state_of(layer))].modules[0].placement
        if checkpointed:
            layer.register_forward_pre_hook(lambda m, a: slot_in_recompute.append(
                placement.slots.post_entry.get() is placement.post_hook)
                if torch._C._current_graph_task_id() != -1 else None)
        x = torch.randn(4, S.DIM, requires_grad=True)
        with torch.autocast("cpu", dtype=S.BF16):
            out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        out.float().sum().backward()
        return [x.grad] + [p.grad.full_tensor() for p in layer.parameters()]

    reference, checkpointed = run(False), run(True)
    casts = output_dtype is not None and (force or _compat.load().needs_cast_replay)
    assert slot_in_recompute == [casts]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(reference, checkpointed))
    assert _no_replays()


def test_stale_post_hook_after_an_exception_is_dropped_on_the_next_call() -> None:
    fully_shard, policy_cls = S._fsdp()
    layer = RaisesInRecompute()
    fsdp_autocast_fix.patched_fully_shard(layer, mp_policy=policy_cls())
    stock_post = len(layer._forward_hooks)
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        out = S.RecomputeWithoutAutocast.apply(layer, x)
    with pytest.raises(Boom):
        out.float().sum().backward()
    layer(torch.randn(4, S.DIM))
    assert len(layer._forward_hooks) == stock_post


def test_post_hook_stays_where_module_call_is_not_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    """If nn.Module.__call__ is not the one we read, the post-hook stays registered; results are the same."""
    internals = dataclasses.replace(_compat.load(), forward_hooks_snapshot=False)
    monkeypatch.setattr(_compat, "load", lambda: internals)
    reference = S.run(S.SCENARIOS["float_first"], "reference")
    result = S.run(S.SCENARIOS["float_first"], "patched_fully_shard")
    assert result.error is None and result.same_as(reference)
    layer = _sharded(patched=True)
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).float().sum().backward()
    assert _hook_count(layer)[1] == 2  # FSDP's and the patch's exit hook, which stays
