"""A gloo process group for a rank spawned by ``torch.multiprocessing.spawn`` (or launched by ``torchrun``), torn
down in step.

Invariant: no rank closes its connections while a peer may still be inside a collective, and what holds the
group (sharded modules, pending work) is freed before the interpreter finalizes. Gloo's shutdown is racy when
one rank destroys its context as a peer finishes (pytorch/gloo issue 155), and work objects that outlive the
interpreter abort it at exit; either way a rank that did its job exits on SIGABRT ("terminate called without
an active exception"), which fails the spawning test for a reason that is not the test's.
"""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def spawned_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """Init a gloo group on 127.0.0.1:``port``; on a clean exit, a barrier (every rank is past its last
    collective), then free what holds the group, then destroy it. On an exception only destroy: a barrier
    could wait for a rank that already failed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ok = False
    try:
        yield
        ok = True
    finally:
        tear_down(ok)


def tear_down(clean: bool = True) -> None:
    """End this rank's group in step: where the rank got here cleanly, a barrier (every rank is past its last
    collective); then free what holds the group, then destroy it."""
    if clean:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
