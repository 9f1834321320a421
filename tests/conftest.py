"""Shared fixtures: a world-size-1 gloo process group on 127.0.0.1, and a clean patch state."""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import fsdp_autocast_fix  # noqa: E402


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: ``nccl`` for the GPU check (tests/gpu_check.sh); gloo on CPU otherwise.
BACKEND = os.environ.get("FSDP_AUTOCAST_FIX_TEST_BACKEND", "gloo")


@pytest.fixture(scope="session")
def pg() -> Iterator[None]:
    """One process group of world size 1 for the whole session (gloo on 127.0.0.1 unless told otherwise)."""
    if not dist.is_initialized():
        if BACKEND == "nccl":
            import torch

            torch.cuda.set_device(0)
        dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _clean_patch() -> Iterator[None]:
    fsdp_autocast_fix.remove()
    gc.collect()  # sharded modules from earlier tests live in reference cycles until collected
    yield
    fsdp_autocast_fix.remove()
