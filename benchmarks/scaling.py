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

Timed, the rounds' growths spread by 10-15 % on a shared machine, far wider than the target. ``--instructions``
counts instead the instructions each step executes, under valgrind's callgrind (``benchmarks/instructions.py``;
needs valgrind and a C compiler): one step per count, the second in its state, stock and patched, 2 rounds; a count
repeats within a few tenths of a percent, so the growth is resolved well inside 2 %. Instructions are a proxy for
time: the timed table is the one that says what a step costs.

JSON: a list of ``{"torch", "checkpoint", "layers", "micro_batches", "evals_alive", "rounds", "base", "ratio",
"growth"}`` plus ``"steps_per_timing", "stock_ms", "patched_ms", "growth_quartiles"`` (timed) or
``"stock_instructions", "patched_instructions", "growth_range"`` (counted).

    python benchmarks/scaling.py [--rounds 40] [--instructions] [--json out.json] [--smoke]
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsdp_autocast_fix  # noqa: E402
import instructions  # noqa: E402
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

    def _run(self, patched: bool, measure: Callable[[], float]) -> float:
        """``measure()`` of this configuration's steps, patched or stock; the eval forwards (their inputs stay
        alive, so their records do) run before it, untimed."""
        if patched:
            fsdp_autocast_fix.apply()
        try:
            self.model.checkpointed = False
            with torch.no_grad():
                for e in self.evals:
                    self.model(e)
            self.model.checkpointed = True
            return measure()
        finally:
            fsdp_autocast_fix.remove()

    def _step(self) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [self.model(x) for x in self.inputs]
        for out in outs:
            out.float().sum().backward()

    def _clear(self) -> None:
        self.model.zero_grad(set_to_none=True)
        for x in self.inputs:
            x.grad = None

    def time(self, patched: bool) -> float:
        """Seconds per step of ``self.steps`` steps, patched or stock (clearing the gradients untimed)."""
        def timed() -> float:
            total = 0.0
            for _ in range(self.steps):
                start = time.perf_counter()
                self._step()
                total += time.perf_counter() - start
                self._clear()
            return total / self.steps
        return self._run(patched, timed)

    def instructions(self, patched: bool, counter: Any) -> int:
        """Instructions one step executes, patched or stock (``counter``: an ``instructions.Counter``): the
        second step in that state, so that what the first step after ``apply()`` or ``remove()`` does once is
        not counted as a cost per step."""
        def counted() -> float:
            self._step()
            self._clear()
            count = counter.count(self._step)
            self._clear()
            return count
        return int(self._run(patched, counted))


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


def _bases(configs: list[tuple[int, int, int]]) -> dict[tuple[int, int, int], tuple[int, int, int]]:
    bases = {key: _base(key, configs[0]) for key in configs}
    missing = sorted(base for base in bases.values() if base not in bases)
    if missing:
        raise ValueError(f"the growth's base configurations {missing} are not among {configs}")
    return bases


Rounds = list[dict[tuple[int, int, int], tuple[float, float]]]  # per round: key -> (stock, patched)


def _round(cells: list[_Config], i: int, cost: Callable[[_Config, bool], float]) -> dict[tuple[int, int, int],
                                                                                        tuple[float, float]]:
    """Round ``i``: ``cost(cell, patched)`` of every cell, stock and patched, the order alternating by round."""
    pairs = {}
    for cell in cells:
        order = (True, False) if i % 2 == 0 else (False, True)
        c = {patched: cost(cell, patched) for patched in order}
        pairs[cell.key] = (c[False], c[True])
    return pairs


def _summary(kind: str, configs: list[tuple[int, int, int]], per_round: Rounds, unit: str,
             scale: float, spread: str) -> list[dict[str, Any]]:
    """Per configuration: the median stock and patched costs (``stock_<unit>``, ``patched_<unit>``: the
    measured values times ``scale``), the median of the rounds' patched / stock, and the growth: the median of
    the rounds' (patched / stock) / (its base's patched / stock in that round), with its spread over the rounds
    (``spread``: ``"quartiles"``, ``growth_quartiles``, for many rounds; ``"range"``, ``growth_range``, the
    lowest and highest, for a few)."""
    bases = _bases(configs)
    ratios = [{key: patched / stock for key, (stock, patched) in pairs.items()} for pairs in per_round]
    results = []
    for key in configs:
        base = bases[key]
        growth = [r[key] / r[base] for r in ratios]
        layers, micro_batches, evals_alive = key
        results.append({"torch": torch.__version__, "checkpoint": kind, "layers": layers,
                        "micro_batches": micro_batches, "evals_alive": evals_alive, "rounds": len(per_round),
                        "base": list(base),
                        f"stock_{unit}": statistics.median(r[key][0] for r in per_round) * scale,
                        f"patched_{unit}": statistics.median(r[key][1] for r in per_round) * scale,
                        "ratio": statistics.median(r[key] for r in ratios), "growth": statistics.median(growth),
                        f"growth_{spread}": [min(growth), max(growth)] if spread == "range" else _quartiles(growth)})
    return results


def measure(kind: str, configs: list[tuple[int, int, int]], rounds: int) -> list[dict[str, Any]]:
    """Every configuration of one checkpoint kind, side by side: each round times each configuration stock and
    patched (the order alternating by round), so a slow phase of the machine hits a configuration and its base
    in the same round (:func:`_summary`)."""
    _bases(configs)
    cells = [_Config(kind, *key) for key in configs]
    for cell, (stock, _) in zip(cells, _round(cells, 0, _Config.time).values()):  # warm-up: steps per timing
        cell.steps = max(1, round(MIN_TIMING_S / stock))
    per_round: Rounds = [_round(cells, i, _Config.time) for i in range(1, rounds + 1)]  # seconds
    results = _summary(kind, configs, per_round, "ms", 1e3, "quartiles")
    for row, cell in zip(results, cells):
        row["steps_per_timing"] = cell.steps
    return results


def count(kinds: list[str], configs: list[tuple[int, int, int]], rounds: int) -> list[dict[str, Any]]:
    """Every configuration of every checkpoint kind in instructions, in a process :func:`instructions.relaunch`
    started: each configuration runs a step stock and patched untimed before counting starts, then each round
    counts one step of each, stock and patched, the order alternating by round (:func:`_summary`; the counts
    of a step repeat within a few tenths of a percent, see ``instructions.Counter``)."""
    _bases(configs)
    counter = instructions.Counter()
    cells = {kind: [_Config(kind, *key) for key in configs] for kind in kinds}
    for cell in (cell for kind in kinds for cell in cells[kind]):  # warm-up, uninstrumented
        cell.time(False)
        cell.time(True)
    counter.start()
    results = []
    for kind in kinds:
        per_round = [_round(cells[kind], i, lambda cell, patched: cell.instructions(patched, counter))
                     for i in range(rounds)]
        results += _summary(kind, configs, per_round, "instructions", 1, "range")
    return results


#: (layers, micro-batches in flight, eval inputs alive): the growth in each dimension from one base point
#: (the first), eval inputs from the same configuration without them.
CONFIGS = [(8, 1, 0), (8, 4, 0), (8, 16, 0), (8, 64, 0), (64, 1, 0), (8, 16, 64)]
SMOKE_CONFIGS = [(2, 1, 0), (2, 3, 0), (2, 3, 2)]


def main(argv: list[str] | None = None) -> int:
    """Measure every configuration for both checkpoints; print a markdown table (and write JSON)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, help="rounds (default: 40 timed, 2 counted)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind's callgrind instead of timing")
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.instructions and not instructions.relaunched():
        return instructions.relaunch(os.path.abspath(__file__), sys.argv[1:] if argv is None else argv)
    rounds = args.rounds or (2 if args.instructions else 40)
    configs, rounds = (SMOKE_CONFIGS, 1) if args.smoke else (CONFIGS, rounds)
    logging.getLogger("fsdp_autocast_fix").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    kinds = ["torch", "function"]
    if args.instructions:
        results = count(kinds, configs, rounds)
    else:
        results = [r for kind in kinds for r in measure(kind, configs, rounds)]
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    unit, spread = (("instructions (M)", "rounds (growth's range)") if args.instructions
                    else ("ms", "growth's quartiles"))
    print(f"| checkpoint | layers | micro-batches in flight | eval inputs alive | stock {unit} | patched {unit} "
          f"| patched / stock | growth (against) | {spread} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        against = "" if r["base"] == [r["layers"], r["micro_batches"], r["evals_alive"]] else \
            " ({}, {}, {})".format(*r["base"])
        if args.instructions:
            stock, patched = r["stock_instructions"] / 1e6, r["patched_instructions"] / 1e6
            last = "{} ({:.4f}–{:.4f})".format(r["rounds"], *r["growth_range"])
        else:
            stock, patched = r["stock_ms"], r["patched_ms"]
            last = "{:.3f}–{:.3f}".format(*r["growth_quartiles"])
        print(f"| {r['checkpoint']} | {r['layers']} | {r['micro_batches']} | {r['evals_alive']} | "
              f"{stock:.1f} | {patched:.1f} | {r['ratio']:.4f} | {r['growth']:.4f}{against} | {last} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
