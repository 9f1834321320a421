"""CI smoke run of the benchmarks: tiny sizes, a couple of steps; the scripts run and write well-formed JSON.

Not timing tests: no time measured here is asserted. The instruction counter (``benchmarks/instructions.py``)
is checked on blocks whose counts are known relative to each other, as counts are exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_KEYS = {"variant", "torch", "ok", "error", "step_ms_median", "step_ms_all", "peak_rss_mib",
             "peak_rss_increase_mib", "cuda_max_allocated_mib", "all_gathers_per_step", "reduce_scatters_per_step",
             "losses", "losses_equal_to_d"}


def _run(script: str, *args: str) -> None:
    subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", script), *args],
                   check=True, cwd=ROOT, timeout=900 if "--instructions" in args else 300)


_COUNTER_PROBE = """
import json, os, sys, threading
sys.path.insert(0, sys.argv[1])
import instructions
if not instructions.relaunched():
    sys.exit(instructions.relaunch(os.path.abspath(__file__), sys.argv[1:]))
counter = instructions.Counter()
counter.start()
def loop(n):
    total = 0
    for i in range(n):
        total ^= 1
def on_thread(n):
    worker = threading.Thread(target=loop, args=(n,))
    worker.start()
    worker.join()
def raises():
    loop(10000)
    raise ValueError
counts = {"n": counter.count(lambda: loop(100000)), "2n": counter.count(lambda: loop(200000)),
          "thread": counter.count(lambda: on_thread(100000)), "empty": counter.count(lambda: None)}
try:
    counter.count(raises)
except ValueError:
    pass
counts["after_raise"] = counter.count(lambda: loop(100000))
json.dump(counts, open(sys.argv[2], "w"))
"""


def test_instruction_counter(tmp_path) -> None:
    """A count is the block's, on every thread, and a block that raised leaves the next count right."""
    probe, out = tmp_path / "probe.py", tmp_path / "counts.json"
    probe.write_text(_COUNTER_PROBE)
    subprocess.run([sys.executable, str(probe), os.path.join(ROOT, "benchmarks"), str(out)], check=True,
                   timeout=300)
    counts = json.loads(out.read_text())
    n = counts["n"]  # a loop's count moves by a few percent with the interpreter's specialisation of it
    assert 1.8 < counts["2n"] / n < 2.2
    assert 0.8 < counts["thread"] / n < 1.25  # the loop on another thread is counted (not: about 0.002)
    assert 0.8 < counts["after_raise"] / n < 1.25  # not the dump of the block that raised (about 0.1)
    assert counts["empty"] < 0.01 * n


def test_step_smoke(tmp_path) -> None:
    out = tmp_path / "step.json"
    _run("step.py", "--smoke", "--variants", "ad", "--json", str(out))
    results = json.loads(out.read_text())
    assert [r["variant"] for r in results] == ["a", "d"]
    for r in results:
        assert STEP_KEYS <= set(r), STEP_KEYS - set(r)
        assert r["ok"], r["error"]
        assert r["losses_equal_to_d"] is True
        assert r["torch"] == torch.__version__
        assert r["all_gathers_per_step"] > 0 and r["reduce_scatters_per_step"] > 0


#: The operations an exact record or replay cannot leave out, counted alone (hook_overhead._floors).
FLOORS = {"floor-record", "floor-record-autocast", "floor-replay"}


def test_hook_overhead_smoke(tmp_path) -> None:
    out = tmp_path / "hooks.json"
    _run("hook_overhead.py", "--smoke", "--json", str(out))
    results = json.loads(out.read_text())
    assert {r["grad"] for r in results if "grad" in r} == {"off", "on"}
    recomputes = {"recompute", "recompute-region", "recompute-entered"}
    assert {r["path"] for r in results if "path" in r} == {"ordinary", "ordinary-autocast", "disable-wrapper"} | \
        recomputes | {path + "-fp32-params" for path in recomputes} | FLOORS
    for r in results:
        assert all(isinstance(v, (int, float, str)) for v in r.values())


def test_hook_overhead_instructions_smoke(tmp_path) -> None:
    out = tmp_path / "hooks_instructions.json"
    _run("hook_overhead.py", "--instructions", "--smoke", "--json", str(out))
    results = json.loads(out.read_text())
    direct = [r for r in results if "path" in r]
    results = [r for r in results if "path" not in r]
    assert sorted((r["autocast"], r["grad"]) for r in results) == [("bf16", "off"), ("bf16", "on"), ("off", "off"),
                                                                   ("off", "on")]
    replays = {"recompute-region", "recompute-entered"}  # the direct paths counted: all but the sampled ones
    assert {r["path"] for r in direct} == {"ordinary", "ordinary-autocast"} | replays | {
        path + "-fp32-params" for path in replays} | FLOORS
    for r in direct:  # the patch's own work: some, and a small part of FSDP2's hooks
        assert 0 < r["instructions_per_call"] and 0 < r["over_fsdp_hook"] < 1, r
    for r in results:
        counts = [r[f"{what}_instructions"] for what in ("unsharded", "stock", "prebuilt", "patched")]
        assert all(count > 0 for count in counts)
        unsharded, stock, prebuilt, _ = counts
        assert unsharded < prebuilt < stock  # FSDP's hooks; FSDP's per-call wrapper, built once instead
        assert r["fsdp_hook_instructions"] == r["stock_instructions"] - r["unsharded_instructions"]
        assert r["own_instructions"] == r["patched_instructions"] - r["prebuilt_instructions"]  # one round


def test_ab_step_smoke(tmp_path) -> None:
    out = tmp_path / "ab.json"
    _run("ab_step.py", "--smoke", "--json", str(out))
    result = json.loads(out.read_text())
    assert {"torch", "rounds", "config", "step_ms", "step_ms_all", "patched_over_stock",
            "reentrant_over_stock"} <= set(result)
    assert set(result["step_ms"]) == {"patched", "stock", "reentrant"}
    assert all(len(v) == result["rounds"] for v in result["step_ms_all"].values())


def test_ab_step_instructions_smoke(tmp_path) -> None:
    out = tmp_path / "ab_instructions.json"
    _run("ab_step.py", "--instructions", "--smoke", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["unit"] == "instructions"
    assert set(result["step_instructions"]) == {"patched", "stock", "reentrant"}
    assert all(len(v) == result["rounds"] for v in result["step_instructions_all"].values())
    assert all(c > 0 for v in result["step_instructions_all"].values() for c in v)
    low, high = result["patched_over_stock_range"]
    assert low <= result["patched_over_stock"] <= high  # the median of both ranks' rounds


def test_value_check_smoke(tmp_path) -> None:
    out = tmp_path / "value.json"
    _run("value_check.py", "--smoke", "--json", str(out))
    result = json.loads(out.read_text())
    assert set(result) == {"torch", "off_ms", "on_ms", "ratio"}


def test_scaling_smoke(tmp_path) -> None:
    out = tmp_path / "scaling.json"
    _run("scaling.py", "--smoke", "--json", str(out))
    results = json.loads(out.read_text())
    assert {r["checkpoint"] for r in results} == {"torch", "function"}
    for r in results:
        assert {"torch", "layers", "micro_batches", "evals_alive", "rounds", "steps_per_timing", "base",
                "stock_ms", "patched_ms", "ratio", "growth", "growth_quartiles"} <= set(r)
        assert r["stock_ms"] > 0 and r["patched_ms"] > 0 and r["growth"] > 0


def test_scaling_instructions_smoke(tmp_path) -> None:
    out = tmp_path / "scaling_instructions.json"
    _run("scaling.py", "--instructions", "--smoke", "--json", str(out))
    results = json.loads(out.read_text())
    assert {r["checkpoint"] for r in results} == {"torch", "function"}
    for r in results:
        assert {"torch", "layers", "micro_batches", "evals_alive", "rounds", "base", "stock_instructions",
                "patched_instructions", "ratio", "growth", "growth_range"} <= set(r)
        assert r["stock_instructions"] > 0 and r["patched_instructions"] > 0
        assert r["ratio"] == r["patched_instructions"] / r["stock_instructions"]  # one round: its own ratio


def test_memory_smoke(tmp_path) -> None:
    """The peak-memory benchmark writes a row per configuration with its three peaks and ratios."""
    out = tmp_path / "memory.json"
    _run("memory.py", "--layers", "2", "--checkpoints", "torch", "fn_disable", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["checkpoint"], r["params"], r["layers"]) for r in rows] == [
        ("torch", "fp32", 2), ("torch", "bf16", 2), ("fn_disable", "fp32", 2), ("fn_disable", "bf16", 2)]
    for r in rows:
        assert r["patched_peak"] > 0 and r["exact_peak"] > 0 and r["grads_equal_exact"], r
