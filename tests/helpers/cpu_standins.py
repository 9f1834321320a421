"""Test-only stand-ins that let torch 2.4-2.6's FSDP2 run on CPU, as 2.7+ runs itself there.

FSDP2 before torch 2.7 runs only on CUDA, and in exactly two ways that matter here:

1. **Streams and events.** It overlaps communication with compute on CUDA streams and orders them with CUDA
   events (``FSDPCommContext.lazy_init`` makes the streams: 2.4 calls ``torch.cuda.Stream`` outright, 2.5 first
   refuses without CUDA, "FSDP requires CUDA for streams"; 2.6 asks the device handle, and ``torch.cpu.Stream``
   there lacks ``record_event`` and ``wait_event``). On CPU every op runs in order on the calling thread, so
   there is nothing to overlap and nothing to wait for: streams and events that do nothing are exact. They are
   what torch 2.7 runs FSDP2 on CPU with (``torch.cpu.Stream``, ``Event``, ``current_stream``, ``stream`` of
   2.7; :class:`Stream` adds ``record_event`` returning an event instead of ``None``, which 2.4-2.6 use).
   They are put in place of ``torch.cuda``'s only inside FSDP2's own modules (a ``torch`` seen there whose
   ``cuda`` has them, and, on 2.6, a device handle for ``"cpu"`` that has them); nothing else in the process
   sees them, and ``torch.cuda.is_available()`` stays false everywhere but in 2.5's one check in
   ``FSDPCommContext.lazy_init``.
2. **The all-gather copy-out keeps the unsharded parameters' version counters.** FSDP2 reuses one all-gather
   output buffer per parameter and writes it in place at every unshard; the unsharded parameters are views of
   it, saved by autograd. CUDA's ``torch.split_with_sizes_copy(..., out=...)`` fast path does not bump the
   version counters of ``out`` (pytorch issue 132014), and FSDP2 relies on that: saved parameters are not
   "modified by an inplace operation" when the backward unshards again. The CPU kernel bumps them. torch 2.7+
   makes the CUDA behaviour explicit on every device (``foreach_all_gather_copy_out`` runs the copy under
   ``torch.autograd._unsafe_preserve_version_counter``); the stand-in does the same around 2.4-2.6's copy-out.

3. **Gradient averaging.** FSDP2 reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG`` (and all-reduces
   them so across replicas for HSDP), NCCL's built-in average. gloo in these releases does not average:
   ``reduce_scatter_tensor`` sums silently, and ``all_reduce`` refuses ("Cannot use ReduceOp.AVG with Gloo").
   Inside FSDP2's collectives module, the stand-in runs them with ``ReduceOp.SUM`` and divides by the group's
   size, as NCCL's average does (for the power-of-two groups the tests use, the very same bits).

Nothing here is active unless :func:`install` is called: tests/conftest.py calls it on torch < 2.7 without
CUDA, and sets ``FSDP_AUTOCAST_FIX_TEST_CPU_STANDINS=1`` with tests/helpers/standins_site on ``PYTHONPATH`` so that
the interpreters the tests start (torchrun, spawned ranks, fresh interpreters) install them too, when FSDP2 is
imported. Faithfulness is tested in tests/test_cpu_standins.py: plain training steps come out bitwise equal to
the unsharded model and FSDP1, on 1 and 2 ranks; the seed report's pattern fails stock as the report says.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import types
from collections.abc import Iterator
from typing import Any

import torch

ENV_VAR = "FSDP_AUTOCAST_FIX_TEST_CPU_STANDINS"
#: FSDP2's modules, by torch release: 2.6 moved them (the old path re-exports).
_PACKAGES = ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")
_MODULES = ("_fsdp_param_group", "_fsdp_collectives", "_fsdp_state", "_fsdp_param")
_installed: list[str] = []


def needed() -> bool:
    """Whether this torch needs the stand-ins to run FSDP2 here: torch 2.4-2.6 without CUDA."""
    base = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
    return (2, 4) <= base < (2, 7) and not torch.cuda.is_available()


class Event:
    """A CUDA event where every op runs in order: recorded, waited on and queried, it has nothing to wait for."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Stream:
    """A CUDA stream where every op runs in order on the calling thread: waiting on it waits for nothing."""

    def __init__(self, priority: int = -1, **kwargs: Any) -> None:
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Event | None = None) -> Event:
        return event if event is not None else Event()

    def synchronize(self) -> None:
        return None


_DEFAULT_STREAM = Stream()


@contextlib.contextmanager
def _stream(stream: Any) -> Iterator[None]:
    yield


def _namespace(base: Any, **overrides: Any) -> types.SimpleNamespace:
    """``base``'s attributes, looked up when asked, except ``overrides``."""

    class Namespace(types.SimpleNamespace):
        def __getattr__(self, name: str) -> Any:
            return getattr(base, name)

    return Namespace(**overrides)


def _cuda_standins(**extra: Any) -> types.SimpleNamespace:
    return _namespace(torch.cuda, Stream=Stream, Event=Event, current_stream=lambda device=None: _DEFAULT_STREAM,
                      stream=_stream, **extra)


def _device_handle(original: Any) -> Any:
    """2.6's ``_get_device_handle``, with stream and event stand-ins for ``"cpu"``."""
    cpu = _namespace(torch.cpu, Stream=Stream, Event=Event, current_stream=lambda device=None: _DEFAULT_STREAM,
                     stream=_stream)

    @functools.wraps(original)
    def get(device_type: str = "cuda") -> Any:
        return cpu if device_type == "cpu" else original(device_type)

    return get


def _averaging(name: str) -> Any:
    """``dist.<name>`` (``reduce_scatter_tensor`` or ``all_reduce``, looked up at each call, so that what patches
    ``torch.distributed`` still sees it) with ``ReduceOp.AVG`` on a gloo group done as NCCL does it: a sum,
    divided by the group's size."""
    import torch.distributed as dist

    def run(*args: Any, **kwargs: Any) -> Any:
        collective = getattr(dist, name)
        op = kwargs.get("op")
        group = kwargs.get("group")
        if op != dist.ReduceOp.AVG or dist.get_backend(group) != "gloo":
            return collective(*args, **kwargs)
        if kwargs.get("async_op"):
            raise RuntimeError("the averaging stand-in runs synchronous collectives only")
        kwargs["op"] = dist.ReduceOp.SUM
        work = collective(*args, **kwargs)
        out = kwargs.get("output" if name == "reduce_scatter_tensor" else "tensor", args[0] if args else None)
        out.div_(dist.get_world_size(group))
        return work

    return run


def _preserving_copy_out(copy_out: Any) -> Any:
    """The all-gather copy-out, leaving the version counters of the buffers it writes as they were before (a
    buffer it first makes starts at 0), as CUDA's copy and torch 2.7+'s copy-out do (see the module docstring)."""

    @functools.wraps(copy_out)
    def preserving(all_gather_result: Any, fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
        before = {id(t): t._version for p in fsdp_params for t in getattr(p, "all_gather_outputs", ())}
        try:
            return copy_out(all_gather_result, fsdp_params, *args, **kwargs)
        finally:
            for p in fsdp_params:
                for t in getattr(p, "all_gather_outputs", ()):
                    if not t.is_inference():  # torch 2.7 leaves inference tensors alone too
                        torch._C._autograd._unsafe_set_version_counter(t, before.get(id(t), 0))

    return preserving


def _package() -> str:
    for name in _PACKAGES:
        try:
            importlib.import_module(f"{name}._fsdp_param_group")
        except ImportError:
            continue
        return name
    raise ImportError(f"no FSDP2 package in {_PACKAGES}")


def install() -> list[str]:
    """Put the stand-ins in place in FSDP2's modules (idempotent); return what was replaced, for the record.

    Raises:
        RuntimeError: this torch does not need them (2.7+, or CUDA present), or its FSDP2 is not the one the
            stand-ins were written against.
    """
    if _installed:
        return list(_installed)
    if not needed():
        raise RuntimeError(f"torch {torch.__version__} runs FSDP2 here without stand-ins")
    package = _package()
    modules = {name: importlib.import_module(f"{package}.{name}") for name in _MODULES}
    group = modules["_fsdp_param_group"]
    if not hasattr(group, "foreach_all_gather_copy_out") or not hasattr(group, "FSDPCommContext"):
        raise RuntimeError(f"torch {torch.__version__}: FSDP2's param group module is not the expected one")
    for name, module in modules.items():
        if getattr(module, "torch", None) is torch:
            # 2.5's FSDPCommContext.lazy_init refuses without CUDA: in that module, CUDA is "available" for streams.
            extra = {"is_available": lambda: True} if name == "_fsdp_param_group" else {}
            module.torch = _namespace(torch, cuda=_cuda_standins(**extra))
            _installed.append(f"{module.__name__}.torch.cuda: Stream, Event, current_stream, stream")
        if hasattr(module, "_get_device_handle"):  # 2.6: the device handle for "cpu"
            module._get_device_handle = _device_handle(module._get_device_handle)
            _installed.append(f"{module.__name__}._get_device_handle('cpu')")
    group.foreach_all_gather_copy_out = _preserving_copy_out(group.foreach_all_gather_copy_out)
    _installed.append(f"{group.__name__}.foreach_all_gather_copy_out: version counters kept")
    collectives = modules["_fsdp_collectives"]
    real = collectives.dist
    collectives.dist = _namespace(real, reduce_scatter_tensor=_averaging("reduce_scatter_tensor"),
                                  all_reduce=_averaging("all_reduce"))
    _installed.append(f"{collectives.__name__}.dist: reduce_scatter_tensor, all_reduce with ReduceOp.AVG on gloo")
    return list(_installed)

