"""Issue 37's cases: the patch leaves stock's bits where stock is right, its peak memory is never above stock's or
the exact workaround's, a registered method is recorded and replayed as ``forward`` is, and a checkpoint inside
another's recompute is replayed exactly (or warned about and reported, where it cannot be).

Each case states what stock torch does there (the positive control, or "right, and the patch keeps its bits");
every patched mode must give the gradients of the run without checkpointing, bitwise.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, Callable

import grid as G
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_autocast_fix
from fsdp_autocast_fix import _cache, _compat, _replay

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import memory  # noqa: E402

pytestmark = pytest.mark.usefixtures("pg")


def _buggy() -> bool:
    return _compat.load().needs_cast_replay


def _grads(*tensors: torch.Tensor, modules: tuple[nn.Module, ...] = ()) -> G.Result:
    return G.Result(grads=[G.full_grad(t.grad) for t in tensors] + [G.full_grad(p.grad) for m in modules
                                                                  for p in m.parameters()])


# -- 1. the cast-cache rule: no drop where autocast cached nothing without grad --------------------------


def _passes(mode: str, history: str, shard: bool = True) -> G.Result:
    """A trainable block ``m`` and a frozen one ``f`` (fp32 parameters) in one autocast region, backwarded once:

    * ``frozen_between``: ``m``, ``f`` under ``no_grad`` (a critic on the real batch), ``f`` on ``m``'s output,
      ``m`` again (a GAN's or a distillation step's shape);
    * ``eval_before``: ``m`` under ``no_grad`` first, then ``m`` twice: the eval's casts are cached without
      grad, a real hazard (stock loses the gradients);
    * ``eval_between``: ``m``, ``m`` under ``no_grad``, ``m``: the first pass cached its casts with grad, the
      eval and the last pass reuse them (stock is right).

    ``shard=False``: the ground truth, the unsharded model, where the eval's casts are dropped after it as plain
    PyTorch must not reuse them either (before torch 2.12 they have no autograd history at all).
    """
    torch.manual_seed(0)
    with G.in_mode(mode) as fully_shard:
        m, f = G.Block(), G.Block()
        f.requires_grad_(False)
        if shard:
            policy = _compat.fsdp_package().MixedPrecisionPolicy()
            fully_shard(m, mp_policy=policy)
            fully_shard(f, mp_policy=policy)
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        x1, x2, real = (torch.randn(4, G.DIM, requires_grad=i < 2) for i in range(3))
        try:
            with torch.autocast("cpu", dtype=G.BF16):
                if history == "eval_before":
                    with torch.no_grad():
                        m(real)
                    if not shard:
                        torch.clear_autocast_cache()
                a = m(x1)
                if history == "eval_between":
                    with torch.no_grad():
                        m(real)
                if history == "frozen_between":
                    with torch.no_grad():
                        f(real)
                    a = f(a)
                b = m(x2)
            (a.float().sum() + b.float().pow(2).sum()).backward()
        except Exception as e:
            return G.Result(error=e)
    return _grads(x1, x2, modules=(m,))


@pytest.mark.parametrize("history", ["frozen_between", "eval_between"])
def test_a_no_grad_pass_between_training_passes_keeps_stocks_bits(history: str) -> None:
    """Stock is right: autocast never caches a frozen parameter's cast, and a trainable one's was cached with grad
    by the first pass. The patch drops nothing and the eval reads nothing from the cache: the very same bits as
    stock (a drop would make the last pass cast the weights anew: other bits in the last place)."""
    truth = _passes("stock", history, shard=False)
    stock = _passes("stock", history)
    assert stock.verdict(truth) == "bitwise"
    for mode in G.PATCHED_MODES:
        assert _passes(mode, history).same_as(stock), mode


class _TwoTowers(nn.Module):
    """One FSDP state, two towers; each call runs one (CLIP's ``encode_image`` / ``encode_text``)."""

    def __init__(self) -> None:
        super().__init__()
        self.img, self.txt = nn.Linear(G.DIM, G.DIM), nn.Linear(G.DIM, G.DIM)

    def forward(self, x: torch.Tensor, tower: str) -> torch.Tensor:
        return (self.img if tower == "img" else self.txt)(F.gelu(x))


def _towers(mode: str, shard: bool = True) -> G.Result:
    """Text with grad (its output unused), an image eval under ``no_grad``, image with grad, in one region."""
    torch.manual_seed(0)
    with G.in_mode(mode) as fully_shard:
        model = _TwoTowers()
        if shard:
            fully_shard(model, mp_policy=_compat.fsdp_package().MixedPrecisionPolicy())
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        x1, x2, real = (torch.randn(4, G.DIM, requires_grad=i < 2) for i in range(3))
        with torch.autocast("cpu", dtype=G.BF16):
            model(x1, "txt")
            if shard:
                with torch.no_grad():
                    model(real, "img")
            out = model(x2, "img")
        out.float().pow(2).sum().backward()
    return _grads(x2, modules=(model,))


def test_a_no_grad_call_casting_other_parameters_of_a_state_than_its_grad_calls_is_a_hazard() -> None:
    """Found by review: a grad-enabled call of a state does not tell which of its parameters autocast cached;
    the image tower's first cast is the eval's, made without grad, which costs stock the image gradients."""
    truth = _towers("stock", shard=False)
    assert _towers("stock").verdict(truth) != "bitwise"  # positive control
    for mode in G.PATCHED_MODES:
        assert _towers(mode).verdict(truth) == "bitwise", mode


def test_a_no_grad_pass_that_casts_first_is_still_a_hazard() -> None:
    """The rule's other side: an eval pass first in the cache's lifetime caches its casts without grad, which
    costs stock the gradients of the passes after it; the patch drops the cache before them."""
    truth = _passes("stock", "eval_before", shard=False)
    assert _passes("stock", "eval_before").verdict(truth) != "bitwise"  # positive control
    for mode in G.PATCHED_MODES:
        assert _passes(mode, "eval_before").verdict(truth) == "bitwise", mode


def test_a_torch_whose_autocast_ignores_the_marks_is_unsupported() -> None:
    """Without the marks a ``no_grad`` call's casts could only be dropped, which changes the bits of passes that
    share casts: the probe refuses marks that autocast does not honour (here, marks that mark nothing), and this
    torch's own pass it."""
    assert isinstance(_compat.load().cache_marks, _compat.CacheMarks)
    ignored = (lambda t: None, lambda t: None, lambda t: True, lambda on: None)
    with pytest.raises(_compat.UnsupportedTorchError, match="autocast's cache marks.*does not honour them"):
        _compat._probe_cache_marks(*ignored)


@pytest.mark.parametrize("end", ["training_call", "remove", "model_freed"])
def test_the_shield_lasts_from_a_no_grad_call_to_the_next_training_call(end: str) -> None:
    """The marks a ``no_grad`` call puts on its gathered parameters are on through its forward and off before
    the next grad-enabled call casts, or at ``remove()`` (also where the model was freed first). torch's flag for
    them stays on once the patch turned it on: something else marking its own tensors meanwhile (CUDA graph
    trees' calls, here on CPU) keeps working."""
    marks = _compat.load().cache_marks
    assert marks is not None
    seen: list[bool] = []
    with G.in_mode("apply") as fully_shard:
        m = G.Block()
        fully_shard(m, mp_policy=_compat.fsdp_package().MixedPrecisionPolicy())
        state = _compat.load().state_of(m)
        m.register_forward_hook(lambda *_: seen.append(all(
            marks.marked(p) for p in _compat.unsharded_parameters(state))))
        x = torch.randn(4, G.DIM)
        with torch.autocast("cpu", dtype=G.BF16):
            m(x)  # gathers once: the parameters' tensors exist from here
            with torch.no_grad():
                m(x)
            theirs = torch.randn(2)
            marks.add(theirs)  # another user of the flag, after the patch turned it on
            parameters = _compat.unsharded_parameters(state)
            if end == "training_call":
                m(x)
                assert not any(marks.marked(p) for p in parameters)
            elif end == "model_freed":
                del m, state
                gc.collect()
    assert not _cache._shielded and not any(marks.marked(p) for p in parameters)
    assert marks.flag_on() and marks.marked(theirs)
    marks.remove(theirs)
    assert seen[:2] == [False, True] and seen[2:] == ([False] if end == "training_call" else []), seen


class _SelfEncoder(nn.Module):
    """A block whose forward runs its own ``encode`` (registered with ``register_fsdp_forward_method``) under
    ``no_grad`` between two uses of its weight with grad (found by review)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(G.DIM, G.DIM)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        with torch.no_grad():
            t = self.encode(x)
        return self.lin(a) + t


def _self_encoder(mode: str, shard: bool = True) -> G.Result:
    torch.manual_seed(0)
    with G.in_mode(mode) as fully_shard:
        m = _SelfEncoder()
        if shard:
            fully_shard(m, mp_policy=_compat.fsdp_package().MixedPrecisionPolicy())
            _compat.fsdp_package().register_fsdp_forward_method(m, "encode")
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        x = torch.randn(4, G.DIM, requires_grad=True)
        with torch.autocast("cpu", dtype=G.BF16):
            out = m(x)
        out.float().pow(2).sum().backward()
    return _grads(x, modules=(m,))


def test_a_registered_methods_no_grad_call_inside_a_training_forward_keeps_stocks_bits() -> None:
    """Stock is right: the method's eval reuses the cast the forward cached with grad, and so does the weight's
    second use. The method's marks end with the method's call, so that second use reuses the cast too."""
    truth = _self_encoder("stock", shard=False)
    stock = _self_encoder("stock")
    assert stock.verdict(truth) == "bitwise"
    for mode in G.PATCHED_MODES:
        assert _self_encoder(mode).same_as(stock), mode


# -- 2. peak memory ------------------------------------------------------------------------------------


MEMORY_CASES = [memory.Config(c, p, 8) for c in memory.CHECKPOINTS for p in ("fp32", "bf16")]


@pytest.mark.parametrize("config", MEMORY_CASES, ids=[f"{c.checkpoint}-{c.params}" for c in MEMORY_CASES])
def test_peak_memory_is_never_above_stocks_or_the_exact_workarounds(config: memory.Config) -> None:
    """Peak bytes of one step from torch's allocation record (exact on CPU): where stock is right, patched at most
    stock's; elsewhere at most the larger of stock's (where it runs) and that of ``preserve_autocast`` without the
    patch, whose gradients the patched run gives bitwise."""
    row = memory.row(config)
    assert row["grads_equal_exact"]
    if row["stock_grads_equal_exact"]:
        assert row["patched_peak"] <= row["stock_peak"], row
    else:
        assert row["patched_peak"] <= max(p for p in (row["stock_peak"], row["exact_peak"]) if p is not None), row


def test_peak_memory_control_a_hold_kept_to_the_end_of_backward_costs_a_layer_of_casts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: where the replay's hold on autocast's cache is kept to the end of the backward
    (as it was), the bf16 casts of every layer's fp32 parameters stay alive together, above the workaround."""
    config = memory.Config("fn_disable", "fp32", 8)
    exact = memory.run(config, "exact").peak
    monkeypatch.setattr(_replay, "_end_when_backwarded", lambda output, entered: None)
    held = memory.run(config, "patched").peak
    assert exact is not None and held is not None and held > exact


def _sharded_stack(mode: str, fully_shard: Callable[..., Any]) -> G.Stack:
    """Two sharded fp32 blocks in a sharded stack, with ``apply()`` after sharding in the late mode."""
    model = G.Stack([G.Block(), G.Block()])
    policy = _compat.fsdp_package().MixedPrecisionPolicy()
    for unit in model.units:
        fully_shard(unit, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if mode == "late_apply":
        fsdp_autocast_fix.apply()
    return model


def _penalty(mode: str, frontend: str) -> G.Result:
    """Two sharded blocks in one checkpointed region that takes a gradient of the first block's output (an
    input-gradient penalty) before calling the second: a backward inside the recompute."""
    torch.manual_seed(0)
    with G.in_mode(mode) as fully_shard:
        model = _sharded_stack(mode, fully_shard)
        first, second = model.units

        def region(x: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                h = first(x)
                (g,) = torch.autograd.grad(h.float().pow(2).sum(), [x], retain_graph=True) if x.requires_grad \
                    else (torch.zeros_like(x),)
                return second(h + 0.1 * g.to(h.dtype))

        model.body = lambda x, s: G.frontend_fn(frontend)(region, x)
        x = torch.randn(4, G.DIM, requires_grad=True)
        with torch.autocast("cpu", dtype=G.BF16):
            out = model(x)
        out.float().pow(2).sum().backward()
    return _grads(x, modules=(model,))


@pytest.mark.parametrize("frontend", ["fn_no_restore", "fn_disable"])
def test_a_backward_inside_a_region_lets_its_hold_go_and_its_later_calls_enter_the_state_again(frontend: str) -> None:
    """Found by review: the backward inside the recompute reaches the first block's output, which lets the region's
    hold go; the second block, a later call of the same region, enters the state again. The truth is the same
    region under a checkpoint that restores autocast (the penalty needs the region's graph)."""
    truth = _penalty("stock", "fn_restore")
    assert _penalty("stock", frontend).verdict(truth) != "bitwise"  # positive control
    for mode in G.PATCHED_MODES:
        assert _penalty(mode, frontend).verdict(truth) == "bitwise", mode


# -- 3. a method registered with register_fsdp_forward_method -----------------------------------------


class _Encoder(nn.Module):
    """``encode`` is the route into FSDP (CLIP's ``encode_image``); ``float_first``: it begins with ``x.float()``,
    where a lost input cast changes values, not dtypes."""

    def __init__(self, float_first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(G.DIM, G.DIM)
        self.float_first = float_first

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_first:
            x = x.float()
            return self.lin(x * x)
        return self.lin(F.log_softmax(F.gelu(x), dim=-1).to(self.lin.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)


def _encode(mode: str, frontend: str, precision: str, float_first: bool, register: str = "before",
            shard: bool = True) -> tuple[G.Result, fsdp_autocast_fix.Report]:
    """One step through ``model.encode``, checkpointed by ``frontend``; the method registered ``before`` or
    ``after`` the patch is applied."""
    torch.manual_seed(0)
    package = _compat.fsdp_package()
    fsdp_autocast_fix.report(reset=True)
    with G.in_mode(mode) as fully_shard:
        model = _Encoder(float_first)
        if shard:
            fully_shard(model, mp_policy=package.MixedPrecisionPolicy(**G._policy(precision)))
            if register == "before":
                package.register_fsdp_forward_method(model, "encode")
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        if shard and register == "after":
            package.register_fsdp_forward_method(model, "encode")
        x = torch.randn(4, G.DIM, requires_grad=True)
        try:
            with torch.autocast("cpu", dtype=G.BF16):
                out = G.frontend_fn(frontend)(model.encode, x)
            out.float().pow(2).sum().backward()
        except Exception as e:
            return G.Result(error=e), fsdp_autocast_fix.report()
        return _grads(x, modules=(model,)), fsdp_autocast_fix.report()


METHOD_CASES = [(f, p, ff) for f in ("torch", "torch_reentrant", "fn_no_restore")
                for p in ("bf16_params", "output_fp32", "fp32_params") for ff in (False, True)]


@pytest.mark.parametrize("frontend, precision, float_first", METHOD_CASES)
def test_a_registered_method_is_recorded_and_replayed_as_forward_is(frontend: str, precision: str,
                                                                      float_first: bool) -> None:
    """Stock: the seed report's ``CheckpointError`` (or, with ``x.float()``, wrong gradients) under torch's
    checkpoint with a casting policy on a buggy torch; wrong gradients under a checkpoint that does not restore
    autocast with fp32 parameters on every torch. Patched, registered before or after the patch: exact."""
    truth, _ = _encode("stock", "none", precision, float_first, shard=precision != "fp32_params")
    assert truth.error is None
    stock, _ = _encode("stock", frontend, precision, float_first)
    broken = (frontend == "torch" and precision != "fp32_params" and _buggy()) or (
        frontend == "fn_no_restore" and (precision == "fp32_params" or float_first))
    assert (stock.verdict(truth) != "bitwise") == broken, stock.verdict(truth)
    for mode in G.PATCHED_MODES:
        for register in ("before", "after"):
            result, report = _encode(mode, frontend, precision, float_first, register)
            assert result.verdict(truth) == "bitwise", (mode, register)
            assert report.by_module["_Encoder"].recomputes == 1, (mode, register)


class _CallsItsMethod(nn.Module):
    """A block whose ``forward`` calls its registered ``encode`` (as CLIP's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(G.DIM, G.DIM)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.gelu(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x) * 2


def _method_in_forward(mode: str, use_checkpoint: bool = True) -> G.Result:
    """``a`` (an ``output_dtype`` policy) under torch's checkpoint, whose early stop unwinds ``a.encode`` in the
    recompute before its post-forward; then ``b`` (fp32) under a checkpoint that does not restore autocast,
    recomputed later in the same backward."""
    torch.manual_seed(0)
    package = _compat.fsdp_package()
    with G.in_mode(mode) as fully_shard:
        root = nn.Module()
        root.b, root.a = G.Block(), _CallsItsMethod()
        fully_shard(root.b, mp_policy=package.MixedPrecisionPolicy())
        fully_shard(root.a, mp_policy=package.MixedPrecisionPolicy(**G._policy("output_fp32")))
        package.register_fsdp_forward_method(root.a, "encode")
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        x = torch.randn(4, G.DIM, requires_grad=True)
        try:
            with torch.autocast("cpu", dtype=G.BF16):
                if use_checkpoint:
                    out = torch.utils.checkpoint.checkpoint(root.a, G.frontend_fn("fn_no_restore")(root.b, x),
                                                            use_reentrant=False)
                else:
                    out = root.a(root.b(x))
            out.float().pow(2).sum().backward()
        except Exception as e:
            return G.Result(error=e)
    return _grads(x, modules=(root,))


def test_a_method_unwound_by_early_stop_inside_a_forward_is_undone_before_the_forwards_own_replay() -> None:
    """Found by review: the forward's exit hook undid the method's replay instead of its own, so the forward's
    stayed in flight and the later recompute of ``b`` was taken for a module inside it (not replayed)."""
    truth = _method_in_forward("stock", use_checkpoint=False)
    if truth.error is not None:  # torch 2.5 (seen): FSDP cannot run a method inside the forward of its own module
        for mode in G.PATCHED_MODES:  # (its second pre-forward finds the parameters in another state); nor patched
            assert type(_method_in_forward(mode, use_checkpoint=False).error) is type(truth.error), mode
        return
    assert _method_in_forward("stock").verdict(truth) != "bitwise"  # positive control: b's lost autocast
    for mode in G.PATCHED_MODES:
        assert _method_in_forward(mode).verdict(truth) == "bitwise", mode
    assert not _replay._tls.methods and not _replay._tls.frames


def test_a_registered_method_leaves_no_attribute_on_the_state_after_remove() -> None:
    package = _compat.fsdp_package()
    model = _Encoder(False)
    package.fully_shard(model)
    state = _compat.load().state_of(model)
    fsdp_autocast_fix.apply()
    assert "_pre_forward" in vars(state) and "_post_forward" in vars(state)
    fsdp_autocast_fix.remove()
    assert "_pre_forward" not in vars(state) and "_post_forward" not in vars(state)


# -- 4. a checkpoint inside another checkpoint's recompute --------------------------------------------


def _nested(mode: str, outer: str, inner: str, use_checkpoint: bool = True) -> tuple[G.Result,
                                                                                     fsdp_autocast_fix.Report]:
    """Two sharded fp32 blocks, each in the checkpoint ``inner``, the whole stack in the checkpoint ``outer`` (a
    Hugging Face-style outer checkpoint), under bf16 autocast, the backward outside it."""
    torch.manual_seed(0)
    fsdp_autocast_fix.report(reset=True)
    with G.in_mode(mode) as fully_shard:
        model = _sharded_stack(mode, fully_shard)
        inner_fn = G.frontend_fn(inner if use_checkpoint else "none")

        def body(x: torch.Tensor, s: Any) -> torch.Tensor:
            for unit in model.units:
                x = inner_fn(unit, x)
            return x

        model.body = body
        x = torch.randn(4, G.DIM, requires_grad=True)
        try:
            with torch.autocast("cpu", dtype=G.BF16):
                out = G.frontend_fn(outer if use_checkpoint else "none")(model, x)
            out.float().pow(2).sum().backward()
        except Exception as e:
            return G.Result(error=e), fsdp_autocast_fix.report()
        return _grads(x, modules=(model,)), fsdp_autocast_fix.report()


@pytest.mark.parametrize("inner", ["fn_no_restore", "fn_disable"])
def test_a_checkpoint_inside_a_reentrant_recompute_is_replayed_exactly(inner: str) -> None:
    """The inner checkpoint's forward runs inside the outer recompute (no_grad, in the state the outer restored):
    recorded there, its own recompute (in the outer's backward, outside its autocast blocks) replays it. Stock
    recomputes the inner under the backward's state: wrong gradients."""
    truth, _ = _nested("stock", "torch_reentrant", inner, use_checkpoint=False)
    stock, _ = _nested("stock", "torch_reentrant", inner)
    assert stock.verdict(truth) != "bitwise"  # positive control
    for mode in G.PATCHED_MODES:
        result, report = _nested(mode, "torch_reentrant", inner)
        assert result.verdict(truth) == "bitwise", mode
        assert report.autocast_changed >= 2 and not report.unidentified, (mode, report)


def test_a_checkpoint_inside_an_early_stopping_recompute_is_warned_about_and_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    """Under torch's non-reentrant checkpoint with early stop, the outer recompute stops before the last inner
    forward runs: nothing records it, and its recompute cannot be identified. The patch warns once and the report
    says so; never that the patch changed nothing. ``preserve_autocast`` around the inner checkpoint is exact."""
    truth, _ = _nested("stock", "torch", "fn_no_restore", use_checkpoint=False)
    assert _nested("stock", "torch", "fn_no_restore")[0].verdict(truth) != "bitwise"  # positive control
    for mode in G.PATCHED_MODES:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_autocast_fix"):
            _, report = _nested(mode, "torch", "fn_no_restore")
        assert report.unidentified >= 1, mode
        assert "changed nothing" not in report.advice() and "preserve_autocast" in report.advice(), mode
        assert any("cannot tell which forward call" in r.getMessage() for r in caplog.records), mode


@contextlib.contextmanager
def _preserved_inner() -> Iterator[None]:
    real = G.frontend_fn

    def frontend_fn(frontend: str) -> Callable[..., torch.Tensor]:
        fn = real(frontend)
        return fsdp_autocast_fix.preserve_autocast(fn) if frontend == "fn_no_restore" else fn

    G.frontend_fn = frontend_fn  # type: ignore[assignment]
    try:
        yield
    finally:
        G.frontend_fn = real  # type: ignore[assignment]


def test_preserve_autocast_on_the_inner_checkpoint_is_exact_under_an_early_stopping_recompute() -> None:
    truth, _ = _nested("stock", "torch", "fn_no_restore", use_checkpoint=False)
    with _preserved_inner():
        for mode in ("stock",) + G.PATCHED_MODES:
            assert _nested(mode, "torch", "fn_no_restore")[0].verdict(truth) == "bitwise", mode


def test_the_advice_never_says_nothing_changed_about_recomputes_it_could_not_identify() -> None:
    report = fsdp_autocast_fix.Report(recomputes=2, unidentified=2)
    assert "changed nothing" not in report.advice() and "preserve_autocast" in report.advice()
