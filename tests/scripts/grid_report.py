"""Run cells of the scenario space (tests/helpers/grid.py) and report them: JSON per cell, markdown counts per
dimension.

    python tests/scripts/grid_report.py --sample 1200 --json grid/torch-2.12.1.json   # a seeded sample
    python tests/scripts/grid_report.py --all --json grid/torch-2.12.1.json           # the whole product (hours)
    python tests/scripts/grid_report.py --markdown grid/torch-*.json                  # docs/testing.md's tables

Each cell: the ground truth, stock (the positive control, recorded) and the three patched modes, which must
be bitwise equal to the truth; the exit status is 1 if any patched mode of any cell is not.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))

import grid as G  # noqa: E402


#: torch's own checkpoint front ends (they restore autocast themselves).
TORCH_CHECKPOINTS = ("torch", "torch_reentrant", "wrapper", "composable", "selective")


def measure(cells: list[G.Cell]) -> dict[str, Any]:
    """Run every cell in every mode; the verdicts, with torch's version and what it needs."""
    import torch

    from fsdp_autocast_fix import _compat

    results = []
    start = time.time()
    for cell in cells:
        truth = G.truth(cell)
        row: dict[str, Any] = {"cell": cell.name}
        if truth.error is not None:
            row["truth"] = f"fails ({type(truth.error).__name__}: {truth.error})"[:300]
        else:
            row.update({mode: G.run(cell, mode).verdict(truth) for mode in G.MODES})
        results.append(row)
    return {"torch": str(torch.__version__), "needs_cast_replay": _compat.load().needs_cast_replay,
            "seconds": round(time.time() - start, 1), "cells": results}


def _fixed(row: dict[str, Any]) -> bool:
    return all(row.get(mode) == "bitwise" for mode in G.PATCHED_MODES)


def markdown(reports: list[dict[str, Any]]) -> str:
    """Counts per dimension value: cells, stock broken (error or wrong gradients), patched bitwise (3 ways)."""
    out = []
    for report in reports:
        rows = [r for r in report["cells"] if "truth" not in r]
        broken = sum(r["stock"] != "bitwise" for r in rows)
        fixed = sum(_fixed(r) for r in rows)
        torch_own = [r for r in rows if r["cell"].split("-")[0] in TORCH_CHECKPOINTS and r["stock"] == "bitwise"]
        unchanged = sum(_fixed(r) for r in torch_own)
        out += [f"torch {report['torch']} (needs cast replay: {report['needs_cast_replay']}): {len(rows)} cells, "
                f"stock broken in {broken}, patched bitwise in {fixed} (apply, late apply and "
                f"patched_fully_shard each){_truth_note(report)}. Cells of torch's own checkpoints that stock gets "
                f"right: {len(torch_own)}, the same bits patched in {unchanged}.", ""]
        out += ["| dimension | value | cells | stock broken | patched bitwise |", "|---|---|---|---|---|"]
        for dimension, values in G.DIMENSIONS.items():
            index = list(G.DIMENSIONS).index(dimension)
            count: Counter[str] = Counter()
            stock: Counter[str] = Counter()
            patched: Counter[str] = Counter()
            default = G.Cell.__dataclass_fields__[dimension].default  # for a cell named before the dimension
            for r in rows:
                parts = r["cell"].split("-")
                value = parts[index] if index < len(parts) else default
                count[value] += 1
                stock[value] += r["stock"] != "bitwise"
                patched[value] += _fixed(r)
            for value in values:
                if count[value]:
                    out.append(f"| {dimension} | {value} | {count[value]} | {stock[value]} | {patched[value]} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _truth_note(report: dict[str, Any]) -> str:
    failed = [r for r in report["cells"] if "truth" in r]
    return f"; {len(failed)} cells whose ground truth itself fails were left out" if failed else ""


def failures(report: dict[str, Any]) -> list[str]:
    """Cells where a patched mode is not bitwise (or the truth fails), one line each."""
    lines = []
    for r in report["cells"]:
        if "truth" in r:
            lines.append(f"{r['cell']}: ground truth {r['truth']}")
        elif not _fixed(r):
            lines.append(f"{r['cell']}: " + ", ".join(f"{m} {r[m]}" for m in G.MODES))
    return lines


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--sample", type=int, help="this many cells, seeded, every dimension value included")
    what.add_argument("--all", action="store_true", help="every valid cell of the product")
    what.add_argument("--markdown", nargs="+", metavar="JSON", help="print the tables for these reports")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    if args.markdown:
        reports = [json.load(open(path)) for path in args.markdown]
        print(markdown(reports), end="")
        return 0

    import torch.distributed as dist
    from ranks import free_port

    warnings.simplefilter("ignore")
    logging.getLogger("fsdp_autocast_fix").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        cells = G.all_cells() if args.all else G.sample(args.sample, args.seed)
        report = measure(cells)
    finally:
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=0)
    print(markdown([report]), end="")
    bad = failures(report)
    for line in bad:
        print("NOT FIXED:", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
