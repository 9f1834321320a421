"""``fsdp_autocast_fix.report()``: exact counts for known runs, the advice line, reset, and the exit report.

Each run is one cell of the generated space (tests/helpers/grid.py) under ``apply()``; what the patch must have done
there is stated here per torch: the cast replay happens only where torch skips FSDP's casts (2.4-2.12).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Callable

import grid as G
import pytest
from conftest import free_port
from torch.utils.checkpoint import set_checkpoint_early_stop

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat, _report

pytestmark = pytest.mark.usefixtures("pg")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _report_of(cell: G.Cell, early_stop: bool = True) -> fsdp_autocast_fix.Report:
    fsdp_autocast_fix.report(reset=True)
    with set_checkpoint_early_stop(early_stop):
        result = G.run(cell, "apply")
    assert result.error is None, repr(result.error)
    return fsdp_autocast_fix.report()


def _buggy() -> int:
    return int(_compat.load().needs_cast_replay)


def _counts(report: fsdp_autocast_fix.ModuleReport) -> dict[str, int]:
    return {f: getattr(report, f) for f in ("recomputes", "autocast_changed", "input_casts", "output_casts",
                                            "root_moves", "cache_drops", "cache_shields", "unidentified")}


def _expect(**counts: int) -> dict[str, int]:
    base = dict.fromkeys(("recomputes", "autocast_changed", "input_casts", "output_casts", "root_moves",
                          "cache_drops", "cache_shields", "unidentified"), 0)
    return {**base, **counts}


def test_report_before_anything_ran() -> None:
    fsdp_autocast_fix.report(reset=True)
    report = fsdp_autocast_fix.report()
    assert _counts(report) == _expect() and dict(report.by_module) == {}
    assert str(report).splitlines()[-1].startswith("the patch changed nothing in this run (no recompute seen)")


def test_seed_pattern_reports_the_replayed_casts() -> None:
    """The seed report's pattern: torch's checkpoint restores autocast itself; on a buggy torch the patch replays
    FSDP's input cast of the one recompute, and, with ``output_dtype``, the output cast where the recompute runs
    to the module's end (checkpoint's early stop off; with it, the recompute stops before the output)."""
    cell = G.Cell("torch", "output_fp32", "bf16", "outside", "none", "none", "root")
    report = _report_of(cell)
    assert _counts(report) == _expect(recomputes=1, input_casts=_buggy())
    assert _counts(report.by_module["Block"]) == _counts(report)
    report = _report_of(cell, early_stop=False)
    assert _counts(report) == _expect(recomputes=1, input_casts=_buggy(), output_casts=_buggy())
    advice = str(report).splitlines()[-1]
    assert advice.startswith("the patch fixed this run" if _buggy() else "the patch changed nothing in this run")


def test_layers_count_per_module_class() -> None:
    """Two sharded layers in a sharded root, a checkpoint per layer: two recomputes of ``Block``, none of the root."""
    report = _report_of(G.Cell("torch", "bf16_params", "bf16", "outside", "none", "none", "layers"))
    assert set(report.by_module) == {"Block"}
    assert _counts(report) == _expect(recomputes=2, input_casts=2 * _buggy())


def test_custom_checkpoint_not_restoring_autocast_reports_changed_states() -> None:
    """Backward outside autocast: the recompute ran without autocast; the patch entered the forward's state. Its
    forward ran under ``no_grad``, but its autocast region ended before the backward: nothing cached to drop."""
    report = _report_of(G.Cell("fn_no_restore", "fp32_params", "bf16", "outside", "none", "none", "root"))
    assert _counts(report) == _expect(recomputes=1, autocast_changed=1)
    assert "replayed 1 autocast states" in report.advice()


def test_reentrant_checkpoint_with_backward_inside_autocast_reports_the_shielded_call() -> None:
    """The checkpoint's forward runs under no_grad in the training's autocast region: its casts are kept out of
    the cache, which its recompute (a grad-enabled call of the module) would otherwise reuse."""
    report = _report_of(G.Cell("torch_reentrant", "fp32_params", "bf16", "inside", "none", "none", "root"))
    assert _counts(report) == _expect(recomputes=1, cache_shields=1)
    assert report.advice().startswith("the patch replayed nothing (1 recomputes seen) but kept casts")


def test_torch_checkpoint_without_a_cache_hazard_changes_nothing_on_a_fixed_torch() -> None:
    report = _report_of(G.Cell("torch", "fp32_params", "bf16", "outside", "none", "none", "root"))
    assert _counts(report) == _expect(recomputes=1)
    assert report.advice().startswith("the patch changed nothing in this run (1 recomputes seen)")


def _pre_ops_region(preserve: bool = False, eval_in_another_state: bool = False) -> fsdp_autocast_fix.Report:
    """Unsharded ops before the sharded call under a checkpoint that does not restore autocast (through
    ``preserve_autocast`` where ``preserve``), and, where told, an eval pass in a third state (fp16) before the
    backward: the report."""
    cell = G.Cell("fn_no_restore", "fp32_params", "bf16", "outside", "none", "none", "root", "pre_ops")
    fsdp_autocast_fix.report(reset=True)
    fsdp_autocast_fix.apply()
    block = G.Block()
    fsdp = _compat.fsdp_package()
    fsdp.fully_shard(block, mp_policy=fsdp.MixedPrecisionPolicy())
    forward = G._forward(block, block, cell, None, preserve=preserve)
    x = G.torch.randn(4, G.DIM, requires_grad=True)
    with G.torch.autocast("cpu", dtype=G.BF16):
        out = forward(x)
    if eval_in_another_state:  # neither the forward's state nor the backward's: the module's latest call
        with G.torch.no_grad(), G.torch.autocast("cpu", dtype=G.torch.float16):
            block(G.torch.randn(4, G.DIM))
    out.float().sum().backward()
    return fsdp_autocast_fix.report()


def test_unidentified_recomputes_are_reported_with_why() -> None:
    """Unsharded ops before the sharded call under a checkpoint that does not restore autocast: nothing
    recorded names the call (the remedy is ``preserve_autocast``, which the grid's patched modes use)."""
    report = _pre_ops_region()
    assert _counts(report) == _expect(recomputes=1, unidentified=1, cache_drops=0)
    assert report.unidentified_reasons["Block"] == (
        "no recorded call got its tensor arguments (computed in the region, or copied by the checkpoint)",)
    assert "preserve_autocast" in report.advice()


@pytest.mark.parametrize("preserve", [False, True])
def test_a_recompute_preserve_autocast_restored_is_not_reported_unidentified(
        preserve: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The same region, then an eval pass in a third state (the module's latest call): unidentified, and the
    warning that points to ``preserve_autocast``, only where it is not used. Under it the recompute runs in the
    call site's state, which is exact (before: reported and warned there too, advising what was done)."""
    with caplog.at_level("WARNING", logger="fsdp_autocast_fix"):
        report = _pre_ops_region(preserve=preserve, eval_in_another_state=True)
    assert _counts(report) == _expect(recomputes=1, unidentified=0 if preserve else 1, cache_drops=0)
    warned = [r.getMessage() for r in caplog.records if "cannot tell which forward call" in r.getMessage()]
    assert bool(warned) == (not preserve), warned


def test_reset_starts_again_at_zero() -> None:
    cell = G.Cell("torch", "bf16_params", "bf16", "outside", "none", "none", "root")
    first = _report_of(cell)
    assert fsdp_autocast_fix.report(reset=True) == first
    assert _counts(fsdp_autocast_fix.report()) == _expect()


def test_counts_of_other_threads_outlive_them_and_reset() -> None:
    """A run on another thread is counted, after that thread ends too, as are counts from threads that come and go;
    a reset takes them all off."""
    cell = G.Cell("fn_no_restore", "fp32_params", "bf16", "outside", "none", "none", "root")
    errors: list[BaseException] = []

    def on_threads(n: int, work: Callable[[], None]) -> None:
        def target() -> None:
            try:
                work()
            except BaseException as error:  # noqa: BLE001 (raised in the test's thread below)
                errors.append(error)
        for _ in range(n):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
        assert not errors, errors

    def run() -> None:  # apply() in it starts the counts at zero
        with set_checkpoint_early_stop(True):
            result = G.run(cell, "apply")
        assert result.error is None, repr(result.error)

    on_threads(1, run)
    assert _counts(fsdp_autocast_fix.report()) == _expect(recomputes=1, autocast_changed=1)
    on_threads(5, lambda: _report.count("Block", "recomputes"))
    report = fsdp_autocast_fix.report(reset=True)
    assert _counts(report) == _expect(recomputes=6, autocast_changed=1)
    assert _counts(fsdp_autocast_fix.report()) == _expect()
    assert _counts(_report_of(cell)) == _expect(recomputes=1, autocast_changed=1)  # this thread's, after a reset



def test_report_while_its_thread_counts() -> None:
    """A signal handler or a finalizer may run while its thread holds the counts' lock (inside a count) and call
    ``report()``: it returns instead of waiting for itself."""
    done = threading.Event()

    def inside_a_count() -> None:
        with _report._lock:
            fsdp_autocast_fix.report()
        done.set()

    thread = threading.Thread(target=inside_a_count, daemon=True)
    thread.start()
    assert done.wait(timeout=60), "report() waited for a lock its own thread holds"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
def test_report_in_a_child_forked_while_another_thread_counts() -> None:
    """A process forked while another thread holds the counts' lock gets a free one: its report does not hang."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _report._lock:
            holding.set()
            release.wait(timeout=60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert holding.wait(timeout=60)
    try:
        pid = os.fork()
        if pid == 0:  # the child: report, or be stopped by the alarm (exit code 3 via SIGALRM's default)
            import signal

            signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
            signal.alarm(20)
            fsdp_autocast_fix.report()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join()
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's report hung on the inherited lock"


def test_counting_stays_off_the_ordinary_forward() -> None:
    """Ordinary forwards, with and without autocast, grad on and off, count nothing."""
    fsdp_autocast_fix.report(reset=True)
    fsdp_autocast_fix.apply()
    block = G.Block()
    fsdp = _compat.fsdp_package()
    fsdp.fully_shard(block, mp_policy=fsdp.MixedPrecisionPolicy())
    x = G.torch.randn(4, G.DIM)
    for autocast in (False, True):
        with G.torch.autocast("cpu", dtype=G.BF16, enabled=autocast):
            block(x).sum().backward()
            with G.torch.no_grad():
                block(x)
    assert _counts(fsdp_autocast_fix.report()) == _expect()


def _run(env: dict[str, str], ranks: int) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                    OMP_NUM_THREADS="1", **env)
    full_env.pop("FSDP_AUTOCAST_FIX", None)
    script = os.path.join(HERE, "scripts", "report_run.py")
    if ranks == 1:
        command = [sys.executable, "-W", "ignore", script, str(free_port())]
    else:
        command = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(ranks), script]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=full_env)


@pytest.mark.once
@pytest.mark.parametrize("ranks,value,printed", [(1, "1", 1), (1, "", 0), (2, "1", 1), (2, "all", 2)])
def test_exit_report(ranks: int, value: str, printed: int) -> None:
    proc = _run({"FSDP_AUTOCAST_FIX_REPORT": value}, ranks)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("step done") == ranks
    assert proc.stderr.count("fsdp_autocast_fix report:") == printed, proc.stderr
    if printed:
        assert proc.stderr.count("the patch fixed this run: it replayed 1 autocast states") == printed
    if value == "all":
        assert "[rank 0] " in proc.stderr and "[rank 1] " in proc.stderr
