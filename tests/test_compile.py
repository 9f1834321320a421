"""torch.compile (aot_eager, CPU): compiled sharded layers, checkpointed per layer, under the patch.

Parity with the compiled run without checkpointing over several steps, and no graph break the stock
run does not have (the patch's hooks are registered as FSDP registers its own: ``torch._dynamo.disable``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import cpu_standins
import pytest
import scenarios as S
import torch
import torch._dynamo
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat

pytestmark = pytest.mark.usefixtures("pg")


def _run(patched: bool, use_checkpoint: bool, steps: int = 3) -> tuple[Any, int]:
    torch._dynamo.reset()
    counters.clear()
    fully_shard, policy_cls = S._fsdp()
    shard = fsdp_autocast_fix.patched_fully_shard if patched else fully_shard
    torch.manual_seed(0)
    layers = nn.Sequential(S.GeluLinear(), S.GeluLinear())
    for layer in layers:
        shard(layer, mp_policy=policy_cls(param_dtype=S.BF16, output_dtype=torch.float32))
        layer.compile(backend="aot_eager")
    x = torch.randn(4, S.DIM, requires_grad=True)
    grads = []
    try:
        for _ in range(steps):
            x.grad = None
            for p in layers.parameters():
                p.grad = None
            with torch.autocast("cpu", dtype=S.BF16):
                h = x
                for layer in layers:
                    h = checkpoint(layer, h, use_reentrant=False) if use_checkpoint else layer(h)
                h.float().sum().backward()
            grads.append([x.grad.clone()] + [p.grad.full_tensor() for p in layers.parameters()])
    except Exception as e:
        return e, sum(counters["graph_break"].values())
    return grads, sum(counters["graph_break"].values())


def _compile_failure(result: Any) -> bool:
    return isinstance(result, torch._dynamo.exc.BackendCompilerFailed)


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, list) and len(a) == len(b) and all(
        S.Result(grads=x).same_as(S.Result(grads=y)) for x, y in zip(a, b))


#: ``torch._dynamo.config.skip_fsdp_hooks`` where this torch has it (until 2.12); False: torch 2.4-2.7 trace
#: FSDP's hooks into the graph.
SKIP_FSDP_HOOKS = [True, False] if hasattr(torch._dynamo.config, "skip_fsdp_hooks") else [None]


@pytest.mark.parametrize("skip_fsdp_hooks", SKIP_FSDP_HOOKS, ids=lambda v: f"skip_fsdp_hooks={v}")
def test_compiled_parity_and_no_added_graph_break(skip_fsdp_hooks: bool | None) -> None:
    with (torch._dynamo.config.patch(skip_fsdp_hooks=skip_fsdp_hooks) if skip_fsdp_hooks is not None
          else contextlib.nullcontext()):
        _check_parity_and_graph_breaks()


def _check_parity_and_graph_breaks() -> None:
    reference, reference_breaks = _run(patched=False, use_checkpoint=False)
    if not isinstance(reference, list) and torch.__version__.startswith("2.4.") and cpu_standins.needed():
        pytest.skip(f"torch 2.4 on CPU (the suite's stand-ins) does not compile a sharded module even stock without "
                    f"checkpointing: {type(reference).__name__}")
    assert isinstance(reference, list), reference
    stock, stock_breaks = _run(patched=False, use_checkpoint=True)
    patched, patched_breaks = _run(patched=True, use_checkpoint=True)
    torch._dynamo.reset()  # let the compiled modules go
    if torch.__version__.startswith("2.4.") and all(_compile_failure(r) for r in (stock, patched)):
        pytest.skip(f"torch 2.4 does not compile a checkpointed sharded module, stock or patched: {stock}")
    assert _same(patched, reference), patched
    assert patched_breaks == reference_breaks
    if _compat.load().needs_cast_replay:
        assert not _same(stock, reference), "positive control: stock should fail on this torch"
    else:
        assert _same(stock, reference) and patched_breaks == stock_breaks
