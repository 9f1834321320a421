"""Plain training steps (no checkpoint) on FSDP2, FSDP1 and the unsharded model, for the stand-ins' test.

``run(sharding, world_size, rank)``: two layers in a root (each ``fully_shard``-ed for FSDP2 with
``reshard_after_forward`` as given, FSDP1 around each and the root), fp32 parameters, the same seed; three
steps of SGD over per-rank data, gradients reduced over the ranks (FSDP2 / FSDP1 do it; the unsharded model
runs every rank's batch and averages, as data parallel does). Returns every step's loss and the full gradients
and parameters after the last step. ``worker`` runs it on a spawned rank and saves rank 0's result.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM = 16
STEPS = 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.lin(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Layer(), Layer())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def run(sharding: str, world_size: int, rank: int, reshard_after_forward: bool = True) -> dict[str, Any]:
    """One configuration (see the module docstring); ``sharding`` in ``fsdp2``, ``fsdp1``, ``none``."""
    model = _model()
    if sharding == "fsdp2":
        from fsdp_autocast_fix import _compat

        fully_shard = _compat.fsdp_package().fully_shard
        for layer in model:
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
    elif sharding == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for i, layer in enumerate(list(model)):
            model[i] = FSDP(layer, device_id=torch.device("cpu"), use_orig_params=True)
        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        if sharding == "none":  # every rank's batch, gradients averaged as the collectives do
            total = 0.0
            for r in range(world_size):
                loss = model(_batch(step, r)).pow(2).sum()
                (loss / world_size).backward()
                total += loss.item()
            losses.append(total / world_size)
        else:
            loss = model(_batch(step, rank)).pow(2).sum()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
    if sharding == "fsdp1":  # each rank holds a shard of the flat parameter: gather it with its gradient
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, with_grads=True):
            return {"losses": losses, "grads": [_full(p.grad) for p in model.parameters()],
                    "params": [_full(p) for p in model.parameters()]}
    return {"losses": losses, "grads": [_full(p.grad) for p in model.parameters()],
            "params": [_full(p) for p in model.parameters()]}


def worker(rank: int, world_size: int, port: int, sharding: str, reshard: bool, out_path: str,
           steps: int = STEPS) -> None:
    """A spawned rank: :func:`run` for ``steps`` steps; rank 0 saves its result to ``out_path``, with whether
    gloo's ``reduce_scatter_tensor`` averages for ``ReduceOp.AVG`` in this torch."""
    global STEPS
    STEPS = steps
    from ranks import spawned_group

    with spawned_group(rank, world_size, port):
        out = torch.empty(1)
        dist.reduce_scatter_tensor(out, torch.full((world_size,), float(rank + 1)), op=dist.ReduceOp.AVG)
        result = run(sharding, world_size, rank, reshard)
        result["gloo_averages"] = out.item() != sum(range(1, world_size + 1))
        if rank == 0:
            torch.save(result, out_path)
