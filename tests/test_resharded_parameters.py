"""Issue 38: a recompute finds its parameters gathered as its forward did, on torch before 2.11 too.

A checkpointed parent holding a child sharded on its own, called twice before one backward (DPO's chosen and
rejected forwards; a module applied twice, pytorch issue 187437): the second call's backward runs the child's
post-backward, which reshards it, before the first call's recompute. torch before 2.11 returns early from
``FSDPState._pre_forward`` in that recompute and leaves the child sharded ("mixed torch.Tensor and DTensor",
pytorch issue 153354); torch 2.11 and later gather it, and the patch does the same where torch does not
(``Internals.needs_param_gather``, probed on torch's own code). The named cells of the generated space are in
tests/helpers/grid.py (``NAMED``, "resharding torch"); here the same shape across FSDP's knobs.
"""

from __future__ import annotations

from typing import Any

import grid as G
import pytest
import torch
from torch.distributed._composable import checkpoint as composable_checkpoint

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat

pytestmark = pytest.mark.usefixtures("pg")


def _twice(mode: str, frontend: str, reshard: Any = True, prefetch: bool = False, bf16: bool = False,
           use_checkpoint: bool = True) -> tuple[G.Result, fsdp_autocast_fix.Report]:
    """``G.Outer`` (a block holding ``sub``, sharded on its own) checkpointed by ``frontend``, called on two inputs
    before one backward; ``reshard``: ``reshard_after_forward``; ``prefetch``: the parent prefetches the child
    in backward (``set_modules_to_backward_prefetch``); ``bf16``: a bf16 policy under bf16 autocast."""
    torch.manual_seed(0)
    package = _compat.fsdp_package()
    fsdp_autocast_fix.report(reset=True)
    with G.in_mode(mode) as fully_shard:
        model = G.Outer()
        policy = package.MixedPrecisionPolicy(param_dtype=G.BF16 if bf16 else None)
        fully_shard(model.sub, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
        if prefetch:
            model.set_modules_to_backward_prefetch([model.sub])
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        if frontend == "composable" and use_checkpoint:
            composable_checkpoint(model)
        run = G.frontend_fn("none" if frontend == "composable" or not use_checkpoint else frontend)
        x1, x2 = (torch.randn(4, G.DIM, requires_grad=True) for _ in range(2))
        try:
            with torch.autocast("cpu", dtype=G.BF16, enabled=bf16):
                out1, out2 = run(model, x1), run(model, x2)
            (out1.float().sum() + out2.float().pow(2).sum()).backward()
        except Exception as e:
            return G.Result(error=e), fsdp_autocast_fix.report()
        grads = [G.full_grad(x1.grad), G.full_grad(x2.grad)] + [G.full_grad(p.grad) for p in model.parameters()]
        return G.Result(grads=grads), fsdp_autocast_fix.report()


def _check(frontend: str, **kwargs: Any) -> None:
    """Stock fails where torch leaves the child sharded (the positive control) and, with the non-reentrant
    checkpoints, is right where it gathers it; patched, every mode is bitwise the run without checkpointing, and
    counts the gathers exactly where this torch needs them."""
    truth, _ = _twice("stock", frontend, use_checkpoint=False, **kwargs)
    assert truth.error is None, repr(truth.error)
    stock, _ = _twice("stock", frontend, **kwargs)
    internals = _compat.load()
    # A reentrant recompute runs as a forward of its own, which gathers.
    needs = internals.needs_param_gather and frontend != "torch_reentrant"
    casts = kwargs.get("bf16") and internals.needs_cast_replay  # the lost input cast of the seed report, first
    if needs and not casts:
        assert stock.error is not None and "DTensor" in str(stock.error), stock.verdict(truth)
    elif needs or casts:
        assert stock.verdict(truth) != "bitwise"
    else:
        assert stock.verdict(truth) == "bitwise"
    for mode in G.PATCHED_MODES:
        result, report = _twice(mode, frontend, **kwargs)
        assert result.verdict(truth) == "bitwise", mode
        assert (report.param_gathers > 0) == needs, (mode, report)


@pytest.mark.parametrize("frontend", ["composable", "torch", "torch_reentrant"])
def test_a_parent_with_a_sharded_child_called_twice_before_one_backward(frontend: str) -> None:
    _check(frontend)


@pytest.mark.parametrize("reshard", [True, False, 1], ids=["reshard", "no_reshard", "reshard_to_1"])
def test_the_gather_holds_for_every_reshard_after_forward(reshard: Any) -> None:
    _check("torch", reshard=reshard)


def test_the_gather_holds_with_explicit_backward_prefetch() -> None:
    """Explicit prefetch where this torch has it (``set_modules_to_backward_prefetch``, 2.5+), else FSDP's own."""
    _check("torch", prefetch=hasattr(_compat.fsdp_package().FSDPModule, "set_modules_to_backward_prefetch"))


def test_the_gather_holds_with_a_bf16_policy_under_autocast() -> None:
    _check("torch", bf16=True)


def test_status_says_whether_this_torch_needs_the_gather() -> None:
    assert fsdp_autocast_fix.status().needs_param_gather is _compat.load().needs_param_gather
