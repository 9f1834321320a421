"""Training parity on 2 spawned gloo ranks: 20 AdamW steps with per-layer checkpointing and the patch give
bitwise the losses and final parameters of the same training without checkpointing.

Uses ``benchmarks/step.py`` (a transformer-like stack, autocast bf16, param bf16 / reduce fp32); each layer
returns fp32 (``output_dtype``), so every checkpointed layer's input needs FSDP's cast.
"""

from __future__ import annotations

import os
import sys

import pytest

from fsdp_autocast_fix import _compat

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import step  # noqa: E402

CFG = {"layers": 2, "hidden": 32, "heads": 2, "seq": 16, "batch": 2, "warmup": 0, "steps": 20, "output_fp32": True}


@pytest.fixture(scope="module")
def no_checkpoint() -> dict:
    result = step.run_variant("d", CFG)
    assert result["ok"], result["error"]
    return result


def test_patched_training_is_bitwise_equal(no_checkpoint: dict) -> None:
    patched = step.run_variant("a", CFG)
    assert patched["ok"], patched["error"]
    assert len(patched["losses"]) == 20
    assert patched["losses"] == no_checkpoint["losses"]
    assert patched["params_sha256"] == no_checkpoint["params_sha256"]


def test_stock_training_positive_control(no_checkpoint: dict) -> None:
    stock = step.run_variant("e", CFG)
    if _compat.load().needs_cast_replay:
        assert not stock["ok"] or stock["losses"] != no_checkpoint["losses"], "stock should fail on this torch"
    else:
        assert stock["ok"] and stock["losses"] == no_checkpoint["losses"]
        assert stock["params_sha256"] == no_checkpoint["params_sha256"]
