"""How the patch's cost grows with the work: layers, micro-batches in flight, eval forwards kept alive.

World size 1, gloo, CPU; ``L`` tiny sharded layers (``Linear`` + ``gelu``, fp32 parameters) in a sharded root,
under CPU autocast bf16, each layer checkpointed by torch's non-reentrant ``checkpoint`` (the recompute gets
the very input back) or by a hand-written reentrant-style ``autograd.Function`` that restores autocast (it
gets a ``detach()``: the patch's other lookup). A step runs ``K`` forwards before their ``K`` backwards, as a
pipeline schedule keeps micro-batches in flight; ``E`` inputs of ``no_grad`` eval forwards are kept alive (their
records stay in every layer). Every configuration is built at once and each round times each of them stock and
patched (``apply()`` before, ``remove()`` after, outside the time; the order alternating by round), each timing
enough steps for about 0.15 s. ``ratio``: the median over rounds of the round's patched / stock. ``growth``: the
median over rounds of the round's ratio over its base configuration's ratio in the same round (8 layers and 1
micro-batch; for eval inputs, the same configuration without them), so a slow phase of the machine, which moves
both, divides out (step-to-step noise does not). The target: growth at 64 micro-batches in flight within 2 %
(at most 1.02), flat in layers.

JSON: a list of ``{"torch", "checkpoint", "layers", "micro_batches", "evals_alive", "rounds", "steps_per_timing",
"base", "stock_ms", "patched_ms", "ratio", "growth", "growth_quartiles"}``.

    python benchmarks/scaling.py [--rounds 40] [--json out.json] [--smoke]
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


class _Config:
    """One configuration of a kind: its model, its inputs in flight, its eval inputs, and how many steps one
    timing runs (enough for about ``MIN_TIMING_S``, so a millisecond step is not timed alone)."""

    def __init__(self, kind: str, layers: int, micro_batches: int, evals_alive: int) -> None:
        self.key = (layers, micro_batches, evals_alive)
        self.model = _build(layers, kind)
        gen = torch.Generator().manual_seed(1)
        self.inputs = [torch.randn(2, DIM, generator=gen, requires_grad=True) for _ in range(micro_batches)]
        self.evals = [torch.randn(2, DIM, generator=gen) for _ in range(evals_alive)]
        self.steps = 1

    def time(self, patched: bool) -> float:
        """Seconds per step of ``self.steps`` steps, patched or stock; the eval forwards (their inputs stay alive,
        so their records do) and clearing the gradients are outside the time."""
        if patched:
            fsdp_autocast_fix.apply()
        self.model.checkpointed = False
        with torch.no_grad():
            for e in self.evals:
                self.model(e)
        self.model.checkpointed = True
        total = 0.0
        for _ in range(self.steps):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs = [self.model(x) for x in self.inputs]
            for out in outs:
                out.float().sum().backward()
            total += time.perf_counter() - start
            self.model.zero_grad(set_to_none=True)
            for x in self.inputs:
                x.grad = None
        fsdp_autocast_fix.remove()
        return total / self.steps


def _base(key: tuple[int, int, int], first: tuple[int, int, int]) -> tuple[int, int, int]:
    """The configuration a growth is measured against: the same one without eval inputs alive, or the first
    (the fewest layers, 1 micro-batch in flight)."""
    layers, micro_batches, evals_alive = key
    return (layers, micro_batches, 0) if evals_alive else first


MIN_TIMING_S = 0.15


def _quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles: how far the rounds spread around the median (both the value itself with
    one round)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [q1, q3]


def measure(kind: str, configs: list[tuple[int, int, int]], rounds: int) -> list[dict[str, Any]]:
    """Every configuration of one checkpoint kind, side by side: each round times each configuration stock and
    patched (the order alternating by round), so a slow phase of the machine hits a configuration and its base
    in the same round. Per configuration: the median step times, the median of the rounds' patched / stock, and
    the growth: the median of the rounds' (patched / stock) / (its base's patched / stock in that round)."""
    bases = {key: _base(key, configs[0]) for key in configs}
    missing = sorted(base for base in bases.values() if base not in bases)
    if missing:
        raise ValueError(f"the growth's base configurations {missing} are not among {configs}")
    cells = [_Config(kind, *key) for key in configs]
    per_round: list[dict[tuple[int, int, int], tuple[float, float]]] = []  # key -> (stock, patched) seconds
    for i in range(rounds + 1):  # round 0 warms up and sets each configuration's steps per timing
        pairs = {}
        for cell in cells:
            order = (False, True) if i % 2 else (True, False)
            t = {patched: cell.time(patched) for patched in order}
            pairs[cell.key] = (t[False], t[True])
            if i == 0:
                cell.steps = max(1, round(MIN_TIMING_S / t[False]))
        if i:
            per_round.append(pairs)
    ratios = [{key: patched / stock for key, (stock, patched) in pairs.items()} for pairs in per_round]
    results = []
    for cell in cells:
        key, base = cell.key, bases[cell.key]
        growth = [r[key] / r[base] for r in ratios]
        layers, micro_batches, evals_alive = key
        results.append({"torch": torch.__version__, "checkpoint": kind, "layers": layers,
                        "micro_batches": micro_batches, "evals_alive": evals_alive, "rounds": rounds,
                        "steps_per_timing": cell.steps, "base": list(base),
                        "stock_ms": statistics.median(r[key][0] for r in per_round) * 1e3,
                        "patched_ms": statistics.median(r[key][1] for r in per_round) * 1e3,
                        "ratio": statistics.median(r[key] for r in ratios), "growth": statistics.median(growth),
                        "growth_quartiles": _quartiles(growth)})
    return results


#: (layers, micro-batches in flight, eval inputs alive): the growth in each dimension from one base point
#: (the first), eval inputs from the same configuration without them.
CONFIGS = [(8, 1, 0), (8, 4, 0), (8, 16, 0), (8, 64, 0), (64, 1, 0), (8, 16, 64)]
SMOKE_CONFIGS = [(2, 1, 0), (2, 3, 0), (2, 3, 2)]


def main(argv: list[str] | None = None) -> int:
    """Measure every configuration for both checkpoints; print a markdown table (and write JSON)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
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
    results = [r for kind in ("torch", "function") for r in measure(kind, configs, rounds)]
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("| checkpoint | layers | micro-batches in flight | eval inputs alive | stock ms | patched ms "
          "| patched / stock | growth (against) | growth's quartiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        against = "" if r["base"] == [r["layers"], r["micro_batches"], r["evals_alive"]] else \
            " ({}, {}, {})".format(*r["base"])
        print(f"| {r['checkpoint']} | {r['layers']} | {r['micro_batches']} | {r['evals_alive']} | "
              f"{r['stock_ms']:.1f} | {r['patched_ms']:.1f} | {r['ratio']:.3f} | {r['growth']:.3f}{against} | "
              "{:.3f}–{:.3f} |".format(*r["growth_quartiles"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
