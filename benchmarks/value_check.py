"""Cost of the value-level recompute check (``fsdp_autocast_fix.check_recompute``), interleaved in one process.

World size 1, gloo, CPU: a sharded 4-layer MLP (hidden 512, batch 64) under ``patched_fully_shard``,
checkpoint per layer, autocast bf16; one step (forward and backward) timed with and without the check,
alternating. JSON keys: ``torch``, ``off_ms``, ``on_ms`` (medians), ``ratio`` (on / off).

    python benchmarks/value_check.py [--rounds 20] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp_autocast_fix  # noqa: E402
from fsdp_autocast_fix import _compat  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Measure and print (or write) the ratio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    rounds, hidden, batch = (2, 32, 4) if args.smoke else (args.rounds, 512, 64)
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(4))
    for layer in layers:
        fsdp_autocast_fix.patched_fully_shard(layer, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(batch, hidden, requires_grad=True)

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False)
        h.float().sum().backward()
        return (time.perf_counter() - start) * 1e3

    samples: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(rounds + 2):
        off = step()
        with fsdp_autocast_fix.check_recompute():
            on = step()
        if i >= 2:  # warm-up
            samples["off"].append(off)
            samples["on"].append(on)
    dist.destroy_process_group()
    result = {"torch": torch.__version__, "off_ms": statistics.median(samples["off"]),
              "on_ms": statistics.median(samples["on"])}
    result["ratio"] = result["on_ms"] / result["off_ms"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print("| value check | step ms (median) |\n|---|---|")
    print(f"| off | {result['off_ms']:.2f} |\n| on | {result['on_ms']:.2f} |")
    print(f"\nThe check costs {result['ratio']:.2f}x the step time here ({rounds} interleaved rounds).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
