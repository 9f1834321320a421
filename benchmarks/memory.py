"""Peak memory of a checkpointed training step: stock, patched and the exact workaround, side by side.

A stack of sharded linear layers, one checkpoint per layer, the forward under CPU autocast (bf16) and the
backward outside it. Each configuration (checkpoint x parameter dtype x depth) runs in three modes:

* ``stock``: ``fully_shard``, no patch (a hand-written checkpoint that does not restore autocast may fail);
* ``patched``: ``patched_fully_shard``;
* ``exact``: ``fully_shard`` with the checkpoint wrapped in ``preserve_autocast``, no patch: the workaround whose
  gradients the patched run must give.

The peak is read from torch's record of every CPU allocation and free in one step (the profiler with
``profile_memory=True``), after a warm-up step: exact and the same on every run, so the ratios are too.
``python benchmarks/memory.py [--layers 8 32] [--json out.json]``; world size 1, gloo on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import socket
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat

WIDTH, BATCH = 256, 64
MODES = ("stock", "patched", "exact")


class _Recompute(torch.autograd.Function):
    """A hand-written checkpoint: ``mode`` is what its recompute does with autocast (``restore`` the forward's,
    ``none``: nothing, ``disable`` it)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], mode: str, x: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.mode = fn, mode
        ctx.autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor | None]:
        x = ctx.saved_tensors[0].detach().requires_grad_(True)
        enabled, dtype = ctx.autocast
        context: Any = {"restore": torch.autocast("cpu", dtype=dtype, enabled=enabled),
                        "disable": torch.autocast("cpu", enabled=False)}.get(ctx.mode, contextlib.nullcontext())
        with torch.enable_grad(), context:
            out = ctx.fn(x)
        torch.autograd.backward(out, grad)
        return None, None, x.grad


#: The checkpoints measured: torch's (either mode) and three hand-written ones.
CHECKPOINTS: dict[str, Callable[..., torch.Tensor]] = {
    "torch": lambda fn, x: checkpoint(fn, x, use_reentrant=False),
    "torch_reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=True),
    "fn_restore": lambda fn, x: _Recompute.apply(fn, "restore", x),
    "fn_no_restore": lambda fn, x: _Recompute.apply(fn, "none", x),
    "fn_disable": lambda fn, x: _Recompute.apply(fn, "disable", x),
}


@dataclass(frozen=True)
class Config:
    """One configuration: the checkpoint, the parameters' dtype in the forward (``fp32``: autocast casts them,
    ``bf16``: the policy's ``param_dtype``) and the number of layers."""

    checkpoint: str
    params: str
    layers: int


@dataclass
class Measured:
    """One mode's step: its peak in bytes and its gradients, or the error it raised (then no peak)."""

    peak: int | None
    grads: list[torch.Tensor] | None
    error: str | None = None


def peak_bytes(fn: Callable[[], None]) -> int:
    """The most CPU memory that allocations made while ``fn`` runs hold at once, from the profiler's record of every
    allocation and free (frees of memory allocated before, such as a previous step's garbage, are not counted:
    they would shift the figure by what happened to be left over)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        pass  # the first profile of a process allocates for itself: not in the step's record
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = sorted((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size)
                         for e in _events(prof.profiler.kineto_results.experimental_event_tree())
                         if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu")
    live: dict[int, int] = {}
    now = peak = 0
    for _, ptr, size in allocations:
        if size > 0:
            live[ptr] = size
            now += size
            peak = max(peak, now)
        elif ptr in live:
            now -= live.pop(ptr)
    return peak


def _events(nodes: list[Any]) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _events(node.children)


def run(config: Config, mode: str) -> Measured:
    """A warm-up step, then the measured one, of ``config`` in ``mode``."""
    package = _compat.fsdp_package()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(config.layers)))
    policy = package.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if config.params == "bf16" else None)
    fully_shard = fsdp_autocast_fix.patched_fully_shard if mode == "patched" else package.fully_shard
    for layer in model:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    ckpt = CHECKPOINTS[config.checkpoint]
    if mode == "exact":
        ckpt = fsdp_autocast_fix.preserve_autocast(ckpt)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for layer in model:
                h = ckpt(layer, h)
        h.float().pow(2).sum().backward()

    try:
        step()
        gc.collect()
        peak = peak_bytes(step)
    except Exception as e:
        return Measured(peak=None, grads=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:80]}")
    grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in (p.grad for p in model.parameters())]
    return Measured(peak=peak, grads=grads)


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """A world-size-1 gloo group on 127.0.0.1 (none made if one is up)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def row(config: Config) -> dict[str, Any]:
    """The three modes of ``config``: their peaks, patched/stock and patched/exact, and whether the patched
    gradients are bitwise the exact workaround's."""
    measured = {mode: run(config, mode) for mode in MODES}
    patched, stock, exact = measured["patched"], measured["stock"], measured["exact"]
    return {**asdict(config), **{f"{m}_peak": measured[m].peak for m in MODES},
            "stock_error": stock.error, "patched_over_stock": _ratio(patched.peak, stock.peak),
            "patched_over_exact": _ratio(patched.peak, exact.peak), "grads_equal_exact": _same(patched, exact),
            "stock_grads_equal_exact": _same(stock, exact)}


def _same(a: Measured, b: Measured) -> bool:
    return a.grads is not None and b.grads is not None and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.grads, b.grads))


def _ratio(a: int | None, b: int | None) -> float | None:
    return None if a is None or not b else a / b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--checkpoints", nargs="+", default=list(CHECKPOINTS), choices=list(CHECKPOINTS))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    with process_group():
        rows = [row(Config(c, p, n)) for c, p, n in itertools.product(args.checkpoints, ("fp32", "bf16"),
                                                                        args.layers)]
    print(f"torch {torch.__version__}: peak bytes of one step (exact: preserve_autocast, no patch)")
    print("| checkpoint | params | layers | stock | patched | exact | patched/stock | patched/exact | "
          "grads = exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        stock = r["stock_peak"] if r["stock_error"] is None else f"fails ({r['stock_error'].split(':')[0]})"
        ratio = "-" if r["patched_over_stock"] is None else f"{r['patched_over_stock']:.4f}"
        print(f"| {r['checkpoint']} | {r['params']} | {r['layers']} | {stock} | {r['patched_peak']} | "
              f"{r['exact_peak']} | {ratio} | {r['patched_over_exact']:.4f} | {r['grads_equal_exact']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
