"""The seed's own script on 2 spawned gloo ranks: patched fully_shard matches FSDP1 exactly."""

from __future__ import annotations

import seed_two_ranks
import torch
import torch.multiprocessing as mp
from conftest import free_port

from fsdp_autocast_fix import _compat


def _run(tmp_path, patch: bool) -> dict:
    out = tmp_path / f"seed-{patch}.pt"
    mp.spawn(seed_two_ranks.worker, args=(2, free_port(), patch, str(out)), nprocs=2, join=True)
    result = torch.load(out, weights_only=False)
    assert "crash" not in result, result.get("crash")
    assert result["fsdp1"]["error"] is None, result["fsdp1"]["error"]
    assert result["fsdp1_dtypes"] == [torch.bfloat16, torch.bfloat16]  # FSDP1 replays its cast
    return result


def test_seed_stock_fails_on_buggy_torch(tmp_path) -> None:
    result = _run(tmp_path, patch=False)
    if _compat.load().needs_cast_replay:
        assert result["fully_shard"]["error"] is not None and "CheckpointError" in result["fully_shard"]["error"]
        assert result["fully_shard_dtypes"] == [torch.bfloat16, torch.float32]
    else:
        assert result["fully_shard"]["error"] is None
        assert result["fully_shard_dtypes"] == result["fsdp1_dtypes"]


def test_seed_patched_matches_fsdp1(tmp_path) -> None:
    result = _run(tmp_path, patch=True)
    assert result["fully_shard"]["error"] is None, result["fully_shard"]["error"]
    assert result["fully_shard_dtypes"] == result["fsdp1_dtypes"]
    assert torch.equal(result["fully_shard"]["grad"], result["fsdp1"]["grad"])
