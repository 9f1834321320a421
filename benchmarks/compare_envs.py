"""(a) patched on a buggy torch against (e) the upstream fix, measured alternately in one run.

Runs ``benchmarks/step.py`` variant ``a`` with one interpreter (torch 2.12.1 + this package) and variant
``e`` with another (torch 2.13.0, stock), alternating A, E, A, E ... for ``--rounds`` rounds, and reports
the ratios of the pooled medians. JSON keys: ``rounds``, ``a`` and ``e`` (the per-round result objects of
``step.py``), ``step_ratio_a_over_e``, ``rss_increase_ratio_a_over_e`` (None if (e) had none; peak RSS
increase during the steps: the two torch builds differ in library size, so absolute RSS is not
comparable; it is reported as ``peak_rss_mib``), ``all_gathers`` and ``reduce_scatters`` (per step, a and e).

    python benchmarks/compare_envs.py --a-python .nox/tests-2-12-1/bin/python \\
        --e-python .nox/tests-2-13-0/bin/python [--rounds 3] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(python: str, variant: str, smoke: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [python, "-W", "ignore", os.path.join(HERE, "step.py"), "--variants", variant, "--json", out]
        subprocess.run(cmd + (["--smoke"] if smoke else []), check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)[0]


def _fmt(ratio: float | None) -> str:
    return "n/a (no increase in (e))" if ratio is None else f"{ratio:.3f}"


def main(argv: list[str] | None = None) -> int:
    """Alternate the two environments and print the ratios."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--a-python", required=True)
    parser.add_argument("--e-python", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "e": []}
    for _ in range(args.rounds):
        runs["a"].append(_run(args.a_python, "a", args.smoke))
        runs["e"].append(_run(args.e_python, "e", args.smoke))
    for variant, results in runs.items():
        failed = [r["error"] for r in results if not r["ok"]]
        if failed:
            print(f"variant {variant} failed: {failed[0]}", file=sys.stderr)
            return 1
    step = {v: statistics.median(t for r in rs for t in r["step_ms_all"]) for v, rs in runs.items()}
    rss = {v: statistics.median(r["peak_rss_mib"] for r in rs) for v, rs in runs.items()}
    rss_increase = {v: statistics.median(r["peak_rss_increase_mib"] for r in rs) for v, rs in runs.items()}
    summary = {
        "rounds": args.rounds,
        "torch": {v: rs[0]["torch"] for v, rs in runs.items()},
        "step_ms": step,
        "peak_rss_mib": rss,
        "step_ratio_a_over_e": step["a"] / step["e"],
        "peak_rss_increase_mib": rss_increase,
        "rss_increase_ratio_a_over_e": rss_increase["a"] / rss_increase["e"] if rss_increase["e"] > 0 else None,
        "all_gathers": {v: rs[0]["all_gathers_per_step"] for v, rs in runs.items()},
        "reduce_scatters": {v: rs[0]["reduce_scatters_per_step"] for v, rs in runs.items()},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary, a=runs["a"], e=runs["e"]), f, indent=1)
    print("| | (a) patched | (e) upstream fix | (a)/(e) |\n|---|---|---|---|")
    print(f"| torch | {summary['torch']['a']} | {summary['torch']['e']} | |")
    print(f"| step ms (median, {args.rounds} rounds alternated) | {step['a']:.1f} | {step['e']:.1f} | "
          f"{summary['step_ratio_a_over_e']:.3f} |")
    print(f"| peak RSS MiB (different torch builds) | {rss['a']:.0f} | {rss['e']:.0f} | |")
    print(f"| peak RSS increase during the steps, MiB | {rss_increase['a']:.1f} | {rss_increase['e']:.1f} | "
          f"{_fmt(summary['rss_increase_ratio_a_over_e'])} |")
    print(f"| all-gathers / reduce-scatters per step | {summary['all_gathers']['a']} / "
          f"{summary['reduce_scatters']['a']} | {summary['all_gathers']['e']} / {summary['reduce_scatters']['e']} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
