"""The examples run as documented, ``torchrun --nproc-per-node 2 examples/<name>.py``, on CPU.

``hf_training.py`` needs transformers and runs in ``test_transformers.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 examples/<name>`` with this checkout importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("FSDP_AUTOCAST_FIX", None)
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", os.path.join(ROOT, "examples", name)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.parametrize("name,expect", [
    ("seed_fixed.py", "input gradients of FSDP1 and fully_shard bitwise equal: True"),
    ("torchtitan_style.py", "bitwise equal without checkpointing: True"),
])
def test_example(name: str, expect: str) -> None:
    proc = run_example(name)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count(expect) == 2, proc.stdout  # both ranks
