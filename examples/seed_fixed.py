"""The seed report's script (pytorch issue 148831), fixed: FSDP1 and fully_shard, checkpoint under autocast.

    torchrun --nproc-per-node 2 examples/seed_fixed.py

CPU and gloo by default, CUDA and NCCL when present. Prints the dtype each forward received and the
input gradients' agreement between FSDP1 and fully_shard.
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision

try:  # torch 2.6+
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

import fsdp_autocast_fix

fsdp_autocast_fix.apply()  # the fix: one line, before or after sharding


class CheckpointedModule(nn.Module):
    def __init__(self, wrap_type: str) -> None:
        super().__init__()
        self.wrap_type = wrap_type
        self.linear1 = nn.Linear(2048, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print(f"[rank {dist.get_rank()}] {self.wrap_type} forward input dtype {x.dtype}")
        return self.linear1(nn.functional.gelu(x))


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    inner1, inner2 = CheckpointedModule("FSDP"), CheckpointedModule("fully_shard")
    inner2.load_state_dict(inner1.state_dict())
    fsdp1 = FSDP(inner1, mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16),
                 device_id=device)
    fsdp2 = fully_shard(inner2.to(device), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
    x = torch.randn(256, 2048, device=device)
    grads = []
    for model in (fsdp1, fsdp2):
        xi = x.clone().requires_grad_(True)
        with torch.autocast(device_type=device.type, dtype=bf16):
            checkpoint(model, xi, use_reentrant=False).sum().backward()
        grads.append(xi.grad)
    same = torch.equal(grads[0], grads[1])
    print(f"[rank {dist.get_rank()}] input gradients of FSDP1 and fully_shard bitwise equal: {same}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
