"""Hook overhead: what the patch adds to a sharded module's call, stock vs patched, interleaved in one process.

World size 1, gloo, CPU. One sharded module with a tiny forward, called in blocks of calls that alternate
between stock and patched (``apply()`` before the block, ``remove()`` after it, a few untimed calls first), the
order flipped every round; the added time is the median of the paired differences (patched block minus the
stock block beside it), which cancels the machine's drift. Every call gets a fresh input tensor (a ``detach()``),
as a training step's activations are, so a patched call makes its record and frees it. Without and with
autocast (bf16), grad disabled and enabled. FSDP2's own hook time is the stock call minus the same module
unsharded. The patch's own work (the record of an ordinary call; the start and end of a replayed recompute,
inside a backward pass with the state set to ``PRE_BACKWARD``) is also timed on its methods directly, and so
is the ``torch._dynamo.disable`` wrapper its hook has, as FSDP's has (torch.compile must not trace either).

JSON keys: ``torch``, ``grad`` (``off``/``on``), ``autocast`` (``off``/``bf16``), ``unsharded_ns``,
``stock_ns``, ``patched_ns``, ``fsdp_hook_ns`` (stock - unsharded), ``added_ns`` (median paired patched -
stock), ``added_over_fsdp_hook`` (the target is <= 0.01), ``ratio`` (patched / stock); and for the paths
measured on the hooks directly, ``path`` (``ordinary``, ``ordinary-autocast``, ``recompute``,
``recompute-region``, ``recompute-entered``, each also ``-fp32-params``, ``disable-wrapper``; ``floor-record``,
``floor-record-autocast`` and ``floor-replay``: the operations an exact record or replay cannot leave out, alone),
``ns_per_call``, ``over_fsdp_hook``.

``--instructions`` counts, instead of timing, the instructions of the blocks of calls under valgrind's callgrind
(``benchmarks/instructions.py``; needs valgrind and a C compiler): unsharded, stock, prebuilt (below) and patched,
per row, 4 rounds (``rounds`` and ``calls`` per block in each row); the added cost is then resolved to a few
instructions where the timed difference spreads by microseconds (``*_instructions`` keys in place of ``*_ns``).
Each row also counts stock with FSDP's pre-hook called through one prebuilt ``torch._dynamo.disable`` wrapper,
as the patch calls it (FSDP's own builds one per call): ``prebuilt_instructions``, and the patch's own work
``own_instructions`` (patched - prebuilt), ``own_over_fsdp_hook``. The direct paths are counted too
(``instructions_per_call``; ``over_fsdp_hook`` of the rows' mean FSDP2 hook instructions), all but
``recompute``, sampled one by one inside torch's recompute, and ``disable-wrapper``. Instructions are a proxy for
time, not time (a cache miss counts as one).

    python benchmarks/hook_overhead.py [--rounds 200] [--calls 100] [--instructions] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsdp_autocast_fix  # noqa: E402
import instructions  # noqa: E402
from fsdp_autocast_fix import _compat, _hooks, _patch, _replay  # noqa: E402


def _per_call_ns(module: nn.Module, x: torch.Tensor, calls: int) -> float:
    """Per call, each on a fresh tensor as a training step's activations are (a record made and freed)."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        module(x.detach())
    return (time.perf_counter_ns() - start) / calls


def _timer_ns() -> int:
    start = time.perf_counter_ns()
    return time.perf_counter_ns() - start


def _paired(module: nn.Module, unsharded: nn.Module, x: torch.Tensor, rounds: int, calls: int) -> dict[str, float]:
    """Stock and patched blocks of calls on the same module, side by side; medians and the paired difference."""
    stock, patched, plain, diffs = [], [], [], []
    for i in range(rounds):
        pair = {}
        for variant in (("stock", "patched") if i % 2 == 0 else ("patched", "stock")):
            if variant == "patched":
                fsdp_autocast_fix.apply()
            _per_call_ns(module, x, 10)  # untimed: the first calls after a change
            pair[variant] = _per_call_ns(module, x, calls)
            fsdp_autocast_fix.remove()
        stock.append(pair["stock"])
        patched.append(pair["patched"])
        diffs.append(pair["patched"] - pair["stock"])
        plain.append(_per_call_ns(unsharded, x, calls))
    return {"stock": statistics.median(stock), "patched": statistics.median(patched),
            "unsharded": statistics.median(plain), "added": statistics.median(diffs)}


@contextlib.contextmanager
def _prebuilt_wrapper(module: nn.Module) -> Any:
    """Stock FSDP with its pre-hook entry called through one ``torch._dynamo.disable`` wrapper built beforehand
    (as the patch calls it) instead of FSDP's own, which builds one per call: stock minus what the patch saves."""
    state = _compat.load().state_of(module)
    slot = _compat.hook_slots(state, module).entry
    theirs = slot.get()
    slot.set(_hooks.eager(_compat.load().bare_hook(theirs, state)))
    try:
        yield
    finally:
        slot.set(theirs)


def _counted(module: nn.Module, unsharded: nn.Module, x: torch.Tensor, rounds: int, calls: int,
             counter: Any) -> dict[str, float]:
    """Instructions per call of blocks of calls, unsharded, stock, stock with a prebuilt wrapper
    (:func:`_prebuilt_wrapper`) and patched (``counter``: an ``instructions.Counter``), each block after a few
    uncounted calls, in an order reversed every round; the medians over rounds, and the medians of the rounds'
    patched - stock (``added``) and patched - prebuilt (``own``: the patch's own work)."""
    def block(target: nn.Module) -> Any:
        return lambda: [target(x.detach()) for _ in range(calls)]

    variants = {"unsharded": contextlib.nullcontext, "stock": contextlib.nullcontext,
                "prebuilt": lambda: _prebuilt_wrapper(module), "patched": fsdp_autocast_fix.patched}
    counts: dict[str, list[float]] = {key: [] for key in (*variants, "added", "own")}
    for i in range(rounds):
        for variant, context in list(variants.items())[::-1 if i % 2 else 1]:
            target = unsharded if variant == "unsharded" else module
            with context():
                block(target)()  # uncounted: the first calls after a change
                counts[variant].append(counter.count(block(target)) / calls)
        counts["added"].append(counts["patched"][-1] - counts["stock"][-1])
        counts["own"].append(counts["patched"][-1] - counts["prebuilt"][-1])
    return {key: statistics.median(values) for key, values in counts.items()}


class _InBackward(torch.autograd.Function):
    """Runs ``ctx.body()`` in its backward: inside a real backward pass (graph task, backward node), where every
    recompute runs."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        ctx.body()
        return grad


def _in_backward(body: Any) -> None:
    out = _InBackward.apply(torch.ones(1, requires_grad=True))
    out.grad_fn.body = body
    out.sum().backward()


def _timed_ns(block: Any) -> float:
    start = time.perf_counter_ns()
    block()
    return time.perf_counter_ns() - start


def _hooks_directly(module: nn.Module, fp32_module: nn.Module, rounds: int, calls: int,
                    counter: Any = None) -> list[dict[str, Any]]:
    """The patch's own work per module call, called directly (FSDP's hooks not included); timed, or counted in
    instructions where ``counter`` (an ``instructions.Counter``) is given (then without ``recompute``, whose
    samples are taken inside torch's recompute one by one, and ``disable-wrapper``).

    ``ordinary``: what runs before FSDP's pre-hook on an ordinary forward (the record), autocast off and on;
    ``recompute``: the start of a replayed recompute and its end (the exit hook), with the state in
    ``PRE_BACKWARD``, timed inside ``torch.utils.checkpoint``'s own recompute (non-reentrant, one per checkpoint,
    the backward outside autocast); ``recompute-region``: the same inside a backward pass where a checkpoint of
    another kind restores the call's state in an autocast region of its own per recompute (the region's own entry
    and exit, stock's too, are measured apart and taken off); ``recompute-entered``: the same where the
    checkpoint does not restore the state and the patch enters it (each recompute is then a region of the
    patch's own, ended when the next one starts). ``module`` has bf16 parameters, whose casts autocast never
    caches (no cast-cache bookkeeping); the recompute paths are timed again on ``fp32_module``, fp32 parameters
    that autocast casts (``-fp32-params``: the hazard bookkeeping, and outside torch's checkpoint the sentinel)."""
    cost = counter.count if counter is not None else _timed_ns
    unit = "instructions_per_call" if counter is not None else "ns_per_call"
    cover = _patch._covers[id(_compat.load().state_of(module))]
    module_cover = cover.modules[0]
    replayer = module_cover.replayer
    x = torch.randn(2, 8)
    args: tuple[Any, ...] = (x,)
    results = []

    def torch_checkpoint_recomputes(samples: list[float]) -> None:
        # Each replay timed inside torch.utils.checkpoint's own recompute (non-reentrant), one per checkpoint.
        timer = statistics.median(_timer_ns() for _ in range(1000))

        def body(t: torch.Tensor) -> torch.Tensor:
            if torch._C._current_graph_task_id() != -1:
                start = time.perf_counter_ns()
                replayer.start(module, [x])
                if replayer.replays:
                    replayer.exit(module, args, x)
                samples.append(time.perf_counter_ns() - start - timer)
            return t.sin()

        saved = cover.state._training_state
        cover.state._training_state = _compat.load().pre_backward
        seed = torch.ones(1, requires_grad=True)
        try:
            for _ in range(rounds):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    outs = [torch.utils.checkpoint.checkpoint(body, seed, use_reentrant=False) for _ in range(calls)]
                torch.stack(outs).sum().backward()
        finally:
            cover.state._training_state = saved

    def recomputes(samples: list[float], restored: bool) -> None:
        saved = cover.state._training_state
        cover.state._training_state = _compat.load().pre_backward
        # restored: torch.utils.checkpoint's region per recompute; else none (the patch's region is the only one)
        region: Any = torch.autocast("cpu", dtype=torch.bfloat16) if restored else contextlib.nullcontext()
        def baseline() -> None:
            for _ in range(calls):
                with region:  # the checkpoint's own region: stock enters and leaves it too
                    pass

        def replays() -> None:
            for _ in range(calls):
                with region:
                    replayer.start(module, [x])
                    if replayer.replays:
                        replayer.exit(module, args, x)

        try:
            for _ in range(rounds):
                samples.append((cost(replays) - cost(baseline)) / calls)
            _replay.release_region()  # the last recompute's region (ended at the end of the backward otherwise)
        finally:
            cover.state._training_state = saved

    for path in ("ordinary", "ordinary-autocast"):
        samples: list[float] = []
        # ordinary-autocast: the record reads autocast's state (grad off: a grad-enabled pass repeated in one
        # autocast region would also drop the cast cache every time, see docs/safety.md).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=path != "ordinary"), \
                torch.set_grad_enabled(path == "ordinary"):
            def baseline() -> None:
                for _ in range(calls):
                    x.detach()  # what the loop does besides the patch's work

            def records() -> None:
                for _ in range(calls):
                    module_cover.begin(module, (x.detach(),), {})  # a fresh input each time

            for _ in range(rounds):
                samples.append((cost(records) - cost(baseline)) / calls)
        results.append({"torch": torch.__version__, "path": path, unit: statistics.median(samples)})
    results += _floors(module, x, rounds, calls, cost, unit)
    for covered, suffix in ((module, ""), (fp32_module, "-fp32-params")):
        cover = _patch._covers[id(_compat.load().state_of(covered))]
        module_cover, replayer = cover.modules[0], cover.modules[0].replayer
        with torch.autocast("cpu", dtype=torch.bfloat16):
            covered(x)  # the call the recomputes replay
        module = covered
        if counter is None:
            samples = []
            torch_checkpoint_recomputes(samples)
            results.append({"torch": torch.__version__, "path": "recompute" + suffix,
                            unit: statistics.median(samples)})
        for path, restored in (("recompute-region", True), ("recompute-entered", False)):
            samples = []
            _in_backward(lambda: recomputes(samples, restored))  # noqa: B023 - run before the next iteration
            results.append({"torch": torch.__version__, "path": path + suffix, unit: statistics.median(samples)})
    if counter is not None:
        return results
    wrapped = _hooks.eager(lambda module, args, kwargs: None)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            wrapped(module, args, {})
        samples.append((time.perf_counter_ns() - start) / calls)
    results.append({"torch": torch.__version__, "path": "disable-wrapper", "ns_per_call": statistics.median(samples)})
    return results


def _floors(module: nn.Module, x: torch.Tensor, rounds: int, calls: int, cost: Any, unit: str) -> list[dict[str, Any]]:
    """What any exact record or replay of this design costs at least: the operations the patch cannot leave
    out, done alone in the same loops as ``ordinary`` and ``recompute-region`` (``cost``: timed or counted).

    ``floor-record``: the record of a call on one tensor (a weak reference that outlives the tensor, its version
    counter, one tuple stored under its id), on a fresh ``detach()`` that is then freed; ``floor-record-autocast``:
    the same with autocast's state read through torch's getters (enabled and dtype for the device type, the
    cache flag). ``floor-replay``: what a replay reads and writes inside a backward pass, within an autocast
    region of the checkpoint's own: the graph task, the backward node and its sequence number, autocast's state,
    autocast's nesting count (up and down again), and a forward hook added to the module's hook dicts and taken
    off again (the exit hook)."""
    results = []
    store: dict[int, Any] = {}

    def baseline() -> None:
        for _ in range(calls):
            x.detach()

    def records() -> None:
        for _ in range(calls):
            t = x.detach()
            store[id(t)] = ((weakref.ref(t),), (t._version,), ((None, -1),))

    def records_autocast() -> None:
        for _ in range(calls):
            t = x.detach()
            state = ((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),), \
                torch.is_autocast_cache_enabled()
            store[id(t)] = ((weakref.ref(t),), (t._version,), ((state, -1),))

    for path, block, autocast in (("floor-record", records, False), ("floor-record-autocast", records_autocast,
                                                                      True)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            samples = [cost(block) - cost(baseline) for _ in range(rounds)]
        results.append({"torch": torch.__version__, "path": path, unit: statistics.median(samples) / calls})
    hooks, always_called = module._forward_hooks, module._forward_hooks_always_called
    exit_hook = _hooks.eager(lambda module, args, output: None)
    key = -1  # a key no registration uses
    replay_samples: list[float] = []

    def replays() -> None:
        region = torch.autocast("cpu", dtype=torch.bfloat16)

        def baseline() -> None:
            for _ in range(calls):
                with region:
                    pass

        def reads() -> None:
            for _ in range(calls):
                with region:
                    torch._C._current_graph_task_id()
                    node = torch._C._current_autograd_node()
                    node._sequence_nr()
                    ((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),), \
                        torch.is_autocast_cache_enabled()
                    torch.autocast_increment_nesting()
                    torch.autocast_decrement_nesting()
                    hooks[key] = exit_hook
                    always_called[key] = True
                    hooks.pop(key)
                    always_called.pop(key)

        for _ in range(rounds):
            replay_samples.append((cost(reads) - cost(baseline)) / calls)

    _in_backward(replays)
    results.append({"torch": torch.__version__, "path": "floor-replay", unit: statistics.median(replay_samples)})
    return results


def main(argv: list[str] | None = None) -> int:
    """Measure and print (or write) the overhead table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, help="rounds (default: 200 timed, 4 counted)")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind's callgrind instead of timing")
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.instructions and not instructions.relaunched():
        return instructions.relaunch(os.path.abspath(__file__), sys.argv[1:] if argv is None else argv)
    rounds = args.rounds or (4 if args.instructions else 200)
    rounds, calls = (1 if args.instructions else 3, 5) if args.smoke else (rounds, args.calls)
    logging.getLogger("fsdp_autocast_fix").setLevel(logging.ERROR)  # the direct calls replay one input on purpose
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    fsdp = _compat.fsdp_package()
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    unsharded, module = nn.Linear(8, 8), nn.Linear(8, 8)
    fsdp.fully_shard(module, mp_policy=policy)
    x = torch.randn(2, 8)
    counter = instructions.Counter() if args.instructions else None
    unit = "instructions" if args.instructions else "ns"  # the rows' keys: *_ns timed, *_instructions counted
    results: list[dict[str, Any]] = []
    for autocast in ("off", "bf16"):
        for grad in ("off", "on"):
            with torch.set_grad_enabled(grad == "on"), torch.autocast("cpu", dtype=torch.bfloat16,
                                                                      enabled=autocast == "bf16"):
                _paired(module, unsharded, x, 2, calls)  # warm-up
                if counter is not None:
                    counter.start()  # once the first row's warm-up is done; a no-op after
                    m = _counted(module, unsharded, x, rounds, calls, counter)
                else:
                    m = _paired(module, unsharded, x, rounds, calls)
            fsdp_hook = m["stock"] - m["unsharded"]
            results.append({"torch": torch.__version__, "grad": grad, "autocast": autocast,
                            f"unsharded_{unit}": m["unsharded"], f"stock_{unit}": m["stock"],
                            f"patched_{unit}": m["patched"], f"fsdp_hook_{unit}": fsdp_hook,
                            f"added_{unit}": m["added"], "added_over_fsdp_hook": m["added"] / fsdp_hook,
                            "ratio": m["patched"] / m["stock"]})
            if counter is not None:
                results[-1].update({"prebuilt_instructions": m["prebuilt"], "own_instructions": m["own"],
                                    "own_over_fsdp_hook": m["own"] / fsdp_hook, "rounds": rounds, "calls": calls})
    covered = fsdp_autocast_fix.patched_fully_shard(nn.Linear(8, 8), mp_policy=policy)
    fp32_covered = fsdp_autocast_fix.patched_fully_shard(nn.Linear(8, 8), mp_policy=fsdp.MixedPrecisionPolicy())
    direct = _hooks_directly(covered, fp32_covered, rounds, calls, counter)
    direct_unit = "instructions_per_call" if counter is not None else "ns_per_call"
    fsdp_hook = statistics.mean(r[f"fsdp_hook_{unit}"] for r in results)
    for r in direct:
        r["over_fsdp_hook"] = r[direct_unit] / fsdp_hook
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results + direct, f, indent=1)
    if counter is not None:
        print("| autocast | grad | unsharded | stock | stock, prebuilt wrapper | patched | FSDP hooks "
              "| added (patched - stock) | added / FSDP hooks | the patch's own (patched - prebuilt) "
              "| own / FSDP hooks |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['autocast']} | {r['grad']} | {r['unsharded_instructions']:.0f} | "
                  f"{r['stock_instructions']:.0f} | {r['prebuilt_instructions']:.0f} | "
                  f"{r['patched_instructions']:.0f} | {r['fsdp_hook_instructions']:.0f} | "
                  f"{r['added_instructions']:.0f} | {r['added_over_fsdp_hook']:.2%} | {r['own_instructions']:.0f} | "
                  f"{r['own_over_fsdp_hook']:.2%} |")
    else:
        print("| autocast | grad | unsharded ns | stock ns | patched ns | FSDP hooks ns | added ns (paired median) "
              "| added / FSDP hooks |")
        print("|---|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['autocast']} | {r['grad']} | {r['unsharded_ns']:.0f} | {r['stock_ns']:.0f} | "
                  f"{r['patched_ns']:.0f} | {r['fsdp_hook_ns']:.0f} | {r['added_ns']:.0f} | "
                  f"{r['added_over_fsdp_hook']:.2%} |")
    print()
    per_call, of = ("instructions per call", "instructions") if counter is not None else ("ns per call", "time")
    print(f"| the patch's own work, called directly | {per_call} | of FSDP2's hook {of} ({fsdp_hook:.0f}) |")
    print("|---|---|---|")
    for r in direct:
        print(f"| {r['path']} | {r[direct_unit]:.0f} | {r['over_fsdp_hook']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
