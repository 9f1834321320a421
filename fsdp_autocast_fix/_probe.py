"""A small live probe: the patterns behind pytorch issue 148831, stock and patched, on this machine.

It runs at world size 1: gloo on CPU, NCCL with CUDA. Each pattern runs without checkpointing (the reference), then
with stock ``fully_shard`` and with ``patched_fully_shard``, and gets ``ok`` (gradients bitwise equal to the
reference), ``wrong gradients`` or ``fails: <exception type>``. ``python -m fsdp_autocast_fix doctor`` runs it in
a subprocess, so that it sees stock torch.
"""

from __future__ import annotations

import re
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import _compat
from ._checks import check_recompute
from ._patch import patched_fully_shard

DIM = 64


class _GeluLinear(nn.Module):
    """The seed report's module: gelu (``float_first``: ``x.float()``, then a square), then a linear layer."""

    def __init__(self, float_first: bool = False) -> None:
        super().__init__()
        self.linear1 = nn.Linear(DIM, DIM)
        self.float_first = float_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_first:
            x = x.float()
            return self.linear1(x * x)
        return self.linear1(F.gelu(x))


class NoAutocastRestore(torch.autograd.Function):
    """A checkpoint that reruns forward in backward without restoring autocast, as some libraries do."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
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


class _Parent(nn.Module):
    """A checkpointed block with a child sharded on its own (pytorch issues 153354, 187437)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = _GeluLinear()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.child(x))


#: (name, module kwargs, MixedPrecisionPolicy kwargs, checkpoint kind)
PATTERNS: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("checkpoint(fully_shard(m)) under autocast, MixedPrecisionPolicy(param_dtype=bf16)", {},
     {"param_dtype": torch.bfloat16}, "torch"),
    ("same, block starts with x.float()", {"float_first": True}, {"param_dtype": torch.bfloat16}, "torch"),
    ("checkpoint that does not restore autocast (custom autograd.Function)", {}, {}, "custom"),
    ("checkpointed block with a child sharded on its own, called twice before one backward", {}, {}, "twice"),
]


def _grads(device: torch.device, shard: Callable[..., Any], module_kwargs: dict[str, Any],
           policy_kwargs: dict[str, Any], kind: str, use_checkpoint: bool = True) -> list[torch.Tensor]:
    """The input and parameter gradients of one step of the pattern (``use_checkpoint=False``: without checkpoint)."""
    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    policy = fsdp.MixedPrecisionPolicy(**policy_kwargs)
    model: nn.Module = (_Parent() if kind == "twice" else _GeluLinear(**module_kwargs)).to(device)
    if kind == "twice":
        shard(model.child, mp_policy=policy)
    shard(model, mp_policy=policy)
    x = torch.randn(8, DIM, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=kind != "twice"):  # twice: no autocast needed
        if not use_checkpoint:
            out = model(x)
        elif kind == "custom":
            out = NoAutocastRestore.apply(model, x)
        else:
            out = checkpoint(model, x, use_reentrant=False)
        if kind == "twice":  # the second call's post-backward reshards the child before the first's recompute
            y = torch.randn(8, DIM, device=device, requires_grad=True)
            out = torch.cat([out, (checkpoint(model, y, use_reentrant=False) if use_checkpoint else model(y)).pow(2)])
    out.float().sum().backward()
    return [x.grad] + [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr,return-value]


def _verdict(run: Callable[[], list[torch.Tensor]], reference: list[torch.Tensor]) -> str:
    try:
        grads = run()
    except Exception as e:
        return f"fails: {type(e).__name__}"
    same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(grads, reference))
    return "ok" if same else "wrong gradients"


def can_probe() -> str | None:
    """Why this machine cannot run the probe, or None if it can."""
    if torch.cuda.is_available():
        return None
    base = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
    if base < (2, 7):
        return f"FSDP2 needs CUDA before torch 2.7 (this is {torch.__version__}, no CUDA)"
    return None


def run() -> list[dict[str, str]]:
    """Run every pattern in a world-size-1 process group it creates and destroys; return one dict per pattern."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    fully_shard = _compat.fsdp_package().fully_shard
    results = []
    try:
        for name, module_kwargs, policy_kwargs, kind in PATTERNS:
            reference = _grads(device, fully_shard, module_kwargs, policy_kwargs, kind, use_checkpoint=False)
            row = {"pattern": name, "checkpoint": kind}
            row["stock"] = _verdict(lambda: _grads(device, fully_shard, module_kwargs, policy_kwargs, kind), reference)
            if kind == "torch" and row["stock"] == "wrong gradients":
                with check_recompute():
                    row["stock_with_value_check"] = _verdict(
                        lambda: _grads(device, fully_shard, module_kwargs, policy_kwargs, kind), reference)
            row["patched"] = _verdict(
                lambda: _grads(device, patched_fully_shard, module_kwargs, policy_kwargs, kind), reference)
            results.append(row)
    finally:
        dist.destroy_process_group()
    return results


def table(results: list[dict[str, str]]) -> str:
    """The results as a plain-text table."""
    rows = [("pattern", "stock", "patched")]
    for r in results:
        caught = r.get("stock_with_value_check", "").startswith("fails")
        rows.append((r["pattern"], r["stock"] + (" (value check: caught)" if caught else ""), r["patched"]))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}} | {b:<{widths[1]}} | {c}" for a, b, c in rows)
