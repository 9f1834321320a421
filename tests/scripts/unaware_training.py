"""A training step that knows nothing of fsdp_autocast_fix, for the auto-apply tests (tests/test_autoapply*.py).

    python tests/scripts/unaware_training.py SITE_DIR "FIRST STATEMENT"

Adds SITE_DIR as a site directory (so its ``.pth`` files run, as at interpreter start), runs the first
statement (``import torch._dynamo``, ``from transformers import LlamaForCausalLM``, ...), then shards small
blocks with ``fully_shard`` and takes steps under CPU autocast with and without checkpointing:
``torch.utils.checkpoint`` with ``MixedPrecisionPolicy(param_dtype=bf16)`` (the seed report's pattern), and a
checkpoint that does not restore autocast with the default policy. Prints one JSON line: whether the patch
was in force right after the first ``fully_shard`` call, each checkpointed step's verdict against the same
step without checkpointing (``bitwise``, ``differs`` or ``fails: <error>``), and
``status().patched_globally`` (None where fsdp_autocast_fix was never imported).
"""

from __future__ import annotations

import json
import site
import socket
import sys
from typing import Any

site.addsitedir(sys.argv[1])
exec(sys.argv[2])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
try:  # torch 2.6+
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

DIM = 16


class NoAutocastRestore(torch.autograd.Function):
    """Re-runs forward in backward without restoring autocast, as some libraries' checkpoints do."""

    @staticmethod
    def forward(ctx: Any, fn: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


def _patch_in_force() -> bool | None:
    package = sys.modules.get("fsdp_autocast_fix")
    return None if package is None else package._patch.covered_modules() > 0


def step(kind: str, param_dtype: torch.dtype | None) -> tuple[list[torch.Tensor], bool | None]:
    """One step of a freshly sharded block; its gradients, and whether the patch covered it once sharded."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.GELU(), nn.Linear(DIM, DIM))
    fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    in_force = _patch_in_force()
    x = torch.randn(4, DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if kind == "torch_checkpoint":
            out = checkpoint(block, x, use_reentrant=False)
        elif kind == "custom_checkpoint":
            out = NoAutocastRestore.apply(block, x)
        else:
            out = block(x)
    out.float().sum().backward()
    return [x.grad] + [p.grad.full_tensor() for p in block.parameters()], in_force


def verdict(kind: str, param_dtype: torch.dtype | None) -> str:
    reference, _ = step("reference", param_dtype)
    try:
        grads, _ = step(kind, param_dtype)
    except Exception as e:
        return f"fails: {type(e).__name__}"
    same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(grads, reference))
    return "bitwise" if same else "differs"


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
report: dict[str, Any] = {"in_force_at_first_shard": step("reference", None)[1]}
report["torch_checkpoint"] = verdict("torch_checkpoint", torch.bfloat16)
report["custom_checkpoint"] = verdict("custom_checkpoint", None)
package = sys.modules.get("fsdp_autocast_fix")
report["patched_globally"] = None if package is None else package.status().patched_globally
dist.destroy_process_group()
print(json.dumps(report))
