"""``python -m fsdp_autocast_fix demo``: the seed report's failure and its fix, side by side, on CPU."""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from . import _compat, patched_fully_shard, status


class _Seed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear1(nn.functional.gelu(x))


def _grads(shard: Any, use_checkpoint: bool) -> list[torch.Tensor]:
    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    model = _Seed()
    shard(model, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = checkpoint(model, x, use_reentrant=False) if use_checkpoint else model(x)
        out.sum().backward()
    return [x.grad] + [p.grad.full_tensor() for p in model.parameters()]


def main() -> int:
    """Run the seed's pattern with stock ``fully_shard`` and with ``patched_fully_shard``; print both."""
    print(f"torch {torch.__version__}; needs the cast replay: {status().needs_cast_replay}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        fully_shard = _compat.fsdp_package().fully_shard
        reference = _grads(fully_shard, use_checkpoint=False)
        ok = True
        for label, shard in (("stock fully_shard", fully_shard), ("patched_fully_shard", patched_fully_shard)):
            try:
                grads = _grads(shard, use_checkpoint=True)
            except Exception as e:
                first_line = str(e).strip().splitlines()[0]
                print(f"{label:>20}: {type(e).__name__}: {first_line}")
                ok = ok and label.startswith("stock")
                continue
            same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(grads, reference))
            print(f"{label:>20}: gradients {'bitwise equal to' if same else 'DIFFER from'} the run without checkpoint")
            ok = ok and (same or label.startswith("stock"))
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1
