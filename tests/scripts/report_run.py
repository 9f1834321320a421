"""A training step the report tests run in a fresh interpreter (``torchrun`` or plain): one step of a sharded
block under autocast, checkpointed with a hand-written checkpoint that does not restore autocast, ``apply()``
first, then a spawned worker process that imports the package and exits (a DataLoader's). With
``FSDP_AUTOCAST_FIX_REPORT`` set, the report is printed at exit, by the training process only."""

from __future__ import annotations

import multiprocessing
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))

import grid as G  # noqa: E402
from ranks import tear_down  # noqa: E402

import fsdp_autocast_fix  # noqa: E402


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    step()  # its sharded module is freed on return, before the group goes
    tear_down()
    worker = multiprocessing.get_context("spawn").Process(target=_worker)
    worker.start()
    worker.join()
    assert worker.exitcode == 0, worker.exitcode
    print("step done")


def _worker() -> None:
    """A process that imports the package (with this script) and never uses the patch."""


def step() -> None:
    fsdp_autocast_fix.apply()
    fsdp = G._compat.fsdp_package()
    torch.manual_seed(0)
    block = G.Block()
    fsdp.fully_shard(block, mp_policy=fsdp.MixedPrecisionPolicy())
    x = torch.randn(4, G.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=G.BF16):
        out = G._FunctionCheckpoint.apply(block, "no_restore", x)
    out.float().sum().backward()


if __name__ == "__main__":
    main()
