"""The seed report's script on spawned gloo ranks: FSDP1 against fully_shard, checkpoint under autocast.

Run by ``test_seed_two_ranks.py`` through ``torch.multiprocessing.spawn``; rank 0 saves
what it saw (recompute input dtypes, input gradients, or the error) for the test to read.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DIM = 256


class CheckpointedModule(nn.Module):
    """The seed's module, recording the dtype its forward receives instead of printing it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(DIM, DIM)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        x = nn.functional.gelu(x)
        return self.linear1(x)


def _step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_(True)
    try:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            out = checkpoint(model, x, use_reentrant=False)
            out.sum().backward()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"grad": x.grad.detach().clone(), "error": None}


def worker(rank: int, world_size: int, port: int, patch: bool, out_path: str) -> None:
    """One rank: FSDP1 and fully_shard (patched with ``patched_fully_shard`` or stock) on the same input."""
    from ranks import spawned_group

    with spawned_group(rank, world_size, port):
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import MixedPrecision

            import fsdp_autocast_fix
            from fsdp_autocast_fix import _compat

            fsdp2 = _compat.fsdp_package()
            torch.manual_seed(0)
            x = torch.randn(8, DIM)
            bf16 = torch.bfloat16
            inner1 = CheckpointedModule()
            inner2 = CheckpointedModule()
            inner2.load_state_dict(inner1.state_dict())
            fsdp1_model = FSDP(inner1, mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16,
                                                                      buffer_dtype=bf16),
                               device_id=torch.device("cpu"))
            shard = fsdp_autocast_fix.patched_fully_shard if patch else fsdp2.fully_shard
            shard(inner2, mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
            result = {"fsdp1": _step(fsdp1_model, x), "fully_shard": _step(inner2, x),
                      "fsdp1_dtypes": inner1.seen, "fully_shard_dtypes": inner2.seen}
        except Exception:
            result = {"crash": traceback.format_exc()}
        if rank == 0:
            torch.save(result, out_path)
