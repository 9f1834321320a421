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

JSON keys: ``torch``, ``rounds``, ``config``, ``step_ms`` (median per variant), ``step_ms_all`` (per variant),
``patched_over_stock``, ``reentrant_over_stock`` (medians of the per-round ratios).

    python benchmarks/ab_step.py [--rounds 180] [--json out.json] [--smoke]
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

from step import ROOT, Stack, _free_port, config  # noqa: E402

VARIANTS = ("patched", "stock", "reentrant")


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], rounds: int, out_path: str) -> None:
    sys.path.insert(0, ROOT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
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

    def step(variant: str) -> float:
        if variant == "patched":
            fsdp_autocast_fix.apply()
        model.variant = "b" if variant == "reentrant" else "e"
        x = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"], generator=gen).requires_grad_(True)
        dist.barrier()
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        dist.barrier()
        elapsed = (time.perf_counter() - start) * 1e3
        fsdp_autocast_fix.remove()
        return elapsed

    for _ in range(cfg["warmup"]):
        for variant in VARIANTS:
            step(variant)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    orders = list(itertools.permutations(VARIANTS))
    for i in range(rounds):
        for variant in orders[i % len(orders)]:
            times[variant].append(step(variant))
    if rank == 0:
        medians = {v: statistics.median(t) for v, t in times.items()}

        def paired(variant: str) -> float:
            return statistics.median(a / b for a, b in zip(times[variant], times["stock"]))

        with open(out_path, "w") as f:
            json.dump({"torch": torch.__version__, "rounds": rounds, "config": cfg, "step_ms": medians,
                       "step_ms_all": times, "patched_over_stock": paired("patched"),
                       "reentrant_over_stock": paired("reentrant")}, f)
    dist.destroy_process_group()


def run(cfg: dict[str, Any], rounds: int, world: int = 2) -> dict[str, Any]:
    """Run the A/B on ``world`` spawned ranks; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, _free_port(), cfg, rounds, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)  # type: ignore[no-any-return]


def markdown(result: dict[str, Any]) -> str:
    """The result as a markdown table."""
    ms = result["step_ms"]
    return "\n".join([
        "| | patched | stock | reentrant workaround |",
        "|---|---|---|---|",
        f"| step ms (median of {result['rounds']} rounds) | {ms['patched']:.1f} | {ms['stock']:.1f} | "
        f"{ms['reentrant']:.1f} |",
        f"| ratio to stock (median of the rounds' ratios) | {result['patched_over_stock']:.3f} | 1 | "
        f"{result['reentrant_over_stock']:.3f} |",
    ])


def main(argv: list[str] | None = None) -> int:
    """Measure; print the table, and write JSON if asked."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=180)
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    cfg = config(args.smoke, steps=0)
    result = run(cfg, 2 if args.smoke else args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
