"""In-process A/B training-step benchmark: the patch against stock torch on one torch build.

The stack of ``step.py`` (8 layers, hidden 256, sequence 128, batch 2; autocast bf16,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, every layer and the root sharded) on 2
spawned gloo ranks. One model, one pair of ranks; every round runs one step of each variant:

* ``patched``: ``fsdp_autocast_fix.apply()`` (retrofitting the sharded model), non-reentrant ``checkpoint``
  per layer, then ``remove()`` (outside the timed step);
* ``stock``: the same step without the patch (right on every torch for this stack: its checkpointed layers'
  inputs are already bf16, so the casts torch <= 2.12 skips change nothing);
* ``reentrant``: stock, ``checkpoint(..., use_reentrant=True)``: the usual workaround.

The three run in every order in turn (six orders, cycled), so neither the machine's drift nor a step's
position in the round favours one. Reported: the median step time of each, and the median over rounds of each
round's ratio to the stock step of the same round (``patched / stock``, target <= 1.01; ``reentrant / stock``).

Timed, a step spreads by several percent from round to round on a shared machine, so even the median of 180
rounds' ratios moves by about 1 % from run to run: wider than the 1.005 target. ``--instructions`` counts
instead the instructions each rank executes in each step, under valgrind's callgrind
(``benchmarks/instructions.py``; every rank is its own process under callgrind), the same steps in the same
orders (4 rounds by default, the first four of the six orders: a step's count repeats within a few hundredths of
a percent). Instructions are a proxy for time, not time: they leave out memory stalls and waits, and the timed
ratio is the one that says what a step costs here.

JSON keys: ``torch``, ``rounds``, ``config``, ``unit`` (``ms`` or ``instructions``), ``step_ms`` or
``step_instructions`` (median per variant, rank 0), ``step_ms_all`` or ``step_instructions_all`` (per variant and
round), ``patched_over_stock``, ``reentrant_over_stock`` (medians of the per-round ratios; counted, over both
ranks' rounds), and, counted, ``patched_over_stock_range`` (the lowest and highest round's ratio).

    python benchmarks/ab_step.py [--rounds 180] [--instructions] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import instructions  # noqa: E402
from step import ROOT, Stack, _free_port, config  # noqa: E402

VARIANTS = ("patched", "stock", "reentrant")


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], rounds: int, out_path: str,
            counted: bool = False) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    from ranks import spawned_group  # the group torn down in step (gloo's shutdown races otherwise)

    torch.set_num_threads(1)
    with spawned_group(rank, world, port):
        _ab(rank, world, cfg, rounds, out_path, counted)  # what holds the group is freed on its return


def _ab(rank: int, world: int, cfg: dict[str, Any], rounds: int, out_path: str, counted: bool) -> None:
    """This rank's A/B rounds; rank 0 writes the result to ``out_path``."""
    import fsdp_autocast_fix
    from fsdp_autocast_fix import _compat

    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    model = Stack(cfg["layers"], cfg["hidden"], cfg["heads"], "e")
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fsdp.fully_shard(layer, mp_policy=policy)
    fsdp.fully_shard(model, mp_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)

    counter = instructions.Counter() if counted else None

    def train_step(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()

    def step(variant: str) -> float:
        if variant == "patched":
            fsdp_autocast_fix.apply()
        model.variant = "b" if variant == "reentrant" else "e"
        x = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"], generator=gen).requires_grad_(True)
        dist.barrier()
        if counter is not None:  # this rank's instructions in the step (a rank waiting on the other executes none)
            cost = float(counter.count(lambda: train_step(x)))
        else:
            start = time.perf_counter()
            train_step(x)
            dist.barrier()
            cost = (time.perf_counter() - start) * 1e3
        fsdp_autocast_fix.remove()
        return cost

    for _ in range(cfg["warmup"]):
        for variant in VARIANTS:
            step(variant)
    if counter is not None:
        counter.start()
    costs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    orders = list(itertools.permutations(VARIANTS))
    for i in range(rounds):
        for variant in orders[i % len(orders)]:
            costs[variant].append(step(variant))
    mine = torch.tensor([costs[v] for v in VARIANTS], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)  # counted: every rank's rounds are samples
    if rank == 0:
        unit = "instructions" if counted else "ms"
        samples = [dict(zip(VARIANTS, g.tolist())) for g in gathered] if counted else [costs]

        def ratios(variant: str) -> list[float]:
            return [a / b for c in samples for a, b in zip(c[variant], c["stock"])]

        result = {"torch": torch.__version__, "rounds": rounds, "config": cfg, "unit": unit,
                  f"step_{unit}": {v: statistics.median(t) for v, t in costs.items()}, f"step_{unit}_all": costs,
                  "patched_over_stock": statistics.median(ratios("patched")),
                  "reentrant_over_stock": statistics.median(ratios("reentrant"))}
        if counted:
            result["patched_over_stock_range"] = [min(ratios("patched")), max(ratios("patched"))]
        with open(out_path, "w") as f:
            json.dump(result, f)


def run(cfg: dict[str, Any], rounds: int, world: int = 2, counted: bool = False) -> dict[str, Any]:
    """Run the A/B on ``world`` spawned ranks (``counted``: in instructions, in a process started by
    ``instructions.relaunch``); rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, _free_port(), cfg, rounds, out, counted), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)  # type: ignore[no-any-return]


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown table."""
    unit = result.get("unit", "ms")
    per_step = result[f"step_{unit}"]
    shown = (lambda v: f"{v / 1e6:.1f}M") if unit == "instructions" else (lambda v: f"{v:.1f}")
    return "\n".join([
        "| | patched | stock | reentrant workaround |",
        "|---|---|---|---|",
        f"| step {unit} (median of {result['rounds']} rounds) | {shown(per_step['patched'])} | "
        f"{shown(per_step['stock'])} | {shown(per_step['reentrant'])} |",
        f"| ratio to stock (median of the rounds' ratios) | {result['patched_over_stock']:.3f} | 1 | "
        f"{result['reentrant_over_stock']:.3f} |",
    ])


def main(argv: list[str] | None = None) -> int:
    """Measure; print the table, and write JSON if asked."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, help="rounds (default: 180 timed, 4 counted)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind's callgrind instead of timing")
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.instructions and not instructions.relaunched():
        return instructions.relaunch(os.path.abspath(__file__), sys.argv[1:] if argv is None else argv,
                                     children=True)
    cfg = config(args.smoke, steps=0)
    rounds = args.rounds or (4 if args.instructions else 180)
    result = run(cfg, (1 if args.instructions else 2) if args.smoke else rounds, counted=args.instructions)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
