"""A fixed, seeded sample of the generated scenario space (tests/helpers/grid.py), every cell compared bitwise.

``FSDP_AUTOCAST_FIX_GRID`` sets the sample size (default 400 cells; the named cells and every value of every
dimension are in it) and ``FSDP_AUTOCAST_FIX_GRID_SEED`` the seed of the rest (default 0: the nox sessions give
each torch its own, so that together they cover more of the space). ``python3 -m nox -s grid`` runs larger
samples through ``tests/scripts/grid_report.py`` instead.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict

import grid as G
import pytest

from fsdp_autocast_fix import _compat

pytestmark = pytest.mark.usefixtures("pg")

SAMPLE = G.sample(int(os.environ.get("FSDP_AUTOCAST_FIX_GRID", "400")),
                  int(os.environ.get("FSDP_AUTOCAST_FIX_GRID_SEED", "0")))
#: Front ends through which stock torch recomputes a sampled cell wrongly on every torch (lost autocast,
#: the weight-cast cache), and, where torch skips FSDP's casts, also those that recompute in PRE_BACKWARD.
ALWAYS_BROKEN_SOMEWHERE = ("none", "torch_reentrant", "fn_no_restore", "fn_disable")
BROKEN_WHERE_CASTS_SKIPPED = ("torch", "wrapper", "selective")


@functools.lru_cache(maxsize=None)
def _truth(cell: G.Cell) -> G.Result:
    return G.truth(cell)


@functools.lru_cache(maxsize=None)
def _stock(cell: G.Cell) -> str:
    """Stock's verdict in ``cell``: the recorded positive control."""
    return G.run(cell, "stock").verdict(_truth(cell))


@pytest.mark.parametrize("cell", SAMPLE, ids=[c.name for c in SAMPLE])
def test_cell(cell: G.Cell) -> None:
    truth = _truth(cell)
    assert truth.error is None, f"the ground truth itself fails: {truth.error!r}"
    _stock(cell)
    for mode in G.PATCHED_MODES:
        assert G.run(cell, mode).verdict(truth) == "bitwise", mode


#: Cells of the sample whose truth is checked against the other references (each costs two or three runs).
REFERENCE_CHECKS = 40


def test_the_truth_is_fsdp1s_and_fsdp2s_without_the_cache_where_no_cast_is_shared() -> None:
    """Where autocast's cache gives no two uses of a parameter one cast, the truth equals FSDP2 without the cache
    and, for fp32 parameters, FSDP1 (whose parameters autocast never caches: FSDP1 hands modules views). Where
    it does (:meth:`grid.Cell.shares_a_cast`), the cache itself changes the bits, which the truth keeps: see
    ``test_the_cache_changes_the_bits_where_a_cast_is_shared``."""
    checked = 0
    for cell in SAMPLE[:REFERENCE_CHECKS]:
        if cell.shares_a_cast():
            continue
        truth = _truth(cell)
        reference = G.dataclasses.replace(cell, frontend="none")
        assert G.run(reference, "stock", cache=False, reference=True).verdict(truth) == "bitwise", cell.name
        if cell.precision == "fp32_params":
            assert G.run(reference, "stock", sharding="fsdp1").verdict(truth) == "bitwise", cell.name
        checked += 1
    assert checked >= REFERENCE_CHECKS // 2


def test_the_cache_changes_the_bits_where_a_cast_is_shared() -> None:
    """A block applied twice in one autocast region: one cast of its weight serves both uses, so the weight's
    gradient is summed in bf16 before the cast's backward; without the cache, in fp32 after two casts. The
    unsharded model shows it (no FSDP at all), and the truth keeps the cache's bits."""
    cell = G.NAMED["block_twice_no_checkpoint"][0]
    assert cell.shares_a_cast()
    plain = G.run(cell, "stock", sharding="none", reference=True)
    assert G.run(cell, "stock", sharding="none", cache=False, reference=True).verdict(plain) == "wrong gradients"
    assert _truth(cell).verdict(plain) == "bitwise"


def test_positive_controls_in_the_sample() -> None:
    """The sample exercises real failures: stock is broken through each front end that can break it."""
    broken: dict[str, int] = defaultdict(int)
    for cell in SAMPLE:
        broken[cell.frontend] += _stock(cell) != "bitwise"
    expected = ALWAYS_BROKEN_SOMEWHERE + (BROKEN_WHERE_CASTS_SKIPPED if _compat.load().needs_cast_replay else ())
    expected = tuple(f for f in expected if any(c.frontend == f for c in SAMPLE))  # front ends this torch has
    missing = [f for f in expected if not broken[f]]
    assert not missing, f"no sampled cell breaks stock through {missing}: {dict(broken)}"
    assert sum(broken.values()) >= len(SAMPLE) // 10, dict(broken)
