"""Shared fixtures: a world-size-1 gloo process group on 127.0.0.1, and a clean patch state.

On torch 2.4-2.6 without CUDA the suite runs FSDP2 on CPU through the test-only stand-ins of
tests/helpers/cpu_standins.py, here and in every interpreter it starts (tests/helpers/standins_site).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist

#: The suite's helpers (scenario engines, CPU stand-ins, rank workers), importable by every test and script.
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
sys.path.insert(0, HELPERS)

import cpu_standins  # noqa: E402
from ranks import free_port  # noqa: E402,F401  (the tests' import of it)

import fsdp_autocast_fix  # noqa: E402

if cpu_standins.needed():
    cpu_standins.install()
    os.environ[cpu_standins.ENV_VAR] = "1"
    _site = os.path.join(HELPERS, "standins_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_site, os.environ.get("PYTHONPATH")) if p)



#: ``nccl`` for the GPU check (tests/scripts/gpu_check.sh); gloo on CPU otherwise.
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
    registry = _strong_state_registry()
    before = set(map(id, registry)) if registry is not None else set()
    yield
    fsdp_autocast_fix.remove()
    if registry is not None:  # what the test sharded is gone with it, as 2.6+'s weak registry lets it go
        for module in [m for m in registry if id(m) not in before]:
            registry.pop(module, None)


def _strong_state_registry() -> dict | None:
    """torch 2.4-2.5's composable-state registry, a plain dict that keeps every sharded module alive (2.6+ holds
    them weakly); None where it is weak."""
    from torch.distributed import _composable_state

    mapping = _composable_state._module_state_mapping
    return mapping if type(mapping) is dict else None
