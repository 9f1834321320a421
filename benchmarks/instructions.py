"""Instructions executed by a block of code, counted by valgrind's callgrind: exact where a timer is noisy.

A ratio of two step times measured on a shared machine spreads by several percent from round to round; the
instructions a step executes are the same in every run of the same program on the same input, so ratios of
them resolve differences far below that (the cost growth's 2 % target, ``benchmarks/scaling.py``). They are
a proxy for time, not time: they weigh a cache miss as one instruction.

:func:`relaunch` runs a script again under callgrind, with instrumentation off (fast) until the script calls
:meth:`Counter.start`. From there callgrind counts every thread (gloo's collectives run on threads of its
own), and each :meth:`Counter.count` zeroes the counters of all threads, runs its block and dumps them, read
back from the dump's file. The zeroing and dumping are valgrind's client requests, from a small C library built
here with the system's C compiler against valgrind's header (``valgrind/callgrind.h``).

    from instructions import Counter, relaunch
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

#: Set in the relaunched process: the client-request library's path, and where callgrind writes its dumps.
LIBRARY_ENV, DUMPS_ENV = "INSTRUCTIONS_REQUESTS_LIBRARY", "INSTRUCTIONS_DUMPS"

_SOURCE = r"""
#include <valgrind/callgrind.h>
void start_instrumentation(void) { CALLGRIND_START_INSTRUMENTATION; }
void zero_stats(void) { CALLGRIND_ZERO_STATS; }
void dump_stats(void) { CALLGRIND_DUMP_STATS; }
int running_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""


def _build(directory: str) -> str:
    """The client-request library, compiled into ``directory``; a clear error where the tools are missing."""
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"counting instructions needs {' and '.join(missing)} (valgrind's callgrind and a C "
                           "compiler with valgrind's headers)")
    source, library = os.path.join(directory, "requests.c"), os.path.join(directory, "librequests.so")
    with open(source, "w") as f:
        f.write(_SOURCE)
    built = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"could not build the callgrind client-request library (valgrind's headers missing?):\n"
                           f"{built.stderr}")
    return library


def relaunched() -> bool:
    """Whether this process is the one :func:`relaunch` started (it then counts with a :class:`Counter`)."""
    return LIBRARY_ENV in os.environ


def relaunch(script: str, args: list[str], children: bool = False) -> int:
    """Run ``script`` with ``args`` again in this Python under callgrind (see the module docstring), hash seed
    fixed so that every run executes alike; its exit status (callgrind's log is printed where it fails).
    ``children``: the processes it starts run under callgrind too (spawned ranks, each counting its own).

    Callgrind's options are all set here (``VALGRIND_OPTS`` is dropped): one dump file per dump and process,
    every thread's counts summed in it, as :meth:`Counter.count` reads them."""
    with tempfile.TemporaryDirectory() as directory:
        env = {k: v for k, v in os.environ.items() if k != "VALGRIND_OPTS"}
        env.update(PYTHONHASHSEED="0", **{LIBRARY_ENV: _build(directory), DUMPS_ENV: directory})
        log = os.path.join(directory, "valgrind.log")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=yes",
                   "--separate-threads=no", "--combine-dumps=no",
                   f"--trace-children={'yes' if children else 'no'}",
                   f"--callgrind-out-file={os.path.join(directory, 'dump.%p')}", f"--log-file={log}",
                   sys.executable, "-W", "ignore", script, *args]
        status = subprocess.run(command, env=env).returncode
        if status and os.path.exists(log):
            with open(log) as f:
                print("callgrind's log:\n" + "".join(f.readlines()[-40:]), file=sys.stderr)
        return status


class Counter:
    """Counts in the relaunched process: :meth:`start` once the untimed warm-up is done, then :meth:`count`.

    Invariant: :meth:`count` returns the instructions executed on every thread from right before ``block()`` to
    right after it: the block's, what other threads do meanwhile (the collectives it waits for), and a constant
    of about 2,000 for the count's own calls into the library, which cancels in every difference and ratio.
    Each count reads the dump of counters zeroed right before it, checked by its part number. Each block starts
    right after a full garbage collection (uncounted), so the collections a block triggers are its own, and a
    count repeats from run to run within a few tenths of a percent (addresses, and so the order of dicts keyed
    by them, still differ)."""

    def __init__(self) -> None:
        if not relaunched():
            raise RuntimeError("Counter is for a process started by instructions.relaunch()")
        self._lib = ctypes.CDLL(os.environ[LIBRARY_ENV])
        if not self._lib.running_on_valgrind():
            raise RuntimeError("not running under valgrind")
        self._prefix = os.path.join(os.environ[DUMPS_ENV], f"dump.{os.getpid()}")
        self._dumps = 0

    def start(self) -> None:
        """Turn instrumentation on (everything runs many times slower from here)."""
        self._lib.start_instrumentation()

    def count(self, block: Callable[[], object]) -> int:
        """The instructions ``block()`` executes (see the class docstring); a block that raises is not counted."""
        gc.collect()
        self._lib.zero_stats()
        try:
            block()
        finally:
            self._lib.dump_stats()
            self._dumps += 1
        path = f"{self._prefix}.{self._dumps}"
        with open(path, "rb") as f:  # one read, few objects: what a count leaves on the heap shifts the next
            dump = f.read()
        os.remove(path)
        found = dict(re.findall(rb"^(part|summary|totals): (\d+)", dump, re.M))
        del dump
        part = int(found[b"part"]) if b"part" in found else None
        total = int(found.get(b"summary") or found[b"totals"]) if found.keys() & {b"summary", b"totals"} else None
        if part != self._dumps or total is None:
            raise RuntimeError(f"callgrind's dump {path} is part {part} with totals {total}; expected part "
                               f"{self._dumps} with totals")
        return total
