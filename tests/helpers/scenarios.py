"""Bug scenarios: each builds a small model, shards it, runs one checkpointed step, returns gradients.

A scenario runs in one of these modes:

* ``reference``: stock ``fully_shard``, no checkpoint - what the gradients must be;
* ``stock``: stock ``fully_shard`` with the checkpoint (the positive control);
* ``apply``: ``fsdp_autocast_fix.apply()`` before sharding;
* ``late_apply``: ``fsdp_autocast_fix.apply()`` after sharding, before the forward;
* ``patched_fully_shard``: ``patched_fully_shard`` instead of ``fully_shard``, no global patch.

They run on the scenario space's engine (:mod:`grid`): its ``Result``, its switch of modes and its probe of what
this torch's FSDP supports. Needs a process group (world size 1 or more); everything runs on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from grid import BF16, DIM, MODES, Result, fsdp_supports, full_grad, in_mode

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat
from fsdp_autocast_fix._probe import NoAutocastRestore

FIXED_MODES = MODES[1:]


def _fsdp_package() -> Any:
    return _compat.fsdp_package()


def _fsdp() -> tuple[Callable[..., Any], type]:
    package = _fsdp_package()
    return package.fully_shard, package.MixedPrecisionPolicy


class GeluLinear(nn.Module):
    """The seed's module: an elementwise op first, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.gelu(x))


class FloatFirst(nn.Module):
    """Starts with ``x.float()``: the recompute sees unrounded values with the same metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.lin(h * h)


#: A hand-written checkpoint that re-runs forward in backward without restoring autocast.
RecomputeWithoutAutocast = NoAutocastRestore


@dataclass(frozen=True)
class Scenario:
    """One bug pattern; ``broken_stock`` says whether the positive control must fail on this torch."""

    name: str
    build: Callable[[], nn.Module]
    shard: Callable[[nn.Module, Callable[..., Any], type], list[nn.Module]]
    step: Callable[[nn.Module, torch.Tensor, bool], torch.Tensor]
    broken_on_buggy_torch: bool = True
    broken_on_fixed_torch: bool = False
    #: Compare with this scenario's run without checkpointing, where this one cannot run without it.
    reference_of: str | None = None
    #: What of fully_shard it needs (:func:`fsdp_supports`); left out where this torch lacks it.
    requires: tuple[str, ...] = ()

    def broken_stock(self) -> bool:
        needs = _compat.load().needs_cast_replay
        return self.broken_on_buggy_torch if needs else self.broken_on_fixed_torch


def _shard_root(policy_kwargs: dict[str, Any]) -> Callable[[nn.Module, Callable[..., Any], type], list[nn.Module]]:
    def shard(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
        fully_shard(model, mp_policy=policy_cls(**policy_kwargs))
        return [model]

    return shard


def _shard_layers(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
    for layer in model:
        fully_shard(layer, mp_policy=policy_cls(param_dtype=BF16, output_dtype=torch.float32))
    return list(model)


def _autocast() -> Any:
    return torch.autocast("cpu", dtype=BF16)


def _ckpt(fn: Callable[..., Any], x: torch.Tensor, use_checkpoint: bool, reentrant: bool = False) -> Any:
    return checkpoint(fn, x, use_reentrant=reentrant) if use_checkpoint else fn(x)


def _seed_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    with _autocast():
        out = _ckpt(model, x, use_checkpoint)
        out.float().sum().backward()
    return out


def _seed_backward_outside(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    with _autocast():
        out = _ckpt(model, x, use_checkpoint)
    out.float().sum().backward()
    return out


def _no_autocast_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    out = _ckpt(model, x, use_checkpoint)
    out.float().sum().backward()
    return out


def _reentrant_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    with _autocast():
        out = _ckpt(model, x, use_checkpoint, reentrant=True)
        out.float().sum().backward()
    return out


def _stack_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    h = x
    for layer in model:
        h = _ckpt(layer, h, use_checkpoint)
    h.sum().backward()
    return h


def _custom_function_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    with _autocast():
        out = RecomputeWithoutAutocast.apply(model, x) if use_checkpoint else model(x)
    out.float().sum().backward()
    return out


class Layer(nn.Module):
    """A layer holding a sharded sub-layer: root -> layer -> sub-layer nesting."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = GeluLinear()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.sub(F.gelu(x)))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.use_checkpoint else layer(x)
        return x


class Pair(nn.Module):
    """Two sibling layers sharded as one group, ``fully_shard([a, b])``, run in one checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.a = GeluLinear()
        self.b = GeluLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def region(h: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(h))

        return checkpoint(region, x, use_reentrant=False) if self.use_checkpoint else region(x)


@dataclass
class Extra:
    """A dataclass input mixing a float and an integer tensor."""

    f: torch.Tensor
    i: torch.Tensor


class MixedInputs(GeluLinear):
    """Positional, tuple, dict and dataclass inputs, float and integer; records the integer dtypes it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.int_dtypes: list[tuple[torch.dtype, ...]] = []

    def forward(self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], *, extra: dict[str, torch.Tensor],
                dc: Extra) -> torch.Tensor:
        self.int_dtypes.append((pair[1].dtype, extra["idx"].dtype, dc.i.dtype))
        h = x + pair[0] * pair[1] + extra["a"] * extra["idx"] + dc.f * dc.i
        return super().forward(h)


def _shard_nested(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
    policy = policy_cls(param_dtype=BF16, output_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer.sub, mp_policy=policy)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return [model]


def _shard_pair(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
    fully_shard([model.a, model.b], mp_policy=policy_cls(param_dtype=BF16, output_dtype=torch.float32))
    fully_shard(model)
    return [model]


def _shard_with(**options: Any) -> Callable[[nn.Module, Callable[..., Any], type], list[nn.Module]]:
    def shard(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
        extra = {k: v(model) if callable(v) else v for k, v in options.items()}
        fully_shard(model, mp_policy=policy_cls(param_dtype=BF16), **extra)
        return [model]

    return shard


def _root_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    model.use_checkpoint = use_checkpoint
    with _autocast():
        out = model(x)
    out.float().sum().backward()
    return out


def _twice_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    with _autocast():
        out = _ckpt(model, x, use_checkpoint) + _ckpt(model, 2 * x, use_checkpoint)
    out.float().sum().backward()
    return out


def _twice_mixed_autocast_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    with _autocast():
        first = _ckpt(model, x, use_checkpoint)
    out = first.float() + _ckpt(model, 2 * x, use_checkpoint).float()
    out.sum().backward()
    return out


def _accumulate_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    for sync, micro in ((False, x[:2]), (True, x[2:])):
        model.set_requires_gradient_sync(sync)
        with _autocast():
            out = _ckpt(model, micro, use_checkpoint)
        out.float().sum().backward()
    return out


def _mixed_inputs_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    pair = (torch.randn(4, DIM, generator=gen), torch.randint(0, 3, (4, DIM), generator=gen))
    extra = {"a": torch.randn(4, DIM, generator=gen), "idx": torch.randint(0, 3, (4, DIM), generator=gen)}
    dc = Extra(torch.randn(4, DIM, generator=gen), torch.randint(0, 3, (4, DIM), generator=gen))
    with _autocast():
        if use_checkpoint:
            out = checkpoint(model, x, pair, use_reentrant=False, extra=extra, dc=dc)
        else:
            out = model(x, pair, extra=extra, dc=dc)
    out.float().sum().backward()
    assert all(d == (torch.int64,) * 3 for d in model.int_dtypes), model.int_dtypes  # never cast
    return out


SEED_POLICY = {"param_dtype": BF16}
SCENARIOS = {
    s.name: s
    for s in [
        Scenario("seed", GeluLinear, _shard_root(SEED_POLICY), _seed_step),
        Scenario("seed_backward_outside_autocast", GeluLinear, _shard_root(SEED_POLICY), _seed_backward_outside),
        Scenario("mixed_precision_without_autocast", GeluLinear, _shard_root(SEED_POLICY), _no_autocast_step),
        Scenario("float_first", FloatFirst, _shard_root(SEED_POLICY), _seed_step),
        Scenario("stack_output_dtype_fp32", lambda: nn.Sequential(*[GeluLinear() for _ in range(3)]),
                 _shard_layers, _stack_step),
        Scenario("reentrant", GeluLinear, _shard_root(SEED_POLICY), _reentrant_step,
                 broken_on_buggy_torch=False),
        # Parameters stay fp32 here, so only autocast makes the linear layer run in bf16.
        Scenario("custom_function_checkpoint", GeluLinear, _shard_root({}), _custom_function_step,
                 broken_on_fixed_torch=True),
    ]
}
#: FSDP2 topologies and calling patterns people use (issue 6), each with a checkpoint that needs the casts.
TOPOLOGIES = {
    s.name: s
    for s in [
        Scenario("nested_root_layer_sublayer", Nested, _shard_nested, _root_step),
        Scenario("reshard_after_forward_false", GeluLinear, _shard_with(reshard_after_forward=False), _seed_step),
        Scenario("reshard_after_forward_int", GeluLinear, _shard_with(reshard_after_forward=1), _seed_step),
        Scenario("called_twice_same_autocast", GeluLinear, _shard_root(SEED_POLICY), _twice_step),
        Scenario("called_twice_different_autocast", GeluLinear, _shard_root(SEED_POLICY), _twice_mixed_autocast_step),
        Scenario("gradient_accumulation_no_sync", GeluLinear, _shard_root(SEED_POLICY), _accumulate_step),
        Scenario("cpu_offload_policy", GeluLinear,
                 _shard_with(offload_policy=lambda m: _fsdp_package().CPUOffloadPolicy(pin_memory=False)),
                 _seed_step),
        Scenario("kwargs_tuple_dict_dataclass_inputs", MixedInputs, _shard_root(SEED_POLICY), _mixed_inputs_step),
        Scenario("ignored_params", GeluLinear, _shard_with(ignored_params=lambda m: {m.lin.bias}), _seed_step,
                 requires=("ignored_params",)),
        Scenario("grouped_fully_shard", Pair, _shard_pair, _root_step, requires=("grouped",)),
    ]
}


class GeluDropoutLinear(GeluLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.dropout(F.gelu(x), p=0.25, training=True))


class Holder(nn.Module):
    """Holds a layer and a checkpointed view of it (``checkpoint_wrapper`` outside the sharded layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = GeluLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.wrapped if self.use_checkpoint else self.inner)(x)


class Outer(nn.Module):
    """Calls its layer; the layer gets ``checkpoint_wrapper`` and then ``fully_shard`` (torchtitan's order)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = GeluLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _checkpoint_wrapper(module: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(module)


def _shard_then_wrap(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
    fully_shard(model.inner, mp_policy=policy_cls(**SEED_POLICY))
    object.__setattr__(model, "wrapped", _checkpoint_wrapper(model.inner))  # a view, not a submodule
    return [model.inner]


def _wrap_then_shard(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
    model.inner = _checkpoint_wrapper(model.inner)
    fully_shard(model.inner, mp_policy=policy_cls(**SEED_POLICY))
    return [model.inner]


def _composable_then_shard(model: nn.Module, fully_shard: Callable[..., Any], policy_cls: type) -> list[nn.Module]:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    composable_checkpoint(model)
    fully_shard(model, mp_policy=policy_cls(**SEED_POLICY))
    return [model]


def _holder_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    model.use_checkpoint = use_checkpoint
    return _no_checkpoint_seed_step(model, x)


def _no_checkpoint_seed_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool = False) -> torch.Tensor:
    with _autocast():
        out = model(x)
        out.float().sum().backward()
    return out


def _early_stop_off_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    from torch.utils.checkpoint import set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        return _seed_step(model, x, use_checkpoint)


def _dropout_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    with _autocast():
        out = checkpoint(model, x, use_reentrant=False, preserve_rng_state=True) if use_checkpoint else model(x)
        out.float().sum().backward()
    return out


def _sequential_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint_sequential

    with _autocast():
        out = checkpoint_sequential(model, 2, x, use_reentrant=False) if use_checkpoint else model(x)
    out.float().sum().backward()
    return out


def _selective_step(model: nn.Module, x: torch.Tensor, use_checkpoint: bool) -> torch.Tensor:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    with _autocast():
        out = checkpoint(model, x, use_reentrant=False, context_fn=context_fn) if use_checkpoint else model(x)
        out.float().sum().backward()
    return out


#: Every checkpoint front end (issue 5), on the seed's module.
FRONT_ENDS = {
    s.name: s
    for s in [
        Scenario("checkpoint_early_stop_off", GeluLinear, _shard_root(SEED_POLICY), _early_stop_off_step),
        Scenario("checkpoint_preserve_rng_dropout", GeluDropoutLinear, _shard_root(SEED_POLICY), _dropout_step),
        Scenario("checkpoint_sequential", lambda: nn.Sequential(GeluLinear(), GeluLinear()), _shard_layers,
                 _sequential_step),
        Scenario("checkpoint_wrapper_outside_fully_shard", Holder, _shard_then_wrap, _holder_step),
        Scenario("checkpoint_wrapper_inside_fully_shard", Outer, _wrap_then_shard,
                 _no_checkpoint_seed_step, broken_on_buggy_torch=False, reference_of="seed"),
        Scenario("composable_checkpoint", GeluLinear, _composable_then_shard, _no_checkpoint_seed_step,
                 broken_on_buggy_torch=False, reference_of="seed"),
        Scenario("selective_activation_checkpoint", GeluLinear, _shard_root(SEED_POLICY), _selective_step,
                 requires=("selective",)),
    ]
}
ALL = {name: s for name, s in {**SCENARIOS, **TOPOLOGIES, **FRONT_ENDS}.items()
       if all(fsdp_supports(feature) for feature in s.requires)}


def run(scenario: Scenario, mode: str, seed: int = 0) -> Result:
    """Run ``scenario`` once in ``mode`` (see the module docstring); never leaves a patch applied."""
    torch.manual_seed(seed)
    model = scenario.build()
    x = torch.randn(4, DIM, requires_grad=True)
    with in_mode(mode) as fully_shard:
        scenario.shard(model, fully_shard, _compat.fsdp_package().MixedPrecisionPolicy)
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        try:
            scenario.step(model, x, mode != "reference")
        except Exception as e:  # the positive control's failure
            return Result(error=e)
    return Result(grads=[full_grad(x.grad)] + [full_grad(p.grad) for p in model.parameters()])


def _cell(result: Result, reference: Result) -> str:
    if result.error is not None:
        return f"fails ({type(result.error).__name__})"
    return "bitwise equal" if result.same_as(reference) else "wrong gradients"


def table() -> str:
    """Markdown table: scenario x stock x apply x late apply x patched_fully_shard, measured now."""
    rows = [f"torch {torch.__version__} (needs cast replay: {_compat.load().needs_cast_replay})", "",
            "| scenario | " + " | ".join(MODES) + " |", "|---" * (len(MODES) + 1) + "|"]
    for name, scenario in ALL.items():
        reference = run(ALL[scenario.reference_of or name], "reference")
        rows.append(f"| {name} | " + " | ".join(_cell(run(scenario, m), reference) for m in MODES) + " |")
    return "\n".join(rows)


def measure() -> dict[str, Any]:
    """The scenario table as data: torch version, whether it needs the cast replay, a cell per mode."""
    cells: dict[str, dict[str, str]] = {}
    for name, scenario in ALL.items():
        reference = run(ALL[scenario.reference_of or name], "reference")
        cells[name] = {m: _cell(run(scenario, m), reference) for m in MODES}
        cells[name]["broken_stock_expected"] = str(scenario.broken_stock())
    return {"torch": str(torch.__version__), "needs_cast_replay": _compat.load().needs_cast_replay,
            "scenarios": cells}


if __name__ == "__main__":
    import json
    import sys
    import warnings

    import torch.distributed as dist
    from ranks import free_port

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if sys.argv[1:2] == ["--json"]:
        with open(sys.argv[2], "w") as f:
            json.dump(measure(), f, indent=1)
    else:
        print(table())
    dist.destroy_process_group()
