"""How the patch's cost grows with the work: layers, micro-batches in flight, eval forwards kept alive.

World size 1, gloo, CPU; ``L`` tiny sharded layers (``Linear`` + ``gelu``, fp32 parameters) in a sharded root,
under CPU autocast bf16, each layer checkpointed by torch's non-reentrant ``checkpoint`` (the recompute gets
the very input back) or by a hand-written reentrant-style ``autograd.Function`` that restores autocast (it
gets a ``detach()``: the patch's other lookup). A step runs ``K`` forwards before their ``K`` backwards, as a
pipeline schedule keeps micro-batches in flight; ``E`` inputs of ``no_grad`` eval forwards are kept alive (their
records stay in every layer). Each round runs a stock step and a patched step (``apply()`` before it,
``remove()`` after it, outside the time) in alternating order; the ratio is the median over rounds of each
round's patched / stock. The target: at 64 micro-batches in flight within 2 % of its value at 1, flat in layers.

JSON: a list of ``{"torch", "checkpoint", "layers", "micro_batches", "evals_alive", "rounds", "stock_ms",
"patched_ms", "ratio"}``.

    python benchmarks/scaling.py [--rounds 15] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp_autocast_fix  # noqa: E402
from fsdp_autocast_fix import _compat  # noqa: E402

DIM = 16


class _Restoring(torch.autograd.Function):
    """A reentrant-style checkpoint that restores the forward's autocast state in its recompute."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.state = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        enabled, dtype = ctx.state
        with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled):
            out = ctx.fn(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.lin(x))


class Model(nn.Module):
    def __init__(self, layers: int, kind: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.kind = kind
        self.checkpointed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if not self.checkpointed:
                x = layer(x)
            elif self.kind == "torch":
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = _Restoring.apply(layer, x)
        return x


def _build(layers: int, kind: str) -> Model:
    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    model = Model(layers, kind)
    for layer in model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def _step(model: Model, inputs: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [model(x) for x in inputs]
    for out in outs:
        out.float().sum().backward()
    return time.perf_counter() - start


def measure(kind: str, layers: int, micro_batches: int, evals_alive: int, rounds: int) -> dict[str, Any]:
    """One configuration: stock and patched steps alternated; medians and the median per-round ratio."""
    model = _build(layers, kind)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, DIM, generator=gen, requires_grad=True) for _ in range(micro_batches)]
    evals = [torch.randn(2, DIM, generator=gen) for _ in range(evals_alive)]
    times: dict[str, list[float]] = {"stock": [], "patched": []}
    ratios = []
    for i in range(rounds + 1):  # round 0 warms up
        pair = {}
        for variant in (("stock", "patched") if i % 2 else ("patched", "stock")):
            if variant == "patched":
                fsdp_autocast_fix.apply()
            model.checkpointed = False
            with torch.no_grad():
                for e in evals:  # the eval forwards whose inputs stay alive
                    model(e)
            model.checkpointed = True
            pair[variant] = _step(model, inputs)
            fsdp_autocast_fix.remove()
            model.zero_grad(set_to_none=True)
        if i:
            for variant, t in pair.items():
                times[variant].append(t)
            ratios.append(pair["patched"] / pair["stock"])
    return {"torch": torch.__version__, "checkpoint": kind, "layers": layers, "micro_batches": micro_batches,
            "evals_alive": evals_alive, "rounds": rounds,
            "stock_ms": statistics.median(times["stock"]) * 1e3,
            "patched_ms": statistics.median(times["patched"]) * 1e3, "ratio": statistics.median(ratios)}


#: (layers, micro-batches in flight, eval inputs alive): the growth in each dimension from one base point.
CONFIGS = [(8, 1, 0), (8, 4, 0), (8, 16, 0), (8, 64, 0), (64, 1, 0), (64, 16, 0), (8, 16, 64)]
SMOKE_CONFIGS = [(2, 1, 0), (2, 3, 2)]


def main(argv: list[str] | None = None) -> int:
    """Measure every configuration for both checkpoints; print a markdown table (and write JSON)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    configs, rounds = (SMOKE_CONFIGS, 1) if args.smoke else (CONFIGS, args.rounds)
    logging.getLogger("fsdp_autocast_fix").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    results = [measure(kind, *config, rounds) for kind in ("torch", "function") for config in configs]
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("| checkpoint | layers | micro-batches in flight | eval inputs alive | stock ms | patched ms "
          "| patched / stock |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['checkpoint']} | {r['layers']} | {r['micro_batches']} | {r['evals_alive']} | "
              f"{r['stock_ms']:.1f} | {r['patched_ms']:.1f} | {r['ratio']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
