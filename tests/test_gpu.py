"""GPU checks (marked ``gpu``; skipped without CUDA): run by ``tests/scripts/gpu_check.sh`` with NCCL, world size 1.

What CPU cannot reach: CUDA autocast (bf16, and fp16 with ``GradScaler``), the seed report's script as
written (FSDP1 against fully_shard on CUDA), and FSDP's root input move to the device, which no torch
release replays in the recompute.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fsdp_autocast_fix
from seed_two_ranks import DIM
from seed_two_ranks import CheckpointedModule as Seed
from fsdp_autocast_fix import _compat

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: run tests/scripts/gpu_check.sh on a GPU machine"),
    pytest.mark.usefixtures("pg"),
]


def _run(dtype: torch.dtype, patched: bool, use_checkpoint: bool, input_device: str = "cuda",
         scaler: bool = False) -> list[torch.Tensor] | BaseException:
    fsdp = _compat.fsdp_package()
    shard: Callable[..., Any] = fsdp_autocast_fix.patched_fully_shard if patched else fsdp.fully_shard
    torch.manual_seed(0)
    model = Seed().cuda()
    shard(model, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=dtype))
    x = torch.randn(32, DIM, device=input_device, requires_grad=True)
    grad_scaler = torch.amp.GradScaler("cuda") if scaler else None
    try:
        with torch.autocast("cuda", dtype=dtype):
            out = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
            loss = out.float().sum()
        (grad_scaler.scale(loss) if grad_scaler else loss).backward()
    except Exception as e:
        return e
    return [x.grad] + [p.grad.full_tensor() for p in model.parameters()]


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, list) and isinstance(b, list) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype,scaler", [(torch.bfloat16, False), (torch.float16, True)], ids=["bf16", "fp16-scaler"])
def test_cuda_autocast(dtype: torch.dtype, scaler: bool) -> None:
    reference = _run(dtype, patched=False, use_checkpoint=False, scaler=scaler)
    stock = _run(dtype, patched=False, use_checkpoint=True, scaler=scaler)
    fixed = _run(dtype, patched=True, use_checkpoint=True, scaler=scaler)
    if _compat.load().needs_cast_replay:
        assert not _same(stock, reference), "positive control: stock should fail on this torch"
    assert _same(fixed, reference), fixed


def test_root_input_move_is_replayed() -> None:
    """Inputs arrive on CPU; FSDP's root moves them to CUDA in forward, and the patch does it again in the recompute."""
    reference = _run(torch.bfloat16, patched=False, use_checkpoint=False, input_device="cpu")
    stock = _run(torch.bfloat16, patched=False, use_checkpoint=True, input_device="cpu")
    fixed = _run(torch.bfloat16, patched=True, use_checkpoint=True, input_device="cpu")
    assert isinstance(reference, list), reference
    assert not _same(stock, reference), "positive control: stock recompute sees CPU inputs"
    assert _same(fixed, reference), fixed


def test_seed_script_fsdp1_parity() -> None:
    """The seed's script on CUDA: FSDP1 and patched fully_shard see the same dtypes and give the same input grads."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    fsdp = _compat.fsdp_package()
    bf16 = torch.bfloat16
    torch.manual_seed(0)
    inner1, inner2 = Seed(), Seed()
    inner2.load_state_dict(inner1.state_dict())
    fsdp1 = FSDP(inner1, mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16),
                 device_id=torch.cuda.current_device())
    inner2.cuda()
    fsdp_autocast_fix.patched_fully_shard(inner2, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=bf16,
                                                                                      reduce_dtype=bf16))
    x = torch.randn(256, DIM, device="cuda")
    grads = []
    for model in (fsdp1, inner2):
        xi = x.clone().requires_grad_(True)
        with torch.autocast(device_type="cuda", dtype=bf16):
            checkpoint(model, xi, use_reentrant=False).sum().backward()
        grads.append(xi.grad)
    assert inner1.seen == inner2.seen == [bf16, bf16]
    assert torch.equal(grads[0], grads[1])
