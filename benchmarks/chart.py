"""PNG chart of the latest benchmark results (``benchmarks/results/*.json``); needs matplotlib (extra ``plot``).

    python benchmarks/chart.py [--out benchmarks/results/benchmarks.png]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    """Draw step time and peak RSS increase per variant, and the hook overhead, into one PNG."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(RESULTS / "benchmarks.png"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = []
    for name in ("step-2.12.1.json", "step-2.13.0.json"):
        for r in json.loads((RESULTS / name).read_text()):
            if r["ok"]:
                steps.append((f"({r['variant']}) {r['torch'].split('+')[0]}", r["step_ms_median"],
                              r["peak_rss_increase_mib"]))
    hooks = [r for r in json.loads((RESULTS / "hook_overhead-2.12.1.json").read_text()) if "grad" in r]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    labels = [s[0] for s in steps]
    axes[0].bar(labels, [s[1] for s in steps], color="tab:blue")
    axes[0].set_title("training step, median ms (2 ranks, CPU)")
    axes[1].bar(labels, [s[2] for s in steps], color="tab:orange")
    axes[1].set_title("peak RSS increase during the steps, MiB")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=45)
    width = 0.35
    xs = range(len(hooks))
    axes[2].bar([x - width / 2 for x in xs], [h["stock_ns"] / 1e3 for h in hooks], width, label="stock")
    axes[2].bar([x + width / 2 for x in xs], [h["patched_ns"] / 1e3 for h in hooks], width, label="patched")
    axes[2].set_xticks(list(xs), [f"autocast {h['autocast']}\ngrad {h['grad']}" for h in hooks])
    axes[2].set_title("sharded module call, median us (torch 2.12.1)")
    axes[2].legend()
    _scaling(axes[3])
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


def _scaling(ax: object) -> None:
    """The cost growth against micro-batches in flight (8 layers): each torch and checkpoint's patched / stock over
    its value at 1 micro-batch, measured in the same rounds (the median; bars from the first to the third
    quartile of the rounds timed, from the lowest to the highest of the few rounds counted), timed (solid) and
    counted in instructions (dashed); the target band (within 2 %) shaded."""
    for prefix, style, what in (("scaling", "-", "time"), ("scaling_instructions", "--", "instructions")):
        for torch in ("2.12.1", "2.13.0"):
            path = RESULTS / f"{prefix}-{torch}.json"
            if not path.exists():
                continue
            rows = json.loads(path.read_text())
            for kind in ("torch", "function"):
                line = sorted((r["micro_batches"], r["growth"], r.get("growth_quartiles") or r["growth_range"])
                              for r in rows
                              if r["checkpoint"] == kind and r["layers"] == 8 and r["evals_alive"] == 0)
                ax.errorbar([k for k, _, _ in line], [v for _, v, _ in line],  # type: ignore[attr-defined]
                            yerr=[[v - q[0] for _, v, q in line], [q[1] - v for _, v, q in line]], marker="o",
                            linestyle=style, capsize=3, label=f"{torch}, {kind} checkpoint, {what}")
    ax.axhspan(0.98, 1.02, color="0.9", zorder=0, label="within 2 %")  # type: ignore[attr-defined]
    ax.set_xscale("log", base=2)  # type: ignore[attr-defined]
    ax.set_xlabel("micro-batches in flight (8 layers)")  # type: ignore[attr-defined]
    ax.set_title("cost growth: patched / stock over its value at 1")  # type: ignore[attr-defined]
    ax.legend(fontsize=6)  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
