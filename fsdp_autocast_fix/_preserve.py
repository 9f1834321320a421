"""``preserve_autocast``: a checkpoint made to run its function under the autocast state of its call site.

What it promises users is in :func:`preserve_autocast`'s docstring. Inside, the function's calls follow the cast
cache policy of :mod:`._cache`, and in the recompute the covered modules it calls keep the state it runs under
(:func:`~._replay.restored`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import _autocast, _cache, _compat
from ._replay import restored


def preserve_autocast(checkpoint_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``checkpoint_fn`` made to run the checkpointed function under the autocast state of its call site.

    For any checkpoint called as ``checkpoint_fn(function, *args, **kwargs)``: ``torch.utils.checkpoint.checkpoint``
    (either mode), DeepSpeed's ``checkpoint`` and ``non_reentrant_checkpoint``, or a hand-written
    ``autograd.Function``. The result has the same signature, arguments, return value and errors; ``function`` runs
    under the autocast state (per device type, and the cache flag) current when the checkpoint was called, in the
    forward and in the recompute. A recompute whose forward ran under ``no_grad`` first drops autocast's cached
    casts, which would cut it off from the parameters.

    Use it where :func:`fsdp_autocast_fix.apply` cannot help: a checkpoint whose region does not start at a sharded
    module's call (a sharded block whose ``forward`` checkpoints part of itself) re-runs no sharded call at the
    start of its recompute.

    Raises:
        TypeError: ``checkpoint_fn`` is not callable (or, when called, ``function`` is not).
    """
    if not callable(checkpoint_fn):
        raise TypeError(f"preserve_autocast expects a checkpoint function, got {type(checkpoint_fn).__name__}")
    device_types = _compat.autocast_device_types()

    @functools.wraps(checkpoint_fn)
    def checkpoint_with_autocast(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not callable(function):
            raise TypeError(f"the checkpointed function must be callable, got {type(function).__name__}")
        call_site = _autocast.capture(device_types)

        @functools.wraps(function)
        def run(*run_args: Any, **run_kwargs: Any) -> Any:
            if _autocast.capture(device_types) == call_site:
                return _checkpointed(function, run_args, run_kwargs)
            with _autocast.entered(call_site, device_types):
                return _checkpointed(function, run_args, run_kwargs)

        return checkpoint_fn(run, *args, **kwargs)

    return checkpoint_with_autocast


def _checkpointed(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a checkpointed function under the state it must see (see the module docstring)."""
    internals = _compat.load()
    if internals.any_autocast_enabled() and torch.is_autocast_cache_enabled():
        if not torch.is_grad_enabled():
            _cache.note(_cache.EVERY_STATE, -1, _compat.autocast_device_types())
        elif _cache.active:
            _cache.check(_cache.EVERY_STATE, internals.graph_task_id(), "preserve_autocast")
    if internals.graph_task_id() == -1:
        return function(*args, **kwargs)
    with restored():
        return function(*args, **kwargs)
