"""HSDP: a 2-D mesh (replicate x shard) on 4 spawned gloo ranks; positive control and bitwise parity."""

from __future__ import annotations

import re

import mesh_2d
import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port

from fsdp_autocast_fix import _compat


_BASE = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])


@pytest.mark.skipif(_BASE < (2, 8), reason="stock FSDP2 HSDP fails on CPU before torch 2.8, without checkpointing "
                    "too (post_backward: 'assert all_reduce_event is not None')")
def test_mesh_2d(tmp_path) -> None:
    out = tmp_path / "mesh.pt"
    mp.spawn(mesh_2d.worker, args=(4, free_port(), str(out)), nprocs=4, join=True)
    result = torch.load(out, weights_only=False)
    assert "crash" not in result, result.get("crash")
    assert result["mesh_ndim"] == 2
    reference, stock, patched = result["reference"], result["stock"], result["patched"]
    assert isinstance(reference, list), reference

    def same(a: object) -> bool:
        return isinstance(a, list) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, reference))

    assert same(patched), patched
    if _compat.load().needs_cast_replay:
        assert not same(stock), "positive control: stock should fail on this torch"
        assert isinstance(stock, str) and "CheckpointError" in stock
    else:
        assert same(stock)
