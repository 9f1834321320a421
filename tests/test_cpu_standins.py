"""The CPU stand-ins of tests/helpers/cpu_standins.py are faithful: with them, FSDP2 of torch 2.4-2.6 trains as the
unsharded model and FSDP1 do, on 1 and 2 ranks, and the seed report's pattern fails stock as the report says.

On torch 2.7+ (or with CUDA) FSDP2 runs here without them: the same comparisons then check the references
themselves, and that the stand-ins refuse to install.
"""

from __future__ import annotations

import os

import cpu_standins
import pytest
import scenarios as S
import standins_faithful as F
import torch
import torch.multiprocessing as mp
from conftest import free_port
from torch.utils.checkpoint import CheckpointError, checkpoint

from fsdp_autocast_fix import _compat

pytestmark = pytest.mark.usefixtures("pg")


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(
        torch.equal(x, y) for key in ("grads", "params") for x, y in zip(a[key], b[key]))


def test_installed_exactly_where_needed() -> None:
    if cpu_standins.needed():
        assert cpu_standins._installed, "conftest installs them on this torch"
        assert any("foreach_all_gather_copy_out" in what for what in cpu_standins.install())
        assert not torch.cuda.is_available()  # nothing outside FSDP2's modules sees CUDA "available"
    else:
        with pytest.raises(RuntimeError, match="without stand-ins"):
            cpu_standins.install()


@pytest.mark.parametrize("reshard", [True, False])
def test_plain_steps_equal_the_unsharded_model_and_fsdp1_on_one_rank(reshard: bool) -> None:
    fsdp2 = F.run("fsdp2", 1, 0, reshard)
    assert _same(fsdp2, F.run("none", 1, 0))
    assert _same(fsdp2, F.run("fsdp1", 1, 0))


def _spawned(sharding: str, reshard: bool, tmp_path: os.PathLike) -> dict:
    out = os.path.join(tmp_path, f"{sharding}-{reshard}.pt")
    mp.spawn(F.worker, args=(2, free_port(), sharding, reshard, out), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.parametrize("reshard", [True, False])
def test_plain_steps_equal_the_unsharded_model_and_fsdp1_on_two_ranks(reshard: bool, tmp_path) -> None:
    """On 2 ranks the gradients are averaged over the ranks. Where gloo's ``reduce_scatter_tensor`` sums for
    ``ReduceOp.AVG`` (torch 2.7, measured; fixed by 2.12) and no stand-in averages (FSDP2 runs on CPU natively
    there), stock FSDP2 on CPU gives twice the gradients of one step: torch's, checked to be exactly that."""
    fsdp2 = _spawned("fsdp2", reshard, tmp_path)
    fsdp1 = _spawned("fsdp1", reshard, tmp_path)
    assert fsdp2["losses"][0] == fsdp1["losses"][0] == F.run("fsdp2", 1, 0)["losses"][0]  # rank 0's first batch
    if fsdp2["gloo_averages"] or cpu_standins.needed():
        assert _same(fsdp2, fsdp1)
        unsharded = F.run("none", 2, 0)
        assert all(torch.equal(x, y) for x, y in zip(fsdp2["grads"], unsharded["grads"]))
    else:
        one_step = lambda sharding: _spawned_steps(sharding, reshard, tmp_path, 1)  # noqa: E731
        assert all(torch.equal(x, 2 * y) for x, y in zip(one_step("fsdp2")["grads"], one_step("fsdp1")["grads"]))


def _spawned_steps(sharding: str, reshard: bool, tmp_path: os.PathLike, steps: int) -> dict:
    out = os.path.join(tmp_path, f"{sharding}-{reshard}-{steps}.pt")
    mp.spawn(F.worker, args=(2, free_port(), sharding, reshard, out, steps), nprocs=2, join=True)
    return torch.load(out)


def test_the_seed_pattern_fails_stock_as_the_report_says() -> None:
    """The positive control: ``checkpoint(fully_shard(m))`` under autocast with bf16 parameters raises the seed
    report's error on a torch that skips FSDP's casts in the recompute, and is right on one that does not."""
    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    block = S.GeluLinear()  # the seed's module: gelu, then a linear layer
    fsdp.fully_shard(block, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(4, S.DIM, requires_grad=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            checkpoint(block, x, use_reentrant=False).float().sum().backward()

    if _compat.load().needs_cast_replay:
        with pytest.raises(CheckpointError, match="Recomputed values for the following tensors have different "
                                                  "metadata than during the forward pass"):
            step()
    else:
        step()
        assert x.grad is not None
