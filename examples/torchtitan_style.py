"""torchtitan-style FSDP2 training: per-block ``fully_shard``, a checkpoint per block, autocast bf16.

    torchrun --nproc-per-node 2 examples/torchtitan_style.py

Each block returns fp32 (``output_dtype``), so every checkpointed block's input needs FSDP's cast in the
recompute: without ``fsdp_autocast_fix`` this fails on torch <= 2.12. Trains a few steps twice, with and
without checkpointing, and checks the losses are bitwise equal.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
try:  # torch 2.6+
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from fsdp_autocast_fix import patched_fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4, activation_checkpoint: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)
        self.activation_checkpoint = activation_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.activation_checkpoint else block(x)
        return self.head(x)


def train(device: torch.device, activation_checkpoint: bool, steps: int = 5) -> list[float]:
    torch.manual_seed(0)
    model = Model(activation_checkpoint=activation_checkpoint).to(device)
    block_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                        output_dtype=torch.float32)
    for block in model.blocks:
        patched_fully_shard(block, mp_policy=block_policy)  # fully_shard, plus the recompute fix
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, 64, generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with_ac, without_ac = train(device, True), train(device, False)
    print(f"[rank {dist.get_rank()}] losses {with_ac}; bitwise equal without checkpointing: {with_ac == without_ac}")
    dist.destroy_process_group()
    if with_ac != without_ac:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
