"""Nothing kept alive: the captured state holds no tensors, and nothing outlives backward or the model."""

from __future__ import annotations

import gc
import weakref

import pytest
import scenarios as S
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import fsdp_autocast_fix
from fsdp_autocast_fix import _patch

pytestmark = pytest.mark.usefixtures("pg")


def _no_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (tuple, list)):
        return all(_no_tensors(v) for v in value)
    return value is None or isinstance(value, (bool, str, torch.dtype))


def _patched_layer() -> torch.nn.Module:
    fully_shard, policy_cls = S._fsdp()
    fsdp_autocast_fix.apply()
    layer = S.GeluLinear()
    fully_shard(layer, mp_policy=policy_cls(param_dtype=S.BF16, output_dtype=torch.float32))
    return layer


def test_records_hold_no_tensors() -> None:
    """What a forward call leaves: a few scalars on its input's storage, nothing that holds a tensor."""
    layer = _patched_layer()
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    records = getattr(x.untyped_storage(), _patch._CALLS)
    assert len(records) == 1
    ((key, (version, calls)),) = records.items()
    assert all(type(k) is int for k in key)  # (module, storage offset, numel)
    assert isinstance(version, int) and calls and _no_tensors(calls)
    cover = _patch._covers[id(fsdp_autocast_fix._compat.load().state_of(layer))]
    assert all(m.replays == [] for m in cover.modules)


def test_no_activation_or_input_alive_after_backward() -> None:
    layer = _patched_layer()
    x = torch.randn(4, S.DIM, requires_grad=True)
    seen: list[weakref.ref[torch.Tensor]] = []
    layer.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))  # forward and recompute outputs
    with torch.autocast("cpu", dtype=S.BF16), set_checkpoint_early_stop(False):
        out = checkpoint(layer, x, use_reentrant=False)
        out.sum().backward()
    refs = [weakref.ref(x), weakref.ref(out)] + seen
    assert len(seen) == 2
    del x, out
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_model_is_freed_and_uncovered_after_del() -> None:
    before = fsdp_autocast_fix.status().covered_modules
    layer = _patched_layer()
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    ref = weakref.ref(layer)
    assert fsdp_autocast_fix.status().covered_modules == before + 1
    del layer
    gc.collect()
    assert ref() is None
    assert fsdp_autocast_fix.status().covered_modules == before
