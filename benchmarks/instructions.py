"""Instructions executed by a block of code, counted by valgrind's callgrind: exact where a timer is noisy.

A ratio of two step times measured on a shared machine spreads by several percent from round to round; the
instructions a step executes are the same in every run of the same program on the same input, so ratios of
them resolve differences far below that (the cost growth's 2 % target, ``benchmarks/scaling.py``). They are
a proxy for time, not time: they weigh a cache miss as one instruction.

:func:`relaunch` runs a script again under callgrind, with instrumentation off (fast) until the script calls
:meth:`Counter.start` and collection off except inside :meth:`Counter.count`. Each count is one dump of
callgrind's counters, read back from its file. The toggles are valgrind's client requests, from a small C
library built here with the system's C compiler against valgrind's header (``valgrind/callgrind.h``).

    from instructions import Counter, relaunch
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

#: Set in the relaunched process: the toggle library's path, and where callgrind writes its dumps.
LIBRARY_ENV, DUMPS_ENV = "INSTRUCTIONS_TOGGLE_LIBRARY", "INSTRUCTIONS_DUMPS"

_SOURCE = r"""
#include <valgrind/callgrind.h>
void start_instrumentation(void) { CALLGRIND_START_INSTRUMENTATION; }
void toggle_collect(void) { CALLGRIND_TOGGLE_COLLECT; }
void zero_stats(void) { CALLGRIND_ZERO_STATS; }
void dump_stats(void) { CALLGRIND_DUMP_STATS; }
int running_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
"""


def _build(directory: str) -> str:
    """The toggle library, compiled into ``directory``; a clear error where the tools are missing."""
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"counting instructions needs {' and '.join(missing)} (valgrind's callgrind and a C "
                           "compiler with valgrind's headers)")
    source, library = os.path.join(directory, "toggle.c"), os.path.join(directory, "libtoggle.so")
    with open(source, "w") as f:
        f.write(_SOURCE)
    built = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"could not build the callgrind toggle library (valgrind's headers missing?):\n"
                           f"{built.stderr}")
    return library


def relaunched() -> bool:
    """Whether this process is the one :func:`relaunch` started (it then counts with a :class:`Counter`)."""
    return LIBRARY_ENV in os.environ


def relaunch(script: str, args: list[str]) -> int:
    """Run ``script`` with ``args`` again in this Python under callgrind (see the module docstring), hash seed
    fixed so that every run executes alike; its exit status."""
    with tempfile.TemporaryDirectory() as directory:
        env = dict(os.environ, PYTHONHASHSEED="0", **{LIBRARY_ENV: _build(directory), DUMPS_ENV: directory})
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                   f"--callgrind-out-file={os.path.join(directory, 'dump.%p')}",
                   f"--log-file={os.path.join(directory, 'valgrind.log')}", sys.executable, "-W", "ignore",
                   script, *args]
        return subprocess.run(command, env=env).returncode


class Counter:
    """Counts in the relaunched process: :meth:`start` once the untimed warm-up is done, then :meth:`count`.

    Invariant: :meth:`count` returns the instructions executed by ``block()`` on every thread (callgrind
    serialises them), and nothing else: collection is on exactly while it runs, and each count reads a dump of
    counters zeroed right before it. Each block starts right after a full garbage collection (uncounted), so the
    collections a block triggers are its own, and a count repeats from run to run within a few tenths of a
    percent (addresses, and so the order of dicts keyed by them, still differ)."""

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
        """The instructions ``block()`` executes."""
        gc.collect()
        self._lib.zero_stats()
        self._lib.toggle_collect()
        try:
            block()
        finally:
            self._lib.toggle_collect()
            self._lib.dump_stats()
        self._dumps += 1
        with open(f"{self._prefix}.{self._dumps}") as f:
            for line in f:
                if line.startswith("totals:") or line.startswith("summary:"):
                    return int(line.split()[1])
        raise RuntimeError(f"no totals in callgrind's dump {self._prefix}.{self._dumps}")
