"""Every bug scenario: positive control on stock torch, bitwise parity under each way of patching."""

from __future__ import annotations

import pytest
import scenarios as S
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint, set_checkpoint_early_stop

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat

pytestmark = pytest.mark.usefixtures("pg")
NAMES = sorted(S.ALL)


@pytest.fixture(scope="module")
def references(pg: None) -> dict[str, S.Result]:
    refs = {name: S.run(S.ALL[S.ALL[name].reference_of or name], "reference") for name in NAMES}
    for name, ref in refs.items():
        assert ref.error is None, f"{name}: the run without checkpointing failed: {ref.error!r}"
    return refs


@pytest.mark.parametrize("name", NAMES)
def test_positive_control(name: str, references: dict[str, S.Result]) -> None:
    """Stock torch: broken scenarios raise or give different gradients; the others match bitwise."""
    scenario = S.ALL[name]
    stock = S.run(scenario, "stock")
    if scenario.broken_stock():
        assert stock.error is not None or not stock.same_as(references[name]), (
            f"{name}: expected stock torch {torch.__version__} to fail, but it matched"
        )
        if stock.error is not None:
            assert isinstance(stock.error, (CheckpointError, RuntimeError)), repr(stock.error)
    else:
        assert stock.error is None, repr(stock.error)
        assert stock.same_as(references[name])


@pytest.mark.parametrize("mode", S.FIXED_MODES)
@pytest.mark.parametrize("name", NAMES)
def test_fixed_bitwise(name: str, mode: str, references: dict[str, S.Result]) -> None:
    """Patched: input and parameter gradients bitwise equal to the run without checkpointing."""
    result = S.run(S.ALL[name], mode)
    assert result.error is None, repr(result.error)
    assert result.same_as(references[name])


def test_remove_brings_the_failure_back(references: dict[str, S.Result]) -> None:
    scenario = S.SCENARIOS["float_first"] if _compat.load().needs_cast_replay else S.SCENARIOS[
        "custom_function_checkpoint"]
    assert S.run(scenario, "apply").same_as(references[scenario.name])
    fsdp_autocast_fix.apply()
    fsdp_autocast_fix.remove()
    stock = S.run(scenario, "stock")
    assert stock.error is not None or not stock.same_as(references[scenario.name])


@pytest.mark.parametrize("patch", ["none", "apply", "patched_fully_shard"])
def test_recompute_output_dtype(patch: str) -> None:
    """The recompute's output has FSDP's ``output_dtype``, as in the forward.

    ``cast_forward_inputs=False`` isolates the output cast: stock torch <= 2.12
    returns the recomputed output uncast (bf16 from autocast) instead of fp32.
    """
    fully_shard, policy_cls = S._fsdp()
    if patch == "apply":
        fsdp_autocast_fix.apply()
    if patch == "patched_fully_shard":
        fully_shard = fsdp_autocast_fix.patched_fully_shard
    layer = S.GeluLinear()
    fully_shard(layer, mp_policy=policy_cls(param_dtype=S.BF16, output_dtype=torch.float32,
                                            cast_forward_inputs=False))
    seen: list[torch.dtype] = []

    def region(h: torch.Tensor) -> torch.Tensor:
        out = layer(h)
        seen.append(out.dtype)
        return out

    x = torch.randn(4, S.DIM, requires_grad=True)
    with set_checkpoint_early_stop(False), torch.autocast("cpu", dtype=S.BF16):
        checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen[0] == torch.float32
    if patch == "none" and _compat.load().needs_cast_replay:
        assert seen == [torch.float32, torch.bfloat16]  # positive control
    else:
        assert seen == [torch.float32, torch.float32]
