"""Robustness: ambiguous replays, threads, faults, bad input."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import pytest
import scenarios as S
import torch
from test_api import Boom, RaisesInRecompute, _added_hooks, _hook_count, _sharded

import fsdp_autocast_fix
from fsdp_autocast_fix import UnsupportedTorchError, _compat, _patch, _replay

pytestmark = pytest.mark.usefixtures("pg")


def _two_states(mode: str, use_checkpoint: bool = True) -> S.Result:
    """One module, two checkpointed calls on the same input under bf16 and fp16 autocast, one backward, twice."""
    torch.manual_seed(0)
    fully_shard, policy_cls = S._fsdp()
    if mode == "apply":
        fsdp_autocast_fix.apply()
    layer = S.GeluLinear()
    fully_shard(layer, mp_policy=policy_cls())
    x = torch.randn(4, S.DIM, requires_grad=True)
    run = S.RecomputeWithoutAutocast.apply if use_checkpoint else (lambda fn, t: fn(t))
    for _ in range(2):
        with torch.autocast("cpu", dtype=S.BF16):
            first = run(layer, x)
        with torch.autocast("cpu", dtype=torch.float16):
            second = run(layer, x)
        (first.float() + second.float()).sum().backward()
    fsdp_autocast_fix.remove()
    return S.Result(grads=[x.grad] + [p.grad.full_tensor() for p in layer.parameters()])


def test_two_states_on_one_input_each_replay_their_own_call(caplog: pytest.LogCaptureFixture) -> None:
    """A custom checkpoint, one module, two calls on the same input under different autocast states before one
    backward: each recompute replays its own call (the checkpoint's autograd node tells), with no warning."""
    truth = _two_states("stock", use_checkpoint=False)
    assert not _two_states("stock").same_as(truth)  # positive control
    with caplog.at_level(logging.WARNING, logger="fsdp_autocast_fix"):
        assert _two_states("apply").same_as(truth)
    assert not [r for r in caplog.records if "autocast states" in r.getMessage()]


def test_unambiguous_custom_checkpoint_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fsdp_autocast_fix"):
        result = S.run(S.SCENARIOS["custom_function_checkpoint"], "apply")
    assert result.error is None
    assert not caplog.records


def test_apply_remove_from_8_threads() -> None:
    before = _sharded()
    stock = (_hook_count(before)[0], _hook_count(before)[1])
    original = _compat.load().fsdp_state_cls.__dict__["init"]
    errors: list[BaseException] = []

    def toggle() -> None:
        try:
            for i in range(1000):
                fsdp_autocast_fix.apply(force=bool(i % 3 == 0))
                fsdp_autocast_fix.remove()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=toggle) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not fsdp_autocast_fix.status().patched_globally
    assert _compat.load().fsdp_state_cls.__dict__["init"] is original
    assert _hook_count(before) == stock
    fsdp_autocast_fix.apply()
    added = _added_hooks()
    assert _hook_count(before) == (stock[0] + added[0], stock[1] + added[1])
    assert _compat.load().fsdp_state_cls.__dict__["init"] is not original


def test_backward_on_another_thread_sees_the_captured_state() -> None:
    """Autocast state is thread-local: a recompute on another thread must still run under the forward's."""
    reference = S.run(S.SCENARIOS["custom_function_checkpoint"], "reference")
    fully_shard, policy_cls = S._fsdp()
    fsdp_autocast_fix.apply()
    torch.manual_seed(0)
    layer = S.GeluLinear()
    fully_shard(layer, mp_policy=policy_cls())
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        out = S.RecomputeWithoutAutocast.apply(layer, x)
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: (out.float().sum().backward(), seen.append(
        torch.is_autocast_enabled("cpu"))))
    thread.start()
    thread.join()
    assert seen == [False]  # and the other thread's autocast is left as it was
    grads = [x.grad] + [p.grad.full_tensor() for p in layer.parameters()]
    assert S.Result(grads=grads).same_as(reference)


class RaisesOnce(RaisesInRecompute):
    armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and torch._C._current_graph_task_id() != -1:
            self.armed = False
            raise Boom("once, in the recompute")
        return S.GeluLinear.forward(self, x)


def test_next_step_is_correct_after_an_exception_in_the_recompute() -> None:
    fully_shard, policy_cls = S._fsdp()
    fsdp_autocast_fix.apply()
    torch.manual_seed(0)
    layer = RaisesOnce()
    fully_shard(layer, mp_policy=policy_cls())
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        out = S.RecomputeWithoutAutocast.apply(layer, x)
    with pytest.raises(Boom):
        out.float().sum().backward()
    assert not torch.is_autocast_enabled("cpu")
    # The next step, with a checkpoint that restores autocast, runs and matches the run without one.
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    with torch.autocast("cpu", dtype=S.BF16):
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        out.float().sum().backward()
    grads = [x.grad] + [p.grad.full_tensor() for p in layer.parameters()]
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    with torch.autocast("cpu", dtype=S.BF16):
        layer(x).float().sum().backward()
    reference = [x.grad] + [p.grad.full_tensor() for p in layer.parameters()]
    assert S.Result(grads=grads).same_as(S.Result(grads=reference))


def test_torch_without_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    _compat.load.cache_clear()
    try:
        with pytest.raises(UnsupportedTorchError, match="torch.distributed"):
            fsdp_autocast_fix.apply()
        with pytest.raises(UnsupportedTorchError, match="torch.distributed"):
            fsdp_autocast_fix.patched_fully_shard(torch.nn.Linear(2, 2))
        assert "without distributed" in str(fsdp_autocast_fix.status().unsupported)
    finally:
        monkeypatch.undo()
        _compat.load.cache_clear()


def test_apply_inside_patched_is_a_no_op() -> None:
    with fsdp_autocast_fix.patched():
        assert fsdp_autocast_fix.apply() is False
        fsdp_autocast_fix.remove()  # documented: remove() ends the patch, also inside patched()
        assert not fsdp_autocast_fix.status().patched_globally
    assert not fsdp_autocast_fix.status().patched_globally


def test_patched_fully_shard_on_non_modules() -> None:
    fully_shard, _ = S._fsdp()
    for bad in (None, 3, [torch.nn.Linear(2, 2), "x"]):
        with pytest.raises(Exception) as stock:
            fully_shard(bad)
        with pytest.raises(type(stock.value)):
            fsdp_autocast_fix.patched_fully_shard(bad)
    assert not _patch._covers


class InterruptedOnce(S.GeluLinear):
    armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and torch._C._current_graph_task_id() != -1:
            self.armed = False
            raise KeyboardInterrupt("Ctrl-C during the recompute")
        return super().forward(x)


def _interrupted(patched: bool) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A model whose replayed recompute was interrupted by a KeyboardInterrupt (Ctrl-C during backward)."""
    fully_shard, policy_cls = S._fsdp()
    if patched:
        fsdp_autocast_fix.apply()
    torch.manual_seed(0)
    layer, after = InterruptedOnce(), S.GeluLinear()
    fully_shard(layer, mp_policy=policy_cls())
    fully_shard(after, mp_policy=policy_cls())
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        out = S.RecomputeWithoutAutocast.apply(layer, x)
    with pytest.raises(KeyboardInterrupt):
        out.float().sum().backward()
    x.grad = None
    return layer, after, x


def test_a_keyboard_interrupt_in_the_recompute_leaves_nothing_behind_at_the_next_call() -> None:
    """``always_call`` hooks do not run for a ``KeyboardInterrupt``: the module's next call forgets the replay it
    left behind and restores the autocast state the replay had entered (nothing was entered on top of it)."""
    def run(patched: bool) -> tuple[list[bool], S.Result]:
        layer, after, x = _interrupted(patched)
        seen = [torch.is_autocast_enabled("cpu")]
        with torch.no_grad():
            layer(x)  # the next call: an eval forward, no autocast
        seen.append(torch.is_autocast_enabled("cpu"))
        with torch.autocast("cpu", dtype=S.BF16):
            loss = after(layer(x)).float().sum()
        loss.backward()
        fsdp_autocast_fix.remove()
        return seen, S.Result(grads=[x.grad] + [p.grad.full_tensor() for p in after.parameters()])

    stock_seen, stock = run(False)
    seen, patched = run(True)
    assert seen == stock_seen == [False, False]  # the engine restored it as the backward unwound
    assert patched.same_as(stock)
    assert _nesting() == 0  # and the patch its nesting count: the cast cache is cleared at region ends again
    assert not _replay._tls.frames
    assert not any(m.replayer.replays for cover in list(_patch._covers.values()) for m in cover.modules)


def _nesting() -> int:
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return nesting


def test_a_keyboard_interrupt_then_a_new_autocast_region() -> None:
    """The next call inside a new region: the user's state stands; the count is right once the region ends."""
    layer, after, x = _interrupted(True)
    with torch.autocast("cpu", dtype=torch.float16):
        layer(x)
        assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == (True, torch.float16)
    assert not torch.is_autocast_enabled("cpu") and _nesting() == 0


def test_inputs_made_under_inference_mode() -> None:
    """A sharded module called outside inference mode on tensors made under it (no version counter): as stock."""
    with torch.inference_mode():
        x = torch.randn(4, S.DIM)
    outputs = []
    for patched in (False, True):
        torch.manual_seed(0)
        layer = _sharded(patched=patched)
        with torch.no_grad(), torch.autocast("cpu", dtype=S.BF16):
            outputs.append(layer(x))
            outputs.append(layer((x, x)[0]))
    assert all(torch.equal(outputs[0], out) for out in outputs)


def test_every_hold_a_backward_entered_ends_with_it() -> None:
    """Three sharded layers, each under a checkpoint that does not restore autocast, one backward outside
    autocast, twice: each recompute is a region whose state the patch enters and holds; the backward's end
    releases the last hold (one end-of-backward release per backward and thread), so that autocast's nesting
    count, state and cache flag are as before once the backward returns, before any other forward; the gradients
    are those of the run without checkpointing. Positive control: with the release not queued, the hold outlives
    the backward (the count stays up), where the recompute's own backward does not end it first (it does: a
    backward reaching a replayed call's output ends its region's hold)."""
    def run(checkpointed: bool, release: bool = True, end_when_backwarded: bool = True) -> tuple[list[Any],
                                                                                                 S.Result]:
        torch.manual_seed(0)
        fully_shard, policy_cls = S._fsdp()
        fsdp_autocast_fix.apply()
        layers = [S.GeluLinear() for _ in range(3)]
        for layer in layers:
            fully_shard(layer, mp_policy=policy_cls())
        x = torch.randn(4, S.DIM, requires_grad=True)
        after: list[Any] = []
        real = _compat.load()
        queued = [0]

        def queue(callback: Any) -> None:
            queued[0] += 1
            if release:
                real.queue_backward_callback(callback)

        internals = dataclasses.replace(real, queue_backward_callback=queue)
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(_compat, "load", lambda: internals)
            if not end_when_backwarded:
                monkeypatch.setattr(_replay, "_end_when_backwarded", lambda output, entered: None)
            for _ in range(2):
                queued[0] = 0
                with torch.autocast("cpu", dtype=S.BF16):
                    h = x
                    for layer in layers:
                        h = S.RecomputeWithoutAutocast.apply(layer, h) if checkpointed else layer(h)
                h.float().sum().backward()
                after.append((_nesting(), _replay.held, _replay.Region.current() is None,
                              torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled(), queued[0]))
        _replay.release_region()
        fsdp_autocast_fix.remove()
        return after, S.Result(grads=[x.grad] + [p.grad.full_tensor() for m in layers for p in m.parameters()])

    _, reference = run(False)
    after, patched = run(True)
    assert after == [(0, 0, True, False, True, 1)] * 2  # three holds, one release queued per backward
    assert patched.same_as(reference)
    ended_by_the_recompute, _ = run(True, release=False)
    assert ended_by_the_recompute[0][:2] == (0, 0)  # the holds (the region itself ends at the next one)
    unreleased, _ = run(True, release=False, end_when_backwarded=False)
    assert unreleased[0][:3] == (1, 1, False)


def test_a_hold_started_in_a_final_callback_of_the_backward_ends_with_it() -> None:
    """A final callback queued after the patch's end-of-backward release (a metric pass on the training batch,
    ``no_grad``, autocast off) runs the sharded module while the backward's graph task is still current: a
    recompute for the patch, whose replay enters the forward's state and holds it. That hold is released when
    the backward ends too, so autocast's nesting count is 0 again and an unsharded module's autocast region
    empties the cast cache at its exit: after an optimizer step its next region casts the new weight, not the
    old one's cached cast (silently stale bits otherwise). Positive control: with the pending mark not cleared
    when the release runs, the hold outlives the backward and the stale cast is used."""
    def run(clear_mark: bool) -> tuple[int, bool]:
        torch.manual_seed(0)
        fully_shard, policy_cls = S._fsdp()
        fsdp_autocast_fix.apply()
        layer = S.GeluLinear()
        fully_shard(layer, mp_policy=policy_cls())
        x = torch.randn(4, S.DIM, requires_grad=True)

        def metric() -> None:
            with torch.no_grad():
                layer(x)

        x.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(metric) or g)
        real_end = _replay._end_of_backward
        with pytest.MonkeyPatch.context() as monkeypatch:
            if not clear_mark:  # the release as it would be without clearing the thread's mark
                def end_keeping_mark(graph_task: int) -> None:
                    mark = getattr(_replay._tls, "ending", None)
                    real_end(graph_task)
                    _replay._tls.ending = mark
                monkeypatch.setattr(_replay, "_end_of_backward", end_keeping_mark)
            with torch.autocast("cpu", dtype=S.BF16):
                out = S.RecomputeWithoutAutocast.apply(layer, x)
            out.float().sum().backward()
        nesting = _nesting()
        torch.manual_seed(1)
        head, z = torch.nn.Linear(S.DIM, S.DIM), torch.randn(4, S.DIM)
        with torch.no_grad(), torch.autocast("cpu", dtype=S.BF16):
            head(z)  # caches the bf16 cast of head.weight until autocast's outermost region ends
        with torch.no_grad():
            head.weight.add_(1.0)  # an optimizer step
        with torch.autocast("cpu", dtype=S.BF16):
            y = head(z)
        fresh = torch.nn.functional.linear(z.bfloat16(), head.weight.bfloat16(), head.bias.bfloat16())
        _replay.release_region()
        fsdp_autocast_fix.remove()
        return nesting, torch.equal(y, fresh)

    assert run(clear_mark=True) == (0, True)
    assert run(clear_mark=False) == (1, False)
